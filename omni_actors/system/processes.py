"""Finding and ending the processes of one actor system (Linux ``/proc``).

Thespian's admin daemonises into a session of its own (``setsid``) and every
actor is forked from it, so the admin's **session** holds the whole actor
tree: the leader (or member) records the sessions of the children it starts
(:func:`child_sessions`). As a second net, the CLI puts a unique
``OMNI_ACTORS_SYSTEM_ID`` in its environment at exec time, which forks
inherit; ``/proc/<pid>/environ`` shows it, except where a process retitled
itself over its environment block (seen here for actors of member hosts).
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

ENV_SYSTEM_ID = "OMNI_ACTORS_SYSTEM_ID"
#: vLLM's setting for where its ZeroMQ IPC sockets go (default: the temp directory, where the
#: sockets of engines that were stopped or killed stay: 3 files per engine measured here).
ENV_VLLM_IPC = "VLLM_RPC_BASE_PATH"


def ipc_dir(system_id: str) -> str:
    """The directory of the vLLM IPC sockets of the system (one host's process tree)
    ``system_id``: ``<temp dir>/omni-actors-ipc-<first 16 characters of the id>`` (short: a
    socket path has at most 107 bytes). The leader or member removes it when it stops."""
    name, base = f"omni-actors-ipc-{system_id[:16]}", tempfile.gettempdir()
    return base if os.path.basename(base) == name else os.path.join(base, name)  # (it may be $TMPDIR now)


def own_ipc_dir() -> str | None:
    """This process's system's :func:`ipc_dir`, made (mode 0700); None outside any system."""
    system_id = os.environ.get(ENV_SYSTEM_ID)
    if not system_id:
        return None
    path = ipc_dir(system_id)
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def use_ipc_dir() -> str | None:
    """In a replica's process, before its vLLM engine starts: point ``$VLLM_RPC_BASE_PATH``
    at a directory of this process's own in this system's :func:`ipc_dir`
    (``<ipc dir>/p<pid>``, made, mode 0700), unless it is set already or this process
    belongs to no system; the directory, or None. :func:`release_ipc_dir` removes it
    when the engine has stopped: the sockets of a replica scaled down stayed until the
    system stopped."""
    if os.environ.get(ENV_VLLM_IPC):
        return None
    path = process_ipc_dir(os.getpid()) if own_ipc_dir() else None
    if path:
        os.makedirs(path, mode=0o700, exist_ok=True)
        os.environ[ENV_VLLM_IPC] = path
    return path


def process_ipc_dir(pid: int) -> str | None:
    """The directory :func:`use_ipc_dir` made (or would make) for process ``pid`` of this
    process's system, or None outside any system."""
    system_id = os.environ.get(ENV_SYSTEM_ID)
    return os.path.join(ipc_dir(system_id), f"p{pid}") if system_id else None


def release_ipc_dir(path: str | None) -> None:
    """Remove a directory :func:`use_ipc_dir` made (its engine has stopped); None: nothing."""
    if path and os.path.basename(os.path.dirname(path)).startswith("omni-actors-ipc-"):
        shutil.rmtree(path, ignore_errors=True)
        if os.environ.get(ENV_VLLM_IPC) == path:
            del os.environ[ENV_VLLM_IPC]


def use_ipc_dir_for_temp_files() -> str | None:
    """In a vLLM engine core's process, before vLLM starts: its temporary files go to the
    system's :func:`ipc_dir` (made, mode 0700), which the leader or member removes when it
    stops; the directory, or None where this process belongs to no system.

    vLLM makes one there per engine start: the ``torch.distributed`` FileStore of its
    single-process executor (``vllm_dist_<uuid>``, 2.4 KB), left in the temp directory before
    (13 after one session's test runs). torch's compile cache keeps its usual place
    (``$TORCHINDUCTOR_CACHE_DIR``, set to ``<temp dir>/torchinductor_<user>`` unless set),
    so it outlives the system as before."""
    path = own_ipc_dir()
    if not path:
        return None
    import getpass

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid
        user = str(os.getuid())
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), f"torchinductor_{user}"))
    os.environ["TMPDIR"] = path
    tempfile.tempdir = path
    return path


