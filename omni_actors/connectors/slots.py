"""Slots: segment files a producer writes again and again, with no system call per ``put``.

A recycled segment (:mod:`omni_actors.connectors.recycling`) still costs a
``rename`` to claim, a ``rename`` to release and a ``stat`` and ``fstat`` per
``get``: at 1 MB those system calls and the cache lines they touch cost as much
as the copy itself. A *slot* is a segment file that keeps its name for its
whole life and says in a header who may read it:

- the file ``<prefix>slot-<16 hex>`` holds a 64-byte header (:data:`WORDS`
  little-endian u64 words) in its first page and the payload from
  :data:`HEADER` on (page-aligned, so every field offset keeps its alignment);
- the producing process keeps a writable mapping of each slot it made; a
  ``put`` picks one of its free slots of the payload's size class (the one it
  wrote last first: its lines are still in the cache), counts its
  *generation* up and copies the payload in. The ref's location is
  ``<file name>@<generation>``;
- a ``get`` maps the file once per process (kept, looked up by name: names
  are never reused) and reads the payload in place if the header still shows
  that generation in use; otherwise the segment was released (or reaped) and
  the ``get`` fails as for a segment that is gone;
- a release writes the generation into the header (``pwrite``; the file is
  free again for its producer's next ``put``), or, without ``recycle``
  (readers may still hold arrays on it), marks it retired and unlinks it: the
  arrays read keep their pages, and the producer drops its mapping.

Who writes which word: the producer the generation and the claim time;
releasers the released generation and its time, or the retired generation.
Each is one aligned 8-byte store, so no word is seen half written, and no
word has two writers racing for one generation: a late second release of a
generation its producer has already claimed again writes a value that no
longer matches (the slot is then kept in use until the reaper's age limit,
never handed out twice).

Lifetimes: a producer unlinks its own free slots idle longer than
``free_idle_s`` (a thread, as the data service trims recycled segments) and
keeps at most ``$OMNI_ACTORS_SHM_SLOT_BYTES`` of them (default: the free
budget of the node's tmpfs, :func:`~omni_actors.connectors.recycling.free_budget`;
0: no slots, every ``put`` takes a segment of its own as before). The node's
data service reaps slots in use longer than its ``reap_after_s`` and the free
ones of producers that exited (:func:`reap_slots`); anyone who unlinks a slot
marks it retired first, so a process that kept it mapped stops using it.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import struct
import threading
import time

import numpy as np
import structlog

from omni_actors.connectors.base import FieldLayout, _unlink_in, pwrite_all
from omni_actors.connectors.inline import ConnectorError, pieces
from omni_actors.connectors.mappings import _OPEN_FLAGS, DEFAULT_READ_CACHE_BYTES, PAGE, READ_CACHE_ENV, \
    SegmentNotFound, _Cache, _drop_hooks, _drop_unlinked_hooks, _Mapped, _not_found, _too_small, write_payload
from omni_actors.connectors.recycling import free_budget, free_idle_s, size_class

log = structlog.get_logger(__name__)

SLOT_BYTES_ENV = "OMNI_ACTORS_SHM_SLOT_BYTES"  #: most bytes of slots one producer keeps (0: no slots)
#: A producer claims a free slot only within this many ``free_idle_s`` of its release (its
#: own trim takes it at 1); the data service unlinks free slots idle for TRIM_AFTER of them
#: (those of a producer that cannot trim: stopped, or its thread stuck) without asking it.
CLAIM_WITHIN, TRIM_AFTER = 2, 4
SLOT_READ_ENTRIES = 256  #: most slot files a consumer keeps mapped
HEADER = max(PAGE, 4096)  #: bytes before the payload
TAG = "slot-"
MAGIC = 0x31746F6C732D616F  # b"oa-slot1", little-endian
#: The header's u64 words: the magic, the generation claimed last, the generation released last
#: and when (ns since the epoch), the generation retired, when the last claim was, the
#: producer's pid and start time (clock ticks after boot, from /proc), the payload capacity.
W_MAGIC, W_GEN, W_RELEASED, W_RELEASED_NS, W_RETIRED, W_CLAIMED_NS, W_PID, W_START = range(8)
WORDS = 8
_HEAD = struct.Struct(f"<{WORDS}Q")
_WORD = struct.Struct("<Q")
_TAIL = re.compile(r"slot-[0-9a-f]{16}")

FREE, IN_USE, RETIRED = "free", "in use", "retired"


def is_slot(name: str) -> bool:
    """Whether segment file ``name`` is a slot (``<prefix>slot-<16 hex>``)."""
    return len(name) > 21 and "/" not in name and _TAIL.fullmatch(name, len(name) - 21) is not None


def split(location: str) -> tuple[str, int] | None:
    """``(file name, generation)`` of a slot location ``<name>@<gen>``; None for a plain segment name.

    Raises:
        ConnectorError: it has an ``@`` but is no slot location.
    """
    name, at, gen = location.rpartition("@")
    if not at:
        return None
    if not is_slot(name) or not gen.isascii() or not gen.isdigit() or len(gen) > 19:
        raise ConnectorError(f"malformed slot location {location!r}")
    return name, int(gen)


def slot_budget(directory: str) -> int:
    """Bytes of slots one producing process may keep in ``directory``:
    ``$OMNI_ACTORS_SHM_SLOT_BYTES``, else (unset, or not an integer >= 0: logged
    once) :func:`~omni_actors.connectors.recycling.free_budget` of it."""
    raw = os.environ.get(SLOT_BYTES_ENV)
    if raw:
        if raw.isascii() and raw.isdigit():
            return int(raw)
        if raw not in _warned:
            _warned.add(raw)
            log.warning("shm_slot_bytes_invalid", value=raw,
                        reason=f"${SLOT_BYTES_ENV} must be an integer >= 0 (bytes; 0: no slots): "
                               "the default budget applies")
    budget = _budgets.get(directory)
    if budget is None:
        budget = _budgets[directory] = free_budget(directory)
    return budget


_budgets: dict[str, int] = {}
_warned: set[str] = set()


def _start_time(pid: int) -> int:
    """Process ``pid``'s start time in clock ticks after boot (0 when unknown)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


