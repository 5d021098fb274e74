"""The stage pool's request plane: which replica runs each task, and what happens to
the tasks of a replica that goes.

A mixin of :class:`~omni_actors.actors.stage_pool.StagePoolActor`. A task goes to
the least-loaded READY replica that has not failed it yet (``balancing``); with
none ready it waits up to ``supervision.queue_timeout_s`` for one that is on its
way, else its request gets a 503. When a replica goes, its tasks in flight go to
another replica (a streaming task goes back to its RequestActor, which decides);
a task is tried on at most ``supervision.max_task_attempts`` replicas, and one
that was running on ``supervision.max_task_crashes`` replicas that died is failed,
not retried. Moves that are not the task's doing (its replica's host lost, the
replica drained or refused it) are not attempts (``StageTask.moved``).
"""

from __future__ import annotations

import dataclasses
import time

from thespian.actors import PoisonMessage

from omni_actors.balancing import ROUTABLE, ReplicaLoad, describe_replicas, no_replica_reason, none_on_its_way
from omni_actors.messages import (LATENCY_BUCKETS_S, MAX_TASK_MOVES, CancelStage, DrainReplica, ErrorKind,
                                  ReplicaState, StageCancelled, StageFailed, StageTask, TaskFinished, cancels_attempt)

#: A task still in flight this long past its request's deadline (``StageTask.timeout_s``
#: from its dispatch) was orphaned: its RequestActor ended it at the deadline, so its
#: cancel was lost or overtaken. It is cancelled and no longer counted.
TASK_OVERDUE_GRACE_S = 10.0
#: Why the tasks of a pool's replicas fail once the pool is exiting (see PoolRoutingMixin._redispatch).
SYSTEM_STOPPING = "the omni-actors system is stopping"

#: A replica in one of these states when its tasks are sent elsewhere lost them (see PoolRoutingMixin._redispatch).
_LOST_TASKS_STATES = (ReplicaState.ISOLATED, ReplicaState.DEAD, ReplicaState.FAILED)


