"""One more API server: an aiohttp front end attached to a running system.

``python -m omni_actors.system api --port P [--host H] [--admin-port A]``
attaches to the admin of a system already running on this host (it never
starts one: nothing listening on the admin port is a one-line error), looks
the coordinator up by its ``globalName``, builds an :class:`ActorBridge` on it
and serves the same pipeline as the leader's own API server. Any number of
them can run beside the leader's; each one is independent of the others.

``api --port P --convention-address HOST:PORT`` does the same from any host:
it starts no admin of its own but talks straight to the convention leader's
admin at HOST:PORT (see :mod:`omni_actors.system.remote`; a member's admin
address works too), so its lookups reach the same coordinator and its
RequestActors are created by the leader's admin, as for an API server on the
leader's host. It binds only its HTTP port (``--host``) and the sockets on
which actors reply to it; nothing else is left on its host when it exits.

On SIGINT/SIGTERM it stops accepting connections, lets its requests in flight
finish (up to ``drain_timeout_s``), and stops **only itself**: it never calls
``ActorSystem.shutdown()`` (that would stop the whole system). The
RequestActors its bridge created live in the admin's process tree, not in
ours, so they would outlive us; we track every one the bridge creates and send
each an ``ActorExitRequest`` when we close. (A server killed with SIGKILL
cannot do that: its RequestActors then stay, idle, until the system stops.)
If the system itself goes away (its admin stops listening), the server notices
within :data:`ADMIN_CHECK_EVERY_S`, ends its requests in flight at once with a
503 saying so (they cannot finish: their RequestActors went with the system),
and exits with status 1. (A trial's request sent just after the leader stopped
waited 12-14 s, then got a 503 blaming ``drain_timeout_s``.)
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from contextlib import contextmanager
from typing import Any


#: How often a running API server checks that the system's admin still listens, in
#: seconds: a loopback connect, or one to the convention leader's admin.
ADMIN_CHECK_EVERY_S = 1.0


class ApiServerError(RuntimeError):
    """The API server could not start; the message is one line for the CLI."""


class _TrackingContext:
    """An ``ActorSystem`` context that records the RequestActors created through it."""

    def __init__(self, ctx, created: list, lock: threading.Lock, supervisors: list):
        self._ctx, self._created, self._lock, self._supervisors = ctx, created, lock, supervisors

    def createActor(self, actorClass, *args, **kwargs):
        from omni_actors.actors.request import RequestActor
        from omni_actors.actors.request_supervisor import RequestActorSupervisor

        address = self._ctx.createActor(actorClass, *args, **kwargs)
        # (ending the supervisor ends the RequestActors it made)
        if actorClass in (RequestActor, RequestActorSupervisor) and not kwargs.get("globalName"):
            with self._lock:
                (self._supervisors if actorClass is RequestActorSupervisor else self._created).append(address)
        return address

    def tell(self, address, message) -> None:
        """``tell``; an exit request to a RequestActor (the bridge ending one left idle
        after a burst) also takes it off the list, which would otherwise only grow."""
        from thespian.actors import ActorExitRequest

        self._ctx.tell(address, message)
        if isinstance(message, ActorExitRequest):
            with self._lock:
                try:
                    self._created.remove(address)
                except ValueError:
                    pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


class TrackingSystem:
    """Wraps the process's ``ActorSystem`` for :class:`ActorBridge`: every
    ``private()`` context it hands out records the RequestActors created
    through it, so :meth:`exit_request_actors` can end them at close.

    The bridge only uses ``private()``; anything else passes through.
    """

    def __init__(self, asys):
        self._asys = asys
        self._lock = threading.Lock()
        self.created: list = []
        #: RequestActorSupervisors made here: told to exit at close even when the bridge
        #: told them already (a trial's stopped server left one and its RequestActors behind)
        self.supervisors: list = []

    @contextmanager
    def private(self):
        with self._asys.private() as ctx:
            yield _TrackingContext(ctx, self.created, self._lock, self.supervisors)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._asys, name)

    def exit_request_actors(self) -> int:
        """Send ``ActorExitRequest`` to every RequestActor (and RequestActorSupervisor, which
        ends those it made) created here; returns how many were told."""
        from thespian.actors import ActorExitRequest

        with self._lock:
            actors = [*self.supervisors, *(a for a in self.created if a not in self.supervisors)]
            self.created[:], self.supervisors[:] = [], []
        told = 0
        with self._asys.private() as ctx:
            for address in actors:
                try:
                    ctx.tell(address, ActorExitRequest())
                    told += 1
                except Exception:  # noqa: BLE001 - already gone: nothing to end
                    pass
        return told


def _is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback interface (``127.0.0.1``, ``localhost``, ``::1``)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_api(*, host: str, port: int, admin_port: int | None = None, convention: tuple[str, int] | None = None,
            api_key: str | None = None, request_actors: int | None = None, connect_timeout_s: float = 10.0) -> int:
    """Serve the running system's pipeline on ``host:port`` until SIGINT/SIGTERM. Returns the exit code.

    Attaches to the admin on ``admin_port`` (this host) or, given ``convention``
    (``(host, port)`` of the convention leader's admin), to that one from here.

    Raises:
        ApiServerError: bad or busy port, no admin there, or no deployed coordinator.
    """
    from omni_actors.http.bridge import BridgeError
    from omni_actors.logs import get_logger
    from omni_actors.system.admin import AdminError, attach
    from omni_actors.system.processes import handle_stop_signals
    from omni_actors.system.leader import http_port_problem, other_leaders_hint
    from omni_actors.system.remote import NO_LEADER, RemoteSystem, _address_text, attach_remote

    problem = http_port_problem(host, port, None if convention else admin_port, api=True)
    if problem:
        raise ApiServerError(problem)
    where = f"the convention at {convention[0]}:{convention[1]}" if convention else f"admin port {admin_port}"

    stopping, started, lost = threading.Event(), threading.Event(), threading.Event()

    hurry = threading.Event()

    def interrupt(signum, frame):
        if started.is_set():
            if stopping.is_set():
                hurry.set()  # a second Ctrl-C: do not wait for the drain
            stopping.set()
        else:
            raise KeyboardInterrupt

    handle_stop_signals(interrupt)  # (SIGHUP too: its terminal closed left its RequestActors behind)

    log = get_logger(actor="api")
    admin = None
    try:
        try:
            admin = attach_remote(*convention) if convention else attach(admin_port)
        except AdminError as exc:
            hint = ""
            if convention and str(exc).startswith(NO_LEADER) and _is_loopback(convention[0]):
                # (as `--admin-port` with nothing there says: trial AZ)
                hint = other_leaders_hint(convention[1], f"--convention-address {convention[0]}:{{}}")
            raise ApiServerError(f"{exc}{hint}") from None
        except Exception as exc:  # noqa: BLE001 - Thespian raises several kinds here
            raise ApiServerError(f"cannot attach to {where}: {exc}") from None
        from omni_actors.messages import GetRoutes, Routes

        if not convention:  # (a member's admin port: its leader is the system it serves, and says gone)
            leader = _address_text(admin.asys.admin_address, "127.0.0.1")
            if leader != f"127.0.0.1:{admin_port}":  # (trial BO: its 503 named the member's port, stopped long before)
                where = f"the convention at {leader} (found through admin port {admin_port})"
        routes = admin.asys.ask(admin.coordinator, GetRoutes(), connect_timeout_s)
        if not isinstance(routes, Routes) or routes.config is None:
            raise ApiServerError(f"the coordinator of {where} did not answer with a "
                                 f"deployed pipeline within {connect_timeout_s:g} s")
        deployment = routes.config.deployment
        tracking = TrackingSystem(admin.asys)
        # (the leader's admin, also where `--admin-port` is a member's: it was that port, which a
        # member keeps listening on with its leader killed, so the server never stopped; a code review)
        alive = admin.asys.admin_alive
        try:
            asyncio.run(_serve(tracking, admin.coordinator, host=host, port=port, where=where, alive=alive,
                               api_key=api_key, request_actors=request_actors or deployment.request_actors,
                               drain_timeout_s=deployment.supervision.drain_timeout_s,
                               connect_timeout_s=connect_timeout_s, started=started, stopping=stopping,
                               lost=lost, hurry=hurry))
        except BridgeError as exc:
            raise ApiServerError(f"the coordinator of {where} did not answer: {exc}") from None
        finally:
            # with the system gone there is nothing left to end (and each tell would wait on a dead peer)
            # (a supervisor ends the RequestActors it made: a trial read "request_actors_ended: 1"
            # beside 4 RequestActors, as this counts the actors told, the supervisor being one)
            told = 0 if lost.is_set() else tracking.exit_request_actors()
            log.info("api_server_stopped", actors_told_to_exit=told)
        print("omni-actors API server stopped", flush=True)
        return 1 if lost.is_set() else 0
    except KeyboardInterrupt:
        print("interrupted during start-up", file=sys.stderr)
        return 130
    finally:
        if admin is not None and isinstance(admin.asys, RemoteSystem):
            admin.asys.close()  # our sockets only (an attached local ActorSystem is left as it is)


async def _serve(asys, coordinator, *, host: str, port: int, where: str, alive, api_key: str | None,
                 request_actors: int, drain_timeout_s: float, connect_timeout_s: float, started: threading.Event,
                 stopping: threading.Event, lost: threading.Event, hurry: threading.Event | None = None) -> None:
    from omni_actors.http.app import start_http
    from omni_actors.http.bridge import ActorBridge
    from omni_actors.system.leader import drain_http

    loop = asyncio.get_running_loop()
    bridge = ActorBridge(asys, coordinator, request_actors=request_actors,
                         connect_timeout_s=connect_timeout_s)
    bridge.system_alive = alive
    await loop.run_in_executor(None, bridge.start, loop)  # blocks on the coordinator's answers
    try:
        try:
            runner = await start_http(bridge, host, port, api_key=api_key)
        except OSError as exc:
            raise ApiServerError(f"cannot serve HTTP on {host}:{port}: {exc.strerror}") from None
        started.set()
        shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
        print(f"omni-actors API server serving model {bridge.model_name!r} at http://{shown}:{port}/v1 "
              f"(attached to {where}); Ctrl-C to stop this server only", flush=True)
        if not api_key:  # (a trial's second server answered everyone while the leader took a key)
            print("note: this API server takes no API key (--api-key K or OMNI_ACTORS_API_KEY): every client "
                  "is served; a key the leader was given is not taken over", file=sys.stderr, flush=True)
        try:
            next_check = time.monotonic() + ADMIN_CHECK_EVERY_S
            while not stopping.is_set() and not bridge.system_stopping.is_set():
                await asyncio.sleep(0.2)
                if time.monotonic() >= next_check:
                    if not await loop.run_in_executor(None, alive):
                        lost.set()
                        # (resumed after a freeze: what the system sent before it went is read first)
                        await bridge.inbound_settled()
                        how = "has stopped" if bridge.system_stopping.is_set() else "is gone"
                        print(f"error: the system on {where} {how}; stopping this API server",
                              file=sys.stderr, flush=True)
                        break
                    next_check = time.monotonic() + ADMIN_CHECK_EVERY_S
            gone = ""
            if lost.is_set():  # (trial AS: one frozen through a whole stop read "gone", not "stopped")
                gone = (f"the omni-actors system on {where} has stopped (while this API server did not "
                        f"answer, so it could not drain)" if bridge.system_stopping.is_set() else
                        f"the omni-actors system on {where} is gone (its admin stopped listening)")
                gone += ": the request cannot finish; this API server stops too"
            system_stops = bridge.system_stopping.is_set() and not stopping.is_set() and not gone
            if system_stops:  # the leader was stopped: drain as it does, then stop too
                drain_timeout_s = bridge.system_drain_timeout_s or drain_timeout_s
                print(f"the system on {where} is stopping: this API server takes no new requests, gives its "
                      f"{bridge.in_flight()} request(s) in flight up to {drain_timeout_s:g} s to finish "
                      f"(supervision.drain_timeout_s), then stops too", file=sys.stderr, flush=True)
            watch = asyncio.ensure_future(_watch_admin(loop, alive, lost)) if not gone else None
            try:
                ended = await drain_http(
                    runner, bridge, drain_timeout_s, _Either(hurry, bridge.system_hurry), gone=gone,
                    stopping=f"the omni-actors system on {where} is stopping" if system_stops else "",
                    went=lambda: (f"the omni-actors system on {where} went away while this API server drained: "
                                  f"the request cannot finish") if lost.is_set() else "")
            finally:
                if watch is not None:
                    watch.cancel()
            if bridge.system_stopping.is_set() and not lost.is_set():  # (the leader waits for this answer)
                from omni_actors.messages import ApiServerDrained

                try:
                    await loop.run_in_executor(None, asys.tell, coordinator, ApiServerDrained(bridge.address, ended))
                except Exception as exc:  # noqa: BLE001 - the system is stopping anyway
                    from omni_actors.logs import get_logger

                    get_logger(actor="api").warning("drained_unannounced", error=str(exc))
        finally:
            await runner.cleanup()
    finally:
        bridge.close()


async def _watch_admin(loop, alive, lost: threading.Event) -> None:
    """(During a drain) Set ``lost`` once the system's admin stops listening (checked every
    :data:`ADMIN_CHECK_EVERY_S`): requests still in flight then cannot finish."""
    while not lost.is_set():
        await asyncio.sleep(ADMIN_CHECK_EVERY_S)
        if not await loop.run_in_executor(None, alive):
            lost.set()


class _Either:
    """``is_set()`` of either of two events: the server's own second Ctrl-C, or its system's
    leader stopped a second time (``ActorBridge.system_hurry``)."""

    def __init__(self, *events) -> None:
        self._events = [e for e in events if e is not None]

    def is_set(self) -> bool:
        return any(e.is_set() for e in self._events)