def remove_ipc_dir(system_id: str) -> int:
    """Remove the system's :func:`ipc_dir` (after its processes are gone); how many
    sockets (files) were left in it."""
    path = ipc_dir(system_id) if system_id else ""
    try:
        left = sum(len(files) for _, _, files in os.walk(path)) if path else 0
    except OSError:
        return 0
    shutil.rmtree(path, ignore_errors=True)
    return left


def sweep_stale_ipc_dirs() -> list[str]:
    """Remove the :func:`ipc_dir` s of systems none of whose processes runs any more (a member
    or leader killed outright, with its watchdog, leaves its own: vLLM's sockets, the device
    leases of ``actors.device_leases``); the paths removed. Run at a leader's or member's start."""
    base = tempfile.gettempdir()
    try:
        dirs = [d for d in os.listdir(base) if d.startswith("omni-actors-ipc-")]
    except OSError:
        return []
    if not dirs:
        return []
    live, needle = set(), f"{ENV_SYSTEM_ID}=".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        for var in env.split(b"\0"):
            if var.startswith(needle):
                live.add(var[len(needle):len(needle) + 16].decode(errors="replace"))
    removed = []
    for d in dirs:
        if d.removeprefix("omni-actors-ipc-") not in live:
            path = os.path.join(base, d)
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.exists(path):
                removed.append(path)
    return removed


#: Where POSIX named semaphores live on Linux, and the names Python's ``multiprocessing``
#: gives its own (``sem.mp-<random>``).
SEM_DIR = "/dev/shm"
SEM_PREFIX = "sem.mp-"


def boot_ticks_to_unix(ticks: int) -> float:
    """A time in clock ticks since boot (``/proc/<pid>/stat`` field 22) as Unix time."""
    with open("/proc/stat") as f:
        btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def remove_orphan_semaphores(since: float, directory: str = SEM_DIR) -> list[str]:
    """Unlink the ``multiprocessing`` semaphores (``sem.mp-*`` in ``directory``) made at or
    after ``since`` (Unix time, seconds) that no process has mapped; their names.

    A spawned child (vLLM's engine core) is handed its semaphores by name, so its parent
    unlinks them only when it is done with them; a system stopped while its engines load
    kills them first (a `stop` 3 s into the vLLM chain's start found three, and one of them
    stayed in ``/dev/shm`` for good). One that any process still maps (its inode in a
    ``/proc/<pid>/maps``) is in use and is kept; so is one older than ``since``: it cannot
    be this system's.
    """
    candidates: dict[int, str] = {}  # inode -> name
    try:
        for entry in os.scandir(directory):
            if entry.name.startswith(SEM_PREFIX):
                try:
                    st = entry.stat()
                except OSError:
                    continue
                if st.st_ctime >= since - 1.0:
                    candidates[st.st_ino] = entry.name
    except OSError:
        return []
    # (glibc maps a semaphore under a temporary name that it then links to the real one and
    # unlinks: a mapping names the inode, not the name)
    for proc in Path("/proc").iterdir():
        if not candidates:
            return []
        if not proc.name.isdigit():
            continue
        try:
            maps = (proc / "maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split(None, 5)
            if len(fields) == 6 and fields[5].startswith(directory + "/") and fields[4].isdigit():
                candidates.pop(int(fields[4]), None)
    removed = []
    for name in candidates.values():
        try:
            os.unlink(os.path.join(directory, name))
            removed.append(name)
        except OSError:
            pass
    return removed


def proc_stat(entry: Path) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name: state, ppid, pgrp, session, ..."""
    try:
        return (entry / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(pid: int | None = None) -> list[int]:
    """PIDs of ``pid``'s (default: this process's) children, theirs, and so on (zombies left out)."""
    pid = pid or os.getpid()
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = proc_stat(entry)
            if fields and fields[0] != "Z":
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], list(children.get(pid, ()))
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(children.get(child, ()))
    return found


def child_sessions(pid: int | None = None) -> list[int]:
    """Sessions of ``pid``'s children (zombies too) other than ``pid``'s own:
    called right after the actor system starts, these are its admin's session."""
    pid = pid or os.getpid()
    own = os.getsid(pid)
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = proc_stat(entry)
            if fields and int(fields[1]) == pid and int(fields[3]) != own:
                found.add(int(fields[3]))
    return sorted(found)


