"""The synthetic engine: per-stage shapes, streaming, determinism (also across
processes), the cost model, concurrency limits, abort and start-up failures."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest

from omni_actors.config import StageDeployment, StageSpec, SyntheticCost
from omni_actors.engines import create_backend
from omni_actors.engines.base import BackendLoad, BackendTask, StageFinal, StageInputError, TextDelta
from omni_actors.engines.synthetic import SUPPORTED_STAGES, SyntheticEngine, token_id

REPO = Path(__file__).resolve().parents[1]


def stage(name: str, stage_id: int = 0) -> StageSpec:
    return msgspec.convert({"stage_id": stage_id, "engine_args": {"model_stage": name}}, StageSpec)


def engine(name: str, **cost) -> SyntheticEngine:
    return SyntheticEngine(stage(name), SyntheticCost(**cost), f"{name}/0")


async def collect(eng: SyntheticEngine, task: BackendTask) -> list:
    return [ev async for ev in eng.generate(task)]


def run_task(name: str, engine_input: dict, sampling=None, params=None, **cost) -> list:
    async def main():
        eng = engine(name, **cost)
        await eng.start()
        task = BackendTask("req-1", engine_input, sampling or {}, params or {})
        events = await collect(eng, task)
        assert eng.load() == BackendLoad(running=0, waiting=0)
        return events
    return asyncio.run(main())


def final_of(events: list) -> StageFinal:
    assert isinstance(events[-1], StageFinal)
    assert sum(isinstance(e, StageFinal) for e in events) == 1
    return events[-1]


def thinker_outputs(prompt="tell me a story about the sea", max_tokens=12, seed=0):
    return final_of(run_task("thinker", {"prompt": prompt},
                             {"max_tokens": max_tokens, "seed": seed})).outputs


# -- stages ------------------------------------------------------------------

def test_thinker_streams_deltas_that_add_up_to_the_text():
    events = run_task("thinker", {"prompt": "hello there world"}, {"max_tokens": 10})
    deltas, final = events[:-1], final_of(events)
    assert len(deltas) == 10 and all(isinstance(d, TextDelta) for d in deltas)
    assert "".join(d.text for d in deltas) == final.outputs["text"]
    assert not deltas[0].text.startswith(" ") and all(d.text.startswith(" ") for d in deltas[1:])
    ids = final.outputs["token_ids"]
    assert ids.dtype == np.int32 and ids.shape == (10,)
    assert [d.token_ids[0] for d in deltas] == ids.tolist()
    assert [token_id(w) for w in final.outputs["text"].split()] == ids.tolist()
    hidden = final.outputs["hidden_states"]
    assert hidden.dtype == np.float32 and hidden.shape == (3 + 10, 64)
    assert final.num_prompt_tokens == 3 and final.num_output_tokens == 10


def test_thinker_ends_where_a_stop_string_begins_with_the_same_tokens_up_to_it():
    """``stop`` (the API's): the text ends before the first stop string completed; the
    tokens are those generated without it, up to the one that completed it (as vLLM's);
    finish_reason "stop". A trial saw the demo ignore it ("length", the word in the text)."""
    whole = final_of(run_task("thinker", {"prompt": "hello there world"}, {"max_tokens": 10}))
    words = whole.outputs["text"].split()
    stop = words[4][:2]  # begins inside the 5th word (its first two letters)
    assert stop not in " ".join(words[:4])
    events = run_task("thinker", {"prompt": "hello there world"}, {"max_tokens": 10, "stop": ["zzz", stop]})
    deltas, final = events[:-1], final_of(events)
    assert final.outputs["text"] == " ".join(words[:4]) + " " and final.finish_reason == "stop"
    assert "".join(d.text for d in deltas) == final.outputs["text"]
    assert final.num_output_tokens == len(deltas) == 5  # the 5th completed the stop string
    assert final.outputs["token_ids"].tolist() == whole.outputs["token_ids"][:5].tolist()
    assert np.array_equal(final.outputs["hidden_states"], whole.outputs["hidden_states"][:3 + 5])
    # a stop string that never occurs changes nothing; one at the very start leaves no text
    none = final_of(run_task("thinker", {"prompt": "hello there world"}, {"max_tokens": 10, "stop": "zzz"}))
    assert none.outputs["text"] == whole.outputs["text"] and none.finish_reason is None
    first = final_of(run_task("thinker", {"prompt": "hello there world"}, {"max_tokens": 10, "stop": words[0]}))
    assert first.outputs["text"] == "" and first.num_output_tokens == 1
    with pytest.raises(ValueError, match="stop"):
        run_task("thinker", {"prompt": "x"}, {"stop": [""]})


def test_thinker_default_max_tokens_and_hidden_size():
    final = final_of(run_task("thinker", {"prompt": "hi"}, hidden_size=16))
    assert final.outputs["token_ids"].shape == (32,)
    assert final.outputs["hidden_states"].shape == (33, 16)


def test_talker_shapes():
    out = thinker_outputs(max_tokens=5)
    final = final_of(run_task("talker", {"token_ids": out["token_ids"],
                                         "hidden_states": out["hidden_states"]},
                              frames_per_token=3, num_codebooks=4, codebook_size=100))
    codes = final.outputs["codes"]
    assert codes.dtype == np.int32 and codes.shape == (15, 4)
    assert codes.min() >= 0 and codes.max() < 100
    assert final.num_output_tokens == 15


def test_code2wav_shapes_and_audible():
    codes = np.arange(6 * 8, dtype=np.int32).reshape(6, 8)
    final = final_of(run_task("code2wav", {"codes": codes}, samples_per_frame=480))
    audio = final.outputs["audio"]
    assert audio.dtype == np.int16 and audio.shape == (6 * 480,)
    assert final.outputs["sample_rate"] == 24000
    assert np.sqrt(np.mean(audio.astype(np.float64) ** 2)) > 1000  # clearly non-silent


def test_ar_shapes():
    final = final_of(run_task("ar", {"prompt": "a red cat"}, prior_grid=8))
    prior = final.outputs["prior_token_ids"]
    assert prior.dtype == np.int32 and prior.shape == (64,)
    assert prior.min() >= 0 and prior.max() < 16384


def test_dit_shapes_default_and_custom_size():
    prior = final_of(run_task("ar", {"prompt": "a cat"}, prior_grid=4)).outputs["prior_token_ids"]
    img = final_of(run_task("dit", {"prior_token_ids": prior, "prompt": "a cat"})).outputs["image"]
    assert img.dtype == np.uint8 and img.shape == (256, 256, 3)
    assert img.std() > 1  # not a flat colour
    img = final_of(run_task("dit", {"prior_token_ids": prior, "prompt": "a cat"},
                            params={"width": 100, "height": 60})).outputs["image"]
    assert img.shape == (60, 100, 3)
    # a non-square token count still works
    img = final_of(run_task("dit", {"prior_token_ids": prior[:10], "prompt": "x"},
                            params={"width": 8, "height": 8})).outputs["image"]
    assert img.shape == (8, 8, 3)


@pytest.mark.parametrize("name,engine_input,match", [
    ("thinker", {}, "no `prompt`"),
    ("thinker", {"prompt": 3}, "must be a str"),
    ("talker", {"token_ids": np.zeros(3, np.int32)}, "no `hidden_states`"),
    ("talker", {"token_ids": np.zeros((3, 2), np.int32),
                "hidden_states": np.zeros((3, 4), np.float32)}, "1-D int"),
    ("code2wav", {"codes": np.zeros(5, np.int32)}, "2-D int"),
    ("code2wav", {"codes": np.zeros((5, 2), np.float32)}, "2-D int"),
    ("ar", {"text": "x"}, "no `prompt`"),
    ("dit", {"prior_token_ids": np.zeros(4, np.int32)}, "no `prompt`"),
    ("dit", {"prior_token_ids": np.zeros(0, np.int32), "prompt": "x"}, "empty"),
    ("talker", {"token_ids": [[1, 2], [3]], "hidden_states": np.zeros((3, 4), np.float32)}, "is no array"),
])
def test_engine_input_without_the_fields_a_stage_reads_is_the_pipelines_fault(name, engine_input, match):
    """A stage's engine_input is what its processor made, never the client's own fields: a
    StageInputError (a 500), not a ValueError (a 400 blaming the client: trial CE)."""
    with pytest.raises(StageInputError, match=match):
        run_task(name, engine_input)


def test_bad_params_raise_value_error():
    with pytest.raises(ValueError, match="max_tokens"):
        run_task("thinker", {"prompt": "x"}, {"max_tokens": -1})
    with pytest.raises(ValueError, match="width"):
        run_task("dit", {"prior_token_ids": np.ones(4, np.int32), "prompt": "x"},
                 params={"width": 0})


def test_a_prompt_over_the_context_length_is_refused_and_generation_stops_at_it():
    """As vLLM's engine: a prompt longer than ``max_model_len`` is a ValueError (the client
    gets a 400), not 100 s of prefill and a 130 MB hidden-state array (a trial's 512,000
    words); a shorter one whose max_tokens runs past it stops there, finish_reason length."""
    words = " ".join(["w"] * 10)
    final = final_of(run_task("thinker", {"prompt": words}, {"max_tokens": 6}, max_model_len=16))  # fits
    assert final.num_output_tokens == 6 and final.finish_reason is None
    final = final_of(run_task("thinker", {"prompt": words}, {"max_tokens": 9}, max_model_len=16))
    assert final.num_output_tokens == 6 and final.finish_reason == "length"
    assert final.outputs["hidden_states"].shape[0] == 16
    with pytest.raises(ValueError, match=r"the prompt has 17 tokens: over the model's context length of 16"):
        run_task("thinker", {"prompt": words + " x" * 7}, {"max_tokens": 1}, max_model_len=16)
    # (trial CL: one that fills the context, no max_tokens asked, made an empty text: refused as vLLM does)
    with pytest.raises(ValueError, match=r"the prompt has 16 tokens: no room is left for a completion"):
        run_task("thinker", {"prompt": words + " x" * 6}, max_model_len=16)
    with pytest.raises(ValueError, match=r"the prompt has 2 tokens and 16 more are needed, 18 in all: over"):
        run_task("ar", {"prompt": "a cat"}, prior_grid=4, max_model_len=16)  # AR: prior_grid ** 2 tokens


# -- determinism ---------------------------------------------------------------

def _pipeline_digest(seed: int) -> str:
    """sha256 over every stage's outputs of a thinker->talker->code2wav and ar->dit run."""
    import hashlib

    h = hashlib.sha256()
    th = thinker_outputs(seed=seed)
    tk = final_of(run_task("talker", {"token_ids": th["token_ids"],
                                      "hidden_states": th["hidden_states"]},
                           {"seed": seed})).outputs
    wav = final_of(run_task("code2wav", {"codes": tk["codes"]})).outputs
    ar = final_of(run_task("ar", {"prompt": "a cat"}, {"seed": seed})).outputs
    img = final_of(run_task("dit", {"prior_token_ids": ar["prior_token_ids"],
                                    "prompt": "a cat"})).outputs
    for arr in (th["token_ids"], th["hidden_states"], tk["codes"], wav["audio"],
                ar["prior_token_ids"], img["image"]):
        h.update(arr.tobytes())
    h.update(th["text"].encode())
    return h.hexdigest()


def test_same_input_and_seed_give_identical_bytes():
    a, b = thinker_outputs(seed=7), thinker_outputs(seed=7)
    assert a["text"] == b["text"]
    assert a["token_ids"].tobytes() == b["token_ids"].tobytes()
    assert a["hidden_states"].tobytes() == b["hidden_states"].tobytes()
    assert _pipeline_digest(3) == _pipeline_digest(3)


def test_different_seed_or_prompt_gives_different_output():
    a, b = thinker_outputs(seed=1), thinker_outputs(seed=2)
    assert a["text"] != b["text"]
    assert a["hidden_states"].tobytes() != b["hidden_states"].tobytes()
    assert thinker_outputs(prompt="one")["text"] != thinker_outputs(prompt="two")["text"]
    assert _pipeline_digest(1) != _pipeline_digest(2)


def test_deterministic_across_processes():
    """Two fresh interpreters with different hash seeds agree with this one."""
    code = ("import sys; sys.path.insert(0, 'tests'); "
            "from test_synthetic_engine import _pipeline_digest; print(_pipeline_digest(5))")
    digests = set()
    for hash_seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed,
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        digests.add(out.stdout.strip())
    assert digests == {_pipeline_digest(5)}


# -- cost model, concurrency, abort ----------------------------------------------

def test_decode_cost_is_spent():
    t0 = time.monotonic()
    events = run_task("thinker", {"prompt": "x"}, {"max_tokens": 20}, decode_ms_per_token=5)
    elapsed = time.monotonic() - t0
    assert len(events) == 21
    assert elapsed >= 0.1  # 20 tokens x 5 ms; no upper bound (noisy machines)


def test_prefill_cost_is_spent():
    t0 = time.monotonic()
    run_task("code2wav", {"codes": np.zeros((40, 2), np.int32)}, prefill_ms_per_token=2.5,
             samples_per_frame=10)
    assert time.monotonic() - t0 >= 0.1  # 40 frames x 2.5 ms


def test_startup_cost_and_fail_startup():
    async def main():
        eng = engine("talker", startup_s=0.05, fail_startup="weights are missing")
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="weights are missing"):
            await eng.start()
        assert time.monotonic() - t0 >= 0.05
        with pytest.raises(RuntimeError, match="not started"):
            await collect(eng, BackendTask("r", {"prompt": "x"}))
    asyncio.run(main())


