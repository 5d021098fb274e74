"""The host watchdog: what a leader or member host's processes do when its main process dies.

A host's main process (``start --convention-leader`` or a member's ``start``) holds
the HTTP API (leader) and the host's data service, and its orderly stop ends the
Thespian admin and every actor on the host. Killed outright (SIGKILL, the kernel's
OOM killer), it cannot: the admin daemonises into a session of its own, so the
admin and its actors lived on, holding devices and memory, serving nothing (a
member's outputs could no longer be read: its data service was gone).

So each host's main process starts one small watchdog process, in a session of its
own and without the system's id in its environment (so that the host's own
clean-up, which ends everything carrying the id, does not count it). It checks the
main process every :data:`POLL_S`; when it is gone, the watchdog does what the
orderly stop would have done: SIGTERM, then SIGKILL after 3 s, to every process of
the host's system (:func:`~omni_actors.system.processes.kill_system`), removes its
vLLM IPC directory and its shared-memory segments, and the leader's state file. It
says so on stderr (inherited: the host's log) in one line and one ``host_process_died``
log event. The main process SIGTERMs it at the end of its orderly stop.

Meanwhile it also kills an EngineActor whose pool is gone and that is stopped (SIGSTOP)
for :data:`FROZEN_ORPHAN_KILL_S` (:func:`reap_frozen_orphans`): an orphaned engine drains
and exits by itself, a frozen one cannot, and it held its memory (and a GPU's) until the
system stopped, where nothing else would kill it (trial BS: after `inject kill-pool` of a
stage whose replica was frozen; a replica pinned to devices is killed by its successor's
device lease, one without devices was not).

Run as ``python -m omni_actors.system.watchdog --pid P --start-time T --role R
--system-id ID [--session S ...] [--shm-prefix P] [--state-file F]``;
:func:`start_watchdog` builds that command.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from omni_actors.system.processes import (ENV_SYSTEM_ID, boot_ticks_to_unix, cli, kill_system, proc_stat,
                                          process_title, remove_ipc_dir, remove_orphan_semaphores, system_pids)

#: Seconds between two looks at the main process (the SIGTERM grace comes after).
POLL_S = 0.2
#: How Thespian titles its admin process (``MultiProcAdmin ActorAddr-(T|:1900)``).
ADMIN_TITLE = "MultiProcAdmin"
#: Seconds the main process gets to stop after its admin died (SIGTERM), before SIGKILL.
ADMIN_DIED_GRACE_S = 3.0
#: The signal by which the main process tells its watchdog that it shuts its admin down itself
#: (an orderly stop): from then on only the main process is watched.
ADMIN_STOPS = signal.SIGUSR1
#: ``<pid>:<start time>:<role>`` of the host's main process, set by it before its admin starts,
#: so that every actor of the host inherits it (see :func:`host_process_gone`).
ENV_HOST_PROCESS = "OMNI_ACTORS_HOST_PROCESS"


def start_time(pid: int) -> int | None:
    """``pid``'s start time in clock ticks since boot (``/proc/<pid>/stat`` field 22), None
    if it is gone: with the pid it names one process, a reused pid being another."""
    fields = proc_stat(Path(f"/proc/{pid}"))
    return None if fields is None or fields[0] in ("Z", "X") else int(fields[19])  # a zombie has exited


def boot_id() -> str:
    """This boot's id (``/proc/sys/kernel/random/boot_id``; "" where there is none)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def identity() -> dict:
    """What a state file records of the process writing it, besides its pid: its start time
    and the boot, so that a record left by a process gone (a reboot, a leader and watchdog
    killed together) is not taken for it once its pid names another process."""
    return {"pid_start": start_time(os.getpid()), "boot_id": boot_id()}


def recorded_process_runs(state: dict) -> bool:
    """Whether the process a state file names (``pid``, with :func:`identity`'s fields when
    recorded) is the one running under that pid now (not a zombie)."""
    pid = state.get("pid")
    if not isinstance(pid, int):
        return False
    now = start_time(pid)
    if now is None:
        return False
    if state.get("boot_id") and state["boot_id"] != boot_id():
        return False
    return state.get("pid_start") is None or state["pid_start"] == now


def mark_host_process(role: str) -> None:
    """Record this process as its host's main process (:data:`ENV_HOST_PROCESS`, with its
    ``role``: ``"leader"`` or ``"member"``) for the processes it starts from now on."""
    os.environ[ENV_HOST_PROCESS] = f"{os.getpid()}:{start_time(os.getpid())}:{role}"


