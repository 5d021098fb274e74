"""ActorBridge: the HTTP layer's link to the actor system.

Thespian's external API blocks, and one ``ActorSystem`` handle shared by
threads mixes up replies (seen here: 163 of 200 wrong). So the bridge runs its
threads, each owning its own ``private()`` context:

- the **sender** threads (``senders``, default 4) each drain a queue of
  outgoing work: they make RequestActors, start requests on them, and keep
  the map from request id to the RequestActor running it, for the requests
  hashed to them. A Thespian external ``tell`` waits for the receiver's
  acknowledgement (about 1.5 ms here), so one sender would start simultaneous
  requests one after another; several start them side by side;
- the **receiver** thread sits in ``listen()``; every message carries its
  ``request_id`` and is handed to the event loop with
  ``loop.call_soon_threadsafe``. Final outputs are fetched from their
  connector and released on this thread, so a buffer is freed even when the
  client has gone; those on another host, from its data service, on a
  **fetch** thread (:data:`FETCH_THREADS`), the request's later messages held
  until it is in: a member whose process was frozen held each fetch for
  10 s, and every other request, ``/ready`` too, waited behind it (trial CG);
  each host has threads of its own, so that one frozen host holds up only
  the outputs made there.

A request's messages come from two senders: its RequestActor (audio parts,
final outputs, the end) and the replica of its final text stage (text
deltas, straight from the engine, several requests' in one
:class:`~omni_actors.messages.OutputDeltas`, some of which the bridge answers
with a :class:`~omni_actors.messages.DeltasAck`, through its supervisor, for the
engine's flow control). Each sender numbers its own;
the receiver puts each series back in order, holds a final output or the end
until the text deltas it says came before it are in, and fails a request
whose text stage was retried after part of its text went out.

Neither thread ever runs on the event loop, so no handler blocks.

**How many RequestActors** (each is a process): the event loop counts them
(:class:`~omni_actors.http.admission.RequestActorPool`). At most ``request_actors`` exist (the
deployment's ``request_actors``, 16 by default, or the CLI's
``--request-actors``); ``min_request_actors`` of them are made at start and
kept. A request takes a free one, or has one made while fewer than the
maximum exist, or else waits in a FIFO queue of at most ``queue_limit``
requests (default 4 x the maximum) for one to come free, within its deadline
(504 when it passes first). With the queue full it is refused at once: HTTP
429 with ``Retry-After``. A RequestActor above the minimum that stays idle
``idle_exit_s`` (:data:`REQUEST_ACTOR_IDLE_EXIT_S`, 30 s) is told to exit, so
the process count comes back down after a burst. One whose request ended
with stages still running (``RequestFinished.free`` False) stays busy until
it says those stages confirmed their cancels (:class:`~omni_actors.messages.RequestActorFree`,
within :data:`~omni_actors.actors.request.CANCEL_CONFIRM_S`), so clients
that hang up cannot leave more cancelled work in the engines than there are
RequestActors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import queue
import re
import threading
import time
from typing import Any, AsyncIterator

from thespian.actors import ActorExitRequest

from omni_actors.actors.coordinator import COORDINATOR_NAME, CoordinatorActor
from omni_actors.balancing import no_replica_reason, none_on_its_way
from omni_actors.connectors import make_connector
from omni_actors.connectors.data_client import DataServiceError, forget_down, give_up, mark_down, probe_down
from omni_actors.http.types import (CONTEXT_LENGTH_CODE, BridgeEvent, OutputFinal, OutputPart, OutputText,
                                    PipelineRequest, RequestDone, RequestFailed, within)
from omni_actors.logs import get_logger
from omni_actors.messages import (LATENCY_BUCKETS_S, CancelRequest, CancelStage, DeltasAck, ErrorKind, GetRoutes,
                                  GetStatus, OutputChunk, OutputDelta, OutputDeltas, OutputReady, OutputsAck, Relay,
                                  RequestActorAlive, RequestActorExited, RequestActorFree, RequestFinished, Routes,
                                  RoutesChanged,
                                  PublicationsReceived, ReplicaState, RunRequest, Subscribe, SUBSCRIPTION,
                                  SupervisorAlive,
                                  SystemStatus, SystemStopping, Unsubscribe, WhoAmI, YouAre)
from omni_actors.http.admission import RETRY_AFTER_MIN_S, QueueFull, RequestActorPool, ShuttingDown
from omni_actors.http.request_actors import (LOST_AFTER_S, REQUEST_ACTOR_SILENT_S,  # noqa: F401 - (tests)
                                             RequestActorKeeping, _Held)
from omni_actors.planning import PlanError, plan_request

#: How often the bridge renews its subscription with the coordinator (a lease:
#: a coordinator restarted after a crash learns of us within this time).
SUBSCRIBE_EVERY_S = 2.0
#: Outbox items a sender thread relays through our RequestActorSupervisor (or sends to a
#: RequestActor or pool): one stuck on a stopped or hung supervisor is replaced, as a stuck
#: hand-over is (see RequestActorKeeping._unstick_senders).
_RELAYED = ("cancel", "abandon", "exit", "tell", "routes")
#: Seconds the receiver thread waits for one message before it looks at its other duties.
RECEIVE_LISTEN_S = 0.5
#: Seconds past a listen's that the receiver thread may take between two reads before it
#: counts as held up (a fetch from a vanished host, a slow subscription): see _tick.
RECEIVER_STALL_S = 1.0
#: Seconds a finished request waits for text deltas of its own that have not come before
#: it goes on without them: its final text carries what they did, and the HTTP layer sends
#: the part no delta carried. Deltas come straight from the replica, which keeps a few in
#: flight and holds the rest; killed with them held (trial BD: a SIGKILL 33 ms after the
#: request's end), they never come, and the stream hung until its client gave up.
TEXT_GAP_S = 3.0
#: A receiver turn this much later than the last one: the process did not run meanwhile
#: (frozen, starved), so the deltas on their way had no time to be read.
RECEIVER_PAUSED_S = 2.0
#: Seconds between two looks for such requests (the receiver turns on every message).
TEXT_GAP_CHECK_S = 0.25
#: Seconds the receiver thread waits for a data service taken for down to answer a probe, once
#: per time it is taken for down, before it fetches an output made there (see ActorBridge._take).
DATA_SERVICE_PROBE_S = 1.0
#: Threads per other host that fetch outputs from its data service (and send releases
#: there): each may wait its timeouts (10 s a get, from a host frozen or cut off).
FETCH_THREADS = 4
#: The coordinator's publications (routes, status) the bridge says it has, every this many
#: (:class:`PublicationsReceived`: half the coordinator's ``SUBSCRIBER_BACKLOG``).
PUBLICATIONS_ACK_EVERY = 4
#: RequestActors made at start and kept however long they idle (at most ``request_actors``).
DEFAULT_MIN_REQUEST_ACTORS = 4
#: Requests that may wait for a free RequestActor, per RequestActor allowed (``queue_limit`` default).
DEFAULT_QUEUE_PER_ACTOR = 4
#: A RequestActor above the minimum idle this long is told to exit (``idle_exit_s`` default).
REQUEST_ACTOR_IDLE_EXIT_S = 30.0
#: HTTP status for each way a request can fail.
HTTP_STATUS = {ErrorKind.UNAVAILABLE: 503, ErrorKind.TIMEOUT: 504, ErrorKind.ENGINE_ERROR: 500,
               ErrorKind.CRASHED: 500, ErrorKind.STAGE_INPUT: 500, ErrorKind.INPUT_LOST: 500,
               ErrorKind.BAD_REQUEST: 400, ErrorKind.CANCELLED: 499}

#: What the engines say when a prompt, with the tokens it must get, is over the model's
#: context length (vLLM's two messages, the synthetic engine's): that 400 gets OpenAI's
#: ``code`` for it (a trial's client found ``code`` and ``param`` null).
CONTEXT_LENGTH = re.compile(r"maximum context length|longer than the maximum model length"
                            r"|over the model's context length")


class BridgeError(RuntimeError):
    """The bridge could not reach the coordinator."""


@dataclasses.dataclass
class RequestRejected(RequestFailed):
    """The request was refused before it started: every RequestActor is busy and
    the queue for one is full. Answered as HTTP 429 with ``Retry-After``."""

    code: str | None = "rate_limit_exceeded"
    #: s (see :meth:`~omni_actors.http.admission.RequestActorPool.retry_after_s`): the
    #: ``Retry-After`` (whole seconds, rounded up) and ``retry-after-ms`` headers
    retry_after_s: float = RETRY_AFTER_MIN_S


@dataclasses.dataclass
class _Inbox:
    """One request's messages that came before their turn (receiver thread only)."""

    seq: int = 0  #: the next RequestActor message to deliver
    early: dict = dataclasses.field(default_factory=dict)  #: RequestActor messages by seq
    finished: RequestFinished | None = None  #: the end, waiting for outputs still on their way
    text_attempt: int = 0  #: the text stage's attempt whose deltas are delivered
    text_seq: int = 0  #: the next text delta of that attempt
    text_early: dict = dataclasses.field(default_factory=dict)  #: its deltas by seq
    #: (monotonic) since when its end has waited for text deltas that have not come (see
    #: ``ActorBridge.check_text_gaps``); None: it does not wait for any
    gap_since: float | None = None
    #: an output is being fetched from another host on a fetch thread: what follows waits
    fetching: bool = False

    def after(self, after_text: tuple[int, int] | None) -> bool:
        """Whether the text deltas a message must follow are all delivered."""
        return after_text is None or (self.text_attempt == after_text[0] and self.text_seq >= after_text[1])


