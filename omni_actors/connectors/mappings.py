"""Mappings of shared-memory segments a process keeps, to use them again.

With segment recycling (:mod:`omni_actors.connectors.recycling`) the same few
files (inodes) carry one payload after another under new names, so the
mappings of them are worth keeping: making one (``open``, ``fstat``, ``mmap``,
``close``) and filling its page tables again (a fault per 4 KiB page where the
tmpfs has no huge pages) cost more than copying a megabyte. Two caches per
process, both keyed by (segment directory, inode):

- the producer's (:data:`_maps`, :class:`_MapCache`): writable mappings of the
  segments a ``put`` claimed, to write the next payload of a claimed inode
  through (memory-copy speed, where ``pwrite`` runs at a third to a half of
  it); ``$OMNI_ACTORS_SHM_MAP_CACHE_BYTES`` (default 1 GiB; 0: off), at most
  :data:`MAP_CACHE_ENTRIES` mappings. The claim itself tries the free names of
  these inodes first (:meth:`_MapCache.guesses`; a free segment is named after
  its inode), so a producer that gets its own segments back claims one with a
  single ``rename``;
- the consumer's (:data:`_reads`, :class:`_ReadCache`): read-only mappings of
  whole segment files that a ``get`` read in place for the second time (under
  another name: recycled), so a later ``get`` of a segment of that file costs
  a ``stat`` of the name and an ``fstat`` (no ``open``, ``mmap``, ``munmap``,
  and the page tables are still there); a file read once is mapped for that
  ``get`` alone, as without the cache. ``$OMNI_ACTORS_SHM_READ_CACHE_BYTES``
  (default 1 GiB; 0: off), at most :data:`READ_CACHE_ENTRIES` mappings.

An entry is used only after the file the name points at *now* is checked to
be the kept one: the ``stat`` of the name and the ``fstat`` of the kept
descriptor agree on inode, device and ctime (an inode number can come back
for another file: after its file is gone, or on a tmpfs with 32-bit inode
numbers after the counter wrapped; the ctime tells the newcomer apart). So a ``get``
through the cache reads exactly the file an ``open`` of the name would have
mapped: a name that is gone (released, recycled, reaped) is not found, as
before. What a cached mapping does not change: a recycled segment's mapping
shows the next payload (true of any mapping, kept or not; hence refs are
recycled only when nobody reads them any more).

Both caches are bounded (least recently used out first), and a thread per
cache (started with the first entry, ended when the cache is empty) closes,
every :data:`MAP_CHECK_S`, the mappings of segments unlinked meanwhile (a
mapping would keep their pages alive); a ``put`` that finds its tmpfs full
closes those at once (:func:`drop_unlinked_mappings`), and
:func:`drop_mappings` closes every one (before unmounting a segment
directory). Arrays a ``get`` returned keep their mapping alive after the
cache closed its entry (the ``mmap`` is closed only when nothing exports it).
A forked child starts with empty caches.
"""

from __future__ import annotations

import itertools
import mmap
import os
import stat
import sys
import threading
import time

import numpy as np

from omni_actors.connectors.base import PACKED_KINDS, FieldLayout
from omni_actors.connectors.inline import ConnectorError, array_bytes

PAGE = mmap.PAGESIZE
MAP_CACHE_ENV = "OMNI_ACTORS_SHM_MAP_CACHE_BYTES"  #: most bytes of segments a producer keeps mapped
DEFAULT_MAP_CACHE_BYTES = 1 << 30
MAP_CACHE_ENTRIES = 128
READ_CACHE_ENV = "OMNI_ACTORS_SHM_READ_CACHE_BYTES"  #: most bytes of segments a consumer keeps mapped
DEFAULT_READ_CACHE_BYTES = 1 << 30
READ_CACHE_ENTRIES = 64
SEEN_PER_ENTRY = 4  #: files read once that a consumer remembers, per mapping it may keep
MAP_CHECK_S = 1.0  #: how often a process drops its mappings of segments unlinked meanwhile
GUESSES = 2  #: free names of its own mapped inodes a claim tries before it lists the free directory

#: O_NOFOLLOW as shm_open uses it: a segment name is never followed elsewhere.
_OPEN_FLAGS = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
# Python >= 3.13 can map without keeping a dup of the fd open per mapping.
_MMAP_KWARGS = {"trackfd": False} if sys.version_info >= (3, 13) else {}


class SegmentNotFound(ConnectorError):
    """The segment a name refers to is gone (released, recycled, reaped or swept)."""


def _not_found(name: str, directory: str) -> SegmentNotFound:
    return SegmentNotFound(f"shared-memory segment {name!r} not found in {directory}: already "
                          "released, or reaped/swept")


