"""SIGKILL a Talker replica under load: nothing is lost, it is replaced at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_actors.system.faultlab import (assert_no_request_lost, read_events, replicas, run_scenario, stages,
                                         wait_gone, wait_no_segments)
from omni_actors.system.processes import ipc_dir

from .conftest import CLIENTS, REQUEST_TIMEOUT_S

pytestmark = [pytest.mark.system, pytest.mark.serial]


def test_sigkilled_replica_is_isolated_at_once_its_tasks_rerun_and_it_is_restarted(leader):
    """talker/0 is SIGKILLed while 8 clients keep sending text+audio requests.

    The pool hears of the exit (ChildActorExited) at once, re-dispatches its
    in-flight tasks to talker/1 and restarts it after the backoff (0.5 s). Users
    see only 200s.
    """
    # (a killed vLLM engine left its IPC directory, sockets and all, until the system stopped: trial AM)
    sockets = Path(ipc_dir(leader.system_id)) / f"p{replicas(stages(leader))['talker/0']['pid']}"
    sockets.mkdir(parents=True)
    (sockets / "engine.sock").touch()
    r = run_scenario(leader, "sigkill", target="talker/0", clients=CLIENTS, request_timeout_s=REQUEST_TIMEOUT_S)

    assert_no_request_lost(r)
    assert r.isolation_ms is not None and r.isolation_ms < 1000, r.events
    # It left the routing table: isolated (above), and seen down or with a new pid (its restart,
    # 0.5 s after, can come between two polls of the status on a busy machine: seen as ['ready'] only)
    assert r.disturbed, r.target_states
    assert r.restored_at is not None, r.after
    old, new = replicas(r.before)["talker/0"], replicas(r.after)["talker/0"]
    assert new["state"] == "ready" and new["restarts"] >= old["restarts"] + 1 and new["pid"] != old["pid"]
    assert new["completed"] >= old["completed"]  # its counters go on across the restart
    # The tasks it lost count as its failed ones (a trial's alert on that counter missed every crash)
    lost = sum(e["tasks"] for e in r.events if e["event"] == "replica_tasks_lost" and e["replica"] == "talker/0")
    assert new["failed"] == old["failed"] + lost, (old, new, lost)
    # READY again, it says when it came back and why it was down (RESTARTS alone does not)
    # (and how its process ended: a trial's log said only "process exited", SIGKILL or not)
    assert new["reason"].startswith("restarted at ") and \
        "it was down: process exited (killed by SIGKILL)" in new["reason"], new
    assert all(rep["state"] == "ready" for rep in replicas(r.after).values())
    # The leader's log says the crash was injected, before it came (a trial read it as a real one)
    noted = [e for e in read_events(leader.log_path, r.injected_at - 10) if e["event"] == "fault_injected"]
    assert [(e["kind"], e["target"], e["target_pid"]) for e in noted][-1:] == [("sigkill", "talker/0", old["pid"])], \
        noted
    assert noted[-1]["t"] <= r.injected_at + 0.5
    assert wait_gone(leader, [old["pid"]], timeout_s=2) == []
    assert not sockets.exists()
    assert wait_no_segments(leader) == []