_own_start: dict[int, int] = {}  # this process's start time, by pid (a forked child has its own)


def _alive(pid: int, start: int) -> bool:
    """Whether the process that wrote ``pid``/``start`` into a header still runs
    (its pid not taken by another process since: the start times agree)."""
    now = _start_time(pid) if pid > 0 else 0
    return now != 0 and (start == 0 or now == start)


# -- the producer -------------------------------------------------------------------------------

def _words(mm: mmap.mmap) -> memoryview:
    """The header's words as a u64 memoryview: an item is read and written with
    one aligned 8-byte load or store (never seen half written by another process)."""
    return memoryview(mm)[:WORDS * 8].cast("Q")


class _Slot:
    """One slot this process made: its name, the writable mapping of its header
    and ``capacity`` payload bytes (its size class, all backed by pages), and the
    header words."""

    __slots__ = ("name", "path", "cls", "capacity", "mm", "hdr")

    def __init__(self, name: str, path: str, cls: int, capacity: int, mm: mmap.mmap) -> None:
        self.name, self.path, self.cls, self.capacity, self.mm = name, path, cls, capacity, mm
        self.hdr: memoryview | None = _words(mm)  # (None once closed)

    def free(self) -> bool:
        return state(self.hdr) == FREE

    def retired(self) -> bool:
        return state(self.hdr) == RETIRED

    def close(self, unlink: bool) -> None:
        """Forget the slot; with ``unlink``, mark it retired and unlink its file first."""
        if unlink:
            self.hdr[W_RETIRED] = self.hdr[W_GEN]
            _unlink_slot(os.path.dirname(self.path), self.name)
        self.hdr.release()
        self.hdr = None
        try:
            self.mm.close()
        except (BufferError, ValueError):
            pass  # (arrays on it: unmapped with the last of them)


