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
server was killed. It says it is alive to its bridge every ``alive_every_s``
(:class:`~omni_actors.messages.SupervisorAlive`): a bridge that stops hearing
it makes another.
"""

from __future__ import annotations

import time

from thespian.actors import ActorExitRequest, ActorTypeDispatcher, ChildActorExited, WakeupMessage

from omni_actors.actors.request import RequestActor
from omni_actors.actors.supervision import WakeupChain
from omni_actors.logs import get_logger
from omni_actors.messages import (BRIDGE_LOST_AFTER_S, SUPERVISOR_ALIVE_EVERY_S, BridgeAlive, MakeRequestActor, Relay,
                                  RequestActorExited, SuperviseRequestActors, SupervisorAlive)


class RequestActorSupervisor(ActorTypeDispatcher):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._bridge = None
        self._lost_after_s = BRIDGE_LOST_AFTER_S
        self._heard_at = time.monotonic()
        self._checks = WakeupChain("bridge_check")
        self._beats = WakeupChain("supervisor_alive")
        self._alive_every_s = SUPERVISOR_ALIVE_EVERY_S
        self._beat_at = 0.0
        self._log = get_logger(actor="request_supervisor")

    def receiveMsg_SuperviseRequestActors(self, msg: SuperviseRequestActors, sender):
        self._bridge, self._lost_after_s = msg.bridge, msg.lost_after_s
        self._heard_at = time.monotonic()
        self._checks.start(self, self._lost_after_s / 2)
        self._alive_every_s = msg.alive_every_s
        self._beat(restart=True)

    def _beat(self, restart: bool = False) -> None:
        """Tell the bridge we run; ``restart``: begin a new chain of wake-ups for that
        (Thespian drops wake-ups that fall due while an actor drains a long transmit queue)."""
        if self._bridge is None:  # (exiting)
            return
        self._beat_at = time.monotonic()
        self.send(self._bridge, SupervisorAlive(self.myAddress))
        if restart:
            self._beats.start(self, self._alive_every_s)
        else:
            self._beats.again(self, self._alive_every_s)

    def _beat_if_late(self) -> None:
        if self._bridge is not None and time.monotonic() - self._beat_at > 2 * self._alive_every_s:
            self._beat(restart=True)  # (its wake-up was dropped)

    def receiveMsg_MakeRequestActor(self, msg: MakeRequestActor, sender):
        self.send(self.createActor(RequestActor), MakeRequestActor(reply_to=sender))
        self._beat_if_late()

    def receiveMsg_Relay(self, msg: Relay, sender):
        self.send(msg.to, msg.message)
        self._beat_if_late()

    def receiveMsg_ActorExitRequest(self, msg: ActorExitRequest, sender):
        self._bridge = None  # (its RequestActors exit with it: nothing more to tell)

    def receiveMsg_ChildActorExited(self, msg: ChildActorExited, sender):
        if self._bridge is not None:
            self.send(self._bridge, RequestActorExited(msg.childAddress))

    def receiveMsg_BridgeAlive(self, msg: BridgeAlive, sender):
        self._heard_at = time.monotonic()
        self._beat_if_late()

    def receiveMsg_WakeupMessage(self, msg: WakeupMessage, sender):
        if self._beats.current(msg.payload):
            self._beat()
            return
        if not self._checks.current(msg.payload):
            return
        silent = time.monotonic() - self._heard_at
        if silent > self._lost_after_s:
            self._log.info("request_supervisor_exit_api_server_gone", silent_s=round(silent, 1))
            self.send(self.myAddress, ActorExitRequest())
            return
        self._checks.again(self, self._lost_after_s / 2)
