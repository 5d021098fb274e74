"""Connectors: stage outputs travel between actors by reference.

Use :func:`make_connector`: small outputs ride inline in the ref, larger ones
go into a shared-memory segment on the producer's node (a slot the producer
writes again and again, :mod:`omni_actors.connectors.slots`, or beyond the
slots' budget a segment of its own). A consumer on that
node maps the segment (zero copy); a consumer on another node fetches it from
the node's data service (:mod:`omni_actors.connectors.data_service`). Whoever
owns a request releases its refs (:func:`release_all`) however the request ends:
segments are unlinked, or, with ``recycle=True`` where the owner knows nobody
reads them any more (a request that completed), kept for a later ``put`` on
their node (:mod:`omni_actors.connectors.recycling`).

Every ``get`` returns read-only arrays (views on the buffer the data arrived
in); copy before modifying.

Environment (set by the host's leader/member for every actor it starts):

- ``OMNI_ACTORS_NODE``: this node's name; unset: a single-host system
  (refs carry no node, every reader maps the segment).
- ``OMNI_ACTORS_DATA_SERVICE``: ``host:port`` of this node's data service.
- ``OMNI_ACTORS_SHM_PREFIX``: prefix of this node's segment names.
- ``OMNI_ACTORS_SHM_DIR``: the directory (a tmpfs) segments live in; default
  ``/dev/shm``. Read whenever a segment is made, opened, listed or unlinked.
- ``OMNI_ACTORS_SHM_FREE_IDLE_S`` / ``OMNI_ACTORS_SHM_FREE_BYTES``: how long a
  recycled segment may wait for a ``put`` (default 2 s) and how many bytes of
  them a node keeps per prefix (default half its tmpfs, at most 1 GiB);
  ``OMNI_ACTORS_SHM_MAP_CACHE_BYTES`` / ``OMNI_ACTORS_SHM_READ_CACHE_BYTES``:
  how many bytes of segments a producer keeps mapped to write them again, and
  a consumer to read them again (default 1 GiB each; 0: off; see
  :mod:`omni_actors.connectors.mappings`).
- ``OMNI_ACTORS_SHM_SLOT_BYTES``: how many bytes of slots (segment files a
  producer writes again in place, :mod:`omni_actors.connectors.slots`) a
  process keeps (default: the free budget; 0: a segment of its own per put).
- ``OMNI_ACTORS_DATA_TCP_CONGESTION``: the TCP congestion control the node's
  data service sends with (default: the host's).
- ``OMNI_ACTORS_CONNECTOR``: default mode, see :data:`MODES` (or an
  ``omni:<Name>`` mode: :mod:`omni_actors.connectors.omni`).
"""

from __future__ import annotations

import collections
import os
from typing import Any, Iterable

import numpy as np
import structlog

from omni_actors.connectors import data_client, omni
from omni_actors.connectors.base import Connector, ConnectorRef, FieldLayout, OmniHandle
from omni_actors.connectors.data_client import DataServiceError
from omni_actors.connectors.data_service import NODE_ENV, SERVICE_ENV, DataService
from omni_actors.connectors.inline import ConnectorError, InlineConnector, plan, read_outputs
from omni_actors.connectors.recycling import list_free_segments, size_class, trim_free_segments
from omni_actors.connectors.release_retry import release_retries, unreleased
from omni_actors.connectors.shm import DIR_ENV, SegmentDirError, ShmConnector, buffer_counts, \
    check_segment_dir, default_prefix, free_usage, list_segments, read_segment, release_segments, segment_dir, segment_usage, sweep_segments

__all__ = [
    "Connector", "ConnectorError", "ConnectorRef", "DIR_ENV", "buffer_counts", "DataService", "DataServiceError", "FieldLayout",
    "InlineConnector", "MODES", "NodeConnector", "OmniHandle", "SegmentDirError", "ShmConnector",
    "check_segment_dir", "default_prefix", "free_usage", "list_free_segments", "list_segments", "local_node",
    "make_connector", "release_all", "release_segments", "segment_dir", "segment_usage", "size_class",
    "sweep_segments", "trim_free_segments", "unreleased",
]

