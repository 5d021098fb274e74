"""vLLM-Omni's deploy format (``stages:`` with ``num_replicas``) as a config.

Since vLLM-Omni's config refactor (PR #2383, spring 2026; its legacy
``stage_args`` loader went in August 2026, PR #6200; 0.30.0 ships only this
format, in ``vllm_omni/deploy/*.yaml``, and refuses ``stage_args``) a model is
described in two parts:

- the **topology**, frozen in Python: a ``PipelineConfig`` of
  ``StagePipelineConfig`` entries in the model's ``pipeline.py``
  (``model_stage``, ``execution_type``, ``input_sources``, ``final_output``,
  ``final_output_type``, input processors...), registered by key in
  ``vllm_omni/config/pipeline_registry.py``;
- the **deploy file**, YAML: pipeline-wide engine settings (``dtype``,
  ``trust_remote_code``...), ``async_chunk``, named ``connectors`` and
  ``edges``, per-platform overlays (``platforms``), an optional
  ``base_config`` to inherit from, the registry key (``pipeline``), and a
  ``stages`` list of per-stage knobs by ``stage_id``: ``devices``,
  ``num_replicas``, ``env``, ``input_connectors`` / ``output_connectors``,
  ``default_sampling_params`` and any engine argument, flat or under
  ``engine_args`` / ``engine_extras`` (``devices``, ``num_replicas`` and
  ``env`` may also sit under ``runtime``).

A config file here is such a deploy file, unchanged, plus our keys beside it:
``deployment`` (required, as in every config), ``topology`` (the stage graph,
for when vLLM-Omni's registry is not at hand) and ``model`` (the checkpoint for
every stage that names none; vLLM-Omni takes it from the command line). Where
the topology comes from: :mod:`omni_actors.vllm_omni_deploy.topology`; how the
file and its ``base_config`` chain are read: :mod:`omni_actors.vllm_omni_deploy.files`.

:func:`parse_deploy_config` turns the pair into our :class:`PipelineConfig`
(a :class:`DeployPipelineConfig`, which also keeps the vLLM-Omni settings that
have no ``stage_args`` equivalent, in :class:`VllmOmniDeploy`):

- each topology stage becomes a ``stage_args`` entry: ``engine_args`` holds
  ``model_stage``, ``model``, the topology's engine-facing fields
  (``model_arch``, ``worker_type`` or ``stage_type: diffusion``,
  ``hf_config_name``, ``engine_output_type``...), the pipeline-wide settings
  and the stage's own engine arguments (the stage's win);
  ``engine_input_source`` is ``input_sources``; ``runtime.devices`` is
  ``devices``; ``default_sampling_params`` are the stage's with the
  topology's ``sampling_constraints`` on top, as vLLM-Omni merges them;
- processors are the whole-output ones (``sync_process_input_func`` before
  ``custom_process_input_func``; ``custom_process_next_stage_input_func``),
  because stages hand over whole outputs here: ``async_chunk`` is kept, not
  applied;
- ``deployment.stages.<name>`` gets, where our block does not say otherwise:
  ``replicas`` from ``num_replicas``, ``backend: vllm_omni``, and
  ``devices_per_replica`` from ``tensor_parallel_size`` x
  ``pipeline_parallel_size`` x ``data_parallel_size`` when over 1;
- ``connectors``, ``edges``, ``input_connectors`` / ``output_connectors``
  (each a connector name or an inline ``{name, extra}``), ``env`` and
  ``platforms`` are checked for shape and kept in ``config.vllm_omni``;
  the connector settings are then mapped as a legacy config's
  (``config.omni_connectors``, see :class:`~omni_actors.config.OmniConnectors`:
  notes name this file's paths); ``env`` and platform overlays are not applied;
- a ``stages`` entry (or connector key, or edge) naming a ``stage_id`` the
  topology lacks is refused (vLLM-Omni skips such a stage entry silently).

Errors are :class:`~omni_actors.config.ConfigError` naming the file and the
YAML path in it (``stages[1].num_replicas``, ``topology.stages[0].model_stage``),
or ``pipeline`` for a topology from vLLM-Omni's registry.
"""

from __future__ import annotations

import re
from typing import Any, Callable

import msgspec

