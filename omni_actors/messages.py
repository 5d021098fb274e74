"""The whole actor protocol, in one module.

Every message is a small frozen dataclass that pickles (the TCP base pickles
every message; ``simpleSystemBase`` does not, so test on TCP). Bulk data never
rides here: stage outputs travel as :class:`~omni_actors.connectors.base.ConnectorRef`.

Who sends what:

- control plane: CLI -> Coordinator (:class:`Deploy`, :class:`GetStatus`,
  :class:`GetRoutes`); Coordinator -> pool (:class:`StartPool`); pool ->
  engine (:class:`StartEngine`); engine -> pool (:class:`EngineReady`,
  :class:`EngineFailed`, :class:`Heartbeat`); pool -> Coordinator
  (:class:`PoolState`).
- request plane: bridge -> RequestActor (:class:`RunRequest`,
  :class:`CancelRequest`); RequestActor -> pool -> engine (:class:`StageTask`,
  :class:`CancelStage`); engine -> RequestActor (:class:`TextStarted`,
  :class:`StageDone`, :class:`StageFailed`, :class:`StageCancelled`); engine
  -> pool (:class:`TaskFinished`); engine -> bridge (:class:`OutputDeltas`:
  streamed text goes straight to the client's API server; the bridge answers
  some with :class:`DeltasAck`); RequestActor ->
  bridge (:class:`OutputChunk`, :class:`OutputReady`, :class:`RequestFinished`,
  :class:`RequestActorFree`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from omni_actors.config import PipelineConfig, StageDeployment, StageSpec, Supervision
from omni_actors.connectors.base import ConnectorRef

ActorAddress = Any  # thespian.actors.ActorAddress; kept loose so this module imports without thespian


class Message:
    """Base of every message here: a short ``str()`` (the class and the request).

    Thespian formats every message it sends or receives for its debug log
    (``str(message)``, evaluated even when that log is off): with the
    dataclass ``repr`` of a task (its refs, layouts and addresses) that was
    20-30% of the CPU a message costs (measured: ping-pong of
    ``StageTask``/``StageDone`` between two actors). ``repr()`` is unchanged.
    """

    __slots__ = ()

    def __str__(self) -> str:
        rid = getattr(self, "request_id", None)
        return f"{type(self).__name__}({rid})" if rid is not None else type(self).__name__


class ReplicaState(str, enum.Enum):
    """Lifecycle of one engine replica."""

    PENDING = "pending"  #: waiting for a node with free devices (placement); retried as nodes join
    STARTING = "starting"  #: created; backend loading; no work routed
    READY = "ready"  #: loaded and taking work
    ISOLATED = "isolated"  #: unhealthy (``reason`` says why): no new work; being killed, then restarted
    DRAINING = "draining"  #: finishing in-flight work, taking no new work, then exits
    DEAD = "dead"  #: its process exited; a restart is pending (backoff)
    FAILED = "failed"  #: down for good: failed to load, or restarted too often; ``reason`` says why
    STOPPED = "stopped"  #: drained or scaled down on purpose


#: States in which a replica has (or is getting) a process of its own.
LIVE_STATES = (ReplicaState.STARTING, ReplicaState.READY, ReplicaState.DRAINING, ReplicaState.ISOLATED)

#: ``reason`` of a PENDING replica whose placement request is still out.
PLACING = "waiting for placement"


class FaultKind(str, enum.Enum):
    """Faults the engine injects into itself, for fault-injection tests."""

    RAISE_NEXT = "raise"  #: the backend raises on the next task
    SLOW = "slow"  #: every task takes ``factor`` times as long
    STALL = "stall"  #: tasks stop making progress; heartbeats go on
    CLEAR = "clear"  #: back to normal


class ErrorKind(str, enum.Enum):
    """Why a request failed; maps to the HTTP status the client sees."""

    UNAVAILABLE = "unavailable"  #: no ready replica for a stage (503)
    TIMEOUT = "timeout"  #: the request deadline passed (504)
    ENGINE_ERROR = "engine_error"  #: a stage's engine raised (500)
    BAD_REQUEST = "bad_request"  #: a stage rejected the input (400)
    #: replicas died while running the request's stage, ``supervision.max_task_crashes``
    #: of them: not retried, it may be what crashes them (500)
    CRASHED = "crashed"
    #: a stage's input processor failed on its upstream stages' outputs (500): a pipeline or
    #: processor error, not the client's input, and the same on any replica: not retried
    STAGE_INPUT = "stage_input"
    #: an upstream stage's output could not be fetched: the data service of the host it was on
    #: is unreachable (the host is gone). Not the consuming replica's fault, and the same on any
    #: replica: not retried there; the API server runs the request again once the host is
    #: reported down, if nothing reached the client yet (500 otherwise)
    INPUT_LOST = "input_lost"
    CANCELLED = "cancelled"  #: the client went away


# -- control plane --------------------------------------------------------


@dataclass(frozen=True)
class Deploy(Message):
    """CLI -> Coordinator: serve this config. Answered with :class:`SystemStatus`
    once every replica is ready, failed or pending placement (or ``ready_timeout_s`` passed)."""

    config: PipelineConfig
    leader_node: "NodeInfo | None" = None  #: the leader host's own node (it runs replicas too)
    #: The stages as the coordinator before this one last reported them (the leader's watchdog
    #: sends them when it redeploys to a recreated coordinator): each stage's pool starts the
    #: replicas they list, under their names, with their counters and restart history, as a
    #: pool recreated after a crash does; empty: the config's replica counts.
    previous: tuple = ()
    #: Nodes an operator had drained (``node drain``) under the coordinator before this one: they
    #: stay drained here, each as it joins this coordinator (trial BF: a coordinator crash put
    #: every replica back on a node drained for maintenance, and `node undrain` said it was not).
    drained_nodes: tuple[str, ...] = ()
    #: The API servers subscribed to the coordinator before this one: they get this one's routes
    #: at once, not at their next renewal (trial BF: for 1.8 s after a coordinator crash the API
    #: server sent new requests to the old, exiting pools, and their streams failed part-way).
    subscribers: tuple = ()
    #: Unix seconds the pipeline was first deployed (``created`` in ``/v1/models``, the same from
    #: every API server, also after a coordinator restart); 0: now
    deployed_at: int = 0


@dataclass(frozen=True)
class NodeInfo(Message):
    """A host that offers devices to replicas (from its admin's capabilities)."""

    name: str
    devices: tuple[str, ...] = ()  #: GPU ids it offers; empty: a CPU node (replicas get no devices)
    stages: tuple[str, ...] = ()  #: stages it accepts; empty: any
    admin: ActorAddress = None
    #: the host process's own id (its admin's ``omni_member`` capability): actors placed on the
    #: node go to this admin, not to another (a lost one, still up) of the same node name
    member: str = ""
    #: the machine it runs on (``supervision.host_identity()``, its admin's ``omni_host``
    #: capability; "" where unknown): two nodes on one machine offering one device id may share it
    host: str = ""


@dataclass(frozen=True)
class NodeStatus(Message):
    name: str
    alive: bool
    devices: tuple[str, ...]
    used: dict[str, str]  #: device -> replica holding it
    stages: tuple[str, ...]
    replicas: tuple[str, ...]  #: replicas placed there
    last_seen_age_s: float | None = None
    data_service: str | None = None  #: ``host:port`` of its data service (connectors across hosts)
    buffers: int | None = None  #: live shared-memory segments there (last heartbeat); None: unknown
    free_buffers: int | None = None  #: free (recycled, unclaimed) segments there, apart from ``buffers``
    free_bytes: int | None = None  #: their bytes
    #: why it is not alive: ``placement.LEFT_REASON`` (its member stopped cleanly), or what was missed
    down_reason: str = ""
    leaving: bool = False  #: alive, but its member is stopping: its replicas drain, nothing new goes there
    #: alive, but an operator drained it (``node drain``): nothing new goes there until ``node undrain``
    drained: bool = False
    #: seconds its data service has not answered (its host process frozen or hung; 0: it answers):
    #: stage outputs made there cannot be fetched from other hosts meanwhile
    data_service_silent_s: float = 0.0

    @property
    def state(self) -> str:
        """``alive``, ``drained`` (an operator drained it; its member runs on), ``leaving``
        (its member stops: draining), ``left`` (stopped cleanly) or ``lost`` (gone without a word)."""
        from omni_actors.placement import LEFT_REASON

        if self.alive:
            return "leaving" if self.leaving else "drained" if self.drained else "alive"
        return "left" if self.down_reason == LEFT_REASON else "lost"


@dataclass(frozen=True)
class PlaceReplica(Message):
    """Pool -> Coordinator: pick a node and ``devices`` free devices for ``replica``.
    Answered with :class:`Placement` or :class:`PlacementFailed`."""

    stage: str
    replica: str
    devices: int
    nodes: tuple[str, ...] = ()  #: allowed nodes (the stage's placement rule); empty: any
    pin_devices: tuple[str, ...] = ()  #: a pinned replica: exactly these devices of ``nodes[0]``
    #: where it ran last, ``(node, devices)`` or ``()``: taken again if they are free and
    #: allowed (a restarted replica, or one of a recreated pool or coordinator, goes back to
    #: its devices rather than to another replica's, whose old engine may still be exiting)
    prefer: tuple = ()


@dataclass(frozen=True)
class Placement(Message):
    replica: str
    node: str
    devices: tuple[str, ...]
    member: str = ""  #: the node's :attr:`NodeInfo.member` ("" : any admin of that node name)


@dataclass(frozen=True)
class PlacementFailed(Message):
    replica: str
    reason: str


@dataclass(frozen=True)
class ReleasePlacement(Message):
    """Pool -> Coordinator: ``replica`` is gone; its devices are free again."""

    replica: str


@dataclass(frozen=True)
class DataServicesSilent(Message):
    """Coordinator -> pools -> replicas: the nodes whose data service does not answer now
    (their host process frozen or hung: what replicas there make cannot be fetched from other
    hosts); a pool sends new tasks to replicas elsewhere while any is ready, and passes this
    on to its replicas, which end their fetches waiting on those services. Sent whenever the
    set changes, and to a new pool (by a pool: to a replica once ready)."""

    nodes: tuple[str, ...] = ()
    #: the data services (``host:port``) not to wait on: those nodes', and those of nodes lost
    #: or gone (replicas end their fetches waiting on them)
    services: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodesChanged(Message):
    """Coordinator -> pools: a node joined or came back, or devices kept for other stages
    may be free now (a refused pool's); retry pending placements."""

    #: the node an operator undrained (``node undrain``), if that is the change: its lingering
    #: replicas (``ReplicaStatus.lingering``) stay, as ready ones
    undrained: str = ""


@dataclass(frozen=True)
class NodeLost(Message):
    """Coordinator -> pools: ``node`` stopped answering; its replicas are gone."""

    node: str
    reason: str


@dataclass(frozen=True)
class StartNodeAgent(Message):
    """Coordinator -> the NodeAgentActor it placed on a member host."""

    node: str
    interval_s: float
    reap_after_s: float | None = None  #: the host's data service reaps buffers older than this
    join: int = 0  #: which join of the node to the convention this agent serves (its heartbeats say it)


@dataclass(frozen=True)
class NodeHeartbeat(Message):
    """NodeAgent -> Coordinator every interval; answered with :class:`NodeHeartbeatAck`."""

    node: str
    data_service: str | None = None  #: ``host:port`` of the host's data service
    buffers: int | None = None  #: live shared-memory segments of the host
    free_buffers: int | None = None  #: free (recycled, unclaimed) segments of the host, apart from ``buffers``
    free_bytes: int | None = None  #: their bytes
    join: int = 0  #: the agent's :attr:`StartNodeAgent.join`: heartbeats of an earlier join are stale
    #: seconds its data service has not answered the agent's probe, once past a few intervals; 0: it answers
    data_service_silent_s: float = 0.0


@dataclass(frozen=True)
class NodeHeartbeatAck(Message):
    pass


@dataclass(frozen=True)
class NodeLeaving(Message):
    """NodeAgent -> Coordinator: its member host is stopping cleanly (Ctrl-C), so that the
    node shows as left, not lost (Thespian's own notice says the same for both); or, with
    ``lost``, its actors are being stopped because its member process died (the host's
    watchdog): the node is lost for that reason."""

    node: str
    lost: str | None = None
    #: the agent's join (``StartNodeAgent.join``): one of an earlier join of the node's name
    #: (a member lost, then replaced by a new one under that name) is ignored; 0: not known
    join: int = 0


@dataclass(frozen=True)
class GetStatus(Message):
    """Anyone -> Coordinator: answered at once with :class:`SystemStatus`,
    sent to ``reply_to`` (or to the sender when None)."""

    query_id: str = ""
    reply_to: ActorAddress = None


@dataclass(frozen=True)
class GetRoutes(Message):
    """Bridge -> Coordinator: answered with :class:`Routes` (to ``reply_to`` or the sender)."""

    reply_to: ActorAddress = None


@dataclass(frozen=True)
class Subscribe(Message):
    """Subscriber (API server bridge) -> Coordinator: send me :class:`Routes` and
    :class:`SystemStatus` now and on every change. A lease: renew it every few
    seconds (a restarted coordinator learns its subscribers that way)."""

    reply_to: ActorAddress


@dataclass(frozen=True)
class PublicationsReceived(Message):
    """Subscriber (API server bridge) -> Coordinator: ``count`` more of the publications
    (routes, status) sent to it since its last renewal came. The coordinator keeps at most
    ``SUBSCRIBER_BACKLOG`` unanswered; one that fell behind in a burst of changes gets the
    latest at once, not at its next renewal (up to 2 s of a stale status, in which its
    admission could refuse a stage that was ready again)."""

    reply_to: ActorAddress
    count: int


@dataclass(frozen=True)
class Unsubscribe(Message):
    """Subscriber (API server bridge) -> Coordinator, as its server exits: forget me (a
    stop would otherwise wait for it to drain, until its silence showed: a trial's next
    ``stop`` took 5-6 s after an attached server had exited)."""

    reply_to: ActorAddress


@dataclass(frozen=True)
class WhoAmI(Message):
    """External endpoint -> Coordinator: answered with :class:`YouAre`, which
    tells a bridge thread its own address (Thespian exposes no other way)."""


@dataclass(frozen=True)
class YouAre(Message):
    address: ActorAddress


@dataclass(frozen=True)
class Routes(Message):
    """The pool address of each stage, for building :class:`RequestPlan`s.
    ``version`` grows each time a pool is replaced."""

    config: PipelineConfig
    pools: dict[int, ActorAddress]
    version: int = 0
    #: when the coordinator took its config (Unix seconds): the served model's ``created``,
    #: the same through every API server
    deployed_at: int = 0
    #: Stages whose pool is the first one this coordinator made after it replaced a lost
    #: coordinator: the pool before it was not seen to die (it drains its replicas, which
    #: finish their tasks in flight), so a RequestActor with a task there waits for it.
    inherited: frozenset = frozenset()
    #: ``(stage_id, why)`` of stages whose pool exited and was given up on (its restarts used
    #: up; tried again after ``failed_retry_s``): a RequestActor with a task there, or one still
    #: to send, ends its request at once (it waited for its deadline: a code review)
    given_up: tuple = ()


@dataclass(frozen=True)
class ReplicaStatus(Message):
    replica: str  #: "<stage>/<index>"
    state: ReplicaState
    reason: str = ""  #: why it is in that state (failure message, isolation cause, ...)
    in_flight: int = 0  #: tasks dispatched by the pool and not yet finished
    running: int = 0  #: as last reported by the engine's heartbeat
    waiting: int = 0
    completed: int = 0
    failed: int = 0
    last_heartbeat_age_s: float | None = None
    pid: int | None = None
    node: str = ""
    #: its devices: the last ones it had once stopped or failed; a dead one's in a ``SystemStatus``,
    #: only those still reserved for it (the coordinator's ``_dead_devices``)
    devices: str = ""
    backend: str = ""
    restarts: int = 0
    #: a fault injected into it and still in force, as its last heartbeat said ("slow x20"); "" none
    fault: str = ""
    rate: float = 0.0  #: tokens / frames / items per second, over the last heartbeats
    kv_cache_usage: float | None = None
    latency_buckets: tuple[int, ...] = ()  #: stage task latency histogram (``LATENCY_BUCKETS_S``)
    latency_sum_s: float = 0.0
    #: ``(node, devices)`` the replica was launched pinned to (``stage launch --node/--devices``;
    #: devices may be empty: that node only); ``()``: placed wherever it fits
    pin: tuple = ()
    #: READY on a node that is leaving, as the last ready replica of its stage: it takes the
    #: tasks of the requests begun before it lingered, until another is ready or none of those is
    #: in flight, then drains (see :class:`NoRequestsInFlight`)
    lingering: bool = False
    #: since when it lingers (``time.time()``, seconds; 0.0 when it does not)
    lingering_since: float = 0.0
    #: pinned to a node that was drained or left, it drains (or lingers) there and starts again
    #: on that node once it is undrained or back (a pool recreated meanwhile launches it again)
    relaunch: bool = False
    #: the machine its process runs on (``supervision.host_identity()``); "" unknown or none
    host: str = ""

    def reason_label(self) -> str:
        """The REASON cell of a status table: its reason, and the fault injected into it, if any."""
        return "; ".join(filter(None, (self.reason, self.fault and f"fault injected: {self.fault}")))

    @property
    def held_devices(self) -> str:
        """The devices it holds now: none once it stopped or failed (``devices`` keeps
        the last ones it had then; a dead replica's, in a ``SystemStatus``, are only those
        still reserved for it)."""
        return self.devices if self.state not in (ReplicaState.STOPPED, ReplicaState.FAILED) else ""

    def devices_label(self) -> str:
        """The DEVICES cell of a status table: ``"2"``, ``"2 (pinned)"`` (to those devices),
        ``"- (pinned to 2)"`` (not held now: pending, stopped, failed), ``"2 (node pinned)"``
        (to its node only), ``"-"`` (none, or no longer held)."""
        held = self.held_devices
        if self.pin and self.pin[1] and not held:  # (a trial read a pending pinned replica's "- (pinned)")
            return f"- (pinned to {','.join(self.pin[1])})"
        return (held or "-") + ((" (pinned)" if self.pin[1] else " (node pinned)") if self.pin else "")


def replica_index(replica: str) -> int:
    """The index in a replica's name: ``"talker/3"`` -> 3 (names are ``<stage>/<index>``)."""
    return int(replica.rsplit("/", 1)[1])


#: Upper bounds (seconds) of the stage latency histogram buckets; the last is +Inf.
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, float("inf"))


