"""Which vLLM requests a vLLM or vLLM-Omni backend has in flight, and which it aborted.

A task of ours (a pipeline request on one stage) runs as one request inside the
engine, under an id of its own (``"<request id>:<stage id>:<n>"``: a retry of the
task on the same replica gets a new one). ``abort(request_id)`` must reach every
engine request of that pipeline request, and the task's output loop must tell an
aborted request from one that finished.
"""

from __future__ import annotations

import itertools

__all__ = ["VllmRequests"]


class VllmRequests:
    """The engine requests of our tasks in flight, by pipeline request id (one thread:
    the backend's event loop)."""

    def __init__(self, stage_id: int) -> None:
        self._stage_id = stage_id
        self._by_request: dict[str, set[str]] = {}  # pipeline request id -> engine request ids
        self._aborted: set[str] = set()
        self._numbers = itertools.count()

    def start(self, request_id: str) -> str:
        """A new engine request id for a task of ``request_id``, counted in flight."""
        vid = f"{request_id}:{self._stage_id}:{next(self._numbers)}"
        self._by_request.setdefault(request_id, set()).add(vid)
        return vid

    def end(self, request_id: str, vid: str) -> bool:
        """Engine request ``vid`` is over (its output loop ended); whether it was aborted."""
        ids = self._by_request.get(request_id)
        if ids is not None:
            ids.discard(vid)
            if not ids:
                del self._by_request[request_id]
        aborted = vid in self._aborted
        self._aborted.discard(vid)
        return aborted

    def abort(self, request_id: str) -> list[str]:
        """Mark every engine request of ``request_id`` aborted; their ids (to abort in the
        engine; none for an unknown request)."""
        ids = self._by_request.get(request_id)
        if not ids:
            return []
        self._aborted.update(ids)
        return list(ids)

    def aborted(self, vid: str) -> bool:
        return vid in self._aborted

    def requests(self) -> list[str]:
        """The pipeline request ids with an engine request in flight."""
        return list(self._by_request)

    def __len__(self) -> int:
        """How many engine requests are in flight."""
        # (a list first, in one step: the loop thread adds and removes requests meanwhile; a
        # generator over the live view could raise "dictionary changed size during iteration")
        return sum(map(len, list(self._by_request.values())))
