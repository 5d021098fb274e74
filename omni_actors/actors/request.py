"""RequestActor: walks the stage graph for one request at a time.

A stage is dispatched to its pool as soon as every stage in its
``engine_input_source`` is done (fan-in waits for all sources); upstream
outputs pass as connector references only. Text deltas of a final text stage
are forwarded to the bridge as they come; each final output goes to the
bridge by reference (the bridge fetches and releases it). At the end, however
the request ends (done, stage error, client cancel, deadline), every running
stage is cancelled and every intermediate buffer is released.

Creating an actor is a fork (about 8 ms here), so the bridge keeps a pool of
ready RequestActors and reuses each one after it reports
:class:`~omni_actors.messages.RequestFinished`; state is reset per request.
Messages for a request that is no longer current (a late ``StageDone`` after a
cancel) only have their buffers released.
"""

from __future__ import annotations

import dataclasses
import time

from thespian.actors import ActorTypeDispatcher, WakeupMessage

from omni_actors.connectors import make_connector, release_all
from omni_actors.logs import get_logger
from omni_actors.messages import (CancelRequest, CancelStage, ErrorKind, OutputDelta, OutputReady,
                                  RequestFinished, RoutesChanged, RunRequest, StageDelta, StageDone, StageFailed,
                                  StageTask)

#: Stage failures worth another replica: the engine raised, or was going away.
RETRYABLE = (ErrorKind.ENGINE_ERROR, ErrorKind.UNAVAILABLE)


class RequestActor(ActorTypeDispatcher):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._req: RunRequest | None = None
        self._connector = make_connector()
        self._log = get_logger(actor="request")
        self._reset()

    def _reset(self) -> None:
        self._req = None
        self._done: dict[int, StageDone] = {}
        self._running: dict[int, StageTask] = {}  # the last task sent, per running stage
        self._pools: dict[int, object] = {}
        self._owned = []  # intermediate refs to release at the end
        self._tokens = [0, 0]
        self._finish_reason = None

    def _current(self, request_id: str) -> bool:
        return self._req is not None and self._req.request_id == request_id

    def receiveMsg_RunRequest(self, msg: RunRequest, sender):
        if self._req is not None:  # the bridge never does this; fail the newcomer loudly
            self.send(msg.reply_to, RequestFinished(msg.request_id, ErrorKind.ENGINE_ERROR,
                                                    "request actor busy", request_actor=self.myAddress))
            return
        self._reset()
        self._req = msg
        self._pools = {s.stage_id: s.pool for s in msg.plan.stages}
        self._started = time.monotonic()
        self.wakeupAfter(msg.timeout_s, payload=msg.request_id)
        self._dispatch_ready()

    def _dispatch_ready(self) -> None:
        req = self._req
        for st in req.plan.stages:
            if st.stage_id in self._done or st.stage_id in self._running:
                continue
            if not all(src in self._done for src in st.sources):
                continue
            if self._pools.get(st.stage_id) is None:
                self._finish(ErrorKind.UNAVAILABLE, f"stage {st.stage} has no pool")
                return
            inputs = tuple((src, self._done[src].output) for src in st.sources)
            task = StageTask(
                request_id=req.request_id, stage_id=st.stage_id, prompt=req.prompt, inputs=inputs,
                # The client's max_tokens / temperature / seed are about the text it reads: they
                # go to the final text stage; other stages run their default_sampling_params
                # (a Talker's own token budget is not the client's max_tokens).
                sampling_params=req.sampling_params if st.final_output_type == "text" else {},
                params=req.params,
                stream_text=st.final_output_type == "text", final_output_type=st.final_output_type,
                needs_output=st.needs_output, reply_to=self.myAddress)
            self._running[st.stage_id] = task
            self.send(self._pools[st.stage_id], task)

    def receiveMsg_StageDelta(self, msg: StageDelta, sender):
        if self._current(msg.request_id):
            self.send(self._req.reply_to, OutputDelta(msg.request_id, msg.text))

    def receiveMsg_StageDone(self, msg: StageDone, sender):
        if not self._current(msg.request_id) or msg.stage_id not in self._running:
            release_all([msg.output, msg.final])
            return
        del self._running[msg.stage_id]
        self._done[msg.stage_id] = msg
        if msg.output is not None:
            self._owned.append(msg.output)
        planned = next(s for s in self._req.plan.stages if s.stage_id == msg.stage_id)
        if planned.final_output_type and msg.final is not None:
            self.send(self._req.reply_to, OutputReady(msg.request_id, msg.stage_id,
                                                      planned.final_output_type, msg.final))
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
        if not self._current(msg.request_id) or msg.stage_id not in self._running:
            return
        task = self._running[msg.stage_id]
        if msg.attempt < task.attempt:
            return  # an attempt that was already retried
        attempt = msg.attempt + 1  # the pool may have re-dispatched it already (a dead replica)
        if msg.replica and msg.kind in RETRYABLE and attempt < self._req.max_attempts:
            # An engine failed this task: try another replica of the stage.
            self._log.warning("stage_retry", request_id=msg.request_id, stage_id=msg.stage_id,
                              replica=msg.replica, error=msg.message)
            self._resend(dataclasses.replace(task, attempt=attempt, exclude=task.exclude + (msg.replica,)))
            return
        del self._running[msg.stage_id]
        self._finish(msg.kind, msg.message)

    def _resend(self, task: StageTask) -> None:
        self._running[task.stage_id] = task
        self.send(self._pools[task.stage_id], task)

    def receiveMsg_RoutesChanged(self, msg: RoutesChanged, sender):
        """A pool was replaced: re-send stages that were waiting on the old one."""
        if self._req is None:
            return
        for stage_id, pool in msg.routes.pools.items():
            if stage_id not in self._pools or pool == self._pools[stage_id]:
                continue
            self._pools[stage_id] = pool
            task = self._running.get(stage_id)
            if task is not None:
                self._log.warning("stage_retry", request_id=task.request_id, stage_id=stage_id,
                                  error="the stage's pool was replaced")
                self._resend(dataclasses.replace(task, attempt=task.attempt + 1))

    def receiveMsg_CancelRequest(self, msg: CancelRequest, sender):
        if self._current(msg.request_id):
            self._finish(ErrorKind.CANCELLED, "cancelled by the client")

    def receiveMsg_WakeupMessage(self, msg: WakeupMessage, sender):
        if self._current(msg.payload):
            self._finish(ErrorKind.TIMEOUT, f"request deadline of {self._req.timeout_s:g} s passed")

    def _finish(self, error: ErrorKind | None, message: str) -> None:
        req = self._req
        for stage_id in self._running:
            self.send(self._pools[stage_id], CancelStage(req.request_id, stage_id))
        release_all(self._owned)
        names = {s.stage_id: s.stage for s in req.plan.stages}
        self._log.info("request_finished", request_id=req.request_id,
                       error=error.value if error else None, message=message or None,
                       duration_ms=round((time.monotonic() - self._started) * 1000, 2),
                       replicas={names[sid]: d.replica for sid, d in self._done.items()})
        self.send(req.reply_to, RequestFinished(
            req.request_id, error, message, prompt_tokens=self._tokens[0], completion_tokens=self._tokens[1],
            finish_reason=self._finish_reason,
            stage_replicas={sid: d.replica for sid, d in self._done.items()}, request_actor=self.myAddress))
        self._reset()
