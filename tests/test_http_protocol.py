"""The OpenAI HTTP layer over a scripted fake Bridge (no actors)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import time
import wave

import numpy as np
import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestClient, TestServer

from omni_actors.http.app import create_app, start_http
from omni_actors.http.protocol import ApiError, parse_chat_request, render_prompt
from omni_actors.http.types import (
    OutputFinal, OutputText, PipelineRequest, RequestDone, RequestFailed,
)

MODEL = "fake-omni"
CHAT = "/v1/chat/completions"
IMAGES = "/v1/images/generations"
GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
GOOD_IMAGE = {"model": MODEL, "prompt": "a cat", "size": "64x128"}


def sine(n: int = 2400, sr: int = 24000) -> np.ndarray:
    t = np.arange(n) / sr
    return (np.sin(2 * np.pi * 440 * t) * 8000).astype(np.int16)


class FakeBridge:
    """Scripted events; the prompt picks the script (``[fail503]``,
    ``[failmid]``, ``[slow]``, ``[notext]``, ``[stuck]``, ``[lost]``: its final
    output lost with its host, ``[lost][lostonce]``: the first time only)."""

    def __init__(self, output_types=("text", "audio"), request_timeout_s: float = 30.0):
        self.model_name = MODEL
        self.output_types = frozenset(output_types)
        self.max_tokens_limit = 1024
        self.request_timeout_s = request_timeout_s
        self.submitted: list[PipelineRequest] = []
        self.cancelled: list[str] = []
        self.waited: list[tuple[str, int]] = []  # (node, requests submitted by then)

    async def wait_node_down(self, node: str, timeout_s: float) -> bool:
        self.waited.append((node, len(self.submitted)))
        await asyncio.sleep(0.01)
        return True

    async def submit(self, req: PipelineRequest):
        self.submitted.append(req)
        p = req.prompt
        if "[lost]" in p and ("[lostonce]" not in p or len(self.submitted) == 1):
            for piece in ("Gone ", "soon"):
                yield OutputText(piece)
            yield RequestFailed(500, "final output lost: data service 10.0.0.9:4000 unreachable", lost_output=True,
                                lost_on="m9")
            return
        if "[notstarted]" in p and len(self.submitted) == 1:  # (its RequestActor never took it)
            yield RequestFailed(500, "the request was lost: its RequestActor did not take the request within 3 s "
                                     "(stopped or hung?)", not_started=True)
            return
        if "[raexited]" in p:
            yield RequestFailed(500, "the request was lost: its RequestActor exited (its process was killed?)",
                                lost_by_server=True)
            return
        if "[fail503]" in p:
            yield RequestFailed(503, "no ready replica for stage thinker")
            return
        if "[midsent]" in p and ("[midonce]" not in p or len(self.submitted) == 1):
            if "[textfirst]" in p:
                yield OutputText("Hel")
            yield RequestFailed(503, MID_STREAM, code="service_unavailable", output_sent=True)
            return
        if "[stuck]" in p:
            await asyncio.sleep(3600)
        if "[slow]" in p:
            while True:
                await asyncio.sleep(0.02)
                yield OutputText("tick ")
        if "[flood]" in p:
            while True:
                await asyncio.sleep(0.001)
                yield OutputText("x" * 65536)
        if "image" in req.output_types:
            w, h = req.params["width"], req.params["height"]
            img = np.zeros((h, w, 3), np.uint8)
            img[..., 0] = 200
            yield OutputFinal(0, "image", {"image": img})
            yield RequestDone(4, 0)
            return
        if "[bigtext]" in p:  # (a 16 MB reply)
            yield OutputFinal(0, "text", {"text": "y" * (16 << 20)})
            yield RequestDone(prompt_tokens=5, completion_tokens=3)
            return
        if "[notext]" not in p:
            for piece in ("Hel", "lo ", "world"):
                await asyncio.sleep(0)
                yield OutputText(piece)
        if "[failmid]" in p:
            yield RequestFailed(500, "engine crashed")
            return
        yield OutputFinal(0, "text", {"text": "Hello world"})
        if "audio" in req.output_types:
            yield OutputFinal(2, "audio", {"audio": sine(), "sample_rate": 16000 if "[16k]" in p else 24000})
        yield RequestDone(prompt_tokens=5, completion_tokens=3)

    async def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)

    async def stages(self):
        return {"thinker": {"replicas": 1, "ready": np.int64(1)}}


def serve(bridge, body, **app_kwargs):
    """Run ``await body(client)`` against the app in a fresh event loop."""
    server_kwargs = {"handler_cancellation": app_kwargs.pop("handler_cancellation", True)}

    async def main():
        server = TestServer(create_app(bridge, **app_kwargs), **server_kwargs)
        async with TestClient(server) as client:
            return await body(client)

    return asyncio.run(main())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_request_whose_output_was_lost_with_its_host_runs_once_more(stream):
    """The API server could not read a finished request's output (its member host was
    killed meanwhile): the request runs again under a new id, within its deadline, and
    the client gets the second run's answer; it got a 500. A stream runs again only if
    nothing of it was sent (here its text was: an error event, as before)."""
    async def body(client):
        resp = await client.post(CHAT, json=chat("[lost][lostonce]", stream=stream))
        return resp.status, await resp.text()

    bridge = FakeBridge(output_types=("text",))
    status, text = serve(bridge, body)
    ids = [r.request_id for r in bridge.submitted]
    if stream:
        assert status == 200 and "final output lost" in text and len(ids) == 1, text
        assert "(not run again: part of the reply had reached the client)" in text, text  # (trial CJ)
        return
    assert status == 200 and json.loads(text)["choices"][0]["message"]["content"] == "Hello world", text
    assert len(ids) == 2 and ids[1] == ids[0] + "-rerun1", ids
    assert bridge.submitted[1].timeout_s <= bridge.submitted[0].timeout_s
    assert bridge.waited == [("m9", 1)]  # the rerun waited for the host to be reported down

    bridge = FakeBridge(output_types=("text",))  # lost again: one rerun only, and the error says so
    status, text = serve(bridge, lambda client: _post_text(client, chat("[lost]")))
    assert status == 500 and len(bridge.submitted) == 2
    assert "after the request ran again: an output of its first run was lost with its host" in text, text

    # not run again where that would only go back to the host (up, its data service silent,
    # the only ready replicas of a stage there): trial CI waited 21 s for a 500, 10 s of it again
    bridge = FakeBridge(output_types=("text",))
    bridge.rerun_goes_back = lambda node, request: node == "m9"
    status, text = serve(bridge, lambda client: _post_text(client, chat("[lost][lostonce]")))
    assert status == 500 and len(bridge.submitted) == 1
    assert "(not run again: node m9's data service does not answer" in text, text


MID_STREAM = ("replica thinker/0 went down mid-stream (dead: process exited); part of the output had already "
              "reached the client, so it was not retried")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_stage_that_failed_mid_stream_before_any_output_reached_the_client_runs_once_more(stream):
    """A soak trial: the Thinker was SIGKILLed just after its first text left for the API
    server, so its RequestActor did not retry it ("part of the output had already reached
    the client"), but that text never came: the client got a 503 and no event. Now the API
    server, which knows it sent nothing, runs the request again."""
    bridge = FakeBridge(output_types=("text",))
    status, text = serve(bridge, lambda client: _post_text(client, chat("[midsent][midonce]", stream=stream)))
    ids = [r.request_id for r in bridge.submitted]
    if stream:
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
        content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    else:
        content = json.loads(text)["choices"][0]["message"]["content"]
    assert (status, content) == (200, "Hello world"), text
    assert ids == [ids[0], ids[0] + "-rerun1"] and bridge.waited == []  # (no host to wait for)

    bridge = FakeBridge(output_types=("text",))  # again: one rerun only, and the error says why it ran again
    status, text = serve(bridge, lambda client: _post_text(client, chat("[midsent]", stream=stream)))
    assert status == 503 and len(bridge.submitted) == 2, text
    assert json.loads(text)["error"]["message"] == (
        MID_STREAM + " (after the request ran again: its first run failed before any of it reached the client)")


def test_a_stage_that_failed_mid_stream_after_text_reached_the_client_does_not_run_again():
    """The stream's text went out: an SSE error event, as before; the request is not run again."""
    bridge = FakeBridge(output_types=("text",))
    status, text = serve(bridge, lambda client: _post_text(client, chat("[midsent][midonce][textfirst]",
                                                                         stream=True)))
    assert status == 200 and MID_STREAM in text and len(bridge.submitted) == 1, text


async def _post_text(client, body):
    resp = await client.post(CHAT, json=body)
    return resp.status, await resp.text()


def chat(content="hi", **extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


async def assert_error(resp, status, param=None):
    assert resp.status == status, await resp.text()
    assert resp.content_type == "application/json"
    err = (await resp.json())["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param
    assert resp.headers.get("X-Request-Id")
    return err


async def assert_good_chat(client):
    resp = await client.post(CHAT, json=GOOD_CHAT)
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["choices"][0]["message"]["content"] == "Hello world"


def wav_info(b64: str):
    with wave.open(io.BytesIO(base64.b64decode(b64))) as w:
        return w.getframerate(), w.getnchannels(), w.getnframes()


# --------------------------------------------------------------- bad inputs

BAD = [
    (CHAT, b"{not json", 400, None),
    (CHAT, b"[1, 2]", 400, None),
    (CHAT, {**GOOD_CHAT, "model": "nope"}, 404, "model"),
    (CHAT, {"messages": GOOD_CHAT["messages"]}, 400, "model"),
    (CHAT, {"model": MODEL}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": "hi"}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role"),
    (CHAT, {"model": MODEL, "messages": [{"content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x", "name": 5}]}, 400,
     "messages[0].name"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": 3}]}, 400,
     "messages[0].content"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content[0].type"),
    (CHAT, chat(modalities=["audio"]), 400, "modalities"),
    (CHAT, chat(modalities=["text", "video"]), 400, "modalities"),
    (CHAT, chat(modalities="text"), 400, "modalities"),
    (CHAT, chat(modalities=["text", "audio"], audio={"voice": "x", "format": "mp3"}), 400,
     "audio.format"),
    (CHAT, chat(max_tokens=-1), 400, "max_tokens"),
    (CHAT, chat(max_tokens=0), 400, "max_tokens"),
    (CHAT, chat(max_tokens=10**30), 400, "max_tokens"),
    (CHAT, chat(max_tokens=1025), 400, "max_tokens"),
    (CHAT, chat(max_tokens="10"), 400, "max_tokens"),
    (CHAT, chat(max_tokens=1.5), 400, "max_tokens"),
    (CHAT, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    (CHAT, chat(temperature=3), 400, "temperature"),
    (CHAT, chat(temperature="hot"), 400, "temperature"),
    (CHAT, chat(top_p=5), 400, "top_p"),
    (CHAT, chat(top_p=0), 400, "top_p"),  # vLLM takes (0, 1]
    (CHAT, chat(top_p=True), 400, "top_p"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": []}]}, 400,
     "messages[0].content"),
    (CHAT, chat(seed="x"), 400, "seed"),
    (CHAT, chat(stop=[1, {"a": 2}]), 400, "stop"),
    (CHAT, {"model": MODEL, "messages": [{"role": "tool", "content": "42"}]}, 400, "messages[0].tool_call_id"),
    (CHAT, chat(stop=5), 400, "stop"),
    (CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (CHAT, chat(stop=[]), 400, "stop"),
    (CHAT, chat(stop=""), 400, "stop"),
    (CHAT, chat(stream="yes"), 400, "stream"),
    (CHAT, chat(n=2), 400, "n"),
    (CHAT, chat(stream=True, stream_options={"include_usage": "yes"}), 400, "stream_options.include_usage"),
    (CHAT, {**GOOD_CHAT, "model": "m" * 100_000}, 404, "model"),  # (quoted clipped: 100 characters)
    (IMAGES, {**GOOD_IMAGE, "response_format": "url"}, 400, "response_format"),
    (IMAGES, {**GOOD_IMAGE, "size": "100x100"}, 400, "size"),
    (IMAGES, {**GOOD_IMAGE, "size": "2048x2048"}, 400, "size"),
    (IMAGES, {**GOOD_IMAGE, "size": "32x64"}, 400, "size"),
    (IMAGES, {**GOOD_IMAGE, "size": "big"}, 400, "size"),
    (IMAGES, {**GOOD_IMAGE, "stream": True}, 400, "stream"),
    (IMAGES, {**GOOD_IMAGE, "output_format": "jpeg"}, 400, "output_format"),
    (IMAGES, {**GOOD_IMAGE, "stream": "x"}, 400, "stream"),
    (CHAT, chat(stream_options={"include_usage": True}), 400, "stream_options"),
    (CHAT, chat(stream=False, stream_options={"include_usage": True}), 400, "stream_options"),
    (IMAGES, {**GOOD_IMAGE, "background": "transparent"}, 400, "background"),
    (IMAGES, {**GOOD_IMAGE, "size": "0256x256"}, 400, "size"),  # (OpenAI's sizes have no leading zeros)
    (IMAGES, {**GOOD_IMAGE, "size": "64x128\n"}, 400, "size"),  # ("$" matched before a final newline)
    (IMAGES, {**GOOD_IMAGE, "size": "\u0666\u0664x128"}, 400, "size"),  # Arabic-Indic digits: int() takes them
    (IMAGES, {**GOOD_IMAGE, "n": 2}, 400, "n"),
    (IMAGES, {**GOOD_IMAGE, "prompt": ""}, 400, "prompt"),
    (IMAGES, {"model": MODEL}, 400, "prompt"),
    (IMAGES, {**GOOD_IMAGE, "model": "nope"}, 404, "model"),
    # (a trial: all these got a 200, and `logprobs: true` a silent null)
    (CHAT, chat(logprobs=True), 400, "logprobs"),
    (CHAT, chat(logprobs="yes"), 400, "logprobs"),
    (CHAT, chat(top_logprobs=5), 400, "top_logprobs"),
    (CHAT, chat(top_logprobs=50), 400, "top_logprobs"),
    (CHAT, chat(response_format="json"), 400, "response_format"),
    (CHAT, chat(response_format={"type": "json_object"}), 400, "response_format.type"),
    (CHAT, chat(tools="nope"), 400, "tools"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}], tool_choice="required"), 400,
     "tool_choice"),
    (CHAT, chat(tool_choice="sometimes"), 400, "tool_choice"),
    # (trial CL: a function tool with no function got a 200; OpenAI's answer is a 400)
    (CHAT, chat(tools=[{"type": "function"}]), 400, "tools[0].function"),
    (CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {}}]), 400,
     "tools[1].function.name"),
    (CHAT, chat(tools=[{"type": "function", "function": "f"}]), 400, "tools[0].function"),
    (CHAT, chat(functions=[{"description": "no name"}]), 400, "functions[0].name"),
    # (a trial: the deprecated form of a forced call got a 200 with text)
    (CHAT, chat(functions=[{"name": "f"}], function_call={"name": "f"}), 400, "function_call"),
    (CHAT, chat(function_call="sometimes"), 400, "function_call"),
    (CHAT, chat(functions="f"), 400, "functions"),
    (CHAT, chat(presence_penalty=5), 400, "presence_penalty"),
    (CHAT, chat(frequency_penalty="x"), 400, "frequency_penalty"),
    # vLLM's own sampling fields, checked as vLLM checks them (a trial's `top_k: -5` was a silent 200)
    (CHAT, chat(top_k=-5), 400, "top_k"),
    (CHAT, chat(top_k=1.5), 400, "top_k"),
    (CHAT, chat(top_k=2**64), 400, "top_k"),  # (a review: vLLM took it, then failed to encode it: a 500)
    (CHAT, chat(min_p=1.5), 400, "min_p"),
    (CHAT, chat(repetition_penalty=0), 400, "repetition_penalty"),
    (CHAT, chat(min_tokens=-1), 400, "min_tokens"),
    (CHAT, chat(min_tokens=50, max_tokens=10), 400, "min_tokens"),
    (CHAT, chat(user=5), 400, "user"),
    (CHAT, chat(seed=2**63), 400, "seed"),  # (a signed 64-bit integer, as OpenAI and vLLM take it)
]


