"""Device leases: which live replica process holds each device of a host.

The coordinator's inventory says which replica a device is given to, not
which process still holds it. When the coordinator or a stage pool is lost
and recreated, the old engines, orphaned, run on until they have finished
their in-flight work and seen that their pool is gone (seconds), while the
new pool places its replicas on the same devices. On a GPU the new engine
would then load beside the old one, and fail for lack of memory (trial AJ:
a new talker/1 started on device 2 about 2.3 s before the old code2wav/0
there exited).

So a replica given devices takes a lease on each: a file ``<lease
dir>/<device>`` holding the processes that use the device (the replica's own,
and the engine's children once started, such as a vLLM engine core) with
their start times, so that a reused pid is not taken for a holder. Before its
engine loads, a replica waits for every process of the previous lease of
each of its devices to exit (:func:`wait_and_take`), up to a bound. A holder
still running then is killed (resumed first, if stopped): the coordinator gave
its devices to the new replica, so its own pool is gone or has replaced it,
and nothing would ever stop it (trial AK: an engine frozen by SIGSTOP when its
pool was killed held its device until the system stopped). Only if it cannot
be killed does the engine load beside it (logged: on a GPU that load may then
fail for lack of memory, and the replica is retried as any failed load is).

The lease directory is one per convention and node on a host
(:func:`scope_dir`, named by the leader's admin port and the node's name; the
leader and each member set ``$OMNI_ACTORS_LEASE_DIR`` for their actors), not
per actor system: a member started again under the name of one that froze
(lost, its engines still holding their GPUs) is another actor system on the
same host, and with a directory per system its replicas saw none of the old
engines' leases and loaded beside them (a code review). Outside a leader or
member (tests), the system's IPC directory holds the leases.
"""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import tempfile
import time
from pathlib import Path
from typing import Callable

from omni_actors.system.processes import own_ipc_dir, proc_stat

#: Seconds between two looks at the holders of a replica's devices while it waits.
POLL_S = 0.1
#: A holder stopped (SIGSTOP, state ``T``) this many seconds in a row is killed without
#: waiting out the rest of the bound: it cannot exit while stopped, and its pool is gone
#: (trial AM: a frozen vLLM Thinker kept the only Thinker down for 80 s, the full 66 s wait).
#: A few seconds, not at once: an operator may have stopped it a moment to look at it.
STOPPED_KILL_AFTER_S = 3.0
#: Seconds to wait for the holders killed by :func:`evict` to be gone (a killed process
#: frees its memory, a GPU's too, as it exits; a zombie holds none and counts as gone).
EVICT_WAIT_S = 5.0


#: The lease directory of this process's convention and node (see :func:`use_scope`).
ENV_LEASE_DIR = "OMNI_ACTORS_LEASE_DIR"


def _prefix() -> str:
    return f"omni-actors-devices-{os.getuid()}-"


def scope_dir(leader_port: int, node: str) -> str:
    """The lease directory of node ``node`` of the convention led from admin port
    ``leader_port``, on this host, for this user: ``<temp dir>/omni-actors-devices-<uid>-<port>-<node>``
    (the node's name with other characters than letters, digits, ``.``, ``_`` and ``-`` as ``_``)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", node)[:100]
    return os.path.join(tempfile.gettempdir(), f"{_prefix()}{int(leader_port)}-{safe}")


def _ours(path: str) -> bool:
    """Whether ``path`` is a directory (not a link) of this user that nobody else may write in:
    in a shared temp directory, another user could have made it first (a code review)."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def use_scope(leader_port: int, node: str) -> str:
    """In a leader or member, before its actor system starts: its actors take their leases
    in :func:`scope_dir` (``$OMNI_ACTORS_LEASE_DIR``, which they inherit); the directory."""
    path = os.environ[ENV_LEASE_DIR] = scope_dir(leader_port, node)
    return path