class PoolRoutingMixin:
    def _redispatch(self, rep, crashed: bool = False, lost: bool = False, poison=frozenset()) -> None:
        """Send the replica's tasks elsewhere; ``crashed``: it died running them
        (not drained or stopped on purpose), which counts against each task; ``poison``:
        the (request id, stage id) of those it died running though not ``crashed`` (silent
        in their processor calls: ``actors.stack_dumps``), which counts against them alone.

        Tasks lost by a replica that went down unplanned (crashed, isolated, dead,
        failed, ``lost``: hung while it drained; not drained, stopped, or with the
        system) count as its failed tasks (``failed``,
        ``omni_replica_tasks_failed_total``), retried elsewhere or not: a trial's alert on
        that counter missed every replica crash."""
        tasks, rep.in_flight = [t for t, _ in rep.in_flight.values()], {}
        cancelling, rep.cancelling = rep.cancelling, set()
        for task in tasks:  # (its request no longer wants it: a code review saw it run again elsewhere)
            if (task.request_id, task.stage_id) in cancelling:
                self.send(task.reply_to, StageCancelled(task.request_id, task.stage_id, task.attempt))
        tasks = [t for t in tasks if (t.request_id, t.stage_id) not in cancelling]
        if tasks and not self._exiting and (crashed or lost or poison or rep.state in _LOST_TASKS_STATES):
            rep.failed += len(tasks)
            self._log.warning("replica_tasks_lost", replica=rep.replica, tasks=len(tasks),
                              request_ids=sorted({t.request_id for t in tasks}))
        for task in tasks:
            if self._exiting:  # the system stops: nowhere to send it, and no crash (no replica: not retried)
                # (trial AT: a request held by a frozen API server read "replica thinker/0 went down
                # mid-stream (dead: process exited)" at an orderly stop)
                self.send(task.reply_to, StageFailed(
                    task.request_id, task.stage_id, "", ErrorKind.UNAVAILABLE,
                    f"{SYSTEM_STOPPING}: replica {rep.replica} stopped with it", task.attempt, task.crashed,
                    task.moved))
                continue
            self._elsewhere(task, rep.replica, f"{rep.state.value}: {rep.reason}",
                            crashed=crashed or (task.request_id, task.stage_id) in poison)

    def _hand_back_finished(self, rep, cause: str) -> None:
        """The replica died: its tasks that finished within the window may have lost
        their results (queued behind our TaskFinished in the dead process). Their
        RequestActors retry those they still wait for and ignore the others."""
        horizon = time.monotonic() - self._finished_window_s
        for task, at in rep.finished.values():
            if at >= horizon:
                self.send(task.reply_to, StageFailed(
                    task.request_id, task.stage_id, rep.replica, ErrorKind.UNAVAILABLE,
                    f"replica {rep.replica} died ({cause}) right after this task: its results were lost",
                    task.attempt, task.crashed, task.moved + 1))
        rep.finished.clear()

    def _elsewhere(self, task: StageTask, replica: str, why: str, crashed: bool = False) -> None:
        """``task`` cannot finish on ``replica``: send it to another one, or, for a
        streaming task, tell its RequestActor (chunks already went out from or into
        that replica: it retries the streaming stages together, or fails the request).
        ``crashed``: the replica died running it; after ``max_task_crashes`` such
        deaths the task is failed (``ErrorKind.CRASHED``), not retried. Otherwise
        (its host was lost or left, it drained or refused the task) the move is not
        counted as an attempt (``StageTask.moved``)."""
        if not crashed:
            task = dataclasses.replace(task, moved=task.moved + 1)
        else:
            task = dataclasses.replace(task, crashed=task.crashed + (replica,))
            limit = self._spec.supervision.max_task_crashes
            if len(task.crashed) >= limit:
                self._log.error("task_crashed_replicas", request_id=task.request_id, replicas=list(task.crashed))
                self.send(task.reply_to, StageFailed(
                    task.request_id, task.stage_id, replica, ErrorKind.CRASHED,
                    f"stage {self._spec.stage.name}: {len(task.crashed)} replicas died while running this "
                    f"request ({', '.join(task.crashed)}; the last: {why}); not retried, it may be what "
                    f"crashes them (supervision.max_task_crashes: {limit})", task.attempt, task.crashed,
                    task.moved))
                return
        if task.streaming:
            self.send(task.reply_to, StageFailed(task.request_id, task.stage_id, replica, ErrorKind.UNAVAILABLE,
                                                 f"replica {replica} went down mid-stream ({why})", task.attempt,
                                                 task.crashed, task.moved))
            return
        if self._orphaned:
            # Its coordinator was lost: this pool only drains (its replicas refuse new work, and it
            # restarts none), so the task goes back to its RequestActor, which sends it to the new
            # coordinator's pool (a code review: routed here, it ended refused, a 503).
            self.send(task.reply_to, StageFailed(task.request_id, task.stage_id, replica, ErrorKind.UNAVAILABLE,
                                                 f"replica {replica} {why}; its pool's coordinator was lost",
                                                 task.attempt, task.crashed, task.moved, coordinator_lost=True))
            return
        self._log.warning("task_redispatched", request_id=task.request_id, replica=replica,
                          attempt=task.attempt + 1)
        retry = dataclasses.replace(task, attempt=task.attempt + 1, exclude=task.exclude + (replica,))
        self._route(retry, why=f"replica {replica} {why}")

    def receiveMsg_PoisonMessage(self, msg: PoisonMessage, sender):
        poisoned = msg.poisonMessage
        self._log.error("poison_message", message_type=type(poisoned).__name__, details=str(msg.details))
        if isinstance(poisoned, StageTask):
            rep = next((r for r in self._replicas.values() if r.address == sender), None)
            if rep is not None:
                rep.in_flight.pop((poisoned.request_id, poisoned.stage_id), None)
                rep.cancelling.discard((poisoned.request_id, poisoned.stage_id))
            self._route(dataclasses.replace(poisoned, attempt=poisoned.attempt + 1,
                                            exclude=poisoned.exclude + ((rep.replica,) if rep else ())),
                        why="the replica could not take the task")

    def receiveMsg_StageTask(self, msg: StageTask, sender):
        if self._cancelled_early.take((msg.request_id, msg.stage_id), msg.attempt):
            self.send(msg.reply_to, StageCancelled(msg.request_id, msg.stage_id, msg.attempt))
            return
        if self._spec is None:
            # Before its StartPool: a recreated pool's address reaches the RequestActors (the
            # coordinator's routes, through the API server) on other connections than its own
            # StartPool, and a task re-sent there can come first. Routed once it has started
            # (routing it raised: Thespian returned it to its RequestActor as a PoisonMessage,
            # and the request waited for its deadline).
            self._before_start.append(msg)
            return
        self._route(msg)

    def _route_before_start(self) -> None:
        """StartPool came: route the tasks that came before it (see receiveMsg_StageTask)."""
        kept, self._before_start = self._before_start, []
        for task in kept:
            self.receiveMsg_StageTask(task, None)

    def _takers(self, task: StageTask) -> list:
        """The replicas that may take ``task`` now (a lingering replica takes only the tasks
        of requests begun before it lingered)."""
        return [r for r in self._replicas.values() if r.state in ROUTABLE
                and not (r.linger and task.began_at > r.linger_since)]

    def _route(self, task: StageTask, why: str = "") -> None:
        if task.counted_attempts >= self._spec.supervision.max_task_attempts or task.moved > MAX_TASK_MOVES:
            self._reject(task, f"stage {self._spec.stage.name}: gave up after {task.counted_attempts} attempts"
                               + (f" and {task.moved} moves" if task.moved else "") + f" ({why})")
            return
        takers = self._takers(task)
        ready = [r for r in takers if r.replica not in task.exclude] or takers
        ready = [r for r in ready if r.node not in self._silent_nodes] or ready  # (see DataServicesSilent)
        chosen = self._policy([ReplicaLoad(r.replica, len(r.in_flight), r.last_dispatch) for r in ready])
        if chosen is None:
            wait_s = self._spec.supervision.queue_timeout_s
            refused = no_replica_reason(self._spec.stage.name, self._replicas.values(), wait_s,
                                        new_request=any(r.linger for r in self._replicas.values()))
            if refused is None:
                self._pending.append((task, time.monotonic() + wait_s))
            else:
                self._reject(task, refused, none_coming=none_on_its_way(self._replicas.values()))
            return
        rep = self._replicas[chosen]
        now = time.monotonic()
        rep.health.on_dispatch(now, was_idle=not rep.in_flight)
        rep.in_flight[(task.request_id, task.stage_id)] = (task, now)
        rep.cancelling.discard((task.request_id, task.stage_id))  # (a new attempt, not the one cancelled)
        rep.dispatched += 1
        rep.last_dispatch = now
        self.send(rep.address, task)

    def _refuse_pending_if_none_comes(self) -> None:
        """Route the tasks waiting for a replica again once none is on its way any more (the
        last one failed, drained, or was scaled away): they get their 503 now, as a new task
        would, not after ``queue_timeout_s`` (a code review)."""
        if self._pending and no_replica_reason(self._spec.stage.name, self._replicas.values(),
                                               self._spec.supervision.queue_timeout_s,
                                               new_request=any(r.linger for r in self._replicas.values())):
            pending, self._pending = self._pending, []
            for task, _ in pending:
                self._route(task)

    def _drain_pending(self) -> None:
        """Route the tasks that waited for a ready replica. While other replicas of the
        stage are starting, the ready ones take their share of the backlog and the rest
        waits for the others, at most a heartbeat interval (then it goes to whoever is
        ready): the first replica up would otherwise take all of it (after a pool was
        recreated: every task its RequestActors re-sent)."""
        pending, self._pending = self._pending, []
        now = time.monotonic()
        ready = sum(r.state in ROUTABLE for r in self._replicas.values())
        starting = sum(r.state == ReplicaState.STARTING for r in self._replicas.values())
        take = len(pending)
        if starting and ready and pending:
            if not self._hold_until:
                self._hold_until = now + self._spec.heartbeat_interval_s
            if now < self._hold_until:
                take = -(-len(pending) * ready // (ready + starting))
        if take == len(pending):
            self._hold_until = 0.0
        for task, _ in pending[:take]:
            self._route(task)
        self._pending = pending[take:] + self._pending

    def _reject(self, task: StageTask, message: str, none_coming: bool = False) -> None:
        # (by a pool whose coordinator was lost: its replicas drain, and are not restarted)
        lost = self._orphaned and not self._exiting
        self.send(task.reply_to, StageFailed(task.request_id, task.stage_id, "", ErrorKind.UNAVAILABLE,
                                             message + ("; its pool's coordinator was lost" if lost else ""),
                                             task.attempt, task.crashed, task.moved, coordinator_lost=lost,
                                             none_coming=none_coming and not lost))

    def _describe(self) -> str:
        return describe_replicas(self._replicas.values())

    def receiveMsg_TaskFinished(self, msg: TaskFinished, sender):
        rep = self._replicas.get(msg.replica)
        if rep is None:
            return
        entry = rep.in_flight.get((msg.request_id, msg.stage_id))
        if entry is None or (msg.attempt is not None and entry[0].attempt != msg.attempt):
            # (an earlier attempt's end: the one in flight now, a streaming consumer started over
            # on the same replica, stays counted and cancellable there; a code review)
            if entry is not None and msg.attempt is not None and msg.attempt < entry[0].attempt \
                    and not (msg.ok or msg.cancelled or msg.rejected):
                # ... but its failure counts: its retry, sent here again before this end came,
                # had hidden it from FAILED and from the circuit breaker (trial BV: a replica
                # that failed a task twice counted one failure). It failed before that retry was
                # sent (so the retry's success, if it succeeds, still resets the breaker's count).
                self._task_failed(rep, msg, failed_at=entry[1] - 1e-3, now=time.monotonic())
            return
        del rep.in_flight[(msg.request_id, msg.stage_id)]
        cancelled = (msg.request_id, msg.stage_id) in rep.cancelling
        rep.cancelling.discard((msg.request_id, msg.stage_id))
        if msg.rejected:  # it did not run there (the replica drains or is not ready)
            if msg.reason == "draining" and rep.state == ReplicaState.READY:
                # It drains on its own (it missed our acks): no more work; when it
                # exits it is restarted as any isolated replica is.
                rep.state, rep.reason = ReplicaState.ISOLATED, "drained itself: it heard nothing from its pool"
                self._publish()
            if cancelled:  # its request no longer wants it: confirmed cancelled here, not run elsewhere
                self.send(entry[0].reply_to, StageCancelled(msg.request_id, msg.stage_id, entry[0].attempt))
            else:
                self._elsewhere(entry[0], rep.replica, f"is {msg.reason}")
            return
        now = time.monotonic()
        if not msg.cancelled:
            rep.finished[(msg.request_id, msg.stage_id)] = (entry[0], now)
            while rep.finished and next(iter(rep.finished.values()))[1] < now - self._finished_window_s:
                del rep.finished[next(iter(rep.finished))]
        if msg.ok:
            rep.completed += 1
            took = now - entry[1]
            rep.latency[next(i for i, b in enumerate(LATENCY_BUCKETS_S) if took <= b)] += 1
            rep.latency_sum += took
        if rep.health is not None and not rep.in_flight:
            rep.health.went_idle(now, answered=msg.client_error, min_stretch_s=self._health.heartbeat_interval_s)
        if msg.ok and rep.health is not None and not msg.cancelled and not msg.input_error:
            rep.health.on_task_done(True, now, dispatched_at=entry[1])
        elif not msg.ok and not msg.cancelled:  # (cancelled: the client went away, nothing of the replica's health)
            if self._task_failed(rep, msg, failed_at=now, now=now):
                return
        if rep.state == ReplicaState.DRAINING and not rep.in_flight:
            self.send(rep.address, DrainReplica(rep.replica))

    def _task_failed(self, rep, msg: TaskFinished, failed_at: float, now: float) -> bool:
        """Count a task's failure on ``rep`` (not a client's bad request, a 400) and tell its
        circuit breaker (not a failure on its input), which may isolate it: True then."""
        if not msg.client_error:
            rep.failed += 1
        if rep.health is None or msg.input_error:
            return False
        rep.health.on_task_done(False, failed_at)
        if rep.state != ReplicaState.READY:
            return False
        # judge now: a success before the next tick would reset the breaker's count
        why = self._health.verdict(rep.health, now, len(rep.in_flight))
        if why:
            # It answers (it just reported a failure): ask it to exit rather than SIGKILL it,
            # so the messages it has sent (the failure itself) are not lost in transit with it.
            self._isolate(rep, why, hard=False)
            return True
        return False

    def _cancel_overdue(self, now: float) -> None:
        """Cancel tasks in flight past their request's deadline plus :data:`TASK_OVERDUE_GRACE_S`."""
        for rep in self._replicas.values():
            overdue = [key for key, (task, at) in rep.in_flight.items()
                       if task.timeout_s and now - at > task.timeout_s + TASK_OVERDUE_GRACE_S]
            for key in overdue:
                task, at = rep.in_flight.pop(key)
                rep.cancelling.discard(key)
                if rep.health is not None and not rep.in_flight:
                    rep.health.went_idle(now, min_stretch_s=self._health.heartbeat_interval_s)
                self._log.warning("task_outlived_request", replica=rep.replica, request_id=task.request_id,
                                  in_flight_s=round(now - at, 1), request_timeout_s=task.timeout_s)
                if rep.address is not None:
                    self.send(rep.address, CancelStage(task.request_id, task.stage_id))

    def receiveMsg_CancelStage(self, msg: CancelStage, sender):
        key = (msg.request_id, msg.stage_id)

        def cancelled(task: StageTask) -> bool:
            return (task.request_id, task.stage_id) == key and cancels_attempt(msg.attempt, task.attempt)
        queued = [(t, d) for t, d in self._pending if cancelled(t)]
        if queued:
            self._pending = [(t, d) for t, d in self._pending if not cancelled(t)]
            for task, _ in queued:  # it never ran: confirm the cancel here (the engine does otherwise)
                self.send(task.reply_to, StageCancelled(task.request_id, task.stage_id, task.attempt))
        found = bool(queued)
        for rep in self._replicas.values():
            if key in rep.in_flight and cancelled(rep.in_flight[key][0]):
                self.send(rep.address, msg)
                rep.cancelling.add(key)
                found = True
        if not found or msg.attempt is None:
            # (its task may still be on its way here; a cancel of every attempt, its request over, is
            # kept even where it found one: that one may be an earlier attempt's, ended, and the
            # retry on its way here, to run for nobody: a review)
            self._cancelled_early.add(key, msg.attempt)
