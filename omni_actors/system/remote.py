"""Talking to a convention leader's admin from another host, with no admin of our own.

Thespian's ``ActorSystem()`` always talks to an admin on *this* host (it
derives the admin's address from the local interface and starts one when
none listens), and ``globalName`` lookups are per admin: an admin of our own,
even one that joined the convention, would answer a coordinator lookup with a
new, empty coordinator of its own. So an API server on another host does what
``ActorSystem.private()`` does under the hood, but aimed at the leader:

- one external TCP transport (a listening socket on the interface that routes
  to the leader; the leader's actors send their replies there), and
- per ``private()`` context, a Thespian ``BaseContext`` whose admin is the
  **leader's** admin, so ``createActor`` (RequestActors, the coordinator's
  ``globalName`` lookup) is done by the leader's admin, exactly as for an API
  server on the leader's host; ``tell``/``ask``/``listen`` go actor to actor.

Nothing is started on this host: no admin, no actor process. What this
process creates (its RequestActors) lives in the leader's admin and is ended
by the API server when it stops (see ``api_server``), or with the system.
This uses Thespian 4.0.1 internals (``BaseContext``, ``TCPTransport``),
the same ones ``ActorSystem.private()`` uses; ``pyproject`` pins Thespian.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

from omni_actors.system.admin import Admin, AdminError
from omni_actors.system.processes import port_in_use

#: Seconds to wait for the leader's admin to answer a status request.
ADMIN_ANSWER_S = 5.0


class RemoteSystem:
    """A stand-in for ``ActorSystem`` that talks to the admin at ``(host, port)``.

    Offers what the bridge and :class:`~omni_actors.system.admin.Admin` use:
    ``private()`` contexts, and ``createActor``/``tell``/``ask``/``listen`` on
    a main context (one thread at a time). Never shuts the remote system down.
    """

    def __init__(self, host: str, port: int):
        from thespian.system.transport import ExternalInterfaceTransportInit
        from thespian.system.transport.TCPTransport import TCPTransport

        self.host, self.port = host, port
        caps = {"Convention Address.IPv4": (host, port), "Admin Port": port}
        self._transport = TCPTransport(ExternalInterfaceTransportInit(), caps, None, None)
        self.admin_address = TCPTransport.getAddressFromString((host, port))
        self._lock = threading.Lock()
        self._main = None

    def retarget(self, admin_address) -> None:
        """Talk to another admin from now on (the convention leader, found through a member)."""
        self.admin_address = admin_address
        self._close_main()

    @contextmanager
    def private(self):
        ctx = self._context()
        try:
            yield ctx
        finally:
            ctx.exit_clone()

    def _context(self):
        from thespian.actors import ExternalContext
        from thespian.system.systemBase import BaseContext

        return ExternalContext(BaseContext(self.admin_address, self._transport))

    def _main_context(self):
        with self._lock:
            if self._main is None:
                self._main = self._context()
            return self._main

    def createActor(self, *args, **kwargs):
        return self._main_context().createActor(*args, **kwargs)

    def tell(self, *args, **kwargs):
        return self._main_context().tell(*args, **kwargs)

    def ask(self, *args, **kwargs):
        return self._unanswered_drops_main(self._main_context().ask, *args, **kwargs)

    def listen(self, *args, **kwargs):
        return self._unanswered_drops_main(self._main_context().listen, *args, **kwargs)

    def _unanswered_drops_main(self, call, *args, **kwargs):
        """``call``'s answer; where there is none (timed out, interrupted, raised), the main
        context goes: Thespian hands an ask whatever reaches its context next, so the late
        answer would have been taken as the next ask's (a code review: after one `status`
        timed out in the shell, every command showed the previous command's answer)."""
        try:
            answer = call(*args, **kwargs)
        except BaseException:
            self._close_main()
            raise
        if answer is None:
            self._close_main()
        return answer

    def admin_alive(self) -> bool:
        """Whether the admin still accepts connections."""
        host, port = self.admin_address.addressDetails.sockname[:2]
        return port_in_use(port, host)

    def _close_main(self) -> None:
        with self._lock:
            main, self._main = self._main, None
        if main is not None:
            main.exit_clone()

    def close(self) -> None:
        """Close our sockets (the remote system is left as it is)."""
        self._close_main()
        self._transport.close()


#: How :func:`probe_admin` begins its answer when nothing listens on the port (yet).
NO_LEADER = "no convention leader answers"


def probe_admin(host: str, port: int) -> str | None:
    """None when a Thespian admin answers at ``host:port``, else why not (one line)."""
    if not port_in_use(port, host):
        return f"{NO_LEADER} at {host}:{port}"
    try:
        status = admin_status(host, port)
    except Exception as exc:  # noqa: BLE001 - Thespian raises several kinds here
        return f"cannot reach {host}:{port}: {exc}"
    if status is None:
        return f"{host}:{port} is not a Thespian admin (no answer within {ADMIN_ANSWER_S:g} s)"
    return None


def admin_status(host: str, port: int, timeout_s: float = ADMIN_ANSWER_S):
    """The Thespian admin at ``host:port``'s own status (``Thespian_SystemStatus``), or
    None when nothing there answers one within ``timeout_s`` (not a Thespian admin:
    attaching an ``ActorSystem`` to such a port takes about 15 s to fail).

    Raises:
        Exception: whatever Thespian raises making the transport to ask it with.
    """
    from thespian.system.messages.status import Thespian_StatusReq, Thespian_SystemStatus

    system = RemoteSystem(host, port)
    try:
        status = system.ask(system.admin_address, Thespian_StatusReq(), timeout_s)
        return status if isinstance(status, Thespian_SystemStatus) else None
    finally:
        system.close()


