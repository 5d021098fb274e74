"""How many RequestActors an API server keeps, and what a client sees when all are busy.

At most ``request_actors`` RequestActors (each a process); a request above that
waits in a bounded FIFO queue for one, within its deadline, and one more than
the queue holds gets HTTP 429 with ``Retry-After`` and OpenAI error JSON. A
RequestActor above the minimum that idles ``idle_exit_s`` exits.

The first tests drive :class:`RequestActorPool` and ``ActorBridge.submit``
without an actor system; the last one serves a real leader (multiprocTCPBase,
synthetic engine) through an API server whose bridge has small bounds, and
counts the leader system's processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from omni_actors.http.admission import QueueFull, RequestActorPool
from omni_actors.http.bridge import ActorBridge, RequestRejected, _Held
from omni_actors.http.types import PipelineRequest, RequestFailed, within
from omni_actors.messages import ErrorKind, OutputDelta, OutputDeltas, RequestFinished, Routes, RunRequest

ROOT = Path(__file__).resolve().parent.parent
MODEL = "admission-test"
# One text stage, slow enough per token that a long request holds its RequestActor
# until the test lets it go.
CONFIG = f"""
stage_args:
  - stage_id: 0
    engine_args: {{model_stage: thinker}}
    final_output: true
    final_output_type: text
    default_sampling_params: {{max_tokens: 4, seed: 1}}
deployment:
  served_model_name: {MODEL}
  heartbeat_interval_s: 0.5
  request_timeout_s: 60
  max_tokens_limit: 4096
  request_actors: 1
  stages:
    thinker: {{replicas: 1, synthetic: {{startup_s: 0, decode_ms_per_token: 20, max_concurrency: 16}}}}
"""


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


# -- the pool ----------------------------------------------------------------

def test_the_pool_makes_up_to_its_maximum_then_queues_first_come_first_served_then_refuses():
    async def main():
        pool = RequestActorPool(maximum=2, minimum=0, queue_limit=2, idle_exit_s=30)
        assert await pool.acquire(1) is None and await pool.acquire(1) is None  # "make one", twice
        assert pool.total == 2
        first = asyncio.ensure_future(pool.acquire(5))
        second = asyncio.ensure_future(pool.acquire(5))
        await asyncio.sleep(0)
        assert pool.queued == 2
        with pytest.raises(QueueFull):
            await pool.acquire(5)
        assert pool.rejected == 1
        pool.release("a")
        pool.release("b")
        assert await first == "a" and await second == "b"  # in order
        assert pool.total == 2 and pool.queued == 0 and pool.idle == 0
        pool.release("a")
        assert await pool.acquire(1) == "a"  # a free one is reused, none made
        assert pool.total == 2

    asyncio.run(main())


def test_a_fresh_acquire_makes_a_new_request_actor_while_one_more_may_be_made():
    """Trial CC: the rerun of a request that its RequestActor never took (stopped) went to
    another idle RequestActor, stopped too, and failed: a rerun asks for a new one."""
    async def main():
        pool = RequestActorPool(maximum=2, minimum=0, queue_limit=2, idle_exit_s=30)
        assert await pool.acquire(1) is None
        pool.release("a")
        assert await pool.acquire(1, fresh=True) is None and pool.total == 2 and pool.idle == 1  # a new one
        assert await pool.acquire(1, fresh=True) == "a"  # (at the maximum: the idle one after all)

    asyncio.run(main())


def test_a_waiter_that_leaves_or_times_out_leaves_the_queue_and_passes_on_what_it_was_given():
    async def main():
        pool = RequestActorPool(maximum=1, minimum=0, queue_limit=2, idle_exit_s=30)
        assert await pool.acquire(1) is None
        with pytest.raises(asyncio.TimeoutError):
            await pool.acquire(0.05)
        assert pool.queued == 0
        leaving = asyncio.ensure_future(pool.acquire(5))
        staying = asyncio.ensure_future(pool.acquire(5))
        await asyncio.sleep(0)
        leaving.cancel()  # the client went away
        await asyncio.gather(leaving, return_exceptions=True)
        assert pool.queued == 1
        pool.release("a")
        assert await staying == "a"
        # Given an actor at the very moment it is cancelled: the actor goes to the next one.
        waiting = asyncio.ensure_future(pool.acquire(5))
        after = asyncio.ensure_future(pool.acquire(5))
        await asyncio.sleep(0)
        pool.release("b")  # resolves `waiting`...
        waiting.cancel()  # ...which is cancelled before it runs
        assert await after == "b"
        assert (await asyncio.gather(waiting, return_exceptions=True))[0].__class__ is asyncio.CancelledError
        assert pool.queued == 0 and pool.total == 1

    asyncio.run(main())


def test_a_lost_request_actor_makes_room_for_the_next_in_line():
    async def main():
        pool = RequestActorPool(maximum=1, minimum=0, queue_limit=1, idle_exit_s=30)
        assert await pool.acquire(1) is None
        waiting = asyncio.ensure_future(pool.acquire(5))
        await asyncio.sleep(0)
        pool.lost()
        assert await waiting is None  # it makes the new one
        assert pool.total == 1

    asyncio.run(main())


def test_idle_request_actors_above_the_minimum_are_reaped_oldest_first():
    clock = Clock()
    pool = RequestActorPool(maximum=4, minimum=1, queue_limit=0, idle_exit_s=30, clock=clock)
    pool.reserve(3)
    pool.release("a")
    clock.now += 10
    pool.release("b")
    clock.now += 10
    pool.release("c")
    assert pool.reap() == []
    clock.now += 15  # a: 35 s idle, b: 25 s
    assert pool.reap() == ["a"] and pool.total == 2
    clock.now += 100
    assert pool.reap() == ["b"] and pool.total == 1  # the minimum stays
    with pytest.raises(ValueError):
        RequestActorPool(maximum=1, minimum=2, queue_limit=0, idle_exit_s=1)


# -- the bridge's submit, without an actor system ------------------------------

def _bridge(**kw) -> ActorBridge:
    from omni_actors.config import parse_config
    import yaml

    bridge = ActorBridge(asys=None, coordinator=None, **kw)
    bridge._routes = Routes(parse_config(yaml.safe_load(CONFIG)), {0: "pool-0"})
    bridge._address, bridge._max_attempts, bridge.request_timeout_s = "bridge", 1, 60.0
    return bridge


def _bridge_with_idle(*actors: str, **kw) -> ActorBridge:
    """:func:`_bridge` on the running loop, with ``actors`` made and idle in its pool."""
    bridge = _bridge(**kw)
    bridge._loop = asyncio.get_running_loop()
    bridge._pool.reserve(len(actors))
    for actor in actors:
        bridge._pool.release(actor)
    return bridge


async def _first(bridge: ActorBridge, rid: str, timeout_s: float = 60.0):
    gen = bridge.submit(PipelineRequest(rid, "hi", frozenset({"text"}), timeout_s=timeout_s))
    try:
        return await gen.__anext__()
    finally:
        await gen.aclose()


class _SyncLoop:
    """Stands in for the bridge's event loop: runs what the receiver thread hands it at once."""

    def call_soon_threadsafe(self, fn, *args):
        fn(*args)


def _outbox_items(bridge: ActorBridge) -> list:
    items = []
    for box in bridge._outboxes:
        while not box.empty():
            items.append(box.get_nowait())
    return items


class _Waiting:
    """A request waiting in the queue (its future not done)."""

    @staticmethod
    def done() -> bool:
        return False


