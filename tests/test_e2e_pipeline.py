"""End to end on a real actor system: the CPU demo pipelines over real HTTP.

Every test talks to a leader started by the real CLI (multiprocTCPBase on
free ports), with the official ``openai`` client or aiohttp, and asserts what
a user sees.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import time
import urllib.request
import wave
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest
from PIL import Image

pytestmark = pytest.mark.system

MODEL = "qwen3-omni-cpu-demo"
MESSAGES = [{"role": "user", "content": "Say something about the sea."}]


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _wav_seconds(data: bytes) -> float:
    with wave.open(io.BytesIO(data)) as w:
        assert w.getframerate() == 24000 and w.getnchannels() == 1 and w.getsampwidth() == 2
        return w.getnframes() / w.getframerate()


def _stage_table(leader) -> dict[str, dict]:
    stages = _get_json(leader.base_url + "/stages")["stages"]
    return {r["replica"]: r for st in stages for r in st["replicas"]}


def test_text_chat_with_openai_client(openai_client):
    resp = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12)
    assert resp.object == "chat.completion"
    text = resp.choices[0].message.content
    assert isinstance(text, str) and len(text.split()) == 12
    assert resp.usage.completion_tokens == 12
    assert resp.choices[0].finish_reason == "length"


def test_finish_reason_is_length_when_the_stage_default_max_tokens_is_reached(openai_client):
    resp = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES)  # stage default: 32
    assert resp.usage.completion_tokens == 32
    assert resp.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_stop_string_ends_the_text_before_it_with_finish_reason_stop(openai_client, stream):
    whole = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, seed=3)
    words = whole.choices[0].message.content.split()
    at = next(i for i in range(3, len(words)) if all(words[i] not in w for w in words[:i]))  # (first here)
    stop, before = words[at], " ".join(words[:at]) + " "
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=12, seed=3, stop=[stop])
    if stream:
        chunks = list(openai_client.chat.completions.create(**kwargs, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert (text, finish) == (before, ["stop"])
    else:
        cut = openai_client.chat.completions.create(**kwargs)
        assert cut.choices[0].message.content == before and cut.choices[0].finish_reason == "stop"
        assert cut.usage.completion_tokens == at + 1  # up to the token that completed it


def test_same_request_same_output(openai_client):
    """The synthetic engine is deterministic: same prompt and seed, same text."""
    a = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, seed=5)
    b = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, seed=5)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_text_and_audio_returns_playable_wav(openai_client):
    resp = openai_client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "wav"})
    msg = resp.choices[0].message
    assert msg.content
    wav = base64.b64decode(msg.audio.data)
    # 10 tokens x 2 codec frames x 1920 samples at 24 kHz = 1.6 s
    assert _wav_seconds(wav) == pytest.approx(10 * 2 * 1920 / 24000)


def test_streaming_sends_text_deltas_and_audio_parts_as_they_are_made(omni_leader):
    """The demo streams between stages: audio arrives as base64 PCM16 parts
    (the id in the first only, as OpenAI streams it), the last audio delta carries the
    transcript, and the parts joined are the PCM of the non-streamed WAV."""
    async def run():
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 16, "stream": True,
                "modalities": ["text", "audio"]}
        events = []
        async with aiohttp.ClientSession() as s:
            async with s.post(omni_leader.base_url + "/chat/completions", json=body) as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/event-stream")
                async for line in r.content:
                    line = line.strip()
                    if line.startswith(b"data: "):
                        events.append(line[6:])
            async with s.post(omni_leader.base_url + "/chat/completions",
                              json={**body, "stream": False}) as r:
                whole = await r.json()
        return events, whole

    events, whole = asyncio.run(run())
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    kinds, text, pcm, audio = [], "", b"", []
    for c in chunks:
        delta = c["choices"][0]["delta"] if c["choices"] else {}
        if delta.get("content"):
            kinds.append("text")
            text += delta["content"]
        if delta.get("audio"):
            kinds.append("audio")
            audio.append(delta["audio"])
            pcm += base64.b64decode(delta["audio"].get("data", ""))
    assert kinds.count("text") > 1
    assert sum(1 for a in audio if a.get("data")) > 1
    assert [a for a in audio if "id" in a] == audio[:1] and audio[0]["id"].startswith("audio_")
    assert audio[-1]["transcript"] == text and "data" not in audio[-1]
    wav = base64.b64decode(whole["choices"][0]["message"]["audio"]["data"])
    with wave.open(io.BytesIO(wav)) as w:
        assert w.readframes(w.getnframes()) == pcm


def _streamed_with_helper(client, **kwargs):
    """The completion the `openai` package's stream helper puts together from a streamed audio
    reply (its snapshot: `get_final_completion` refuses a reply cut at max_tokens)."""
    with client.chat.completions.stream(model=MODEL, messages=MESSAGES, modalities=["text", "audio"],
                                        **kwargs) as stream:
        for _ in stream:
            pass
        return stream.current_completion_snapshot


def test_the_openai_stream_helper_gives_a_streamed_audios_id_and_transcript(openai_client):
    """Trial CL: every audio delta carried the id, and the `openai` package's stream helper,
    which joins each string field across deltas, gave it five times over."""
    final = _streamed_with_helper(openai_client, max_tokens=16, seed=3)
    message = final.choices[0].message
    assert re.fullmatch(r"audio_[0-9a-f]{32}", message.audio.id), message.audio.id
    assert message.audio.transcript == message.content and message.content
    assert message.audio.expires_at > final.created


def test_an_audio_reply_can_be_replayed_by_its_id_in_the_next_turn(openai_client):
    """Trial CL: OpenAI's way to carry an audio turn forward, an assistant message holding only
    `audio: {"id"}`, was taken and the turn left out of the prompt (a made-up id too). It is
    now the reply's transcript; an id the server does not know is a 400 naming it."""
    import openai

    first = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, seed=4,
                                                  modalities=["text", "audio"])
    streamed = _streamed_with_helper(openai_client, max_tokens=8, seed=5).choices[0].message
    for reply in (first.choices[0].message, streamed):
        follow = {"role": "user", "content": "And the sky?"}
        by_id = openai_client.chat.completions.create(model=MODEL, max_tokens=8, seed=6, messages=[
            *MESSAGES, {"role": "assistant", "audio": {"id": reply.audio.id}}, follow])
        by_text = openai_client.chat.completions.create(model=MODEL, max_tokens=8, seed=6, messages=[
            *MESSAGES, {"role": "assistant", "content": reply.audio.transcript}, follow])
        assert by_id.usage.prompt_tokens == by_text.usage.prompt_tokens, (by_id.usage, by_text.usage)
        assert by_id.choices[0].message.content == by_text.choices[0].message.content
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(model=MODEL, max_tokens=8, messages=[
            *MESSAGES, {"role": "assistant", "audio": {"id": "audio_doesnotexist"}}, follow])
    assert caught.value.body["param"] == f"messages[{len(MESSAGES)}].audio.id", caught.value.body
    assert "audio_doesnotexist" in caught.value.body["message"], caught.value.body