def lease_dir() -> str | None:
    """This process's lease directory (made): ``$OMNI_ACTORS_LEASE_DIR``, else its system's
    IPC directory's ``devices``; None outside any system."""
    path = os.environ.get(ENV_LEASE_DIR)
    if path:
        os.makedirs(path, mode=0o700, exist_ok=True)
        if _ours(path):
            return path
    base = own_ipc_dir()  # (else, or where that one is not ours: the system's own)
    if base is None:
        return None
    path = os.path.join(base, "devices")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def sweep_stale() -> int:
    """:func:`sweep` every lease directory of this host (:func:`scope_dir`'s, of any
    convention): what members and leaders killed outright left (only leases nobody holds
    go). A leader or member runs it as it starts. Returns how many leases were removed."""
    base = tempfile.gettempdir()
    try:
        paths = [os.path.join(base, n) for n in os.listdir(base) if n.startswith(_prefix())]
    except OSError:
        return 0
    return sum(sweep(path) for path in paths if _ours(path))


def sweep(directory: str) -> int:
    """Remove the leases in ``directory`` none of whose processes still runs, then the
    directory if that left it empty (a leader or member stopping: another system of the
    same node may still hold leases there). Returns how many leases were removed."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        path = os.path.join(directory, name)
        if not name.endswith(".tmp") and not live_holders(read_lease(directory, name)):  # (.tmp: being taken)
            try:
                os.unlink(path)
                removed += 1
            except OSError:
                pass
    try:
        os.rmdir(directory)
    except OSError:  # (not empty: leases of a live system)
        pass
    return removed


def _start_time(pid: int) -> int | None:
    """Process ``pid``'s start time (clock ticks since boot), or None if it is gone (zombies too)."""
    fields = proc_stat(Path(f"/proc/{pid}"))
    if not fields or fields[0] in ("Z", "X"):
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def _lease_file(directory: str, device: str) -> str:
    return os.path.join(directory, device.replace("/", "_"))


def read_lease(directory: str, device: str) -> dict | None:
    """The lease of ``device``: ``{"replica", "pids": [[pid, start time], ...]}``, or None."""
    try:
        with open(_lease_file(directory, device)) as f:
            lease = json.load(f)
    except (OSError, ValueError):
        return None
    return lease if isinstance(lease, dict) and isinstance(lease.get("pids"), list) else None


def live_holders(lease: dict | None, me: int | None = None) -> list[int]:
    """The processes of ``lease`` still running (the same processes: start times match), but ``me``."""
    alive = []
    for entry in (lease or {}).get("pids", ()):
        try:
            pid, start = int(entry[0]), int(entry[1])
        except (TypeError, ValueError, IndexError):
            continue
        if pid != me and _start_time(pid) == start:
            alive.append(pid)
    return alive


def holders(directory: str, devices: tuple[str, ...], me: int | None = None) -> dict[str, tuple[str, list[int]]]:
    """Device -> (the replica that leased it, its processes still running), for the
    devices of ``devices`` whose last lease is held by a running process other than ``me``."""
    held = {}
    for device in devices:
        lease = read_lease(directory, device)
        alive = live_holders(lease, me)
        if alive:
            held[device] = (str(lease.get("replica") or "?"), alive)
    return held


def describe(held: dict[str, tuple[str, list[int]]]) -> str:
    """``"device 2 (held by code2wav/0, pid 4711)"``, joined by ``"; "``."""
    return "; ".join(f"device {device} (held by {replica}, pid {', '.join(map(str, pids))})"
                     for device, (replica, pids) in sorted(held.items()))


def take(directory: str, devices: tuple[str, ...], replica: str, pids: list[int] | None = None) -> None:
    """Write the lease of each of ``devices`` for ``replica``: ``pids`` (default: this
    process) with their start times; each file is replaced at once (rename), so a
    reader sees the old lease or the new one. Processes already gone are left out."""
    entries = []
    for pid in pids or [os.getpid()]:
        start = _start_time(pid)
        if start is not None:
            entries.append([pid, start])
    body = json.dumps({"replica": replica, "pids": entries})
    os.makedirs(directory, mode=0o700, exist_ok=True)  # (a stopping system's sweep may have removed it, empty)
    for device in devices:
        path = _lease_file(directory, device)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(body)
        os.replace(tmp, path)