def test_a_429_asks_for_a_wait_drawn_from_how_fast_requests_are_served():
    """Every 429 said ``Retry-After: 1`` and OpenAI's clients wait exactly that: a refused
    burst came back all at once, a second later. The wait now runs from the time one queue
    place comes free to the time the queue ahead has been served, at the rate of the last
    10 s, drawn in between; 1 s (the least) when nothing was served in that window; 30 s at
    most."""
    from omni_actors.http.admission import RETRY_AFTER_MAX_S, RETRY_AFTER_MIN_S

    clock = Clock()
    pool = RequestActorPool(maximum=2, minimum=0, queue_limit=4, idle_exit_s=30, clock=clock)
    assert pool.retry_after_s(lambda: 0.5) == RETRY_AFTER_MIN_S  # nothing served yet
    for _ in range(5):  # 5 served in the last 10 s: 0.5 a second
        clock.now += 1
        pool.release("ra")
    assert pool.retry_after_s(lambda: 0.0) == 2.0  # one place comes free in 2 s
    pool._waiters.extend(_Waiting() for _ in range(4))
    assert pool.retry_after_s(lambda: 1.0) == 10.0  # the 4 queued and this one: (4 + 1) / 0.5
    assert 2.0 < pool.retry_after_s() < 10.0
    for _ in range(4):
        pool._waiters.popleft()
    clock.now += 100  # nothing served for 100 s: the least again
    assert pool.retry_after_s(lambda: 0.9) == RETRY_AFTER_MIN_S
    clock.now += 1
    pool.release("ra")  # one served in 10 s: one place in 10 s; the bound where the queue is long
    assert pool.retry_after_s(lambda: 0.0) == 10.0
    pool._waiters.extend(_Waiting() for _ in range(4))
    assert pool.retry_after_s(lambda: 1.0) == RETRY_AFTER_MAX_S


def test_submit_waits_for_a_request_actor_within_the_deadline_and_refuses_past_the_queue():
    async def main():
        bridge = _bridge(request_actors=1, queue_limit=1)
        bridge._loop = asyncio.get_running_loop()
        bridge._pool.reserve(1)  # the one RequestActor is busy

        # its deadline passes while it waits: 504, and it leaves the queue
        t0 = time.monotonic()
        ev = await _first(bridge, "late", timeout_s=0.2)
        assert isinstance(ev, RequestFailed) and ev.status == 504
        assert "while the request waited for a free RequestActor" in ev.message
        assert time.monotonic() - t0 < 5
        assert bridge._pool.queued == 0 and bridge.in_flight() == 0

        # one waits (the queue holds one); the next is refused at once
        waiting = asyncio.ensure_future(_first(bridge, "waiting"))
        await asyncio.sleep(0.01)
        assert bridge._pool.queued == 1 and bridge.in_flight() == 1
        ev = await _first(bridge, "refused")
        assert isinstance(ev, RequestRejected) and ev.status == 429
        assert ev.retry_after_s >= 1 and ev.code == "rate_limit_exceeded"
        assert bridge.request_actors()["rejected"] == 1

        # it starts when the RequestActor comes back, with what is left of its deadline
        await asyncio.sleep(0.05)
        bridge._pool.release("ra-1")
        await asyncio.sleep(0.01)
        runs = [item for item in _outbox_items(bridge) if item[0] == "run"]
        assert len(runs) == 1
        _, run, actor = runs[0]
        assert isinstance(run, RunRequest) and run.request_id == "waiting" and actor == "ra-1"
        assert 59 < run.timeout_s < 60
        waiting.cancel()
        # its RequestActor says the request ended: free again (idle, none queued)
        bridge._on_message(RequestFinished("waiting", request_actor="ra-1"))
        await asyncio.sleep(0.01)
        assert bridge.request_actors() == {"total": 1, "busy": 0, "idle": 1, "closing": 0, "queued": 0, "max": 1,
                                           "min": 1, "queue_limit": 1, "rejected": 1}

        # a queued request whose client goes away leaves the queue and starts nothing
        _outbox_items(bridge)
        assert await bridge._pool.acquire(1) == "ra-1"  # busy again
        gone = asyncio.ensure_future(_first(bridge, "gone"))
        await asyncio.sleep(0.01)
        assert bridge._pool.queued == 1
        gone.cancel()
        await asyncio.sleep(0.01)
        assert bridge._pool.queued == 0 and bridge.in_flight() == 0
        assert [item for item in _outbox_items(bridge) if item[0] in ("run", "cancel")] == []

    asyncio.run(main())


def test_a_busy_request_actor_that_stops_answering_is_written_off_and_its_request_fails_with_500():
    """A RequestActor killed mid-request says nothing more. A busy one tells its bridge it
    is alive every alive_every_s; one silent for REQUEST_ACTOR_SILENT_S is written off: its
    client gets a 500 then (it waited for the deadline, 120 s in the demo, before), its
    stages are cancelled and its place goes to a new RequestActor. One heard from stays."""
    from omni_actors.http.bridge import REQUEST_ACTOR_SILENT_S
    from omni_actors.messages import RequestActorAlive

    async def main():
        bridge = _bridge_with_idle("ra-dead", "ra-alive", request_actors=2, queue_limit=0)
        dead = asyncio.ensure_future(_first(bridge, "dead"))
        alive = asyncio.ensure_future(_first(bridge, "alive"))
        await asyncio.sleep(0.01)
        runs = [item[1] for item in _outbox_items(bridge) if item[0] == "run"]
        assert [run.alive_every_s for run in runs] == [5.0, 5.0]
        bridge._held["dead"].heard -= REQUEST_ACTOR_SILENT_S + 1  # silent since then
        bridge._held["alive"].heard -= REQUEST_ACTOR_SILENT_S + 1
        bridge._on_message(RequestActorAlive("alive"))  # (the receiver thread hands it to the loop)
        await asyncio.sleep(0.01)
        bridge._tick()
        ev = await within(dead, 5)
        assert isinstance(ev, RequestFailed) and ev.status == 500
        assert "its RequestActor was not heard from for 60 s" in ev.message
        # (a tell to a dead one blocks); its place is made up at once (one being made counts busy)
        assert sorted(_outbox_items(bridge)) == [("abandon", "dead", False), ("create",)]
        stats = bridge.request_actors()
        assert (stats["total"], stats["busy"]) == (2, 2)
        assert not alive.done()
        # it was only hung: back, it ends its request; now it is told to exit (it runs: the tell cannot block)
        bridge._on_message(RequestFinished("dead", ErrorKind.TIMEOUT, request_actor="ra-dead"))
        await asyncio.sleep(0.01)
        assert ("exit", "ra-dead") in _outbox_items(bridge)
        assert bridge.request_actors()["total"] == 2  # (the one alive, and the one made in the dead one's place)
        alive.cancel()
        bridge._stop.set()

    asyncio.run(main())


def test_a_request_actor_that_exits_fails_its_request_or_leaves_the_idle_pool_and_is_replaced():
    """The supervisor of our RequestActors says one exited (RequestActorExited): a busy
    one's request fails with a 500 at once; an idle one leaves the pool, so no request
    is handed to it, and one is made in its place while fewer than the minimum are left."""
    from omni_actors.messages import RequestActorExited

    async def main():
        bridge = _bridge_with_idle("ra-busy", "ra-idle", request_actors=3, min_request_actors=2, queue_limit=0)
        busy = asyncio.ensure_future(_first(bridge, "r1"))  # takes the last freed: ra-idle
        await asyncio.sleep(0.01)
        assert {rid: held.actor for rid, held in bridge._held.items()} == {"r1": "ra-idle"}
        _outbox_items(bridge)
        bridge._on_message(RequestActorExited("ra-idle"))
        ev = await within(busy, 5)
        assert isinstance(ev, RequestFailed) and ev.status == 500 and "its RequestActor exited" in ev.message
        # its place is made up at once (below the minimum of 2), not at the next request
        assert sorted(_outbox_items(bridge)) == [("abandon", "r1", False), ("create",)]
        assert (bridge._pool.total, bridge._pool.idle_actors()) == (2, ["ra-busy"])
        bridge._on_message(RequestActorExited("ra-busy"))  # idle: out of the pool, one made instead
        await asyncio.sleep(0.01)
        assert bridge._pool.idle_actors() == [] and bridge._pool.total == 2
        assert _outbox_items(bridge) == [("create",)]
        bridge._on_message(RequestActorExited("ra-unknown"))  # (one told to exit idle, say): nothing
        await asyncio.sleep(0.01)
        assert bridge._pool.total == 2 and _outbox_items(bridge) == []

    asyncio.run(main())


