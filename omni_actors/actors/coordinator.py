"""CoordinatorActor: the control plane (one per system, by ``globalName``).

Holds the config, creates one StagePoolActor per stage, keeps the live
instance table the pools publish, answers discovery ("what runs, where"),
publishes every change to subscribers (the API servers' bridges), and routes
admin requests (inject, drain, scale) to the right pool. It never touches
request payloads.

Restart policy for pools (the same :class:`RestartPolicy` as replicas): a
pool that exits is recreated after a backoff; the new pool starts new
replicas, and the old pool's engines, no longer acked, finish their in-flight
work and exit by themselves. Subscribers get the new :class:`Routes` so that
requests still waiting on the old pool are re-sent to the new one. Too many
pool restarts in the window and the stage stays down, saying why.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time

from thespian.actors import (ActorExitRequest, ActorSystemConventionUpdate, ActorTypeDispatcher, ChildActorExited,
                             WakeupMessage)

from omni_actors.actors.node_agent import (HOST_CAPABILITY, MEMBER_CAPABILITY, NODE_CAPABILITY, NodeAgentActor,
                                           requirements_on)
from omni_actors.actors.stage_pool import StagePoolActor
from omni_actors.actors.supervision import (POOL_HUNG_INTERVALS, TICK_LOST_AFTER_INTERVALS, WAKEUP_LOST_AFTER_S,
                                          RestartPolicy, WakeupChain, host_identity)
from omni_actors.connectors import buffer_counts, data_service, default_prefix
from omni_actors.logs import get_logger
from omni_actors.messages import (LIVE_STATES, PLACING, AdminReply, ApiServerDrained, ApiServersDrained,
                                  DataServicesSilent, Deploy, DrainApiServers, DrainNode, DrainReplica, GetRoutes,
                                  NoRequestsInFlight,
                                  GetStatus, InjectFault, LaunchReplicas, NodeHeartbeat, NodeLeaving,
                                  NodeHeartbeatAck, NodeInfo, NodeLost, NodesChanged, NOT_DEPLOYED, PlaceReplica,
                                  Placement, PlacementFailed, PoolState, PoolStateAck, ReleasePlacement, ReplicaState,
                                  PlannedStop, PlannedStopNoted, PublicationsReceived, Routes,
                                  ScaleStage, ShutdownDone, ShutdownSystem, SignalFault,
                                  StartNodeAgent, StartPool, Subscribe, SUBSCRIPTION, SystemStatus, SystemStopping,
                                  UndrainNode, Unsubscribe, WATCHDOG_QUERY, WhoAmI, YouAre)
from omni_actors.placement import LEFT_REASON, FirstInLine, Inventory, KeptForOthers, PlacementError, pinned_devices

#: A member node whose agent has been silent this many heartbeat intervals is lost.
NODE_MISSED_HEARTBEATS = 3
#: A node lost that way whose member is still in the convention is asked to join again (a new
#: node agent there) this many intervals after the loss and every this many after that (later
#: than a host that was only frozen comes back by its own agent's next heartbeat): its
#: agent, unacknowledged for 5 intervals, has exited (a network cut of 5-15 s, a coordinator
#: stalled as long), and Thespian announces a member again only once its registration has
#: lapsed (15 s), which a short cut does not make it: the node stayed LOST for good (a code review).
NODE_REJOIN_PROBE_INTERVALS = 10
#: Seconds a member dropped from the convention has for its leave notice (``NodeLeaving``)
#: to arrive before it is taken as lost: its admin's deregistration can overtake the notice,
#: and a member stopped cleanly then showed as LOST.
LEAVE_NOTICE_GRACE_S = 1.0

#: The coordinator's ``globalName``.
COORDINATOR_NAME = "omni-actors-coordinator"
#: A stage pool that has not reported for this many heartbeat intervals is shown as silent
#: in ``status`` (a pool reports every interval; one frozen for 4, swamped by a burst, must
#: keep its replicas: ``tests/faults/test_busy_pool.py``) ...
POOL_SILENT_NOTE_INTERVALS = 3
#: ... and at POOL_HUNG_INTERVALS (supervision.py) it is taken for hung: SIGKILLed, and recreated
#: as a pool that exited is.
#: Seconds with no task in flight or queued in any pool before lingering replicas drain
#: (see CoordinatorActor._end_lingering).
LINGER_QUIET_S = 1.0
#: Publications a subscriber is sent between two of its renewals (every 2 s:
#: ``bridge.SUBSCRIBE_EVERY_S``) at most; see CoordinatorActor._publish.
SUBSCRIBER_BACKLOG = 8
#: Seconds since its last renewal (every 2 s) after which a subscriber that falls behind is
#: logged at warning (it may be frozen), not info.
SUBSCRIBER_LATE_S = 4.0
#: A subscriber that has not renewed its lease for this long is dropped.
SUBSCRIPTION_LEASE_S = 10.0
#: Seconds without a renewal of its subscription (every 2 s) after which a stop no longer
#: waits for an API server's drain: it is frozen (SIGSTOP, a paused VM) or gone, and would
#: hold the stop for the whole drain timeout (a trial: 16.9 s).
API_DRAIN_SILENT_S = 6.0
#: Seconds a stop waits for the pools to note it (``PlannedStopNoted``) before it tells them to
#: exit anyway; under the leader's STOP_POOLS_TIMEOUT_S (3 s) for the whole exchange.
PLANNED_STOP_WAIT_S = 2.0
#: Seconds a pinned launch's devices are kept for its replicas before they ask to be placed
#: (the pool sends their asks at once; a launch its pool refused, at its replica limit, or
#: lost frees them after this, and a corrected launch of those devices is refused meanwhile).
PLANNED_PIN_S = 10.0

_SETTLED = (ReplicaState.READY, ReplicaState.FAILED, ReplicaState.DEAD, ReplicaState.STOPPED,
            ReplicaState.PENDING)


#: A replica's reason when a recreated coordinator started it again (``StartPool.recreated_why``).
COORDINATOR_RECREATED = "the coordinator was lost and recreated, and its stage pools with it"


def _in_layout(r) -> bool:
    """Whether a recreated pool starts replica ``r`` of its predecessor's last report: not one
    stopped or draining, unless pinned to a node it drains off to start there again; not one
    lingering on a leaving or drained node unless pinned (its replacement is in the report:
    a code review saw both started, one replica too many for good)."""
    if r.state in (ReplicaState.STOPPED, ReplicaState.DRAINING):
        return r.state == ReplicaState.DRAINING and r.relaunch
    return not (r.lingering and not r.pin)


class CoordinatorActor(ActorTypeDispatcher):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._config = None
        self._pools: dict[int, object] = {}
        self._states: dict[int, PoolState] = {}
        self._pool_restarts: dict[int, list[float]] = {}
        self._pool_restarts_before: dict[int, int] = {}  #: stage id -> pool restarts under earlier coordinators
        #: stage id -> its pool's last own report: what a pool recreated after a crash starts (see _layout)
        self._reported: dict[int, PoolState] = {}
        self._pools_down: dict[int, str] = {}  #: stage id -> why its pool is not there (exited, not yet back)
        #: stage ids of _pools_down given up (restarts used up): back after failed_retry_s, or at
        #: an operator's `stage scale` or `stage launch`
        self._pools_given_up: set[int] = set()
        self._pool_exits: dict[int, int] = {}  #: stage id -> times its pool exited (the restart wake-up's tag)
        #: stage id -> (exit tag, monotonic time) of its exited pool's restart (see _restart_lost_pools)
        self._pool_restart_due: dict[int, tuple[int, float]] = {}
        #: stage id -> when its pool last reported (monotonic; its creation before the first report)
        self._pool_heard: dict[int, float] = {}
        self._pool_silent: set[int] = set()  #: stage ids whose pool is past POOL_SILENT_NOTE_INTERVALS
        #: stage id -> why the coordinator killed its pool: the reason its recreated replicas give
        self._pool_killed_why: dict[int, str] = {}
        self._asks: dict[str, PlaceReplica] = {}  #: replica -> its latest placement request (nodes, devices)
        #: pools refused a placement because the free devices were kept for stages with no replica
        #: running (:class:`~omni_actors.placement.KeptForOthers`): told to retry when that may have changed
        self._kept_from: set = set()
        self._silent_sent = DataServicesSilent()  #: what the pools were last told
        #: node -> a member that registered under its name while another ran as it (taken if that one goes)
        self._waiting_members: dict[str, NodeInfo] = {}
        #: ``(time.monotonic(), stage, node, devices)`` of pinned launches whose replicas have not asked yet
        self._planned_pins: list[tuple[float, str, str, tuple[str, ...]]] = []
        self._routes_version = 0
        self._deployed_at = 0  # (Unix seconds: when it took its config)
        self._deploy_waiters: list[object] = []
        self._subscribers: list[_Subscriber] = []
        #: a stop's drain of the attached API servers (:class:`DrainApiServers`), while it runs
        self._api_drain: _ApiDrain | None = None
        self._stopping = False
        self._stop_unnoted: set[int] | None = None  # at a stop: pools yet to note it (PlannedStop)
        self._shutdown_waiters: list = []  # who asked ShutdownSystem, answered once the pools noted it
        #: since when no pool has had a task in flight or queued, while some replica lingers
        #: (see :meth:`_end_lingering`); None: not quiet, or nothing lingers
        self._quiet_since: float | None = None
        self._inventory = Inventory()
        #: the node check's wake-ups (restarted by a pool's report when one was lost)
        self._node_checks = WakeupChain("node_check")
        self._last_node_check = 0.0  # (monotonic)
        self._joins: dict[str, int] = {}  #: node -> times it joined the convention (see LEAVE_NOTICE_GRACE_S)
        #: node -> (its info, join number): in the convention, its node agent not heard from yet
        self._joining: dict[str, tuple[NodeInfo, int]] = {}
        #: node -> the address of its agent (of the node's current join), from its heartbeats
        self._agents: dict[str, object] = {}
        #: nodes whose members the convention lists (Thespian's last word on each: added, not removed)
        self._registered: set[str] = set()
        #: node lost for missed heartbeats -> when to ask its member to join again (monotonic)
        self._rejoin_at: dict[str, float] = {}
        self._leader_node = ""
        self._drained_before: set[str] = set()  #: see Deploy.drained_nodes
        self._inherited: set[int] = set()  #: see Routes.inherited
        self._log = get_logger(actor="coordinator")

    # -- deployment -------------------------------------------------------
    def receiveMsg_Deploy(self, msg: Deploy, sender):
        if self._config is None:
            self._config = cfg = msg.config
            self._deployed_at = msg.deployed_at or int(time.time())
            r = cfg.deployment.supervision.restart
            self._restart = RestartPolicy(r.initial_backoff_s, r.max_backoff_s, r.max_restarts, r.window_s)
            leader = msg.leader_node or NodeInfo("local")
            self._leader_node = leader.name
            self._drained_before = set(msg.drained_nodes)
            now = time.monotonic()  # (the API servers of the coordinator before: see Deploy.subscribers)
            known = {str(s.address) for s in self._subscribers}
            self._subscribers += [_Subscriber(a, now) for a in msg.subscribers if str(a) not in known]
            self._add_node(leader)
            self.notifyOnSystemRegistrationChanges(True)  # member hosts joining the convention
            self._last_node_check = time.monotonic()
            self._node_checks.start(self, cfg.deployment.heartbeat_interval_s)
            previous = {(st.stage_id, st.stage): st for st in msg.previous}
            for stage in cfg.stage_args:
                self._states[stage.stage_id] = PoolState(stage.stage_id, stage.name, ())
                self._pool_restarts[stage.stage_id] = []
                last = previous.get((stage.stage_id, stage.name))
                if last is not None:  # a recreated coordinator: the pools start what ran before
                    self._reported[stage.stage_id] = last
                    # (+1: its pool went with the coordinator, and this one is new: a trial's alert on
                    # omni_stage_restarts_total missed a coordinator crash that restarted everything)
                    self._pool_restarts_before[stage.stage_id] = last.restarts + 1
                self._start_pool(stage, COORDINATOR_RECREATED if last is not None else None)
                if last is not None:  # (the lost coordinator's pool may still finish its tasks: see Routes)
                    self._inherited.add(stage.stage_id)
            if msg.previous:
                self._log.warning("deploying_as_before", stages=[st.stage for st in msg.previous],
                                  replicas=sum(r.state != ReplicaState.STOPPED for st in msg.previous
                                               for r in st.replicas))  # (stopped ones are not started again)
            self._log.info("deploying", model=cfg.deployment.served_model_name,
                           stages=[s.name for s in cfg.stage_args])
            for note in cfg.omni_connectors.notes:  # vLLM-Omni connector settings: what was applied
                if "not applied" in note:
                    self._log.warning("config_note", note=note)
                else:
                    self._log.info("config_note", note=note)
            # Answer even if a pool never reports: ready deadline plus a margin.
            self.wakeupAfter(cfg.deployment.ready_timeout_s + 5.0, payload="deploy_deadline")
            self._publish_routes()  # subscribers that came before the config (after a coordinator restart)
        self._deploy_waiters.append(sender)
        self._answer_deploy_waiters()

    def _pool_restart_count(self, stage_id: int) -> int:
        """Times the stage's pool was recreated, under the coordinators before this one too
        (their times are not kept: only this one's count against the restart budget)."""
        return self._pool_restarts_before.get(stage_id, 0) + len(self._pool_restarts.get(stage_id, ()))

    def _start_pool(self, stage, why: str | None = None) -> None:
        """Create the stage's pool: the config's replicas, or after a crash the ones the
        pool before it ran (:meth:`_layout`); ``why``: what their ``status`` reason says
        replaced their processes (default: the pool's crash)."""
        cfg = self._config
        dep = cfg.deployment
        pool = self.createActor(StagePoolActor)
        self._pools[stage.stage_id] = pool
        self._pool_heard[stage.stage_id] = time.monotonic()
        self.send(pool, StartPool(stage, cfg.deployment_of(stage), dep.heartbeat_interval_s, dep.ready_timeout_s,
                                  cfg.inline_threshold_of(stage), dep.load_balancing, dep.supervision,
                                  connector_mode=cfg.connector_mode_of(stage),
                                  replicas=self._layout(stage.stage_id),
                                  next_index=getattr(self._reported.get(stage.stage_id), "next_index", 0),
                                  coordinator_pid=os.getpid(), coordinator_host=socket.gethostname(),
                                  **({"recreated_why": why} if why else {})))
        self._tell_silent(pool)

    def _tell_silent(self, pool) -> None:
        """A new pool hears which data services do not answer, if any (a lost node's alone
        too: only the silent nodes' were sent, a review)."""
        silent = self._silent_data_services()
        if silent != DataServicesSilent():
            self.send(pool, silent)

    def _layout(self, stage_id: int) -> tuple[tuple[str, tuple, tuple[float, ...], tuple, str, bool, tuple], ...] | None:
        """``(replica id, pin, restart times, counters, failed, ran, was on)`` of each replica the stage's pool last
        reported running or failed (launched and scaled ones included; scaled down or draining: left
        out); None before any report (the config's count then). See ``StartPool.replicas``."""
        report = self._reported.get(stage_id)
        if report is None:
            return None
        restarts, failed = dict(report.restart_times), dict(report.failed)
        return tuple((r.replica, r.pin, restarts.get(r.replica, ()),
                      (r.completed, r.failed, r.latency_buckets, r.latency_sum_s,
                       r.restarts - len(restarts.get(r.replica, ()))),
                      failed.get(r.replica, "") if r.state == ReplicaState.FAILED else "",
                      r.pid is not None or r.state in LIVE_STATES,
                      (r.node, tuple(r.devices.split(",")) if r.devices else ()) if r.node else ())
                     for r in report.replicas if _in_layout(r))

    def _settled(self) -> bool:
        if self._config is None:
            return False
        for stage in self._config.stage_args:
            replicas = self._states[stage.stage_id].replicas
            if len(replicas) < self._config.deployment_of(stage).replicas:
                return False
            if any(r.state not in _SETTLED or (r.state == ReplicaState.PENDING and r.reason.startswith(PLACING))
                   for r in replicas):
                return False
        return True

    def _answer_deploy_waiters(self, force: bool = False) -> None:
        if self._deploy_waiters and (force or self._settled()):
            status = self._status("")
            for waiter in self._deploy_waiters:
                self.send(waiter, status)
            self._deploy_waiters = []

    # -- the instance table -----------------------------------------------
    def receiveMsg_PoolState(self, msg: PoolState, sender):
        self.send(sender, PoolStateAck())
        self._node_checks_lost()
        if self._pools.get(msg.stage_id) != sender:
            return  # an old pool, draining after it was replaced
        self._pool_heard[msg.stage_id] = time.monotonic()
        if msg.stage_id in self._pool_silent:
            self._pool_silent.discard(msg.stage_id)
            self._log.info("pool_heard_again", stage=msg.stage)
            self._publish_status()  # (its note goes)
        old = self._states.get(msg.stage_id)
        self._reported[msg.stage_id] = msg
        shown = {r.replica for r in msg.replicas}
        self._asks = {r: a for r, a in self._asks.items() if a.stage != msg.stage or r in shown}
        # (with what a recreated coordinator needs to start them as they were: the leader keeps
        # the last status it got and hands it on)
        # (every field as reported but the restart count, which is ours: a field copied one by one was
        # once left out, and the lingering replicas then waited for nothing)
        self._states[msg.stage_id] = dataclasses.replace(msg, restarts=self._pool_restart_count(msg.stage_id))
        if old is None or _states_of(old) != _states_of(msg):
            for r in msg.replicas:
                before = next((o for o in (old.replicas if old else ()) if o.replica == r.replica), None)
                if before is None or before.state != r.state:
                    self._log.info("instance_update", stage=msg.stage, replica=r.replica, state=r.state.value,
                                   reason=r.reason or None)
            self._publish_status()
            self._retry_kept()
        self._answer_deploy_waiters()
        self._end_lingering()

    def _end_lingering(self) -> None:
        """Lingering replicas (the last ready ones of their stage, on a node that is
        leaving: ``ReplicaStatus.lingering``) take only the tasks of requests begun before
        they lingered (``lingering_since``), and stay only while such a request may still
        need them. Once, for :data:`LINGER_QUIET_S`, no pool has reported such a task in
        flight or queued that feeds another stage (``PoolState.feeding_began``: a
        text-only request's Thinker task does not), and the lingering stages' own pools
        none at all (``oldest_began``; pools report every heartbeat interval, and one
        quiet report could fall between two stages of a request), their pools are told
        to drain them. Called on each pool report and node check."""
        since = [r.lingering_since for st in self._states.values() for r in st.replicas if r.lingering]
        lingering = [sid for sid, st in self._states.items() if any(r.lingering for r in st.replicas)]
        latest = max(since, default=0.0)

        def before(began: float | None) -> bool:  # (a task of a request that may need them)
            return began is not None and began <= latest

        if not lingering or any(before(st.feeding_began) for st in self._states.values()) or any(
                before(st.oldest_began) or any(r.in_flight for r in st.replicas if r.lingering)
                for sid, st in self._states.items() if sid in lingering):
            self._quiet_since = None
            return
        now = time.monotonic()
        if self._quiet_since is None:
            self._quiet_since = now
        elif now - self._quiet_since >= LINGER_QUIET_S:
            for sid in lingering:
                if sid in self._pools:
                    self.send(self._pools[sid], NoRequestsInFlight())

    def _check_nodes(self) -> None:
        """Every heartbeat interval: our own node's data-plane figures, and the member
        nodes that went silent are lost."""
        interval = self._config.deployment.heartbeat_interval_s
        now = time.monotonic()
        late = now - self._last_node_check - interval if self._last_node_check else 0.0
        self._last_node_check = now
        self._check_pools(now, late)
        for name, node in list(self._inventory.nodes.items()):
            if late > interval and name != self._leader_node:
                # (as for the pools: time this check ran late, the coordinator paused or its
                # wake-ups held up, is not the nodes' silence; their heartbeats wait in its queue.
                # A code review: a coordinator stopped for 3 intervals lost every member node.)
                node.last_seen += late
            if name == self._leader_node:
                node.last_seen = now  # our own host: alive while we are
                # and its data plane, as a member's agent reports it in heartbeats
                node.data_service = os.environ.get(data_service.SERVICE_ENV)
                node.buffers, node.free_buffers, node.free_bytes = buffer_counts(default_prefix())
            elif node.alive and now - node.last_seen > NODE_MISSED_HEARTBEATS * interval:
                self._lose_node(name, f"missed {NODE_MISSED_HEARTBEATS} node heartbeats")
                self._rejoin_at[name] = now + NODE_REJOIN_PROBE_INTERVALS * interval
            elif node.alive or name not in self._registered:
                self._rejoin_at.pop(name, None)
            elif name in self._rejoin_at and now >= self._rejoin_at[name]:
                self._rejoin_at[name] = now + NODE_REJOIN_PROBE_INTERVALS * interval
                self._log.warning("node_rejoin_asked", node=name, reason=node.down_reason,
                                  message="still in the convention: a new node agent is started there")
                self._start_agent(node.info)

    def _check_pools(self, now: float, late: float) -> None:
        """A pool that stops reporting (SIGSTOP, a deadlock) holds every request of its
        stage while ``status`` showed its last report: ready. Past
        :data:`POOL_SILENT_NOTE_INTERVALS` its silence is noted in the status; past
        :data:`POOL_HUNG_INTERVALS` it is SIGKILLed, and recreated as any pool that exited
        (its engines exit, the RequestActors send their tasks again). ``late``: how much
        later than its interval this check runs; past an interval (the coordinator itself
        was not running, or its wake-ups were held up) it does not count as the pools'."""
        if self._stopping:
            return
        interval = self._config.deployment.heartbeat_interval_s
        if late > interval:
            for stage_id in self._pool_heard:
                self._pool_heard[stage_id] += late
        changed = False
        for stage_id in list(self._pools):
            if stage_id in self._pools_down or stage_id in self._pool_killed_why:
                continue
            silent = now - self._pool_heard.get(stage_id, now)
            state = self._states[stage_id]
            if silent > POOL_HUNG_INTERVALS * interval and state.pid:
                if state.host and state.host != host_identity():
                    continue  # (not ours to signal; pools run on the leader's host)
                self._log.error("pool_hung_killing", stage=state.stage, pool_pid=state.pid, silent_s=round(silent, 1))
                try:
                    os.kill(state.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    continue
                self._pool_killed_why[stage_id] = (f"its stage pool hung (no report for {silent:.1f} s) and was "
                                                   "killed and recreated")
            elif silent > POOL_SILENT_NOTE_INTERVALS * interval and stage_id not in self._pool_silent:
                self._pool_silent.add(stage_id)
                self._log.warning("pool_silent", stage=state.stage, pool_pid=state.pid, silent_s=round(silent, 1))
                changed = True
        if changed:
            self._publish_status()

    def _pool_notes(self) -> tuple[str, ...]:
        """One line per silent pool, for the status."""
        if not self._config:
            return ()
        interval, now = self._config.deployment.heartbeat_interval_s, time.monotonic()
        return tuple(f"the pool of stage {self._states[i].stage} has not reported for "
                     f"{now - self._pool_heard[i]:.1f} s (busy or hung): its replicas are shown as it last "
                     f"reported them; it is killed and recreated at {POOL_HUNG_INTERVALS * interval:g} s"
                     for i in sorted(self._pool_silent) if i in self._pool_heard)

    def _node_checks_lost(self) -> None:
        """Called on each pool report: restart the node checks when their wake-up was lost
        (Thespian drops wake-ups that fall due while an actor drains a long transmit
        queue): member hosts would never be found lost again."""
        interval = self._config.deployment.heartbeat_interval_s if self._config is not None else 0.0
        since = time.monotonic() - self._last_node_check
        if interval and self._last_node_check and since > TICK_LOST_AFTER_INTERVALS * interval:
            self._log.warning("node_check_lost", since_s=round(since, 2))
            self._check_nodes()
            self._node_checks.start(self, interval)

    def receiveMsg_WakeupMessage(self, msg: WakeupMessage, sender):
        if msg.payload == "deploy_deadline":
            self._answer_deploy_waiters(force=True)
        elif msg.payload == "api_drain_deadline":
            self._answer_api_drain()
        elif msg.payload == "planned_stop_deadline":
            self._end_planned_stop(force=True)
        elif self._node_checks.owns(msg.payload):
            if self._node_checks.current(msg.payload):
                self._check_nodes()
                self._restart_lost_pools()
                self._end_lingering()
                self._check_api_drain()
                self._node_checks.again(self, self._config.deployment.heartbeat_interval_s)
        elif isinstance(msg.payload, tuple) and msg.payload[0] == "node_dropped":
            if self._joins.get(msg.payload[1], 0) == msg.payload[2]:  # (not if it rejoined since)
                self._lose_node(msg.payload[1], "dropped from the convention without a leave notice")
        elif isinstance(msg.payload, tuple) and msg.payload[0] == "restart_pool" and not self._stopping \
                and msg.payload[1] in self._pools_down \
                and self._pool_restart_due.get(msg.payload[1], (None,))[0] == msg.payload[2]:
            # (once, and only for the exit it was set for: a code review saw the wake-up of a pool
            # given up, and recreated since by an operator, restart its next incarnation early)
            self._restart_pool(msg.payload[1])

    def _restart_lost_pools(self) -> None:
        """Recreate the exited pools whose restart wake-up is over WAKEUP_LOST_AFTER_S late:
        Thespian drops wake-ups (see receiveMsg_PoolState), and the stage stayed down for good."""
        now = time.monotonic()
        for stage_id, (_, due) in list(self._pool_restart_due.items()):
            if stage_id in self._pools_down and now > due + WAKEUP_LOST_AFTER_S and not self._stopping:
                self._log.warning("wakeup_lost", payload=f"restart_pool {stage_id}")
                self._restart_pool(stage_id)

    def _restart_pool(self, stage_id: int, by: str = "") -> None:
        """Recreate the exited pool of ``stage_id`` (its restart's time has come, or ``by``:
        an operator's admin request for a stage whose pool was given up)."""
        stage = self._config.stage(stage_id)
        self._pool_restarts[stage.stage_id].append(time.monotonic())
        self._pools_down.pop(stage.stage_id, None)
        self._pool_restart_due.pop(stage.stage_id, None)
        self._pools_given_up.discard(stage.stage_id)
        self._inherited.discard(stage.stage_id)  # (this one's own pool died)
        self._start_pool(stage, self._pool_killed_why.pop(stage.stage_id, None))
        self._routes_version += 1
        self._log.warning("pool_restarted", stage=stage.name, restarts=len(self._pool_restarts[stage.stage_id]),
                          **({"by": by} if by else {}))
        self._publish_routes()

    def receiveMsg_ChildActorExited(self, msg: ChildActorExited, sender):
        for stage_id, pool in list(self._pools.items()):
            if pool != msg.childAddress:
                continue
            old = self._states[stage_id]
            if self._stopping or stage_id in self._pools_down:
                return  # (a second notice of the same exit: handled, its restart is set)
            now = time.monotonic()
            delay = self._restart.next_delay(self._pool_restarts[stage_id], now)
            self._pool_silent.discard(stage_id)
            killed = self._pool_killed_why.get(stage_id)
            why = "stage pool hung: killed" if killed else "stage pool exited"
            given_up = delay is None
            if given_up:
                # tried again after failed_retry_s, as a FAILED replica is (a code review: it
                # stayed down for good, and every admin request for its stage was refused)
                # (those in the window, which decided it: a review read every restart ever, 8 of "5 in 60 s")
                why += (f"; gave up after {self._restart.recent(self._pool_restarts[stage_id], now)} restarts in "
                        f"{self._restart.window_s:g} s")
                delay = self._config.deployment.supervision.restart.failed_retry_s or None
                why += (f"; next try in {delay:g} s (at "
                        f"{time.strftime('%H:%M:%S UTC', time.gmtime(time.time() + delay))}), or at a `stage "
                        "scale` or `stage launch`" if delay is not None else
                        "; a `stage scale` or `stage launch` starts it again")
            self._log.error("pool_exited", stage=old.stage, restart_in_s=delay)
            # What the new pool will not start (scaled down, drained) gives its devices back now;
            # the others keep theirs under the same names.
            kept = {rid for rid, *_ in (self._layout(stage_id) or ())} if not given_up else set()
            for r in old.replicas:
                if r.replica not in kept:
                    self._inventory.release(r.replica)
            # (counters kept, and a replica that was only waiting for placement still waits: a
            # trial read DONE and RESTARTS 0, and a pending one "dead", until the new pool reported)
            down = ReplicaState.FAILED if given_up else ReplicaState.DEAD
            self._states[stage_id] = PoolState(stage_id, old.stage, tuple(
                dataclasses.replace(r, reason=why, pid=None, in_flight=0, running=0, waiting=0, rate=0.0,
                                    kv_cache_usage=None, last_heartbeat_age_s=None, fault="", host="",
                                    state=(r.state if r.state == ReplicaState.STOPPED or (
                                        r.state == ReplicaState.PENDING and not given_up) else down))
                for r in old.replicas), None, 0, self._pool_restart_count(stage_id), old.restart_times, old.failed,
                old.next_index)
            self._pools_down[stage_id] = (f"its pool exited; a new one starts in {delay:g} s, try again then"
                                          if not given_up else why)
            if given_up:
                self._pools_given_up.add(stage_id)
                self._routes_version += 1  # (the RequestActors with a task there end their requests)
                self._publish_routes()
            self._publish_status()
            if delay is not None:
                exits = self._pool_exits[stage_id] = self._pool_exits.get(stage_id, 0) + 1
                self._pool_restart_due[stage_id] = (exits, time.monotonic() + delay)
                self.wakeupAfter(delay, payload=("restart_pool", stage_id, exits))

    # -- nodes and placement ----------------------------------------------
    def receiveMsg_ActorSystemConventionUpdate(self, msg: ActorSystemConventionUpdate, sender):
        caps = msg.remoteCapabilities or {}
        name = caps.get(NODE_CAPABILITY)
        if not name or self._config is None:
            return
        if not msg.remoteAdded:
            waiting = self._waiting_members.get(name)
            if waiting is not None and waiting.admin == msg.remoteAdminAddress:  # (it went before it was taken)
                del self._waiting_members[name]
                return
            node = self._inventory.nodes.get(name)
            # (the member whose agent has not answered yet, if one joined since: a review saw an old
            # member's registration lapse right after a new one joined under its name)
            current = self._joining[name][0] if name in self._joining else node.info if node is not None else None
            if current is not None and current.admin is not None and current.admin != msg.remoteAdminAddress:
                # Thespian dropping the admin of a node that has rejoined since (a new admin): not this node
                self._log.info("node_stale_registration_dropped", node=name, admin=str(msg.remoteAdminAddress))
                return
            self._registered.discard(name)
            # A member that stops cleanly says so (NodeLeaving, from its node agent), but that notice
            # may come after its admin's deregistration: lost only if none came within a grace.
            self.wakeupAfter(LEAVE_NOTICE_GRACE_S, payload=("node_dropped", name, self._joins.get(name, 0)))
            return
        # The node takes work once its agent's first heartbeat comes: Thespian may report a member
        # that has just stopped as joining again (CI saw one 9 s after it left), with nobody there.
        member = str(caps.get(MEMBER_CAPABILITY) or "")
        info = NodeInfo(name, _split(caps.get("omni_devices")), _split(caps.get("omni_stages")),
                        msg.remoteAdminAddress, member, str(caps.get(HOST_CAPABILITY) or ""))
        node = self._inventory.nodes.get(name)
        if node is not None and node.alive and member and node.info.member and node.info.member != member:
            # Another member runs as this node: either this one was lost (frozen past its heartbeats),
            # a new one joined under its name and Thespian announced the old one again as it resumed
            # (a review: its agent replaced the new one's, and the node was added afresh, every device
            # free under the new member's replicas), or the running one just died and this is its
            # restart. Kept until the running one is lost or leaves, then taken.
            self._log.warning("node_name_taken", node=name, member=member, running_member=node.info.member,
                              admin=str(msg.remoteAdminAddress))
            self._waiting_members[name] = info
            return
        self._waiting_members.pop(name, None)
        self._take_member(info)

    def _take_member(self, info: NodeInfo) -> None:
        """A member registered as node ``info.name``: its agent is started (see :meth:`_start_agent`)."""
        self._registered.add(info.name)
        self._rejoin_at.pop(info.name, None)  # (its agent is on its way: a probe would make it stale)
        self._start_agent(info)

    def _start_agent(self, info: NodeInfo) -> None:
        """A node agent on ``info``'s member, as its join number next: the node takes work
        once that agent's first heartbeat comes (any earlier agent's are ignored from then)."""
        name = info.name
        join = self._joins[name] = self._joins.get(name, 0) + 1
        self._joining[name] = (info, join)
        # (to this member's admin: a lost one of the same name may still be up, and took a trial's)
        agent = self.createActor(NodeAgentActor, targetActorRequirements=requirements_on(name, info.member))
        self.send(agent, StartNodeAgent(name, self._config.deployment.heartbeat_interval_s,
                                        reap_after_s=self._config.deployment.request_timeout_s + 30, join=join))

    def _add_node(self, info: NodeInfo) -> None:
        """Put a node that joined into the inventory; drained again if an operator had drained
        it under the coordinator before this one (:attr:`Deploy.drained_nodes`), once, or
        under this one before its member left or was lost and joined again (a code review:
        a member restarted after `node drain` took new replicas without `node undrain`)."""
        before = self._inventory.nodes.get(info.name)
        again = before is not None and before.drained
        self._inventory.add(info)
        if info.name in self._drained_before or again:
            self._drained_before.discard(info.name)
            self._inventory.drain(info.name, operator=True)
            self._log.warning("node_still_drained", node=info.name,
                              message=("drained before it joined again" if again else
                                       "drained before the coordinator was recreated")
                              + ": nothing new is placed there until `node undrain`")

    def _joined(self, info: NodeInfo) -> None:
        """A member's node agent answered: its devices take work (unless it is still drained).
        A node back already through its earlier agent (``node_back``: a member frozen long
        enough for Thespian to announce it again) keeps what was placed there since: added
        again, its devices read all free and a second replica was placed on one in use,
        which then killed the first (trial BO)."""
        node = self._inventory.nodes.get(info.name)
        if node is not None and node.alive and node.info.member == info.member:
            self._log.info("node_joined", node=info.name, devices=list(node.info.devices), back_already=True)
            return
        self._add_node(info)
        self._log.info("node_joined", node=info.name, devices=list(info.devices), stages=list(info.stages))
        for note in self._shared_devices(info.name):
            self._log.warning("node_devices_shared", node=info.name, message=note)
        for pool in self._pools.values():
            self.send(pool, NodesChanged())
        self._publish_status()

    def _shared_devices(self, only: str | None = None) -> list[str]:
        """A note for each two alive nodes on one machine (a leader and a member started there
        with node names of their own, say) that both offer a device id: placement counts each
        node's devices apart, so two replicas could load on that GPU. Worded as a possibility:
        two containers given GPUs of their own both call theirs 0, and nothing here tells a GPU's
        physical identity. (``only``: the pairs with that node.)"""
        alive = sorted((n.info for n in self._inventory.nodes.values() if n.alive and n.info.host),
                       key=lambda i: i.name)
        notes = []
        for i, a in enumerate(alive):
            for b in alive[i + 1:]:
                common = sorted(set(a.devices) & set(b.devices))
                if a.host == b.host and common and only in (None, a.name, b.name):
                    notes.append(f"nodes {a.name} and {b.name} run on one machine ({a.host}) and both offer "
                                 f"device(s) {','.join(common)}: if those ids name the same GPUs (not containers "
                                 "given GPUs of their own), a replica on each could load on one GPU; give each "
                                 "node devices of its own (--devices)")
        return notes

    def _lose_node(self, name: str, reason: str) -> None:
        node = self._inventory.nodes.get(name)
        if node is None or not node.alive:
            return
        lost = self._inventory.lose(name, reason)
        if reason == LEFT_REASON:
            self._log.info("node_left", node=name, replicas=lost)
        else:
            self._log.error("node_lost", node=name, reason=reason, replicas=lost)
        for pool in self._pools.values():
            self.send(pool, NodeLost(name, reason))
        self._publish_status()
        waiting = self._waiting_members.pop(name, None)
        if waiting is not None:  # (another member registered under its name meanwhile: see node_name_taken)
            self._log.info("node_member_taken_after_loss", node=name, member=waiting.member)
            self._take_member(waiting)

    def receiveMsg_DrainNode(self, msg: DrainNode, sender):
        """A member that stops cleanly asks first: nothing new goes to its node, and every
        pool drains its replicas there (see :class:`DrainNode`); answered at once, the
        member then watches ``status`` until they have stopped."""
        reply_to = msg.reply_to or sender
        if not self._inventory.drain(msg.node, operator=msg.operator):
            self.send(reply_to, AdminReply(False, f"no alive node named {msg.node!r}"))
            return
        self._log.info("node_drained" if msg.operator else "node_leaving", node=msg.node)
        for pool in self._pools.values():
            self.send(pool, DrainNode(msg.node, operator=msg.operator))
        self._publish_status()
        others = [n for n, node in self._inventory.nodes.items() if n != msg.node and node.open]
        # (trial BF: the only node drained read "each replaced on another node" before the
        # warnings that none was)
        where = (" (each replaced on another node where one has room)" if others else
                 " (no other node takes replicas: they are not replaced until `node undrain` or a node joins)")
        self.send(reply_to, AdminReply(True, f"node {msg.node}: its replicas drain" + (
            f"{where}; nothing new is placed there until `node undrain`" if msg.operator else "")))

    def receiveMsg_UndrainNode(self, msg: UndrainNode, sender):
        """``node undrain``: the node takes new replicas again; pools retry their pending ones."""
        reply_to = msg.reply_to or sender
        node = self._inventory.nodes.get(msg.node)
        if not self._inventory.undrain(msg.node):
            why = (f"no alive node named {msg.node!r}" if node is None or not node.alive else
                   f"node {msg.node} is not drained (it is {'leaving' if node.leaving else 'alive'})")
            self.send(reply_to, AdminReply(False, why))
            return
        if not node.open:
            # Its member has left, was lost, or is leaving: undrained for when a member joins under
            # its name again, and nothing changes meanwhile (`status` said "LEFT, still drained:
            # `node undrain`", which then refused it; during a leave, the pools retired the
            # replacements of the replicas still leaving with it: code reviews).
            self._drained_before.discard(msg.node)
            now = "leaving" if node.alive else node.gone
            self._log.info("node_undrained", node=msg.node, state=now)
            self._publish_status()
            self.send(reply_to, AdminReply(True, f"node {msg.node} is no longer drained; it is {now}: it takes new "
                                                 "replicas once a member joins under its name again"))
            return
        self._log.info("node_undrained", node=msg.node)
        for pool in self._pools.values():
            self.send(pool, NodesChanged(undrained=msg.node))
        self._publish_status()
        self.send(reply_to, AdminReply(True, f"node {msg.node} takes new replicas again (those waiting for it "
                                             "are placed there; its replicas still serving stay, and their "
                                             "replacements not ready yet are stopped; those ready elsewhere "
                                             "stay where they are)"))

    def _stale_join(self, node: str, join: int) -> bool:
        """Whether ``join`` is of an earlier member under ``node``'s name than the one
        that joined last (that one was lost, and a new member joined under its name)."""
        current = self._joins.get(node, 0)
        return bool(join and current and join != current)

    def receiveMsg_NodeLeaving(self, msg: NodeLeaving, sender):
        if self._stale_join(msg.node, msg.join):
            # (a trial's old, stuck member, stopped with Ctrl-C, took down the new one of its name)
            self._log.warning("node_leaving_of_earlier_member_ignored", node=msg.node, join=msg.join)
            return
        self._lose_node(msg.node, msg.lost or LEFT_REASON)

    def receiveMsg_NodeHeartbeat(self, msg: NodeHeartbeat, sender):
        if self._stale_join(msg.node, msg.join):
            # The agent of an earlier member under this name (lost, then replaced): not acked, so
            # it exits; its heartbeats kept the new member's node "seen" and set its data service.
            return
        self.send(sender, NodeHeartbeatAck())
        self._agents[msg.node] = sender
        joining = self._joining.get(msg.node)
        if joining is not None and joining[1] == msg.join:
            del self._joining[msg.node]
            self._joined(joining[0])
        node = self._inventory.nodes.get(msg.node)
        if node is not None and not node.alive and (
                node.down_reason == LEFT_REASON or msg.join != self._joins.get(msg.node, 0)):
            # Sent before its leave notice and delivered after it, or from the agent of an
            # earlier join: a node that left comes back by joining again.
            return
        if node is not None and not node.alive:
            # It was declared lost (paused, partitioned) but is back: its old replicas
            # were told to exit; it starts again with all its devices free (drained still, if it was).
            drained = node.drained
            self._inventory.add(node.info)
            if drained:
                self._inventory.drain(msg.node, operator=True)
            self._log.warning("node_back", node=msg.node)
            for pool in self._pools.values():
                self.send(pool, NodesChanged())
            self._publish_status()
        elif node is not None:
            node.last_seen = time.monotonic()
        node = self._inventory.nodes.get(msg.node)
        if node is not None:
            node.data_service, node.buffers = msg.data_service, msg.buffers
            node.free_buffers, node.free_bytes = msg.free_buffers, msg.free_bytes
            flipped = bool(msg.data_service_silent_s) != bool(node.data_service_silent_s)
            if flipped:
                (self._log.warning if msg.data_service_silent_s else self._log.info)(
                    "node_data_service_silent" if msg.data_service_silent_s else "node_data_service_answers",
                    node=msg.node, silent_s=msg.data_service_silent_s)
            node.data_service_silent_s = msg.data_service_silent_s
            if flipped:
                self._publish_status()  # (an API server about to run a request again waits for this)
        silent = self._silent_data_services()
        if silent != self._silent_sent:  # (also a silent node lost, or back)
            self._silent_sent = silent
            for pool in self._pools.values():
                self.send(pool, silent)

    def _silent_data_services(self) -> DataServicesSilent:
        """The live nodes whose data service does not answer now (their node agents' heartbeats
        say), and the services not to wait on: theirs and those of nodes lost or gone (a review:
        a silent node then lost left the set, which replicas took for "it answers again")."""
        nodes = self._inventory.nodes.values()
        return DataServicesSilent(
            tuple(sorted(n.info.name for n in nodes if n.alive and n.data_service_silent_s)),
            tuple(sorted({n.data_service for n in nodes if n.data_service
                          and (not n.alive or n.data_service_silent_s)})))

    def receiveMsg_PlaceReplica(self, msg: PlaceReplica, sender):
        self._asks[msg.replica] = msg
        if msg.pin_devices:  # (its launch's plan is its ask now)
            self._planned_pins = [p for p in self._planned_pins
                                  if (p[2], p[3]) != ((msg.nodes or ("",))[0], tuple(msg.pin_devices))]
        try:
            node, devices = self._inventory.place(msg.stage, msg.replica, msg.devices, msg.nodes,
                                                  pin=msg.pin_devices, prefer=msg.prefer,
                                                  first=() if msg.pin_devices else self._first_in_line(msg),
                                                  reserved={} if msg.pin_devices else self._reserved_pins())
        except PlacementError as exc:
            if isinstance(exc, KeptForOthers):
                self._kept_from.add(sender)
            self.send(sender, PlacementFailed(msg.replica, str(exc)))
            return
        known = self._inventory.nodes.get(node)
        self.send(sender, Placement(msg.replica, node, devices, known.info.member if known else ""))
        self._retry_kept()

    def _retry_kept(self) -> None:
        """The pools refused while devices were kept for other stages retry now: a replica was
        placed or a stage's replicas changed state, so those stages may run (or want none) now.
        Trial CE's start-up table showed talker/1 `pending` "the free devices are kept for stage
        thinker, which has no replica running" beside thinker/0 ready, until the pool's own
        retry (every 8 heartbeat intervals). A pool refused again is told again at the next change."""
        kept, self._kept_from = self._kept_from, set()
        for pool in kept:
            self.send(pool, NodesChanged())

    def _first_in_line(self, ask: PlaceReplica) -> tuple[FirstInLine, ...]:
        """The other stages that have no replica running (placed, or reported starting
        or ready, on an open node) and one that wants to run, when ``ask``'s stage has
        one running besides ``ask.replica``: their devices are not given to it."""
        nodes = self._inventory.nodes
        placed: dict[str, set[str]] = {}  # stage -> its replicas placed on open nodes
        for node in nodes.values():
            if node.open:
                for replica, stage in node.replicas.items():
                    placed.setdefault(stage, set()).add(replica)

        def running(stage: str, state: PoolState | None, but: str = "") -> set[str]:
            reported = {r.replica for r in (state.replicas if state else ())
                        if r.state in (ReplicaState.READY, ReplicaState.STARTING)
                        and r.node in nodes and nodes[r.node].open}
            return (placed.get(stage, set()) | reported) - {but}

        states = {st.stage: st for st in self._states.values()}
        if not running(ask.stage, states.get(ask.stage), ask.replica):
            return ()  # its own stage has none running: it is one of the first
        first = []
        for stage, state in states.items():
            if stage == ask.stage or running(stage, state):
                continue
            wanting = [r.replica for r in state.replicas
                       if r.state not in (ReplicaState.FAILED, ReplicaState.STOPPED)]
            # (a new pool that has not reported yet wants its config's replicas, below: trial BT saw a
            # second Talker take the last device at start-up while Code2Wav's pool had not reported)
            if not wanting and (state.replicas or state.stage_id in self._reported):
                continue
            asked = next((self._asks[r] for r in wanting if r in self._asks), None)
            if asked is not None and asked.pin_devices:
                continue  # pinned: it waits for its own devices, not for any
            if asked is None:
                dep = self._config.deployment_of(self._config.stage_by_name(stage))
                first.append(FirstInLine(stage, dep.devices_per_replica, tuple(dep.nodes)))
            else:
                first.append(FirstInLine(stage, asked.devices, asked.nodes))
        return tuple(first)

    def _reserved_pins(self) -> dict[tuple[str, str], str]:
        """``(node, device) -> replica``: the devices pinned to replicas that are not stopped
        (as their pools report them, and as they last asked), and those of launches planned
        in the last :data:`PLANNED_PIN_S` whose replicas have not asked yet: no other replica
        takes them (see :func:`~omni_actors.placement.pinned_devices`)."""
        states = {r.replica: r.state for st in self._states.values() for r in st.replicas}
        rows = [(r.replica, r.pin, r.state.value) for st in self._states.values() for r in st.replicas]
        rows += [(r, ((a.nodes or ("",))[0], a.pin_devices), "asked") for r, a in self._asks.items()
                 if a.pin_devices and states.get(r) != ReplicaState.STOPPED]
        now = time.monotonic()
        self._planned_pins = [p for p in self._planned_pins if now - p[0] < PLANNED_PIN_S]
        rows += [(f"a {stage} replica being launched", (node, devices), "planned")
                 for _, stage, node, devices in self._planned_pins]
        return pinned_devices(rows)

    def receiveMsg_ReleasePlacement(self, msg: ReleasePlacement, sender):
        self._inventory.release(msg.replica)

    # -- discovery and subscriptions --------------------------------------
    def receiveMsg_GetStatus(self, msg: GetStatus, sender):
        self.send(msg.reply_to or sender, self._status(msg.query_id))

    def receiveMsg_GetRoutes(self, msg: GetRoutes, sender):
        self.send(msg.reply_to or sender, self._routes())

    def receiveMsg_WhoAmI(self, msg: WhoAmI, sender):
        self.send(sender, YouAre(sender))

    def receiveMsg_Subscribe(self, msg: Subscribe, sender):
        now = time.monotonic()
        known = next((s for s in self._subscribers if s.address == msg.reply_to), None)
        self._subscribers = [s for s in self._subscribers
                             if s.address != msg.reply_to and now - s.renewed_at < SUBSCRIPTION_LEASE_S]
        self._subscribers.append(_Subscriber(msg.reply_to, now))
        if (known is None or known.behind) and self._config is not None:
            self.send(msg.reply_to, self._routes())
            self.send(msg.reply_to, self._status(SUBSCRIPTION))

    def receiveMsg_PublicationsReceived(self, msg: PublicationsReceived, sender):
        sub = next((s for s in self._subscribers if s.address == msg.reply_to), None)
        if sub is None:  # (renewed meanwhile, and counted afresh; or not ours: a restarted coordinator)
            return
        sub.sent = max(0, sub.sent - msg.count)
        if sub.behind and self._config is not None:  # it missed some: the latest, now
            sub.behind = False
            sub.sent += 2
            self.send(sub.address, self._routes())
            self.send(sub.address, self._status(SUBSCRIPTION))

    def receiveMsg_Unsubscribe(self, msg: Unsubscribe, sender):
        self._subscribers = [s for s in self._subscribers if s.address != msg.reply_to]
        drain = self._api_drain
        if drain is not None and msg.reply_to in drain.left:  # (it exited: nothing of it to wait for)
            drain.left.remove(msg.reply_to)
            if not drain.left:
                self._answer_api_drain()

    def _routes(self) -> Routes:
        return Routes(self._config, dict(self._pools), self._routes_version, self._deployed_at,
                      inherited=frozenset(self._inherited),
                      given_up=tuple((sid, self._pools_down[sid]) for sid in sorted(self._pools_given_up)
                                     if sid in self._pools_down))

    def _publish_routes(self) -> None:
        self._publish(self._routes())

    def _publish_status(self) -> None:
        if self._config is None:
            return
        self._publish(self._status(SUBSCRIPTION))

    def _publish(self, message) -> None:
        """``message`` to each subscriber that has fewer than :data:`SUBSCRIBER_BACKLOG`
        unanswered (sent since it last renewed, less those it said came:
        :class:`PublicationsReceived`, every few); those that have get the latest routes
        and status once they answer, or renew. Thespian keeps a fixed number of transmits
        in flight per sender, and those to a frozen API server stay in flight up to 5
        minutes: a burst of changes published to one would otherwise silence the
        coordinator (see DeltaWindow for the engines)."""
        for sub in self._subscribers:
            if sub.sent < SUBSCRIBER_BACKLOG:
                sub.sent += 1
                self.send(sub.address, message)
            elif not sub.behind:
                sub.behind = True
                # (a burst of changes, a deployment's, holds back a healthy one until it answers:
                # info; one that has missed its renewal may be frozen: warning)
                ago = time.monotonic() - sub.renewed_at
                (self._log.warning if ago > SUBSCRIBER_LATE_S else self._log.info)(
                    "subscriber_behind", subscriber=str(sub.address), sent=sub.sent, renewed_s_ago=round(ago, 1))

    # -- admin ------------------------------------------------------------
    def _pool_of_replica(self, replica: str):
        stage = replica.rsplit("/", 1)[0]
        return next((self._pools[s.stage_id] for s in self._config.stage_args if s.name == stage), None) \
            if self._config else None

    def _pool_down(self, pool) -> str | None:
        """Why ``pool`` (an exited one, not yet replaced) takes no admin request; None if it does."""
        for stage in (self._config.stage_args if self._config else ()):
            if self._pools.get(stage.stage_id) == pool and stage.stage_id in self._pools_down:
                return f"stage {stage.name}: {self._pools_down[stage.stage_id]}"
        return None

    def _forward_admin(self, pool, msg, sender, missing: str) -> None:
        """Pass an admin request to its pool, which answers the requester directly (at once
        here, with the reason, when its pool is down, or with ``missing`` when there is no
        such stage or replica)."""
        down = NOT_DEPLOYED if self._config is None else self._pool_down(pool) if pool is not None else None
        if pool is None or down:
            self.send(msg.reply_to or sender, AdminReply(False, down or missing))
        else:
            self.send(pool, dataclasses.replace(msg, reply_to=msg.reply_to or sender))

    def receiveMsg_SignalFault(self, msg: SignalFault, sender):
        self._log.warning("fault_injected", kind=msg.fault, target=msg.target, target_pid=msg.pid,
                          **({"replica": msg.target} if "/" in msg.target else {}))
        self.send(sender, AdminReply(True, "noted"))

    def receiveMsg_InjectFault(self, msg: InjectFault, sender):
        if self._stopped(msg.replica):  # (as its pool and the signal faults say it)
            self.send(msg.reply_to or sender, AdminReply(False, f"{msg.replica} is stopped, not running "
                                                                "(see `status`)"))
            return
        self._forward_admin(self._pool_of_replica(msg.replica), msg, sender, self._no_replica(msg.replica))

    def receiveMsg_DrainReplica(self, msg: DrainReplica, sender):
        if self._stopped(msg.replica):
            self.send(msg.reply_to or sender, AdminReply(
                False, f"{msg.replica} is stopped, not ready or starting: nothing to drain"))
            return
        self._forward_admin(self._pool_of_replica(msg.replica), msg, sender, self._no_replica(msg.replica))

    def _stopped(self, replica: str) -> bool:
        """Whether ``status`` lists ``replica`` as stopped (a name is never reused, so it stays
        so). Its pool may not know it: one made after a pool or coordinator was replaced
        starts only the replicas that were running (trial BF: `stage drain` of such a one read
        "no replica named", `inject` "no live replica")."""
        return any(r.replica == replica and r.state == ReplicaState.STOPPED
                   for st in self._states.values() for r in st.replicas)

    def _restart_given_up(self, stage_name: str) -> None:
        """An operator's `stage scale` or `stage launch` of a stage whose pool was given up
        restarts it now (the size it asks for is the size wanted; else the operator had no
        way but to wait ``failed_retry_s`` or restart the system, a code review)."""
        stage = next((s for s in (self._config.stage_args if self._config else ()) if s.name == stage_name), None)
        if stage is not None and stage.stage_id in self._pools_given_up and not self._stopping:
            self._restart_pool(stage.stage_id, by="operator")

    def receiveMsg_ScaleStage(self, msg: ScaleStage, sender):
        self._restart_given_up(msg.stage)
        self._forward_admin(self._pool_of_replica(msg.stage + "/"), msg, sender, self._no_stage(msg.stage))

    @staticmethod
    def _no_replica(name: str) -> str:
        return f"no replica named {name!r} (see `status`)"

    def _no_stage(self, name: str) -> str:
        """``no stage named 'talkr' (stages: thinker, talker, code2wav)``."""
        stages = ", ".join(st.name for st in self._config.stage_args) if self._config is not None else ""
        return f"no stage named {name!r}" + (f" (stages: {stages})" if stages else "")

    def receiveMsg_LaunchReplicas(self, msg: LaunchReplicas, sender):
        """Check a launch that names a node or devices against the inventory, then pass
        it to the pool with one pin per replica (or the reason it cannot be done)."""
        reply_to = msg.reply_to or sender
        self._restart_given_up(msg.stage)
        pool = self._pool_of_replica(msg.stage + "/")
        down = NOT_DEPLOYED if self._config is None else self._pool_down(pool) if pool is not None else None
        if pool is None or down:
            self.send(reply_to, AdminReply(False, down or self._no_stage(msg.stage)))
            return
        dep = self._config.deployment_of(self._config.stage_by_name(msg.stage))
        try:
            pins = self._inventory.plan_launch(msg.stage, msg.replicas, dep.devices_per_replica,
                                               allowed=tuple(dep.nodes), node=msg.node, devices=msg.devices,
                                               reserved=self._reserved_pins())
        except PlacementError as exc:
            self.send(reply_to, AdminReply(False, str(exc)))
            return
        now = time.monotonic()  # (kept until their replicas ask: a second launch at once may not take them)
        self._planned_pins += [(now, msg.stage, node, tuple(devices)) for node, devices in pins if devices]
        self.send(pool, dataclasses.replace(msg, pins=pins, reply_to=reply_to))

    # -- shutdown ---------------------------------------------------------
    def receiveMsg_ActorExitRequest(self, msg: ActorExitRequest, sender):
        self._stopping = True  # the system is shutting down: pools exiting is expected

    def receiveMsg_ShutdownSystem(self, msg: ShutdownSystem, sender):
        """Tell every pool its replicas' exits are now planned, then (once each has said it
        noted that, or after :data:`PLANNED_STOP_WAIT_S`) tell the pools to exit and answer
        ``ShutdownDone``: the system's shutdown that follows may report replicas exited
        before a pool's exit request reaches it."""
        self._stopping = True
        self._shutdown_waiters.append(sender)
        if self._stop_unnoted is None:
            self._stop_unnoted = set(self._pools)
            for pool in self._pools.values():
                self.send(pool, PlannedStop())
            for node, agent in self._agents.items():  # (not waited for: see PlannedStop)
                if node in self._inventory.nodes and self._inventory.nodes[node].alive:  # (a lost host's
                    self.send(agent, PlannedStop())  # transmit could only wait for it)
            self.wakeupAfter(PLANNED_STOP_WAIT_S, payload="planned_stop_deadline")
        self._end_planned_stop()

    def receiveMsg_PlannedStopNoted(self, msg: PlannedStopNoted, sender):
        if self._stop_unnoted is not None:
            self._stop_unnoted.discard(msg.stage_id)
            self._end_planned_stop()

    def _end_planned_stop(self, force: bool = False) -> None:
        if self._stop_unnoted is None or (self._stop_unnoted and not force) or not self._shutdown_waiters:
            return
        if self._stop_unnoted:
            self._log.warning("planned_stop_unanswered", stages=sorted(self._stop_unnoted),
                              waited_s=PLANNED_STOP_WAIT_S)
        self._stop_unnoted = set()
        for pool in self._pools.values():
            self.send(pool, ActorExitRequest())
        for waiter in self._shutdown_waiters:
            self.send(waiter, ShutdownDone())
        self._shutdown_waiters.clear()

    def receiveMsg_DrainApiServers(self, msg: DrainApiServers, sender):
        if msg.hurry:
            for address in (self._api_drain.left if self._api_drain is not None else ()):
                self.send(address, SystemStopping(msg.drain_timeout_s, hurry=True))
            return
        now = time.monotonic()
        servers = [s.address for s in self._subscribers
                   if s.address != msg.exclude and now - s.renewed_at < SUBSCRIPTION_LEASE_S]
        self._api_drain = _ApiDrain(sender, servers, len(servers), since=now)
        self._log.info("api_servers_told_to_drain", api_servers=len(servers), drain_timeout_s=msg.drain_timeout_s)
        for address in servers:
            self.send(address, SystemStopping(msg.drain_timeout_s))
        if servers:
            self.wakeupAfter(msg.timeout_s, payload="api_drain_deadline")
        else:
            self._answer_api_drain()

    def receiveMsg_ApiServerDrained(self, msg: ApiServerDrained, sender):
        drain = self._api_drain
        if drain is not None and msg.address in drain.left:
            drain.left.remove(msg.address)
            drain.ended += msg.ended
            if not drain.left:
                self._answer_api_drain()

    def _check_api_drain(self) -> None:
        """(Every node check) Stop waiting for the drain of an API server that has not renewed
        its subscription for :data:`API_DRAIN_SILENT_S`; answer once none is left."""
        drain = self._api_drain
        if drain is None:
            return
        now = time.monotonic()
        renewed = {str(s.address): s.renewed_at for s in self._subscribers}
        for address in list(drain.left):
            silent_s = now - renewed.get(str(address), drain.since)
            if silent_s > API_DRAIN_SILENT_S:
                drain.left.remove(address)
                drain.silent += 1
                self._log.warning("api_server_silent_at_stop", api_server=str(address), silent_s=round(silent_s, 1),
                                  note="not waited for: it stopped renewing its subscription (frozen, or gone)")
        if not drain.left:
            self._answer_api_drain()

    def _aged(self, state: PoolState) -> PoolState:
        """``state`` with its replicas' heartbeat ages as of now: grown by the time since its
        pool reported them (a code review: a frozen pool's last report served every scrape,
        its replicas' ages near 0, until the pool was killed; trial CK: between two reports
        every scrape read the same age, a flat line, and an alert on it fired up to a report
        late)."""
        silent = time.monotonic() - self._pool_heard.get(state.stage_id, time.monotonic())
        if silent <= 0 or state.stage_id in self._pools_down:
            return state
        return dataclasses.replace(state, replicas=tuple(
            dataclasses.replace(r, last_heartbeat_age_s=round(r.last_heartbeat_age_s + silent, 3))
            if r.last_heartbeat_age_s is not None else r for r in state.replicas))

    def _answer_api_drain(self) -> None:
        drain, self._api_drain = self._api_drain, None
        if drain is not None:
            self.send(drain.asker, ApiServersDrained(told=drain.told, late=len(drain.left), ended=drain.ended,
                                                     silent=drain.silent))

    def _dead_devices(self, state: PoolState) -> PoolState:
        """``state`` with each DEAD replica's devices cut to those still reserved for it: one that
        is not pinned gives its devices back while it waits to restart (a review: `status` and
        ``omni_replica_info`` showed them held, beside another replica placed on them); one whose
        pool exited keeps them."""
        nodes = self._inventory.nodes

        def held(r):
            node = nodes.get(r.node)
            if r.state != ReplicaState.DEAD or not r.devices or node is None or not node.info.devices:
                return r
            return dataclasses.replace(r, devices=",".join(d for d in r.devices.split(",")
                                                           if node.used.get(d) == r.replica))
        return dataclasses.replace(state, replicas=tuple(held(r) for r in state.replicas))

    def _status(self, query_id: str) -> SystemStatus:
        stages = tuple(self._dead_devices(self._aged(self._states[s.stage_id]))
                       for s in self._config.stage_args) if self._config else ()
        # (a lingering replica takes no new request: trial BK read ready, exit 0, while every
        # Talker lingered on a leaving member and new audio requests waited for a replacement)
        ready = bool(stages) and all(any(r.state == ReplicaState.READY and not r.lingering for r in st.replicas)
                                     for st in stages) \
            and not self._pool_silent  # (a silent pool routes nothing: see _check_pools)
        model = self._config.deployment.served_model_name if self._config else ""
        notes = ((tuple(self._config.omni_connectors.notes) if self._config else ()) + self._pool_notes()
                 + tuple(self._shared_devices()) + tuple(
                     f"node {n.info.name}: its data service has not answered for {n.data_service_silent_s:g} s (its "
                     "host process frozen or hung?): stage outputs made there cannot be fetched from other hosts"
                     for n in self._inventory.nodes.values() if n.alive and n.data_service_silent_s))
        now = time.monotonic()
        subscribers = tuple(s.address for s in self._subscribers if now - s.renewed_at < SUBSCRIPTION_LEASE_S) \
            if query_id == WATCHDOG_QUERY else ()
        return SystemStatus(query_id=query_id or str(time.time()), model=model, ready=ready, stages=stages,
                            coordinator_pid=os.getpid(), nodes=self._inventory.status(), notes=notes,
                            coordinator_host=host_identity(), leader_node=self._leader_node,
                            drain_timeout_s=self._config.deployment.supervision.drain_timeout_s if self._config else 0.0,
                            subscribers=subscribers)


@dataclasses.dataclass
class _Subscriber:
    """An API server's bridge that gets the routes and status as they change."""

    address: object
    renewed_at: float  #: (monotonic) its last Subscribe
    sent: int = 0  #: publications sent to it since then, less those it said came (PublicationsReceived)
    #: some were not sent (SUBSCRIBER_BACKLOG): it gets the latest when it says it has the others,
    #: or renews
    behind: bool = False


@dataclasses.dataclass
class _ApiDrain:
    """A stop's drain of the attached API servers: who asked, the servers that have not
    answered yet, how many were told, the requests they ended at their timeout, and how
    many were given up as silent."""

    asker: object
    left: list
    told: int
    ended: int = 0
    silent: int = 0  #: servers no longer waited for (see API_DRAIN_SILENT_S)
    since: float = 0.0  #: (monotonic) when the drain began


def _split(value) -> tuple[str, ...]:
    """``"0,1"`` or ``["0", "1"]`` -> ``("0", "1")``; None or "" -> ``()``."""
    if not value:
        return ()
    items = value.split(",") if isinstance(value, str) else value
    return tuple(str(i).strip() for i in items if str(i).strip())


def _states_of(state: PoolState) -> tuple:
    return tuple((r.replica, r.state, r.reason) for r in state.replicas)
