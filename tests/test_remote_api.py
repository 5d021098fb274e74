"""``api --convention-address HOST:PORT``: one more API server that reaches the
leader's coordinator from another host.

It starts no admin of its own: it talks straight to the leader's admin (see
omni_actors.system.remote). On loopback: it serves beside the leader's own API
server, leaves no process behind when it stops (SIGINT or SIGKILL), and the
leader keeps serving. Given a member host's admin address it finds the leader
through it. The last test puts it in a network namespace of its own (another
IP, no loopback path to the leader), where this runs as root with ``ip netns``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from thespian.actors import Actor, ActorSystem

from omni_actors.system.local import LocalLeader, free_port, reserve_port
from omni_actors.system.processes import kill_system, system_pids

from conftest import CONFIGS, ROOT
from test_multihost import NETNS_NET, Member, Namespaces, _netns_unavailable

pytestmark = pytest.mark.system
MODEL = "qwen3-omni-cpu-demo"


@pytest.fixture(scope="module")
def leader():
    leader = LocalLeader(CONFIGS / "cpu_omni_demo.yaml").start()
    yield leader
    # what the API servers left (the RequestActors of the one killed with SIGKILL) ends with the system
    assert leader.stop() == 0
    assert leader.left_after_exit == []


class RemoteApi:
    """``python -m omni_actors.system api --convention-address ...`` in a child process, marked
    with its own ``OMNI_ACTORS_SYSTEM_ID`` so that anything it started could be found."""

    def __init__(self, convention: str, *extra: str, prefix: list[str] | None = None, env: dict | None = None,
                 port: int = 0):
        reserved = None if port else reserve_port()  # held until the API listens (see reserve_port)
        self.port = port or reserved.getsockname()[1]
        self.marker = uuid.uuid4().hex
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", "omni_actors.system", "api", "--port", str(self.port),
             "--convention-address", convention, "--request-actors", "2", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
            env={**os.environ, "OMNI_ACTORS_SYSTEM_ID": self.marker, **(env or {})})
        try:
            self.first_line = self.proc.stdout.readline()
        finally:
            if reserved is not None:
                reserved.close()
        assert f"at http://127.0.0.1:{self.port}/v1 (attached to the convention at {convention})" in \
            self.first_line, (self.first_line, self.proc.stderr.read() if self.proc.poll() is not None else "")

    def others(self) -> list[int]:
        """Processes it started: its children, or anything carrying its marker but itself."""
        kids = [int(e.name) for e in Path("/proc").iterdir()
                if e.name.isdigit() and _ppid(int(e.name)) == self.proc.pid]
        return sorted(set(kids) | set(system_pids(self.marker)) - {self.proc.pid})

    def stop(self, sig=signal.SIGINT) -> tuple[str, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.communicate(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)


def _ppid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _chat(port: int, text: str = "Tell me about the sea.") -> tuple[str, int]:
    import openai

    with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                           max_tokens=6, modalities=["text", "audio"],
                                           audio={"voice": "default", "format": "wav"})
    return r.choices[0].message.content, len(r.choices[0].message.audio.data)


def test_api_from_another_host_serves_beside_the_leader_and_leaves_nothing(leader):
    _chat(leader.port)  # answered once the leader's own bridge has made its RequestActors
    t0 = time.monotonic()
    before = set(system_pids(leader.system_id, sessions=leader.sessions))
    api = RemoteApi(f"127.0.0.1:{leader.admin_port}")
    try:
        started = time.monotonic() - t0
        ports = [leader.port, api.port] * 4
        with ThreadPoolExecutor(len(ports)) as pool:
            answers = list(pool.map(_chat, ports))
        assert len(set(answers)) == 1 and answers[0][0] and answers[0][1] > 1000, answers  # same pipeline, same seed
        with urllib.request.urlopen(f"http://127.0.0.1:{api.port}/v1/stages", timeout=10) as r:
            stages = json.loads(r.read())
        assert [s["stage"] for s in stages["stages"]] == ["thinker", "talker", "code2wav"]
        assert all(r["state"] == "ready" for s in stages["stages"] for r in s["replicas"])
        assert api.others() == []  # no admin, no actor of its own on its host
        # its RequestActors were made by the leader's admin: they are the leader system's processes
        assert len(set(system_pids(leader.system_id, sessions=leader.sessions)) - before) >= 2
        out, err = api.stop(signal.SIGINT)
        assert api.proc.returncode == 0, err
        assert "omni-actors API server stopped" in out
    finally:
        api.stop(signal.SIGKILL)
    assert api.others() == []
    deadline = time.monotonic() + 10
    while set(system_pids(leader.system_id, sessions=leader.sessions)) - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert set(system_pids(leader.system_id, sessions=leader.sessions)) - before == set()  # its RequestActors ended
    assert _chat(leader.port) == answers[0]  # the leader serves on

    # killed outright: nothing of it is left on its host, and the leader serves on; the
    # RequestActors it had made on the leader exit once they hear nothing from it (2 s here,
    # OMNI_ACTORS_BRIDGE_LOST_AFTER_S; 120 s by default): they lived until the system stopped
    before = set(system_pids(leader.system_id, sessions=leader.sessions))
    api = RemoteApi(f"127.0.0.1:{leader.admin_port}", env={"OMNI_ACTORS_BRIDGE_LOST_AFTER_S": "2"})
    try:
        assert _chat(api.port) == answers[0]
        made = set(system_pids(leader.system_id, sessions=leader.sessions)) - before
        assert made, "the API server made no RequestActor on the leader"
        time.sleep(1.5)  # (they heard it once at least)
        api.proc.kill()
        api.proc.wait(10)
        assert api.others() == []
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{api.port}/health", timeout=2)
        assert _chat(leader.port) == answers[0]
        deadline = time.monotonic() + 15
        while made & set(system_pids(leader.system_id, sessions=leader.sessions)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert made & set(system_pids(leader.system_id, sessions=leader.sessions)) == set(), \
            "the killed API server's RequestActors are still running"
        assert _chat(leader.port) == answers[0]
    finally:
        api.stop(signal.SIGKILL)
    print(f"\nremote API server: serving {started:.2f} s after start; scenario {time.monotonic() - t0:.1f} s")


def test_an_api_server_attached_through_a_members_admin_port_exits_when_the_leader_is_killed(tmp_path):
    """A code review: `api --admin-port <a member's port>` watched that port, which the member
    keeps listening on with its leader killed: the server never stopped. It watches the
    leader's admin now, as with `--convention-address`."""
    own = LocalLeader(CONFIGS / "cpu_omni_demo.yaml").start()
    member = api = None
    try:
        member = Member(tmp_path, f"127.0.0.1:{own.admin_port}", "frontend", "").start()
        api = subprocess.Popen([sys.executable, "-m", "omni_actors.system", "api", "--port", str(free_port()),
                                "--admin-port", str(member.admin_port), "--request-actors", "1"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        first = api.stdout.readline()
        assert "omni-actors API server" in first and api.poll() is None, (first, api.stderr.read())
        # (trial BO: its messages named the member's admin port, not the leader it follows)
        assert f"(attached to the convention at 127.0.0.1:{own.admin_port} (found through admin port " \
               f"{member.admin_port}))" in first, first
        os.kill(own.proc.pid, signal.SIGKILL)
        own.proc.wait(10)
        _, err = api.communicate(timeout=30)
        assert api.returncode == 1 and "is gone; stopping this API server" in err, err
    finally:
        if api is not None and api.poll() is None:
            api.kill()
            api.wait(10)
        if member is not None:
            member.stop()
        if own.proc.poll() is None:
            own.stop()


class SlowEcho(Actor):
    """Answers ``(seconds, word)`` with ``word`` after ``seconds``."""

    def receiveMessage(self, msg, sender):
        if isinstance(msg, tuple):
            time.sleep(msg[0])
            self.send(sender, msg[1])


def test_an_ask_that_timed_out_does_not_take_the_next_asks_answer():
    """A code review: Thespian hands an ask whatever reaches its context next, so after one
    `status` timed out in the admin shell (or was interrupted) every later command showed the
    previous command's answer. A context left without its answer is dropped now."""
    from omni_actors.system.remote import RemoteSystem

    port = free_port()
    asys = ActorSystem("multiprocTCPBase", {"Admin Port": port})
    remote = RemoteSystem("127.0.0.1", port)
    try:
        echo = asys.createActor(SlowEcho)
        assert remote.ask(echo, (1.0, "late"), 0.2) is None
        time.sleep(1.2)  # (the late answer has come)
        assert remote.ask(echo, (0, "mine"), 10) == "mine"
        assert remote.ask(echo, (0, "again"), 10) == "again"
    finally:
        remote.close()
        asys.shutdown()


def test_status_of_another_programs_thespian_admin_says_so_and_makes_nothing_there():
    """A code review: `status` of a port where another program's Thespian admin listens made
    an omni-actors coordinator in it and said NOT READY (exit 3)."""
    from omni_actors.actors.coordinator import COORDINATOR_NAME
    from omni_actors.system.remote import admin_status

    port = free_port()
    asys = ActorSystem("multiprocTCPBase", {"Admin Port": port})
    try:
        out = subprocess.run([sys.executable, "-m", "omni_actors.system", "status", "--admin-port", str(port)],
                             capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert out.returncode == 1, (out.stdout, out.stderr)
        assert out.stderr.strip() == f"error: 127.0.0.1:{port} is a Thespian admin, but not an omni-actors system's"
        assert COORDINATOR_NAME not in admin_status("127.0.0.1", port).globalActors
    finally:
        asys.shutdown()


def test_api_finds_the_leader_through_a_member_and_refuses_bad_addresses(leader, tmp_path):
    # a member host (a CPU node; every replica is placed already, so nothing goes there)
    member = Member(tmp_path, f"127.0.0.1:{leader.admin_port}", "frontend", "").start()
    try:
        api = RemoteApi(f"127.0.0.1:{member.admin_port}")
        try:
            assert _chat(api.port)[0]
            out, err = api.stop(signal.SIGINT)
            assert api.proc.returncode == 0, err
        finally:
            api.stop(signal.SIGKILL)
        assert api.others() == []
    finally:
        member.stop()
    assert member.left_after_exit == []

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "omni_actors.system", "api", "--port", str(free_port()), *args],
                              capture_output=True, text=True, cwd=ROOT, timeout=60)

    nobody = free_port()
    for args, code, message in (
            (("--convention-address", f"127.0.0.1:{nobody}"), 1,
             f"error: no convention leader answers at 127.0.0.1:{nobody}"),
            (("--convention-address", "127.0.0.1"), 2,
             "error: --convention-address must be HOST:PORT, got '127.0.0.1'"),
            (("--convention-address", f"127.0.0.1:{leader.admin_port}", "--admin-port", "1901"), 2,
             "error: give --convention-address HOST:PORT or --admin-port, not both")):
        out = run(*args)
        assert (out.returncode, out.stderr.strip()) == (code, message), out.stderr


def test_status_shell_and_stage_verbs_reach_the_system_through_the_convention_address(leader, tmp_path):
    """As from another host: no local admin, no state dir, only the leader's admin address."""
    env = {**os.environ, "OMNI_ACTORS_STATE_DIR": str(tmp_path), "OMNI_ACTORS_HISTORY": str(tmp_path / "h")}
    address = f"127.0.0.1:{leader.admin_port}"

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "omni_actors.system", *args, "--convention-address", address],
                              capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)

    out = cli("status", "--json")
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert {st["stage"] for st in status["stages"]} == {"thinker", "talker", "code2wav"}
    out = cli("shell", "-c", "nodes", "-c", "scale talker 3")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "(control plane)" in out.stdout and "talker: 2 -> 3 replicas" in out.stdout
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        out = cli("shell", "-c", "replicas talker")
        if "talker/2  ready" in out.stdout:
            break
        time.sleep(0.3)
    assert "talker/2  ready" in out.stdout, out.stdout + out.stderr
    out = cli("stage", "scale", "--stage", "talker", "--replicas", "2")
    assert out.returncode == 0, out.stderr
    out = subprocess.run([sys.executable, "-m", "omni_actors.system", "status", "--convention-address", "nowhere"],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert (out.returncode, out.stderr.strip()) == (2, "error: --convention-address must be HOST:PORT, got 'nowhere'")


def test_api_in_another_network_namespace_serves_through_the_leaders_admin(request, tmp_path):
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
    t0 = time.monotonic()
    # the leader in the hub namespace (198.18.0.1), the API server in m1's (198.18.0.2): no shared loopback
    port, admin_port = ns.port(), ns.port()
    state = tmp_path / "state"
    out, err = tmp_path / "leader.out", tmp_path / "leader.err"
    with open(out, "wb") as o, open(err, "wb") as e:
        leader = subprocess.Popen([*ns.exec_prefix(ns.hub), sys.executable, "-m", "omni_actors.system", "start",
                                   "--convention-leader", "--config", str(CONFIGS / "cpu_omni_demo.yaml"),
                                   "--port", str(port), "--admin-port", str(admin_port)],
                                  stdout=o, stderr=e, stdin=subprocess.DEVNULL, cwd=ROOT,
                                  env={**os.environ, "OMNI_ACTORS_STATE_DIR": str(state),
                                       "THESPIAN_BASE_IPADDR": f"{NETNS_NET}.1"})

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

    api = RemoteApi(f"{NETNS_NET}.1:{admin_port}", prefix=ns.exec_prefix(ns.m1), port=ns.port())
    try:
        client = subprocess.run([*ns.exec_prefix(ns.m1), sys.executable, "-c", (
            "import json, sys, urllib.request\n"
            "body = {'model': sys.argv[2], 'messages': [{'role': 'user', 'content': 'hi'}],\n"
            "        'modalities': ['text', 'audio'], 'max_tokens': 6}\n"
            "req = urllib.request.Request(sys.argv[1] + '/chat/completions', json.dumps(body).encode(),\n"
            "                             {'Content-Type': 'application/json'})\n"
            "m = json.load(urllib.request.urlopen(req, timeout=60))['choices'][0]['message']\n"
            "print(json.dumps([m['content'], len(m['audio']['data'])]))\n"),
            f"http://127.0.0.1:{api.port}/v1", MODEL], capture_output=True, text=True, timeout=90, cwd=ROOT)
        assert client.returncode == 0, client.stderr[-2000:]
        text, audio = json.loads(client.stdout)
        assert text and audio > 1000
        stopped, err_text = api.stop(signal.SIGINT)
        assert api.proc.returncode == 0, err_text
        assert "omni-actors API server stopped" in stopped
    finally:
        api.stop(signal.SIGKILL)
    assert api.others() == []
    print(f"\nremote API server in another network namespace: scenario {time.monotonic() - t0:.1f} s")


def test_a_leader_address_in_a_message_reads_as_host_and_port():
    """A trial read `the convention leader ActorAddr-(T|:59000) of the member at ...`:
    Thespian's text for an admin on the member's own host. It is `127.0.0.1:59000` now."""
    from thespian.actors import ActorAddress
    from thespian.system.transport.IPBase import TCPv4ActorAddress

    from omni_actors.system.remote import _address_text

    assert _address_text(ActorAddress(TCPv4ActorAddress(None, 59000, external=False)), "127.0.0.1") == \
        "127.0.0.1:59000"
    assert _address_text(ActorAddress(TCPv4ActorAddress("10.0.0.5", 1900, external=True)), "127.0.0.1") == \
        "10.0.0.5:1900"
    assert _address_text("leader", "h") == "leader"
