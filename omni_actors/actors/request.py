"""RequestActor: walks the stage graph for one request at a time.

A stage is dispatched to its pool as soon as every stage in its
``engine_input_source`` is done (fan-in waits for all sources); upstream
outputs pass as connector references only. Text deltas of a final text stage
whose client reads a stream go from the engine straight to the bridge (this
actor only hears that text started: :class:`~omni_actors.messages.TextStarted`);
each final output goes to the bridge by reference (the bridge fetches and
releases it), after the text deltas it completes. At the end, however
the request ends (done, stage error, client cancel, deadline), every running
stage is cancelled and every intermediate buffer is released: recycled for
later puts on its node when the request completed and no stage ran twice
(every engine that read the buffer has finished with it), unlinked otherwise
(a cancelled, failed, timed-out or retried stage may still be reading; an
unlinked segment stays valid for its mappings). A request that ends with
stages still running answers its client at once, but its RequestActor takes
no new request until those stages confirm their cancels
(:class:`~omni_actors.messages.StageCancelled`, or their late ``StageDone`` /
``StageFailed``), :data:`CANCEL_CONFIRM_S` at most
(:class:`~omni_actors.messages.RequestActorFree`): clients that hang up at
once cannot pile up cancelled work in the engines beyond ``request_actors``.

Creating an actor is a fork (about 8 ms here), so the bridge keeps a pool of
ready RequestActors and reuses each one after it reports
:class:`~omni_actors.messages.RequestFinished`; state is reset per request.
Messages for a request that is no longer current (a late ``StageDone`` after a
cancel) only have their buffers released.

Streaming between stages (``deployment.streaming``): a producer sends its
outputs as :class:`~omni_actors.messages.StageChunk` s; its streaming consumer
is dispatched on the first chunk, answers ``StageAccepted``, and gets every
chunk so far and each new one as an ``InputChunk`` (then an end marker once
the producer is done). The RequestActor keeps every chunk ref (released at
the end), so a consumer retried on another replica is replayed from chunk 0.
Credits bound the buffers: the consumer reports ``ChunkConsumed``, the
producer gets ``ChunkAck`` s and pauses with ``chunk_window`` chunks
unacknowledged. A streaming stage that fails is retried together with its
streaming consumers, unless part of their output already reached the client:
then the request ends with an error that says so.
"""

from __future__ import annotations

import dataclasses
import os
import time

from thespian.actors import ActorExitRequest, ActorTypeDispatcher, PoisonMessage, WakeupMessage

from omni_actors.actors.supervision import WAKEUP_LOST_AFTER_S, WakeupChain, pop_overdue, refuses_connections
from omni_actors.connectors import data_client, make_connector, release_all
from omni_actors.logs import get_logger
from omni_actors.messages import (BRIDGE_LOST_AFTER_S, MAX_TASK_MOVES, BridgeAlive, CancelRequest, CancelStage,
                                  ChunkAck, ChunkConsumed, ErrorKind, InputChunk, MakeRequestActor, OutputChunk,
                                  OutputReady, OutputsAck, RequestActorAlive, RequestActorFree, RequestActorMade,
                                  RequestFinished, RoutesChanged, RunRequest, StageAccepted, StageCancelled,
                                  StageChunk, StageDone, StageFailed, StageTask, TextStarted)

#: Stage failures worth another replica: the engine raised, or was going away.
RETRYABLE = (ErrorKind.ENGINE_ERROR, ErrorKind.UNAVAILABLE)
#: Wake-up payload: time to check that the API server owning this actor still runs.
BRIDGE_CHECK = "bridge_check"
#: Wake-up payload: time to tell the bridge this actor still runs its request (RequestActorAlive).
ALIVE_BEAT = "alive_beat"
#: Seconds a RequestActor whose request ended with stages still running (client gone,
#: deadline, a failed stage) waits for those stages to confirm their cancels before it
#: takes the next request anyway: a stopped or overloaded engine may never answer. Until
#: then its API server counts it busy, so abandoned work stays within ``request_actors``.
CANCEL_CONFIRM_S = 5.0
#: Environment variable that sets it for the RequestActors of a system (0: free at once, as
#: before this wait existed; benchmarks/hangups.py compares the two).
CANCEL_CONFIRM_ENV = "OMNI_ACTORS_CANCEL_CONFIRM_S"
#: Wake-up payload ``(CANCEL_CONFIRM, request_id)``: stop waiting for those confirmations.
CANCEL_CONFIRM = "cancel_confirm"
#: Wake-up payload ``(INHERITED, request_id, stage_id, attempt)``: a task left on a lost
#: coordinator's pool (``Routes.inherited``) has had :data:`INHERITED_WAIT_S` to finish there.
INHERITED = "inherited"
#: Seconds a task on a lost coordinator's pool is waited for before it is treated as lost
#: with its pool (that pool drains: its replicas finish what they run, then exit).
INHERITED_WAIT_S = 30.0
#: Seconds past its due time after which an overdue beat of a RequestActor says it did not run
#: (see RequestActor._own_silence).
OWN_SILENCE_S = 2.0
#: Wake-up payload: a task refused by a lost coordinator's pool (StageFailed.coordinator_lost)
#: has waited :data:`NEW_POOL_WAIT_S` for the new coordinator's pool of its stage.
PARKED = "parked"
#: Seconds such a task waits for the new coordinator's pool (the leader recreates a lost
#: coordinator within a few heartbeat intervals) before its request fails with a 503.
NEW_POOL_WAIT_S = 30.0
#: Wake-up payload: a request's deadline may have passed. One such wake-up is pending at a
#: time (see :meth:`RequestActor._arm_deadline`), not one per request.
DEADLINE = "request_deadline"
#: A DEADLINE wake-up this close (seconds) before the deadline counts as at it (timers
#: may fire a little early).
DEADLINE_EARLY_S = 0.001
#: Numbered outputs (OutputChunk, OutputReady) a RequestActor keeps sent to its bridge and
#: not answered (OutputsAck); beyond, it holds them. Thespian keeps at most 20 transmits in
#: flight per sending actor, each to a frozen API server for up to 5 minutes: streamed audio
#: to one filled them, and the Thinker's chunks this actor relays to the Talker waited
#: behind them until the Talker timed out (trial AQ). The producer of the audio is credited
#: only for the chunks its bridge has, so a frozen client side holds the whole chain back.
OUTPUT_WINDOW = 6
#: Every this many outputs (fewer with a ``chunk_window`` under 6) asks the bridge to answer.
OUTPUT_ACK_EVERY = 3
#: Beats while outputs are held and the bridge has not answered for ``alive_every_s`` ask
#: it how many it has (RequestActorAlive.ack_to); this many in a row, then one every
#: :data:`OUTPUT_PROBE_SLOW_S` until it answers (the other beats are left out: each one to
#: a frozen server holds a transmit, up to 5 minutes).
OUTPUT_PROBES = 2
#: Seconds between the probes after the first :data:`OUTPUT_PROBES` (an answer that was lost
#: with a RequestActorSupervisor, say, is asked for again).
OUTPUT_PROBE_SLOW_S = 30.0


