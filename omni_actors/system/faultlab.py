"""Fault scenarios under load, for ``tests/faults/`` and ``benchmarks/faults.py``.

    with LocalLeader("configs/cpu_omni_demo.yaml") as leader:
        r = run_scenario(leader, "sigkill", target="talker/0")
        print(r.isolation_ms, r.restore_ms, r.ok, r.failed, r.retried)

A scenario runs a steady load of real HTTP clients (aiohttp, 127.0.0.1 only),
injects one fault through the CLI (``python -m omni_actors.system inject``),
keeps the load on, and reports what the clients saw and how fast the system
reacted: isolation from the leader's JSON log, capacity from ``GET /v1/stages``
polled every 50 ms.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime
from urllib.parse import urlparse

import aiohttp

ISOLATION_EVENTS = ("replica_isolated", "replica_exited", "pool_exited", "coordinator_restarted")
RETRY_EVENTS = ("task_redispatched", "stage_retry")
KEPT_EVENTS = ISOLATION_EVENTS + RETRY_EVENTS + ("replica_down", "replica_ready", "pool_restarted",
                                                  "instance_update", "fault_injected", "replica_tasks_lost")
POLL_S = 0.05


@dataclass
class Outcome:
    """One request as its client saw it. Times are Unix seconds."""

    start: float
    end: float
    status: int | None  #: None: no HTTP answer (client timeout, connection error)
    error: str = ""  #: "error: <OpenAI-style error.message>", or what else went wrong

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def lost(self) -> bool:
        """No answer, or an answer that is neither a 200 nor a clear OpenAI-style error."""
        return not self.ok and (self.status is None or not self.error.startswith("error: "))


class LoadGenerator:
    """``clients`` workers, each looping non-streaming text+audio chat completions."""

    def __init__(self, base_url: str, *, clients: int = 8, max_tokens: int = 16,
                 request_timeout_s: float = 20.0, duration_s: float = 60.0):
        if urlparse(base_url).hostname != "127.0.0.1":
            raise ValueError(f"load only goes to 127.0.0.1, not {base_url}")
        self.base_url, self.clients, self.max_tokens = base_url, clients, max_tokens
        self.request_timeout_s, self.duration_s = request_timeout_s, duration_s
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> list[Outcome]:
        """Until :meth:`stop` or ``duration_s``; requests in flight then run to their end or timeout."""
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=self.clients)) as s:
            async with s.get(self.base_url + "/models") as r:
                model = (await r.json())["data"][0]["id"]
            deadline = time.monotonic() + self.duration_s
            await asyncio.gather(*(self._worker(s, model, w, deadline) for w in range(self.clients)))
        return self.outcomes

    async def _worker(self, session, model: str, worker: int, deadline: float) -> None:
        i = 0
        while not self._stop.is_set() and time.monotonic() < deadline:
            body = {"model": model, "messages": [{"role": "user", "content": f"story {worker}-{i}"}],
                    "modalities": ["text", "audio"], "audio": {"format": "wav"},  # (no voice: a model's own)
                    "max_tokens": self.max_tokens}
            self.outcomes.append(await self._one(session, body))
            i += 1

    async def _one(self, session, body: dict) -> Outcome:
        start = time.time()
        try:
            async with session.post(self.base_url + "/chat/completions", json=body) as r:
                status, text = r.status, await r.text()
        except asyncio.TimeoutError:
            return Outcome(start, time.time(), None, f"no answer within {self.request_timeout_s:g} s")
        except aiohttp.ClientError as exc:
            return Outcome(start, time.time(), None, f"{type(exc).__name__}: {exc}")
        end = time.time()
        try:
            data = json.loads(text)
            if status == 200:
                audio = data["choices"][0]["message"]["audio"]["data"]
                return Outcome(start, end, status, "" if audio else "200 with empty audio")
            return Outcome(start, end, status, "error: " + data["error"]["message"])
        except (ValueError, KeyError, IndexError, TypeError):
            return Outcome(start, end, status, f"unexpected body: {text[:200]!r}")


@dataclass
class ScenarioResult:
    fault: str
    target: str
    injected_at: float  #: Unix time, from the CLI's ``--json``
    isolated_at: float | None  #: first isolation event for the target after the injection (leader log)
    restored_at: float | None  #: first poll showing full capacity again, after the target left
    disturbed: bool  #: the target left the routing table (not ready, new pid, new pool or coordinator)
    target_states: list[str]  #: the target's states seen after the injection, in order, deduplicated
    outcomes: list[Outcome]
    retried: int  #: distinct request ids in task_redispatched / stage_retry events after the injection
    before: dict  #: ``/v1/stages`` just before the injection
    after: dict  #: ``/v1/stages`` after the load stopped
    events: list[dict] = field(default_factory=list)  #: supervision events after the injection
    follow_up: dict | None = None  #: the second injection (sigcont): return code and output

    def _ms(self, t: float | None) -> float | None:
        return None if t is None else (t - self.injected_at) * 1000

    isolation_ms = property(lambda self: self._ms(self.isolated_at))
    restore_ms = property(lambda self: self._ms(self.restored_at))
    ok = property(lambda self: sum(o.ok for o in self.outcomes))
    lost = property(lambda self: sum(o.lost for o in self.outcomes))
    failures = property(lambda self: [f"HTTP {o.status}: {o.error}" for o in self.outcomes if not o.ok])
    failed = property(lambda self: len(self.failures))


def inject_cli(admin_port: int, fault: str, *args: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    """``python -m omni_actors.system inject FAULT ARGS --admin-port P --json``, environment unchanged."""
    return subprocess.run([sys.executable, "-m", "omni_actors.system", "inject", fault, *args,
                           "--admin-port", str(admin_port), "--json"],
                          capture_output=True, text=True, timeout=timeout_s, env=dict(os.environ))


def read_events(log_path, since: float = 0.0) -> list[dict]:
    """The leader log's JSON events from ``since`` (Unix time) on, each with ``t`` (Unix time) added."""
    events = []
    with open(log_path, errors="replace") as f:
        for line in f:
            try:
                ev = json.loads(line)
                ev["t"] = datetime.fromisoformat(ev["timestamp"]).timestamp()
            except (ValueError, KeyError, TypeError):
                continue  # Thespian's own plain-text lines
            if ev["t"] >= since:
                events.append(ev)
    return events


