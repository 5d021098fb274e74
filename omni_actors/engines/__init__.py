"""Engine backends: what an EngineActor drives (see :mod:`omni_actors.engines.base`).

:func:`create_backend` picks the backend a stage is deployed with. Backend
modules are imported lazily, so importing this package stays cheap (numpy at
most) and never pulls in vLLM: ``backend: vllm`` builds a
:class:`~omni_actors.engines.vllm.VllmEngine`, which imports vLLM in ``start``.
"""

from __future__ import annotations

from omni_actors.config import StageDeployment, StageSpec
from omni_actors.engines.base import EngineBackend

__all__ = ["create_backend", "BACKENDS"]

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

        return VllmEngine(stage, replica)
    if backend == "vllm_omni":
        from omni_actors.engines.vllm_omni import VllmOmniEngine

        return VllmOmniEngine(stage, replica)
    raise ValueError(f"unknown backend `{backend}` for stage `{stage.name}`; "
                     f"known: {', '.join(BACKENDS)}")
