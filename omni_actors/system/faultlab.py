"""Fault scenarios under load, for ``tests/faults/`` and ``benchmarks/faults.py``.

    with LocalLeader("configs/cpu_omni_demo.yaml") as leader:
        result = run_scenario(leader, "sigkill", target="talker/0")
        print(result.isolation_ms, result.restore_ms, result.ok, result.failed, result.retried)

A scenario runs a steady load of real HTTP clients (aiohttp, 127.0.0.1 only),
injects one fault through the CLI (``python -m omni_actors.system inject``),
keeps the load on, and reports what users saw and how fast the system reacted.
Times come from the leader's JSON log and from polling ``GET /v1/stages``.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from urllib.parse import urlparse

import aiohttp

#: Events that mean the system noticed the fault, by fault family.
ISOLATION_EVENTS = ("replica_isolated", "replica_exited", "pool_exited", "coordinator_restarted")
RETRY_EVENTS = ("task_redispatched", "stage_retry")
POLL_S = 0.05


@dataclass
class Outcome:
    """One HTTP request as its client saw it. Times are Unix seconds."""

    start: float
    end: float
    status: int | None  #: None: no HTTP response (timeout, connection error)
    error: str = ""  #: the OpenAI-style ``error.message``, or what went wrong

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def lost(self) -> bool:
        """No answer, or an answer that is not a clear OpenAI-style error."""
        return not self.ok and (self.status is None or not self.error.startswith("error: "))


class LoadGenerator:
    """``clients`` workers, each looping non-streaming text+audio chat completions."""

    def __init__(self, base_url: str, *, clients: int = 8, max_tokens: int = 8,
                 request_timeout_s: float = 20.0, duration_s: float = 120.0):
        if urlparse(base_url).hostname != "127.0.0.1":
            raise ValueError(f"load only goes to 127.0.0.1, not {base_url}")
        self.base_url, self.clients, self.max_tokens = base_url, clients, max_tokens
        self.request_timeout_s, self.duration_s = request_timeout_s, duration_s
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> list[Outcome]:
        """Until :meth:`stop` or ``duration_s``; then waits for requests in flight."""
        timeout = aiohttp.ClientTimeout(total=self.request_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout,
                                         connector=aiohttp.TCPConnector(limit=self.clients)) as session:
            async with session.get(self.base_url + "/models") as r:
                model = (await r.json())["data"][0]["id"]
            deadline = time.monotonic() + self.duration_s
            await asyncio.gather(*(self._worker(session, model, w, deadline) for w in range(self.clients)))
        return self.outcomes

    async def _worker(self, session, model: str, worker: int, deadline: float) -> None:
        i = 0
        while not self._stop.is_set() and time.monotonic() < deadline:
            body = {"model": model, "messages": [{"role": "user", "content": f"story {worker}-{i}"}],
                    "modalities": ["text", "audio"], "audio": {"voice": "default", "format": "wav"},
                    "max_tokens": self.max_tokens}
            self.outcomes.append(await self._one(session, body))
            i += 1

    async def _one(self, session, body: dict) -> Outcome:
        start = time.time()
        try:
            async with session.post(self.base_url + "/chat/completions", json=body) as r:
                text = await r.text()
                status = r.status
        except asyncio.TimeoutError:
            return Outcome(start, time.time(), None, f"no answer within {self.request_timeout_s:g} s")
        except aiohttp.ClientError as exc:
            return Outcome(start, time.time(), None, f"{type(exc).__name__}: {exc}")
        end = time.time()
        try:
            data = json.loads(text)
        except ValueError:
            return Outcome(start, end, status, f"not JSON: {text[:200]!r}")
        if status == 200:
            audio = (((data.get("choices") or [{}])[0].get("message") or {}).get("audio") or {}).get("data")
            return Outcome(start, end, status, "" if audio else "200 without audio")
        err = data.get("error") if isinstance(data, dict) else None
        if isinstance(err, dict) and err.get("message"):
            return Outcome(start, end, status, f"error: {err['message']}")
        return Outcome(start, end, status, f"unclear error body: {text[:200]!r}")


@dataclass
class ScenarioResult:
    fault: str
    target: str
    injected_at: float  #: Unix time, from the CLI's ``--json``
    isolated_at: float | None  #: first isolation event for the target after injection
    restored_at: float | None  #: first poll showing full capacity again (after it was lost)
    disturbed: bool  #: the target left the routing table (not ready, new pid, new pool or coordinator)
    outcomes: list[Outcome]
    retried: int  #: distinct request ids in task_redispatched / stage_retry after injection
    target_states: list[str]  #: the target's states seen after injection, in order, deduplicated
    before: dict  #: ``/v1/stages`` just before injection
    after: dict | None  #: ``/v1/stages`` at the end
    events: list[dict] = field(default_factory=list)  #: supervision log events after injection
    follow_up: dict | None = None  #: a second injection (sigcont): its CLI output and return code

    @property
    def isolation_ms(self) -> float | None:
        return None if self.isolated_at is None else (self.isolated_at - self.injected_at) * 1000

    @property
    def restore_ms(self) -> float | None:
        return None if self.restored_at is None else (self.restored_at - self.injected_at) * 1000

    @property
    def ok(self) -> int:
        return sum(o.ok for o in self.outcomes)

    @property
    def failures(self) -> list[str]:
        return [f"HTTP {o.status}: {o.error}" for o in self.outcomes if not o.ok]

    @property
    def failed(self) -> int:
        return len(self.failures)

    @property
    def lost(self) -> int:
        return sum(o.lost for o in self.outcomes)


def inject_cli(admin_port: int, fault: str, *args: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
    """``python -m omni_actors.system inject FAULT ... --admin-port P --json`` (environment unchanged)."""
    return subprocess.run([sys.executable, "-m", "omni_actors.system", "inject", fault, *args,
                           "--admin-port", str(admin_port), "--json"],
                          capture_output=True, text=True, timeout=timeout_s, env=dict(os.environ))


def read_events(log_path, since: float = 0.0) -> list[dict]:
    """The leader log's JSON events at or after ``since`` (Unix time), with ``t`` (Unix time) added."""
    events = []
    with open(log_path, errors="replace") as f:
        for line in f:
            if not line.startswith("{"):
                continue
            try:
                ev = json.loads(line)
                ev["t"] = datetime.fromisoformat(ev["timestamp"]).timestamp()
            except (ValueError, KeyError, TypeError):
                continue
            if ev["t"] >= since:
                events.append(ev)
    return events


