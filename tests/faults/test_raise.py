"""A Talker replica's backend raises on its next task, under load."""

from __future__ import annotations

import pytest

from omni_actors.system.faultlab import assert_no_request_lost, replicas, run_scenario, wait_no_segments

from .conftest import CLIENTS, REQUEST_TIMEOUT_S

pytestmark = [pytest.mark.system, pytest.mark.serial]


def test_task_failed_by_the_backend_is_retried_on_another_replica(leader):
    """talker/0's backend raises on its next task (once).

    The request actor retries that stage on talker/1 (``stage_retry``): the
    user gets a 200. One failure is not a replica fault: talker/0 stays ready
    and in the routing table (isolation is not expected here; see
    test_circuit_breaker.py for repeated failures).
    """
    r = run_scenario(leader, "raise", target="talker/0", count=1, clients=CLIENTS,
                     request_timeout_s=REQUEST_TIMEOUT_S, expect_disturbance=False)

    assert_no_request_lost(r)
    assert [ev["event"] for ev in r.events if ev["event"] == "stage_retry"] == ["stage_retry"], r.events
    assert r.retried == 1
    assert r.isolated_at is None and r.target_states == ["ready"]
    old, new = replicas(r.before)["talker/0"], replicas(r.after)["talker/0"]
    assert new["pid"] == old["pid"] and new["failed"] == old["failed"] + 1
    assert new["completed"] > old["completed"]  # and it kept serving
    assert wait_no_segments(leader) == []
