"""Kill the coordinator under load, the leader's node offering simulated devices (one per
replica); then scale a stage beyond the devices left."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from omni_actors.system.faultlab import (assert_clean_exit, assert_no_request_lost, read_events, replicas, run_scenario,
                                         stages, wait_gone, wait_no_segments)
from omni_actors.system.local import LocalLeader
from omni_actors.system.processes import proc_stat

from .conftest import CLIENTS, CONFIG, HEARTBEAT_S, REQUEST_TIMEOUT_S

pytestmark = [pytest.mark.system, pytest.mark.serial]

#: The devices the leader's node offers (simulated GPUs): one per replica, and one to spare.
DEVICES = "0,1,2,3,4,5"


@pytest.fixture(scope="module")
def leader(request) -> LocalLeader:
    """The demo config's leader, its node offering :data:`DEVICES`: each replica is given one."""
    leader = LocalLeader(CONFIG, extra_args=["--devices", DEVICES])
    request.addfinalizer(lambda: assert_clean_exit(leader))
    leader.start()
    return leader


class ExitWatch:
    """Notes when each of ``pids`` exits (Unix time; a zombie counts as exited), polling /proc,
    and when each was last seen alive (the time taken before looking: a strict lower bound of
    its exit, however late this thread runs beside the test's load)."""

    def __init__(self, pids) -> None:
        self.exited: dict[int, float] = {}
        self.last_alive: dict[int, float] = {}
        self._pids, self._stop = set(pids), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set() and len(self.exited) < len(self._pids):
            for pid in self._pids - set(self.exited):
                before = time.time()
                fields = proc_stat(Path(f"/proc/{pid}"))
                if not fields or fields[0] in ("Z", "X"):
                    self.exited[pid] = time.time()
                else:
                    self.last_alive[pid] = before
            time.sleep(0.02)

    def stop(self) -> dict[int, float]:
        self._stop.set()
        self._thread.join()
        return self.exited


def _events(leader, name: str) -> list[dict]:
    return [ev for ev in read_events(leader.log_path) if ev.get("event") == name]


def test_killed_coordinator_is_recreated_and_the_old_tree_winds_down(leader):
    """The coordinator process is SIGKILLed; its pools and their engines lose their supervisor.

    The leader's watchdog finds it gone (``coordinator_restarted``) and deploys
    the config to a new one, which starts new pools and replicas; the API
    server re-subscribes and routes new requests there, while requests already
    running finish on the old pools. The old pools, no longer acked, drain
    their engines and exit. Users see only 200s.
    """
    import subprocess
    import sys

    # A replica launched at runtime: it comes back too (a trial saw it dropped, every counter
    # and restart count back at 0, and no reason saying why each replica was new)
    launched = subprocess.run([sys.executable, "-m", "omni_actors.system", "stage", "launch", "--stage", "talker",
                               "--admin-port", str(leader.admin_port)], capture_output=True, text=True, timeout=60)
    assert launched.returncode == 0, launched.stderr
    old_engines = {rep["pid"]: rep for rep in replicas(stages(leader)).values()}
    watch = ExitWatch(old_engines)
    try:
        r = run_scenario(leader, "kill-coordinator", clients=CLIENTS, request_timeout_s=REQUEST_TIMEOUT_S)
    except BaseException:
        watch.stop()
        raise

    assert_no_request_lost(r)
    assert r.isolation_ms is not None and r.isolation_ms < 3 * HEARTBEAT_S * 1000, r.events
    assert r.disturbed and r.restored_at is not None, r.after
    assert r.after["coordinator_pid"] != r.before["coordinator_pid"]
    assert all(rep["state"] == "ready" for rep in replicas(r.after).values())
    assert [st["ready_replicas"] for st in r.after["stages"]] == [st["ready_replicas"] for st in r.before["stages"]]
    # Each pool went with the coordinator, and each replica's process with its pool: both counted
    # (a trial's alert on the restart counters missed a coordinator crash that restarted everything)
    assert [st["restarts"] for st in r.after["stages"]] == [st["restarts"] + 1 for st in r.before["stages"]]
    before, after = replicas(r.before), replicas(r.after)
    assert sorted(after) == sorted(before) and len(before) == 5, (sorted(before), sorted(after))  # talker/2 too
    for name, rep in after.items():
        assert rep["completed"] >= before[name]["completed"] and rep["restarts"] == before[name]["restarts"] + 1, \
            (name, before[name], rep)
        assert "it was down: the coordinator was lost and recreated" in rep["reason"], rep
    # each went back to its own devices (a trial saw them dealt out anew: each new engine then
    # waited for another replica's old one)
    assert {name: rep["devices"] for name, rep in after.items()} == \
        {name: rep["devices"] for name, rep in before.items()}
    old = {r.before["coordinator_pid"]} | {st["pid"] for st in r.before["stages"]} \
        | {rep["pid"] for rep in replicas(r.before).values()}
    # old pools orphan after 5 missed acks, then drain their engines and exit
    try:
        assert wait_gone(leader, old, timeout_s=12 * HEARTBEAT_S) == []
    finally:
        exited = watch.stop()
    assert wait_no_segments(leader) == []
    # No device is held by two engines at once: each new engine loaded only once the old engine
    # on its device had exited (a trial saw a new talker/1 start on a device 2.3 s before the old
    # code2wav/0 there exited: on a GPU, a load without memory)
    ready = {ev["replica"]: ev for ev in _events(leader, "engine_ready") if ev["t"] >= r.injected_at}
    holder_of = {rep["devices"]: pid for pid, rep in old_engines.items()}
    assert sorted(holder_of) == sorted(rep["devices"] for rep in before.values()) and "" not in holder_of, before
    for name, rep in after.items():
        old_pid = holder_of.get(rep["devices"])
        if old_pid is None:
            continue  # (the spare device: nobody held it before)
        assert old_pid in exited, (name, rep["devices"], old_pid)
        alive = watch.last_alive.get(old_pid, 0.0)  # (seen alive then: it exited later)
        assert ready[name]["t"] >= alive, \
            (f"{name} loaded on device {rep['devices']} {alive - ready[name]['t']:.2f} s or more before "
             f"the old engine there (pid {old_pid}, {old_engines[old_pid]['replica']}) exited")
    assert _events(leader, "engine_waits_for_devices"), "no new engine had to wait: the test saw no overlap"


