"""Pipeline and deployment specs: loading and validation.

A config file has two parts:

- ``stage_args``: the stage graph in vLLM-Omni's own stage-config terms
  (``stage_id``, ``engine_args.model_stage``, ``engine_input_source``,
  ``custom_process_input_func``, ``final_output``, ``final_output_type``,
  ``default_sampling_params``, ``runtime.devices``). Fields we do not use are
  kept in ``engine_args`` and otherwise ignored, so vLLM-Omni's shipped stage
  YAMLs load unchanged.
- ``deployment``: how the graph is served: replicas and backend per stage,
  heartbeat interval, timeouts, load-balancing policy.

Every error raised is a :class:`ConfigError` naming the file, the YAML path
of the bad field (for example ``deployment.stages.talker.replicas``) and what
was expected. Durations are finite and bounded per field (a ``.inf`` or a huge
timeout would overflow or hang a timer later), counts that make processes
too (``replicas``: at most 1024). A stage key that is not known but is close
to one that is (``final_ouput``) is kept as vLLM-Omni keeps it and reported as
a warning (see :func:`omni_actors.config_keys.unknown_key_warnings`).
"""

from __future__ import annotations

import codecs
import contextvars
import difflib
import os
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml

from omni_actors.config_keys import unknown_key_warnings

__all__ = [
    "ConfigError",
    "StageSpec",
    "SyntheticCost",
    "StageDeployment",
    "Deployment",
    "PipelineConfig",
    "OmniConnectors",
    "StageConnector",
    "load_config",
    "parse_config",
    "DEFAULT_CONFIG",
]

#: The default config of ``python -m omni_actors.system start``.
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "cpu_omni_demo.yaml"

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


def _count(top: int) -> Any:
    """An integer from 1 to ``top``, whose out-of-range error names both bounds."""
    return Annotated[int, msgspec.Meta(ge=1, le=top, extra={"unit": "integer"})]

# Bounded numbers. ``extra["unit"]`` marks a field whose out-of-range error is
# rewritten to name both bounds and the value given (see ``_bounds_message``);
# NaN and infinities fail the bounds. Durations are bounded because every one
# ends up in a timer (``wakeupAfter``, ``asyncio.wait_for``), where ``inf``
# raises OverflowError and a huge value never fires.
_DAY_S = 86400
_HOUR_S = 3600
#: A timeout: more than 0 s, at most a day (a large model can take hours to load).
Timeout = Annotated[float, msgspec.Meta(gt=0, le=_DAY_S, extra={"unit": "seconds", "max": "a day"})]
#: A wait that may be 0 (no wait): 0 s to a day.
Wait = Annotated[float, msgspec.Meta(ge=0, le=_DAY_S, extra={"unit": "seconds", "max": "a day"})]
#: The heartbeat interval: 0.1 s to 10 minutes (a lost replica or host
#: is noticed after a few intervals).
#: (At least 0.1 s: each beat is an actor message per replica, about 1 ms of CPU; a trial's 0.001 s
#: swamped the pools until the coordinator stopped answering and the leader never served.)
HeartbeatInterval = Annotated[float, msgspec.Meta(ge=0.1, le=600, extra={"unit": "seconds", "max": "10 minutes"})]
#: A restart backoff or a simulated start-up time: 0 s to an hour.
UpToAnHour = Annotated[float, msgspec.Meta(ge=0, le=_HOUR_S, extra={"unit": "seconds", "max": "an hour"})]
#: Simulated time per token: 0 to 60000 ms (a minute).
MsPerToken = Annotated[float, msgspec.Meta(ge=0, le=60_000, extra={"unit": "milliseconds", "max": "a minute"})]
#: Replicas of a stage, or devices of one replica: 1 to 1024 (each replica is a process).
MAX_REPLICAS = 1024
Replicas = Annotated[int, msgspec.Meta(ge=1, le=MAX_REPLICAS, extra={"unit": "integer"})]
OutputType = Literal["text", "audio", "image"]
#: How engines store their stage outputs: ``omni_actors.connectors.MODES``.
ConnectorMode = Literal["auto", "inline", "shm", "tcp"]


class ConfigError(ValueError):
    """A config that cannot be served. ``str()`` is one line:
    ``FILE: PATH: what is wrong``."""

    def __init__(self, source: str, path: str, message: str):
        self.source = source
        self.path = path
        self.message = message
        super().__init__(f"{source}: {path or '<top>'}: {message}")


class RuntimeSpec(msgspec.Struct, kw_only=True):
    """vLLM-Omni's ``runtime`` block; only ``devices`` is read (a GPU id list
    such as ``"0"`` or ``"0,1"``: non-negative integers, none twice; made its
    canonical string at load), the rest is kept for the vLLM-Omni backend."""

    devices: str | int | list[int] | None = None
    process: bool | None = None
    max_batch_size: int | None = None


class StageSpec(msgspec.Struct, kw_only=True):
    """One ``stage_args`` entry, as vLLM-Omni writes it."""

    stage_id: Annotated[int, msgspec.Meta(ge=0)]
    engine_args: dict[str, Any]
    engine_input_source: list[int] = []
    custom_process_input_func: str | None = None
    final_output: bool = False
    final_output_type: OutputType | None = None
    default_sampling_params: dict[str, Any] = {}
    runtime: RuntimeSpec = msgspec.field(default_factory=RuntimeSpec)

    @property
    def name(self) -> str:
        """The stage's name: ``engine_args.model_stage`` (``thinker``, ``talker``...)."""
        return str(self.engine_args["model_stage"])


