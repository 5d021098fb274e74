"""A stage pool that stops answering for a while (swamped by a burst) is not taken for dead."""

from __future__ import annotations

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

    def client() -> None:
        while not resumed.is_set():
            answers.append(_ask(leader))

    clients = [threading.Thread(target=client) for _ in range(4)]
    for c in clients:
        c.start()
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
