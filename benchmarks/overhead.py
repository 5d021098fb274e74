"""Orchestration overhead of the actor system on a zero-cost 3-stage pipeline.

Runs the same Thinker -> Talker -> Code2Wav requests (zero-cost synthetic
stages, ``configs/bench_zero_cost.yaml``, output types text + audio) three ways,
at concurrency 1 and 16:

1. **direct**: the three SyntheticEngines and stage processors called in this
   process, one asyncio loop, no actors, no connectors;
2. **actors (bridge)**: through a real leader (started with
   :class:`~omni_actors.system.local.LocalLeader`) via an :class:`ActorBridge`
   in this process, attached to the leader's admin port (no HTTP);
3. **actors + HTTP**: ``POST /v1/chat/completions`` with
   ``modalities: ["text", "audio"]`` against the leader's API server.

For each: per-request latency p50/p99 (ms) and requests/s after a warm-up;
then the overhead per request (actors minus direct) and the ratios.

    python benchmarks/overhead.py                 # defaults: 200 requests at c=1, 400 at c=16
    python benchmarks/overhead.py --requests 50   # quicker
    python benchmarks/overhead.py --json out.json

The leader is always stopped (context manager), whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # runnable as `python benchmarks/overhead.py` without installing
    sys.path.insert(0, str(REPO))

DEFAULT_CONFIG = REPO / "configs" / "bench_zero_cost.yaml"
PROMPT = "Tell me a short story about a lighthouse keeper and a whale"
OUTPUT_TYPES = frozenset({"text", "audio"})
MODES = ("direct", "bridge", "http")
LABELS = {"direct": "direct", "bridge": "actors (bridge)", "http": "actors + HTTP"}


# --------------------------------------------------------------------- measuring

def percentile(sorted_xs: list[float], q: float) -> float:
    """Linear-interpolated percentile of an already sorted list (q in [0, 100])."""
    if not sorted_xs:
        return float("nan")
    if len(sorted_xs) == 1:
        return sorted_xs[0]
    pos = (len(sorted_xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


async def run_load(one: Callable[[int], Awaitable[bool]], n: int, concurrency: int) -> dict[str, Any]:
    """``n`` calls of ``one(i)`` by ``concurrency`` workers pulling from a shared counter.

    ``one`` returns True on success. Returns latency percentiles (ms), req/s, failures.
    """
    next_i = 0
    lat: list[float] = []
    failures = 0

    async def worker() -> None:
        nonlocal next_i, failures
        while next_i < n:
            i = next_i
            next_i += 1
            t0 = time.perf_counter()
            try:
                ok = await one(i)
            except Exception as exc:  # noqa: BLE001 - count it, keep measuring
                ok = False
                if failures < 3:
                    print(f"    request failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            lat.append((time.perf_counter() - t0) * 1000.0)
            if not ok:
                failures += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    lat.sort()
    return {"n": n, "concurrency": concurrency, "failures": failures, "wall_s": round(wall, 3),
            "rps": n / wall if wall > 0 else float("nan"),
            "p50_ms": percentile(lat, 50), "p99_ms": percentile(lat, 99),
            "mean_ms": statistics.fmean(lat) if lat else float("nan"),
            "max_ms": lat[-1] if lat else float("nan")}


async def measure(name: str, one: Callable[[int], Awaitable[bool]], plan: list[tuple[int, int]],
                  warmup: int) -> dict[int, dict[str, Any]]:
    """Warm up, then measure, at each (concurrency, n) of ``plan``."""
    results = {}
    for conc, n in plan:
        w = await run_load(one, max(warmup, 2 * conc), conc)
        r = await run_load(one, n, conc)
        r["warmup_failures"] = w["failures"]
        results[conc] = r
        print(f"  {LABELS[name]:<16} c={conc:<3} n={n:<5} p50 {r['p50_ms']:8.2f} ms  "
              f"p99 {r['p99_ms']:8.2f} ms  {r['rps']:9.1f} req/s  failures {r['failures']}"
              f"{' (warm-up ' + str(w['failures']) + ')' if w['failures'] else ''}", flush=True)
    return results


# ------------------------------------------------------------------------ direct

async def bench_direct(config, plan, warmup, max_tokens) -> dict[int, dict[str, Any]]:
    from omni_actors.config_checks import resolve_processor
    from omni_actors.engines.base import BackendTask, StageFinal
    from omni_actors.engines.synthetic import SyntheticEngine
    from omni_actors.processors import default_input

    stages = sorted(config.stage_args, key=lambda s: s.stage_id)  # 0 thinker, 1 talker, 2 code2wav
    engines = [SyntheticEngine(s, config.deployment_of(s).synthetic, f"{s.name}-direct") for s in stages]
    for e in engines:
        await e.start()
    procs = [resolve_processor(s.custom_process_input_func) if s.custom_process_input_func
             else default_input for s in stages]
    request_sampling = {"max_tokens": max_tokens}

    async def one(i: int) -> bool:
        rid = f"direct-{i}-{uuid.uuid4().hex[:8]}"
        outputs: dict[int, dict[str, Any]] = {}
        for stage, engine, proc in zip(stages, engines, procs):
            upstream = {sid: outputs[sid] for sid in stage.engine_input_source}
            engine_input = proc(upstream, PROMPT, {})
            sampling = {**stage.default_sampling_params, **request_sampling}
            final = None
            async for ev in engine.generate(BackendTask(rid, engine_input, sampling, {})):
                if isinstance(ev, StageFinal):
                    final = ev
            if final is None:
                return False
            outputs[stage.stage_id] = final.outputs
        return "audio" in outputs[stages[-1].stage_id] and "text" in outputs[stages[0].stage_id]

    try:
        return await measure("direct", one, plan, warmup)
    finally:
        for e in engines:
            await e.shutdown()


# ------------------------------------------------------------------------ bridge

async def bench_bridge(admin_port: int, config, plan, warmup, max_tokens) -> dict[int, dict[str, Any]]:
    from thespian.actors import ActorSystem

    from omni_actors.actors.coordinator import COORDINATOR_NAME, CoordinatorActor
    from omni_actors.http.bridge import ActorBridge
    from omni_actors.http.types import OutputFinal, PipelineRequest, RequestDone, RequestFailed
    from omni_actors.system.leader import ACTOR_BASE

    # Attach to the leader's admin (its port is taken, so nothing new starts).
    # Never shutdown() this handle: that would stop the leader's whole system.
    asys = ActorSystem(ACTOR_BASE, {"Admin Port": admin_port})
    coordinator = asys.createActor(CoordinatorActor, globalName=COORDINATOR_NAME)
    bridge = ActorBridge(asys, coordinator, request_actors=config.deployment.request_actors)
    bridge.start(asyncio.get_running_loop())  # blocks briefly (WhoAmI + GetRoutes): fine here
    first_error: list[str] = []

    async def one(i: int) -> bool:
        req = PipelineRequest(f"bench-{i}-{uuid.uuid4().hex}", PROMPT, OUTPUT_TYPES,
                              {"max_tokens": max_tokens})
        finals = set()
        async for ev in bridge.submit(req):
            if isinstance(ev, OutputFinal):
                finals.add(ev.output_type)
            elif isinstance(ev, RequestDone):
                return finals == OUTPUT_TYPES
            elif isinstance(ev, RequestFailed):
                if not first_error:
                    first_error.append(f"{ev.status} {ev.type}: {ev.message}")
                    print(f"    request failed: {first_error[0]}", file=sys.stderr)
                return False
        return False

    try:
        return await measure("bridge", one, plan, warmup)
    finally:
        bridge.close()


# -------------------------------------------------------------------------- http

async def bench_http(base_url: str, model: str, plan, warmup, max_tokens) -> dict[int, dict[str, Any]]:
    import aiohttp

    limit = max(32, 2 * max(c for c, _ in plan))
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}],
            "modalities": ["text", "audio"], "audio": {"format": "wav"}, "max_tokens": max_tokens}
    url = base_url + "/chat/completions"
    first_error: list[str] = []

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit),
                                     timeout=aiohttp.ClientTimeout(total=120)) as session:
        async def one(i: int) -> bool:
            async with session.post(url, json=body) as resp:
                data = await resp.read()
                if resp.status != 200:
                    if not first_error:
                        first_error.append(f"HTTP {resp.status}: {data[:300]!r}")
                        print(f"    request failed: {first_error[0]}", file=sys.stderr)
                    return False
            msg = json.loads(data)["choices"][0]["message"]
            return bool(msg.get("audio", {}).get("data"))

        return await measure("http", one, plan, warmup)


# ----------------------------------------------------------------------- report

def derive(results: dict[str, dict[int, dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    """Overheads (actors minus direct, ms) and ratios (actors / direct) per concurrency."""
    out: dict[int, dict[str, Any]] = {}
    direct = results.get("direct", {})
    for conc, d in direct.items():
        row: dict[str, Any] = {}
        for mode in ("bridge", "http"):
            a = results.get(mode, {}).get(conc)
            if a is None:
                continue
            row[mode] = {
                "overhead_p50_ms": a["p50_ms"] - d["p50_ms"],
                "overhead_p99_ms": a["p99_ms"] - d["p99_ms"],
                "latency_ratio_p50": a["p50_ms"] / d["p50_ms"] if d["p50_ms"] else float("nan"),
                "latency_ratio_p99": a["p99_ms"] / d["p99_ms"] if d["p99_ms"] else float("nan"),
                "throughput_ratio": a["rps"] / d["rps"] if d["rps"] else float("nan"),
            }
        out[conc] = row
    return out


def print_report(results, derived, plan) -> None:
    print()
    print("== results (latency per request; throughput over the measured requests) ==")
    header = f"{'mode':<17}{'c':>4}{'n':>6}{'p50 ms':>10}{'p99 ms':>10}{'mean ms':>10}{'req/s':>10}{'fail':>6}"
    print(header)
    print("-" * len(header))
    for conc, _ in plan:
        for mode in MODES:
            r = results.get(mode, {}).get(conc)
            if r is None:
                continue
            print(f"{LABELS[mode]:<17}{conc:>4}{r['n']:>6}{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}"
                  f"{r['mean_ms']:>10.2f}{r['rps']:>10.1f}{r['failures']:>6}")
    print()
    print("== orchestration overhead vs direct ==")
    header = (f"{'mode':<17}{'c':>4}{'+p50 ms':>10}{'+p99 ms':>10}{'lat x p50':>11}{'lat x p99':>11}"
              f"{'thru x':>9}")
    print(header)
    print("-" * len(header))
    for conc, _ in plan:
        for mode in ("bridge", "http"):
            o = derived.get(conc, {}).get(mode)
            if o is None:
                continue
            print(f"{LABELS[mode]:<17}{conc:>4}{o['overhead_p50_ms']:>10.2f}{o['overhead_p99_ms']:>10.2f}"
                  f"{o['latency_ratio_p50']:>10.1f}x{o['latency_ratio_p99']:>10.1f}x"
                  f"{o['throughput_ratio']:>8.3f}x")
    print()
    for conc, _ in plan:
        d = results.get("direct", {}).get(conc)
        for mode in ("bridge", "http"):
            a = results.get(mode, {}).get(conc)
            o = derived.get(conc, {}).get(mode)
            if d is None or a is None or o is None:
                continue
            print(f"c={conc}: {LABELS[mode]} {a['rps']:.0f} req/s vs direct {d['rps']:.0f} req/s = "
                  f"{o['throughput_ratio']:.2f}x; overhead p50 {o['overhead_p50_ms']:.1f} ms "
                  f"p99 {o['overhead_p99_ms']:.1f} ms")


# ------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="pipeline config (default: %(default)s)")
    p.add_argument("--requests", type=int, default=200,
                   help="measured requests at c=1; each higher concurrency gets twice as many "
                        "(default: %(default)s)")
    p.add_argument("--warmup", type=int, default=20, help="warm-up requests per run (default: %(default)s)")
    p.add_argument("--concurrency", default="1,16", help="comma-separated levels (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=8, help="thinker tokens per request (default: %(default)s)")
    p.add_argument("--modes", default=",".join(MODES),
                   help="which of direct,bridge,http to run (default: all)")
    p.add_argument("--json", metavar="FILE", help="also write the figures to FILE as JSON")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.concurrency or min(args.concurrency) < 1 or args.requests < 1:
        p.error(f"bad --modes {bad}" if bad else "concurrency levels and --requests must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from omni_actors.config import load_config
    from omni_actors.system.local import LocalLeader

    config = load_config(args.config)
    plan = [(c, args.requests if c == 1 else 2 * args.requests) for c in args.concurrency]
    print(f"config {args.config}: stages "
          + " -> ".join(s.name for s in sorted(config.stage_args, key=lambda s: s.stage_id))
          + f"; output types {sorted(OUTPUT_TYPES)}; max_tokens {args.max_tokens}; "
          f"plan {', '.join(f'c={c} n={n}' for c, n in plan)}; warm-up {args.warmup}; "
          f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}", flush=True)
    results: dict[str, dict[int, dict[str, Any]]] = {}
    t_start = time.perf_counter()
    startup_s = None

    if "direct" in args.modes:
        results["direct"] = asyncio.run(bench_direct(config, plan, args.warmup, args.max_tokens))
    if "bridge" in args.modes or "http" in args.modes:
        t0 = time.perf_counter()
        with LocalLeader(args.config) as leader:
            startup_s = time.perf_counter() - t0
            print(f"  leader up in {startup_s:.1f} s (HTTP {leader.base_url}, admin port {leader.admin_port})",
                  flush=True)
            if "bridge" in args.modes:
                results["bridge"] = asyncio.run(
                    bench_bridge(leader.admin_port, config, plan, args.warmup, args.max_tokens))
            if "http" in args.modes:
                results["http"] = asyncio.run(
                    bench_http(leader.base_url, config.deployment.served_model_name, plan,
                               args.warmup, args.max_tokens))
        print(f"  leader stopped: exit code {leader.exit_code}"
              + (f"; processes it left (killed): {leader.left_after_exit}" if leader.left_after_exit else ""),
              flush=True)

    derived = derive(results)
    print_report(results, derived, plan)
    total_s = time.perf_counter() - t_start
    print(f"\n(total {total_s:.1f} s; load average now {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs: "
          "other work on the machine inflates the actor figures)")
    if args.json:
        doc = {"config": args.config, "output_types": sorted(OUTPUT_TYPES), "max_tokens": args.max_tokens,
               "warmup": args.warmup, "cpus": os.cpu_count(), "loadavg_end": os.getloadavg()[0], "leader_startup_s": startup_s,
               "total_s": total_s,
               "results": {m: {str(c): r for c, r in by_c.items()} for m, by_c in results.items()},
               "overhead": {str(c): row for c, row in derived.items()}}
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")
    failures = sum(r["failures"] for by_c in results.values() for r in by_c.values())
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