@pytest.mark.parametrize("path,body,status,param", BAD,
                         ids=[f"{i}-{b[0].rsplit('/', 1)[1]}" for i, b in enumerate(BAD)])
def test_bad_input_then_good_request(path, body, status, param):
    bridge = FakeBridge(output_types=("text", "audio", "image"))

    async def body_fn(client):
        if isinstance(body, bytes):
            resp = await client.post(path, data=body,
                                     headers={"Content-Type": "application/json"})
        else:
            resp = await client.post(path, json=body)
        err = await assert_error(resp, status, param)
        if status == 404:
            assert err["code"] == "model_not_found" and len(err["message"]) < 300
        assert bridge.submitted == []
        await assert_good_chat(client)
        resp = await client.post(IMAGES, json=GOOD_IMAGE)
        assert resp.status == 200, await resp.text()

    serve(bridge, body_fn)


def test_a_message_without_role_or_with_a_role_of_another_type_says_so_in_json_terms():
    """Trial X: a missing role read ``Invalid value for 'messages[0].role': None``."""
    bridge = FakeBridge(output_types=("text",))

    async def body(client):
        err = await assert_error(await client.post(CHAT, json={"model": MODEL, "messages": [{"content": "x"}]}),
                                 400, "messages[0].role")
        assert err["message"] == "Missing required parameter: 'messages[0].role'."
        err = await assert_error(await client.post(CHAT, json={"model": MODEL, "messages": [
            {"role": "robot", "content": "x"}]}), 400, "messages[0].role")
        assert err["message"].startswith("Invalid value for 'messages[0].role': \"robot\". Supported values are: ")
        err = await assert_error(await client.post(CHAT, json={"model": MODEL, "messages": [
            {"role": ["user"], "content": "x"}]}), 400, "messages[0].role")
        assert err["message"].startswith("Invalid value for 'messages[0].role': list. ")

    serve(bridge, body)


