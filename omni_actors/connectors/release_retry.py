"""Remote releases tried again: a release whose data service did not answer (its host frozen,
cut off, or its service restarting) is kept and sent again until it is heard, or until the
owner's reaper would have unlinked the segment anyway (:class:`ReleaseRetries`)."""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Iterable

import structlog

from omni_actors.connectors import data_client
from omni_actors.connectors.data_client import DataServiceError

__all__ = ["RELEASE_RETRY_EVERY_S", "RELEASE_RETRY_FOR_S", "RELEASE_RETRY_MAX", "ReleaseRetries",
           "release_retries", "unreleased"]

log = structlog.get_logger(__name__)

#: Seconds between tries of the releases that found their data service unreachable.
RELEASE_RETRY_EVERY_S = 1.0
#: How long (seconds) a failed release is tried again: by then the owner's reaper has
#: unlinked the segment (its ``reap_after_s``, 900 s by default: data_service.DEFAULT_REAP_AFTER_S).
RELEASE_RETRY_FOR_S = 900.0
#: Seconds a round waits for a service taken for down to answer its probe, and the least
#: seconds between two probes of one service (a review: probed every round, a service cut off
#: cost each process a connection a second for 15 minutes).
RELEASE_RETRY_PROBE_S = 0.5
RELEASE_RETRY_PROBE_EVERY_S = 2.0
#: Most segment names kept for a retry in a process (the oldest go first, to the reaper).
RELEASE_RETRY_MAX = 100_000


class ReleaseRetries:
    """Remote releases that failed (the owning host's data service frozen, cut off or
    restarting), tried again every :data:`RELEASE_RETRY_EVERY_S` on a thread of their own
    until the service answers or :data:`RELEASE_RETRY_FOR_S` has passed. They were dropped
    before: trial CG froze a member for a few seconds and its 11 released buffers stayed
    for the reaper's 15 minutes, in the host's shared memory and in ``omni_node_buffers``.
    Unlinked, not recycled: the releaser's reader may have mapped them long ago. A
    generation already claimed again by its producer is not touched (see ``slots``).

    The same thread also sends the releases handed to :meth:`send` (a first try, off the
    caller's thread: a RequestActor's release to a frozen host waited 2 s before its
    request could end, trial CN)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._names: dict[str, dict[str, float]] = {}  # service -> segment name -> when it first failed
        self._sends: collections.deque[tuple[str, list[str], bool]] = collections.deque()
        self._wake = threading.Event()
        self._probed_at: dict[str, float] = {}
        self._thread: threading.Thread | None = None
        self._pid = os.getpid()

    def _forked(self) -> None:
        """Under the lock: a forked child drops its parent's work (not its to do)."""
        if self._pid != os.getpid():
            self._names, self._sends, self._thread, self._pid = {}, collections.deque(), None, os.getpid()
            self._wake = threading.Event()

    def _start(self) -> None:
        """Under the lock: the thread, if it is not running."""
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="connector-release-retry", daemon=True)
            self._thread.start()

    def send(self, service: str, names: list[str], recycle: bool = False) -> None:
        """Release ``names`` on ``service`` from this object's thread, soon (as
        :func:`~omni_actors.connectors.data_client.release`); kept for a retry if it fails."""
        with self._lock:
            self._forked()
            self._sends.append((service, list(names), recycle))
            self._start()
        self._wake.set()

    def add(self, service: str, names: Iterable[str]) -> None:
        now = time.monotonic()
        with self._lock:
            self._forked()
            kept = self._names.setdefault(service, {})
            for name in names:
                kept.setdefault(name, now)
            over = sum(len(v) for v in self._names.values()) - RELEASE_RETRY_MAX
            for _ in range(max(0, over)):  # (each service's names are in the order they failed)
                oldest = min((svc for svc in self._names if self._names[svc]),
                             key=lambda svc: next(iter(self._names[svc].values())))
                del self._names[oldest][next(iter(self._names[oldest]))]
            self._start()

    def clear(self) -> None:
        """Give up every retry (tests: one test's dead services are not another's business)."""
        with self._lock:
            self._names, self._probed_at = {}, {}
            self._sends.clear()

    def pending(self) -> dict[str, int]:
        """Segment names waiting for a retry, by data service."""
        with self._lock:
            return {svc: len(names) for svc, names in self._names.items() if names}

    def retry(self, now: float | None = None) -> None:
        """One round: each service's names in one request; those given up are dropped."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for svc in list(self._names):
                self._names[svc] = {n: t for n, t in self._names[svc].items() if now - t < RELEASE_RETRY_FOR_S}
                if not self._names[svc]:
                    del self._names[svc]
            batches = {svc: list(names) for svc, names in self._names.items()}
        for svc, names in batches.items():
            if data_client.taken_for_down(svc):
                # (asked whether it answers, every few rounds: after a long freeze its mark, doubled at
                # each failure, kept releases skipped for 18 s after it answered again: trial CN)
                if now - self._probed_at.get(svc, float("-inf")) < RELEASE_RETRY_PROBE_EVERY_S:
                    continue
                self._probed_at[svc] = now
                if not data_client.answers(svc, RELEASE_RETRY_PROBE_S):
                    continue
                data_client.forget_down(svc)
            try:
                released = data_client.release(svc, names)
            except DataServiceError:
                continue  # (taken for down: it costs nothing until it may answer again)
            except Exception:  # noqa: BLE001 - a bad name: nothing to retry
                log.warning("connector_release_retry_failed", service=svc, segments=len(names), exc_info=True)
                released = None
            with self._lock:
                kept = self._names.get(svc, {})
                for name in names:
                    kept.pop(name, None)
                if not kept:
                    self._names.pop(svc, None)
            if released is not None:
                # (those not released were gone already: unlinked by their producer or the service's reaper)
                log.info("connector_release_retried", service=svc, segments=len(names), released=released,
                         already_gone=len(names) - released)

    def _send_queued(self) -> None:
        """The releases handed to :meth:`send`, in order; those that fail are kept for a retry."""
        while True:
            with self._lock:
                if not self._sends:
                    return
                svc, names, recycle = self._sends.popleft()
            try:
                data_client.release(svc, names, recycle=recycle)
            except DataServiceError as exc:
                log.warning("connector_release_failed", service=svc, segments=len(names), error=str(exc),
                            retried=True)
                self.add(svc, names)
            except Exception:  # noqa: BLE001 - a bad name: nothing to retry
                log.warning("connector_release_failed", service=svc, segments=len(names), exc_info=True)

    def _loop(self) -> None:
        last = time.monotonic()
        while True:
            self._wake.wait(max(0.0, RELEASE_RETRY_EVERY_S - (time.monotonic() - last)))
            self._wake.clear()
            self._send_queued()
            if time.monotonic() - last >= RELEASE_RETRY_EVERY_S:
                last = time.monotonic()
                self.retry()
            with self._lock:
                if not self._names and not self._sends:
                    self._thread = None
                    return


#: This process's retries (``release_all`` adds to them).
release_retries = ReleaseRetries()


def unreleased() -> dict[str, int]:
    """The segment names whose release this process is still trying, by data service
    (their service did not answer; see :class:`ReleaseRetries`)."""
    return release_retries.pending()
