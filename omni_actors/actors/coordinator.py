"""CoordinatorActor: the control plane (one per system, by ``globalName``).

Holds the config, creates one StagePoolActor per stage, keeps the live
replica table the pools publish, and answers "what is running". It never
touches request payloads.

Restart policy: a pool that exits is recorded with the reason in the stage
table and its stage reports no ready replica (requests get 503); recreating
pools is the control-plane work of issue 4.
"""

from __future__ import annotations

import time

from thespian.actors import ActorTypeDispatcher, ChildActorExited, WakeupMessage

from omni_actors.actors.stage_pool import StagePoolActor
from omni_actors.logs import get_logger
from omni_actors.messages import (Deploy, GetRoutes, GetStatus, PoolState, ReplicaState, ReplicaStatus,
                                  Routes, ShutdownDone, ShutdownSystem, StartPool, SystemStatus, WhoAmI,
                                  YouAre)

#: The coordinator's ``globalName``.
COORDINATOR_NAME = "omni-actors-coordinator"

_SETTLED = (ReplicaState.READY, ReplicaState.FAILED, ReplicaState.DEAD, ReplicaState.STOPPED)


class CoordinatorActor(ActorTypeDispatcher):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._config = None
        self._pools: dict[int, object] = {}
        self._states: dict[int, PoolState] = {}
        self._deploy_waiters: list[object] = []
        self._stopping = False
        self._log = get_logger(actor="coordinator")

    def receiveMsg_Deploy(self, msg: Deploy, sender):
        if self._config is None:
            self._config = cfg = msg.config
            dep = cfg.deployment
            for stage in cfg.stage_args:
                pool = self.createActor(StagePoolActor)
                self._pools[stage.stage_id] = pool
                self._states[stage.stage_id] = PoolState(stage.stage_id, stage.name, ())
                self.send(pool, StartPool(stage, cfg.deployment_of(stage), dep.heartbeat_interval_s,
                                          dep.ready_timeout_s, dep.inline_threshold_bytes,
                                          dep.load_balancing))
            self._log.info("deploying", model=dep.served_model_name, stages=[s.name for s in cfg.stage_args])
            # Answer even if a pool never reports: ready deadline plus a margin.
            self.wakeupAfter(dep.ready_timeout_s + 5.0, payload="deploy_deadline")
        self._deploy_waiters.append(sender)
        self._answer_deploy_waiters()

    def _settled(self) -> bool:
        if self._config is None:
            return False
        for stage in self._config.stage_args:
            replicas = self._states[stage.stage_id].replicas
            if len(replicas) < self._config.deployment_of(stage).replicas:
                return False
            if any(r.state not in _SETTLED for r in replicas):
                return False
        return True

    def _answer_deploy_waiters(self, force: bool = False) -> None:
        if self._deploy_waiters and (force or self._settled()):
            status = self._status("")
            for waiter in self._deploy_waiters:
                self.send(waiter, status)
            self._deploy_waiters = []

    def receiveMsg_PoolState(self, msg: PoolState, sender):
        self._states[msg.stage_id] = msg
        self._answer_deploy_waiters()

    def receiveMsg_WakeupMessage(self, msg: WakeupMessage, sender):
        if msg.payload == "deploy_deadline":
            self._answer_deploy_waiters(force=True)

    def receiveMsg_GetStatus(self, msg: GetStatus, sender):
        self.send(msg.reply_to or sender, self._status(msg.query_id))

    def receiveMsg_GetRoutes(self, msg: GetRoutes, sender):
        self.send(sender, Routes(self._config, dict(self._pools)))

    def receiveMsg_WhoAmI(self, msg: WhoAmI, sender):
        self.send(sender, YouAre(sender))

    def receiveMsg_ActorExitRequest(self, msg, sender):
        self._stopping = True  # the system is shutting down: pools exiting is expected

    def receiveMsg_ChildActorExited(self, msg: ChildActorExited, sender):
        for stage_id, pool in list(self._pools.items()):
            if pool == msg.childAddress:
                old = self._states[stage_id]
                if not self._stopping:
                    self._log.error("pool_exited", stage=old.stage)
                self._states[stage_id] = PoolState(stage_id, old.stage, tuple(
                    ReplicaStatus(r.replica, ReplicaState.DEAD, "stage pool exited") for r in old.replicas))

    def receiveMsg_ShutdownSystem(self, msg: ShutdownSystem, sender):
        from thespian.actors import ActorExitRequest
        for pool in self._pools.values():
            self.send(pool, ActorExitRequest())
        self.send(sender, ShutdownDone())

    def _status(self, query_id: str) -> SystemStatus:
        stages = tuple(self._states[s.stage_id] for s in self._config.stage_args) if self._config else ()
        ready = bool(stages) and all(any(r.state == ReplicaState.READY for r in st.replicas) for st in stages)
        model = self._config.deployment.served_model_name if self._config else ""
        return SystemStatus(query_id=query_id or str(time.time()), model=model, ready=ready, stages=stages)