#: What each final output type must hold (see :class:`~omni_actors.http.types.OutputFinal`).
_FINAL_KEYS = {"text": ("text",), "audio": ("audio",), "image": ("image",)}


def _lane(ref) -> str:
    """Where ``ref`` is read from: its host's data service (a vLLM-Omni connector's: its kind)."""
    return ref.service or ref.kind


class _FetchLanes:
    """:data:`FETCH_THREADS` daemon threads per lane (another host's data service), started
    on its first use: a host frozen or cut off holds up the fetches and releases of what was
    made there only (a review: 8 threads for all hosts, each waiting out a frozen one's 10 s,
    held up every other host's outputs as well). Daemon: one that waits does not hold up the
    API server's exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lanes: dict[str, queue.SimpleQueue] = {}
        self._log = get_logger(actor="bridge")

    def submit(self, lane: str, fn, *args) -> None:
        with self._lock:
            work = self._lanes.get(lane)
            if work is None:
                work = self._lanes[lane] = queue.SimpleQueue()
                for i in range(FETCH_THREADS):
                    threading.Thread(target=self._run, args=(work,), name=f"bridge-fetch-{lane}-{i}",
                                     daemon=True).start()
        work.put((fn, args))

    def _run(self, work: queue.SimpleQueue) -> None:
        while (item := work.get()) is not None:
            fn, args = item
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - one fetch, not the lane
                self._log.exception("bridge_fetch_failed")

    def close(self) -> None:
        """Tell every thread to end once it is done with what it has."""
        with self._lock:
            for work in self._lanes.values():
                for _ in range(FETCH_THREADS):
                    work.put(None)


class ActorBridge(RequestActorKeeping):
    """Implements :class:`omni_actors.http.types.Bridge` over a running actor system.

    Args:
        asys: the process's ``ActorSystem`` (only ``private()`` contexts are used).
        coordinator: the CoordinatorActor's address.
        request_actors: the most RequestActors this bridge keeps at once (each is a
            process). Its callers pass the deployment's ``request_actors`` (16 by
            default) or the CLI's ``--request-actors``.
        connect_timeout_s: how long to wait for the coordinator at start.
        senders: sender threads (at most ``request_actors``; default 4, see above).
        min_request_actors: RequestActors made at start and kept however long they
            idle (default :data:`DEFAULT_MIN_REQUEST_ACTORS`, at most ``request_actors``).
        queue_limit: requests that may wait for a free RequestActor; one more is
            refused with HTTP 429 (default :data:`DEFAULT_QUEUE_PER_ACTOR` x
            ``request_actors``; 0: refuse whenever all are busy).
        idle_exit_s: a RequestActor above the minimum idle this long is told to exit
            (default :data:`REQUEST_ACTOR_IDLE_EXIT_S`).
        silent_s: a busy RequestActor not heard from for this long is written off and its
            request fails with a 500 (default :data:`REQUEST_ACTOR_SILENT_S`).

    Raises:
        BridgeError: from :meth:`start` when the coordinator does not answer.
        ValueError: bounds that make no sense (``request_actors`` < 1, ...).
    """

    def __init__(self, asys, coordinator, *, request_actors: int = 16, connect_timeout_s: float = 10.0,
                 senders: int = 4, min_request_actors: int | None = None, queue_limit: int | None = None,
                 idle_exit_s: float = REQUEST_ACTOR_IDLE_EXIT_S, silent_s: float = REQUEST_ACTOR_SILENT_S):
        self._asys = asys
        self._coordinator = coordinator
        self._connect_timeout_s = connect_timeout_s
        self._pool = RequestActorPool(
            request_actors,
            min(request_actors, DEFAULT_MIN_REQUEST_ACTORS) if min_request_actors is None else min_request_actors,
            DEFAULT_QUEUE_PER_ACTOR * request_actors if queue_limit is None else queue_limit,
            idle_exit_s)
        self._init_request_actors(silent_s, idle_exit_s)
        #: one queue per sender thread; a request's work always goes to the same one
        self._outboxes: list[queue.SimpleQueue] = [queue.SimpleQueue()
                                                   for _ in range(max(1, min(senders, request_actors)))]
        self._senders: list[threading.Thread] = []
        n = len(self._outboxes)
        #: per outbox: the generation of its current sender thread (a stuck one is replaced)
        self._sender_gen = [0] * n
        #: per outbox: (since, by _running_clock(), request id) while its sender hands a request over
        self._handing: list[tuple[float, str] | None] = [None] * n
        #: per outbox: request -> its RequestActor, and -> (pool, stage id) of its stages
        self._running: list[dict[str, Any]] = [{} for _ in range(n)]
        self._stages: list[dict[str, tuple]] = [{} for _ in range(n)]
        self._streams: dict[str, asyncio.Queue] = {}
        #: request -> what came early, and the requests that ended lately (receiver thread only)
        self._inbox: dict[str, _Inbox] = {}
        self._ended: dict[str, None] = {}  # (an ordered set: the oldest go past 4,096)
        self._queries: dict[str, asyncio.Future] = {}
        self._ids = itertools.count()
        self._connector = make_connector()
        #: held by the receiver thread for each message it handles, and by a fetch thread while it
        #: delivers what it fetched: the inboxes (``_inbox``, ``_ended``) are theirs alone
        self._boxes_lock = threading.RLock()
        self._fetcher = _FetchLanes()
        self._stop = threading.Event()
        self._log = get_logger(actor="bridge")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._address = None
        self._routes: Routes | None = None
        #: set when the coordinator says the system stops (:class:`SystemStopping`): an attached
        #: API server then drains and exits; ``system_drain_timeout_s`` is the drain it was given
        self.system_stopping = threading.Event()
        #: set when the leader was told a second time to stop: end the requests still running now
        self.system_hurry = threading.Event()
        self.system_drain_timeout_s: float | None = None
        #: when the receiver last found nothing to read for a whole listen (monotonic; see
        #: :meth:`inbound_settled`)
        self._quiet_at = 0.0
        self._gaps_checked_at = 0.0  # (monotonic) the last check_text_gaps
        self._publications = 0  #: the coordinator's publications that came since we last said so
        #: the stages' replicas as the coordinator last published them (on every state change)
        self._published: SystemStatus | None = None
        #: how long requests waited for a free RequestActor (the 429/504 ones are not in it),
        #: exported by the app's /metrics (``queue_waits``)
        from omni_actors.http.metrics import queue_wait_histogram

        self._waited = queue_wait_histogram()

    # -- lifecycle --------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the threads; blocks until the receiver knows its address and the routes.
        The first ``min_request_actors`` RequestActors are made in the background."""
        self._loop = loop
        ready = threading.Event()
        errors: list[str] = []
        self._receiver = threading.Thread(target=self._receive_loop, args=(ready, errors),
                                          name="bridge-recv", daemon=True)
        self._receiver.start()
        if not ready.wait(self._connect_timeout_s + 1) or errors:
            self._stop.set()
            raise BridgeError(errors[0] if errors else "coordinator did not answer")
        for i in range(len(self._outboxes)):
            self._start_sender(i)
        # No request can come before start() returns, so the pool is not in use yet.
        self._pool.reserve(self._pool.minimum)
        for i in range(self._pool.minimum):
            self._outboxes[i % len(self._outboxes)].put(("create",))
        loop.call_soon_threadsafe(self._tick)
        cfg = self._routes.config
        self.model_name = cfg.deployment.served_model_name
        self.created = self._routes.deployed_at
        self.output_types = frozenset(cfg.output_types())
        self.max_tokens_limit = cfg.deployment.max_tokens_limit
        self.request_timeout_s = cfg.deployment.request_timeout_s
        self._max_attempts = cfg.deployment.supervision.max_task_attempts

    def close(self) -> None:
        """Stop the threads. Our RequestActorSupervisor is told to exit first, ending
        our RequestActors with it: once the receiver's address is closed, whatever they
        sent to it would wait in their transmit queues, and an actor exits only after
        draining those (up to 7 s), which held up the actor system's shutdown."""
        self._stop.set()
        if self._senders and getattr(self, "_address", None) is not None:  # (so that a stop does not wait for us)
            self._outboxes[0].put(("coordinator", Unsubscribe(self._address)))
        if self._supervisor is not None and self._senders:
            self._outboxes[0].put(("exit", self._supervisor))
        for outbox in self._outboxes:
            outbox.put(None)
        for t in (*self._senders, getattr(self, "_receiver", None)):
            if t is not None:
                t.join(timeout=3)
        self._fetcher.close()  # (its threads end once what they have is sent or fails: daemons)

    def _outbox(self, request_id: str | None = None) -> queue.SimpleQueue:
        """The queue of the sender thread that owns ``request_id`` (None: any, the first)."""
        if request_id is None:
            return self._outboxes[0]
        return self._outboxes[hash(request_id) % len(self._outboxes)]

    # -- the Bridge protocol ----------------------------------------------
    async def submit(self, request: PipelineRequest) -> AsyncIterator[BridgeEvent]:
        """Run one request; yields events, ending with RequestDone or RequestFailed.

        It first waits for a RequestActor (see :class:`~omni_actors.http.admission.RequestActorPool`): refused
        at once with :class:`RequestRejected` (429) when the queue is full; 504 when
        its deadline passes while it waits. Time spent waiting counts towards the
        deadline."""
        try:
            plan = plan_request(self._routes.config, self._routes.pools, request.output_types)
        except PlanError as exc:
            yield RequestFailed(400, str(exc), "invalid_request_error")
            return
        refused = self._no_replica(plan)
        if refused is not None:  # refused here, before a stream could begin (as the pool would, later)
            yield RequestFailed(503, refused[0], code="service_unavailable", none_coming=refused[1])
            return
        timeout = request.timeout_s or self.request_timeout_s
        rid = request.request_id
        t0 = time.monotonic()
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[rid] = stream  # (a request waiting for a RequestActor is in flight too)
        started = finished = False
        try:
            try:
                actor = await self._pool.acquire(timeout, fresh=request.fresh_actor)
            except QueueFull:
                pool = self._pool
                closing = (f" ({len(self._closing)} of them waiting for the engines to confirm the cancels "
                           "of requests that ended early)" if self._closing else "")
                wait_s = pool.retry_after_s()
                yield RequestRejected(
                    429, f"The server is busy: all {pool.maximum} of its RequestActors are serving requests"
                         f"{closing} and {pool.queue_limit} more requests wait for one (the most allowed). "
                         f"Retry after {wait_s:.1f} s.", "rate_limit_error", retry_after_s=wait_s)
                return
            except asyncio.TimeoutError:
                yield RequestFailed(504, f"request deadline of {timeout:g} s passed while the request waited "
                                         f"for a free RequestActor (all {self._pool.maximum} busy)", code="timeout")
                return
            except ShuttingDown as exc:
                yield RequestFailed(503, str(exc), code="service_unavailable")
                return
            remaining = max(timeout - (time.monotonic() - t0), 0.001)
            self._waited.observe(time.monotonic() - t0)
            now = time.monotonic()
            self._held[rid] = _Held(now + remaining + LOST_AFTER_S, now, actor)
            started = True
            streaming = self._routes.config.deployment.streaming
            self._outbox(rid).put(("run", RunRequest(rid, request.prompt, plan,
                                   dict(request.sampling_params), dict(request.params),
                                   remaining, self._address, self._max_attempts,
                                   stream_outputs=request.stream,
                                   chunk_window=streaming.max_buffered_chunks,
                                   chunk_timeout_s=streaming.chunk_timeout_s,
                                   chunk_tokens=streaming.chunk_tokens,
                                   queued_s=round(timeout - remaining, 3),
                                   alive_every_s=self._alive_every_s,
                                   silent_services=self._silent_services()), actor))
            deadline = time.monotonic() + remaining + 5.0  # the RequestActor's own deadline fires first
            while True:
                left = deadline - time.monotonic()
                try:
                    event = await within(stream.get(), max(left, 0.001))
                except asyncio.TimeoutError:
                    yield RequestFailed(504, f"no answer from the pipeline within {timeout:g} s", code="timeout")
                    return
                finished = isinstance(event, (RequestDone, RequestFailed))
                yield event
                if finished:
                    return
        finally:
            self._streams.pop(rid, None)
            if started and not finished:
                self._outbox(rid).put(("cancel", rid))

    def request_actors(self) -> dict[str, int]:
        """The RequestActor pool now (event loop only): ``total`` (alive or being made),
        ``busy``, ``idle``, ``closing`` (busy: their request is over, its stages' cancels
        not all confirmed yet), ``queued`` (requests waiting for one), ``max``, ``min``,
        ``queue_limit``, ``rejected`` (429s so far)."""
        p = self._pool
        return {"total": p.total, "busy": p.total - p.idle, "idle": p.idle, "closing": len(self._closing),
                "queued": p.queued,
                "max": p.maximum, "min": p.minimum, "queue_limit": p.queue_limit, "rejected": p.rejected}

    def queue_waits(self) -> list:
        """The ``omni_request_queue_wait_seconds`` histogram's metric families: how long the
        requests that got a RequestActor waited for it."""
        return list(self._waited.collect())

    @property
    def address(self) -> Any:
        """The address the coordinator and RequestActors answer this bridge at (None before ``start``)."""
        return self._address

    def in_flight(self) -> int:
        """Requests submitted and not yet finished."""
        return len(self._streams)

    def abort_all(self, reason: str, cancel: bool = True) -> int:
        """The server is stopping (event loop only): end every request in flight
        with a 503 saying ``reason`` (an SSE error event where the stream has
        begun) and, if ``cancel``, cancel its work in the pipeline (not when the
        system is gone: nothing would answer); requests waiting for a
        RequestActor get the same 503. Returns how many requests it ended."""
        ended = self._pool.fail_waiters(ShuttingDown(reason))
        for rid in list(self._streams):
            if rid in self._held:  # started on a RequestActor: stop its stages too
                if cancel:
                    self._outbox(rid).put(("cancel", rid, reason))
                self._put(rid, RequestFailed(503, reason, code="service_unavailable"))
                ended += 1
        return ended

    async def cancel(self, request_id: str) -> None:
        if request_id in self._streams:
            self._outbox(request_id).put(("cancel", request_id))

    async def stages(self) -> dict[str, Any]:
        """The coordinator's stage table as JSON-ready dicts (see ``status_to_dict``)."""
        status = await self.system_status()
        return status_to_dict(status)

    async def system_status(self, timeout_s: float = 5.0) -> SystemStatus:
        query_id = f"q{next(self._ids)}"
        fut = self._loop.create_future()
        self._queries[query_id] = fut
        self._outbox().put(("tell", self._coordinator, GetStatus(query_id, reply_to=self._address)))
        try:
            return await within(fut, timeout_s)
        finally:
            self._queries.pop(query_id, None)

    # -- threads ----------------------------------------------------------
    def _start_sender(self, i: int) -> None:
        """A sender thread for outbox ``i``; one that was there before is retired (it
        exits when its stuck ``tell`` returns, taking nothing more from the outbox)."""
        self._sender_gen[i] += 1
        t = threading.Thread(target=self._send_loop, args=(i, self._sender_gen[i]),
                             name=f"bridge-send-{i}.{self._sender_gen[i]}", daemon=True)
        t.start()
        self._senders.append(t)

    def _send_loop(self, i: int, gen: int) -> None:
        outbox, running, stages = self._outboxes[i], self._running[i], self._stages[i]
        with self._asys.private() as ctx:
            while self._sender_gen[i] == gen:
                item = outbox.get()
                if item is None:
                    return
                kind = item[0]
                if kind in _RELAYED:  # (a stopped supervisor held every sender: a code review)
                    self._handing[i] = (self._running_clock(), None)
                try:
                    if kind == "run":
                        run = _current_pools(item[1], self._routes.pools)
                        try:
                            actor = item[2]
                            if actor is None:
                                actor = self._make_request_actor(ctx)
                                self._loop.call_soon_threadsafe(self._bind, run.request_id, actor)
                            running[run.request_id] = actor
                            stages[run.request_id] = tuple((s.pool, s.stage_id) for s in run.plan.stages)
                            # Straight to it (through the supervisor would add a hop to every request);
                            # a RequestActor that is stopped or hung holds this thread, so the event
                            # loop replaces a sender stuck here (see _unstick_senders).
                            self._handing[i] = (self._running_clock(), run.request_id)
                            try:
                                ctx.tell(actor, run)
                            finally:
                                if self._sender_gen[i] == gen:
                                    self._handing[i] = None
                        except Exception as exc:  # noqa: BLE001 - fail this request, not the bridge
                            if self._sender_gen[i] != gen:
                                return  # (retired: the request was written off)
                            running.pop(run.request_id, None)
                            self._loop.call_soon_threadsafe(self._not_started, run.request_id, str(exc))
                            raise
                    elif kind == "create":
                        try:
                            actor = self._make_request_actor(ctx)
                        except Exception:
                            self._loop.call_soon_threadsafe(self._pool.lost)
                            raise
                        self._loop.call_soon_threadsafe(self._pool.release, actor)
                    elif kind == "cancel":
                        actor = running.get(item[1])
                        if actor is not None:
                            self._tell_request_actor(ctx, actor, CancelRequest(item[1], *item[2:]))
                    elif kind == "finished":
                        running.pop(item[1], None)  # (the event loop takes its RequestActor back)
                        stages.pop(item[1], None)
                    elif kind == "abandon":  # written off: dead, hung, or it never said its request ended
                        for pool, stage_id in stages.pop(item[1], ()):  # (its stages' work is nobody's)
                            try:  # (through our supervisor: an old pool may be dead, or hung)
                                self._tell_request_actor(ctx, pool, CancelStage(item[1], stage_id))
                            except Exception as exc:  # noqa: BLE001 - the other pools and its exit still
                                self._log.warning("bridge_cancel_failed", request_id=item[1], error=str(exc))
                        actor = running.pop(item[1], None)
                        if actor is not None and item[2]:
                            self._tell_request_actor(ctx, actor, ActorExitRequest())
                    elif kind == "supervise":  # the last one was lost; end its idle RequestActors
                        self._supervise_again(ctx, item[1], item[2])
                    elif kind == "exit":  # idle too long, or our supervisor when we close
                        self._tell_request_actor(ctx, item[1], ActorExitRequest())
                    elif kind == "tell":
                        self._tell_request_actor(ctx, item[1], item[2])
                    elif kind == "coordinator":
                        ctx.tell(self._coordinator, item[1])
                    elif kind == "routes":
                        # a pool was replaced: requests in flight re-send what waited on it
                        # (a copy: a sender replaced while stuck here shares `running` with its successor)
                        for rid, actor in list(running.items()):
                            self._tell_request_actor(ctx, actor, RoutesChanged(item[1]))
                            # (a written-off one's cancels go to the new pools too: its tasks may
                            # have moved there; to the old ones as well, where they may still run)
                            # (a list, not a set: Thespian's addresses are not hashable)
                            known = list(stages.get(rid, ()))
                            for _, sid in list(known):
                                if sid in item[1].pools and (item[1].pools[sid], sid) not in known:
                                    known.append((item[1].pools[sid], sid))
                            stages[rid] = tuple(known)
                except Exception as exc:  # noqa: BLE001 - keep the bridge alive
                    self._log.error("bridge_send_failed", kind=kind, error=str(exc))
                finally:
                    if kind in _RELAYED and self._sender_gen[i] == gen:
                        self._handing[i] = None

    def _supervise_again(self, ctx, idle: tuple, lost) -> None:
        """Sender thread: a new supervisor in place of ``lost`` (None: none was there), which
        ends the lost one's ``idle`` RequestActors and the lost one itself, not recursively:
        its busy RequestActors finish their requests (a code review saw the default end each
        of them with it, a 503 apiece)."""
        relays = self._take_relays()  # (before the new one's first alive trims the backlog)
        self._make_supervisor(ctx)
        if self._supervisor is None:
            self._relay_backlog.extendleft(reversed(relays))
            return
        for _, actor, message in relays:
            ctx.tell(self._supervisor, Relay(actor, message))
        self._loop.call_soon_threadsafe(self._retire_idle_orphans)
        for actor in idle:
            ctx.tell(self._supervisor, Relay(actor, ActorExitRequest()))
        if lost is not None:
            ctx.tell(self._supervisor, Relay(lost, ActorExitRequest(recursive=False)))

    def _receive_loop(self, ready: threading.Event, errors: list[str]) -> None:
        with self._asys.private() as ctx:
            you = ctx.ask(self._coordinator, WhoAmI(), self._connect_timeout_s)
            routes = ctx.ask(self._coordinator, GetRoutes(), self._connect_timeout_s)
            if not isinstance(you, YouAre) or not isinstance(routes, Routes) or routes.config is None:
                errors.append("the coordinator did not answer (is the system deployed?)")
                ready.set()
                return
            self._address, self._routes = you.address, routes
            self._make_supervisor(ctx)
            ready.set()
            next_subscribe = 0.0
            while not self._stop.is_set():
                if time.monotonic() >= next_subscribe:
                    try:
                        # Re-resolve by globalName: a coordinator restarted after a crash has a new address.
                        self._coordinator = ctx.createActor(CoordinatorActor, globalName=COORDINATOR_NAME)
                    except Exception as exc:  # noqa: BLE001 - admin busy or gone; keep the old address
                        self._log.warning("coordinator_lookup_failed", error=str(exc))
                    try:
                        ctx.tell(self._coordinator, Subscribe(self._address))
                    except Exception as exc:  # noqa: BLE001 - a dead coordinator: this thread must live on
                        self._log.warning("coordinator_subscribe_failed", error=str(exc))
                    next_subscribe = time.monotonic() + SUBSCRIBE_EVERY_S
                msg = ctx.listen(RECEIVE_LISTEN_S)
                now = time.monotonic()
                if self._receiver_turn_at and now - self._receiver_turn_at > RECEIVE_LISTEN_S + RECEIVER_STALL_S:
                    # (held up: what came meanwhile is still queued, unread; see _tick)
                    self._receiver_stalled_s += now - self._receiver_turn_at
                self._receiver_turn_at = now
                with self._boxes_lock:
                    if msg is not None:
                        try:
                            self._on_message(msg)
                        except Exception:  # noqa: BLE001 - one message, not every request after it
                            self._log.exception("bridge_message_failed", message=type(msg).__name__)
                    else:
                        self._quiet_at = time.monotonic()
                    self.check_text_gaps()

    async def inbound_settled(self, timeout_s: float = 2 * RECEIVE_LISTEN_S + 0.2) -> bool:
        """Wait until the receiver has read everything that had come (a whole listen of
        :data:`RECEIVE_LISTEN_S` found nothing more), at most ``timeout_s``; whether it did.

        For an API server resumed after a freeze that finds its system gone: what the system
        sent before it went (:class:`SystemStopping`, requests' ends) is still to be read, and
        says whether the system stopped in order or was killed."""
        since = time.monotonic()
        while self._quiet_at <= since:
            receiver = getattr(self, "_receiver", None)
            if time.monotonic() - since > timeout_s or receiver is None or not receiver.is_alive():
                return False
            await asyncio.sleep(0.05)
        return True

    def _on_message(self, msg: Any) -> None:
        """Receiver thread: turn an actor message into a loop-side event."""
        # Actor messages may overtake each other: each series is put back in order by
        # seq, and the end waits for the last outputs (RequestFinished.sent, .after_text).
        if isinstance(msg, OutputDeltas):
            for delta in msg.deltas:
                self._text(delta)
            if msg.ack:  # the engine keeps only a few in flight to us (see DeltaWindow): tell it we have them
                self._outboxes[msg.ack % len(self._outboxes)].put(("tell", msg.ack_to, DeltasAck(msg.peer, msg.ack)))
        elif isinstance(msg, (OutputChunk, OutputReady)):
            box = self._box(msg.request_id)
            if box is None:
                self._drop(msg)  # the request is over (the client went away)
                self._discard(msg.request_id)  # and what came before it, out of order
                return
            box.early[msg.seq] = msg
            self._pump(box)
            if msg.ack_to is not None:  # its RequestActor keeps only a few in flight to us (request.OUTPUT_WINDOW)
                self._outputs_ack(msg.request_id, msg.ack_to, box)
                self._loop.call_soon_threadsafe(self._alive, msg.request_id)  # (its beats pause while it holds some)
        elif isinstance(msg, RequestActorFree):
            self._actor_free(msg.request_id, msg.request_actor)
        elif isinstance(msg, RequestActorAlive):
            self._loop.call_soon_threadsafe(self._alive, msg.request_id)
            box = self._inbox.get(msg.request_id)
            if msg.ack_to is not None and box is not None and msg.request_id not in self._ended:
                self._outputs_ack(msg.request_id, msg.ack_to, box)  # (it asks: it holds outputs for us)
        elif isinstance(msg, SupervisorAlive):
            self._loop.call_soon_threadsafe(self._supervisor_alive, msg.address)
        elif isinstance(msg, RequestActorExited):
            self._loop.call_soon_threadsafe(self._exited, msg.address)
        elif isinstance(msg, RequestFinished):
            if msg.free:  # its RequestActor is free from now on, whatever is still to be delivered
                self._actor_free(msg.request_id, msg.request_actor)
            else:  # busy until its stages confirm their cancels (RequestActorFree)
                self._loop.call_soon_threadsafe(self._closing_begins, msg.request_id)
            box = self._inbox.get(msg.request_id)
            live = msg.request_id in self._streams and msg.request_id not in self._ended
            if live and msg.error is None and ((box.seq if box else 0) < msg.sent or msg.after_text is not None
                                               or (box is not None and box.fetching)):
                box = box or self._inbox.setdefault(msg.request_id, _Inbox())
                box.finished = msg  # (ends now if nothing is on its way)
                self._pump(box)
                return
            self._end(msg)
        elif isinstance(msg, SystemStopping):
            self.system_drain_timeout_s = msg.drain_timeout_s
            if msg.hurry:
                self.system_hurry.set()
            self.system_stopping.set()
        elif isinstance(msg, SystemStatus):
            if msg.query_id == SUBSCRIPTION:
                self._data_services_changed(self._published, msg)
                self._published = msg
                self._publication_came()
            self._loop.call_soon_threadsafe(self._resolve_query, msg)
        elif isinstance(msg, Routes):
            self._publication_came()
            if msg.config is not None and (msg.version != self._routes.version or msg.pools != self._routes.pools):
                before, self._routes = self._routes.pools, msg
                names = {st.stage_id: st.name for st in msg.config.stage_args}
                # (which pools are new: the version starts again at 0 with a recreated coordinator,
                # and trial BG could not tell one change from another)
                self._log.info("routes_changed", version=msg.version,
                               new_pools=[names.get(sid, str(sid)) for sid, pool in msg.pools.items()
                                          if before.get(sid) != pool])
                for outbox in self._outboxes:  # every sender tells its requests
                    outbox.put(("routes", msg))

    def _data_services_changed(self, before: SystemStatus | None, now: SystemStatus) -> None:
        """Receiver thread: a data service the coordinator now says is silent has the fetches
        waiting on it ended at once (:func:`~omni_actors.connectors.data_client.give_up`: each
        waited out its 10 s, trial CG); one it said was silent and now says answers is tried
        again at once (:func:`~omni_actors.connectors.data_client.forget_down`)."""
        silent = {n.data_service for n in (before.nodes if before else ()) if n.data_service_silent_s}
        for n in now.nodes:
            if not n.data_service or not n.alive:
                continue
            if n.data_service_silent_s and n.data_service not in silent:
                ended = give_up(n.data_service)
                self._log.warning("data_service_given_up", node=n.name, service=n.data_service,
                                  fetches_ended=ended)
            elif n.data_service in silent and not n.data_service_silent_s and forget_down(n.data_service):
                self._log.info("data_service_answers_again", node=n.name, service=n.data_service)

    def _silent_services(self) -> tuple[str, ...]:
        """The data services the coordinator's last published status says do not answer: of
        live nodes whose data service is silent, and of nodes lost or gone (a review: a silent
        node then lost was taken for "it answers again")."""
        published = self._published
        return tuple(n.data_service for n in (published.nodes if published else ())
                     if n.data_service and (n.data_service_silent_s or not n.alive))

    def rerun_goes_back(self, node: str, request: PipelineRequest) -> bool:
        """Whether running ``request`` again would only meet ``node`` again, or another like it:
        it is up but its data service silent (not lost: its replicas are not replaced) and a
        stage the request needs has its ready replicas on such nodes alone (a trial's rerun went
        back to the frozen member that held every Code2Wav and waited its 10 s again, 21 s for a 500)."""
        published = self._published
        if published is None or self._routes is None:
            return False
        here = [n for n in published.nodes if node in (n.name, n.data_service)]
        if not here or not here[0].alive or not here[0].data_service_silent_s:
            return False
        # (any node whose data service is silent: trial CJ froze both members, and the rerun went
        # from one to the other)
        silent = {n.name for n in published.nodes if n.alive and n.data_service_silent_s}
        try:
            plan = plan_request(self._routes.config, self._routes.pools, request.output_types)
        except PlanError:
            return False
        states = {st.stage_id: st for st in published.stages}
        for planned in plan.stages:
            ready = [r for r in getattr(states.get(planned.stage_id), "replicas", ())
                     if r.state == ReplicaState.READY]
            if ready and all(r.node in silent for r in ready):
                return True
        return False

    def _publication_came(self) -> None:
        """Receiver thread: count one of the coordinator's publications; tell it every
        :data:`PUBLICATIONS_ACK_EVERY` (it sends only a few unanswered)."""
        self._publications += 1
        if self._publications >= PUBLICATIONS_ACK_EVERY and self._address is not None:
            self._outboxes[0].put(("coordinator", PublicationsReceived(self._address, self._publications)))
            self._publications = 0

    def _outputs_ack(self, request_id: str, request_actor: Any, box: _Inbox) -> None:
        """Tell ``request_actor`` how many of its numbered outputs for ``request_id`` came."""
        received = box.seq + len(box.early)
        self._outbox(request_id).put(("tell", request_actor, OutputsAck(request_id, received)))

    def _box(self, request_id: str) -> _Inbox | None:
        """The request's inbox; None when it is over (the client went away)."""
        if request_id not in self._streams or request_id in self._ended:
            return None
        return self._inbox.setdefault(request_id, _Inbox())

    def _pump(self, box: _Inbox) -> None:
        """Deliver a request's RequestActor messages whose turn came, then its end
        (none while an output of it is being fetched from another host)."""
        while not box.fetching and box.seq in box.early \
                and box.after(getattr(box.early[box.seq], "after_text", None)):
            self._output(box.early.pop(box.seq), box)
            box.seq += 1
        done = box.finished
        if done is not None and not box.fetching and box.seq >= done.sent and box.after(done.after_text):
            self._end(done)

    def check_text_gaps(self, now: float | None = None) -> None:
        """Receiver thread, every turn: a finished request whose end has waited
        :data:`TEXT_GAP_S` for text deltas that have not come goes on without them (see
        :data:`TEXT_GAP_S`): its final text follows, and the client gets the missing part
        from it. One with no final text to follow fails with a 503 instead of hanging. A
        turn after a pause (:data:`RECEIVER_PAUSED_S`: this process was frozen) starts
        every wait afresh."""
        now = time.monotonic() if now is None else now
        if now - self._gaps_checked_at < TEXT_GAP_CHECK_S:  # (not on every message: a few times a second)
            return
        paused = now - self._gaps_checked_at > RECEIVER_PAUSED_S
        self._gaps_checked_at = now
        for rid, box in list(self._inbox.items()):
            done = box.finished
            if done is None or done.after_text is None or box.after(done.after_text) or box.fetching:
                # (fetching: an output, maybe the final text, is on its way from another host, within
                # its fetch's own timeout: a CI run met a 503 for a final text still being fetched)
                box.gap_since = None
            elif box.gap_since is None or paused:
                box.gap_since = now
            elif now - box.gap_since >= TEXT_GAP_S:
                self._skip_text_gap(rid, box, done)

    def _skip_text_gap(self, rid: str, box: _Inbox, done: RequestFinished) -> None:
        attempt, n = done.after_text
        got = box.text_seq if box.text_attempt == attempt else 0
        final = any(getattr(m, "after_text", None) is not None and m.output_type == "text"
                    for m in box.early.values())
        self._log.warning("text_deltas_missing", request_id=rid, came=got, expected=n,
                          final_text=final, waited_s=TEXT_GAP_S)
        box.gap_since = None
        if not final:
            self._discard(rid)
            self._ended[rid] = None
            self._deliver(rid, RequestFailed(
                503, f"the last {n - got} text part(s) of the request did not come within {TEXT_GAP_S:g} s of its "
                     "end (its replica went down holding them) and no final text carries them",
                output_sent=got > 0, code="service_unavailable"))
            return
        box.text_attempt, box.text_seq, box.text_early = attempt, n, {}
        self._pump(box)

    def _text(self, delta: OutputDelta) -> None:
        """A text delta from the engine: delivered in seq order within its attempt."""
        rid = delta.request_id
        box = self._box(rid)
        if box is None:
            # Over (the client went away): outputs held for the text before them go too
            self._discard(rid)
            return
        if delta.attempt < box.text_attempt:
            return
        if delta.attempt > box.text_attempt:
            if box.text_seq:
                # The stage was retried although its text had begun to reach the client
                # (the replica died before the RequestActor heard of it): the client would
                # read the text twice. End the request instead.
                # (a 503 as the RequestActor's own error for it: the stage's replica or pool
                # went down; the same event gave a trial a 500 with no code one way, 503 the other)
                self._fail_here(rid, RequestFailed(
                    503, f"stage {self._stage_name(delta.stage_id)} was run again (its replica or pool went "
                         "down) after part of its text had reached the client; the request was not retried",
                    output_sent=True, code="service_unavailable"))
                return
            box.text_attempt, box.text_seq, box.text_early = delta.attempt, 0, {}
        box.text_early[delta.seq] = delta.text
        box.gap_since = None  # (text is still coming)
        while box.text_seq in box.text_early:
            self._deliver(rid, OutputText(box.text_early.pop(box.text_seq)))
            box.text_seq += 1
        self._pump(box)

    def _stage_name(self, stage_id: int) -> str:
        """``thinker``, ``talker``... as other messages name stages (the id when unknown)."""
        try:
            return self._routes.config.stage(stage_id).name
        except (AttributeError, KeyError):
            return str(stage_id)

    def _output(self, msg: OutputChunk | OutputReady, box: _Inbox) -> None:
        """Deliver one RequestActor output of a request, in order: fetched here, or, from
        another host, on a fetch thread (``box.fetching`` until it is delivered)."""
        if self._connector.reads_remotely(msg.ref):
            box.fetching = True
            self._fetcher.submit(_lane(msg.ref), self._fetch_output, msg, box)
            return
        data = self._take(msg)
        if data is not None:
            self._deliver_output(msg, data)

    def _fetch_output(self, msg: OutputChunk | OutputReady, box: _Inbox) -> None:
        """Fetch thread: ``msg``'s output from its host's data service, then, under the
        receiver's lock, deliver it and what waited behind it (dropped if the request
        ended meanwhile: its client went, or it failed)."""
        try:
            data, failure = self._fetch(msg.ref), None
        except Exception as exc:  # noqa: BLE001 - told to the client, as on the receiver thread
            data, failure = None, exc
        with self._boxes_lock:
            box.fetching = False
            if self._inbox.get(msg.request_id) is not box or msg.request_id in self._ended:
                return
            if failure is not None:
                self._lost(msg, failure)
                return
            self._deliver_output(msg, data)
            self._pump(box)

    def _deliver_output(self, msg: OutputChunk | OutputReady, data: dict[str, Any]) -> None:
        missing = [k for k in _FINAL_KEYS.get(msg.output_type, ()) if k not in data]
        if missing:  # (a trial's `final_output_type: text` on a stage making prior tokens: a KeyError, a bare 500)
            self._fail_here(msg.request_id, RequestFailed(
                500, f"stage {self._stage_name(msg.stage_id)}'s {msg.output_type} output has no "
                     f"`{missing[0]}` (it has: {', '.join(sorted(data)) or 'nothing'}): its engine makes no "
                     f"{msg.output_type}; see its final_output_type in the config"))
            return
        event = (OutputPart if isinstance(msg, OutputChunk) else OutputFinal)(msg.stage_id, msg.output_type, data)
        self._deliver(msg.request_id, event)

    def _drop(self, msg: OutputChunk | OutputReady) -> None:
        ref = getattr(msg, "ref", None)
        if ref is not None and self._connector.reads_remotely(ref):
            self._fetcher.submit(_lane(ref), self._connector.release, ref)  # (a frozen host holds it seconds)
        elif ref is not None:
            self._connector.release(ref)

    def _actor_free(self, request_id: str, actor: Any) -> None:
        """Receiver thread: the RequestActor of ``request_id`` takes the next request."""
        self._outbox(request_id).put(("finished", request_id, actor))
        self._loop.call_soon_threadsafe(self._returned, request_id, actor)

    def _discard(self, request_id: str) -> None:
        """Forget the request's inbox, releasing the outputs that waited in it for their turn."""
        box = self._inbox.pop(request_id, None)
        for early in (box.early.values() if box else ()):
            self._drop(early)
        if box is not None:  # (a _pump going through it stops: nothing more is delivered)
            box.early.clear()
            box.finished = None

    def _end(self, msg: RequestFinished) -> None:
        """The request is over: tell the client (its RequestActor was freed on arrival)."""
        self._discard(msg.request_id)  # (only a failed one has any: a finished one waited for them all)
        self._ended[msg.request_id] = None
        if len(self._ended) > 4096:
            del self._ended[next(iter(self._ended))]
        if msg.error is None:
            event = RequestDone(msg.prompt_tokens, msg.completion_tokens, msg.finish_reason)
        else:
            status = HTTP_STATUS.get(msg.error, 500)
            kind = "invalid_request_error" if status == 400 else "server_error"
            code = {503: "service_unavailable", 504: "timeout"}.get(status)
            if status == 400 and CONTEXT_LENGTH.search(msg.message):
                code = CONTEXT_LENGTH_CODE
            lost = msg.error == ErrorKind.INPUT_LOST  # (the API server may run it again, as a lost final output)
            event = RequestFailed(status, msg.message, kind, lost_output=lost, lost_on=msg.lost_on if lost else None,
                                  output_sent=msg.output_sent, code=code, none_coming=msg.none_coming)
        self._deliver(msg.request_id, event)

    def _take(self, msg: OutputChunk | OutputReady) -> dict[str, Any] | None:
        """Fetch ``msg.ref`` and release it (the bridge owns it): ``take`` copies what it
        would map in place, so the segment can be recycled while the event is still
        to be encoded. On failure (the ref is unlinked) the request fails with a 500
        that says what was lost, and None is returned."""
        try:
            return self._fetch(msg.ref)
        except Exception as exc:  # noqa: BLE001
            self._lost(msg, exc)
            return None

    def _fetch(self, ref) -> dict[str, Any]:
        """``ref``'s outputs, taken (:meth:`NodeConnector.take`). Raises as that does."""
        if ref.service and self._node_alive(ref):
            if self._data_service_silent(ref):  # (our own mark may have run out: 3 s; a review saw each
                mark_down(ref.service)          # fetch after that wait its 10 s on a host still frozen)
            # Taken for down (it timed out, or the coordinator says it is silent), it is asked once per
            # mark whether it answers now (at most 1 s), and tried if so (trial CD: the rerun of a
            # request, made on the member just resumed, failed with a 500 "not tried again for 2.3 s").
            probe_down(ref.service, DATA_SERVICE_PROBE_S)
        return self._connector.take(ref)

    def _lost(self, msg: OutputChunk | OutputReady, exc: Exception) -> None:
        """The request fails with a 500 that says which of its outputs was lost, and where."""
        what = "streamed output" if isinstance(msg, OutputChunk) else "final output"
        lost = isinstance(exc, DataServiceError)
        # (the host by name: the service's address alone left a client to guess which one)
        where = f" (made on node {msg.ref.node})" if lost and msg.ref.node else ""
        self._fail_here(msg.request_id, RequestFailed(500, f"{what} lost{where}: {exc}", lost_output=lost,
                                                      lost_on=(msg.ref.node or msg.ref.service) if lost else None))

    def _data_service_silent(self, ref) -> bool:
        """Whether the coordinator's last published status has ``ref``'s node's data service silent."""
        published = self._published
        return published is not None and any(
            n.data_service_silent_s and (n.name == ref.node or n.data_service == ref.service) for n in published.nodes)

    def _node_alive(self, ref) -> bool:
        """Whether the coordinator's last published status has ``ref``'s node alive (a lost
        one is not probed)."""
        published = self._published
        return published is not None and any(
            n.alive and (n.name == ref.node or n.data_service == ref.service) for n in published.nodes)

    def _fail_here(self, request_id: str, event: RequestFailed) -> None:
        """Receiver thread: the bridge itself ends the request with ``event`` (an output it
        could not fetch or use, text it cannot deliver in order). Its pipeline is cancelled
        and what comes for it from now on is dropped: the RequestActor, which does not know,
        would otherwise go on and hold its outputs for a client that is gone (a code review:
        its producers stalled on their output window until the chunk timeout or the deadline)."""
        self._discard(request_id)
        self._ended[request_id] = None
        self._outbox(request_id).put(("cancel", request_id))
        self._deliver(request_id, event)

    def _deliver(self, request_id: str, event: BridgeEvent) -> None:
        self._loop.call_soon_threadsafe(self._put, request_id, event)

    def _put(self, request_id: str, event: BridgeEvent) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(event)

    def _no_replica(self, plan) -> tuple[str, bool] | None:
        """Why a request of ``plan`` gets a 503 at once: a stage it needs has no ready
        replica and none on its way (scaled to 0, failed, draining), as its pool
        would answer (:func:`~omni_actors.balancing.no_replica_reason`) once an
        upstream stage reached it, when a stream could already have begun (with
        a 200 and part of the text); and whether none of that stage's replicas is on its
        way (:func:`~omni_actors.balancing.none_on_its_way`). None when every stage may take
        it, or when the coordinator has published no status yet, or none from a stage's pool
        (the pools decide then)."""
        published = self._published
        if published is None:
            return None
        wait_s = self._routes.config.deployment.supervision.queue_timeout_s
        states = {st.stage_id: st for st in published.stages}
        for planned in plan.stages:
            st = states.get(planned.stage_id)
            if st is None or (st.pid is None and not st.replicas):
                continue  # its pool has not reported yet (a coordinator just restarted): it decides
            refused = no_replica_reason(planned.stage, st.replicas, wait_s, new_request=True)
            if refused:
                return refused, none_on_its_way(st.replicas)
        return None

    async def wait_node_down(self, node: str, timeout_s: float) -> bool:
        """See :meth:`omni_actors.http.types.Bridge.wait_node_down`: watches the status the
        coordinator publishes on every change (a node lost, left, its data service silent:
        its pools then send new tasks elsewhere, trial CG's reruns waited 5 s for a member
        frozen, which its node agent had reported)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            published = self._published
            if published is not None and any((not n.alive or n.data_service_silent_s)
                                             and node in (n.name, n.data_service) for n in published.nodes):
                return True
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.05)

    def _resolve_query(self, status: SystemStatus) -> None:
        fut = self._queries.get(status.query_id)
        if fut is not None and not fut.done():
            fut.set_result(status)


def status_to_dict(status: SystemStatus) -> dict[str, Any]:
    """``SystemStatus`` -> JSON-ready ``{"model", "ready", "coordinator_pid", "notes", "nodes", "stages": [...]}``;
    each stage lists its replicas with state, reason, load and counters (``devices``: those it
    holds now, as the status table's DEVICES; ``latency_buckets``: its completed tasks per
    bucket of ``latency_bucket_bounds_s``, not cumulative, the last above the last bound)."""
    def replica(r) -> dict[str, Any]:
        d = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}
        d["state"] = r.state.value
        d["devices"] = r.held_devices  # (a trial read a stopped replica's last devices as held)
        d["latency_buckets"] = list(r.latency_buckets)
        return d

    return {
        "model": status.model,
        "ready": status.ready,
        "coordinator_pid": status.coordinator_pid,
        "notes": list(status.notes),
        "latency_bucket_bounds_s": [b for b in LATENCY_BUCKETS_S if b != float("inf")],
        "nodes": [{"name": n.name, "alive": n.alive, "state": n.state, "down_reason": n.down_reason,
                   "devices": list(n.devices), "used": dict(n.used),
                   "stages": list(n.stages), "replicas": list(n.replicas),
                   "last_seen_age_s": n.last_seen_age_s, "data_service": n.data_service,
                   "buffers": n.buffers, "free_buffers": n.free_buffers, "free_bytes": n.free_bytes,
                   "data_service_silent_s": n.data_service_silent_s}
                  for n in status.nodes],
        "stages": [
            {"stage_id": st.stage_id, "stage": st.stage, "pid": st.pid, "pending": st.pending,
             "restarts": st.restarts,
             "ready_replicas": sum(1 for r in st.replicas if r.state.value == "ready" and not r.lingering),
             "replicas": [replica(r) for r in st.replicas]}
            for st in status.stages],
    }


def _current_pools(run: RunRequest, pools: dict) -> RunRequest:
    """``run`` with its plan's pools as ``pools`` (the routes now) has them.

    Its plan was made before it waited for a RequestActor; a pool replaced meanwhile is
    told only to the requests already running (``"routes"``), so one that waited would
    send its tasks to the old pool and hang until its deadline (a code review found it).
    The routes are replaced before that notice is queued: a change after this reads them
    reaches the request through the notice, which comes after its ``run`` in the outbox."""
    stages = run.plan.stages
    if all(pools.get(s.stage_id, s.pool) == s.pool for s in stages):
        return run
    return dataclasses.replace(run, plan=dataclasses.replace(run.plan, stages=tuple(
        dataclasses.replace(s, pool=pools.get(s.stage_id, s.pool)) for s in stages)))