def test_streaming_with_openai_client_matches_non_streaming(openai_client):
    whole = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, seed=9)
    stream = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, seed=9,
                                                   stream=True)
    deltas = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
    assert len(deltas) > 1
    assert "".join(deltas) == whole.choices[0].message.content


def test_both_talker_replicas_get_work_under_concurrent_requests(omni_leader, openai_client):
    # pools publish their table every heartbeat interval (1 s): taken once two reads a heartbeat
    # apart agree (the completions of the tests before all counted)
    before, settle_by = _stage_table(omni_leader), time.monotonic() + 15
    while time.monotonic() < settle_by:
        time.sleep(1.2)
        again = _stage_table(omni_leader)
        if all(again[rep]["completed"] == before[rep]["completed"] for rep in ("talker/0", "talker/1")):
            break
        before = again

    def one(i):
        return openai_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"request {i}"}], max_tokens=8,
            modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"})

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(16)))
    assert all(r.choices[0].message.audio.data for r in results)
    deadline = time.monotonic() + 5  # pools publish their table every heartbeat interval
    while True:
        after = _stage_table(omni_leader)
        gained = {rep: after[rep]["completed"] - before[rep]["completed"] for rep in ("talker/0", "talker/1")}
        if sum(gained.values()) >= 16 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sum(gained.values()) == 16
    assert gained["talker/0"] > 0 and gained["talker/1"] > 0, gained


def test_fan_in_of_two_sources(fanin_leader):
    import openai

    client = openai.OpenAI(base_url=fanin_leader.base_url, api_key="x", max_retries=0)
    resp = client.chat.completions.create(
        model="fanin-test", messages=MESSAGES, max_tokens=5, modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "wav"})
    seconds = _wav_seconds(base64.b64decode(resp.choices[0].message.audio.data))
    # Code2Wav joined both Talkers' codes: (5x2 + 5x3) frames x 480 samples.
    assert seconds == pytest.approx((5 * 2 + 5 * 3) * 480 / 24000)
    client.close()


