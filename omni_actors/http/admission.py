"""How many RequestActors the API server's bridge keeps, and who waits for one.

Each RequestActor is a process: a burst of 200 requests used to leave 200 of
them for good. :class:`RequestActorPool` caps them, queues requests above the
cap (bounded: past it, the bridge answers 429) and ends the ones left idle
after a burst. Pure logic on the event loop: the bridge makes and ends the
actors.
"""

from __future__ import annotations

import asyncio
import collections
import random
import time
from typing import Any, Callable


class ShuttingDown(Exception):
    """The server stops: a request waiting for a RequestActor gets none."""


class QueueFull(Exception):
    """:meth:`RequestActorPool.acquire`: no RequestActor is free and the queue is full."""


#: The window (s) over which :meth:`RequestActorPool.retry_after_s` counts the requests served.
SERVED_WINDOW_S = 10.0
#: The bounds (s) of the wait a 429 asks for: at least 1 s (as before it was always 1 s); at most
#: 30 s, below the 60 s past which OpenAI's clients give up rather than wait (MAX_RETRY_AFTER_DELAY).
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1.0, 30.0


class RequestActorPool:
    """The bridge's RequestActors, counted on the event loop (use it from the loop only).

    At most ``maximum`` exist, counting those being made. :meth:`acquire` gives a
    free one (the most recently freed), or ``None`` ("make one": counted at once)
    while fewer than ``maximum`` exist, or waits in a FIFO queue of at most
    ``queue_limit`` requests until :meth:`release` or :meth:`lost` makes room.
    :meth:`reap` takes out the ones that idled ``idle_exit_s`` while more than
    ``minimum`` exist, for the caller to end.
    """

    def __init__(self, maximum: int, minimum: int, queue_limit: int, idle_exit_s: float,
                 clock: Callable[[], float] = time.monotonic):
        if maximum < 1 or not 0 <= minimum <= maximum or queue_limit < 0 or idle_exit_s <= 0:
            raise ValueError(f"bad RequestActor pool bounds: maximum {maximum}, minimum {minimum}, "
                             f"queue_limit {queue_limit}, idle_exit_s {idle_exit_s}")
        self.maximum, self.minimum, self.queue_limit, self.idle_exit_s = maximum, minimum, queue_limit, idle_exit_s
        self.total = 0  #: RequestActors alive or being made
        self.rejected = 0  #: acquires refused (QueueFull) so far
        self._clock = clock
        self._served: collections.deque = collections.deque(maxlen=100_000)  # release times, oldest first
        self._idle: collections.deque = collections.deque()  # (address, idle since), oldest first
        self._waiters: collections.deque = collections.deque()  # futures, first come first

    @property
    def idle(self) -> int:
        return len(self._idle)

    @property
    def queued(self) -> int:
        """Requests waiting for a RequestActor."""
        return sum(1 for f in self._waiters if not f.done())

    def reserve(self, n: int) -> None:
        """Count ``n`` RequestActors about to be made outside :meth:`acquire` (each
        then comes in through :meth:`release`, or :meth:`lost` if it could not be made)."""
        self.total += n

    async def acquire(self, timeout_s: float | None, fresh: bool = False) -> Any:
        """A free RequestActor's address, or ``None``: make one (it is counted). ``fresh``:
        ``None`` while fewer than ``maximum`` exist, before any free one.

        Raises:
            QueueFull: none free, ``maximum`` exist and ``queue_limit`` requests wait.
            asyncio.TimeoutError: none came free within ``timeout_s``.
        """
        if not self._waiters:
            if self._idle and not (fresh and self.total < self.maximum):
                return self._idle.pop()[0]
            if self.total < self.maximum:
                self.total += 1
                return None
        if len(self._waiters) >= self.queue_limit:
            self.rejected += 1
            raise QueueFull()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiters.append(fut)
        timer = None if timeout_s is None else loop.call_later(max(timeout_s, 0), self._expire, fut)
        try:
            return await fut
        except BaseException:  # timed out, or cancelled (the client went away): leave the queue
            try:
                self._waiters.remove(fut)
            except ValueError:
                pass
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                actor = fut.result()  # given one just as it left: to the next in line
                if actor is None:
                    self.lost()
                else:
                    self.release(actor)
            else:
                fut.cancel()
            raise
        finally:
            if timer is not None:
                timer.cancel()

    @staticmethod
    def _expire(fut: asyncio.Future) -> None:
        if not fut.done():
            fut.set_exception(asyncio.TimeoutError())

    def release(self, actor: Any) -> None:
        """``actor`` is free again: to the first request waiting, else idle."""
        self._served.append(self._clock())
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(actor)
                return
        self._idle.append((actor, self._clock()))

    def retry_after_s(self, draw: Callable[[], float] = random.random) -> float:
        """How long (s) a request refused now (:class:`QueueFull`) should wait before it tries
        again: a draw between the time one queue place comes free and the time the whole queue
        ahead of it has been served, at the rate RequestActors came free over the last
        :data:`SERVED_WINDOW_S` (``(queued + 1) / rate``), within :data:`RETRY_AFTER_MIN_S`
        and :data:`RETRY_AFTER_MAX_S`; the minimum when none came free in that window. Drawn,
        so that a burst refused together comes back spread over that time rather than all at
        once (a trial's note: every 429 said 1 s, and OpenAI's clients wait exactly that).
        ``draw``: uniform in [0, 1)."""
        now = self._clock()
        while self._served and now - self._served[0] > SERVED_WINDOW_S:
            self._served.popleft()
        if not self._served:
            return RETRY_AFTER_MIN_S
        rate = len(self._served) / SERVED_WINDOW_S  # requests served per second
        low = min(max(1 / rate, RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S)
        high = min(max((self.queued + 1) / rate, low), RETRY_AFTER_MAX_S)
        return low + (high - low) * draw()

    def lost(self) -> None:
        """A RequestActor is gone, or could not be made: room for another (the first
        request waiting gets to make it)."""
        self.total -= 1
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                self.total += 1
                fut.set_result(None)
                return

    def discard(self, actor: Any) -> bool:
        """Take ``actor`` out if it is idle (it exited); False if it is not idle here."""
        for i, (idle, _) in enumerate(self._idle):
            if idle == actor:
                del self._idle[i]
                self.total -= 1
                return True
        return False

    def idle_actors(self) -> list[Any]:
        """The addresses of the idle RequestActors, oldest first."""
        return [actor for actor, _ in self._idle]

    def fail_waiters(self, exc: BaseException) -> int:
        """Fail every request waiting for a RequestActor with ``exc`` (the server is
        stopping); returns how many."""
        failed = 0
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(exc)
                failed += 1
        return failed

    def reap(self) -> list[Any]:
        """Take out the RequestActors idle for ``idle_exit_s`` or more, oldest first,
        down to ``minimum``; the caller ends them."""
        now, out = self._clock(), []
        while self._idle and self.total > self.minimum and now - self._idle[0][1] >= self.idle_exit_s:
            out.append(self._idle.popleft()[0])
            self.total -= 1
        return out