@dataclass(frozen=True)
class PoolState(Message):
    """Pool -> Coordinator on every replica state change and every heartbeat interval."""

    stage_id: int
    stage: str
    replicas: tuple[ReplicaStatus, ...]
    pid: int | None = None
    pending: int = 0  #: tasks waiting for a ready replica
    restarts: int = 0  #: times the coordinator recreated this stage's pool
    #: (replica, monotonic times of its restarts) for the replicas restarted (the pool's reports only):
    #: a recreated pool carries them on, so its restart budget does not start over
    restart_times: tuple[tuple[str, tuple[float, ...]], ...] = ()
    #: (replica, why it went down) of its FAILED replicas: a recreated pool keeps them failed,
    #: tried again after ``failed_retry_s``, where it used to start them at once
    failed: tuple[tuple[str, str], ...] = ()
    #: the index the pool's next new replica gets (its names are never used twice)
    next_index: int = 0
    host: str = ""  #: the machine the pool's process runs on (``supervision.host_identity()``)
    #: the earliest ``StageTask.began_at`` of the tasks in flight or queued whose request goes
    #: on to another stage (``StageTask.feeds``); None: no such task
    feeding_began: float | None = None
    #: the earliest ``StageTask.began_at`` of all its tasks in flight or queued; None: none
    oldest_began: float | None = None