def cancel_confirm_s() -> float:
    """``$OMNI_ACTORS_CANCEL_CONFIRM_S`` if set (a number >= 0), else :data:`CANCEL_CONFIRM_S`."""
    try:
        return max(0.0, float(os.environ.get(CANCEL_CONFIRM_ENV) or CANCEL_CONFIRM_S))
    except ValueError:  # (a bad setting must not stop requests)
        return CANCEL_CONFIRM_S


class RequestActor(ActorTypeDispatcher):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._req: RunRequest | None = None
        self._marked_down: set[str] = set()  # (the last RunRequest's silent_services)
        self._connector = make_connector()
        self._log = get_logger(actor="request")
        #: when it last heard from its API server's bridge or ended a request (see BridgeAlive)
        self._heard_at = time.monotonic()
        self._lost_after_s = BRIDGE_LOST_AFTER_S
        self._bridge_checks = WakeupChain(BRIDGE_CHECK)  # (gen 0: not started)
        self._alive_beats = WakeupChain(ALIVE_BEAT)  # RequestActorAlive while busy
        self._alive_every_s = 5.0  # (the last request's RunRequest.alive_every_s)
        #: (request id, stages whose cancel is not confirmed yet, its bridge) after an end
        #: with stages still running; None: free (see CANCEL_CONFIRM_S)
        self._closing: tuple[str, set[int], object] | None = None
        self._closing_since = 0.0  # (monotonic) when it began to wait for those confirmations
        self._last_plan = ()  # the stages of the last request (names for the log)
        self._confirm_s = cancel_confirm_s()
        #: (monotonic s) when the pending DEADLINE wake-up falls due; None: none pending
        self._deadline_wake: float | None = None
        self._began_at = 0.0  # (time.time()) when the current request began here
        self._reset()

    def _reset(self) -> None:
        self._req = None
        self._done: dict[int, StageDone] = {}
        self._running: dict[int, StageTask] = {}  # the last task sent, per running stage
        self._pools: dict[int, object] = {}
        #: stage -> the lost coordinator's pool its running task was left on (its cancel goes there)
        self._left_on: dict[int, object] = {}
        #: stage -> its next task, refused by a lost coordinator's pool before the new pools were
        #: known: sent to the new pool of its stage when RoutesChanged comes (see _wait_for_new_pool)
        self._parked: dict[int, StageTask] = {}
        #: (seconds, when: monotonic) of the last time this actor did not run, by its beat's lateness
        self._paused: tuple[float, float] | None = None
        #: INHERITED and PARKED wake-ups asked for -> when due (monotonic): run by the beat if lost
        self._stage_wakeups: dict[tuple, float] = {}
        #: streaming consumers cancelled to start over with their producer: (attempt, moved) of
        #: their next task (a later attempt than the one cancelled: see CancelStage.attempt)
        self._restarts: dict[int, tuple[int, int]] = {}
        self._owned = []  # intermediate refs to release at the end
        #: stages whose task was sent again: two copies of one may run, and an earlier attempt may
        #: still read its inputs
        self._resent: set[int] = set()
        self._failed_on: dict[int, str] = {}  # stage -> the replica its last failure came from (the log)
        self._tokens = [0, 0]
        self._finish_reason = None
        # Streaming between stages, per stage id:
        self._chunks: dict[int, list] = {}  # producer -> its chunk refs, by seq
        self._chunk_last: dict[int, list[int]] = {}  # producer -> per chunk, the backend's last chunk in it
        self._chunk_total: dict[int, int] = {}  # producer -> chunk count, once it is done
        self._chunk_at: dict[int, float] = {}  # producer -> monotonic time of its latest chunk
        self._producer: dict[int, object] = {}  # producer -> the engine sending its chunks
        self._consumer: dict[int, object] = {}  # consumer -> the engine that accepted it
        self._sent: dict[int, int] = {}  # consumer -> chunks sent to it (end marker: -1)
        self._consumed: dict[int, int] = {}  # consumer -> chunks it consumed
        self._stream_consumers: dict[int, list[int]] = {}  # producer -> the stages streaming from it
        self._acked: dict[int, int] = {}  # producer -> chunks acknowledged to it
        self._to_client: set[int] = set()  # stages whose output (part of it) reached the client
        self._early: dict[int, dict[int, object]] = {}  # producer -> chunks that came before their turn
        self._done_waiting: dict[int, StageDone] = {}  # a stage done before all its chunks came
        self._out_seq = 0  # messages sent to the bridge for this request (they are numbered)
        self._out_acked = 0  # of them, how many the bridge said it has (OutputsAck)
        self._out_heard = time.monotonic()  # when it last said so (or the request began)
        self._out_probes = 0  # beats that asked since (OUTPUT_PROBES)
        self._out_probed_at = 0.0  # (monotonic) when the last of them did
        self._out_held: list[tuple] = []  # (make, ref, credit): not sent yet, the window is full
        self._out_credit: list[tuple[int, int, int]] = []  # (seq, producer, its chunks) sent, not credited

    def _current(self, request_id: str) -> bool:
        return self._req is not None and self._req.request_id == request_id

    def receiveMsg_RunRequest(self, msg: RunRequest, sender):
        if self._req is not None:  # the bridge never does this; fail the newcomer loudly
            self.send(msg.reply_to, RequestFinished(msg.request_id, ErrorKind.ENGINE_ERROR,
                                                    "request actor busy", request_actor=self.myAddress))
            return
        if self._closing is not None:  # (the bridge waits for RequestActorFree: it never does this)
            self._log.warning("request_actor_reused_while_closing", request_id=msg.request_id,
                              closing=self._closing[0])
            self._closing = None
        self._reset()
        self._heard()
        self._req = msg
        for service in msg.silent_services:
            data_client.mark_down(service)
        for service in self._marked_down - set(msg.silent_services):  # (it answers again: trial CO's
            data_client.forget_down(service)                          # releases were refused 5 s more)
        self._marked_down = set(msg.silent_services)
        self._pools = {s.stage_id: s.pool for s in msg.plan.stages}
        self._plan = {s.stage_id: s for s in msg.plan.stages}
        self._stream_consumers = {sid: [s.stage_id for s in msg.plan.stages if s.stream_source == sid]
                                  for sid in self._plan}
        self._started = time.monotonic()
        self._began_at = time.time()  # (StageTask.began_at: lingering replicas take older requests only)
        self._arm_deadline()
        self._alive_every_s = msg.alive_every_s
        self._alive_beats.ensure(self, msg.alive_every_s)
        self._dispatch_ready()

    def _dispatch_ready(self) -> None:
        req = self._req
        for st in req.plan.stages:
            if st.stage_id in self._done or st.stage_id in self._running:
                continue
            stream = st.stream_source
            if not all(src in self._done for src in st.sources if src != stream):
                continue
            if stream is not None and not (stream in self._done or self._chunks.get(stream)):
                continue  # a streaming consumer starts on its source's first chunk
            if self._pools.get(st.stage_id) is None:
                self._finish(ErrorKind.UNAVAILABLE, f"stage {st.stage} has no pool")
                return
            inputs = tuple((src, self._done[src].output) for src in st.sources if src != stream)
            attempt, moved = self._restarts.get(st.stage_id, (0, 0))
            task = StageTask(
                request_id=req.request_id, stage_id=st.stage_id, prompt=req.prompt, inputs=inputs,
                sampling_params=self._sampling_for(st),
                params=req.params,
                final_output_type=st.final_output_type,
                needs_output=st.needs_output, reply_to=self.myAddress,
                stream_source=stream, emit_chunks=self._emits_chunks(st),
                chunk_window=req.chunk_window, chunk_timeout_s=req.chunk_timeout_s,
                chunk_tokens=req.chunk_tokens,
                text_to=req.reply_to if st.final_output_type == "text" and req.stream_outputs else None,
                timeout_s=self._left(), began_at=self._began_at, attempt=attempt, moved=moved,
                feeds=any(st.stage_id in s.sources or s.stream_source == st.stage_id for s in req.plan.stages))
            self._running[st.stage_id] = task
            self._left_on.pop(st.stage_id, None)
            self.send(self._pools[st.stage_id], task)

    def _sampling_for(self, st) -> dict:
        """The client's sampling overrides that stage ``st`` runs with (over its
        ``default_sampling_params``).

        A request with a text output (chat): its ``max_tokens`` / ``temperature`` /
        ``seed`` are about the text the client reads, so only the final text stage
        gets them (a Talker's own token budget is not the client's max_tokens).
        A request without one (an image): its only override, ``seed``, seeds every
        stage, as each draws its own randomness (the AR stage its prior tokens, a
        DiT its noise), so that another seed gives another image.
        """
        plan = self._req.plan.stages
        if any(s.final_output_type == "text" for s in plan):
            return self._req.sampling_params if st.final_output_type == "text" else {}
        return self._req.sampling_params

    def _emits_chunks(self, st) -> bool:
        """Chunks go to a streaming consumer, or (final audio) to a streaming client."""
        if self._stream_consumers.get(st.stage_id):
            return True
        return st.emits_chunks and st.final_output_type == "audio" and self._req.stream_outputs

    def _task_of(self, request_id: str, stage_id: int, attempt: int) -> StageTask | None:
        """The running task a streaming message belongs to (None: stale, drop it)."""
        if not self._current(request_id):
            return None
        task = self._running.get(stage_id)
        return task if task is not None and task.attempt == attempt else None

    def _to_bridge(self, make, ref=None, credit: tuple[int, int] | None = None) -> None:
        """Send ``make(seq, ack_to)`` to the bridge (it delivers them in seq order), or hold
        it while :data:`OUTPUT_WINDOW` are unanswered. ``ref``: its buffer (released if the
        request fails while it is held); ``credit``: (producer, its chunks so far) to credit
        once the bridge has it."""
        if self._out_held or self._out_seq - self._out_acked >= OUTPUT_WINDOW:
            self._out_held.append((make, ref, credit))
        else:
            self._send_output(make, credit)

    def _send_output(self, make, credit: tuple[int, int] | None) -> None:
        """Send output ``seq`` to the bridge, asking for its answer every few outputs, and on
        one whose answer would credit its producer (a review: merged chunks took a Code2Wav to
        its window between two outputs that asked, and the chain waited for the next beat,
        5 s, with no answer asked for)."""
        seq = self._out_seq
        every = max(1, min(OUTPUT_ACK_EVERY, self._req.chunk_window // 2))
        ask = (seq + 1) % every == 0 or (credit is not None and self._credit_upto(*credit) is not None)
        self.send(self._req.reply_to, make(seq, self.myAddress if ask else None))
        if credit is not None:
            self._out_credit.append((seq, *credit))
        self._out_seq += 1

    def receiveMsg_OutputsAck(self, msg: OutputsAck, sender):
        """The bridge has ``msg.received`` of our outputs: credit their producers, and send
        what was held while the window has room."""
        if not self._current(msg.request_id) or msg.received <= self._out_acked:
            return
        self._out_acked = min(msg.received, self._out_seq)
        self._out_heard, self._out_probes = time.monotonic(), 0
        credits: dict[int, int] = {}
        while self._out_credit and self._out_credit[0][0] < self._out_acked:
            _, producer, chunks = self._out_credit.pop(0)
            credits[producer] = chunks
        for producer, chunks in credits.items():
            self._ack(producer, chunks)
        while self._out_held and self._out_seq - self._out_acked < OUTPUT_WINDOW:
            make, _, credit = self._out_held.pop(0)
            self._send_output(make, credit)

    def receiveMsg_TextStarted(self, msg: TextStarted, sender):
        if self._task_of(msg.request_id, msg.stage_id, msg.attempt) is not None:
            self._to_client.add(msg.stage_id)

    def _after_text(self) -> tuple[int, int] | None:
        """(attempt, deltas) of the text stage's finished attempt, whose deltas went
        straight to the bridge: what a final output must not overtake."""
        for sid, done in self._done.items():
            if done.deltas and self._plan[sid].final_output_type == "text":
                return done.attempt, done.deltas
        return None

    def _incomplete(self, msg: StageDone) -> bool:
        """Whether chunks sent before ``msg`` have not arrived yet."""
        task = self._running[msg.stage_id]
        return task.emit_chunks and len(self._chunks.get(msg.stage_id, ())) < msg.chunks

    def _resume_done(self, stage_id: int, sender) -> None:
        waiting = self._done_waiting.get(stage_id)
        if waiting is not None and not self._incomplete(waiting):
            del self._done_waiting[stage_id]
            self.receiveMsg_StageDone(waiting, sender)

    # -- streaming between stages -------------------------------------------
    def receiveMsg_StageChunk(self, msg: StageChunk, sender):
        task = self._task_of(msg.request_id, msg.stage_id, msg.attempt)
        if task is None:
            release_all([msg.ref])
            if not self._current(msg.request_id):
                # Its request is over, yet a producer streams on: its cancel was lost or
                # overtaken by its task (Thespian may reorder two messages of one sender),
                # and it would wait for credits for ever. Stop it where it runs.
                self.send(sender, CancelStage(msg.request_id, msg.stage_id))
            return
        # Thespian keeps several transmits in flight per sender: chunks may overtake
        # each other, so they are put back in order by seq here.
        early = self._early.setdefault(msg.stage_id, {})
        early[msg.seq] = msg
        self._chunk_at[msg.stage_id] = time.monotonic()
        self._producer[msg.stage_id] = sender
        chunks = self._chunks.setdefault(msg.stage_id, [])
        consumers = self._stream_consumers[msg.stage_id]
        lasts = self._chunk_last.setdefault(msg.stage_id, [])
        while len(chunks) in early:
            got = early.pop(len(chunks))
            ref = got.ref
            chunks.append(ref)  # kept (released at the end) for replays to a retried consumer
            lasts.append(got.last)
            if not consumers:  # final audio to a streaming client: the bridge fetches and releases it
                self._to_client.add(msg.stage_id)
                output_type = self._plan[msg.stage_id].final_output_type
                self._to_bridge(lambda seq, ack_to, ref=ref: OutputChunk(msg.request_id, msg.stage_id, output_type,
                                                                         ref, seq, ack_to),
                                ref=ref, credit=(msg.stage_id, len(chunks)))
                chunks[-1] = None  # the bridge owns it now (or _out_held, until it is sent)
        for dst in consumers:
            self._feed(dst)
        if msg.stage_id in self._done_waiting:
            self._resume_done(msg.stage_id, sender)
        else:
            self._dispatch_ready()

    def receiveMsg_StageAccepted(self, msg: StageAccepted, sender):
        task = self._task_of(msg.request_id, msg.stage_id, msg.attempt)
        if task is None or task.stream_source is None:
            return
        self._consumer[msg.stage_id] = sender
        self._sent[msg.stage_id] = 0
        self._feed(msg.stage_id)

    def _feed(self, dst: int) -> None:
        """Send consumer ``dst`` the chunks of its source it has not had, then the end marker."""
        engine, sent = self._consumer.get(dst), self._sent.get(dst, 0)
        if engine is None or sent < 0:
            return
        task, src = self._running[dst], self._plan[dst].stream_source
        chunks = self._chunks.get(src, [])
        lasts = self._chunk_last.get(src, [])
        for seq in range(sent, len(chunks)):  # (the consumer puts them back in order by seq)
            self.send(engine, InputChunk(task.request_id, dst, src, seq, chunks[seq], task.attempt, lasts[seq]))
        self._sent[dst] = len(chunks)
        if self._chunk_total.get(src) == len(chunks):
            self.send(engine, InputChunk(task.request_id, dst, src, len(chunks), None, task.attempt))
            self._sent[dst] = -1

    def receiveMsg_ChunkConsumed(self, msg: ChunkConsumed, sender):
        if self._task_of(msg.request_id, msg.stage_id, msg.attempt) is None:
            return
        self._consumed[msg.stage_id] = max(self._consumed.get(msg.stage_id, 0), msg.upto)
        consumers = self._stream_consumers[msg.source]
        self._ack(msg.source, min(self._consumed.get(d, 0) for d in consumers))

    def _ack(self, producer: int, consumed: int) -> None:
        """Credit the producer once half a window is consumed (fewer messages, no stall).

        ``consumed`` counts chunk messages; credits count the backend's chunks
        (several merge into one message when the producer is busy)."""
        due = self._credit_upto(producer, consumed)
        if due is not None:
            task, upto = due
            self._acked[producer] = upto
            self.send(self._producer[producer], ChunkAck(task.request_id, producer, upto, task.attempt))

    def _credit_upto(self, producer: int, consumed: int) -> tuple[StageTask, int] | None:
        """``(task, backend chunks)`` to credit ``producer`` with once ``consumed`` of its chunk
        messages are consumed, where that is half a window more than it has; else None."""
        task = self._running.get(producer)
        if task is None or producer not in self._producer or consumed <= 0:
            return None
        upto = self._chunk_last[producer][consumed - 1] + 1
        return (task, upto) if upto - self._acked.get(producer, 0) >= max(1, task.chunk_window // 2) else None

    def _downstream(self, stage_id: int) -> set[int]:
        """``stage_id`` and every stage that streams from it, transitively."""
        out, stack = set(), [stage_id]
        while stack:
            sid = stack.pop()
            if sid not in out:
                out.add(sid)
                stack.extend(self._stream_consumers.get(sid, ()))
        return out

    def _forget_stream(self, stages: set[int], recycle: bool = False, wait: bool = True) -> None:
        """Drop the streaming state of ``stages`` (their chunks are released, and the
        outputs of a StageDone that came before its last chunks; ``wait``: as ``release_all``'s)."""
        for sid in stages:
            release_all(self._chunks.pop(sid, []), recycle=recycle, wait=wait)
            release_all((m.ref for m in self._early.pop(sid, {}).values()), recycle=recycle, wait=wait)
            waiting = self._done_waiting.pop(sid, None)
            if waiting is not None:  # (nobody else holds its refs: they would leak)
                release_all([waiting.output, waiting.final], recycle=recycle, wait=wait)
            for table in (self._chunk_last, self._chunk_total, self._producer, self._consumer, self._sent, self._consumed,
                          self._acked):
                table.pop(sid, None)

    # -- stage results ---------------------------------------------------------
    def receiveMsg_StageDone(self, msg: StageDone, sender):
        self._confirm(msg.request_id, msg.stage_id)
        task = self._running.get(msg.stage_id) if self._current(msg.request_id) else None
        if task is None or (task.streaming and msg.attempt != task.attempt):
            release_all([msg.output, msg.final])
            return
        self._parked.pop(msg.stage_id, None)  # (done after all: not sent to the new pool; a review)
        if self._incomplete(msg):
            self._done_waiting[msg.stage_id] = msg  # it overtook its last chunks or text: wait for them
            return
        del self._running[msg.stage_id]
        self._done[msg.stage_id] = msg
        if msg.stage_id in self._resent and not task.streaming:
            # Its task went out twice (a retry, or a pool replaced), and the other copy may still run:
            # a cancel of every attempt stops it (a review: a copy of a first stage ran to max_tokens
            # for nobody after the orphaned engine of a killed pool finished first).
            self.send(self._pools[msg.stage_id], CancelStage(msg.request_id, msg.stage_id))
        if msg.output is not None:
            self._owned.append(msg.output)
        planned = self._plan[msg.stage_id]
        if task.emit_chunks:
            self._chunk_total[msg.stage_id] = msg.chunks
            for dst in self._stream_consumers[msg.stage_id]:
                self._feed(dst)
        if msg.final is not None and msg.stage_id in self._to_client and planned.final_output_type == "audio":
            release_all([msg.final], recycle=True)  # its audio went out in chunks; nobody else got this ref
        elif planned.final_output_type and msg.final is not None:
            final = msg.final
            after_text = self._after_text()
            self._to_bridge(lambda seq, ack_to: OutputReady(msg.request_id, msg.stage_id, planned.final_output_type,
                                                            final, seq, after_text=after_text, ack_to=ack_to),
                            ref=final)
        elif msg.final is not None:
            self._owned.append(msg.final)
        if planned.final_output_type == "text" or not self._tokens[0]:
            self._tokens[0] = max(self._tokens[0], msg.prompt_tokens)
        if planned.final_output_type == "text":
            self._tokens[1] += msg.output_tokens
            self._finish_reason = msg.finish_reason
        if len(self._done) == len(self._req.plan.stages):
            self._finish(None, "")
        else:
            self._dispatch_ready()

    def receiveMsg_StageFailed(self, msg: StageFailed, sender):
        self._confirm(msg.request_id, msg.stage_id)
        if not self._current(msg.request_id) or msg.stage_id not in self._running:
            return
        task = self._running[msg.stage_id]
        if msg.attempt < task.attempt or msg.stage_id in self._parked:
            return  # an attempt that was already retried
        if msg.replica:
            self._failed_on[msg.stage_id] = msg.replica
        if msg.coordinator_lost and msg.kind == ErrorKind.UNAVAILABLE:
            self._wait_for_new_pool(task, msg, sender)
            return
        attempt = msg.attempt + 1  # the pool may have re-dispatched it already (a dead replica)
        moved = max(msg.moved, task.moved)  # (an engine's failure of a chunk does not know them)
        retry = (bool(msg.replica) and msg.kind in RETRYABLE and attempt - moved < self._req.max_attempts
                 and moved <= MAX_TASK_MOVES)
        message = msg.message
        if msg.kind == ErrorKind.TIMEOUT and task.stream_source is not None:
            message += self._relay_state(msg.stage_id, task.stream_source) + self._own_silence()
        output_sent = False
        if task.streaming:
            affected = self._downstream(msg.stage_id)
            if retry and affected & self._to_client:
                retry, output_sent = False, True
                message += "; part of the output had already reached the client, so it was not retried"
            elif retry:
                for sid in affected - {msg.stage_id}:  # its streaming consumers start over with it
                    gone = self._running.pop(sid, None)
                    if gone is not None:  # (as the next attempt, which this cancel leaves alone: not a retry)
                        self.send(self._left_on.get(sid, self._pools[sid]),
                                  CancelStage(msg.request_id, sid, attempt=gone.attempt))
                        self._restarts[sid] = (gone.attempt + 1, gone.moved + 1)
                self._forget_stream(affected)
        if retry:
            # An engine failed this task: try another replica of the stage.
            self._log.warning("stage_retry", request_id=msg.request_id, stage=self._stage_of(msg.stage_id),
                              stage_id=msg.stage_id, replica=msg.replica, error=msg.message)
            self._resend(dataclasses.replace(task, attempt=attempt, exclude=task.exclude + (msg.replica,),
                                             crashed=msg.crashed or task.crashed, moved=moved))
            return
        del self._running[msg.stage_id]
        self._finish(msg.kind, message, lost_on=msg.lost_on, output_sent=output_sent,
                     none_coming=msg.none_coming and not msg.replica)

    def _wait_for_new_pool(self, task: StageTask, msg: StageFailed, sender) -> None:
        """``task`` was refused by a pool whose coordinator was lost (it only drains): send
        it to the new coordinator's pool of its stage, now if the routes already name another
        pool, else once they do (RoutesChanged), at most :data:`NEW_POOL_WAIT_S`. A review:
        a coordinator frozen and then killed by the leader's watchdog left its pools orphaned
        at once, before the new routes came; their refusals were retried on the same pool, or
        not at all, and every request that reached a stage in that second got a 503."""
        moved = max(msg.moved, task.moved) + (0 if msg.replica else 1)  # (a move, not an attempt)
        if moved > MAX_TASK_MOVES:
            del self._running[msg.stage_id]
            self._finish(msg.kind, msg.message)
            return
        retry = dataclasses.replace(task, attempt=msg.attempt + 1, moved=moved, crashed=msg.crashed or task.crashed)
        if sender != self._pools.get(msg.stage_id):  # (the routes already moved on)
            self._log.warning("stage_retry", request_id=msg.request_id, stage=self._stage_of(msg.stage_id),
                              stage_id=msg.stage_id, replica=msg.replica, error=msg.message)
            self._resend(retry)
            return
        self._log.warning("stage_waits_for_new_pool", request_id=msg.request_id, stage_id=msg.stage_id,
                          error=msg.message)
        # (its refused task stays the running one, so that a late StageDone of it, from a replica
        # of that pool that finished it after all, is taken: it then is no longer parked)
        self._parked[msg.stage_id] = retry
        self._stage_wakeup(NEW_POOL_WAIT_S, (PARKED, msg.request_id, msg.stage_id, retry.attempt))

    def _stage_wakeup(self, delay: float, payload: tuple) -> None:
        """``wakeupAfter`` for a stage's INHERITED or PARKED wait, run by the beat where it is
        lost (see :meth:`_run_lost_wakeups`)."""
        self._stage_wakeups[payload] = time.monotonic() + delay
        self.wakeupAfter(delay, payload=payload)

    def _own_silence(self) -> str:
        """Where this actor itself did not run for a while lately (its last beat came over
        :data:`OWN_SILENCE_S` late, within the chunk timeout before now: stopped, starved of
        CPU), says so: the chunks it relays between stages stopped with it, and a consumer's
        timeout blamed the producer (trial CC: "its replica died or stalled" of a healthy
        Talker, after the RequestActor was stopped 25 s). Thespian runs the wake-ups that fell
        due while it was stopped before the messages that came meanwhile, so the beat comes
        first; a beat whose wake-up was lost says nothing."""
        if self._paused is None:
            return ""
        late, at = self._paused
        if time.monotonic() - at > self._req.chunk_timeout_s + OWN_SILENCE_S:
            return ""
        return (f"; this request's RequestActor itself did not run for about {late:.0f} s (stopped or starved "
                "of CPU) just before, and the chunks it relays between the stages stopped with it")

    def _relay_state(self, dst: int, src: int) -> str:
        """What this RequestActor got from stream source ``src`` and relayed to consumer
        ``dst``: says, when a consumer timed out, whether the producer stalled or a
        chunk went astray between them."""
        got, held = len(self._chunks.get(src, ())), sorted(self._early.get(src, {}))
        total = self._chunk_total.get(src)
        if total is None and src in self._done_waiting:
            total = self._done_waiting[src].chunks
        sent = self._sent.get(dst, 0)
        return (f" [request actor: {got} chunk(s) of stage {src} ({self._plan[src].stage}) in order"
                + (f", {held} waiting for an earlier one" if held else "")
                + (f", stage {src} done after {total}" if total is not None else f", stage {src} still running")
                + (", all relayed with the end marker" if sent < 0 else
                   f", {sent} relayed" if dst in self._consumer else ", consumer not accepted yet")
                + self._held_back_by(dst, src) + self._upstream_silence(src) + "]")

    def _held_back_by(self, dst: int, src: int) -> str:
        """The other consumers of ``src`` behind ``dst``: a producer streaming to several
        is credited as its slowest consumer reads, so one not started yet (its replicas busy,
        its task queued) or slow holds ``dst``'s chunks back too (a review: the healthy
        producer took the blame for the timeout)."""
        if src in self._done or src in self._done_waiting:
            return ""
        got, notes = len(self._chunks.get(src, ())), []
        for d in self._stream_consumers.get(src, ()):
            if d == dst:
                continue
            if d not in self._consumer:
                notes.append(f"stage {d} ({self._plan[d].stage}) has not started")
            elif self._consumed.get(d, 0) < got:
                notes.append(f"stage {d} ({self._plan[d].stage}) has read {self._consumed.get(d, 0)} of them")
        return (f"; stage {src} makes chunks only as fast as its slowest consumer reads them, and "
                + ", ".join(notes)) if notes else ""

    def _upstream_silence(self, src: int) -> str:
        """How long each still-running stage that ``src`` streams from has been
        silent: a stalled Thinker starves the Talker, and Code2Wav's timeout on the
        Talker can fire first; this names the stage where the chunks stopped."""
        notes, now = [], time.monotonic()
        up = self._plan[src].stream_source
        while up is not None and up not in self._done and up not in self._done_waiting:
            at = self._chunk_at.get(up)
            notes.append(f"; upstream of it, stage {up} ({self._plan[up].stage}) still running, " +
                         (f"its last chunk {now - at:.1f} s ago" if at is not None else "no chunk from it yet"))
            up = self._plan[up].stream_source
        return "".join(notes)

    def _left(self) -> float:
        """Seconds left before this request's deadline (at least a millisecond)."""
        return max(round(self._req.timeout_s - (time.monotonic() - self._started), 3), 0.001)

    def _resend(self, task: StageTask) -> None:
        self._resent.add(task.stage_id)
        task = dataclasses.replace(task, timeout_s=self._left())
        self._running[task.stage_id] = task
        self._left_on.pop(task.stage_id, None)
        self.send(self._pools[task.stage_id], task)

    def receiveMsg_RoutesChanged(self, msg: RoutesChanged, sender):
        """A pool was replaced: re-send stages that were waiting on the old one; one that
        runs on a lost coordinator's pool (``Routes.inherited``) is waited for, at most
        :data:`INHERITED_WAIT_S`: that pool drains and finishes it (trial BG: every stream
        in flight when the API server switched to a recreated coordinator's pools failed)."""
        if self._req is None:
            return
        for stage_id, pool in msg.routes.pools.items():
            if stage_id not in self._pools or pool == self._pools[stage_id]:
                continue
            old, self._pools[stage_id] = self._pools[stage_id], pool  # (what it sends next goes to the new pool)
            parked = self._parked.pop(stage_id, None)
            if parked is not None:  # (refused by the lost coordinator's pool: see _wait_for_new_pool)
                self._resend(parked)
                continue
            task = self._running.get(stage_id)
            if task is not None and stage_id in msg.routes.inherited:
                self._left_on.setdefault(stage_id, old)  # (a cancel of its task goes there: where it runs, if
                # a second coordinator was lost meanwhile, not the pool of the one in between)
                self._stage_wakeup(INHERITED_WAIT_S, (INHERITED, task.request_id, stage_id, task.attempt))
                continue
            # (it said "the stage's pool": a trial could not tell which, nor why)
            self._pool_gone(stage_id, f"the pool of stage {self._plan[stage_id].stage} was replaced (it, or the "
                                      "coordinator, died and was restarted)" if stage_id in self._plan
                            else "the stage's pool was replaced", sender)
        for stage_id, why in msg.routes.given_up:
            # (a stage of this request still to finish, on the pool given up: not one replaced since)
            if (stage_id not in self._done and stage_id in self._pools and stage_id not in self._left_on
                    and self._pools[stage_id] == msg.routes.pools.get(stage_id)):
                self._running.pop(stage_id, None)  # (its pool is gone: no cancel to send there)
                name = self._plan[stage_id].stage if stage_id in self._plan else str(stage_id)
                self._finish(ErrorKind.UNAVAILABLE, f"stage {name}: {why}")
                return

    def _stage_of(self, stage_id: int) -> str:
        """The stage's name, as other events give it (trial CK: `stage_retry` had only the id)."""
        return getattr(self._plan.get(stage_id), "stage", str(stage_id))

    def _pool_gone(self, stage_id: int, why: str, sender) -> None:
        """The pool running stage ``stage_id``'s task is gone: fail a streaming task
        (its chunks went out; see StageFailed), re-send any other."""
        task = self._running.get(stage_id)
        if task is not None and task.streaming:
            self.receiveMsg_StageFailed(StageFailed(task.request_id, stage_id, "pool", ErrorKind.UNAVAILABLE,
                                                    why, task.attempt, task.crashed, task.moved + 1), sender)
        elif task is not None:
            self._log.warning("stage_retry", request_id=task.request_id, stage=self._stage_of(stage_id),
                              stage_id=stage_id, error=why)
            self._resend(dataclasses.replace(task, attempt=task.attempt + 1, moved=task.moved + 1))

    def receiveMsg_StageCancelled(self, msg: StageCancelled, sender):
        # (A cancel of a task it no longer waits for (an orphaned replica's, sent again
        # elsewhere; an earlier attempt, its own restart's) changes nothing: ignored. A later
        # attempt than its own is one its pool sent elsewhere itself, as StageFailed takes it.)
        task = self._running.get(msg.stage_id) if self._current(msg.request_id) else None
        if task is not None and msg.attempt >= task.attempt and msg.asked:
            # Cancelled by a CancelStage it did not send while it runs the request: its API
            # server's, which wrote it off (a hand-over stuck for 3 s; silent for a minute) and
            # answered its client. It ends the request (a code review: it retried each stage so
            # cancelled, and the whole pipeline ran for a client that had had its 500).
            del self._running[msg.stage_id]  # (confirmed: this is its StageCancelled)
            self._finish(ErrorKind.CANCELLED, "cancelled by its API server, which wrote this request off")
            return
        if task is not None and msg.attempt >= task.attempt:
            # The very task it waits for ended cancelled, and nobody asked: its replica ended
            # it (its inputs were gone, its engine aborted it, its pool went). A failure,
            # tried again elsewhere or reported (a code review: ignored, the request waited
            # for its deadline and read a timeout).
            stage = self._plan[msg.stage_id].stage if msg.stage_id in self._plan else str(msg.stage_id)
            self.receiveMsg_StageFailed(StageFailed(
                msg.request_id, msg.stage_id, msg.replica or "its replica", ErrorKind.UNAVAILABLE,
                f"stage {stage}'s task ended cancelled on its replica, which this request did not ask for "
                "(its inputs were gone, or its engine or pool ended it)", msg.attempt,
                getattr(task, "crashed", ()), getattr(task, "moved", 0)), sender)
            return
        self._confirm(msg.request_id, msg.stage_id)

    def _confirm(self, request_id: str, stage_id: int) -> None:
        """A stage of the request this actor is closing ended: free once all have."""
        if self._closing is not None and self._closing[0] == request_id:
            self._closing[1].discard(stage_id)
            if not self._closing[1]:
                self._free(confirmed=True)

    def _free(self, confirmed: bool) -> None:
        request_id, unconfirmed, bridge = self._closing
        self._closing = None
        if not confirmed:
            names = {s.stage_id: s.stage for s in self._last_plan}
            self._log.warning("cancel_unconfirmed", request_id=request_id, after_s=self._confirm_s,
                              stages=sorted(names.get(sid, str(sid)) for sid in unconfirmed))
        self._heard_at = time.monotonic()
        self.send(bridge, RequestActorFree(request_id, self.myAddress, confirmed))

    def receiveMsg_PoisonMessage(self, msg: PoisonMessage, sender):
        """A pool raised on one of our tasks (twice: Thespian retries a message once) and
        Thespian returned it: that pool will never run it, so the stage fails as a pool's
        refusal would, retried while attempts are left (it was ignored: the request waited
        for its deadline with nothing running it)."""
        task = msg.poisonMessage
        if not isinstance(task, StageTask) or not self._current(task.request_id):
            return
        last = (str(msg.details).strip().splitlines() or ["no details"])[-1]  # (a traceback's last line)
        self._log.error("stage_task_poisoned", request_id=task.request_id, stage_id=task.stage_id, error=last)
        name = self._plan[task.stage_id].stage if task.stage_id in self._plan else str(task.stage_id)
        self.receiveMsg_StageFailed(StageFailed(
            task.request_id, task.stage_id, "pool", ErrorKind.ENGINE_ERROR,
            f"the pool of stage {name} failed to take the task ({last})", task.attempt, task.crashed,
            task.moved), sender)

    def receiveMsg_CancelRequest(self, msg: CancelRequest, sender):
        if self._current(msg.request_id):
            self._finish(ErrorKind.CANCELLED, msg.reason)

    def receiveMsg_ActorExitRequest(self, msg: ActorExitRequest, sender):
        """Told to exit with a request still on (the system stops while the API server that
        owns it is frozen or slow, so its drain could not end the request): end it here, so it
        still gets its ``request_finished`` line, its stages are cancelled and its buffers are
        released; the API server reads a 503 if it ever hears from us again (trial AS: this
        actor was killed at the shutdown, and the request had no ``request_finished``)."""
        if self._req is not None:
            # (its releases waited for: the process exits after this handler, with the thread that
            # would send them: a review)
            self._finish(ErrorKind.UNAVAILABLE, "the omni-actors system stopped before this request finished",
                         wait=True)

    # -- the API server that owns this actor ------------------------------------
    def receiveMsg_BridgeAlive(self, msg: BridgeAlive, sender):
        changed = msg.lost_after_s != self._lost_after_s
        self._lost_after_s = msg.lost_after_s
        self._heard(rearm=changed)

    def receiveMsg_MakeRequestActor(self, msg: MakeRequestActor, sender):
        """From the supervisor that made this actor: say our address to the bridge that asked."""
        if msg.reply_to is not None:
            self.send(msg.reply_to, RequestActorMade(self.myAddress))

    def _beat(self) -> None:
        """Tell the bridge this actor still runs (or closes) its request; again later while it does.
        While outputs are held for a bridge that has not answered for a beat, the beat asks it
        how many it has instead: :data:`OUTPUT_PROBES` beats, then one every
        :data:`OUTPUT_PROBE_SLOW_S` (it may be frozen)."""
        now = time.monotonic()
        due = self._alive_beats.due
        if due is not None and now - due > OWN_SILENCE_S:  # (this actor did not run: see _own_silence)
            self._paused = (now - due, now)
        self._run_lost_wakeups(now)
        if self._req is not None and now - self._started >= self._req.alive_every_s \
                and refuses_connections(self._req.reply_to):
            # Its API server is gone (SIGKILLed: its address refuses connections; a frozen one's
            # does not). Nobody will take the request's outputs: its stages stop now (trial BM:
            # they stalled, holding their engines' slots, until the request's deadline).
            self._finish(ErrorKind.CANCELLED, "its API server is gone (its address refuses connections)")
            return
        if self._req is not None:
            # (also while outputs it sent wait for the answer that credits their producers: one
            # asked only every OUTPUT_ACK_EVERY outputs, and merged chunks can leave the producer
            # out of credit with no answer asked for; a code review saw the chain hang until the
            # deadline)
            credit_due = bool(self._out_credit) and now - self._out_heard >= self._req.alive_every_s
            if not self._out_held:
                self.send(self._req.reply_to, RequestActorAlive(self._req.request_id,
                                                                ack_to=self.myAddress if credit_due else None))
            elif now - self._out_heard >= self._req.alive_every_s and (
                    self._out_probes < OUTPUT_PROBES or now - self._out_probed_at >= OUTPUT_PROBE_SLOW_S):
                self._out_probes += 1
                self._out_probed_at = now
                self.send(self._req.reply_to, RequestActorAlive(self._req.request_id, ack_to=self.myAddress))
            self._alive_beats.again(self, self._req.alive_every_s)
        elif self._closing is not None:
            self.send(self._closing[2], RequestActorAlive(self._closing[0]))
            self._alive_beats.again(self, self._alive_every_s)
        else:
            self._alive_beats.stopped()

    def _run_lost_wakeups(self, now: float) -> None:
        """The request's deadline and the end of the wait for cancel confirmations, when
        their wake-ups are over :data:`WAKEUP_LOST_AFTER_S` late (Thespian drops wake-ups
        that fall due while an actor drains a long transmit queue): run late by the beat,
        so a request still ends and its RequestActor is still freed."""
        req = self._req
        if req is not None and now - self._started > req.timeout_s + WAKEUP_LOST_AFTER_S:
            self._log.warning("wakeup_lost", payload="request_deadline", request_id=req.request_id)
            self._deadline_passed()
        if self._closing is not None and now - self._closing_since > self._confirm_s + WAKEUP_LOST_AFTER_S:
            self._log.warning("wakeup_lost", payload=CANCEL_CONFIRM, request_id=self._closing[0])
            self._free(confirmed=False)
        for payload in pop_overdue(self._stage_wakeups, now):
            # (a stage's wait on a lost coordinator's pool, or for the new one: a review saw it
            # last until the request's deadline, a 504, where its wake-up was lost)
            self._log.warning("wakeup_lost", payload=payload[0], request_id=payload[1], stage_id=payload[2])
            self.receiveMsg_WakeupMessage(WakeupMessage(0, payload=payload), self.myAddress)

    def _deadline_passed(self) -> None:
        req = self._req
        waited = (f" ({req.queued_s:.1f} s of it waiting for a RequestActor in the API server)"
                  if req.queued_s >= 0.05 else "")
        total = round(req.timeout_s + req.queued_s, 2)
        self._finish(ErrorKind.TIMEOUT, f"request deadline of {total:g} s passed{waited}")

    def _heard(self, rearm: bool = False) -> None:
        self._heard_at = time.monotonic()
        if rearm or not self._bridge_checks.gen:
            self._bridge_checks.start(self, self._lost_after_s / 2)

    def _check_bridge(self) -> None:
        """Exit when idle and nothing came from the bridge for ``lost_after_s`` (its API
        server was killed); else look again later."""
        silent = time.monotonic() - self._heard_at
        if self._req is None and silent > self._lost_after_s:
            self._log.info("request_actor_exit_api_server_gone", silent_s=round(silent, 1))
            self.send(self.myAddress, ActorExitRequest())
            return
        self._bridge_checks.again(self, self._lost_after_s / 2)

    def receiveMsg_WakeupMessage(self, msg: WakeupMessage, sender):
        if isinstance(msg.payload, tuple) and msg.payload[0] == CANCEL_CONFIRM:
            if self._closing is not None and self._closing[0] == msg.payload[1]:
                self._free(confirmed=False)
        elif self._bridge_checks.owns(msg.payload):
            if self._bridge_checks.current(msg.payload):
                self._check_bridge()
        elif self._alive_beats.owns(msg.payload):
            if self._alive_beats.current(msg.payload):
                self._beat()
        elif isinstance(msg.payload, tuple) and msg.payload[0] == INHERITED:
            self._stage_wakeups.pop(msg.payload, None)
            _, request_id, stage_id, attempt = msg.payload
            task = self._running.get(stage_id) if self._current(request_id) else None
            if task is not None and task.attempt == attempt:  # (still on the lost coordinator's pool)
                old = self._left_on.get(stage_id)
                if old is not None:  # (it may still run there: stop it, as it is run again elsewhere; every
                    # attempt: that pool may have moved it on its own, as attempt + 1: a review)
                    self.send(old, CancelStage(request_id, stage_id))
                self._pool_gone(stage_id, f"the pool of stage {self._plan[stage_id].stage} was left by its lost "
                                          f"coordinator and did not finish this stage within {INHERITED_WAIT_S:g} s",
                                sender)
        elif isinstance(msg.payload, tuple) and msg.payload[0] == PARKED:
            self._stage_wakeups.pop(msg.payload, None)
            _, request_id, stage_id, attempt = msg.payload
            parked = self._parked.get(stage_id) if self._current(request_id) else None
            if parked is not None and parked.attempt == attempt:
                del self._parked[stage_id]
                self._running.pop(stage_id, None)
                self._finish(ErrorKind.UNAVAILABLE, f"stage {self._plan[stage_id].stage}: its pool's coordinator was "
                                                    f"lost, and no new pool of it came within {NEW_POOL_WAIT_S:g} s")
        elif msg.payload == DEADLINE:
            self._deadline_wake = None
            req = self._req
            if req is not None:
                if time.monotonic() >= self._started + req.timeout_s - DEADLINE_EARLY_S:
                    self._deadline_passed()
                else:
                    self._arm_deadline()

    def _arm_deadline(self) -> None:
        """Make sure a DEADLINE wake-up comes by the current request's deadline.

        Thespian cannot cancel a wake-up and keeps the pending ones in a list that it
        sorts on every ``wakeupAfter``; with one per request (120 s each by default), one
        RequestActor serving about 80 one-token requests a second used 3.0 ms of CPU per
        request, 1.7 ms without (measured here, tiny vLLM model). So a wake-up that is
        already pending and comes no later is kept (when it comes, it arms the next one);
        a lost one (over :data:`WAKEUP_LOST_AFTER_S` late) is not counted on."""
        now = time.monotonic()
        due = self._started + self._req.timeout_s
        pending = self._deadline_wake
        if pending is not None and pending <= due and now <= pending + WAKEUP_LOST_AFTER_S:
            return
        self._deadline_wake = due
        self.wakeupAfter(max(due - now, 0.0), payload=DEADLINE)

    def _finish(self, error: ErrorKind | None, message: str, lost_on: str | None = None,
                output_sent: bool = False, wait: bool = False, none_coming: bool = False) -> None:
        req = self._req
        for stage_id in self._parked:  # (not sent anywhere: nothing to cancel)
            self._running.pop(stage_id, None)
        for stage_id in self._running:
            self.send(self._left_on.get(stage_id, self._pools[stage_id]), CancelStage(req.request_id, stage_id))
        # Stages to hear from before the next request (one done but short of its chunks has ended)
        unconfirmed = set(self._running) - set(self._done_waiting) if self._confirm_s > 0 else set()
        # Completed, every stage once (a pool re-dispatches a task on its own: attempt > 0): every
        # engine that read these buffers is done with them, so they are recycled. Otherwise one may
        # still be reading them: unlinked (its mapping keeps the pages).
        recycle = error is None and not self._running and not self._resent \
            and all(d.attempt == 0 for d in self._done.values())
        held, self._out_held = self._out_held, []
        if error is None:  # (all of it is due: the bridge ends the request after the last)
            for make, _, _ in held:
                self._send_output(make, None)
        names = {s.stage_id: s.stage for s in req.plan.stages}
        # (a warning when the system failed it; a cancel or a client's bad request is no fault of ours)
        quiet = error is None or error in (ErrorKind.CANCELLED, ErrorKind.BAD_REQUEST)
        log = self._log.info if quiet else self._log.warning
        log("request_finished", request_id=req.request_id,
            error=error.value if error else None, message=message or None,
            duration_ms=round((time.monotonic() - self._started) * 1000, 2),
            # (before it: the wait in the API server for a free RequestActor)
            queued_ms=round(req.queued_s * 1000, 2),
            replicas={names[sid]: d.replica for sid, d in self._done.items()},
            # (stages cut short: cancelled with the request; their replicas are not known here)
            stages_cancelled=[names[sid] for sid in self._running] or None,
            # (where each stage last failed, retried or not: trial BX read `replicas: {}` of a request
            # that failed mid-stream, the case where it is wanted most)
            failed_on={names[sid]: r for sid, r in self._failed_on.items()} or None)
        self.send(req.reply_to, RequestFinished(
            req.request_id, error, message, prompt_tokens=self._tokens[0], completion_tokens=self._tokens[1],
            finish_reason=self._finish_reason,
            stage_replicas={sid: d.replica for sid, d in self._done.items()}, request_actor=self.myAddress,
            sent=self._out_seq, after_text=None if error else self._after_text(), free=not unconfirmed,
            lost_on=lost_on, output_sent=output_sent, none_coming=none_coming))
        # Released once the answer is sent, those on other hosts from a thread of their own: a release
        # to a host whose data service does not answer waits up to 2 s (trial CN's requests each ended
        # that much late on a frozen member, and a review saw the answer wait behind them in Thespian)
        release_all(self._owned, recycle=recycle, wait=wait)
        self._forget_stream(set(self._chunks) | set(self._done_waiting), recycle=recycle, wait=wait)
        if error is not None:  # (the bridge drops outputs of a request that failed)
            release_all([ref for _, ref, _ in held if ref is not None], recycle=recycle, wait=wait)
        self._heard_at = time.monotonic()  # (a request that outlived lost_after_s is no silence)
        self._last_plan = req.plan.stages
        self._reset()
        if unconfirmed:
            self._closing = (req.request_id, unconfirmed, req.reply_to)
            self._closing_since = time.monotonic()
            self.wakeupAfter(self._confirm_s, payload=(CANCEL_CONFIRM, req.request_id))