def test_audio_on_text_only_pipeline_and_wrong_endpoint():
    bridge = FakeBridge(output_types=("text",))

    async def body(client):
        await assert_error(await client.post(CHAT, json=chat(modalities=["text", "audio"])),
                           400, "modalities")
        err = await assert_error(await client.post(IMAGES, json=GOOD_IMAGE), 400)
        assert "/v1/chat/completions" in err["message"]
        await assert_good_chat(client)

    serve(bridge, body)
    image_only = FakeBridge(output_types=("image",))

    async def body2(client):
        err = await assert_error(await client.post(CHAT, json=GOOD_CHAT), 400)
        assert "/v1/images/generations" in err["message"]
        assert (await client.post(IMAGES, json=GOOD_IMAGE)).status == 200

    serve(image_only, body2)


def test_router_errors_and_body_limit_are_openai_json():
    bridge = FakeBridge()

    async def body(client):
        err = await assert_error(await client.get("/v1/nothing"), 404)
        # (OpenAI's type for an unknown route or model; the openai client raises NotFoundError by status)
        assert (err["type"], err["message"]) == ("invalid_request_error", "Unknown request URL: GET /v1/nothing")
        resp = await client.get(CHAT)
        await assert_error(resp, 405)
        assert "POST" in resp.headers["Allow"]
        await assert_error(await client.post(CHAT, data=b"x" * 10_000,
                                             headers={"Content-Type": "application/json"}), 413)
        big = chat("y" * 5000)
        await assert_error(await client.post(CHAT, json=big), 413)
        await assert_good_chat(client)

    serve(bridge, body, max_body_bytes=2048)


# ------------------------------------------------------------- good requests