def release(directory: str | None, devices: tuple[str, ...], me: int | None = None) -> None:
    """Remove the leases of ``devices`` that are still this process's (``me``, default
    this process): the replica stopped its engine. A lease another replica took since is kept."""
    if not directory:
        return
    me = me or os.getpid()
    for device in devices:
        lease = read_lease(directory, device)
        if lease and any(isinstance(e, list) and e and e[0] == me for e in lease["pids"]):
            try:
                os.unlink(_lease_file(directory, device))
            except OSError:
                pass


def evict(held: dict[str, tuple[str, list[int]]], wait_s: float = EVICT_WAIT_S,
          sleep: Callable[[float], None] = time.sleep) -> list[int]:
    """Kill the holding processes of ``held`` (:func:`holders`' answer): SIGCONT first
    (a stopped process that is killed is gone only once it runs), then SIGKILL; wait
    at most ``wait_s`` seconds for them to be gone. Returns the pids still running."""
    pids = {pid for _, alive in held.values() for pid in alive}
    starts = {pid: _start_time(pid) for pid in pids}
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except OSError:  # gone already, or not ours to signal
                pass
    deadline = time.monotonic() + wait_s
    while True:
        running = sorted(pid for pid in pids if starts[pid] is not None and _start_time(pid) == starts[pid])
        if not running or time.monotonic() >= deadline:
            return running
        sleep(POLL_S)


def wait_and_take(devices: tuple[str, ...], replica: str, limit_s: float,
                  on_wait: Callable[[str], None] | None = None,
                  sleep: Callable[[float], None] = time.sleep) -> tuple[float, str, str]:
    """Wait until no other running process holds a lease on any of ``devices`` (at
    most ``limit_s`` seconds), kill the holders still running then (:func:`evict`), or
    sooner those stopped for :data:`STOPPED_KILL_AFTER_S`, and take the leases for this process.

    ``on_wait(what)`` is called when what is waited for changes (``describe``'s text;
    ``""`` when the wait is over). Returns ``(seconds waited, what was killed, what
    still holds the devices: it could not be killed)``, the last two ``describe``'s
    text or ``""``. Outside any system (no ``$OMNI_ACTORS_SYSTEM_ID``) or with no
    devices it returns at once.
    """
    directory = lease_dir() if devices else None
    if directory is None:
        return 0.0, "", ""
    t0, shown = time.monotonic(), ""
    evicted: list[str] = []
    stopped_since: dict[int, float] = {}
    held = holders(directory, devices, os.getpid())
    while held and time.monotonic() - t0 < limit_s:
        what = describe(held)
        if what != shown and on_wait is not None:
            on_wait(what)
        shown = what
        frozen = _stopped_too_long(held, stopped_since)
        if frozen:  # (it cannot exit while stopped: no use waiting out the bound)
            evict(frozen, sleep=sleep)
            evicted.append(describe(frozen) + f" (stopped for {STOPPED_KILL_AFTER_S:g} s: it could not exit)")
        else:
            sleep(POLL_S)
        held = holders(directory, devices, os.getpid())
    if held:
        evicted.append(describe(held))
        evict(held, sleep=sleep)
        held = holders(directory, devices, os.getpid())
    if shown and on_wait is not None:
        on_wait("")
    take(directory, devices, replica)
    return time.monotonic() - t0, "; ".join(evicted), describe(held)


def _stopped_too_long(held: dict[str, tuple[str, list[int]]],
                      stopped_since: dict[int, float]) -> dict[str, tuple[str, list[int]]]:
    """The devices of ``held`` one of whose holding processes has been stopped (state ``T``
    or ``t``) for :data:`STOPPED_KILL_AFTER_S` in a row, with all their processes (a vLLM
    engine core waits for its stopped engine). ``stopped_since`` (pid -> since when, monotonic)
    is kept across calls."""
    now = time.monotonic()
    pids = {pid for _, alive in held.values() for pid in alive}
    for pid in pids:
        fields = proc_stat(Path(f"/proc/{pid}"))
        if fields and fields[0] in ("T", "t"):
            stopped_since.setdefault(pid, now)
        else:
            stopped_since.pop(pid, None)
    frozen = {pid for pid, since in stopped_since.items() if pid in pids and now - since >= STOPPED_KILL_AFTER_S}
    return {device: (rep, alive) for device, (rep, alive) in held.items() if frozen & set(alive)}
