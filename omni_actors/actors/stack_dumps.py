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
line carries the stacks, and the tasks whose processor calls it was in count as crashed by
them (trial CS: uncounted, as a lost host's tasks are, one such request took 11 replicas
down in turn and its stage out for 5 minutes). The files go when the process has ended. A replica stopped (SIGSTOP) or killed writes none: its watchdog stops with it.
"""

from __future__ import annotations

import faulthandler
import os
import re

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
        if self._fd is not None:
            record = f"{request_id}\t{stage_id}".encode("utf-8", "replace")[:MARK_BYTES - 1]
            self._write(slot, record.ljust(MARK_BYTES - 1) + b"\n")

    def clear(self, slot: int) -> None:
        if self._fd is not None:
            self._write(slot, b" " * (MARK_BYTES - 1) + b"\n")

    def _write(self, slot: int, record: bytes) -> None:
        try:
            os.pwrite(self._fd, record, slot * MARK_BYTES)
        except OSError:
            pass


def calls_of(pid: int) -> set[tuple[str, int]]:
    """The (request id, stage id) of the processor calls replica ``pid`` on this host had
    running, from its :class:`CallMarks` file; empty without one."""
    path = dump_path(pid)
    if not path:
        return set()
    try:
        with open(_calls_path(path), "rb") as f:
            data = f.read(64 * MARK_BYTES)
    except OSError:
        return set()
    calls = set()
    for at in range(0, len(data), MARK_BYTES):  # (a thread's record; one never written reads as zeros)
        record = data[at:at + MARK_BYTES].strip(b"\0 \n").decode("utf-8", "replace")
        request_id, tab, stage = record.partition("\t")
        if tab and stage.isdigit():
            calls.add((request_id, int(stage)))
    return calls


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
    (request id, stage id) of the processor calls then running (:func:`calls_of`). ``("", "",
    set())`` where it wrote none."""
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
            "that holds the GIL stops heartbeats"), last, calls_of(pid)


def _processor_frame(text: str, processor: str) -> tuple[tuple[str, str], tuple[str, str, str]] | None:
    """In a dump, the frame of ``processor``'s function in its module's file, (file, line), and
    the innermost frame of the same thread, (file, line, function); None if no thread is in it."""
    module, _, func = processor.rpartition(".")
    if not module:
        return None
    tails = (os.sep + module.replace(".", os.sep) + ".py", os.sep + module.replace(".", os.sep) + os.sep + "__init__.py")
    for block in re.split(r"^(?:Current thread|Thread) 0x[0-9a-f]+", text, flags=re.M)[1:]:
        frames = [m for m in map(_FRAME.match, block.splitlines()) if m]
        for m in frames:
            if m["func"] == func and (m["file"].endswith(tails) or m["file"] == module.replace(".", os.sep) + ".py"):
                return (m["file"], m["line"]), (frames[0]["file"], frames[0]["line"], frames[0]["func"])
    return None