def test_unknown_stage_raises_in_start():
    async def main():
        eng = engine("vocoder")
        with pytest.raises(ValueError) as info:
            await eng.start()
        assert "vocoder" in str(info.value)
        assert all(s in str(info.value) for s in SUPPORTED_STAGES)
    asyncio.run(main())


def test_max_concurrency_limits_running_tasks():
    async def main():
        eng = engine("thinker", decode_ms_per_token=10, max_concurrency=2)
        await eng.start()
        tasks = [asyncio.create_task(collect(eng, BackendTask(f"r{i}", {"prompt": "x"},
                                                              {"max_tokens": 5})))
                 for i in range(4)]
        seen, peak_running = set(), 0
        while not all(t.done() for t in tasks):
            load = eng.load()
            seen.add((load.running, load.waiting))
            peak_running = max(peak_running, load.running)
            await asyncio.sleep(0.002)
        results = [t.result() for t in tasks]
        assert (2, 2) in seen
        assert peak_running == 2
        assert all(isinstance(r[-1], StageFinal) and len(r) == 6 for r in results)
        assert eng.load() == BackendLoad(0, 0)
    asyncio.run(main())


def test_abort_running_and_waiting_tasks():
    async def main():
        eng = engine("thinker", decode_ms_per_token=20, max_concurrency=1)
        await eng.start()
        running = asyncio.create_task(collect(eng, BackendTask("a", {"prompt": "x"},
                                                               {"max_tokens": 100})))
        waiting = asyncio.create_task(collect(eng, BackendTask("b", {"prompt": "x"},
                                                               {"max_tokens": 100})))
        await asyncio.sleep(0.1)
        assert eng.load() == BackendLoad(running=1, waiting=1)
        await eng.abort("b")
        await eng.abort("a")
        await eng.abort("never-seen")  # unknown ids are ignored
        a, b = await asyncio.wait_for(asyncio.gather(running, waiting), 30)  # hang guard only
        assert b == []
        # ended early: some of the 100 deltas, no final
        assert 0 < len(a) < 100 and not any(isinstance(e, StageFinal) for e in a)
        assert eng.load() == BackendLoad(0, 0)
        # the engine still serves, and the aborted id can be reused
        again = await collect(eng, BackendTask("a", {"prompt": "x"}, {"max_tokens": 2}))
        assert isinstance(again[-1], StageFinal)
    asyncio.run(main())