def test_non_streaming_chat_with_audio_and_pipeline_request():
    bridge = FakeBridge()

    async def body(client):
        messages = [{"role": "system", "content": "be brief"},
                    {"role": "user", "content": [{"type": "text", "text": "say"},
                                                 {"type": "text", "text": "hello"}]}]
        resp = await client.post(CHAT, json={
            "model": MODEL, "messages": messages, "modalities": ["audio", "text"],
            "audio": {"voice": "Chelsie", "format": "wav"}, "max_tokens": 100,
            "temperature": 0.5, "top_p": 0.9, "seed": 7, "stop": "\n\n", "unknown_field": {"ignored": True},
            "presence_penalty": 0.5, "frequency_penalty": -1, "top_k": 20, "min_p": 0.05,
            "repetition_penalty": 1.1, "min_tokens": 2,  # (to the text stage: vLLM applies them)
            # accepted and ignored (they ask for nothing the reply lacks)
            "logprobs": False, "top_logprobs": 0, "response_format": {"type": "text"},
            "user": "u1", "tool_choice": "auto",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]})
        assert resp.status == 200, await resp.text()
        data = await resp.json()
        assert data["object"] == "chat.completion" and data["model"] == MODEL
        assert data["id"].startswith("chatcmpl-") and resp.headers["X-Request-Id"] == data["id"]
        choice = data["choices"][0]
        assert choice["finish_reason"] == "stop"
        msg = choice["message"]
        assert msg["role"] == "assistant" and msg["content"] == "Hello world"
        assert msg["audio"]["transcript"] == "Hello world"
        assert msg["audio"]["expires_at"] > data["created"]
        assert wav_info(msg["audio"]["data"]) == (24000, 1, 2400)
        assert data["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
        req = bridge.submitted[0]
        assert req.request_id == data["id"]
        assert req.output_types == frozenset({"text", "audio"})
        assert req.sampling_params == {"max_tokens": 100, "temperature": 0.5, "top_p": 0.9, "seed": 7,
                                       "stop": ["\n\n"], "presence_penalty": 0.5, "frequency_penalty": -1.0,
                                       "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2}
        assert req.params == {"voice": "Chelsie"}
        assert req.timeout_s == bridge.request_timeout_s
        assert req.prompt == "system: be brief\nuser: say\nhello"
        assert bridge.cancelled == []

        resp = await client.post(CHAT, json=chat(max_completion_tokens=3))
        data = await resp.json()
        assert data["choices"][0]["finish_reason"] == "length"
        assert "audio" not in data["choices"][0]["message"]
        assert bridge.submitted[1].sampling_params == {"max_tokens": 3}
        assert bridge.submitted[1].output_types == frozenset({"text"})

    serve(bridge, body)


def read_sse(raw: str):
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), raw
    payloads = [e[len("data: "):] for e in events]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def test_streaming_chat():
    bridge = FakeBridge()

    async def body(client):
        resp = await client.post(CHAT, json=chat(
            stream=True, modalities=["text", "audio"], stream_options={"include_usage": True}))
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"
        chunks = read_sse(await resp.text())
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        contents = [c["choices"][0]["delta"]["content"] for c in chunks[1:]
                    if c["choices"] and c["choices"][0]["delta"].get("content")]
        assert len(contents) > 1 and "".join(contents) == "Hello world"
        audio = [c["choices"][0]["delta"]["audio"] for c in chunks
                 if c["choices"] and "audio" in c["choices"][0]["delta"]]
        # the whole audio as PCM16 parts of at most 1 s, then the transcript (as when stages
        # stream: one SSE line of a long reply's WAV was tens of MB, a trial)
        assert audio[0]["id"].startswith("audio_") and "id" not in audio[1] and len(audio) == 2  # (the id once)
        assert len(base64.b64decode(audio[0]["data"])) == 2400 * 2 and "transcript" not in audio[0]
        assert audio[1]["transcript"] == "Hello world" and "data" not in audio[1] and audio[1]["expires_at"]

        # at another rate than the parts' 24 kHz: one WAV, which says its rate (a review)
        resp16 = await client.post(CHAT, json=chat("[16k]", stream=True, modalities=["text", "audio"]))
        audio16 = [c["choices"][0]["delta"]["audio"] for c in read_sse(await resp16.text())
                   if c["choices"] and "audio" in c["choices"][0]["delta"]]
        assert len(audio16) == 1 and wav_info(audio16[0]["data"]) == (16000, 1, 2400)
        assert audio16[0]["transcript"] == "Hello world"
        assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 8
        assert resp.headers["X-Request-Id"] == chunks[0]["id"] == bridge.submitted[0].request_id

        # A final text that no delta carried is streamed as one delta; no usage chunk.
        resp = await client.post(CHAT, json=chat("[notext]", stream=True))
        chunks = read_sse(await resp.text())
        assert [c["choices"][0]["delta"].get("content") for c in chunks] == [
            "", "Hello world", None]
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
        assert bridge.cancelled == []

    serve(bridge, body)


def test_request_failed_before_and_during_stream():
    bridge = FakeBridge()

    async def body(client):
        err = await assert_error(await client.post(CHAT, json=chat("[fail503]")), 503)
        assert "no ready replica" in err["message"] and err["type"] == "server_error"
        await assert_error(await client.post(CHAT, json=chat("[fail503]", stream=True)), 503)
        await assert_error(await client.post(CHAT, json=chat("[failmid]")), 500)
        resp = await client.post(CHAT, json=chat("[failmid]", stream=True))
        assert resp.status == 200
        chunks = read_sse(await resp.text())
        assert chunks[-1]["error"]["message"] == "engine crashed"
        assert [c["choices"][0]["delta"].get("content") for c in chunks[1:-1]] == [
            "Hel", "lo ", "world"]
        assert bridge.cancelled == []  # failed requests are finished, nothing to cancel
        await assert_good_chat(client)

    serve(bridge, body)


@pytest.mark.parametrize("handler_cancellation", [True, False])
def test_client_disconnect_mid_stream_cancels(handler_cancellation):
    bridge = FakeBridge()

    async def body(client):
        resp = await client.post(CHAT, json=chat("[slow]", stream=True))
        assert resp.status == 200
        await resp.content.readuntil(b"\n\n")
        await resp.content.readuntil(b"\n\n")
        rid = resp.headers["X-Request-Id"]
        resp.close()
        for _ in range(200):
            if rid in bridge.cancelled:
                break
            await asyncio.sleep(0.02)
        assert bridge.cancelled == [rid]
        await assert_good_chat(client)

    serve(bridge, body, handler_cancellation=handler_cancellation)


async def _post_reading_nothing(client, body: dict):
    """POST ``body`` to the chat endpoint on a raw socket with a tiny receive buffer, which
    the caller then does not read: the socket."""
    import socket

    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, (client.server.host, client.server.port))
    payload = json.dumps(body).encode()
    await loop.sock_sendall(sock, b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                            b"Content-Type: application/json\r\nContent-Length: "
                            + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    return sock


async def _read_to_the_end(sock) -> int:
    """Bytes read from ``sock`` until it is reset. Trial BU: a client cut off for reading
    nothing then read megabytes of its dead stream (the server's send queue) and an end
    with no error: the server resets the connection, which drops what it had queued."""
    loop, got = asyncio.get_running_loop(), 0
    while True:
        try:
            chunk = await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 5)
        except ConnectionResetError:
            return got
        assert chunk, f"the connection ended with no reset after {got} bytes"
        got += len(chunk)


def test_a_client_that_reads_nothing_of_its_stream_is_cut_off_and_its_request_cancelled(monkeypatch):
    """A trial's clients that never read their streams kept every byte of their replies in
    the API server (13 MB per audio stream) for as long as they stayed connected."""
    monkeypatch.setenv("OMNI_ACTORS_SEND_TIMEOUT_S", "0.5")
    bridge = FakeBridge(output_types=("text",))

    async def body(client):
        sock = await _post_reading_nothing(client, chat("[flood]", stream=True))
        try:
            for _ in range(250):  # (never reading: the stream fills the buffers, then waits)
                if bridge.cancelled:
                    break
                await asyncio.sleep(0.02)
            assert bridge.cancelled == [bridge.submitted[0].request_id]
            got = await _read_to_the_end(sock)  # (what was in flight, then the connection's end)
            assert got < 64 << 20  # (cut off: the flood never ends)
        finally:
            sock.close()
        await assert_good_chat(client)  # (and the server serves on)

    serve(bridge, body)


def test_a_client_that_reads_nothing_of_a_large_reply_is_cut_off(monkeypatch):
    """A code review: a non-streamed reply (an audio reply, an image: megabytes) went out with
    no send timeout, and a client that read none of it kept all of it in the API server's
    memory for as long as it kept its connection. It is cut off after the send timeout."""
    monkeypatch.setenv("OMNI_ACTORS_SEND_TIMEOUT_S", "0.5")
    bridge = FakeBridge(output_types=("text",))

    async def body(client):
        sock = await _post_reading_nothing(client, chat("[bigtext]"))
        try:
            await asyncio.sleep(2.0)  # (reading nothing: past the send timeout)
            got = await _read_to_the_end(sock)  # (what was in flight, then the connection's end)
            assert got < 16 << 20  # (cut off)
        finally:
            sock.close()
        await assert_good_chat(client)  # (and the server serves on)
        resp = await client.post(CHAT, json=chat("[bigtext]"))  # (a client that reads gets it all)
        assert resp.status == 200 and len((await resp.json())["choices"][0]["message"]["content"]) == 16 << 20

    serve(bridge, body)


