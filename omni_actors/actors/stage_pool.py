"""StagePoolActor: owns the replicas of one stage, routes its tasks, supervises them.

Supervision follows ``omni_actors.actors.supervision`` (the policy, in one
place). In short: a replica that misses heartbeats, stalls, or trips its
circuit breaker is ISOLATED (no new work), killed, and restarted with
backoff; one whose process exits is restarted the same way; its in-flight
tasks go at once to another replica of the stage. Tasks it reported
finished just before it died are handed back to their RequestActors too:
its report to us and its results to them travel separately, and what was
still queued in the dead process is lost (a RequestActor that has the
results ignores that). A replica that fails to
load is FAILED and not retried at once (a bad model path fails the same way
again); a FAILED replica is tried once more every ``failed_retry_s``.
Tasks that find no ready replica wait up to ``queue_timeout_s`` for one (a
restart, a late start), then the request gets a clear 503.

A pool whose coordinator died (no acks, and it is no longer the pool's
parent process) drains its replicas and exits: a new coordinator makes a
new pool.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

from thespian.actors import ActorExitRequest, ActorTypeDispatcher, ChildActorExited, PoisonMessage, WakeupMessage

from omni_actors.actors.cancels import CancelledStages
from omni_actors.actors.pool_admin import PoolAdminMixin
from omni_actors.actors.pool_placement import PoolPlacementMixin
from omni_actors.actors.supervision import (WAKEUP_LOST_AFTER_S, HealthPolicy, ParentWatch, ReplicaHealth,
                                            RestartPolicy, WakeupChain, exit_if_orphaned_before_start)
from omni_actors.balancing import POLICIES, ReplicaLoad
from omni_actors.logs import get_logger
from omni_actors.placement import LEFT_REASON
from omni_actors.messages import (LATENCY_BUCKETS_S, LIVE_STATES, MAX_TASK_MOVES, PLACING, CancelStage, DrainReplica, EngineFailed,
                                  EngineReady, ErrorKind, Heartbeat, HeartbeatAck, PoolState, ReleasePlacement,
                                  ReplicaState, ReplicaStatus, StageCancelled, StageFailed, StageTask, StartPool,
                                  TaskFinished, replica_index)

#: Ticks per heartbeat interval: how often health is judged.
TICKS_PER_INTERVAL = 4
#: Missing this many coordinator acks (in intervals) means the coordinator is gone, once
#: it is no longer this process's parent either (``ParentWatch``: a busy one acks late).
ORPHAN_AFTER_INTERVALS = 5

_ROUTABLE = (ReplicaState.READY,)
#: States in which a replica has no process (any pid it had is gone).
_NO_PROCESS = (ReplicaState.FAILED, ReplicaState.STOPPED, ReplicaState.DEAD)
_ALIVE = LIVE_STATES
#: Ticks between placement retries for replicas still waiting for a node.
PLACEMENT_RETRY_TICKS = 8
#: A task still in flight this long past its request's deadline (``StageTask.timeout_s``
#: from its dispatch) was orphaned: its RequestActor ended it at the deadline, so its
#: cancel was lost or overtaken. It is cancelled and no longer counted.
TASK_OVERDUE_GRACE_S = 10.0
#: Health ticks missed, in heartbeat intervals, before a heartbeat restarts them (see _after).
TICK_LOST_AFTER_INTERVALS = 3
#: Stopped replicas (drained, scaled away) a pool keeps showing, the latest; older ones
#: leave its table, `status` and /metrics (every scale or drain made one more for good).
MAX_STOPPED_SHOWN = 8


@dataclass
class Replica:
    replica: str
    address: object  # None until placed and created
    state: ReplicaState = ReplicaState.PENDING
    reason: str = ""
    in_flight: dict[tuple[str, int], tuple[StageTask, float]] = field(default_factory=dict)
    #: tasks it reported finished lately, oldest first: (request, stage) -> (task, when)
    finished: dict[tuple[str, int], tuple[StageTask, float]] = field(default_factory=dict)
    dispatched: int = 0
    completed: int = 0
    failed: int = 0
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float | None = None
    pid: int | None = None
    node: str = ""
    host: str = ""
    devices: str = ""
    backend: str = ""
    placing: bool = False  # a PlaceReplica is out
    restarts: list[float] = field(default_factory=list)
    failed_at: float = 0.0  # when it went FAILED (its retry's wake-up carries it)
    #: why it last went down (died, isolated, failed); its next incarnation's reason says it once READY
    down_cause: str = ""
    health: ReplicaHealth | None = None
    latency: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS_S))
    latency_sum: float = 0.0


class StagePoolActor(PoolAdminMixin, PoolPlacementMixin, ActorTypeDispatcher):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._started = threading.Event()  # StartPool came (see exit_if_orphaned_before_start)
        exit_if_orphaned_before_start(self._started)
        self._spec: StartPool | None = None
        self._coordinator = None
        self._replicas: dict[str, Replica] = {}
        self._pending: list[tuple[StageTask, float]] = []
        #: cancels that came before their task (see actors.cancels)
        self._cancelled_early = CancelledStages()
        self._hold_until = 0.0  # the backlog kept for replicas still starting goes out by then
        self._next_index = 0
        self._pins: dict[str, tuple[str, tuple[str, ...]]] = {}  # replica -> (node, devices) it is pinned to
        self._last_ack = time.monotonic()
        self._orphaned = False
        self._parent = ParentWatch(0, "")
        self._last_tick = 0.0  # when the last health tick ran (monotonic)
        self._ticks_chain = WakeupChain("tick")  # (restarted by a heartbeat when its wake-up is lost)
        self._timers: dict[tuple, float] = {}  # wake-ups asked for (see _after) -> when due
        self._exiting = False  # told to exit (system stop, stage removed): replicas exiting is expected
        self._ticks = 0
        self._log = get_logger(actor="pool")

    # -- set-up -----------------------------------------------------------
    def receiveMsg_StartPool(self, msg: StartPool, sender):
        if self._spec is not None:
            return
        self._spec, self._coordinator = msg, sender
        self._started.set()
        self._parent = ParentWatch(msg.coordinator_pid, msg.coordinator_host)
        sup = msg.supervision
        self._policy = POLICIES[msg.load_balancing]
        self._health = HealthPolicy(msg.heartbeat_interval_s, sup.missed_heartbeats, sup.stall_timeout_s,
                                    sup.circuit_breaker_failures)
        r = sup.restart
        self._restart = RestartPolicy(r.initial_backoff_s, r.max_backoff_s, r.max_restarts, r.window_s,
                                      r.failed_retry_s)
        # A hung replica is found out within this (missed heartbeats or a stall), plus a margin:
        # results it had not sent by then are lost with it.
        self._finished_window_s = max(sup.missed_heartbeats * msg.heartbeat_interval_s, sup.stall_timeout_s) + 1.0
        self._log = self._log.bind(stage=msg.stage.name)
        self._next_index = msg.next_index
        if msg.replicas is None:
            for _ in range(msg.deployment.replicas):
                self._launch(self._new_replica_id())
        else:  # recreated after a crash: the replicas the last pool ran, under their names
            for rid, pin, restarts, (completed, failed, buckets, latency_sum) in msg.replicas:
                self._next_index = max(self._next_index, replica_index(rid) + 1)
                if pin:
                    self._pins[rid] = (pin[0], tuple(pin[1]))
                self._launch(rid, list(restarts))
                rep = self._replicas[rid]  # (its counters go on, as after a restart)
                rep.completed, rep.failed, rep.latency_sum = completed, failed, latency_sum
                if len(buckets) == len(rep.latency):
                    rep.latency = list(buckets)
        self._start_ticks()
        self._publish()

    def _start_ticks(self) -> None:
        """Start a (new) chain of health ticks; a tick of an older chain is ignored."""
        self._ticks_chain.start(self, self._spec.heartbeat_interval_s / TICKS_PER_INTERVAL)

    def _after(self, delay: float, payload: tuple) -> None:
        """``wakeupAfter`` that a lost wake-up cannot defeat: the tick runs it late instead.

        Thespian drops the wake-ups that fall due while an actor drains an excessive
        transmit queue ("tx-only mode", over 950 messages queued: seen in a storm of
        client hang-ups), and a restart or a retry of a failed replica would then never
        happen (the ready deadline, whose payload holds an unhashable ActorAddress, is not
        tracked). Each handler is guarded, so running one twice changes nothing."""
        self._timers[payload] = time.monotonic() + delay
        self.wakeupAfter(delay, payload=payload)

    def _run_lost_timers(self, now: float) -> None:
        """Run the wake-ups asked for with _after that are over WAKEUP_LOST_AFTER_S late."""
        for payload in [p for p, due in self._timers.items() if now > due + WAKEUP_LOST_AFTER_S]:
            self._log.warning("wakeup_lost", payload=str(payload))
            del self._timers[payload]
            self._on_timer(payload)

    def _new_replica_id(self) -> str:
        rid = f"{self._spec.stage.name}/{self._next_index}"
        self._next_index += 1
        return rid

    def _launch(self, replica_id: str, restarts: list[float] | None = None) -> None:
        """Ask the coordinator where the replica goes; it starts on :class:`Placement`."""
        rep = Replica(replica_id, None, restarts=restarts or [], reason=PLACING)
        old = self._replicas.get(replica_id)
        if old is not None:  # a restart: its counters go on (a Prometheus counter must not go back)
            rep.dispatched, rep.completed, rep.failed = old.dispatched, old.completed, old.failed
            rep.down_cause = old.down_cause
            rep.latency, rep.latency_sum = old.latency, old.latency_sum
        self._replicas[replica_id] = rep
        self._place(rep)

    # -- registration -----------------------------------------------------
    def receiveMsg_EngineReady(self, msg: EngineReady, sender):
        rep = self._replicas.get(msg.replica)
        if rep and rep.state == ReplicaState.STARTING:
            now = time.monotonic()
            # After a restart, READY says when and why it was down (RESTARTS alone does not).
            rep.state, rep.reason = ReplicaState.READY, (
                f"{'placed again' if LEFT_REASON in rep.down_cause else 'restarted'} at "
                f"{time.strftime('%H:%M:%S')}; it was down: {rep.down_cause}" if rep.down_cause else "")
            rep.pid, rep.host, rep.backend = msg.pid, msg.host, msg.backend
            rep.devices = msg.devices or rep.devices
            rep.health = ReplicaHealth(last_heartbeat=now, progress_at=now)
            self._log.info("replica_ready", replica=msg.replica, engine_pid=msg.pid, node=msg.node)
            self._publish()
            self._drain_pending()

    def receiveMsg_EngineFailed(self, msg: EngineFailed, sender):
        rep = self._replicas.get(msg.replica)
        if rep is None or rep.state not in _ALIVE:
            return
        if rep.state == ReplicaState.READY:
            self._isolate(rep, f"engine died: {msg.reason}", crashed=True)  # it ran before: restart it
            return
        self._set_down(rep, ReplicaState.FAILED, msg.reason)  # it never loaded: not at once (fails the same way)
        self.send(rep.address, ActorExitRequest())

    def receiveMsg_Heartbeat(self, msg: Heartbeat, sender):
        rep = self._replicas.get(msg.replica)
        if rep is None or rep.address != sender:
            # An engine we gave up on (its node was declared lost, it was replaced):
            # no ack, and an exit request, so it does not hold devices twice.
            self.send(sender, ActorExitRequest())
            return
        self.send(sender, HeartbeatAck())
        now = time.monotonic()
        if self._last_tick and now - self._last_tick > TICK_LOST_AFTER_INTERVALS * self._spec.heartbeat_interval_s:
            # The tick's wake-up was lost (see _after): supervision would stop for good.
            self._log.warning("pool_tick_lost", since_s=round(now - self._last_tick, 2))
            self._start_ticks()
            self._tick()
        if rep is not None and rep.health is not None:
            rep.running, rep.waiting, rep.kv_cache_usage = msg.running, msg.waiting, msg.kv_cache_usage
            rep.health.on_heartbeat(time.monotonic(), msg.progress, msg.idle_s)

    def receiveMsg_PoolStateAck(self, msg, sender):
        self._last_ack = time.monotonic()

    # -- supervision ------------------------------------------------------
    def receiveMsg_WakeupMessage(self, msg: WakeupMessage, sender):
        payload = msg.payload
        if self._ticks_chain.owns(payload):
            if self._ticks_chain.current(payload):
                self._tick()
                self._ticks_chain.again(self, self._spec.heartbeat_interval_s / TICKS_PER_INTERVAL)
        else:
            if isinstance(payload, tuple) and payload[0] in ("restart", "retry_failed"):
                self._timers.pop(payload, None)  # (others may hold an unhashable ActorAddress)
            self._on_timer(payload)

    def _on_timer(self, payload) -> None:
        if isinstance(payload, tuple) and payload[0] == "ready_deadline":
            rep = self._replicas.get(payload[1])
            if rep is not None and rep.address == payload[2] and rep.state == ReplicaState.STARTING:
                self._set_down(rep, ReplicaState.FAILED,
                               f"did not become ready within {self._spec.ready_timeout_s:g} s")
                self._kill(rep)
        elif isinstance(payload, tuple) and payload[0] == "retry_failed":
            rep = self._replicas.get(payload[1])
            if (rep is not None and rep.state == ReplicaState.FAILED and rep.failed_at == payload[2]
                    and not self._orphaned and not self._exiting):
                self._log.warning("replica_retry_after_failure", replica=rep.replica, reason=rep.reason)
                if rep.address is not None:  # (its process should be gone; make sure)
                    self._kill(rep)
                rep.restarts.append(time.monotonic())  # (RESTARTS counts the retries too)
                self._launch(rep.replica, rep.restarts)
                self._publish()
        elif isinstance(payload, tuple) and payload[0] == "restart":
            rep = self._replicas.get(payload[1])
            if rep is not None and rep.state == ReplicaState.DEAD and not self._orphaned:
                rep.restarts.append(time.monotonic())
                self._launch(rep.replica, rep.restarts)
                self._publish()

    def _tick(self) -> None:
        now = time.monotonic()
        self._ticks += 1
        period = self._spec.heartbeat_interval_s / TICKS_PER_INTERVAL
        late = now - self._last_tick - period if self._last_tick else 0.0
        self._last_tick = now
        if late > self._spec.heartbeat_interval_s:
            # This pool did not run for a while (swamped by a burst, starved of CPU, stopped):
            # the heartbeats sent meanwhile are still queued, unread. Time it did not listen
            # is neither its replicas' silence nor their lack of progress.
            self._log.warning("pool_tick_late", late_s=round(late, 2))
            for rep in self._replicas.values():
                if rep.health is not None:
                    rep.health.last_heartbeat = min(now, rep.health.last_heartbeat + late)
                    rep.health.progress_at = min(now, rep.health.progress_at + late)
        self._run_lost_timers(now)
        if self._ticks % TICKS_PER_INTERVAL == 0:
            self._cancel_overdue(now)
            self._publish()  # load figures once per interval; state changes publish at once
        for rep in list(self._replicas.values()):
            if rep.state == ReplicaState.READY and rep.health is not None:
                why = self._health.verdict(rep.health, now, len(rep.in_flight))
                if why:  # (stalled running its tasks counts against them; silence may be a lost host)
                    self._isolate(rep, why, crashed=not self._health.silent(rep.health, now))
            elif rep.state == ReplicaState.DRAINING and not rep.in_flight:
                self.send(rep.address, DrainReplica(rep.replica))
        if self._ticks % PLACEMENT_RETRY_TICKS == 0:
            self._retry_placements()  # devices may have been freed by another stage
        expired = [(t, d) for t, d in self._pending if now >= d]
        if expired:
            self._pending = [(t, d) for t, d in self._pending if now < d]
            for task, _ in expired:
                self._reject(task, f"no ready replica of stage {self._spec.stage.name} within "
                                   f"{self._spec.supervision.queue_timeout_s:g} s ({self._describe()})")
        if self._hold_until and now >= self._hold_until:
            self._drain_pending()  # the backlog kept for replicas that are still starting
        if not self._orphaned and self._parent.lost(
                now - self._last_ack > ORPHAN_AFTER_INTERVALS * self._spec.heartbeat_interval_s):
            self._orphaned = True
            self._log.warning("coordinator_lost_draining")
            for rep in self._replicas.values():
                if rep.state in _ALIVE:
                    self.send(rep.address, DrainReplica(rep.replica))
        if self._orphaned and not any(r.state in _ALIVE and r.address is not None
                                      for r in self._replicas.values()):
            self.send(self.myAddress, ActorExitRequest())

    def _isolate(self, rep: Replica, why: str, hard: bool = True, crashed: bool = False) -> None:
        """Take ``rep`` out of routing, re-dispatch its work and end its process:
        SIGKILL when ``hard`` and local (hung replicas), else an exit request.
        ``crashed``: its engine died, hung or stalled running its tasks (counts
        against each of them, see :meth:`_elsewhere`)."""
        self._log.error("replica_isolated", replica=rep.replica, reason=why)
        rep.state, rep.reason = ReplicaState.ISOLATED, why
        self._redispatch(rep, crashed=crashed)
        if not hard and rep.address is not None:
            self.send(rep.address, ActorExitRequest())
        elif not self._kill(rep):
            # On another host: no ChildActorExited may ever come (the host may be gone).
            self._gone(rep, why)
        self._publish()

    def _kill(self, rep: Replica) -> bool:
        """SIGKILL a replica on this host (a hung process cannot take an exit
        request) and return True; elsewhere, ask it to exit and return False."""
        if rep.pid and rep.host == socket.gethostname():
            try:
                os.kill(rep.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return True
        if rep.address is not None:
            self.send(rep.address, ActorExitRequest())
        return False

    def _set_down(self, rep: Replica, state: ReplicaState, reason: str) -> None:
        rep.down_cause = reason
        if state == ReplicaState.FAILED:
            reason += self._retry_later(rep)
        rep.state, rep.reason = state, reason
        self._log.error("replica_down", replica=rep.replica, state=state.value, reason=reason)
        self._redispatch(rep)
        self._release(rep)
        self._publish()

    def _retry_later(self, rep: Replica) -> str:
        """Schedule one more try of the FAILED ``rep`` after ``failed_retry_s``;
        returns what to add to its reason ("" when it will not be tried again)."""
        after = self._restart.failed_retry_s
        if not after or self._orphaned or self._exiting:
            return ""
        rep.failed_at = time.monotonic()
        self._after(after, ("retry_failed", rep.replica, rep.failed_at))
        return f"; next try in {after:g} s (at {time.strftime('%H:%M:%S', time.localtime(time.time() + after))})"

    def _release(self, rep: Replica) -> None:
        if self._coordinator is not None:
            self.send(self._coordinator, ReleasePlacement(rep.replica))

    def receiveMsg_ChildActorExited(self, msg: ChildActorExited, sender):
        rep = next((r for r in self._replicas.values() if r.address == msg.childAddress), None)
        if rep is not None:
            self._gone(rep, rep.reason if rep.state == ReplicaState.ISOLATED else "process exited")

    def _gone(self, rep: Replica, cause: str, crashed: bool = True, counted: bool = True) -> None:
        """The replica's process is gone (exited, killed, or lost with its node):
        free its devices, re-dispatch its work, and restart it if it should run.
        ``counted=False`` (its node left cleanly): placed again at once, and not
        a restart (no back-off, not in RESTARTS, not towards ``max_restarts``)."""
        rep.address = None  # a late ChildActorExited for it changes nothing
        if rep.state in (ReplicaState.FAILED, ReplicaState.STOPPED):
            self._release(rep)
            self._redispatch(rep)
            self._publish()
            return
        if rep.state == ReplicaState.DRAINING:
            self._release(rep)
            rep.state, rep.reason = ReplicaState.STOPPED, rep.reason or "drained"
            self._redispatch(rep)
            self._publish()
            return
        rep.state, rep.reason, rep.down_cause = ReplicaState.DEAD, cause, cause
        # (at info when the pool itself is exiting: Thespian stops its children with it)
        (self._log.info if self._exiting or not counted else self._log.error)(
            "replica_exited", replica=rep.replica, reason=cause, pool_exiting=self._exiting)
        self._redispatch(rep, crashed=crashed and not self._exiting)
        self._hand_back_finished(rep, cause)
        if not counted and not self._orphaned and not self._exiting:
            if not self._pins.get(rep.replica, ("", ()))[1]:
                self._release(rep)  # (pinned: it waits for its node to come back)
            self._launch(rep.replica, rep.restarts)
            self._publish()
            return
        now = time.monotonic()
        delay = None if self._orphaned else self._restart.next_delay(rep.restarts, now)
        if self._orphaned:  # the coordinator's next pool starts it again
            self._release(rep)
            rep.state, rep.reason = ReplicaState.FAILED, f"{cause}; not restarted: its pool lost the coordinator"
        elif delay is None:
            self._release(rep)
            rep.state = ReplicaState.FAILED
            rep.reason = (f"{cause}; gave up after {self._restart.recent(rep.restarts, now)} restarts in "
                          f"{self._restart.window_s:g} s{self._retry_later(rep)}")
        else:
            if not self._pins.get(rep.replica, ("", ()))[1]:
                self._release(rep)  # a replica pinned to devices keeps them for its restart
            rep.reason = f"{cause}; restarting in {delay:g} s"
            self._after(delay, ("restart", rep.replica))
        self._publish()

    def _redispatch(self, rep: Replica, crashed: bool = False) -> None:
        """Send the replica's tasks elsewhere; ``crashed``: it died running them
        (not drained or stopped on purpose), which counts against each task."""
        tasks, rep.in_flight = [t for t, _ in rep.in_flight.values()], {}
        for task in tasks:
            self._elsewhere(task, rep.replica, f"{rep.state.value}: {rep.reason}", crashed=crashed)

    def _hand_back_finished(self, rep: Replica, cause: str) -> None:
        """The replica died: its tasks that finished within the window may have lost
        their results (queued behind our TaskFinished in the dead process). Their
        RequestActors retry those they still wait for and ignore the others."""
        horizon = time.monotonic() - self._finished_window_s
        for task, at in rep.finished.values():
            if at >= horizon:
                self.send(task.reply_to, StageFailed(
                    task.request_id, task.stage_id, rep.replica, ErrorKind.UNAVAILABLE,
                    f"replica {rep.replica} died ({cause}) right after this task: its results were lost",
                    task.attempt, task.crashed, task.moved + 1))
        rep.finished.clear()

    def _elsewhere(self, task: StageTask, replica: str, why: str, crashed: bool = False) -> None:
        """``task`` cannot finish on ``replica``: send it to another one, or, for a
        streaming task, tell its RequestActor (chunks already went out from or into
        that replica: it retries the streaming stages together, or fails the request).
        ``crashed``: the replica died running it; after ``max_task_crashes`` such
        deaths the task is failed (``ErrorKind.CRASHED``), not retried. Otherwise
        (its host was lost or left, it drained or refused the task) the move is not
        counted as an attempt (``StageTask.moved``)."""
        if not crashed:
            task = dataclasses.replace(task, moved=task.moved + 1)
        if crashed:
            task = dataclasses.replace(task, crashed=task.crashed + (replica,))
            limit = self._spec.supervision.max_task_crashes
            if len(task.crashed) >= limit:
                self._log.error("task_crashed_replicas", request_id=task.request_id, replicas=list(task.crashed))
                self.send(task.reply_to, StageFailed(
                    task.request_id, task.stage_id, replica, ErrorKind.CRASHED,
                    f"stage {self._spec.stage.name}: {len(task.crashed)} replicas died while running this "
                    f"request ({', '.join(task.crashed)}; the last: {why}); not retried, it may be what "
                    f"crashes them (supervision.max_task_crashes: {limit})", task.attempt, task.crashed,
                    task.moved))
                return
        if task.streaming:
            self.send(task.reply_to, StageFailed(task.request_id, task.stage_id, replica, ErrorKind.UNAVAILABLE,
                                                 f"replica {replica} {why} mid-stream", task.attempt,
                                                 task.crashed, task.moved))
            return
        self._log.warning("task_redispatched", request_id=task.request_id, replica=replica,
                          attempt=task.attempt + 1)
        retry = dataclasses.replace(task, attempt=task.attempt + 1, exclude=task.exclude + (replica,))
        self._route(retry, why=f"replica {replica} {why}")

    def receiveMsg_PoisonMessage(self, msg: PoisonMessage, sender):
        poisoned = msg.poisonMessage
        self._log.error("poison_message", message_type=type(poisoned).__name__, details=str(msg.details))
        if isinstance(poisoned, StageTask):
            rep = next((r for r in self._replicas.values() if r.address == sender), None)
            if rep is not None:
                rep.in_flight.pop((poisoned.request_id, poisoned.stage_id), None)
            self._route(dataclasses.replace(poisoned, attempt=poisoned.attempt + 1,
                                            exclude=poisoned.exclude + ((rep.replica,) if rep else ())),
                        why="the replica could not take the task")

    def receiveMsg_ActorExitRequest(self, msg, sender):
        self._orphaned = True  # shutting down: replicas that exit now are not restarted
        self._exiting = True
        return None  # Thespian sends our children their own exit requests

    # -- request plane ----------------------------------------------------
    def receiveMsg_StageTask(self, msg: StageTask, sender):
        if self._cancelled_early.take((msg.request_id, msg.stage_id)):
            self.send(msg.reply_to, StageCancelled(msg.request_id, msg.stage_id, msg.attempt))
            return
        self._route(msg)

    def _route(self, task: StageTask, why: str = "") -> None:
        if task.counted_attempts >= self._spec.supervision.max_task_attempts or task.moved > MAX_TASK_MOVES:
            self._reject(task, f"stage {self._spec.stage.name}: gave up after {task.counted_attempts} attempts"
                               + (f" and {task.moved} moves" if task.moved else "") + f" ({why})")
            return
        ready = [r for r in self._replicas.values() if r.state in _ROUTABLE and r.replica not in task.exclude]
        if not ready:
            ready = [r for r in self._replicas.values() if r.state in _ROUTABLE]
        chosen = self._policy([ReplicaLoad(r.replica, len(r.in_flight), r.dispatched) for r in ready])
        if chosen is None:
            if any(r.state in (ReplicaState.PENDING, ReplicaState.STARTING, ReplicaState.DEAD,
                               ReplicaState.ISOLATED)
                   for r in self._replicas.values()) and self._spec.supervision.queue_timeout_s > 0:
                self._pending.append((task, time.monotonic() + self._spec.supervision.queue_timeout_s))
            else:
                self._reject(task, f"no ready replica of stage {self._spec.stage.name} ({self._describe()})")
            return
        rep = self._replicas[chosen]
        now = time.monotonic()
        rep.health.on_dispatch(now, was_idle=not rep.in_flight)
        rep.in_flight[(task.request_id, task.stage_id)] = (task, now)
        rep.dispatched += 1
        self.send(rep.address, task)

    def _drain_pending(self) -> None:
        """Route the tasks that waited for a ready replica. While other replicas of the
        stage are starting, the ready ones take their share of the backlog and the rest
        waits for the others, at most a heartbeat interval (then it goes to whoever is
        ready): the first replica up would otherwise take all of it (after a pool was
        recreated: every task its RequestActors re-sent)."""
        pending, self._pending = self._pending, []
        now = time.monotonic()
        ready = sum(r.state in _ROUTABLE for r in self._replicas.values())
        starting = sum(r.state == ReplicaState.STARTING for r in self._replicas.values())
        take = len(pending)
        if starting and ready and pending:
            if not self._hold_until:
                self._hold_until = now + self._spec.heartbeat_interval_s
            if now < self._hold_until:
                take = -(-len(pending) * ready // (ready + starting))
        if take == len(pending):
            self._hold_until = 0.0
        for task, _ in pending[:take]:
            self._route(task)
        self._pending = pending[take:] + self._pending

    def _reject(self, task: StageTask, message: str) -> None:
        self.send(task.reply_to, StageFailed(task.request_id, task.stage_id, "", ErrorKind.UNAVAILABLE, message,
                                             task.attempt, task.crashed, task.moved))

    def _describe(self) -> str:
        return "; ".join(f"{r.replica} {r.state.value}" + (f": {r.reason}" if r.reason else "")
                         for r in self._replicas.values()) or "no replicas"

    def receiveMsg_TaskFinished(self, msg: TaskFinished, sender):
        rep = self._replicas.get(msg.replica)
        if rep is None:
            return
        entry = rep.in_flight.pop((msg.request_id, msg.stage_id), None)
        if entry is None:
            return
        if msg.rejected:  # it did not run there (the replica drains or is not ready)
            if msg.reason == "draining" and rep.state == ReplicaState.READY:
                # It drains on its own (it missed our acks): no more work; when it
                # exits it is restarted as any isolated replica is.
                rep.state, rep.reason = ReplicaState.ISOLATED, "drained itself: it heard nothing from its pool"
                self._publish()
            self._elsewhere(entry[0], rep.replica, f"is {msg.reason}")
            return
        now = time.monotonic()
        if not msg.cancelled:
            rep.finished[(msg.request_id, msg.stage_id)] = (entry[0], now)
            while rep.finished and next(iter(rep.finished.values()))[1] < now - self._finished_window_s:
                del rep.finished[next(iter(rep.finished))]
        if msg.ok:
            rep.completed += 1
            took = now - entry[1]
            rep.latency[next(i for i, b in enumerate(LATENCY_BUCKETS_S) if took <= b)] += 1
            rep.latency_sum += took
        elif msg.cancelled:
            pass  # the client went away: says nothing about the replica's health
        elif not msg.client_error:
            rep.failed += 1  # (a client's bad request, a 400, is no failure of the replica)
        if rep.health is not None and not msg.cancelled and not msg.input_error:
            rep.health.on_task_done(msg.ok, now, dispatched_at=entry[1])
            if not msg.ok and rep.state == ReplicaState.READY:
                # judge now: a success before the next tick would reset the breaker's count
                why = self._health.verdict(rep.health, now, len(rep.in_flight))
                if why:
                    # It answers (it just reported a failure): ask it to exit rather than
                    # SIGKILL it, so the messages it has sent (the failure itself) are not
                    # lost in transit with its process.
                    self._isolate(rep, why, hard=False)
                    return
        if rep.state == ReplicaState.DRAINING and not rep.in_flight:
            self.send(rep.address, DrainReplica(rep.replica))

    def _cancel_overdue(self, now: float) -> None:
        """Cancel tasks in flight past their request's deadline plus :data:`TASK_OVERDUE_GRACE_S`."""
        for rep in self._replicas.values():
            overdue = [key for key, (task, at) in rep.in_flight.items()
                       if task.timeout_s and now - at > task.timeout_s + TASK_OVERDUE_GRACE_S]
            for key in overdue:
                task, at = rep.in_flight.pop(key)
                self._log.warning("task_outlived_request", replica=rep.replica, request_id=task.request_id,
                                  in_flight_s=round(now - at, 1), request_timeout_s=task.timeout_s)
                if rep.address is not None:
                    self.send(rep.address, CancelStage(task.request_id, task.stage_id))

    def receiveMsg_CancelStage(self, msg: CancelStage, sender):
        key = (msg.request_id, msg.stage_id)
        queued = [(t, d) for t, d in self._pending if (t.request_id, t.stage_id) == key]
        if queued:
            self._pending = [(t, d) for t, d in self._pending if (t.request_id, t.stage_id) != key]
            for task, _ in queued:  # it never ran: confirm the cancel here (the engine does otherwise)
                self.send(task.reply_to, StageCancelled(task.request_id, task.stage_id, task.attempt))
        found = bool(queued)
        for rep in self._replicas.values():
            if key in rep.in_flight:
                self.send(rep.address, msg)
                found = True
        if not found:  # (its task may still be on its way here)
            self._cancelled_early.add(key)

    # -- status -----------------------------------------------------------
    def _prune_stopped(self) -> None:
        """Forget the oldest stopped replicas beyond :data:`MAX_STOPPED_SHOWN` (names are not reused)."""
        stopped = [name for name, r in self._replicas.items() if r.state == ReplicaState.STOPPED and not r.in_flight]
        for name in stopped[:max(0, len(stopped) - MAX_STOPPED_SHOWN)]:
            del self._replicas[name]
            self._pins.pop(name, None)

    def _publish(self) -> None:
        if self._coordinator is None:
            return
        self._prune_stopped()
        now = time.monotonic()
        # A replica with no process has no pid and no load (not its last heartbeat's figures)
        replicas = tuple(
            ReplicaStatus(
                replica=r.replica, state=r.state, reason=r.reason, in_flight=len(r.in_flight),
                running=r.running if r.state not in _NO_PROCESS else 0,
                waiting=r.waiting if r.state not in _NO_PROCESS else 0, completed=r.completed, failed=r.failed,
                last_heartbeat_age_s=None if r.health is None else round(now - r.health.last_heartbeat, 3),
                pid=r.pid if r.state not in _NO_PROCESS else None,
                node=r.node, devices=r.devices, backend=r.backend, restarts=len(r.restarts),
                rate=round(r.health.rate(), 2) if r.health and r.state not in _NO_PROCESS else 0.0,
                kv_cache_usage=r.kv_cache_usage if r.state not in _NO_PROCESS else None,
                latency_buckets=tuple(r.latency), latency_sum_s=round(r.latency_sum, 6),
                pin=self._pins.get(r.replica, ()))
            for r in self._replicas.values())
        self.send(self._coordinator, PoolState(self._spec.stage.stage_id, self._spec.stage.name, replicas,
                                               pid=os.getpid(), pending=len(self._pending),
                                               restart_times=tuple((r.replica, tuple(r.restarts))
                                                                   for r in self._replicas.values() if r.restarts),
                                               next_index=self._next_index))
