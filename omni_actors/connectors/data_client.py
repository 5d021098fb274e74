"""The data service's wire protocol and its client side.

Wire format (big-endian). A request is ``u32 length`` + a JSON object of that
many bytes (at most :data:`MAX_REQUEST` bytes): ``{"op": "get", "name": N,
"size": S}``, ``{"op": "release", "names": [...]}`` (with ``"recycle": true``:
keep them for later puts on that node, see :func:`release`), ``{"op": "stats"}``,
``{"op": "config", "reap_after_s": X}``. A reply is ``u8 status`` + ``u64
length`` + that many bytes: the segment's bytes for a ``get``, JSON for
``release``/``stats``/``config``, a UTF-8 message for an error.

The client (:func:`fetch`, :func:`release`, :func:`stats`, :func:`configure`)
keeps one connection per service per thread, receives a segment with
``recv_into`` straight into the buffer the arrays are then views on, and
reuses such buffers once the consumer has dropped every array on them
(:class:`ReceivePool`). The server is :mod:`omni_actors.connectors.data_service`.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from omni_actors.connectors.inline import ConnectorError

POOL_ENV = "OMNI_ACTORS_RECV_POOL_BYTES"  #: most bytes of receive buffers a process keeps for reuse

REQUEST_HEADER = struct.Struct("!I")
REPLY_HEADER = struct.Struct("!BQ")
MAX_REQUEST = 1 << 20  #: bytes of one request's JSON
RELEASE_BATCH = 2000  #: names per release request (keeps a request well under MAX_REQUEST)

OK, NOT_FOUND, BAD_REQUEST, FAILED = 0, 1, 2, 3

CONNECT_TIMEOUT_S = 5.0
#: Releases give up sooner (they are retried by no one: the owner's reaper frees what they miss).
RELEASE_CONNECT_TIMEOUT_S = 1.0
#: A service that could not be reached (refused, no answer) is not tried again by this process
#: for DOWN_FOR_S, doubled with each failure in a row up to DOWN_FOR_MAX_S: every request to
#: it fails at once meanwhile. Gets waited each their own connect timeout (5 s) on a host cut
#: off: the API server's receiver thread, or a replica's event loop, froze 5 s per output from
#: that host while every other stream waited (a code review).
DOWN_FOR_S = 3.0
DOWN_FOR_MAX_S = 30.0
#: Longest wait for one recv/send of a get or a stats request: a service that sends nothing
#: for this long is taken for gone. A host cut off (no reset comes back) otherwise held the
#: callers (an engine's event loop, the API server's receiver thread) for its whole length:
#: 60 s, when it was that (a code review). A healthy service sends a segment without pauses.
IO_TIMEOUT_S = 10.0
#: The same for releases, which nobody waits on (the owner's reaper frees what they miss).
RELEASE_IO_TIMEOUT_S = 2.0
RECV_CHUNK = 1 << 22
DEFAULT_POOL_BYTES = 256 << 20
POOL_MIN_BUFFER = 1 << 20  #: smaller receive buffers come from malloc, which reuses memory by itself


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None on a clean EOF before the first byte."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            if got == 0:
                return None
            raise ConnectionError(f"peer closed after {got} of {n} bytes")
        got += k
        _heard_on(sock)
    return bytes(buf)


class DataServiceError(ConnectionError):
    """The data service could not be reached, or broke the protocol."""


def parse_address(service: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"[v6]:port"``) -> ``(host, port)``. Raises ValueError."""
    host, sep, port = service.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"data service address must be host:port, got {service!r}")
    return host.strip("[]"), int(port)


class _Connections(threading.local):
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.by_service: dict[str, socket.socket] = {}


_conns = _Connections()


@dataclass
class _Wait:
    """A request waiting for its answer on a socket (any thread's), so that :func:`give_up`
    can end the wait."""

    service: str
    heard: float  #: when the request was sent or its last bytes came (monotonic)
    given_up: bool = False  #: :func:`give_up` ended it


#: socket -> its request's wait, while it waits (not a probe's)
_waits: dict[socket.socket, _Wait] = {}
_waiting_lock = threading.Lock()


def _heard_on(sock: socket.socket) -> None:
    wait = _waits.get(sock)
    if wait is not None:
        wait.heard = time.monotonic()
#: A request that has heard from its service within this many seconds is not ended by
#: :func:`give_up`: the service answers (the coordinator's word that it is silent can lag
#: its resume by a probe: a review).
GIVE_UP_QUIET_S = 1.0
#: service -> (until when it is taken for down (monotonic), failures in a row)
_down: dict[str, tuple[float, int]] = {}
#: service -> the ``_down`` entry it was last probed for (see probe_down)
_probed: dict[str, tuple[float, int]] = {}