from omni_actors.config import MAX_REPLICAS, ConfigError, OmniConnectors, PipelineConfig, _convert, parse_config
from omni_actors.connector_config import omni_connectors
from omni_actors.placement import is_device_template, parse_devices
from omni_actors.vllm_omni_deploy.files import (ConnectorSpec, Edge, check_connectors, deep_merge,
                                                resolve)
from omni_actors.vllm_omni_deploy.topology import PASSED_ON, PIPELINE_EXTRA, Topology, TopologyStage, resolve_topology

__all__ = ["ConnectorSpec", "Edge", "TopologyStage", "Topology", "StageDeploySettings",
           "VllmOmniDeploy", "DeployPipelineConfig", "is_deploy_format", "parse_deploy_config"]

#: Deploy-file settings vLLM-Omni applies to every stage's engine.
PIPELINE_WIDE = ("trust_remote_code", "distributed_executor_backend", "dtype", "quantization",
                 "enable_prefix_caching", "enable_chunked_prefill", "data_parallel_size",
                 "pipeline_parallel_size", "custom_voice_dir")
#: Stage keys that are not engine arguments.
_STAGE_OWN = frozenset({"stage_id", "devices", "num_replicas", "env", "async_chunk",
                        "input_connectors", "output_connectors", "default_sampling_params",
                        "default_pooling_params", "engine_args", "engine_extras", "runtime"})


class StageDeploySettings(msgspec.Struct, kw_only=True):
    """What a deploy file says about one stage beyond its engine arguments."""

    stage_id: int
    num_replicas: int | None = None
    devices: str | None = None
    env: dict[str, Any] | None = None
    async_chunk: bool | None = None
    input_connectors: dict[str, str | ConnectorSpec] = {}
    output_connectors: dict[str, str | ConnectorSpec] = {}


class VllmOmniDeploy(msgspec.Struct, kw_only=True):
    """The vLLM-Omni deploy settings a config keeps (not applied here)."""

    #: the registry key the topology came from; None: the file's ``topology`` block
    pipeline: str | None = None
    #: the deploy files read, the loaded file last (its ``base_config`` chain before it)
    files: list[str] = []
    async_chunk: bool = True
    connectors: dict[str, ConnectorSpec] = {}
    edges: list[Edge] = []
    #: by stage name
    stages: dict[str, StageDeploySettings] = {}
    platforms: dict[str, Any] = {}
    #: the other top-level keys (``session_mode``, ``model_runner``, ``duplex_session``...)
    settings: dict[str, Any] = {}


class DeployPipelineConfig(PipelineConfig, kw_only=True):
    """A :class:`PipelineConfig` loaded from a vLLM-Omni deploy file."""

    vllm_omni: VllmOmniDeploy = msgspec.field(default_factory=VllmOmniDeploy)


# -- loading ----------------------------------------------------------------


def is_deploy_format(data: Any) -> bool:
    """Whether a decoded config is in vLLM-Omni's deploy format."""
    return isinstance(data, dict) and ("stages" in data or "base_config" in data)


