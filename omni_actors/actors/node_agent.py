"""NodeAgentActor: the coordinator's eyes on a member host.

Thespian notices a SIGKILLed member host only after minutes by default (seen
here), so the coordinator places one agent on every member host and expects a
heartbeat from it every interval; three missed and the node is lost (its
replicas are re-placed). An agent that stops getting acks (its coordinator
was replaced) exits.

At each heartbeat the agent also checks that its member's main process lives (it
holds the host's data service): if it died and its watchdog did not stop the host
(killed too), the agent reports the node lost and why, and starts that clean-up
itself (:func:`omni_actors.system.watchdog.clean_up_dead_host`).

The agent also looks after the host's data service: it sets its reap age from
the config, and every heartbeat carries the service's address and the host's
live shared-memory buffer count, free (recycled) ones apart (``status`` shows them per node).
"""

from __future__ import annotations

import os
import threading
import time

from thespian.actors import ActorExitRequest, ActorTypeDispatcher, WakeupMessage

from omni_actors.connectors import SERVICE_ENV, buffer_counts, data_client, default_prefix, sweep_segments
from omni_actors.logs import get_logger
from omni_actors.messages import NodeHeartbeat, NodeHeartbeatAck, NodeLeaving, PlannedStop, StartNodeAgent

#: Placement key in an admin's Thespian capabilities: the node name.
NODE_CAPABILITY = "omni_node"
#: And the host process's own id (unique per start): two admins of one node name (a member
#: lost while still up, and the new member that replaced it) are told apart by it.
MEMBER_CAPABILITY = "omni_member"
#: And the machine it runs on (``supervision.host_identity()``).
HOST_CAPABILITY = "omni_host"
#: An agent without acks for this many intervals (counted while it ran) exits.
ORPHAN_AFTER_INTERVALS = 5
#: A heartbeat turn this many intervals late: the agent did not run meanwhile.
LATE_TICK_INTERVALS = 2
#: The agent asks its host's data service for its ``stats`` every interval, waiting this long for
#: the answer; unanswered for SILENT_AFTER_INTERVALS, its heartbeats say for how long (trial BX: a
#: member whose main process, the data service's, was frozen showed alive, and `status` ready,
#: while every stage output made there could not be fetched).
PROBE_TIMEOUT_S = 1.0
SILENT_AFTER_INTERVALS = 3


def on_node(capabilities: dict, requirements: dict | None) -> bool:
    """``actorSystemCapabilityCheck`` for actors placed on a named node: an actor
    created with ``targetActorRequirements={"omni_node": N}`` goes to the admin
    whose capabilities say ``omni_node: N`` (and, with ``omni_member: M`` too, to
    that host process's admin only); without requirements, anywhere."""
    requirements = requirements or {}
    return all(requirements.get(key) is None or capabilities.get(key) == requirements[key]
               for key in (NODE_CAPABILITY, MEMBER_CAPABILITY))


def requirements_on(node: str, member: str = "") -> dict:
    """``targetActorRequirements`` for an actor on ``node`` (see :func:`on_node`): that host
    process's admin only, when its ``member`` id is known."""
    return {NODE_CAPABILITY: node, **({MEMBER_CAPABILITY: member} if member else {})}