def test_a_client_that_reads_a_large_reply_slowly_gets_all_of_it(monkeypatch):
    """A code review: the send timeout bounded the whole transfer of a large reply (one write
    of it all), so a client that kept reading, but took longer than the timeout over all of
    it, was cut off midway. It bounds a stretch without reading now."""
    import socket

    monkeypatch.setenv("OMNI_ACTORS_SEND_TIMEOUT_S", "0.5")
    bridge = FakeBridge(output_types=("text",))

    async def body(client):
        loop = asyncio.get_running_loop()
        sock = socket.socket()
        sock.setblocking(False)
        await loop.sock_connect(sock, (client.server.host, client.server.port))
        payload = json.dumps(chat("[bigtext]")).encode()
        await loop.sock_sendall(sock, b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                                b"Content-Type: application/json\r\nContent-Length: "
                                + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        got, t0 = bytearray(), time.monotonic()
        try:
            while True:  # (about 4 MB a second: 16 MB take longer than the send timeout)
                chunk = await asyncio.wait_for(loop.sock_recv(sock, 128 << 10), 5)
                if not chunk:
                    break
                got += chunk
                await asyncio.sleep(0.03)
        finally:
            sock.close()
        assert time.monotonic() - t0 > 1.0
        head, _, reply = bytes(got).partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert len(json.loads(reply)["choices"][0]["message"]["content"]) == 16 << 20

    serve(bridge, body)


def test_client_disconnect_non_streaming_cancels_with_start_http():
    bridge = FakeBridge()

    async def main():
        runner = await start_http(bridge, "127.0.0.1", 0)
        port = runner.addresses[0][1]
        try:
            async with ClientSession() as s:
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(
                        s.post(f"http://127.0.0.1:{port}{CHAT}", json=chat("[stuck]")), 0.3)
            for _ in range(200):
                if bridge.cancelled:
                    break
                await asyncio.sleep(0.02)
            assert bridge.cancelled == [bridge.submitted[0].request_id]
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_stuck_bridge_times_out_with_504(monkeypatch):
    import omni_actors.http.app as app_mod

    monkeypatch.setattr(app_mod, "DEADLINE_GRACE_S", 0.0)
    bridge = FakeBridge(request_timeout_s=0.2)

    async def body(client):
        resp = await client.post(CHAT, json=chat("[stuck]"))
        err = await assert_error(resp, 504)
        assert (err["type"], err["code"]) == ("server_error", "timeout")
        assert resp.headers.get("x-should-retry") == "false"  # (openai's client would wait out 2 more deadlines)
        assert bridge.cancelled == [bridge.submitted[0].request_id]

    serve(bridge, body)


def test_images_models_health_stages():
    bridge = FakeBridge(output_types=("image",))

    async def body(client):
        resp = await client.post(IMAGES, json={**GOOD_IMAGE, "seed": 3, "response_format": "b64_json",
                                               "output_format": "png", "background": "opaque"})
        assert resp.status == 200, await resp.text()
        data = await resp.json()
        png = base64.b64decode(data["data"][0]["b64_json"])
        assert png.startswith(b"\x89PNG")
        from PIL import Image

        img = Image.open(io.BytesIO(png))
        assert img.size == (64, 128)
        req = bridge.submitted[0]
        assert req.request_id.startswith("img-") and req.output_types == frozenset({"image"})
        assert req.params == {"width": 64, "height": 128} and req.sampling_params == {"seed": 3}
        await client.post(IMAGES, json={"model": MODEL, "prompt": "x"})
        assert bridge.submitted[1].params == {"width": 256, "height": 256}
        # `model` is optional in OpenAI's images API (a trial's request without it got a 400)
        resp = await client.post(IMAGES, json={"prompt": "x"})
        assert resp.status == 200 and (await resp.json())["data"], await resp.text()

        models = await (await client.get("/v1/models")).json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
        assert (await client.get(f"/v1/models/{MODEL}")).status == 200
        await assert_error(await client.get("/v1/models/other"), 404)
        # an id with a slash, not escaped (zai-org/GLM-Image; a code review read "Unknown request URL")
        err = await assert_error(await client.get("/v1/models/zai-org/GLM-Image"), 404)
        assert err["code"] == "model_not_found" and "'zai-org/GLM-Image'" in err["message"], err
        resp = await client.get("/health")
        assert resp.status == 200 and await resp.json() == {"status": "ok"}
        assert await (await client.get("/v1/stages")).json() == {
            "thinker": {"replicas": 1, "ready": 1}}

    serve(bridge, body)


def test_api_key():
    bridge = FakeBridge()

    async def body(client):
        resp = await client.post(CHAT, json=GOOD_CHAT)
        err = await assert_error(resp, 401)
        assert err["code"] is None and err["message"].startswith("You didn't provide an API key")
        assert resp.headers["WWW-Authenticate"] == 'Bearer realm="omni-actors"'  # (RFC 9110 asks it of a 401)
        # a key sent another way is not "no key" (a trial's `Basic ...` was told it gave none)
        err = await assert_error(await client.post(
            CHAT, json=GOOD_CHAT, headers={"Authorization": "Basic czNjcmV0"}), 401)
        assert err["message"] == "The Authorization header is not 'Bearer YOUR_KEY' (it has scheme 'Basic')."
        resp = await client.post(CHAT, json=GOOD_CHAT, headers={"Authorization": "Bearer wrong"})
        err = await assert_error(resp, 401)
        assert err["code"] == "invalid_api_key"
        assert resp.headers["WWW-Authenticate"] == 'Bearer realm="omni-actors", error="invalid_token"'
        # a byte that is not UTF-8 in the key: a 401 too (a code review: a 500)
        err = await assert_error(await client.post(
            CHAT, json=GOOD_CHAT, headers={"Authorization": "Bearer s3cr\xff"}), 401)
        assert err["code"] == "invalid_api_key"
        await assert_error(await client.get("/v1/models"), 401)
        assert (await client.get("/health")).status == 200
        probe = await client.get("/ready")  # open too (a probe sends no key); this fake is not ready
        assert probe.status == 503 and (await probe.json())["status"] == "not ready"
        resp = await client.post(CHAT, json=GOOD_CHAT,
                                 headers={"Authorization": "Bearer s3cret"})
        assert resp.status == 200
        assert bridge.submitted and len(bridge.submitted) == 1

    serve(bridge, body, api_key="s3cret")


def test_unexpected_exception_is_500_json():
    class Broken(FakeBridge):
        async def stages(self):
            raise RuntimeError("boom")

    async def body(client):
        err = await assert_error(await client.get("/v1/stages"), 500)
        assert err["type"] == "server_error"
        await assert_good_chat(client)

    serve(Broken(), body)


def test_a_stage_table_the_coordinator_does_not_answer_in_time_is_a_503():
    """A code review: a coordinator slow to answer (frozen, busy, being recreated) made
    `/v1/stages` a 500 and logged a traceback; /ready and /metrics said what it was."""
    class Slow(FakeBridge):
        async def stages(self):
            raise asyncio.TimeoutError

    async def body(client):
        resp = await client.get("/v1/stages")
        err = await assert_error(resp, 503)
        assert (err["type"], err["code"]) == ("server_error", "service_unavailable")
        assert "coordinator did not answer in time" in err["message"]
        await assert_good_chat(client)

    serve(Slow(), body)


def test_a_500_for_a_request_the_server_lost_leaves_the_client_free_to_retry():
    """A code review: a 500 for a request whose RequestActor exited (or could not take it)
    carried ``x-should-retry: false``, meant for a pipeline's 500 (the server retried the
    stage already), so OpenAI's clients did not try a request that nothing in it had failed."""
    async def body(client):
        lost = await client.post(CHAT, json=chat("[raexited]"))
        await assert_error(lost, 500)
        failed = await client.post(CHAT, json=chat("[failmid]"))
        await assert_error(failed, 500)
        return lost.headers.get("x-should-retry"), failed.headers.get("x-should-retry")

    assert serve(FakeBridge(), body) == (None, "false")


def test_protocol_pure_functions():
    assert render_prompt([{"role": "developer", "content": "d"},
                          {"role": "assistant", "content": None}]) == "developer: d\nassistant: "
    # An assistant turn replayed from OpenAI may hold a refusal part (a trial's got a 400); a user's may not.
    assert render_prompt([{"role": "user", "content": "x"},
                          {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]) == \
        "user: x\nassistant: no"
    with pytest.raises(ApiError) as e:
        render_prompt([{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}])
    assert e.value.param == "messages[0].content[0].type"
    with pytest.raises(ApiError) as e:  # (trial BZ: "Invalid value for '...type': None")
        render_prompt([{"role": "user", "content": [{"text": "hi"}]}])
    assert (str(e.value), e.value.param) == ("Missing required parameter: 'messages[0].content[0].type'.",
                                             "messages[0].content[0].type")
    bridge = FakeBridge()
    creq = parse_chat_request(chat(max_tokens=5, max_completion_tokens=7), bridge)
    assert creq.sampling_params() == {"max_tokens": 7}
    # `audio` is unused without audio output: its voice does not reach the stages (a review: a
    # vLLM-Omni Thinker refused a text-only request for it)
    assert parse_chat_request(chat(audio={"voice": "alloy"}), bridge).params() == {}
    assert parse_chat_request(chat(modalities=["text", "audio"], audio={"voice": "alloy"}), bridge).params() == {
        "voice": "alloy"}
    with pytest.raises(ApiError) as e:
        parse_chat_request(chat(max_tokens=True), bridge)
    assert e.value.status == 400 and e.value.param == "max_tokens"


# ------------------------------------------------------------- openai client

def test_official_openai_client():
    openai = pytest.importorskip("openai")
    bridge = FakeBridge(output_types=("text", "audio", "image"))

    def drive(port: int) -> None:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0)
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}],
            modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "wav"})
        assert r.choices[0].message.content == "Hello world"
        assert wav_info(r.choices[0].message.audio.data)[0] == 24000
        assert r.usage.total_tokens == 8
        raw = client.chat.completions.create(  # OpenAI's pcm16: the same samples, no WAV header
            model=MODEL, messages=[{"role": "user", "content": "hi"}],
            modalities=["text", "audio"], audio={"voice": "Chelsie", "format": "pcm16"})
        pcm = base64.b64decode(raw.choices[0].message.audio.data)
        assert base64.b64decode(r.choices[0].message.audio.data).endswith(pcm) and len(pcm) > 0

        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True,
            stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "Hello world" and chunks[-1].usage.completion_tokens == 3

        img = client.images.generate(model=MODEL, prompt="a cat", size="256x256",
                                     response_format="b64_json")
        assert base64.b64decode(img.data[0].b64_json).startswith(b"\x89PNG")

        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model="nope",
                                           messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(model=MODEL, max_tokens=0,
                                           messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 400
        with pytest.raises(openai.APIError, match="engine crashed"):
            list(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "[failmid]"}], stream=True))
        assert [m.id for m in client.models.list()] == [MODEL]

    async def main():
        runner = await start_http(bridge, "127.0.0.1", 0)
        try:
            await asyncio.to_thread(drive, runner.addresses[0][1])
        finally:
            await runner.cleanup()

    asyncio.run(main())


