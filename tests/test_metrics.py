"""``GET /metrics``: Prometheus text from the API server.

Pure tests over a fake Bridge (the stage table built by the real
``status_to_dict``), parsed as Prometheus parses it; and one system test on
the real CPU demo pipeline.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from omni_actors.http.app import create_app
from omni_actors.http.bridge import status_to_dict
from omni_actors.http.metrics import REQUEST_BUCKETS_S
from omni_actors.http.types import (OutputFinal, OutputText, PipelineRequest, RequestDone,
                                    RequestFailed)
from omni_actors.messages import (LATENCY_BUCKETS_S, PoolState, ReplicaState, ReplicaStatus,
                                  SystemStatus)

MODEL = "fake-omni"
CHAT = "/v1/chat/completions"
IMAGES = "/v1/images/generations"
STATES = {s.value for s in ReplicaState}


def _buckets(by_bound: dict[float, int]) -> tuple[int, ...]:
    """Per-bucket (not cumulative) counts, as the pools report them."""
    return tuple(by_bound.get(b, 0) for b in LATENCY_BUCKETS_S)


INF = float("inf")


def status() -> SystemStatus:
    """Thinker 1 ready replica; talker one ready, one isolated; code2wav failed."""
    return SystemStatus("q0", MODEL, True, (
        PoolState(0, "thinker", (
            ReplicaStatus("thinker/0", ReplicaState.READY, in_flight=3, running=2, waiting=4,
                          completed=10, failed=1, pid=1234, node="node-a", devices="0",
                          backend="synthetic", restarts=1, rate=250.0, kv_cache_usage=0.25,
                          latency_buckets=_buckets({0.01: 2, 0.1: 5, 1.0: 2, INF: 1}),
                          latency_sum_s=42.5, last_heartbeat_age_s=0.3),
        ), pid=100, pending=2),
        PoolState(1, "talker", (
            ReplicaStatus("talker/0", ReplicaState.READY, completed=7, backend="synthetic", fault="slow x5",
                          latency_buckets=_buckets({0.05: 7}), latency_sum_s=0.2),
            ReplicaStatus("talker/1", ReplicaState.ISOLATED,
                          reason='missed 3 heartbeats "x"\nagain',
                          completed=3, failed=2, restarts=2),  # no histogram reported yet
        ), pid=101, restarts=1),
        PoolState(2, "code2wav", (
            ReplicaStatus("code2wav/0", ReplicaState.FAILED, reason="restarted too often",
                          last_heartbeat_age_s=95.0),
            ReplicaStatus("code2wav/1", ReplicaState.STOPPED, reason="drained on request",
                          last_heartbeat_age_s=99.0, devices="1"),
        ), pid=102),
    ), coordinator_pid=99)


class FakeBridge:
    """Chat with three deltas (``[slow]`` waits before the first), images;
    ``stages()`` per ``mode``: ``ok``, ``raise``, ``hang``, ``junk``."""

    def __init__(self, mode: str = "ok"):
        self.model_name = MODEL
        self.output_types = frozenset({"text", "audio", "image"})
        self.max_tokens_limit = 1024
        self.request_timeout_s = 30.0
        self.mode = mode

    async def submit(self, req: PipelineRequest):
        if "image" in req.output_types:
            yield OutputFinal(0, "image", {"image": np.zeros((8, 8, 3), np.uint8)})
            yield RequestDone(4, 0)
            return
        if "[slow]" in req.prompt:
            await asyncio.sleep(0.2)
        while "[forever]" in req.prompt:
            await asyncio.sleep(0.01)
            yield OutputText("tick ")
        if "[fail]" in req.prompt:
            yield RequestFailed(503, "no ready replica for stage thinker")
            return
        for piece in ("Hel", "lo ", "world"):
            yield OutputText(piece)
        if "[failmid]" in req.prompt:
            yield RequestFailed(500, "engine crashed")
            return
        yield OutputFinal(0, "text", {"text": "Hello world"})
        yield RequestDone(5, 3)

    async def cancel(self, request_id: str) -> None:
        pass

    async def stages(self):
        if self.mode == "raise":
            raise RuntimeError("coordinator gone")
        if self.mode == "hang":
            await asyncio.sleep(3600)
        if self.mode == "junk":
            return {"thinker": {"replicas": 1}}
        return status_to_dict(status())


def serve(bridge, body, **app_kwargs):
    async def main():
        server = TestServer(create_app(bridge, **app_kwargs), handler_cancellation=True)
        async with TestClient(server) as client:
            return await body(client)

    return asyncio.run(main())


def chat(content="hi", **extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


async def scrape(client, headers=None) -> dict:
    resp = await client.get("/metrics", headers=headers)
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/plain; version=")
    return {f.name: f for f in text_string_to_metric_families(await resp.text())}


def samples(families: dict, family: str, sample: str | None = None, **labels) -> list:
    """Samples of ``family`` (named ``sample``, if given) whose labels include ``labels``."""
    return [s for s in families[family].samples
            if (sample is None or s.name == sample)
            and all(s.labels.get(k) == v for k, v in labels.items())]


def value(families: dict, family: str, sample: str | None = None, **labels) -> float:
    found = samples(families, family, sample, **labels)
    assert len(found) == 1, (family, sample, labels, found)
    return found[0].value


def histogram(families: dict, family: str, **labels) -> tuple[list, float, float]:
    """(sorted ``(le, cumulative count)``, count, sum) of one histogram series."""
    buckets = sorted((float(s.labels["le"]), s.value)
                     for s in samples(families, family, family + "_bucket", **labels))
    return (buckets, value(families, family, family + "_count", **labels),
            value(families, family, family + "_sum", **labels))


def assert_cumulative(buckets, count):
    assert buckets, "no buckets"
    assert buckets[-1][0] == float("inf") and buckets[-1][1] == count
    assert all(a[1] <= b[1] for a, b in zip(buckets, buckets[1:])), buckets


# ------------------------------------------------------------- stage table

def test_replica_state_info_gauges_and_counters():
    async def body(client):
        return await scrape(client)

    f = serve(FakeBridge(), body)
    assert value(f, "omni_scrape_error") == 0
    expect = {"thinker/0": "ready", "talker/0": "ready", "talker/1": "isolated",
              "code2wav/0": "failed"}
    for replica, current in expect.items():
        found = samples(f, "omni_replica_state", replica=replica)
        assert {s.labels["state"]: s.value for s in found} == {
            s: float(s == current) for s in STATES}, replica
        assert {s.labels["stage"] for s in found} == {replica.split("/")[0]}

    info = samples(f, "omni_replica_info", replica="talker/1")
    assert len(info) == 1 and info[0].value == 1
    assert info[0].labels["state"] == "isolated"
    assert info[0].labels["reason"] == 'missed 3 heartbeats "x"\nagain'  # escaped and read back
    (t0,) = samples(f, "omni_replica_info", replica="thinker/0")
    assert t0.labels == {"stage": "thinker", "replica": "thinker/0", "state": "ready", "reason": "",
                         "pid": "1234", "node": "node-a", "devices": "0", "backend": "synthetic"}
    assert value(f, "omni_replica_info", replica="code2wav/0") == 1
    (c0,) = samples(f, "omni_replica_info", replica="code2wav/0")
    assert c0.labels["reason"] == "restarted too often"
    (t0,) = samples(f, "omni_replica_info", replica="talker/0")
    assert t0.labels["reason"] == "fault injected: slow x5"  # (as the status table's REASON says)
    (c1,) = samples(f, "omni_replica_info", replica="code2wav/1")
    assert c1.labels["devices"] == ""  # (stopped: holds none, as DEVICES says; a trial read "1")

    r = {"stage": "thinker", "replica": "thinker/0"}
    assert value(f, "omni_replica_in_flight", **r) == 3
    assert value(f, "omni_replica_queue_depth", **r) == 4
    assert value(f, "omni_replica_running", **r) == 2
    assert value(f, "omni_replica_rate", **r) == 250
    assert value(f, "omni_replica_kv_cache_usage", **r) == 0.25
    assert value(f, "omni_replica_last_heartbeat_age_seconds", **r) == 0.3
    # (not for replicas without a process: a trial's "heartbeat too old" alert fired for drained ones)
    assert not samples(f, "omni_replica_last_heartbeat_age_seconds", replica="code2wav/0")
    assert not samples(f, "omni_replica_last_heartbeat_age_seconds", replica="code2wav/1")
    assert f["omni_replica_tasks_completed"].type == "counter"
    assert value(f, "omni_replica_tasks_completed", "omni_replica_tasks_completed_total", **r) == 10
    assert value(f, "omni_replica_tasks_failed", "omni_replica_tasks_failed_total", **r) == 1
    assert value(f, "omni_replica_restarts", "omni_replica_restarts_total", **r) == 1
    assert value(f, "omni_replica_tasks_completed", "omni_replica_tasks_completed_total",
                 replica="talker/1") == 3
    assert value(f, "omni_replica_tasks_failed", "omni_replica_tasks_failed_total",
                 replica="talker/1") == 2
    assert value(f, "omni_replica_restarts", "omni_replica_restarts_total", replica="talker/1") == 2
    # KV-cache usage only where known
    assert {s.labels["replica"] for s in samples(f, "omni_replica_kv_cache_usage")} == {"thinker/0"}

    assert value(f, "omni_stage_pending_tasks", stage="thinker") == 2
    assert value(f, "omni_stage_pending_tasks", stage="talker") == 0
    assert value(f, "omni_stage_ready_replicas", stage="talker") == 1
    assert value(f, "omni_stage_ready_replicas", stage="code2wav") == 0
    assert value(f, "omni_stage_restarts", "omni_stage_restarts_total", stage="talker") == 1


def test_the_stage_table_gives_held_devices_and_the_latency_bucket_bounds():
    """``/v1/stages``: a stopped replica holds no devices (its last ones are not shown
    as held); ``latency_buckets`` are per bucket of ``latency_bucket_bounds_s``, the last
    one above the last bound (a trial had to read the bounds off /metrics)."""
    table = status_to_dict(status())
    reps = {r["replica"]: r for st in table["stages"] for r in st["replicas"]}
    assert reps["thinker/0"]["devices"] == "0" and reps["code2wav/1"]["devices"] == ""
    assert table["latency_bucket_bounds_s"] == [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
    assert len(reps["thinker/0"]["latency_buckets"]) == len(table["latency_bucket_bounds_s"]) + 1
    assert reps["thinker/0"]["latency_buckets"][-1] == 1  # (the task that took over 30 s)
    json.dumps(table, allow_nan=False)  # (plain JSON: no Infinity)


def test_stage_latency_histogram_is_cumulative_per_replica():
    async def body(client):
        return await scrape(client)

    f = serve(FakeBridge(), body)
    assert f["omni_stage_task_latency_seconds"].type == "histogram"
    buckets, count, total = histogram(f, "omni_stage_task_latency_seconds", stage="thinker",
                                      replica="thinker/0")
    assert [b for b, _ in buckets] == list(LATENCY_BUCKETS_S)
    assert_cumulative(buckets, count)
    assert count == 10 and total == 42.5
    cum = dict(buckets)
    assert cum[0.005] == 0 and cum[0.01] == 2 and cum[0.05] == 2 and cum[0.1] == 7
    assert cum[1.0] == 9 and cum[30.0] == 9 and cum[float("inf")] == 10

    buckets, count, total = histogram(f, "omni_stage_task_latency_seconds", replica="talker/0")
    assert_cumulative(buckets, count)
    assert count == 7 and dict(buckets)[0.025] == 0 and dict(buckets)[0.05] == 7 and total == 0.2
    # a replica with no histogram yet: an empty one, not a gap
    buckets, count, total = histogram(f, "omni_stage_task_latency_seconds", replica="talker/1")
    assert count == 0 and total == 0 and all(v == 0 for _, v in buckets) and len(buckets) == 13


# ------------------------------------------------------------- per request

def test_request_latency_ttft_and_counter_after_chat_requests():
    async def body(client):
        before = await scrape(client)
        r = await client.post(CHAT, json=chat("[slow] hi"))
        assert r.status == 200
        assert (await r.json())["choices"][0]["message"]["content"] == "Hello world"
        r = await client.post(CHAT, json=chat("[slow] hi", stream=True))
        assert r.status == 200
        assert "[DONE]" in await r.text()
        r = await client.post(CHAT, json=chat("[fail]"))
        assert r.status == 503
        r = await client.post(CHAT, json=chat(stream=True, content="[failmid]"))
        assert r.status == 200 and "engine crashed" in await r.text()
        r = await client.post(CHAT, json={"model": "nope", "messages": []})
        assert r.status == 404
        r = await client.post(IMAGES, json={"model": MODEL, "prompt": "a cat", "size": "64x64"})
        assert r.status == 200
        return before, await scrape(client)

    before, f = serve(FakeBridge(), body)
    # nothing recorded before any request, and both histograms are declared
    assert not samples(before, "omni_request_latency_seconds")
    assert not samples(before, "omni_requests")
    assert f["omni_request_latency_seconds"].type == "histogram"
    assert f["omni_request_ttft_seconds"].type == "histogram"

    total = "omni_requests_total"
    assert value(f, "omni_requests", total, endpoint=CHAT, status="200") == 2
    assert value(f, "omni_requests", total, endpoint=CHAT, status="503") == 1
    assert value(f, "omni_requests", total, endpoint=CHAT, status="500") == 1  # failed mid-stream
    assert value(f, "omni_requests", total, endpoint=CHAT, status="404") == 1
    assert value(f, "omni_requests", total, endpoint=IMAGES, status="200") == 1

    buckets, count, s = histogram(f, "omni_request_latency_seconds", endpoint=CHAT, status="200")
    assert [b for b, _ in buckets] == list(REQUEST_BUCKETS_S)
    assert_cumulative(buckets, count)
    assert count == 2 and 0.4 <= s < 10  # two requests that each waited 0.2 s
    assert dict(buckets)[0.1] == 0 and dict(buckets)[60.0] == 2
    _, count, _ = histogram(f, "omni_request_latency_seconds", endpoint=IMAGES, status="200")
    assert count == 1

    for stream in ("false", "true"):
        buckets, count, s = histogram(f, "omni_request_ttft_seconds", endpoint=CHAT, stream=stream)
        assert_cumulative(buckets, count)
        # the ok request after 0.2 s; the stream that failed mid-way had its first text at once
        assert count == (1 if stream == "false" else 2), stream
        assert s >= 0.2
    _, _, ttft_sum = histogram(f, "omni_request_ttft_seconds", endpoint=CHAT, stream="false")
    _, _, lat_sum = histogram(f, "omni_request_latency_seconds", endpoint=CHAT, status="200")
    assert ttft_sum < lat_sum
    # no text on the images endpoint, no TTFT for it; the 503 had no text either
    assert {s.labels["endpoint"] for s in samples(f, "omni_request_ttft_seconds")} == {CHAT}


def test_client_gone_mid_stream_counts_as_499():
    async def body(client):
        r = await client.post(CHAT, json=chat("[forever]", stream=True))
        assert r.status == 200
        await r.content.readuntil(b"tick")
        r.close()
        for _ in range(200):
            f = await scrape(client)
            if samples(f, "omni_requests", "omni_requests_total", status="499"):
                return f
            await asyncio.sleep(0.01)
        return f

    from structlog.testing import capture_logs

    with capture_logs() as logs:
        f = serve(FakeBridge(), body)
    assert value(f, "omni_requests", "omni_requests_total", endpoint=CHAT, status="499") == 1
    assert not samples(f, "omni_requests", "omni_requests_total", status="200")
    # (trial CK: its access log line read `"error": null`)
    (line,) = [e for e in logs if e["event"] == "http_request" and e["status"] == 499]
    assert line["error"] == "the client closed the connection", line
    _, count, _ = histogram(f, "omni_request_ttft_seconds", endpoint=CHAT, stream="true")
    assert count == 1


def test_apps_in_one_process_have_their_own_registries():
    async def main():
        async with TestClient(TestServer(create_app(FakeBridge()))) as a, \
                TestClient(TestServer(create_app(FakeBridge()))) as b:
            assert (await a.post(CHAT, json=chat())).status == 200
            fa, fb = await scrape(a), await scrape(b)
            assert value(fa, "omni_requests", "omni_requests_total", endpoint=CHAT,
                         status="200") == 1
            assert not samples(fb, "omni_requests")

    asyncio.run(main())


# ---------------------------------------------------------- scrape failure

@pytest.mark.parametrize("mode", ["raise", "hang", "junk"])
def test_scrape_error_still_answers_with_request_metrics(mode, monkeypatch):
    monkeypatch.setattr("omni_actors.http.metrics.STAGES_TIMEOUT_S", 0.2)

    async def body(client):
        assert (await client.post(CHAT, json=chat())).status == 200
        t = time.monotonic()
        f = await scrape(client)
        return f, time.monotonic() - t

    f, took = serve(FakeBridge(mode), body)
    assert took < 2
    assert value(f, "omni_scrape_error") == 1
    assert value(f, "omni_requests", "omni_requests_total", endpoint=CHAT, status="200") == 1
    _, count, _ = histogram(f, "omni_request_latency_seconds", endpoint=CHAT, status="200")
    assert count == 1
    assert "omni_replica_state" not in f or not f["omni_replica_state"].samples


def test_metrics_requires_the_api_key_when_set_health_does_not():
    async def body(client):
        assert (await client.get("/health")).status == 200
        r = await client.get("/metrics")
        assert r.status == 401 and (await r.json())["error"]["type"] == "invalid_request_error"
        r = await client.get("/metrics", headers={"Authorization": "Bearer wrong"})
        assert r.status == 401
        return await scrape(client, {"Authorization": "Bearer sekret"})

    f = serve(FakeBridge(), body, api_key="sekret")
    assert value(f, "omni_scrape_error") == 0
    assert samples(f, "omni_replica_state")


def test_requests_refused_before_their_handler_runs_are_counted():
    """A code review: a chat refused by the API key check (401), or while the server stops
    (503), was in the access log only, not in ``omni_requests_total``; a GET of /v1/models
    refused the same way is still not counted (GETs never are)."""
    from omni_actors.http.app import refuse_new_requests

    async def body(client):
        assert (await client.post(CHAT, json=chat())).status == 401
        assert (await client.post(CHAT, json=chat(), headers={"Authorization": "Bearer wrong"})).status == 401
        assert (await client.get("/v1/models")).status == 401
        assert (await client.post(CHAT, json=chat(), headers={"Authorization": "Bearer k"})).status == 200
        refuse_new_requests(client.server.app)
        assert (await client.post(CHAT, json=chat(), headers={"Authorization": "Bearer k"})).status == 503
        return await scrape(client, {"Authorization": "Bearer k"})  # (/metrics: answered while it stops)

    f = serve(FakeBridge(), body, api_key="k")
    assert value(f, "omni_requests", "omni_requests_total", endpoint=CHAT, status="401") == 2
    assert value(f, "omni_requests", "omni_requests_total", endpoint=CHAT, status="200") == 1
    assert value(f, "omni_requests", "omni_requests_total", endpoint=CHAT, status="503") == 1
    assert {s.labels["endpoint"] for s in samples(f, "omni_requests", "omni_requests_total")} == {CHAT}


# ------------------------------------------------------------ real system

@pytest.mark.system
def test_each_node_says_whether_it_is_up_and_its_buffers_while_it_is():
    """A trial: a data-plane leak showed only in `status --json`; a node that left
    kept its last buffer figures there (not here: none for a node not alive)."""
    from prometheus_client.registry import Collector, CollectorRegistry

    from omni_actors.http.metrics import node_families

    nodes = [{"name": "leader", "alive": True, "buffers": 2, "free_buffers": 5, "free_bytes": 4 << 20},
             {"name": "m1", "alive": False, "buffers": 1, "free_buffers": 1, "free_bytes": 1 << 20},
             {"name": "m2", "alive": True, "buffers": None, "free_buffers": None, "free_bytes": None,
              "data_service_silent_s": 2.5}]

    class Nodes(Collector):
        def collect(self):
            return node_families(nodes)

    registry = CollectorRegistry()
    registry.register(Nodes())
    from prometheus_client import generate_latest
    f = {fam.name: fam for fam in text_string_to_metric_families(generate_latest(registry).decode())}
    assert {s.labels["node"]: s.value for s in samples(f, "omni_node_up")} == {"leader": 1, "m1": 0, "m2": 1}
    assert {s.labels["node"]: s.value for s in samples(f, "omni_node_buffers")} == {"leader": 2}
    assert value(f, "omni_node_free_buffers", node="leader") == 5
    assert value(f, "omni_node_free_bytes", node="leader") == 4 << 20
    # (trial CN: only `status` said a member's data service was silent; /metrics had it up and nothing else)
    assert {s.labels["node"]: s.value for s in samples(f, "omni_node_data_service_silent_seconds")} == \
        {"leader": 0.0, "m2": 2.5}


def test_metrics_on_the_real_pipeline(omni_leader):
    root = omni_leader.base_url.removesuffix("/v1")
    body = json.dumps({"model": "qwen3-omni-cpu-demo", "max_tokens": 8,
                       "modalities": ["text", "audio"],
                       "messages": [{"role": "user", "content": "Say something about the sea."}],
                       }).encode()
    req = urllib.request.Request(omni_leader.base_url + "/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
        assert json.loads(r.read())["choices"][0]["message"]["audio"]["data"]

    # Pools publish load figures once per heartbeat interval (1 s), so the counters
    # lag the request by up to that; other tests may have left a replica restarting.
    deadline = time.monotonic() + 30
    while True:
        with urllib.request.urlopen(root + "/metrics", timeout=10) as r:
            assert r.status == 200
            f = {fam.name: fam for fam in text_string_to_metric_families(r.read().decode())}
        ready = {s.labels["replica"]: s.value
                 for s in samples(f, "omni_replica_state", state="ready")}
        talkers = samples(f, "omni_replica_tasks_completed", "omni_replica_tasks_completed_total",
                          stage="talker")
        if (len(ready) == 4 and all(v == 1 for v in ready.values())
                and sum(s.value for s in talkers) >= 1) or time.monotonic() > deadline:
            break
        time.sleep(0.25)

    assert value(f, "omni_scrape_error") == 0
    assert ready == {"thinker/0": 1, "talker/0": 1, "talker/1": 1, "code2wav/0": 1}
    assert [s.value for s in samples(f, "omni_node_up")] == [1]  # (the leader's host, the only node)
    assert [s.value >= 0 for s in samples(f, "omni_node_buffers")] == [True]
    assert {s.labels["replica"] for s in talkers} == {"talker/0", "talker/1"}
    assert sum(s.value for s in talkers) >= 1
    assert value(f, "omni_request_latency_seconds", "omni_request_latency_seconds_count",
                 endpoint=CHAT, status="200") >= 1
    assert value(f, "omni_request_ttft_seconds", "omni_request_ttft_seconds_count",
                 endpoint=CHAT, stream="false") >= 1
    buckets, count, _ = histogram(f, "omni_stage_task_latency_seconds", replica="thinker/0")
    assert_cumulative(buckets, count)
    assert count >= 1