#: ``SystemStatus.query_id`` of the statuses the coordinator publishes to its subscribers.
SUBSCRIPTION = "subscription"
#: ``SystemStatus.query_id`` of the leader's watchdog: its answers also list the subscribers.
WATCHDOG_QUERY = "watchdog"


#: What an admin request or ``status`` gets from a coordinator that has no config yet.
NOT_DEPLOYED = ("the coordinator has no config yet: it was just recreated (the leader's watchdog redeploys "
                "the config) or the system is starting; try again in a few seconds")


@dataclass(frozen=True)
class SystemStatus(Message):
    query_id: str
    model: str
    ready: bool  #: every stage has at least one READY replica that takes new requests (not lingering)
    stages: tuple[PoolState, ...]
    coordinator_pid: int | None = None
    nodes: tuple[NodeStatus, ...] = ()
    coordinator_host: str = ""  #: the machine the coordinator runs on (``supervision.host_identity()``)
    #: the leader's node name (``--node-name``, or its host's name): where the control plane runs
    leader_node: str = ""
    #: the config's ``supervision.drain_timeout_s``: how long a drain waits (0: no config yet)
    drain_timeout_s: float = 0.0
    #: config settings accepted but not (or only partly) applied, one line each
    notes: tuple[str, ...] = ()
    #: (to the leader's watchdog only, :data:`WATCHDOG_QUERY`) the API servers' bridges subscribed
    #: to the routes and status, for the coordinator that replaces this one (:attr:`Deploy.subscribers`)
    subscribers: tuple = ()


