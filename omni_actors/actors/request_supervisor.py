"""RequestActorSupervisor: the parent of one API server's RequestActors.

An API server's bridge talks to the actor system from outside (Thespian's
external ``ActorSystem``), so RequestActors it created itself had the admin as
their parent and nobody heard when one died: a killed idle RequestActor was
handed the next requests, and each waited out its deadline. The bridge now has
its RequestActors made by this actor (:class:`~omni_actors.messages.MakeRequestActor`),
which hears Thespian's ``ChildActorExited`` for each at once and tells the
bridge (:class:`~omni_actors.messages.RequestActorExited`): the bridge drops an
idle one from its pool and fails the request of a busy one with a 500.

It exits, ending its RequestActors, when its bridge has not been heard from
(:class:`~omni_actors.messages.BridgeAlive`) for ``lost_after_s``: the API
server was killed.
"""

from __future__ import annotations

import time

from thespian.actors import ActorExitRequest, ActorTypeDispatcher, ChildActorExited, WakeupMessage

from omni_actors.actors.request import RequestActor
from omni_actors.actors.supervision import WakeupChain
from omni_actors.logs import get_logger
from omni_actors.messages import (BRIDGE_LOST_AFTER_S, BridgeAlive, MakeRequestActor, Relay, RequestActorExited,
                                  SuperviseRequestActors)


class RequestActorSupervisor(ActorTypeDispatcher):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._bridge = None
        self._lost_after_s = BRIDGE_LOST_AFTER_S
        self._heard_at = time.monotonic()
        self._checks = WakeupChain("bridge_check")
        self._log = get_logger(actor="request_supervisor")

    def receiveMsg_SuperviseRequestActors(self, msg: SuperviseRequestActors, sender):
        self._bridge, self._lost_after_s = msg.bridge, msg.lost_after_s
        self._heard_at = time.monotonic()
        self._checks.start(self, self._lost_after_s / 2)

    def receiveMsg_MakeRequestActor(self, msg: MakeRequestActor, sender):
        self.send(self.createActor(RequestActor), MakeRequestActor(reply_to=sender))

    def receiveMsg_Relay(self, msg: Relay, sender):
        self.send(msg.to, msg.message)

    def receiveMsg_ChildActorExited(self, msg: ChildActorExited, sender):
        if self._bridge is not None:
            self.send(self._bridge, RequestActorExited(msg.childAddress))

    def receiveMsg_BridgeAlive(self, msg: BridgeAlive, sender):
        self._heard_at = time.monotonic()

    def receiveMsg_WakeupMessage(self, msg: WakeupMessage, sender):
        if not self._checks.current(msg.payload):
            return
        silent = time.monotonic() - self._heard_at
        if silent > self._lost_after_s:
            self._log.info("request_supervisor_exit_api_server_gone", silent_s=round(silent, 1))
            self.send(self.myAddress, ActorExitRequest())
            return
        self._checks.again(self, self._lost_after_s / 2)