def test_image_pipeline_returns_png(image_leader):
    import openai

    client = openai.OpenAI(base_url=image_leader.base_url, api_key="x", max_retries=0)
    resp = client.images.generate(model="glm-image-cpu-demo", prompt="a red lighthouse", size="128x96",
                                  response_format="b64_json")
    img = Image.open(io.BytesIO(base64.b64decode(resp.data[0].b64_json)))
    assert img.format == "PNG" and img.size == (128, 96) and img.mode == "RGB"
    client.close()


def test_an_image_requests_seed_changes_the_image_and_repeats_it(image_leader):
    """The client's seed reaches the image stages: the same seed gives the same PNG,
    another seed another PNG (the AR stage draws its prior tokens from it)."""
    import openai

    client = openai.OpenAI(base_url=image_leader.base_url, api_key="x", max_retries=0)

    def png(seed):
        resp = client.images.generate(model="glm-image-cpu-demo", prompt="a red lighthouse", size="64x64",
                                      response_format="b64_json", extra_body={"seed": seed})
        return base64.b64decode(resp.data[0].b64_json)

    first, again, other = png(1), png(1), png(2)
    assert first == again
    assert first != other
    client.close()


def test_models_health_and_stages(omni_leader):
    models = _get_json(omni_leader.base_url + "/models")
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert _get_json(f"http://127.0.0.1:{omni_leader.port}/health")["status"] == "ok"
    stages = _get_json(omni_leader.base_url + "/stages")
    assert stages["ready"] is True
    assert [(s["stage"], len(s["replicas"])) for s in stages["stages"]] == [
        ("thinker", 1), ("talker", 2), ("code2wav", 1)]
    assert all(r["state"] == "ready" for s in stages["stages"] for r in s["replicas"])


BAD_REQUESTS = [
    ("malformed json", b"{not json", 400),
    ("unknown model", {"model": "nope", "messages": MESSAGES}, 404),
    ("missing messages", {"model": MODEL}, 400),
    ("empty messages", {"model": MODEL, "messages": []}, 400),
    ("bad modalities", {"model": MODEL, "messages": MESSAGES, "modalities": ["video"]}, 400),
    ("negative max_tokens", {"model": MODEL, "messages": MESSAGES, "max_tokens": -1}, 400),
    ("huge max_tokens", {"model": MODEL, "messages": MESSAGES, "max_tokens": 10**9}, 400),
    ("nested too deeply", b"[" * 100_000 + b"]" * 100_000, 400),
    ("body over the limit", {"model": MODEL, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}, 413),
    ("prompt over the context length",  # (the Thinker's max_model_len: 32768 words)
     {"model": MODEL, "messages": [{"role": "user", "content": "x " * 40_000}]}, 400),
    ("max_tokens past what the context leaves",  # (trial AU: it was cut at the context, "length")
     {"model": MODEL, "messages": [{"role": "user", "content": "x " * 32_700}], "max_tokens": 200}, 400),
    ("prompt that fills the context",  # (trial CL: a 200 with an empty text and an empty audio)
     {"model": MODEL, "messages": [{"role": "user", "content": "x " * 32_767}], "modalities": ["text", "audio"]},
     400),
]


@pytest.mark.parametrize("name,body,status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_openai_error_and_server_keeps_serving(omni_leader, openai_client, name, body, status):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(omni_leader.base_url + "/chat/completions", data=data,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == status
    error = json.loads(err.value.read())["error"]
    assert error["message"] and error["type"]
    if name == "prompt over the context length":  # (the stage named once: it said "...: thinker: the prompt...")
        assert re.match(r"stage thinker \(thinker/\d+\): the prompt has \d+ tokens: over the model's context "
                        r"length of 32768 tokens", error["message"]), error["message"]
        # (as OpenAI's: a client can tell it from other 400s)
        assert (error["code"], error["param"]) == ("context_length_exceeded", "messages"), error
    elif name == "prompt that fills the context":
        assert re.match(r"stage thinker \(thinker/\d+\): the prompt has 32768 tokens: no room is left for a "
                        r"completion in this model's maximum context length of 32768 tokens", error["message"]), \
            error["message"]
        # (as OpenAI's: a client can tell it from other 400s)
        assert (error["code"], error["param"]) == ("context_length_exceeded", "messages"), error
    elif name == "max_tokens past what the context leaves":
        assert re.match(r"stage thinker \(thinker/\d+\): this model's maximum context length is 32768 tokens, and "
                        r"the request asks for \d+: \d+ in the prompt and 200 in the completion", error["message"]), \
            error["message"]
        assert (error["code"], error["param"]) == ("context_length_exceeded", "messages"), error
    elif status == 400:
        assert error["code"] != "context_length_exceeded", error
    ok = openai_client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert ok.choices[0].message.content