def _host_process() -> tuple[int, int, str] | None:
    """(pid, start time, role) of :data:`ENV_HOST_PROCESS`; None where it is not set."""
    pid, _, rest = os.environ.get(ENV_HOST_PROCESS, "").partition(":")
    started, _, role = rest.partition(":")
    if not pid.isdigit() or not started.isdigit():
        return None
    return int(pid), int(started), role or "host"


def host_process_gone() -> str | None:
    """Why this host's main process is gone (``"its member process (pid N) died"``), or
    None while it lives (or where none was recorded)."""
    host = _host_process()
    if host is None or start_time(host[0]) == host[1]:
        return None
    return f"its {host[2]} process (pid {host[0]}) died"


def exit_if_host_gone(signum: int) -> None:
    """For the signal handler that the host's main process installs and the Thespian admin
    and its logger inherit (they leave their shutdown to the main process, so they ignore
    its SIGTERM): once the main process is gone, a SIGTERM is the watchdog's (or
    ``stop``'s) clean-up, and they exit at once. (They waited for its SIGKILL, 3 s on.)"""
    if signum == signal.SIGTERM and host_process_gone() is not None:
        os._exit(0)


def watchdog_of(main_pid: int) -> int | None:
    """The pid of a live watchdog watching ``main_pid`` (its parent, or not any more), or None."""
    needle = f"--pid\0{main_pid}\0".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and is_watchdog(int(entry.name)):
            try:
                if needle in (entry / "cmdline").read_bytes():
                    return int(entry.name)
            except OSError:
                continue
    return None


def clean_up_dead_host() -> bool:
    """From a process of a host whose main process has died and whose watchdog is gone
    too (a member's node agent sees it): start a watchdog for the dead process, which
    cleans up at once, as the first would have. Returns whether one was started."""
    host = _host_process()
    if host is None or watchdog_of(host[0]) is not None:
        return False
    cmd = _command(*host, os.environ.get(ENV_SYSTEM_ID, ""), [os.getsid(0)],
                   os.environ.get("OMNI_ACTORS_SHM_PREFIX"), None)
    return _spawn(cmd) is not None


def _command(pid: int, started: int | None, role: str, system_id: str, sessions: list[int],
             shm_prefix: str | None, state_file: Path | None) -> list[str]:
    cmd = [sys.executable, "-m", "omni_actors.system.watchdog", "--pid", str(pid),
           "--start-time", str(started), "--role", role, "--system-id", system_id]
    for session in sessions:
        cmd += ["--session", str(session)]
    if shm_prefix:
        cmd += ["--shm-prefix", shm_prefix]
    if state_file is not None:
        cmd += ["--state-file", str(state_file)]
    return cmd


def _spawn(cmd: list[str]) -> subprocess.Popen | None:
    env = {k: v for k, v in os.environ.items() if k not in (ENV_SYSTEM_ID, ENV_HOST_PROCESS)}
    try:
        return subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    except OSError as exc:
        print(f"warning: no host watchdog ({exc}): if this process is killed, stop its system with "
              f"`{cli('stop')}`", file=sys.stderr)
        return None


def start_watchdog(role: str, system_id: str, sessions: list[int], *, shm_prefix: str | None = None,
                   state_file: Path | None = None) -> subprocess.Popen | None:
    """Start this process's watchdog (see the module docstring); None where it cannot
    start (logged by the caller's stderr: the host serves all the same).

    Args:
        role: ``"leader"`` or ``"member"`` (what its messages call the main process).
        system_id: the host's ``OMNI_ACTORS_SYSTEM_ID``.
        sessions: the admin's sessions (:func:`~omni_actors.system.processes.child_sessions`).
        shm_prefix: the host's segment prefix (``oa-<admin port>-``); its segments are swept.
        state_file: the leader's state file, removed if it still names this process.
    """
    me = os.getpid()
    cmd = _command(me, start_time(me), role, system_id, sessions, shm_prefix, state_file)
    admin = find_admin(me)
    if admin is not None and start_time(admin) is not None:
        cmd += ["--admin-pid", str(admin), "--admin-start-time", str(start_time(admin))]
    return _spawn(cmd)