def _mark_down(service: str) -> None:
    """One more failure in a row of ``service``, unless it is taken for down already (the
    threads that failed together in one outage count once: a review saw 4 make it 24 s). A
    mark that ran out :data:`DOWN_FOR_MAX_S` ago or more counts no more (its count is kept
    until the service answers: one timeout long after would be taken for down 30 s)."""
    until, failures = _down.get(service, (0.0, 0))
    now = time.monotonic()
    if now < until:
        return
    if now - until >= DOWN_FOR_MAX_S:
        failures = 0
    failures += 1
    _down[service] = (now + min(DOWN_FOR_S * 2 ** (failures - 1), DOWN_FOR_MAX_S), failures)


def probe_down(service: str, timeout_s: float) -> bool:
    """Whether ``service``, taken for down, answers now (:func:`answers`, at most
    ``timeout_s``): then it is taken for up again and the next request to it is tried.
    Probed once per time it is taken for down (a frozen host would otherwise cost each caller
    the probe); False while it is not taken for down too (nothing to probe)."""
    down = _down.get(service)
    if down is None or time.monotonic() >= down[0] or _probed.get(service) == down:
        return False
    _probed[service] = down
    if not answers(service, timeout_s):
        return False
    _down.pop(service, None)
    return True


def give_up(service: str) -> int:
    """Take ``service`` for down and end the requests waiting on it now (their sockets shut
    down: each fails at once with a DataServiceError instead of waiting out its timeout, 10 s
    for a get): its host's node agent says it does not answer (a frozen host; trial CG's
    requests begun just before the freeze was seen each waited 10 s). How many were ended.
    Those spared for having heard from it within :data:`GIVE_UP_QUIET_S` are looked at again
    that much later, and ended if they have heard nothing since and the service has not
    answered anyone (trial CN: fetches sent 0.7 and 1 s before the report were spared, and
    each waited its 10 s)."""
    _mark_down(service)
    again = threading.Timer(GIVE_UP_QUIET_S, _end_quiet_waits, (service, True))
    again.daemon = True
    again.start()
    return _end_quiet_waits(service)


def _end_quiet_waits(service: str, unless_answered: bool = False) -> int:
    """:func:`give_up`'s work: the waits on ``service`` quiet for :data:`GIVE_UP_QUIET_S` or more
    are ended (with ``unless_answered``, none once the service has answered meanwhile)."""
    if unless_answered and service not in _down:  # (a reply, or forget_down, took its mark away)
        return 0
    now = time.monotonic()
    with _waiting_lock:  # (shut down here: once its request ends, its thread may reuse the socket)
        socks = [s for s, w in _waits.items()
                 if w.service == service and not w.given_up and now - w.heard >= GIVE_UP_QUIET_S]
        for sock in socks:
            _waits[sock].given_up = True
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # (closed meanwhile)
    return len(socks)


def mark_down(service: str) -> None:
    """Take ``service`` for down (again, if its last mark has run out): requests to it fail at
    once until :func:`probe_down` finds it answers, once per mark. For a caller that knows it
    does not answer (the coordinator says so) while its own mark ran out."""
    _mark_down(service)


def taken_for_down(service: str) -> bool:
    """Whether requests to ``service`` fail at once now (its down mark has not run out)."""
    down = _down.get(service)
    return down is not None and time.monotonic() < down[0]


def forget_down(service: str) -> bool:
    """Take ``service`` for up again (its host's node agent says it answers: the coordinator
    publishes that): the next request to it is tried. Whether it was taken for down. (A
    trial's API server refused a member's outputs for 7 s after it was resumed from a long
    freeze: 3 failures in a row had it skipped for 12 s, and its one probe had failed.)"""
    _probed.pop(service, None)
    return _down.pop(service, None) is not None


def _connection(service: str, quick: bool = False) -> tuple[socket.socket, bool]:
    """This thread's connection to ``service``: ``(socket, reused)``; none is tried
    while the service is taken for down (see DOWN_FOR_S). ``quick`` (releases):
    a short connect timeout."""
    if _conns.pid != os.getpid():  # forked: the parent's sockets are not ours to use
        for sock in _conns.by_service.values():
            sock.close()
        _conns.by_service, _conns.pid = {}, os.getpid()
    down = _down.get(service)
    if down is not None and time.monotonic() < down[0]:
        # (before this thread's open connection too: a review saw each thread that had one wait out
        # its own 10 s on a frozen host, after the first had timed out)
        raise DataServiceError(f"data service {service} unreachable ({down[1]} time(s) in a row); "
                               f"not tried again for {down[0] - time.monotonic():.1f} s")
    sock = _conns.by_service.get(service)
    if sock is not None:
        return sock, True
    try:
        host, port = parse_address(service)
        sock = socket.create_connection((host, port),
                                        timeout=RELEASE_CONNECT_TIMEOUT_S if quick else CONNECT_TIMEOUT_S)
    except (OSError, ValueError) as exc:
        _mark_down(service)
        raise DataServiceError(f"data service {service} unreachable: {exc}") from None
    # (a connection made is no answer: a frozen host's kernel accepts them; its mark, and its count of
    # failures, go when it answers: trial CN's fetches each waited 10 s after a release connected)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    _conns.by_service[service] = sock
    return sock, False