@dataclass(frozen=True)
class StartPool(Message):
    """Coordinator -> pool: run this stage with these settings."""

    stage: StageSpec
    deployment: StageDeployment
    heartbeat_interval_s: float
    ready_timeout_s: float
    inline_threshold_bytes: int
    load_balancing: str = "least_loaded"
    supervision: Supervision = field(default_factory=Supervision)
    #: how its engines store outputs (``omni_actors.connectors.MODES``, or ``omni:...``:
    #: through a vLLM-Omni connector, ``omni_actors.connectors.omni``); None: each engine's default
    connector_mode: str | None = None
    #: The replicas to start, ``(replica id, pin, restart times, counters, failed, ran, was on)``
    #: each (was on: ``(node, devices)`` it last ran on, or ``()``, see ``PlaceReplica.prefer``; pin:
    #: ``(node, devices)`` or ``()``; monotonic seconds, this host's clock; counters: ``(completed,
    #: failed, latency buckets, latency sum in s, restarts)``, the last report's (restarts: its
    #: ``restarts`` count less its restart times); failed: why it went down
    #: if it is FAILED, then kept so, else ""; ran: it had a process under the last pool, so
    #: its new one is a restart), instead of ``deployment.replicas`` new ones: a
    #: pool recreated after a crash gets the replicas its predecessor ran (launched and scaled
    #: ones included, those scaled down or drained left out) with their restart history and
    #: counters (Prometheus counters must not go back).
    replicas: tuple[tuple[str, tuple, tuple[float, ...], tuple, str, bool, tuple], ...] | None = None
    #: the index of the next new replica's name (``<stage>/<index>``): a recreated pool goes on
    #: from its predecessor's, so no name is used twice
    next_index: int = 0
    #: The coordinator's process id and hostname (``supervision.ParentWatch``); 0: judge by acks.
    coordinator_pid: int = 0
    coordinator_host: str = ""
    #: with ``replicas``: why those that ran have a new process (their ``status`` reason)
    recreated_why: str = "its stage pool was lost and recreated"


@dataclass(frozen=True)
class StartEngine(Message):
    """Pool -> engine: load the backend, then answer :class:`EngineReady` or
    :class:`EngineFailed`."""

    replica: str
    stage: StageSpec
    deployment: StageDeployment
    heartbeat_interval_s: float
    inline_threshold_bytes: int
    node: str = ""
    devices: tuple[str, ...] | None = None  #: pinned devices; None: leave CUDA_VISIBLE_DEVICES alone (CPU node)
    #: ``deployment.connector`` (``omni_actors.connectors.MODES``) or an ``omni:`` mode
    #: (``omni_actors.connectors.omni``); None: ``$OMNI_ACTORS_CONNECTOR``, else auto
    connector_mode: str | None = None
    #: Seconds without the pool's heartbeat acks after which the replica takes its pool
    #: for gone and drains; the pool sends ``missed_heartbeats`` intervals (the silence
    #: it tolerates from the replica). 0: ``ORPHAN_AFTER_INTERVALS`` intervals.
    orphan_after_s: float = 0.0
    #: The pool's process id and hostname: an engine forked by its pool (same host) watches
    #: that pid (``supervision.ParentWatch``) instead of the acks' delay. 0: judge by acks.
    pool_pid: int = 0
    pool_host: str = ""
    #: Longest its engine's start waits for an old engine still holding its devices to exit
    #: (``actors.device_leases``), in seconds, before it kills it (``pool_placement.device_wait_s``).
    device_wait_s: float = 30.0
    #: Its place among the stage's live replicas (0, 1, ...: the lowest no other one has), by
    #: which a replica with no placed devices takes its share of the stage's ``runtime.devices``
    #: (``placement.replica_devices``; its name's index grows with every replacement)
    slot: int = 0
    #: Seconds a task waits for the stage's processor (``supervision.stall_timeout_s``): one of
    #: the user's runs on a thread of its own (see ``actors.processor_threads``)
    processor_timeout_s: float = 10.0


@dataclass(frozen=True)
class EngineReady(Message):
    """Engine -> pool: loaded. Registration: where it runs and on what."""

    replica: str
    pid: int = 0
    node: str = ""
    devices: str = ""
    backend: str = ""
    host: str = ""  #: the machine it runs on (``supervision.host_identity()``: where ``pid`` means something)
    #: what its start had to do about an old engine on its devices, for its ``status`` reason
    #: (``"killed the old engine that still held device 1 (held by talker/0, pid 4711) after 15 s"``)
    note: str = ""


@dataclass(frozen=True)
class EngineFailed(Message):
    replica: str
    reason: str


@dataclass(frozen=True)
class Heartbeat(Message):
    """Engine -> pool every heartbeat interval: load as the engine sees it."""

    replica: str
    running: int
    waiting: int
    completed: int
    failed: int
    kv_cache_usage: float | None = None
    progress: int = 0  #: tokens / frames / items produced since start (the stall watchdog's clock)
    idle_s: float | None = None  #: seconds since the last progress, as the engine measured it
    #: the fault injected into it that is in force (``"slow x20"``, ``"stall"``, ``"raise x2"``); "" none
    fault: str = ""
    #: the ``InjectFault.seq`` that ``fault`` follows (the pool ignores a heartbeat's ``fault``
    #: from before the fault it passed on last: `status` lost a fault injected just then)
    fault_seq: int = 0
    #: while it starts: the devices its engine waits for (held by an old engine), ``device_leases.describe``
    waiting_for: str = ""
    #: while it starts: its process and machine (``status`` showed no PID until it was ready,
    #: which with a device wait or a vLLM load is a minute or more)
    pid: int = 0
    host: str = ""
    #: while it starts: what its engine is doing (``EngineBackend.start_phase``: ``"loading the
    #: vLLM engine (weights, memory profile, KV cache)"``); "" once ready, or if it does not say
    phase: str = ""


@dataclass(frozen=True)
class HeartbeatAck(Message):
    """Pool -> engine, answering each heartbeat: an engine that stops getting
    acks has lost its pool and drains itself."""


@dataclass(frozen=True)
class NoRequestsInFlight(Message):
    """Coordinator -> pool with lingering replicas (``ReplicaStatus.lingering``): for
    ``LINGER_QUIET_S``, no pool has had a task in flight or queued of a request begun
    before they lingered that may still need them: they drain now."""


@dataclass(frozen=True)
class PoolStateAck(Message):
    """Coordinator -> pool, answering each :class:`PoolState`: a pool that stops
    getting acks has lost its coordinator and drains itself."""