async def _raw_post(client, rest: bytes, wait_s: float = 10) -> tuple[bytes, dict]:
    """POST to the chat route over a raw socket, ``rest`` after the first headers (more
    headers, the blank line, some body): the response head and its OpenAI error."""
    reader, writer = await asyncio.open_connection(client.host, client.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + rest)
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), wait_s)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    err = json.loads(await asyncio.wait_for(reader.readexactly(length), wait_s))["error"]
    writer.close()
    return head, err


def test_a_body_that_stalls_midway_gets_408_and_the_server_serves_on(monkeypatch):
    """A client sends its headers and 10 of the 100 body bytes it announced, then nothing:
    after ``BODY_READ_TIMEOUT_S`` (0.5 s here) it gets a 408 in OpenAI error JSON, where the
    server used to wait for ever; the next request is served."""
    from omni_actors.http import app as app_module

    monkeypatch.setattr(app_module, "BODY_READ_TIMEOUT_S", 0.5)

    async def body(client):
        head, err = await _raw_post(client, b"Content-Length: 100\r\n\r\n" + b'{"model": ')
        assert head.startswith(b"HTTP/1.1 408"), head
        assert err["message"] == ("The request body did not arrive within 0.5 s (or its chunked transfer "
                                  "encoding could not be read)."), err
        resp = await client.post("/v1/chat/completions", json=chat())
        assert resp.status == 200, await resp.text()

    serve(FakeBridge(), body)


