"""One vLLM-Omni deploy file: its shape, its ``base_config`` chain, its connectors.

The shape is checked file by file (so an error names the file and the YAML
path in it), then the chain is merged as vLLM-Omni merges it: top-level keys
of the overlay win; ``connectors`` are merged key by key; ``stages`` (and each
platform's ``stages``) are merged by ``stage_id``, an overlay's sampling
parameters and ``engine_args`` / ``engine_extras`` key by key, its other
fields replacing the base's. Keys other than the typed ones are kept as
written: vLLM-Omni passes unknown stage keys to the engine.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from omni_actors.config import ConfigError, Replicas, _convert, read_yaml

__all__ = ["ConnectorSpec", "Edge", "OUR_KEYS", "resolve", "check_connectors", "deep_merge"]

NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Name = Annotated[str, msgspec.Meta(min_length=1)]

#: Our keys beside a deploy file; read from the loaded file only, not from its bases.
OUR_KEYS = ("deployment", "topology", "model")
#: Stage keys whose mappings a ``base_config`` overlay merges key by key (others it replaces).
_MERGED_KEYS = frozenset({"default_sampling_params", "default_pooling_params",
                          "subtalker_sampling_params", "engine_args", "engine_extras"})
_CONNECTOR_KEY = {"input_connectors": re.compile(r"from_stage_(\d+)"),
                  "output_connectors": re.compile(r"to_stage_(\d+)")}


class ConnectorSpec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A connector: vLLM-Omni's connector class name and its settings."""

    name: Name
    extra: dict[str, Any] = {}