def parse_deploy_config(data: dict[str, Any], source: str = "<memory>") -> DeployPipelineConfig:
    """Validate a decoded deploy-format config (a deploy file plus ``deployment``).

    ``base_config`` is read relative to ``source``'s folder (the working
    folder for ``<memory>``), then, for a bare file name, from the installed
    ``vllm_omni/deploy``.

    Raises:
        ConfigError: naming the file and YAML path of the first bad field.
    """
    if "stage_args" in data:
        raise ConfigError(source, "stage_args", "a config has either `stage_args` (vLLM-Omni's "
                          "legacy stage configs) or `stages` (its deploy format), not both")
    if "deployment" not in data:
        raise ConfigError(source, "deployment", "required field is missing")
    files: list[str] = []
    merged, origin = resolve(data, source, files, chain=(source,))
    topo, key = resolve_topology(data, merged, files, source)
    by_id = {s.stage_id: s for s in topo.stages}
    for sid, (src, i) in origin.items():
        if sid not in by_id:
            raise ConfigError(src, f"stages[{i}].stage_id",
                              f"no stage {sid} in the topology; its stages: {sorted(by_id)}")
    for name, spec in (merged.get("connectors") or {}).items():
        _convert(spec, ConnectorSpec, source, f"connectors.{name}")
    check_connectors(merged, origin, by_id, source)

    if merged.get("env") is not None and not isinstance(merged["env"], dict):  # (kept, not applied: still checked)
        raise ConfigError(source, "env", f"expected a mapping, got `{merged['env']!r}`")
    model = data.get("model")
    if model is not None and (not isinstance(model, str) or not model.strip()):  # (a trial's `model: 5` passed)
        raise ConfigError(source, "model", f"expected a model id or path (a non-empty string), got `{model!r}`")
    stages = {int(s["stage_id"]): s for s in merged.get("stages") or []}
    _check_stop_tokens(topo, key, stages, origin, source)
    stage_args = [_stage_args(ts, topo, stages.get(ts.stage_id, {}), merged, data.get("model"))
                  for ts in topo.stages]
    deployment = _deployment(data.get("deployment"), topo, stages, merged, origin, source)
    try:
        cfg = parse_config({"stage_args": stage_args, "deployment": deployment}, source)
    except ConfigError as exc:
        raise _where(exc, topo, key, origin, stages, merged) from None
    notes = cfg.omni_connectors.notes  # (parse_config's, such as cpus not applied: a review saw them dropped)
    cfg.omni_connectors = _connectors(merged, stages, topo, origin, cfg, source)
    cfg.omni_connectors.notes = (notes + cfg.omni_connectors.notes
                                 + _replica_notes(data.get("deployment"), topo, stages, origin)
                                 + _kept_notes(merged, stages, origin))

    names = {ts.stage_id: ts.model_stage for ts in topo.stages}
    kept = VllmOmniDeploy(
        pipeline=key, files=files,
        async_chunk=bool(merged.get("async_chunk", True)),
        connectors=_convert(merged.get("connectors") or {}, dict[str, ConnectorSpec], source),
        edges=_convert(merged.get("edges") or [], list[Edge], source),
        stages={names[sid]: _settings(sid, s, source) for sid, s in stages.items()},
        platforms=merged.get("platforms") or {},
        settings={k: v for k, v in merged.items()
                  if k not in ("async_chunk", "connectors", "edges", "stages", "platforms")
                  and k not in PIPELINE_WIDE})
    return DeployPipelineConfig(**msgspec.structs.asdict(cfg), vllm_omni=kept)


# -- conversion -------------------------------------------------------------


def _connectors(merged: dict[str, Any], stages: dict[int, dict[str, Any]], topo: Topology,
                origin: dict[int, tuple[str, int]], cfg: PipelineConfig, source: str) -> OmniConnectors:
    """The file's ``connectors`` / ``edges`` / ``input_connectors`` / ``output_connectors``
    mapped as a legacy config's are (:class:`~omni_actors.config.OmniConnectors`), its notes
    and errors naming the deploy file's paths."""
    fields = ("input_connectors", "output_connectors")
    per_stage = [{f: stages.get(ts.stage_id, {}).get(f) or {} for f in fields} for ts in topo.stages]
    runtime = {"connectors": merged.get("connectors") or {}, "edges": merged.get("edges") or []}
    if not (runtime["connectors"] or runtime["edges"]):
        runtime = None

    def ours(text: str) -> str:
        def stage(m: re.Match) -> str:
            return f"stages[{origin.get(topo.stages[int(m.group(1))].stage_id, (source, '?'))[1]}]"
        text = re.sub(r"stage_args\[(\d+)\]", stage, text)
        return re.sub(r"\bruntime\.(connectors|edges)", r"\1", text)

    try:
        found = omni_connectors({"runtime": runtime, "stage_args": per_stage}, cfg, source)
    except ConfigError as exc:
        raise ConfigError(exc.source, ours(exc.path), ours(exc.message)) from None
    found.notes = [ours(n) for n in found.notes]
    return found



