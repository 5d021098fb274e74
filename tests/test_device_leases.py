"""Device leases (``omni_actors.actors.device_leases``): a replica's engine does not load on
a device that a live process of an older replica still holds (trial AJ: after the coordinator
was recreated, a new talker/1 started on device 2 while the old code2wav/0 still ran there)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from omni_actors.actors import device_leases as L
from omni_actors.system import processes as P


@pytest.fixture
def system(monkeypatch, tmp_path):
    """This process as a member of a system whose IPC directory is under tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv(P.ENV_SYSTEM_ID, "feedfacefeedface0001")
    return L.lease_dir()


@pytest.fixture
def holder():
    """Another running process (an old engine stand-in); killed at the end."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_device_held_by_a_live_process_is_waited_for_until_it_exits(system, holder):
    L.take(system, ("2",), "code2wav/0", [holder.pid])
    assert L.holders(system, ("1", "2")) == {"2": ("code2wav/0", [holder.pid])}
    seen: list[str] = []
    threading.Timer(0.5, holder.kill).start()
    waited, killed, still = L.wait_and_take(("1", "2"), "talker/1", limit_s=20, on_wait=seen.append)
    assert (killed, still) == ("", "") and 0.4 <= waited < 10, waited
    assert seen == [f"device 2 (held by code2wav/0, pid {holder.pid})", ""]
    # the devices are this process's now: the next replica would wait for it
    assert L.holders(system, ("1", "2"), me=-1) == {d: ("talker/1", [os.getpid()]) for d in ("1", "2")}
    L.release(system, ("1", "2"))
    assert L.holders(system, ("1", "2"), me=-1) == {}


def test_a_holder_still_running_after_the_wait_is_killed_and_its_devices_taken(system, holder):
    L.take(system, ("0",), "thinker/0", [holder.pid])
    t0 = time.monotonic()
    waited, killed, still = L.wait_and_take(("0",), "thinker/0", limit_s=0.3)
    assert 0.3 <= waited and time.monotonic() - t0 < 5
    assert (killed, still) == (f"device 0 (held by thinker/0, pid {holder.pid})", "")
    assert holder.wait(timeout=5) == -signal.SIGKILL
    # the lease is this process's now (the old holder is no longer in it)
    assert L.holders(system, ("0",), me=-1) == {"0": ("thinker/0", [os.getpid()])}


def test_a_frozen_holder_is_resumed_and_killed_not_left_holding_the_device(system, holder):
    """Trial AK: an engine frozen by SIGSTOP when its pool was killed held its device
    until the system stopped, beside the new engine."""
    os.kill(holder.pid, signal.SIGSTOP)
    L.take(system, ("1", "2"), "talker/0", [holder.pid])
    waited, killed, still = L.wait_and_take(("1", "2"), "talker/0", limit_s=0.2)
    assert killed == f"device 1 (held by talker/0, pid {holder.pid}); device 2 (held by talker/0, pid {holder.pid})"
    assert still == ""
    assert holder.wait(timeout=5) == -signal.SIGKILL


def test_a_holder_stopped_for_a_few_seconds_is_killed_without_waiting_out_the_bound(system, holder, monkeypatch):
    """Trial AM: a frozen vLLM Thinker was killed only after the whole wait (66 s on the GPU
    configs), and the only Thinker was down for 80 s. A stopped process cannot exit: it is
    killed once stopped for ``STOPPED_KILL_AFTER_S`` in a row."""
    monkeypatch.setattr(L, "STOPPED_KILL_AFTER_S", 0.5)
    os.kill(holder.pid, signal.SIGSTOP)
    L.take(system, ("4",), "thinker/0", [holder.pid])
    waited, killed, still = L.wait_and_take(("4",), "thinker/0", limit_s=30)
    assert 0.5 <= waited < 10, waited
    assert (killed, still) == (f"device 4 (held by thinker/0, pid {holder.pid}) (stopped for 0.5 s: it could not "
                               "exit)", "")
    assert holder.wait(timeout=5) == -signal.SIGKILL
    assert L.holders(system, ("4",), me=-1) == {"4": ("thinker/0", [os.getpid()])}


def test_a_holder_that_cannot_be_killed_is_reported_and_the_engine_loads_beside_it(system, holder, monkeypatch):
    """(Another user's process, say: the signals are refused.) The wait does not hang on it."""
    def refused(pid, sig):
        raise PermissionError(1, "Operation not permitted")
    L.take(system, ("5",), "old/0", [holder.pid])
    t0 = time.monotonic()
    with monkeypatch.context() as patch:
        patch.setattr(L.os, "kill", refused)
        waited, killed, still = L.wait_and_take(("5",), "new/0", limit_s=0.2)
    assert killed == still == f"device 5 (held by old/0, pid {holder.pid})"
    assert time.monotonic() - t0 < L.EVICT_WAIT_S + 3 and holder.poll() is None


def test_a_dead_holder_or_a_reused_pid_is_no_holder(system, holder):
    L.take(system, ("3",), "talker/0", [holder.pid])
    lease = L.read_lease(system, "3")
    lease["pids"][0][1] += 1  # the same pid, started at another time: another process
    assert L.live_holders(lease) == []
    holder.kill()
    holder.wait()
    assert L.holders(system, ("3",)) == {}
    slept = []
    waited, killed, still = L.wait_and_take(("3",), "talker/0", limit_s=10, sleep=slept.append)
    assert (killed, still, slept) == ("", "", [])  # (not waited for: no wall-clock bound)


def test_release_keeps_a_lease_another_replica_took_since(system, holder):
    L.take(system, ("4",), "talker/1")
    L.take(system, ("4",), "talker/2", [holder.pid])
    L.release(system, ("4",))
    assert L.holders(system, ("4",)) == {"4": ("talker/2", [holder.pid])}


def test_outside_a_system_or_without_devices_nothing_is_waited_for(monkeypatch):
    monkeypatch.delenv(P.ENV_SYSTEM_ID, raising=False)
    assert L.lease_dir() is None
    assert L.wait_and_take(("0",), "thinker/0", limit_s=10) == (0.0, "", "")
    monkeypatch.setenv(P.ENV_SYSTEM_ID, "feedfacefeedface0002")
    assert L.wait_and_take((), "thinker/0", limit_s=10) == (0.0, "", "")


def test_the_wait_is_how_long_an_orphaned_engine_takes_to_end_and_at_most_half_the_ready_timeout():
    """With the GPU configs' ready timeouts (1200-1800 s) half of it alone let a frozen old
    engine hold a GPU for 10-15 minutes."""
    from omni_actors.actors.pool_placement import ENGINE_EXIT_S, device_wait_s
    from omni_actors.config import load_config
    from omni_actors.messages import StartPool

    root = Path(__file__).resolve().parents[1] / "configs"
    for name, expected in (("cpu_omni_demo.yaml", 15.0), ("gpu_qwen3_omni.yaml", None)):
        cfg = load_config(root / name)
        stage = cfg.stage_args[0]
        dep = cfg.deployment
        spec = StartPool(stage, cfg.deployment_of(stage), dep.heartbeat_interval_s, dep.ready_timeout_s,
                         65536, dep.load_balancing, dep.supervision)
        wait = device_wait_s(spec)
        assert wait <= dep.ready_timeout_s / 2
        if expected is not None:
            assert wait == expected  # (half of its 30 s)
        else:  # 1200 s ready timeout: about a minute, not 600 s
            assert ENGINE_EXIT_S < wait <= ENGINE_EXIT_S + 2 * 10 * dep.heartbeat_interval_s, wait


def test_systems_of_one_node_of_a_convention_see_each_others_leases(monkeypatch, tmp_path, holder):
    """A code review: a member started again under the name of one that froze (lost, its
    engines holding their GPUs) is another actor system on the same host; with a lease
    directory per system its replicas saw none of the old engines' leases. The leases are
    per convention and node now: the new system's replica waits for the old holder."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv(P.ENV_SYSTEM_ID, "feedfacefeedface0003")  # the member that froze
    directory = L.use_scope(1900, "m2")
    assert L.lease_dir() == directory == L.scope_dir(1900, "m2")
    L.take(directory, ("0",), "talker/0", [holder.pid])
    monkeypatch.setenv(P.ENV_SYSTEM_ID, "feedfacefeedface0004")  # m2 started again
    L.use_scope(1900, "m2")
    threading.Timer(0.5, holder.kill).start()
    waited, killed, still = L.wait_and_take(("0",), "talker/1", limit_s=20)
    assert (killed, still) == ("", "") and waited >= 0.4, waited
    # other nodes, and the same node name in another convention, have leases of their own
    assert len({L.scope_dir(1900, "m2"), L.scope_dir(1900, "m3"), L.scope_dir(1901, "m2")}) == 3
    assert os.path.dirname(L.scope_dir(1900, "../x y")) == str(tmp_path)
    # one that others may write in (another user made it first, in a shared /tmp) is not used
    other = L.use_scope(1902, "m2")
    os.makedirs(other)
    os.chmod(other, 0o777)
    assert L.lease_dir() == os.path.join(P.ipc_dir("feedfacefeedface0004"), "devices")


def test_a_stopping_system_sweeps_only_the_leases_nobody_holds(monkeypatch, tmp_path, holder):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    directory = L.use_scope(1900, "m2")
    os.makedirs(directory, exist_ok=True)
    L.take(directory, ("0", "1"), "talker/0", [holder.pid])
    L.take(directory, ("2",), "talker/2")  # (this process: still running)
    holder.kill()
    holder.wait()
    assert L.sweep(directory) == 2
    assert sorted(os.listdir(directory)) == ["2"]
    L.release(directory, ("2",))
    assert L.sweep(directory) == 0 and not os.path.exists(directory)


def test_lease_directories_left_by_systems_killed_outright_are_swept_of_what_nobody_holds(monkeypatch, tmp_path,
                                                                                          holder):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead, live = L.scope_dir(1900, "m1"), L.scope_dir(1901, "m1")
    for directory in (dead, live):
        os.makedirs(directory)
        L.take(directory, ("0",), "talker/0", [holder.pid])
    L.take(live, ("1",), "talker/1")  # (this process: running)
    holder.kill()
    holder.wait()
    assert L.sweep_stale() == 2
    assert not os.path.exists(dead) and os.listdir(live) == ["1"]
    L.take(dead, ("3",), "code2wav/0")  # (a replica taking a lease there again makes the directory again)
    assert os.listdir(dead) == ["3"]
