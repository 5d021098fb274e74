"""The stage graph of a vLLM-Omni deploy file, which the file itself does not hold.

vLLM-Omni keeps it in Python: a ``PipelineConfig`` of ``StagePipelineConfig``
entries in the model's ``pipeline.py``, registered by key in
``vllm_omni/config/pipeline_registry.py``. Here it comes from, in order: the
config's ``topology`` block (that ``PipelineConfig`` written as YAML); the
registered pipeline that the deploy file's ``pipeline`` key names; the one
whose default deploy file has the name of the loaded file or of one of its
``base_config`` files; the one registered under the loaded file's stem. The
last three import ``vllm_omni`` (about 15 s on 2 cores).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from omni_actors.config import ConfigError, _convert

__all__ = ["PASSED_ON", "PIPELINE_EXTRA", "TopologyStage", "Topology", "resolve_topology"]

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Name = Annotated[str, msgspec.Meta(min_length=1)]


class TopologyStage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One stage of the topology: the fields of vLLM-Omni's
    ``StagePipelineConfig`` that serving a stage here needs."""

    stage_id: NonNegInt
    model_stage: Name
    execution_type: Literal["llm_ar", "llm_generation", "diffusion"] = "llm_ar"
    input_sources: list[NonNegInt] = []
    final_output: bool = False
    final_output_type: str | None = None
    owns_tokenizer: bool = False
    requires_multimodal_data: bool = False
    requires_full_payload_input: bool = False
    hf_config_name: str | None = None
    engine_output_type: str | None = None
    model_arch: str | None = None
    model_subdir: str | None = None
    tokenizer_subdir: str | None = None
    omni_kv_config: dict[str, Any] | None = None
    sampling_constraints: dict[str, Any] = {}
    custom_process_input_func: str | None = None
    sync_process_input_func: str | None = None
    custom_process_next_stage_input_func: str | None = None
    async_chunk_process_next_stage_input_func: str | None = None
    # The rest of ``StagePipelineConfig``: handed on to the stage's own (one-stage) pipeline
    # as they are (:data:`PASSED_ON`; a review: registry pipelines lost them, IndexTTS2's
    # `extras`, Ming-Image's `model_path_resolver`, VoxCPM2's `scheduler_cls`...)
    retains_state_across_chunks: bool = False
    supports_native_mrv2_data_plane: bool = False
    prompt_transform_func: str | None = None
    prompt_expand_func: str | None = None
    cfg_kv_collect_func: str | None = None
    stage_input_payload_keys: list[str] = []
    stage_output_payload_keys: list[str] = []
    scheduler_cls: str | None = None
    model_path_resolver: str | None = None
    inline_diffusion: bool = False
    extras: dict[str, Any] = {}


#: The ``engine_args`` key that carries :data:`PASSED_ON` fields (a mapping) to the stage's replicas.
PIPELINE_EXTRA = "vllm_omni_pipeline"
#: The :class:`TopologyStage` fields handed on to a stage's pipeline (``StagePipelineConfig``)
#: as they are, under the stage's ``engine_args.vllm_omni_pipeline`` (not vLLM engine arguments:
#: ``scheduler_cls`` is one of vLLM's too, with another meaning).
PASSED_ON = ("retains_state_across_chunks", "supports_native_mrv2_data_plane", "prompt_transform_func",
             "prompt_expand_func", "cfg_kv_collect_func", "stage_input_payload_keys", "stage_output_payload_keys",
             "scheduler_cls", "model_path_resolver", "inline_diffusion", "extras")


