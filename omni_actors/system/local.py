"""Run a leader as a child process on free ports: for tests, benchmarks and scripts.

    with LocalLeader("configs/cpu_omni_demo.yaml") as leader:
        requests.post(leader.base_url + "/chat/completions", ...)

It runs the real CLI (``python -m omni_actors.system start --convention-leader``),
so what is tested is what a user runs. On exit it sends SIGINT (as Ctrl-C
does), waits for a clean exit, and kills whatever of the system is left.

Its two ports are held (:func:`reserve_port`) from the moment they are picked
until the leader serves on them, so that no other process on the machine takes
them in between (see :class:`LocalLeader`).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from omni_actors.system.processes import kill_system, system_pids
from omni_actors.system.watchdog import is_watchdog


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it).

    Nothing keeps it free: for a port a server will bind later, use :func:`reserve_port`.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reserve_port() -> socket.socket:
    """A free TCP port held for a server that another process will start: a socket
    bound to it (all interfaces, ``SO_REUSEADDR``) that does not listen. Its port is
    ``sock.getsockname()[1]``; close the socket once the server listens.

    While it is open, Linux gives the port to no ``bind(("", 0))`` (every Thespian
    actor's listener, every other leader's data service) and to no outgoing
    connection, yet a server that sets ``SO_REUSEADDR`` binds and listens on it
    (Thespian's admin and aiohttp both do; a process binding it without that flag
    gets EADDRINUSE). With :func:`free_port` instead, the port is free only at the
    moment it is picked: an actor of another system starting in the seconds before
    the leader binds it can take it, and Thespian's admin start-up then gives up
    after about 11 s ("not a valid or useable ActorSystem Admin").
    """
    s = socket.socket()
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", 0))
    except OSError:
        s.close()
        raise
    return s


class LeaderStartError(RuntimeError):
    pass


#: Set to keep each LocalLeader's directory (its log, output and state files) after this process exits.
KEEP_DIRS_ENV = "OMNI_ACTORS_KEEP_LEADER_DIRS"
_dirs: list[Path] = []


def _remove_at_exit(path: Path) -> None:
    """Remove ``path`` when this process exits (the leader's logs stay readable after
    :meth:`LocalLeader.stop`, for the caller's asserts), unless ``$OMNI_ACTORS_KEEP_LEADER_DIRS``
    is set: test runs used to leave thousands of them in /tmp."""
    if not _dirs:
        atexit.register(_remove_dirs)
    _dirs.append(path)


def _remove_dirs() -> None:
    if not os.environ.get(KEEP_DIRS_ENV):
        for path in _dirs:
            shutil.rmtree(path, ignore_errors=True)


class LocalLeader:
    """A leader process on free ports.

    Both ports are reserved (:func:`reserve_port`) until the leader serves. Should the
    leader still exit because one of them could not be served (a port taken all the
    same, or a Thespian admin that did not come up on it), it is started again on
    fresh ports, up to ``start_attempts`` times in all; any other exit, or no answer
    within ``start_timeout_s`` (per attempt), fails at once. With ``admin_port`` the
    leader starts on that admin port (not reserved; every attempt tries it again).

    Attributes (after start): ``port``, ``admin_port``, ``base_url``
    (``http://127.0.0.1:PORT/v1``), ``system_id``, ``log_path`` (its stderr,
    JSON lines), ``stdout_path``, ``start_attempts_failed`` (one line per failed
    attempt before the one that served).

    Raises:
        LeaderStartError: it exited, did not serve within ``start_timeout_s``, or hit a
        port error in every attempt; the message has each attempt's error line.
    """

    def __init__(self, config: str | os.PathLike, *, extra_args: list[str] | None = None,
                 start_timeout_s: float = 60.0, env: dict[str, str] | None = None,
                 log_level: str = "info", start_attempts: int = 3, admin_port: int | None = None):
        self.config = str(config)
        #: the admin port to start on (e.g. a leader's again, for its members); None: a free one
        self.fixed_admin_port = admin_port
        self.extra_args = extra_args or []
        self.start_timeout_s = start_timeout_s
        self.start_attempts = start_attempts
        self.env = env or {}
        self.log_level = log_level
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self.left_after_exit: list[int] = []
        self.start_attempts_failed: list[str] = []
        self.shm_dir: str | None = None  #: the leader's segment directory (None: this process's)

    def start(self) -> "LocalLeader":
        for attempt in range(1, self.start_attempts + 1):
            reserved = [reserve_port()] + ([reserve_port()] if self.fixed_admin_port is None else [])
            try:
                self.port = reserved[0].getsockname()[1]
                self.admin_port = self.fixed_admin_port or reserved[1].getsockname()[1]
                if self._start_once():
                    return self
            finally:
                for s in reserved:  # the leader listens on both now, or has exited
                    s.close()
            self.start_attempts_failed.append(f"attempt {attempt} on port {self.port}, admin port "
                                              f"{self.admin_port}: {self._error_line()}")
        raise LeaderStartError(f"leader could not serve on fresh ports ({self.start_attempts} attempts): "
                               + "; ".join(self.start_attempts_failed) + f". Last output: {self.tail()}")

    def _start_once(self) -> bool:
        """Start the leader on ``self.port`` and ``self.admin_port``; wait until it serves.

        Returns:
            True once it serves; False when it exited because one of its ports could
            not be served (:meth:`_port_error`), which fresh ports can cure.

        Raises:
            LeaderStartError: it exited for any other reason, or did not serve in time.
        """
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._dir = Path(tempfile.mkdtemp(prefix="omni-actors-leader-"))
        _remove_at_exit(self._dir)
        self.log_path, self.stdout_path = self._dir / "leader.log", self._dir / "leader.out"
        env = {**os.environ, "OMNI_ACTORS_STATE_DIR": str(self._dir), **self.env}
        cmd = [sys.executable, "-m", "omni_actors.system", "start", "--convention-leader",
               "--config", self.config, "--port", str(self.port), "--admin-port", str(self.admin_port),
               "--log-level", self.log_level, *self.extra_args]
        # Append mode (O_APPEND): every actor process of the system writes to these files
        # through inherited descriptors; without it two writes can land at one offset and
        # one log line overwrites another (seen: a lost coordinator_restarted event).
        with open(self.stdout_path, "ab") as out, open(self.log_path, "ab") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if self._port_error():
                    return False  # its own clean-up has run (run_leader's finally)
                raise LeaderStartError(f"leader exited with {self.proc.returncode}"
                                       f"{self._earlier_attempts()}: {self.tail()}")
            if b"serving model" in self.stdout_path.read_bytes() and self._healthy():
                state = json.loads((self._dir / f"leader-{self.admin_port}.json").read_text())
                self.system_id = state["system_id"]
                self.sessions = state.get("sessions", [])
                self.shm_dir = state.get("shm_dir")  # where its segments live (--shm-dir)
                self.watchdog_pid = state.get("watchdog_pid")  # (see omni_actors.system.watchdog)
                return True
            time.sleep(0.1)
        self.stop()
        raise LeaderStartError(f"leader did not serve within {self.start_timeout_s:g} s"
                               f"{self._earlier_attempts()}: {self.tail()}")

    def _port_error(self) -> bool:
        """Whether the leader's ``error:`` line says one of its ports could not be served
        (leader.run_leader, processes.serve_args_error): taken by another process all
        the same, or a Thespian admin that did not come up on it."""
        line = self._error_line()
        return any(what in line for what in (
            f"admin port {self.admin_port} is in use",
            f"the actor system did not start on admin port {self.admin_port}",
            f"HTTP port {self.port} on ", "cannot serve HTTP on ",
            "--port and --admin-port must differ"))

    def _error_line(self) -> str:
        """The leader's last ``error: ...`` line on stderr (the CLI prints one when start-up fails)."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        lines = [line for line in text.splitlines() if line.startswith("error: ")]
        return lines[-1] if lines else f"exit code {self.proc.returncode if self.proc else None}"

    def _earlier_attempts(self) -> str:
        return f" (after {'; '.join(self.start_attempts_failed)})" if self.start_attempts_failed else ""

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def tail(self, n: int = 2000) -> str:
        text = b""
        for p in (self.stdout_path, self.log_path):
            if p.exists():
                text += p.read_bytes()[-n:]
        return text.decode(errors="replace")

    def stop(self, timeout_s: float = 20.0) -> int | None:
        """SIGINT, wait up to ``timeout_s``; returns the exit code. Kills leftovers."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.exit_code = self.proc.returncode
        if getattr(self, "system_id", None):
            #: what the leader's own shutdown left behind (tests assert it is empty)
            self.left_after_exit = system_pids(self.system_id, sessions=self.sessions)
            kill_system(self.system_id, sessions=self.sessions)
        watchdog = getattr(self, "watchdog_pid", None)
        if watchdog:  # the leader's orderly stop ends it; a killed leader's finishes its clean-up
            deadline = time.monotonic() + (0 if self.exit_code == 0 else 8)
            while is_watchdog(watchdog) and time.monotonic() < deadline:
                time.sleep(0.05)
            if is_watchdog(watchdog):
                self.left_after_exit.append(watchdog)
                os.kill(watchdog, signal.SIGKILL)
        return self.exit_code

    def pids(self) -> list[int]:
        """Live processes of this system (leader, admin, every actor)."""
        return system_pids(self.system_id, sessions=self.sessions) if getattr(self, "system_id", None) else []

    def __enter__(self) -> "LocalLeader":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
