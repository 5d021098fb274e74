"""Request planning: which stages one request needs, from the outputs it asks for."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from omni_actors.config import PipelineConfig
from omni_actors.engines import chunk_capabilities, stream_edges
from omni_actors.messages import PlannedStage, RequestPlan


class PlanError(ValueError):
    """The pipeline cannot produce the requested outputs."""


def plan_request(config: PipelineConfig, pools: Mapping[int, Any],
                 output_types: Iterable[str]) -> RequestPlan:
    """Prune the stage graph to the final stages producing ``output_types``
    and all their ancestors.

    Example: Thinker -> Talker -> Code2Wav with outputs ``{"text"}`` runs the
    Thinker only; ``{"text", "audio"}`` runs all three. With streaming on,
    edges that stream (:func:`~omni_actors.engines.stream_edges`) are marked
    on the consumer (``stream_source``) and the producer (``emits_chunks``).

    Raises:
        PlanError: an output type no final stage produces.
    """
    wanted = set(output_types)
    finals = [s for s in config.stage_args if s.final_output and s.final_output_type in wanted]
    missing = wanted - {s.final_output_type for s in finals}
    if missing:
        raise PlanError(f"this pipeline produces no {', '.join(sorted(missing))} output")
    needed: set[int] = set()
    stack = [s.stage_id for s in finals]
    while stack:
        sid = stack.pop()
        if sid in needed:
            continue
        needed.add(sid)
        stack.extend(config.stage(sid).engine_input_source)
    streams = {dst: src for dst, src in stream_edges(config).items() if dst in needed}
    consumed = {src for sid in needed for src in config.stage(sid).engine_input_source
                if streams.get(sid) != src}
    stages = []
    for s in config.stage_args:
        if s.stage_id not in needed:
            continue
        final = s.final_output_type if (s.final_output and s.final_output_type in wanted) else None
        # Final audio goes to a streaming client in chunks where the stage can make them.
        chunked_final = (final == "audio" and config.deployment.streaming.enabled
                         and chunk_capabilities(s, config.deployment_of(s))[0])
        stages.append(PlannedStage(
            stage_id=s.stage_id,
            stage=s.name,
            sources=tuple(s.engine_input_source),
            pool=pools.get(s.stage_id),
            final_output_type=final,
            needs_output=s.stage_id in consumed,
            stream_source=streams.get(s.stage_id),
            emits_chunks=s.stage_id in streams.values() or chunked_final,
        ))
    return RequestPlan(stages=tuple(stages))