def _drop(service: str) -> None:
    sock = _conns.by_service.pop(service, None)
    if sock is not None:
        sock.close()


def _request(service: str, req: dict, into: np.ndarray | None = None,
             quick: bool = False) -> tuple[int, bytes | np.ndarray]:
    """Send ``req``, return ``(status, body)``. With ``into`` (an OK ``get``), the
    body is received into that preallocated buffer, which must have the body's size.

    A connection that was reused and turns out dead is replaced once (the
    requests are idempotent). Raises DataServiceError.
    """
    payload = json.dumps(req).encode()
    message = REQUEST_HEADER.pack(len(payload)) + payload
    for attempt in (0, 1):
        sock, reused = _connection(service, quick)
        with _waiting_lock:
            _waits[sock] = _Wait(service, time.monotonic())
        try:
            return _exchange(service, sock, reused, attempt, message, into, quick)
        except _Again:
            continue
        finally:
            with _waiting_lock:
                _waits.pop(sock, None)
    raise AssertionError("unreachable")


class _Again(Exception):
    """A reused connection turned out dead: try once more on a new one."""


def _exchange(service: str, sock: socket.socket, reused: bool, attempt: int, message: bytes,
              into: np.ndarray | None, quick: bool) -> tuple[int, bytes | np.ndarray]:
    """One try of :func:`_request` on ``sock``."""
    try:
        sock.settimeout(RELEASE_IO_TIMEOUT_S if quick else IO_TIMEOUT_S)
        sock.sendall(message)
        head = _recv_exact(sock, REPLY_HEADER.size)
        if head is None:
            raise ConnectionError("closed by the data service")
    except (OSError, ConnectionError) as exc:
        _drop(service)
        _if_given_up(service, sock)
        if isinstance(exc, TimeoutError):  # (no answer: not a stale connection, which fails at once)
            _mark_down(service)
            raise DataServiceError(f"data service {service}: no answer within "
                                   f"{RELEASE_IO_TIMEOUT_S if quick else IO_TIMEOUT_S:g} s") from None
        if reused and attempt == 0:
            raise _Again() from None
        raise DataServiceError(f"data service {service}: {exc}") from None
    status, length = REPLY_HEADER.unpack(head)
    if service in _down:  # (it answers: whatever another thread saw of it is over)
        _down.pop(service, None)
    try:
        if status == OK and into is not None:
            if length != into.nbytes:
                raise ConnectionError(f"sent {length} bytes, {into.nbytes} were asked")
            _recv_into(sock, memoryview(into))
            return status, into
        if length > MAX_REQUEST:
            raise ConnectionError(f"a reply of {length} bytes (status {status}) is not a reply")
        body = _recv_exact(sock, length) if length else b""
        return status, body or b""
    except (OSError, ConnectionError) as exc:
        _drop(service)
        _if_given_up(service, sock)
        if isinstance(exc, TimeoutError):
            _mark_down(service)
            exc = f"no data within {IO_TIMEOUT_S:g} s"
        raise DataServiceError(f"data service {service}: {exc}") from None


def _if_given_up(service: str, sock: socket.socket) -> None:
    """Raises DataServiceError when :func:`give_up` ended the wait on ``sock``."""
    with _waiting_lock:
        wait = _waits.get(sock)
    if wait is not None and wait.given_up:
        raise DataServiceError(f"data service {service}: not waited for: its host's node agent says it does not "
                               "answer (its process frozen or hung?)") from None


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got, total = 0, view.nbytes
    while got < total:
        n = sock.recv_into(view[got:], min(total - got, RECV_CHUNK))
        if n == 0:
            raise ConnectionError(f"closed after {got} of {total} bytes")
        got += n
        _heard_on(sock)


def _error(status: int, body: bytes, service: str) -> ConnectorError | DataServiceError:
    text = body.decode("utf-8", "replace")
    if status in (NOT_FOUND, BAD_REQUEST):
        return ConnectorError(f"{text} (data service {service})")
    return DataServiceError(f"data service {service} failed: {text}")