def find_admin(main_pid: int) -> int | None:
    """The pid of the Thespian admin ``main_pid`` started (a live child titled
    ``MultiProcAdmin ...``), or None."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = proc_stat(entry)
            if fields is not None and fields[0] not in ("Z", "X") and int(fields[1]) == main_pid \
                    and process_title(int(entry.name)).startswith(ADMIN_TITLE):
                return int(entry.name)
    return None


def is_watchdog(pid: int) -> bool:
    """Whether ``pid`` is a live (not zombie) watchdog process."""
    try:
        return (start_time(pid) is not None
                and b"omni_actors.system.watchdog" in Path(f"/proc/{pid}/cmdline").read_bytes())
    except OSError:
        return False


def find_watchdog(main_pid: int) -> int | None:
    """The pid of ``main_pid``'s watchdog (a live child of it running this module), or None."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = proc_stat(entry)
        if fields is not None and int(fields[1]) == main_pid and is_watchdog(int(entry.name)):
            return int(entry.name)
    return None


def admin_stops(proc: subprocess.Popen | None) -> None:
    """Tell the watchdog that this process shuts its admin down (:data:`ADMIN_STOPS`), so
    that the admin's exit is not taken for a death (call it before ``ActorSystem.shutdown``)."""
    if proc is not None and proc.poll() is None:
        try:
            proc.send_signal(ADMIN_STOPS)
        except OSError:
            pass


