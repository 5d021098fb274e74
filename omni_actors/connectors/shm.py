"""The shared-memory connector: one POSIX segment per ``put`` (read in place on its node).

``put`` creates a segment of exactly the packed size and writes the array
bytes into it with ``pwrite`` (one copy, no page tables to build: on the VMs
measured here that was 2x faster than writing through a mapping). ``get``
maps the segment read-only and returns read-only numpy views on the mapping:
nothing is copied, and the mapping lives as long as any of those arrays (an
unlinked segment stays readable through a mapping made before the unlink).

Lifetimes are ours, not the interpreter's: segments are created and opened
with ``_posixshmem`` directly, never through ``multiprocessing``'s resource
tracker (which would unlink a segment when any process that merely read it
exits). The request owner releases (unlinks) each segment; the node's data
service reaps what a crashed producer or request left
(:mod:`omni_actors.connectors.data_service`), and :func:`sweep_segments`
clears a whole system's prefix at start and stop.
"""

from __future__ import annotations

import _posixshmem  # the C module behind SharedMemory: open/unlink without the tracker
import mmap
import os
import sys
import uuid
from typing import Any

import numpy as np

from omni_actors.connectors.base import ConnectorRef, FieldLayout
from omni_actors.connectors.inline import ConnectorError, InlineConnector, array_bytes, plan, \
    read_outputs

PREFIX_ENV = "OMNI_ACTORS_SHM_PREFIX"
DEFAULT_PREFIX = "omni-actors-"
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory; used to list, age and sweep
NAME_MAX = 255

# Python >= 3.13 can map without keeping a dup of the fd open per mapping.
_MMAP_KWARGS = {"trackfd": False} if sys.version_info >= (3, 13) else {}


def default_prefix() -> str:
    """Segment name prefix: ``$OMNI_ACTORS_SHM_PREFIX``, else ``"omni-actors-"``.

    The actor system sets the variable per host admin (``oa-<adminport>-``)
    so that its data service and sweeps touch only its own segments.
    """
    return os.environ.get(PREFIX_ENV) or DEFAULT_PREFIX


def check_name(name: str, prefix: str | None = None) -> str | None:
    """Why ``name`` is not a segment name (of ``prefix``, when given); None if it is."""
    if not isinstance(name, str) or not name:
        return "segment name must be a non-empty str"
    if "/" in name or "\0" in name or len(name) > NAME_MAX:
        return f"invalid segment name {name!r}"
    if prefix is not None and not name.startswith(prefix):
        return f"segment {name!r} is not under prefix {prefix!r}"
    return None


def _unlink(name: str) -> bool:
    """Unlink segment ``name``; False if it was already gone."""
    try:
        _posixshmem.shm_unlink("/" + name)
        return True
    except FileNotFoundError:
        return False


def create_segment(name: str, size: int, layout: tuple[FieldLayout, ...],
                   arrays: list[np.ndarray]) -> None:
    """Create segment ``name`` of ``size`` bytes holding ``arrays`` at their
    offsets (gaps read as zeros). Leaves nothing behind when it fails.

    Raises:
        FileExistsError: the name is taken. OSError: ``/dev/shm`` is full.
    """
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        # One writer: tmpfs serialises writes to a file (the inode lock), so threads gain nothing.
        for field, arr in zip([f for f in layout if f.kind == "array"], arrays):
            if field.nbytes:
                _pwrite_all(fd, memoryview(array_bytes(arr)), field.offset)
    except BaseException:
        os.close(fd)
        _unlink(name)
        raise
    os.close(fd)


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done, total = 0, data.nbytes
    while done < total:  # one call writes at most ~2 GiB
        n = os.pwrite(fd, data[done:], offset + done)
        if n <= 0:
            raise OSError(f"pwrite to shared memory wrote {n} bytes")
        done += n


def open_segment(name: str) -> tuple[int, int]:
    """Open segment ``name`` read-only: ``(fd, size in bytes)``; the caller closes ``fd``.

    Raises:
        FileNotFoundError: no such segment.
    """
    fd = _posixshmem.shm_open("/" + name, os.O_RDONLY, 0)
    try:
        return fd, os.fstat(fd).st_size
    except BaseException:
        os.close(fd)
        raise


