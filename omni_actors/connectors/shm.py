"""The shared-memory connector: segments read in place on their node.

A ``put`` writes into one of its process's slots
(:mod:`omni_actors.connectors.slots`: files it writes again and again, no
system call per put, get or release) while their budget allows; otherwise
into a segment of its own, as described here.

A segment is a file in a tmpfs directory: ``$OMNI_ACTORS_SHM_DIR``, else
``/dev/shm`` (on Linux a POSIX ``shm_open`` segment is exactly such a file in
``/dev/shm``, so the default behaves as POSIX shared memory). The directory
is read from the environment whenever a segment is made, opened, listed or
unlinked; every process of one node must see the same one (the leader and
members export it to the actors they start, see ``start --shm-dir``). A tmpfs
mounted with ``huge=within_size`` (or ``always``) backs big segments with
huge pages, which makes writing them several times faster on hosts whose
``/dev/shm`` has none (``shmem_enabled`` ``never``).

``put`` writes the array bytes into a new segment with ``pwrite`` (one copy,
no page tables to build: on the VMs measured here that was 2x faster than
writing through a new mapping), or into a recycled one through the mapping
its producer kept. ``get`` returns read-only numpy views on a read-only
mapping of the segment: nothing is copied, and the mapping lives as long as
any of those arrays (an unlinked segment stays readable through a mapping
made before the unlink). A process keeps its mappings of the segment files
it read (:mod:`omni_actors.connectors.mappings`): a ``get`` of a segment whose
file it mapped before, as a recycled segment's is, costs a ``stat`` of the
name and an ``fstat`` that checks the file is the same (at 1 MB: about 7 us
where opening and mapping it took 20).

Lifetimes are ours, not the interpreter's: segments are plain files opened
with ``os.open``, never through ``multiprocessing``'s resource tracker (which
would unlink a segment when any process that merely read it exits). The
request owner releases each segment; the node's data service reaps what a
crashed producer or request left
(:mod:`omni_actors.connectors.data_service`), and :func:`sweep_segments`
clears a whole system's prefix at start and stop.

A segment's file has the size class of its payload (the ref keeps the payload
size and readers map only that), so that a released segment whose owner knows
that nobody reads it any more can be *recycled*: kept for a later ``put`` on its
node instead of unlinked (opt-in and bounded, see
:mod:`omni_actors.connectors.recycling`).
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import time
from typing import Any, Iterable

import numpy as np

from omni_actors.connectors import slots
from omni_actors.connectors.base import DIR_ENV, PACKED_KINDS, SHM_DIR, ConnectorRef, FieldLayout, _unlink_in, pwrite_all, \
    segment_dir  # noqa: F401
from omni_actors.connectors.inline import ConnectorError, InlineConnector, array_bytes, plan, \
    read_outputs
from omni_actors.connectors.mappings import _OPEN_FLAGS, _maps, _not_found, _reads, _too_small, \
    drop_unlinked_mappings
from omni_actors.connectors.mappings import MAP_CHECK_S, drop_mappings  # noqa: F401 - re-exported for tests
from omni_actors.connectors.recycling import FREE_SUFFIX, _claim, _free_usage_in, _recycle, free_budget, \
    purge_free_segments, size_class
from omni_actors.connectors.recycling import (  # noqa: F401 - re-exported for tests, benchmarks
    FREE_BYTES_ENV, _free_ino, free_dir)

PREFIX_ENV = "OMNI_ACTORS_SHM_PREFIX"
DEFAULT_PREFIX = "omni-actors-"
NAME_MAX = 255
#: How long a put that found the tmpfs full, and gave back its free slots, waits for their pages
#: (the node's data service may map them: it lets go within its SLOT_MAPS_CHECK_S, 0.1 s). Other
#: processes that read the slots (consumers) let go within MAP_CHECK_S; they are not waited for.
GIVE_BACK_WAIT_S = 0.3


def default_prefix() -> str:
    """Segment name prefix: ``$OMNI_ACTORS_SHM_PREFIX``, else ``"omni-actors-"``.

    The actor system sets the variable per host admin (``oa-<adminport>-``)
    so that its data service and sweeps touch only its own segments.
    """
    return os.environ.get(PREFIX_ENV) or DEFAULT_PREFIX


class SegmentDirError(OSError):
    """The segment directory (``$OMNI_ACTORS_SHM_DIR``) is unusable; the message says why."""


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
    if "@" in name:  # (a slot's location: a review's malformed one stopped a data service's release batch)
        try:
            slots.split(name)
        except ConnectorError as exc:
            return str(exc)
    return None


def _unlink(name: str) -> bool:
    """Unlink segment ``name``; False if it was already gone."""
    return _unlink_in(segment_dir(), name)


def create_segment(name: str, size: int, layout: tuple[FieldLayout, ...],
                   arrays: list[np.ndarray], *, reuse_prefix: str | None = None) -> bool:
    """Create segment ``name`` holding ``size`` bytes, ``arrays`` at their offsets
    (gaps read as zeros), in a file of ``size_class(size)`` bytes. With
    ``reuse_prefix``, a free segment of that prefix and class is claimed and
    overwritten when there is one. Leaves nothing behind when it fails.

    Returns:
        Whether a free segment was reused.

    Raises:
        FileExistsError: the name is taken. SegmentDirError: the segment
        directory is unusable. OSError: the directory's tmpfs is full.
    """
    directory = segment_dir()
    path = f"{directory}/{name}"
    ino = _claim(reuse_prefix, directory, size_class(size), name) if reuse_prefix else None
    reused = ino is not None
    if reused:
        try:
            if _maps.write(directory, path, ino, size, layout, arrays):
                return True
        except BaseException:
            _unlink_in(directory, name)
            raise
    try:
        fd = os.open(path, os.O_RDWR | _OPEN_FLAGS | (0 if reused else os.O_CREAT | os.O_EXCL), 0o600)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        if reused:
            _unlink_in(directory, name)
        check_segment_dir(directory)  # raises the clear error when the directory is the problem
        raise
    try:
        if not reused:
            os.ftruncate(fd, size_class(size))
        # One writer: tmpfs serialises writes to a file (the inode lock), so threads gain nothing.
        pos = 0
        for field, arr in zip([f for f in layout if f.kind in PACKED_KINDS], arrays):
            if field.nbytes:
                if reused and field.offset > pos:  # padding: zeros, not the last payload's bytes
                    pwrite_all(fd, memoryview(bytes(field.offset - pos)), pos)
                pwrite_all(fd, memoryview(array_bytes(arr)), field.offset)
                pos = field.offset + field.nbytes
        if reused and size > pos:
            pwrite_all(fd, memoryview(bytes(size - pos)), pos)
        if reused and _maps.max_bytes:
            _maps.add(directory, fd, size)  # a recycled one: this process may well claim it again
    except BaseException:
        os.close(fd)
        _unlink_in(directory, name)
        raise
    os.close(fd)
    return reused


def open_segment(name: str) -> tuple[int, int]:
    """Open segment ``name`` read-only: ``(fd, size in bytes)``; the caller closes ``fd``.

    Raises:
        FileNotFoundError: no such segment (in :func:`segment_dir`).
    """
    fd = os.open(segment_path(name), os.O_RDONLY | _OPEN_FLAGS)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # (a free directory)
            raise FileNotFoundError(errno.ENOENT, "not a segment", name)
        return fd, st.st_size
    except BaseException:
        os.close(fd)
        raise


def open_payload(name: str, size: int) -> tuple[int, int]:
    """Open segment ``name`` (a slot's location too) read-only: ``(fd, offset)``, its
    first ``size`` bytes being the file's from ``offset`` on; the caller closes ``fd``.
    For a reader that copies the bytes out (``preadv``) rather than mapping them.

    Raises:
        SegmentNotFound: the segment (that slot generation) is gone.
        ConnectorError: it is smaller than ``size``, or ``name`` is a malformed slot location.
    """
    if "@" in name:
        file, gen = slots.split(name)
        return slots.open_payload(segment_dir(), file, gen, size), slots.HEADER
    try:
        fd, length = open_segment(name)
    except (FileNotFoundError, NotADirectoryError):
        raise _not_found(name, segment_dir()) from None
    if length < size:
        os.close(fd)
        raise _too_small(name, length, size)
    return fd, 0


def read_kept(name: str, size: int) -> memoryview | None:
    """The first ``size`` (> 0) bytes of slot location ``name``, read-only, in place,
    from a mapping this process keeps (made and kept here from the slot's second
    generation on, see :func:`omni_actors.connectors.slots.read_kept`); None where
    there is none to keep (a slot's first generation; a segment that is no slot):
    :func:`open_payload` then.

    Raises:
        ConnectorError: the slot generation is gone or smaller than ``size``.
    """
    if "@" not in name:
        return None
    file, gen = slots.split(name)
    return slots.read_kept(segment_dir(), file, gen, size)


def read_segment(name: str, size: int) -> memoryview | mmap.mmap:
    """The first ``size`` (> 0) bytes of segment ``name``, read-only, in place: a
    view on the mapping this process keeps of its file (see
    :class:`~omni_actors.connectors.mappings._ReadCache`; one is made and kept
    when there is none).

    A slot's location (``<name>@<generation>``, see
    :mod:`omni_actors.connectors.slots`) reads that generation's payload.

    Raises:
        ConnectorError: the segment is gone or smaller than ``size``.
    """
    if "@" in name:
        file, gen = slots.split(name)
        return slots.read(segment_dir(), file, gen, size)
    return _reads.view(segment_dir(), name, size)


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
            OSError: the segment cannot be created (its tmpfs is full: after giving back
                this process's free segments and slots, and, where that was not enough,
                GIVE_BACK_WAIT_S for the data service to let go of the slots given back).
        """
        return self.put_planned(*plan(outputs))

    def put_planned(self, layout: tuple[FieldLayout, ...], size: int,
                    arrays: list[np.ndarray]) -> ConnectorRef:
        """``put`` for a result of :func:`plan` (saves planning twice)."""
        if size == 0:
            return self._inline.put_planned(layout, size, arrays)
        directory = segment_dir()
        location = slots.put(self.prefix, directory, size, layout, arrays)
        if location is not None:
            return ConnectorRef(kind=self.kind, size=size, layout=layout, location=location,
                                node=self.node, service=self.service)
        name = f"{self.prefix}{os.urandom(8).hex()}"
        try:
            create_segment(name, size, layout, arrays, reuse_prefix=self.prefix)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            # The tmpfs is full, and free segments and slots (or our mappings of unlinked ones, kept
            # to write, to read or to release) may hold some of it: give them back (the free ones
            # first: a review saw their mappings, dropped before they were unlinked, keep them),
            # try once more.
            gave = slots.drop_free_slots() + purge_free_segments(self.prefix)
            if not gave + drop_unlinked_mappings():
                raise
            deadline = time.monotonic() + GIVE_BACK_WAIT_S
            while True:
                try:
                    create_segment(name, size, layout, arrays)
                    break
                except OSError as again:
                    # The node's data service may still map the slots just unlinked (it drops such
                    # mappings every SLOT_MAPS_CHECK_S): wait that long, not more, on this thread
                    # (an engine's actor thread, which heartbeats, or its loop).
                    if again.errno != errno.ENOSPC or time.monotonic() >= deadline:
                        raise
                    time.sleep(0.05)
                    drop_unlinked_mappings()
        return ConnectorRef(kind=self.kind, size=size, layout=layout, location=name,
                            node=self.node, service=self.service)

    def get(self, ref: ConnectorRef) -> dict[str, Any]:
        """Map the segment: read-only views on it, nothing copied (through the
        mapping this process keeps of the segment's file, see
        :class:`~omni_actors.connectors.mappings._ReadCache`).

        Raises:
            ConnectorError: the segment is gone (released or reaped) or too small.
        """
        if ref.kind == "inline":
            return self._inline.get(ref)
        if ref.kind not in ("shm", "tcp") or not ref.location:
            raise ConnectorError(f"not a shared-memory ref: kind={ref.kind!r}")
        if ref.size == 0:
            return read_outputs(b"", ref.layout)
        return read_outputs(read_segment(ref.location, ref.size), ref.layout)

    def release(self, ref: ConnectorRef, *, recycle: bool = False) -> None:
        """Unlink the segment, or with ``recycle`` keep it for a later ``put`` on
        this node (see :func:`release_segments`). Idempotent and silent if it is
        already gone.

        Unlinked, arrays already read from it stay valid (their mapping keeps the
        pages); recycled, they must not be read any more.
        """
        if ref.kind in ("shm", "tcp") and ref.location:
            release_segments([ref.location], recycle=recycle)


def release_segments(names: Iterable[str], *, recycle: bool = False, directory: str | None = None,
                     budget: int | None = None) -> tuple[int, int]:
    """Release in-use segments ``names`` (in ``directory``, default :func:`segment_dir`):
    unlink each, or with ``recycle`` rename it into its prefix's free directory,
    where a later ``put`` of its size class on this node claims it. A segment is
    unlinked all the same when keeping it would take its prefix's free segments
    over ``budget`` bytes (default :func:`free_budget`) or :data:`MAX_FREE_SEGMENTS`,
    or its name or size is not one ``put`` makes. Names already gone are skipped.

    Recycle only what no process reads any more: an array mapped from the
    segment before would see the next payload. A slot's location
    (``<name>@<generation>``) is released in its header instead
    (:func:`omni_actors.connectors.slots.release`: free for its producer, or
    retired and unlinked).

    Returns:
        ``(released, recycled)``: how many were still there, how many of those were kept.
    """
    directory = segment_dir() if directory is None else directory
    released = recycled = 0
    usage: dict[str, list[int]] = {}  # free directory -> [segments, bytes], listed once per call
    for name in names:
        try:
            slot = slots.split(name) if "@" in name else None
        except ConnectorError:  # (no segment's name: skipped as one gone, not the end of the batch)
            continue
        if slot is not None:
            if slots.release(directory, slot, recycle=recycle):
                released += 1
                recycled += recycle
            continue
        if recycle and budget is None:
            budget = free_budget(directory)
        try:
            kept = recycle and _recycle(name, directory, usage, budget)
        except OSError:  # (whatever stops the recycling, the segment is still released)
            kept = False
        if kept:
            released += 1
            recycled += 1
        elif _unlink_in(directory, name):
            released += 1
    return released, recycled


def list_segments(prefix: str, directory: str | None = None) -> list[str]:
    """Names of the in-use segments in ``directory`` (default :func:`segment_dir`)
    that start with ``prefix``, sorted; none if the directory does not exist.
    Free (recycled) segments are not listed (see :func:`list_free_segments`),
    nor slots that are not in use (see :func:`list_segment_files`)."""
    directory = segment_dir() if directory is None else directory
    return [n for n in list_segment_files(prefix, directory)
            if not slots.is_slot(n) or (h := slots.header(directory, n)) is not None and slots.state(h) == slots.IN_USE]


def list_segment_files(prefix: str, directory: str | None = None) -> list[str]:
    """Names of every segment file under ``prefix`` in ``directory``, slots in any state included, sorted."""
    if not prefix:
        raise ValueError("refusing an empty prefix: it would match every segment")
    try:
        with os.scandir(segment_dir() if directory is None else directory) as it:
            return sorted(e.name for e in it
                          if e.name.startswith(prefix) and not e.is_dir(follow_symlinks=False))
    except FileNotFoundError:
        return []


def free_usage(prefix: str, directory: str | None = None) -> tuple[int, int]:
    """``(segments, bytes)`` of ``prefix``'s free segments right now: recycled ones
    (from their names) and free slots (from their headers)."""
    return buffer_counts(prefix, directory)[1:]


def buffer_counts(prefix: str, directory: str | None = None) -> tuple[int, int, int]:
    """``(in use, free, free bytes)`` of ``prefix``'s segments, in one pass over the
    directory (a node's heartbeat): in-use segments and slots; free (recycled)
    segments and free slots."""
    directory = segment_dir() if directory is None else directory
    free, free_bytes = _free_usage_in(free_dir(prefix, directory))
    files = list_segment_files(prefix, directory)
    slot_files = [n for n in files if slots.is_slot(n)]
    in_use = len(files) - len(slot_files)
    if slot_files:
        counts = slots.usage(slot_files, directory)
        in_use += counts[slots.IN_USE][0]
        free, free_bytes = free + counts[slots.FREE][0], free_bytes + counts[slots.FREE][1]
    return in_use, free, free_bytes


def segment_usage(prefix: str, directory: str | None = None) -> tuple[int, int]:
    """``(segments, bytes)`` of the in-use segments under ``prefix`` right now (bytes:
    their files' sizes, see :func:`size_class`)."""
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
    default :func:`segment_dir`), in use or free (the free directories of those
    prefixes are removed too); return how many segments.

    Raises:
        ValueError: ``prefix`` is empty.
    """
    directory = segment_dir() if directory is None else directory
    removed = sum(slots.retire_and_unlink(directory, name) if slots.is_slot(name) else _unlink_in(directory, name)
                  for name in list_segment_files(prefix, directory))
    try:
        with os.scandir(directory) as it:
            fdirs = [e.path for e in it if e.name.startswith(prefix) and e.name.endswith(FREE_SUFFIX)
                     and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return removed
    for fdir in fdirs:
        for name in _listdir(fdir):
            removed += _unlink_in(fdir, name)
        try:
            os.rmdir(fdir)
        except OSError:
            pass  # (a release made a new free segment meanwhile: the next sweep takes it)
    return removed


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []
