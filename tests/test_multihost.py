"""Multi-host on one machine: a leader and two member hosts, each its own
Thespian admin on its own loopback port, started with the real CLI.

The config is tests/configs/multihost.yaml: the Thinker on node ``leader``,
two Talkers and two Code2Wavs on nodes ``m1`` / ``m2`` (each replica pinned
to one of the members' devices), heartbeat 0.5 s. Every member is stopped by
its finaliser (SIGINT, then SIGKILL to whatever is left in its admin's
session), then the leader; a member "host" is killed as a real host dies:
SIGKILL to the member process and to every process of its admin's session.

The last test runs the basic scenario again with the leader and each member
in a network namespace of its own (joined by veth pairs on a bridge), where
this runs as root and ``ip netns`` works; otherwise it is skipped with the
reason.

Measured times are printed (``pytest -s`` shows them).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import pytest

from omni_actors.system.faultlab import LoadGenerator, read_events
from omni_actors.system.local import LocalLeader, free_port, reserve_port
from omni_actors.system.processes import kill_system, system_pids
from omni_actors.system.watchdog import find_watchdog, is_watchdog

from conftest import ROOT, TEST_CONFIGS

pytestmark = pytest.mark.system

CONFIG = TEST_CONFIGS / "multihost.yaml"
MODEL = "multihost-test"
MEMBER_STAGES = ("talker", "code2wav")
#: what the replicas of each stage may run on (tests/configs/multihost.yaml)
NODES_OF = {"thinker": {"leader"}, "talker": {"m1", "m2"}, "code2wav": {"m1", "m2"}}
LIVE = ("starting", "ready", "draining", "isolated")
#: node loss to every lost replica ready elsewhere: measured 2.0-2.6 s here (README); the
#: bound leaves a loaded CI machine room (a review) and is still well short of the 20 s
#: queue_timeout_s a request waiting for the stage would run into
REPLACE_WITHIN_S = 10.0


# -- processes ----------------------------------------------------------------------------------
def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def _proc_stat(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes of session ``sid``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _proc_stat(int(entry.name))
            if fields and fields[0] != "Z" and int(fields[3]) == sid:
                found.append(int(entry.name))
    return found


def admin_pid(admin_port: int) -> int | None:
    """The Thespian admin listening on ``admin_port`` (its process title names the port)."""
    title = f"MultiProcAdmin ActorAddr-(T|:{admin_port})".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().rstrip(b"\0") == title:
                    return int(entry.name)
            except OSError:
                continue
    return None


class Member:
    """A member host: ``python -m omni_actors.system start --convention-address ...`` in a child process."""

    def __init__(self, workdir: Path, convention: str, name: str, devices: str, *,
                 env: dict[str, str] | None = None, prefix: list[str] | None = None, admin_port: int = 0,
                 extra_args: tuple[str, ...] = ()):
        self.name, self.devices, self.convention, self.extra_args = name, devices, convention, extra_args
        #: held until the member's admin listens on it (see reserve_port)
        self._reserved = None if admin_port else reserve_port()
        self.admin_port = admin_port or self._reserved.getsockname()[1]
        # (its own state directory, where it records itself for `stop`: not the user's ~/.omni-actors)
        self.env, self.prefix = {"OMNI_ACTORS_STATE_DIR": str(workdir / "member-state"), **(env or {})}, prefix or []
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None
        self.session: int | None = None
        self.watchdog: int | None = None
        self.system_id = ""
        self.left_after_exit: list[int] = []

    def start(self, timeout_s: float = 30.0) -> "Member":
        tag = f"{self.name}-{self.admin_port}"
        self.out, self.err = self.workdir / f"{tag}.out", self.workdir / f"{tag}.err"
        cmd = [*self.prefix, sys.executable, "-m", "omni_actors.system", "start",
               "--convention-address", self.convention, "--admin-port", str(self.admin_port),
               "--node-name", self.name, "--devices", self.devices, *self.extra_args]
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=ROOT,
                                         env={**os.environ, **self.env})
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"member {self.name} exited with {self.proc.returncode}: {self.tail()}")
                if b"joined the convention" in self.out.read_bytes():
                    break
                time.sleep(0.05)
            else:
                raise RuntimeError(f"member {self.name} did not start within {timeout_s:g} s: {self.tail()}")
        finally:
            if self._reserved is not None:  # its admin listens on the port now, or it has exited
                self._reserved.close()
                self._reserved = None
        admin = admin_pid(self.admin_port)
        assert admin is not None, f"no admin process for member {self.name} on port {self.admin_port}"
        self.session = os.getsid(admin)
        self.watchdog = find_watchdog(self.proc.pid)  # (started before "joined" is printed)
        try:
            env = Path(f"/proc/{self.proc.pid}/environ").read_bytes().split(b"\0")
            self.system_id = next((e.split(b"=", 1)[1].decode() for e in env
                                   if e.startswith(b"OMNI_ACTORS_SYSTEM_ID=")), "")
        except OSError:
            pass
        return self

    def pids(self) -> list[int]:
        """This host's processes: the member process, its admin's session (every actor placed here)."""
        pids = set(session_pids(self.session)) if self.session else set()
        if self.system_id:
            pids |= set(system_pids(self.system_id, sessions=[self.session] if self.session else []))
        if self.proc is not None and self.proc.poll() is None:
            pids.add(self.proc.pid)
        return sorted(pids)

    def kill(self) -> float:
        """SIGKILL the whole host at once (its watchdog too); returns when (Unix time)."""
        victims = self.pids() + ([self.watchdog] if self.watchdog and is_watchdog(self.watchdog) else [])
        at = time.time()
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        return at

    def stop(self) -> None:
        """SIGINT (as Ctrl-C), then SIGKILL whatever of this host is left."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.left_after_exit = self.pids()  # what its own shutdown left (a killed host: nothing to leave)
        if self.watchdog and self.proc.returncode == 0 and is_watchdog(self.watchdog):
            self.left_after_exit.append(self.watchdog)  # (an orderly stop ends it and waits for it)
            os.kill(self.watchdog, signal.SIGKILL)
        if self.left_after_exit:
            print(f"\nmember {self.name} (admin port {self.admin_port}) left {self.left_after_exit} after "
                  f"exit code {self.proc.returncode}: killing them")
        if self.system_id or self.session:
            kill_system(self.system_id, grace_s=1.0, sessions=[self.session] if self.session else [])
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # What a host killed outright (its watchdog too) left in shared memory: in a deployment,
        # that host's next start (or a `stop`) sweeps it; this one never starts again.
        from omni_actors.connectors import sweep_segments

        sweep_segments(f"oa-{self.admin_port}-")

    def tail(self, n: int = 1500) -> str:
        return "".join(p.read_bytes()[-n:].decode(errors="replace") for p in (self.out, self.err) if p.exists())


class Cluster:
    """A leader (LocalLeader) and its members; ``add_member`` registers each one's finaliser."""

    def __init__(self, request, workdir: Path, leader: LocalLeader, member_env: dict[str, str]):
        self.request, self.workdir, self.leader, self.member_env = request, workdir, leader, member_env
        self.members: dict[str, Member] = {}

    @property
    def base_url(self) -> str:
        return self.leader.base_url

    def add_member(self, name: str, devices: str) -> Member:
        """Start a member host (the real CLI) on a free admin port; it is stopped by a finaliser."""
        member = Member(self.workdir, f"127.0.0.1:{self.leader.admin_port}", name, devices, env=self.member_env)
        self.request.addfinalizer(member.stop)  # finalisers run last-in first-out: members before the leader
        self.members[name] = member
        return member.start()

    def stages(self) -> dict:
        with urllib.request.urlopen(self.base_url + "/stages", timeout=5) as r:
            return json.loads(r.read())

    def replicas(self, table: dict | None = None) -> list[dict]:
        table = table or self.stages()
        return [dict(r, stage=st["stage"]) for st in table["stages"] for r in st["replicas"]]

    def wait(self, predicate, what: str, timeout_s: float = 30.0, poll_s: float = 0.05) -> tuple[float, list[dict]]:
        """Poll ``/v1/stages`` until ``predicate(replicas)``; returns (seconds waited, replicas)."""
        t0 = time.monotonic()
        reps: list[dict] = []
        while time.monotonic() - t0 < timeout_s:
            try:
                reps = self.replicas()
            except OSError:
                reps = []
            if reps and predicate(reps):
                return time.monotonic() - t0, reps
            time.sleep(poll_s)
        raise AssertionError(f"not {what} within {timeout_s:g} s: {_table(reps)}")

    def wait_all_ready(self, timeout_s: float = 30.0, **counts: int) -> list[dict]:
        """Every replica not stopped is ready (and, per stage, ``counts`` of them)."""
        def done(reps):
            live = [r for r in reps if r["state"] != "stopped"]
            if any(r["state"] != "ready" for r in live):
                return False
            per_stage = collections.Counter(r["stage"] for r in live)
            return all(per_stage[s] == n for s, n in counts.items())
        return self.wait(done, f"every replica ready {counts or ''}", timeout_s)[1]

    def cli(self, *args: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "omni_actors.system", *args,
                               "--admin-port", str(self.leader.admin_port)],
                              capture_output=True, text=True, timeout=timeout_s, cwd=ROOT,
                              env={**os.environ, "OMNI_ACTORS_STATE_DIR": str(self.leader.log_path.parent)})


def _table(reps: list[dict]) -> str:
    return "; ".join(f"{r['replica']} {r['state']} node={r['node'] or '-'} dev={r['devices'] or '-'} "
                     f"done={r['completed']}" + (f" ({r['reason'][:160]})" if r["reason"] else "")
                     for r in reps) or "(no table)"