def _stage_args(ts: TopologyStage, topo: Topology, stage: dict[str, Any],
                merged: dict[str, Any], model: Any) -> dict[str, Any]:
    engine: dict[str, Any] = {"model_stage": ts.model_stage}
    if model is not None:
        engine["model"] = model
    arch = ts.model_arch or topo.model_arch
    if arch:
        engine["model_arch"] = arch
    if ts.execution_type == "diffusion":
        engine["stage_type"] = "diffusion"
    else:
        engine["worker_type"] = "generation" if ts.execution_type == "llm_generation" else "ar"
    for f in ("hf_config_name", "engine_output_type", "model_subdir", "tokenizer_subdir",
              "omni_kv_config", "custom_process_next_stage_input_func"):
        if getattr(ts, f) is not None:
            engine[f] = getattr(ts, f)
    passed = {f: getattr(ts, f) for f in PASSED_ON if getattr(ts, f) not in (None, False, [], {})}
    if passed:
        engine[PIPELINE_EXTRA] = passed
    for f, name in (("requires_multimodal_data", "requires_multimodal_data"),
                    ("requires_full_payload_input", "requires_full_payload_input"),
                    ("owns_tokenizer", "is_comprehension")):
        if getattr(ts, f):
            engine[name] = True
    engine.update({k: merged[k] for k in PIPELINE_WIDE if merged.get(k) is not None})
    engine.update(_engine_args(stage))
    mine = stage.get("default_sampling_params") or {}
    must = ts.sampling_constraints
    sampling = {**mine, **must}
    if "stop_token_ids" in must:  # the topology's stop tokens join the stage's
        sampling["stop_token_ids"] = list(dict.fromkeys([*(mine.get("stop_token_ids") or []),
                                                         *(must["stop_token_ids"] or [])]))
    entry: dict[str, Any] = {
        "stage_id": ts.stage_id, "engine_args": engine,
        "engine_input_source": list(ts.input_sources),
        "custom_process_input_func": ts.sync_process_input_func or ts.custom_process_input_func,
        "final_output": ts.final_output, "final_output_type": ts.final_output_type,
        "default_sampling_params": sampling}
    devices = _own(stage, "devices")
    if devices is not None:
        entry["runtime"] = {"devices": str(devices)}
    return entry


def _engine_args(stage: dict[str, Any]) -> dict[str, Any]:
    """A stage entry's engine arguments as vLLM-Omni reads them: the flat keys,
    then ``engine_args`` over them, both over ``engine_extras``."""
    flat = deep_merge({k: v for k, v in stage.items() if k not in _STAGE_OWN},
                      stage.get("engine_args") or {})
    return deep_merge(stage.get("engine_extras") or {}, flat)


def _own(stage: dict[str, Any], key: str) -> Any:
    """``devices``, ``num_replicas``, ``env``: under ``runtime`` first, as vLLM-Omni reads them."""
    runtime = stage.get("runtime") or {}
    return runtime.get(key, stage.get(key))


def _replica_notes(raw: Any, topo: Topology, stages: dict[int, dict[str, Any]],
                   origin: dict[int, tuple[str, int]]) -> list[str]:
    """A note for each stage whose replica count our block sets and the deploy file's
    ``num_replicas`` sets otherwise (ours is used: a trial's 5 over 2 went unsaid)."""
    ours = raw.get("stages") if isinstance(raw, dict) else None
    notes = []
    for ts in topo.stages:
        entry = ours.get(ts.model_stage) if isinstance(ours, dict) else None
        theirs = _own(stages.get(ts.stage_id, {}), "num_replicas")
        if isinstance(entry, dict) and entry.get("replicas") is not None and theirs is not None \
                and entry["replicas"] != theirs:
            notes.append(f"deployment.stages.{ts.model_stage}.replicas ({entry['replicas']}) is used, not "
                         f"stages[{origin.get(ts.stage_id, ('', '?'))[1]}].num_replicas ({theirs})")
    return notes


