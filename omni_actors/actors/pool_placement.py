"""The stage pool's side of placement: where each replica runs.

A mixin of :class:`~omni_actors.actors.stage_pool.StagePoolActor`. A replica
starts PENDING; the pool asks the coordinator for a node and devices
(:class:`~omni_actors.messages.PlaceReplica`), creates the EngineActor on that
node when the answer comes, retries pending replicas when nodes change, and
gives up the replicas of a node that is lost.

A replica launched with ``--node``/``--devices`` is pinned (``self._pins``):
each of its placements, restarts included, asks for that node (and exactly
those devices) only, so it comes back where it was or waits, pending.
"""

from __future__ import annotations

import os
import socket
import time

from thespian.actors import ActorExitRequest

from omni_actors.actors.engine import ORPHAN_AFTER_INTERVALS, EngineActor
from omni_actors.actors.node_agent import requirements_on
from omni_actors.placement import LEAVING, LEFT_REASON
from omni_actors.messages import (LIVE_STATES, DrainNode, NodeLost, NodesChanged, NoRequestsInFlight, PlaceReplica,
                                  Placement, PlacementFailed, ReleasePlacement, ReplicaState, StartEngine)


#: Seconds an orphaned engine may take, once its tasks are cancelled, to stop its backend and
#: exit (a tiny vLLM engine's shutdown took 4-5 s here; a large model on GPUs takes longer):
#: part of how long a new replica waits for an old engine on its devices (:func:`device_wait_s`).
ENGINE_EXIT_S = 60.0


def device_wait_s(spec) -> float:
    """How long a new replica's engine waits for an old engine still holding its devices
    before it kills it (``StartEngine.device_wait_s``; ``spec``: the pool's ``StartPool``):
    how long an orphaned engine takes to wind down (it notices its pool is gone after
    ``orphan`` seconds, gives its tasks as long again, then stops: 2 x ``orphan`` +
    :data:`ENGINE_EXIT_S`), and at most half of ``ready_timeout_s``. (Half of it alone was
    600-900 s with the GPU configs' ready timeouts: a frozen old engine would have held a
    GPU that long.)"""
    interval = spec.heartbeat_interval_s
    orphan = max(ORPHAN_AFTER_INTERVALS * interval, spec.supervision.missed_heartbeats * interval)
    return min(spec.ready_timeout_s / 2, 2 * orphan + ENGINE_EXIT_S)


#: How a replica pinned to a draining or leaving node says it comes back (``"...; it starts again
#: when the node is undrained"``); cut from the reason it gives once back (:func:`was_down`).
STARTS_AGAIN = "; it starts again when the node is "
#: What a replica moved off a node an operator drained says (``node m2 drained (`node drain`)``).
DRAINED_BY_OPERATOR = "drained (`node drain`)"


def was_down(cause: str) -> str:
    """Why a replica was down, in the past: a pinned one's ``"it starts again when ..."`` goes
    (trial AY: ``restarted at 23:42:23; it was down: node m2 drained (`node drain`); it starts
    again when the node is undrained``, of a replica running again), and a node that "is
    leaving" was (trial BK read it of a node that had left)."""
    return cause.split(STARTS_AGAIN)[0].replace(f" {LEAVING}", f" was {LEAVING.split(' ', 1)[1]}")


def moved_on_purpose(cause: str) -> bool:
    """Whether a replica was down because its node was drained or left (not a crash): it was
    placed again, not restarted (its RESTARTS do not change)."""
    return LEFT_REASON in cause or LEAVING in cause or DRAINED_BY_OPERATOR in cause


def down_phrase(cause: str) -> str:
    """``it was down: <why>`` (a crash, a hang), or ``it was stopped: <why>`` when its node was
    drained or left (trial BK: "it was down: node m2 drained" read as a failure)."""
    return f"it was {'stopped' if moved_on_purpose(cause) else 'down'}: {was_down(cause)}"


def starting_reason(rep) -> str:
    """The reason a STARTING replica shows: why it was down (a restart, which can take a minute
    with vLLM), which devices its engine still waits for (its heartbeats' ``waiting_for``), and
    what its engine is doing (their ``phase``)."""
    parts = [f"starting again; {down_phrase(rep.down_cause)}"] if rep.down_cause else []
    if rep.device_wait:
        parts.append(f"waiting for {rep.device_wait}")
    elif rep.start_phase:
        parts.append(rep.start_phase)
    return "; ".join(parts)