def replicas(table: dict) -> dict[str, dict]:
    """Replica name -> its row, from a ``/v1/stages`` table."""
    return {r["replica"]: r for st in table["stages"] for r in st["replicas"]}


def _ready_counts(table: dict) -> dict[str, int]:
    return {st["stage"]: st["ready_replicas"] for st in table["stages"]}


def _pool_pid(table: dict, stage: str) -> int | None:
    return next((st["pid"] for st in table["stages"] if st["stage"] == stage), None)


def _is_isolation(ev: dict, fault: str, target: str, stage: str) -> bool:
    if fault == "kill-coordinator":
        return ev["event"] == "coordinator_restarted"
    if fault == "kill-pool":
        return ev["event"] == "pool_exited" and ev.get("stage") == stage
    return ev["event"] in ("replica_isolated", "replica_exited") and ev.get("replica") == target


def _disturbed(fault: str, target: str, stage: str, before: dict, now: dict) -> bool:
    if fault == "kill-coordinator":
        return now["coordinator_pid"] != before["coordinator_pid"]
    if fault == "kill-pool":
        return _pool_pid(now, stage) != _pool_pid(before, stage)
    rep = replicas(now).get(target)
    return rep is None or rep["state"] != "ready" or rep["pid"] != replicas(before)[target]["pid"]


