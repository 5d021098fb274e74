"""EngineActor: one replica of one stage.

The backend runs on its own asyncio loop on a thread inside this actor's
process, so no handler ever waits on the engine. Results come back through a
socketpair that the actor watches (``ThespianWatch``): the loop thread puts
``(address, message)`` pairs on a queue and writes one byte; the actor's
``WatchMessage`` handler sends them. Every handler returns the watch (seen
here: once a handler returns None, no WatchMessage comes again).
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import queue
import signal
import socket
import sys
import threading
import time
from typing import Any

from thespian.actors import ActorExitRequest, ActorTypeDispatcher, ThespianWatch, WakeupMessage, WatchMessage

from omni_actors.actors import device_leases
from omni_actors.actors.cancels import CancelledStages
from omni_actors.actors.engine_stream import StreamingMixin
from omni_actors.actors.outbox import AddressNames, DeltaWindow, PendingChunk, Sequencer, bundle, coalesce
from omni_actors.actors.processor_threads import ProcessorsBusy, ProcessorThreads, hung_after_s, runs_inline
from omni_actors.actors.stack_dumps import StackDumps
from omni_actors.actors.supervision import (POOL_HUNG_INTERVALS, ParentWatch, WakeupChain, exit_if_orphaned_before_start,
                                          host_identity)
from omni_actors.actors.node_agent import on_node
from omni_actors.config_checks import resolve_processor
from omni_actors.connectors import ConnectorError, data_client, make_connector, release_all
from omni_actors.connectors.omni import OmniDataMissing
from omni_actors.engines import create_backend
from omni_actors.engines.base import (REPLICA_PROCESS_NAME, BackendEvent, BackendTask, InputLost, OutputChunk,
                                     StageFinal, StageInputError, TextDelta, UpstreamTimeout, replica_log_prefix)
from omni_actors.logs import get_logger
from omni_actors.messages import (CancelStage, DataServicesSilent, DeltasAck, DrainReplica, EngineFailed,
                                  EngineReady, ErrorKind, FaultKind, Heartbeat, HeartbeatAck, InjectFault,
                                  OutputDelta, OutputDeltas, StageAccepted,
                                  StageCancelled, StageDone, StageFailed, StageTask, StartEngine, TaskFinished,
                                  TextStarted, cancels_attempt)
from omni_actors.placement import replica_devices
from omni_actors.processors import InvalidRequest, default_input, read_only_hint

#: Missing pool acks for this many heartbeat intervals means the pool is gone (one on this
#: host must also no longer be our parent process, ``ParentWatch``: a busy pool acks late).
ORPHAN_AFTER_INTERVALS = 3
#: Longest a text delta waits to share a message with the next ones (50 updates a
#: second per stream): an actor message costs about 1 ms of CPU here, so one per
#: token would cap a replica near a thousand tokens a second, all streams together.
STREAM_FLUSH_S = 0.02
#: Heartbeat intervals without a heartbeat wake-up before an engine starts them again.
HEARTBEAT_LOST_AFTER_INTERVALS = 3
#: How long an exiting replica waits for its backend to stop (a vLLM core takes 2.5 s alone,
#: over 5 s when three stop at once on 2 cores).
SHUTDOWN_TIMEOUT_S = 10.0

#: How long a drained replica lingers before it exits, so its last messages leave first.
EXIT_GRACE_S = 0.5

#: Which output fields go to the client for each final output type.
FINAL_FIELDS = {"text": ("text",), "audio": ("audio", "sample_rate"), "image": ("image",)}



def _log_escaped(future) -> None:
    """Done-callback of a coroutine run on an engine's loop: log what it let out."""
    if not future.cancelled() and future.exception() is not None:
        get_logger(actor="engine").error("engine_task_error", error=repr(future.exception()),
                                         exc_info=future.exception())

