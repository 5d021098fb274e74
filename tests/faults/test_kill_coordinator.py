"""Kill the coordinator under load."""

from __future__ import annotations

import pytest

from omni_actors.system.faultlab import (assert_no_request_lost, replicas, run_scenario, wait_gone,
                                         wait_no_segments)

from .conftest import CLIENTS, HEARTBEAT_S, REQUEST_TIMEOUT_S

pytestmark = [pytest.mark.system, pytest.mark.serial]


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
    r = run_scenario(leader, "kill-coordinator", clients=CLIENTS, request_timeout_s=REQUEST_TIMEOUT_S)

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
    old = {r.before["coordinator_pid"]} | {st["pid"] for st in r.before["stages"]} \
        | {rep["pid"] for rep in replicas(r.before).values()}
    # old pools orphan after 5 missed acks, then drain their engines and exit
    assert wait_gone(leader, old, timeout_s=12 * HEARTBEAT_S) == []
    assert wait_no_segments(leader) == []
