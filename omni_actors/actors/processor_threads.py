"""Threads that run stage processors off a replica's event loop.

A stage's processor (``custom_process_input_func``) runs once per task, on each
chunk for an edge that streams. One of this package (:mod:`omni_actors.processors`,
the vLLM-Omni hand-over) takes microseconds and runs on the replica's event loop;
one of the user's may take as long as it likes: on the loop it held every other
task of the replica, whose stall watchdog then isolated it, blaming whatever
request was in flight (trial CQ: a processor that slept 8 s killed both DiT
replicas in turn, and a request that only shared the replica got "it may be what
crashes them"). :class:`ProcessorThreads` runs those on daemon threads (a processor
that never returns holds one thread, not the process's exit), and the replica
stops waiting for one after its stage's ``supervision.stall_timeout_s``.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from typing import Any, Callable

#: Modules whose processors run on the event loop (quick by construction).
INLINE_MODULES = ("omni_actors.processors", "omni_actors.engines.vllm_omni")
#: Most threads one replica runs processors on at once (more tasks wait for one).
PROCESSOR_THREADS = 4


class ProcessorsBusy(RuntimeError):
    """A task's processor call did not start within the timeout: every thread was held by
    calls of other tasks. The replica's fault, not the task's: ``ErrorKind.UNAVAILABLE``
    (retried on another replica, counted by the replica's circuit breaker, a 503 where no
    replica takes it)."""


def hung_after_s(timeout_s: float) -> float:
    """Seconds after which a call given up on (past ``timeout_s``) counts as one that will not
    return, its thread lost: 3 timeouts, at least 30 s more than one (a review: four calls
    merely slower than the timeout restarted a replica)."""
    return max(3 * timeout_s, timeout_s + 30.0)


def runs_inline(fn: Callable) -> bool:
    """Whether processor ``fn`` is one of this package's (run on the loop)."""
    return getattr(fn, "__module__", "") in INLINE_MODULES


class ProcessorThreads:
    """At most ``size`` daemon threads, started as work comes, that run calls in order.

    :meth:`submit` returns a :class:`concurrent.futures.Future` of the call's result
    (or exception). Threads wait for work for ever once started (daemons: the process
    exits without them)."""

    def __init__(self, size: int = PROCESSOR_THREADS, name: str = "stage-processor", marks=None) -> None:
        self.size, self.name, self.marks = size, name, marks  # (marks: a stack_dumps.CallMarks, or None)
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0
        self._running: dict[concurrent.futures.Future, float] = {}  # call -> when it began (monotonic)

    def submit(self, fn: Callable[..., Any], *args: Any,
               task: tuple[str, int] | None = None) -> concurrent.futures.Future:
        """``task``: the (request id, stage id) the call is for, noted in ``marks`` while it runs."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._work.put((fut, fn, args, task))
        with self._lock:
            if self._idle <= 0 and self._threads < self.size:
                self._threads += 1
                threading.Thread(target=self._run, args=(self._threads - 1,), name=f"{self.name}-{self._threads}",
                                 daemon=True).start()
            else:
                self._idle -= 1  # (one idle thread is taken; it counts itself idle again when done)
        return fut

    def held(self, for_s: float) -> int:
        """How many threads are running a call begun ``for_s`` seconds ago or more (calls
        given up on that never returned hold their thread for good)."""
        now = time.monotonic()
        with self._lock:
            return sum(1 for began in self._running.values() if now - began >= for_s)

    def _run(self, slot: int) -> None:
        while True:
            fut, fn, args, task = self._work.get()
            if fut.set_running_or_notify_cancel():
                with self._lock:
                    self._running[fut] = time.monotonic()
                if self.marks is not None and task is not None:
                    self.marks.mark(slot, *task)
                try:
                    result, failed = fn(*args), None
                except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                    result, failed = None, exc
                finally:  # (the call is over before whoever waits hears of it)
                    if self.marks is not None and task is not None:
                        self.marks.clear(slot)
                    with self._lock:
                        self._running.pop(fut, None)
                if failed is None:
                    fut.set_result(result)
                else:
                    fut.set_exception(failed)
                del result, failed  # (not kept alive by this thread until its next call)
            with self._lock:
                self._idle += 1
