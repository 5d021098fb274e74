"""``stage launch --node N --devices 2,3``: replicas on a named node, pinned to named devices.

A leader (a CPU node, the demo's 1:2:1 on it) and one member host ``m1``
offering devices 0-3, each its own admin on loopback, started with the real
CLI. Launches that name devices take exactly those (split
``devices_per_replica`` each), keep them across restarts, and free them when
scaled down; launches that cannot be done fail with one line and exit 1
(the admin shell shows the same errors). The rules themselves are unit-tested
in tests/test_placement.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from omni_actors.system.faultlab import read_events
from omni_actors.system.local import LocalLeader

from conftest import CONFIGS, ROOT
from test_multihost import Member

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def system(request, tmp_path_factory):
    leader = LocalLeader(CONFIGS / "cpu_omni_demo.yaml", extra_args=["--node-name", "leader"])
    request.addfinalizer(leader.stop)
    leader.start()
    member = Member(tmp_path_factory.mktemp("members"), f"127.0.0.1:{leader.admin_port}", "m1", "0,1,2,3")
    request.addfinalizer(member.stop)  # last in, first out: the member stops before the leader
    member.start()
    _wait(leader, lambda st: any(n["name"] == "m1" and n["alive"] for n in st["nodes"]), "m1 joined")
    leader.member = member
    return leader


def _cli(leader: LocalLeader, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omni_actors.system", *args, "--admin-port", str(leader.admin_port)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env={**os.environ, "OMNI_ACTORS_STATE_DIR": str(leader.log_path.parent)})


def _status(leader: LocalLeader) -> dict:
    """The stage table and nodes, as ``status --json`` prints them (from the HTTP API: quicker to poll)."""
    with urllib.request.urlopen(leader.base_url + "/stages", timeout=10) as r:
        return json.loads(r.read())


def _reps(status: dict) -> dict[str, dict]:
    return {r["replica"]: r for st in status["stages"] for r in st["replicas"]}


def _wait(leader: LocalLeader, predicate, what: str, timeout_s: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        status = _status(leader)
        if predicate(status):
            return status
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout_s:g} s: " + "; ".join(
                f"{r['replica']} {r['state']} {r['node']}:{r['devices']} {r['reason']}"
                for r in _reps(status).values()))
        time.sleep(0.2)


def _on(leader: LocalLeader, placed: dict[str, tuple[str, str]], **extra) -> dict:
    """Wait until each replica in ``placed`` is ready on (node, devices)."""
    def ok(status):
        reps = _reps(status)
        return all(r in reps and reps[r]["state"] == "ready" and (reps[r]["node"], reps[r]["devices"]) == where
                   for r, where in placed.items())
    return _wait(leader, ok, f"ready on {placed}", **extra)


def _used(status: dict, node: str = "m1") -> dict[str, str]:
    return next(n["used"] for n in status["nodes"] if n["name"] == node)


def _pool_pid(status: dict, stage: str) -> int | None:
    return next(st["pid"] for st in status["stages"] if st["stage"] == stage)


def _error(out: subprocess.CompletedProcess, text: str) -> None:
    assert out.returncode == 1, (out.stdout, out.stderr)
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: "), out.stderr
    assert text in out.stderr, out.stderr


def test_launch_on_named_devices_pins_them_for_life_and_refuses_what_cannot_be_done(system):
    leader = system
    t0 = time.monotonic()
    out = _cli(leader, "stage", "launch", "--stage", "talker", "--devices", "1,2", "--node", "m1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "talker: 2 -> 4 replicas; launched talker/2 on m1 devices 1, talker/3 on m1 devices 2"
    status = _on(leader, {"talker/2": ("m1", "1"), "talker/3": ("m1", "2")})
    assert _used(status) == {"1": "talker/2", "2": "talker/3"}
    assert {r: v["node"] for r, v in _reps(status).items() if r.startswith("talker")} == {
        "talker/0": "leader", "talker/1": "leader", "talker/2": "m1", "talker/3": "m1"}

    # what cannot be done: one line, exit 1, nothing launched
    _error(_cli(leader, "stage", "launch", "--stage", "talker", "--devices", "1", "--node", "m1"),
           "device(s) already taken on node m1: 1 (held by talker/2)")
    _error(_cli(leader, "stage", "launch", "--stage", "talker", "--devices", "7", "--node", "m1"),
           "device(s) 7 not on node m1 (it offers 0,1,2,3)")
    _error(_cli(leader, "stage", "launch", "--stage", "talker", "--devices", "7"),
           "no node offers device(s) 7 (leader: none; m1: 0,1,2,3)")
    _error(_cli(leader, "stage", "launch", "--stage", "talker", "--devices", "0,3", "--replicas", "1"),
           "1 replica(s) of talker at 1 device(s) each need 1 device(s); --devices gives 2")
    _error(_cli(leader, "stage", "launch", "--stage", "talker", "--devices", "0", "--node", "leader"),
           "node leader offers no devices (a CPU node): drop --devices")
    _error(_cli(leader, "stage", "launch", "--stage", "talker", "--node", "nope"),
           "no node named 'nope' (nodes: leader, m1)")
    _error(_cli(leader, "stage", "launch", "--stage", "nope", "--node", "m1"),
           "no stage named 'nope' (stages: thinker, talker, code2wav)")
    assert len(_reps(_status(leader))) == 6

    # --node alone: that node, the first free device there
    out = _cli(leader, "stage", "launch", "--stage", "code2wav", "--node", "m1")
    assert out.returncode == 0, out.stderr
    _on(leader, {"code2wav/1": ("m1", "0")})

    # a pinned replica that dies comes back on the same devices (held for it meanwhile)
    pid = _reps(_status(leader))["talker/3"]["pid"]
    out = _cli(leader, "inject", "sigkill", "--replica", "talker/3")
    assert out.returncode == 0, out.stderr
    status = _wait(leader, lambda st: _reps(st)["talker/3"]["restarts"] == 1 and
                   _reps(st)["talker/3"]["state"] == "ready", "talker/3 restarted")
    rep = _reps(status)["talker/3"]
    assert (rep["node"], rep["devices"]) == ("m1", "2") and rep["pid"] != pid

    # the admin shell launches the same way, and says why not in one line
    def shell(*lines: str) -> subprocess.CompletedProcess:
        args = [a for line in lines for a in ("-c", line)]
        return subprocess.run([sys.executable, "-m", "omni_actors.system", "shell", "--admin-port",
                               str(leader.admin_port), *args], capture_output=True, text=True, timeout=60, cwd=ROOT)
    out = shell("launch talker --node m1 --devices 3")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "talker: 4 -> 5 replicas; launched talker/4 on m1 devices 3"
    status = _on(leader, {"talker/4": ("m1", "3")})
    assert _used(status) == {"0": "code2wav/1", "1": "talker/2", "2": "talker/3", "3": "talker/4"}
    out = shell("launch talker 1 --devices=3 --node m1", "launch talker --devices")
    assert out.returncode == 1
    assert out.stderr.splitlines() == ["error: device(s) already taken on node m1: 3 (held by talker/4)",
                                       "error: --devices needs a value; usage: launch STAGE [N] [--node NODE] "
                                       "[--devices IDS]"]

    # scaling down drains the newest (idle) replicas and frees their devices; they can be named again
    out = _cli(leader, "stage", "scale", "--stage", "talker", "--replicas", "2")
    assert out.returncode == 0, out.stderr
    status = _wait(leader, lambda st: all(_reps(st)[f"talker/{i}"]["state"] == "stopped" for i in (2, 3, 4))
                   and _used(st) == {"0": "code2wav/1"}, "talker/2-4 stopped, devices 1-3 free")
    out = _cli(leader, "stage", "launch", "--stage", "talker", "--devices", "3,1,2")
    assert out.returncode == 0, out.stderr
    assert "talker: 2 -> 5 replicas" in out.stdout
    _on(leader, {"talker/5": ("m1", "3"), "talker/6": ("m1", "1"), "talker/7": ("m1", "2")})
    print(f"\nlaunch/pin/restart/scale scenario: {time.monotonic() - t0:.1f} s")


def test_pinned_replicas_of_a_lost_node_wait_for_it_and_come_back_on_their_devices(system):
    leader = system
    t0 = time.monotonic()
    pinned = {r: (v["node"], v["devices"]) for r, v in _reps(_status(leader)).items()
              if v["node"] == "m1" and v["state"] == "ready"}
    assert len(pinned) >= 2, pinned  # what the test above left there
    leader.member.kill()  # the whole host at once
    status = _wait(leader, lambda st: all(_reps(st)[r]["state"] == "pending" for r in pinned),
                   "m1's replicas pending", timeout_s=30)
    reasons = {r: _reps(status)[r]["reason"] for r in pinned}
    assert any("which is lost" in why for why in reasons.values()), reasons
    leader.member.start()  # the same host again: its pinned replicas return to their devices
    _on(leader, pinned, timeout_s=30)
    print(f"\nm1 lost and back, {len(pinned)} pinned replicas on their devices again: "
          f"{time.monotonic() - t0:.1f} s")


def test_a_pool_recreated_after_a_crash_runs_the_replicas_launched_and_scaled_at_runtime(system):
    """The talker pool is SIGKILLed after the launches and the scale-down above: the
    coordinator's new pool starts the replicas the old one ran, under the same names,
    the pinned ones on their devices, and not those scaled down (not the config's 2)."""
    leader = system
    status = _status(leader)
    talkers = {r: v for r, v in _reps(status).items() if r.startswith("talker/")}
    running = {r: (v["node"], v["devices"]) for r, v in talkers.items() if v["state"] == "ready"}
    pins = {r: talkers[r]["pin"] for r in running if talkers[r]["pin"]}
    assert len(running) == 5 and len(pins) == 3, talkers  # what the tests above left
    assert {r for r, v in talkers.items() if v["state"] == "stopped"} == {"talker/2", "talker/3", "talker/4"}
    before = {r: talkers[r]["restarts"] for r in running}  # (the lost node above restarted m1's replicas)
    before["talker/5"] += 1
    assert _cli(leader, "inject", "sigkill", "--replica", "talker/5").returncode == 0  # restarts carry on
    status = _wait(leader, lambda st: _reps(st)["talker/5"]["restarts"] == before["talker/5"]
                   and _reps(st)["talker/5"]["state"] == "ready", "talker/5 restarted")
    pid = _pool_pid(status, "talker")
    os.kill(pid, signal.SIGKILL)
    status = _wait(leader, lambda st: _pool_pid(st, "talker") not in (None, pid)
                   and {r for r in _reps(st) if r.startswith("talker/")} == set(running)
                   and all(_reps(st)[r]["state"] == "ready" for r in running), "the talker pool recreated",
                   timeout_s=30)
    reps = _reps(status)
    assert {r: (reps[r]["node"], reps[r]["devices"]) for r in running} == running
    # (their history goes on; the new processes count, each once, outside the restart budget)
    assert {r: reps[r]["restarts"] for r in running} == {r: n + 1 for r, n in before.items()}
    assert {r: reps[r]["pin"] for r in running if reps[r]["pin"]} == pins
    table = {line.split()[1]: line for line in _cli(leader, "status").stdout.splitlines() if line.startswith("talker ")}
    assert all(("(pinned)" in table[r]) == (r in pins) for r in running), table
    assert _used(status) == {"0": "code2wav/1", **{d: r for r, (node, d) in running.items() if node == "m1"}}
    # and the next launch takes the next free name
    out = _cli(leader, "stage", "launch", "--stage", "talker", "--node", "leader")
    assert out.returncode == 0, out.stderr
    assert "launched talker/8" in out.stdout, out.stdout


def test_a_replica_draining_when_its_pool_dies_frees_its_devices_and_names_are_not_reused(system):
    """A pinned replica is drained with work in flight (slowed down) and the talker pool is
    SIGKILLed at once: the new pool leaves it out and its device is free again; the replica
    scaled down before the crash (the newest) does not lend its name to the next launch."""
    import threading

    leader = system
    out = _cli(leader, "stage", "scale", "--stage", "talker", "--replicas", "5")  # talker/8 (newest) goes
    assert out.returncode == 0, out.stderr
    _wait(leader, lambda st: _reps(st)["talker/8"]["state"] == "stopped", "talker/8 scaled down")
    assert _cli(leader, "inject", "slow", "--replica", "talker/7", "--factor", "200").returncode == 0
    device = _reps(_status(leader))["talker/7"]["devices"]

    def ask() -> None:
        body = json.dumps({"model": "qwen3-omni-cpu-demo", "modalities": ["text", "audio"],
                           "messages": [{"role": "user", "content": "hello"}]}).encode()
        req = urllib.request.Request(leader.base_url + "/chat/completions", body,
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=90) as r:
                r.read()
        except Exception:  # noqa: BLE001 - this test is about devices and names, not answers
            pass
    clients = [threading.Thread(target=ask) for _ in range(8)]
    for c in clients:
        c.start()
    _wait(leader, lambda st: _reps(st)["talker/7"]["in_flight"] > 0, "talker/7 busy")
    assert _cli(leader, "stage", "drain", "--replica", "talker/7").returncode == 0
    status = _status(leader)
    assert _reps(status)["talker/7"]["state"] == "draining", _reps(status)["talker/7"]
    pid = _pool_pid(status, "talker")
    os.kill(pid, signal.SIGKILL)
    status = _wait(leader, lambda st: _pool_pid(st, "talker") not in (None, pid)
                   and sorted(r for r in _reps(st) if r.startswith("talker/")) == [
                       "talker/0", "talker/1", "talker/5", "talker/6"]
                   and all(_reps(st)[r]["state"] == "ready" for r in _reps(st) if r.startswith("talker/")),
                   "the talker pool recreated without talker/7", timeout_s=30)
    assert device not in _used(status), _used(status)
    for c in clients:
        c.join(120)
    out = _cli(leader, "stage", "launch", "--stage", "talker", "--devices", device, "--node", "m1")
    assert out.returncode == 0, out.stderr
    assert f"launched talker/9 on m1 devices {device}" in out.stdout, out.stdout


def test_a_member_stopped_cleanly_shows_as_left_not_lost(system):
    """Ctrl-C on the member host: its node agent tells the coordinator it leaves, so `nodes`
    says LEFT (it said LOST, as for a host that was killed) and the log has node_left."""
    leader = system
    if not any(r["node"] == "m1" for r in _reps(_status(leader)).values()):  # (run on its own)
        out = _cli(leader, "stage", "launch", "--stage", "code2wav", "--node", "m1")
        assert out.returncode == 0, out.stderr
        _wait(leader, lambda st: any(r["node"] == "m1" and r["state"] == "ready" for r in _reps(st).values()),
              "a replica ready on m1")
    before = _reps(_status(leader))
    on_m1 = [name for name, r in before.items() if r["node"] == "m1"]
    since = time.time()
    leader.member.stop()
    status = _wait(leader, lambda st: any(n["name"] == "m1" and not n["alive"] for n in st["nodes"]), "m1 gone")
    m1 = next(n for n in status["nodes"] if n["name"] == "m1")
    assert m1["state"] == "left", m1  # (status --json told LEFT from LOST by nothing)
    # A clean leave is not a crash: RESTARTS does not count it, even where a replica's process
    # exit reached its pool before the node's leave did (a trial saw 0 -> 1 -> 2).
    time.sleep(2.0)  # (past the first restart back-off)
    after = _reps(_status(leader))
    assert {n: after[n]["restarts"] for n in before} == {n: before[n]["restarts"] for n in before}, after
    moved = [after[n]["reason"] for n in on_m1 if after[n]["state"] == "ready"]
    assert all(r.startswith("placed again at ") for r in moved), moved  # (not "restarted")
    out = _cli(leader, "shell", "-c", "nodes")
    assert out.returncode == 0, out.stderr
    events = [(e["event"], e.get("reason")) for e in read_events(leader.log_path, since) if e.get("node") == "m1"
              and e["event"] in ("node_left", "node_lost")]
    assert "m1 LEFT: " in out.stdout, (events, out.stdout)
    assert [e for e, _ in events] == ["node_left"], events


def test_a_second_member_with_a_node_name_in_use_is_refused(system, tmp_path):
    """Two admins calling themselves m1 would share m1's placements (Thespian sends an actor
    for node m1 to either) and corrupt its device inventory; a trial's duplicate, when
    stopped, took a replica of the real m1 with it. The second one now exits at once with
    one line, and the first keeps its devices."""
    leader = system
    leader.member.start()  # (the test above stopped it)
    _wait(leader, lambda st: any(n["name"] == "m1" and n["alive"] for n in st["nodes"]), "m1 back")
    duplicate = Member(tmp_path, f"127.0.0.1:{leader.admin_port}", "m1", "0")
    try:
        with pytest.raises(RuntimeError) as err:
            duplicate.start(timeout_s=30)
        assert "a member host named 'm1' is already in the convention" in str(err.value), str(err.value)
        assert duplicate.proc.returncode not in (None, 0)
    finally:
        duplicate.stop()
    m1 = next(n for n in _status(leader)["nodes"] if n["name"] == "m1")
    assert m1["alive"] and m1["devices"] == ["0", "1", "2", "3"], m1


def test_a_member_given_a_stage_the_system_has_not_is_refused(system, tmp_path):
    """Trial AP's member joined with `--stages talkr` (a typo) and could never be given a
    replica. It now exits at once with one line naming the system's stages."""
    leader = system
    typo = Member(tmp_path, f"127.0.0.1:{leader.admin_port}", "m9", "", extra_args=["--stages", "talker,talkr"])
    try:
        with pytest.raises(RuntimeError) as err:
            typo.start(timeout_s=30)
        assert "error: --stages: no stage named 'talkr' in the system this member joins (its stages: " \
            in str(err.value), str(err.value)
        assert typo.proc.returncode == 1
    finally:
        typo.stop()
    assert all(n["name"] != "m9" for n in _status(leader)["nodes"])


def test_a_node_undrained_before_its_replacements_ran_keeps_each_stage_at_its_size(request):
    """Trial AW: `node drain` of the only node, then `node undrain` half a second later. The
    drained node's replicas were its stages' last ready ones, so they lingered, and their
    replacements waited for a node; the undrain kept the first and placed the second there
    too: every stage ran twice its replicas. The replacements not yet ready now stop."""
    leader = LocalLeader(CONFIGS / "cpu_omni_demo.yaml", extra_args=["--node-name", "solo"])
    request.addfinalizer(leader.stop)
    leader.start()
    import threading

    import openai

    live = ("pending", "starting", "ready")
    before = _reps(_wait(leader, lambda st: all(r["state"] == "ready" for r in _reps(st).values()), "ready"))
    # A stream in flight (about 16 s of Thinker, slowed 2x: 8 s was short of three CLI start-ups
    # on a loaded machine, a review) keeps the node's replicas lingering, as the trial's
    # clients did: with none, they drain at once and their replacements are needed.
    slowed = _cli(leader, "inject", "slow", "--replica", "thinker/0", "--factor", "2")
    assert slowed.returncode == 0, slowed.stderr
    client = openai.OpenAI(base_url=leader.base_url, api_key="x", max_retries=0, timeout=60)
    first, text = threading.Event(), []

    def stream():
        for chunk in client.chat.completions.create(model="qwen3-omni-cpu-demo", stream=True, max_tokens=2048,
                                                    messages=[{"role": "user", "content": "a long story"}]):
            if chunk.choices and chunk.choices[0].delta.content:
                text.append(chunk.choices[0].delta.content)
                first.set()
    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert first.wait(30), "no text"
    # (from the shell: trial BB's `drain --node` there, of the only node, said nothing of the
    # stages it left with no replica; `node drain` on the command line did)
    drained = _cli(leader, "shell", "-c", "drain --node solo")
    assert drained.returncode == 0, drained.stderr
    for stage in ("thinker", "talker", "code2wav"):
        assert f"warning: stage {stage} has no replica running while node solo is drained (" in drained.stdout, \
            drained.stdout
    assert any("the last ready replica" in v["reason"] for v in _reps(_status(leader)).values())
    undrained = _cli(leader, "node", "undrain", "--node", "solo")
    assert undrained.returncode == 0, undrained.stderr
    assert "replacements not ready yet are stopped" in undrained.stdout, undrained.stdout
    wrong = _cli(leader, "shell", "-c", "undrain talker/1")  # (trial BB: "no alive node named 'talker/1'")
    assert "error: undrain takes a node, not a replica: a drained replica stops for good; `scale talker N` or " \
           "`launch talker` starts new ones" in wrong.stdout + wrong.stderr, wrong

    def settled(st):
        reps = _reps(st)
        return all(reps[r]["state"] == "ready" for r in before) and \
            sum(r["state"] in live for r in reps.values()) == len(before)
    reps = _reps(_wait(leader, settled, "back to its size"))
    time.sleep(2.0)  # (two heartbeats: nothing else starts)
    reps = _reps(_status(leader))
    assert sorted(r for r, v in reps.items() if v["state"] in live) == sorted(before), reps
    extra = {r: v for r, v in reps.items() if r not in before}
    assert len(extra) == len(before), extra  # one replacement each, stopped
    assert all(v["state"] == "stopped" and v["reason"].startswith("not needed: ") for v in extra.values()), extra
    reader.join(60)
    assert not reader.is_alive() and len(text) > 100, len(text)  # (the stream finished)


def test_replicas_on_a_host_without_devices_share_out_their_stages_runtime_devices(tmp_path):
    """A review: a stage whose `runtime.devices` list one device per replica (`"1,2"`, two
    replicas) ran every replica on all of them (CUDA_VISIBLE_DEVICES `1,2`: a one-GPU engine
    on GPU 1, twice); as vLLM-Omni shares a stage's devices out, each replica has its own."""
    import yaml

    cfg = yaml.safe_load((CONFIGS / "cpu_omni_demo.yaml").read_text())
    cfg["stage_args"][1]["runtime"]["devices"] = "1,2"  # the Talker, 2 replicas, 1 device each
    path = tmp_path / "split.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    leader = LocalLeader(path).start()
    try:
        reps = _reps(_wait(leader, lambda st: st.get("ready"), "ready"))
        assert (reps["talker/0"]["devices"], reps["talker/1"]["devices"], reps["thinker/0"]["devices"]) == \
            ("1", "2", "0"), reps
    finally:
        assert leader.stop() == 0
