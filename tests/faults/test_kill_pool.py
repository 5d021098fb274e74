"""Kill the Talker stage pool actor under load."""

from __future__ import annotations

import pytest

from omni_actors.system.faultlab import (assert_no_request_lost, replicas, run_scenario, wait_gone,
                                         wait_no_segments)

from .conftest import CLIENTS, HEARTBEAT_S, REQUEST_TIMEOUT_S

pytestmark = pytest.mark.system


def _stage(table: dict, name: str) -> dict:
    return next(st for st in table["stages"] if st["stage"] == name)


def test_killed_pool_is_recreated_and_its_orphaned_engines_exit(leader):
    """The talker pool process is SIGKILLed: its engines lose their supervisor.

    The coordinator recreates the pool (``pool_exited`` then ``pool_restarted``),
    which starts two new talker replicas; requests waiting on the old pool are
    re-sent to the new one, and tasks the old engines were running finish.
    The old engines, no longer acked, exit by themselves within a few
    heartbeat intervals. Users see only 200s.
    """
    r = run_scenario(leader, "kill-pool", stage="talker", clients=CLIENTS, request_timeout_s=REQUEST_TIMEOUT_S)

    assert_no_request_lost(r)
    assert r.isolation_ms is not None and r.isolation_ms < 1000, r.events
    assert "pool_restarted" in [ev["event"] for ev in r.events]
    assert r.disturbed and r.restored_at is not None, r.after
    old, new = _stage(r.before, "talker"), _stage(r.after, "talker")
    assert new["pid"] != old["pid"] and new["restarts"] >= old["restarts"] + 1
    assert new["ready_replicas"] == 2 and all(rep["state"] == "ready" for rep in replicas(r.after).values())
    old_engines = [rep["pid"] for rep in old["replicas"]]
    assert not set(old_engines) & {rep["pid"] for rep in new["replicas"]}
    # engines whose pool is gone exit by themselves (3 missed acks), not only at shutdown
    assert wait_gone(leader, [old["pid"], *old_engines], timeout_s=6 * HEARTBEAT_S) == []
    assert wait_no_segments(leader) == []