def _too_small(name: str, actual: int, size: int) -> ConnectorError:
    return ConnectorError(f"shared-memory segment {name!r} has {actual} bytes, the ref says {size}")


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return a.st_ino == b.st_ino and a.st_dev == b.st_dev and a.st_ctime_ns == b.st_ctime_ns


class _Mapped:
    """A kept mapping: ``mm`` of the file open as ``fd`` (kept to check the file
    is still the one a name points at), ``size`` bytes mapped, the file's
    size ``cls`` (its size class)."""

    __slots__ = ("mm", "fd", "size", "cls")

    def __init__(self, mm: mmap.mmap, fd: int, size: int, cls: int = 0) -> None:
        self.mm, self.fd, self.size, self.cls = mm, fd, size, cls

    def close(self) -> None:
        try:
            self.mm.close()
        except (BufferError, ValueError):
            pass  # arrays still export it: it is unmapped when the last of them goes
        os.close(self.fd)


class _Cache:
    """Mappings by (directory, inode), least recently used first, bounded; the
    subclasses say how they are made and used."""

    ENV = ""
    DEFAULT_BYTES = 0
    ENTRIES = 0
    THREAD = ""
    check_s = MAP_CHECK_S  #: how often this cache drops its mappings of files unlinked meanwhile

    def __init__(self) -> None:
        self._reset()
        try:
            self.max_bytes = max(0, int(os.environ.get(self.ENV) or self.DEFAULT_BYTES))
        except ValueError:
            self.max_bytes = self.DEFAULT_BYTES

    def _reset(self) -> None:
        self._entries: dict[tuple[str, int], _Mapped] = {}  # (directory, inode) -> mapping; LRU order
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._held = 0

    def _pop(self, key: tuple[str, int]) -> _Mapped | None:
        """Take ``key``'s entry out (under the lock)."""
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._held -= entry.size
        return entry

    def _forget(self) -> None:
        """Empty the cache's tables (under the lock)."""
        self._entries.clear()
        self._held = 0

    def clear(self) -> None:
        """Close every mapping."""
        with self._lock:
            entries = list(self._entries.values())
            self._forget()
        for e in entries:
            e.close()

    def after_fork(self) -> None:
        """In a forked child: start afresh (a new lock, in case another thread held the
        old one at the fork; the parent's watcher thread is not there) and close the
        child's copies of the mappings."""
        entries = list(self._entries.values())
        self._reset()
        for e in entries:
            e.close()

    def _insert(self, key: tuple[str, int], entry: _Mapped) -> list[_Mapped]:
        """Keep ``entry`` as the most recently used (under the lock); the entries to
        close: it, if the key is taken or it is over the bound, or the least
        recently used ones to stay within the bounds."""
        if key in self._entries or entry.size > self.max_bytes:
            return [entry]
        self._entries[key] = entry
        self._held += entry.size
        evicted = []
        while self._held > self.max_bytes or len(self._entries) > self.ENTRIES:
            evicted.append(self._pop(next(iter(self._entries))))
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name=self.THREAD, daemon=True)
            self._thread.start()
        return evicted

    def drop_unlinked(self) -> int:
        """Close the mappings of segments unlinked meanwhile; how many."""
        with self._lock:
            items = list(self._entries.items())
        gone = []
        for key, entry in items:
            try:
                if os.fstat(entry.fd).st_nlink == 0:
                    gone.append((key, entry))
            except OSError:
                gone.append((key, entry))
        closing = []
        with self._lock:
            for key, entry in gone:
                if self._entries.get(key) is entry:  # (not closed and replaced meanwhile)
                    closing.append(self._pop(key))
        for entry in closing:
            entry.close()
        return len(closing)

    def _watch(self) -> None:
        while True:
            time.sleep(self.check_s)
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


