"""A fix to Thespian 4.0.1's multiprocess bases: a parent hears of every child that exits.

A parent actor learns that a child exited from two sources: the child's own goodbye
(a ``ChildActorExited`` it sends as it exits) and ``SIGCHLD``, on which Thespian checks
its child processes and sends itself a ``ChildActorExited`` for each dead one. Each
time the parent handles a ``ChildActorExited``, Thespian also checks its child
processes (``MultiProcReplicator._childExited``) and forgets the dead ones *without*
a notice: a child that died since the last ``SIGCHLD`` check is then missed by the
next one. When that child's goodbye was lost as well (seen here in a debug trace:
a stage pool's goodbye sent, never received by the coordinator), the parent never
hears of it. An exiting parent waits for all its children, so the coordinator did not
exit and the leader's stop took 13 s, not 0.1-0.7 s: Thespian's 10 s system shutdown
timeout, then the kill of what was left. Seen in 3 of about 40 leader stops of one
``make test`` run on the two cores and 2 of 33 in three runs of the topology tests
beside it; a CI run failed on it (``test_lifecycle``'s drain test). With the fix:
none in 42 stops of the same ``make test`` part and 47 of those tests.

:func:`apply` makes that check send the notice for every other child it finds dead,
as the ``SIGCHLD`` check does. A second notice for one child is harmless: Thespian and
our actors already get one from each source.

A third change keeps how each child's process ended (:func:`exit_code`): Thespian
reaps it and tells the parent only ``ChildActorExited``; a stage pool's
``replica_exited`` could then not say whether its engine was killed by a signal (the
OOM killer's SIGKILL) or exited with an error status.

A second change makes every actor message cheaper. Thespian's TCP transport makes a
new selector for each turn of its loop (its own comment: "creates selector on each
loop, perhaps this could be optimized"): with the default epoll selector that is an
``epoll_create``, an ``epoll_ctl`` per socket, the wait and a ``close``, several turns
per message on each side. :class:`PollSelector` does the same with one ``poll``
system call. Measured side by side (``benchmarks/messages.py``): 7-10% less CPU
and wall time per message on both sides.

A fourth (:func:`use_short_identify`) stops Thespian from describing every transmit in
full for a debug log that is off: 9-12% less CPU per message on both sides, measured
the same way (medians of 7 runs of 3,000 round trips; shorter runs on this noisy machine
gave anything from 0 to 26%).
"""

from __future__ import annotations

import errno
import logging
import math
import os
import select
import selectors
import types

_applied = False


class PollSelector:
    """What Thespian's TCP transport asks of a selector (``register``, ``select``,
    ``close``, for the one loop turn it is made for), on a single ``poll(2)`` call.

    Unlike the epoll selector it replaces, registering makes no system call, so a
    descriptor that was closed shows up only in the poll itself (``POLLNVAL``):
    ``select`` then raises ``OSError(EBADF)``, as registering it with epoll would
    have, and Thespian's loop drops the bad descriptor (a closed watch) as before
    instead of spinning on it. A negative descriptor (a closed socket's ``fileno()``)
    raises ValueError at ``register``, as with the default selector (Thespian handles
    both). Registering a descriptor twice adds the events.
    """

    def __init__(self) -> None:
        self._poll = select.poll()
        self._events: dict[int, int] = {}

    def register(self, fd: int, events: int, data=None) -> selectors.SelectorKey:
        if not isinstance(fd, int):
            fd = fd.fileno()
        events |= self._events.get(fd, 0)
        self._events[fd] = events
        self._poll.register(fd, (select.POLLIN if events & selectors.EVENT_READ else 0)
                            | (select.POLLOUT if events & selectors.EVENT_WRITE else 0))
        return selectors.SelectorKey(fd, fd, events, data)

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        """``[(key, events ready)]`` within ``timeout`` seconds (None: no limit).

        Raises:
            OSError: EBADF, a registered descriptor is not open.
        """
        ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
        ready = []
        for fd, got in self._poll.poll(ms):
            if got & select.POLLNVAL:
                raise OSError(errno.EBADF, os.strerror(errno.EBADF), fd)
            wanted = self._events.get(fd, 0)
            # (errors and hang-ups wake readers and writers alike, as in selectors.PollSelector)
            events = ((selectors.EVENT_READ if got & ~select.POLLOUT else 0)
                      | (selectors.EVENT_WRITE if got & ~select.POLLIN else 0)) & wanted
            if events:
                ready.append((selectors.SelectorKey(fd, fd, wanted, None), events))
        return ready

    def close(self) -> None:
        self._events.clear()


#: Child actor address (its ``str``) -> its process's exit code as Thespian reaped it in
#: this process (``multiprocessing.Process.exitcode``: minus the signal that killed it);
#: the latest :data:`EXIT_CODES_KEPT`.
_EXIT_CODES: dict[str, int] = {}
EXIT_CODES_KEPT = 256


#: The attribute of a ``ChildActorExited`` that carries the exit code from the admin that
#: reaped the child (a member host's) to the actor that created it (see :func:`apply`).
EXIT_CODE_ATTR = "omni_exit_code"