def _deployment(raw: Any, topo: Topology, stages: dict[int, dict[str, Any]],
                merged: dict[str, Any], origin: dict[int, tuple[str, int]], source: str) -> Any:
    """Our block, with what the deploy file says filled in where it is silent.

    Raises:
        ConfigError: a stage's engine arguments shard it over more devices than a replica
            may have (named at the stage: the block's ``devices_per_replica`` was not
            written by the user; a review)."""
    if not isinstance(raw, dict) or not isinstance(raw.get("stages", {}), dict):
        return raw  # parse_config names what is wrong
    ours = dict(raw.get("stages") or {})
    for ts in topo.stages:
        entry = ours.get(ts.model_stage, {})
        if not isinstance(entry, dict):
            continue
        stage = stages.get(ts.stage_id, {})
        filled = {"backend": "vllm_omni"}
        if _own(stage, "num_replicas") is not None:
            filled["replicas"] = _own(stage, "num_replicas")
        engine = _engine_args(stage)
        # (a trial's TP-2 DiT got one GPU of its two)
        size, how = engine_devices(lambda k: engine.get(k, merged.get(k)), ts.execution_type == "diffusion")
        if size > MAX_REPLICAS:
            src, at = origin.get(ts.stage_id, (source, None))
            raise ConfigError(src, f"stages[{at}]" if at is not None else "stages",
                              f"stage {ts.stage_id} `{ts.model_stage}`: its engine arguments shard it over {size} "
                              f"devices ({how}), more than a replica may have ({MAX_REPLICAS})")
        if size > 1:
            filled["devices_per_replica"] = size
        ours[ts.model_stage] = {**filled, **entry}
        _check_devices_split(stage, filled.get("devices_per_replica", 1), origin.get(ts.stage_id, (source, None)))
    return {**raw, "stages": ours}


def _kept_notes(merged: dict[str, Any], stages: dict[int, dict[str, Any]],
                origin: dict[int, tuple[str, int]]) -> list[str]:
    """Notes on what the file sets that is kept and not applied (trial CA read none: a
    CUDA overlay that fixes audio, and async chunks, dropped without a word; trial CH
    none for `env`, which the README said had one)."""
    notes = []
    if merged.get("env"):
        notes.append("env: kept, not applied: set the variables in the environment of the processes that "
                     "start the replicas")
    for sid, stage in sorted(stages.items()):
        if _own(stage, "env"):
            key = "runtime.env" if isinstance(stage.get("runtime"), dict) and "env" in stage["runtime"] else "env"
            notes.append(f"stages[{origin.get(sid, ('', '?'))[1]}].{key} (stage {sid}): kept, not applied: set "
                         "the variables in the environment of the processes that start the stage's replicas")
    platforms = merged.get("platforms")
    if isinstance(platforms, dict) and platforms:
        notes.append(f"platforms ({', '.join(sorted(map(str, platforms)))}): kept, not applied: copy what a "
                     "platform needs into its stages (for example `platforms.cuda`'s into `stages` on CUDA hosts)")
    if merged.get("async_chunk", True) is True and any(
            isinstance(s, dict) and s.get("stage_id") is not None for s in merged.get("stages") or []):
        notes.append("async_chunk: true: not applied: stages hand over whole outputs, or stream where "
                     "`deployment.streaming` says")
    return notes


def _check_devices_split(stage: dict[str, Any], per: int, where: tuple[str, Any]) -> None:
    """A stage's ``devices`` splits among its ``num_replicas`` (the file's) as vLLM-Omni
    requires (``split_devices_for_replicas``): with k > 1 replicas of ``per`` (P) devices,
    either P ids below P (a template) or k x P (one P each); a trial's ``"1,2,3"`` for 2
    replicas left GPU 3 out, and ``"1,2"`` for 3 put two on GPU 1, without a word, where
    vLLM-Omni refuses both.

    Raises:
        ConfigError: at the stage's ``devices``."""
    devices, replicas = _own(stage, "devices"), _own(stage, "num_replicas")
    if devices is None or not isinstance(replicas, int) or not isinstance(per, int) or replicas <= 1:
        return
    try:
        ids = parse_devices(str(devices))
    except ValueError:
        return  # (parse_config names it)
    if is_device_template(ids, per) or len(ids) == replicas * per:
        return
    src, at = where
    key = "runtime.devices" if isinstance(stage.get("runtime"), dict) and "devices" in stage["runtime"] else "devices"
    raise ConfigError(src, f"stages[{at}].{key}" if at is not None else "stages",
                      f"`{devices}` has {len(ids)} device id(s): {replicas} replicas of {per} device(s) each take "
                      f"either {per} id(s) below {per} (a template, each replica's offset by its place) or "
                      f"{replicas * per} (the next {per} each), as vLLM-Omni splits them (or start hosts with "
                      "--devices: placement gives each replica its own)")