class SlotStore:
    """This process's slots, by (directory, prefix, size class); the one written
    last at the end of each list."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._slots: dict[tuple[str, str, int], list[_Slot]] = {}
        self._lock = threading.Lock()
        self._held = 0
        self._thread: threading.Thread | None = None

    def after_fork(self) -> None:
        """In a forked child: the parent's slots are not the child's."""
        slots = [s for group in self._slots.values() for s in group]
        self._reset()
        for s in slots:
            s.close(unlink=False)

    def put(self, prefix: str, directory: str, size: int, layout: tuple[FieldLayout, ...],
            arrays: list[np.ndarray]) -> str | None:
        """Copy the payload into a free slot of this process (made when there is
        none and the budget allows); its location ``<name>@<gen>``, or None when
        slots are off, over the budget, or cannot be made (a full tmpfs)."""
        cls = size_class(size)
        key = (directory, prefix, cls)
        with self._lock:
            group = self._slots.get(key)
            slot = None
            if group:
                fresh_after = time.time_ns() - CLAIM_WITHIN * free_idle_s() * 1e9
                for i in range(len(group) - 1, -1, -1):
                    s = group[i]
                    if s.capacity >= size and s.free():
                        if s.hdr[W_RELEASED_NS] >= fresh_after:
                            slot = group.pop(i)
                            break
                        continue  # (free too long: the data service may be unlinking it; our trim takes it)
                    if s.retired():  # (released without recycling and unlinked: its pages go with our
                        group.pop(i)  # mapping, and a slot made next reuses them while they are in the cache)
                        s.close(unlink=False)
                        self._held -= HEADER + s.capacity
            if slot is not None:
                gen = slot.hdr[W_GEN] + 1
                slot.hdr[W_CLAIMED_NS] = time.time_ns()
                slot.hdr[W_GEN] = gen
                group.append(slot)
            else:
                gen = 1
                if self._held + HEADER + cls <= slot_budget(directory):
                    slot = self._make(prefix, directory, cls, layout, arrays)
                if slot is not None:
                    self._held += HEADER + cls
                    self._slots.setdefault(key, []).append(slot)
                    if self._thread is None:
                        self._thread = threading.Thread(target=self._watch, name="shm-slots", daemon=True)
                        self._thread.start()
        if slot is None:
            return None
        if gen > 1:
            try:
                write_payload(slot.mm, HEADER, size, layout, arrays)
            except BaseException:
                slot.hdr[W_RELEASED] = gen  # (free again)
                raise
        return f"{slot.name}@{gen}"

    def _make(self, prefix: str, directory: str, cls: int, layout: tuple[FieldLayout, ...],
              arrays: list[np.ndarray]) -> _Slot | None:
        """A new slot of ``cls`` payload bytes (any payload of its size class fits),
        holding this payload as generation 1 (in use). The payload is written with
        ``pwrite`` and the rest allocated with ``fallocate`` (every page once, a
        full tmpfs an error here, not a SIGBUS later), then the file is mapped."""
        capacity = cls
        name = f"{prefix}{TAG}{os.urandom(8).hex()}"
        path = f"{directory}/{name}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _OPEN_FLAGS, 0o600)
        except OSError:
            return None  # (the caller's own put says what is wrong with the directory)
        try:
            os.ftruncate(fd, HEADER + capacity)
            pid = os.getpid()
            words = [0] * WORDS
            words[W_MAGIC], words[W_GEN], words[W_CLAIMED_NS] = MAGIC, 1, time.time_ns()
            start = _own_start.get(pid)
            if start is None:
                start = _own_start[pid] = _start_time(pid)
            words[W_PID], words[W_START] = pid, start
            pwrite_all(fd, memoryview(_HEAD.pack(*words)), 0)
            pos = HEADER
            for piece in pieces(layout, arrays):
                data = memoryview(piece).cast("B")
                pwrite_all(fd, data, pos)
                pos += data.nbytes
            if HEADER + capacity > pos:  # (the class's tail: pages to allocate, not a hole)
                os.posix_fallocate(fd, pos, HEADER + capacity - pos)
            # (not populated: a slot released unrecycled never pays for page tables; a reused one
            # fills them on its first write through the mapping)
            mm = mmap.mmap(fd, HEADER + capacity, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            _unlink_in(directory, name)
            if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                return None
            raise
        except BaseException:
            os.close(fd)
            _unlink_in(directory, name)
            raise
        os.close(fd)
        return _Slot(name, path, cls, capacity, mm)

    def trim(self, idle_s: float, now_ns: int | None = None) -> int:
        """Unlink this process's free slots idle longer than ``idle_s`` (all free ones
        when it is negative) and forget the retired ones or those whose file is
        gone; how many were dropped."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        dropped: list[tuple[_Slot, bool]] = []
        with self._lock:
            for key, group in list(self._slots.items()):
                keep = []
                for s in group:
                    if s.retired():
                        dropped.append((s, False))
                    elif s.free() and (idle_s < 0 or now_ns - int(s.hdr[W_RELEASED_NS]) > idle_s * 1e9):
                        dropped.append((s, True))
                    else:
                        keep.append(s)
                if keep:
                    self._slots[key] = keep
                else:
                    del self._slots[key]
            for s, _ in dropped:
                self._held -= HEADER + s.capacity
        for s, unlink in dropped:
            s.close(unlink)
        return len(dropped)

    def _gone(self) -> None:
        """Forget (as retired) slots whose file someone unlinked without marking them."""
        with self._lock:
            slots = [s for group in self._slots.values() for s in group]
        for s in slots:
            try:
                if os.stat(s.path, follow_symlinks=False).st_nlink:
                    continue
            except OSError:
                pass
            with self._lock:
                if s.hdr is not None:
                    s.hdr[W_RETIRED] = s.hdr[W_GEN]

    def _watch(self) -> None:
        while True:
            time.sleep(max(0.05, min(1.0, free_idle_s() / 4)))
            with self._lock:
                if self._thread is not threading.current_thread():
                    return  # (a forked child reset the store)
            try:
                self._gone()
                self.trim(free_idle_s())
            except Exception:  # noqa: BLE001 - the watcher outlives any one bad pass
                log.warning("shm_slots_trim_failed", exc_info=True)
            with self._lock:
                if self._thread is not threading.current_thread():
                    return
                if not self._slots:
                    self._thread = None
                    return


