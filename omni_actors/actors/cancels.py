"""Cancels that arrive before the task they cancel.

A ``CancelStage`` can reach an actor before the ``StageTask`` it cancels: in an
EngineActor the task is started on the engine's event loop a step after the
actor thread hands it over, and a cancel handed over right behind it ran first,
found no task and was lost (the task then ran until its upstream-chunk timeout,
10 s in the demo: seen in about 1 of 100 client hang-ups under load); between
two actors, Thespian does not promise that one sender's messages arrive in order.
:class:`CancelledStages` remembers such cancels for a while, so that the task,
when it comes, is cancelled at once. A request id is never reused, so a cancel
of every attempt stays right for every later attempt of that request's stage; one of the
attempts up to N (``CancelStage.attempt``: a streaming consumer started again after its
producer failed) lets attempt N + 1 through (a code review: the consumer started again
was cancelled by the cancel of the one before, which had found no task, and its request
hung until its deadline).
"""

from __future__ import annotations

import time

#: Seconds a cancel that found no task is remembered (a task arrives milliseconds later).
REMEMBER_S = 300.0
#: At most this many remembered at once (the oldest go first).
MAX_REMEMBERED = 10_000


class CancelledStages:
    """``(request_id, stage_id)`` pairs cancelled before their task was seen, with the last
    attempt each cancel covers (None: all); not thread-safe: one thread, or the owner's lock."""

    def __init__(self, remember_s: float = REMEMBER_S, most: int = MAX_REMEMBERED, clock=time.monotonic) -> None:
        self._at: dict[tuple[str, int], tuple[float, int | None]] = {}  # oldest first
        self._remember_s, self._most, self._clock = remember_s, most, clock

    def add(self, key: tuple[str, int], attempt: int | None = None) -> None:
        """Remember a cancel of ``key``'s attempts up to ``attempt`` (None: all) that found no task."""
        now = self._clock()
        before = self._at.pop(key, None)
        if before is not None and (before[1] is None or (attempt is not None and before[1] > attempt)):
            attempt = before[1]  # (the wider of the two)
        self._at[key] = (now, attempt)
        while self._at and (len(self._at) > self._most or now - next(iter(self._at.values()))[0] > self._remember_s):
            del self._at[next(iter(self._at))]

    def take(self, key: tuple[str, int], attempt: int = 0) -> bool:
        """Whether ``key``'s ``attempt`` was cancelled before its task came (the cancel is
        forgotten from now on, unless it was of earlier attempts only: one may still come)."""
        entry = self._at.get(key)
        if entry is None:
            return False
        at, upto = entry
        if self._clock() - at > self._remember_s:
            del self._at[key]
            return False
        if upto is not None and attempt > upto:
            return False
        del self._at[key]
        return True

    def __len__(self) -> int:
        return len(self._at)
