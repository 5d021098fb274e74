"""Where a replica's threads were when it went silent.

A call that holds the Python interpreter (one long C call that keeps the GIL: a stage
processor's ``sum(range(5 * 10**8))``, a stuck extension) stops everything else in its
replica's process, heartbeats included: its pool takes it for hung and kills it, and
nothing said what it was doing (trial CR: a processor took its stage down and was named
nowhere). The replica arms :mod:`faulthandler`'s watchdog (a C thread that runs without
the interpreter) at each heartbeat; when a heartbeat is :data:`DUMP_AHEAD_INTERVALS`
intervals short of the silence its pool tolerates and has not come, the watchdog writes
every thread's stack to :func:`dump_path` (``stacks/<pid>.txt`` in the system's
``processes.ipc_dir``). A replica whose stage runs a processor of the user's (on threads:
``actors.processor_threads``) is watched closer, :data:`PROCESSOR_DUMP_AFTER_INTERVALS`,
since a pool takes a replica with work for silent 1.5 intervals after its last heartbeat
(trial CS: at the demo's settings most isolations came before a dump), and each of those
threads notes the task its call is for (:class:`CallMarks`, ``<pid>.calls``). A pool that
isolates a replica of its own host as silent reads both (:func:`where_silent`): the reason
(``status``, the ``replica_isolated`` log line) names the processor call it was in, the log
line carries the stacks, and the task whose processor call held the interpreter counts it
as a crash by it (trial CS: uncounted, as a lost host's tasks are, one such request took 11
replicas down in turn and its stage out for 5 minutes; see :func:`culprits` for which one).
The files go when the process has ended. A replica stopped (SIGSTOP) or killed writes none: its watchdog stops with it.
"""

from __future__ import annotations

import faulthandler
import os
import re
import threading
import time

from omni_actors.actors.supervision import LATE_WITH_WORK_INTERVALS
from omni_actors.system.processes import ENV_SYSTEM_ID, ipc_dir

__all__ = ["DUMP_AHEAD_INTERVALS", "CallMarks", "StackDumps", "dump_path", "remove_dump", "where_silent"]

#: The watchdog writes this many heartbeat intervals before the pool's silence limit
#: (``missed_heartbeats`` x ``heartbeat_interval_s``): the stacks are on disk when the pool
#: looks (its verdict comes after the limit, at a tick of its own).
DUMP_AHEAD_INTERVALS = 0.5
#: Heartbeat intervals of silence after which a replica running a user's processor has its
#: stacks written: a quarter of an interval before a pool may take a replica with work for
#: silent (``supervision.LATE_WITH_WORK_INTERVALS``).
PROCESSOR_DUMP_AFTER_INTERVALS = LATE_WITH_WORK_INTERVALS - 0.25
#: Bytes per processor thread in a :class:`CallMarks` file (a task's request id and stage).
MARK_BYTES = 256
#: Seconds over which :func:`culprits` measures the CPU of threads in processor calls.
CPU_WINDOW_S = 0.05
#: The most of a dump :func:`where_silent` reads, in bytes (a dump is a few KiB: 100 frames
#: per thread at most, faulthandler's own limit).
READ_MAX_BYTES = 1 << 20

_FRAME = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>\S+)')


def dump_path(pid: int) -> str | None:
    """The stack dump file of the replica process ``pid`` on this host:
    ``<ipc_dir>/stacks/<pid>.txt`` of this process's system (``$OMNI_ACTORS_SYSTEM_ID``);
    None outside any system."""
    system_id = os.environ.get(ENV_SYSTEM_ID)
    return os.path.join(ipc_dir(system_id), "stacks", f"{pid}.txt") if system_id else None


def remove_dump(pid: int) -> None:
    """Remove the dump and call-mark files of replica ``pid`` (its process has ended: its pool
    reads them first)."""
    path = dump_path(pid)
    if path:
        for name in (path, _calls_path(path)):
            try:
                os.unlink(name)
            except OSError:
                pass


def _calls_path(dump: str) -> str:
    return dump[:-len(".txt")] + ".calls"


