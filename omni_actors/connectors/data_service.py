"""The per-node data service: serves this node's shared-memory segments to other nodes.

One runs on every host of a system (started by the leader and by each member
before their Thespian admin, see ``omni_actors.system``), bound to the
interface the host uses to reach the others. It serves the segments of its
prefix (``$OMNI_ACTORS_SHM_PREFIX``, in ``$OMNI_ACTORS_SHM_DIR``, default
``/dev/shm``) over plain TCP:

- ``get``: the raw bytes of a segment (a slot's while its generation is in
  use), sent from the mapping the service keeps of a slot written more than
  once (up to :data:`KEPT_SEND_MAX` bytes), else read from its file into a
  buffer of the connection's thread at most :data:`SEND_CHUNK` bytes at a
  time and sent from there (the reply's header held back with ``MSG_MORE``
  to leave with the first bytes), nothing pickled;
- ``release``: unlink segments (the request owner, on another node, is done),
  or with ``"recycle": true`` keep them as free segments of this node for
  later puts (:func:`omni_actors.connectors.shm.release_segments`);
- ``stats``: in-use segments and bytes under the prefix, free (recycled,
  unclaimed) ones apart, and counters;
- ``config``: change ``reap_after_s`` (a member learns it from the coordinator).

A reaper thread unlinks segments of the prefix older than ``reap_after_s``
(by their files' mtime; slots in use that long, by their headers, see
:mod:`omni_actors.connectors.slots`): what a dead replica or a crashed
request left, and the free slots of producers that exited; and
every ``free_idle_s / 4`` it trims the prefix's free segments: those idle
longer than ``free_idle_s`` go, then the oldest until they fit
``free_budget_bytes`` (:func:`omni_actors.connectors.recycling.trim_free_segments`).

The wire protocol (length-prefixed JSON requests, replies of ``u8 status`` +
``u64 length`` + bytes) and the client side (:func:`fetch`, :func:`release`,
:func:`stats`, :func:`configure`, re-exported here) are in
:mod:`omni_actors.connectors.data_client`. A connection serves requests until
the client closes it. No request is unpickled or executed: the worst a client
can do is read or unlink segments of the prefix (the cluster network is the
trust boundary, as for the actor transport). It sends with the host's TCP
congestion control unless ``$OMNI_ACTORS_DATA_TCP_CONGESTION`` names another:
with ``bbr`` (which paces), a 1 MB get over loopback was seen to take 0.22 ms
or 0.41 ms by turns, for minutes at a time; with ``cubic``, 0.22 ms.

Run one by hand (or from a benchmark): ``python -m omni_actors.connectors.data_service
--host 127.0.0.1 --port 0 --prefix oa-test-`` prints ``READY host:port``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import socketserver
import sys
import threading
import time
import weakref
from typing import Any

import numpy as np
import structlog

from omni_actors.connectors.data_client import (  # noqa: F401 - the client side, re-exported
    BAD_REQUEST, FAILED, MAX_REQUEST, NOT_FOUND, OK, POOL_ENV, RECV_CHUNK, RELEASE_BATCH, REPLY_HEADER,
    REQUEST_HEADER, DataServiceError, ReceivePool, _recv_exact, close_connections, configure, fetch,
    parse_address, release, stats)
from omni_actors.connectors import slots
from omni_actors.connectors.recycling import free_budget, free_idle_s, trim_free_segments
from omni_actors.connectors.shm import DIR_ENV, _unlink, check_name, check_segment_dir, default_prefix, \
    free_usage, list_segment_files, list_segments, open_payload, read_kept, release_segments, segment_dir, \
    segment_usage
from omni_actors.connectors.inline import ConnectorError
from omni_actors.connectors.mappings import SegmentNotFound

log = structlog.get_logger(__name__)

NODE_ENV = "OMNI_ACTORS_NODE"  #: this process's node name (set by the host's leader/member)
SERVICE_ENV = "OMNI_ACTORS_DATA_SERVICE"  #: ``host:port`` of this node's data service
HOST_ENV = "OMNI_ACTORS_DATA_HOST"  #: interface the host's data service binds (overrides the default)
PORT_ENV = "OMNI_ACTORS_DATA_PORT"  #: port the host's data service binds (default: any free one)
CONGESTION_ENV = "OMNI_ACTORS_DATA_TCP_CONGESTION"  #: its connections' TCP congestion control; unset: the host's
DEFAULT_REAP_AFTER_S = 900.0
#: The longest reap age a client may set (``config``): a week, past any request_timeout_s + 30.
MAX_REAP_AFTER_S = 7 * 86400.0
_WILDCARDS = ("", "0.0.0.0", "::")
_free_idle_default = free_idle_s  # (the constructor's argument shadows the name)


def local_address_towards(host: str, port: int) -> str:
    """The local IP this host uses to reach ``host`` (a UDP connect sends nothing);
    127.0.0.1 if there is no route."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port or 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def node_service_host(default: str) -> tuple[str, str | None]:
    """Where a host's data service binds, and the address it advertises if not that.

    ``$OMNI_ACTORS_DATA_HOST``, else ``$THESPIAN_BASE_IPADDR`` (the address the
    host's Thespian admin advertises), else ``default`` (the leader's HTTP
    interface, or a member's own address towards its leader). A wildcard binds
    every interface and advertises the address of the default route.
    """
    host = os.environ.get(HOST_ENV) or os.environ.get("THESPIAN_BASE_IPADDR") or default
    if host in _WILDCARDS:
        return host or "0.0.0.0", local_address_towards("8.8.8.8", 80)
    return host, None