def start_cluster(request, tmp_path: Path, *, config: Path = CONFIG, members=(("m1", "0,1,2"), ("m2", "3,4,5")),
                  env: dict[str, str] | None = None, wait_ready: bool = True) -> Cluster:
    """A leader (node ``leader``) and ``members`` (started together), each stopped by a finaliser."""
    env = env or {}
    leader = LocalLeader(config, extra_args=["--node-name", "leader"], env=env)
    request.addfinalizer(leader.stop)
    leader.start()
    cluster = Cluster(request, tmp_path, leader, env)
    threads = [threading.Thread(target=cluster.add_member, args=spec) for spec in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    missing = [name for name, _ in members if name not in cluster.members or cluster.members[name].session is None]
    assert not missing, f"members {missing} did not start: " + " | ".join(
        m.tail() for m in cluster.members.values())
    if wait_ready:
        cluster.wait_all_ready(talker=2, code2wav=2, thinker=1)
    return cluster


# -- checks ---------------------------------------------------------------------------------------
def assert_placement(reps: list[dict], *, devices_of: dict[str, set[str]] | None = None) -> None:
    """Live replicas: on a node their stage allows, pinned to devices of that node, no device twice."""
    devices_of = devices_of or {"m1": {"0", "1", "2"}, "m2": {"3", "4", "5"}}
    held: dict[tuple[str, str], str] = {}
    for r in reps:
        if r["state"] not in LIVE:
            continue
        assert r["node"] in NODES_OF[r["stage"]], f"{r['replica']} on node {r['node']!r}: {_table(reps)}"
        devices = [d for d in (r["devices"] or "").split(",") if d]
        if r["node"] == "leader":
            assert devices == [], f"the leader offers no devices, yet {r['replica']} got {devices}"
            continue
        assert len(devices) == 1, f"{r['replica']} got {devices}, not one device"
        for d in devices:
            assert d in devices_of[r["node"]], f"{r['replica']} got device {d}, not offered by {r['node']}"
            assert (r["node"], d) not in held, f"device {r['node']}:{d} given to {held[(r['node'], d)]} and " \
                                               f"{r['replica']}: {_table(reps)}"
            held[(r["node"], d)] = r["replica"]


def chat(base_url: str, *, audio: bool = True, timeout_s: float = 60.0, content: str = "Tell me about the sea.") \
        -> tuple[int, dict]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "modalities": ["text", "audio"] if audio else ["text"]}
    req = urllib.request.Request(base_url + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def assert_audio_reply(status: int, body: dict) -> None:
    assert status == 200, body
    message = body["choices"][0]["message"]
    assert message["content"] and message["audio"]["data"], body


async def burst(base_url: str, n: int, concurrency: int) -> list[int]:
    """``n`` text+audio requests, ``concurrency`` at a time; returns the statuses."""
    sem = asyncio.Semaphore(concurrency)

    async def one(session, i):
        body = {"model": MODEL, "messages": [{"role": "user", "content": f"story {i}"}],
                "modalities": ["text", "audio"]}
        async with sem:
            async with session.post(base_url + "/chat/completions", json=body) as r:
                data = await r.json()
                assert r.status != 200 or data["choices"][0]["message"]["audio"]["data"]
                return r.status

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        return list(await asyncio.gather(*(one(session, i) for i in range(n))))


def summarise(outcomes) -> str:
    return f"{sum(o.ok for o in outcomes)} of {len(outcomes)} ok; " + "; ".join(
        f"HTTP {o.status}: {o.error[:200]}" for o in outcomes if not o.ok)[:1500]


def assert_nothing_lost(outcomes, since: float) -> None:
    """Every request of the load ended 200 with audio, and the load went on after ``since``."""
    assert outcomes, "the load sent nothing"
    bad = [o for o in outcomes if not o.ok]
    assert not bad, summarise(outcomes)
    assert sum(o.start >= since for o in outcomes) >= 3, f"the load did not go on: {summarise(outcomes)}"


# -- the cluster shared by the serve and scale scenarios ------------------------------------------
@pytest.fixture(scope="module")
def cluster(request, tmp_path_factory) -> Cluster:
    return start_cluster(request, tmp_path_factory.mktemp("multihost"))


def test_1nm_across_hosts_serves_and_every_replica_gets_work(cluster):
    reps = cluster.replicas()
    assert_placement(reps)
    assert {r["node"] for r in reps if r["stage"] in MEMBER_STAGES} <= {"m1", "m2"}
    assert [r["node"] for r in reps if r["stage"] == "thinker"] == ["leader"]
    assert_audio_reply(*chat(cluster.base_url))
    t0, sent = time.monotonic(), 0
    while True:  # least-loaded routing spreads concurrent work; send until every replica has some
        statuses = asyncio.run(burst(cluster.base_url, 24, concurrency=8))
        sent += len(statuses)
        assert statuses == [200] * len(statuses), statuses
        try:
            _, reps = cluster.wait(lambda rs: all(r["completed"] > 0 for r in rs), "every replica busy",
                                   timeout_s=2.0)
            break
        except AssertionError:
            if sent >= 120:
                raise
    print(f"\n1:N:M across hosts: {sent + 1} requests in {time.monotonic() - t0:.1f} s; {_table(reps)}")
    assert_placement(reps)
    cluster.wait(lambda rs: all(sum(r["completed"] for r in rs if r["stage"] == st) >= sent + 1
                                for st in ("thinker", "talker", "code2wav")), "every request through every stage", 5)


def test_stop_on_a_members_admin_port_recorded_elsewhere_says_so_and_stops_nothing(cluster, tmp_path):
    member = cluster.members["m1"]
    out = subprocess.run([sys.executable, "-m", "omni_actors.system", "stop", "--admin-port", str(member.admin_port)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "OMNI_ACTORS_STATE_DIR": str(tmp_path)})
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out
    assert f"no omni-actors system recorded on admin port {member.admin_port}" in out.stderr
    # (a trial's leader recorded in another OMNI_ACTORS_STATE_DIR got only "a member or another program")
    assert "a leader or member that records itself elsewhere (started with another OMNI_ACTORS_STATE_DIR" \
        in out.stderr
    assert member.proc.poll() is None
    # (and a member keeps no zombie: the process that forked its admin was one for its whole life)
    zombies = [e.name for e in Path("/proc").iterdir() if e.name.isdigit()
               and (_proc_stat(int(e.name)) or ["", ""])[:2] == ["Z", str(member.proc.pid)]]
    assert zombies == [], zombies
    assert any(r["node"] == "m1" and r["state"] == "ready" for r in cluster.replicas())


def test_stop_on_a_members_admin_port_stops_that_member_as_its_ctrl_c_does(cluster):
    """``stop --admin-port`` of a member host: it drains and leaves (node ``left``), its
    processes end, the others serve on (before, it said "no system recorded" and a user had to
    find the member's pid)."""
    member = cluster.add_member("m3", "")
    pids = member.pids()
    record = json.loads((cluster.workdir / "member-state" / f"member-{member.admin_port}.json").read_text())
    # (`stop` waits as long as the member drains: the leader's drain_timeout_s, read when it joined)
    from omni_actors.config import load_config

    assert pids and record["drain_timeout_s"] == load_config(CONFIG).deployment.supervision.drain_timeout_s
    out = subprocess.run([sys.executable, "-m", "omni_actors.system", "stop", "--admin-port", str(member.admin_port)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, **member.env})
    assert (out.returncode, out.stderr) == (0, ""), out
    assert out.stdout == (f"stopped member 'm3' on admin port {member.admin_port} (it left the convention at "
                          f"{member.convention}; its replicas drained first)\n"), out.stdout
    assert member.proc.wait(10) == 0 and "omni-actors member stopped" in member.out.read_text()
    assert [pid for pid in pids if _proc_stat(pid) and _proc_stat(pid)[0] != "Z"] == []
    assert not (cluster.workdir / "member-state" / f"member-{member.admin_port}.json").exists()
    assert _nodes(cluster)["m3"]["state"] == "left"
    assert cluster.members["m1"].proc.poll() is None
    assert_audio_reply(*chat(cluster.base_url))


def test_signal_faults_and_logs_work_through_a_members_admin_port_on_the_leaders_host(cluster):
    """A member's admin port on the leader's host leads to the leader (README): a signal
    fault and the shell's `logs` work through it as through the leader's own. (Both
    were refused: "run it on the leader's host", "no leader log file known".)"""
    member = cluster.members["m1"]
    rep = next(r for r in cluster.replicas() if r["node"] == "m1" and r["state"] == "ready")

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "omni_actors.system", *args, "--admin-port",
                               str(member.admin_port)], capture_output=True, text=True, timeout=60, cwd=ROOT,
                              env={**os.environ, "OMNI_ACTORS_STATE_DIR": str(cluster.leader.log_path.parent)})

    # SIGCONT first, to a running replica (harmless): with heartbeats every 0.5 s a
    # replica held stopped while a second CLI starts (seconds on a loaded machine) is
    # isolated as silent and killed, and a SIGCONT after it is refused ("dead").
    resumed = cli("inject", "sigcont", "--replica", rep["replica"])
    assert resumed.returncode == 0, resumed.stderr
    assert f"{rep['replica']} (pid {rep['pid']}) was not stopped" in resumed.stdout, resumed.stdout
    asked_at = time.time()
    stopped = cli("inject", "sigstop", "--replica", rep["replica"])
    state = (_proc_stat(rep["pid"]) or ["gone"])[0]
    with contextlib.suppress(ProcessLookupError):
        os.kill(rep["pid"], signal.SIGCONT)  # (or the pool isolates and replaces it: both end ready)
    if state != "T":
        # (this process, starved 1.5 s after the CLI, read the state only once the stopped
        # replica had been isolated as silent and killed: that says it was stopped, too)
        silent = [e for e in read_events(cluster.leader.log_path, asked_at) if e["event"] == "replica_isolated"
                  and e.get("replica") == rep["replica"] and "silent" in str(e.get("reason"))]
        state = "T" if silent else state
    assert stopped.returncode == 0 and state == "T", (state, stopped.stderr)
    logs = cli("shell", "-c", "logs 5")
    assert logs.returncode == 0 and len(logs.stdout.splitlines()) == 5, logs
    cluster.wait_all_ready(30)
    # `status` through it reads the leader's record too (a code review: with the leader's
    # process stopped or gone it said ready and exited 0)
    os.kill(cluster.leader.proc.pid, signal.SIGSTOP)
    try:
        status = cli("status")
    finally:
        os.kill(cluster.leader.proc.pid, signal.SIGCONT)
    assert status.returncode == 3 and "NOT SERVING" in status.stdout.splitlines()[-1], status.stdout + status.stderr