def map_segment(name: str, size: int) -> mmap.mmap:
    """Map the first ``size`` (> 0) bytes of segment ``name`` read-only.

    Raises:
        ConnectorError: the segment is gone or smaller than ``size``.
    """
    try:
        fd, actual = open_segment(name)
    except FileNotFoundError:
        raise ConnectorError(f"shared-memory segment {name!r} not found: already released, "
                             "or reaped/swept") from None
    try:
        if actual < size:
            raise ConnectorError(f"shared-memory segment {name!r} has {actual} bytes, "
                                 f"the ref says {size}")
        return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, **_MMAP_KWARGS)
    finally:
        os.close(fd)


class ShmConnector:
    """Outputs live in a shared-memory segment named ``ref.location``.

    ``put`` stamps ``node``/``service`` into the ref (where the segment lives
    and which data service serves it to other nodes) and uses ``kind``
    (``"shm"``, or ``"tcp"`` to make every reader fetch it through the data
    service). The caller (the request owner) must ``release`` the ref, or the
    segment outlives every process until reaped or swept. Outputs with no
    array bytes need no segment and come back as inline refs.
    """

    def __init__(self, prefix: str | None = None, *, node: str | None = None,
                 service: str | None = None, kind: str = "shm") -> None:
        self.prefix = default_prefix() if prefix is None else prefix
        if not self.prefix or "/" in self.prefix:
            raise ValueError(f"shared-memory prefix must be non-empty, without '/': {prefix!r}")
        if kind not in ("shm", "tcp"):
            raise ValueError(f"kind must be 'shm' or 'tcp', got {kind!r}")
        self.node, self.service, self.kind = node, service, kind
        self._inline = InlineConnector()

    def put(self, outputs: dict[str, Any]) -> ConnectorRef:
        """Copy the outputs' arrays into a new segment.

        Raises:
            TypeError: an array's dtype cannot be packed (object, structured).
            OSError: the segment cannot be created (``/dev/shm`` full).
        """
        return self.put_planned(*plan(outputs))

    def put_planned(self, layout: tuple[FieldLayout, ...], size: int,
                    arrays: list[np.ndarray]) -> ConnectorRef:
        """``put`` for a result of :func:`plan` (saves planning twice)."""
        if size == 0:
            return self._inline.put_planned(layout, size, arrays)
        name = f"{self.prefix}{uuid.uuid4().hex[:16]}"
        create_segment(name, size, layout, arrays)
        return ConnectorRef(kind=self.kind, size=size, layout=layout, location=name,
                            node=self.node, service=self.service)

    def get(self, ref: ConnectorRef) -> dict[str, Any]:
        """Map the segment: read-only views on it, nothing copied.

        Raises:
            ConnectorError: the segment is gone (released or reaped) or too small.
        """
        if ref.kind == "inline":
            return self._inline.get(ref)
        if ref.kind not in ("shm", "tcp") or not ref.location:
            raise ConnectorError(f"not a shared-memory ref: kind={ref.kind!r}")
        if ref.size == 0:
            return read_outputs(b"", ref.layout)
        return read_outputs(map_segment(ref.location, ref.size), ref.layout)

    def release(self, ref: ConnectorRef) -> None:
        """Unlink the segment. Idempotent and silent if it is already gone.

        Arrays already read from it stay valid (their mapping keeps the pages).
        """
        if ref.kind in ("shm", "tcp") and ref.location:
            _unlink(ref.location)


def list_segments(prefix: str) -> list[str]:
    """Names of the segments under ``/dev/shm`` that start with ``prefix``, sorted."""
    if not prefix:
        raise ValueError("refusing an empty prefix: it would match every segment")
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def segment_usage(prefix: str) -> tuple[int, int]:
    """``(segments, bytes)`` under ``prefix`` right now."""
    count = total = 0
    for name in list_segments(prefix):
        try:
            total += os.stat(os.path.join(SHM_DIR, name)).st_size
            count += 1
        except FileNotFoundError:
            pass
    return count, total


def sweep_segments(prefix: str) -> int:
    """Unlink every segment whose name starts with ``prefix``; return how many.

    Raises:
        ValueError: ``prefix`` is empty.
    """
    return sum(_unlink(name) for name in list_segments(prefix))
