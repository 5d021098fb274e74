"""A stage pool that stops answering for a while (swamped by a burst) is not taken for dead."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from omni_actors.system.faultlab import read_events, replicas, stages, wait_ready

from .conftest import HEARTBEAT_S, REQUEST_TIMEOUT_S

pytestmark = [pytest.mark.system, pytest.mark.serial]


def _ask(leader, max_tokens: int = 64) -> int | str:
    body = {"model": "qwen3-omni-cpu-demo", "messages": [{"role": "user", "content": "hello"}],
            "modalities": ["text", "audio"], "max_tokens": max_tokens}
    req = urllib.request.Request(leader.base_url + "/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            answer = json.loads(r.read())
        message = answer["choices"][0]["message"]
        return r.status if message["content"] and message["audio"]["data"] else "empty answer"
    except urllib.error.HTTPError as err:
        return f"{err.code}: {err.read()[:300]!r}"


def _stage(table: dict, name: str) -> dict:
    return next(st for st in table["stages"] if st["stage"] == name)


def _clients(leader, answers: list, done: threading.Event, max_tokens: int = 64) -> list[threading.Thread]:
    """4 clients asking back to back, each answer appended to ``answers``, until ``done``."""
    def client() -> None:
        while not done.is_set():
            answers.append(_ask(leader, max_tokens))

    clients = [threading.Thread(target=client) for _ in range(4)]
    for c in clients:
        c.start()
    return clients


def test_a_pool_frozen_for_four_heartbeat_intervals_keeps_its_replicas(leader):
    """The talker pool is frozen with SIGSTOP for 4 heartbeat intervals, with 4 clients sending
    requests back to back, then resumed:
    to its engines that looks like a pool swamped by a burst of requests (no acks for
    longer than the 3 intervals an engine waits), and to the pool, once it runs again,
    like replicas that missed 4 heartbeats and made no progress on their tasks for as long
    (their heartbeats are still queued, unread).

    Both used to act on it: every engine drained itself and exited ("pool_lost_draining"),
    and each exit counted against the replica's restart budget (bursts in a row left the
    stage FAILED). Now an engine forked by its pool watches the pool's pid, and the pool
    does not count the time it was not running as its replicas' silence or stall: same
    processes, no restart, every request is served.
    """
    before = wait_ready(leader)
    pool = _stage(before, "talker")
    since = time.time()
    # Requests in flight while it is frozen: its replicas have tasks (the stall check applies)
    # and those wait for it (their results and new tasks go through it).
    answers: list = []
    resumed = threading.Event()
    clients = _clients(leader, answers, resumed)
    time.sleep(1.0)
    os.kill(pool["pid"], signal.SIGSTOP)
    try:
        time.sleep(4 * HEARTBEAT_S)
    finally:
        os.kill(pool["pid"], signal.SIGCONT)
        resumed.set()
    for c in clients:
        c.join(REQUEST_TIMEOUT_S)
    time.sleep(3 * HEARTBEAT_S)  # long enough for a drain, an exit and a restart to show

    after = stages(leader)
    events = [ev for ev in read_events(leader.log_path, since)
              if ev["event"] in ("pool_lost_draining", "replica_isolated", "replica_exited", "pool_exited")]
    assert events == [], events
    assert _stage(after, "talker")["pid"] == pool["pid"]
    old, new = replicas(before), replicas(after)
    for rid in ("talker/0", "talker/1"):
        assert (new[rid]["state"], new[rid]["pid"], new[rid]["restarts"]) == \
            ("ready", old[rid]["pid"], old[rid]["restarts"]), (rid, new[rid])
    assert answers and set(answers) == {200}, answers  # those it held up too
    assert _ask(leader) == 200


def test_a_pool_frozen_for_good_is_shown_silent_then_killed_and_recreated(leader):
    """The talker pool is frozen with SIGSTOP and never resumed, under load. A trial saw every
    request of the stage hang for as long as the pool was stopped (20 s), while `status`,
    `/v1/stages` and `/metrics` went on showing its last report: ready. Now past 3 silent
    intervals the status notes it and is not ready, and past 10 the coordinator kills the pool
    and recreates it, as a pool that crashed: the requests it held are sent again, and
    every one is answered."""
    before = wait_ready(leader)
    pool = _stage(before, "talker")
    since = time.time()
    answers: list = []
    done = threading.Event()
    clients = _clients(leader, answers, done, max_tokens=16)
    time.sleep(1.0)
    os.kill(pool["pid"], signal.SIGSTOP)
    try:
        noted = None
        deadline = time.monotonic() + 9 * HEARTBEAT_S
        while time.monotonic() < deadline and noted is None:
            table = stages(leader)
            noted = next((n for n in table["notes"] if "the pool of stage talker has not reported" in n), None)
            time.sleep(0.2)
        assert noted is not None and table["ready"] is False, table["notes"]
        deadline = time.monotonic() + 20 * HEARTBEAT_S
        while time.monotonic() < deadline and _stage(stages(leader), "talker")["pid"] in (pool["pid"], None):
            time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pool["pid"], signal.SIGCONT)  # (in case it was not killed: the module's later tests)
        done.set()
    for c in clients:
        c.join(REQUEST_TIMEOUT_S * 2)
    after = wait_ready(leader)
    new = _stage(after, "talker")
    assert new["pid"] != pool["pid"] and new["restarts"] == pool["restarts"] + 1, new
    killed = [ev for ev in read_events(leader.log_path, since) if ev["event"] == "pool_hung_killing"]
    assert [(ev["stage"], ev["pool_pid"]) for ev in killed] == [("talker", pool["pid"])], killed
    assert 10 * HEARTBEAT_S <= killed[0]["silent_s"] < 14 * HEARTBEAT_S, killed
    assert all("it was down: its stage pool hung (no report for" in rep["reason"] for rep in new["replicas"]), \
        new["replicas"]
    assert after["ready"] and after["notes"] == [], after["notes"]
    assert answers and set(answers) == {200}, answers  # those it held were sent again to the new pool