def _full_capacity(fault: str, before: dict, now: dict) -> bool:
    if fault in ("kill-pool", "kill-coordinator"):  # new pools, new pids: compare ready counts
        return all(n >= _ready_counts(before)[s] for s, n in _ready_counts(now).items())
    reps = replicas(now)
    return all(reps.get(name, {}).get("state") == "ready"
               for name, r in replicas(before).items() if r["state"] == "ready")


async def _get_stages(session, base_url: str) -> dict | None:
    try:
        async with session.get(base_url + "/stages", timeout=aiohttp.ClientTimeout(total=1.0)) as r:
            return await r.json() if r.status == 200 else None
    except (asyncio.TimeoutError, aiohttp.ClientError, ValueError):
        return None


async def scenario(leader, fault: str, *, target: str = "talker/0", stage: str = "", factor: float = 5.0,
                   count: int = 1, clients: int = 8, max_tokens: int = 16, request_timeout_s: float = 20.0,
                   warmup_s: float = 1.0, hold_s: float = 3.0, settle_s: float = 1.0, max_wait_s: float = 20.0,
                   expect_disturbance: bool = True, follow_up: str | None = None) -> ScenarioResult:
    """Wait for every replica ready, start the load, warm up, inject ``fault``, hold, stop the load.

    The load is held ``hold_s`` after the injection and, when the fault is
    expected to take the target out, until capacity is back plus ``settle_s``
    (at most ``max_wait_s``). ``follow_up`` (``"sigcont"``) is injected into
    the target once it left the routing table (or after ``hold_s``).
    """
    stage = stage or target.rsplit("/", 1)[0]
    await asyncio.to_thread(wait_ready, leader)
    load = LoadGenerator(leader.base_url, clients=clients, max_tokens=max_tokens,
                         request_timeout_s=request_timeout_s, duration_s=warmup_s + max_wait_s + 30)
    load_task = asyncio.create_task(load.run())
    async with aiohttp.ClientSession() as session:
        await asyncio.sleep(warmup_s)
        before = await _get_stages(session, leader.base_url)
        args = {"kill-pool": ["--stage", stage], "kill-coordinator": []}.get(fault, ["--replica", target])
        args += {"slow": ["--factor", str(factor)], "raise": ["--count", str(count)]}.get(fault, [])
        done = await asyncio.to_thread(inject_cli, leader.admin_port, fault, *args)
        if before is None or done.returncode != 0:
            load.stop()
            await load_task
            raise RuntimeError(f"inject {fault} failed ({done.returncode}): {done.stderr.strip()} "
                               f"(stages before: {before})")
        injected_at, started = json.loads(done.stdout)["at"], time.monotonic()
        disturbed, restored_at, states, after, follow = False, None, [], before, None
        while True:
            now, t = await _get_stages(session, leader.base_url), time.time()
            if now is not None:
                after = now
                state = replicas(now).get(target, {}).get("state", "absent")
                states += [state] if not states or states[-1] != state else []
                disturbed = disturbed or _disturbed(fault, target, stage, before, now)
                if disturbed and restored_at is None and _full_capacity(fault, before, now):
                    restored_at = t
            elapsed = time.monotonic() - started
            if follow_up and follow is None and (disturbed or elapsed >= hold_s):
                out = await asyncio.to_thread(inject_cli, leader.admin_port, follow_up, "--replica", target)
                follow = {"fault": follow_up, "returncode": out.returncode, "stdout": out.stdout.strip(),
                          "stderr": out.stderr.strip()[-300:]}
            settled = not expect_disturbance or (restored_at is not None and time.time() - restored_at >= settle_s)
            if elapsed >= max_wait_s or (elapsed >= hold_s and settled):
                break
            await asyncio.sleep(POLL_S)
        load.stop()
        outcomes = await load_task
        after = await _get_stages(session, leader.base_url) or after
    events = [ev for ev in read_events(leader.log_path, injected_at) if ev.get("event") in KEPT_EVENTS]
    isolated_at = next((ev["t"] for ev in events if _is_isolation(ev, fault, target, stage)), None)
    retried = len({ev.get("request_id") for ev in events if ev["event"] in RETRY_EVENTS})
    shown = {"kill-pool": f"pool {stage}", "kill-coordinator": "coordinator"}.get(fault, target)
    return ScenarioResult(fault, shown, injected_at, isolated_at, restored_at, disturbed, states, outcomes,
                          retried, before, after, events, follow)


