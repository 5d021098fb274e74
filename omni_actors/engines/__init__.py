"""Engine backends: what an EngineActor drives (see :mod:`omni_actors.engines.base`).

:func:`create_backend` picks the backend a stage is deployed with. Backend
modules are imported lazily, so importing this package stays cheap (numpy at
most) and never pulls in vLLM: ``backend: vllm`` builds a
:class:`~omni_actors.engines.vllm.VllmEngine`, which imports vLLM in ``start``.
"""

from __future__ import annotations

from omni_actors.config import PipelineConfig, StageDeployment, StageSpec
from omni_actors.engines.base import EngineBackend

__all__ = ["create_backend", "BACKENDS", "chunk_capabilities", "stream_edges"]

#: Backend names a deployment may ask for, and whether this build provides them.
BACKENDS = {"synthetic": True, "vllm": True, "vllm_omni": True}


def create_backend(stage: StageSpec, deployment: StageDeployment, replica: str) -> EngineBackend:
    """Build (not start) the backend of one replica.

    Args:
        stage: the stage spec (``stage.name`` picks the stage behaviour).
        deployment: the stage's deployment; ``deployment.backend`` picks the
            backend and ``deployment.synthetic`` is the synthetic cost model.
        replica: the replica name (``"talker/0"``), used in messages.

    Raises:
        ValueError: an unknown backend name.
    """
    backend = deployment.backend
    if backend == "synthetic":
        from omni_actors.engines.synthetic import SyntheticEngine

        return SyntheticEngine(stage, deployment.synthetic, replica)
    if backend == "vllm":
        from omni_actors.engines.vllm import VllmEngine

        return VllmEngine(stage, replica, cpus=deployment.cpus)
    if backend == "vllm_omni":
        from omni_actors.engines.vllm_omni import VllmOmniEngine

        return VllmOmniEngine(stage, replica)
    raise ValueError(f"unknown backend `{backend}` for stage `{stage.name}`; "
                     f"known: {', '.join(BACKENDS)}")


def chunk_capabilities(stage: StageSpec, deployment: StageDeployment) -> tuple[bool, bool]:
    """``(emits, accepts)``: whether this stage's backend can send its outputs
    in chunks as it makes them, and start on chunks of its input.

    The synthetic engine's thinker, talker and code2wav emit chunks (tokens +
    hidden states, codec frames, audio), its talker and code2wav accept them.
    A vLLM engine emits its text and token ids in chunks
    (``chunk_tokens`` tokens each) but takes whole prompts, so edges into it
    pass whole outputs. vLLM-Omni stages do neither here.
    """
    if deployment.backend == "vllm":
        return True, False
    if deployment.backend != "synthetic":
        return False, False
    from omni_actors.engines.synthetic import CHUNK_INPUT_STAGES, CHUNK_OUTPUT_STAGES

    kind = deployment.synthetic.kind or str(stage.engine_args.get("model_stage", ""))
    return kind in CHUNK_OUTPUT_STAGES, kind in CHUNK_INPUT_STAGES


def stream_edges(config: PipelineConfig) -> dict[int, int]:
    """``{consumer stage_id: producer stage_id}`` for every edge that streams.

    An edge streams when ``deployment.streaming.enabled``, the consumer has
    exactly one source, the producer emits chunks and the consumer accepts
    them (:func:`chunk_capabilities`). Empty when streaming is off.
    """
    if not config.deployment.streaming.enabled:
        return {}
    caps = {s.stage_id: chunk_capabilities(s, config.deployment_of(s)) for s in config.stage_args}
    return {s.stage_id: s.engine_input_source[0] for s in config.stage_args
            if len(s.engine_input_source) == 1 and caps[s.stage_id][1]
            and caps[s.engine_input_source[0]][0]}
