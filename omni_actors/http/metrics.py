"""Prometheus metrics for the API server: ``GET /metrics``.

Two sources, one per-app :class:`~prometheus_client.CollectorRegistry` (never
the global one, so several apps in one process do not clash):

- **per request**, measured here in the API server: end-to-end latency and
  time to first text, as histograms, and a request counter, labelled by
  ``endpoint`` and HTTP ``status`` (``499`` when the client went away);
- **per stage and replica**, from the bridge's stage table
  (``await bridge.stages()``, see ``omni_actors.http.bridge.status_to_dict``):
  fetched by the ``/metrics`` handler on each scrape and handed to a
  synchronous custom collector. When the bridge does not answer, the scrape
  still succeeds with the request metrics and ``omni_scrape_error 1``.

Metric names:

======================================  =========  ==========================================
``omni_request_latency_seconds``        histogram  ``endpoint``, ``status``
``omni_request_ttft_seconds``           histogram  ``endpoint``, ``stream``
``omni_requests_total``                 counter    ``endpoint``, ``status``
``omni_scrape_error``                   gauge      1 when the stage table could not be read
``omni_replica_state``                  gauge      ``stage``, ``replica``, ``state``: 1 or 0
``omni_replica_info``                   gauge (1)  ``stage``, ``replica``, ``state``, ``reason``,
                                                   ``pid``, ``node``, ``devices``, ``backend``
                                                   (``reason`` without clock times and countdowns:
                                                   :func:`label_reason`)
``omni_replica_in_flight``              gauge      ``stage``, ``replica``
``omni_replica_queue_depth``            gauge      (engine's waiting requests)
``omni_replica_running``                gauge
``omni_replica_rate``                   gauge      tokens / frames / items per second
``omni_replica_kv_cache_usage``         gauge      only for replicas that report it
``omni_replica_last_heartbeat_age_seconds`` gauge  only when known, and not for replicas that
                                                   have no process (stopped, failed, pending)
``omni_replica_tasks_completed_total``  counter
``omni_replica_tasks_failed_total``     counter
``omni_replica_restarts_total``         counter
``omni_stage_task_latency_seconds``     histogram  ``stage``, ``replica``
``omni_stage_pending_tasks``            gauge      ``stage``
``omni_stage_ready_replicas``           gauge      ``stage``
``omni_stage_restarts_total``           counter    ``stage`` (times its pool was recreated)
``omni_node_up``                        gauge      ``node``: 1 alive, 0 left or lost
``omni_node_buffers``                   gauge      ``node``: shared-memory buffers in use there
``omni_node_free_buffers``              gauge      ``node``: free (recycled) buffers kept there
``omni_node_free_bytes``                gauge      ``node``: their bytes (the buffer figures only
                                                   for alive nodes that reported them)
``omni_node_data_service_silent_seconds`` gauge    ``node``: how long its data service has not
                                                   answered (0 while it answers; alive nodes)
``omni_request_actors``                 gauge      RequestActors of this API server (busy and idle)
``omni_request_actors_busy``            gauge      those running a request (or being made)
``omni_request_actors_max``             gauge      the most it keeps (``request_actors``)
``omni_request_queue_wait_seconds``     histogram  time requests waited for a free RequestActor
``omni_request_queue_depth``            gauge      requests waiting for a free RequestActor
``omni_requests_rejected_total``        counter    requests refused with 429 (queue full)
======================================  =========  ==========================================
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from typing import Any, Awaitable, Callable, Iterable

from aiohttp import web
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram,
                               generate_latest)
from prometheus_client.metrics_core import (CounterMetricFamily, GaugeMetricFamily,
                                            HistogramMetricFamily, InfoMetricFamily, Metric)
from prometheus_client.utils import floatToGoString

from omni_actors.http import protocol as P
from omni_actors.http.types import within
from omni_actors.messages import LATENCY_BUCKETS_S, ReplicaState

__all__ = ["CONTENT_TYPE_LATEST", "METRICS_KEY", "REQUEST_BUCKETS_S", "STAGES_TIMEOUT_S", "Metrics",
           "StageCollector", "first_text", "label_reason", "set_outcome", "timed"]

#: Request latency / TTFT histogram bounds (seconds): 1 ms .. 300 s (the default
#: ``request_timeout_s``: long audio and image requests, and timeouts, fell in +Inf), then +Inf.
REQUEST_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0, 20.0, 30.0, 60.0, 120.0, 180.0, 300.0, float("inf"))
#: How long a scrape waits for the stage table (Prometheus' default scrape timeout is 10 s).
STAGES_TIMEOUT_S = 3.0
#: Longer ``reason`` strings are cut in the ``omni_replica_info`` label.
MAX_REASON_CHARS = 200
#: Status recorded for a request whose client went away (as nginx does).
CLIENT_CLOSED = 499

_STATES = tuple(s.value for s in ReplicaState)
#: States of a replica without a process: a heartbeat age would only grow (a trial's alert on
#: it fired for drained replicas), and its rate and KV-cache usage are its last process's (a
#: code review: a dead pool's replicas showed their throughput for the whole restart back-off).
_NO_PROCESS = (ReplicaState.STOPPED.value, ReplicaState.FAILED.value, ReplicaState.PENDING.value,
               ReplicaState.DEAD.value)
_RL = ("stage", "replica")

METRICS_KEY: web.AppKey["Metrics"] = web.AppKey("metrics", object)
_T0: web.RequestKey[float] = web.RequestKey("metrics_t0", float)
_STATUS: web.RequestKey[int] = web.RequestKey("metrics_status", int)
#: set once a request is counted (its handler ran under :func:`timed`)
_COUNTED: web.RequestKey[bool] = web.RequestKey("metrics_counted", bool)
#: The outcome status :func:`set_outcome` recorded (a stream that failed after its 200 header).
OUTCOME_KEY = _STATUS
_TTFT_SEEN: web.RequestKey[bool] = web.RequestKey("metrics_ttft_seen", bool)


def _log() -> Any:
    from omni_actors.logs import get_logger

    return get_logger(component="metrics")


def _s(value: Any) -> str:
    """A label value: ``None`` -> ``""``; lists joined by commas."""
    if value is None:
        return ""
    text = ",".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)
    # (a lone surrogate, as Python decodes a file name's bad bytes in an engine's error, made the
    # whole scrape a 500: a code review)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


#: What :func:`label_reason` cuts: a clock time (``at 17:53:48 UTC``, ``(at 17:54:48 UTC)``) and a
#: countdown (``restarting in 8 s``, ``next try in 60 s``; not a window such as ``5 restarts in 300 s``).
_CLOCK = re.compile(r" ?\(at \d{1,2}:\d{2}(?::\d{2})?(?: UTC)?\)| at \d{1,2}:\d{2}(?::\d{2})?(?: UTC)?")
_COUNTDOWN = re.compile(r"\b(restarting|next try|starts) in \d+(?:\.\d+)? s\b")


def label_reason(reason: str) -> str:
    """A replica's reason as the ``omni_replica_info`` label: without the clock times and
    countdowns that ``status`` shows (``restarted at 17:53:48 UTC``, ``restarting in 8 s``:
    trial CK, a new series at each restart and each second of a back-off), cut to
    :data:`MAX_REASON_CHARS`."""
    return _COUNTDOWN.sub(r"\1", _CLOCK.sub("", reason))[:MAX_REASON_CHARS]


class StageCollector:
    """Custom collector over one stage-table snapshot.

    Collectors are synchronous, so the ``/metrics`` handler fetches the table
    first and calls :meth:`Metrics.render`, which sets :attr:`families` and
    generates the text in one synchronous step.
    """

    def __init__(self) -> None:
        self.families: list[Metric] = []
        self.error = False

    def describe(self) -> Iterable[Metric]:  # nothing fixed up front: names depend on the table
        return []

    def collect(self) -> Iterable[Metric]:
        yield GaugeMetricFamily("omni_scrape_error",
                                "1 when the stage table could not be read from the actor system "
                                "during this scrape", value=1 if self.error else 0)
        yield from self.families


def stage_families(table: dict[str, Any]) -> list[Metric]:
    """The stage table (``status_to_dict`` shape) as metric families. Raises
    on a table of the wrong shape."""
    state = GaugeMetricFamily("omni_replica_state", "Replica lifecycle state: 1 for the current "
                              "state, 0 for the others", labels=(*_RL, "state"))
    info = InfoMetricFamily("omni_replica", "Replica state, why it is in it, and where it runs",
                            labels=(*_RL, "state", "reason", "pid", "node", "devices", "backend"))
    in_flight = GaugeMetricFamily("omni_replica_in_flight", "Tasks dispatched to the replica "
                                  "and not yet finished", labels=_RL)
    queue = GaugeMetricFamily("omni_replica_queue_depth", "Requests waiting in the replica's "
                              "engine (last heartbeat)", labels=_RL)
    running = GaugeMetricFamily("omni_replica_running", "Requests running in the replica's "
                                "engine (last heartbeat)", labels=_RL)
    rate = GaugeMetricFamily("omni_replica_rate",
                             "Replica throughput: tokens (or outputs, for a stage that makes none) per second", labels=_RL)
    kv = GaugeMetricFamily("omni_replica_kv_cache_usage",
                           "KV-cache usage, 0..1 (backends that report it)", labels=_RL)
    hb_age = GaugeMetricFamily("omni_replica_last_heartbeat_age_seconds",
                               "Seconds since the replica's last heartbeat (not for replicas stopped, "
                               "failed or pending: they have no process)", labels=_RL)
    completed = CounterMetricFamily("omni_replica_tasks_completed",
                                    "Stage tasks the replica completed", labels=_RL)
    failed = CounterMetricFamily("omni_replica_tasks_failed",
                                 "Stage tasks that failed on the replica, those it lost by dying, hanging or "
                                 "being isolated included (not counted: cancelled ones, and those failed on a "
                                 "client's bad input: a 400)", labels=_RL)
    restarts = CounterMetricFamily("omni_replica_restarts", "Times the replica was restarted",
                                   labels=_RL)
    latency = HistogramMetricFamily("omni_stage_task_latency_seconds",
                                    "Stage task latency on the replica", labels=_RL)
    pending = GaugeMetricFamily("omni_stage_pending_tasks",
                                "Stage tasks waiting for a ready replica", labels=("stage",))
    ready = GaugeMetricFamily("omni_stage_ready_replicas", "Replicas of the stage in state ready that take "
                              "new requests (not lingering)",
                              labels=("stage",))
    pool_restarts = CounterMetricFamily("omni_stage_restarts",
                                        "Times the stage's pool was recreated", labels=("stage",))
    bounds = [floatToGoString(b) for b in LATENCY_BUCKETS_S]
    for st in table["stages"]:
        stage = str(st["stage"])
        pending.add_metric([stage], float(st.get("pending") or 0))
        pool_restarts.add_metric([stage], float(st.get("restarts") or 0))
        n_ready = 0
        for r in st["replicas"]:
            labels = [stage, str(r["replica"])]
            current = _s(r.get("state"))
            n_ready += current == ReplicaState.READY.value and not r.get("lingering")
            for s in _STATES if current in _STATES else (*_STATES, current):
                state.add_metric([*labels, s], 1.0 if s == current else 0.0)
            fault = _s(r.get("fault"))  # (as the status table's REASON: a trial's info said "" meanwhile)
            reason = "; ".join(filter(None, (_s(r.get("reason")), fault and f"fault injected: {fault}")))
            reason = label_reason(reason)
            info.add_metric([*labels, current, reason, _s(r.get("pid")), _s(r.get("node")),
                             _s(r.get("devices")), _s(r.get("backend"))], {})
            in_flight.add_metric(labels, float(r.get("in_flight") or 0))
            queue.add_metric(labels, float(r.get("waiting") or 0))
            running.add_metric(labels, float(r.get("running") or 0))
            rate.add_metric(labels, float(r.get("rate") or 0) if current not in _NO_PROCESS else 0.0)
            if r.get("kv_cache_usage") is not None and current not in _NO_PROCESS:
                kv.add_metric(labels, float(r["kv_cache_usage"]))
            if r.get("last_heartbeat_age_s") is not None and current not in _NO_PROCESS:
                hb_age.add_metric(labels, float(r["last_heartbeat_age_s"]))
            completed.add_metric(labels, float(r.get("completed") or 0))
            failed.add_metric(labels, float(r.get("failed") or 0))
            restarts.add_metric(labels, float(r.get("restarts") or 0))
            counts = list(r.get("latency_buckets") or [0] * len(bounds))
            if len(counts) == len(bounds):  # per-bucket counts -> cumulative, as Prometheus wants
                cumulative, total = [], 0.0
                for le, n in zip(bounds, counts):
                    total += n
                    cumulative.append((le, total))
                latency.add_metric(labels, cumulative, float(r.get("latency_sum_s") or 0.0))
        ready.add_metric([stage], float(n_ready))
    return [state, info, in_flight, queue, running, rate, kv, hb_age, completed, failed, restarts,
            latency, pending, ready, pool_restarts, *node_families(table.get("nodes") or ())]


def node_families(nodes: Iterable[dict[str, Any]]) -> list[Metric]:
    """Each node's liveness and data-plane buffers (``status_to_dict``'s ``nodes``): a
    leak shows as ``omni_node_buffers`` that stays above 0 with no request in flight (a
    trial: only `status --json` had them)."""
    up = GaugeMetricFamily("omni_node_up", "1 while the node is alive, 0 once it left or was lost",
                           labels=("node",))
    buffers = GaugeMetricFamily("omni_node_buffers", "Shared-memory buffers in use on the node "
                                "(stage outputs not yet released)", labels=("node",))
    free = GaugeMetricFamily("omni_node_free_buffers", "Free (recycled) shared-memory buffers kept "
                             "on the node for later outputs", labels=("node",))
    free_bytes = GaugeMetricFamily("omni_node_free_bytes", "Bytes of the node's free buffers",
                                   labels=("node",))
    silent = GaugeMetricFamily("omni_node_data_service_silent_seconds", "Seconds the node's data service has "
                               "not answered its node agent (0 while it answers; only once past a few heartbeat "
                               "intervals): stage outputs made there cannot be fetched from other hosts meanwhile",
                               labels=("node",))
    for n in nodes:
        labels = [_s(n.get("name"))]
        up.add_metric(labels, 1.0 if n.get("alive") else 0.0)
        if not n.get("alive"):
            continue
        silent.add_metric(labels, float(n.get("data_service_silent_s") or 0.0))
        for family, key in ((buffers, "buffers"), (free, "free_buffers"), (free_bytes, "free_bytes")):
            if n.get(key) is not None:
                family.add_metric(labels, float(n[key]))
    return [up, buffers, free, free_bytes, silent]


class Metrics:
    """One app's metrics: its registry, request metrics and stage collector."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.request_latency = Histogram(
            "omni_request_latency_seconds", "End-to-end request latency in the API server",
            ("endpoint", "status"), buckets=REQUEST_BUCKETS_S, registry=self.registry)
        self.ttft = Histogram(
            "omni_request_ttft_seconds", "Time from request arrival to the first text: with "
            "stream=\"true\" the first content delta sent (TTFT); with stream=\"false\" the whole "
            "text received (the engines send no deltas for a request that does not stream)",
            ("endpoint", "stream"), buckets=REQUEST_BUCKETS_S, registry=self.registry)
        self.requests = Counter("omni_requests_total", "Requests answered, by endpoint and status",
                                ("endpoint", "status"), registry=self.registry)
        self.stages = StageCollector()
        self.registry.register(self.stages)
        self._lock = threading.Lock()

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        self.request_latency.labels(endpoint, str(status)).observe(seconds)
        self.requests.labels(endpoint, str(status)).inc()

    async def fetch(self, bridge: Any, timeout_s: float | None = None) -> dict[str, Any] | None:
        """The bridge's stage table, or ``None`` when it raises or times out."""
        try:
            return await within(bridge.stages(), STAGES_TIMEOUT_S if timeout_s is None
                                          else timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a scrape must still answer
            _log().warning("metrics_stages_failed", error=repr(exc))
            return None

    def render(self, table: dict[str, Any] | None) -> bytes:
        """Prometheus text for the request metrics plus ``table`` (``None``: scrape error)."""
        try:
            families = [] if table is None else stage_families(table)
            error = table is None
        except Exception as exc:  # noqa: BLE001 - a malformed table is a scrape error, not a 500
            _log().warning("metrics_stage_table_malformed", error=repr(exc))
            families, error = [], True
        with self._lock:
            self.stages.families, self.stages.error = families, error
            try:
                return generate_latest(self.registry)
            finally:
                self.stages.families = []


# ------------------------------------------------------- request timing hooks

def timed(endpoint: str, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
          ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """Wrap a handler: record its latency and outcome status under ``endpoint``.

    The status is the response's, or the one :func:`set_outcome` set (a
    stream that fails after its 200 header), or the error's; ``499`` when the
    client went away.
    """

    async def wrapped(request: web.Request) -> web.StreamResponse:
        t0 = time.perf_counter()
        request[_T0] = t0
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except P.ApiError as e:
            status = e.status
            raise
        except web.HTTPException as e:
            status = e.status
            raise
        except (ConnectionResetError, asyncio.CancelledError):
            status = CLIENT_CLOSED
            raise
        finally:
            status = request.get(_STATUS, status)
            request[_COUNTED] = True
            metrics = request.app.get(METRICS_KEY)
            if metrics is not None:
                metrics.observe_request(endpoint, status, time.perf_counter() - t0)

    wrapped.__name__ = getattr(handler, "__name__", "handler")
    wrapped.__doc__ = handler.__doc__
    return wrapped


def count_refused(request: web.Request, endpoint: str, status: int, took_s: float) -> None:
    """Count a request to ``endpoint`` answered before its handler ran (a 401 of the API key
    check, a 503 while the server stops): a code review found them in the log only."""
    if not request.get(_COUNTED):
        request[_COUNTED] = True
        metrics = request.app.get(METRICS_KEY)
        if metrics is not None:
            metrics.observe_request(endpoint, status, took_s)


def set_outcome(request: web.Request, status: int) -> None:
    """Record ``status`` for a request whose HTTP status is already sent (a stream)."""
    request[_STATUS] = status


def first_text(request: web.Request, endpoint: str, stream: bool) -> None:
    """Record the time to first text, once per request."""
    if request.get(_TTFT_SEEN) or _T0 not in request:
        return
    request[_TTFT_SEEN] = True
    metrics = request.app.get(METRICS_KEY)
    if metrics is not None:
        metrics.ttft.labels(endpoint, "true" if stream else "false").observe(
            time.perf_counter() - request[_T0])


def queue_wait_histogram() -> Histogram:
    """``omni_request_queue_wait_seconds`` in a registry of its own: the bridge observes it,
    :class:`RequestActorCollector` exports it."""
    return Histogram("omni_request_queue_wait_seconds", "How long requests waited in the API server for a "
                     "free RequestActor (those refused with 429, or whose deadline passed while waiting, "
                     "not included)", buckets=REQUEST_BUCKETS_S, registry=CollectorRegistry())


class RequestActorCollector:
    """``omni_request_actors*`` and ``omni_request_queue_depth`` from
    ``bridge.request_actors()`` (a bridge without it adds nothing)."""

    def __init__(self, bridge: Any) -> None:
        self.bridge = bridge

    def describe(self) -> list:
        return []

    def collect(self):
        stats = getattr(self.bridge, "request_actors", None)
        if not callable(stats):
            return
        s = stats()
        yield GaugeMetricFamily("omni_request_actors", "RequestActors of this API server (processes, "
                                "busy and idle)", value=s["total"])
        yield GaugeMetricFamily("omni_request_actors_busy", "RequestActors of this API server running "
                                "a request (or being made)", value=s["busy"])
        yield GaugeMetricFamily("omni_request_actors_closing", "Busy RequestActors whose request is over, "
                                "waiting for its stages to confirm their cancels", value=s.get("closing", 0))
        yield GaugeMetricFamily("omni_request_actors_max", "The most RequestActors this API server keeps "
                                "(request_actors)", value=s["max"])
        yield GaugeMetricFamily("omni_request_queue_depth", "Requests waiting for a free RequestActor",
                                value=s["queued"])
        yield CounterMetricFamily("omni_requests_rejected", "Requests refused with 429: every RequestActor "
                                  "busy and the queue full", value=s["rejected"])
        waits = getattr(self.bridge, "queue_waits", None)
        if callable(waits):
            yield from waits()