def run_scenario(leader, fault: str, **kwargs) -> ScenarioResult:
    """:func:`scenario` on a fresh event loop, for synchronous tests and scripts."""
    return asyncio.run(scenario(leader, fault, **kwargs))


def assert_no_request_lost(result: ScenarioResult, *, clear_errors_allowed: bool = False) -> None:
    """Every request ended 200 (or, if allowed, with a clear OpenAI-style error); none hung."""
    lost = [f"HTTP {o.status}: {o.error}" for o in result.outcomes if o.lost]
    assert not lost, f"{len(lost)} of {len(result.outcomes)} requests lost: {lost[:5]}"
    assert clear_errors_allowed or not result.failures, f"{result.failed} failed: {result.failures[:5]}"
    after = sum(o.ok and o.start >= result.injected_at for o in result.outcomes)
    assert after > 0, "no request succeeded after the injection: the load did not go on"


def stages(leader, timeout_s: float = 5.0) -> dict:
    with urllib.request.urlopen(leader.base_url + "/stages", timeout=timeout_s) as r:
        return json.loads(r.read())


def replace_coordinator(leader, until=lambda table: table.get("ready"), timeout_s: float = 30.0) -> dict:
    """``inject kill-coordinator``, then wait until a new coordinator (another pid) reports a
    ``/v1/stages`` table for which ``until(table)`` holds (default: ready); returns it.
    Raises AssertionError (the inject failed, or ``timeout_s`` passed)."""
    before = stages(leader)["coordinator_pid"]
    out = inject_cli(leader.admin_port, "kill-coordinator")
    assert out.returncode == 0, out.stderr
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            now = stages(leader)
        except OSError:  # (between two coordinators)
            now = {}
        if now.get("coordinator_pid") not in (None, before) and until(now):
            return now
        assert time.monotonic() < deadline, now
        time.sleep(0.3)


def wait_ready(leader, timeout_s: float = 30.0) -> dict:
    """Wait until every replica is ready; returns ``/v1/stages``. Raises TimeoutError."""
    deadline, now = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            now = stages(leader)
            if all(r["state"] == "ready" for r in replicas(now).values()):
                return now
        except OSError:
            pass
        time.sleep(POLL_S)
    raise TimeoutError(f"not every replica ready within {timeout_s:g} s: {now}")


def wait_gone(leader, pids, timeout_s: float = 10.0) -> list[int]:
    """Wait until none of ``pids`` is a live process of the system; returns those still alive."""

    deadline = time.monotonic() + timeout_s
    while (left := sorted(set(pids) & set(leader.pids()))) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def wait_no_segments(leader, timeout_s: float = 5.0) -> list[str]:
    """Wait until the system holds no shared-memory segment; returns those left."""
    from omni_actors.connectors import list_segments

    deadline = time.monotonic() + timeout_s
    while (left := list_segments(f"oa-{leader.admin_port}-", getattr(leader, "shm_dir", None))) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def assert_clean_exit(leader) -> None:
    """Stop the leader (if still running); assert no orphan process and no shared-memory segment."""
    from omni_actors.connectors import list_segments

    if leader.exit_code is None:
        leader.stop()
    assert leader.left_after_exit == [], f"processes left after stop: {leader.left_after_exit}"
    assert list_segments(f"oa-{leader.admin_port}-", getattr(leader, "shm_dir", None)) == [], \
        "shared-memory segments left after stop"