def _is_isolation(ev: dict, fault: str, target: str, stage: str) -> bool:
    if fault == "kill-coordinator":
        return ev["event"] == "coordinator_restarted"
    if fault == "kill-pool":
        return ev["event"] == "pool_exited" and ev.get("stage") == stage
    return ev["event"] in ("replica_isolated", "replica_exited") and ev.get("replica") == target


def _replicas(stages: dict) -> dict[str, dict]:
    return {r["replica"]: r for st in stages["stages"] for r in st["replicas"]}


def _ready_counts(stages: dict) -> dict[str, int]:
    return {st["stage"]: st["ready_replicas"] for st in stages["stages"]}


def _disturbed(fault: str, target: str, stage: str, before: dict, now: dict) -> bool:
    if fault == "kill-coordinator":
        return now["coordinator_pid"] != before["coordinator_pid"]
    if fault == "kill-pool":
        pid = {st["stage"]: st["pid"] for st in now["stages"]}.get(stage)
        return pid != {st["stage"]: st["pid"] for st in before["stages"]}[stage]
    rep, was = _replicas(now).get(target), _replicas(before)[target]
    return rep is None or rep["state"] != "ready" or rep["pid"] != was["pid"]


def _full_capacity(fault: str, before: dict, now: dict) -> bool:
    if fault in ("kill-pool", "kill-coordinator"):  # new pools, new pids: compare counts
        return all(n >= _ready_counts(before)[s] for s, n in _ready_counts(now).items())
    reps = _replicas(now)
    return all(reps.get(name, {}).get("state") == "ready"
               for name, r in _replicas(before).items() if r["state"] == "ready")


async def _get_stages(session, base_url: str) -> dict | None:
    try:
        async with session.get(base_url + "/stages", timeout=aiohttp.ClientTimeout(total=1.0)) as r:
            return await r.json() if r.status == 200 else None
    except (asyncio.TimeoutError, aiohttp.ClientError, ValueError):
        return None


