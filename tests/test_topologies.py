"""configs/topologies/: every GPU deployment loads and has a CPU twin with the same
graph and replica counts, and every CPU twin serves one request of its kind."""

from __future__ import annotations

import base64
import io
import json
import time
import urllib.request
import wave
from pathlib import Path

import pytest
from PIL import Image

from omni_actors.config import load_config
from omni_actors.system.local import LocalLeader

TOPOLOGIES = Path(__file__).resolve().parent.parent / "configs" / "topologies"
ALL = sorted(TOPOLOGIES.glob("*.yaml"))
CPU = [p for p in ALL if p.name.startswith("cpu_")]
GPU = [p for p in ALL if not p.name.startswith("cpu_")]


def _shape(path: Path) -> dict:
    cfg = load_config(path)
    return {s.name: (sorted(cfg.stage(i).name for i in s.engine_input_source),
                     cfg.deployment_of(s).replicas) for s in cfg.stage_args}


def test_the_shipped_topologies():
    names = {p.stem for p in GPU}
    assert names == {"qwen3_omni_1_1_1", "qwen3_omni_1_2_1", "qwen3_omni_1_2_2",
                     "hunyuan_image3_1_1", "hunyuan_image3_1_3", "ming_flash_omni_1_1",
                     "ming_flash_omni_1_4", "ming_flash_omni_imagegen_1_4", "glm_image_1_1"}
    assert {p.stem for p in CPU} == {f"cpu_{n}" for n in names}


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_loads(path):
    cfg = load_config(path)
    text = path.read_text()
    assert text.startswith("# "), "starts with a comment saying the topology"
    if path in GPU:
        assert "GPUs:" in text and "--convention-leader" in text and "--devices" in text
        assert {cfg.deployment_of(s).backend for s in cfg.stage_args} == {"vllm_omni"}
        assert all("/" in s.engine_args["model"] and not s.engine_args["model"].startswith("synthetic/")
                   for s in cfg.stage_args)
    else:
        for s in cfg.stage_args:
            dep = cfg.deployment_of(s)
            assert dep.backend == "synthetic" and dep.nodes == [] and dep.devices_per_replica == 1


@pytest.mark.parametrize("path", GPU, ids=lambda p: p.stem)
def test_gpu_config_has_a_cpu_twin_of_the_same_shape(path):
    assert _shape(path) == _shape(TOPOLOGIES / f"cpu_{path.name}")


def test_gpu_counts_and_placement_rules():
    def need(name):
        cfg = load_config(TOPOLOGIES / f"{name}.yaml")
        return sum(cfg.deployment_of(s).replicas * cfg.deployment_of(s).devices_per_replica
                   for s in cfg.stage_args)
    assert [need(n) for n in ("qwen3_omni_1_1_1", "qwen3_omni_1_2_1", "qwen3_omni_1_2_2")] == [3, 4, 5]
    assert need("hunyuan_image3_1_1") == 8 and need("hunyuan_image3_1_3") == 16
    assert need("ming_flash_omni_1_1") == 5 and need("ming_flash_omni_1_4") == 8
    assert need("ming_flash_omni_imagegen_1_4") == 8 and need("glm_image_1_1") == 2
    h = load_config(TOPOLOGIES / "hunyuan_image3_1_3.yaml").deployment.stages
    assert (h["AR"].nodes, h["AR"].devices_per_replica) == (["n0"], 4)
    assert (h["dit"].nodes, h["dit"].devices_per_replica, h["dit"].replicas) == (["n1", "n2", "n3"], 4, 3)
    for n in ("ming_flash_omni_1_1", "ming_flash_omni_1_4", "ming_flash_omni_imagegen_1_4"):
        assert load_config(TOPOLOGIES / f"{n}.yaml").deployment.stages["thinker"].devices_per_replica == 4


def _request(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, json.loads(r.read())


@pytest.mark.parametrize("path", CPU, ids=lambda p: p.stem)
def test_cpu_twin_serves(path):
    cfg = load_config(path)
    outputs = cfg.output_types()
    model = cfg.deployment.served_model_name
    leader = LocalLeader(path, start_timeout_s=30)
    t0 = time.monotonic()
    try:
        leader.start()
        if "image" in outputs:
            status, body = _request(leader.base_url + "/images/generations", {
                "model": model, "prompt": "a red lighthouse", "size": "64x64",
                "response_format": "b64_json"})
            assert status == 200
            png = base64.b64decode(body["data"][0]["b64_json"])
            assert png.startswith(b"\x89PNG")
            assert Image.open(io.BytesIO(png)).size == (64, 64)
        else:
            modalities = ["text", "audio"] if "audio" in outputs else ["text"]
            status, body = _request(leader.base_url + "/chat/completions", {
                "model": model, "messages": [{"role": "user", "content": "Tell me about the sea."}],
                "modalities": modalities, "max_tokens": 8})
            assert status == 200
            msg = body["choices"][0]["message"]
            assert msg["content"]
            if "audio" in outputs:
                with wave.open(io.BytesIO(base64.b64decode(msg["audio"]["data"]))) as w:
                    assert (w.getframerate(), w.getnchannels(), w.getsampwidth()) == (24000, 1, 2)
                    assert w.getnframes() > 0
        status, table = _request(leader.base_url + "/stages")
        assert status == 200
        seen = {st["stage"]: [r["state"] for r in st["replicas"]] for st in table["stages"]}
        want = {s.name: cfg.deployment_of(s).replicas for s in cfg.stage_args}
        assert {k: len(v) for k, v in seen.items()} == want
        assert all(state == "ready" for v in seen.values() for state in v), seen
    finally:
        leader.stop()
        print(f"{path.name}: {time.monotonic() - t0:.1f} s")
    assert leader.left_after_exit == []
