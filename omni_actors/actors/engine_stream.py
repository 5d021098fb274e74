"""The streaming half of an EngineActor: input chunks in, credits back.

A task with a ``stream_source`` reads its input as :class:`InputChunk` s that
the RequestActor relays (put back in order by seq here: Thespian may deliver
two messages of one sender out of order) and reports what it consumed; a task
that emits chunks waits for :class:`ChunkAck` s once ``chunk_window`` chunks
are unconsumed. A consumer gives up after ``chunk_timeout_s`` without a
chunk (:class:`UpstreamTimeout`); a producer waits as long as its request
lives. Everything here but the two ``receiveMsg_`` handlers
runs on the engine's loop thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from omni_actors.connectors import DataServiceError, data_client
from omni_actors.engines.base import InputLost, UpstreamTimeout
from omni_actors.messages import ChunkAck, ChunkConsumed, InputChunk, StageTask

#: Inputs at least this large are read on a worker thread (see StreamingMixin._fetch).
FETCH_ON_THREAD_BYTES = 1 << 20
#: Seconds a replica waits for a silent data service's answer to its probe (as the API server's).
SILENT_PROBE_S = 1.0


class StreamingMixin:
    """Needs ``self._rt`` (the loop thread), ``self._connector``,
    ``self._process_input``, ``self._inputs``, ``self._credits``, ``self._parked``,
    ``self._all_held``, ``self._tasks`` and ``self._progress_at`` (see EngineActor)."""

    def receiveMsg_InputChunk(self, msg: InputChunk, sender):
        if self._rt is not None:
            self._rt.loop.call_soon_threadsafe(self._on_input_chunk, msg)
        return self._watch()

    def _on_input_chunk(self, msg: InputChunk) -> None:
        """On the loop thread: queue a chunk for its task (stale attempts are dropped)."""
        entry = self._inputs.get((msg.request_id, msg.stage_id))
        if entry is not None and entry[0] == msg.attempt:
            entry[1].put_nowait(msg)
        elif entry is not None:
            self._log.info("input_chunk_dropped", request_id=msg.request_id, seq=msg.seq,
                           attempt=msg.attempt, running_attempt=entry[0])

    def receiveMsg_ChunkAck(self, msg: ChunkAck, sender):
        if self._rt is not None:
            self._rt.loop.call_soon_threadsafe(self._on_chunk_ack, msg)
        return self._watch()

    def _on_chunk_ack(self, msg: ChunkAck) -> None:
        credit = self._credits.get((msg.request_id, msg.stage_id))
        if credit is not None and credit[0] == msg.attempt and msg.upto > credit[1]:
            credit[1] = msg.upto
            credit[2].set()

    async def _fetch(self, ref) -> dict[str, Any]:
        """Read a connector ref. A large one, or one on another node, is read on a
        worker thread: fetched from another node's data service it can take 0.1 s
        per 256 MB here, or a connect timeout (5 s) from a host cut off, and the
        loop must keep every other task streaming meanwhile (a code review: a small
        chunk from a host gone froze every stream of the replica, and the pool
        killed it as stalled).

        Raises:
            InputLost: the ref's data lives on a host whose data service is unreachable.
            ConnectorError: the data was released (its request ended).
        """
        try:
            remote = self._connector.reads_remotely(ref)
            if ref.size < FETCH_ON_THREAD_BYTES and not remote:
                return self._connector.get(ref)
            # waiting on another host's data service is no stall of ours (a review: one whose
            # process was frozen held the read for its 10 s timeout, and the pool's stall
            # watchdog killed the healthy replica that waited, then the next one)
            with self._parked_while() if remote else contextlib.nullcontext():
                return await asyncio.to_thread(self._read_remote if remote else self._connector.get, ref)
        except DataServiceError as exc:
            raise InputLost(ref.node or ref.service or "?", str(exc)) from None

    def _read_remote(self, ref) -> dict[str, Any]:
        """On a worker thread: ``ref`` read from its node's data service. While the coordinator
        says that service does not answer (:class:`~omni_actors.messages.DataServicesSilent`),
        it is taken for down (the mark ``give_up`` set runs out after 3 s: a review saw each
        fetch after it wait its 10 s again) and asked once per mark whether it answers now
        (at most :data:`SILENT_PROBE_S`): a fetch from it fails at once, or goes ahead once it
        answers (the coordinator's word can lag a resume by a probe)."""
        silent = ref.service in getattr(self, "_silent_services", ())
        if silent:
            data_client.mark_down(ref.service)
        if ref.service:
            data_client.probe_down(ref.service, SILENT_PROBE_S)
        try:
            return self._connector.get(ref)
        except DataServiceError as exc:
            if not silent:
                raise
            # (said as the coordinator says it: trial CN read "unreachable (2 time(s) in a row); not tried
            # again for 4.5 s" of a member whose process was frozen)
            raise DataServiceError(f"its data service ({ref.service}) does not answer: its node agent says so "
                                   f"(its process frozen or hung?); {exc}") from None

    async def _input_chunks(self, msg: StageTask, chunks: asyncio.Queue):
        """The processed input chunks of a streaming task, in order, until the end marker.

        Reports progress (:class:`ChunkConsumed`) every half window of the
        producer's chunks, so the producer, which waits at a full window,
        never stalls on us.

        Raises:
            UpstreamTimeout: no chunk for ``chunk_timeout_s``.
        """
        src, seq, every = msg.stream_source, 0, max(1, msg.chunk_window // 2)
        reported = 0  # the producer's chunks (not messages: several may share one) reported consumed
        early: dict[int, InputChunk] = {}  # chunks may overtake each other in transit
        end_at = None
        while True:
            while seq not in early and seq != end_at:
                try:
                    with self._parked_while():  # waiting on a neighbour is no stall of ours
                        item = await asyncio.wait_for(chunks.get(), msg.chunk_timeout_s)
                except asyncio.TimeoutError:
                    held = f"; chunks {sorted(early)} came ahead of it" if early else ""
                    raise UpstreamTimeout(f"no chunk from upstream stage {src} within {msg.chunk_timeout_s:g} s "
                                          f"(after {seq} chunks{held}): its replica died or stalled, or it "
                                          "makes its chunks more slowly than that (streaming.chunk_timeout_s)"
                                          ) from None
                if item.ref is None:
                    end_at = item.seq
                elif item.seq >= seq:
                    early[item.seq] = item  # (a replayed duplicate of an earlier one is dropped)
            if seq == end_at:
                return
            item = early.pop(seq)
            outputs = await self._fetch(item.ref)
            seq += 1
            yield await self._process_input({src: outputs}, msg)
            if item.last + 1 - reported >= every:
                reported = item.last + 1
                self._rt.emit(msg.reply_to, ChunkConsumed(msg.request_id, msg.stage_id, src, seq, msg.attempt))

    async def _wait_credit(self, msg: StageTask, seq: int) -> None:
        """Backpressure: wait until fewer than ``chunk_window`` chunks are unconsumed.

        No timeout here: a consumer that is slow, queued for a replica, or
        gone is the RequestActor's to judge (it cancels this task when the
        request ends: a consumer's failure, the pool's 503, the deadline).
        """
        credit = self._credits[(msg.request_id, msg.stage_id)]
        while seq - credit[1] >= msg.chunk_window:
            credit[2].clear()
            with self._parked_while():
                await credit[2].wait()

    @contextlib.contextmanager
    def _parked_while(self):
        """A task waits on a neighbour stage. While every task of this replica
        waits so, heartbeats report no idle time: nothing here could progress,
        so the pool's stall watchdog must not blame this replica.

        When the first of them stops waiting, the idle clock starts afresh, with
        no progress counted (``self._progress``, which the pool's stall clock
        watches, is only what the backend makes). One task's wait that ends
        while another is stuck starts nothing: a stalled replica takes a new
        task's input before it stalls on it too, and must not look fresh then
        (a trial saw a stalled Talker isolated after 20-30 s, not its 10 s)."""
        self._parked += 1
        try:
            yield
        finally:
            self._parked -= 1
            if self._all_held(self._parked + 1):  # every task was held up: now one can work
                self._progress_at = time.monotonic()