def stop_watchdog(proc: subprocess.Popen | None) -> None:
    """End the watchdog after an orderly stop (SIGTERM; waits up to 2 s for it)."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(2)
    except subprocess.TimeoutExpired:
        proc.kill()


def _clean_up(args) -> None:
    from omni_actors.connectors import sweep_segments
    from omni_actors.logs import configure_logging, get_logger

    configure_logging()
    titles: list[str] = []
    killed = kill_system(args.system_id, sessions=args.session, titles=titles)
    remove_ipc_dir(args.system_id)
    # (not where a new leader or member runs on this admin port by now: the prefix is its too; a
    # code review: a leader restarted at once lost its live segments to its predecessor's watchdog)
    removed = sweep_segments(args.shm_prefix) if args.shm_prefix and not successor_runs(args.state_file, args.pid) \
        else 0
    remove_orphan_semaphores(boot_ticks_to_unix(args.start_time))
    if args.state_file:
        remove_state_file(Path(args.state_file), args.pid)
    try:  # (stderr may be a closed terminal by now)
        if not killed and not removed:  # (`stop` killed it and cleaned up, or it died with nothing left)
            get_logger(actor="watchdog").info("host_process_gone_nothing_left", role=args.role, main_pid=args.pid)
            return
        print(f"omni-actors watchdog: the {args.role} process (pid {args.pid}) died without stopping its "
              f"system; stopped its {killed} remaining process(es) on this host", file=sys.stderr, flush=True)
        get_logger(actor="watchdog").warning("host_process_died", role=args.role, main_pid=args.pid,
                                             processes_killed=killed, killed=titles[:20],
                                             shm_segments_removed=removed)
    except OSError:
        pass


def _stop_after_admin_died(args) -> None:
    """The host's Thespian admin died and its main process lives on: stop that process
    (SIGTERM, SIGKILL after :data:`ADMIN_DIED_GRACE_S`); the clean-up follows. Without its
    admin no actor can be made or looked up, and an orphan holds the admin port (trial BH:
    after a `kill -9` of the admin, clients waited in silence until their own timeouts,
    `status` called the port another program's, and only a 31 s `stop` ended it)."""
    from omni_actors.logs import configure_logging, get_logger

    configure_logging()
    try:
        print(f"omni-actors watchdog: the Thespian admin (pid {args.admin_pid}) of this {args.role} died: its "
              f"system cannot work without it; stopping the {args.role} (pid {args.pid}) and every process of "
              f"its system on this host", file=sys.stderr, flush=True)
        get_logger(actor="watchdog").error("thespian_admin_died", role=args.role, admin_pid=args.admin_pid,
                                           main_pid=args.pid)
    except OSError:
        pass
    try:
        os.kill(args.pid, signal.SIGTERM)
        deadline = time.monotonic() + ADMIN_DIED_GRACE_S
        while start_time(args.pid) == args.start_time and time.monotonic() < deadline:
            time.sleep(POLL_S)
        if start_time(args.pid) == args.start_time:
            os.kill(args.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def successor_runs(path: str | Path | None, pid: int) -> bool:
    """Whether the state file at ``path`` names a running process other than ``pid``: a new
    leader or member on the same admin port (whose segments share the prefix)."""
    import json

    if not path:
        return False
    try:
        state = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False
    return state.get("pid") != pid and recorded_process_runs(state)


def remove_state_file(path: Path, pid: int) -> None:
    """Remove a leader's or member's state file if it still names process ``pid`` (not a newer one's)."""
    import json

    try:
        if json.loads(path.read_text()).get("pid") == pid:  # (not a new leader's)
            path.unlink(missing_ok=True)
    except (OSError, ValueError):
        pass


#: Seconds an orphaned EngineActor (its parent no StagePoolActor) may stay stopped before the
#: watchdog kills it, and how often it looks.
FROZEN_ORPHAN_KILL_S, ORPHAN_CHECK_S = 10.0, 1.0


def reap_frozen_orphans(system_id: str, sessions: list[int], main_pid: int, stopped_since: dict,
                        now: float) -> list[str]:
    """Kill (SIGKILL) this host's EngineActors whose pool is gone (their parent died: they
    were handed to the host's main process, ``main_pid``, its subreaper) and that have been
    stopped for :data:`FROZEN_ORPHAN_KILL_S`. Not one whose parent is its pool, nor one a
    member's admin started for a pool on another host (its parent, whether that pool lives
    or not: a review). ``stopped_since``: ``(pid, start time) -> now`` when each was first
    seen so, kept by the caller between calls. Returns the titles of those killed."""
    frozen = {}
    for pid in system_pids(system_id, sessions=sessions):
        fields = proc_stat(Path(f"/proc/{pid}"))
        if not fields or fields[0] not in ("T", "t") or not process_title(pid).startswith("EngineActor "):
            continue
        if int(fields[1]) != main_pid:
            continue  # (its pool, or a member's admin for a pool elsewhere, judges it)
        frozen[(pid, start_time(pid))] = stopped_since.get((pid, start_time(pid)), now)
    stopped_since.clear()
    stopped_since.update(frozen)
    killed = []
    for (pid, _), since in frozen.items():
        if now - since >= FROZEN_ORPHAN_KILL_S:
            title = process_title(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed.append(title)
    return killed


def _reap(args, stopped_since: dict) -> None:
    killed = reap_frozen_orphans(args.system_id, args.session, args.pid, stopped_since, time.monotonic())
    if killed:
        from omni_actors.logs import configure_logging, get_logger

        configure_logging()
        try:
            get_logger(actor="watchdog").warning("frozen_orphan_engines_killed", killed=killed,
                                                 stopped_s=FROZEN_ORPHAN_KILL_S,
                                                 note="their pool was gone and they were stopped (SIGSTOP)")
        except OSError:
            pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_actors.system.watchdog",
                                     description="Stop a host's actor system if its main process dies.")
    parser.add_argument("--pid", type=int, required=True)
    parser.add_argument("--start-time", type=int, required=True)
    parser.add_argument("--role", default="leader")
    parser.add_argument("--system-id", required=True)
    parser.add_argument("--session", type=int, action="append", default=[])
    parser.add_argument("--shm-prefix")
    parser.add_argument("--state-file")
    parser.add_argument("--admin-pid", type=int)
    parser.add_argument("--admin-start-time", type=int)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # the orderly stop's "done"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (a terminal's Ctrl-C is for the main process)

    def admin_stops(*_) -> None:  # (the main process is about to shut its admin down: see ADMIN_STOPS)
        args.admin_pid = None
    signal.signal(ADMIN_STOPS, admin_stops)
    stopped_since: dict = {}
    next_reap = time.monotonic() + ORPHAN_CHECK_S
    while start_time(args.pid) == args.start_time and (
            args.admin_pid is None or start_time(args.admin_pid) == args.admin_start_time):
        time.sleep(POLL_S)
        if time.monotonic() >= next_reap and args.admin_pid is not None:  # (not once an orderly stop began)
            next_reap = time.monotonic() + ORPHAN_CHECK_S
            _reap(args, stopped_since)
    if start_time(args.pid) == args.start_time:  # its admin died, it lives on
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (its stop ends with a SIGTERM to us)
        _stop_after_admin_died(args)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the clean-up is not broken off half-way
    _clean_up(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
