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
    retries = [ev for ev in r.events if ev["event"] == "stage_retry"]
    assert len(retries) == 1, r.events
    assert retries[0]["stage"] == "talker", retries  # (trial CK: it had only the stage id to filter on)
    assert r.retried == 1
    assert r.isolated_at is None and r.target_states == ["ready"]
    old, new = replicas(r.before)["talker/0"], replicas(r.after)["talker/0"]
    assert new["pid"] == old["pid"] and new["failed"] == old["failed"] + 1
    assert new["completed"] > old["completed"]  # and it kept serving
    assert wait_no_segments(leader) == []


def test_every_failure_of_the_only_replica_of_a_stage_is_counted(leader):
    """Trials BV and BW: on the only Thinker, `inject raise --count 2` failed one request's
    task twice there (the retry went to the same replica), yet its FAILED count (and
    omni_replica_tasks_failed_total) grew by 1: the first failure's report came after the
    retry had reached the replica, and was dropped as a stale attempt's end."""
    import json
    import time
    import urllib.request

    from omni_actors.system.faultlab import inject_cli, stages

    before = replicas(stages(leader))["thinker/0"]["failed"]
    out = inject_cli(leader.admin_port, "raise", "--replica", "thinker/0", "--count", "2")
    assert out.returncode == 0, out.stderr
    body = json.dumps({"model": "qwen3-omni-cpu-demo", "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 4}).encode()
    with urllib.request.urlopen(urllib.request.Request(leader.base_url + "/chat/completions", body,
                                                       {"Content-Type": "application/json"}), timeout=60) as r:
        assert r.status == 200  # (the third attempt, on the same replica, succeeds)
    deadline = time.monotonic() + 10
    while (now := replicas(stages(leader))["thinker/0"]["failed"]) != before + 2:
        assert time.monotonic() < deadline, (before, now)
        time.sleep(0.2)