def start_node_service(node: str, default_host: str, *, reap_after_s: float,
                       prefix: str | None = None) -> DataService:
    """Start this host's data service (see :func:`node_service_host`; on port
    ``$OMNI_ACTORS_DATA_PORT``, default any free one, for a firewall) and export
    ``OMNI_ACTORS_NODE`` and ``OMNI_ACTORS_DATA_SERVICE``, so that every process
    started from here on (the Thespian admin and its actors) stamps its refs.

    Raises:
        OSError: the address cannot be bound.
    """
    host, advertise = node_service_host(default_host)
    text = os.environ.get(PORT_ENV, "").strip()
    if text and not (text.isdigit() and 0 < int(text) < 65536):
        raise OSError(f"{PORT_ENV} must be a port number from 1 to 65535, got {text!r}")
    service = DataService(host, int(text or 0), prefix, reap_after_s=reap_after_s, node=node, advertise=advertise)
    service.start()
    os.environ[NODE_ENV] = node
    os.environ[SERVICE_ENV] = service.address
    return service


# -- server -------------------------------------------------------------------------------------

#: Seconds a connection may sit idle between requests before the service closes it (a
#: client's pooled connection that it closes is opened again at its next request).
IDLE_TIMEOUT_S = 300.0
#: Seconds a request may take to arrive in full once its first byte has (trial CP: 200
#: clients that each sent a 1 MiB request but its last byte held 200 MB and 200 threads
#: in the leader's process for as long as they liked).
REQUEST_READ_TIMEOUT_S = 10.0
#: Most connections served at once; more are answered FAILED and closed (each one is a
#: thread: trial CP's 1,000 idle connections were 1,000 threads). Every process of a host
#: (replicas, RequestActors, API servers) keeps one per thread that reads through it.
MAX_CONNECTIONS = 1024
#: Seconds a connection must have been idle to be closed for a new one when MAX_CONNECTIONS are
#: served (the longest idle goes: one client's idle connections shut no other out for good).
EVICT_IDLE_S = 1.0
#: Bytes of a request received per ``recv``: what a request holds is what its client sent.
_REQUEST_CHUNK = 64 << 10


