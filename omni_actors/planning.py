"""Request planning: which stages one request needs, from the outputs it asks for."""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from omni_actors.config import PipelineConfig
from omni_actors.engines import chunk_capabilities, stream_edges
from omni_actors.messages import PlannedStage, RequestPlan


class PlanError(ValueError):
    """The pipeline cannot produce the requested outputs."""


def stages_for(config: PipelineConfig, outputs: Iterable[str]) -> set[int]:
    """The ids of the stages that ``outputs`` (output types) need: their final stages and
    every stage upstream of those."""
    wanted = set(outputs)
    needed: set[int] = set()
    stack = [s.stage_id for s in config.stage_args if s.final_output and s.final_output_type in wanted]
    while stack:
        sid = stack.pop()
        if sid not in needed:
            needed.add(sid)
            stack.extend(config.stage(sid).engine_input_source)
    return needed


def handover_refusal(outputs: Iterable[str], stages: list[str]) -> str:
    """Why requests for ``outputs`` are refused: ``stages`` are fed by vLLM-Omni's model-runner hand-over."""
    names = ", ".join(stages)
    one = len(stages) == 1
    return (f"this deployment cannot produce {' + '.join(sorted(outputs))} output yet: stage{'' if one else 's'} "
            f"{names} take{'s' if one else ''} {'its' if one else 'their'} input "
            f"through vLLM-Omni's model-runner hand-over (`requires_full_payload_input`), which omni-actors "
            f"does not carry between replicas")


def plan_request(config: PipelineConfig, pools: Mapping[int, Any],
                 output_types: Iterable[str]) -> RequestPlan:
    """Prune the stage graph to the final stages producing ``output_types``
    and all their ancestors.

    Example: Thinker -> Talker -> Code2Wav with outputs ``{"text"}`` runs the
    Thinker only; ``{"text", "audio"}`` runs all three. With streaming on,
    edges that stream (:func:`~omni_actors.engines.stream_edges`) are marked
    on the consumer (``stream_source``) and the producer (``emits_chunks``).

    Raises:
        PlanError: an output type no final stage produces, or one that needs a stage
            fed by vLLM-Omni's model-runner hand-over
            (:meth:`~omni_actors.config.PipelineConfig.runner_handover_stages`).
    """
    wanted = set(output_types)
    finals = [s for s in config.stage_args if s.final_output and s.final_output_type in wanted]
    missing = wanted - {s.final_output_type for s in finals}
    if missing:
        raise PlanError(f"this pipeline produces no {', '.join(sorted(missing))} output")
    needed = stages_for(config, wanted)
    blocked = [s for s in config.runner_handover_stages() if s.stage_id in needed]
    if blocked:
        ids = {s.stage_id for s in blocked}
        raise PlanError(handover_refusal([out for out in wanted if stages_for(config, [out]) & ids],
                                         [s.name for s in blocked]))
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