def test_a_body_with_a_malformed_chunked_encoding_gets_a_400_or_a_408_that_says_so(monkeypatch):
    """A review: a chunked body with a bad chunk-size line got a 500 and a traceback from
    aiohttp's pure-Python parser (its TransferEncodingError is no RequestPayloadError), and
    the C parser's queued 400 left the body's reader waiting: a 408 that said the body "did
    not arrive". The first is a 400 now; the second's 408 names the likely cause."""
    from aiohttp.http_exceptions import TransferEncodingError

    from omni_actors.http import app as app_module

    monkeypatch.setattr(app_module, "BODY_READ_TIMEOUT_S", 0.5)

    async def body(client):
        reader, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)  # (the handler reads the body by now: the bad chunk comes later)
        writer.write(b"zz\r\nxx\r\n0\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        err = json.loads(await asyncio.wait_for(reader.readexactly(length), 10))["error"]
        writer.close()
        assert head.startswith((b"HTTP/1.1 408", b"HTTP/1.1 400")), head
        assert "chunked transfer encoding" in err["message"], err

    serve(FakeBridge(), body)

    class Request:  # (the pure-Python parser's error, as its reader raises it)
        content_length = None
        app = {app_module._MAX_BODY: 1 << 20}

        async def read(self):
            raise TransferEncodingError("zz")

    with pytest.raises(ApiError) as info:
        asyncio.run(app_module._read_json(Request()))
    assert info.value.status == 400 and "its chunked transfer encoding is malformed (at 'zz')" in str(info.value)


def test_a_gzip_body_that_does_not_decompress_gets_a_json_400_and_the_server_serves_on():
    """``Content-Encoding: gzip`` on a body that is not gzip: an OpenAI-style 400 that says
    so (a trial got a 500 and two tracebacks); a real gzip body is served."""
    import gzip

    async def body(client):
        resp = await client.post(CHAT, data=json.dumps(chat()).encode(),
                                 headers={"Content-Type": "application/json", "Content-Encoding": "gzip",
                                          "Connection": "close"})  # (the server closes it after the answer)
        assert resp.status == 400, await resp.text()
        err = (await resp.json())["error"]
        assert err["type"] == "invalid_request_error", err
        assert err["message"] == "We could not read the body of your request: Can not decode content-encoding: gzip"
        resp = await client.post(CHAT, data=gzip.compress(json.dumps(chat()).encode()),
                                 headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
        assert resp.status == 200, await resp.text()

    serve(FakeBridge(), body)


def test_a_body_that_does_not_decode_is_logged_as_a_bad_request_not_a_server_error():
    from aiohttp.http_exceptions import ContentEncodingError
    from aiohttp.web_protocol import RequestPayloadError

    from omni_actors.logs import _is_bad_http

    try:
        try:
            raise ContentEncodingError("Can not decode content-encoding: gzip")
        except ContentEncodingError as cause:
            raise RequestPayloadError("400, message: Can not decode content-encoding: gzip") from cause
    except RequestPayloadError as exc:
        assert _is_bad_http(exc)
    assert not _is_bad_http(RuntimeError("boom"))


def test_a_malformed_requests_log_line_holds_no_credential_and_is_bounded():
    """Trial CP: a request with bare LF line ends got aiohttp's 400, and the one
    ``bad_http_request`` line logged its whole head, ``Authorization: Bearer <the API key>``
    included, up to 8 KiB a line. Credentials are redacted and the text is cut."""
    import logging

    from aiohttp.http_exceptions import BadStatusLine
    from structlog.testing import capture_logs

    from omni_actors.logs import BAD_HTTP_TEXT_MAX, _StdlibToJson

    head = ("POST /v1/chat/completions HTTP/1.1\nHost: x\nAuthorization: Bearer s3cret-key\nCookie: sid=abc\n"
            "X-Api-Key: k3y\nX-Pad: " + "p" * 8000 + "\n\n")
    exc = BadStatusLine(f"Expected CRLF after version: {head.encode()!r}")
    record = logging.LogRecord("aiohttp.server", logging.ERROR, __file__, 1, "Error handling request", (),
                               (type(exc), exc, None))
    with capture_logs() as logs:
        _StdlibToJson().filter(record)
    (event,) = logs
    assert event["event"] == "bad_http_request", event
    text = event["error"]
    assert "s3cret-key" not in text and "sid=abc" not in text and "k3y" not in text, text
    assert "Authorization: <redacted>" in text and "Cookie: <redacted>" in text, text
    assert len(text) < BAD_HTTP_TEXT_MAX + 40 and text.endswith(" characters)"), text
    # aiohttp's pure-Python parser quotes a bad header's value without its name (a review)
    from omni_actors.logs import redact_credentials

    assert "SECRET" not in redact_credentials("Invalid HTTP header: b'sk-SECRET\\x01abc'")
    # a folded value, or a line over the limit, quoted without its header's name (trial CR); a key in the URL
    assert redact_credentials("Unexpected whitespace after header value: b' SECRETKEY' ^") == \
        "Unexpected whitespace after header value: b'<10 characters not logged>' ^"
    assert "SECRET" not in redact_credentials("Got more than 8190 bytes when reading: b'SECRETaaaa'")
    assert redact_credentials("b'GET /v1/models?api_key=SECRET&x=1 HTTP/1.1\\nHost: x'") == \
        "b'GET /v1/models?api_key=<redacted>&x=1 HTTP/1.1\\nHost: x'"
    assert "SECRET" not in redact_credentials("b'Authorization: Bearer abc\\\\SECRET\\x01'")


def test_a_body_declared_over_the_limit_gets_413_at_once_without_being_sent():
    """``Content-Length`` over the body limit and no body: a 413 at once, where the server
    used to wait ``BODY_READ_TIMEOUT_S`` (30 s) for a body it would refuse, then say 408."""
    async def body(client):
        head, err = await _raw_post(client, b"Content-Length: 5000000\r\n\r\n", wait_s=5)
        assert head.startswith(b"HTTP/1.1 413"), head
        assert err["message"] == "Request body too large: the limit is 2048 bytes.", err
        assert (await client.post(CHAT, json=chat())).status == 200
        # Trial BZ: with `Expect: 100-continue` (curl's, for bodies over 1 MB) the server said
        # "100 Continue", took the whole body, then refused it: the 413 comes instead.
        head, err = await _raw_post(client, b"Content-Length: 5000000\r\nExpect: 100-continue\r\n\r\n", wait_s=5)
        assert head.startswith(b"HTTP/1.1 413"), head
        assert err["message"] == "Request body too large: the limit is 2048 bytes.", err
        assert b"x-request-id:" in head.lower(), head  # (through the middlewares: logged and counted)
        reader, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 20\r\n"
                     b"Expect: 100-continue\r\n\r\n")
        await writer.drain()
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.close()

    serve(FakeBridge(), body, max_body_bytes=2048)


def test_a_connection_whose_headers_never_end_is_closed(monkeypatch):
    """Half a request line and headers, then nothing: the server closes the connection after
    ``IDLE_CONNECTION_TIMEOUT_S`` (0.5 s here; 75 s by default) instead of holding it an hour."""
    from omni_actors.http import app as app_module

    async def main():
        runner = await app_module.start_http(FakeBridge(), "127.0.0.1", 0)
        try:
            port = runner.addresses[0][1]
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            await writer.drain()
            t0 = asyncio.get_running_loop().time()
            assert await asyncio.wait_for(reader.read(), 10) == b""  # closed, nothing answered
            writer.close()
            return asyncio.get_running_loop().time() - t0
        finally:
            await runner.cleanup()

    monkeypatch.setattr(app_module, "IDLE_CONNECTION_TIMEOUT_S", 0.5)
    assert asyncio.run(main()) < 5


def test_a_long_streamed_audio_part_goes_out_in_parts_of_at_most_a_second():
    """A busy engine merges audio chunks; a part of 2.5 s (one 320 KB SSE line before)
    goes out as 1 s + 1 s + 0.5 s parts whose PCM joins back exactly, the id in the first."""
    import base64

    import numpy as np

    from omni_actors.http import protocol as P

    pcm = (np.arange(60_000) % 3000 - 1500).astype(np.int16)
    parts = P.audio_parts("audio_x", pcm)
    decoded = [np.frombuffer(base64.b64decode(p["data"]), "<i2") for p in parts]
    assert [len(d) for d in decoded] == [24_000, 24_000, 12_000]
    assert [p.get("id") for p in parts] == ["audio_x", None, None]
    np.testing.assert_array_equal(np.concatenate(decoded), pcm)
    assert len(P.audio_parts("audio_x", pcm[:100])) == 1
    assert [p.get("id") for p in P.audio_parts(None, pcm)] == [None, None, None]  # (a later chunk's)


@pytest.mark.parametrize("body, why", [
    (b'{"a": "x\\ud800"}', "an unpaired utf-16 surrogate escape"),  # (msgspec itself says "truncated")
    # (trial BZ: msgspec says "unexpected end of escaped utf-16 surrogate pair", read as malformed JSON)
    (b'{"messages": [{"content": "\\ud800 x"}], "max_tokens": 3}', "an unpaired utf-16 surrogate escape"),
    (b'{"a": "\\udc00x"}', "an unpaired utf-16 surrogate escape"),
    (b'{"a": "\\udc00x", }', "JSON is malformed"),  # (not JSON anyway: msgspec's own words)
    (b'{"a": "x', "truncated"),
    (b"", "the body is empty"),  # (msgspec says "truncated" here too)
    (b" \n", "the body is empty"),
])
def test_a_body_that_is_not_json_says_why(body, why):
    from omni_actors.http.app import decode_json

    with pytest.raises(ApiError) as err:
        decode_json(body)
    assert err.value.status == 400 and why in str(err.value), str(err.value)


#: A value of every JSON type (and a few edge cases of each), put in turn into each field.
ANY_JSON = [None, True, False, 0, -1, 1.5, 1e308, "", "x", [], ["x"], [1], [[]], {}, {"a": 1}, {"type": []}]
CHAT_FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
               "stream", "stream_options", "n", "modalities", "audio", "logprobs", "top_logprobs",
               "response_format", "tool_choice", "tools", "function_call", "functions", "user", "presence_penalty",
               "frequency_penalty", "top_k", "min_p", "repetition_penalty", "min_tokens"]
MESSAGE_FIELDS = ["role", "content", "name", "tool_call_id", "refusal"]
IMAGE_FIELDS = ["model", "prompt", "size", "n", "seed", "response_format", "output_format", "background", "stream"]


def _with(body: dict, path: tuple, value):
    out = json.loads(json.dumps(body))
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return out


def test_no_value_of_any_json_type_in_any_field_gets_a_500():
    """Trial X found no 500, but a role or audio format given as a list was one (a membership
    test on a frozenset: unhashable). Every field, every JSON type: a 200 or a 4xx in
    OpenAI's shape, never a server error, and the server answers the next good request."""
    bridge = FakeBridge(output_types=("text", "audio", "image"))
    cases = ([(CHAT, GOOD_CHAT, (f,)) for f in CHAT_FIELDS]
             + [(CHAT, GOOD_CHAT, ("messages", 0, f)) for f in MESSAGE_FIELDS]
             + [(CHAT, chat(modalities=["text", "audio"], audio={"format": "wav"}), ("audio", f))
                for f in ("format", "voice")]
             + [(CHAT, chat(stream=True, stream_options={"include_usage": True}), ("stream_options", "include_usage"))]
             + [(CHAT, {**GOOD_CHAT, "messages": [*GOOD_CHAT["messages"], {"role": "assistant", "audio": {"id": "x"}}]},
                 ("messages", 1, "audio", f)) for f in ("id",)]
             + [(CHAT, {**GOOD_CHAT, "messages": [*GOOD_CHAT["messages"], {"role": "assistant", "audio": {"id": "x"}}]},
                 ("messages", 1, "audio"))]
             + [(CHAT, chat(content=[{"type": "text", "text": "hi"}]), ("messages", 0, "content", 0, f))
                for f in ("type", "text")]
             + [(IMAGES, GOOD_IMAGE, (f,)) for f in IMAGE_FIELDS])

    async def body(client):
        bad = []
        for path, good, field in cases:
            for value in ANY_JSON:
                resp = await client.post(path, json=_with(good, field, value))
                text = await resp.text()
                if resp.status >= 500:
                    bad.append((path, field, value, resp.status, text[:200]))
                elif resp.status >= 400:
                    err = json.loads(text)["error"]
                    assert err["message"] and err["type"], (field, value, err)
        assert bad == []
        await assert_good_chat(client)

    serve(bridge, body)