class _MapCache(_Cache):
    """Writable mappings of reused segments, kept by the producer that wrote them.

    Writing through a mapping whose page tables are already built runs at
    memory-copy speed, where ``pwrite`` (page-cache lookups per page) runs at a
    third to a half of it (measured here). So when a ``put`` claims a free
    segment, it keeps a mapping of it (built at once with ``MAP_POPULATE``), and
    when it claims the same inode again it copies the payload through that
    mapping. Only bytes the file already has pages for are written that way (the
    mapping covers what the ``pwrite`` before it wrote, checked against
    ``st_blocks``): a write to a hole through a mapping of a full tmpfs is a
    SIGBUS, through ``pwrite`` an error. An entry is out of the cache while a
    ``put`` writes through it, and is checked against the claimed file (inode,
    device, ctime) before use.
    """

    ENV = MAP_CACHE_ENV
    DEFAULT_BYTES = DEFAULT_MAP_CACHE_BYTES
    ENTRIES = MAP_CACHE_ENTRIES
    THREAD = "shm-map-cache"

    def _reset(self) -> None:
        super()._reset()
        #: (directory, size class) -> the inodes kept of that class, least recently written first
        self._classes: dict[tuple[str, int], dict[int, None]] = {}

    def _forget(self) -> None:
        super()._forget()
        self._classes.clear()

    def _insert(self, key: tuple[str, int], entry: _Mapped) -> list[_Mapped]:
        evicted = super()._insert(key, entry)
        if entry not in evicted:
            self._classes.setdefault((key[0], entry.cls), {})[key[1]] = None
        return evicted

    def _pop(self, key: tuple[str, int]) -> _Mapped | None:
        entry = super()._pop(key)
        if entry is not None:
            inos = self._classes.get((key[0], entry.cls))
            if inos is not None:
                inos.pop(key[1], None)
                if not inos:
                    del self._classes[(key[0], entry.cls)]
        return entry

    def inodes(self, directory: str) -> dict[int, None] | None:
        if not self._entries:
            return None
        with self._lock:
            return {ino: None for d, ino in self._entries if d == directory}

    def guesses(self, directory: str, cls: int, most: int = GUESSES) -> list[int]:
        """Up to ``most`` inodes of size class ``cls`` in ``directory`` this process
        keeps mapped, the least recently written first (the likeliest to be back
        among the free segments)."""
        if not self._entries:
            return []
        with self._lock:
            return list(itertools.islice(self._classes.get((directory, cls), ()), most))

    def take(self, directory: str, ino: int | None) -> _Mapped | None:
        """The mapping of ``ino``, out of the cache while the caller writes through it."""
        with self._lock:
            return self._pop((directory, ino))

    def put_back(self, directory: str, ino: int, entry: _Mapped) -> None:
        """Keep ``entry`` (most recently used); closes it, or the least recently used
        ones, to stay within the bounds."""
        with self._lock:
            evicted = self._insert((directory, ino), entry)
        for e in evicted:
            e.close()

    def add(self, directory: str, fd: int, size: int) -> None:
        """Map the first ``size`` bytes of file ``fd`` (a segment just written there:
        pages for every one; not its tail, which a populated mapping would
        allocate) and keep the mapping; best effort."""
        size = -(-size // PAGE) * PAGE
        if size > self.max_bytes:
            return
        st = os.fstat(fd)
        with self._lock:
            if (directory, st.st_ino) in self._entries:
                return
        dup = os.dup(fd)
        try:
            mm = mmap.mmap(dup, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):
            os.close(dup)
            return
        self.put_back(directory, st.st_ino, _Mapped(mm, dup, size, st.st_size))

    def write(self, directory: str, path: str, ino: int | None, size: int, layout: tuple[FieldLayout, ...],
              arrays: list[np.ndarray]) -> bool:
        """Write the payload into just-claimed segment ``path`` (inode ``ino``, from
        its free name) through this process's mapping of it, if it has one and
        the file has pages for every byte; whether it did."""
        entry = self.take(directory, ino) if self._entries else None
        if entry is None:
            return False
        try:
            st, mine = os.stat(path, follow_symlinks=False), os.fstat(entry.fd)
            if not _same_file(st, mine) or size > entry.size or size > mine.st_blocks * 512:
                # Another file, or more bytes than the mapping covers (pages that may not exist:
                # pwrite them, it fails cleanly when the tmpfs is full; a new mapping follows).
                entry.close()
                return False
            write_payload(entry.mm, 0, size, layout, arrays)
        except BaseException:
            entry.close()
            raise
        self.put_back(directory, ino, entry)
        return True


def write_payload(mm: mmap.mmap, base: int, size: int, layout: tuple[FieldLayout, ...],
                  arrays: list[np.ndarray]) -> None:
    """Copy ``arrays`` (from :func:`~omni_actors.connectors.inline.plan`) into ``mm``
    at ``base`` + their offsets, the ``size`` bytes' padding as zeros (not the
    last payload's bytes)."""
    pos = 0
    for field, arr in zip([f for f in layout if f.kind in PACKED_KINDS], arrays):
        if field.nbytes:
            if field.offset > pos:
                mm[base + pos:base + field.offset] = bytes(field.offset - pos)
            mm[base + field.offset:base + field.offset + field.nbytes] = array_bytes(arr)
            pos = field.offset + field.nbytes
    if size > pos:
        mm[base + pos:base + size] = bytes(size - pos)


class _ReadCache(_Cache):
    """Read-only mappings of whole segments, kept by a process that read them in place.

    Only segments whose file it reads for the second time (under another name:
    recycled) are kept: a file read once is mapped for that ``get`` alone (its
    pages go with the arrays on it, as they went before there was a cache), so
    segments that are unlinked after one read never wait here for the watcher.
    Which files were read is remembered (inode numbers only) for the last
    :data:`SEEN_PER_ENTRY` times :data:`READ_CACHE_ENTRIES` of them.
    """

    ENV = READ_CACHE_ENV
    DEFAULT_BYTES = DEFAULT_READ_CACHE_BYTES
    ENTRIES = READ_CACHE_ENTRIES
    THREAD = "shm-read-cache"

    def _reset(self) -> None:
        super()._reset()
        self._seen: dict[tuple[str, int], None] = {}  # (directory, inode) of files read once; oldest first

    def _forget(self) -> None:
        super()._forget()
        self._seen.clear()

    def view(self, directory: str, name: str, size: int) -> memoryview | mmap.mmap:
        """The first ``size`` (> 0) bytes of segment ``name`` in ``directory``, read-only,
        from the mapping this process keeps of its file if it has one; else from a
        new mapping (kept, within the bounds, if this process read that file before).

        Raises:
            SegmentNotFound: the segment is gone. ConnectorError: it is smaller than ``size``.
        """
        path = f"{directory}/{name}"
        try:
            st = os.stat(path, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            st = None
        if st is None or not stat.S_ISREG(st.st_mode):  # (a free directory, a link)
            raise _not_found(name, directory)
        if st.st_size < size:
            raise _too_small(name, st.st_size, size)
        if self._entries:
            key = (directory, st.st_ino)
            with self._lock:  # (under it, no other thread closes the entry while it is checked and viewed)
                entry = self._entries.get(key)
                if entry is not None:
                    if _same_file(st, os.fstat(entry.fd)) and size <= entry.size:
                        del self._entries[key]  # most recently used: to the end
                        self._entries[key] = entry
                        return memoryview(entry.mm)[:size]
                    self._pop(key)  # another file now has that inode number
            if entry is not None:
                entry.close()
        return self._map(directory, path, name, size)

    def _map(self, directory: str, path: str, name: str, size: int) -> memoryview | mmap.mmap:
        try:
            fd = os.open(path, os.O_RDONLY | _OPEN_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            raise _not_found(name, directory) from None
        keep, evicted = False, []
        try:
            st = os.fstat(fd)  # (the file opened: the name may have moved on since the stat)
            if not stat.S_ISREG(st.st_mode):
                raise _not_found(name, directory)
            if st.st_size < size:
                raise _too_small(name, st.st_size, size)
            key = (directory, st.st_ino)
            with self._lock:
                again = self._seen.pop(key, False) is None
                if not again:
                    self._seen[key] = None
                    while len(self._seen) > SEEN_PER_ENTRY * self.ENTRIES:
                        del self._seen[next(iter(self._seen))]
            if not again or st.st_size > self.max_bytes:  # not kept: map what is read, for this get
                return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, **_MMAP_KWARGS)
            mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ, **_MMAP_KWARGS)
            entry = _Mapped(mm, fd, st.st_size, st.st_size)
            view = memoryview(mm)[:size]
            with self._lock:
                evicted = self._insert(key, entry)
            keep = entry not in evicted  # (another thread kept its own meanwhile: the view keeps ours)
        finally:
            if not keep:
                os.close(fd)
        for e in evicted:
            if e is not entry:
                e.close()
        return view


_maps = _MapCache()
_reads = _ReadCache()


#: Called by :func:`drop_mappings` too: the slots' mappings (:mod:`omni_actors.connectors.slots`).
_drop_hooks: list = []


def drop_mappings() -> None:
    """Close every mapping this process keeps (to write, :class:`_MapCache`, and to
    read, :class:`_ReadCache`; and its slots, which it forgets without unlinking
    them), e.g. before unmounting a segment directory."""
    _maps.clear()
    _reads.clear()
    for hook in _drop_hooks:
        hook()


#: Called by :func:`drop_unlinked_mappings` too (the slots'); each returns how many it closed.
_drop_unlinked_hooks: list = []


def drop_unlinked_mappings() -> int:
    """Close this process's mappings of segments unlinked meanwhile (slots' included); how many."""
    return _maps.drop_unlinked() + _reads.drop_unlinked() + sum(hook() for hook in _drop_unlinked_hooks)


def _after_fork_in_child() -> None:
    _maps.after_fork()
    _reads.after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)
