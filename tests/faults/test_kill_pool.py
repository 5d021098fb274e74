"""Kill the Talker stage pool actor under load."""

from __future__ import annotations

import pytest

from omni_actors.system.faultlab import (assert_no_request_lost, inject_cli, replicas, run_scenario, wait_gone,
                                         wait_no_segments)

from .conftest import CLIENTS, HEARTBEAT_S, REQUEST_TIMEOUT_S

pytestmark = [pytest.mark.system, pytest.mark.serial]


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
    r = run_scenario(leader, "kill-pool", stage="talker", clients=CLIENTS, request_timeout_s=REQUEST_TIMEOUT_S,
                     warmup_s=3.0)  # (long enough for the talker to have completed tasks)

    assert_no_request_lost(r)
    assert r.isolation_ms is not None and r.isolation_ms < 1000, r.events
    assert "pool_restarted" in [ev["event"] for ev in r.events]
    assert r.disturbed and r.restored_at is not None, r.after
    old, new = _stage(r.before, "talker"), _stage(r.after, "talker")
    assert new["pid"] != old["pid"] and new["restarts"] >= old["restarts"] + 1
    assert new["ready_replicas"] == 2 and all(rep["state"] == "ready" for rep in replicas(r.after).values())
    # each replica's new process counts as a restart (not against its restart budget)
    restarts_before = {rep["replica"]: rep["restarts"] for rep in old["replicas"]}
    assert {rep["replica"]: rep["restarts"] for rep in new["replicas"]} == {
        rid: n + 1 for rid, n in restarts_before.items()}, new["replicas"]
    # the new pool's replicas go on counting from their predecessors' counts (they went back to 0)
    done_before = {rep["replica"]: rep["completed"] for rep in old["replicas"]}
    assert sum(done_before.values()) > 0, old
    assert all(rep["completed"] >= done_before.get(rep["replica"], 0) for rep in new["replicas"]), (old, new)
    old_engines = [rep["pid"] for rep in old["replicas"]]
    assert not set(old_engines) & {rep["pid"] for rep in new["replicas"]}
    # `status` says why each replica has a new process (a trial saw an empty REASON)
    assert all("it was down: its stage pool was lost and recreated" in rep["reason"]
               for rep in new["replicas"]), new["replicas"]
    # engines whose pool is gone exit by themselves (3 missed acks), not only at shutdown
    assert wait_gone(leader, [old["pid"], *old_engines], timeout_s=6 * HEARTBEAT_S) == []
    assert wait_no_segments(leader) == []
    # (and quietly: Thespian's exit-time send to the dead pool printed a traceback per engine)
    assert "Traceback" not in leader.log_path.read_text()


def test_engines_of_a_killed_pool_blocked_mid_stream_exit(leader):
    """The Thinker pool is SIGKILLed while its replica streams a long answer to the
    Talker: the Thinker's task waits for chunk credits that nobody will send any more
    (its request re-sent the stage to the new pool). The orphaned engine still exits
    within a few heartbeat intervals (it used to wait forever), and the request ends
    with a 200 or a clear error, not a hang."""
    import json
    import os
    import signal
    import threading
    import time
    import urllib.error
    import urllib.request

    def table() -> dict:
        with urllib.request.urlopen(leader.base_url + "/stages", timeout=10) as r:
            return json.loads(r.read())

    outcome: dict = {}

    def ask() -> None:
        body = json.dumps({"model": "qwen3-omni-cpu-demo", "max_tokens": 1500, "stream": True,
                           "modalities": ["text", "audio"],
                           "messages": [{"role": "user", "content": "a long story"}]}).encode()
        req = urllib.request.Request(leader.base_url + "/chat/completions", body,
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S * 6) as r:
                outcome["status"], outcome["body"] = r.status, r.read().decode()
        except urllib.error.HTTPError as exc:
            outcome["status"], outcome["body"] = exc.code, exc.read().decode()
        except Exception as exc:  # noqa: BLE001 - a hang or a reset shows in the assertion
            outcome["error"] = repr(exc)

    client = threading.Thread(target=ask)
    client.start()
    deadline = time.monotonic() + 10
    while True:  # until the Thinker's replica has the task
        thinker = _stage(table(), "thinker")
        busy = [rep for rep in thinker["replicas"] if rep["in_flight"]]
        if busy:
            break
        assert time.monotonic() < deadline, thinker
        time.sleep(0.05)
    time.sleep(1.0)  # well into the stream: the Talker consumes, the Thinker waits for credits
    old_engines = [rep["pid"] for rep in thinker["replicas"]]
    os.kill(thinker["pid"], signal.SIGKILL)
    left = wait_gone(leader, [thinker["pid"], *old_engines], timeout_s=12 * HEARTBEAT_S)
    client.join(REQUEST_TIMEOUT_S * 6)
    assert not client.is_alive(), "the request hung"
    assert left == [], f"engines of the killed pool still running: {left}"
    assert "Traceback" not in leader.log_path.read_text()
    assert "error" not in outcome, outcome
    assert outcome["status"] == 200 or '"error"' in outcome["body"], outcome
    if '"error"' in outcome["body"]:  # it names the stage and why (it said "the stage's pool was replaced")
        assert "the pool of stage thinker was replaced (it, or the coordinator, died" in outcome["body"], outcome


def test_the_backlog_of_a_recreated_pool_is_shared_by_its_replicas(leader):
    """The Talker pool is SIGKILLed with requests in flight: their RequestActors re-send
    the Talker tasks to the new pool, which queues them until a replica is ready. Both
    new replicas get a share (the first one ready used to take them all)."""
    import json
    import os
    import signal
    import threading
    import time
    import urllib.request

    def table() -> dict:
        with urllib.request.urlopen(leader.base_url + "/stages", timeout=10) as r:
            return json.loads(r.read())

    codes: list[int] = []

    def ask() -> None:
        body = json.dumps({"model": "qwen3-omni-cpu-demo", "max_tokens": 200, "modalities": ["text", "audio"],
                           "messages": [{"role": "user", "content": "tell me more"}]}).encode()
        req = urllib.request.Request(leader.base_url + "/chat/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S * 3) as r:
            r.read()
            codes.append(r.status)

    old = _stage(table(), "talker")
    for rep in old["replicas"]:  # long Talker tasks: still running when the pool dies
        out = inject_cli(leader.admin_port, "slow", "--replica", rep["replica"], "--factor", "50")
        assert out.returncode == 0, out.stderr
    clients = [threading.Thread(target=ask) for _ in range(8)]
    for c in clients:
        c.start()
    deadline = time.monotonic() + 10
    while sum(rep["in_flight"] for rep in _stage(table(), "talker")["replicas"]) < 4:
        assert time.monotonic() < deadline, "the Talker never got the requests"
        time.sleep(0.02)
    os.kill(old["pid"], signal.SIGKILL)
    for c in clients:
        c.join(REQUEST_TIMEOUT_S * 3)
    assert codes == [200] * 8, codes
    deadline = time.monotonic() + 5 * HEARTBEAT_S  # (counters come with heartbeats)
    while True:
        new = _stage(table(), "talker")
        done = {rep["replica"]: rep["completed"] for rep in new["replicas"]}
        if sum(done.values()) >= 8 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert new["pid"] != old["pid"]
    assert len(done) == 2 and all(n > 0 for n in done.values()), done