def test_status_says_when_a_members_data_service_does_not_answer(cluster):
    """Trial BX: a member whose main process (its host's data service) was frozen showed alive,
    and `status` ready, while every stage output made there could not be fetched. Its node
    agent asks the data service every heartbeat interval: silent for 3 intervals (0.5 s here),
    the node says so (a note, `data_service_silent_s`, its label in the table); answering
    again, no more."""
    member = cluster.members["m1"]
    os.kill(member.proc.pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 15
        while True:
            table = cluster.stages()
            node = next(n for n in table["nodes"] if n["name"] == "m1")
            if node["data_service_silent_s"]:
                break
            assert time.monotonic() < deadline, node
            time.sleep(0.2)
    finally:
        os.kill(member.proc.pid, signal.SIGCONT)
    assert node["state"] == "alive" and node["data_service_silent_s"] >= 1.5, node
    assert any(note.startswith("node m1: its data service has not answered for ") for note in table["notes"]), table
    deadline = time.monotonic() + 10
    while next(n for n in cluster.stages()["nodes"] if n["name"] == "m1")["data_service_silent_s"]:
        assert time.monotonic() < deadline, "still silent after it was resumed"
        time.sleep(0.2)
    cluster.wait_all_ready(30)


def test_a_member_replica_killed_by_sigkill_says_so_in_its_reason(cluster):
    """A replica on a member host is a child of that host's admin, which reaps it: its reason
    read only "process exited" there (trial AN), where a leader-host replica's says how."""
    rep = next(r for r in cluster.replicas() if r["node"] == "m1" and r["state"] == "ready")
    os.kill(rep["pid"], signal.SIGKILL)
    _, reps = cluster.wait(lambda rs: any(r["replica"] == rep["replica"] and r["state"] == "ready"
                                          and r["pid"] != rep["pid"] for r in rs), "the replica restarted", 30)
    new = next(r for r in reps if r["replica"] == rep["replica"])
    assert "it was down: process exited (killed by SIGKILL)" in new["reason"], new
    cluster.wait_all_ready(30)


def test_stage_scale_up_and_down_under_load_loses_nothing(cluster):
    """talker and code2wav 2 -> 3 (every device in use), -> 1, -> 2 (on freed devices), all under load."""
    async def scenario():
        load = LoadGenerator(cluster.base_url, clients=4, max_tokens=8, request_timeout_s=30, duration_s=120)
        task = asyncio.create_task(load.run())
        try:
            await asyncio.sleep(1.0)
            started = time.time()
            steps = []
            for replicas in (3, 1, 2):
                t0 = time.monotonic()
                for stage in MEMBER_STAGES:
                    out = await asyncio.to_thread(cluster.cli, "stage", "scale", "--stage", stage,
                                                  "--replicas", str(replicas))
                    assert out.returncode == 0, out.stderr
                reps = await asyncio.to_thread(cluster.wait_all_ready, 30, talker=replicas, code2wav=replicas)
                assert_placement(reps)
                steps.append((replicas, round(time.monotonic() - t0, 2), _table(reps)))
                await asyncio.sleep(1.0)  # load on the new shape
        finally:
            load.stop()
            outcomes = await task
        return started, steps, outcomes

    started, steps, outcomes = asyncio.run(scenario())
    for replicas, took, table in steps:
        print(f"\nscaled to {replicas} in {took} s: {table}")
    print(f"load during scaling: {summarise(outcomes)}")
    assert_nothing_lost(outcomes, started)
    reps = cluster.replicas()
    live = [r for r in reps if r["state"] != "stopped"]
    assert collections.Counter(r["stage"] for r in live) == {"thinker": 1, "talker": 2, "code2wav": 2}
    assert all(r["reason"] == "scaled down" for r in reps if r["state"] == "stopped")
    # the replicas made at the last step took work
    newest = {st: max((r for r in live if r["stage"] == st), key=lambda r: int(r["replica"].split("/")[1]))
              for st in MEMBER_STAGES}
    asyncio.run(burst(cluster.base_url, 16, concurrency=8))
    cluster.wait(lambda rs: all(r["completed"] > 0 for r in rs if r["replica"] in
                                {n["replica"] for n in newest.values()}), "the newest replicas busy", 5)


# -- launch order ----------------------------------------------------------------------------------
def test_leader_first_member_replicas_pending_and_a_request_waits_until_members_join(request, tmp_path):
    cluster = start_cluster(request, tmp_path, members=(), wait_ready=False)
    reps = cluster.replicas()
    for r in reps:
        if r["stage"] in MEMBER_STAGES:
            assert r["state"] == "pending", _table(reps)
            assert r["reason"] == (f"{r['replica']} may run only on nodes m1 (not joined), m2 (not joined): it "
                                   "waits for a member of one of those names to join (the nodes now: leader)"), \
                r["reason"]
        else:
            assert r["state"] == "ready" and r["node"] == "leader", _table(reps)
    # text alone needs only the Thinker, which runs on the leader
    status, body = chat(cluster.base_url, audio=False)
    assert status == 200 and body["choices"][0]["message"]["content"], body
    result: dict = {}

    def ask():
        t0 = time.monotonic()
        result["reply"] = chat(cluster.base_url, timeout_s=60)
        result["took"] = time.monotonic() - t0

    waiting = threading.Thread(target=ask)
    waiting.start()
    time.sleep(1.5)
    assert waiting.is_alive(), f"the request did not wait for the members: {result}"
    t_join = time.monotonic()
    threads = [threading.Thread(target=cluster.add_member, args=spec) for spec in (("m1", "0,1,2"), ("m2", "3,4,5"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    waiting.join(60)
    assert not waiting.is_alive()
    assert_audio_reply(*result["reply"])
    print(f"\nleader first: the audio request waited {result['took']:.2f} s and succeeded "
          f"{time.monotonic() - t_join:.2f} s after the members were started")
    reps = cluster.wait_all_ready(talker=2, code2wav=2)
    assert_placement(reps)


def test_a_member_started_before_its_leader_waits_for_it_and_joins(request, tmp_path):
    """Hosts started together, in any order (as a scheduler does): a member whose leader
    does not answer yet waits for it (``--leader-wait``, 60 s by default) and joins once
    it is up; it used to exit at once ("no convention leader answers"), so hosts had to
    be started in order. One that waits in vain says for how long, with exit status 1."""
    held = reserve_port()  # (until the leader listens there: another system's actor could take it)
    request.addfinalizer(held.close)
    leader_port = held.getsockname()[1]
    member = Member(tmp_path, f"127.0.0.1:{leader_port}", "m1", "0,1,2,3,4,5")
    request.addfinalizer(member.stop)
    joining = threading.Thread(target=member.start, kwargs={"timeout_s": 90})
    joining.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (member.proc and b"waiting up to 60 s" in member.out.read_bytes()):
        time.sleep(0.1)
    assert b"no convention leader answers" in member.out.read_bytes(), member.tail()
    leader = LocalLeader(CONFIG, extra_args=["--node-name", "leader"], admin_port=leader_port)
    request.addfinalizer(leader.stop)
    leader.start()
    held.close()
    joining.join(90)
    assert member.session is not None, f"the member did not join: {member.tail()}"
    cluster = Cluster(request, tmp_path, leader, {})
    cluster.members["m1"] = member
    cluster.wait(lambda reps: any(r["node"] == "m1" and r["state"] == "ready" for r in reps), "placed on m1")

    out = subprocess.run([sys.executable, "-m", "omni_actors.system", "start", "--convention-address",
                          f"127.0.0.1:{free_port()}", "--admin-port", str(free_port()), "--leader-wait", "1"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 1 and out.stderr.strip().endswith("(waited 1 s: --leader-wait)"), out.stderr


def test_a_member_waiting_for_its_leader_is_stopped_by_stop_and_leaves_no_record(tmp_path):
    """A code review: `stop --admin-port` of a member still waiting for its leader said "no
    omni-actors system recorded on admin port N", and the member joined later. It records
    itself while it waits now; `stop` ends the wait and says so, and the record goes."""
    member = Member(tmp_path, f"127.0.0.1:{free_port()}", "w1", "")
    starting = threading.Thread(target=lambda: pytest.raises(RuntimeError, member.start, timeout_s=60))
    starting.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (member.proc and b"waiting up to 60 s" in member.out.read_bytes()):
            time.sleep(0.1)
        assert b"waiting up to 60 s" in member.out.read_bytes(), member.tail()
        out = subprocess.run([sys.executable, "-m", "omni_actors.system", "status", "--admin-port",
                              str(member.admin_port)], capture_output=True, text=True, cwd=ROOT, timeout=60,
                             env={**os.environ, **member.env})
        assert out.returncode == 1 and out.stderr.strip() == (
            f"error: the member on admin port {member.admin_port} is still waiting for its leader at "
            f"{member.convention}: it has no admin yet"), out.stderr  # (trial BO: "no actor system")
        out = subprocess.run([sys.executable, "-m", "omni_actors.system", "stop", "--admin-port",
                              str(member.admin_port)], capture_output=True, text=True, cwd=ROOT, timeout=60,
                             env={**os.environ, **member.env})
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == (f"stopped member 'w1' on admin port {member.admin_port} (it had not joined "
                                      f"the convention at {member.convention}: it was waiting for its leader)")
        assert member.proc.wait(10) == 130
        assert list((tmp_path / "member-state").glob("**/*.json")) == []
    finally:
        starting.join(60)
        member.stop()
    # one that gives up waiting removes its record as well
    out = subprocess.run([sys.executable, "-m", "omni_actors.system", "start", "--convention-address",
                          f"127.0.0.1:{free_port()}", "--admin-port", str(free_port()), "--leader-wait", "1"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60, env={**os.environ, **member.env})
    assert out.returncode == 1 and list((tmp_path / "member-state").glob("**/*.json")) == []


def test_a_member_whose_process_and_watchdog_were_killed_is_stopped_by_its_node_agent(request, tmp_path):
    """The member's own process SIGKILLed after its watchdog: its node agent sees the process
    gone at its next heartbeat, reports the node lost and why, and stops the host's actors.
    They lived on, shown ready, their outputs unreadable (a trial: every request whose
    audio was over 64 KiB failed with a 500), and nothing could stop them."""
    from omni_actors.connectors import list_segments

    cluster = start_cluster(request, tmp_path, members=(("m1", "0,1,2"), ("m2", "3,4,5")))
    member = cluster.members["m1"]
    since = time.time()
    os.kill(member.watchdog, signal.SIGKILL)
    member.proc.kill()
    member.proc.wait(10)
    def said() -> str:
        return member.err.read_text(errors="replace")

    # (the clean-up watchdog kills the actors, then sweeps the segments, then says so: wait
    # for all three, as a CI run read stderr between the first and the last)
    deadline = time.monotonic() + 15
    while (member.pids() or list_segments(f"oa-{member.admin_port}-")
           or "died without stopping its system" not in said()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert member.pids() == [], member.pids()
    assert list_segments(f"oa-{member.admin_port}-") == []
    assert "host_process_gone" in said() and "died without stopping its system" in said(), said()[-2000:]
    lost = [e for e in read_events(cluster.leader.log_path, since) if e.get("event") in ("node_lost", "node_left")]
    assert [(e["event"], e["node"], e["reason"]) for e in lost] == [
        ("node_lost", "m1", f"its member process (pid {member.proc.pid}) died")], lost
    status, body = chat(cluster.base_url, timeout_s=60)
    assert status == 200, body


def test_a_member_killed_outright_takes_its_actors_with_it(request, tmp_path):
    """The member's own process SIGKILLed (as the OOM killer would): its watchdog stops the
    admin and every actor on that host within seconds, and the leader loses the node and
    serves on. They lived on, serving nothing (the host's data service died with it)."""
    cluster = start_cluster(request, tmp_path, members=(("m1", "0,1,2"), ("m2", "3,4,5")))
    member = cluster.members["m1"]
    assert member.watchdog is not None and is_watchdog(member.watchdog)
    actors = [pid for pid in member.pids() if pid != member.proc.pid]
    assert actors, "no actor on m1"
    since = time.time()
    member.proc.kill()
    member.proc.wait(10)
    deadline = time.monotonic() + 15
    while (member.pids() or is_watchdog(member.watchdog)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert member.pids() == [], member.pids()
    assert not is_watchdog(member.watchdog)
    said = member.err.read_text(errors="replace")
    assert re.search(rf"the member process \(pid {member.proc.pid}\) died without stopping its system; "
                     r"stopped its [1-9]\d* remaining process\(es\) on this host", said), said[-2000:]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        lost = [e for e in read_events(cluster.leader.log_path, since) if e.get("event") in ("node_lost", "node_left")]
        if lost:
            break
        time.sleep(0.2)
    assert [(e["event"], e["node"], e["reason"]) for e in lost] == [
        ("node_lost", "m1", f"its member process (pid {member.proc.pid}) died")], lost
    status, body = chat(cluster.base_url, timeout_s=60)
    assert status == 200, body


def test_no_member_joins_a_request_gets_a_clear_503_after_queue_timeout(request, tmp_path):
    config = tmp_path / "multihost_short_queue.yaml"
    text = CONFIG.read_text()
    assert "queue_timeout_s: 20" in text
    config.write_text(text.replace("queue_timeout_s: 20", "queue_timeout_s: 1.5"))
    cluster = start_cluster(request, tmp_path, config=config, members=(), wait_ready=False)
    t0 = time.monotonic()
    status, body = chat(cluster.base_url, timeout_s=30)
    took = time.monotonic() - t0
    print(f"\nno members: HTTP {status} after {took:.2f} s: {body}")
    assert status == 503, body
    message = body["error"]["message"]
    assert "no ready replica of stage talker within 1.5 s" in message, message
    assert "may run only on nodes m1 (not joined), m2 (not joined)" in message, message
    assert 1.0 <= took < 10, took
    # the system keeps serving what it can
    status, body = chat(cluster.base_url, audio=False)
    assert status == 200, body


# -- host loss -------------------------------------------------------------------------------------
#: Seconds ``kill_busiest_member``'s ``around_kill`` holds (what it returns is called then):
#: less than the 1.5 s of silence (3 heartbeats of 0.5 s) that isolates a replica held stopped.
AROUND_KILL_S = 0.6


def kill_busiest_member(cluster: Cluster, clients: int = 4, extra=None, process_only: bool = False,
                        around_kill=None) -> dict:
    """Under a steady load: SIGKILL the member host holding most replicas (``process_only``: only
    its main process, as the OOM killer would: its watchdog stops the rest); wait until all of
    them are ready elsewhere, keep the load on a moment, then ``extra(cluster, victim)`` (under
    load too). ``around_kill(cluster)``, called just before the kill, returns what to call
    ``AROUND_KILL_S`` after that."""
    reps = cluster.replicas()
    counts = collections.Counter(r["node"] for r in reps if r["stage"] in MEMBER_STAGES)
    victim = counts.most_common(1)[0][0]
    lost = sorted(r["replica"] for r in reps if r["node"] == victim)
    member = cluster.members[victim]
    devices_of = {"m1": {"0", "1", "2", "3"}, "m2": {"4", "5", "6", "7"}}

    async def scenario():
        load = LoadGenerator(cluster.base_url, clients=clients, max_tokens=8, request_timeout_s=30,
                             duration_s=120)
        task = asyncio.create_task(load.run())
        try:
            await asyncio.sleep(1.5)
            after_kill = around_kill(cluster) if around_kill else None
            # (undone on a timer, not after the kill returns: the kill scans /proc for the host's
            # processes first and reaps it after, seconds on a loaded machine, a review)
            undo = threading.Timer(AROUND_KILL_S, after_kill) if after_kill else None
            if undo:
                undo.start()
            if process_only:
                killed_at = time.time()
                member.proc.kill()
            else:
                killed_at = await asyncio.to_thread(member.kill)
            if undo:
                await asyncio.to_thread(undo.join)

            def replaced(rs):
                assert_placement(rs, devices_of=devices_of)
                return all(r["state"] == "ready" and r["node"] != victim for r in rs if r["state"] != "stopped")

            _, after = await asyncio.to_thread(cluster.wait, replaced, "re-placed", 20.0, 0.05)
            took = time.time() - killed_at
            await asyncio.sleep(1.5)
            done = await asyncio.to_thread(extra, cluster, victim) if extra else None
        finally:
            load.stop()
            outcomes = await task
        return killed_at, took, after, done, outcomes

    killed_at, took, after, done, outcomes = asyncio.run(scenario())
    events = read_events(cluster.leader.log_path, killed_at - 1)
    lost_event = next((e for e in events if e["event"] == "node_lost" and e.get("node") == victim), None)
    assert lost_event is not None, f"no node_lost event for {victim}"
    detected = lost_event["t"] - killed_at
    print(f"\nkilled {victim} (held {lost}; {len(member.pids())} processes left): "
          f"detected after {detected:.2f} s ({lost_event.get('reason')}), all re-placed after {took:.2f} s; "
          f"{_table(after)}\nload: {summarise(outcomes)}")
    return {"victim": victim, "member": member, "lost": lost, "detected": detected, "replaced": took, "after": after,
            "outcomes": outcomes, "killed_at": killed_at, "extra": done}


def test_member_host_sigkill_is_detected_and_its_replicas_replaced_without_losing_requests(request, tmp_path):
    # four devices each: either member can take all four member replicas alone
    cluster = start_cluster(request, tmp_path, members=(("m1", "0,1,2,3"), ("m2", "4,5,6,7")))
    r = kill_busiest_member(cluster)
    assert r["lost"], "the killed member held no replica"
    assert r["detected"] < REPLACE_WITHIN_S, r["detected"]
    assert r["replaced"] < REPLACE_WITHIN_S, f"re-placed after {r['replaced']:.2f} s"
    assert r["member"].pids() == []
    assert_nothing_lost(r["outcomes"], r["killed_at"])
    survivor = ({"m1", "m2"} - {r["victim"]}).pop()
    assert {x["node"] for x in r["after"] if x["stage"] in MEMBER_STAGES and x["state"] == "ready"} == {survivor}


def test_a_member_process_killed_under_load_loses_no_request(request, tmp_path):
    """Only the member's main process SIGKILLed under load (its data service with it): its
    watchdog stops its actors, the node is lost, and a request whose output was on it runs
    again once the node is reported down. A trial lost 6-9 requests this way ("final
    output lost ... after the request ran again": the rerun went to the dying host)."""
    cluster = start_cluster(request, tmp_path, members=(("m1", "0,1,2,3"), ("m2", "4,5,6,7")))
    r = kill_busiest_member(cluster, process_only=True)
    assert r["lost"], "the killed member held no replica"
    assert r["replaced"] < REPLACE_WITHIN_S, f"re-placed after {r['replaced']:.2f} s"
    deadline = time.monotonic() + 10
    while r["member"].pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert r["member"].pids() == []
    assert_nothing_lost(r["outcomes"], r["killed_at"])


def test_a_member_killed_while_the_leader_reads_its_outputs_loses_no_request(request, tmp_path, monkeypatch):
    """Talkers on the members, Code2Wav on the leader, streaming between them through the
    members' data services: at the kill, Code2Wav has chunks to read from the dead host
    (it is held with SIGSTOP for 0.6 s around the kill, less than its heartbeats allow).
    Those requests end with their input lost (INPUT_LOST) and run again once the node is
    reported down; Code2Wav, healthy, is neither retried against the dead service nor
    isolated. (A trial: 2 requests failed with 500 "data service ... unreachable", and the
    only Code2Wav was retried 5 times in 50 ms and isolated by its circuit breaker.) The kill
    catches Code2Wav with unread chunks of the dead host in most runs (1-3 inputs lost in 6
    of 8 here; without the fix those requests failed); what is asserted holds either way, and
    the engine, RequestActor and bridge logic tests cover the path itself."""
    text = CONFIG.read_text()
    for old, new in (("code2wav: {replicas: 2, nodes: [m1, m2]}", "code2wav: {replicas: 1, nodes: [leader]}"),
                     ("  request_timeout_s: 60\n", "  request_timeout_s: 60\n  inline_threshold_bytes: 0\n"
                                                   "  streaming: {enabled: true, chunk_tokens: 4}\n")):
        assert old in text, old
        text = text.replace(old, new)
    config = tmp_path / "multihost_code2wav_on_leader.yaml"
    config.write_text(text)
    monkeypatch.setitem(NODES_OF, "code2wav", {"leader"})
    cluster = start_cluster(request, tmp_path, config=config, members=(("m1", "0,1,2,3"), ("m2", "4,5,6,7")),
                            wait_ready=False)
    cluster.wait_all_ready(talker=2, code2wav=1, thinker=1)

    def hold_code2wav(cluster):
        (c2w,) = [x for x in cluster.replicas() if x["stage"] == "code2wav"]
        os.kill(c2w["pid"], signal.SIGSTOP)
        return lambda: os.kill(c2w["pid"], signal.SIGCONT)

    r = kill_busiest_member(cluster, clients=6, around_kill=hold_code2wav)
    events = read_events(cluster.leader.log_path, r["killed_at"] - 1)
    counts = collections.Counter(e["event"] for e in events)
    print(f"inputs lost: {counts['stage_input_lost']}, requests run again: {counts['http_request_rerun']}, "
          f"retries: {counts['stage_retry']}")
    assert_nothing_lost(r["outcomes"], r["killed_at"])
    isolated = [e for e in events if e["event"] == "replica_isolated" and "code2wav" in str(e.get("replica"))]
    assert not isolated, isolated
    (c2w,) = [x for x in cluster.replicas() if x["stage"] == "code2wav"]
    assert c2w["state"] == "ready" and not c2w.get("restarts"), c2w


def _demo_variant(tmp_path, *, thinker_ms: float | None = None, code2wav_ms: float | None = None,
                  drain_timeout_s: float | None = None, queue_timeout_s: float | None = None) -> Path:
    """The CPU demo config with a Thinker / Code2Wav of ``*_ms`` a token (their other synthetic
    costs left at 0) and ``supervision.drain_timeout_s`` / ``queue_timeout_s``, written under
    ``tmp_path``."""
    import yaml

    cfg = yaml.safe_load(CONFIG.read_text())
    for stage, ms in (("thinker", thinker_ms), ("code2wav", code2wav_ms)):
        if ms is not None:
            cfg["deployment"]["stages"][stage]["synthetic"] = {"decode_ms_per_token": ms}
    if drain_timeout_s is not None:
        cfg["deployment"]["supervision"]["drain_timeout_s"] = drain_timeout_s
    if queue_timeout_s is not None:
        cfg["deployment"]["supervision"]["queue_timeout_s"] = queue_timeout_s
    config = tmp_path / "demo-variant.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return config


def _stream(base_url: str, max_tokens: int) -> tuple[int, list[str]]:
    """One streamed text + audio chat: (HTTP status, its SSE data payloads)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "modalities": ["text", "audio"], "stream": True, "max_tokens": max_tokens}
    req = urllib.request.Request(base_url + "/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, [line[6:].decode().strip() for line in r if line.startswith(b"data: ")]
    except urllib.error.HTTPError as err:
        return err.code, [err.read().decode()]


def test_a_member_leaving_with_ctrl_c_drains_its_replicas_first(request, tmp_path):
    """Ctrl-C on a member host with audio streaming from its Code2Wav: it has the coordinator
    drain its replicas (replacements start on the other member, nothing new is sent to it), waits
    until the work in flight there is done, then leaves. Every stream ends with [DONE] and no
    error event (a trial's stream was cut: "replica code2wav/4 dead: process exited mid-stream")."""
    config = _demo_variant(tmp_path, thinker_ms=5, code2wav_ms=20)
    cluster = start_cluster(request, tmp_path, config=config, members=(("m1", "0,1,2,3"), ("m2", "4,5,6,7")))
    with ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(_stream, cluster.base_url, 40) for _ in range(6)]
        _, reps = cluster.wait(lambda rs: any(r["stage"] == "code2wav" and r["in_flight"] for r in rs),
                               "a code2wav busy", 20, poll_s=0.02)
        time.sleep(0.3)  # (its first audio parts have gone out)
        victim = next(r["node"] for r in reps if r["stage"] == "code2wav" and r["in_flight"])
        member = cluster.members[victim]
        member.proc.send_signal(signal.SIGINT)
        results = [f.result(90) for f in streams]
    assert member.proc.wait(30) == 0
    for status, events in results:
        assert status == 200 and events[-1] == "[DONE]", (status, events[-3:])
        errors = [e for e in events if e.startswith('{"error"')]
        assert not errors, errors
    out = member.out.read_text()
    assert f"leaving: the replicas on node {victim} drain" in out, out
    assert "warning: stage" not in out, out  # (the other member took its stages' replacements)
    _, reps = cluster.wait(lambda rs: sum(r["state"] == "ready" for r in rs if r["stage"] in MEMBER_STAGES) == 4,
                           "two talkers and two code2wavs ready again", 20)
    assert all(r["node"] != victim for r in reps if r["state"] in LIVE), _table(reps)
    # (once the node has left, its drained replicas say so: trial AN read "is leaving" after it)
    _, reps = cluster.wait(lambda rs: all(f"node {victim} left the convention (replaced by" in r["reason"]
                                          for r in rs if r["node"] == victim and r["stage"] in MEMBER_STAGES),
                           "the drained replicas say the node left", 10)
    drained = [r for r in reps if r["node"] == victim and r["stage"] in MEMBER_STAGES]
    assert drained and all(r["state"] == "stopped" for r in drained), _table(reps)
    events = [e["event"] for e in read_events(cluster.leader.log_path, 0) if e.get("node") == victim]
    assert "node_leaving" in events and "node_left" in events and "node_lost" not in events, events


def test_the_last_member_of_a_stage_says_that_leaving_leaves_the_stage_without_replicas(request, tmp_path):
    """Ctrl-C on the only member that can run the Talker and Code2Wav: it still leaves (exit
    0), and says on its way out that those stages have no replica running any more, with
    their replacements' state, and what requests meet. (A trial's member left in silence:
    each request then waited the queue timeout three times over, the client's retries.)"""
    cluster = start_cluster(request, tmp_path, members=(("m1", "0,1,2,3"),))
    member = cluster.members["m1"]
    member.proc.send_signal(signal.SIGINT)
    assert member.proc.wait(30) == 0
    # (trial AR: its drain record, for `stop` to read, was left behind; nobody reads it after Ctrl-C)
    assert list(Path(member.env["OMNI_ACTORS_STATE_DIR"]).glob("*.drain")) == []
    out = member.out.read_text()
    for stage in MEMBER_STAGES:
        line = next((x for x in out.splitlines() if x.startswith(f"warning: stage {stage} ")), None)
        assert line is not None, out
        assert "has no replica running once node m1 has left" in line and "pending" in line, line
        assert "queue_timeout_s, then get a 503" in line, line
    assert "warning: stage thinker" not in out, out  # (on the leader: untouched)
    _, reps = cluster.wait(lambda rs: all(r["state"] in ("pending", "stopped") for r in rs
                                          if r["stage"] in MEMBER_STAGES), "the member stages without replicas", 20)
    assert any(r["state"] == "pending" for r in reps if r["stage"] == "talker"), _table(reps)


def test_stop_on_the_last_member_of_a_stage_says_that_the_stage_has_no_replica_left(request, tmp_path):
    """Trial AT: `stop --admin-port` of the only member that can run the Talker and Code2Wav
    said only that it stopped: the warning that those stages have no replica running any
    more went to the member's own terminal. `stop` prints it too (stderr), and exits 0."""
    cluster = start_cluster(request, tmp_path, members=(("m1", "0,1,2,3"),))
    member = cluster.members["m1"]
    out = subprocess.run([sys.executable, "-m", "omni_actors.system", "stop", "--admin-port", str(member.admin_port)],
                         capture_output=True, text=True, timeout=90, cwd=ROOT, env={**os.environ, **member.env})
    assert out.returncode == 0 and "its replicas drained first" in out.stdout, out
    for stage in MEMBER_STAGES:
        line = next((x for x in out.stderr.splitlines() if x.startswith(f"warning: stage {stage} ")), None)
        assert line is not None and "has no replica running once node m1 has left" in line, out.stderr
    assert "warning: stage thinker" not in out.stderr, out.stderr


def test_the_last_member_of_a_stage_serves_the_requests_in_flight_before_it_leaves(request, tmp_path):
    """Trial AP: Ctrl-C on the only member that runs the Talker and Code2Wav while streams
    were still in the Thinker (on the leader): its idle replicas stopped at once, their
    replacements could not be placed, and each stream waited queue_timeout_s, then ended
    with an error event and no audio. Now the last ready replicas of a stage linger: they
    take the tasks of the requests in flight, and drain once no request is in flight."""
    config = _demo_variant(tmp_path, thinker_ms=40)
    cluster = start_cluster(request, tmp_path, config=config, members=(("m1", "0,1,2,3"),))
    member = cluster.members["m1"]
    with ThreadPoolExecutor(4) as pool:
        streams = [pool.submit(_stream, cluster.base_url, 40) for _ in range(4)]
        _, reps = cluster.wait(lambda rs: any(r["stage"] == "thinker" and r["in_flight"] >= 4 for r in rs),
                               "the streams in the thinker", 20, poll_s=0.02)
        assert not any(r["in_flight"] for r in reps if r["stage"] in MEMBER_STAGES), _table(reps)
        member.proc.send_signal(signal.SIGINT)
        _, reps = cluster.wait(lambda rs: any("the last ready replica of stage talker" in r["reason"] for r in rs),
                               "a lingering talker", 10, poll_s=0.05)
        results = [f.result(90) for f in streams]
    # (trial AS: it said "new ones go to other nodes", and there was none)
    assert "new ones go to other nodes; code2wav, talker (no ready replica elsewhere) finish here the requests " \
        "begun before now, and newer requests wait for a replacement" in member.out.read_text(), member.tail()
    for status, events in results:
        assert status == 200 and events[-1] == "[DONE]", (status, events[-3:])
        assert not [e for e in events if e.startswith('{"error"')], events[-3:]
        assert any('"audio"' in e for e in events), "no audio part"
    assert member.proc.wait(30) == 0
    events = read_events(cluster.leader.log_path, 0)
    ends = [e for e in events if e["event"] == "replica_linger_ends"]
    assert ends and all(e["cause"] == "no request in flight" for e in ends), ends


def test_the_last_member_of_a_stage_leaves_at_its_drain_timeout_when_an_earlier_request_outlasts_it(
        request, tmp_path):
    """A stream begun before the leave that outlasts the drain timeout holds the lingering
    replicas: the member leaves at its drain timeout (+ DRAIN_GRACE_S), as for any replica
    still busy then, and says that they were the last of their stages, with requests begun
    before the leave. They are drained, not crashed."""
    from omni_actors.system.member import DRAIN_GRACE_S

    config = _demo_variant(tmp_path, thinker_ms=20, drain_timeout_s=1)
    cluster = start_cluster(request, tmp_path, config=config, members=(("m1", "0,1,2,3"),))
    member = cluster.members["m1"]
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(_stream, cluster.base_url, 400)  # (8 s of Thinker, then its audio)
        cluster.wait(lambda rs: any(r["stage"] == "thinker" and r["in_flight"] for r in rs),
                     "the stream in the thinker", 20, poll_s=0.02)
        member.proc.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        assert member.proc.wait(30) == 0
        left_s = time.monotonic() - signalled
        long.result(90)
    assert left_s < 1 + DRAIN_GRACE_S + 3, left_s
    out = member.out.read_text()
    line = next((x for x in out.splitlines() if x.startswith("leaving with ")), None)
    assert line is not None and "were the last ready replicas of their stages, still with requests begun " \
        "before the leave" in line, out
    # (trial AR: they were placed again beside their replacements, twice the replicas wanted)
    _, reps = cluster.wait(lambda rs: all(r["state"] == "stopped" for r in rs if r["node"] == "m1"
                                          and r["stage"] in MEMBER_STAGES), "m1's replicas stopped", 10)
    for stage in MEMBER_STAGES:
        assert sum(r["state"] != "stopped" for r in reps if r["stage"] == stage) == 2, _table(reps)
    assert all("node m1 left the convention (replaced by" in r["reason"]
               for r in reps if r["node"] == "m1" and r["stage"] in MEMBER_STAGES), _table(reps)
    crashes = [e for e in read_events(cluster.leader.log_path, 0)
               if e.get("event") == "replica_exited" and e.get("level") == "error"]
    assert not crashes, crashes


def test_the_last_member_of_a_stage_under_steady_load_finishes_the_earlier_requests_and_leaves(request, tmp_path):
    """Trial AS: under steady text+audio load the lingering Talker and Code2Wav of the last
    member took the tasks of every new request until the drain timeout; the streams begun
    late were cut off at the leave (`talker/4 went down mid-stream (stopped: node m1 left
    ...)`). A lingering replica now takes only the requests begun before it lingered: the
    member leaves once those are done, well before its drain timeout of 30 s, and a request
    begun after the leave waits for a replacement, as once the node has left (here none can
    be placed: a clear error after queue_timeout_s), and none is cut off mid-stream."""
    config = _demo_variant(tmp_path, thinker_ms=20, drain_timeout_s=30, queue_timeout_s=2)
    cluster = start_cluster(request, tmp_path, config=config, members=(("m1", "0,1,2,3"),))
    member = cluster.members["m1"]
    with ThreadPoolExecutor(8) as pool:
        before = [pool.submit(_stream, cluster.base_url, 40) for _ in range(2)]
        cluster.wait(lambda rs: any(r["stage"] == "thinker" and r["in_flight"] >= 2 for r in rs),
                     "the streams in the thinker", 20, poll_s=0.02)
        member.proc.send_signal(signal.SIGINT)
        signalled, after = time.monotonic(), []
        while member.proc.poll() is None and time.monotonic() - signalled < 40:
            time.sleep(0.3)
            after.append(pool.submit(_stream, cluster.base_url, 20))
        left_s = time.monotonic() - signalled
        results = [f.result(90) for f in before], [f.result(90) for f in after]
    assert member.proc.wait(5) == 0 and left_s < 15, left_s  # (not its drain timeout of 30 s)
    assert not any(x.startswith("leaving with ") for x in member.out.read_text().splitlines()), member.tail()
    for status, events in results[0]:
        assert status == 200 and events[-1] == "[DONE]", (status, events[-3:])
        assert not [e for e in events if e.startswith('{"error"')] and any('"audio"' in e for e in events)
    assert len(results[1]) >= 2
    for status, events in results[1]:
        errors = [e for e in events if e.startswith('{"error"')]
        assert status == 503 or errors, (status, events[-3:])
        text = "".join(errors) if status == 200 else events[0]
        assert "no ready replica of stage" in text or "takes new requests" in text, text
        assert "mid-stream" not in text and not any('"audio"' in e for e in events), text


def test_the_last_member_of_a_stage_leaves_under_text_only_load_without_waiting_its_drain_timeout(
        request, tmp_path):
    """Trial AR: text-only requests kept the Thinker busy, and with it the lingering Talker and
    Code2Wav of the last member, until its drain timeout, though none of those requests would
    ever need them. A task now says whether another stage takes its outputs (StageTask.feeds):
    text-only traffic does not hold them, and the member leaves at once."""
    config = _demo_variant(tmp_path, thinker_ms=20, drain_timeout_s=30)
    cluster = start_cluster(request, tmp_path, config=config, members=(("m1", "0,1,2,3"),))
    member = cluster.members["m1"]

    def text(max_tokens: int) -> int:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
        req = urllib.request.Request(cluster.base_url + "/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status

    with ThreadPoolExecutor(4) as pool:
        asked = [pool.submit(text, 20)]
        time.sleep(0.3)
        member.proc.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        while member.proc.poll() is None and time.monotonic() - signalled < 40:
            asked.append(pool.submit(text, 20))
            time.sleep(0.2)
        left_s = time.monotonic() - signalled
        assert all(f.result(60) == 200 for f in asked)
    assert member.proc.wait(5) == 0 and left_s < 15, left_s  # (not its drain timeout of 30 s)
    out = member.out.read_text()
    assert not any(x.startswith("leaving with ") for x in out.splitlines()), out


def test_an_operator_drains_a_node_and_undrains_it_its_member_running_on(request, tmp_path):
    """`node drain --node N`: N's replicas finish their work and stop, replacements start on
    the other member, nothing new is placed on N (status: DRAINED) while its member runs on;
    `node undrain` lets it take replicas again: one waiting for room is placed there. (A
    trial found no way to empty a node for maintenance but to stop its member.)"""
    cluster = start_cluster(request, tmp_path, members=(("m1", "0,1,2,3"), ("m2", "4,5,6,7")))
    victim = next(r["node"] for r in cluster.replicas() if r["stage"] == "talker" and r["state"] == "ready")
    other = "m2" if victim == "m1" else "m1"
    on_victim = sorted(r["replica"] for r in cluster.replicas() if r["node"] == victim and r["state"] == "ready")
    out = cluster.cli("node", "drain", "--node", victim)
    assert out.returncode == 0 and out.stdout.startswith(f"node {victim}: its replicas drain"), (out.stdout, out.stderr)
    assert "warning" not in out.stderr, out.stderr  # (the other member takes the replacements)
    _, reps = cluster.wait(lambda rs: sum(r["state"] == "ready" for r in rs if r["stage"] in MEMBER_STAGES) == 4
                           and all(r["state"] == "stopped" for r in rs if r["replica"] in on_victim),
                           f"{victim}'s replicas replaced on {other}", 30)
    assert all(r["node"] == other for r in reps if r["stage"] in MEMBER_STAGES and r["state"] == "ready"), \
        _table(reps)
    assert all(f"node {victim} drained (`node drain`) (replaced by" in r["reason"]
               for r in reps if r["replica"] in on_victim), _table(reps)
    node = next(n for n in cluster.stages()["nodes"] if n["name"] == victim)
    assert node["state"] == "drained" and node["alive"], node
    assert cluster.members[victim].proc.poll() is None  # (its member runs on)
    assert f"{victim} (DRAINED" in cluster.cli("status").stdout
    # nothing new goes there while it is drained: the other member is full, so a launch waits
    out = cluster.cli("stage", "launch", "--stage", "talker")
    assert out.returncode == 0, out.stderr
    cluster.wait(lambda rs: any(r["state"] == "pending" and f"{victim}: drained" in r["reason"] for r in rs),
                 f"a talker waiting, {victim} drained", 15)
    # undrained: it is placed there
    out = cluster.cli("node", "undrain", "--node", victim)
    assert out.returncode == 0 and out.stdout.startswith(f"node {victim} takes new replicas again"), out
    cluster.wait(lambda rs: any(r["stage"] == "talker" and r["node"] == victim and r["state"] == "ready"
                                for r in rs), f"a talker ready on {victim}", 20)
    again = cluster.cli("node", "undrain", "--node", victim)
    assert again.returncode == 1 and again.stderr.strip() == f"error: node {victim} is not drained (it is alive)", \
        again
    missing = cluster.cli("node", "drain", "--node", "m9")
    assert missing.returncode == 1 and "no alive node named 'm9'" in missing.stderr, missing
    shell = cluster.cli("shell", "-c", f"undrain {victim}", "-c", "drain --node m9")  # (the shell's verbs)
    assert f"node {victim} is not drained (it is alive)" in shell.stdout + shell.stderr, shell
    assert "no alive node named 'm9'" in shell.stdout + shell.stderr, shell
    # Draining both members leaves the Talker and Code2Wav without a replica: said (a trial's
    # drain took the last Code2Wav in silence)
    assert cluster.cli("node", "drain", "--node", victim).returncode == 0
    out = cluster.cli("node", "drain", "--node", other)
    assert out.returncode == 0, out.stderr
    for stage in MEMBER_STAGES:  # (trial BK: it named only the node drained last)
        assert f"warning: stage {stage} has no replica running while nodes {other}, {victim} are drained (" \
            in out.stderr, out.stderr
    assert "until `node undrain` or a node that can run it joins" in out.stderr, out.stderr
    # A drained node's member stopped and started again: the node stays drained, and says so
    # (trial BK: `LEFT` meanwhile, and the member said only that it joined)
    old = cluster.members[victim]
    old.proc.send_signal(signal.SIGINT)
    assert old.proc.wait(30) == 0
    deadline = time.monotonic() + 15
    while f"{victim} (LEFT, still drained: `node undrain`)" not in cluster.cli("status").stdout:
        assert time.monotonic() < deadline, cluster.cli("status").stdout
        time.sleep(0.3)
    member = cluster.add_member(victim, old.devices)
    deadline = time.monotonic() + 30
    while f"node {victim} is drained (`node drain`, before this member started)" not in member.out.read_text():
        assert time.monotonic() < deadline, member.tail()
        time.sleep(0.3)


def test_member_that_rejoins_gets_work_again(request, tmp_path):
    """Kill the busiest member, start it again (same node name, new admin port), scale talker to 3:
    the new replica goes to the rejoined node (the survivor's devices are all in use), becomes ready,
    takes work, and stays there after Thespian drops the dead admin's registration (three missed
    re-registrations, ~10-17 s after the kill with the CLI's 5 s period): that late drop is the old
    admin's, not the rejoined node's."""
    cluster = start_cluster(request, tmp_path, members=(("m1", "0,1,2,3"), ("m2", "4,5,6,7")))

    def rejoin(cluster, victim):
        old = cluster.members[victim]
        t0 = time.monotonic()
        member = cluster.add_member(victim, old.devices)  # a new admin port
        out = cluster.cli("stage", "scale", "--stage", "talker", "--replicas", "3")
        assert out.returncode == 0, out.stderr
        took, reps = cluster.wait(lambda rs: any(r["node"] == victim and r["state"] == "ready" for r in rs),
                                  f"a replica ready on the rejoined {victim}", 20)
        return member, time.monotonic() - t0, reps

    r = kill_busiest_member(cluster, extra=rejoin)
    victim = r["victim"]
    member, took, reps = r["extra"]
    assert_nothing_lost(r["outcomes"], r["killed_at"])
    on_rejoined = [x for x in reps if x["node"] == victim and x["state"] == "ready"]
    assert [x["replica"] for x in on_rejoined] == ["talker/2"], _table(reps)
    print(f"\n{victim} rejoined (admin port {member.admin_port}); talker/2 ready there {took:.2f} s after "
          f"its start")

    def node_events():
        return [e for e in read_events(cluster.leader.log_path, r["killed_at"])
                if e.get("node") == victim and e["event"] in ("node_lost", "node_stale_registration_dropped")]

    # Work goes on until Thespian has dropped the dead admin (the coordinator logs that it ignored it)
    # or the node was lost again (the bug this guards against), at most 25 s after the kill.
    while time.time() < r["killed_at"] + 25 and len(node_events()) < 2:
        statuses = asyncio.run(burst(cluster.base_url, 8, concurrency=4))
        assert statuses == [200] * 8, statuses
    events = node_events()
    print(f"{victim} node events after the kill: " + "; ".join(
        f"+{e['t'] - r['killed_at']:.1f} s {e['event']} {e.get('reason', '')}" for e in events))
    lost_again = [e for e in events if e["event"] == "node_lost"][1:]
    assert not lost_again, f"the rejoined {victim} was declared lost again: {lost_again}"
    _, reps = cluster.wait(lambda rs: next(x for x in rs if x["replica"] == "talker/2")["completed"] > 0,
                           "talker/2 busy", 5)
    talker2 = next(x for x in reps if x["replica"] == "talker/2")
    assert talker2["state"] == "ready" and talker2["node"] == victim, _table(reps)
    print(f"talker/2 on {victim}: {talker2['completed']} tasks done; {_table(reps)}")


def _nodes(cluster: Cluster) -> dict[str, dict]:
    """``status --json``'s nodes by name."""
    return {n["name"]: n for n in json.loads(cluster.cli("status", "--json").stdout)["nodes"]}


def _wait_node(cluster: Cluster, name: str, alive: bool, timeout_s: float, why: str = "") -> dict:
    """Poll ``status`` until node ``name`` is (not) alive; its status then."""
    deadline = time.monotonic() + timeout_s
    while True:
        node = _nodes(cluster)[name]
        if node["alive"] == alive:
            return node
        assert time.monotonic() < deadline, f"node {name} not {'alive' if alive else 'down'}: {node}; {why}"
        time.sleep(0.2)


@contextlib.contextmanager
def _frozen(pids: list[int]):
    """SIGSTOP ``pids`` (a host frozen: a paused VM) for the block, SIGCONT after."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def test_a_member_frozen_past_its_agents_orphan_time_comes_back_when_it_resumes(request, tmp_path):
    """Trial Z: a member host frozen for a few seconds (SIGSTOP of its process and its actors'
    session: a paused VM, a long stall) was declared lost, as it should be; on resuming, its
    node agent found no ack for over 5 intervals and exited at once, so the node never came
    back and the member said nothing. The agent now counts only the time it ran: it
    heartbeats, and the coordinator takes the node back (``node_back``)."""
    cluster = start_cluster(request, tmp_path)
    member = cluster.members["m2"]
    frozen = member.pids()
    t0 = time.time()
    with _frozen(frozen):
        time.sleep(8 * 0.5)  # 8 heartbeat intervals: lost after 3, past the agent's 5
        assert not _nodes(cluster)["m2"]["alive"]
    _wait_node(cluster, "m2", True, 20, member.tail())
    assert [e["event"] for e in read_events(cluster.leader.log_path, t0)
            if e.get("node") == "m2" and e["event"] in ("node_lost", "node_back")][:2] == ["node_lost", "node_back"]
    # and the pipeline is whole again (the replicas it ran were placed again, there or elsewhere)
    reps = cluster.wait_all_ready(timeout_s=30)
    assert all(r["state"] in ("ready", "stopped") for r in reps), _table(reps)


def test_a_member_whose_node_agent_gave_up_on_a_stalled_coordinator_comes_back(request, tmp_path):
    """A code review: the coordinator stalled (or the network cut) for longer than a node
    agent's orphan time (5 intervals) and shorter than Thespian's re-registration window
    (15 s): the agent exited, the node was lost 3 intervals later, and Thespian never
    announced the member again, so it stayed LOST for good. The coordinator now starts a
    new agent on a lost node's member while the convention still lists it."""
    cluster = start_cluster(request, tmp_path)
    coordinator = json.loads(cluster.cli("status", "--json").stdout)["coordinator_pid"]
    t0 = time.time()
    # (the leader's main process too, where its watchdog of the coordinator runs: its third
    # unanswered ask could come 0.5 s after the resume on a slow machine, and kill the coordinator;
    # the members' agents need nothing there)
    with _frozen([coordinator, cluster.leader.proc.pid]):
        time.sleep(7 * 0.5)  # past the agents' 5 intervals
    lost = _wait_node(cluster, "m2", False, 10, "the agents exited: the nodes are lost")
    assert "missed 3 node heartbeats" in lost["down_reason"], lost
    _wait_node(cluster, "m2", True, 15, cluster.leader.tail())
    _wait_node(cluster, "m1", True, 5, cluster.leader.tail())
    events = [e for e in read_events(cluster.leader.log_path, t0) if e.get("node") == "m2"]
    assert "node_rejoin_asked" in [e["event"] for e in events], events
    assert "coordinator_hung_killing" not in cluster.leader.log_path.read_text()  # (the same coordinator)
    reps = cluster.wait_all_ready(timeout_s=30)
    assert all(r["state"] in ("ready", "stopped") for r in reps), _table(reps)


def test_an_old_member_replaced_under_its_name_leaves_without_touching_the_new_one(request, tmp_path):
    """Trial Z: m1 froze and was declared lost; a new member joined as m1 and ran replicas;
    then the old m1 process resumed and was stopped with Ctrl-C: its drain (by name) and its
    agent's leave notice took the new m1 down (LEFT, its replicas pending again). Now the
    old member sees that the system's m1 has another data service and leaves without a
    drain, and the coordinator ignores its agent (an earlier join of the name)."""
    cluster = start_cluster(request, tmp_path)
    old = cluster.members["m1"]
    frozen = old.pids()
    with _frozen(frozen):
        _wait_node(cluster, "m1", False, 10)  # lost after 3 missed node heartbeats (0.5 s each)
        new = Member(tmp_path, f"127.0.0.1:{cluster.leader.admin_port}", "m1", old.devices, env=cluster.member_env)
        request.addfinalizer(new.stop)
        new.start()
        cluster.wait_all_ready(timeout_s=30, talker=2, code2wav=2, thinker=1)
    time.sleep(1.0)  # (the old agent heartbeats again: ignored, not acked)
    old.proc.send_signal(signal.SIGINT)
    assert old.proc.wait(30) == 0, old.tail()
    assert "leaving without a drain: node m1 in the system is another member's now" in old.out.read_text(), \
        old.tail()
    time.sleep(1.0)
    nodes = _nodes(cluster)
    assert nodes["m1"]["alive"] and nodes["m1"]["state"] == "alive", nodes["m1"]
    assert nodes["m1"]["data_service"] != nodes["m2"]["data_service"]
    reps = cluster.wait_all_ready(timeout_s=10, talker=2, code2wav=2, thinker=1)
    assert all(r["state"] in ("ready", "stopped") for r in reps), _table(reps)


def test_stop_on_a_member_whose_leader_is_down_says_its_replicas_did_not_drain(request, tmp_path):
    """Trial AP: with the leader down, the member left "without a drain", and `stop` said
    "its replicas drained first"."""
    cluster = start_cluster(request, tmp_path, members=(("m1", "0,1,2,3"),))
    member = cluster.members["m1"]
    assert cluster.leader.stop() == 0
    out = subprocess.run([sys.executable, "-m", "omni_actors.system", "stop", "--admin-port", str(member.admin_port)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT, env={**os.environ, **member.env})
    assert out.returncode == 0, out
    # (trial AY: it said "it left the convention at ...", though no leader answered)
    assert out.stdout.startswith(f"stopped member 'm1' on admin port {member.admin_port} (it left without a drain: "
                                 "no convention leader answers at 127.0.0.1:"), out.stdout
    assert "leaving without a drain" in member.out.read_text(), member.tail()


def test_a_member_says_when_its_leader_stops_and_joins_it_again_when_it_is_back(request, tmp_path):
    """The leader stops (Ctrl-C) with a member attached: the member keeps running and says so
    within LEADER_CHECK_S (it was silent); a leader started again on the same admin port takes it
    back, places replicas on it, and serves audio through them."""
    from omni_actors.system.member import LEADER_CHECK_S

    cluster = start_cluster(request, tmp_path, members=(("m1", "0,1,2,3"),))
    member = cluster.members["m1"]
    admin_port = cluster.leader.admin_port
    # What a request left in m1's shared memory (trial AT: a request held by a frozen API server
    # left 5 buffers there, counted in `status` until the member's reaper took them): an orderly
    # stop of the system unlinks it, though the member lives on.
    shm_dir = json.loads((cluster.workdir / "member-state" / f"member-{member.admin_port}.json").read_text())["shm_dir"]
    leftover = Path(shm_dir) / f"oa-{member.admin_port}-left-by-a-request"
    leftover.write_bytes(b"x" * 4096)
    request.addfinalizer(lambda: leftover.unlink(missing_ok=True))
    assert cluster.leader.stop() == 0
    # a planned stop: the replicas' exits, those on m1 included, are no crashes (a trial saw each
    # remote replica's exit logged at error: it exited before its pool heard of the stop)
    exits = [ev for ev in read_events(cluster.leader.log_path) if ev.get("event") == "replica_exited"]
    # (a pool may be gone before a remote replica's exit reaches it: not every exit is logged)
    assert exits and all(ev["level"] == "info" and ev["pool_exiting"] for ev in exits), \
        [ev for ev in exits if ev["level"] != "info" or not ev["pool_exiting"]] or exits  # (the odd ones in full)
    deadline = time.monotonic() + LEADER_CHECK_S + 5
    while b"does not answer" not in member.out.read_bytes():
        assert time.monotonic() < deadline, f"the member did not say its leader stopped: {member.tail()}"
        assert member.proc.poll() is None, f"the member exited: {member.tail()}"
        time.sleep(0.1)
    assert f"the convention leader at 127.0.0.1:{admin_port} does not answer" in member.out.read_text()
    assert not leftover.exists() and member.proc.poll() is None

    again = LocalLeader(CONFIG, extra_args=["--node-name", "leader"], admin_port=admin_port)
    request.addfinalizer(again.stop)  # (before the member's: last in, first out)
    again.start()
    cluster.leader = again
    cluster.wait_all_ready(talker=2, code2wav=2, thinker=1)
    reps = cluster.replicas()
    assert {r["node"] for r in reps if r["stage"] in MEMBER_STAGES and r["state"] == "ready"} == {"m1"}, _table(reps)
    assert_audio_reply(*chat(cluster.base_url))
    deadline = time.monotonic() + LEADER_CHECK_S + 5
    while b"answers again" not in member.out.read_bytes():
        assert time.monotonic() < deadline, f"the member did not say its leader is back: {member.tail()}"
        time.sleep(0.1)
    # `status` on the member's admin port answers for the system, through its leader (it showed
    # an empty table, NOT READY, and made a stray coordinator on the member)
    out = subprocess.run([sys.executable, "-m", "omni_actors.system", "status", "--admin-port", str(member.admin_port)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0 and f"model {MODEL}: ready" in out.stdout, (out.stdout, out.stderr)
    assert not [p for p in member.pids() if _cmdline(p).startswith("CoordinatorActor")], "a coordinator on the member"


# -- network namespaces ----------------------------------------------------------------------------
#: addresses only inside the namespaces this test creates (RFC 2544 benchmarking range, not routed)
NETNS_NET = "198.18.0"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=15, check=check)


def _netns_unavailable() -> str:
    if os.geteuid() != 0:
        return "needs root for `ip netns`"
    if not shutil.which("ip"):
        return "no `ip` command (iproute2)"
    if _ip("netns", "list", check=False).returncode != 0:
        return "`ip netns list` fails here"
    return ""


class Namespaces:
    """Three network namespaces (hub, m1, m2); the members' veth pairs end on a bridge in the hub.
    Nothing links them to the host's own namespace: no traffic can leave them."""

    def __init__(self):
        tag = f"oa{os.getpid() % 100000}"
        self.hub, self.m1, self.m2 = f"{tag}hub", f"{tag}m1", f"{tag}m2"
        self.created: list[str] = []
        self._next_port = random.randrange(20000, 30000)

    def port(self) -> int:
        """A port for a server that starts inside one of the namespaces. ``free_port()`` asks the
        host's namespace, which says nothing about these: there, the actors' own ephemeral binds
        (32768-60999 in a new namespace) once took the HTTP port the leader was about to listen on.
        Ports below that range are free in a namespace we just made; each call gives another."""
        self._next_port += 1
        return self._next_port

    def setup(self) -> None:
        for ns in (self.hub, self.m1, self.m2):
            _ip("netns", "add", ns)
            self.created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "addr", "add", f"{NETNS_NET}.1/24", "dev", "br0")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for i, ns in ((2, self.m1), (3, self.m2)):
            _ip("-n", self.hub, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", self.hub, "link", "set", f"v{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{NETNS_NET}.{i}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def teardown(self) -> None:
        for ns in self.created:  # anything still running in them (ours only: we made them)
            pids = _ip("netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for ns in reversed(self.created):
            _ip("netns", "del", ns, check=False)
        self.created = []


CLIENT = textwrap.dedent("""
    import asyncio, json, sys, urllib.request
    import aiohttp
    base, n = sys.argv[1], int(sys.argv[2])

    async def one(s, i):
        body = {"model": "multihost-test", "messages": [{"role": "user", "content": f"story {i}"}],
                "modalities": ["text", "audio"]}
        async with s.post(base + "/chat/completions", json=body) as r:
            data = await r.json()
            return r.status, bool(r.status == 200 and data["choices"][0]["message"]["audio"]["data"])

    async def main():
        sem = asyncio.Semaphore(8)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            async def guarded(i):
                async with sem:
                    return await one(s, i)
            return await asyncio.gather(*(guarded(i) for i in range(n)))

    results = asyncio.run(main()) if n else []
    with urllib.request.urlopen(base + "/stages", timeout=10) as r:
        print(json.dumps({"results": results, "stages": json.loads(r.read())}))
""")


def test_netns_members_in_network_namespaces_serve_1nm(request, tmp_path):
    why = _netns_unavailable()
    if why:
        print(f"\nskipped: {why}")
        pytest.skip(why)
    ns = Namespaces()
    request.addfinalizer(ns.teardown)
    try:
        ns.setup()
    except subprocess.CalledProcessError as exc:
        why = f"cannot build network namespaces with veth pairs here: {' '.join(exc.cmd)}: {exc.stderr.strip()}"
        print(f"\nskipped: {why}")
        pytest.skip(why)

    # The leader, in the hub namespace, advertises the bridge address to its members.
    port, admin_port = ns.port(), ns.port()
    state = tmp_path / "state"
    env = {**os.environ, "OMNI_ACTORS_STATE_DIR": str(state), "THESPIAN_BASE_IPADDR": f"{NETNS_NET}.1"}
    out, err = tmp_path / "leader.out", tmp_path / "leader.err"
    with open(out, "wb") as o, open(err, "wb") as e:
        leader = subprocess.Popen([*ns.exec_prefix(ns.hub), sys.executable, "-m", "omni_actors.system", "start",
                                   "--convention-leader", "--config", str(CONFIG), "--node-name", "leader",
                                   "--port", str(port), "--admin-port", str(admin_port)],
                                  stdout=o, stderr=e, stdin=subprocess.DEVNULL, cwd=ROOT, env=env)

    def stop_leader():
        if leader.poll() is None:
            leader.send_signal(signal.SIGINT)
            try:
                leader.wait(20)
            except subprocess.TimeoutExpired:
                leader.kill()
        try:
            recorded = json.loads((state / f"leader-{admin_port}.json").read_text())
            kill_system(recorded["system_id"], grace_s=1.0, sessions=recorded.get("sessions", []))
        except (OSError, ValueError, KeyError):
            pass
    request.addfinalizer(stop_leader)

    deadline = time.monotonic() + 60
    while b"serving model" not in out.read_bytes():
        assert leader.poll() is None and time.monotonic() < deadline, \
            (out.read_bytes() + err.read_bytes()[-2000:]).decode(errors="replace")
        time.sleep(0.1)

    members = []
    for name, devices, net_ns, i in (("m1", "0,1,2", ns.m1, 2), ("m2", "3,4,5", ns.m2, 3)):
        member = Member(tmp_path, f"{NETNS_NET}.1:{admin_port}", name, devices, prefix=ns.exec_prefix(net_ns),
                        env={"THESPIAN_BASE_IPADDR": f"{NETNS_NET}.{i}"})
        request.addfinalizer(member.stop)
        members.append(member)
    threads = [threading.Thread(target=m.start) for m in members]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(m.session for m in members), " | ".join(m.tail() for m in members)

    def client(n: int) -> dict:
        done = subprocess.run([*ns.exec_prefix(ns.hub), sys.executable, "-c", CLIENT,
                               f"http://127.0.0.1:{port}/v1", str(n)],
                              capture_output=True, text=True, timeout=90, cwd=ROOT)
        assert done.returncode == 0, done.stderr[-2000:]
        return json.loads(done.stdout)

    deadline = time.monotonic() + 30
    while True:
        reps = [dict(r, stage=st["stage"]) for st in client(0)["stages"]["stages"] for r in st["replicas"]]
        if all(r["state"] == "ready" for r in reps) and len(reps) == 5:
            break
        assert time.monotonic() < deadline, f"not every replica ready: {_table(reps)}"
        time.sleep(0.5)
    answer = client(32)
    assert answer["results"] == [[200, True]] * 32, answer["results"]
    time.sleep(1.0)  # the table is published every heartbeat interval
    reps = [dict(r, stage=st["stage"]) for st in client(0)["stages"]["stages"] for r in st["replicas"]]
    print(f"\nnetwork namespaces: 32 requests served; {_table(reps)}")
    assert_placement(reps)
    assert {r["node"] for r in reps if r["stage"] in MEMBER_STAGES} <= {"m1", "m2"}
    assert sum(r["completed"] for r in reps if r["stage"] == "code2wav") >= 32


def test_the_leaders_admin_answers_while_a_frozen_member_is_lost_and_after_it_resumes(request, tmp_path):
    """Trial CB: a member frozen past its heartbeats (lost), then resumed: from about 20 s
    into the freeze the leader's admin answered no status request for good (a node agent
    asked for on the frozen member left a local address among the admin's children, and
    Thespian held every status answer that listed it), so `status`, the shell, `node drain`
    and a new member all read "not a Thespian admin". It answers throughout."""
    from omni_actors.system.remote import admin_status

    cluster = start_cluster(request, tmp_path)
    member = cluster.members["m1"]
    port = cluster.leader.admin_port
    unanswered = []
    t0 = time.monotonic()
    with _frozen(member.pids()):
        while time.monotonic() - t0 < 30:
            time.sleep(3)
            if admin_status("127.0.0.1", port) is None:
                unanswered.append(round(time.monotonic() - t0))
        assert not _nodes(cluster)["m1"]["alive"]
    assert unanswered == [], f"the leader's admin did not answer at {unanswered} s into the freeze"
    _wait_node(cluster, "m1", True, 30, member.tail())
    out = cluster.cli("status")
    assert out.returncode == 0 and "m1" in out.stdout, out
