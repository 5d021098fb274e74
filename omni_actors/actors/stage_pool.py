"""StagePoolActor: owns the replicas of one stage, routes its tasks, supervises them.

Its parts: placement (``pool_placement``), routing and the tasks of replicas that
go (``pool_routing``), scaling and draining asked for by the admin (``pool_admin``);
this module holds the replicas' lifecycle, supervision and status.

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

import os
import signal
import threading
import time
from dataclasses import dataclass, field

from thespian.actors import ActorExitRequest, ActorTypeDispatcher, ChildActorExited, WakeupMessage

from omni_actors.actors.cancels import CancelledStages
from omni_actors.actors.engine import EXIT_GRACE_S, SHUTDOWN_TIMEOUT_S
from omni_actors.actors.pool_admin import PoolAdminMixin
from omni_actors.actors.pool_placement import PoolPlacementMixin, down_phrase, moved_on_purpose, starting_reason
from omni_actors.actors.pool_routing import TASK_OVERDUE_GRACE_S, PoolRoutingMixin  # noqa: F401 (re-exported)
from omni_actors.actors.stack_dumps import remove_dump, where_silent
from omni_actors.actors.supervision import (TICK_LOST_AFTER_INTERVALS, WAKEUP_LOST_AFTER_S, HealthPolicy, host_identity,
                                            ParentWatch, ReplicaHealth, RestartPolicy, WakeupChain,
                                            exit_hard_after, exit_if_orphaned_before_start, pop_overdue)
from omni_actors.actors.thespian_fixes import describe_exit, exit_code
from omni_actors.balancing import POLICIES
from omni_actors.logs import get_logger
from omni_actors.placement import LEAVING, LEFT_REASON
from omni_actors.system.processes import process_ipc_dir, release_ipc_dir
from omni_actors.messages import (LATENCY_BUCKETS_S, LIVE_STATES, PLACING, DataServicesSilent, DrainReplica,
                                  EngineFailed, EngineReady,
                                  Heartbeat, HeartbeatAck, PlannedStop, PlannedStopNoted, PoolState, ReleasePlacement,
                                  ReplicaState, ReplicaStatus, StageTask, StartPool, replica_index)

#: Ticks per heartbeat interval: how often health is judged.
TICKS_PER_INTERVAL = 4
#: Missing this many coordinator acks (in intervals) means the coordinator is gone, once
#: it is no longer this process's parent either (``ParentWatch``: a busy one acks late).
ORPHAN_AFTER_INTERVALS = 5
#: An orphaned pool (see above) whose replicas have all exited asks to exit; if it has not
#: within this many seconds (Thespian waits for a child that never answers), it exits hard.
ORPHAN_EXIT_GRACE_S = 30.0

#: States in which a replica has no process (any pid it had is gone).
_NO_PROCESS = (ReplicaState.FAILED, ReplicaState.STOPPED, ReplicaState.DEAD)
_ALIVE = LIVE_STATES
#: Ticks between placement retries for replicas still waiting for a node.
PLACEMENT_RETRY_TICKS = 8
#: Seconds past its engine's stop and exit grace that a drained replica with no task may
#: stay silent before it is killed as hung (see StagePoolActor._drain_exit_s): its loop
#: thread's join (2 s) and its interpreter's exit, on a loaded host.
DRAIN_EXIT_SLACK_S = 5.0
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
    #: those of its tasks in flight whose cancel was passed on to it: if it goes before it
    #: confirms one, that task is confirmed cancelled, not run elsewhere
    cancelling: set[tuple[str, int]] = field(default_factory=set)
    #: tasks it reported finished lately, oldest first: (request, stage) -> (task, when)
    finished: dict[tuple[str, int], tuple[StageTask, float]] = field(default_factory=dict)
    dispatched: int = 0
    last_dispatch: float = 0.0  #: (monotonic) when it was last sent a task; 0.0 none since it (re)started
    slot: int = 0  #: its place among the live replicas when it was last started (``StartEngine.slot``)
    completed: int = 0
    failed: int = 0
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float | None = None
    fault: str = ""  # the injected fault in force, as its engine's heartbeats say
    fault_seq: int = 0  # how many faults were passed to its engine (InjectFault.seq)
    pid: int | None = None
    node: str = ""
    host: str = ""
    devices: str = ""
    backend: str = ""
    placing: bool = False  # a PlaceReplica is out
    restarts: list[float] = field(default_factory=list)
    #: restarts not in ``restarts`` (not counted against the restart budget): its process was
    #: replaced with a pool (or coordinator) that was lost and recreated
    restarts_recreated: int = 0
    failed_at: float = 0.0  # when it went FAILED (its retry's wake-up carries it)
    failed_why: str = ""  # why it went FAILED, without when it is tried next (a recreated pool says it)
    #: why it last went down (died, isolated, failed); its next incarnation's reason says it once READY
    down_cause: str = ""
    health: ReplicaHealth | None = None
    killed: bool = False  #: killed as hung while it drained (see StagePoolActor._stop_hung_drain)
    latency: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS_S))
    latency_sum: float = 0.0
    #: drained because its node's member stops, and pinned there: started again (placed
    #: when the node is back) once it has stopped, rather than stopped for good
    relaunch: bool = False
    restart_tag: float = 0.0  #: (monotonic) when its pending restart was set: that timer's tag
    #: READY on a node that is leaving, the last ready replica of its stage: the drain reason it
    #: gets once another is ready or no request is in flight (see PoolPlacementMixin.receiveMsg_DrainNode)
    linger: str = ""
    #: since when it lingers (``time.time()``): it takes only the tasks of requests begun before
    linger_since: float = 0.0
    #: the replica launched to replace this one when its node drained (`node drain`, a leave)
    replaced_by: str = ""
    #: it has been READY at least once (its config loads), and load failures since it last was
    loaded: bool = False
    load_failures: int = 0
    #: while it starts, the devices its engine waits for (an old engine holds them; its heartbeats say)
    device_wait: str = ""
    start_phase: str = ""  #: while STARTING: what its engine is doing (its heartbeats' ``phase``)
    #: ``(node, devices)`` the coordinator placed it on; and where it (its name) ran before
    #: (a restart, or a recreated pool's layout): its placement asks for that again first
    placed: tuple = ()
    was_on: tuple = ()
    #: when (``time.monotonic()``) its ready timeout ends, from its Placement (0: not started);
    #: the tick checks it where the wake-up set for it was lost
    ready_by: float = 0.0


class StagePoolActor(PoolAdminMixin, PoolPlacementMixin, PoolRoutingMixin, ActorTypeDispatcher):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._started = threading.Event()  # StartPool came (see exit_if_orphaned_before_start)
        exit_if_orphaned_before_start(self._started)
        self._spec: StartPool | None = None
        self._coordinator = None
        self._replicas: dict[str, Replica] = {}
        self._pending: list[tuple[StageTask, float]] = []
        self._before_start: list[StageTask] = []  # tasks that came before StartPool (see _route_before_start)
        #: cancels that came before their task (see actors.cancels)
        self._cancelled_early = CancelledStages()
        self._hold_until = 0.0  # the backlog kept for replicas still starting goes out by then
        self._next_index = 0
        self._pins: dict[str, tuple[str, tuple[str, ...]]] = {}  # replica -> (node, devices) it is pinned to
        self._silent_nodes: frozenset[str] = frozenset()  # (DataServicesSilent: avoided while others serve)
        self._silent = DataServicesSilent()  # (the last one: passed on to each replica once ready)
        self._last_ack = time.monotonic()
        self._orphaned = False
        self._planned_stop = False  # (PlannedStop: the system stops; replicas exiting now are not failures)
        self._exit_timer = None  # orphaned and exiting: ends the process if Thespian does not
        self._parent = ParentWatch(0, "")
        self._last_tick = 0.0  # when the last health tick ran (monotonic)
        self._ticks_chain = WakeupChain("tick")  # (restarted by a heartbeat when its wake-up is lost)
        self._timers: dict[tuple, float] = {}  # wake-ups asked for (see _after) -> when due
        self._exiting = False  # told to exit (system stop, stage removed): replicas exiting is expected
        self._ticks = 0
        self._log = get_logger(actor="pool")

    # -- set-up -----------------------------------------------------------
    def receiveMsg_DataServicesSilent(self, msg: DataServicesSilent, sender):
        """Replicas on these nodes get new tasks only when no other is ready (trial CG: with a
        member's process frozen, new requests went on to its replicas, and each waited out
        the API server's 10 s fetch of the output, or failed)."""
        if frozenset(msg.nodes) != self._silent_nodes:
            self._log.info("data_services_silent", nodes=sorted(msg.nodes))
        self._silent_nodes = frozenset(msg.nodes)
        if msg.services != self._silent.services:
            # (their fetches from those services end at once: trial CG's replicas reading inputs
            # from the frozen member each waited the fetch's 10 s)
            for rep in self._replicas.values():
                if rep.state == ReplicaState.READY or rep.state == ReplicaState.DRAINING:
                    self.send(rep.address, msg)
        self._silent = msg

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
            for rid, pin, restarts, (completed, failed, buckets, latency_sum, recreated), down, ran, was_on \
                    in msg.replicas:
                self._next_index = max(self._next_index, replica_index(rid) + 1)
                if pin:
                    self._pins[rid] = (pin[0], tuple(pin[1]))
                if down:  # supervision gave up on it: it stays so until its next try, as it would have
                    rep = self._replicas[rid] = Replica(rid, None, restarts=list(restarts))
                    rep.state, rep.down_cause, rep.failed_why = ReplicaState.FAILED, down, down
                    rep.reason = down + self._retry_later(rep)
                else:
                    self._launch(rid, list(restarts), was_on)
                    if ran:  # (its process was replaced with its pool's: a trial saw nothing in `status` say so)
                        self._replicas[rid].down_cause = msg.recreated_why
                rep = self._replicas[rid]  # (its counters go on, as after a restart)
                rep.completed, rep.failed, rep.latency_sum = completed, failed, latency_sum
                # (RESTARTS and omni_replica_restarts_total count its new process: a trial's alert on
                # them missed a coordinator crash that had restarted every replica)
                rep.restarts_recreated = recreated + (1 if ran and not down else 0)
                if len(buckets) == len(rep.latency):
                    rep.latency = list(buckets)
        self._start_ticks()
        self._publish()
        self._route_before_start()

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
        for payload in pop_overdue(self._timers, now):
            self._log.warning("wakeup_lost", payload=str(payload))
            self._on_timer(payload)

    def _new_replica_id(self) -> str:
        rid = f"{self._spec.stage.name}/{self._next_index}"
        self._next_index += 1
        return rid

    def _launch(self, replica_id: str, restarts: list[float] | None = None, was_on: tuple = ()) -> None:
        """Ask the coordinator where the replica goes (where it ran before, ``was_on``
        ``(node, devices)`` or its own last placement, if those are free); it starts on
        :class:`Placement`."""
        rep = Replica(replica_id, None, restarts=restarts or [], reason=PLACING, was_on=was_on)
        old = self._replicas.get(replica_id)
        if old is not None:  # a restart: its counters go on (a Prometheus counter must not go back)
            # (where it ran, unless it failed to load there: a bad device would fail it again)
            rep.was_on = () if old.load_failures else (old.placed or old.was_on)
            rep.dispatched, rep.completed, rep.failed = old.dispatched, old.completed, old.failed
            rep.restarts_recreated = old.restarts_recreated
            rep.down_cause = old.down_cause
            rep.latency, rep.latency_sum = old.latency, old.latency_sum
            rep.loaded, rep.load_failures = old.loaded, old.load_failures
            if rep.down_cause:  # (a trial read a restart as a bare "waiting for placement")
                rep.reason = f"{PLACING}; {down_phrase(rep.down_cause)}"
        self._replicas[replica_id] = rep
        self._place(rep)

    # -- registration -----------------------------------------------------
    def receiveMsg_EngineReady(self, msg: EngineReady, sender):
        rep = self._replicas.get(msg.replica)
        # (from its engine now: one given up on, its node declared lost while it loaded, still says
        # it is ready; a code review saw its replacement taken for READY with the old one's pid)
        if rep and rep.state == ReplicaState.STARTING and rep.address == sender:
            now = time.monotonic()
            # After a restart, READY says when and why it was down (RESTARTS alone does not).
            at = time.strftime("%H:%M:%S UTC", time.gmtime())  # (UTC, as the logs' timestamps)
            rep.state, rep.reason = ReplicaState.READY, "; ".join(filter(None, (
                f"{'placed again' if moved_on_purpose(rep.down_cause) else 'restarted'} at "
                f"{at}; {down_phrase(rep.down_cause)}" if rep.down_cause else "",
                msg.note)))
            rep.pid, rep.host, rep.backend = msg.pid, msg.host, msg.backend
            rep.devices = msg.devices or rep.devices
            rep.health = ReplicaHealth(last_heartbeat=now, progress_at=now)
            rep.loaded, rep.load_failures = True, 0
            self._log.info("replica_ready", replica=msg.replica, engine_pid=msg.pid, node=msg.node)
            if self._silent.services:
                self.send(sender, self._silent)
            for other in self._replicas.values():  # the last ones on a leaving node can go now
                if other is not rep:
                    self._end_linger(other, f"{msg.replica} is ready")
            self._publish()
            self._drain_pending()

    def receiveMsg_EngineFailed(self, msg: EngineFailed, sender):
        rep = self._replicas.get(msg.replica)
        if rep is None or rep.state not in _ALIVE or rep.address != sender:
            return  # (an engine given up on: see receiveMsg_EngineReady)
        if rep.state == ReplicaState.DRAINING:
            # It was going anyway (scaled away, drained): stopped when its process exits, as any
            # drained one; not FAILED, which is tried again after failed_retry_s (a code review:
            # a replica scaled away came back 300 s later, one more than asked for).
            self._log.warning("engine_died_while_draining", replica=rep.replica, reason=msg.reason)
            rep.reason = f"{rep.reason}; its engine died while it drained: {msg.reason}"
            self._redispatch(rep, crashed=True)
            self.send(rep.address, ActorExitRequest())
            self._publish()
            return
        if rep.state == ReplicaState.READY:
            self._isolate(rep, f"engine died: {msg.reason}", crashed=True)  # it ran before: restart it
            return
        if rep.state == ReplicaState.ISOLATED:
            # Its engine died while it was being isolated already (its failed tasks tripped the
            # circuit breaker first): it is restarted as it is; not failed for good (it loaded).
            self._log.warning("engine_died_while_isolated", replica=rep.replica, reason=msg.reason)
            return
        rep.load_failures += 1
        if rep.state == ReplicaState.STARTING and rep.loaded and rep.load_failures == 1:
            # It loaded before, so its config is sound: a restart that fails to load once (its
            # engine core killed while loading: trial W) is restarted as a crash is, within the
            # restart budget, not failed for failed_retry_s (300 s on one replica fewer).
            self._isolate(rep, f"failed to load on restart: {msg.reason}", hard=False)
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
        if rep.state == ReplicaState.STARTING:
            if msg.pid and rep.pid != msg.pid:
                rep.pid, rep.host = msg.pid, msg.host
                self._publish()
            self._show_start(rep, msg.waiting_for, msg.phase)
        now = time.monotonic()
        if self._last_tick and now - self._last_tick > TICK_LOST_AFTER_INTERVALS * self._spec.heartbeat_interval_s:
            # The tick's wake-up was lost (see _after): supervision would stop for good.
            self._log.warning("pool_tick_lost", since_s=round(now - self._last_tick, 2))
            self._start_ticks()
            self._tick()
        if rep is not None and rep.health is not None:
            rep.running, rep.waiting, rep.kv_cache_usage = msg.running, msg.waiting, msg.kv_cache_usage
            # (a heartbeat sent before its engine applied the fault passed on last says the one
            # before: `status` showed no fault just after an `inject`, until the next heartbeat)
            if msg.fault != rep.fault and msg.fault_seq >= rep.fault_seq:
                rep.fault = msg.fault
                self._publish()  # (status shows an injected fault within a heartbeat)
            rep.health.on_heartbeat(time.monotonic(), msg.progress, msg.idle_s)

    def _show_start(self, rep: Replica, waiting_for: str, phase: str) -> None:
        """A starting replica's reason says which old engine holds its devices while it waits,
        and what its engine is doing (its heartbeats' ``waiting_for`` and ``phase``)."""
        if (waiting_for, phase) != (rep.device_wait, rep.start_phase):
            rep.device_wait, rep.start_phase = waiting_for, phase
            rep.reason = starting_reason(rep)
            self._publish()

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
            if rep is not None and rep.address == payload[2]:
                rep.ready_by = 0.0  # (come: the tick's check for a lost one is not needed; a review)
            if rep is not None and rep.address == payload[2] and rep.state == ReplicaState.STARTING:
                self._set_down(rep, ReplicaState.FAILED,
                               f"did not become ready within {self._spec.ready_timeout_s:g} s")
                self._kill(rep)
            elif rep is not None and rep.address == payload[2] and rep.state == ReplicaState.DRAINING \
                    and rep.health is None:  # (drained while it started, and never ready: not waited for)
                self._stop_hung_drain(rep, f"did not become ready within {self._spec.ready_timeout_s:g} s")
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
            if rep is not None and rep.state == ReplicaState.DEAD and not self._orphaned \
                    and rep.restart_tag == payload[2]:
                rep.restarts.append(time.monotonic())
                self._launch(rep.replica, rep.restarts)
                self._publish()

    def _drain_exit_s(self) -> float:
        """Seconds a drained replica with no task may go without a heartbeat before it is
        taken for hung: its missed heartbeats and one more (the drain's way to it), plus
        what its exit may take when it sends none: the time its engine gets to stop
        (:data:`~omni_actors.actors.engine.SHUTDOWN_TIMEOUT_S`), its exit grace, and
        :data:`DRAIN_EXIT_SLACK_S` for its loop thread and interpreter to end."""
        return ((self._health.missed_heartbeats + 1) * self._health.heartbeat_interval_s + SHUTDOWN_TIMEOUT_S
                + EXIT_GRACE_S + DRAIN_EXIT_SLACK_S)

    def _stop_hung_drain(self, rep: Replica, why: str, crashed: bool = True, silent: bool = False) -> None:
        """A DRAINING replica that does not answer (``why``): its tasks go elsewhere, those it
        finished lately are handed back (their results may be stuck in it), and its process is
        killed (stopped, its devices freed, once it is gone). ``silent``: as for :meth:`_isolate`."""
        where, stacks, poison = self._where_silent(rep, silent)
        why += where
        self._log.error("replica_isolated", replica=rep.replica, reason=why, draining=True, **stacks)
        rep.reason = f"{why} while draining ({rep.reason})"
        rep.killed = True  # (not again at the next tick, before its exit is heard of)
        # (lost, as an isolated ready replica's are: trial CC read FAILED 2 for one frozen replica,
        # 0 for one frozen and then drained, both with 2 tasks moved)
        self._redispatch(rep, crashed=crashed, lost=True, poison=poison)
        self._hand_back_finished(rep, rep.reason)
        if not self._kill(rep):
            self._gone(rep, rep.reason)
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
                if rep.ready_by:  # (its EngineReady may be among the unread)
                    rep.ready_by += late
        self._run_lost_timers(now)
        for rep in list(self._replicas.values()):
            if rep.ready_by and not rep.killed and now > rep.ready_by + WAKEUP_LOST_AFTER_S and (
                    rep.state == ReplicaState.STARTING or (rep.state == ReplicaState.DRAINING and rep.health is None)):
                # Its ready deadline's wake-up was lost (its payload holds an address, so _after does
                # not track it): a replica that never got ready stayed STARTING for good, holding its
                # devices, and its stage's tasks waited for it (a review)
                self._log.warning("wakeup_lost", payload=f"ready_deadline {rep.replica}")
                rep.ready_by = 0.0
                self._on_timer(("ready_deadline", rep.replica, rep.address))
        if self._ticks % TICKS_PER_INTERVAL == 0:
            self._cancel_overdue(now)
            self._publish()  # load figures once per interval; state changes publish at once
        for rep in list(self._replicas.values()):
            if rep.state == ReplicaState.READY and rep.health is not None:
                why = self._health.verdict(rep.health, now, len(rep.in_flight))
                if why:  # (stalled running its tasks counts against them; silence may be a lost host)
                    silent = self._health.silent(rep.health, now, len(rep.in_flight))
                    self._isolate(rep, why, crashed=not silent, silent=silent)
            elif rep.state == ReplicaState.DRAINING and rep.killed:
                pass  # (killed as hung: its exit is on its way)
            elif rep.state == ReplicaState.DRAINING and not rep.in_flight:
                silent_s = now - rep.health.last_heartbeat if rep.health is not None else 0.0
                if silent_s > self._drain_exit_s():
                    # (a code review: frozen, then drained, it stayed `draining` for ever, holding
                    # its devices; one that stops its engine sends no heartbeat meanwhile)
                    self._stop_hung_drain(rep, f"no heartbeat for {silent_s:.0f} s")
                else:
                    self.send(rep.address, DrainReplica(rep.replica))
            elif rep.state == ReplicaState.DRAINING and rep.health is not None:
                why = self._health.verdict(rep.health, now, len(rep.in_flight))
                if why:  # hung while it drains: its tasks go elsewhere now (they waited for it for ever)
                    silent = self._health.silent(rep.health, now, len(rep.in_flight))
                    self._stop_hung_drain(rep, why, crashed=not silent, silent=silent)
        if self._ticks % PLACEMENT_RETRY_TICKS == 0:
            self._retry_placements()  # devices may have been freed by another stage
        self._refuse_pending_if_none_comes()
        expired = [(t, d) for t, d in self._pending if now >= d]
        if expired:
            self._pending = [(t, d) for t, d in self._pending if now < d]
            # (held back for replicas still starting while one was ready: that one takes them
            # now; a review saw them refused "no ready replica" beside a ready one)
            for task, _ in expired:
                if self._takers(task):
                    self._route(task)
                else:
                    self._reject(task, f"no ready replica of stage {self._spec.stage.name} within "
                                       f"{self._spec.supervision.queue_timeout_s:g} s ({self._describe()})")
        if self._hold_until and now >= self._hold_until:
            self._drain_pending()  # the backlog kept for replicas that are still starting
        self._wind_down_if_orphaned(now)

    def _wind_down_if_orphaned(self, now: float) -> None:
        """With no acks from the coordinator for :data:`ORPHAN_AFTER_INTERVALS` (or its
        process gone), drain every replica; once none is alive, exit (hard after
        :data:`ORPHAN_EXIT_GRACE_S` if Thespian holds the exit)."""
        if not self._orphaned and self._parent.lost(
                now - self._last_ack, ORPHAN_AFTER_INTERVALS * self._spec.heartbeat_interval_s):
            self._orphaned = True
            self._log.warning("coordinator_lost_draining")
            for rep in self._replicas.values():
                if rep.state in _ALIVE:
                    self.send(rep.address, DrainReplica(rep.replica))
        if self._orphaned and not any(r.state in _ALIVE and r.address is not None
                                      for r in self._replicas.values()):
            if self._exit_timer is None:
                self._exit_timer = exit_hard_after(ORPHAN_EXIT_GRACE_S, self._log, reason="coordinator lost")
            self.send(self.myAddress, ActorExitRequest())

    def _isolate(self, rep: Replica, why: str, hard: bool = True, crashed: bool = False,
                 silent: bool = False) -> None:
        """Take ``rep`` out of routing, re-dispatch its work and end its process:
        SIGKILL when ``hard`` and local (hung replicas), else an exit request.
        ``crashed``: its engine died, hung or stalled running its tasks (counts
        against each of them, see :meth:`_elsewhere`). ``silent``: its heartbeats stopped;
        where its threads were then is added, from its stack dump (``actors.stack_dumps``)."""
        where, stacks, poison = self._where_silent(rep, silent)
        why += where
        self._log.error("replica_isolated", replica=rep.replica, reason=why, **stacks)
        rep.state, rep.reason = ReplicaState.ISOLATED, why
        self._redispatch(rep, crashed=crashed, poison=poison)
        if not hard and rep.address is not None:
            self.send(rep.address, ActorExitRequest())
        elif not self._kill(rep):
            # On another host: no ChildActorExited may ever come (the host may be gone).
            self._gone(rep, why)
        self._publish()

    def _where_silent(self, rep: Replica, silent: bool) -> tuple[str, dict, set[tuple[str, int]]]:
        """For a replica of this host whose heartbeats stopped (``silent``): what to add to its reason, the
        fields to add to its log line (``stacks``), and the (request id, stage id) of the tasks
        whose processor calls it went silent in (they count as crashed by them), from its stack
        dump (``actors.stack_dumps``); ("", {}, set()) without one."""
        if not (silent and rep.pid and rep.host == host_identity()):
            return "", {}, set()
        where, stacks, calls = where_silent(rep.pid, self._spec.stage.custom_process_input_func if self._spec else None)
        return where, ({"stacks": stacks} if stacks else {}), calls

    def _kill(self, rep: Replica) -> bool:
        """SIGKILL a replica on this host (a hung process cannot take an exit
        request) and return True; elsewhere, ask it to exit and return False."""
        if rep.pid and rep.host == host_identity():
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
            rep.failed_why = reason
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
        return f"; next try in {after:g} s (at {time.strftime('%H:%M:%S UTC', time.gmtime(time.time() + after))})"

    def _release(self, rep: Replica) -> None:
        if self._coordinator is not None:
            self.send(self._coordinator, ReleasePlacement(rep.replica))

    def receiveMsg_ChildActorExited(self, msg: ChildActorExited, sender):
        rep = next((r for r in self._replicas.values() if r.address == msg.childAddress), None)
        if rep is not None:
            # (how it ended, when Thespian has reaped it: "killed by SIGKILL" says the OOM killer
            # or an operator, an exit status an error; a trial's log said only "process exited")
            code = exit_code(msg.childAddress, msg)
            how = describe_exit(code)
            if rep.pid and rep.host == host_identity():  # (killed: it could not remove its vLLM sockets)
                release_ipc_dir(process_ipc_dir(rep.pid))
                remove_dump(rep.pid)
            if rep.state == ReplicaState.ISOLATED:  # (trial BB: its reason did not say it was then killed)
                cause = rep.reason + ("" if not how else f"; then {how}" if how.startswith("killed")
                                      else f"; then exited ({how})")
            else:
                cause = "process exited" + (f" ({how})" if how else "")
            self._gone(rep, cause, exited_cleanly=code in (0, None))

    def _gone(self, rep: Replica, cause: str, crashed: bool = True, counted: bool = True,
              exited_cleanly: bool = False) -> None:
        """The replica's process is gone (exited, killed, or lost with its node):
        free its devices, re-dispatch its work, and restart it if it should run.
        ``counted=False`` (its node left cleanly): placed again at once, and not
        a restart (no back-off, not in RESTARTS, not towards ``max_restarts``).
        ``exited_cleanly``: it exited by itself (status 0, or not known), so the results of
        the tasks it finished went out before it did."""
        rep.address = None  # a late ChildActorExited for it changes nothing
        if rep.state == ReplicaState.ISOLATED and (rep.linger or rep.replaced_by):
            # Lingering on a drained node, its replacement launched, then isolated (frozen,
            # stalled, its circuit breaker): it ends as a drained one, not restarted (a review:
            # restarted as a crash, the stage ran one replica more than configured for good).
            rep.state, rep.linger = ReplicaState.DRAINING, ""
            rep.reason = f"{cause} (replaced by {rep.replaced_by})" if rep.replaced_by else cause
        if rep.linger and rep.state == ReplicaState.READY:
            # A lingering replica (see PoolPlacementMixin.receiveMsg_DrainNode) whose node left
            # before it was released (steady load until the member's drain timeout): it was being
            # drained, and its replacement is on its way. Not a crash, nor restarted (trial AR: it
            # was placed again beside its replacement, and the stage wanted twice its replicas).
            rep.state = ReplicaState.DRAINING
            rep.reason = rep.linger.replace(LEAVING, LEFT_REASON) if LEFT_REASON in cause else rep.linger
            rep.linger = ""
        if rep.state in (ReplicaState.FAILED, ReplicaState.STOPPED):
            self._release(rep)
            self._redispatch(rep)
            self._publish()
            return
        if rep.state == ReplicaState.DRAINING:
            self._release(rep)
            died = not exited_cleanly and not self._exiting
            reason = rep.reason or "drained"
            if died and cause not in reason:  # (trial BY: SIGKILLed while it drained, it said "drained on request")
                reason = f"{reason}; then {cause}"
            rep.state, rep.reason = ReplicaState.STOPPED, reason
            # (died with tasks in flight: lost as a ready replica's are, in FAILED and the log; trial BY)
            self._redispatch(rep, crashed=crashed and died)
            if exited_cleanly or self._exiting:
                rep.finished.clear()
            else:  # (killed, or lost with its node, while it drained: a code review)
                self._hand_back_finished(rep, cause)
            if rep.relaunch and not self._orphaned and not self._exiting:
                rep.down_cause = rep.reason
                self._launch(rep.replica, rep.restarts)
            self._publish()
            return
        rep.state, rep.reason, rep.down_cause = ReplicaState.DEAD, cause, cause
        # (at info when the pool itself is exiting: Thespian stops its children with it)
        # (and when its coordinator is gone: this pool drains its replicas and a new one replaces them;
        # trial BF read four errors after an injected kill-coordinator)
        (self._log.info if self._exiting or self._orphaned or not counted else self._log.error)(
            "replica_exited", replica=rep.replica, reason=cause, pool_exiting=self._exiting)
        self._redispatch(rep, crashed=crashed and not self._exiting)
        if self._exiting:  # (its finished tasks' requests end with the system)
            rep.finished.clear()
        else:
            self._hand_back_finished(rep, cause)
        if not counted and not self._orphaned and not self._exiting:
            if not self._pins.get(rep.replica, ("", ()))[1]:
                self._release(rep)  # (pinned: it waits for its node to come back)
            self._launch(rep.replica, rep.restarts)
            self._publish()
            return
        now = time.monotonic()
        delay = None if self._orphaned else self._restart.next_delay(rep.restarts, now)
        if self._exiting:  # (trial AX: an orderly stop logged every replica as failed)
            self._release(rep)
            rep.state = ReplicaState.STOPPED
            rep.reason = "stopped with the system" if self._planned_stop else f"{cause}; its pool is exiting"
        elif self._orphaned:  # the coordinator's next pool starts it again
            self._release(rep)
            rep.state, rep.reason = ReplicaState.FAILED, f"{cause}; not restarted: its pool lost the coordinator"
        elif delay is None:
            self._release(rep)
            rep.state = ReplicaState.FAILED
            rep.failed_why = (f"{cause}; gave up after {self._restart.recent(rep.restarts, now)} restarts in "
                              f"{self._restart.window_s:g} s")
            rep.reason = rep.failed_why + self._retry_later(rep)
        else:
            if not self._pins.get(rep.replica, ("", ()))[1]:
                self._release(rep)  # a replica pinned to devices keeps them for its restart
            rep.reason = f"{cause}; restarting in {delay:g} s"
            # (tagged: a timer of an earlier incarnation, a node's leave having relaunched that one
            # meanwhile, must not restart this one before its own back-off; a code review)
            rep.restart_tag = now
            self._after(delay, ("restart", rep.replica, now))
        self._publish()

    def receiveMsg_PlannedStop(self, msg: PlannedStop, sender):
        """The system stops: replicas exiting from now on is planned (see ``PlannedStop``)."""
        self._orphaned = self._exiting = self._planned_stop = True
        self.send(sender, PlannedStopNoted(self._spec.stage.stage_id if self._spec is not None else -1))

    def receiveMsg_ActorExitRequest(self, msg, sender):
        self._orphaned = True  # shutting down: replicas that exit now are not restarted
        self._exiting = True
        return None  # Thespian sends our children their own exit requests

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
                last_heartbeat_age_s=None if r.health is None or r.state in _NO_PROCESS
                else round(now - r.health.last_heartbeat, 3),
                pid=r.pid if r.state not in _NO_PROCESS else None,
                node=r.node, devices=r.devices, backend=r.backend, restarts=len(r.restarts) + r.restarts_recreated,
                rate=round(r.health.rate(), 2) if r.health and r.state not in _NO_PROCESS else 0.0,
                kv_cache_usage=r.kv_cache_usage if r.state not in _NO_PROCESS else None,
                latency_buckets=tuple(r.latency), latency_sum_s=round(r.latency_sum, 6),
                pin=self._pins.get(r.replica, ()), fault=r.fault if r.state not in _NO_PROCESS else "",
                host=r.host if r.state not in _NO_PROCESS else "",
                lingering=bool(r.linger) and r.state == ReplicaState.READY,
                lingering_since=r.linger_since if r.linger and r.state == ReplicaState.READY else 0.0,
                relaunch=r.relaunch)
            for r in self._replicas.values())
        self.send(self._coordinator, PoolState(self._spec.stage.stage_id, self._spec.stage.name, replicas,
                                               pid=os.getpid(), pending=len(self._pending),
                                               restart_times=tuple((r.replica, tuple(r.restarts))
                                                                   for r in self._replicas.values() if r.restarts),
                                               failed=tuple((r.replica, r.failed_why)
                                                            for r in self._replicas.values()
                                                            if r.state == ReplicaState.FAILED and r.failed_why),
                                               next_index=self._next_index, host=host_identity(),
                                               feeding_began=self._began(feeding=True),
                                               oldest_began=self._began()))

    def _began(self, feeding: bool = False) -> float | None:
        """The earliest ``StageTask.began_at`` of the tasks queued or in flight (with
        ``feeding``: of those whose request goes on to another stage, ``StageTask.feeds``);
        None when there is none."""
        tasks = [task for task, _ in self._pending]
        tasks += [task for r in self._replicas.values() for task, _ in r.in_flight.values()]
        return min((t.began_at for t in tasks if t.feeds or not feeding), default=None)
