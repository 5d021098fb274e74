"""The shared-memory connector: one segment per ``put`` (read in place on its node).

A segment is a file in a tmpfs directory: ``$OMNI_ACTORS_SHM_DIR``, else
``/dev/shm`` (on Linux a POSIX ``shm_open`` segment is exactly such a file in
``/dev/shm``, so the default behaves as POSIX shared memory). The directory
is read from the environment whenever a segment is made, opened, listed or
unlinked; every process of one node must see the same one (the leader and
members export it to the actors they start, see ``start --shm-dir``). A tmpfs
mounted with ``huge=within_size`` (or ``always``) backs big segments with
huge pages, which makes writing them several times faster on hosts whose
``/dev/shm`` has none (``shmem_enabled`` ``never``).

``put`` creates a segment of exactly the packed size and writes the array
bytes into it with ``pwrite`` (one copy, no page tables to build: on the VMs
measured here that was 2x faster than writing through a mapping). ``get``
maps the segment read-only and returns read-only numpy views on the mapping:
nothing is copied, and the mapping lives as long as any of those arrays (an
unlinked segment stays readable through a mapping made before the unlink).

Lifetimes are ours, not the interpreter's: segments are plain files opened
with ``os.open``, never through ``multiprocessing``'s resource tracker (which
would unlink a segment when any process that merely read it exits). The
request owner releases (unlinks) each segment; the node's data service reaps
what a crashed producer or request left
(:mod:`omni_actors.connectors.data_service`), and :func:`sweep_segments`
clears a whole system's prefix at start and stop.
"""

from __future__ import annotations

import mmap
import os
import stat
import sys
import uuid
from typing import Any

import numpy as np

from omni_actors.connectors.base import ConnectorRef, FieldLayout
from omni_actors.connectors.inline import ConnectorError, InlineConnector, array_bytes, plan, \
    read_outputs

PREFIX_ENV = "OMNI_ACTORS_SHM_PREFIX"
DEFAULT_PREFIX = "omni-actors-"
DIR_ENV = "OMNI_ACTORS_SHM_DIR"  #: the directory segments live in (a tmpfs); default SHM_DIR
SHM_DIR = "/dev/shm"  #: the default directory: where Linux keeps POSIX shared memory
NAME_MAX = 255
#: O_NOFOLLOW as shm_open uses it: a segment name is never followed elsewhere.
_OPEN_FLAGS = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)

# Python >= 3.13 can map without keeping a dup of the fd open per mapping.
_MMAP_KWARGS = {"trackfd": False} if sys.version_info >= (3, 13) else {}


def default_prefix() -> str:
    """Segment name prefix: ``$OMNI_ACTORS_SHM_PREFIX``, else ``"omni-actors-"``.

    The actor system sets the variable per host admin (``oa-<adminport>-``)
    so that its data service and sweeps touch only its own segments.
    """
    return os.environ.get(PREFIX_ENV) or DEFAULT_PREFIX


class SegmentDirError(OSError):
    """The segment directory (``$OMNI_ACTORS_SHM_DIR``) is unusable; the message says why."""


def segment_dir() -> str:
    """The directory segments live in: ``$OMNI_ACTORS_SHM_DIR``, else ``/dev/shm``.

    Read from the environment on every call (not validated here: see
    :func:`check_segment_dir`)."""
    return os.environ.get(DIR_ENV) or SHM_DIR


def check_segment_dir(path: str | None = None) -> str:
    """``path`` (default :func:`segment_dir`) if segments can live there; returns it.

    Raises:
        SegmentDirError: it is not absolute, does not exist, is not a
            directory, or this process cannot create files in it.
    """
    path = segment_dir() if path is None else path
    where = f"segment directory {path!r} (${DIR_ENV} / --shm-dir)"
    if not path or not os.path.isabs(path):
        raise SegmentDirError(f"{where} must be an absolute path")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise SegmentDirError(f"{where} does not exist") from None
    except OSError as exc:
        raise SegmentDirError(f"{where} cannot be read: {exc.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SegmentDirError(f"{where} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise SegmentDirError(f"{where} is not writable by this process")
    probe = os.path.join(path, f".omni-actors-probe-{os.getpid()}")
    try:  # (access() says yes to root everywhere, /proc included: try it)
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, 4096)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        raise SegmentDirError(f"{where}: cannot create a file there: {exc.strerror or exc}") from None
    return path


def segment_path(name: str, directory: str | None = None) -> str:
    """The file of segment ``name`` (in ``directory``, default :func:`segment_dir`)."""
    return os.path.join(segment_dir() if directory is None else directory, name)


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
    return _unlink_in(segment_dir(), name)


def _unlink_in(directory: str, name: str) -> bool:
    try:
        os.unlink(os.path.join(directory, name))
        return True
    except FileNotFoundError:
        return False


def create_segment(name: str, size: int, layout: tuple[FieldLayout, ...],
                   arrays: list[np.ndarray]) -> None:
    """Create segment ``name`` of ``size`` bytes holding ``arrays`` at their
    offsets (gaps read as zeros). Leaves nothing behind when it fails.

    Raises:
        FileExistsError: the name is taken. SegmentDirError: the segment
        directory is unusable. OSError: the directory's tmpfs is full.
    """
    directory = segment_dir()
    try:
        fd = os.open(os.path.join(directory, name), os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        check_segment_dir(directory)  # raises the clear error when the directory is the problem
        raise
    try:
        os.ftruncate(fd, size)
        # One writer: tmpfs serialises writes to a file (the inode lock), so threads gain nothing.
        for field, arr in zip([f for f in layout if f.kind == "array"], arrays):
            if field.nbytes:
                _pwrite_all(fd, memoryview(array_bytes(arr)), field.offset)
    except BaseException:
        os.close(fd)
        _unlink_in(directory, name)
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
        FileNotFoundError: no such segment (in :func:`segment_dir`).
    """
    fd = os.open(segment_path(name), os.O_RDONLY | _OPEN_FLAGS)
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
        raise ConnectorError(f"shared-memory segment {name!r} not found in {segment_dir()}: already "
                             "released, or reaped/swept") from None
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
            SegmentDirError: the segment directory is unusable.
            OSError: the segment cannot be created (its tmpfs is full).
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


def list_segments(prefix: str, directory: str | None = None) -> list[str]:
    """Names of the segments in ``directory`` (default :func:`segment_dir`) that
    start with ``prefix``, sorted; none if the directory does not exist."""
    if not prefix:
        raise ValueError("refusing an empty prefix: it would match every segment")
    try:
        return sorted(n for n in os.listdir(segment_dir() if directory is None else directory)
                      if n.startswith(prefix))
    except FileNotFoundError:
        return []


def segment_usage(prefix: str, directory: str | None = None) -> tuple[int, int]:
    """``(segments, bytes)`` under ``prefix`` right now."""
    directory = segment_dir() if directory is None else directory
    count = total = 0
    for name in list_segments(prefix, directory):
        try:
            total += os.stat(os.path.join(directory, name)).st_size
            count += 1
        except FileNotFoundError:
            pass
    return count, total


def sweep_segments(prefix: str, directory: str | None = None) -> int:
    """Unlink every segment whose name starts with ``prefix`` (in ``directory``,
    default :func:`segment_dir`); return how many.

    Raises:
        ValueError: ``prefix`` is empty.
    """
    directory = segment_dir() if directory is None else directory
    return sum(_unlink_in(directory, name) for name in list_segments(prefix, directory))