#: The least seed the synthetic engine takes (a request's, or a stage's default).
SEED_MIN = -(2 ** 63)


class SyntheticCost(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Cost model of the synthetic engine (all times are simulated with
    ``asyncio.sleep``; defaults are zero cost)."""

    startup_s: UpToAnHour = 0.0
    prefill_ms_per_token: MsPerToken = 0.0
    decode_ms_per_token: MsPerToken = 0.0
    max_concurrency: _count(4096) = 8
    #: Thinker / AR: the context length in tokens (whitespace-separated words), as vLLM's
    #: ``max_model_len``: a longer prompt fails with a 400 (an AR prompt must leave room for its
    #: image tokens), and a Thinker stops there (``finish_reason`` length), as vLLM's engine does.
    #: 32768 as Qwen3-Omni's Thinker's. (A 512,000-word prompt took a demo Thinker 100 s.)
    #: (The sizes below have upper bounds, far above any real model's: a code review's
    #: `hidden_size: 100000000000` passed, and the first request asked for that many floats.)
    max_model_len: _count(1 << 20) = 32768
    #: Thinker hidden size (columns of the hidden-state tensor).
    hidden_size: _count(65536) = 64
    #: Talker codec: frames per thinker token and codebooks per frame.
    frames_per_token: _count(64) = 2
    num_codebooks: _count(64) = 8
    codebook_size: _count(1 << 20) = 2048
    #: Code2Wav: samples per codec frame at 24 kHz (80 ms, 12.5 Hz codec).
    samples_per_frame: _count(96000) = 1920
    #: AR: prior tokens per image side (tokens = side * side).
    prior_grid: _count(1024) = 16
    #: Which synthetic behaviour to run (thinker, talker, code2wav, ar, dit);
    #: default: the stage name. Lets two stages of one graph share one.
    kind: str | None = None
    #: For tests: spend ``startup_s`` blocking the engine's loop, as a vLLM engine's start does.
    startup_blocks: bool = False
    #: Fault injection for tests: fail start-up with this message.
    fail_startup: str | None = None
    #: Fault injection for tests, a "poison" request: the replica's process exits at once
    #: (``os._exit(70)``, as a segfault would end it) when a task's prompt contains this text.
    crash_on: str | None = None


class StageDeployment(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """How one stage is deployed."""

    replicas: Replicas = 1
    backend: Literal["synthetic", "vllm", "vllm_omni"] = "synthetic"
    #: devices each replica takes on one node (its tensor-parallel size); ignored on CPU nodes
    devices_per_replica: Replicas = 1
    #: nodes this stage may run on (placement rule); empty: any node that accepts it
    nodes: list[Annotated[str, msgspec.Meta(min_length=1)]] = []  # (not "": a node that never joins)
    #: CPU cores its engines compute on, a Linux CPU list ("1", "0-3", "0,2"): what pinned
    #: devices are on a GPU node. vLLM backend on a CPU build: the engine core process
    #: runs there with one OpenMP thread per core (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``
    #: binds only its multiprocess workers), and the replica's own threads move off those
    #: CPUs. Empty (default): not pinned, vLLM's threads.
    cpus: str | int = ""  # (a bare number in YAML, e.g. cpus: 3, is one CPU; made a str at load)
    synthetic: SyntheticCost = msgspec.field(default_factory=SyntheticCost)


class RestartSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Restart intensity (Erlang/OTP style): backoff doubling from
    ``initial_backoff_s`` to ``max_backoff_s``; more than ``max_restarts`` in
    ``window_s`` and the replica goes FAILED (a pool: its replicas do), to be
    tried again after ``failed_retry_s``. Bounds: backoffs up to an hour, the window
    and ``failed_retry_s`` up to a day, ``max_restarts`` up to 1000."""

    initial_backoff_s: UpToAnHour = 0.5
    max_backoff_s: UpToAnHour = 8.0
    #: at most 1000: the backoff doubles per restart (2 ** 1024 overflows a float)
    max_restarts: Annotated[int, msgspec.Meta(ge=0, le=1000, extra={"unit": "integer"})] = 5
    window_s: Timeout = 60.0
    #: a FAILED replica (restarts used up, or it never loaded) is tried once more after this
    #: long, and again every as long (0: never). 300 s: Kubernetes caps CrashLoopBackOff at 5 min.
    failed_retry_s: Wait = 300.0


class Supervision(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Health and restart rules (see ``omni_actors.actors.supervision``).

    Defaults: 3 missed heartbeats (Ray Serve marks a replica unhealthy after 3
    failed checks); stall after 10 s without progress; circuit breaker after 5
    failures in a row (SGLang's gateway opens after 5); a task tried on at
    most 3 replicas (moves off replicas that were lost, drained or refused it
    do not count, see ``messages.MAX_TASK_MOVES``); a task waits up to 30 s for a ready replica of its stage
    before the request gets 503; drain on shutdown up to 10 s; a task that was
    running on 2 replicas that died (process exited, engine died, or killed
    as stalled; not silent ones, which may be a lost host) is failed with a
    500, not sent to a third: one death can be the replica's own (a kill),
    two in a row point at the request
    (a "poison" input that crashes the engine), which would otherwise take
    replica after replica down and use up their restart budgets.

    Bounds: ``stall_timeout_s``, ``queue_timeout_s`` and ``drain_timeout_s`` up
    to a day; ``missed_heartbeats`` up to 100.
    """

    #: at most 100 (times ``heartbeat_interval_s``: how long a silent replica is waited for)
    missed_heartbeats: Annotated[int, msgspec.Meta(ge=1, le=100, extra={"unit": "integer"})] = 3
    stall_timeout_s: Timeout = 10.0
    circuit_breaker_failures: _count(1000) = 5
    max_task_attempts: _count(100) = 3
    max_task_crashes: _count(100) = 2
    queue_timeout_s: Wait = 30.0
    drain_timeout_s: Wait = 10.0
    restart: RestartSpec = msgspec.field(default_factory=RestartSpec)


class Streaming(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Streaming between stages (the ``deployment.streaming`` block).

    When ``enabled``, an edge whose two stages both support chunks streams:
    the producer sends its outputs in chunks as it makes them and the
    consumer starts on the first one (see ``omni_actors.engines.stream_edges``
    for which stages do; other edges pass whole outputs). Defaults: off;
    ``chunk_tokens`` 8 Thinker tokens per chunk; at most
    ``max_buffered_chunks`` 16 chunks per edge produced and not yet consumed
    (the producer waits: backpressure); a consumer that gets no chunk for
    ``chunk_timeout_s`` 10 s fails with an error naming the upstream stage.
    """

    enabled: bool = False
    chunk_tokens: Annotated[int, msgspec.Meta(ge=1, le=65536)] = 8
    max_buffered_chunks: Annotated[int, msgspec.Meta(ge=2, le=4096)] = 16
    chunk_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=_HOUR_S,
                                                   extra={"unit": "seconds", "max": "an hour"})] = 10.0


class Deployment(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The deployment block. Defaults: heartbeat 1 s (issue 4); ready timeout
    60 s; request timeout 300 s; 64 KiB inline threshold as vLLM-Omni's;
    connector ``auto``. Bounds: heartbeat interval up to 10 minutes, ready and
    request timeouts up to a day, ``request_actors`` up to 1024 (each a process).

    ``connector`` is how every engine stores its stage outputs (see
    ``omni_actors.connectors.MODES``): ``auto`` inline up to
    ``inline_threshold_bytes``, else a shared-memory segment read in place on
    its node and fetched from the node's data service elsewhere; ``inline``
    always inline; ``shm`` always a segment; ``tcp`` as ``auto`` but every
    reader fetches segments through the data service. With ``auto``, a
    process's ``$OMNI_ACTORS_CONNECTOR`` (where set) picks its mode.
    """

    served_model_name: Annotated[str, msgspec.Meta(min_length=1)]
    heartbeat_interval_s: HeartbeatInterval = 1.0
    ready_timeout_s: Timeout = 60.0
    request_timeout_s: Timeout = 300.0
    #: at most 1,048,576 (a million-token context, the largest vLLM serves)
    max_tokens_limit: _count(1 << 20) = 4096
    load_balancing: Literal["least_loaded"] = "least_loaded"
    #: at most 64 MiB: what is under it rides in actor messages (10 MB took 0.5 s there)
    inline_threshold_bytes: Annotated[int, msgspec.Meta(ge=0, le=64 << 20, extra={"unit": "integer"})] = 64 * 1024
    connector: ConnectorMode = "auto"
    #: the most RequestActors (each a process) an API server keeps: requests above wait in a
    #: bounded queue, then get 429 (``omni_actors.http.admission``)
    request_actors: Replicas = 16
    supervision: Supervision = msgspec.field(default_factory=Supervision)
    streaming: Streaming = msgspec.field(default_factory=Streaming)
    stages: dict[str, StageDeployment] = {}


class StageConnector(msgspec.Struct, kw_only=True):
    """What a vLLM-Omni connector setting made of one producing stage's puts."""

    #: the inline threshold its engines use (``shm_threshold_bytes``); None: the deployment's
    inline_threshold_bytes: int | None = None
    #: ``{name, extra}``: the vLLM-Omni connector its engines put outputs over the
    #: threshold through (where ``vllm_omni`` is importable in the engine); None: ours
    omni: dict[str, Any] | None = None
    #: the settings it came from (YAML paths)
    origin: list[str] = []


class OmniConnectors(msgspec.Struct, kw_only=True):
    """vLLM-Omni's connector settings in a ``stage_args`` config, and what was made of them.

    vLLM-Omni's legacy stage configs name connectors in a top-level
    ``runtime`` block (``connectors``: name -> ``{name, extra}``; ``edges``:
    ``{from, to, window_size, max_inflight}``) and per stage in
    ``input_connectors`` (``from_stage_N``) / ``output_connectors``
    (``to_stage_N``): a connector name of ``runtime.connectors`` or an inline
    ``{name, extra}``. All of it is checked and kept. ``SharedMemoryConnector``
    has an equivalent here (ours: inline up to its ``shm_threshold_bytes``,
    default 64 KiB, a shared-memory segment above), so its threshold is applied
    to the producing stage. Another connector (``MooncakeStoreConnector``,
    ``YuanrongConnector``) is applied where ``vllm_omni`` is importable in the
    process that loads the config (and ``deployment.connector`` is ``auto``):
    the producing stage's engines put their outputs over the inline threshold
    through vLLM-Omni's own connector (:mod:`omni_actors.connectors.omni`; an
    engine without ``vllm_omni`` uses ours and logs so). Not applied, the edge
    using ours: any connector without ``vllm_omni`` here, and vLLM-Omni's
    transfer engines (Mooncake/Mori transfer engine, NIXL), which need sender
    and receiver roles per stage replica. ``notes`` says what was and was not
    applied, one line each.
    """

    connectors: dict[str, Any] = {}
    edges: list[Any] = []
    #: ``"FROM->TO"`` -> the connector class a stage names for that edge
    by_edge: dict[str, str] = {}
    #: producing stage name -> what was applied to its engines
    applied: dict[str, StageConnector] = {}
    notes: list[str] = []


class PipelineConfig(msgspec.Struct, kw_only=True):
    """A whole config: the stage graph plus its deployment."""

    stage_args: list[StageSpec]
    deployment: Deployment
    source: str = "<memory>"
    #: vLLM-Omni's connector settings (legacy ``runtime`` / ``input_connectors`` / ``output_connectors``)
    omni_connectors: OmniConnectors = msgspec.field(default_factory=OmniConnectors)

    # -- derived views ---------------------------------------------------
    def stage(self, stage_id: int) -> StageSpec:
        for s in self.stage_args:
            if s.stage_id == stage_id:
                return s
        raise KeyError(stage_id)

    def stage_by_name(self, name: str) -> StageSpec:
        for s in self.stage_args:
            if s.name == name:
                return s
        raise KeyError(name)

    def deployment_of(self, stage: StageSpec) -> StageDeployment:
        return self.deployment.stages.get(stage.name) or StageDeployment()

    def output_types(self) -> set[str]:
        """Final output types this pipeline can produce."""
        return {s.final_output_type for s in self.stage_args if s.final_output}

    def runner_handover_stages(self) -> list[StageSpec]:
        """The vllm_omni stages that take their input through vLLM-Omni's model-runner
        hand-over (``engine_args.requires_full_payload_input``, with upstream stages:
        Qwen3-Omni's Talker and Code2Wav). That payload (the Thinker's hidden states and
        embeddings) is sent by vLLM-Omni's own connector between the stage engines of one
        pipeline, which does not reach another replica's engine: their processors build
        only placeholder prompts, so requests that need these stages are refused
        (:func:`omni_actors.planning.plan_request`) rather than run on empty payloads."""
        return [s for s in self.stage_args
                if s.engine_input_source and s.engine_args.get("requires_full_payload_input") is True
                and self.deployment_of(s).backend == "vllm_omni"]

    def consumers(self, stage_id: int) -> list[int]:
        return [s.stage_id for s in self.stage_args if stage_id in s.engine_input_source]

    def connector_mode_of(self, stage: StageSpec) -> str | None:
        """The connector mode of ``stage``'s engines: ``deployment.connector``;
        for ``auto``, an ``omni:`` mode where a vLLM-Omni connector is applied
        to its outputs or to those of a stage it reads (see :class:`OmniConnectors`),
        else None (each process's default: ``$OMNI_ACTORS_CONNECTOR``, else auto)."""
        mode = self.deployment.connector
        if mode != "auto":
            return mode
        applied = self.omni_connectors.applied
        own = applied.get(stage.name)
        mine = own.omni if own is not None else None
        inputs: dict[tuple[str, str], tuple[str, dict[str, Any]]] = {}
        for sid in stage.engine_input_source:
            src = applied.get(self.stage(sid).name)
            if src is not None and src.omni is not None:
                name, extra = src.omni["name"], src.omni.get("extra") or {}
                inputs.setdefault((name, repr(sorted(extra.items()))), (name, extra))
        if mine is None and not inputs:
            return None
        from omni_actors.connectors.omni import encode_mode

        return encode_mode(mine["name"] if mine else None, mine.get("extra") if mine else None,
                           stage=stage.stage_id, inputs=inputs.values())

    def inline_threshold_of(self, stage: StageSpec) -> int:
        """The inline threshold of ``stage``'s engines: a vLLM-Omni
        ``SharedMemoryConnector``'s ``shm_threshold_bytes`` on its output
        edges, else ``deployment.inline_threshold_bytes``."""
        applied = self.omni_connectors.applied.get(stage.name)
        if applied is not None and applied.inline_threshold_bytes is not None:
            return applied.inline_threshold_bytes
        return self.deployment.inline_threshold_bytes


# -- loading -------------------------------------------------------------

_PATH_RE = re.compile(r"at `\$(.*)`")
#: msgspec's form for a mapping key of the wrong type: "... - at `key` in `$.a.b`"
_KEY_RE = re.compile(r"at `key` in `\$(.*)`")


def _yaml_path(raw: str) -> str:
    """msgspec's ``$.a[0].b`` -> ``a[0].b``."""
    return raw[1:] if raw.startswith(".") else raw


def _type_at(typ: Any, path: str) -> Any:
    """The declared type at a msgspec error path (``a[0].b``), or None."""
    for part in path.replace("]", "").replace("[", ".").split("."):
        if not part:
            continue
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if len(args) == 1 and typing.get_origin(args[0]) is dict:  # (an optional mapping)
            typ, args = args[0], list(typing.get_args(args[0]))
        if typing.get_origin(typ) is dict and len(args) == 2:  # a mapping's value, by its key
            typ = args[1]
            continue
        if part.isdigit() and args:  # list item
            typ = args[0]
            continue
        if isinstance(typ, type) and issubclass(typ, msgspec.Struct):
            fields = {f.encode_name: f.type for f in msgspec.structs.fields(typ)}
            if part not in fields:
                return None
            typ = fields[part]
        else:
            return None
    return typ


_MISSING = object()


def _value_at(obj: Any, path: str) -> Any:
    """The value at a msgspec error path (``a[0].b``) of a decoded document, or ``_MISSING``."""
    for part in path.replace("]", "").replace("[", ".").split("."):
        if not part:
            continue
        if isinstance(obj, dict) and part in obj:
            obj = obj[part]
        elif isinstance(obj, list) and part.isdigit() and int(part) < len(obj):
            obj = obj[int(part)]
        else:
            return _MISSING
    return obj


#: msgspec's messages for a number out of a field's bounds (not for a wrong type).
_OUT_OF_BOUNDS = re.compile(r"Expected `(int|float)` [<>]=? |Number out of range|Integer value out of range")


def _show(value: Any) -> str:
    """A value as an error message shows it: a number as ``inf``, ``nan``, ``1e+30``; a
    string quoted (``'60s'``), cut at 60 characters."""
    if isinstance(value, str):
        return repr(value if len(value) <= 60 else value[:57] + "...")
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** 15:
        return f"about 10^{len(str(abs(value))) - 1}" if value > 0 else f"about -10^{len(str(-value)) - 1}"
    return str(value)


def _bounds_message(typ: Any, value: Any) -> str | None:
    """``must be a finite number of seconds > 0 and <= 86400 (a day), got inf`` for a
    field typed with bounds and ``extra["unit"]`` (or such a type or None); None for any other field."""
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        typ = next((a for a in typing.get_args(typ) if typing.get_origin(a) is Annotated), typ)
    if typing.get_origin(typ) is not Annotated:
        return None
    base, *metas = typing.get_args(typ)
    meta = next((m for m in metas if isinstance(m, msgspec.Meta) and m.extra and "unit" in m.extra), None)
    if meta is None:
        return None
    low = f"> {meta.gt}" if meta.gt is not None else f">= {meta.ge}"
    high = f"<= {meta.le}" + (f" ({meta.extra['max']})" if "max" in meta.extra else "")
    what = "an integer" if base is int else f"a finite number of {meta.extra['unit']}"
    got = "" if value is _MISSING else f", got {_show(value)}"
    return f"must be {what} {low} and {high}{got}"


def _expected(typ: Any, path: str, message: str, obj: Any = _MISSING) -> tuple[str, str]:
    """Add to msgspec's message what was expected (unknown field, enum value, bounds)."""
    if _OUT_OF_BOUNDS.match(message):
        value = _value_at(obj, path) if obj is not _MISSING else obj
        better = _bounds_message(_type_at(typ, path), value)
        if better is not None:
            return path, better
        if value is not _MISSING:  # (a field without a unit: msgspec's bound, and what was given)
            return path, f"{message}, got {_show(value)}"
    m = re.match(r"Object missing required field `(.*)`$", message)
    if m:  # (named by its own path, as every other error is: trial BA read `deployment: Object ...`)
        return (f"{path}.{m.group(1)}" if path else m.group(1)), "required field is missing"
    m = re.match(r"Expected `(.*)`, got `(.*)`$", message)
    if m and obj is not _MISSING and _value_at(obj, path) is not _MISSING:
        # what was given, and what is wanted where the field says (trial BA: `request_timeout_s: 60s`
        # read only "Expected `float`, got `str`")
        value = _value_at(obj, path)
        if isinstance(value, (str, int, float)):
            better = _bounds_message(_type_at(typ, path), value)
            return path, (better if better is not None else f"{message}: {_show(value)}")
    m = re.match(r"Object contains unknown field `(.*)`", message)
    if m:
        t = _type_at(typ, path)
        names = [f.encode_name for f in msgspec.structs.fields(t)] if isinstance(t, type) and issubclass(
            t, msgspec.Struct) else []
        field = m.group(1)
        near = difflib.get_close_matches(field, names, n=1)
        known = (f" (did you mean `{near[0]}`?)" if near else "") + (
            f"; expected one of: {', '.join(names)}" if names else "")
        return (f"{path}.{field}" if path else field), f"unknown field `{field}`{known}"
    if message.startswith("Invalid enum value"):
        t = _type_at(typ, path)
        lits = [a for a in (t, *typing.get_args(t)) if typing.get_origin(a) is Literal]
        if lits:
            message += f"; expected one of: {', '.join(map(str, typing.get_args(lits[0])))}"
    return path, message


def _named_keys(obj: Any, typ: type, path: str) -> str:
    """``path`` with each ``[...]`` (msgspec's word for a mapping's key) replaced by the key
    of the entry that fails: the first whose mapping, cut down to it alone, still fails to
    convert (a review read `platforms[...]` and `input_connectors[...].bogus`). Left as it
    is where that cannot be told."""
    while "[...]" in path:
        head, tail = path.split("[...]", 1)
        mapping = _value_at(obj, head)
        if not isinstance(mapping, dict):
            return path
        parts = [p for p in head.replace("]", "").replace("[", ".").split(".") if p]
        for key in mapping:
            try:
                msgspec.convert(_with_value(obj, parts, {key: mapping[key]}), typ)
            except msgspec.ValidationError as exc:
                m = _PATH_RE.search(str(exc))
                if m and _yaml_path(m.group(1)) == path:  # (the same error: not another one further on)
                    path = f"{head}.{key}{tail}" if head else f"{key}{tail}"
                    break
        else:
            return path
    return path


def _with_value(obj: Any, parts: list[str], value: Any) -> Any:
    """A copy of ``obj`` with ``value`` at ``parts`` (copied along the way only)."""
    if not parts:
        return value
    if isinstance(obj, list):
        i = int(parts[0])
        return [*obj[:i], _with_value(obj[i], parts[1:], value), *obj[i + 1:]]
    return {**obj, parts[0]: _with_value(obj[parts[0]], parts[1:], value)}


def _convert(obj: Any, typ: type, source: str, prefix: str = "") -> Any:
    try:
        return msgspec.convert(obj, typ)
    except msgspec.ValidationError as exc:
        text = str(exc)
        key = _KEY_RE.search(text)
        if key:  # (a key of the wrong type: it read `<top>` and msgspec's own words; a code review)
            path = _yaml_path(key.group(1))
            message = "its keys must be strings, one is not: " + _KEY_RE.sub("", text).strip(" -").replace(
                "Expected `str`, got", "got a key of type")
        else:
            m = _PATH_RE.search(text)
            path = _named_keys(obj, typ, _yaml_path(m.group(1))) if m else ""
            path, message = _expected(typ, path, _PATH_RE.sub("", text).strip(" -"), obj)
        if prefix:
            path = prefix + ("." + path if path and not path.startswith("[") else path)
        raise ConfigError(source, path, message) from None


#: True while a deploy-format file is converted: its inner ``parse_config`` call sees
#: generated ``stage_args``, whose keys the outer call has already checked in the file.
_CONVERTING = contextvars.ContextVar("omni_actors_config_converting", default=False)


def parse_config(data: Any, source: str = "<memory>",
                 on_warning: typing.Callable[[str], None] | None = None) -> PipelineConfig:
    """Validate a decoded YAML document.

    Warnings (:func:`~omni_actors.config_keys.unknown_key_warnings`, one line each, ``FILE: PATH: message``)
    go to ``on_warning``; by default each is logged as a structlog
    ``config_unknown_key`` warning. They come before any error, which they may explain.

    Raises:
        ConfigError: naming the YAML path of the first bad field.
    """
    if not isinstance(data, dict):
        raise ConfigError(source, "", "expected a mapping with `stage_args` and `deployment`")

    def warn(path: str, message: str) -> None:
        if on_warning is not None:
            on_warning(f"{source}: {path}: {message}")
        else:
            from omni_actors.logs import get_logger

            get_logger().warning("config_unknown_key", config=source, path=path, message=message)
    if not _CONVERTING.get():
        for path, message in unknown_key_warnings(data):
            warn(path, message)
    if "stages" in data or "base_config" in data or (
            "stage_args" not in data and ("topology" in data or "pipeline" in data)):
        # vLLM-Omni's deploy format (a `stages:` list; the topology elsewhere).
        from omni_actors.vllm_omni_deploy import parse_deploy_config

        token = _CONVERTING.set(True)
        try:
            return parse_deploy_config(data, source)
        finally:
            _CONVERTING.reset(token)
    if "stage_args" not in data:
        raise ConfigError(source, "stage_args", "required field is missing: the stage graph, as a `stage_args` "
                                                "list (vLLM-Omni's stage configs) or in vLLM-Omni's deploy format "
                                                "(a `stages:` list with a `topology:` block or a `pipeline:` key)")
    if "deployment" not in data:
        raise ConfigError(source, "deployment", "required field is missing")
    deployment = data["deployment"]
    stages = deployment.get("stages") if isinstance(deployment, dict) else None
    counts, kept = ({}, []) if _CONVERTING.get() else _vllm_omni_stage_keys(data, stages, source)
    if isinstance(stages, dict):
        # One entry at a time, so an error names the stage (msgspec writes dict keys as `[...]`).
        deployment = {**deployment, "stages": {
            str(name): msgspec.to_builtins(_convert(entry, StageDeployment, source, f"deployment.stages.{name}"))
            for name, entry in stages.items()}}
    if counts and isinstance(deployment, dict) and isinstance(deployment.get("stages", {}), dict):
        ours = dict(deployment.get("stages") or {})
        for name, n in counts.items():
            entry = ours.get(name, {})
            ours[name] = {**entry, "replicas": n} if isinstance(entry, dict) else entry  # (entry: with defaults)
        deployment = {**deployment, "stages": ours}
    cfg = _convert({"stage_args": data["stage_args"], "deployment": deployment}, PipelineConfig, source)
    cfg.source = source
    from omni_actors.config_checks import _check_cpus, _check_graph, _note_runner_handover  # (they need the types above)

    _check_graph(cfg, source)
    from omni_actors.connector_config import omni_connectors  # (it needs the types above)

    cfg.omni_connectors = omni_connectors(data, cfg, source)
    cfg.omni_connectors.notes[:0] = kept
    _check_cpus(cfg, source)
    _note_runner_handover(cfg)
    if not _CONVERTING.get():
        for path, message in _unlisted_model_warnings(cfg, stages if isinstance(stages, dict) else {}):
            warn(path, message)
        for path, message in _replica_count_warnings(cfg):
            warn(path, message)
        for path, message in _unreachable_audio_warnings(cfg):
            warn(path, message)
    return cfg


def _vllm_omni_stage_keys(data: dict, ours: Any, source: str) -> tuple[dict[str, int], list[str]]:
    """What a ``stage_args`` config sets in vLLM-Omni's keys that this project reads
    elsewhere or not at all (trial CH: each passed in silence):

    - a stage's ``runtime.num_replicas`` is its replica count where
      ``deployment.stages.<stage>.replicas`` (``ours``, raw) is not given, as a deploy
      file's ``num_replicas`` is; where both are and differ, ours is used;
    - the top-level ``env``, a stage's ``runtime.env`` and ``async_chunk: true`` are not
      applied.

    Returns:
        ``({stage name: replicas}, notes)``: the counts to fill in, one note per key above.

    Raises:
        ConfigError: a ``num_replicas`` that is not an integer from 1 to :data:`MAX_REPLICAS`.
    """
    counts: dict[str, int] = {}
    notes: list[str] = []
    entries = data.get("stage_args")
    for i, entry in enumerate(entries if isinstance(entries, list) else []):
        runtime = entry.get("runtime") if isinstance(entry, dict) else None
        engine = entry.get("engine_args") if isinstance(entry, dict) else None
        name = engine.get("model_stage") if isinstance(engine, dict) else None
        if not isinstance(runtime, dict) or name is None:
            continue  # (the conversion names what is wrong)
        n = runtime.get("num_replicas")
        if n is not None:
            path = f"stage_args[{i}].runtime.num_replicas"
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_REPLICAS:
                raise ConfigError(source, path, f"expected an integer from 1 to {MAX_REPLICAS}, got `{_show(n)}`")
            mine = ours.get(str(name)) if isinstance(ours, dict) else None
            given = mine.get("replicas") if isinstance(mine, dict) else None
            if given is None:
                counts[str(name)] = n
                notes.append(f"{path} ({n}): applied as deployment.stages.{name}.replicas")
            elif given != n:
                notes.append(f"deployment.stages.{name}.replicas ({_show(given)}) is used, not {path} ({n})")
        if runtime.get("env") is not None:
            notes.append(f"stage_args[{i}].runtime.env: not applied: set the variables in the environment of "
                         "the processes that start the stage's replicas")
    if data.get("env") is not None:
        notes.append("env: not applied: set the variables in the environment of the processes that start "
                     "the replicas")
    if data.get("async_chunk") is True:
        notes.append("async_chunk: true: not applied: stages hand over whole outputs, or stream where "
                     "`deployment.streaming` says")
    return counts, notes


#: Replicas in all per CPU of this host above which a config is warned about (each replica
#: is a process of its own; 16 per CPU is far past anything that serves well).
REPLICAS_PER_CPU_WARNING = 16


def _replica_count_warnings(cfg: PipelineConfig, cpus: int | None = None) -> list[tuple[str, str]]:
    """``(YAML path, message)`` when the config asks for more replicas in all than
    :data:`REPLICAS_PER_CPU_WARNING` per CPU of this host (``cpus``, default
    ``os.cpu_count()``). Not an error: members add hosts, and devices bound each host's share.
    (A trial's 1,000 Diffusion replicas on 2 CPUs passed `check-config`, then were not ready
    after 110 s, with 16 GB in use.)"""
    cpus = cpus or os.cpu_count() or 1
    counts = {s.name: cfg.deployment_of(s).replicas for s in cfg.stage_args}
    total = sum(counts.values())
    if total <= REPLICAS_PER_CPU_WARNING * cpus:
        return []
    most = max(counts, key=counts.get)
    return [(f"deployment.stages.{most}.replicas",
             f"{total} replicas in all ({most}: {counts[most]}), each a process with its own engine: a host of "
             f"{cpus} CPU(s) like this one that runs them all takes minutes to start them and may run out of "
             f"memory (more than {REPLICAS_PER_CPU_WARNING} per CPU); member hosts share them out")]


def _unreachable_audio_warnings(cfg: PipelineConfig) -> list[tuple[str, str]]:
    """``(YAML path, message)`` for a final audio stage with no final text stage: audio is
    served by chat completions only, whose reply has a text, so no request reaches it (trial
    CQ: a Thinker made no final text, its Talker branch ran idle and every chat got a 400).
    A warning, not an error: vLLM-Omni ships such pipelines (text-to-audio), which load."""
    finals = {s.final_output_type: i for i, s in enumerate(cfg.stage_args) if s.final_output}
    if "audio" not in finals or "text" in finals:
        return []
    k = finals["audio"]
    return [(f"stage_args[{k}].final_output_type",
             f"`audio` with no final `text` stage: this server serves audio only in chat completions, whose "
             f"reply carries a text, so no request reaches stage {cfg.stage_args[k].name} (or those before it "
             "that feed only it): make the stage that writes the reply's text final_output: true, "
             "final_output_type: text")]


def _unlisted_model_warnings(cfg: PipelineConfig, listed: dict) -> list[tuple[str, str]]:
    """``(YAML path, message)`` for each stage that names a real model
    (``engine_args.model``, not ``synthetic/...``) but has no ``deployment.stages``
    entry: it runs the default backend, the synthetic engine, and the model is never
    loaded (a trial left the Thinker out of a vLLM config: `check-config` said ok, and
    the pipeline would have served made-up text)."""
    out = []
    for stage in cfg.stage_args:
        model = stage.engine_args.get("model")
        if stage.name in listed or not isinstance(model, str) or model.startswith("synthetic/"):
            continue
        out.append((f"deployment.stages.{stage.name}",
                    f"missing: stage {stage.name} runs the synthetic engine, and its model {model!r} "
                    "(stage_args engine_args.model) is not loaded; give it `backend: vllm` or `vllm_omni`"))
    return out


def load_config(path: str | Path, on_warning: typing.Callable[[str], None] | None = None) -> PipelineConfig:
    """Load and validate a config file (``on_warning``: as :func:`parse_config`'s).

    Raises:
        ConfigError: file missing, not YAML, or a field is invalid.
    """
    source = str(path)
    data = read_yaml(Path(path), source, "", "cannot read config")
    if data is None:  # (it said "expected a mapping ...": trial Y)
        raise ConfigError(source, "", "the file is empty, or holds only comments (expected a mapping with "
                                      "`stage_args` and `deployment`)")
    return parse_config(data, source, on_warning)


def read_yaml(path: Path, source: str, field: str, cannot: str) -> Any:
    """The YAML document in file ``path`` (a config, or a deploy file's ``base_config``).

    Raises:
        ConfigError: the file cannot be read (``source``, ``field``: "<cannot>: <why>"),
            is neither UTF-8 nor UTF-16 with its BOM, is not valid YAML, has a key twice,
            or is nested too deeply for the parser (each naming ``path`` and the line).
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(source, field, f"{cannot}: {exc.strerror}") from None
    where = str(path)
    text = _decode(raw, where)
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as exc:
        raise ConfigError(where, f"line {exc.line}", f"duplicate key `{exc.key}`") from None
    except yaml.reader.ReaderError as exc:  # (no mark: it was two lines with no line number; a review)
        line = text.count("\n", 0, exc.position) + 1
        code = ord(exc.character) if isinstance(exc.character, str) else exc.character
        raise ConfigError(where, f"line {line}", f"not valid YAML: character U+{code:04X} is not allowed "
                          "(YAML allows no control character but tab and line breaks)") from None
    except yaml.YAMLError as exc:
        mark, context = getattr(exc, "problem_mark", None), getattr(exc, "context_mark", None)
        line = f"line {mark.line + 1}" if mark is not None else ""
        problem = f"not valid YAML: {getattr(exc, 'problem', exc)}"
        # (trial BT: PyYAML finds a mistake where the parse fails, often the line after it:
        # an unclosed `[0` was reported on the next line, a key with no colon too)
        if context is not None and mark is not None and context.line != mark.line and getattr(exc, "context", None):
            problem += f" ({exc.context} from line {context.line + 1})"
        if getattr(exc, "problem", "") == "mapping values are not allowed here":
            problem += " (a key above with no colon after it? a value with `: ` in it, not quoted?)"
        raise ConfigError(where, line, problem) from None
    except RecursionError:  # (thousands of nested `[`: a traceback; a code review)
        raise ConfigError(where, "", "not valid YAML here: nested too deeply") from None


def _decode(raw: bytes, source: str) -> str:
    """A config file's text: UTF-8 (a BOM allowed), or UTF-16 with its BOM, as YAML allows.

    Raises:
        ConfigError: other bytes (the line of the first one that does not decode)."""
    encoding = "utf-16" if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)) else "utf-8-sig"
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(source, f"line {line}", f"not {encoding.upper().removesuffix('-SIG')} text: "
                          f"byte {exc.start} ({raw[exc.start:exc.start + 1]!r}): {exc.reason}") from None


class _DuplicateKey(Exception):
    def __init__(self, key: str, line: int):
        self.key, self.line = key, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, except that a key given twice in one mapping is an
    error (plain YAML keeps the last one silently), and that ``1e3`` is a float as
    in YAML 1.2 (PyYAML follows YAML 1.1, where it is the string "1e3")."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # (`<<: *common`: merged below, its keys
                continue  # overridden by the mapping's own; it was "could not determine a constructor")
            key = self.construct_object(key_node, deep=deep)
            try:
                hash(key)
            except TypeError:  # (a complex key, `? [a, b]`: it was a traceback; a code review)
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"a key must be a plain value, not a {type(key).__name__}", key_node.start_mark) from None
            if key in seen:
                raise _DuplicateKey(str(key), key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _no_yaml11_number(loader: yaml.SafeLoader, node, construct):
    """A YAML int or float, except YAML 1.1's base-60 (``1:30`` read as 90) and leading-zero
    octal (``010`` read as 8) forms, which YAML 1.2 has not: a code review's ``cpus: 010``
    pinned CPU 8. Refused, with how to write it."""
    value = loader.construct_scalar(node).replace("_", "")
    bare = value.lstrip("+-")
    if ":" in bare or (len(bare) > 1 and bare[0] == "0" and bare[1].isdigit()):
        raise yaml.constructor.ConstructorError(
            None, None, f"`{value}` is a YAML 1.1 {'base-60' if ':' in bare else 'octal'} number, which reads "
                        f"as {construct(loader, node)!r}: write the number you mean, or quote it for a string",
            node.start_mark)
    return construct(loader, node)


_UniqueKeyLoader.add_constructor(
    "tag:yaml.org,2002:int", lambda loader, node: _no_yaml11_number(loader, node, yaml.SafeLoader.construct_yaml_int))
_UniqueKeyLoader.add_constructor(
    "tag:yaml.org,2002:float",
    lambda loader, node: _no_yaml11_number(loader, node, yaml.SafeLoader.construct_yaml_float))

_UniqueKeyLoader.add_implicit_resolver(  # (YAML 1.2's float: the exponent's sign and the dot are optional)
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))
