"""Reaction to faults under load: time to isolation, time to full capacity, requests lost.

Runs each fault of ``tests/faults/`` once, on a fresh leader of the CPU demo
pipeline (``configs/cpu_omni_demo.yaml``: Thinker:Talker:Code2Wav 1:2:1,
heartbeat 1 s) under 8 concurrent HTTP clients (non-streaming text + audio
chat completions), with :func:`omni_actors.system.faultlab.run_scenario`.
Replica faults hit ``talker/0``; ``kill-pool`` the talker pool.

Prints a table (fault, injection -> isolation in ms, injection -> every
replica ready again in ms, requests ok / failed / lost / retried, what
isolated it), then the targets with PASS/FAIL:

- SIGKILL isolated in under 0.5 s;
- a hang (SIGSTOP) and a stall isolated in under 3 heartbeat intervals;
- zero requests lost (no request without an answer or with an unclear one);
- nothing left after stop (no process of the system, no shared-memory segment).

    python benchmarks/faults.py
    python benchmarks/faults.py --json faults.json

Exit status 1 when a target fails. About a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # runnable as `python benchmarks/faults.py` without installing
    sys.path.insert(0, str(REPO))

from omni_actors.config import load_config  # noqa: E402
from omni_actors.connectors import list_segments  # noqa: E402
from omni_actors.system.faultlab import run_scenario  # noqa: E402
from omni_actors.system.local import LocalLeader  # noqa: E402

DEFAULT_CONFIG = REPO / "configs" / "cpu_omni_demo.yaml"

#: (label, fault, scenario keyword arguments)
FAULTS = [
    ("sigkill", "sigkill", {}),
    ("sigstop (hang) + sigcont", "sigstop", {"follow_up": "sigcont"}),
    ("raise (next task)", "raise", {"count": 1, "expect_disturbance": False}),
    ("raise x5 (breaker)", "raise", {"count": 5, "max_wait_s": 4.0}),
    ("slow 5x", "slow", {"factor": 5.0, "expect_disturbance": False}),
    ("stall (heartbeating)", "stall", {}),
    ("kill-pool talker", "kill-pool", {"stage": "talker"}),
    ("kill-coordinator", "kill-coordinator", {}),
]


def _why(result) -> str:
    """What isolated the target, in a few words, from its first isolation event."""
    ev = next((e for e in result.events if e["t"] == result.isolated_at), None)
    if ev is None:
        return "-"
    reason = (ev.get("reason") or "").split(":")[0].split(";")[0]
    return ev["event"] + (f": {reason}" if reason else "")


def run_one(config: Path, label: str, fault: str, kwargs: dict, clients: int) -> dict:
    leader = LocalLeader(config)
    leader.start()
    try:
        r = run_scenario(leader, fault, clients=clients, **kwargs)
    finally:
        leader.stop()
    left = {"processes": leader.left_after_exit, "segments": list_segments(f"oa-{leader.admin_port}-", leader.shm_dir)}
    latencies = sorted(o.end - o.start for o in r.outcomes)
    return {"label": label, "fault": fault, "target": r.target,
            "isolation_ms": r.isolation_ms and round(r.isolation_ms, 1),
            "restore_ms": r.restore_ms and round(r.restore_ms, 1),
            "requests": len(r.outcomes), "ok": r.ok, "failed": r.failed, "lost": r.lost, "retried": r.retried,
            "failures": r.failures[:10], "isolated_by": _why(r), "target_states": r.target_states,
            "max_latency_s": round(latencies[-1], 3) if latencies else None,
            "follow_up": r.follow_up, "left_after_stop": left, "exit_code": leader.exit_code}


def _fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.0f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    p.add_argument("--clients", type=int, default=8, help="concurrent HTTP clients (default 8)")
    p.add_argument("--json", type=Path, default=None, help="also write the results to this file")
    args = p.parse_args(argv)
    heartbeat_s = load_config(args.config).deployment.heartbeat_interval_s

    t0 = time.monotonic()
    rows = []
    for label, fault, kwargs in FAULTS:
        print(f"... {label}", file=sys.stderr, flush=True)
        rows.append(run_one(args.config, label, fault, kwargs, args.clients))

    head = ("fault", "target", "isolation ms", "capacity ms", "ok", "failed", "lost", "retried", "isolated by")
    table = [head] + [(r["label"], r["target"], _fmt(r["isolation_ms"]), _fmt(r["restore_ms"]), str(r["ok"]),
                       str(r["failed"]), str(r["lost"]), str(r["retried"]), r["isolated_by"]) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    print(f"faults under load: {args.clients} clients, {args.config.name}, heartbeat {heartbeat_s:g} s")
    for row in table:
        print("  ".join(c.rjust(w) if 2 <= i <= 7 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
    for r in rows:
        for f in r["failures"][:3]:
            print(f"  {r['label']}: {f}")

    by = {r["fault"]: r for r in rows}
    limit_ms = 3 * heartbeat_s * 1000

    def under(row, ms):
        return row["isolation_ms"] is not None and row["isolation_ms"] < ms

    lost = sum(r["lost"] for r in rows)
    left = [f"{r['label']}: {r['left_after_stop']}" for r in rows
            if r["left_after_stop"]["processes"] or r["left_after_stop"]["segments"]]
    targets = [
        ("SIGKILL isolated in under 0.5 s", f"{_fmt(by['sigkill']['isolation_ms'])} ms",
         under(by["sigkill"], 500)),
        (f"hang (SIGSTOP) isolated in under 3 heartbeat intervals ({limit_ms / 1000:g} s)",
         f"{_fmt(by['sigstop']['isolation_ms'])} ms", under(by["sigstop"], limit_ms)),
        (f"stall isolated in under 3 heartbeat intervals ({limit_ms / 1000:g} s)",
         f"{_fmt(by['stall']['isolation_ms'])} ms", under(by["stall"], limit_ms)),
        ("zero requests lost", f"{lost} lost of {sum(r['requests'] for r in rows)}", lost == 0),
        ("nothing left after stop (processes, shared memory)", "; ".join(left) or "none", not left),
    ]
    print()
    for name, value, ok in targets:
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {value}")
    print(f"({time.monotonic() - t0:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({"clients": args.clients, "config": str(args.config),
                                         "heartbeat_interval_s": heartbeat_s, "faults": rows,
                                         "targets": [{"target": n, "value": v, "pass": ok}
                                                     for n, v, ok in targets]}, indent=2))
    return 0 if all(ok for _, _, ok in targets) else 1


if __name__ == "__main__":
    sys.exit(main())