def handle_stop_signals(handler) -> None:
    """Install ``handler`` for SIGINT, SIGTERM and SIGHUP (its terminal was closed); SIGHUP
    not where it is ignored already (``nohup``: a code review's `nohup ... start &` stopped
    the whole system at logout). At SIGHUP, :func:`leave_terminal` first: the drain that
    follows prints to a terminal that is gone. A hang-up is one event: SIGHUP is ignored from
    then on (a shell passes the kernel's on to its jobs: a second one, taken for a second Ctrl-C,
    cut the drain short, and one at exit, where Python puts back the default action, ended a
    clean stop with status -1: likely what a CI run saw)."""
    def hung_up(signum, frame):
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        leave_terminal()
        return handler(signum, frame)

    hung_up.handler = handler  # (what it calls: for a reader of signal.getsignal)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN:
            continue
        signal.signal(sig, hung_up if sig == signal.SIGHUP else handler)


def leave_terminal() -> None:
    """Point this process's stdout and stderr, where they are a terminal (a character
    device), at /dev/null. After a hang-up (SIGHUP: the terminal closed) every write there
    fails (EIO): log lines are dropped quietly (``logs._Tolerant``), but a plain ``print`` raised
    and cut a drain short (a code review: a leader cut its requests in flight and exited
    with status 1; a member exited right after asking for its node's drain, killing the
    replicas it had just drained). Files and pipes are kept, but a write there that fails
    from now on (a pipe whose reader died with the terminal: ``start ... | tee run.log``, a
    diff review) points that one at /dev/null too and is dropped (:class:`_HungUp`)."""
    import stat

    for fd in (1, 2):
        try:
            if stat.S_ISCHR(os.fstat(fd).st_mode):
                _to_null(fd)
        except OSError:  # (closed: nothing to point anywhere)
            pass
    if not isinstance(sys.stdout, _HungUp):
        sys.stdout = _HungUp(sys.stdout)
    if not isinstance(sys.stderr, _HungUp):
        sys.stderr = _HungUp(sys.stderr)


def _to_null(fd: int) -> None:
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


class _HungUp:
    """``sys.stdout`` / ``sys.stderr`` after a hang-up (:func:`leave_terminal`): a write or
    flush that fails points the stream's descriptor at /dev/null and is dropped."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except (OSError, ValueError):
            self._drop()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (OSError, ValueError):
            self._drop()

    def _drop(self) -> None:
        try:
            _to_null(self._stream.fileno())
            self._stream.flush()  # (what it held goes to /dev/null now)
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def system_pids(system_id: str, *, exclude_self: bool = True, sessions: tuple[int, ...] | list[int] = ()) -> list[int]:
    """PIDs of live processes started with ``OMNI_ACTORS_SYSTEM_ID=system_id``.

    With ``exclude_self``, this process is left out. Multiprocessing resource
    trackers are always left out: they hold nothing and exit by themselves
    as soon as the processes that started them have exited.
    """
    needle = f"{ENV_SYSTEM_ID}={system_id}".encode()
    me = os.getpid()
    sessions = set(sessions)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if exclude_self and pid == me:
            continue
        fields = proc_stat(entry)
        if fields is None or fields[0] == "Z":  # zombies hold nothing
            continue
        try:
            env = (entry / "environ").read_bytes()
        except OSError:
            continue
        if int(fields[3]) not in sessions and not (system_id and needle in env.split(b"\0")):
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


def resume_stopped(system_id: str, sessions: tuple[int, ...] | list[int] = ()) -> int:
    """SIGCONT every process of a system that is stopped (state ``T``: a replica frozen by
    ``inject sigstop``, or by SIGSTOP from outside), so that it can take its exit request;
    how many. Called before the actor system shuts down: a stopped replica kept its pool,
    and so the whole tree, from exiting until Thespian's 10 s shutdown timeout, then ignored
    the SIGTERM that followed until the SIGKILL after the grace (a stop took 14 s)."""
    resumed = 0
    for pid in system_pids(system_id, sessions=sessions):
        fields = proc_stat(Path(f"/proc/{pid}"))
        if fields and fields[0] == "T":
            try:
                os.kill(pid, signal.SIGCONT)
                resumed += 1
            except ProcessLookupError:
                pass
    return resumed


#: After a SIGKILL, how long :func:`kill_system` waits for the processes to be gone: a
#: process with gigabytes mapped (a vLLM engine's KV cache) takes seconds to tear down.
KILLED_EXIT_WAIT_S = 10.0


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (a zombie holds nothing any more)."""
    fields = proc_stat(Path(f"/proc/{pid}"))
    return fields is not None and fields[0] != "Z"