def test_a_request_that_could_not_be_handed_to_a_request_actor_may_run_again():
    """A code review: a request whose RequestActor could not be made or told failed as one
    that had run (no rerun, ``x-should-retry: false``); nothing of it ran."""
    async def main():
        bridge = _bridge_with_idle("ra-0", request_actors=1, queue_limit=0)
        first = asyncio.ensure_future(_first(bridge, "r1"))
        await asyncio.sleep(0.01)
        bridge._not_started("r1", "connection refused")
        ev = await within(first, 5)
        assert isinstance(ev, RequestFailed) and ev.status == 500 and ev.not_started and ev.lost_by_server
        assert "could not start the request on a RequestActor: connection refused" in ev.message
        bridge._stop.set()

    asyncio.run(main())


def test_a_request_actor_whose_stages_are_still_cancelling_stays_busy_until_it_says_it_is_free():
    """RequestFinished(free=False): the client has its answer, but the RequestActor is
    not given the next request until its RequestActorFree (its stages confirmed their
    cancels), so abandoned work cannot pile up beyond request_actors."""
    from omni_actors.messages import RequestActorFree

    async def main():
        bridge = _bridge(request_actors=1, queue_limit=1)
        bridge._loop = asyncio.get_running_loop()
        bridge._pool.reserve(1)
        bridge._held["gone"] = _Held(time.monotonic() + 60, time.monotonic(), "ra-1")
        bridge._on_message(RequestFinished("gone", ErrorKind.CANCELLED, request_actor="ra-1", free=False))
        await asyncio.sleep(0.01)
        stats = bridge.request_actors()
        assert (stats["busy"], stats["idle"], stats["closing"]) == (1, 0, 1)
        waiting = asyncio.ensure_future(_first(bridge, "next"))
        await asyncio.sleep(0.01)
        assert bridge._pool.queued == 1 and not [i for i in _outbox_items(bridge) if i[0] == "run"]
        bridge._on_message(RequestActorFree("gone", "ra-1"))
        await asyncio.sleep(0.01)
        runs = [item for item in _outbox_items(bridge) if item[0] == "run"]
        assert [(run.request_id, actor) for _, run, actor in runs] == [("next", "ra-1")]
        assert bridge.request_actors()["closing"] == 0
        waiting.cancel()

    asyncio.run(main())


def test_outputs_held_for_a_client_that_left_are_released_when_the_next_one_comes():
    """An output that came before its turn waits in the request's inbox; if the client
    leaves before the missing one arrives, both are released then (the waiting one
    used to stay in the inbox, its segment in use for ever)."""
    from omni_actors.connectors import ConnectorRef
    from omni_actors.messages import OutputReady

    bridge = _bridge()
    bridge._loop = _SyncLoop()
    released = []
    bridge._connector.release = released.append
    bridge._streams["r"] = object()
    refs = [ConnectorRef(kind="shm", size=8, layout=(), location=f"oa-1-{i}") for i in range(2)]
    bridge._on_message(OutputReady("r", 2, "audio", refs[1], seq=1))  # seq 0 is still on its way
    bridge._on_message(RequestFinished("r", request_actor="ra-1", sent=2))
    assert released == [] and bridge._inbox["r"].finished is not None
    del bridge._streams["r"]  # the client leaves
    bridge._on_message(OutputReady("r", 2, "audio", refs[0], seq=0))
    assert sorted(r.location for r in released) == ["oa-1-0", "oa-1-1"] and "r" not in bridge._inbox

    # A final text waits for the text deltas before it; the client leaves; a delta comes.
    released.clear()
    bridge._streams["t"] = asyncio.Queue()
    bridge._on_message(OutputReady("t", 0, "text", refs[0], seq=0, after_text=(0, 2)))
    bridge._on_message(OutputDeltas((OutputDelta("t", "one", 0, stage_id=0),)))
    assert released == [] and bridge._inbox["t"].early  # still one delta short
    del bridge._streams["t"]
    bridge._on_message(OutputDeltas((OutputDelta("t", "two", 1, stage_id=0),)))
    assert [r.location for r in released] == ["oa-1-0"] and "t" not in bridge._inbox


def test_a_text_stage_retried_after_its_text_went_out_is_named_by_its_stage_name():
    bridge = _bridge()
    bridge._loop = _SyncLoop()
    events = []

    class Stream:
        def put_nowait(self, ev):
            events.append(ev)

    bridge._streams["r"] = Stream()
    bridge._on_message(OutputDeltas((OutputDelta("r", "hello", 0, stage_id=0, attempt=0),)))
    bridge._on_message(OutputDeltas((OutputDelta("r", "hello", 0, stage_id=0, attempt=1),)))
    assert isinstance(events[-1], RequestFailed) and (events[-1].status, events[-1].code) == (503, "service_unavailable")
    assert events[-1].message.startswith("stage thinker was run again (its replica or pool went down) after part "
                                         "of its text had reached the client")


# -- over HTTP, on a real actor system ------------------------------------------

@pytest.fixture(scope="module")
def leader(tmp_path_factory):
    from omni_actors.system.local import LocalLeader

    path = tmp_path_factory.mktemp("admission") / "admission.yaml"
    path.write_text(CONFIG)
    leader = LocalLeader(path).start()
    _wait_request_actors_made(leader.base_url)
    yield leader
    assert leader.stop() == 0
    assert leader.left_after_exit == []