async def scenario(leader, fault: str, *, target: str = "talker/0", stage: str = "", factor: float = 5.0,
                   count: int = 1, clients: int = 8, max_tokens: int = 8, warmup_s: float = 1.0,
                   hold_s: float = 3.0, settle_s: float = 1.0, max_wait_s: float = 20.0,
                   expect_disturbance: bool = True, request_timeout_s: float = 20.0,
                   follow_up: str | None = None) -> ScenarioResult:
    """Load, warm up, inject ``fault``, hold the load, stop it; see :class:`ScenarioResult`.

    The load is held ``hold_s`` after the injection and, when a disturbance is
    expected, until capacity is back plus ``settle_s`` (at most ``max_wait_s``).
    ``follow_up`` (e.g. ``"sigcont"``) is injected into the same target once
    the target was isolated (or at the end of the hold).
    """
    stage = stage or target.rsplit("/", 1)[0]
    load = LoadGenerator(leader.base_url, clients=clients, max_tokens=max_tokens,
                         request_timeout_s=request_timeout_s, duration_s=warmup_s + max_wait_s + hold_s + 30)
    load_task = asyncio.create_task(load.run())
    async with aiohttp.ClientSession() as session:
        await asyncio.sleep(warmup_s)
        before = await _get_stages(session, leader.base_url)
        if before is None:
            raise RuntimeError("GET /v1/stages failed before the injection")
        args = {"kill-pool": ["--stage", stage], "kill-coordinator": []}.get(fault, ["--replica", target])
        args += ["--factor", str(factor)] if fault == "slow" else []
        args += ["--count", str(count)] if fault == "raise" else []
        done = await asyncio.to_thread(inject_cli, leader.admin_port, fault, *args)
        if done.returncode != 0:
            load.stop()
            await load_task
            raise RuntimeError(f"inject {fault} failed ({done.returncode}): {done.stderr.strip()}")
        injected_at = json.loads(done.stdout)["at"]
        disturbed, restored_at, states, after, follow = False, None, [], before, None
        started = time.monotonic()
        while True:
            now = await _get_stages(session, leader.base_url)
            t = time.time()
            if now is not None:
                after = now
                rep = _replicas(now).get(target)
                state = rep["state"] if rep else "absent"
                if not states or states[-1] != state:
                    states.append(state)
                disturbed = disturbed or _disturbed(fault, target, stage, before, now)
                if disturbed and restored_at is None and _full_capacity(fault, before, now):
                    restored_at = t
            elapsed = time.monotonic() - started
            if follow_up and follow is None and (disturbed or elapsed >= hold_s):
                out = await asyncio.to_thread(inject_cli, leader.admin_port, follow_up, "--replica", target)
                follow = {"fault": follow_up, "returncode": out.returncode, "stdout": out.stdout.strip(),
                          "stderr": out.stderr.strip()[-500:]}
            settled = (restored_at is not None and time.time() - restored_at >= settle_s) or not expect_disturbance
            if elapsed >= max_wait_s or (elapsed >= hold_s and settled):
                break
            await asyncio.sleep(POLL_S)
        load.stop()
        outcomes = await load_task
        end = await _get_stages(session, leader.base_url)
    events = [ev for ev in read_events(leader.log_path, injected_at)
              if ev["event"] in ISOLATION_EVENTS + RETRY_EVENTS
              + ("replica_down", "replica_ready", "pool_restarted", "instance_update", "fault_injected")]
    isolated = next((ev["t"] for ev in events if _is_isolation(ev, fault, target, stage)), None)
    retried = len({ev.get("request_id") for ev in events if ev["event"] in RETRY_EVENTS})
    return ScenarioResult(fault, target if fault not in ("kill-pool", "kill-coordinator") else
                          (f"pool {stage}" if fault == "kill-pool" else "coordinator"),
                          injected_at, isolated, restored_at, disturbed, outcomes, retried, states, before,
                          end or after, events, follow)


def run_scenario(leader, fault: str, **kwargs) -> ScenarioResult:
    """:func:`scenario` on a fresh event loop (for synchronous tests and scripts)."""
    return asyncio.run(scenario(leader, fault, **kwargs))


def leftovers(leader) -> dict[str, list]:
    """After ``leader.stop()``: processes of the system and shared-memory segments left behind."""
    from omni_actors.connectors import list_segments

    return {"processes": list(leader.left_after_exit),
            "segments": list_segments(f"oa-{leader.admin_port}-")}


def assert_clean_exit(leader) -> None:
    """Stop the leader (if not yet) and assert no orphan process and no shared-memory segment."""
    if leader.exit_code is None:
        leader.stop()
    left = leftovers(leader)
    assert left == {"processes": [], "segments": []}, f"left behind after stop: {left}"