class ReceivePool:
    """Receive buffers, reused once nothing refers to them any more.

    Filling fresh memory costs page faults (and, for huge pages, compaction
    stalls: seen here at 256 MB) on top of the transfer; a buffer whose arrays
    the consumer has dropped is already mapped. A buffer is handed out as a
    view (``buf[:size]``): every array built on it keeps ``buf`` referenced, so
    a buffer whose only reference is the pool's is free. At most ``max_bytes``
    are kept; buffers under :data:`POOL_MIN_BUFFER` are not pooled.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._bufs: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        probe = [np.empty(1, dtype=np.uint8)]
        self._free_refs = sys.getrefcount(probe[0])  # refs of a pooled buffer nobody else holds

    def take(self, size: int) -> np.ndarray:
        """A writable uint8 array of ``size`` bytes that nothing else uses."""
        if size < POOL_MIN_BUFFER or size > self.max_bytes:
            return np.empty(size, dtype=np.uint8)
        with self._lock:
            if self._pid != os.getpid():  # forked: the parent's arrays may still live here
                self._bufs, self._pid = [], os.getpid()
            free = [i for i in range(len(self._bufs)) if sys.getrefcount(self._bufs[i]) <= self._free_refs]
            fits = [i for i in free if size <= self._bufs[i].nbytes <= 2 * size]
            if fits:
                best = min(fits, key=lambda i: self._bufs[i].nbytes)
                return self._bufs[best][:size]
            buf = np.empty(size, dtype=np.uint8)  # numpy asks for huge pages on big buffers
            held = sum(b.nbytes for b in self._bufs)
            for i in sorted(free, key=lambda i: self._bufs[i].nbytes, reverse=True):
                if held + size <= self.max_bytes:
                    break
                held -= self._bufs[i].nbytes
                self._bufs[i] = None  # type: ignore[call-overload]
            self._bufs = [b for b in self._bufs if b is not None]
            if held + size <= self.max_bytes:
                self._bufs.append(buf)
                return buf[:size]
            return buf

    def held_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._bufs)


_pool = ReceivePool(int(os.environ.get(POOL_ENV) or DEFAULT_POOL_BYTES))


def fetch(service: str, name: str, size: int) -> np.ndarray:
    """The first ``size`` bytes of segment ``name`` from ``service``: a read-only
    uint8 array of its own, received straight into it (no extra copy); its
    memory may be reused by a later fetch once nothing refers to it.

    Raises:
        ConnectorError: the segment is gone (released, reaped) or smaller than ``size``.
        DataServiceError: the service is unreachable or broke the protocol.
    """
    buf = _pool.take(size)
    status, body = _request(service, {"op": "get", "name": name, "size": size}, into=buf)
    if status != OK:
        raise _error(status, body, service)
    buf.flags.writeable = False
    return buf


def release(service: str, names: list[str], *, recycle: bool = False) -> int:
    """Unlink segments ``names`` on ``service``'s node, or with ``recycle`` keep them
    there for later puts (within that node's budget; see
    :func:`omni_actors.connectors.shm.release_segments`: only segments nobody
    reads any more); how many were still there. (A service that predates
    ``recycle`` unlinks them.)

    Raises:
        ConnectorError: a name is not one of that service's segments.
        DataServiceError: the service is unreachable.
    """
    removed = 0
    for i in range(0, len(names), RELEASE_BATCH):
        req: dict[str, Any] = {"op": "release", "names": names[i:i + RELEASE_BATCH]}
        if recycle:
            req["recycle"] = True
        status, body = _request(service, req, quick=True)
        if status != OK:
            raise _error(status, body, service)
        removed += json.loads(body)["released"]
    return removed


def answers(service: str, timeout_s: float) -> bool:
    """Whether ``service`` answers a ``stats`` request within ``timeout_s`` seconds, on a
    connection of its own (a health probe: the pooled connections and the down marks of
    :func:`_request` are left alone). A frozen service accepts the connection (its listen
    backlog) and answers nothing: False."""
    try:
        host, port = parse_address(service)
        payload = json.dumps({"op": "stats"}).encode()
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.settimeout(timeout_s)
            sock.sendall(REQUEST_HEADER.pack(len(payload)) + payload)
            return _recv_exact(sock, REPLY_HEADER.size) is not None
    except (OSError, ValueError, ConnectionError):
        return False


def stats(service: str) -> dict[str, Any]:
    """The service's ``stats``: segments and bytes in use, free_segments and free_bytes
    (recycled, unclaimed), gets, bytes_served, releases, recycled, reaped, trimmed, ..."""
    status, body = _request(service, {"op": "stats"})
    if status != OK:
        raise _error(status, body, service)
    return json.loads(body)


def configure(service: str, *, reap_after_s: float | None = None) -> dict[str, Any]:
    """Change the service's settings; returns them."""
    req: dict[str, Any] = {"op": "config"}
    if reap_after_s is not None:
        req["reap_after_s"] = reap_after_s
    status, body = _request(service, req)
    if status != OK:
        raise _error(status, body, service)
    return json.loads(body)


def close_connections() -> None:
    """Close this thread's connections to every data service."""
    for service in list(_conns.by_service):
        _drop(service)
