"""One small request through a config's synthetic stages, in this process, before any is served.

A synthetic stage whose input processor, or whose synthetic ``kind``, does not fit
what the stage before it makes fails every request that reaches it (trial CE: a
Talker given the ``dit`` kind read ``prior_token_ids`` that no Thinker makes; each
audio request was a 500, and check-config had said ok). Which fields a processor
makes and a kind reads is only known by running them, so ``check-config`` and
``start`` run them: every synthetic stage whose sources are synthetic too, in graph
order, at zero cost (the cost model's sleeps off), on :data:`DRY_RUN_PROMPT` (as a
chat's one user message renders it, for a pipeline with text or audio outputs; as an
image request's prompt otherwise) with :data:`DRY_RUN_MAX_TOKENS` text tokens, the
stage's processor on its sources' outputs as a replica runs it (on each chunk, for an
edge that streams; read-only arrays, as a replica gets them; one of the user's on a
thread, as a replica runs it, for ``supervision.stall_timeout_s`` at most, as a replica
waits). A config is refused when a processor fails on the stages' outputs (or returns no
dict, or does not return in time) or a stage's engine cannot take what its processor made
(:class:`~omni_actors.engines.base.StageInputError`); an engine that refuses the
request itself (a context too small for the prompt: the client's 400) stops the run
there, with no verdict. Stages of other backends, and those downstream of them, are not
run (their outputs need their engines).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable

import msgspec

from omni_actors.config import ConfigError, PipelineConfig

__all__ = ["DRY_RUN_MAX_TOKENS", "DRY_RUN_PROMPT", "dry_run_problem"]

#: The dry run's prompt: a chat's one user message (rendered as the API renders it), or an
#: image request's prompt.
DRY_RUN_PROMPT = "Describe the sea in one short sentence."
#: Text tokens the dry run asks of its final text stages (the client's ``max_tokens``).
DRY_RUN_MAX_TOKENS = 8
#: Request parameters of the dry run (an image request's, the API's smallest side:
#: text stages ignore them).
DRY_RUN_PARAMS = {"width": 64, "height": 64}
#: Seconds the stages' engines may take in all before the run is given up (no verdict: the
#: config passes); at zero cost they take milliseconds. A processor's own time is bounded by
#: ``supervision.stall_timeout_s``, as on a replica (trial CQ: a processor that never returned
#: hung ``check-config`` and ``start`` for good, Ctrl-C included).
DRY_RUN_TIMEOUT_S = 10.0
#: Seconds a processor runs before ``on_note`` is told what the dry run waits for.
NOTE_AFTER_S = 2.0


class _ProcessorTimeout(Exception):
    """A processor did not return within the stall timeout."""


class _NoVerdict(Exception):
    """A processor refused the dry run's request as a client's (``InvalidRequest``): the run
    stops there with no verdict, as for an engine that refuses the request itself."""


class _Failure(Exception):
    """A dry-run stage failed: ``path`` is the YAML path to blame."""

    def __init__(self, path: str, message: str):
        super().__init__(message)
        self.path, self.message = path, message


def dry_run_problem(cfg: PipelineConfig, on_note: Callable[[str], None] | None = None) -> ConfigError | None:
    """The first synthetic stage that fails the dry run (see the module), as the error
    ``start`` and ``check-config`` refuse the config with; None when every stage run
    passed, none could run, or the engines took over :data:`DRY_RUN_TIMEOUT_S`.
    ``on_note(text)``: told once per processor call that runs over :data:`NOTE_AFTER_S`
    what the run waits for.

    Must be called with no event loop running in this thread (it runs its own).
    """
    try:
        asyncio.run(_run(cfg, on_note or (lambda text: None)))
    except _Failure as failure:
        return ConfigError(cfg.source, failure.path, failure.message)
    except (asyncio.TimeoutError, _NoVerdict):
        return None
    return None


def _order(cfg: PipelineConfig) -> list:
    """The stages, each after its sources (the graph is acyclic: checked at load)."""
    done: set[int] = set()
    out, left = [], list(cfg.stage_args)
    while left:
        ready = [s for s in left if set(s.engine_input_source) <= done]
        if not ready:  # (a source that is no stage: refused at load; nothing more to run)
            break
        for s in ready:
            out.append(s)
            done.add(s.stage_id)
            left.remove(s)
    return out


async def _waited(done: concurrent.futures.Future, timeout_s: float, note: Callable[[], None]) -> tuple[Any, float]:
    """The result of a processor call on a thread, waited ``timeout_s`` at most (``note()``
    after :data:`NOTE_AFTER_S`), and the longest the event loop went without a turn meanwhile
    (s): a call that holds the interpreter (a long C call that keeps the GIL) stops this
    thread too, and a replica's heartbeats.

    Raises:
        _ProcessorTimeout: not in time. What the call raised (a TimeoutError of its own too).
    """
    loop = asyncio.get_running_loop()
    future = asyncio.wrap_future(done)
    gap, last = [0.0], [loop.time()]

    async def watch() -> None:
        while True:
            await asyncio.sleep(0.05)
            now = loop.time()
            gap[0] = max(gap[0], now - last[0] - 0.05)
            last[0] = now

    watcher = asyncio.ensure_future(watch())
    try:
        finished, _ = await asyncio.wait({future}, timeout=min(timeout_s, NOTE_AFTER_S))
        if not finished and timeout_s > NOTE_AFTER_S:
            note()
            finished, _ = await asyncio.wait({future}, timeout=timeout_s - NOTE_AFTER_S)
        # (a hold that ended as the call returned: the watcher has not had its turn since)
        gap[0] = max(gap[0], loop.time() - last[0] - 0.05)
        if not finished:
            raise _ProcessorTimeout()
        return future.result(), gap[0]
    finally:
        watcher.cancel()


async def _run(cfg: PipelineConfig, on_note: Callable[[str], None]) -> None:
    from omni_actors.actors.processor_threads import ProcessorThreads, runs_inline
    from omni_actors.config_checks import resolve_processor
    from omni_actors.engines import stream_edges
    from omni_actors.engines.base import BackendTask, OutputChunk, StageFinal, StageInputError
    from omni_actors.engines.synthetic import SyntheticEngine
    from omni_actors.http.protocol import render_prompt
    from omni_actors.processors import InvalidRequest, default_input, read_only_hint

    streams = stream_edges(cfg)
    chat = bool(cfg.output_types() & {"text", "audio"})
    prompt = render_prompt([{"role": "user", "content": DRY_RUN_PROMPT}]) if chat else DRY_RUN_PROMPT
    threads = ProcessorThreads(1, name="dry-run-processor")
    request = (f"a chat of one user message {DRY_RUN_PROMPT!r}, {DRY_RUN_MAX_TOKENS} text tokens" if chat else
               f"an image request for {DRY_RUN_PROMPT!r}, {DRY_RUN_PARAMS['width']}x{DRY_RUN_PARAMS['height']}")
    stall_s = cfg.deployment.supervision.stall_timeout_s  # (how long a replica waits for a processor)
    # (how long a processor may hold the interpreter before its replica is taken for silent and
    # replaced: the silence is the hold plus up to one interval since the last heartbeat; trial CT
    # saw a 1.2 s hold pass at missed x interval, 1.5 s, and isolate replicas)
    interval, missed = cfg.deployment.heartbeat_interval_s, cfg.deployment.supervision.missed_heartbeats
    missed_s, silent_s = missed * interval, max(1, missed - 1) * interval
    engine_s = DRY_RUN_TIMEOUT_S  # what is left of the engines' time
    loop = asyncio.get_running_loop()
    finals: dict[int, dict[str, Any]] = {}  # stage id -> its outputs, for the stages that ran
    chunks: dict[int, list[dict[str, Any]]] = {}  # stage id -> the chunks it made
    for i, s in ((cfg.stage_args.index(s), s) for s in _order(cfg)):
        dep = cfg.deployment_of(s)
        if dep.backend != "synthetic" or any(src not in finals for src in s.engine_input_source):
            continue
        func = s.custom_process_input_func
        processor = resolve_processor(func) if func else default_input
        name = func or "the default input processor"
        # (the cost model's sleeps and test faults off: what is left is what the stage computes)
        cost = msgspec.structs.replace(dep.synthetic, startup_s=0.0, prefill_ms_per_token=0.0,
                                       decode_ms_per_token=0.0, startup_blocks=False, fail_startup=None,
                                       crash_on=None)
        engine = SyntheticEngine(s, cost, f"{s.name}/dry-run")
        kind = cost.kind or str(s.engine_args.get("model_stage", ""))
        kind_path = (f"deployment.stages.{s.name}.synthetic.kind" if dep.synthetic.kind
                     else f"stage_args[{i}].engine_args.model_stage")
        src = streams.get(s.stage_id)
        upstream = {sid: _read_only(finals[sid]) for sid in s.engine_input_source}
        from_what = (f"the outputs of stage(s) {sorted(upstream)} ({', '.join(_names(cfg, upstream))})"
                     if upstream else "the prompt")

        async def process(up: dict, _p=processor, _name=name, _what=from_what, _i=i) -> dict:
            path = f"stage_args[{_i}].custom_process_input_func" if func else f"stage_args[{_i}]"
            try:
                if runs_inline(_p):
                    made = _p(up, prompt, dict(DRY_RUN_PARAMS))
                else:  # (one of the user's, on a daemon thread: one that never returns holds no exit)
                    done = threads.submit(_timed, _p, up, prompt, dict(DRY_RUN_PARAMS))
                    (made, took), held = await _waited(done, stall_s, lambda: on_note(
                        f"the dry run waits for {_name} (stage {s.name}) on {_what}, {stall_s:g} s at most "
                        "(supervision.stall_timeout_s; --skip-dry-run: no dry run)"))
                    if held > silent_s:  # (trial CR: sum(range(5 * 10**8)) took a stage down for 5 minutes)
                        raise _Failure(path, f"{_name} held the Python interpreter for {held:.1f} s on {_what} of "
                                             f"the dry run's request ({request}), a call that keeps the GIL: a "
                                             "replica's heartbeats stop meanwhile, and one silent for "
                                             f"{missed_s:g} s (supervision.missed_heartbeats x "
                                             "heartbeat_interval_s) is taken for dead and replaced: the hold "
                                             "plus the time since its last heartbeat, up to an interval, so "
                                             f"over {silent_s:g} s may be (--skip-dry-run: not tried)")
                    if took > stall_s:
                        raise _ProcessorTimeout()
            except InvalidRequest as exc:  # (it refuses the dry run's request as a client's: the request's own)
                on_note(f"{_name} refused the dry run's request ({request}) as a client's (InvalidRequest: {exc}): "
                        f"stage {s.name} and those after it were not tried")
                raise _NoVerdict() from None
            except _ProcessorTimeout:
                raise _Failure(path, f"{_name} did not return within {stall_s:g} s (supervision.stall_timeout_s, "
                                     f"what a replica waits) on {_what} of the dry run's request ({request}): a "
                                     f"processor runs for every request through stage {s.name} and must be quick "
                                     "(--skip-dry-run: not tried)") from None
            except _Failure:
                raise
            except Exception as exc:  # noqa: BLE001 - what a request like it would meet
                raise _Failure(path, f"{_name} fails on {_what} of the dry run's request ({request}), as it would "
                                     f"for such a request through stage {s.name} (--skip-dry-run: not tried): "
                                     f"{type(exc).__name__}: {exc}{read_only_hint(exc)}") from None
            if not isinstance(made, dict):
                raise _Failure(path, f"{_name} returns {type(made).__name__} on {_what}, not a dict (the stage's "
                                     "engine input)")
            return made

        if src is not None:
            pieces = [await process({src: _read_only(c)}) for c in chunks.get(src, [])]
            task_input, stream = {}, _aiter(pieces)
        else:
            task_input, stream = await process(upstream), None
        # (only a Thinker reads max_tokens; a stage's own default, if smaller, as a request gets it)
        sampling = {**s.default_sampling_params,
                    "max_tokens": min(s.default_sampling_params.get("max_tokens", DRY_RUN_MAX_TOKENS),
                                      DRY_RUN_MAX_TOKENS)}
        task = BackendTask(f"dry-run-{s.name}", task_input, sampling, dict(DRY_RUN_PARAMS),
                           input_stream=stream, emit_chunks=True, chunk_tokens=cfg.deployment.streaming.chunk_tokens)

        async def run_engine(engine=engine, task=task, name=name, kind=kind, kind_path=kind_path,
                             from_what=from_what, stage=s.name) -> tuple[list, Any]:
            await engine.start()
            made: list[dict[str, Any]] = []
            final = None
            try:
                async for ev in engine.generate(task):
                    if isinstance(ev, OutputChunk):
                        made.append(ev.outputs)
                    elif isinstance(ev, StageFinal):
                        final = ev
            except StageInputError as exc:  # (what the stage before makes: every request's)
                raise _Failure(kind_path, f"stage {stage}'s synthetic `{kind}` engine cannot take what {name} "
                                          f"makes of {from_what}, as for every request through it: {exc}") from None
            except Exception:  # noqa: BLE001 - the request's own (a context too small for this prompt): no verdict
                final = None
            finally:
                await engine.shutdown()
            return made, final

        began = loop.time()
        try:
            made, final = await asyncio.wait_for(run_engine(), max(engine_s, 0.0))
        finally:
            engine_s -= loop.time() - began
        if final is not None:
            finals[s.stage_id], chunks[s.stage_id] = final.outputs, made


def _timed(fn: Callable, *args: Any) -> tuple[Any, float]:
    """``fn(*args)`` and the seconds it took."""
    import time

    began = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - began


def _read_only(outputs: dict[str, Any]) -> dict[str, Any]:
    """``outputs`` with read-only views of its arrays, as a replica's processor gets them from
    the connectors (trial CQ: a processor that scaled an input array in place passed the dry
    run, then failed every request with "output array is read-only")."""
    import numpy as np

    out = {}
    for key, value in outputs.items():
        if isinstance(value, np.ndarray):
            value = value.view()
            value.flags.writeable = False
        out[key] = value
    return out


def _names(cfg: PipelineConfig, upstream: dict) -> list[str]:
    by_id = {s.stage_id: s.name for s in cfg.stage_args}
    return [by_id[sid] for sid in sorted(upstream)]


async def _aiter(items: list):
    for item in items:
        yield item
