"""A Talker replica stalls (keeps heartbeating, makes no progress) under load."""

from __future__ import annotations

import pytest

from omni_actors.system.faultlab import (assert_no_request_lost, replicas, run_scenario, wait_gone,
                                         wait_no_segments)

from .conftest import CLIENTS, HEARTBEAT_S, REQUEST_TIMEOUT_S

pytestmark = [pytest.mark.system, pytest.mark.serial]


def test_replica_stalling_while_heartbeating_is_isolated_and_restarted(leader):
    """talker/0's backend stops producing but its actor still heartbeats.

    The pool sees work in flight and no progress for ``stall_timeout_s`` (2 s),
    isolates it, re-dispatches its tasks to talker/1, kills it and restarts
    it. Users see only 200s, some slower by the stall.
    """
    r = run_scenario(leader, "stall", target="talker/0", clients=CLIENTS, request_timeout_s=REQUEST_TIMEOUT_S)

    assert_no_request_lost(r)
    assert r.isolation_ms is not None and r.isolation_ms < 3 * HEARTBEAT_S * 1000 + 1000, r.events
    isolated = next(ev for ev in r.events if ev["event"] == "replica_isolated")
    assert isolated["replica"] == "talker/0" and "stalled" in isolated["reason"], isolated
    assert r.retried >= 1
    assert r.disturbed and set(r.target_states) - {"ready"}, r.target_states  # it left the routing table
    assert r.restored_at is not None, r.after
    old, new = replicas(r.before)["talker/0"], replicas(r.after)["talker/0"]
    assert new["state"] == "ready" and new["restarts"] >= old["restarts"] + 1 and new["pid"] != old["pid"]
    assert wait_gone(leader, [old["pid"]], timeout_s=2) == []
    assert all(rep["state"] == "ready" for rep in replicas(r.after).values())
    assert wait_no_segments(leader) == []