def _recv_request(sock: socket.socket, n: int, deadline: float) -> bytes | None:
    """``n`` bytes of a request by ``deadline`` (monotonic); None on a clean EOF before the
    first byte. Memory grows with what arrives, not with the length declared.

    Raises:
        TimeoutError: not all of it by then. ConnectionError: closed part way.
    """
    parts, got = [], 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"request not in within {REQUEST_READ_TIMEOUT_S:g} s")
        sock.settimeout(left)
        part = sock.recv(min(n - got, _REQUEST_CHUNK))
        if not part:
            if got == 0:
                return None
            raise ConnectionError(f"peer closed after {got} of {n} bytes")
        parts.append(part)
        got += len(part)
    return b"".join(parts)


class _Handler(socketserver.BaseRequestHandler):
    server: "_Server"

    def handle(self) -> None:
        sock = self.request
        service = self.server.service
        if not service._admit(sock):
            try:  # (its first request read first: closed unread, the answer could be lost to a reset)
                sock.settimeout(1.0)
                sock.recv(_REQUEST_CHUNK)
            except OSError:
                pass
            try:
                _reply(sock, FAILED, f"too many connections ({MAX_CONNECTIONS}) to this data service".encode())
            except OSError:
                pass
            return
        try:
            self._serve(sock, service)
        finally:
            service._track(sock, False)

    def _serve(self, sock: socket.socket, service: "DataService") -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _watch_peer(sock)
        if service.tcp_congestion:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, service.tcp_congestion.encode())
            except (OSError, AttributeError) as exc:  # (not allowed for this user, or no such algorithm)
                log.warning("data_service_tcp_congestion_refused", algorithm=service.tcp_congestion,
                            error=str(exc))
                service.tcp_congestion = None
        try:
            while not service._stopping.is_set():
                sock.settimeout(IDLE_TIMEOUT_S)
                service._set_idle(sock, True)
                try:
                    first = sock.recv(1)  # (the next request's first byte: idle until then)
                except TimeoutError:
                    return  # idle: closed (a client opens it again at its next request)
                finally:
                    service._set_idle(sock, False)
                if not first:
                    return
                deadline = time.monotonic() + REQUEST_READ_TIMEOUT_S
                head = first + (_recv_request(sock, REQUEST_HEADER.size - 1, deadline) or b"")
                if len(head) < REQUEST_HEADER.size:
                    return
                (length,) = REQUEST_HEADER.unpack(head)
                if length > MAX_REQUEST:
                    _reply(sock, BAD_REQUEST, f"request of {length} bytes is over the limit "
                                              f"of {MAX_REQUEST}".encode())
                    return  # the stream cannot be resynchronised: close it
                body = _recv_request(sock, length, deadline) if length else b""
                if body is None:
                    return
                sock.settimeout(None)  # (a reply's send is bounded by TCP_USER_TIMEOUT, not by this)
                service._serve_one(sock, body)
        except (OSError, ConnectionError):
            pass  # the client went away mid-request, or was too slow to send it; nothing to answer
        except Exception:  # noqa: BLE001 - a bad client never kills the server
            log.warning("data_service_handler_error", exc_info=True)


#: A client's host gone without a reset (power, a partition) is noticed on an idle connection
#: after KEEPALIVE_IDLE_S + KEEPALIVE_PROBES x KEEPALIVE_INTERVAL_S (TCP keepalive), and mid-send
#: after UNACKED_LIMIT_S of data unacknowledged (``TCP_USER_TIMEOUT``): its handler thread,
#: socket and send buffer are freed. Without them each connection from a vanished
#: host was kept for good (idle) or about 15 minutes (mid-send, TCP's own retries; a code review).
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 60, 10, 3
UNACKED_LIMIT_S = 30