def test_a_scale_beyond_the_free_devices_says_which_new_replica_is_only_pending(leader):
    """``stage scale`` past the devices left: the reply names the new replicas, and a warning
    says which of them no node had room for (a trial read "launched code2wav/4" for a replica
    that stayed pending, with nothing saying so)."""
    import subprocess
    import sys

    def scale(n: int) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "omni_actors.system", "stage", "scale", "--stage", "code2wav",
                               "--replicas", str(n), "--admin-port", str(leader.admin_port)],
                              capture_output=True, text=True, timeout=60)

    live = [rep for rep in replicas(stages(leader)).values() if rep["state"] != "stopped"]
    free = len(DEVICES.split(",")) - len(live)
    code2wav = sum(rep["replica"].startswith("code2wav/") for rep in live)
    assert free >= 0, live
    out = scale(code2wav + free + 1)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"code2wav: {code2wav} -> {code2wav + free + 1} replicas; launched "), out.stdout
    last = out.stdout.strip().rsplit(", ", 1)[-1].rsplit(" ", 1)[-1]  # (the newest name)
    warnings = out.stderr.splitlines()
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: {last} is pending, not started: "), \
        (out.stderr, replicas(stages(leader))[last])
    assert replicas(stages(leader))[last]["state"] == "pending"
    out = scale(code2wav)  # (back: the pending one goes first; nothing new, no warning)
    assert (out.returncode, out.stderr) == (0, ""), out.stderr


def test_an_engine_frozen_when_its_pool_is_killed_is_killed_for_its_replacement(leader):
    """``inject sigstop`` on talker/0, then ``inject kill-pool`` on its stage: the frozen
    engine can never exit by itself. The new talker/0 kills it once it has seen it stopped for
    3 s (any other old engine: after half of ``ready_timeout_s``) and takes its device (trial AK: the frozen engine held the device until the
    system stopped, beside the new engine, and ``status`` said nothing)."""
    import subprocess
    import sys

    def inject(*args: str) -> None:
        out = subprocess.run([sys.executable, "-m", "omni_actors.system", "inject", *args,
                              "--admin-port", str(leader.admin_port)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr

    before = replicas(stages(leader))
    frozen = before["talker/0"]["pid"]
    t0 = time.time()
    inject("sigstop", "--replica", "talker/0")
    inject("kill-pool", "--stage", "talker")
    deadline = time.monotonic() + 30 / 2 + 20  # (the config's ready_timeout_s is 30)
    reasons, waiting_pids = set(), set()
    while time.monotonic() < deadline:
        now = replicas(stages(leader)).get("talker/0", {})
        reasons.add(now.get("reason", ""))
        if "to be freed" in now.get("reason", ""):
            waiting_pids.add(now.get("pid"))
        if now.get("pid") not in (None, frozen) and now.get("state") == "ready":
            break
        time.sleep(0.2)
    assert now.get("state") == "ready" and now["pid"] != frozen, now
    # (status says so: the trial read a plain `ready`)
    # (killed once stopped for 3 s, not after the whole 15 s wait: trial AM)
    assert f"killed the old engine that still held device {before['talker/0']['devices']} (held by talker/0, " \
        f"pid {frozen}) (stopped for 3 s: it could not exit) after " in now["reason"], now
    waited = float(now["reason"].rsplit(" after ", 1)[1].split(" s")[0])
    assert 3 <= waited < 15, now["reason"]
    assert wait_gone(leader, {frozen}, timeout_s=5) == []
    # (the waiting engine's own pid, not `-`: trial AN; at most the first sample before its heartbeat lacks it)
    assert now["pid"] in waiting_pids and waiting_pids <= {None, now["pid"]}, (waiting_pids, now["pid"])
    assert any(f"waiting for device {before['talker/0']['devices']} (held by talker/0, pid {frozen}) to be freed"
               in reason and "killed if still running after 15 s, or once stopped (SIGSTOP) for 3 s" in reason
               for reason in reasons), reasons
    killed = [ev for ev in _events(leader, "engine_killed_device_holders") if ev["t"] >= t0]
    assert [(ev["replica"], ev["held"]) for ev in killed] == \
        [("talker/0", f"device {before['talker/0']['devices']} (held by talker/0, pid {frozen}) (stopped for 3 s: "
                      "it could not exit)")], killed
    assert not [ev for ev in _events(leader, "engine_loads_beside_device_holders") if ev["t"] >= t0]
