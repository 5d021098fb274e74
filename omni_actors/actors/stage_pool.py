"""StagePoolActor: owns the replicas of one stage, routes its tasks, supervises them.

Restart policy (the one place it is written down): a replica that fails to
load, or misses its ready deadline, is marked FAILED with the reason and left
down (no tight retry loop: a bad model path fails the same way again). A
replica whose process exits while READY is marked DEAD; its in-flight tasks
are re-dispatched at once to another READY replica of this stage, at most
``MAX_TASK_ATTEMPTS`` times per task, after which the request gets a clear
error. Automatic restarts with backoff arrive with the control plane (issue 4).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from thespian.actors import (ActorExitRequest, ActorTypeDispatcher, ChildActorExited, PoisonMessage,
                             WakeupMessage)

from omni_actors.actors.engine import EngineActor
from omni_actors.balancing import POLICIES, ReplicaLoad
from omni_actors.logs import get_logger
from omni_actors.messages import (CancelStage, EngineFailed, EngineReady, ErrorKind, Heartbeat,
                                  PoolState, ReplicaState, ReplicaStatus, StageFailed, StageTask,
                                  StartEngine, StartPool, TaskFinished)

#: A task is tried on at most this many replicas before its request fails.
MAX_TASK_ATTEMPTS = 3


@dataclass
class Replica:
    replica: str
    address: object
    state: ReplicaState = ReplicaState.STARTING
    reason: str = ""
    in_flight: dict[tuple[str, int], StageTask] = field(default_factory=dict)
    dispatched: int = 0
    completed: int = 0
    failed: int = 0
    running: int = 0
    waiting: int = 0
    last_heartbeat: float | None = None


class StagePoolActor(ActorTypeDispatcher):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._spec: StartPool | None = None
        self._coordinator = None
        self._replicas: dict[str, Replica] = {}
        self._log = get_logger(actor="pool")

    # -- supervision ------------------------------------------------------
    def receiveMsg_StartPool(self, msg: StartPool, sender):
        if self._spec is not None:
            return
        self._spec, self._coordinator = msg, sender
        self._policy = POLICIES[msg.load_balancing]
        self._log = self._log.bind(stage=msg.stage.name)
        for index in range(msg.deployment.replicas):
            self._launch(f"{msg.stage.name}/{index}")
        self.wakeupAfter(msg.heartbeat_interval_s, payload="tick")
        self._publish()

    def _launch(self, replica_id: str) -> None:
        spec = self._spec
        address = self.createActor(EngineActor)
        self._replicas[replica_id] = Replica(replica_id, address)
        self.send(address, StartEngine(replica_id, spec.stage, spec.deployment,
                                       spec.heartbeat_interval_s, spec.inline_threshold_bytes))
        self.wakeupAfter(spec.ready_timeout_s, payload=("ready_deadline", replica_id))
        self._log.info("replica_launched", replica=replica_id)

    def receiveMsg_EngineReady(self, msg: EngineReady, sender):
        rep = self._replicas.get(msg.replica)
        if rep and rep.state == ReplicaState.STARTING:
            rep.state, rep.last_heartbeat = ReplicaState.READY, time.monotonic()
            self._log.info("replica_ready", replica=msg.replica)
            self._publish()

    def receiveMsg_EngineFailed(self, msg: EngineFailed, sender):
        self._fail(msg.replica, msg.reason)

    def _fail(self, replica_id: str, reason: str) -> None:
        rep = self._replicas.get(replica_id)
        if rep is None or rep.state in (ReplicaState.FAILED, ReplicaState.DEAD):
            return
        rep.state, rep.reason = ReplicaState.FAILED, reason
        self._log.error("replica_failed", replica=replica_id, reason=reason)
        self.send(rep.address, ActorExitRequest())
        self._redispatch(rep)
        self._publish()

    def receiveMsg_ChildActorExited(self, msg: ChildActorExited, sender):
        rep = self._replica_at(msg.childAddress)
        if rep is None:
            return
        replica_id = rep.replica
        if rep.state in (ReplicaState.STARTING, ReplicaState.READY):
            rep.state = ReplicaState.DEAD
            rep.reason = rep.reason or "process exited"
            self._log.error("replica_exited", replica=replica_id)
        self._redispatch(rep)
        self._publish()

    def _replica_at(self, address) -> Replica | None:
        # ActorAddress is not hashable: compare, a handful of replicas per pool
        return next((r for r in self._replicas.values() if r.address == address), None)

    def _redispatch(self, rep: Replica) -> None:
        tasks, rep.in_flight = list(rep.in_flight.values()), {}
        for task in tasks:
            retry = dataclasses.replace(task, attempt=task.attempt + 1)
            self._route(retry, why=f"replica {rep.replica} {rep.state.value}: {rep.reason}")

    def receiveMsg_Heartbeat(self, msg: Heartbeat, sender):
        rep = self._replicas.get(msg.replica)
        if rep is not None:
            rep.running, rep.waiting = msg.running, msg.waiting
            rep.last_heartbeat = time.monotonic()

    def receiveMsg_WakeupMessage(self, msg: WakeupMessage, sender):
        if msg.payload == "tick":
            self._publish()
            self.wakeupAfter(self._spec.heartbeat_interval_s, payload="tick")
        elif isinstance(msg.payload, tuple) and msg.payload[0] == "ready_deadline":
            rep = self._replicas.get(msg.payload[1])
            if rep is not None and rep.state == ReplicaState.STARTING:
                self._fail(rep.replica, f"did not become ready within {self._spec.ready_timeout_s:g} s")

    def receiveMsg_PoisonMessage(self, msg: PoisonMessage, sender):
        poisoned = msg.poisonMessage
        self._log.error("poison_message", message_type=type(poisoned).__name__, details=str(msg.details))
        if isinstance(poisoned, StageTask):
            rep = self._replica_at(sender)
            replica_id = rep.replica if rep else None
            if rep is not None:
                rep.in_flight.pop((poisoned.request_id, poisoned.stage_id), None)
            self.send(poisoned.reply_to, StageFailed(poisoned.request_id, poisoned.stage_id,
                                                     replica_id or "?", ErrorKind.ENGINE_ERROR,
                                                     f"replica {replica_id} could not take the task"))

    def receiveMsg_ActorExitRequest(self, msg, sender):
        return None  # Thespian sends our children their own exit requests

    # -- request plane ----------------------------------------------------
    def receiveMsg_StageTask(self, msg: StageTask, sender):
        self._route(msg)

    def _route(self, task: StageTask, why: str = "") -> None:
        ready = [r for r in self._replicas.values() if r.state == ReplicaState.READY]
        if task.attempt >= MAX_TASK_ATTEMPTS:
            self.send(task.reply_to, StageFailed(task.request_id, task.stage_id, "", ErrorKind.UNAVAILABLE,
                                                 f"stage {self._spec.stage.name}: gave up after "
                                                 f"{task.attempt} attempts ({why})"))
            return
        chosen = self._policy([ReplicaLoad(r.replica, len(r.in_flight), r.dispatched) for r in ready])
        if chosen is None:
            reasons = "; ".join(f"{r.replica} {r.state.value}" + (f": {r.reason}" if r.reason else "")
                                for r in self._replicas.values()) or "no replicas"
            self.send(task.reply_to, StageFailed(task.request_id, task.stage_id, "", ErrorKind.UNAVAILABLE,
                                                 f"no ready replica of stage {self._spec.stage.name} "
                                                 f"({reasons})"))
            return
        rep = self._replicas[chosen]
        rep.in_flight[(task.request_id, task.stage_id)] = task
        rep.dispatched += 1
        self.send(rep.address, task)

    def receiveMsg_TaskFinished(self, msg: TaskFinished, sender):
        rep = self._replicas.get(msg.replica)
        if rep is None:
            return
        if rep.in_flight.pop((msg.request_id, msg.stage_id), None) is not None:
            if msg.ok:
                rep.completed += 1
            else:
                rep.failed += 1

    def receiveMsg_CancelStage(self, msg: CancelStage, sender):
        for rep in self._replicas.values():
            if (msg.request_id, msg.stage_id) in rep.in_flight:
                self.send(rep.address, msg)

    # -- status -----------------------------------------------------------
    def _publish(self) -> None:
        if self._coordinator is None:
            return
        now = time.monotonic()
        replicas = tuple(
            ReplicaStatus(
                replica=r.replica, state=r.state, reason=r.reason, in_flight=len(r.in_flight),
                running=r.running, waiting=r.waiting, completed=r.completed, failed=r.failed,
                last_heartbeat_age_s=None if r.last_heartbeat is None else round(now - r.last_heartbeat, 3))
            for r in self._replicas.values())
        self.send(self._coordinator, PoolState(self._spec.stage.stage_id, self._spec.stage.name, replicas))
