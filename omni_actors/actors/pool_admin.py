"""The stage pool's admin requests: fault injection, drain, scale, launch.

A mixin of :class:`~omni_actors.actors.stage_pool.StagePoolActor` (it uses the
pool's replica table and helpers); each request is answered with an
:class:`~omni_actors.messages.AdminReply` to its ``reply_to``.
"""

from __future__ import annotations

import dataclasses

from omni_actors.config import MAX_REPLICAS
from omni_actors.messages import LIVE_STATES as _ALIVE
from omni_actors.messages import (AdminReply, DrainReplica, FaultKind, InjectFault, LaunchReplicas, ReplicaState,
                                  ScaleStage, replica_index)

#: ``scale`` down retires replicas in this order of state (a ready one last; a draining one is
#: pinned to a drained node, to start there again once it is undrained: it serves nothing new).
_RETIRE_ORDER = {ReplicaState.DRAINING: 0, ReplicaState.PENDING: 0, ReplicaState.DEAD: 1, ReplicaState.ISOLATED: 2,
                 ReplicaState.STARTING: 3, ReplicaState.READY: 4}


class PoolAdminMixin:
    #: States of the replicas that count toward a stage's size (``scale`` and ``launch``).
    _COUNTED = (ReplicaState.PENDING, ReplicaState.STARTING, ReplicaState.READY, ReplicaState.DEAD,
                ReplicaState.ISOLATED)

    def receiveMsg_InjectFault(self, msg: InjectFault, sender):
        rep = self._replicas.get(msg.replica)
        if rep is None or rep.state not in _ALIVE:
            # (worded as the signal faults' refusal: trial BS read "no live replica" for one and
            # "is stopped, not running" for the other)
            self.send(msg.reply_to or sender, AdminReply(False, f"no live replica {msg.replica}" if rep is None
                                                         else f"{msg.replica} is {rep.state.value}, not running "
                                                              "(see `status`)"))
            return
        had = rep.fault
        rep.fault_seq += 1
        self.send(rep.address, dataclasses.replace(msg, seq=rep.fault_seq))
        rep.fault = msg.describe()  # (shown at once: its engine's heartbeats said it up to an interval later)
        self._publish()
        self._log.warning("fault_injected", target=msg.replica, replica=msg.replica, **msg.log_fields())
        done = (f"injected {msg.describe()} into {msg.replica}" if msg.kind != FaultKind.CLEAR
                else f"cleared faults of {msg.replica} ({had})" if had
                else f"no fault injected into {msg.replica}: nothing to clear")  # (trial BY: "cleared" twice)
        self.send(msg.reply_to or sender, AdminReply(True, done))

    def receiveMsg_DrainReplica(self, msg: DrainReplica, sender):
        rep = self._replicas.get(msg.replica)
        if rep is None:
            self.send(msg.reply_to or sender, AdminReply(False, f"no replica named {msg.replica!r} (see `status`)"))
            return
        if rep.state not in (ReplicaState.READY, ReplicaState.STARTING):
            self.send(msg.reply_to or sender, AdminReply(
                False, f"{msg.replica} is {rep.state.value}, not ready or starting: nothing to drain"))
            return
        others = [r for r in self._replicas.values() if r is not rep and r.state in self._COUNTED]
        self._drain(rep, "drained on request", for_good=True)
        note = "" if others else f"; it was the last replica of stage {self._spec.stage.name}{self._unserved()}"
        self.send(msg.reply_to or sender,
                  AdminReply(True, f"draining {msg.replica} ({len(rep.in_flight)} in flight){note}"))

    def _unserved(self) -> str:
        return ": its requests get 503 until another is ready (`stage scale` / `stage launch`)"

    def _drain(self, rep, why: str, for_good: bool = False) -> None:
        """Drain ``rep``; ``for_good`` (an operator's `stage drain`, a scale down): a pinned
        replica drained off its node does not start there again, nor does a lingering one
        linger on (a code review: `stage scale 0` of one came back after `node undrain`). A
        node's drain or leave keeps a pinned replica's ``relaunch``."""
        if for_good:
            rep.relaunch, rep.linger = False, ""
        rep.state, rep.reason = ReplicaState.DRAINING, why
        self._log.info("replica_draining", replica=rep.replica, in_flight=len(rep.in_flight))
        if not rep.in_flight:
            self.send(rep.address, DrainReplica(rep.replica))
        self._publish()

    def receiveMsg_ScaleStage(self, msg: ScaleStage, sender):
        # The size asked for is the size wanted: FAILED replicas (not counted) are not tried
        # again after failed_retry_s on top of it; new ones take their place.
        for rep in self._replicas.values():
            if rep.state == ReplicaState.FAILED:
                why = rep.reason.split("; next try in")[0]
                rep.state, rep.reason = ReplicaState.STOPPED, f"{why}; not tried again: scaled to {msg.replicas}"
        # (a lingering replica, its replacement on its way, is not counted: it goes once that one
        # is ready; a code review's `scale 1` retired the replacement and left none. A pinned one
        # lingers with no replacement, to start again where it was pinned: it counts)
        live = [r for r in self._replicas.values()
                if (r.state in self._COUNTED and not (r.linger and r.replaced_by))
                or (r.state == ReplicaState.DRAINING and r.relaunch)]  # (it starts again on its node)
        if not 0 <= msg.replicas <= MAX_REPLICAS:  # (the CLI checks first; this is for any other sender)
            self.send(msg.reply_to or sender, AdminReply(False, f"replicas must be from 0 to {MAX_REPLICAS}"))
            return
        changed = ""
        if msg.replicas > len(live):
            launched = [self._new_replica_id() for _ in range(msg.replicas - len(live))]
            for rid in launched:
                self._launch(rid)
            changed = "; launched " + ", ".join(launched)
        elif msg.replicas < len(live):
            # retire those furthest from serving first (pending, then restarting, starting, isolated;
            # a ready one last: a trial's scale 2 -> 1 stopped the only ready replica and kept one
            # pending that could never be placed), then the least busy, newest first
            retired = sorted(live, key=lambda r: (_RETIRE_ORDER.get(r.state, len(_RETIRE_ORDER)), len(r.in_flight),
                                                  -replica_index(r.replica)))[:len(live) - msg.replicas]
            for rep in retired:
                if rep.state in (ReplicaState.DEAD, ReplicaState.PENDING):
                    rep.state, rep.reason = ReplicaState.STOPPED, msg.why
                    self._release(rep)
                elif rep.state == ReplicaState.DRAINING:  # (pinned, off a drained node: it stays off)
                    rep.relaunch, rep.reason = False, msg.why
                else:
                    self._drain(rep, msg.why, for_good=True)
            changed = "; retiring " + ", ".join(f"{r.replica} ({r.state.value})"  # (draining, or stopped)
                                                for r in sorted(retired, key=lambda r: replica_index(r.replica)))
        self._publish()
        note = f"; stage {self._spec.stage.name} has no replica now{self._unserved()}" if live and not msg.replicas else ""
        self.send(msg.reply_to or sender, AdminReply(
            True, f"{self._spec.stage.name}: {len(live)} -> {msg.replicas} replicas{changed}{note}"))

    def receiveMsg_LaunchReplicas(self, msg: LaunchReplicas, sender):
        """Add replicas; each pinned one (``msg.pins``, checked by the coordinator) keeps its
        node and devices for life, restarts included."""
        before = sum(1 for r in self._replicas.values() if r.state in self._COUNTED)
        pins = msg.pins or ((None,) * (msg.replicas or 1))
        if before + len(pins) > MAX_REPLICAS:
            self.send(msg.reply_to or sender, AdminReply(
                False, f"{self._spec.stage.name} has {before} replicas: {len(pins)} more would pass {MAX_REPLICAS}"))
            return
        launched = []
        for pin in pins:
            rid = self._new_replica_id()
            if pin is not None:
                self._pins[rid] = (pin[0], tuple(pin[1]))
            launched.append(rid + (f" on {pin[0]}" + (f" devices {','.join(pin[1])}" if pin[1] else "")
                                   if pin else ""))
            self._launch(rid)
        self._log.info("replicas_launched", replicas=launched)
        self._publish()
        self.send(msg.reply_to or sender, AdminReply(
            True, f"{self._spec.stage.name}: {before} -> {before + len(pins)} replicas; launched "
                  + ", ".join(launched)))

