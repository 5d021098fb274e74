"""Segment recycling: a released segment kept for a later ``put`` of its size on its node.

A segment's file has the size class of its payload
(:func:`size_class`: a page at least, then four classes per power of two, so
at most 25% over; the tail is a hole that takes no memory until written); the
ref keeps the payload size and readers map only that. Writing fresh tmpfs
pages costs a page fault and zeroing per page (per 4 KiB where ``/dev/shm``
has no huge pages: ~2.7 GB/s here), so a released segment whose owner knows
that nobody reads it any more can be *recycled* (``release(..., recycle=True)``,
:func:`~omni_actors.connectors.shm.release_segments`): it is renamed into its
prefix's free directory ``<dir>/<prefix>free/`` (as ``<class hex>-<inode
hex>``, its mtime set to the release time) instead of unlinked, and a later
``put`` of the same size class on that node claims it by renaming it to its
new in-use name (a rename is atomic: of two processes claiming one free
segment exactly one wins) and overwrites it, its pages already allocated. A
producer first tries the free names of the inodes of that class it keeps
mapped (:mod:`omni_actors.connectors.mappings`: it usually gets its own
segments back), one ``rename`` each, at most
:data:`~omni_actors.connectors.mappings.GUESSES`; failing that, it takes a
name from its listing of the free directory, per class, which it lists again
only when the directory changed (its mtime and size; one ``stat`` per miss) or
the listing is over :data:`RELIST_S` old. (Names of the older form
``<class>-<inode>-<random>`` are claimed from listings too.) Free segments are
bounded: a release keeps one only while the prefix's free segments stay under
:func:`free_budget` bytes and :data:`MAX_FREE_SEGMENTS`; the node's data
service unlinks free segments idle longer than :func:`free_idle_s` and trims
to the budget (:func:`trim_free_segments`); a ``put`` that finds the tmpfs full
unlinks the prefix's free segments and tries once more;
:func:`~omni_actors.connectors.shm.sweep_segments` removes them with the rest.
Refs are never recycled by default: the caller must know that no process still
reads the segment through a mapping made before (a reader that maps it *after*
the release finds its name gone, as for an unlink).

Defaults: a free segment unclaimed for 2 s is unlinked
(``$OMNI_ACTORS_SHM_FREE_IDLE_S``); a prefix keeps at most half its tmpfs, 1 GiB
at most, of free segments (``$OMNI_ACTORS_SHM_FREE_BYTES``; 0: no recycling)
and 1024 of them. The mappings producers and consumers keep of segments (to
write and read them again) are in :mod:`omni_actors.connectors.mappings`.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import threading
import time

from omni_actors.connectors.base import _unlink_in, segment_dir
from omni_actors.connectors.mappings import _maps

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
_IN_USE_TAIL = re.compile(r"[0-9a-f]{16}")  # an in-use segment is named <prefix><16 hex digits>
#: A free segment is named <class>-<inode> (hex); <class>-<inode>-<random> before (still read).
_FREE_NAME = re.compile(r"([0-9a-f]+)-([0-9a-f]+)(?:-[0-9a-f]+)?")


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


def _free_name(cls: int, ino: int) -> str:
    """The name of a free segment of size class ``cls`` whose file is inode ``ino``
    (parsed back by :func:`_free_class` and :func:`_free_ino`)."""
    return f"{cls:x}-{ino:x}"


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


def _claim(prefix: str, directory: str, cls: int, name: str) -> int | None:
    """Rename a free segment of class ``cls`` of ``prefix`` to ``name``: the inode
    number its free name gave, or None if there was none (or its name gave none).

    First the free names of the inodes of that class this process keeps mapped
    (:meth:`~omni_actors.connectors.mappings._MapCache.guesses`: a producer
    usually gets its own segments back), one ``rename`` each; then the names in
    this process's listing of the free directory (listed again if it changed)."""
    fdir, target = free_dir(prefix, directory), f"{directory}/{name}"
    for ino in _maps.guesses(directory, cls):
        try:
            os.rename(f"{fdir}/{_free_name(cls, ino)}", target)
            _claimed_now(target)
            return ino
        except FileNotFoundError:
            pass  # in use (not released yet), claimed by another producer, trimmed, or no free directory
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
            os.rename(os.path.join(fdir, cand), target)
            _claimed_now(target)
            return _free_ino(cand)
        except FileNotFoundError:
            continue  # another producer claimed it first, or the trim took it


def _claimed_now(path: str) -> None:
    """A claimed segment's age (its mtime, which the reaper goes by) starts now: a rename
    keeps the time it was released, and a put through a kept mapping does not touch it, so
    a segment left free longer than ``reap_after_s`` was reaped as soon as it was claimed
    (a code review; only where the free segments are kept that long)."""
    try:
        os.utime(path)
    except FileNotFoundError:
        pass  # (reaped or swept in between: the put finds out)


def _after_fork_in_child() -> None:
    global _views_lock
    _views_lock = threading.Lock()  # (another thread may have held it at the fork)


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
    fdir = free_dir(prefix, directory)
    held = usage.get(fdir)
    if held is None:
        held = usage[fdir] = list(_free_usage_in(fdir))
    if held[0] >= MAX_FREE_SEGMENTS or held[1] + size > budget:
        return False
    try:
        os.utime(path)  # the idle trim counts from now
    except OSError:
        return False
    # Named after its inode, so that a producer that keeps it mapped claims it without a listing
    # (its old name is gone by then). Only one file has that inode number at a time in normal
    # operation; after a wrap of the counter, renaming over a namesake would unlink a free segment:
    # no reader's bytes (free segments are read by nobody).
    target = os.path.join(fdir, _free_name(size, st.st_ino))
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