def test_abort_during_prefill_and_zero_cost_abort():
    async def main():
        eng = engine("ar", prefill_ms_per_token=1000)
        await eng.start()
        task = asyncio.create_task(collect(eng, BackendTask("p", {"prompt": "a b c"})))
        await asyncio.sleep(0.05)
        await eng.abort("p")
        assert await asyncio.wait_for(task, 30) == []  # the prefill alone is 3 s
        assert eng.load() == BackendLoad(0, 0)

        fast = engine("thinker")
        await fast.start()
        events = []
        async for ev in fast.generate(BackendTask("z", {"prompt": "x"}, {"max_tokens": 50})):
            events.append(ev)
            if len(events) == 3:
                await fast.abort("z")
        assert len(events) == 3 and fast.load() == BackendLoad(0, 0)
    asyncio.run(main())


def test_consumer_closing_the_iterator_frees_the_slot():
    async def main():
        eng = engine("thinker", decode_ms_per_token=1, max_concurrency=1)
        await eng.start()
        gen = eng.generate(BackendTask("c", {"prompt": "x"}, {"max_tokens": 50}))
        await gen.__anext__()
        assert eng.load().running == 1
        await gen.aclose()
        assert eng.load() == BackendLoad(0, 0)
    asyncio.run(main())


def test_create_backend():
    eng = create_backend(stage("talker"), StageDeployment(), "talker/0")
    assert isinstance(eng, SyntheticEngine)
    # Building a vLLM backend imports nothing from vLLM (that happens in start()).
    vllm_engine = create_backend(stage("talker"), StageDeployment(backend="vllm"), "talker/0")
    assert type(vllm_engine).__name__ == "VllmEngine"
    # Likewise for vLLM-Omni: nothing from vllm_omni is imported before start().
    omni_engine = create_backend(stage("talker"), StageDeployment(backend="vllm_omni"), "talker/0")
    assert type(omni_engine).__name__ == "VllmOmniEngine"
