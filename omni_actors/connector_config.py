"""vLLM-Omni's connector settings in a config: checked, mapped, and noted.

A ``stage_args`` config may carry vLLM-Omni's connector settings (top-level
``runtime.connectors`` / ``runtime.edges``, a stage's ``input_connectors`` /
``output_connectors``; the deploy format's ``connectors`` / ``edges`` come here
too, see :mod:`omni_actors.vllm_omni_deploy`). :func:`omni_connectors` checks
their shape (errors name the YAML path), maps what has an equivalent here
(``SharedMemoryConnector`` -> our own connectors, its threshold the stage's
inline threshold), hands store connectors to vLLM-Omni's own implementation
where ``vllm_omni`` is importable (:mod:`omni_actors.connectors.omni`), and
records a note for everything else.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from omni_actors.config import ConfigError, OmniConnectors, PipelineConfig, StageConnector, _convert, _show

#: vLLM-Omni connector classes with an equivalent here (see :class:`OmniConnectors`).
SHARED_MEMORY_CONNECTORS = ("SharedMemoryConnector",)
_EDGE_KEYS = {"input_connectors": re.compile(r"from_stage_(\d+)"),
              "output_connectors": re.compile(r"to_stage_(\d+)")}
_NOT_APPLIED = "not applied: needs vLLM-Omni's own connector (e.g. Mooncake)"


#: The largest ``shm_threshold_bytes``: that of ``deployment.inline_threshold_bytes`` (64 MiB),
#: which it stands in for (more would carry hundreds of MB in actor messages).
MAX_SHM_THRESHOLD_BYTES = 64 << 20


def _check_shm_threshold(spec: ConnectorSpec, source: str, named: str) -> None:
    """Refuse a ``SharedMemoryConnector``'s ``extra.shm_threshold_bytes`` that is not an
    integer from 0 to :data:`MAX_SHM_THRESHOLD_BYTES` (``ConfigError`` with its YAML path)."""
    value = spec.extra.get("shm_threshold_bytes") if spec.name in SHARED_MEMORY_CONNECTORS else None
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                              or not 0 <= value <= MAX_SHM_THRESHOLD_BYTES):
        raise ConfigError(source, f"{named}.extra.shm_threshold_bytes",
                          f"expected an integer >= 0 and <= {MAX_SHM_THRESHOLD_BYTES} (as "
                          f"deployment.inline_threshold_bytes), got `{value!r}`")


#: vLLM-Omni 0.30's connector classes (its ``OmniConnectorFactory``), for telling a misspelt
#: name where vLLM-Omni is not installed to ask (check-config asks it where it is).
VLLM_OMNI_CONNECTORS = frozenset({
    "SharedMemoryConnector", "MooncakeStoreConnector", "MooncakeConnector", "MooncakeTransferEngineConnector",
    "YuanrongConnector", "YuanrongTransferEngineConnector", "MoriTransferEngineConnector", "NixlConnector"})


def _check_connector_name(spec: ConnectorSpec, source: str, named: str) -> None:
    """Refuse a connector class that is a near miss of one of :data:`VLLM_OMNI_CONNECTORS`
    (trial CH: `SharedMemoryConector` was noted as "needs vLLM-Omni's own connector")."""
    from omni_actors.config_keys import near_miss

    meant = near_miss(spec.name, VLLM_OMNI_CONNECTORS)
    if meant is not None:
        raise ConfigError(source, f"{named}.name", f"`{spec.name}` is no vLLM-Omni connector; did you mean "
                                                   f"`{meant}`?")


def _omni_not_applied(name: str, cfg: PipelineConfig) -> str | None:
    """Why vLLM-Omni connector ``name`` cannot carry a stage's outputs; None: it can."""
    from omni_actors.connectors import omni

    if name in omni.TRANSFER_ENGINE_CONNECTORS:
        return ("not applied: vLLM-Omni's transfer-engine connectors need sender/receiver roles and "
                "ports per stage replica, which omni-actors does not set up")
    if not omni.available():
        return f"{_NOT_APPLIED}; vllm_omni is not installed in this process (the one that loaded the config)"
    if cfg.deployment.connector != "auto":
        return f"not applied: deployment.connector `{cfg.deployment.connector}` sets how every stage stores its outputs"
    return None