class CallMarks:
    """What each processor thread of a replica is calling its processor for: a record of
    :data:`MARK_BYTES` per thread in ``stacks/<pid>.calls``, ``"<request id>\t<stage id>"``
    while a call runs, blank between calls (one ``pwrite`` each way, with the interpreter
    held: a call that then keeps it is marked before it starts). Inert where ``path`` is None
    or the file cannot be opened."""

    def __init__(self, path: str | None) -> None:
        self._fd = None
        if path:
            try:
                self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            except OSError:
                self._fd = None

    def mark(self, slot: int, request_id: str, stage_id: int) -> None:
        """On the thread that calls the processor, before the call (its native thread id goes
        with it: see :func:`culprits`)."""
        if self._fd is not None:
            record = f"{request_id}\t{stage_id}\t{threading.get_native_id()}".encode("utf-8", "replace")
            record = record[:MARK_BYTES - 1]
            self._write(slot, record.ljust(MARK_BYTES - 1) + b"\n")

    def clear(self, slot: int) -> None:
        if self._fd is not None:
            self._write(slot, b" " * (MARK_BYTES - 1) + b"\n")

    def _write(self, slot: int, record: bytes) -> None:
        try:
            os.pwrite(self._fd, record, slot * MARK_BYTES)
        except OSError:
            pass


def calls_of(pid: int) -> dict[tuple[str, int], int]:
    """The processor calls replica ``pid`` on this host had running, from its
    :class:`CallMarks` file: (request id, stage id) -> the native id of the thread calling;
    empty without one."""
    path = dump_path(pid)
    if not path:
        return {}
    try:
        with open(_calls_path(path), "rb") as f:
            data = f.read(64 * MARK_BYTES)
    except OSError:
        return {}
    calls = {}
    for at in range(0, len(data), MARK_BYTES):  # (a thread's record; one never written reads as zeros)
        fields = data[at:at + MARK_BYTES].strip(b"\0 \n").decode("utf-8", "replace").split("\t")
        if len(fields) == 3 and fields[1].isdigit() and fields[2].isdigit():
            calls[(fields[0], int(fields[1]))] = int(fields[2])
    return calls


def culprits(pid: int, calls: dict[tuple[str, int], int], window_s: float = CPU_WINDOW_S) -> set[tuple[str, int]]:
    """Which of ``calls`` (see :func:`calls_of`) held the interpreter: the only one, or those
    whose threads used at least a quarter of ``window_s`` of CPU over it (a long C call that keeps
    the GIL computes; threads waiting for the GIL, or in a call that let it go, ``time.sleep``,
    I/O, use next to none; trial CT: an innocent request sleeping in its processor call was
    failed with the one that held the GIL). None where that tells none apart (a call that holds
    the GIL and sleeps, beside others): no request is blamed then."""
    if len(calls) <= 1:
        return set(calls)
    before = {call: _cpu_ns(pid, tid) for call, tid in calls.items()}
    time.sleep(window_s)
    busy = set()
    for call, tid in calls.items():
        after = _cpu_ns(pid, tid)
        if before[call] is not None and after is not None and after - before[call] >= window_s * 0.25e9:
            busy.add(call)
    return busy