class _ConnectorPart(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A connector as one file of a ``base_config`` chain may write it (in part)."""

    name: Name | None = None
    extra: dict[str, Any] = {}


class Edge(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """An ``edges`` entry: a stage-to-stage edge and its flow-control window."""

    from_stage: NonNegInt = msgspec.field(name="from")
    to_stage: NonNegInt = msgspec.field(name="to")
    window_size: int = -1
    max_inflight: PositiveInt = 1


class _StageRuntime(msgspec.Struct, kw_only=True):
    devices: str | int | None = None
    num_replicas: Replicas | None = None  # (1 to 1024, as deployment.stages.*.replicas)
    env: dict[str, Any] | None = None


class _Stage(msgspec.Struct, kw_only=True):
    """The typed part of a ``stages`` entry (other keys are engine arguments)."""

    stage_id: NonNegInt
    devices: str | int | None = None
    num_replicas: Replicas | None = None  # (1 to 1024, as deployment.stages.*.replicas)
    env: dict[str, Any] | None = None
    async_chunk: bool | None = None
    input_connectors: dict[str, str | ConnectorSpec] | None = None
    output_connectors: dict[str, str | ConnectorSpec] | None = None
    default_sampling_params: dict[str, Any] | None = None
    default_pooling_params: dict[str, Any] | None = None
    engine_args: dict[str, Any] | None = None
    engine_extras: dict[str, Any] | None = None
    runtime: _StageRuntime | None = None
    tensor_parallel_size: PositiveInt | None = None


class _PlatformStage(msgspec.Struct, kw_only=True):
    stage_id: NonNegInt


class _Platform(msgspec.Struct, kw_only=True):
    model_runner: Literal["v1", "v2"] | None = None
    stages: list[_PlatformStage] = []


class _File(msgspec.Struct, kw_only=True):
    """The typed top level of a deploy file (other keys are kept as written)."""

    base_config: Name | None = None
    pipeline: Name | None = None
    async_chunk: bool | None = None
    session_mode: str | None = None
    model_runner: Literal["v1", "v2"] | None = None
    connectors: dict[str, Any] | None = None
    edges: list[Edge] | None = None
    stages: list[Any] | None = None
    platforms: dict[str, _Platform] | None = None
    trust_remote_code: bool | None = None
    distributed_executor_backend: str | None = None
    dtype: str | None = None
    quantization: str | None = None
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    data_parallel_size: PositiveInt | None = None
    pipeline_parallel_size: PositiveInt | None = None


def _read(path: Path, source: str) -> Any:
    """(A base file is read as the config itself: UTF-16 with its BOM too, and a file
    that is neither, or nested too deeply, is a one-line error, not a traceback.)"""
    return read_yaml(path, source, "base_config", f"cannot read `{path}`")


def _base_path(name: str, source: str) -> Path:
    """``base_config`` relative to the file naming it (as vLLM-Omni reads it), or
    else, for a bare file name, one of the installed vllm-omni's shipped files."""
    here = Path(source).parent if source != "<memory>" else Path.cwd()
    path = here / name
    if path.exists() or "/" in name:
        return path
    spec = importlib.util.find_spec("vllm_omni")  # finds the package without importing it
    if spec is not None and spec.submodule_search_locations:
        shipped = Path(list(spec.submodule_search_locations)[0]) / "deploy" / name
        if shipped.exists():
            return shipped
    return path


def resolve(data: dict[str, Any], source: str, files: list[str],
            chain: tuple[str, ...]) -> tuple[dict[str, Any], dict[int, tuple[str, int]]]:
    """The deploy file with its ``base_config`` chain merged in, and where each
    stage entry was last written (``stage_id -> (file, index)``); ``files``
    gets the files read, bases first."""
    own = {k: v for k, v in data.items() if k not in OUR_KEYS}
    shape = _convert(own, _File, source)
    for name, spec in (own.get("connectors") or {}).items():
        _convert(spec, _ConnectorPart, source, f"connectors.{name}")
    for i, entry in enumerate(own.get("stages") or []):
        _convert(entry, _Stage, source, f"stages[{i}]")
    ids: dict[int, int] = {}
    for i, entry in enumerate(own.get("stages") or []):
        if entry["stage_id"] in ids:
            raise ConfigError(source, f"stages[{i}].stage_id", f"duplicate stage_id "
                              f"{entry['stage_id']} (also stages[{ids[entry['stage_id']]}])")
        ids[entry["stage_id"]] = i
    if shape.base_config is None:
        files.append(source)
        return own, {sid: (source, i) for sid, i in ids.items()}
    path = _base_path(shape.base_config, source)
    if str(path.resolve()) in {str(Path(c).resolve()) for c in chain}:
        raise ConfigError(source, "base_config", f"`{shape.base_config}` is already in the chain: "
                          + " -> ".join(chain))
    if not path.exists() and "/" not in shape.base_config:
        raise ConfigError(source, "base_config", f"no `{shape.base_config}` beside this file, "
                          "nor in the deploy folder of an installed vllm-omni")
    base_data = _read(path, source)
    if not isinstance(base_data, dict):
        raise ConfigError(str(path), "", "expected a mapping (a vLLM-Omni deploy file)")
    base, origin = resolve(base_data, str(path), files, (*chain, str(path)))
    files.append(source)
    own.pop("base_config")
    origin.update({sid: (source, i) for sid, i in ids.items()})
    return _merge(base, own), origin


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """vLLM-Omni's ``base_config`` rule: top-level keys overlay-wins; ``connectors``
    deep-merged; ``stages`` (and each platform's) merged by ``stage_id``."""
    structured = ("connectors", "stages", "platforms")
    out = {**base, **{k: v for k, v in over.items() if k not in structured}}
    if base.get("connectors") or over.get("connectors"):
        out["connectors"] = deep_merge(base.get("connectors") or {}, over.get("connectors") or {})
    out["stages"] = _merge_stages(base.get("stages"), over.get("stages"))
    if base.get("platforms") or over.get("platforms"):
        plats = {}
        for name in {**(base.get("platforms") or {}), **(over.get("platforms") or {})}:
            b = (base.get("platforms") or {}).get(name) or {}
            o = (over.get("platforms") or {}).get(name) or {}
            plats[name] = {**b, **{k: v for k, v in o.items() if k != "stages"},
                           "stages": _merge_stages(b.get("stages"), o.get("stages"))}
        out["platforms"] = plats
    return out


def _merge_stages(base: list | None, over: list | None) -> list[dict[str, Any]]:
    by_id = {s["stage_id"]: s for s in base or []}
    for s in over or []:
        b = by_id.get(s["stage_id"])
        by_id[s["stage_id"]] = s if b is None else {
            **b, **s, **{k: deep_merge(b[k], s[k]) for k in _MERGED_KEYS
                         if isinstance(b.get(k), dict) and isinstance(s.get(k), dict)}}
    return list(by_id.values())


def deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """``a`` with ``b`` over it, mappings merged key by key (neither is changed)."""
    out = dict(a)
    for k, v in b.items():
        both = isinstance(out.get(k), dict) and isinstance(v, dict)
        out[k] = deep_merge(out[k], v) if both else v
    return out


def check_connectors(merged: dict[str, Any], origin: dict[int, tuple[str, int]],
                     by_id: dict[int, Any], source: str) -> None:
    """Connector references name defined connectors and stages of the topology."""
    defined = set(merged.get("connectors") or {})
    for entry in merged.get("stages") or []:
        src, i = origin[entry["stage_id"]]
        for field, pattern in _CONNECTOR_KEY.items():
            for key, ref in (entry.get(field) or {}).items():
                path = f"stages[{i}].{field}.{key}"
                m = pattern.fullmatch(key)
                if m is None:
                    want = "from_stage_N" if field == "input_connectors" else "to_stage_N"
                    raise ConfigError(src, path, f"expected a key `{want}` (N: a stage_id)")
                if int(m.group(1)) not in by_id:
                    raise ConfigError(src, path, f"no stage {m.group(1)} in the topology; "
                                      f"its stages: {sorted(by_id)}")
                if isinstance(ref, str) and ref not in defined:
                    raise ConfigError(src, path, f"no connector `{ref}` under `connectors`; "
                                      f"defined: {sorted(defined) or 'none'}")
    for j, edge in enumerate(merged.get("edges") or []):
        for end in ("from", "to"):
            if edge[end] not in by_id:
                raise ConfigError(source, f"edges[{j}].{end}", f"no stage {edge[end]} in the "
                                  f"topology; its stages: {sorted(by_id)}")
