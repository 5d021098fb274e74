"""Cancels that arrive before the task they cancel.

A ``CancelStage`` can reach an actor before the ``StageTask`` it cancels: in an
EngineActor the task is started on the engine's event loop a step after the
actor thread hands it over, and a cancel handed over right behind it ran first,
found no task and was lost (the task then ran until its upstream-chunk timeout,
10 s in the demo: seen in about 1 of 100 client hang-ups under load); between
two actors, Thespian does not promise that one sender's messages arrive in order.
:class:`CancelledStages` remembers such cancels for a while, so that the task,
when it comes, is cancelled at once. A request id is never reused, so a cancel
stays right for every later attempt of that request's stage.
"""

from __future__ import annotations

import time

#: Seconds a cancel that found no task is remembered (a task arrives milliseconds later).
REMEMBER_S = 300.0
#: At most this many remembered at once (the oldest go first).
MAX_REMEMBERED = 10_000


class CancelledStages:
    """``(request_id, stage_id)`` pairs cancelled before their task was seen (not thread-safe:
    one thread, or the owner's lock)."""

    def __init__(self, remember_s: float = REMEMBER_S, most: int = MAX_REMEMBERED, clock=time.monotonic) -> None:
        self._at: dict[tuple[str, int], float] = {}  # oldest first
        self._remember_s, self._most, self._clock = remember_s, most, clock

    def add(self, key: tuple[str, int]) -> None:
        """Remember a cancel of ``key`` that found no task."""
        now = self._clock()
        self._at.pop(key, None)
        self._at[key] = now
        while self._at and (len(self._at) > self._most or now - next(iter(self._at.values())) > self._remember_s):
            del self._at[next(iter(self._at))]

    def take(self, key: tuple[str, int]) -> bool:
        """Whether ``key`` was cancelled before its task came (forgotten from now on)."""
        at = self._at.pop(key, None)
        return at is not None and self._clock() - at <= self._remember_s

    def __len__(self) -> int:
        return len(self._at)