def kill_system(system_id: str, grace_s: float = 3.0, sessions: tuple[int, ...] | list[int] = (),
                titles: list[str] | None = None, settle_s: float = 0.0) -> int:
    """SIGTERM (and SIGCONT, for stopped ones), then SIGKILL after ``grace_s``, every
    process of a system (by its id and by its admins' ``sessions``).

    Args:
        titles: if given, the titles (``ps`` names, e.g. ``"RequestActor ActorAddr-..."``)
            of the processes signalled are appended to it.
        settle_s: seconds to let processes that are exiting anyway go first, unsignalled
            and uncounted (0: none). After an orderly ``ActorSystem.shutdown()`` the admin
            answers before its process has exited; without this it was counted as killed.

    Returns:
        How many processes had to be signalled.
    """
    def alive():
        return system_pids(system_id, sessions=sessions)

    pids = alive()
    semaphores = mapped_semaphores(pids)
    deadline = time.monotonic() + settle_s
    while pids and time.monotonic() < deadline:
        time.sleep(0.05)
        pids = alive()
    initial = len(pids)
    if titles is not None:
        titles.extend(process_title(pid) for pid in pids)
    signalled: set[int] = set()
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, KILLED_EXIT_WAIT_S)):
        for pid in pids:
            try:
                os.kill(pid, sig)
                signalled.add(pid)
                if sig == signal.SIGTERM:
                    os.kill(pid, signal.SIGCONT)  # a stopped process takes its SIGTERM only once resumed
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        # (by pid too: a process tearing down its memory no longer shows its environment, so
        # `alive()` missed it, and a trial's `stop` returned before a vLLM engine had exited)
        while time.monotonic() < deadline and (alive() or any(_running(pid) for pid in signalled)):
            time.sleep(0.05)
        pids = alive()
        if not pids:
            break
    _unlink_leaked_semaphores(semaphores)
    return initial


def mapped_semaphores(pids: list[int]) -> set[tuple[int, int]]:
    """``(device, inode)`` of the POSIX named semaphores (``/dev/shm/sem.*`` files) that
    processes ``pids`` have mapped: multiprocessing's (vLLM's engine cores make some) are
    unlinked by the resource tracker of the process that made them, which does not happen
    when both are killed mid-start (a trial's stop during engine loading left ``sem.mp-*``
    files). By inode: glibc maps a semaphore under a temporary name before it links it."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    parts = line.split(maxsplit=5)  # address perms offset dev inode path
                    if len(parts) == 6 and parts[5].startswith("/dev/shm/sem."):
                        major, minor = (int(x, 16) for x in parts[3].split(":"))
                        found.add((os.makedev(major, minor), int(parts[4])))
        except (OSError, ValueError):
            pass
    return found


def _unlink_leaked_semaphores(inodes: set[tuple[int, int]], wait_s: float = 2.0,
                              directory: str = "/dev/shm") -> int:
    """Unlink the ``sem.*`` files of ``directory`` with these ``(device, inode)`` that are
    left once their resource trackers have had ``wait_s`` to do it (they clean up when
    the processes that made them are gone); how many."""
    def left() -> list[str]:
        out = []
        try:
            with os.scandir(directory) as it:
                for e in it:
                    if e.name.startswith("sem."):
                        try:
                            st = e.stat(follow_symlinks=False)
                        except OSError:
                            continue
                        if (st.st_dev, st.st_ino) in inodes:
                            out.append(e.path)
        except OSError:
            pass
        return out

    if not inodes:
        return 0
    deadline = time.monotonic() + wait_s
    paths = left()
    while paths and time.monotonic() < deadline:
        time.sleep(0.1)
        paths = left()
    removed = 0
    for path in paths:
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
    return removed


def process_title(pid: int) -> str:
    """A process's title (its command line, as ``ps`` shows it; Thespian names actor
    processes after their class), at most 80 characters; ``"?"`` when it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:80] or "?"