def exit_code(address, notice=None) -> int | None:
    """How the process of the child actor ``address`` ended, once Thespian has reaped it:
    its exit status, or minus the signal that killed it; None when not known (not reaped
    yet: a child's own goodbye can arrive before it has exited). Taken from ``notice`` (the
    ``ChildActorExited``) when the admin of another host reaped it, else from this process."""
    code = getattr(notice, EXIT_CODE_ATTR, None)
    return code if code is not None else _EXIT_CODES.get(str(address))


def describe_exit(code: int | None) -> str:
    """``"killed by SIGKILL"``, ``"exit status 1"``, ``"exit status 0"``, or ``""`` for None."""
    if code is None:
        return ""
    if code < 0:
        try:
            import signal

            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


def _note_exit(child) -> None:
    code = getattr(child.childProc, "exitcode", None)
    if code is None:
        return
    for addr in (child.childAddr, getattr(child, "childRealAddr", None)):
        if addr is not None:
            _EXIT_CODES[str(addr)] = code
    while len(_EXIT_CODES) > EXIT_CODES_KEPT:
        _EXIT_CODES.pop(next(iter(_EXIT_CODES)))


def apply() -> None:
    """Patch ``thespian.system.multiprocCommon.MultiProcReplicator._childExited`` (a
    no-op where Thespian has no such method) and make the TCP transport poll
    (:func:`use_poll_selector`); once per process. Call it before the actor system
    starts: its admin and actors are forked from this process and inherit both."""
    global _applied
    if _applied:
        return
    _applied = True
    use_poll_selector(True)
    use_short_identify(True)
    raise_pending_transmits()
    try:
        from thespian.actors import ChildActorExited
        from thespian.system.addressManager import CannotPickleAddress
        from thespian.system.multiprocCommon import MultiProcReplicator
        from thespian.system.transport import TransmitIntent
    except ImportError:  # another Thespian layout: leave it as it is
        return
    if not hasattr(MultiProcReplicator, "_childExited"):
        return
    check_liveness = MultiProcReplicator._checkChildLiveness

    def _check_child_liveness(child) -> bool:
        alive = check_liveness(child)
        if not alive:  # (joined: its exit code is known)
            _note_exit(child)
        return alive

    MultiProcReplicator._checkChildLiveness = staticmethod(_check_child_liveness)

    def _child_exited(self, childAddr):
        alive, dead = [], []
        for child in getattr(self, "_child_procs", []):
            (alive if MultiProcReplicator._checkChildLiveness(child) else dead).append(child)
        self._child_procs = alive
        for child in dead:
            addr = getattr(child, "childRealAddr", child.childAddr)
            if addr == childAddr:
                continue  # the one being handled now
            try:
                self.transport.scheduleTransmit(None, TransmitIntent(self.transport.myAddress,
                                                                     ChildActorExited(addr)))
            except CannotPickleAddress:
                logging.getLogger(__name__).error("child %s exited; its address cannot be resolved", addr)

    MultiProcReplicator._childExited = _child_exited
    _stamp_admin_notices()
    _status_without_local_addresses()


def _status_without_local_addresses() -> None:
    """An admin's answer to ``Thespian_StatusReq`` lists its children, the messages it
    holds, global names and notification handlers: among them, the local address of an
    actor whose creation waits on another host (a node agent asked for on a member that is
    frozen). Such an address cannot be sent until it is resolved, so Thespian held the whole
    answer, for good: every later status request went unanswered, and with it our check
    that a port is a Thespian admin, so no CLI command, shell or new member could reach the
    leader (trial CB: a member frozen past its heartbeats, then resumed; the admin itself
    ran on). The answer leaves such addresses out (a message's sender or target is kept as
    its name)."""
    try:
        from thespian.system.addressManager import ActorLocalAddress
        from thespian.system.admin.adminCore import AdminCore
    except ImportError:
        return
    get_status = getattr(AdminCore, "getStatus", None)
    if get_status is None:
        return

    def local(address) -> bool:
        return isinstance(getattr(address, "addressDetails", None), ActorLocalAddress)

    def named(address):
        return str(address) if local(address) else address

    def _get_status(self):
        resp = get_status(self)
        resp.childActors = [a for a in resp.childActors if not local(a)]
        resp.receivedMessages = [(named(f), named(t), m) for f, t, m in resp.receivedMessages]
        resp.pendingMessages = [(named(f), named(t), m) for f, t, m in resp.pendingMessages]
        resp.pendingWakeups = [w for w in resp.pendingWakeups if not (isinstance(w, tuple) and local(w[0]))]
        if hasattr(resp, "globalActors"):
            resp.globalActors = {n: a for n, a in resp.globalActors.items() if not local(a)}
            resp.notifyAddresses = [a for a in resp.notifyAddresses if not local(a)]
            resp.deadLetterAddresses = [a for a in resp.deadLetterAddresses if not local(a)]
            if local(resp.deadLetterHandler):
                resp.deadLetterHandler = None
        return resp

    AdminCore.getStatus = _get_status