@dataclass(frozen=True)
class SignalFault(Message):
    """Admin -> Coordinator, just before an admin signals a process (``inject sigkill``,
    ``sigstop``, ``sigcont``, ``kill-pool``, ``kill-coordinator``): the coordinator logs
    ``fault_injected`` and answers :class:`AdminReply`, so that a crash an operator caused is
    not read in the log as a real one (a trial's was not)."""

    fault: str
    target: str  #: ``thinker/0``, ``pool talker``, ``coordinator``
    pid: int


@dataclass(frozen=True)
class InjectFault(Message):
    """Anyone -> Coordinator -> pool -> engine ``replica``: inject a fault."""

    replica: str
    kind: FaultKind
    factor: float = 1.0  #: SLOW: how many times slower
    count: int = 1  #: RAISE_NEXT: how many of the next tasks raise
    reply_to: ActorAddress = None  #: who gets the :class:`AdminReply` (default: the sender)
    #: set by the pool: how many faults it has passed to this replica, this one included
    #: (the engine's heartbeats echo it: :attr:`Heartbeat.fault_seq`)
    seq: int = 0

    def log_fields(self) -> dict:
        """``kind``, and ``factor`` or ``count`` where the kind has one (for the log)."""
        extra = ({"factor": self.factor} if self.kind is FaultKind.SLOW else
                 {"count": self.count} if self.kind is FaultKind.RAISE_NEXT else {})
        return {"kind": self.kind.value, **extra}

    def describe(self) -> str:
        """The fault in force once this is applied, for ``status``: ``"slow x20"``,
        ``"stall"``, ``"raise x2"``; "" for ``clear``."""
        if self.kind is FaultKind.CLEAR:
            return ""
        if self.kind is FaultKind.SLOW:
            return f"slow x{self.factor:g}"
        if self.kind is FaultKind.RAISE_NEXT:
            return f"raise x{self.count}"
        return self.kind.value


@dataclass(frozen=True)
class DrainNode(Message):
    """A member host that stops cleanly (Ctrl-C) -> Coordinator -> every pool: nothing new
    is placed on ``node`` any more; each replica there stops taking tasks, a replacement
    starts elsewhere (a replica pinned to the node waits for it instead), and the replica
    stops once its tasks in flight finish. The member then leaves (:class:`NodeLeaving`)."""

    node: str = ""
    reply_to: ActorAddress = None
    #: an operator's ``node drain``: the member runs on, and the node takes work again after
    #: ``node undrain`` (:class:`UndrainNode`); the replicas' reason says "drained", not "leaving"
    operator: bool = False


@dataclass(frozen=True)
class UndrainNode(Message):
    """Admin -> Coordinator (``node undrain``): node ``node``, drained by an operator, takes
    new replicas again; pinned replicas waiting for it, and pending ones, are placed."""

    node: str = ""
    reply_to: ActorAddress = None


@dataclass(frozen=True)
class DrainReplica(Message):
    """-> Coordinator -> pool: stop routing to ``replica``, let it finish, stop it.
    To an engine: finish in-flight work, then exit."""

    replica: str = ""
    reply_to: ActorAddress = None


@dataclass(frozen=True)
class ScaleStage(Message):
    """-> Coordinator -> pool: run ``replicas`` replicas of ``stage`` (launch or drain)."""

    stage: str
    replicas: int
    reply_to: ActorAddress = None
    why: str = "scaled down"  #: the reason the replicas it retires give (``stage stop``: "stage stopped")


@dataclass(frozen=True)
class LaunchReplicas(Message):
    """-> Coordinator -> pool: add replicas to ``stage``.

    ``node``: only on that node; ``devices``: exactly these devices (of
    ``node``, or of the one node that offers them), ``devices_per_replica``
    each; ``replicas`` None then means one per that many devices. The
    coordinator checks it against its inventory (an :class:`AdminReply` with
    the reason when it cannot be done) and fills ``pins``: one ``(node,
    devices)`` per new replica, which the replica keeps across restarts.
    """

    stage: str
    replicas: int | None = None
    node: str = ""
    devices: tuple[str, ...] = ()
    pins: tuple[tuple[str, tuple[str, ...]], ...] = ()
    reply_to: ActorAddress = None


@dataclass(frozen=True)
class AdminReply(Message):
    """Answer to an admin request (inject, drain, scale): ok or why not."""

    ok: bool
    message: str


@dataclass(frozen=True)
class ShutdownSystem(Message):
    """CLI -> Coordinator: stop every pool (answered with ``ShutdownDone``)."""


@dataclass(frozen=True)
class ShutdownDone(Message):
    pass


@dataclass(frozen=True)
class PlannedStop(Message):
    """Coordinator -> StagePool, at a system stop, before any exit request: from now on the
    pool's replicas exiting is planned (logged at info, not restarted, their work not
    re-dispatched as after a crash). Answered with ``PlannedStopNoted``. The leader's admin
    reports each member-side replica exited as soon as the system shuts down, which could
    reach a pool before its own exit request did (CI saw those exits logged as crashes).

    Coordinator -> each member's NodeAgent too (not answered): as it exits with the system, it
    unlinks what the system's requests left in its host's shared memory (the member lives on,
    and its data service would count those buffers until its reaper took them)."""


@dataclass(frozen=True)
class PlannedStopNoted(Message):
    """StagePool -> Coordinator: answer to ``PlannedStop``."""
    stage_id: int


@dataclass(frozen=True)
class DrainApiServers(Message):
    """Leader (``ask``) -> Coordinator, at a stop, while the leader's own API server drains:
    tell every API server subscribed to it except ``exclude`` (the leader's own bridge) that
    the system stops (:class:`SystemStopping`), and answer :class:`ApiServersDrained` once
    each one has said its requests are over (:class:`ApiServerDrained`), or after
    ``timeout_s`` seconds (``supervision.drain_timeout_s`` plus the time their 503s take).
    The leader's drain counted only its own requests: streams on an attached ``api`` server
    were cut off about 1 s after a ``stop`` (a trial)."""

    timeout_s: float
    drain_timeout_s: float
    exclude: ActorAddress = None
    #: the leader was told a second time to stop (Ctrl-C, SIGTERM): the servers still draining
    #: end their requests now (sent again, while the first one's answer is awaited)
    hurry: bool = False


@dataclass(frozen=True)
class SystemStopping(Message):
    """Coordinator -> a subscribed API server's bridge: the system stops. The server takes no
    new requests, lets those in flight finish (up to ``drain_timeout_s`` seconds), answers
    :class:`ApiServerDrained` and exits."""

    drain_timeout_s: float
    hurry: bool = False  #: end the requests still running now (the leader was stopped a second time)


@dataclass(frozen=True)
class ApiServerDrained(Message):
    """An attached API server -> Coordinator: its requests are over; ``ended`` of them were
    still running at its drain timeout and ended with a 503."""

    address: ActorAddress
    ended: int = 0