def _check_stop_tokens(topo: Topology, key: str | None, stages: dict[int, dict[str, Any]],
                       origin: dict[int, tuple[str, int]], source: str) -> None:
    """The stage's ``default_sampling_params`` and the topology's ``stop_token_ids``, which are
    joined: a list of token ids each (a review's `stop_token_ids: 8294` was a TypeError, and
    `"8294"` the stop tokens 8, 2, 9 and 4).

    Raises:
        ConfigError: at the stage's or the topology's path."""
    for i, ts in enumerate(topo.stages):
        src, at = origin.get(ts.stage_id, (source, None))
        mine = stages.get(ts.stage_id, {}).get("default_sampling_params")  # (a mapping: checked before)
        where = [(src, f"stages[{at}].default_sampling_params", (mine or {}).get("stop_token_ids")),
                 (source, "pipeline" if key else f"topology.stages[{i}].sampling_constraints",
                  ts.sampling_constraints.get("stop_token_ids"))]
        for file, path, ids in where:
            if ids is not None and not (isinstance(ids, list) and all(_is_int(t) and t >= 0 for t in ids)):
                raise ConfigError(file, path if path == "pipeline" else f"{path}.stop_token_ids",
                                  f"expected a list of token ids (integers >= 0), got `{ids!r}`")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


#: The engine arguments whose product is an LLM stage's devices per replica (each data-parallel
#: rank is an engine of tensor x pipeline parallel devices).
PARALLEL_SIZES = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")


def engine_devices(arg: Callable[[str], Any], diffusion: bool) -> tuple[int, str]:
    """The devices one replica of a stage shards over, from its engine arguments (``arg(name)``:
    the value of one, or None), and how that is counted: a diffusion stage's
    :func:`diffusion_world_size`, else the product of :data:`PARALLEL_SIZES` (values that are
    not integers count as 1: the engine refuses them)."""
    if diffusion:
        return diffusion_world_size(arg("parallel_config")), "parallel_config's world size"
    size = 1
    for key in PARALLEL_SIZES:
        v = arg(key) or 1
        size *= v if _is_int(v) else 1
    return size, " x ".join(PARALLEL_SIZES)


def diffusion_world_size(parallel_config: Any) -> int:
    """The devices one replica of a diffusion stage takes: its ``parallel_config``'s world
    size, as vLLM-Omni's ``DiffusionParallelConfig`` computes it (pipeline x data x tensor x
    sequence x CFG parallel, the sequence degree ``allgather_degree`` if over 1, else
    ``ulysses_degree`` x ``ring_degree``; HSDP alone: ``hsdp_replicate_size`` x
    ``hsdp_shard_size``), or its ``world_size`` where it gives one. Not imported from
    vLLM-Omni: that import takes seconds, and configs load without it. 1 for none;
    values that are not positive integers count as 1 (the engine refuses them)."""
    if not isinstance(parallel_config, dict):
        return 1

    def deg(key: str) -> int:
        v = parallel_config.get(key)
        return v if _is_int(v) and v > 0 else 1
    if _is_int(parallel_config.get("world_size")):
        return deg("world_size")
    seq = parallel_config.get("sequence_parallel_size")
    seq = seq if _is_int(seq) and seq > 0 else (
        deg("allgather_degree") if deg("allgather_degree") > 1 else deg("ulysses_degree") * deg("ring_degree"))
    size = (deg("pipeline_parallel_size") * deg("data_parallel_size") * deg("tensor_parallel_size") * seq
            * deg("cfg_parallel_size"))
    shard = parallel_config.get("hsdp_shard_size")
    if size == 1 and parallel_config.get("use_hsdp") and _is_int(shard) and shard > 0:  # (-1: auto)
        return deg("hsdp_replicate_size") * shard
    return size


def _settings(sid: int, stage: dict[str, Any], source: str) -> StageDeploySettings:
    devices = _own(stage, "devices")
    return _convert({"stage_id": sid, "num_replicas": _own(stage, "num_replicas"),
                     "devices": None if devices is None else str(devices),
                     "env": _own(stage, "env"), "async_chunk": stage.get("async_chunk"),
                     "input_connectors": stage.get("input_connectors") or {},
                     "output_connectors": stage.get("output_connectors") or {}},
                    StageDeploySettings, source)


