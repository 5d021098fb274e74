"""Load-balancing policies: pure functions over a snapshot of replica loads.

Kept free of actors so they are unit-tested on their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ReplicaLoad:
    """What a pool knows of one ready replica when it routes a task.

    Attributes:
        replica: id, ``"<stage>/<index>"``.
        in_flight: tasks the pool sent to it that have not finished.
        dispatched: tasks the pool ever sent to it (the tie-breaker).
    """

    replica: str
    in_flight: int
    dispatched: int


def least_loaded(candidates: Sequence[ReplicaLoad]) -> str | None:
    """Pick the replica with the fewest in-flight tasks.

    Ties go to the replica that was sent the fewest tasks so far, then to
    the first in order, so that equal replicas share sequential work evenly
    instead of the first one taking every request at concurrency 1.
    In-flight counts are the pool's own (exact, no heartbeat lag), as Ray
    Serve's and vLLM-Omni's least-queue policies do with reported queues.

    Returns:
        The chosen replica id, or None when ``candidates`` is empty.
    """
    if not candidates:
        return None
    best = min(range(len(candidates)),
               key=lambda i: (candidates[i].in_flight, candidates[i].dispatched, i))
    return candidates[best].replica


POLICIES = {"least_loaded": least_loaded}