class NodeAgentActor(ActorTypeDispatcher):
    actorSystemCapabilityCheck = staticmethod(on_node)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._spec: StartNodeAgent | None = None
        self._coordinator = None
        self._last_ack = time.monotonic()
        self._last_tick = time.monotonic()  # its last heartbeat turn
        self._orphaned = False  # it stops because its coordinator is gone: nobody to tell
        self._system_stops = False  # its coordinator said the whole system stops (PlannedStop)
        #: when its data service began not to answer the probe (None: it answers); set by the probe,
        #: so a host frozen whole, probe and all, is not taken on resuming for a silent service
        self._silent_since: float | None = None

    def receiveMsg_StartNodeAgent(self, msg: StartNodeAgent, sender):
        self._spec, self._coordinator = msg, sender
        service = os.environ.get(SERVICE_ENV)
        if msg.reap_after_s and service:
            try:
                data_client.configure(service, reap_after_s=msg.reap_after_s)
            except Exception as exc:  # noqa: BLE001 - the heartbeat matters more
                get_logger(actor="node_agent", node=msg.node).warning(
                    "data_service_config_failed", service=service, error=str(exc))
            finally:
                data_client.close_connections()
        if service:
            threading.Thread(target=self._probe, args=(service, msg.interval_s), name="data-service-probe",
                             daemon=True).start()
        self.send(sender, self._heartbeat())
        self.wakeupAfter(msg.interval_s)

    def _probe(self, service: str, interval_s: float) -> None:
        """(A thread, for the agent's life) Ask the data service whether it answers, every interval."""
        while True:
            asked = time.monotonic()
            if data_client.answers(service, PROBE_TIMEOUT_S):
                self._silent_since = None
            elif self._silent_since is None:
                self._silent_since = asked
            time.sleep(interval_s)

    def _heartbeat(self) -> NodeHeartbeat:
        since = self._silent_since
        silent = 0.0 if since is None else time.monotonic() - since
        silent = round(silent, 1) if silent > SILENT_AFTER_INTERVALS * self._spec.interval_s else 0.0
        return NodeHeartbeat(self._spec.node, os.environ.get(SERVICE_ENV), *buffer_counts(default_prefix()),
                             join=self._spec.join, data_service_silent_s=silent)

    def receiveMsg_PlannedStop(self, msg: PlannedStop, sender):
        self._system_stops = True

    def receiveMsg_NodeHeartbeatAck(self, msg: NodeHeartbeatAck, sender):
        self._last_ack = time.monotonic()

    def receiveMsg_WakeupMessage(self, msg: WakeupMessage, sender):
        if self._spec is None:
            return
        from omni_actors.system.watchdog import clean_up_dead_host, host_process_gone

        gone = host_process_gone()
        if gone is not None:  # (its watchdog would have stopped this host by now: it is gone too)
            self._orphaned = True  # (said below; nothing more to say on exit)
            self.send(self._coordinator, NodeLeaving(self._spec.node, lost=gone, join=self._spec.join))
            started = clean_up_dead_host()
            get_logger(actor="node_agent", node=self._spec.node).error(
                "host_process_gone", reason=gone, clean_up_started=started)
            return
        now = time.monotonic()
        if now - self._last_tick > LATE_TICK_INTERVALS * self._spec.interval_s:
            # It did not run meanwhile (its host frozen, paused, starved): the acks it missed say
            # nothing of its coordinator; it heartbeats and waits for one again. (A member frozen
            # for 7 s exited its agent at once on resuming: its node, declared lost meanwhile,
            # never came back, and its member said nothing: a trial.)
            self._last_ack = max(self._last_ack, now - self._spec.interval_s)
        self._last_tick = now
        if now - self._last_ack > ORPHAN_AFTER_INTERVALS * self._spec.interval_s:
            self._orphaned = True
            self.send(self.myAddress, ActorExitRequest())
            return
        self.send(self._coordinator, self._heartbeat())
        self.wakeupAfter(self._spec.interval_s)

    def receiveMsg_ActorExitRequest(self, msg: ActorExitRequest, sender):
        """Its member stops cleanly (its actor system shuts down), or its coordinator
        exits: say so, and the node shows as left rather than lost. Stopped because the
        member process died (by its watchdog): the node is lost, and why."""
        if self._system_stops and self._spec is not None:
            # The system stops in order: its requests are over, and what they left in this host's
            # shared memory is nobody's (trial AT: a request held by a frozen API server left 5
            # buffers on a member, counted until its reaper took them, request_timeout_s + 30 s).
            log = get_logger(actor="node_agent", node=self._spec.node)
            try:
                left = buffer_counts(default_prefix())[0]  # (in use; the free ones are no leftovers)
                removed = sweep_segments(default_prefix())
            except OSError as exc:
                log.warning("system_stop_buffers_not_removed", error=str(exc))
            else:
                (log.warning if left else log.info)("system_stop_buffers_removed", in_use=left, segments=removed,
                                                    prefix=default_prefix())
        if self._spec is not None and not self._orphaned:
            from omni_actors.system.watchdog import host_process_gone

            gone = host_process_gone()
            self.send(self._coordinator, NodeLeaving(self._spec.node, lost=gone, join=self._spec.join))
