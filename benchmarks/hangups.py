"""Clients that hang up at once: what they cost the clients that wait for their answers.

Two leaders of the CPU demo pipeline (``configs/cpu_omni_demo.yaml``), one
after the other in one run:

- **hold** (the default): a RequestActor whose request ended with stages still
  running (here: its client hung up) answers at once but takes no new request
  until those stages confirm their cancels
  (:data:`~omni_actors.actors.request.CANCEL_CONFIRM_S` at most), so
  abandoned work stays within ``request_actors``;
- **no hold** (``OMNI_ACTORS_CANCEL_CONFIRM_S=0``): it is free at once, as
  before that change: each hang-up makes room for the next request while its
  cancels are still on their way.

On each, for ``--seconds``: ``--storm`` clients send text + audio chat
completions (half of them streamed) and hang up 1-40 ms into each, over and
over; ``--steady`` clients send text + audio requests and wait for their
answers. Printed per run: the steady clients' requests served, p50 / p99 /
max latency and errors; the storm's requests; the peak of the Thinker's tasks
in flight (its pool's figure, sampled every 0.2 s from ``/v1/stages``);
replica restarts; and, at the end, the ratios hold / no hold.

    python benchmarks/hangups.py
    python benchmarks/hangups.py --seconds 30 --storm 8 --steady 2 --json out.json

Every leader it starts is stopped, whatever happens. About a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # runnable as `python benchmarks/hangups.py` without installing
    sys.path.insert(0, str(REPO))

from omni_actors.actors.request import CANCEL_CONFIRM_ENV  # noqa: E402
from omni_actors.config import load_config  # noqa: E402
from omni_actors.system.local import LocalLeader  # noqa: E402

DEFAULT_CONFIG = REPO / "configs" / "cpu_omni_demo.yaml"


def _replicas(base_url: str) -> list[dict]:
    with urllib.request.urlopen(base_url + "/stages", timeout=10) as r:
        return [rep for stage in json.loads(r.read())["stages"] for rep in stage["replicas"]]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def _load(base_url: str, model: str, seconds: float, storm: int, steady: int, seed: int) -> dict:
    import aiohttp

    rng = random.Random(seed)
    stop_at = time.monotonic() + seconds
    latencies: list[float] = []
    errors: list[str] = []
    sent = [0]
    peak = {"in_flight": 0}

    def body(text: str, stream: bool) -> dict:
        return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 64,
                "modalities": ["text", "audio"], "stream": stream}

    async def hang_up(s, k):
        i = 0
        while time.monotonic() < stop_at:
            i += 1
            sent[0] += 1
            try:
                async with s.post(base_url + "/chat/completions", json=body(f"leave {k} {i}", rng.random() < 0.5),
                                  timeout=aiohttp.ClientTimeout(total=rng.uniform(0.001, 0.04))) as r:
                    await r.read()
            except (asyncio.TimeoutError, aiohttp.ClientError):
                pass

    async def wait_for_answers(s, k):
        i = 0
        while time.monotonic() < stop_at:
            i += 1
            t0 = time.monotonic()
            try:
                async with s.post(base_url + "/chat/completions", json=body(f"stay {k} {i}", False),
                                  timeout=aiohttp.ClientTimeout(total=120)) as r:
                    data = await r.json(content_type=None)
                    if r.status != 200:
                        errors.append(f"{r.status}: {str(data)[:120]}")
                        continue
            except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            latencies.append(time.monotonic() - t0)

    async def sample():
        loop = asyncio.get_running_loop()
        while time.monotonic() < stop_at + 2:
            reps = await loop.run_in_executor(None, _replicas, base_url)
            thinker = sum(r["in_flight"] for r in reps if r["replica"].startswith("thinker/"))
            peak["in_flight"] = max(peak["in_flight"], thinker)
            await asyncio.sleep(0.2)

    async with aiohttp.ClientSession() as s:
        await asyncio.gather(sample(), *(hang_up(s, k) for k in range(storm)),
                             *(wait_for_answers(s, k) for k in range(steady)))
    return {"steady_ok": len(latencies), "steady_errors": len(errors), "error_samples": errors[:3],
            "p50_ms": _ms(_percentile(latencies, 0.5)), "p99_ms": _ms(_percentile(latencies, 0.99)),
            "max_ms": _ms(max(latencies) if latencies else None),
            "mean_ms": _ms(statistics.fmean(latencies) if latencies else None),
            "storm_requests": sent[0], "thinker_in_flight_peak": peak["in_flight"]}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def run_one(config: Path, label: str, env: dict[str, str], args) -> dict:
    model = load_config(config).deployment.served_model_name
    leader = LocalLeader(config, env=env)
    try:
        leader.start()
        restarts = {r["replica"]: r["restarts"] for r in _replicas(leader.base_url)}
        result = asyncio.run(_load(leader.base_url, model, args.seconds, args.storm, args.steady, args.seed))
        deadline = time.monotonic() + 15  # (the storm's cancels settle)
        while time.monotonic() < deadline:
            reps = _replicas(leader.base_url)
            if not any(r["in_flight"] for r in reps):
                break
            time.sleep(0.2)
        result["left_in_flight"] = sum(r["in_flight"] for r in reps)
        result["restarts"] = sum(r["restarts"] - restarts.get(r["replica"], 0) for r in reps)
    finally:
        leader.stop()
    result["run"] = label
    return result


def _fmt(v) -> str:
    return "-" if v is None else f"{v:,}" if isinstance(v, int) else f"{v:,.1f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    p.add_argument("--seconds", type=float, default=20.0, help="load per run (default 20)")
    p.add_argument("--storm", type=int, default=8, help="clients that hang up 1-40 ms into each request (8)")
    p.add_argument("--steady", type=int, default=2, help="clients that wait for their answers (2)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)

    runs = [run_one(args.config, "hold", {}, args),
            run_one(args.config, "no hold", {CANCEL_CONFIRM_ENV: "0"}, args)]
    cols = [("steady ok", "steady_ok"), ("errors", "steady_errors"), ("p50 ms", "p50_ms"),
            ("p99 ms", "p99_ms"), ("max ms", "max_ms"), ("storm requests", "storm_requests"),
            ("Thinker in flight, peak", "thinker_in_flight_peak"), ("left in flight", "left_in_flight"),
            ("restarts", "restarts")]
    print(f"{args.storm} clients hanging up 1-40 ms into each request, {args.steady} waiting for answers, "
          f"{args.seconds:g} s per run ({args.config.name})")
    print("| run | " + " | ".join(c for c, _ in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for r in runs:
        print(f"| {r['run']} | " + " | ".join(_fmt(r[k]) for _, k in cols) + " |")
        for e in r["error_samples"]:
            print(f"    error ({r['run']}): {e}")
    hold, free = runs
    for key in ("p50_ms", "p99_ms", "thinker_in_flight_peak"):
        if hold[key] and free[key]:
            print(f"{key}: hold / no hold = {hold[key] / free[key]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(runs, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