def _cpu_ns(pid: int, tid: int) -> int | None:
    """CPU time thread ``tid`` of ``pid`` has run, in ns (``/proc/<pid>/task/<tid>/schedstat``)."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


class StackDumps:
    """A replica's watchdog: :meth:`arm` at each heartbeat; once not re-armed for
    ``silent_after_s`` less :data:`DUMP_AHEAD_INTERVALS` x ``interval_s`` seconds (at most
    :data:`PROCESSOR_DUMP_AFTER_INTERVALS` x ``interval_s`` with ``processor``: its stage runs
    a processor of the user's, whose threads note their calls in :attr:`marks`), every
    thread's stack is appended to :func:`dump_path`. Not armed (no file, nothing written)
    outside a system or where the file cannot be opened."""

    def __init__(self, silent_after_s: float = 0.0, interval_s: float = 0.0, processor: bool = False) -> None:
        self.after_s = max(interval_s, silent_after_s - DUMP_AHEAD_INTERVALS * interval_s)
        if processor:  # (a user's processor on threads: see PROCESSOR_DUMP_AFTER_INTERVALS)
            self.after_s = min(self.after_s, PROCESSOR_DUMP_AFTER_INTERVALS * interval_s)
        self.path = dump_path(os.getpid()) if self.after_s > 0 else None  # (0: an inert one)
        self._file = None
        if self.path:
            try:
                os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")
            except OSError:
                self.path = None
        #: The processor threads' call marks (inert without a dump file or a user's processor)
        self.marks = CallMarks(_calls_path(self.path) if self.path and processor else None)

    def arm(self) -> None:
        """(Re)start the watchdog's countdown (faulthandler starts a thread for it: tens of
        microseconds, once per heartbeat). A dump written since the last arm is dropped: the
        replica came back before its pool's limit (a loaded host), and a dump of that must not
        be read as the stacks of a later silence."""
        if self._file is not None:
            fd = self._file.fileno()
            if os.fstat(fd).st_size:
                os.ftruncate(fd, 0)
            faulthandler.dump_traceback_later(self.after_s, repeat=False, file=self._file)

    def close(self) -> None:
        """Stop the watchdog and remove the file (a replica that exits cleanly)."""
        if self._file is None:
            return
        faulthandler.cancel_dump_traceback_later()
        self._file.close()
        self._file = None
        # (the marks' file stays open: a processor thread may be writing to it, and a number closed under
        # it could come back for another file; it goes with the process)
        remove_dump(os.getpid())


def where_silent(pid: int, processor: str | None = None) -> tuple[str, str, set[tuple[str, int]]]:
    """What the dump of replica ``pid`` on this host says: ``(suffix, stacks, calls)``. ``suffix``, for
    its isolation reason, names the call of ``processor`` (``custom_process_input_func``,
    ``"module.function"``) a thread was in: ``"; it went silent in its processor procs.hog
    (procs.py:12, in helper at procs.py:3): ..."`` (the innermost frame of that thread too where
    it is another), else ``"; its threads' stacks are in the replica_isolated log line"``;
    ``stacks`` is the last dump's text; ``calls``, where a thread was in ``processor``, the
    (request id, stage id) of the processor calls that held the interpreter (:func:`culprits`).
    ``("", "", set())`` where it wrote none."""
    path = dump_path(pid)
    if not path:
        return "", "", set()
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(READ_MAX_BYTES)
    except OSError:
        return "", "", set()
    at = text.rfind("Timeout (")  # (faulthandler's first line of each dump)
    if at < 0:
        return "", "", set()
    last = text[at:].strip()
    found = _processor_frame(last, processor) if processor else None
    if found is None:
        return "; its threads' stacks are in the replica_isolated log line", last, set()
    (file, line), innermost = found
    deeper = (f", in {innermost[2]} at {os.path.basename(innermost[0])}:{innermost[1]}"
              if innermost[:2] != (file, line) else "")
    return (f"; it went silent in its processor {processor} ({os.path.basename(file)}:{line}{deeper}): a call "
            "that holds the GIL stops heartbeats"), last, culprits(pid, calls_of(pid))


def _processor_frame(text: str, processor: str) -> tuple[tuple[str, str], tuple[str, str, str]] | None:
    """In a dump, the frame of ``processor``'s function in its module's file, (file, line), and
    the innermost frame of the same thread, (file, line, function); None if no thread is in it."""
    module, _, func = processor.rpartition(".")
    if not module:
        return None
    path = module.replace(".", os.sep)
    tails = (os.sep + path + ".py", os.sep + path + os.sep + "__init__.py")
    for block in re.split(r"^(?:Current thread|Thread) 0x[0-9a-f]+", text, flags=re.M)[1:]:
        frames = [m for m in map(_FRAME.match, block.splitlines()) if m]
        for m in frames:
            if m["func"] == func and (m["file"].endswith(tails) or m["file"] == path + ".py"):
                return (m["file"], m["line"]), (frames[0]["file"], frames[0]["line"], frames[0]["func"])
    return None