def _watch_peer(sock: socket.socket) -> None:
    """Keepalive and a limit on unacknowledged data for an accepted connection, where the
    platform has them (Linux does)."""
    options = [(socket.SOL_SOCKET, getattr(socket, "SO_KEEPALIVE", None), 1),
               (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPIDLE", None), KEEPALIVE_IDLE_S),
               (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPINTVL", None), KEEPALIVE_INTERVAL_S),
               (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPCNT", None), KEEPALIVE_PROBES),
               (socket.IPPROTO_TCP, getattr(socket, "TCP_USER_TIMEOUT", None), UNACKED_LIMIT_S * 1000)]
    for level, option, value in options:
        if option is not None:
            try:
                sock.setsockopt(level, option, value)
            except OSError:
                pass


def _reply(sock: socket.socket, status: int, body: bytes) -> None:
    sock.sendall(REPLY_HEADER.pack(status, len(body)) + body)


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 128  # (the listen backlog: socketserver's 5 made every 6th quick connect wait 1 s)

    def __init__(self, address, service: "DataService", family: int) -> None:
        self.address_family = family
        self.service = service
        super().__init__(address, _Handler)


_LIVE: "weakref.WeakSet[DataService]" = weakref.WeakSet()


def _close_in_child() -> None:
    """After a fork: the child must not keep this process's sockets (a leaked
    listener would accept connections nobody serves; a leaked connection would
    keep a client waiting for an EOF). Close the child's copies only."""
    for service in list(_LIVE):
        service._forget_after_fork()


os.register_at_fork(after_in_child=_close_in_child)


class DataService:
    """A node's data service: a threaded TCP server plus a reaper thread.

    Args:
        host: interface to bind (``"127.0.0.1"``, an address, ``"0.0.0.0"``).
        port: port to bind; 0 picks a free one (see :attr:`address`).
        prefix: the segments it serves, releases and reaps; default
            ``$OMNI_ACTORS_SHM_PREFIX``.
        reap_after_s: segments older than this are unlinked by the reaper.
        reap_every_s: how often the reaper looks (default: ``reap_after_s / 4``,
            between 0.05 and 5 s).
        free_idle_s: free (recycled) segments unclaimed this long are unlinked
            (default :func:`~omni_actors.connectors.recycling.free_idle_s`: 2 s); the
            trim runs every ``free_idle_s / 4`` (0.05 s at least).
        free_budget_bytes: most bytes of free segments kept (default
            :func:`~omni_actors.connectors.recycling.free_budget`); it also bounds
            recycling releases that come through this service.
        node: this node's name (reported by ``stats``).
        advertise: the host clients should connect to (default ``host``; a
            wildcard ``host`` advertises 127.0.0.1 unless this is given).
        tcp_congestion: the TCP congestion control of the connections it sends on
            (default ``$OMNI_ACTORS_DATA_TCP_CONGESTION``, else the host's; one
            this process may not use is logged and left alone).

    ``start()`` binds and starts serving; ``stop()`` closes every connection.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, prefix: str | None = None, *,
                 reap_after_s: float = DEFAULT_REAP_AFTER_S, reap_every_s: float | None = None,
                 node: str | None = None, advertise: str | None = None, free_idle_s: float | None = None,
                 free_budget_bytes: int | None = None, tcp_congestion: str | None = None) -> None:
        self.host, self.port, self.advertise = host, port, advertise
        self.prefix = prefix or default_prefix()
        if check_name(self.prefix) is not None:
            raise ValueError(f"invalid prefix {self.prefix!r}")
        self.node = node
        self.reap_after_s = float(reap_after_s)
        self._reap_every_s = reap_every_s
        self.free_idle_s = float(free_idle_s if free_idle_s is not None else _free_idle_default())
        self.free_budget_bytes = int(free_budget_bytes if free_budget_bytes is not None else free_budget())
        self._server: _Server | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._counters = {"gets": 0, "bytes_served": 0, "releases": 0, "recycled": 0, "reaped": 0, "trimmed": 0,
                          "errors": 0, "refused_connections": 0, "evicted_connections": 0}
        self._idle_since: dict[socket.socket, float] = {}  # connections waiting for their next request
        self._refused_logged_at = float("-inf")
        self._pid = os.getpid()
        self.tcp_congestion = tcp_congestion if tcp_congestion is not None else os.environ.get(CONGESTION_ENV)

    # -- lifecycle --------------------------------------------------------------------------
    @property
    def address(self) -> str:
        """``"host:port"`` clients use: ``advertise`` or the bound host, and the bound port."""
        if self._server is None:
            raise RuntimeError("the data service is not started")
        host = self.advertise or (self.host if self.host not in _WILDCARDS else "127.0.0.1")
        port = self._server.server_address[1]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def start(self) -> "DataService":
        """Bind and serve.

        Raises:
            SegmentDirError: the segment directory is unusable.
            OSError: the address cannot be bound.
        """
        check_segment_dir()
        slots.check_unlinked_every(SLOT_MAPS_CHECK_S)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        self._server = _Server((self.host, self.port), self, family)
        serve = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                 name="data-service", daemon=True)
        reap = threading.Thread(target=self._reap_loop, name="data-service-reaper", daemon=True)
        self._threads = [serve, reap]
        for t in self._threads:
            t.start()
        _LIVE.add(self)
        log.info("data_service_started", address=self.address, prefix=self.prefix, dir=segment_dir(),
                 reap_after_s=self.reap_after_s, free_idle_s=self.free_idle_s,
                 free_budget_bytes=self.free_budget_bytes)
        return self

    def stop(self) -> None:
        """Stop serving and close every connection. Idempotent."""
        if self._server is None or self._stopping.is_set() or self._pid != os.getpid():
            return  # not started, stopped, or a forked child's copy (see _forget_after_fork)
        self._stopping.set()
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            conns = list(self._conns)
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=5)
        _LIVE.discard(self)

    def __enter__(self) -> "DataService":
        return self.start() if self._server is None else self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _forget_after_fork(self) -> None:
        # No locks or events here: another thread of the parent may have held them at the fork.
        self._pid = -1
        if self._server is not None:
            self._server.socket.close()
        for sock in list(self._conns):
            sock.close()
        self._conns.clear()

    def _track(self, sock: socket.socket, add: bool) -> None:
        with self._lock:
            (self._conns.add if add else self._conns.discard)(sock)

    def _set_idle(self, sock: socket.socket, idle: bool) -> None:
        """``sock`` waits for its next request (``idle``), or no longer."""
        with self._lock:
            if idle:
                self._idle_since[sock] = time.monotonic()
            else:
                self._idle_since.pop(sock, None)

    def _admit(self, sock: socket.socket) -> bool:
        """Count ``sock`` among the connections served. When :data:`MAX_CONNECTIONS` are, the
        one idle the longest (for :data:`EVICT_IDLE_S` at least) is closed for it (its client
        opens it again at its next request: trial CR's 1,024 idle connections of one client
        shut every other out for 5 minutes); with none idle so long, False (logged once per
        second at most)."""
        victim = None
        with self._lock:
            if len(self._conns) >= MAX_CONNECTIONS and self._idle_since:
                oldest = min(self._idle_since, key=self._idle_since.__getitem__)
                if time.monotonic() - self._idle_since[oldest] >= EVICT_IDLE_S:
                    victim = oldest
                    del self._idle_since[oldest]
                    self._counters["evicted_connections"] += 1
            if len(self._conns) < MAX_CONNECTIONS or victim is not None:
                self._conns.add(sock)
        if victim is not None:
            try:
                victim.shutdown(socket.SHUT_RDWR)  # (its handler's wait ends: it exits, untracked)
            except OSError:
                pass
            return True
        with self._lock:
            if sock in self._conns:
                return True
            self._counters["refused_connections"] += 1
            now = time.monotonic()
            quiet = now - self._refused_logged_at < 1.0
            if not quiet:
                self._refused_logged_at = now
        if not quiet:
            log.warning("data_service_connections_refused", limit=MAX_CONNECTIONS,
                        refused=self._counters["refused_connections"])
        return False

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for key, n in deltas.items():
                self._counters[key] += n

    # -- requests ---------------------------------------------------------------------------
    def _serve_one(self, sock: socket.socket, body: bytes) -> None:
        try:
            req = json.loads(body)
            if not isinstance(req, dict):
                raise ValueError("a request is a JSON object")
        except (ValueError, RecursionError) as exc:  # (RecursionError: nested too deep, trial CP)
            self._count(errors=1)
            _reply(sock, BAD_REQUEST, f"malformed request: {str(exc)[:200]}".encode())
            return
        op = req.get("op")
        handler = {"get": self._get, "release": self._release, "stats": self._stats,
                   "config": self._config}.get(op) if isinstance(op, str) else None
        if handler is None:
            self._count(errors=1)
            _reply(sock, BAD_REQUEST, f"unknown op {str(op)[:100]!r}; ops: get, release, stats, config".encode())
            return
        handler(sock, req)

    def _get(self, sock: socket.socket, req: dict) -> None:
        name, size = req.get("name"), req.get("size")
        problem = check_name(name, self.prefix)
        if problem is None and (not isinstance(size, int) or isinstance(size, bool) or size < 0):
            problem = f"size must be an int >= 0, got {size!r}"
        if problem is not None:
            self._count(errors=1)
            _reply(sock, BAD_REQUEST, problem.encode())
            return
        view = fd = None
        try:
            view = read_kept(name, size) if 0 < size <= KEPT_SEND_MAX else None
            if view is None:
                fd, offset = open_payload(name, size)
        except SegmentNotFound:
            self._count(errors=1)
            _reply(sock, NOT_FOUND, f"segment {name!r} not found on node {self.node or '?'}: "
                                    "already released, or reaped".encode())
            return
        except ConnectorError as exc:  # (smaller than the size asked)
            self._count(errors=1)
            _reply(sock, BAD_REQUEST, str(exc).encode())
            return
        except OSError as exc:
            self._count(errors=1)
            _reply(sock, FAILED, f"cannot read segment {name!r}: {exc}".encode())
            return
        try:
            self._count(gets=1, bytes_served=size)  # before the bytes: a client may ask stats next
            # The header leaves with the first bytes of the segment (MSG_MORE: no packet of its own,
            # one wakeup of the client less).
            sock.sendall(REPLY_HEADER.pack(OK, size), _MSG_MORE if size else 0)
            if view is not None:
                sock.sendall(view)  # (from the slot's kept mapping: see KEPT_SEND_MAX)
            else:
                _send_range(sock, fd, offset, size)
        finally:
            if view is not None:
                view.release()
            else:
                os.close(fd)

    def _release(self, sock: socket.socket, req: dict) -> None:
        names = req.get("names")
        if not isinstance(names, list):
            self._count(errors=1)
            _reply(sock, BAD_REQUEST, b"release needs a list of names")
            return
        bad = [p for p in (check_name(n, self.prefix) for n in names) if p is not None]
        recycle = req.get("recycle", False)
        if not bad and not isinstance(recycle, bool):
            bad = [f"recycle must be true or false, got {recycle!r}"]
        if bad:
            self._count(errors=1)
            _reply(sock, BAD_REQUEST, f"{len(bad)} bad name(s), nothing released: {bad[0]}".encode())
            return
        try:
            removed, recycled = release_segments(names, recycle=recycle, budget=self.free_budget_bytes)
        except Exception as exc:  # noqa: BLE001 - (not a missing segment: those count as missing)
            self._count(errors=1)
            if not isinstance(exc, OSError):  # (a bug of ours: the client still gets its answer)
                log.warning("data_service_release_failed", exc_info=True)
            _reply(sock, FAILED, f"release failed: {exc}".encode())
            return
        self._count(releases=removed, recycled=recycled)
        _reply(sock, OK, json.dumps({"released": removed, "missing": len(names) - removed,
                                     "recycled": recycled}).encode())

    def _stats(self, sock: socket.socket, req: dict) -> None:
        _reply(sock, OK, json.dumps(self.stats()).encode())

    def _config(self, sock: socket.socket, req: dict) -> None:
        value = req.get("reap_after_s")
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 < value <= MAX_REAP_AFTER_S:  # (trial CP's Infinity turned the reaper off)
                self._count(errors=1)
                _reply(sock, BAD_REQUEST, f"reap_after_s must be a number > 0 and <= {MAX_REAP_AFTER_S:g}, "
                                          f"got {str(value)[:40]}".encode())
                return
            self.reap_after_s = float(value)
            log.info("data_service_configured", reap_after_s=self.reap_after_s)
        _reply(sock, OK, json.dumps({"reap_after_s": self.reap_after_s}).encode())

    def stats(self) -> dict[str, Any]:
        """In-use segments of the prefix (count and bytes), free ones (recycled,
        unclaimed) apart, the settings and the counters."""
        segments, nbytes = segment_usage(self.prefix)
        free_segments, free_bytes = free_usage(self.prefix)
        with self._lock:
            counters = dict(self._counters)
        return {"node": self.node, "prefix": self.prefix, "dir": segment_dir(), "segments": segments,
                "bytes": nbytes, "free_segments": free_segments, "free_bytes": free_bytes,
                "reap_after_s": self.reap_after_s, "free_idle_s": self.free_idle_s,
                "free_budget_bytes": self.free_budget_bytes, **counters}

    # -- reaper -----------------------------------------------------------------------------
    def reap(self, now: float | None = None) -> int:
        """Unlink the segments of the prefix older than ``reap_after_s`` (slots: in use that long); how many."""
        now = time.time() if now is None else now
        removed = 0
        directory = segment_dir()
        names = list_segment_files(self.prefix, directory)
        for name in names:
            if slots.is_slot(name):
                continue  # (below, by their headers: writes through a mapping leave the mtime alone)
            try:
                age = now - os.stat(os.path.join(directory, name)).st_mtime
            except FileNotFoundError:
                continue
            if age > self.reap_after_s and _unlink(name):
                removed += 1
                log.warning("data_service_reaped", segment=name, age_s=round(age, 1))
        removed += len(self._slots(names, self.reap_after_s, now)[0])
        if removed:
            self._count(reaped=removed)
        return removed

    def _slots(self, names: list[str] | None = None, reap_after_s: float | None = None,
               now: float | None = None) -> tuple[list, int]:
        """:func:`omni_actors.connectors.slots.reap_slots` over the prefix's slots (among
        ``names``, default: the directory's listing); logs what it reaped."""
        directory = segment_dir()
        names = [n for n in (list_segment_files(self.prefix, directory) if names is None else names)
                 if slots.is_slot(n)]
        if not names:
            return [], 0
        reaped, trimmed = slots.reap_slots(names, directory, reap_after_s=reap_after_s, idle_s=self.free_idle_s,
                                           now=now)
        for name, age in reaped:
            log.warning("data_service_reaped", segment=name, age_s=round(age, 1))
        return reaped, trimmed

    def trim(self, now: float | None = None) -> int:
        """Unlink the prefix's free segments idle over ``free_idle_s``, then the
        oldest until they fit ``free_budget_bytes``, and the free slots of
        producers that exited; how many."""
        removed = trim_free_segments(self.prefix, idle_s=self.free_idle_s, budget=self.free_budget_bytes,
                                     now=now)
        removed += self._slots(now=now)[1]
        if removed:
            self._count(trimmed=removed)
            log.debug("data_service_trimmed", segments=removed)
        return removed

    def _reap_loop(self) -> None:
        next_reap = time.monotonic() + (self._reap_every_s or min(5.0, max(0.05, self.reap_after_s / 4)))
        while True:
            reap_every = self._reap_every_s or min(5.0, max(0.05, self.reap_after_s / 4))
            trim_every = max(0.05, self.free_idle_s / 4)
            if self._stopping.wait(min(reap_every, trim_every)):
                return
            try:
                self.trim()
                if time.monotonic() >= next_reap:
                    next_reap = time.monotonic() + reap_every
                    self.reap()
            except Exception:  # noqa: BLE001 - the reaper outlives any one bad pass
                log.warning("data_service_reap_failed", exc_info=True)


_MSG_MORE = getattr(socket, "MSG_MORE", 0)

#: A get of at most KEPT_SEND_MAX bytes of a slot the service keeps a mapping of (from the
#: slot's second generation on, as a producer writes its slots again and again:
#: :func:`omni_actors.connectors.slots.read_kept`) is sent from that mapping; any other get's
#: bytes are copied from the segment's file (``preadv``) into a buffer of the handler thread's,
#: at most SEND_CHUNK bytes at a time, and sent from it (a mapping made for one get pays a page
#: fault per page). Measured here, median per get: with the service and its client pinned to
#: different CPUs, as they always are across hosts (two runs), 1 MB 250 / 225 us from the kept
#: mapping against 404 / 376 us copied (a raw socket's 314 / 262 us); unpinned, two services side
#: by side with gets alternated, 1 MB 543 against 986 us, 4 MB 1.9 against 3.1 ms, but 16 MB
#: 8.8 against 7.8 ms and 64 MB 30.9 against 29.2 ms (an earlier session's A/B: 16 MB 15-17
#: against 12-15 ms), hence the bound.
KEPT_SEND_MAX = 4 << 20
#: How often the service drops its mappings of slots unlinked meanwhile: those it reads from and
#: the header pages it releases through, either of which keeps the whole file's pages (a producer
#: that finds its tmpfs full unlinks its free slots and waits up to GIVE_BACK_WAIT_S for them; an
#: fstat per kept mapping, at most 256 of each).
SLOT_MAPS_CHECK_S = 0.1
SEND_CHUNK = 4 << 20
#: Bytes of send buffer a connection's thread keeps between gets (a larger get's buffer, up to
#: SEND_CHUNK, is made for it and dropped after): kept at SEND_CHUNK, each client thread that
#: had fetched 4 MB held that much in the service for as long as its connection lived (a code review).
KEEP_SEND_BUFFER = 1 << 20
_send_buffers = threading.local()


def _send_range(sock: socket.socket, fd: int, offset: int, size: int) -> None:
    """Send ``size`` bytes of file ``fd`` from ``offset`` through this thread's send buffer.

    Raises:
        ConnectionError: the file ended first (the connection is then out of step: close it).
        OSError: reading or sending failed.
    """
    if not size:
        return
    want = min(size, SEND_CHUNK)
    buf = getattr(_send_buffers, "buf", None)
    if buf is None or buf.nbytes < want:
        buf = np.empty(want, dtype=np.uint8)
        if want <= KEEP_SEND_BUFFER:
            _send_buffers.buf = buf
    view = memoryview(buf)
    while size:
        n = os.preadv(fd, [view[:min(size, buf.nbytes)]], offset)
        if n <= 0:
            raise ConnectionError(f"segment ended {size} bytes early")
        sock.sendall(view[:n])
        offset += n
        size -= n


# -- command line -------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_actors.connectors.data_service",
                                     description="Serve this node's shared-memory segments over TCP.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--prefix", default=None, help="segment prefix (default $OMNI_ACTORS_SHM_PREFIX)")
    parser.add_argument("--reap-after-s", type=float, default=DEFAULT_REAP_AFTER_S)
    parser.add_argument("--free-idle-s", type=float, default=None,
                        help="unlink free (recycled) segments unclaimed this long (default "
                             "$OMNI_ACTORS_SHM_FREE_IDLE_S, else 2)")
    parser.add_argument("--free-budget-bytes", type=int, default=None,
                        help="most bytes of free segments kept (default $OMNI_ACTORS_SHM_FREE_BYTES, "
                             "else half the tmpfs, at most 1 GiB)")
    parser.add_argument("--node", default=None)
    parser.add_argument("--tcp-congestion", default=None,
                        help=f"TCP congestion control of its connections (default ${CONGESTION_ENV}, "
                             "else the host's)")
    parser.add_argument("--shm-dir", default=None,
                        help=f"directory of the segments (default ${DIR_ENV}, else /dev/shm)")
    args = parser.parse_args(argv)
    if args.shm_dir:
        os.environ[DIR_ENV] = args.shm_dir
    from omni_actors.logs import configure_logging

    configure_logging()  # JSON lines on stderr; stdout carries only the READY line
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    service = DataService(args.host, args.port, args.prefix, reap_after_s=args.reap_after_s,
                          node=args.node, free_idle_s=args.free_idle_s, tcp_congestion=args.tcp_congestion,
                          free_budget_bytes=args.free_budget_bytes).start()
    print(f"READY {service.address}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        service.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
