"""Load-balancing policies: pure functions over a snapshot of replica loads.

Kept free of actors so they are unit-tested on their own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from omni_actors.messages import LIVE_STATES, PLACING, ReplicaState

#: Replica states a stage's pool routes tasks to.
ROUTABLE = (ReplicaState.READY,)
#: Replica states of a replica on its way to READY (placed or not yet, starting, restarting):
#: a task that finds none routable waits for it, up to ``supervision.queue_timeout_s``.
ON_ITS_WAY = (ReplicaState.PENDING, ReplicaState.STARTING, ReplicaState.DEAD, ReplicaState.ISOLATED)


@dataclass(frozen=True)
class ReplicaLoad:
    """What a pool knows of one ready replica when it routes a task.

    Attributes:
        replica: id, ``"<stage>/<index>"``.
        in_flight: tasks the pool sent to it that have not finished.
        last_dispatch: when the pool last sent it a task (``time.monotonic()``; 0.0 never,
            since it last started): the tie-breaker.
    """

    replica: str
    in_flight: int
    last_dispatch: float


def least_loaded(candidates: Sequence[ReplicaLoad]) -> str | None:
    """Pick the replica with the fewest in-flight tasks.

    Ties go to the replica sent a task least recently (one not sent any since
    it started first), then to the first in order, so that equal replicas take
    sequential work in turns instead of the first one taking every request at
    concurrency 1. (Fewest tasks ever sent, the tie-breaker before, starved a
    replica back from a restart beside new ones: trial AY's took 5 tasks in 12 s
    where the other two took 55-70 each.)
    In-flight counts are the pool's own (exact, no heartbeat lag), as Ray
    Serve's and vLLM-Omni's least-queue policies do with reported queues.

    Returns:
        The chosen replica id, or None when ``candidates`` is empty.
    """
    if not candidates:
        return None
    best = min(range(len(candidates)),
               key=lambda i: (candidates[i].in_flight, candidates[i].last_dispatch, i))
    return candidates[best].replica


POLICIES = {"least_loaded": least_loaded}


def lingers(replica) -> bool:
    """Whether ``replica`` (a pool's record, or a ``ReplicaStatus``) is READY and lingering: the
    last ready one of its stage on a leaving node, taking only the tasks of requests begun
    before it lingered."""
    return replica.state in ROUTABLE and bool(getattr(replica, "lingering", False) or getattr(replica, "linger", ""))


def none_on_its_way(replicas: Iterable) -> bool:
    """Whether none of ``replicas`` is on its way to READY (:data:`ON_ITS_WAY`, or one that
    :func:`comes_back`): a request refused for want of one gets the same answer a second later
    (a review: with ``queue_timeout_s: 0`` a refusal is no sign of that)."""
    return not any(r.state in ON_ITS_WAY or comes_back(r) for r in replicas)


def comes_back(replica) -> bool:
    """Whether ``replica`` (a pool's record, or a ``ReplicaStatus``), pinned to a node that was
    drained or left, is draining or lingering there and starts again on that node once it is
    undrained or back: requests wait for it as for one pending there (trial BY: they got a 503
    at once while it drained, and waited once it was pending, as the drain's warning said)."""
    return bool(getattr(replica, "relaunch", False)) and replica.state in (ReplicaState.READY, ReplicaState.DRAINING)


def no_replica_reason(stage: str, replicas: Iterable, queue_timeout_s: float,
                      new_request: bool = False) -> str | None:
    """Why a task of ``stage`` gets a 503 at once; None if it is routed now or may wait.

    ``replicas`` are objects with ``replica``, ``state`` (:class:`ReplicaState`)
    and ``reason`` (a pool's own records, or the ``ReplicaStatus`` es of a
    published ``PoolState``). A task is taken when one is :data:`ROUTABLE`
    (with ``new_request``, of a request begun after the lingering ones lingered:
    one that does not linger, see :func:`lingers`); else it waits when one is
    :data:`ON_ITS_WAY` and ``queue_timeout_s`` > 0. Otherwise (none, or all
    stopped, draining or failed) the answer names each replica's state and
    reason, e.g. ``"no ready replica of stage talker (talker/0 stopped: scaled
    down)"``, or ``"no replica of stage talker takes new requests (...)"`` where
    only lingering ones are ready.
    """
    replicas = list(replicas)
    if any(r.state in ROUTABLE and not (new_request and lingers(r)) for r in replicas) or (
            queue_timeout_s > 0 and any(r.state in ON_ITS_WAY or comes_back(r) for r in replicas)):
        return None
    if new_request and any(lingers(r) for r in replicas):
        return f"no replica of stage {stage} takes new requests ({describe_replicas(replicas)})"
    return f"no ready replica of stage {stage} ({describe_replicas(replicas)})"


#: Names a description gives per reason of stopped replicas; the rest are counted.
STOPPED_NAMED = 3


def describe_replicas(replicas: Iterable) -> str:
    """``"talker/1 starting; talker/2, talker/3 pending: ...; 3 stopped"`` (``"no replicas"``
    for none).

    Replicas in the same state for the same reason are named together (trial AY: a drained
    node's warning gave every pending replica's long placement reason, one after the
    other), at most :data:`STOPPED_NAMED` in each group. Stopped replicas (scaled down,
    drained) are counted, not listed, beside any other (a trial's 503 listed five); with
    no other they say why the stage has nothing: ``"talker/0, talker/1, talker/2 and 1
    more stopped: drained on request; talker/4 stopped: scaled down"`` (a trial's 503 named
    the two scaled down long before and folded the three just drained into "3 more"); a
    stopped one whose reason ends ``(replaced by R)``, R among them, is left out (history).
    """
    reps = list(replicas)
    others = [r for r in reps if r.state.value != "stopped"]
    stopped = [r for r in reps if r.state.value == "stopped"]
    parts = _grouped(others)
    if others and stopped:
        parts.append(f"{len(stopped)} stopped")
    elif stopped:
        # (trial CG: after `stage stop`, the 503 began with replicas replaced long before, each
        # with its node's story, and the cause came last: those whose replacement is listed go)
        names = {r.replica for r in stopped}
        parts = _grouped([r for r in stopped if _REPLACED_BY.search(r.reason or "") is None
                          or _REPLACED_BY.search(r.reason).group(1) not in names] or stopped)
    return "; ".join(parts) or "no replicas"


#: The end of a stopped replica's reason that names the replica launched in its place.
_REPLACED_BY = re.compile(r"\(replaced by ([^()\s]+)\)$")


def _grouped(replicas: list) -> list[str]:
    """``["talker/0, talker/1 and 2 more pending: REASON", ...]``: one per (state, reason), in
    the order of their first replica."""
    groups: dict[tuple[str, str], list[str]] = {}
    for r in replicas:
        groups.setdefault((r.state.value, r.reason or ""), []).append(r.replica)
    parts = []
    for (state, reason), names in groups.items():
        more = len(names) - STOPPED_NAMED
        listed = ", ".join(names[:STOPPED_NAMED]) + (f" and {more} more" if more > 0 else "")
        parts.append(f"{listed} {state}" + (f": {reason}" if reason else ""))
    return parts


def stages_left_without_replicas(status, node: str, before=None, drained: bool = False) -> list[tuple[str, str]]:
    """The stages that node ``node`` leaves with no replica on its way anywhere else:
    ``[(stage, "stage talker has no replica running once node m1 has left (talker/3
    pending: no node has room ...); requests that need it wait up to queue_timeout_s,
    then get a 503, until a node that can run it joins")]``.

    ``status`` is a :class:`~omni_actors.messages.SystemStatus` (None: nothing to say);
    a stage counts when it had a live replica on ``node`` in ``before`` (default ``status``).
    ``drained``: the node was drained by an operator (``node drain``), not left.
    A replica of another node counts as on its way when it is ready, starting, or dead or
    isolated (its pool restarts it), or still being placed; pending ones (no node with
    room) do not. A trial's member, stopped with Ctrl-C, took every replica of two stages
    with it without a word: each request then waited the queue timeout three times over
    (the ``openai`` client's retries).
    """
    if status is None:
        return []
    on_its_way = (ReplicaState.READY, ReplicaState.STARTING, ReplicaState.DEAD, ReplicaState.ISOLATED)
    had = {s.stage for s in (before or status).stages
           if any(r.node == node and r.state in LIVE_STATES for r in s.replicas)}
    out = []
    for stage in status.stages:
        if stage.stage not in had or any(
                (r.node != node and r.node and r.state in on_its_way)
                or (r.state == ReplicaState.PENDING and r.reason.startswith(PLACING))  # (not known yet)
                for r in stage.replicas):
            continue
        others = [r for r in stage.replicas if r.node != node]
        elsewhere = describe_replicas(others) if others else f"none on another node than {node}"
        # (trial BK: with m1 drained before, the drain of m2 said "while node m2 is drained")
        names = [node] + [n.name for n in status.nodes if n.drained and n.name != node]
        when, until = ((f"while node{'s' if len(names) > 1 else ''} {', '.join(names)} "
                        f"{'are' if len(names) > 1 else 'is'} drained",
                        "`node undrain` or a node that can run it joins")
                       if drained else (f"once node {node} has left", "a node that can run it joins"))
        out.append((stage.stage, f"stage {stage.stage} has no replica running {when}"
                                 f" ({elsewhere}); requests that need it wait up to its"
                                 f" queue_timeout_s, then get a 503, until {until}"))
    return out
