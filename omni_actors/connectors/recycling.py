"""Segment recycling: a released segment kept for a later ``put`` of its size on its node.

A segment's file has the size class of its payload
(:func:`size_class`: a page at least, then four classes per power of two, so
at most 25% over; the tail is a hole that takes no memory until written); the
ref keeps the payload size and readers map only that. Writing fresh tmpfs
pages costs a page fault and zeroing per page (per 4 KiB where ``/dev/shm``
has no huge pages: ~2.7 GB/s here), so a released segment whose owner knows
that nobody reads it any more can be *recycled* (``release(..., recycle=True)``,
:func:`~omni_actors.connectors.shm.release_segments`): it is renamed into its
prefix's free directory ``<dir>/<prefix>free/`` (as
``<class hex>-<inode hex>-<random>``, its mtime set to the release time)
instead of unlinked, and a later ``put`` of the same size class on that node
claims it by renaming it to its new in-use name (a rename is atomic: of two
processes claiming one free segment exactly one wins) and overwrites it, its
pages already allocated. Each process keeps the free
directory's listing per class and lists it again only when the directory
changed (its mtime and size; one ``stat`` per miss) or the listing is over
:data:`RELIST_S` old. Free segments are bounded: a release keeps one only
while the prefix's free segments stay under :func:`free_budget` bytes and
:data:`MAX_FREE_SEGMENTS`; the node's data service unlinks free segments idle
longer than :func:`free_idle_s` and trims to the budget
(:func:`trim_free_segments`); a ``put`` that finds the tmpfs full unlinks the
prefix's free segments and tries once more;
:func:`~omni_actors.connectors.shm.sweep_segments` removes them with the rest.
Refs are never recycled by default: the caller must know that no process still
reads the segment through a mapping made before (a reader that maps it *after*
the release finds its name gone, as for an unlink).

Defaults: a free segment unclaimed for 2 s is unlinked
(``$OMNI_ACTORS_SHM_FREE_IDLE_S``); a prefix keeps at most half its tmpfs, 1 GiB
at most, of free segments (``$OMNI_ACTORS_SHM_FREE_BYTES``; 0: no recycling)
and 1024 of them; a producer keeps its mappings of the segments it reused, to
write them again (:class:`_MapCache`), up to 1 GiB
(``$OMNI_ACTORS_SHM_MAP_CACHE_BYTES``; 0: off) and 128 of them.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import threading
import time

import numpy as np

from omni_actors.connectors.base import FieldLayout, _unlink_in, segment_dir
from omni_actors.connectors.inline import array_bytes

# -- segment recycling (see the module docstring) ------------------------------------------------
PAGE = mmap.PAGESIZE
FREE_SUFFIX = "free"  #: the free directory of prefix P is ``<segment dir>/<P>free``
FREE_IDLE_ENV = "OMNI_ACTORS_SHM_FREE_IDLE_S"  #: seconds a free segment may stay unclaimed
FREE_BYTES_ENV = "OMNI_ACTORS_SHM_FREE_BYTES"  #: most bytes of free segments per prefix
#: Under load a released segment is claimed again within milliseconds; one nobody claimed for
#: 2 s means the load changed, and its pages (RAM: tmpfs) are better given back.
DEFAULT_FREE_IDLE_S = 2.0
#: The default budget: half the segment directory's tmpfs, at most this (1 GiB).
DEFAULT_FREE_BYTES_CAP = 1 << 30
MAX_FREE_SEGMENTS = 1024  #: most free segments per prefix (keeps a listing of the free directory cheap)
RELIST_S = 0.05  #: a process lists the free directory again after this even if it looks unchanged
MAP_CACHE_ENV = "OMNI_ACTORS_SHM_MAP_CACHE_BYTES"  #: most bytes of segments a producer keeps mapped
DEFAULT_MAP_CACHE_BYTES = 1 << 30
MAP_CACHE_ENTRIES = 128
MAP_CHECK_S = 1.0  #: how often a producer drops its mappings of segments unlinked meanwhile
_IN_USE_TAIL = re.compile(r"[0-9a-f]{16}")  # an in-use segment is named <prefix><16 hex digits>
_FREE_NAME = re.compile(r"([0-9a-f]+)-([0-9a-f]+)-[0-9a-f]+")  # <class>-<inode>-<random>, hex


def size_class(size: int) -> int:
    """The file size of a segment holding ``size`` bytes: a page at least, else ``size``
    rounded up to a multiple of an eighth of the next power of two (four classes per
    doubling: at most 25% more; the unwritten tail is a hole, no memory)."""
    if size <= PAGE:
        return PAGE
    step = max(PAGE, 1 << ((size - 1).bit_length() - 3))
    return -(-size // step) * step


def free_idle_s() -> float:
    """Seconds a free segment may stay unclaimed before the data service unlinks it:
    ``$OMNI_ACTORS_SHM_FREE_IDLE_S``, else :data:`DEFAULT_FREE_IDLE_S`."""
    try:
        return float(os.environ.get(FREE_IDLE_ENV) or DEFAULT_FREE_IDLE_S)
    except ValueError:  # (a bad setting must not stop releases)
        return DEFAULT_FREE_IDLE_S


def free_budget(directory: str | None = None) -> int:
    """Most bytes of free segments a prefix keeps: ``$OMNI_ACTORS_SHM_FREE_BYTES``, else
    half the size of the segment directory's filesystem, at most 1 GiB (0: no recycling)."""
    try:
        return max(0, int(os.environ[FREE_BYTES_ENV]))
    except (KeyError, ValueError):  # unset, or a bad setting (which must not stop releases)
        pass
    try:
        st = os.statvfs(segment_dir() if directory is None else directory)
    except OSError:
        return 0
    return min(DEFAULT_FREE_BYTES_CAP, st.f_blocks * st.f_frsize // 2)


def free_dir(prefix: str, directory: str | None = None) -> str:
    """The directory of ``prefix``'s free (recycled, unclaimed) segments."""
    return os.path.join(segment_dir() if directory is None else directory, prefix + FREE_SUFFIX)


def _prefix_of(name: str) -> str | None:
    """The prefix of in-use segment ``name`` (``<prefix><16 hex>``); None if it is not one."""
    if len(name) <= 16 or not _IN_USE_TAIL.fullmatch(name, len(name) - 16):
        return None
    return name[:-16]


def _free_class(name: str) -> int | None:
    m = _FREE_NAME.fullmatch(name)
    return int(m.group(1), 16) if m else None


def _free_ino(name: str) -> int | None:
    m = _FREE_NAME.fullmatch(name)
    return int(m.group(2), 16) if m else None


class _FreeView:
    """One process's listing of one free directory, by size class (hints: a
    claim that finds a name gone tries the next)."""

    __slots__ = ("by_class", "stamp", "listed_at")

    def __init__(self) -> None:
        self.by_class: dict[int, list[str]] = {}
        self.stamp: tuple | None = None
        self.listed_at = 0.0


_views: dict[str, _FreeView] = {}
_views_lock = threading.Lock()


def _pop_candidate(fdir: str, cls: int, mapped: "dict | None") -> str | None:
    """A free name of class ``cls`` from this process's listing; one whose
    inode this process keeps mapped (``mapped``) first."""
    with _views_lock:
        view = _views.get(fdir)
        names = view.by_class.get(cls) if view is not None else None
        if not names:
            return None
        if mapped:
            for i in range(len(names) - 1, -1, -1):
                if _free_ino(names[i]) in mapped:
                    return names.pop(i)
        return names.pop()


def _relist(fdir: str) -> bool:
    """List ``fdir`` again if it changed since it was last listed here; whether it was."""
    try:
        st = os.stat(fdir)
    except OSError:  # no free directory (yet): nothing to claim
        with _views_lock:
            _views.pop(fdir, None)
        return False
    stamp = (st.st_ino, st.st_mtime_ns, st.st_size)  # (a tmpfs directory's size counts its entries)
    now = time.monotonic()
    with _views_lock:
        view = _views.setdefault(fdir, _FreeView())
        if view.stamp == stamp and now - view.listed_at < RELIST_S:
            return False
    try:
        names = os.listdir(fdir)
    except OSError:
        return False
    by_class: dict[int, list[str]] = {}
    for n in names:
        cls = _free_class(n)
        if cls is not None:
            by_class.setdefault(cls, []).append(n)
    with _views_lock:
        view.by_class, view.stamp, view.listed_at = by_class, stamp, now
    return True


def _claim(prefix: str, directory: str, cls: int, name: str) -> str | None:
    """Rename a free segment of class ``cls`` of ``prefix`` to ``name``: its free
    name, or None if there was none."""
    fdir = os.path.join(directory, prefix + FREE_SUFFIX)
    mapped = _maps.inodes(directory)
    relisted = False
    while True:
        cand = _pop_candidate(fdir, cls, mapped)
        if cand is None:
            if relisted or not _relist(fdir):
                return None
            relisted = True
            continue
        try:
            os.rename(os.path.join(fdir, cand), os.path.join(directory, name))
            return cand
        except FileNotFoundError:
            continue  # another producer claimed it first, or the trim took it


class _Mapped:
    __slots__ = ("mm", "fd", "size")

    def __init__(self, mm: mmap.mmap, fd: int, size: int) -> None:
        self.mm, self.fd, self.size = mm, fd, size

    def close(self) -> None:
        try:
            self.mm.close()
        except (BufferError, ValueError):
            pass
        os.close(self.fd)


class _MapCache:
    """Writable mappings of reused segments, kept by the producer that wrote them.

    Writing through a mapping whose page tables are already built runs at
    memory-copy speed, where ``pwrite`` (page-cache lookups per page) runs at a
    third to a half of it (measured here). So when a ``put`` claims a free
    segment, it keeps a mapping of it (built at once with ``MAP_POPULATE``), and
    when it claims the same inode again it copies the payload through that
    mapping. Only bytes the file already has pages for are written that way (the
    mapping covers what the ``pwrite`` before it wrote, checked against
    ``st_blocks``): a write to a hole through a mapping of a full tmpfs is a
    SIGBUS, through ``pwrite`` an error. Bounded: at most
    ``$OMNI_ACTORS_SHM_MAP_CACHE_BYTES`` (default 1 GiB; 0: off) and
    :data:`MAP_CACHE_ENTRIES` per process, least recently used out first; a
    thread drops, every :data:`MAP_CHECK_S`, the mappings of segments unlinked
    meanwhile (a mapping would keep their pages alive). An entry is identified by
    inode and checked against the claimed file (inode, device, ctime) before use.
    """

    def __init__(self) -> None:
        self._reset()
        try:
            self.max_bytes = max(0, int(os.environ.get(MAP_CACHE_ENV) or DEFAULT_MAP_CACHE_BYTES))
        except ValueError:
            self.max_bytes = DEFAULT_MAP_CACHE_BYTES

    def _reset(self) -> None:
        self._entries: dict[tuple[str, int], _Mapped] = {}  # (directory, inode) -> mapping; LRU order
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._held = 0

    def clear(self) -> None:
        """Close every mapping (also in a forked child: a new lock, in case another
        thread held the old one at the fork; the watcher thread sees it and ends)."""
        entries = list(self._entries.values())
        self._reset()
        for e in entries:
            e.close()

    def inodes(self, directory: str) -> dict[int, None] | None:
        if not self._entries:
            return None
        with self._lock:
            return {ino: None for d, ino in self._entries if d == directory}

    def take(self, directory: str, ino: int | None) -> _Mapped | None:
        """The mapping of ``ino``, out of the cache while the caller writes through it."""
        with self._lock:
            entry = self._entries.pop((directory, ino), None)
            if entry is not None:
                self._held -= entry.size
            return entry

    def put_back(self, directory: str, ino: int, entry: _Mapped) -> None:
        """Keep ``entry`` (most recently used); closes it, or the least recently used
        ones, to stay within the bounds."""
        evicted = []
        with self._lock:
            if (directory, ino) in self._entries or entry.size > self.max_bytes:
                evicted.append(entry)
            else:
                self._entries[(directory, ino)] = entry
                self._held += entry.size
                while self._held > self.max_bytes or len(self._entries) > MAP_CACHE_ENTRIES:
                    key = next(iter(self._entries))
                    old = self._entries.pop(key)
                    self._held -= old.size
                    evicted.append(old)
            if self._entries and self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="shm-map-cache", daemon=True)
                self._thread.start()
        for e in evicted:
            e.close()

    def add(self, directory: str, fd: int, size: int) -> None:
        """Map the first ``size`` bytes of file ``fd`` (a segment just written there:
        pages for every one; not its tail, which a populated mapping would
        allocate) and keep the mapping; best effort."""
        size = -(-size // PAGE) * PAGE
        if size > self.max_bytes:
            return
        ino = os.fstat(fd).st_ino
        with self._lock:
            if (directory, ino) in self._entries:
                return
        dup = os.dup(fd)
        try:
            mm = mmap.mmap(dup, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):
            os.close(dup)
            return
        self.put_back(directory, ino, _Mapped(mm, dup, size))

    def drop_unlinked(self) -> int:
        """Close the mappings of segments unlinked meanwhile; how many."""
        with self._lock:
            items = list(self._entries.items())
        gone = []
        for key, entry in items:
            try:
                if os.fstat(entry.fd).st_nlink == 0:
                    gone.append(key)
            except OSError:
                gone.append(key)
        closing = []
        with self._lock:
            for key in gone:
                entry = self._entries.pop(key, None)
                if entry is not None:
                    self._held -= entry.size
                    closing.append(entry)
        for entry in closing:
            entry.close()
        return len(closing)

    def _watch(self) -> None:
        while True:
            time.sleep(MAP_CHECK_S)
            with self._lock:
                if self._thread is not threading.current_thread():
                    return  # (a forked child reset the cache)
            self.drop_unlinked()
            with self._lock:
                if self._thread is not threading.current_thread():
                    return
                if not self._entries:
                    self._thread = None
                    return

    def write(self, directory: str, path: str, free_name: str, size: int, layout: tuple[FieldLayout, ...],
              arrays: list[np.ndarray]) -> bool:
        """Write the payload into just-claimed segment ``path`` (free name ``free_name``)
        through this process's mapping of it, if it has one and the file has
        pages for every byte; whether it did."""
        ino = _free_ino(free_name)
        entry = self.take(directory, ino) if self._entries else None
        if entry is None:
            return False
        try:
            st, mine = os.stat(path, follow_symlinks=False), os.fstat(entry.fd)
            if (st.st_ino, st.st_dev, st.st_ctime_ns) != (mine.st_ino, mine.st_dev, mine.st_ctime_ns) \
                    or size > entry.size or size > mine.st_blocks * 512:
                # Another file, or more bytes than the mapping covers (pages that may not exist:
                # pwrite them, it fails cleanly when the tmpfs is full; a new mapping follows).
                entry.close()
                return False
            view = memoryview(entry.mm)
            try:
                pos = 0
                for field, arr in zip([f for f in layout if f.kind == "array"], arrays):
                    if field.nbytes:
                        if field.offset > pos:  # padding: zeros, not the last payload's bytes
                            view[pos:field.offset] = bytes(field.offset - pos)
                        view[field.offset:field.offset + field.nbytes] = array_bytes(arr).data
                        pos = field.offset + field.nbytes
                if size > pos:
                    view[pos:size] = bytes(size - pos)
            finally:
                view.release()
        except BaseException:
            entry.close()
            raise
        self.put_back(directory, ino, entry)
        return True


_maps = _MapCache()


def drop_mappings() -> None:
    """Close every mapping this process keeps for writing (see :class:`_MapCache`),
    e.g. before unmounting a segment directory."""
    _maps.clear()


def _after_fork_in_child() -> None:
    global _views_lock
    _views_lock = threading.Lock()  # (another thread may have held it at the fork)
    _maps.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _recycle(name: str, directory: str, usage: dict[str, list[int]], budget: int) -> bool:
    """Move in-use segment ``name`` to its free directory; False (nothing done) if it
    is gone, not recyclable, or would go over the budget."""
    prefix = _prefix_of(name)
    if prefix is None:
        return False
    path = os.path.join(directory, name)
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    size = st.st_size
    if not stat.S_ISREG(st.st_mode) or size != size_class(size):
        return False
    fdir = os.path.join(directory, prefix + FREE_SUFFIX)
    held = usage.get(fdir)
    if held is None:
        held = usage[fdir] = list(_free_usage_in(fdir))
    if held[0] >= MAX_FREE_SEGMENTS or held[1] + size > budget:
        return False
    try:
        os.utime(path)  # the idle trim counts from now
    except OSError:
        return False
    target = os.path.join(fdir, f"{size:x}-{st.st_ino:x}-{os.urandom(6).hex()}")
    for attempt in (0, 1):
        try:
            os.rename(path, target)
            held[0] += 1
            held[1] += size
            return True
        except FileNotFoundError:
            if attempt or not os.path.lexists(path):
                return False  # (swept or reaped meanwhile)
            try:
                os.mkdir(fdir, 0o700)  # the first recycled segment of this prefix
            except FileExistsError:
                pass
    return False


def _free_usage_in(fdir: str) -> tuple[int, int]:
    try:
        names = os.listdir(fdir)
    except OSError:
        return 0, 0
    sizes = [c for c in map(_free_class, names) if c is not None]
    return len(sizes), sum(sizes)


def list_free_segments(prefix: str, directory: str | None = None) -> list[str]:
    """Names of ``prefix``'s free (recycled, unclaimed) segments, in its free directory, sorted."""
    try:
        return sorted(os.listdir(free_dir(prefix, directory)))
    except OSError:
        return []


def free_usage(prefix: str, directory: str | None = None) -> tuple[int, int]:
    """``(segments, bytes)`` of ``prefix``'s free segments right now (from their names: no stat)."""
    return _free_usage_in(free_dir(prefix, directory))


def trim_free_segments(prefix: str, *, idle_s: float, budget: int, now: float | None = None,
                       directory: str | None = None) -> int:
    """Unlink ``prefix``'s free segments released more than ``idle_s`` ago (by
    mtime, which a release sets), then the oldest others until they hold at most
    ``budget`` bytes and :data:`MAX_FREE_SEGMENTS`; how many were unlinked."""
    fdir = free_dir(prefix, directory)
    now = time.time() if now is None else now
    entries = []
    try:
        with os.scandir(fdir) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # claimed meanwhile
                entries.append((st.st_mtime, st.st_size, entry.name))
    except (FileNotFoundError, NotADirectoryError):
        return 0
    removed = 0
    kept = []
    for mtime, size, name in entries:
        if now - mtime > idle_s:
            removed += _unlink_in(fdir, name)
        else:
            kept.append((mtime, size, name))
    kept.sort()  # oldest first
    held, count = sum(k[1] for k in kept), len(kept)
    for mtime, size, name in kept:
        if held <= budget and count <= MAX_FREE_SEGMENTS:
            break
        removed += _unlink_in(fdir, name)
        held, count = held - size, count - 1
    return removed


def purge_free_segments(prefix: str, directory: str | None = None) -> int:
    """Unlink every free segment of ``prefix``; how many."""
    return trim_free_segments(prefix, idle_s=-1.0, budget=0, directory=directory)