@dataclass(frozen=True)
class ApiServersDrained(Message):
    """Coordinator -> leader: the answer to :class:`DrainApiServers`. ``told`` API servers
    were told; ``late`` of them had not answered by its timeout; ``silent`` of them were not
    waited for, as they had stopped renewing their subscription (frozen, or gone; see
    ``coordinator.API_DRAIN_SILENT_S``); ``ended`` requests in all were ended with a 503 at
    their drain timeout."""

    told: int
    late: int = 0
    ended: int = 0
    silent: int = 0


# -- request plane --------------------------------------------------------


@dataclass(frozen=True)
class PlannedStage(Message):
    """One stage of a request's plan."""

    stage_id: int
    stage: str
    sources: tuple[int, ...]  #: upstream stage ids, in engine_input_source order
    pool: ActorAddress
    final_output_type: str | None  #: set when this stage's output goes to the client
    needs_output: bool  #: some planned stage consumes this one's outputs (whole, not chunked)
    stream_source: int | None = None  #: the source whose outputs reach this stage in chunks
    emits_chunks: bool = False  #: this stage can send chunks (to a streaming consumer or the client)


@dataclass(frozen=True)
class RequestPlan(Message):
    """The part of the stage graph one request needs (pruned by the outputs it asked for)."""

    stages: tuple[PlannedStage, ...]


@dataclass(frozen=True)
class RunRequest(Message):
    """Bridge -> RequestActor: run one request and report to ``reply_to``."""

    request_id: str
    prompt: str
    plan: RequestPlan
    sampling_params: dict[str, Any]
    params: dict[str, Any]
    timeout_s: float
    reply_to: ActorAddress
    max_attempts: int = 3  #: a stage task is tried on at most this many replicas
    stream_outputs: bool = False  #: the client streams: final audio goes out in chunks where it can
    chunk_window: int = 16  #: chunks per edge produced and not yet consumed (backpressure)
    chunk_timeout_s: float = 10.0  #: longest a consumer waits for its next upstream chunk
    chunk_tokens: int = 8  #: Thinker tokens per chunk
    #: seconds the request already waited in the API server for a RequestActor: part of its
    #: deadline (``timeout_s`` is what is left), said in the deadline's error message
    queued_s: float = 0.0
    alive_every_s: float = 5.0  #: how often to send :class:`RequestActorAlive` while busy
    #: data services (``host:port``) the coordinator says do not answer now: the RequestActor
    #: takes them for down, so that its releases there go to the retries at once (each waited
    #: 2 s: trial CN)
    silent_services: tuple[str, ...] = ()


@dataclass(frozen=True)
class RoutesChanged(Message):
    """Bridge -> busy RequestActors: a pool was replaced; re-send stages that were
    running on the old one (a late answer from the old one is dropped)."""

    routes: Routes


#: An idle RequestActor that hears nothing from the API server that owns it for this long
#: exits (the server was killed: nobody would use or end it). See :class:`BridgeAlive`.
BRIDGE_LOST_AFTER_S = 120.0


@dataclass(frozen=True)
class BridgeAlive(Message):
    """Bridge -> each of its idle RequestActors, every quarter of ``lost_after_s``: the
    API server that owns them still runs. One that hears nothing from it (nor runs a
    request) for ``lost_after_s`` exits."""

    lost_after_s: float = BRIDGE_LOST_AFTER_S


@dataclass(frozen=True)
class RequestActorAlive(Message):
    """RequestActor -> its bridge, every :attr:`RunRequest.alive_every_s` while it runs
    (or closes) ``request_id``. A busy RequestActor that goes silent (its process was
    killed) is written off by the bridge and its request fails, instead of waiting for
    the deadline. (The RequestActor sends: an API server's ``tell`` to a dead or hung
    actor blocks its thread for up to 60 s.)"""

    request_id: str
    #: the RequestActor, when it holds outputs the bridge has not made room for and asks
    #: how many arrived (answered with an :class:`OutputsAck`); None: no answer wanted
    ack_to: Any = None


#: Seconds between a RequestActorSupervisor's :class:`SupervisorAlive` messages; its bridge
#: takes it for lost after :data:`SUPERVISOR_MISSED` of them.
SUPERVISOR_ALIVE_EVERY_S = 1.0
SUPERVISOR_MISSED = 5


@dataclass(frozen=True)
class SuperviseRequestActors(Message):
    """Bridge -> its RequestActorSupervisor, once: report to ``bridge`` (and say it is
    alive every ``alive_every_s``); exit (ending its RequestActors) after ``lost_after_s``
    without a :class:`BridgeAlive`."""

    bridge: ActorAddress
    lost_after_s: float = BRIDGE_LOST_AFTER_S
    alive_every_s: float = SUPERVISOR_ALIVE_EVERY_S


@dataclass(frozen=True)
class SupervisorAlive(Message):
    """RequestActorSupervisor -> its bridge, every ``alive_every_s``. A bridge that stops
    hearing them (the supervisor's process was killed) makes a new supervisor: its
    ``Relay`` of cancels would be lost and its ``MakeRequestActor`` unanswered."""

    address: ActorAddress


@dataclass(frozen=True)
class MakeRequestActor(Message):
    """Bridge (``ask``) -> its RequestActorSupervisor: make one RequestActor, a child of
    the supervisor. The supervisor passes it on to the new RequestActor with ``reply_to``
    (the asker), which answers with :class:`RequestActorMade` once it runs (an address
    Thespian has just handed its creator is not yet usable in another process)."""

    reply_to: ActorAddress = None


@dataclass(frozen=True)
class Relay(Message):
    """Bridge -> its RequestActorSupervisor: send ``message`` on to ``to``, a busy
    RequestActor. An actor's send does not wait for the receiver; an API server's
    ``tell`` waits until it takes the message (60 s at most), which held a sender
    thread of the API server while that RequestActor was stopped or blocked."""

    to: ActorAddress
    message: Any


@dataclass(frozen=True)
class RequestActorMade(Message):
    address: ActorAddress


@dataclass(frozen=True)
class RequestActorExited(Message):
    """RequestActorSupervisor -> bridge: this RequestActor's process is gone (Thespian's
    ``ChildActorExited``: at once, killed or not)."""

    address: ActorAddress


@dataclass(frozen=True)
class CancelRequest(Message):
    """Bridge -> RequestActor: the client went away (or the server stops: ``reason``)."""

    request_id: str
    reason: str = "cancelled by the client"


#: Most times one stage task is moved to another replica through no fault of its own
#: (see ``StageTask.moved``) before it fails as unavailable. Such moves are not counted
#: as attempts (a member host lost under a 1:N:M pipeline can take two or three replicas
#: from under a task before the pool knows), but a pool whose replicas keep refusing
#: work must not pass a task around until its deadline. Our own bound, not vLLM's.
MAX_TASK_MOVES = 10


@dataclass(frozen=True)
class StageTask(Message):
    """RequestActor -> pool -> engine: run one stage of one request.

    ``inputs`` are the upstream outputs by reference; the engine fetches them
    and runs the stage's ``custom_process_input_func`` on its side.
    """

    request_id: str
    stage_id: int
    prompt: str
    inputs: tuple[tuple[int, ConnectorRef], ...]
    sampling_params: dict[str, Any]
    params: dict[str, Any]
    final_output_type: str | None
    needs_output: bool
    reply_to: ActorAddress  #: the RequestActor
    attempt: int = 0
    exclude: tuple[str, ...] = ()  #: replicas that already failed this task
    #: replicas whose process exited (or was killed, hung) while running this task: after
    #: ``supervision.max_task_crashes`` of them it is failed with ``ErrorKind.CRASHED``
    crashed: tuple[str, ...] = ()
    #: attempts that ended through no fault of the task (its replica's host was lost or
    #: left, the replica drained, refused it or lost its finished results, the stage's
    #: pool was replaced): not counted towards ``supervision.max_task_attempts``, at most
    #: :data:`MAX_TASK_MOVES` of them
    moved: int = 0
    #: Streaming between stages: the source whose outputs arrive as :class:`InputChunk` s
    #: (the engine answers :class:`StageAccepted` first), and whether to send the outputs
    #: as :class:`StageChunk` s too; with the window, timeout and chunk size to use.
    stream_source: int | None = None
    emit_chunks: bool = False
    chunk_window: int = 16
    chunk_timeout_s: float = 10.0
    chunk_tokens: int = 8

    #: Where this task's text deltas go as :class:`OutputDelta` s: the bridge of a
    #: client that reads a stream (None: no deltas; the final output has the text).
    text_to: ActorAddress = None
    #: Seconds the request had left when this was sent (0: no deadline). A task still in
    #: flight well past it was orphaned (its cancel lost or overtaken): its pool cancels it.
    timeout_s: float = 0.0
    #: Another stage of the request's plan takes this one's outputs (whole or in chunks):
    #: the request goes on past it. A lingering replica waits only for such requests
    #: (``PoolState.feeding_began``); a text-only request's Thinker task does not feed.
    feeds: bool = True
    #: When the request began in its RequestActor (``time.time()``, seconds; pools and
    #: RequestActors run on the leader's host). A lingering replica takes only the tasks of
    #: requests begun before it lingered (``ReplicaStatus.lingering_since``); 0.0: unknown,
    #: taken as long ago.
    began_at: float = 0.0

    @property
    def counted_attempts(self) -> int:
        """Attempts that count towards ``supervision.max_task_attempts`` (not the moves)."""
        return self.attempt - self.moved

    @property
    def streaming(self) -> bool:
        """A streaming task (chunks, or text a client reads as it comes): a dead
        replica's one is failed to the RequestActor, which decides, not re-sent."""
        return self.stream_source is not None or self.emit_chunks or self.text_to is not None


@dataclass(frozen=True)
class CancelStage(Message):
    """RequestActor (or bridge) -> pool -> engine: stop a request's task of a stage."""

    request_id: str
    stage_id: int
    #: cancel only the attempts up to this one (:func:`cancels_attempt`): a streaming
    #: consumer whose producer failed is cancelled and started again as the next attempt,
    #: which the cancel must not stop where it comes late. None: every attempt, and those to
    #: come (the request is over).
    attempt: int | None = None


def cancels_attempt(cancel_upto: int | None, attempt: int) -> bool:
    """Whether a cancel of attempts up to ``cancel_upto`` (None: all) covers ``attempt``."""
    return cancel_upto is None or attempt <= cancel_upto


@dataclass(frozen=True)
class StageCancelled(Message):
    """Engine or pool -> RequestActor: a task of this request ended cancelled (or
    was dropped from the pool's queue before it ran); it confirms a
    :class:`CancelStage`. (A task that ended otherwise says so with
    :class:`StageDone` or :class:`StageFailed`.)"""

    request_id: str
    stage_id: int
    attempt: int = 0
    replica: str = ""  #: the engine's replica that ended it (none: the pool dropped it)
    #: ended by a :class:`CancelStage` (the RequestActor's, or its API server's for a request it
    #: wrote off); False: its replica ended it on its own (its inputs were gone, a lost chunk,
    #: its engine drained or lost its pool), a failure to the RequestActor
    asked: bool = True


@dataclass(frozen=True)
class TextStarted(Message):
    """Engine -> RequestActor: this task attempt's text began to go to the
    client (its :class:`OutputDelta` s go straight to the bridge), so a failure
    from now on is not retried unseen: it ends the request with an error."""

    request_id: str
    stage_id: int
    attempt: int = 0


@dataclass(frozen=True)
class StageDone(Message):
    """Engine -> RequestActor.

    ``output`` is for downstream stages (owned by the RequestActor, released at
    request end); ``final`` holds the client-facing part (text / audio / image)
    and is owned by whoever receives it last (the bridge).
    """

    request_id: str
    stage_id: int
    replica: str
    output: ConnectorRef | None
    final: ConnectorRef | None
    prompt_tokens: int = 0
    output_tokens: int = 0
    finish_reason: str | None = None  #: "stop" or "length", for text stages
    chunks: int = 0  #: how many :class:`StageChunk` s came before this (streaming)
    attempt: int = 0
    deltas: int = 0  #: how many :class:`OutputDelta` s this attempt sent the bridge before this


@dataclass(frozen=True)
class StageAccepted(Message):
    """Engine -> RequestActor: a task with a ``stream_source`` started here;
    send its :class:`InputChunk` s to the sender."""

    request_id: str
    stage_id: int
    attempt: int


@dataclass(frozen=True)
class StageChunk(Message):
    """Engine -> RequestActor: chunk ``seq`` (0, 1, ...) of a stage's outputs, by reference.

    Owned by the RequestActor (released at request end). The sender waits
    for :class:`ChunkAck` s once ``chunk_window`` chunks are unacknowledged.
    """

    request_id: str
    stage_id: int
    seq: int
    ref: ConnectorRef
    attempt: int
    #: the last of the backend's chunks this one holds (several merge when the sender is busy);
    #: credits (:class:`ChunkAck`) count the backend's chunks
    last: int = 0


@dataclass(frozen=True)
class InputChunk(Message):
    """RequestActor -> the consuming engine: chunk ``seq`` of ``source``'s outputs.

    ``ref`` is None on the end marker: ``source`` finished after ``seq`` chunks.
    """

    request_id: str
    stage_id: int
    source: int
    seq: int
    ref: ConnectorRef | None
    attempt: int
    last: int = 0  #: the producer's :attr:`StageChunk.last` (for credits)


@dataclass(frozen=True)
class ChunkConsumed(Message):
    """Consuming engine -> RequestActor: chunks of ``source`` up to ``seq`` (exclusive) are consumed."""

    request_id: str
    stage_id: int
    source: int
    upto: int
    attempt: int


@dataclass(frozen=True)
class ChunkAck(Message):
    """RequestActor -> producing engine: its chunks up to ``upto`` (exclusive,
    counted as its backend made them) are consumed."""

    request_id: str
    stage_id: int
    upto: int
    attempt: int