class Topology(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The ``topology`` block: vLLM-Omni's ``PipelineConfig`` written as YAML."""

    model_arch: str | None = None
    stages: list[TopologyStage]


def resolve_topology(data: dict[str, Any], merged: dict[str, Any], files: list[str],
                     source: str) -> tuple[Topology, str | None]:
    """The stage graph of the config ``data`` (``merged``: its deploy file with
    the ``base_config`` chain, ``files``: that chain), and the registry key it
    came from (None: the ``topology`` block).

    Raises:
        ConfigError: at ``topology`` (or ``pipeline``, when the file names one)
            saying what to add when no topology can be found.
    """
    if "topology" in data:
        topo = _convert(data["topology"], Topology, source, "topology")
        seen: set[int] = set()
        for i, ts in enumerate(topo.stages):  # (a review: a copied stage's id hid the stage it copied)
            if ts.stage_id in seen:
                raise ConfigError(source, f"topology.stages[{i}].stage_id",
                                  f"{ts.stage_id} is the id of an earlier stage: each stage needs its own")
            seen.add(ts.stage_id)
        return topo, None
    key = merged.get("pipeline")
    where = "pipeline" if key else "topology"
    wanted = (f"vLLM-Omni pipeline `{key}`" if key else
              "the vLLM-Omni pipeline whose default deploy file is "
              + " or ".join(f"`{Path(f).name}`" for f in files))
    if importlib.util.find_spec("vllm_omni") is None:
        raise ConfigError(source, where, f"a deploy file has no stage graph: add a `topology:` "
                          f"block, or install vllm-omni here so that {wanted} gives it")
    try:
        registry = importlib.import_module("vllm_omni.config.pipeline_registry")
        stage_config = importlib.import_module("vllm_omni.config.stage_config")
    except Exception as exc:  # noqa: BLE001 - e.g. a torchvision built for another torch
        raise ConfigError(source, where, f"vllm_omni cannot be imported here "
                          f"({type(exc).__name__}: {' '.join(str(exc).split())}), so {wanted} "
                          f"cannot give the stage graph: add a `topology:` block") from None
    table, cls = registry.OMNI_PIPELINES, stage_config.PipelineConfig
    if key:
        entry = table.get(key)
        found = [entry] if isinstance(entry, cls) else [
            p for p in _registered(table, cls) if p.model_type == key]
    else:
        names = {Path(f).name for f in files}
        found = [p for p in _registered(table, cls) if p.default_deploy_config_name in names]
        stem = Path(source).stem
        if not found and isinstance(table.get(stem), cls):
            found = [table[stem]]  # a file named after its pipeline's key
    if len(found) != 1:
        known = ", ".join(sorted(table))
        if key:
            why = f"{wanted} is not registered here (registered: {known})"
        else:
            why = (f"no registered pipeline has `{Path(source).name}` (or a base of it) as its "
                   f"default deploy file nor `{Path(source).stem}` as its key: add a "
                   f"`pipeline:` key naming one (registered: {known})") if not found else (
                   f"more than one registered pipeline has `{Path(source).name}` as its "
                   f"default deploy file: add a `pipeline:` key naming one")
        raise ConfigError(source, where, f"{why}, or a `topology:` block")
    pipe = found[0]
    stages = []
    for ps in pipe.stages:
        fields = {f: getattr(ps, f) for f in TopologyStage.__struct_fields__ if hasattr(ps, f)}
        fields["execution_type"] = getattr(ps.execution_type, "value", ps.execution_type)
        stages.append(fields)
    topo = _convert({"model_arch": pipe.model_arch or None, "stages": stages}, Topology, source,
                    "pipeline")
    return topo, key or pipe.model_type


def _registered(table: dict[str, Any], cls: type) -> list[Any]:
    """Every pipeline the registry holds, the ones behind resolvers (which need
    the model's HF config to choose) included: those in the resolver's module."""
    seen: dict[int, Any] = {}
    for entry in table.values():
        if isinstance(entry, cls):
            seen[id(entry)] = entry
        else:
            module = sys.modules.get(getattr(entry, "__module__", ""))
            for obj in vars(module).values() if module else ():
                if isinstance(obj, cls):
                    seen[id(obj)] = obj
    return list(seen.values())