def test_every_api_request_gets_one_access_log_line_with_its_status():
    """One ``http_request`` event per request: a 200, a 400, a 404 (unknown model and unknown
    route), a stream that failed after its 200 header (its outcome, 500) and a 503, each with
    its status, path, duration and request ids; GETs only when they fail. (A trial found the
    400s, 404s, 429s and 503s in no log.)"""
    from structlog.testing import capture_logs

    bridge = FakeBridge()
    refused = []

    async def body(client):
        await assert_good_chat(client)
        await client.post(CHAT, json={**GOOD_CHAT, "messages": []})
        resp = await client.post(CHAT, json=chat("hi", model="nope"), headers={"X-Request-Id": "my-trace-124"})
        refused.append(resp.headers["X-Request-Id"])
        await client.get("/v1/no-such-route")
        await client.get("/health")
        resp = await client.post(CHAT, json=chat("[failmid]", stream=True))
        await resp.text()
        await client.post(CHAT, json=chat("[fail503]"))

    with capture_logs() as logs:
        serve(bridge, body)
    lines = [e for e in logs if e["event"] == "http_request"]
    (refused_id,) = refused
    assert [(e["method"], e["path"], e["status"]) for e in lines] == [
        ("POST", CHAT, 200), ("POST", CHAT, 400), ("POST", CHAT, 404), ("GET", "/v1/no-such-route", 404),
        ("POST", CHAT, 500), ("POST", CHAT, 503)], lines
    assert [e["log_level"] for e in lines] == ["info"] * 4 + ["warning"] * 2
    assert all(e["duration_ms"] >= 0 and e["request_id"] for e in lines)
    assert lines[0]["request_id"] == bridge.submitted[0].request_id  # (as in request_finished)
    assert lines[2]["client_request_id"] == "my-trace-124" and lines[0]["client_request_id"] is None
    # the id is always ours (clients' ids may collide): a refused request's too (a trial found the
    # client's id as request_id for a 404, and ours for a 200)
    assert lines[2]["request_id"].startswith("req-") and lines[2]["request_id"] == refused_id
    # from 400 up, the message the client got (trial CG: a stream failed after its 200 header was
    # logged with no reason, and its request_finished said "error": null)
    assert lines[0]["error"] is None and "messages" in lines[1]["error"] and "nope" in lines[2]["error"]
    assert lines[3]["error"] and lines[4]["error"] and lines[5]["error"], lines


def test_a_run_cancelled_while_it_cancels_its_request_still_closes_its_events():
    """A code review: a handler cancelled again while it waited for its request's cancel
    (aiohttp cancels the handler of a client that hung up; a server stopping cancels it
    again) skipped closing its bridge events, left to the garbage collector's hook."""
    from omni_actors.http.app import _Run

    closed = []

    class SlowCancelBridge(FakeBridge):
        async def submit(self, req):
            try:
                while True:
                    await asyncio.sleep(0.01)
                    yield OutputText("tick ")
            finally:
                closed.append(req.request_id)

        async def cancel(self, request_id):
            await asyncio.sleep(0.5)
            self.cancelled.append(request_id)

    async def main():
        bridge = SlowCancelBridge()
        req = PipelineRequest("r1", "hi", frozenset({"text"}), {}, {}, 30.0, True)

        async def handler():
            async with _Run(bridge, req) as run:
                async for _ in run:
                    await asyncio.sleep(1)  # (writing to a slow client: the events wait at a yield)

        task = asyncio.create_task(handler())
        await asyncio.sleep(0.05)
        task.cancel()  # (the client hung up)
        await asyncio.sleep(0.05)
        task.cancel()  # (again, while it waits for the cancel)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert closed == ["r1"]  # (closed by the handler, not later by the garbage collector's hook)
        await asyncio.sleep(0.6)  # (the shielded cancel goes on)
        return bridge

    bridge = asyncio.run(main())
    assert bridge.cancelled == ["r1"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_request_its_request_actor_never_took_runs_on_another(stream):
    """Trial BM: a request handed to a stopped idle RequestActor got a 500 after 3 s, though
    nothing of it had run. It runs again (once), on another RequestActor: a new one (trial CC:
    the rerun went to another idle one, stopped as the first was, and failed)."""
    bridge = FakeBridge(output_types=("text",))
    status, text = serve(bridge, lambda client: _post_text(client, chat("[notstarted]", stream=stream)))
    assert status == 200 and "world" in text and "lost" not in text and '"error"' not in text, text
    assert [r.request_id for r in bridge.submitted][1].endswith("-rerun1")
    assert [r.fresh_actor for r in bridge.submitted] == [False, True]


def test_a_stage_table_with_a_lone_surrogate_is_served():
    """A code review: a replica's reason holding a lone surrogate (an engine error naming a
    file with bad bytes) made `/v1/stages` a 500."""
    class Bridge(FakeBridge):
        async def stages(self):
            return {"ready": False, "stages": [{"stage": "thinker", "ready_replicas": np.int64(0),
                                                "reason": "cannot open bad\udc80name"}]}

    async def body(client):
        resp = await client.get("/v1/stages")
        return resp.status, await resp.json()

    status, doc = serve(Bridge(), body)
    assert status == 200 and doc["stages"][0]["reason"] == "cannot open bad\udc80name", doc


def test_replayed_audio_turns_are_bounded_and_so_is_the_store_of_transcripts(monkeypatch):
    """A review: one audio id replayed 12,777 times in a 1 MiB body made a prompt of 131 MB;
    and the transcripts kept for replays were bounded in number only."""
    from omni_actors.http import protocol as P

    kept = P.AudioTranscripts(max_kept=3, max_chars=10)
    for i in range(4):
        kept.keep(f"a{i}", "abc", time.time() + 60)
    assert [kept.get(f"a{i}") for i in range(4)] == [None, "abc", "abc", "abc"]  # (3 at most)
    kept.keep("big", "0123456789", time.time() + 60)  # (10 characters at most: only it is left)
    assert [kept.get(k) for k in ("a3", "big")] == [None, "0123456789"]
    kept.keep("old", "x", time.time() - 1)
    assert kept.get("old") is None  # (past its expires_at)

    kept = P.AudioTranscripts()
    kept.keep("audio_1", "w " * 1000, time.time() + 60)
    turn = [{"role": "user", "content": "hi"}, {"role": "assistant", "audio": {"id": "audio_1"}}]
    assert P.render_prompt(turn, kept) == "user: hi\nassistant: " + "w " * 1000
    monkeypatch.setattr(P, "MAX_REPLAYED_CHARS", 5000)
    with pytest.raises(ApiError) as err:
        P.render_prompt(turn * 3, kept)
    assert err.value.status == 400 and err.value.param == "messages[5].audio", err.value.body()


def test_streamed_audio_parts_data_joined_decodes_as_one():
    """A review: the `openai` package's stream helper joins the parts' base64 `data` strings;
    parts whose bytes were not a multiple of 3 (a Code2Wav frame of 1,000 samples) had padding
    mid-string, and the joined data did not decode. Parts are cut at 3 samples; the rest waits."""
    from omni_actors.http import protocol as P

    chunks = [(np.arange(n) % 700 - 350).astype(np.int16) for n in (1000, 1000, 1001, 3)]
    held, data = (), []
    for pcm in chunks:
        sent, held = P.whole_base64(pcm, held)
        data += [p["data"] for p in P.audio_parts(None, sent)]
    data.append(P.audio_part(None, held)["data"])
    assert all("=" not in d for d in data[:-1])
    np.testing.assert_array_equal(np.frombuffer(base64.b64decode("".join(data)), "<i2"), np.concatenate(chunks))