log = structlog.get_logger(__name__)

DEFAULT_INLINE_THRESHOLD = 65536  # bytes; a 64 KiB message costs little next to a shm round trip
MODE_ENV = "OMNI_ACTORS_CONNECTOR"

#: How ``put`` stores outputs (any connector reads every kind of ref):
#: ``auto``: inline up to the threshold, else a segment, read in place on its
#: node and fetched from the node's data service elsewhere; ``inline``: always
#: inline, whatever the size; ``shm``: always a segment (outputs with array
#: bytes); ``tcp``: as ``auto``, but every reader of a segment fetches it
#: through the data service, even on its own node. A mode ``omni:...``
#: (:func:`omni_actors.connectors.omni.encode_mode`) is ``auto`` with vLLM-Omni's
#: connector in place of the segment, where ``vllm_omni`` is importable (else
#: plain ``auto``, logged).
MODES = ("auto", "inline", "shm", "tcp")

SEGMENT_KINDS = ("shm", "tcp")


def local_node() -> str | None:
    """This process's node name (``$OMNI_ACTORS_NODE``), or None on a single-host system."""
    return os.environ.get(NODE_ENV) or None


class NodeConnector:
    """The connector of one process on one node (see :data:`MODES`).

    ``get``/``release`` dispatch on the ref (its ``kind``, and for segments
    whether its ``node`` is this one), so any process can read or release any
    ref of the system. ``node``/``service`` default to the environment.
    """

    adapter: omni.OmniAdapter | None = None  #: where outputs over the threshold go in an ``omni:`` mode

    def __init__(self, inline_threshold_bytes: int = DEFAULT_INLINE_THRESHOLD,
                 prefix: str | None = None, *, mode: str | None = None,
                 node: str | None = None, service: str | None = None) -> None:
        if inline_threshold_bytes < 0:
            raise ValueError(f"inline_threshold_bytes must be >= 0, got {inline_threshold_bytes}")
        mode = mode or os.environ.get(MODE_ENV) or "auto"
        self.omni_mode = omni.parse_mode(mode)  # raises ValueError if it does not parse
        if self.omni_mode is None and mode not in MODES:
            raise ValueError(f"connector mode must be one of {', '.join(MODES)} or omni:<Name>; got {mode!r}")
        self.mode = "auto" if self.omni_mode else mode
        self.inline_threshold_bytes = inline_threshold_bytes
        self.node = node if node is not None else local_node()
        self.service = service if service is not None else (os.environ.get(SERVICE_ENV) or None)
        self.inline = InlineConnector()
        self.shm = ShmConnector(prefix, node=self.node, service=self.service,
                                kind="tcp" if mode == "tcp" else "shm")
        spec = self.omni_mode
        if spec is not None and (spec.name or spec.inputs):
            if not omni.available():
                log.warning("omni_connector_not_applied", connector=spec.name,
                            reason="vllm_omni is not installed in this process: outputs go through "
                                   "omni-actors' connectors")
                self.omni_mode = None
            elif spec.name:
                self.adapter = omni.OmniAdapter(spec.name, spec.extra, stage=spec.stage,
                                             prefix=self.shm.prefix, node=self.node)

    def prepare(self) -> None:
        """Build the vLLM-Omni connectors of an ``omni:`` mode now (its own and
        those of its inputs; seconds: it imports vLLM-Omni), so no task waits
        for that. A no-op in other modes; where the import fails it falls back
        to ``auto`` and logs. Raises ValueError: vLLM-Omni could not build a
        connector (its message says why)."""
        spec = self.omni_mode
        if spec is None:
            return
        try:
            for name, extra in spec.inputs:
                omni.connector(name, extra)
            if self.adapter is not None:
                self.adapter.open()
        except omni.OmniUnavailable as exc:
            log.warning("omni_connector_not_applied", connector=spec.name, reason=str(exc))
            self.omni_mode = self.adapter = None

    def put(self, outputs: dict[str, Any], *, final: bool = False) -> ConnectorRef:
        """Raises TypeError (unpackable dtype) or OSError (shm full, the
        vLLM-Omni connector refused). ``final``: the outputs go to the API
        server, not to another stage: never through a vLLM-Omni connector."""
        layout, size, arrays = plan(outputs)
        if self.mode == "inline" or (self.mode != "shm" and size <= self.inline_threshold_bytes):
            return self.inline.put_planned(layout, size, arrays)
        if self.adapter is not None and not final:
            return self.adapter.put_planned(layout, size, arrays)
        return self.shm.put_planned(layout, size, arrays)

    def get(self, ref: ConnectorRef) -> dict[str, Any]:
        """The outputs, as read-only arrays (and small values).

        Raises:
            ConnectorError: the data is gone (released, reaped) or the kind is unknown.
            DataServiceError: the data lives on another node whose data service
                cannot be reached.
            OmniConnectorError: a vLLM-Omni connector's ref could not be read
                (see :func:`omni_actors.connectors.omni.get`).
        """
        if ref.kind == "shm" and ref.size and ref.location and (ref.node is None or ref.node == self.node):
            return read_outputs(read_segment(ref.location, ref.size), ref.layout)  # (the common case)
        if ref.kind == "inline":
            return self.inline.get(ref)
        if ref.kind == omni.KIND:
            return omni.get(ref)
        if ref.kind not in SEGMENT_KINDS:
            raise ConnectorError(f"unknown connector kind {ref.kind!r}")
        if not self._remote(ref, for_read=True):
            return self.shm.get(ref)
        if ref.size == 0:
            return read_outputs(b"", ref.layout)
        return read_outputs(data_client.fetch(ref.service, ref.location, ref.size), ref.layout)

    def release(self, ref: ConnectorRef, *, recycle: bool = False) -> None:
        """Unlink the ref's segment (through its node's data service when it is
        elsewhere), or with ``recycle`` keep it for a later ``put`` on its node:
        only when no process still reads it (see :func:`release_all`).
        Idempotent; a no-op for inline refs. When the owning node's data
        service cannot be reached it logs and returns: that node's reaper frees
        the segment later.

        Raises:
            ConnectorError: the kind is unknown, or a remote segment has no service.
        """
        if ref.kind == "inline":
            return
        if ref.kind == omni.KIND:
            omni.release(ref)
            return
        if ref.kind not in SEGMENT_KINDS or not ref.location:
            raise ConnectorError(f"unknown connector kind {ref.kind!r}")
        if not self._remote(ref, for_read=False):
            release_segments([ref.location], recycle=recycle)
            return
        try:
            data_client.release(ref.service, [ref.location], recycle=recycle)
        except DataServiceError as exc:
            log.warning("connector_release_failed", location=ref.location, error=str(exc), retried=True)
            release_retries.add(ref.service, [ref.location])

    def take(self, ref: ConnectorRef) -> dict[str, Any]:
        """``get`` for the ref's one and last reader, which then releases it: the
        arrays are the caller's own (copied where ``get`` would map a segment in
        place; data fetched from another node or inline already is), so the
        segment is recycled (``release(ref, recycle=True)``). Whatever fails, the
        ref is released (unlinked) before the error is raised.

        Raises:
            as :meth:`get`.
        """
        try:
            out = self.get(ref)
            if ref.kind in SEGMENT_KINDS and ref.size and not self._remote(ref, for_read=True):
                out = {k: np.array(v) if isinstance(v, np.ndarray) else v for k, v in out.items()}
        except BaseException:
            self.release(ref)
            raise
        self.release(ref, recycle=True)  # (the mapping's views are gone: out holds copies)
        return out

    def reads_remotely(self, ref: ConnectorRef) -> bool:
        """Whether :meth:`get` of ``ref`` asks another node's data service, or a vLLM-Omni
        connector (Mooncake's store: a review), over the network (a round trip that may wait
        seconds on a host cut off), rather than reading here."""
        if ref.kind == omni.KIND:
            return True
        try:
            return ref.kind in SEGMENT_KINDS and bool(ref.size) and self._remote(ref, for_read=True)
        except ConnectorError:
            return False  # (get raises it at once)

    def _remote(self, ref: ConnectorRef, *, for_read: bool) -> bool:
        """Whether ``ref`` must go through its node's data service from here."""
        here = ref.node is None or ref.node == self.node
        if here and not (for_read and ref.kind == "tcp"):
            return False
        if not ref.service:
            if here:
                return False  # a tcp ref without a service: read it in place
            raise ConnectorError(f"segment {ref.location!r} lives on node {ref.node!r}, "
                                 f"which has no data service (this is node {self.node!r})")
        return True



