"""Where a replica's threads were when it went silent.

A call that holds the Python interpreter (one long C call that keeps the GIL: a stage
processor's ``sum(range(5 * 10**8))``, a stuck extension) stops everything else in its
replica's process, heartbeats included: its pool takes it for hung and kills it, and
nothing said what it was doing (trial CR: a processor took its stage down and was named
nowhere). The replica arms :mod:`faulthandler`'s watchdog (a C thread that runs without
the interpreter) at each heartbeat; when a heartbeat is :data:`DUMP_AHEAD_INTERVALS`
intervals short of the silence its pool tolerates and has not come, the watchdog writes
every thread's stack to :func:`dump_path` (``stacks/<pid>.txt`` in the system's
``processes.ipc_dir``). A pool that isolates a replica of its own host as silent reads it
(:func:`where_silent`): the reason (``status``, the ``replica_isolated`` log line) names the
processor call it was in, and the log line carries the stacks; the file goes when the
replica's process has ended. A replica stopped (SIGSTOP) or killed writes none: its watchdog stops with it.
"""

from __future__ import annotations

import faulthandler
import os
import re

from omni_actors.system.processes import ENV_SYSTEM_ID, ipc_dir

__all__ = ["DUMP_AHEAD_INTERVALS", "StackDumps", "dump_path", "remove_dump", "where_silent"]

#: The watchdog writes this many heartbeat intervals before the pool's silence limit
#: (``missed_heartbeats`` x ``heartbeat_interval_s``): the stacks are on disk when the pool
#: looks (its verdict comes after the limit, at a tick of its own).
DUMP_AHEAD_INTERVALS = 0.5
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
    """Remove the dump file of replica ``pid`` (its process has ended: its pool reads it first)."""
    path = dump_path(pid)
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass


class StackDumps:
    """A replica's watchdog: :meth:`arm` at each heartbeat; once not re-armed for
    ``silent_after_s`` less :data:`DUMP_AHEAD_INTERVALS` x ``interval_s`` seconds, every
    thread's stack is appended to :func:`dump_path`. Not armed (no file, nothing written)
    outside a system or where the file cannot be opened."""

    def __init__(self, silent_after_s: float = 0.0, interval_s: float = 0.0) -> None:
        self.after_s = max(interval_s, silent_after_s - DUMP_AHEAD_INTERVALS * interval_s)
        self.path = dump_path(os.getpid()) if self.after_s > 0 else None  # (0: an inert one)
        self._file = None
        if self.path:
            try:
                os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
                self._file = open(self.path, "a", encoding="utf-8")
            except OSError:
                self.path = None

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
        try:
            os.unlink(self.path)
        except OSError:
            pass


def where_silent(pid: int, processor: str | None = None) -> tuple[str, str]:
    """What the dump of replica ``pid`` on this host says: ``(suffix, stacks)``. ``suffix``, for
    its isolation reason, names the call of ``processor`` (``custom_process_input_func``,
    ``"module.function"``) a thread was in: ``"; it went silent in its processor procs.hog
    (procs.py:12, in helper at procs.py:3): ..."`` (the innermost frame of that thread too where
    it is another), else ``"; its threads' stacks are in the replica_isolated log line"``;
    ``stacks`` is the last dump's text. ``("", "")`` where it wrote none."""
    path = dump_path(pid)
    if not path:
        return "", ""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(READ_MAX_BYTES)
    except OSError:
        return "", ""
    at = text.rfind("Timeout (")  # (faulthandler's first line of each dump)
    if at < 0:
        return "", ""
    last = text[at:].strip()
    found = _processor_frame(last, processor) if processor else None
    if found is None:
        return "; its threads' stacks are in the replica_isolated log line", last
    (file, line), innermost = found
    deeper = (f", in {innermost[2]} at {os.path.basename(innermost[0])}:{innermost[1]}"
              if innermost[:2] != (file, line) else "")
    return (f"; it went silent in its processor {processor} ({os.path.basename(file)}:{line}{deeper}): a call "
            "that holds the GIL stops heartbeats"), last


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