def serve_args_error(host: str, port: int, admin_port: int | None) -> str | None:
    """Why ``--host``/``--port``/``--admin-port`` cannot be served, as one line, or None.

    Checks ranges, that the two ports differ, that the host resolves to an address
    of this host, and that nothing listens on the HTTP port already (see
    ``http_bind_error``). ``admin_port`` None: no admin on this host (an API server
    attached to another host's convention).
    """
    for name, value in (("--port", port), ("--admin-port", admin_port)):
        if value is not None and not 1 <= value <= 65535:
            return f"{name} must be a TCP port, 1..65535 (got {value})"
    if port == admin_port:
        return f"--port and --admin-port must differ (both {port})"
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        return f"--host {host!r} is not a usable address: {exc}"
    return http_bind_error(host, port)


def http_bind_error(host: str, port: int) -> str | None:
    """Why the HTTP server could not listen on ``host:port``, as one line, or None.

    Binds (with SO_REUSEADDR, as the server does, then closes) to each address ``host``
    resolves to, rather than connecting: connecting to an address that is not this
    host's reached whatever answers there (a trial's ``--host`` of another machine
    read "is in use"). Like asyncio's ``create_server``, an address that cannot be
    assigned (EADDRNOTAVAIL: a family not enabled) is skipped while another binds;
    when none can be, ``host`` is not an address of this host.
    """
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as exc:
        return f"--host {host!r} is not a usable address: {exc}"
    not_here, bound = None, False
    for family, kind, proto, _, address in infos:  # (every one: the server binds each of them)
        try:
            s = socket.socket(family, kind, proto)
        except OSError:
            continue  # a family this host lacks
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
                bound = True
            except OSError as exc:
                if exc.errno == errno.EADDRNOTAVAIL:
                    not_here = not_here or exc
                    continue
                if exc.errno == errno.EADDRINUSE:
                    return f"HTTP port {port} on {host} is in use"
                return f"cannot bind HTTP port {port} on {host}: {exc}"
    if not_here is not None and not bound:
        return (f"--host {host} is not an address of this host "
                f"(cannot bind HTTP port {port} there: {not_here})")
    return None


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    """True when something accepts TCP connections on ``host:port`` (an IPv6 address too:
    an IPv4 socket raised for ``::1``, and `status` of a leader started with ``--host ::1``
    was a traceback; a code review)."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def cli(verb: str) -> str:
    """``python -m omni_actors.system VERB`` as this user can paste it: the interpreter
    running now, relative when it is under the working directory (``.venv/bin/python``,
    as after `make run`), bare ``python`` when that is the one on ``PATH``, else its
    full path (a trial pasted a printed ``python -m ...`` into a shell whose ``python``
    lacked the project's packages)."""
    exe = os.path.abspath(sys.executable)
    here = os.getcwd()
    on_path = shutil.which("python")
    # (not realpath: a venv's python is a link to the system's, which lacks the venv's packages)
    if on_path and os.path.abspath(on_path) == exe:
        shown = "python"
    elif exe.startswith(here + os.sep):
        shown = os.path.relpath(exe, here)
    else:
        shown = exe
    return f"{shown} -m omni_actors.system {verb}"