_store = SlotStore()


def put(prefix: str, directory: str, size: int, layout: tuple[FieldLayout, ...],
        arrays: list[np.ndarray]) -> str | None:
    """See :meth:`SlotStore.put` (this process's store)."""
    return _store.put(prefix, directory, size, layout, arrays)


def drop_free_slots() -> int:
    """Unlink every free slot of this process (a full tmpfs wants its pages back); how many."""
    return _store.trim(-1.0)


# -- readers ------------------------------------------------------------------------------------

class _SlotCache(_Cache):
    """Mappings of slot files, by (directory, file name)."""

    def forget(self, directory: str, name: str) -> None:
        """Close the mapping kept of slot ``name``, if any (this process unlinks it)."""
        with self._lock:
            entry = self._pop((directory, name))
        if entry is not None:
            entry.close()


class _SlotReads(_SlotCache):
    """Read-only mappings of whole slot files, by (directory, file name): a slot's
    name is never reused, so no ``stat`` is needed to trust the entry; its
    header says whether the generation asked for is still there. A slot read
    at its first generation is mapped for that ``get`` alone (most are never
    written again: unlinked after one request), from the second on it is kept."""

    ENV = READ_CACHE_ENV
    DEFAULT_BYTES = DEFAULT_READ_CACHE_BYTES
    ENTRIES = SLOT_READ_ENTRIES
    THREAD = "shm-slot-reads"

    def holds(self, directory: str, name: str) -> bool:
        """Whether a mapping of slot ``name`` is kept here."""
        with self._lock:
            return (directory, name) in self._entries

    def view(self, directory: str, name: str, gen: int, size: int) -> memoryview:
        """The payload's first ``size`` bytes of generation ``gen`` of slot ``name``, read-only.

        Raises:
            SegmentNotFound: that generation was released, retired or reaped.
            ConnectorError: the slot holds fewer than ``size`` bytes.
        """
        key = (directory, name)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                del self._entries[key]
                self._entries[key] = entry  # most recently used
                return _payload(entry.mm, entry.size, directory, name, gen, size)
        try:
            fd = os.open(f"{directory}/{name}", os.O_RDONLY | _OPEN_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            raise _not_found(name, directory) from None
        mm = None
        try:
            length = os.fstat(fd).st_size
            if length < HEADER:
                raise _not_found(name, directory)
            mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            view = _payload(mm, length, directory, name, gen, size)
        except BaseException:
            if mm is not None:
                mm.close()
            os.close(fd)
            raise
        if gen == 1:  # (a slot's first payload: kept only once it is written again, as recycled segments)
            os.close(fd)
            return view
        with self._lock:
            evicted = self._insert(key, _Mapped(mm, fd, length, length))
        for e in evicted:
            e.close()
        return view


def _check(h: tuple[int, ...] | None, length: int, directory: str, name: str, gen: int, size: int) -> None:
    """Raises SegmentNotFound unless header ``h`` shows generation ``gen`` in use, and
    ConnectorError if a file of ``length`` bytes holds fewer than ``size`` payload bytes."""
    if h is None or h[W_MAGIC] != MAGIC or h[W_GEN] != gen or state(h) != IN_USE:
        raise SegmentNotFound(f"shared-memory slot {name}@{gen} not found in {directory}: already "
                              "released, or reaped/swept")
    if HEADER + size > length:
        raise _too_small(f"{name}@{gen}", length - HEADER, size)


def _payload(mm: mmap.mmap, length: int, directory: str, name: str, gen: int, size: int) -> memoryview:
    _check(_HEAD.unpack_from(mm, 0), length, directory, name, gen, size)
    return memoryview(mm)[HEADER:HEADER + size]


_reads = _SlotReads()


def read(directory: str, name: str, gen: int, size: int) -> memoryview:
    """See :meth:`_SlotReads.view` (this process's mappings)."""
    return _reads.view(directory, name, gen, size)


def check_unlinked_every(seconds: float) -> None:
    """Drop this process's mappings of slots unlinked meanwhile (read mappings, and the
    header pages a releaser maps, each of which keeps the whole file's pages) every
    ``seconds`` (default MAP_CHECK_S): a data service, which maps the slots it serves
    and releases, lets go of those a producer gave back within that time (a put on a
    full tmpfs waits for it)."""
    _reads.check_s = _headers.check_s = seconds


def read_kept(directory: str, name: str, gen: int, size: int) -> memoryview | None:
    """As :func:`read`, but None where that would map the slot for this read alone (its
    first generation, not mapped here yet): for a reader that can copy the bytes out
    instead (the data service, :func:`open_payload`), cheaper than a mapping's page faults.

    Raises:
        as :meth:`_SlotReads.view`.
    """
    if (gen == 1 and not _reads.holds(directory, name)) or _reads.max_bytes < HEADER + size:
        return None  # (nor where the mapping could not be kept: the read cache is off or too small)
    return _reads.view(directory, name, gen, size)


def open_payload(directory: str, name: str, gen: int, size: int) -> int:
    """A descriptor open read-only on slot ``name`` while its header shows generation
    ``gen`` in use with at least ``size`` payload bytes (from :data:`HEADER` on), for a
    reader that copies the bytes out rather than mapping them; the caller closes it.

    Raises:
        SegmentNotFound: that generation was released, retired or reaped.
        ConnectorError: the slot holds fewer than ``size`` bytes.
    """
    try:
        fd = os.open(f"{directory}/{name}", os.O_RDONLY | _OPEN_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        raise _not_found(name, directory) from None
    try:
        raw = os.pread(fd, _HEAD.size, 0)
        _check(_HEAD.unpack(raw) if len(raw) == _HEAD.size else None, os.fstat(fd).st_size,
               directory, name, gen, size)
        return fd
    except BaseException:
        os.close(fd)
        raise


# -- releasing, listing, reaping ----------------------------------------------------------------

def header(directory: str, name: str) -> tuple[int, ...] | None:
    """Slot ``name``'s header words, or None if it is gone, could not be read, or is no slot."""
    try:
        return read_header(directory, name)
    except OSError:
        return None


def read_header(directory: str, name: str) -> tuple[int, ...] | None:
    """Slot ``name``'s header words, or None if the file has no slot header (too short, or
    not a slot's magic number).

    Raises:
        OSError: it could not be read (gone, or no file descriptor to spare: the caller must
            not take that for "no header").
    """
    fd = os.open(f"{directory}/{name}", os.O_RDONLY | _OPEN_FLAGS)
    try:
        raw = os.pread(fd, _HEAD.size, 0)
    finally:
        os.close(fd)
    if len(raw) < _HEAD.size:
        return None
    h = _HEAD.unpack(raw)
    return h if h[W_MAGIC] == MAGIC else None


def state(h: tuple[int, ...] | memoryview) -> str:
    """:data:`FREE`, :data:`IN_USE` or :data:`RETIRED`, from a slot's header words
    (a generation's release or retirement counts only while it is the slot's last)."""
    gen = h[W_GEN]
    if gen and h[W_RETIRED] == gen:
        return RETIRED
    return FREE if h[W_RELEASED] == gen else IN_USE


class _Headers(_Mapped):
    """A kept writable mapping of a slot's header page, with its words."""

    __slots__ = ("words",)

    def __init__(self, mm: mmap.mmap, fd: int) -> None:
        super().__init__(mm, fd, PAGE, 0)
        self.words = _words(mm)

    def close(self) -> None:
        self.words.release()
        super().close()


class _SlotHeaders(_SlotCache):
    """Writable mappings of the header pages of slots a process released, by
    (directory, file name): a request owner releases the same few slots again
    and again, with two stores and no system call."""

    ENV = READ_CACHE_ENV
    DEFAULT_BYTES = DEFAULT_READ_CACHE_BYTES
    ENTRIES = SLOT_READ_ENTRIES
    THREAD = "shm-slot-headers"

    def release(self, directory: str, name: str, gen: int, recycle: bool) -> bool:
        key = (directory, name)
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                if recycle:
                    del self._entries[key]
                    self._entries[key] = entry
                    return _release_in(entry.words, gen, True)
                # (taken out now, so that neither the watcher nor another release closes it under
                # us: a review's release raised "operation forbidden on released memoryview")
                self._pop(key)
        if entry is None:
            try:
                fd = os.open(f"{directory}/{name}", os.O_RDWR | _OPEN_FLAGS)
            except OSError:
                return False
            try:
                if os.fstat(fd).st_size < HEADER:
                    raise OSError(errno.EINVAL, "not a slot")
                entry = _Headers(mmap.mmap(fd, PAGE, flags=mmap.MAP_SHARED,
                                           prot=mmap.PROT_READ | mmap.PROT_WRITE), fd)
            except (OSError, ValueError):
                os.close(fd)
                return False
            if entry.words[W_MAGIC] != MAGIC:
                entry.close()
                return False
            if recycle:
                with self._lock:
                    done = _release_in(entry.words, gen, True)
                    evicted = self._insert(key, entry)
                for e in evicted:
                    e.close()
                return done
        with self._lock:
            done = _release_in(entry.words, gen, False)
            # (unlinked only if the generation retired is still the slot's last: another release
            # of it may have recycled it meanwhile, and its producer put the next one into it)
            done = done and entry.words[W_GEN] == gen
        entry.close()
        if done:
            _unlink_slot(directory, name)
        return done


def _unlink_slot(directory: str, name: str) -> bool:
    """Unlink slot file ``name``, closing first this process's mappings of it, to read it
    and of its header page to release it (kept, each would hold the whole file's pages
    until the next drop of unlinked mappings: a data service maps the slots it serves;
    a review's put on a full tmpfs failed on its own releaser's header page)."""
    _reads.forget(directory, name)
    _headers.forget(directory, name)
    return _unlink_in(directory, name)


def _release_in(h: memoryview, gen: int, recycle: bool) -> bool:
    if h[W_GEN] != gen or state(h) != IN_USE:
        return False  # released before, or a generation its producer has moved past
    if recycle:
        h[W_RELEASED_NS] = time.time_ns()
        h[W_RELEASED] = gen  # (last: its producer may claim it from now on)
    else:
        h[W_RETIRED] = gen
    return True


_headers = _SlotHeaders()


def release(directory: str, location: tuple[str, int], *, recycle: bool) -> bool:
    """Release generation ``gen`` of slot ``name`` (``location``): free for its
    producer's next ``put`` with ``recycle``, else retired and unlinked (arrays
    read from it keep their pages). Whether that generation was still in use."""
    name, gen = location
    return _headers.release(directory, name, gen, recycle)


def retire_and_unlink(directory: str, name: str, gen: int | None = None) -> bool:
    """Mark slot ``name`` retired and unlink it (sweeps, the reaper); with ``gen``,
    only while that generation is still its last one."""
    h = header(directory, name)
    if h is not None:
        if gen is not None and h[W_GEN] != gen:
            return False
        try:
            fd = os.open(f"{directory}/{name}", os.O_RDWR | _OPEN_FLAGS)
            try:
                os.pwrite(fd, _WORD.pack(h[W_GEN]), W_RETIRED * 8)
                # Retired at that generation, its producer no longer claims it; unless it had
                # claimed the next one meanwhile (released just then): that one is not ours to unlink.
                if gen is not None and _WORD.unpack(os.pread(fd, 8, W_GEN * 8))[0] != gen:
                    return False
            finally:
                os.close(fd)
        except OSError:
            pass
    return _unlink_slot(directory, name)


def reap_slots(names: list[str], directory: str, *, reap_after_s: float | None = None,
               idle_s: float | None = None, now: float | None = None) -> tuple[list[tuple[str, float]], int]:
    """The data service's pass over slot files ``names``: retired ones are unlinked,
    and free ones of producers that exited or idle for :data:`TRIM_AFTER` times
    ``idle_s`` (default :func:`free_idle_s`; a running producer trims its own
    at ``idle_s`` and claims none idle past :data:`CLAIM_WITHIN` times it);
    with ``reap_after_s``, those in use for longer are retired and unlinked
    (reaped).

    A file with no slot header (its producer killed while making it) is unlinked once
    untouched for :data:`TRIM_AFTER` times ``idle_s``, as a stale free slot.

    Returns:
        ``([(name, age in use, s), ...] reaped, trimmed count)``.
    """
    now_ns = int((time.time() if now is None else now) * 1e9)
    stale_ns = TRIM_AFTER * (free_idle_s() if idle_s is None else idle_s) * 1e9
    reaped, trimmed = [], 0
    for name in names:
        try:
            h = read_header(directory, name)
        except OSError:  # (gone, or unreadable now, e.g. no file descriptor left: not judged)
            continue
        if h is None:
            # No slot header: a producer killed while it made the file (or a stray file under a
            # slot's name): gone once it has been untouched that long (a review: such a file was
            # never reaped, trimmed or counted, only swept at the system's stop)
            try:
                untouched_ns = now_ns - os.stat(f"{directory}/{name}").st_mtime_ns
            except OSError:
                continue
            if untouched_ns > stale_ns:
                trimmed += _unlink_slot(directory, name)
            continue
        st = state(h)
        if st == RETIRED:
            trimmed += _unlink_slot(directory, name)
        elif st == IN_USE:
            age = (now_ns - h[W_CLAIMED_NS]) / 1e9
            if reap_after_s is not None and age > reap_after_s and retire_and_unlink(directory, name, h[W_GEN]):
                reaped.append((name, age))
        elif now_ns - h[W_RELEASED_NS] > stale_ns or not _alive(h[W_PID], h[W_START]):
            trimmed += retire_and_unlink(directory, name, h[W_GEN])
    return reaped, trimmed


def usage(names: list[str], directory: str) -> dict[str, list[int]]:
    """``{state: [slots, bytes]}`` of slot files ``names`` (bytes: their payload capacity)."""
    out: dict[str, list[int]] = {FREE: [0, 0], IN_USE: [0, 0], RETIRED: [0, 0]}
    for name in names:
        h = header(directory, name)
        if h is None:
            continue
        try:
            size = os.stat(f"{directory}/{name}").st_size - HEADER
        except OSError:
            continue
        counts = out[state(h)]
        counts[0] += 1
        counts[1] += size
    return out


def forget_slots() -> None:
    """Close every mapping of slots this process keeps: its own (the free ones are
    unlinked; those in use are handed to the data service, which unlinks them
    once released, as the slots of a producer that exited) and those it read
    or released."""
    with _store._lock:
        own = [s for group in _store._slots.values() for s in group]
        _store._slots.clear()
        _store._held = 0
    for s in own:
        free = s.free()
        if not free:
            s.hdr[W_PID] = 0
        s.close(unlink=free)
    _reads.clear()
    _headers.clear()


def _drop_unlinked() -> int:
    """Close the mappings of slots unlinked meanwhile (this process's own retired
    ones, and those it read or released); how many."""
    _store._gone()
    return _store.trim(float("inf")) + _reads.drop_unlinked() + _headers.drop_unlinked()


_drop_hooks.append(forget_slots)
_drop_unlinked_hooks.append(_drop_unlinked)


def _after_fork_in_child() -> None:
    _store.after_fork()
    _reads.after_fork()
    _headers.after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


__all__ = ["HEADER", "SLOT_BYTES_ENV", "SlotStore", "drop_free_slots", "header", "is_slot", "put",
                      "read", "reap_slots", "release", "retire_and_unlink", "split", "state", "usage"]