def omni_connectors(data: dict[str, Any], cfg: PipelineConfig, source: str) -> OmniConnectors:
    """Check and map vLLM-Omni's connector settings of a ``stage_args`` config
    (see :class:`OmniConnectors`). Raises ConfigError naming the YAML path."""
    from omni_actors.vllm_omni_deploy.files import ConnectorSpec, Edge

    runtime = data.get("runtime")
    raw_stages = data["stage_args"]
    if runtime is None and not any(isinstance(st, dict) and (st.get("input_connectors") or st.get("output_connectors"))
                                   for st in raw_stages):
        return OmniConnectors()
    if runtime is None:
        runtime = {}
    if not isinstance(runtime, dict):
        raise ConfigError(source, "runtime", f"expected a mapping (vLLM-Omni's `connectors`, `edges`), "
                                             f"got `{type(runtime).__name__}`")
    defined = runtime.get("connectors") or {}
    if not isinstance(defined, dict):
        raise ConfigError(source, "runtime.connectors", "expected a mapping of connector names to "
                                                        "`{name, extra}`")
    specs = {str(k): _convert(v, ConnectorSpec, source, f"runtime.connectors.{k}") for k, v in defined.items()}
    for k, spec in specs.items():  # (each one, named by a stage or not: a bad value is a mistake either way)
        _check_connector_name(spec, source, f"runtime.connectors.{k}")
        _check_shm_threshold(spec, source, f"runtime.connectors.{k}")
    ids = {st.stage_id: st for st in cfg.stage_args}
    raw_edges = runtime.get("edges")
    for j, raw_edge in enumerate(raw_edges if isinstance(raw_edges, list) else []):
        for end in ("from", "to"):  # (trial AV: a stage's name read "Expected `int`, got `str`")
            value = raw_edge.get(end) if isinstance(raw_edge, dict) else None
            if isinstance(value, str):
                named = next((st.stage_id for st in cfg.stage_args if st.name == value), None)
                raise ConfigError(source, f"runtime.edges[{j}].{end}",
                                  f"expected a stage_id (an integer), got `{_show(value)}`"
                                  + (f": stage {value} has stage_id {named}" if named is not None else
                                     f"; known: {sorted(ids)}"))
    edges = _convert(runtime.get("edges") or [], list[Edge], source, "runtime.edges")
    for j, edge in enumerate(edges):
        for end, sid in (("from", edge.from_stage), ("to", edge.to_stage)):
            if sid not in ids:
                raise ConfigError(source, f"runtime.edges[{j}].{end}",
                                  f"unknown stage_id {sid}; known: {sorted(ids)}")

    # (from, to) -> (connector spec, where a stage names it, where it is defined), from both ends of each edge
    by_edge: dict[tuple[int, int], tuple[ConnectorSpec, str, str]] = {}
    for i, raw in enumerate(raw_stages):
        me = cfg.stage_args[i].stage_id
        for field, pattern in _EDGE_KEYS.items():
            entries = raw.get(field) or {}
            if not isinstance(entries, dict):
                raise ConfigError(source, f"stage_args[{i}].{field}",
                                  "expected a mapping of `from_stage_N` / `to_stage_N` to a connector")
            for key, ref in entries.items():
                path = f"stage_args[{i}].{field}.{key}"
                m = pattern.fullmatch(str(key))
                if m is None:
                    want = "from_stage_N" if field == "input_connectors" else "to_stage_N"
                    raise ConfigError(source, path, f"expected a key `{want}` (N: a stage_id)")
                other = int(m.group(1))
                if other not in ids:
                    raise ConfigError(source, path, f"unknown stage_id {other}; known: {sorted(ids)}")
                if isinstance(ref, str):
                    if ref not in specs:
                        raise ConfigError(source, path, f"no connector `{ref}` under `runtime.connectors`; "
                                                        f"defined: {sorted(specs) or 'none'}")
                    spec, named = specs[ref], f"runtime.connectors.{ref}"
                else:
                    spec, named = _convert(ref, ConnectorSpec, source, path), path
                    _check_connector_name(spec, source, path)
                edge = (other, me) if field == "input_connectors" else (me, other)
                if edge in by_edge and by_edge[edge][0].name != spec.name:
                    raise ConfigError(source, path, f"edge {edge[0]}->{edge[1]} has connector `{spec.name}` "
                                                    f"here but `{by_edge[edge][0].name}` at {by_edge[edge][1]}")
                by_edge.setdefault(edge, (spec, path if named == path else f"{path} -> {named}", named))

    notes: list[str] = []
    thresholds: dict[int, dict[int, str]] = {}  # producer -> threshold -> where it is set
    via_omni: dict[int, dict[tuple[str, str], tuple[str, Any]]] = {}  # producer -> vLLM-Omni connectors named
    for (src, dst), (spec, where, named) in sorted(by_edge.items()):
        producer = ids[src].name
        if src not in ids[dst].engine_input_source:
            notes.append(f"{where}: edge {src}->{dst} is not in the stage graph (stage {dst}'s "
                         f"engine_input_source): ignored")
            continue
        if spec.name not in SHARED_MEMORY_CONNECTORS:
            reason = _omni_not_applied(spec.name, cfg)
            if reason is None:
                via_omni.setdefault(src, {}).setdefault(
                    (spec.name, repr(sorted(spec.extra.items()))), (where, spec))
                continue
            notes.append(f"{where} ({spec.name}) on edge {src}->{dst}: {reason}; "
                         f"{producer}'s outputs go through omni-actors' connectors (deployment.connector: "
                         f"{cfg.deployment.connector})")
            continue
        value = spec.extra.get("shm_threshold_bytes")
        if cfg.deployment.connector in ("inline", "shm"):
            notes.append(f"{where} ({spec.name}) on edge {src}->{dst}: not applied: deployment.connector "
                         f"`{cfg.deployment.connector}` sets how every stage stores its outputs")
            continue
        if value is None:
            notes.append(f"{where} ({spec.name}) on edge {src}->{dst}: applied as omni-actors' shared-memory "
                         f"connector (inline up to deployment.inline_threshold_bytes, "
                         f"{cfg.deployment.inline_threshold_bytes})")
            continue
        _check_shm_threshold(spec, source, named)
        thresholds.setdefault(src, {}).setdefault(value, where)
    applied: dict[str, StageConnector] = {}
    for src, found in thresholds.items():
        producer = ids[src].name
        where = ", ".join(found.values())
        if len(found) > 1:
            notes.append(f"{where}: different shm_threshold_bytes ({', '.join(map(str, found))}) for the "
                         f"outputs of one stage ({producer}): not applied; it uses "
                         f"deployment.inline_threshold_bytes ({cfg.deployment.inline_threshold_bytes})")
            continue
        (value,) = found
        applied[producer] = StageConnector(inline_threshold_bytes=value, origin=list(found.values()))
        notes.append(f"{where} (SharedMemoryConnector): applied to {producer}: inline up to {value} bytes, "
                     f"a shared-memory segment above")
    for src, found in via_omni.items():
        producer = ids[src].name
        where = ", ".join(w for w, _ in found.values())
        if len(found) > 1:
            names = ", ".join(spec.name for _, spec in found.values())
            notes.append(f"{where}: different vLLM-Omni connectors ({names}) for the outputs of one stage "
                         f"({producer}): not applied; its outputs go through omni-actors' connectors")
            continue
        ((_, spec),) = [(w, sp) for w, sp in found.values()]
        entry = applied.setdefault(producer, StageConnector())
        entry.omni = {"name": spec.name, "extra": dict(spec.extra)}
        entry.origin = [*entry.origin, where]
        limit = (entry.inline_threshold_bytes if entry.inline_threshold_bytes is not None
                 else cfg.deployment.inline_threshold_bytes)
        notes.append(f"{where} ({spec.name}): applied to {producer}: its outputs over {limit} bytes "
                     f"(on every edge) go through vLLM-Omni's {spec.name} in engines where vllm_omni is "
                     f"installed (one without it uses omni-actors' connectors and logs so)")
    if edges:
        notes.append("runtime.edges: kept, not applied (flow control between stages is "
                     "deployment.streaming.max_buffered_chunks)")
    for j, edge in enumerate(edges):  # (as a stage's connectors on an edge the graph lacks, above)
        if edge.from_stage not in ids[edge.to_stage].engine_input_source:
            notes.append(f"runtime.edges[{j}]: edge {edge.from_stage}->{edge.to_stage} is not in the stage graph "
                         f"(stage {edge.to_stage}'s engine_input_source)")
    return OmniConnectors(connectors={k: msgspec.to_builtins(v) for k, v in specs.items()},
                          edges=[msgspec.to_builtins(e) for e in edges],
                          by_edge={f"{a}->{b}": spec.name for (a, b), (spec, _, _) in sorted(by_edge.items())},
                          applied=applied, notes=notes)
