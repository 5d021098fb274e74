"""Device leases (``omni_actors.actors.device_leases``): a replica's engine does not load on
a device that a live process of an older replica still holds (trial AJ: after the coordinator
was recreated, a new talker/1 started on device 2 while the old code2wav/0 still ran there)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time

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
    waited, still = L.wait_and_take(("1", "2"), "talker/1", limit_s=20, on_wait=seen.append)
    assert still == "" and 0.4 <= waited < 10, waited
    assert seen == [f"device 2 (held by code2wav/0, pid {holder.pid})", ""]
    # the devices are this process's now: the next replica would wait for it
    assert L.holders(system, ("1", "2"), me=-1) == {d: ("talker/1", [os.getpid()]) for d in ("1", "2")}
    L.release(system, ("1", "2"))
    assert L.holders(system, ("1", "2"), me=-1) == {}


def test_the_wait_gives_up_after_its_limit_and_says_who_held_the_device(system, holder):
    L.take(system, ("0",), "thinker/0", [holder.pid])
    t0 = time.monotonic()
    waited, still = L.wait_and_take(("0",), "thinker/0", limit_s=0.3)
    assert 0.3 <= waited and time.monotonic() - t0 < 5
    assert still == f"device 0 (held by thinker/0, pid {holder.pid})"
    # taken all the same: the lease is this process's now (the old holder is no longer in it)
    assert L.holders(system, ("0",), me=-1) == {"0": ("thinker/0", [os.getpid()])}


def test_a_dead_holder_or_a_reused_pid_is_no_holder(system, holder):
    L.take(system, ("3",), "talker/0", [holder.pid])
    lease = L.read_lease(system, "3")
    lease["pids"][0][1] += 1  # the same pid, started at another time: another process
    assert L.live_holders(lease) == []
    holder.kill()
    holder.wait()
    assert L.holders(system, ("3",)) == {}
    waited, still = L.wait_and_take(("3",), "talker/0", limit_s=10)
    assert (still, waited < L.POLL_S) == ("", True)


def test_release_keeps_a_lease_another_replica_took_since(system, holder):
    L.take(system, ("4",), "talker/1")
    L.take(system, ("4",), "talker/2", [holder.pid])
    L.release(system, ("4",))
    assert L.holders(system, ("4",)) == {"4": ("talker/2", [holder.pid])}


def test_outside_a_system_or_without_devices_nothing_is_waited_for(monkeypatch):
    monkeypatch.delenv(P.ENV_SYSTEM_ID, raising=False)
    assert L.lease_dir() is None
    assert L.wait_and_take(("0",), "thinker/0", limit_s=10) == (0.0, "")
    monkeypatch.setenv(P.ENV_SYSTEM_ID, "feedfacefeedface0002")
    assert L.wait_and_take((), "thinker/0", limit_s=10) == (0.0, "")