def is_member_status(status) -> bool:
    """Whether an admin's ``Thespian_SystemStatus`` is a convention member's (it has a
    convention address) rather than a leader's."""
    return bool(status.capabilities.get("Convention Address.IPv4"))


def leader_status(host: str, port: int):
    """The :class:`~omni_actors.messages.SystemStatus` of the system whose convention
    leader's admin is at ``host:port``, or None when it cannot be asked."""
    try:
        admin = attach_remote(host, port)
    except AdminError:
        return None
    try:
        return admin.status(timeout_s=ADMIN_ANSWER_S)
    except AdminError:
        return None
    finally:
        admin.asys.close()


def node_name_taken(host: str, port: int, node: str, status) -> str | None:
    """Why a member host may not join the convention at ``host:port`` as ``node``
    (one line), or None: another member that is alive already goes by that name.
    Two admins with one node name would share its placements (Thespian sends an
    actor for node ``m1`` to either) and corrupt its device inventory. None too
    when the coordinator could not be asked (``status``, :func:`leader_status`'s answer, is
    None: the join itself then says what is wrong)."""
    if status is None:
        return None
    if any(n.name == node and n.alive for n in status.nodes):
        return (f"a member host named {node!r} is already in the convention at {host}:{port}: give this one "
                f"another --node-name (if that host was just stopped or killed, start again once `status` "
                f"no longer shows it alive)")
    return None


def _local_leader_port(system: RemoteSystem, host: str) -> int | None:
    """The admin port of the leader ``system`` talks to, when it was reached through a
    member's admin at ``host`` and listens on that same address (one host); else None."""
    try:
        ip, port = system.admin_address.addressDetails.connectArgs[0]
    except (AttributeError, IndexError, TypeError, ValueError):
        return None
    return int(port) if (port != system.port and ip == host) else None


def _address_text(address, host: str) -> str:
    """A Thespian admin address as ``host:port`` (``ActorAddr-(T|:1900)``, with no IP,
    is one on ``host``); Thespian's own text when it has no TCP details."""
    try:
        ip, port = address.addressDetails.connectArgs[0]
    except (AttributeError, IndexError, TypeError, ValueError):
        return str(address)
    return f"{host if ip in ('', '0.0.0.0') else ip}:{port}"


def attach_remote(host: str, port: int) -> Admin:
    """An :class:`Admin` on the convention whose admin listens at ``host:port``:
    the leader's admin, or a member's (then its convention leader is used).

    Raises:
        AdminError: nothing listens there, it is not a Thespian admin, or no leader is known.
    """
    from thespian.system.messages.status import Thespian_StatusReq, Thespian_SystemStatus

    from omni_actors.actors.coordinator import COORDINATOR_NAME, CoordinatorActor

    if not port_in_use(port, host):
        raise AdminError(f"no convention leader answers at {host}:{port}")
    try:
        system = RemoteSystem(host, port)
    except Exception as exc:  # noqa: BLE001 - Thespian raises several kinds here
        raise AdminError(f"cannot reach {host}:{port}: {exc}") from None
    try:
        status = system.ask(system.admin_address, Thespian_StatusReq(), ADMIN_ANSWER_S)
        if not isinstance(status, Thespian_SystemStatus):
            raise AdminError(f"{host}:{port} is not a Thespian admin (no answer within {ADMIN_ANSWER_S:g} s)")
        if status.capabilities.get("Convention Address.IPv4"):
            # a member host's admin: go to its convention leader
            leader = status.conventionLeader
            if leader is None:
                raise AdminError(f"{host}:{port} is a member host's admin that knows no convention leader")
            system.retarget(leader)
            status = system.ask(system.admin_address, Thespian_StatusReq(), ADMIN_ANSWER_S)
            if not isinstance(status, Thespian_SystemStatus):
                raise AdminError(f"the convention leader {_address_text(leader, host)} of the member at "
                                 f"{host}:{port} does not "
                                 f"answer (stopped, or busy for over {ADMIN_ANSWER_S:g} s)")
        coordinator = status.globalActors.get(COORDINATOR_NAME)
        if coordinator is None:  # being restarted by the leader's watchdog: the lookup waits for it
            from omni_actors.actors.node_agent import NODE_CAPABILITY

            # (another program's Thespian admin got a coordinator made in it, and `status` read
            # NOT READY; one shutting down raised a traceback; a code review)
            if NODE_CAPABILITY not in status.capabilities:
                raise AdminError(f"{host}:{port} is a Thespian admin, but not an omni-actors system's")
            try:
                coordinator = system.createActor(CoordinatorActor, globalName=COORDINATOR_NAME)
            except Exception as exc:  # noqa: BLE001 - Thespian raises several kinds here
                raise AdminError(f"the omni-actors system at {host}:{port} has no coordinator and none could "
                                 f"be looked up (stopping?): {exc}") from None
        return Admin(system, coordinator, leader_port=_local_leader_port(system, host))
    except BaseException:
        system.close()
        raise