def make_connector(inline_threshold_bytes: int = DEFAULT_INLINE_THRESHOLD,
                   prefix: str | None = None, *, mode: str | None = None) -> Connector:
    """The connector engines, RequestActors and API servers use: see :class:`NodeConnector`.

    ``prefix`` names new shm segments; default ``$OMNI_ACTORS_SHM_PREFIX``,
    else ``"omni-actors-"``. ``mode`` defaults to ``$OMNI_ACTORS_CONNECTOR``,
    else ``"auto"`` (see :data:`MODES`; ``omni:...``: see :meth:`NodeConnector.prepare`).
    """
    return NodeConnector(inline_threshold_bytes, prefix, mode=mode)


def release_all(refs: Iterable[ConnectorRef | None], *, recycle: bool = False, wait: bool = True) -> None:
    """Release every ref (None entries skipped): segments on this node are unlinked
    here, the others with one request per owning data service; a vLLM-Omni
    connector's refs through that connector (:func:`omni_actors.connectors.omni.release`).
    Logs failures, never raises.

    ``recycle``: keep the segments for later ``put`` s on their nodes instead
    (:func:`omni_actors.connectors.shm.release_segments`; within each node's
    budget, the rest unlinked). Only where the caller knows that no process
    still reads them, through a mapping made before: the request completed and
    every task that got them as input finished. Where an engine may still be
    reading (a cancel, an error, a timeout, a retry, a stale message), leave
    it off: an unlinked segment stays valid for its mappings.

    ``wait=False``: the releases for other hosts are sent from a thread of this process's
    (:meth:`~omni_actors.connectors.release_retry.ReleaseRetries.send`), not waited for: a
    host whose data service does not answer holds each up to 2 s (``RELEASE_IO_TIMEOUT_S``)."""
    here = local_node()
    local: list[str] = []
    remote: dict[str, list[str]] = collections.defaultdict(list)
    for ref in refs:
        if ref is None or ref.kind == "inline":
            continue
        if ref.kind == omni.KIND:
            omni.release(ref)  # never raises
            continue
        try:
            if ref.kind not in SEGMENT_KINDS or not ref.location:
                raise ConnectorError(f"unknown connector kind {ref.kind!r}")
            if ref.node is None or ref.node == here or not ref.service:
                if ref.node not in (None, here):
                    raise ConnectorError(f"segment {ref.location!r} lives on node {ref.node!r}, "
                                         "which has no data service")
                local.append(ref.location)
            else:
                remote[ref.service].append(ref.location)
        except Exception:  # noqa: BLE001
            log.warning("connector_release_failed", location=ref.location, exc_info=True)
    if local:
        try:
            release_segments(list(dict.fromkeys(local)), recycle=recycle)
        except Exception:  # noqa: BLE001
            log.warning("connector_release_failed", segments=len(local), exc_info=True)
    for service, names in remote.items():
        if not wait:
            release_retries.send(service, list(dict.fromkeys(names)), recycle=recycle)
            continue
        try:
            data_client.release(service, list(dict.fromkeys(names)), recycle=recycle)
        except DataServiceError as exc:
            log.warning("connector_release_failed", service=service, segments=len(names), error=str(exc),
                        retried=True)
            release_retries.add(service, names)
        except Exception:  # noqa: BLE001
            log.warning("connector_release_failed", service=service, segments=len(names), exc_info=True)