@dataclass(frozen=True)
class StageFailed(Message):
    """Engine or pool -> RequestActor: the stage task could not run."""

    request_id: str
    stage_id: int
    replica: str
    kind: ErrorKind
    message: str
    attempt: int = 0  #: of the task that failed; a failure of an attempt already retried is ignored
    crashed: tuple[str, ...] = ()  #: the task's ``crashed`` with this failure (a replica that died running it)
    moved: int = 0  #: the task's ``moved`` with this failure (one more when it was not the task's fault)
    lost_on: str | None = None  #: with INPUT_LOST: the node (or data service address) the input was on
    #: refused by a pool whose coordinator was lost (it only drains): the task waits for the new
    #: coordinator's pool of its stage (RoutesChanged), not run by this one, not a failure of the stage
    coordinator_lost: bool = False
    #: refused by a pool with no replica ready and none on its way (stopped, scaled to 0,
    #: failed): the request's 503 would be the same a second later (``x-should-retry: false``)
    none_coming: bool = False


@dataclass(frozen=True)
class TaskFinished(Message):
    """Engine -> pool: a task ended (any way), so in-flight counts stay true."""

    replica: str
    request_id: str
    stage_id: int
    ok: bool
    cancelled: bool = False  #: ended by a cancel (client gone): neither a success nor a failure
    #: not run: the replica is draining or not ready (``reason``); the pool sends the task elsewhere
    rejected: bool = False
    reason: str = ""
    #: failed because of what it was given (a bad request, a processor that cannot use its
    #: upstream outputs), not because of the replica: no count towards its circuit breaker
    input_error: bool = False
    #: failed on the client's input (a 400, e.g. a prompt over ``max_model_len``): not counted
    #: as a failed task of the replica either
    client_error: bool = False
    #: the task's attempt (None: any): a later attempt of the same task may be in flight on the
    #: same replica already (a streaming consumer started over), and stays counted there
    attempt: int | None = None


@dataclass(frozen=True)
class OutputDelta(Message):
    """Engine -> bridge (inside :class:`OutputDeltas`): new text of a task
    whose client reads a stream; it does not pass through the RequestActor.

    ``seq`` counts the deltas of one task attempt (0, 1, ...): messages may
    overtake each other, the bridge puts them back in order. Text of an older
    ``attempt`` than one seen is dropped; a newer attempt after some text went
    out fails the request (the client would read the text twice).
    """

    request_id: str
    text: str
    seq: int = 0
    stage_id: int = 0
    attempt: int = 0


@dataclass(frozen=True)
class OutputDeltas(Message):
    """Engine -> bridge: the text deltas that piled up for one bridge since the
    engine last sent, every request's in one message (an actor message costs
    about 1 ms of CPU here; one per request per flush would cost as many).

    Flow control: an engine keeps at most a few of these in flight per bridge
    (:class:`~omni_actors.actors.outbox.DeltaWindow`). ``ack`` > 0 asks the
    bridge to answer :class:`DeltasAck` (``peer``, ``ack``) to ``ack_to``: it has
    the engine's first ``ack`` messages to it."""

    deltas: tuple[OutputDelta, ...]
    ack: int = 0  #: 0: no answer wanted; else this message's number (1, 2, ...) among the engine's to this bridge
    ack_to: ActorAddress = None  #: the engine (set with ``ack``)
    peer: str = ""  #: the engine's name for this bridge, to be given back in the DeltasAck


@dataclass(frozen=True)
class DeltasAck(Message):
    """Bridge -> engine (relayed by the bridge's RequestActorSupervisor): the
    bridge has received the engine's first ``upto`` :class:`OutputDeltas` to it,
    so the engine may send more (see :class:`~omni_actors.actors.outbox.DeltaWindow`)."""

    peer: str
    upto: int


@dataclass(frozen=True)
class OutputChunk(Message):
    """RequestActor -> bridge: a chunk of a final output (streamed audio) by
    reference; the bridge fetches and releases it."""

    request_id: str
    stage_id: int
    output_type: str
    ref: ConnectorRef
    #: every message of one request from its RequestActor to the bridge (OutputChunk,
    #: OutputReady) is numbered 0, 1, ...; the bridge delivers them in that order and
    #: ends the request after ``RequestFinished.sent`` of them
    seq: int = 0
    #: the RequestActor to answer with an :class:`OutputsAck` (through the bridge's
    #: RequestActorSupervisor), or None: no answer wanted (see ``request.OUTPUT_WINDOW``)
    ack_to: Any = None


@dataclass(frozen=True)
class OutputReady(Message):
    """RequestActor -> bridge: a final output by reference; the bridge fetches
    and releases it."""

    request_id: str
    stage_id: int
    output_type: str
    ref: ConnectorRef
    seq: int = 0  #: see :class:`OutputChunk`
    #: (attempt, n): deliver this only after the first n :class:`OutputDelta` s of that
    #: attempt of the text stage (a final text must not overtake the deltas it completes)
    after_text: tuple[int, int] | None = None
    ack_to: Any = None  #: see :class:`OutputChunk`


@dataclass(frozen=True)
class OutputsAck(Message):
    """Bridge -> RequestActor (relayed by the bridge's RequestActorSupervisor): the bridge
    has received ``received`` of the request's numbered outputs (:class:`OutputChunk`,
    :class:`OutputReady`), so the RequestActor may send more, and credit the producer of
    streamed audio for them (see ``request.OUTPUT_WINDOW``)."""

    request_id: str
    received: int


@dataclass(frozen=True)
class RequestFinished(Message):
    """RequestActor -> bridge: the request ended. ``error`` is None on success.
    The RequestActor is free again after sending it, unless ``free`` is False:
    then stages of the request were still running, and it waits for them to
    confirm their cancels before it sends :class:`RequestActorFree`."""

    request_id: str
    error: ErrorKind | None = None
    message: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None  #: of the final text stage
    stage_replicas: dict[int, str] = field(default_factory=dict)  #: which replica ran each stage
    request_actor: ActorAddress = None  #: the sender, free for the next request
    sent: int = 0  #: OutputChunk/OutputReady sent before this (the bridge waits for them all)
    after_text: tuple[int, int] | None = None  #: as :attr:`OutputReady.after_text` (success only)
    free: bool = True  #: False: busy until its :class:`RequestActorFree`
    lost_on: str | None = None  #: with INPUT_LOST: the node an upstream stage's output was lost with
    #: a failed stage was not retried only because text of it had gone to the API server
    #: (which may not have sent any of it to the client yet: it may then run the request again)
    output_sent: bool = False
    #: a stage's pool refused it with no replica ready and none on its way (StageFailed.none_coming)
    none_coming: bool = False


@dataclass(frozen=True)
class RequestActorFree(Message):
    """RequestActor -> bridge: after a ``RequestFinished(free=False)``, the stages
    it cancelled have ended (or :data:`~omni_actors.actors.request.CANCEL_CONFIRM_S`
    passed): it takes the next request. Until then its bridge counts it busy,
    so that the work of abandoned requests stays within ``request_actors``."""

    request_id: str
    request_actor: ActorAddress = None
    confirmed: bool = True  #: False: it stopped waiting at the time limit