class LoopThread:
    """An asyncio loop on a daemon thread, with an outbox the actor drains."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._rsock, self._wsock = socket.socketpair()
        self._rsock.setblocking(False)
        self._flush: asyncio.TimerHandle | None = None  # the pending STREAM_FLUSH_S wake-up
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @property
    def fileno(self) -> int:
        return self._rsock.fileno()

    def submit(self, coro) -> None:
        """Run ``coro`` on the loop; an exception it lets out is logged (it was lost)."""
        asyncio.run_coroutine_threadsafe(coro, self.loop).add_done_callback(_log_escaped)

    def emit(self, address: Any, message: Any, *, urgent: bool = True) -> None:
        """Called on the loop thread: queue a message for the actor to send.

        Urgent messages wake the actor now (and so flush everything queued
        before them, in order); others wait at most ``STREAM_FLUSH_S`` so that
        text deltas of many tokens travel in one message.
        """
        self.outbox.put((address, message))
        if urgent:
            self._wake()
        elif self._flush is None:
            self._flush = self.loop.call_later(STREAM_FLUSH_S, self._wake)

    def _wake(self) -> None:
        # (on the loop thread) An urgent wake-up flushes what the pending timer was for:
        # that timer is cancelled, else it would wake the actor again for a few deltas
        # (measured: a third more drains, so messages, at 8 concurrent streams).
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        try:
            self._wsock.send(b"x")
        except (BlockingIOError, OSError):
            pass  # a wake-up byte is already pending or we are shutting down

    def drain(self) -> list[tuple[Any, Any]]:
        try:
            while self._rsock.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        items = []
        while True:
            try:
                items.append(self.outbox.get_nowait())
            except queue.Empty:
                return items

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=2.0)


def _raised_at(exc: BaseException | None) -> str | None:
    """Where ``exc`` was raised: ``"file.py:12 in f"``, the last frame of its traceback that
    is not in an installed package, the standard library or this package's actors (the
    user's processor, not the NumPy call that raised in it), else its last; for a processor's error in the log (trial
    CQ: one line with no file or line). None without a traceback."""
    import sysconfig

    tb = exc.__traceback__ if exc is not None else None
    if tb is None:
        return None
    # (and this package's own actors: the processor thread that called it, a review)
    libs = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}) + (os.path.dirname(__file__),)
    last = ours = None
    while tb is not None:
        last = tb
        if not tb.tb_frame.f_code.co_filename.startswith(libs):
            ours = tb
        tb = tb.tb_next
    tb = ours or last
    code = tb.tb_frame.f_code
    return f"{code.co_filename}:{tb.tb_lineno} in {code.co_name}"


def made_units(event: BackendEvent, made: int, texted: bool = False) -> int:
    """What ``event`` adds to a replica's progress (its ``rate`` in ``status``): tokens it
    holds (text deltas' ``token_ids``; a chunk's ``token_ids`` or ``codes``), or 1 for an
    output that counts none (audio, an image); for the final event, the tokens of
    ``num_output_tokens`` not counted before (``made``), else 1 if nothing was. (Each event
    counted 1: a vLLM Thinker under load, whose deltas merge, showed a fraction of its
    tokens/s, and a Talker its tasks/s; a review.) ``texted``: the task has sent text deltas,
    whose tokens its chunks carry again (a streaming Thinker's: counted once, not twice).
    At least 1 for every event but a final one whose tokens were all counted and such a
    chunk: the stall watchdog sees any progress (the deltas are progress)."""
    if isinstance(event, TextDelta):
        return len(event.token_ids) or 1
    if isinstance(event, OutputChunk):
        if texted:
            return 0
        ids = event.outputs.get("token_ids", event.outputs.get("codes"))
        return len(ids) if hasattr(ids, "__len__") and len(ids) else 1
    if isinstance(event, StageFinal):
        return max(0, event.num_output_tokens - made) if event.num_output_tokens else int(made == 0)
    return 1


class EngineActor(StreamingMixin, ActorTypeDispatcher):
    """Hosts one engine backend; see the module docstring for the threading model."""

    # Placed by the coordinator: created with targetActorRequirements={"omni_node": N}.
    actorSystemCapabilityCheck = staticmethod(on_node)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._started = threading.Event()  # StartEngine came (see exit_if_orphaned_before_start)
        exit_if_orphaned_before_start(self._started)
        self._rt: LoopThread | None = None
        self._spec: StartEngine | None = None
        self._pool = None
        self._backend = None
        self._ready = False
        self._tasks: dict[tuple[str, int], asyncio.Task] = {}
        #: cancels that came before their task started on the loop (loop thread only)
        self._cancelled_early = CancelledStages()
        self._task_attempts: dict[tuple[str, int], int] = {}  #: the attempt of each of ``_tasks`` (loop thread)
        #: the attempt of each of ``_tasks`` that a CancelStage cancelled (loop thread): its
        #: StageCancelled is ``asked``, not its replica's own doing
        self._cancel_asked: dict[tuple[str, int], int] = {}
        #: (request, stage, attempt) -> the task of an earlier attempt still running when a later
        #: one of the same task came (a streaming consumer started over here): a cancel of it
        #: still reaches it (loop thread)
        self._superseded: dict[tuple[str, int, int], asyncio.Task] = {}
        self._sequencer: Sequencer | None = None
        self._names = AddressNames()  # str() of the addresses its outbox sends to, kept across drains
        self._deltas: DeltaWindow | None = None  # text deltas in flight per bridge (see DeltaWindow)
        # Streaming between stages, per (request, stage), on the loop thread:
        self._inputs: dict[tuple[str, int], tuple[int, asyncio.Queue]] = {}  # attempt, input chunks
        self._credits: dict[tuple[str, int], list] = {}  # [attempt, chunks acknowledged, wake-up event]
        self._completed = 0
        self._failed = 0
        self._progress = 0  # backend events produced: the pool's stall watchdog reads it
        self._progress_at = time.monotonic()  # start of the idle clock: last event or end of a wait
        self._parked = 0  # tasks waiting on a neighbour stage (input chunks, credits)
        #: why this replica is broken: its processor threads are all held by calls that never returned
        self._processors_failure = ""
        self._processor_threads: ProcessorThreads | None = None  # (None: the processor runs on the loop)
        self._last_ack = time.monotonic()
        self._last_hb = time.monotonic()  # when the heartbeat wake-up last ran
        self._heartbeats = WakeupChain("heartbeat")  # (restarted when its wake-up is lost: see _watch)
        self._stacks = StackDumps()  # (armed once started: where its threads were if it goes silent)
        self._draining = False
        self._orphaned = False  # the pool is gone (no ack for orphan_after_s; see ParentWatch.lost)
        self._parent = ParentWatch(0, "")
        self._fault: InjectFault | None = None
        self._fault_seq = 0  # (the InjectFault.seq of the fault set last: its heartbeats say it)
        self._stalled: asyncio.Event | None = None
        #: what its engine's start waits for: devices still held by an old engine (see device_leases)
        self._waiting_for = ""
        self._silent_services: frozenset[str] = frozenset()  # (DataServicesSilent)
        self._device_note = ""  # what its start did about an old engine on its devices (EngineReady.note)
        self._leases: str | None = None  # the lease directory where it took its devices' leases
        self._log = get_logger(actor="engine")

    def _watch(self):
        """What every handler returns: the outbox's socket to watch. Also restarts the
        heartbeats when their wake-up was lost (Thespian drops the wake-ups that fall due
        while an actor drains an excessive transmit queue): a replica that stopped
        heartbeating would be taken for hung and restarted."""
        spec = self._spec
        if spec is not None and not self._orphaned and \
                time.monotonic() - self._last_hb > HEARTBEAT_LOST_AFTER_INTERVALS * spec.heartbeat_interval_s:
            self._log.warning("heartbeat_wakeup_lost", since_s=round(time.monotonic() - self._last_hb, 2))
            self._last_hb = time.monotonic()
            self._heartbeats.start(self, 0.0)
        return ThespianWatch([self._rt.fileno]) if self._rt else None

    # -- control plane ----------------------------------------------------
    def receiveMsg_StartEngine(self, msg: StartEngine, sender):
        if self._rt is not None:
            return self._watch()
        self._spec, self._pool = msg, sender
        self._started.set()
        self._parent = ParentWatch(msg.pool_pid, msg.pool_host)
        self._log = self._log.bind(stage=msg.stage.name, replica=msg.replica)
        self._connector = connector = make_connector(msg.inline_threshold_bytes, mode=msg.connector_mode)
        self._sequencer = Sequencer(connector.put, release_all)
        self._deltas = DeltaWindow(self.myAddress, log=self._log)
        func = msg.stage.custom_process_input_func
        # Pinning: set before the backend (and CUDA) is imported in this process. The
        # coordinator's placement decides; without one (a CPU node), vLLM-Omni's own
        # single-host `runtime.devices` still applies.
        devices = ",".join(msg.devices) if msg.devices else replica_devices(
            msg.stage.runtime.devices, msg.slot, msg.deployment.devices_per_replica)
        if devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = str(devices)
        # vLLM's own log lines (its engine core's too, a child process) say which replica printed
        # them: vLLM reads the prefix once, when it is first imported (in this process, below)
        os.environ["VLLM_LOGGING_PREFIX"] = replica_log_prefix(msg.replica)
        # ... and what this process is: vLLM's lines give its process name, which was Thespian's
        # `Actor_EngineActor__ActorAddr-LocalAddr.1` (trial BC), beside its engine core's `EngineCore`
        multiprocessing.current_process().name = REPLICA_PROCESS_NAME
        self._rt = LoopThread()
        try:
            if msg.deployment.backend == "vllm_omni":
                # vLLM-Omni processors have vLLM-Omni's signature: the backend runs them.
                from omni_actors.engines.vllm_omni import stage_inputs

                self._processor = stage_inputs
            else:
                self._processor = resolve_processor(func) if func else default_input
            inline = runs_inline(self._processor)
            self._stacks = StackDumps(msg.orphan_after_s or ORPHAN_AFTER_INTERVALS * msg.heartbeat_interval_s,
                                      msg.heartbeat_interval_s, processor=not inline)
            self._processor_threads = None if inline else ProcessorThreads(marks=self._stacks.marks)
            self._backend = create_backend(msg.stage, msg.deployment, msg.replica)
        except Exception as exc:  # noqa: BLE001 - any load failure is reported, not raised
            self._log.error("engine_load_failed", error=str(exc))
            self.send(sender, EngineFailed(msg.replica, f"{type(exc).__name__}: {exc}"))
            return self._watch()
        self._rt.submit(self._start_backend())
        self._last_hb = time.monotonic()
        self._heartbeats.start(self, msg.heartbeat_interval_s)
        self._stacks.arm()
        return self._watch()

    async def _start_backend(self) -> None:
        spec = self._spec
        t0 = time.monotonic()
        try:
            if spec.devices:
                await asyncio.to_thread(self._wait_for_devices, spec)
            prepare = getattr(self._connector, "prepare", None)
            if prepare is not None:  # a vLLM-Omni connector (omni: modes) is built now, not by a task
                await asyncio.to_thread(prepare)
            await self._backend.start()
        except Exception as exc:  # noqa: BLE001
            self._rt.emit(self._pool, EngineFailed(spec.replica, f"{type(exc).__name__}: {exc}"))
            return
        if self._leases:  # (its engine's own processes hold the devices too: a vLLM core)
            from omni_actors.system.processes import descendants

            try:
                device_leases.take(self._leases, tuple(spec.devices), spec.replica, [os.getpid(), *descendants()])
            except OSError as exc:  # (it was lost: no EngineReady, no EngineFailed, a restart at ready_timeout_s)
                self._rt.emit(self._pool, EngineFailed(spec.replica, f"cannot record its device leases: {exc}"))
                return
        self._ready = True
        self._log.info("engine_ready", load_s=round(time.monotonic() - t0, 3), pid=os.getpid())
        self._rt.emit(self._pool, EngineReady(spec.replica, os.getpid(), spec.node,
                                              os.environ.get("CUDA_VISIBLE_DEVICES", ""),
                                              spec.deployment.backend, host_identity(), note=self._device_note))

    def _wait_for_devices(self, spec: StartEngine) -> None:
        """On a worker thread, before the engine loads: wait for the processes that still
        hold this replica's devices (an old engine, orphaned when its pool or the coordinator
        was lost and recreated) to exit, at most ``spec.device_wait_s``; kill those still
        running then (frozen or hung: their pool is gone); then lease the devices."""
        def waiting(what: str) -> None:
            self._waiting_for = what and (f"{what} to be freed: an engine from before, still exiting;"
                                          f" killed if still running after {spec.device_wait_s:g} s, or once"
                                          f" stopped (SIGSTOP) for {device_leases.STOPPED_KILL_AFTER_S:g} s")
            if what:
                self._log.warning("engine_waits_for_devices", held=what, limit_s=spec.device_wait_s)

        waited, evicted, still = device_leases.wait_and_take(tuple(spec.devices), spec.replica,
                                                             spec.device_wait_s, on_wait=waiting)
        self._leases = device_leases.lease_dir()
        if evicted:  # (its pool is gone or replaced it: nothing else would ever stop it)
            self._log.error("engine_killed_device_holders", held=evicted, waited_s=round(waited, 2),
                            why="still running after the wait; frozen or hung")
            self._device_note = f"killed the old engine that still held {evicted} after {waited:.0f} s"
        if still:
            self._log.error("engine_loads_beside_device_holders", held=still, waited_s=round(waited, 2))
            self._device_note = f"loaded beside an old engine that could not be killed: {still}"
        elif waited >= device_leases.POLL_S and not evicted:
            self._log.info("engine_devices_freed", waited_s=round(waited, 2))

    def receiveMsg_WakeupMessage(self, msg: WakeupMessage, sender):
        if msg.payload == "exit" and self._draining and not self._tasks:
            held = self._deltas.flush() if self._deltas is not None else []
            if held:  # (text held for a slow API server goes first, and gets its moment in transit)
                for address, message in held:
                    self.send(address, message)
                self.wakeupAfter(EXIT_GRACE_S, payload="exit")
                return self._watch()
            self.send(self.myAddress, ActorExitRequest())
            return self._watch()
        if msg.payload == "orphan_deadline" and self._rt is not None:
            self._rt.loop.call_soon_threadsafe(self._cancel_all, "its pool is gone")
            return self._watch()
        if self._heartbeats.owns(msg.payload) and self._spec is not None:
            if not self._heartbeats.current(msg.payload):
                return self._watch()  # (a chain replaced after a lost wake-up, see _watch)
            self._last_hb = time.monotonic()
            interval = self._spec.heartbeat_interval_s
            self._check_engine()
            orphan_after_s = max(ORPHAN_AFTER_INTERVALS * interval, self._spec.orphan_after_s)
            if not self._orphaned and self._parent.lost(time.monotonic() - self._last_ack, orphan_after_s, self._pool,
                                                        (POOL_HUNG_INTERVALS + 2) * interval):
                # The pool is gone. Its replacement's RequestActors re-sent these tasks, and no
                # cancel can reach us any more: they get as long again to end, then are cancelled
                # (one waiting for chunk credits from a consumer that moved on would wait forever).
                self._log.warning("pool_lost_draining", in_flight=len(self._tasks), no_ack_for_s=orphan_after_s,
                                  parent_gone=self._parent.gone())
                self._orphaned = True
                self._start_drain()
                self.wakeupAfter(orphan_after_s, payload="orphan_deadline")
            if self._orphaned:  # nobody to tell: no more heartbeats
                self._stacks.close()
                return self._watch()
            self._stacks.arm()
            load = self._backend.load() if (self._backend and self._ready) else None
            self.send(self._pool, Heartbeat(
                replica=self._spec.replica,
                running=load.running if load else 0,
                waiting=load.waiting if load else 0,
                completed=self._completed, failed=self._failed,
                kv_cache_usage=load.kv_cache_usage if load else None, progress=self._progress,
                idle_s=self._idle_s(), fault=self._fault.describe() if self._fault else "",
                fault_seq=self._fault_seq,
                waiting_for=self._waiting_for, pid=0 if self._ready else os.getpid(),
                host="" if self._ready else host_identity(),
                phase="" if self._ready else getattr(self._backend, "start_phase", "")))
            self._heartbeats.again(self, self._spec.heartbeat_interval_s)
            for address, message in self._deltas.due():
                self.send(address, message)
        return self._watch()

    def _all_held(self, parked: int) -> bool:
        """Whether, with ``parked`` tasks waiting on a neighbour stage, every task here is
        held up by others: those, and the tasks queued in the backend for a slot that they
        occupy (a trial: a Thinker at its ``max_concurrency`` with every stream held back by
        a frozen API server took one more request, and was isolated as stalled)."""
        if parked >= len(self._tasks):
            return True
        if not parked or self._backend is None or not self._ready:
            return False
        try:
            waiting = self._backend.load().waiting
        except Exception:  # noqa: BLE001 - a backend that cannot say: as before
            return False
        return parked + waiting >= len(self._tasks)

    def _idle_s(self) -> float:
        """Seconds without progress, as the stall watchdog should see them: 0
        with no task here (the pool may still count tasks whose end is in
        transit: messages can overtake each other) or while every task waits
        on a neighbour stage (see StreamingMixin). The backend's own activity
        (``active_at``: a prefill step) counts as progress, except under an
        injected stall, which holds the backend's events while it works on."""
        if self._all_held(self._parked):
            return 0.0
        last = self._progress_at
        if self._stalled is None:
            last = max(last, getattr(self._backend, "active_at", 0.0) or 0.0)
        return round(max(0.0, time.monotonic() - last), 4)

    def receiveMsg_WatchMessage(self, msg: WatchMessage, sender):
        if self._rt is not None:
            stamped = []
            for address, message in coalesce(self._rt.drain(), self._names):
                try:
                    message = self._sequencer.stamp(message)
                except Exception as exc:  # noqa: BLE001 - a chunk could not be stored (shm full)
                    self._chunk_lost(address, message, exc)
                    continue
                if message is not None:  # (None: a later message of an attempt that lost a chunk)
                    stamped.append((address, message))
            for address, message in bundle(stamped, self._names):
                if isinstance(message, OutputDeltas):
                    message = self._deltas.admit(address, self._names[address], message)
                    if message is None:
                        continue  # held: that API server has not answered for the last ones yet
                self.send(address, message)
        return self._watch()

    def receiveMsg_DeltasAck(self, msg: DeltasAck, sender):
        if self._deltas is not None:
            for address, message in self._deltas.acked(msg.peer, msg.upto):
                self.send(address, message)
        return self._watch()

    def _chunk_lost(self, address, chunk: PendingChunk, exc: Exception) -> None:
        """A chunk's outputs could not be stored: its task fails (and is cancelled here)."""
        self._log.error("stage_chunk_lost", request_id=chunk.request_id, error=str(exc))
        self._sequencer.lost(chunk.request_id, chunk.stage_id, chunk.attempt)
        replica = self._spec.replica
        self.send(address, StageFailed(chunk.request_id, chunk.stage_id, replica, ErrorKind.ENGINE_ERROR,
                                       f"stage {self._spec.stage.name} ({replica}): could not store an output "
                                       f"chunk: {exc}", chunk.attempt))
        # (that attempt only: its retry may come back here, and a cancel of every attempt, kept
        # because the task had ended, stopped the retry at once; a code review)
        self._rt.loop.call_soon_threadsafe(self._cancel, chunk.request_id, chunk.stage_id, chunk.attempt)

    def receiveMsg_HeartbeatAck(self, msg: HeartbeatAck, sender):
        self._last_ack = time.monotonic()
        return self._watch()

    def _check_engine(self) -> None:
        """If the backend's engine died under us (a vLLM core crash: its ``failure``), take
        no more work and tell the pool, which restarts us. Checked at each heartbeat (and
        on the loop thread when a task finds the engine dead: see ``_run_task``)."""
        failure = getattr(self._backend, "failure", None) if self._ready else None
        if failure:
            self._log.error("engine_dead", reason=failure)
            self._ready = False
            self.send(self._pool, EngineFailed(self._spec.replica, failure))

    def receiveMsg_DataServicesSilent(self, msg: DataServicesSilent, sender):
        """Fetches of this replica's inputs waiting on a data service that its node agent says
        does not answer end at once (the task fails as its input lost, and its request runs
        again or fails: trial CG's replicas each waited the fetch's 10 s on a frozen member);
        one said to answer again is tried again at once."""
        now = frozenset(msg.services)
        for service in sorted(now - self._silent_services):
            self._log.warning("data_service_given_up", service=service, fetches_ended=data_client.give_up(service))
        for service in sorted(self._silent_services - now):
            if data_client.forget_down(service):
                self._log.info("data_service_answers_again", service=service)
        self._silent_services = now
        return self._watch()

    def receiveMsg_DrainReplica(self, msg: DrainReplica, sender):
        self._start_drain()
        return self._watch()

    def _start_drain(self) -> None:
        """Take no new work; exit once in-flight tasks end (checked per heartbeat and per task end)."""
        self._draining = True
        self._exit_if_drained()

    def _exit_if_drained(self) -> None:
        """Exit once drained, a moment after the last task's messages were handed to
        Thespian: they are still in transit, and go with the process if it exits now."""
        if self._draining and not self._tasks:
            self.wakeupAfter(EXIT_GRACE_S, payload="exit")

    def receiveMsg_InjectFault(self, msg: InjectFault, sender):
        # (the pool logs it as ``fault_injected``; trial CK counted each fault twice under that name)
        self._log.info("fault_applied", **msg.log_fields())
        if self._rt is not None:
            self._rt.loop.call_soon_threadsafe(self._set_fault, msg)
        return self._watch()

    def _set_fault(self, msg: InjectFault) -> None:
        """On the loop thread."""
        if self._stalled is not None:
            self._stalled.set()  # release tasks held by an earlier stall
            self._stalled = None
        self._fault = None if msg.kind == FaultKind.CLEAR else msg
        self._fault_seq = msg.seq
        if hasattr(self._backend, "slowdown"):
            # A backend that paces itself (the synthetic engine keeps to deadlines: it would make
            # up for any delay added between its events) is slowed from inside.
            self._backend.slowdown = msg.factor if msg.kind == FaultKind.SLOW else 1.0
        if msg.kind == FaultKind.STALL:
            self._stalled = asyncio.Event()

    def receiveMsg_ActorExitRequest(self, msg: ActorExitRequest, sender):
        self._stacks.close()  # (its heartbeats stop now: a long clean stop is no silence)
        if self._rt is not None and self._backend is not None and not self._ready:
            self._exit_while_loading()
        if self._rt is not None:
            if self._backend is not None:
                # Stop the engine cleanly (a vLLM core is a child process), within a bound.
                done = asyncio.run_coroutine_threadsafe(self._backend.shutdown(), self._rt.loop)
                try:
                    done.result(timeout=SHUTDOWN_TIMEOUT_S)
                except Exception as exc:  # noqa: BLE001 - exiting anyway
                    self._log.warning("backend_shutdown_incomplete", error=str(exc) or type(exc).__name__)
                else:
                    device_leases.release(self._leases, tuple(self._spec.devices or ()))
            self._rt.stop()  # daemon thread: in-flight tasks end with the process
            # Kept, not dropped: Thespian still watches its socket's fd number until the process
            # ends (it asks no handler for a watch after an exit request). Closed now, the number
            # could come back for a socket that sends our last messages, and Thespian would
            # register it twice ("KeyError: ... is already registered", a traceback at exit).
            self._stopped_rt, self._rt = self._rt, None
        if self._orphaned:
            # Nothing left to say to anyone (the pool is gone), but Thespian would still try to
            # deliver the heartbeats it queued for the dead pool on the way out, and fails doing
            # so with a traceback ("... is already registered"). Leave now instead.
            self._log.info("engine_exit_orphaned")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        return None

    def _exit_while_loading(self) -> None:
        """Told to exit before its engine is ready: nothing of it is worth saving, and its
        shutdown would wait for the load (a vLLM engine's start blocks the loop the shutdown
        needs: a stop during start-up waited 10 s for each such replica, then killed them).
        End what the engine started (a vLLM core, its workers) and this process, now."""
        from omni_actors.system.processes import descendants

        self._log.info("engine_exit_while_loading")
        for pid in descendants():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    # -- request plane ----------------------------------------------------
    def receiveMsg_StageTask(self, msg: StageTask, sender):
        if not self._ready or self._draining:
            # The pool (alive: it just sent this) re-routes it. A word to the RequestActor
            # could be lost in transit if this process exits right after.
            self.send(sender, TaskFinished(self._spec.replica if self._spec else "?", msg.request_id,
                                           msg.stage_id, ok=False, rejected=True,
                                           reason="draining" if self._draining else "not ready",
                                           attempt=msg.attempt))
            return self._watch()
        self._rt.submit(self._run_task(msg))
        return self._watch()

    def receiveMsg_CancelStage(self, msg: CancelStage, sender):
        if self._rt is not None:
            self._rt.loop.call_soon_threadsafe(self._cancel, msg.request_id, msg.stage_id, msg.attempt, True)
        return self._watch()

    def _cancel(self, request_id: str, stage_id: int, attempt: int | None = None, asked: bool = False) -> None:
        """On the loop thread: abort the backend's work and the task (if its attempt is one
        ``attempt`` covers: :func:`~omni_actors.messages.cancels_attempt`). ``asked``: by a
        :class:`CancelStage` (else this replica's own doing: its StageCancelled says so)."""
        key = (request_id, stage_id)
        for (rid, sid, older), old_task in list(self._superseded.items()):
            if (rid, sid) == key and cancels_attempt(attempt, older) and not old_task.done():
                if asked:
                    self._cancel_asked[key] = older
                old_task.cancel()
        task = self._tasks.get(key)
        if task is not None and cancels_attempt(attempt, self._task_attempts.get(key, 0)):
            if not task.done():
                if asked:
                    self._cancel_asked[key] = self._task_attempts.get(key, 0)
                self._rt.loop.create_task(self._backend.abort(request_id))
                task.cancel()
            if asked and attempt is None:  # (its request is over: a later attempt on its way is cancelled too)
                self._cancelled_early.add(key, attempt)
        elif asked:  # (its task may still be on its way to the loop: see actors.cancels)
            self._cancelled_early.add(key, attempt)

    def _cancel_all(self, why: str) -> None:
        """On the loop thread: cancel every task still running (a drained replica then exits)."""
        if self._tasks:
            self._log.warning("tasks_cancelled", in_flight=len(self._tasks), reason=why)
        for request_id, stage_id in list(self._tasks):
            self._cancel(request_id, stage_id)

    async def _run_task(self, msg: StageTask) -> None:
        key = (msg.request_id, msg.stage_id)
        earlier = self._tasks.get(key)
        if earlier is not None and not earlier.done():
            self._superseded[(*key, self._task_attempts.get(key, 0))] = earlier
        self._tasks[key] = asyncio.current_task()
        self._task_attempts[key] = msg.attempt
        replica = self._spec.replica
        emit = self._rt.emit
        ok = cancelled = input_error = client_error = early = engine_dead = False
        try:
            if self._cancelled_early.take(key, msg.attempt):
                early = True
                raise asyncio.CancelledError  # (cancelled before it started)
            done = await self._execute(msg)
            emit(msg.reply_to, done)
            ok = True
        except asyncio.CancelledError:
            cancelled = True
            asked = early or self._cancel_asked.get(key) == msg.attempt
            self._log.info("stage_cancelled", request_id=msg.request_id, asked=asked)
            emit(msg.reply_to, StageCancelled(msg.request_id, msg.stage_id, msg.attempt, replica, asked=asked))
        except ConnectorError as exc:
            # Inputs are released only when their request ends: it ended (the client left)
            # while this task was on its way. Not this replica's fault: it ends as cancelled.
            cancelled = True
            self._log.info("stage_inputs_released", request_id=msg.request_id, error=str(exc))
            emit(msg.reply_to, StageCancelled(msg.request_id, msg.stage_id, msg.attempt, replica, asked=False))
        except UpstreamTimeout as exc:
            # A neighbour stage stopped streaming: the request fails with the reason; this
            # replica is healthy (not counted as its failure).
            cancelled = True
            self._log.warning("stage_stream_timeout", request_id=msg.request_id, error=str(exc))
            emit(msg.reply_to, StageFailed(msg.request_id, msg.stage_id, replica, ErrorKind.TIMEOUT,
                                           f"stage {self._spec.stage.name} ({replica}): {exc}", msg.attempt,
                                           moved=msg.moved))
        except InputLost as exc:
            # An upstream stage's output went with its host (its data service is unreachable):
            # this replica is healthy (not counted as its failure), and any other would fail the
            # same way, so the request ends and its API server runs it again once that host is
            # reported down (a retry here would hammer the dead service: seen 5 in 50 ms).
            cancelled = True
            self._log.warning("stage_input_lost", request_id=msg.request_id, node=exc.node, error=str(exc))
            emit(msg.reply_to, StageFailed(msg.request_id, msg.stage_id, replica, ErrorKind.INPUT_LOST,
                                           f"stage {self._spec.stage.name} ({replica}): an input was lost with "
                                           f"host {exc.node}: {exc}", msg.attempt, moved=msg.moved,
                                           lost_on=exc.node))
        except Exception as exc:  # noqa: BLE001 - a task failure fails the task, not the replica
            # What it was given, not this replica: a processor that cannot use its upstream outputs
            # (500, the same anywhere), a ValueError on the client's input (400, e.g. a prompt over
            # vLLM's max_model_len). Neither counts towards the replica's circuit breaker.
            # A vLLM-Omni connector with nothing for an input (read already by an attempt before,
            # one that hands data to its first reader; expired) fails the same on any replica. (One
            # that cannot be built or reached here is this replica's: retried elsewhere, counted.)
            # A processor call that could not start (every thread held by other tasks' calls) is this
            # replica's, not the request's: retried elsewhere, a 503 to try again if none takes it
            # (trial CT: an engine error, a 500 that said not to retry), counted by its breaker.
            kind = (ErrorKind.STAGE_INPUT if isinstance(exc, (StageInputError, OmniDataMissing)) else
                    ErrorKind.BAD_REQUEST if isinstance(exc, ValueError) else
                    ErrorKind.UNAVAILABLE if isinstance(exc, ProcessorsBusy) else ErrorKind.ENGINE_ERROR)
            input_error = kind in (ErrorKind.STAGE_INPUT, ErrorKind.BAD_REQUEST)
            client_error = kind == ErrorKind.BAD_REQUEST
            # (a client's bad input, a 400, is no warning of the replica's: trial CL read it as one)
            (self._log.info if client_error else self._log.warning)(
                "stage_failed", request_id=msg.request_id, error=str(exc), kind=kind.value,
                where=_raised_at(exc.__cause__) if kind == ErrorKind.STAGE_INPUT else None)
            failure = getattr(self._backend, "failure", None) or self._processors_failure
            if failure and self._ready:
                # Its engine is dead: the pool hears it now. (It heard at the next heartbeat:
                # meanwhile the tasks it sent failed at once, and five failures in a row tripped
                # the circuit breaker first: trial V.)
                self._ready = False  # (the actor thread takes no more work)
                self._log.error("engine_dead", reason=failure)
                emit(self._pool, EngineFailed(replica, failure))
            engine_dead = bool(failure) and kind == ErrorKind.ENGINE_ERROR
            if not engine_dead:
                emit(msg.reply_to, StageFailed(msg.request_id, msg.stage_id, replica, kind,
                                               f"stage {self._spec.stage.name} ({replica}): {exc}", msg.attempt,
                                               moved=msg.moved))
            # (else neither a StageFailed nor a TaskFinished: the pool, told of the death, sends every
            # task in flight here elsewhere, counting the crash against each, as when a replica's
            # process dies. Its RequestActor retried each a second time beside the pool's copy,
            # and, not knowing of the crash, let a poison request take down one replica more:
            # a code review.)
        finally:
            # (Only this attempt's: a retry of the same task may be running here already.)
            if self._tasks.get(key) is asyncio.current_task():
                del self._tasks[key]
                self._task_attempts.pop(key, None)
            if self._cancel_asked.get(key) == msg.attempt:
                del self._cancel_asked[key]
            self._superseded.pop((*key, msg.attempt), None)
            for table in (self._inputs, self._credits):
                if table.get(key, (msg.attempt,))[0] == msg.attempt:
                    table.pop(key, None)
            if ok:
                self._completed += 1
            elif not cancelled and not client_error:
                self._failed += 1
            if not engine_dead:
                emit(self._pool, TaskFinished(replica, msg.request_id, msg.stage_id, ok, cancelled,
                                              input_error=input_error, client_error=client_error,
                                              attempt=msg.attempt))
            if self._draining and not self._tasks:
                emit(self.myAddress, DrainReplica(replica))  # the actor thread exits us

    async def _faulty(self, events):
        """The backend's events, with any injected fault applied."""
        fault = self._fault
        if fault is not None and fault.kind == FaultKind.RAISE_NEXT:
            self._fault = dataclasses.replace(fault, count=fault.count - 1) if fault.count > 1 else None
            raise RuntimeError("injected fault: backend raised")
        last = time.monotonic()
        async for event in events:
            if self._stalled is not None:
                await self._stalled.wait()
            fault = self._fault
            if fault is not None and fault.kind == FaultKind.SLOW and fault.factor > 1 \
                    and not hasattr(self._backend, "slowdown"):
                await asyncio.sleep((time.monotonic() - last) * (fault.factor - 1))
            last = time.monotonic()
            yield event

    async def _process_input(self, upstream: dict, msg: StageTask) -> dict:
        """The stage's engine input from its upstream stages' outputs (the processor): one
        of this package's on the loop, one of the user's on a processor thread, waited for
        ``StartEngine.processor_timeout_s`` at most (the time counts as the replica's work,
        not a stall: see :meth:`_idle_s`).

        Raises:
            StageInputError: the processor failed on upstream outputs (none: on the
                client's prompt, whose ValueError stays a bad request), or did not return
                in time.
        """
        try:
            if self._processor_threads is None:
                made = self._processor(upstream, msg.prompt, msg.params)
            else:
                made = await self._on_processor_thread(upstream, msg)
        except (StageInputError, InvalidRequest, ProcessorsBusy):
            raise  # (InvalidRequest: the processor refuses what the client asked, a 400)
        except Exception as exc:  # noqa: BLE001 - reported with the processor's name
            if not upstream:
                raise
            raise StageInputError(f"{self._processor_name()} failed on the outputs of stage(s) {sorted(upstream)}: "
                                  f"{type(exc).__name__}: {exc}{read_only_hint(exc)}") from exc
        if not isinstance(made, dict):  # (a processor's `[]` read as the engine's error about its fields)
            raise StageInputError(f"{self._processor_name()} returned {type(made).__name__}, not a dict (the "
                                  "stage's engine input)")
        return made

    async def _on_processor_thread(self, upstream: dict, msg: StageTask) -> Any:
        timeout_s = self._spec.processor_timeout_s
        threads = self._processor_threads
        done = threads.submit(self._processor, upstream, msg.prompt, msg.params, task=(msg.request_id, msg.stage_id))
        future = asyncio.wrap_future(done)
        try:
            # (time in a processor is no stall of the replica's while every task is in one or waits on
            # a neighbour, as time parked is; it is bounded here)
            with self._parked_while():
                finished, _ = await asyncio.wait({future}, timeout=timeout_s)
        finally:
            if not future.done():  # (the task cancelled, or the wait over: one still queued never starts)
                done.cancel()  # (at once: the wrapper's cancel reaches it only at the loop's next turn)
                future.cancel()
        if finished:
            return future.result()  # (what it raised: a TimeoutError of its own too, a review)
        began = not done.cancelled()
        hung_s = hung_after_s(timeout_s)
        hung = threads.held(hung_s)
        name = self._processor_name()
        if hung >= threads.size and not self._processors_failure:
            # Every thread holds a call that has not returned for that long: every task would wait
            # here in vain (a review). The replica is broken: its pool restarts it.
            self._processors_failure = (f"all {threads.size} of its processor threads are held by calls of "
                                        f"{name} that have not returned for {hung_s:g} s")
        if not began:
            # (the replica's, not this request's: trial CS's innocent request got a 500 that said not to
            # retry. See the handler in _run_task: retried on another replica, counted by this one's
            # circuit breaker, which restarts a replica whose threads stay held.)
            raise ProcessorsBusy(
                f"{name} did not start within {timeout_s:g} s (supervision.stall_timeout_s): all "
                f"{threads.size} processor threads of this replica are busy ({threads.held(timeout_s)} with "
                "calls over that time, of other requests)")
        raise StageInputError(
            f"{name} did not return within {timeout_s:g} s (supervision.stall_timeout_s) on the outputs of "
            f"stage(s) {sorted(upstream)}: a processor runs for every request (on every chunk of an edge that "
            "streams) and must be quick")

    async def _naming_processor(self, events, msg: StageTask):
        """The backend's ``events``; a StageInputError of the engine (it cannot take what the
        processor made) names the processor too (trial CQ read only "dit: engine_input has
        no `prior_token_ids`")."""
        try:
            async for event in events:
                yield event
        except StageInputError as exc:
            name = self._processor_name()
            # (an edge that streams: the stage's chunks, made by the processor from the source's, trial CS)
            sources = sorted({sid for sid, _ in msg.inputs} | ({msg.stream_source} if msg.stream_source is not None
                                                                else set()))
            if not sources or name in str(exc):
                raise
            raise StageInputError(f"{exc} (in what {name} made of the outputs of stage(s) {sources})") from exc

    def _processor_name(self) -> str:
        return self._spec.stage.custom_process_input_func or "the default input processor"

    async def _execute(self, msg: StageTask) -> StageDone:
        key = (msg.request_id, msg.stage_id)
        stream = None
        if msg.stream_source is not None:
            queue_ = asyncio.Queue()  # bounded by the producer's window (credits), not here
            self._inputs[key] = (msg.attempt, queue_)
            stream = self._input_chunks(msg, queue_)
            self._rt.emit(msg.reply_to, StageAccepted(msg.request_id, msg.stage_id, msg.attempt))
        if msg.emit_chunks:
            self._credits[key] = [msg.attempt, 0, asyncio.Event()]
        upstream = {sid: await self._fetch(ref) for sid, ref in msg.inputs}
        engine_input = await self._process_input(upstream, msg) if stream is None else {}
        sampling = {**self._spec.stage.default_sampling_params, **msg.sampling_params}
        task = BackendTask(msg.request_id, engine_input, sampling, dict(msg.params), input_stream=stream,
                           emit_chunks=msg.emit_chunks, chunk_tokens=msg.chunk_tokens,
                           # (the client's, where this stage takes its overrides: RequestActor._sampling_for)
                           max_tokens_asked=msg.sampling_params.get("max_tokens"))
        final: StageFinal | None = None
        first_text = True
        chunks = 0  # made by the backend (several may leave in one message: see actors/outbox.py)
        made, texted = 0, False  # tokens (or outputs) of this task counted in _progress so far
        async for event in self._faulty(self._naming_processor(self._backend.generate(task), msg)):
            units = made_units(event, made, texted)
            texted = texted or isinstance(event, TextDelta)
            made += units
            self._progress += units
            self._progress_at = time.monotonic()
            if isinstance(event, TextDelta):
                if msg.text_to is not None and event.text:
                    # Straight to the client's bridge. The first text goes at once (time to
                    # first token), then the RequestActor learns that text reached the client;
                    # the rest rides in batches of at most STREAM_FLUSH_S (see LoopThread.emit).
                    self._rt.emit(msg.text_to, OutputDelta(msg.request_id, event.text, stage_id=msg.stage_id,
                                                           attempt=msg.attempt), urgent=False)
                    if first_text:
                        self._rt.emit(msg.reply_to, TextStarted(msg.request_id, msg.stage_id, msg.attempt))
                        first_text = False
            elif isinstance(event, OutputChunk):
                if msg.emit_chunks:
                    await self._wait_credit(msg, chunks)
                    self._rt.emit(msg.reply_to, PendingChunk(msg.request_id, msg.stage_id, msg.attempt,
                                                             [event.outputs], chunks))
                    chunks += 1
            elif isinstance(event, StageFinal):
                final = event
        if final is None:
            raise asyncio.CancelledError()  # aborted inside the backend
        output = final_ref = None
        try:
            if msg.needs_output:
                output = self._connector.put(final.outputs)
            if msg.final_output_type and not (chunks and msg.final_output_type == "audio"):
                # (audio sent in chunks went to the client already)
                fields = FINAL_FIELDS.get(msg.final_output_type, ())
                final_ref = self._connector.put({k: final.outputs[k] for k in fields if k in final.outputs},
                                                final=True)
        except BaseException:
            release_all([output, final_ref])
            raise
        finish = final.finish_reason
        if finish is None:
            limit = sampling.get("max_tokens")
            finish = "length" if limit is not None and final.num_output_tokens >= int(limit) else "stop"
        return StageDone(msg.request_id, msg.stage_id, self._spec.replica, output, final_ref,
                         prompt_tokens=final.num_prompt_tokens, output_tokens=final.num_output_tokens,
                         finish_reason=finish, attempt=msg.attempt)  # (deltas, chunks: see Sequencer)
