"""Finding and ending the processes of one actor system.

Thespian's admin daemonises (``setsid``) and every actor is a forked process,
so process groups do not cover them. Instead the leader puts a unique
``OMNI_ACTORS_SYSTEM_ID`` in its environment before the actor system starts;
every admin and actor process inherits it, and ``/proc/<pid>/environ`` names
them all (Linux).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

ENV_SYSTEM_ID = "OMNI_ACTORS_SYSTEM_ID"


def system_pids(system_id: str, *, exclude_self: bool = True) -> list[int]:
    """PIDs of live processes started with ``OMNI_ACTORS_SYSTEM_ID=system_id``.

    With ``exclude_self``, this process is left out. Multiprocessing resource
    trackers are always left out: they hold nothing and exit by themselves
    as soon as the processes that started them have exited.
    """
    needle = f"{ENV_SYSTEM_ID}={system_id}".encode()
    me = os.getpid()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if exclude_self and pid == me:
            continue
        try:
            env = (entry / "environ").read_bytes()
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if needle not in env.split(b"\0") or ") Z " in stat:  # zombies hold nothing
            continue
        if _is_tracker(entry):
            continue  # multiprocessing's resource tracker: exits by itself once its owners have
        found.append(pid)
    return found


def _is_tracker(entry: Path) -> bool:
    try:
        return b"resource_tracker" in (entry / "cmdline").read_bytes()
    except OSError:
        return False


def kill_system(system_id: str, grace_s: float = 3.0) -> int:
    """SIGTERM, then SIGKILL after ``grace_s``, every process of a system.

    Returns:
        How many processes were still alive at the start.
    """
    pids = system_pids(system_id)
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and system_pids(system_id):
            time.sleep(0.05)
        if not system_pids(system_id):
            break
    return len(pids)


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when something accepts TCP connections on ``host:port``."""
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0