#: ``stage_args`` fields that come from the topology, and their names there.
_FROM_TOPOLOGY = {"stage_id": "stage_id", "engine_args.model_stage": "model_stage",
                  "engine_input_source": "input_sources", "final_output": "final_output",
                  "final_output_type": "final_output_type",
                  "custom_process_input_func": "custom_process_input_func"}


def _where(exc: ConfigError, topo: Topology, key: str | None, origin: dict[int, tuple[str, int]],
           stages: dict[int, dict[str, Any]], merged: dict[str, Any]) -> ConfigError:
    """An error about the converted ``stage_args`` told in the file's own terms: an engine
    argument where the file set it (the stage's ``engine_args``, its flat keys, its
    ``engine_extras``, or the top level for one that applies to every stage: a code review
    read a top-level `dtype` as `stages[0].dtype`, and `stages[0].engine_args.X` as
    `stages[0].X`)."""
    m = re.match(r"stage_args(?:\[(\d+)\])?\.?(.*)", exc.path)
    if m is None:
        return exc  # deployment.*: our block, same path
    index, rest = m.group(1), m.group(2)
    ts = topo.stages[int(index)] if index is not None else None
    if rest == "engine_args.model" and merged.get("model") is None and ts is not None \
            and "model" not in _engine_args(stages.get(ts.stage_id) or {}):
        # (no model anywhere: vLLM-Omni takes it from its command line, `vllm serve MODEL`)
        return ConfigError(exc.source, "model", f"required: stage {ts.model_stage} runs a real engine "
                           "(backend vllm_omni unless `deployment.stages` says otherwise) and the file names no "
                           "model (vLLM-Omni takes it from `vllm serve MODEL`): add a top-level "
                           "`model: <model id or directory>`")
    field = re.split(r"\[", rest, maxsplit=1)[0]
    param = rest.removeprefix("default_sampling_params.")
    # (a sampling constraint of the topology, which wins over the stage's own: a review's bad
    # constraint was blamed on the file's stage)
    constraint = (ts is not None and param != rest
                  and re.split(r"[.\[]", param, maxsplit=1)[0] in ts.sampling_constraints)
    if ts is None or field in _FROM_TOPOLOGY or constraint or not rest:  # (no field: the stage in the graph)
        if key is not None:  # from vLLM-Omni's registry: no YAML path to name
            stage = f", stage {ts.stage_id} `{ts.model_stage}`" if ts else ""
            return ConfigError(exc.source, "pipeline",
                               f"vLLM-Omni pipeline `{key}`{stage}: {exc.message}")
        if ts is None:
            return ConfigError(exc.source, "topology.stages", exc.message)
        there = _FROM_TOPOLOGY.get(field, field)
        if field == "custom_process_input_func" and ts.sync_process_input_func:
            there = "sync_process_input_func"  # the one chosen
        tail = f"sampling_constraints.{param}" if constraint else rest.replace(field, there, 1)
        # (trial CH: a stage that feeds none read "stages[1].:", the deploy stages' list, with a dot)
        return ConfigError(exc.source, f"topology.stages[{index}]" + (f".{tail}" if tail else ""), exc.message)
    stage = stages.get(ts.stage_id) or {}
    arg = rest.removeprefix("engine_args.")
    name = re.split(r"[.\[]", arg, maxsplit=1)[0]
    if rest.startswith("engine_args.") and name in PIPELINE_WIDE and name not in _engine_args(stage) \
            and merged.get(name) is not None:
        return ConfigError(exc.source, arg, exc.message)  # (set at the top level, for every stage)
    if ts.stage_id not in origin:
        return ConfigError(exc.source, f"topology.stages[{index}]", exc.message)
    src, i = origin[ts.stage_id]
    if rest.startswith("engine_args."):  # (which wins, as _engine_args merges them)
        def has(k: str) -> bool:
            return isinstance(stage.get(k), dict) and name in stage[k]
        within = "engine_args." if has("engine_args") else \
            "engine_extras." if has("engine_extras") and name not in stage else ""
        tail = within + arg
    else:
        under_runtime = isinstance(stage.get("runtime"), dict) and "devices" in stage["runtime"]
        tail = rest if under_runtime else rest.replace("runtime.devices", "devices")  # (as _own reads it)
    return ConfigError(src, f"stages[{i}].{tail}", exc.message)