class ApiServer:
    """``api --admin-port`` as the CLI runs it (this file as a script, below), with
    the bridge's bounds set: the CLI sets only ``--request-actors``."""

    def __init__(self, leader, tmp_path: Path, **bridge_kw):
        from omni_actors.system.local import reserve_port

        held = reserve_port()  # (until the server listens: another system's actor could take it)
        self.port = held.getsockname()[1]
        self.log = tmp_path / "api.log"
        with open(self.log, "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, str(leader.admin_port), str(self.port), json.dumps(bridge_kw)],
                stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT,
                env={**os.environ, "OMNI_ACTORS_STATE_DIR": str(leader.log_path.parent),
                     "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
        try:
            line = self.proc.stdout.readline()
        finally:
            held.close()
        assert f"at http://127.0.0.1:{self.port}/v1" in line, (line, self.log.read_text()[-2000:])
        self.url = f"http://127.0.0.1:{self.port}/v1"
        _wait_request_actors_made(self.url, bridge_kw.get("min_request_actors"))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.communicate(timeout=30)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


class Sampler:
    """The most processes the leader's system had beyond ``baseline``, sampled every 50 ms."""

    def __init__(self, leader, baseline: set[int]):
        self.leader, self.baseline, self.peak = leader, baseline, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def extra(self) -> int:
        return len(_request_actors(set(self.leader.pids()) - self.baseline))

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.extra())
            time.sleep(0.05)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join(5)
        return self.peak


def _titled(pids, title: bytes) -> set[int]:
    """Those of ``pids`` whose command line starts with ``title`` (Thespian titles each actor
    process with its class: ``b"RequestActor ActorAddr"``)."""
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().startswith(title):
                    out.add(pid)
        except OSError:
            pass
    return out


def _request_actors(pids) -> set[int]:
    """Those of ``pids`` that are RequestActors."""
    return _titled(pids, b"RequestActor ActorAddr")


def _kill_idle_and_wait_for_its_replacement(leader, api, baseline: set[int], killed: int) -> None:
    """SIGKILL the idle RequestActor ``killed``; within 10 s another RequestActor process runs
    and the API server has it back idle (``omni_request_actors`` 1, ``omni_request_actors_busy``
    0): it is replaced as soon as it is known dead. (The killed process shows for a moment,
    until it is reaped: a check that counted it passed at once, then saw none. And the gauge
    counts a RequestActor from the moment it is asked for, its process runs before the API
    server has it idle, and a request sent in between finds none idle and has another made:
    only busy 0 says the replacement is ready.)"""
    os.kill(killed, signal.SIGKILL)

    def replaced() -> bool:
        text = _get(api.url.removesuffix("/v1") + "/metrics")
        return len(_request_actors(set(leader.pids()) - baseline - {killed})) == 1 and \
            _gauge(text, "omni_request_actors") == 1 and _gauge(text, "omni_request_actors_busy") == 0
    deadline = time.monotonic() + 10
    while not replaced() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert replaced(), (_request_actors(set(leader.pids()) - baseline), api.log.read_text()[-2000:])


def _chat(url: str, max_tokens: int) -> tuple[int, str]:
    """A chat completion at ``url`` (urllib): (HTTP status, body)."""
    import urllib.error
    import urllib.request

    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(url + "/chat/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _gauge(text: str, name: str) -> float | None:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


def _wait_request_actors_made(url: str, minimum: int | None = None, timeout_s: float = 30) -> None:
    """Wait until the API server at ``url`` (``.../v1``) has made its first ``minimum``
    RequestActors (the bridge's default where None) and has them idle
    (``omni_request_actors_busy`` 0: one being made counts busy). It prints its address
    before it makes them, in the background: a count of the system's processes 0.3 s apart
    (:func:`_settle`) could settle before they came on a loaded machine (CI)."""
    from omni_actors.http.bridge import DEFAULT_MIN_REQUEST_ACTORS

    deadline = time.monotonic() + timeout_s
    while True:
        text = _get(url.removesuffix("/v1") + "/metrics")
        want = minimum if minimum is not None else min(DEFAULT_MIN_REQUEST_ACTORS,
                                                       int(_gauge(text, "omni_request_actors_max") or 1))
        if (_gauge(text, "omni_request_actors") or 0) >= want and _gauge(text, "omni_request_actors_busy") == 0:
            return
        assert time.monotonic() < deadline, f"no idle RequestActor within {timeout_s:g} s:\n{text}"
        time.sleep(0.1)


def _settle(baseline_of) -> set[int]:
    """The leader system's processes once their number stops changing (its own bridge
    makes its first RequestActors in the background)."""
    last, deadline = None, time.monotonic() + 10
    while time.monotonic() < deadline:
        now = set(baseline_of())
        if now == last:
            return now
        last = now
        time.sleep(0.3)
    return last


@pytest.mark.system
def test_past_the_cap_requests_queue_then_get_429_and_idle_request_actors_exit(leader, tmp_path):
    import aiohttp

    baseline = _settle(leader.pids)
    api = ApiServer(leader, tmp_path, min_request_actors=1, queue_limit=2, idle_exit_s=1.0)
    sampler = Sampler(leader, baseline)
    try:
        async def scenario():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                async def metrics() -> str:
                    async with s.get(api.url.removesuffix("/v1") + "/metrics") as r:
                        return await r.text()

                async def until(name: str, value: float):
                    deadline = time.monotonic() + 15
                    while time.monotonic() < deadline:
                        if _gauge(await metrics(), name) == value:
                            return
                        await asyncio.sleep(0.05)
                    raise AssertionError(f"{name} never {value}:\n{await metrics()}")

                def body(max_tokens: int, stream: bool = False, text: str = "hi") -> dict:
                    return {"model": MODEL, "messages": [{"role": "user", "content": text}],
                            "max_tokens": max_tokens, "stream": stream}

                async def chat(max_tokens: int, stream: bool = False) -> tuple[int, dict, dict]:
                    async with s.post(api.url + "/chat/completions", json=body(max_tokens, stream)) as r:
                        return r.status, dict(r.headers), await r.json(content_type=None)

                # Two long streams hold both RequestActors (the cap) until we let go.
                long = []
                for i in range(2):
                    r = await s.post(api.url + "/chat/completions", json=body(2000, stream=True, text=f"long {i}"))
                    assert r.status == 200
                    async for line in r.content:  # until its first text: it runs
                        if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                            break
                    long.append(r)
                await until("omni_request_actors_busy", 2)

                # A queued request whose client goes away leaves the queue.
                gone = asyncio.ensure_future(chat(4))
                await until("omni_request_queue_depth", 1)
                gone.cancel()
                await until("omni_request_queue_depth", 0)

                # Two wait in the queue (its limit)...
                queued = [asyncio.ensure_future(chat(4)) for _ in range(2)]
                await until("omni_request_queue_depth", 2)
                # ...and every request beyond is refused at once, streaming or not.
                refused = await asyncio.gather(chat(4), chat(4), chat(4, stream=True), chat(4))
                for status, headers, data in refused:
                    assert status == 429, (status, data)
                    wait_ms = int(headers["retry-after-ms"])  # (read first by OpenAI's clients)
                    assert 1000 <= wait_ms <= 30_000 and headers["Retry-After"] == str(-(-wait_ms // 1000)), headers
                    assert headers["Content-Type"].startswith("application/json")
                    err = data["error"]
                    assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded"
                    assert "busy" in err["message"] and "Retry after" in err["message"]
                assert not any(q.done() for q in queued)
                text = await metrics()
                assert _gauge(text, "omni_request_actors") == 2 and _gauge(text, "omni_request_actors_max") == 2
                assert _gauge(text, "omni_requests_rejected_total") == 4
                assert 'omni_requests_total{endpoint="/v1/chat/completions",status="429"} 4.0' in text

                # The long streams end (their clients go away): the queued requests run and succeed.
                for r in long:
                    r.close()
                for status, _, data in await asyncio.gather(*queued):
                    assert status == 200, data
                    assert data["choices"][0]["message"]["content"] and data["usage"]["completion_tokens"] == 4
                return await metrics()

        text = asyncio.run(scenario())
        assert _gauge(text, "omni_request_queue_depth") == 0
        # How long they waited: the two long streams at once, the two queued ones until the streams
        # ended (the one whose client left, and the 429s, got no RequestActor: not in it)
        assert _gauge(text, "omni_request_queue_wait_seconds_count") == 4, text
        assert re.search(r'^omni_request_queue_wait_seconds_bucket\{le="\+Inf"\} 4\.0$', text, re.M), text
        assert _gauge(text, "omni_request_queue_wait_seconds_sum") > 0, text
        assert sampler.extra() <= 2
        # Idle past idle_exit_s: back down to the minimum (one RequestActor), processes included.
        deadline = time.monotonic() + 15
        while sampler.extra() > 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sampler.extra() == 1
        assert _gauge(_get(api.url.removesuffix("/v1") + "/metrics"), "omni_request_actors") == 1
        assert sampler.stop() == 2  # never more RequestActor processes than the cap
    finally:
        sampler.stop()
        rc = api.stop()
    assert rc == 0, api.log.read_text()[-2000:]
    deadline = time.monotonic() + 10  # its RequestActors end with it
    while set(leader.pids()) - baseline and time.monotonic() < deadline:
        time.sleep(0.1)
    assert set(leader.pids()) - baseline == set()


@pytest.mark.system
def test_clients_that_give_up_on_a_stopped_engine_cannot_pile_work_on_it(tmp_path):
    """The Thinker's process is stopped (SIGSTOP: it cannot even take a cancel) and
    every client gives up after 0.4 s, again and again. Each RequestActor whose
    request ended that way stays busy (``omni_request_actors_closing``) until the
    engine confirms the cancel, so no more than ``request_actors`` (2) tasks ever
    reach the stopped engine; before, every hang-up freed its RequestActor at once
    and the next request piled one more task on it. Once the engine runs again the
    cancels are confirmed, nothing is left in flight, and requests are served."""
    import aiohttp

    from omni_actors.system.local import LocalLeader

    path = tmp_path / "stopped.yaml"  # heartbeats every 5 s: not isolated within the test
    path.write_text(CONFIG.replace("heartbeat_interval_s: 0.5", "heartbeat_interval_s: 5"))
    leader = LocalLeader(path).start()
    api = None
    pid = None
    try:
        api = ApiServer(leader, tmp_path, min_request_actors=2, queue_limit=64)
        base = api.url.removesuffix("/v1")

        def thinker() -> dict:
            return json.loads(_get(api.url + "/stages"))["stages"][0]["replicas"][0]

        async def scenario():
            async with aiohttp.ClientSession() as s:
                async def give_up(i: int):
                    body = {"model": MODEL, "messages": [{"role": "user", "content": f"give up {i}"}],
                            "max_tokens": 200}
                    try:
                        async with s.post(api.url + "/chat/completions", json=body,
                                          timeout=aiohttp.ClientTimeout(total=0.4)) as r:
                            await r.read()
                    except asyncio.TimeoutError:
                        return
                    raise AssertionError(f"request {i} was answered by a stopped engine")

                for wave in range(4):  # 4 waves of 3 clients: 12 requests given up
                    await asyncio.gather(*(give_up(3 * wave + k) for k in range(3)))
                closing = _gauge(_get(base + "/metrics"), "omni_request_actors_closing")
                peak, until = 0, time.monotonic() + 2.5  # (the pool publishes its figures every 1.25 s)
                while time.monotonic() < until:
                    peak = max(peak, thinker()["in_flight"])
                    await asyncio.sleep(0.1)
                return peak, closing

        pid = thinker()["pid"]
        os.kill(pid, signal.SIGSTOP)
        peak, closing = asyncio.run(scenario())
        assert peak <= 2, f"{peak} tasks reached the stopped Thinker (request_actors: 2)"
        assert closing == 2  # both RequestActors wait for the stopped engine's confirmation
        os.kill(pid, signal.SIGCONT)
        pid = None
        deadline = time.monotonic() + 15
        while (_gauge(_get(base + "/metrics"), "omni_request_actors_closing") or thinker()["in_flight"]) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gauge(_get(base + "/metrics"), "omni_request_actors_closing") == 0
        assert thinker()["in_flight"] == 0 and thinker()["restarts"] == 0
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": 4}).encode()
        import urllib.request
        req = urllib.request.Request(api.url + "/chat/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 4
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        if api is not None:
            assert api.stop() == 0, api.log.read_text()[-2000:]
        assert leader.stop() == 0


@pytest.mark.system
def test_request_actors_killed_mid_request_or_idle_are_replaced_at_once(leader, tmp_path):
    """SIGKILL on the RequestActor running a request (its process crashed): the client
    gets a 500 that says so at once (it waited for the request's deadline, plus 5 s,
    before), the Thinker's task is cancelled, and the next request is served by a new
    RequestActor. A killed idle one is not handed the next request (each such request
    waited out its deadline) and is replaced, up to the minimum kept."""

    baseline = _settle(leader.pids)
    api = ApiServer(leader, tmp_path, min_request_actors=1, queue_limit=4)
    try:
        ras = _settle(lambda: _request_actors(set(leader.pids()) - baseline))
        assert len(ras) == 1, ras  # the API server's one RequestActor

        def thinker() -> dict:
            return json.loads(_get(api.url + "/stages"))["stages"][0]["replicas"][0]

        def chat(max_tokens: int) -> tuple[int, str]:
            return _chat(api.url, max_tokens)

        result: list = []
        client = threading.Thread(target=lambda: result.append(chat(2000)))  # 40 s of decoding
        client.start()
        deadline = time.monotonic() + 15
        while thinker()["in_flight"] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert thinker()["in_flight"] == 1
        os.kill(ras.pop(), signal.SIGKILL)
        client.join(10)
        assert result, "no answer 10 s after the RequestActor was killed"
        status, body = result[0]
        assert status == 500, body
        assert "its RequestActor exited (its process was killed?)" in json.loads(body)["error"]["message"]
        deadline = time.monotonic() + 10  # its task was cancelled, not left to run its 40 s
        while thinker()["in_flight"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert thinker()["in_flight"] == 0
        status, body = chat(4)
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4, body
        text = _get(api.url.removesuffix("/v1") + "/metrics")
        assert _gauge(text, "omni_request_actors") == 1 and _gauge(text, "omni_request_actors_busy") == 0
        # the idle one now: killed, then replaced (the minimum is 1); the next request is served
        idle = _settle(lambda: _request_actors(set(leader.pids()) - baseline))
        assert len(idle) == 1, idle
        _kill_idle_and_wait_for_its_replacement(leader, api, baseline, idle.pop())
        status, body = chat(4)
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 4, body
        text = _get(api.url.removesuffix("/v1") + "/metrics")
        assert _gauge(text, "omni_request_actors") == 1 and _gauge(text, "omni_request_actors_busy") == 0
    finally:
        assert api.stop() == 0, api.log.read_text()[-2000:]


@pytest.mark.system
def test_a_killed_request_actor_supervisor_is_replaced_and_watches_the_new_request_actors(leader, tmp_path):
    """SIGKILL on an API server's RequestActorSupervisor: the API server hears no more
    SupervisorAlive, makes another within SUPERVISOR_ALIVE_EVERY_S * SUPERVISOR_MISSED (it
    noticed only when it next asked it for a RequestActor, after a 10 s timeout, and made
    them unsupervised from then on), ends the idle RequestActors of the lost one and makes
    new ones under the new one: a killed idle RequestActor is then replaced at once again,
    and requests are served throughout."""
    from omni_actors.messages import SUPERVISOR_ALIVE_EVERY_S, SUPERVISOR_MISSED

    def supervisors(pids) -> set[int]:
        return _titled(pids, b"RequestActorSupervisor ActorAddr")

    baseline = _settle(leader.pids)
    api = ApiServer(leader, tmp_path, min_request_actors=1, queue_limit=4)
    try:
        deadline = time.monotonic() + 20  # (CI: the first sample of a loaded machine had none of them yet)
        while not (supervisors(set(leader.pids()) - baseline) and _request_actors(set(leader.pids()) - baseline)):
            assert time.monotonic() < deadline, "the API server's supervisor and RequestActor did not show"
            time.sleep(0.1)
        mine = _settle(lambda: set(leader.pids()) - baseline)
        first, old = supervisors(mine), _request_actors(mine)
        assert len(first) == 1 and len(old) == 1, mine
        os.kill(first.pop(), signal.SIGKILL)
        t0 = time.monotonic()
        deadline = t0 + SUPERVISOR_ALIVE_EVERY_S * SUPERVISOR_MISSED + 5
        while time.monotonic() < deadline:
            mine = set(leader.pids()) - baseline
            if supervisors(mine) and _request_actors(mine) and not _request_actors(mine) & old:
                break
            time.sleep(0.1)
        took = time.monotonic() - t0
        assert supervisors(mine) and _request_actors(mine) and not _request_actors(mine) & old, (
            f"no new supervisor with a new RequestActor {took:.1f} s after the kill", mine)
        assert '"request_supervisor_lost"' in api.log.read_text()
        # (its process exists before the API server has it back idle; a request before that
        # finds none idle and has another one made, and two are left: wait for it)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            text = _get(api.url.removesuffix("/v1") + "/metrics")
            if _gauge(text, "omni_request_actors") == 1 and _gauge(text, "omni_request_actors_busy") == 0:
                break
            time.sleep(0.1)
        assert _chat(api.url, 4)[0] == 200
        # the new supervisor watches its RequestActors: an idle one killed is replaced at once
        idle = _settle(lambda: _request_actors(set(leader.pids()) - baseline))
        assert len(idle) == 1, idle
        _kill_idle_and_wait_for_its_replacement(leader, api, baseline, idle.pop())
        assert '"request_actor_exited"' in api.log.read_text()
        t1 = time.monotonic()
        status, body = _chat(api.url, 4)
        assert status == 200 and time.monotonic() - t1 < 10, body
        print(f"\nsupervisor killed: a new one and a new RequestActor {took:.1f} s later")
    finally:
        assert api.stop() == 0, api.log.read_text()[-2000:]


@pytest.mark.system
def test_a_request_actor_supervisor_held_up_past_its_time_is_replaced_and_ends_when_it_resumes(leader, tmp_path):
    """SIGSTOP on an API server's RequestActorSupervisor (a trial: held up by a frozen
    coordinator): the API server makes another, and the old one, resumed, exits (it stayed
    on, with no RequestActors, until its own 120 s without word from the API server ran out)."""
    from omni_actors.messages import SUPERVISOR_ALIVE_EVERY_S, SUPERVISOR_MISSED

    def supervisors(pids) -> set[int]:
        return _titled(pids, b"RequestActorSupervisor ActorAddr")

    baseline = _settle(leader.pids)
    api = ApiServer(leader, tmp_path, min_request_actors=1, queue_limit=4)
    try:
        first = supervisors(_settle(lambda: set(leader.pids()) - baseline))
        assert len(first) == 1, first
        old = first.pop()
        os.kill(old, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + SUPERVISOR_ALIVE_EVERY_S * SUPERVISOR_MISSED + 5
            while time.monotonic() < deadline and not supervisors(set(leader.pids()) - baseline) - {old}:
                time.sleep(0.1)
            assert supervisors(set(leader.pids()) - baseline) - {old}, "no new supervisor"
        finally:
            os.kill(old, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and old in supervisors(set(leader.pids()) - baseline):
            time.sleep(0.1)
        assert old not in supervisors(set(leader.pids()) - baseline), "the old supervisor is still there"
        assert len(supervisors(set(leader.pids()) - baseline)) == 1
        assert _chat(api.url, 4)[0] == 200
    finally:
        assert api.stop() == 0, api.log.read_text()[-2000:]


@pytest.mark.system
@pytest.mark.parametrize("stopped, bound_s", [("RequestActor", 10), ("RequestActorSupervisor", 20)])
def test_a_cancel_for_a_stopped_actor_does_not_hold_up_the_next_request(leader, tmp_path, stopped, bound_s):
    """A client gives up on a request whose RequestActor is stopped (SIGSTOP; a blocked one
    is the same), or while the API server's RequestActorSupervisor is (a code review). The
    API server's cancel goes through the supervisor: sent straight to a stopped
    RequestActor, or relayed through a stopped supervisor, it held the sender thread (one
    here) until that actor took it, up to 60 s, and the next request, started through that
    thread, waited as long (and so did the supervisor's own replacement). A sender stuck on
    a relay is replaced after HAND_OVER_STUCK_S, as one stuck on a hand-over is."""
    import aiohttp

    baseline = _settle(leader.pids)
    api = ApiServer(leader, tmp_path, min_request_actors=1, queue_limit=4, senders=1)
    pid = None
    try:
        found = _titled(_settle(lambda: set(leader.pids()) - baseline), f"{stopped} ActorAddr".encode())
        assert len(found) == 1, found
        pid = found.pop()

        async def scenario() -> float:
            async with aiohttp.ClientSession() as s:
                url = api.url + "/chat/completions"

                async def give_up():
                    body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "max_tokens": 200}
                    try:
                        async with s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=1.0)) as r:
                            await r.read()
                    except asyncio.TimeoutError:
                        return
                    raise AssertionError("the long request was answered within 1 s")

                first = asyncio.create_task(give_up())
                await asyncio.sleep(0.3)
                os.kill(pid, signal.SIGSTOP)  # mid-request
                await first  # gone after 1 s: the API server sends its RequestActor a cancel
                await asyncio.sleep(0.2)
                t0 = time.monotonic()
                body = {"model": MODEL, "messages": [{"role": "user", "content": "next"}], "max_tokens": 4}
                async with s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=90)) as r:
                    assert r.status == 200, await r.text()
                return time.monotonic() - t0

        took = asyncio.run(scenario())
        assert took < bound_s, f"the next request took {took:.1f} s"
        if stopped == "RequestActorSupervisor":
            assert "bridge_relay_stuck" in api.log.read_text()
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        assert api.stop() == 0, api.log.read_text()[-2000:]


def test_a_request_actor_made_without_a_supervisor_runs_unwatched_only_until_one_is_back():
    """Trial BS: RequestActors made while the RequestActorSupervisor was lost (killed, not
    answering) were made directly, and nobody watched them: they stayed in the pool, and one
    killed later left its request waiting 60 s. Such a RequestActor is counted with a lost
    supervisor's (not used again after its request), and an idle one leaves the pool once a
    new supervisor is there, replaced by a watched one."""
    from types import SimpleNamespace

    from omni_actors.http.request_actors import RequestActorKeeping

    keeping = RequestActorKeeping.__new__(RequestActorKeeping)  # (its state, without a bridge)
    keeping._supervisor, keeping._orphans = None, []
    keeping._pool = RequestActorPool(maximum=4, minimum=1, queue_limit=2, idle_exit_s=30)
    keeping._loop = SimpleNamespace(call_soon_threadsafe=lambda fn, *args: fn(*args))
    sent, refills = [], []
    keeping._outbox = lambda *a: SimpleNamespace(put=sent.append)
    keeping._refill = lambda: refills.append(1)
    made = keeping._make_request_actor(SimpleNamespace(createActor=lambda cls: "ra-unwatched"))
    assert made == "ra-unwatched" and keeping._orphans == ["ra-unwatched"]
    keeping._pool.total = 1
    keeping._pool.release(made)  # (made to fill the pool: idle)
    keeping._retire_idle_orphans()  # a new supervisor is ours
    assert sent == [("exit", "ra-unwatched")] and keeping._pool.idle_actors() == [] and keeping._orphans == []
    assert keeping._pool.total == 0 and refills == [1]


@pytest.mark.system
def test_a_stream_goes_on_once_a_killed_supervisor_is_replaced(leader, tmp_path):
    """A code review: the RequestActorSupervisor SIGKILLed with a stream in flight. The API
    server's acks to the replica, relayed through it, were lost until the loss was noticed
    (5 s), and never sent again: the replica held the stream's text back, probing twice,
    then for 30 s (the rest came 3 s after the stage ended). The relays since shortly before
    its last SupervisorAlive (acks, cancels) are sent again through the new supervisor: the
    text flows again within seconds of the replacement."""
    import aiohttp

    from omni_actors.messages import SUPERVISOR_ALIVE_EVERY_S, SUPERVISOR_MISSED

    baseline = _settle(leader.pids)
    api = ApiServer(leader, tmp_path, min_request_actors=1, queue_limit=4)
    try:
        sups = _titled(_settle(lambda: set(leader.pids()) - baseline), b"RequestActorSupervisor ActorAddr")
        assert len(sups) == 1, sups

        async def scenario() -> list[float]:
            arrivals = []
            async with aiohttp.ClientSession() as s:
                body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "max_tokens": 700,
                        "stream": True}  # (14 s at 20 ms a token)
                async with s.post(api.url + "/chat/completions", json=body,
                                  timeout=aiohttp.ClientTimeout(total=90)) as r:
                    assert r.status == 200, await r.text()
                    async for line in r.content:
                        if line.startswith(b"data: {") and b'"content"' in line:
                            arrivals.append(time.monotonic())
                            if len(arrivals) == 5:
                                os.kill(next(iter(sups)), signal.SIGKILL)
                                arrivals.append(-time.monotonic())  # (the kill)
            return arrivals

        arrivals = asyncio.run(scenario())
        killed_at = -next(t for t in arrivals if t < 0)
        after = [killed_at] + [t for t in arrivals if t > killed_at]
        gap = max(b - a for a, b in zip(after, after[1:]))
        # (the loss is noticed after 5 s; the bug held the rest until 3 s after the stage ended,
        # 17 s: 7 s leaves a loaded machine room to make the new supervisor, a review)
        assert gap < SUPERVISOR_ALIVE_EVERY_S * SUPERVISOR_MISSED + 7, f"the text stopped for {gap:.1f} s"
        assert '"request_supervisor_lost"' in api.log.read_text()
    finally:
        assert api.stop() == 0, api.log.read_text()[-2000:]


@pytest.mark.system
def test_a_stopped_idle_request_actor_does_not_hold_up_the_requests_behind_it(leader, tmp_path):
    """An idle RequestActor is stopped (SIGSTOP; a hung one is the same) and then given a
    request. Handing it over blocks the sender thread (one here) as long as Thespian tries,
    up to 60 s, and every request behind it waited as long. The sender is now replaced
    after HAND_OVER_STUCK_S: that request, which has not begun, runs on another
    RequestActor (trial BM: it got a 500), the others are served, and the API server keeps
    its two RequestActors (a new one for the lost one)."""
    import concurrent.futures

    from omni_actors.http.request_actors import HAND_OVER_STUCK_S

    baseline = _settle(leader.pids)
    api = ApiServer(leader, tmp_path, min_request_actors=2, queue_limit=8, senders=1)
    stopped = None
    try:
        deadline = time.monotonic() + 30  # (made in the background: slow on a busy machine)
        while len(ras := _request_actors(set(leader.pids()) - baseline)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(ras) == 2, ras
        stopped = sorted(ras)[0]
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(4) as ex:  # both RequestActors get one
            results = list(ex.map(lambda _: _chat(api.url, 4), range(4)))
        took = time.monotonic() - t0
        statuses = sorted(status for status, _ in results)
        assert statuses == [200] * 4, results
        assert took < HAND_OVER_STUCK_S + 10, f"4 requests took {took:.1f} s"
        for _ in range(4):
            status, body = _chat(api.url, 4)
            assert status == 200, body
        assert len(_request_actors(set(leader.pids()) - baseline) - {stopped}) >= 2
        print(f"\nstopped idle RequestActor: 4 requests in {took:.1f} s, {statuses}")
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
        assert api.stop() == 0, api.log.read_text()[-2000:]


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


if __name__ == "__main__":
    # python tests/test_admission.py ADMIN_PORT PORT '{"queue_limit": 2, ...}': an API server
    # attached to the admin on ADMIN_PORT (as `api --admin-port`), its bridge given these keywords.
    import functools

    from omni_actors.http import bridge as _bridge_module
    from omni_actors.logs import configure_logging
    from omni_actors.system.api_server import run_api

    configure_logging("info")  # as the CLI does: JSON lines on stderr (the test's api.log)

    _admin_port, _port, _kw = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    _bridge_module.ActorBridge = functools.partial(_bridge_module.ActorBridge, **_kw)
    sys.exit(run_api(host="127.0.0.1", port=_port, admin_port=_admin_port, request_actors=2))


def test_the_bridge_answers_the_delta_messages_that_ask_through_its_sender_threads():
    """The engine keeps only a few text-delta messages in flight to a bridge (DeltaWindow):
    the bridge answers those that ask, whether or not their requests are still open."""
    from omni_actors.messages import DeltasAck

    bridge = _bridge()
    bridge._loop = _SyncLoop()
    bridge._on_message(OutputDeltas((OutputDelta("gone", "x", 0),)))  # asks nothing
    bridge._on_message(OutputDeltas((OutputDelta("gone", "y", 1),), ack=3, ack_to="engine-1", peer="b"))
    told = [item for box in bridge._outboxes for item in iter(lambda b=box: None if b.empty() else b.get(), None)]
    assert told == [("tell", "engine-1", DeltasAck("b", 3))]


def test_a_server_that_did_not_run_for_a_while_does_not_blame_its_supervisor_or_request_actors():
    """A trial's API server, frozen (SIGSTOP) for 8 s with a stream in flight, then resumed:
    its first tick found no SupervisorAlive for 8 s, took the supervisor for lost and ended
    it, and with it the stream's RequestActor. A late tick is the server's own silence."""
    from omni_actors.http.bridge import REQUEST_ACTOR_SILENT_S

    async def main():
        bridge = _bridge_with_idle("ra-1", request_actors=1, queue_limit=0)
        stream = asyncio.ensure_future(_first(bridge, "r1"))
        await asyncio.sleep(0.01)
        _outbox_items(bridge)
        bridge._supervisor = "supervisor"
        now = time.monotonic()
        frozen_s = REQUEST_ACTOR_SILENT_S + 5  # (longer than either is given)
        bridge._ticked_at = now - bridge._tick_s - frozen_s
        bridge._supervisor_heard = now - frozen_s - 0.5
        bridge._held["r1"].heard = now - frozen_s - 0.5
        # (and a sender that was handing r1 over when it froze: trial AS's request was written off)
        bridge._handing[0] = (bridge._running_clock() - frozen_s - 0.5, "r1")
        started = list(bridge._sender_gen)
        bridge._start_sender = lambda i: bridge._sender_gen.__setitem__(i, bridge._sender_gen[i] + 1)
        bridge._tick()
        assert bridge._supervisor == "supervisor" and not stream.done()
        assert not [item for item in _outbox_items(bridge) if item[0] in ("supervise", "abandon")]
        assert bridge._sender_gen == started and bridge._handing[0] is not None
        bridge._handing[0] = None
        # a server that ran on, on time, still finds a silent supervisor lost
        bridge._ticked_at = time.monotonic() - bridge._tick_s
        bridge._supervisor_heard = time.monotonic() - 10
        bridge._tick()
        assert bridge._supervisor is None
        stream.cancel()
        bridge._stop.set()

    asyncio.run(main())


def test_a_request_actor_lost_twice_over_is_counted_lost_once():
    """A code review: a RequestActor killed while a sender was stuck handing it a request was
    written off twice, by its exit notice and by the stuck sender, and the pool counted it
    lost twice (it then kept one RequestActor more than ``request_actors``)."""

    async def main():
        bridge = _bridge(request_actors=2, queue_limit=0)
        bridge._loop = asyncio.get_running_loop()
        bridge._pool.reserve(2)
        bridge._pool.release("ra-1")
        bridge._pool.release("ra-2")
        stream = asyncio.ensure_future(_first(bridge, "r1"))
        await asyncio.sleep(0.01)
        _outbox_items(bridge)
        lost, real_lost = [], bridge._pool.lost
        bridge._pool.lost = lambda: (lost.append(1), real_lost())
        bridge._exited(bridge._held["r1"].actor)  # its exit notice
        bridge._write_off("r1", "its RequestActor did not take the request (stuck sender)", tell_exit=False)
        assert len(lost) == 1
        assert len([i for i in _outbox_items(bridge) if i[0] == "abandon"]) == 1
        first = await asyncio.wait_for(stream, 5)
        assert first.status == 500 and "its RequestActor exited" in first.message, first
        bridge._stop.set()

    asyncio.run(main())


def test_a_supervisor_is_judged_only_on_what_the_receiver_read_and_a_lost_one_spares_its_busy_actors():
    """A code review: (1) with the receiver thread held up (a fetch from a vanished host), a
    healthy supervisor's beats went unread and it was taken for lost; (2) the lost one was
    told to exit recursively, which ended every busy RequestActor it had made (a 503 each);
    (3) a supervisor that did not answer a MakeRequestActor was dropped for good."""
    from omni_actors.messages import SUPERVISOR_ALIVE_EVERY_S, SUPERVISOR_MISSED

    async def main():
        bridge = _bridge(request_actors=1, queue_limit=0)
        bridge._loop = asyncio.get_running_loop()
        silent = SUPERVISOR_ALIVE_EVERY_S * SUPERVISOR_MISSED + 1
        bridge._supervisor = "sup-1"
        bridge._supervisor_heard = time.monotonic() - silent
        bridge._receiver_turn_at = bridge._supervisor_heard + 0.5  # (the receiver has read nothing since)
        bridge._tick()
        assert bridge._supervisor == "sup-1" and not [i for i in _outbox_items(bridge) if i[0] == "supervise"]
        bridge._receiver_turn_at = time.monotonic()  # (it reads again, and nothing came)
        bridge._tick()
        assert bridge._supervisor is None
        assert ("supervise", (), "sup-1") in _outbox_items(bridge)

        bridge._supervisor = "sup-2"  # a MakeRequestActor it did not answer: lost, and replaced
        bridge._supervisor_heard = time.monotonic()
        bridge._supervisor_lost_if("sup-other")  # (not ours any more: nothing)
        assert bridge._supervisor == "sup-2"
        bridge._supervisor_lost_if("sup-2")
        assert bridge._supervisor is None and ("supervise", (), "sup-2") in _outbox_items(bridge)
        if bridge._tick_handle is not None:
            bridge._tick_handle.cancel()

    asyncio.run(main())

    # the sender thread's side: the lost supervisor's exit is not recursive
    from types import SimpleNamespace

    from omni_actors.messages import Relay

    bridge = _bridge(request_actors=1, queue_limit=0)
    told = []

    class Ctx:
        def createActor(self, cls, **kw):
            return "sup-new"

        def tell(self, to, message):
            told.append((to, message))

    later = []
    bridge._loop = SimpleNamespace(call_soon_threadsafe=lambda fn, *args: later.append(fn))
    bridge._supervise_again(Ctx(), ("ra-idle",), "sup-1")
    assert bridge._supervisor == "sup-new" and later == [bridge._retire_idle_orphans]
    exits = [(m.to, m.message.isRecursive) for to, m in told if isinstance(m, Relay)]
    assert exits == [("ra-idle", True), ("sup-1", False)]


def test_the_receiver_thread_lives_on_past_a_failed_subscription_and_a_message_it_cannot_take():
    """A code review: a Subscribe to a dead coordinator raises at once (and to a hung one after
    60 s), and nothing caught it: the receiver thread ended, and no event reached any request
    again while the server went on taking them."""
    import contextlib
    import threading

    from omni_actors.messages import RequestActorAlive, WhoAmI, YouAre

    bridge = _bridge(request_actors=1, queue_limit=0)
    routes = bridge._routes
    heard = []

    class Ctx:
        listened = 0

        def ask(self, to, message, timeout):
            return YouAre("bridge") if isinstance(message, WhoAmI) else routes

        def createActor(self, cls, **kw):
            return "coordinator"

        def tell(self, to, message):
            raise RuntimeError("the coordinator is dead")  # (Thespian's ActorSystemFailure)

        def listen(self, timeout):
            self.listened += 1
            if self.listened == 3:
                bridge._stop.set()
            return RequestActorAlive("r1") if self.listened == 1 else None

    class Asys:
        @contextlib.contextmanager
        def private(self):
            yield Ctx()

    bridge._asys = Asys()
    bridge._make_supervisor = lambda ctx: None

    def fails(msg):
        heard.append(msg)
        raise KeyError("r1")

    bridge._on_message = fails
    thread = threading.Thread(target=bridge._receive_loop, args=(threading.Event(), []))
    thread.start()
    thread.join(10)
    assert not thread.is_alive() and heard == [RequestActorAlive("r1")]
    assert bridge._receiver_turn_at > 0  # (it went on reading after both)


def test_a_receiver_held_up_does_not_make_the_messages_it_had_not_read_anyones_silence():
    """A code review: once a receiver thread held up past a supervisor's beats read again,
    the next tick judged the supervisor (and the busy RequestActors) on heard-times older
    than the hold-up, before the beats queued meanwhile were read. The hold-up is credited."""
    from omni_actors.messages import SUPERVISOR_ALIVE_EVERY_S, SUPERVISOR_MISSED

    async def main():
        bridge = _bridge(request_actors=1, queue_limit=0)
        bridge._loop = asyncio.get_running_loop()
        gap = SUPERVISOR_ALIVE_EVERY_S * SUPERVISOR_MISSED + 1
        bridge._supervisor = "sup-1"
        bridge._supervisor_heard = time.monotonic() - gap
        bridge._receiver_turn_at = time.monotonic()  # (it reads again ...)
        bridge._receiver_stalled_s = gap  # (... after a hold-up as long as the silence)
        bridge._tick()
        assert bridge._supervisor == "sup-1"
        bridge._tick()  # (credited once)
        assert bridge._receiver_stall_credited == gap
        if bridge._tick_handle is not None:
            bridge._tick_handle.cancel()

    asyncio.run(main())


def test_an_output_made_on_a_node_whose_data_service_answers_again_is_fetched_not_refused(prefix,
                                                                                          segments_not_slots):
    """Trial CD: a member frozen 10 s made the API server's fetch from its data service time
    out, and that service was then taken for down for a few seconds; the request's rerun ran on
    the member just resumed, and its output was refused without a try ("not tried again for
    2.3 s"): a 500. Such a service is asked once whether it answers now (at most
    DATA_SERVICE_PROBE_S) and tried if it does. One still frozen is probed once, not per output
    (each would hold the receiver thread); one on a node the coordinator has lost, not at all."""
    import dataclasses
    import socket
    from types import SimpleNamespace

    import numpy as np

    from omni_actors.connectors import NodeConnector, data_client
    from omni_actors.connectors.data_client import close_connections
    from omni_actors.connectors.data_service import DataService
    from omni_actors.http.bridge import DATA_SERVICE_PROBE_S
    from omni_actors.messages import NodeStatus, OutputReady

    frozen = socket.socket()  # (accepts connections, answers nothing: a stopped host)
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(8)
    silent = "127.0.0.1:%d" % frozen.getsockname()[1]
    with DataService("127.0.0.1", 0, prefix, node="far") as svc:
        try:
            producer = NodeConnector(0, prefix, node="far", service=svc.address)
            bridge = _bridge()
            bridge._connector = NodeConnector(node="near")
            failed = []
            bridge._fail_here = lambda request_id, event: failed.append(event)

            def nodes(far_alive: bool):
                bridge._published = SimpleNamespace(nodes=(
                    NodeStatus("far", far_alive, (), {}, (), (), data_service=svc.address),
                    NodeStatus("stopped", True, (), {}, (), (), data_service=silent)))

            def take(ref):
                t0 = time.monotonic()
                return bridge._take(OutputReady("r1", 2, "audio", ref)), time.monotonic() - t0

            ref = producer.put({"pcm": np.arange(64, dtype=np.int16)})
            data_client._mark_down(svc.address)  # (its fetches had timed out)
            nodes(far_alive=False)  # (lost: not probed, refused at once)
            out, _ = take(ref)
            assert out is None and "not tried again" in failed[-1].message, failed
            ref = producer.put({"pcm": np.arange(64, dtype=np.int16)})
            nodes(far_alive=True)  # (back: it answers the probe, and is fetched)
            out, _ = take(ref)
            assert out is not None and np.array_equal(out["pcm"], np.arange(64, dtype=np.int16)), failed

            data_client._mark_down(silent)
            gone = dataclasses.replace(ref, node="stopped", service=silent)
            out, took = take(gone)
            assert out is None and "not tried again" in failed[-1].message and took >= DATA_SERVICE_PROBE_S * 0.9
            out, took = take(gone)  # (probed already for this outage: refused at once)
            assert out is None and "not tried again" in failed[-1].message and took < DATA_SERVICE_PROBE_S / 2
        finally:
            for service in (svc.address, silent):
                data_client._down.pop(service, None)
            close_connections()
            frozen.close()
