"""Run a leader as a child process on free ports: for tests, benchmarks and scripts.

    with LocalLeader("configs/cpu_omni_demo.yaml") as leader:
        requests.post(leader.base_url + "/chat/completions", ...)

It runs the real CLI (``python -m omni_actors.system start --convention-leader``),
so what is tested is what a user runs. On exit it sends SIGINT (as Ctrl-C
does), waits for a clean exit, and kills whatever of the system is left.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from omni_actors.system.processes import kill_system, system_pids


def free_port() -> int:
    """A TCP port nothing listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LeaderStartError(RuntimeError):
    pass


class LocalLeader:
    """A leader process on free ports.

    Attributes (after start): ``port``, ``admin_port``, ``base_url``
    (``http://127.0.0.1:PORT/v1``), ``system_id``, ``log_path`` (its stderr,
    JSON lines), ``stdout_path``.

    Raises:
        LeaderStartError: it exited or did not serve within ``start_timeout_s``.
    """

    def __init__(self, config: str | os.PathLike, *, extra_args: list[str] | None = None,
                 start_timeout_s: float = 60.0, env: dict[str, str] | None = None,
                 log_level: str = "info"):
        self.config = str(config)
        self.extra_args = extra_args or []
        self.start_timeout_s = start_timeout_s
        self.env = env or {}
        self.log_level = log_level
        self.proc: subprocess.Popen | None = None
        self.exit_code: int | None = None
        self.left_after_exit: list[int] = []
        self.shm_dir: str | None = None  #: the leader's segment directory (None: this process's)

    def start(self) -> "LocalLeader":
        self.port, self.admin_port = free_port(), free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self._dir = Path(tempfile.mkdtemp(prefix="omni-actors-leader-"))
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
                raise LeaderStartError(f"leader exited with {self.proc.returncode}: {self.tail()}")
            if b"serving model" in self.stdout_path.read_bytes() and self._healthy():
                state = json.loads((self._dir / f"leader-{self.admin_port}.json").read_text())
                self.system_id = state["system_id"]
                self.sessions = state.get("sessions", [])
                self.shm_dir = state.get("shm_dir")  # where its segments live (--shm-dir)
                return self
            time.sleep(0.1)
        self.stop()
        raise LeaderStartError(f"leader did not serve within {self.start_timeout_s:g} s: {self.tail()}")

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
        return self.exit_code

    def pids(self) -> list[int]:
        """Live processes of this system (leader, admin, every actor)."""
        return system_pids(self.system_id, sessions=self.sessions) if getattr(self, "system_id", None) else []

    def __enter__(self) -> "LocalLeader":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