class PoolPlacementMixin:
    def _place(self, rep) -> None:
        dep = self._spec.deployment
        rep.placing = True
        pin = self._pins.get(rep.replica)
        nodes, devices = ((pin[0],), tuple(pin[1])) if pin else (tuple(dep.nodes), ())
        self.send(self._coordinator, PlaceReplica(self._spec.stage.name, rep.replica, dep.devices_per_replica,
                                                  nodes, pin_devices=devices, prefer=rep.was_on))

    def receiveMsg_Placement(self, msg: Placement, sender):
        rep = self._replicas.get(msg.replica)
        if rep is None or rep.state != ReplicaState.PENDING or self._orphaned:
            self.send(sender, ReleasePlacement(msg.replica))  # scaled down or gone meanwhile
            return
        spec = self._spec
        rep.placing = False
        try:
            # (that host process's admin: a lost one of the node's name may still be up)
            address = self.createActor(EngineActor, targetActorRequirements=requirements_on(msg.node, msg.member))
        except Exception as exc:  # noqa: BLE001 - e.g. the node's admin vanished
            rep.reason = f"could not start on {msg.node}: {exc}"
            self.send(sender, ReleasePlacement(msg.replica))
            self._publish()
            return
        rep.address, rep.node, rep.devices = address, msg.node, ",".join(msg.devices)
        rep.placed = (msg.node, tuple(msg.devices))
        taken = {r.slot for r in self._replicas.values() if r is not rep and r.state in LIVE_STATES}
        rep.slot = next(i for i in range(len(self._replicas) + 1) if i not in taken)
        rep.state, rep.device_wait, rep.start_phase = ReplicaState.STARTING, "", ""
        rep.reason = starting_reason(rep)
        self.send(address, StartEngine(rep.replica, spec.stage, spec.deployment, spec.heartbeat_interval_s,
                                       spec.inline_threshold_bytes, msg.node, msg.devices or None,
                                       connector_mode=spec.connector_mode,
                                       orphan_after_s=spec.supervision.missed_heartbeats * spec.heartbeat_interval_s,
                                       pool_pid=os.getpid(), pool_host=socket.gethostname(),
                                       device_wait_s=device_wait_s(spec), slot=rep.slot,
                                       processor_timeout_s=spec.supervision.stall_timeout_s))
        rep.ready_by = time.monotonic() + spec.ready_timeout_s
        self.wakeupAfter(spec.ready_timeout_s, payload=("ready_deadline", rep.replica, address))
        self._log.info("replica_launched", replica=rep.replica, node=msg.node, devices=rep.devices)
        self._publish()

    def receiveMsg_PlacementFailed(self, msg: PlacementFailed, sender):
        rep = self._replicas.get(msg.replica)
        if rep is not None and rep.state == ReplicaState.PENDING:
            changed = rep.reason != msg.reason
            rep.placing, rep.reason = False, msg.reason
            if changed:  # retried every few ticks: log and publish news only
                self._log.warning("replica_not_placed", replica=msg.replica, reason=msg.reason)
                self._publish()

    def receiveMsg_NodesChanged(self, msg: NodesChanged, sender):
        kept = [rep for rep in self._replicas.values() if msg.undrained and rep.node == msg.undrained
                and rep.linger and rep.state == ReplicaState.READY]
        for rep in kept:
            rep.linger, rep.reason = "", f"node {msg.undrained} undrained"  # (it stays)
            rep.relaunch = False
            self._log.info("replica_linger_ends", replica=rep.replica, cause="node undrained",
                           in_flight=len(rep.in_flight))
            self._retire_replacement(rep, f"not needed: {rep.replica}, which it was to replace, stays "
                                          f"(node {msg.undrained} undrained)")
        if kept:
            self._drain_pending()  # (tasks of new requests waited for them: they take those now, a review)
            self._publish()
        self._retry_placements()

    def _retire_replacement(self, rep, why: str) -> None:
        """``rep`` stays after all (its node undrained while it lingered): the replica launched to
        replace it is retired if it is not ready yet, so that the stage keeps its size (trial AW:
        a drain and an undrain 0.5 s apart left every stage with twice its replicas)."""
        new, rep.replaced_by = self._replicas.get(rep.replaced_by), ""
        if new is None or new.state not in (ReplicaState.PENDING, ReplicaState.STARTING, ReplicaState.DEAD,
                                            ReplicaState.FAILED):  # (failed: its retry would grow the stage)
            return
        self._log.info("replacement_retired", replica=new.replica, kept=rep.replica, state=new.state.value)
        if new.state == ReplicaState.STARTING:
            self._drain(new, why)
        else:
            new.state, new.reason = ReplicaState.STOPPED, why
            self._release(new)

    def _retry_placements(self) -> None:
        for rep in self._replicas.values():
            if rep.state == ReplicaState.PENDING and not rep.placing:
                self._place(rep)

    def receiveMsg_DrainNode(self, msg: DrainNode, sender):
        """Node ``msg.node``'s member stops cleanly: each of this stage's replicas there
        that runs or starts is drained (no new tasks; it stops once those in flight are
        done) and a replacement starts on another node at once. A replica pinned to the
        node starts again instead once it has stopped, and waits (``pending``) for the
        node to be back. (The coordinator answers the member that asked.)

        When no replica of the stage is READY elsewhere, those READY here are the
        stage's last: drained now, a request in flight that still needs this stage
        (in an upstream stage, or between two) would wait for a replacement that
        may never be placed, then fail (trial AP: a stream in its Talker lost its
        Code2Wav). They *linger* instead: READY, taking the tasks of the requests
        begun before (``StageTask.began_at``), until another replica of the stage
        is ready or the coordinator says none of those is in flight
        (:class:`~omni_actors.messages.NoRequestsInFlight`); then they drain. A
        request begun later is served as if the node had left already (it waits
        for a replacement, up to ``queue_timeout_s``): taken here, it would break
        when the member's drain timeout runs out (trial AS). The member waits for
        them within its drain timeout, as for any replica."""
        drained = []
        what = DRAINED_BY_OPERATOR if msg.operator else LEAVING
        back = "undrained" if msg.operator else "back"
        last = not any(r.state == ReplicaState.READY and r.node != msg.node for r in self._replicas.values())
        for rep in list(self._replicas.values()):
            if rep.node != msg.node or rep.state not in (ReplicaState.READY, ReplicaState.STARTING):
                continue
            if rep.linger:  # (drained before, its replacement launched: a second drain of the node, its
                continue    # member's leave after `node drain`, launched another; a code review)
            if rep.replica in self._pins:
                rep.relaunch = True
                why = f"node {msg.node} {what}{STARTS_AGAIN}{back}"
            else:
                new = rep.replaced_by = self._new_replica_id()
                self._launch(new)
                why = f"node {msg.node} {what} (replaced by {new})"
            if last and rep.state == ReplicaState.READY:
                rep.linger, rep.linger_since = why, time.time()
                rep.reason = (f"{why}; the last ready replica of stage {self._spec.stage.name}: it finishes the "
                              "requests begun before, and takes no new ones")
                self._log.info("replica_lingers", replica=rep.replica, node=msg.node, in_flight=len(rep.in_flight))
                continue
            self._drain(rep, why)
            drained.append(rep.replica)
        if drained:
            self._log.info("node_draining", node=msg.node, replicas=drained)
        self._publish()

    def receiveMsg_NoRequestsInFlight(self, msg: NoRequestsInFlight, sender):
        for rep in list(self._replicas.values()):
            if not rep.in_flight:
                self._end_linger(rep, "no request in flight")

    def _end_linger(self, rep, cause: str) -> None:
        """A lingering replica (see receiveMsg_DrainNode) drains now, because of ``cause``."""
        if not rep.linger:
            return
        why, rep.linger = rep.linger, ""
        if rep.state == ReplicaState.READY:
            self._log.info("replica_linger_ends", replica=rep.replica, cause=cause, in_flight=len(rep.in_flight))
            self._drain(rep, why)

    def receiveMsg_NodeLost(self, msg: NodeLost, sender):
        leaving = f"node {msg.node} {LEAVING}"
        for rep in list(self._replicas.values()):
            if msg.reason == LEFT_REASON and rep.node == msg.node and rep.state == ReplicaState.STOPPED \
                    and rep.reason and rep.reason.startswith(leaving):
                # (trial AN: once the node had left, its drained replicas still said it "is leaving")
                rep.reason = f"node {msg.node} {LEFT_REASON}" + rep.reason[len(leaving):]
                self._publish()
                continue
            if (msg.reason == LEFT_REASON and rep.node == msg.node and rep.state == ReplicaState.DEAD
                    and rep.address is None and not self._orphaned and not self._exiting):
                # Its process exit came in before its node's clean leave (the member stops its
                # actors, then leaves): not a crash after all. Placed again now; the restart it
                # was waiting for (not yet counted) then finds it placed and does nothing.
                rep.reason = rep.down_cause = f"node {msg.node} {msg.reason}"
                self._log.info("replica_exit_was_a_clean_leave", replica=rep.replica, node=msg.node)
                self._launch(rep.replica, rep.restarts)
                self._publish()
                continue
            if rep.node == msg.node and rep.state in LIVE_STATES:
                rep.reason = (f"node {msg.node} {msg.reason}" if msg.reason == LEFT_REASON  # (a clean stop)
                              else f"node {msg.node} lost: {msg.reason}")
                if rep.replaced_by:  # (still draining when its node went: it says what took its place)
                    rep.reason += f" (replaced by {rep.replaced_by})"
                if rep.address is not None:
                    # If the host is alive after all (a pause, a partition), the old
                    # engine must not keep its devices: it is told to exit.
                    self.send(rep.address, ActorExitRequest())
                # (the host, not the request; a clean leave is not the replica's fault either)
                self._gone(rep, rep.reason, crashed=False, counted=msg.reason != LEFT_REASON)