#: Transmits one actor keeps in flight at once (Thespian's MAX_PENDING_TRANSMITS, 20 by
#: default; the rest wait in its queue), unless THESPIAN_MAX_PENDING_TRANSMITS is set.
PENDING_TRANSMITS = 64


def raise_pending_transmits(limit: int = PENDING_TRANSMITS) -> int:
    """Let each actor keep ``limit`` transmits in flight where Thespian keeps 20; returns the
    limit in force. One to a frozen peer (an API server stopped with SIGSTOP, a host gone
    silent) stays in flight up to 5 minutes, and each actor holds a few for each such peer
    at most (``outbox.DeltaWindow``: 8; a coordinator subscriber: 8; a RequestActor: 8):
    at 20, three frozen API servers silenced the Thinker that streamed to them. Transmits
    to one peer still go one after the other. An operator's own
    ``THESPIAN_MAX_PENDING_TRANSMITS`` is left as it is."""
    try:
        from thespian.system.transport import asyncTransportBase
    except ImportError:  # another Thespian layout
        return 0
    if "THESPIAN_MAX_PENDING_TRANSMITS" not in os.environ and asyncTransportBase.MAX_PENDING_TRANSMITS < limit:
        asyncTransportBase.MAX_PENDING_TRANSMITS = limit
    return asyncTransportBase.MAX_PENDING_TRANSMITS


def _stamp_admin_notices() -> None:
    """An actor created on a member host (a replica placed there) is a child process of
    that host's admin, which reaps it and passes ``ChildActorExited`` on to the actor that
    asked for it (``AdminCore._handleChildExited``): the exit code stayed in the member's
    admin and the replica's reason read only "process exited" (trial AN). Stamp that
    notice with the code (:data:`EXIT_CODE_ATTR`), which travels with it."""
    try:
        from thespian.actors import ChildActorExited
        from thespian.system.admin.adminCore import AdminCore
    except ImportError:
        return
    handle = getattr(AdminCore, "_handleChildExited", None)
    if handle is None or not hasattr(AdminCore, "_send_intent"):
        return

    def _handle_child_exited(self, childAddress):
        code = _EXIT_CODES.get(str(childAddress))
        if code is None:
            return handle(self, childAddress)
        send = self._send_intent

        def stamped(intent, *args, **kwargs):
            if isinstance(intent.message, ChildActorExited) and intent.message.childAddress == childAddress:
                setattr(intent.message, EXIT_CODE_ATTR, code)
            return send(intent, *args, **kwargs)

        self._send_intent = stamped
        try:
            return handle(self, childAddress)
        finally:
            del self._send_intent

    AdminCore._handleChildExited = _handle_child_exited


def use_poll_selector(enabled: bool) -> None:
    """Make Thespian's TCP transport use :class:`PollSelector` for each turn of its
    loop (``enabled``), or its own ``selectors.DefaultSelector`` again; for this
    process and the processes it forks from now on (a no-op where Thespian has no
    TCP transport module)."""
    try:
        from thespian.system.transport import TCPTransport
    except ImportError:
        return
    TCPTransport.selectors = (types.SimpleNamespace(DefaultSelector=PollSelector, EVENT_READ=selectors.EVENT_READ,
                                                    EVENT_WRITE=selectors.EVENT_WRITE)
                              if enabled else selectors)


_FULL_IDENTIFY = None


def use_short_identify(enabled: bool) -> None:
    """Make a transmit's description (``TransmitIntent.identify``) cheap unless Thespian's
    own debug log is on (``THESPLOG_THRESHOLD=DEBUG``); with ``enabled`` False, Thespian's
    own again. For this process and the processes it forks from now on.

    Thespian builds that description for two debug lines on every send, whether or not
    its debug log is on (the string is an argument of the log call): the message's
    ``str()``, the target, and the intent's timers (its expiry, retry and pause times,
    each read from the clock). Profiled on an actor answering a ping-pong, that was 7-8%
    of its time. The short form keeps the target and the message, which Thespian's
    warning and error lines about a transmit still print.
    """
    global _FULL_IDENTIFY
    try:
        from thespian.system import utilis
        from thespian.system.transport import MAX_SHOWLEN, TransmitIntent
    except ImportError:  # another Thespian layout
        return
    if _FULL_IDENTIFY is None:
        _FULL_IDENTIFY = TransmitIntent.identify
    full = _FULL_IDENTIFY
    if not enabled:
        TransmitIntent.identify = full
        return

    def identify(self) -> str:
        if utilis._thesplog_control_settings[0] <= logging.DEBUG:
            return full(self)
        try:
            text = str(self.message)
        except Exception:  # noqa: BLE001 - as Thespian's own: a description never raises
            text = "<message>"
        return f"TransportIntent({self.targetAddr}-{text[:MAX_SHOWLEN]})"  # (Thespian's own prefix)

    TransmitIntent.identify = identify
