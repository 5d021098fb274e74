"""Supervision policy, in one place: when a replica is unhealthy and how it restarts.

Pure logic (no actors), so every rule is unit-tested on its own. The pool
applies it; the coordinator applies :class:`RestartPolicy` to pools.

Rules (defaults in :class:`omni_actors.config.Supervision`):

- **Missed heartbeats**: a READY replica whose last heartbeat is older than
  ``missed_heartbeats`` intervals (3, as Ray Serve's 3 failed checks, but 1 s
  apart instead of 10 s) is isolated: it is hung or gone.
- **Stall**: a replica that heartbeats, has work in flight, and reports no
  progress (tokens or items produced) for ``stall_timeout_s`` is isolated; one
  with work whose heartbeats stopped too is isolated as silent then (hung or
  its host lost: its tasks are not counted against them).
- **Circuit breaker**: ``breaker_failures`` task failures in a row isolate it.
- **Restart** (Erlang/OTP-style intensity): after an isolated replica is
  killed, or a replica's process exits, it is restarted after an exponential
  backoff (``initial_backoff_s`` doubling up to ``max_backoff_s``); more than
  ``max_restarts`` restarts within ``window_s`` and it goes down, FAILED,
  with the reason in ``status``; a FAILED replica (this, or one that never
  loaded) is tried once more every ``failed_retry_s``.
- **Lost parent**: a pool or engine takes its parent (coordinator, pool) for
  gone when its acks are late; a parent on the same host (Thespian forks each
  actor from its parent) must also no longer be its parent process
  (:class:`ParentWatch`): a busy parent acks late too, and is not left for it.
"""

from __future__ import annotations

import functools
import os
import socket
import threading
import time
from dataclasses import dataclass, field


def exit_if_orphaned_before_start(started: threading.Event, poll_s: float = 1.0) -> None:
    """Watch, from a daemon thread, for this actor's parent process dying before
    ``started`` is set, and end this process then (``os._exit(0)``: it holds nothing).

    An actor's own watch (heartbeats, :class:`ParentWatch`) starts with its first
    message (``StartEngine``, ``StartPool``). One whose parent died before sending it
    (a pool killed while its engines were being forked) had no watch at all and lived
    on, re-parented to init, after the system stopped (seen after a scale to 2000).
    The thread ends once ``started`` is set.
    """
    parent = os.getppid()

    def watch() -> None:
        while not started.wait(poll_s):
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, name="orphan-before-start", daemon=True).start()


def exit_hard_after(delay_s: float, log, **fields) -> threading.Timer:
    """End this process (``os._exit(0)``) ``delay_s`` seconds from now, from a daemon
    timer, unless it has ended by then; logs ``exit_forced`` with ``fields`` first.

    For an actor that asked Thespian to exit and holds nothing: Thespian then waits
    for every child to confirm its exit, and a child whose creation was sent towards
    a member that is gone never does (a pool orphaned by a killed coordinator was
    seen alive until the system stopped). Wake-ups are no help there: an exiting
    actor gets none.
    """
    def force() -> None:
        log.warning("exit_forced", after_s=delay_s, **fields)
        os._exit(0)

    timer = threading.Timer(delay_s, force)
    timer.daemon = True
    timer.start()
    return timer


#: How late a wake-up may be before it counts as lost and whatever else runs regularly
#: (a pool's tick, a RequestActor's alive beat) runs its work instead. Our own figure:
#: wake-ups here come within milliseconds of their time unless dropped.
WAKEUP_LOST_AFTER_S = 2.0
#: A repeating check (a pool's health tick, the coordinator's node check) missed for this
#: many heartbeat intervals lost its wake-up: the next message that comes regularly (a
#: heartbeat, a pool's report) restarts it.
TICK_LOST_AFTER_INTERVALS = 3


def pop_overdue(due_by_payload: dict, now: float) -> list:
    """The payloads of ``due_by_payload`` (payload -> when due, monotonic) over
    :data:`WAKEUP_LOST_AFTER_S` late at ``now``, taken out of it: wake-ups that Thespian
    dropped (see :class:`WakeupChain`), for their actor to run late."""
    lost = [p for p, due in due_by_payload.items() if now > due + WAKEUP_LOST_AFTER_S]
    for payload in lost:
        del due_by_payload[payload]
    return lost


class WakeupChain:
    """A repeating wake-up (``wakeupAfter`` re-armed by its own handler) that can be
    started afresh: its payload is ``(name, generation)`` and only the latest
    generation counts. Thespian drops the wake-ups that fall due while an actor drains
    an excessive transmit queue ("tx-only mode"); a chain whose wake-up was lost is
    restarted with :meth:`start`, and a late one of the old chain is then ignored."""

    def __init__(self, name: str) -> None:
        self.name, self.gen = name, 0
        #: (monotonic s) when the current chain's wake-up falls due; None: none is pending
        self.due: float | None = None

    def start(self, actor, delay_s: float) -> None:
        """A new chain (the old one, if any, is ignored from now on)."""
        self.gen += 1
        self.again(actor, delay_s)

    def again(self, actor, delay_s: float) -> None:
        """The next wake-up of the current chain."""
        self.due = time.monotonic() + delay_s
        actor.wakeupAfter(delay_s, payload=(self.name, self.gen))

    def ensure(self, actor, delay_s: float) -> None:
        """Keep the chain going: start it unless its wake-up is pending (and not lost:
        due less than :data:`WAKEUP_LOST_AFTER_S` ago). Thespian cannot cancel a
        wake-up and keeps the pending ones in a list it sorts on every ``wakeupAfter``:
        an actor that started a chain per request (a RequestActor, thousands of requests
        a minute) made each request cost time in proportion to the requests before it."""
        if self.due is None or time.monotonic() > self.due + WAKEUP_LOST_AFTER_S:
            self.start(actor, delay_s)

    def stopped(self) -> None:
        """The current chain's wake-up came and was not followed by :meth:`again`."""
        self.due = None

    def owns(self, payload) -> bool:
        """Whether ``payload`` is one of this chain's, current or not."""
        return isinstance(payload, tuple) and len(payload) == 2 and payload[0] == self.name

    def current(self, payload) -> bool:
        """Whether ``payload`` is the current chain's wake-up."""
        return self.owns(payload) and payload[1] == self.gen


#: A stage pool that has not reported for this many heartbeat intervals is taken for hung by
#: its coordinator: SIGKILLed, and recreated as a pool that exited is (the leader's watchdog kills
#: a coordinator silent for about as long, 3 x 3 intervals). Only the time the coordinator itself
#: ran counts. A replica on another host takes its pool for gone two intervals after that.
POOL_HUNG_INTERVALS = 10


def refuses_connections(address, timeout_s: float = 0.5) -> bool:
    """Whether the TCP endpoint of a Thespian ``address`` refuses a connection: the process
    that listened there is gone (a process stopped with SIGSTOP, or busy, still has its
    connections accepted by the kernel). False when it accepts, does not answer within
    ``timeout_s``, or the address has no TCP endpoint."""
    try:
        ip, port = address.addressDetails.connectArgs[0]
    except (AttributeError, IndexError, TypeError, ValueError):
        return False
    try:
        with socket.create_connection((ip or "127.0.0.1", port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


@functools.lru_cache(maxsize=1)
def host_identity() -> str:
    """Which machine (kernel) this process runs on, as ``"<hostname>/<boot id>"``: where a
    pid it reports means that process. The boot id (``/proc/sys/kernel/random/boot_id``,
    "" where there is none) tells apart two hosts that share a hostname; network namespaces
    on one host share it, as they share its pids. Read once per process (its status
    reports carry it at every heartbeat interval)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class ParentWatch:
    """Is the actor that started this process gone?

    Thespian forks an actor's process from its parent actor's process when
    both run on one host, so the parent process's pid is this process's
    ``os.getppid()`` until the parent dies (then the process is re-parented,
    to init or a subreaper). That test never gives a false alarm however busy
    the parent is; late heartbeat acks do (a pool handling a burst of 200
    requests acked 3 s late and its engines drained themselves). Acks still
    decide *when* (a parent that just died leaves its children the same time
    as before: leaving at once lost requests when the coordinator was killed).

    Args:
        parent_pid: the parent actor's ``os.getpid()`` (0: unknown).
        parent_host: its ``socket.gethostname()``.

    ``local`` is True when the parent is this process's parent; otherwise
    :meth:`gone` returns None (cannot tell: judge by acks).
    """

    def __init__(self, parent_pid: int, parent_host: str):
        self.parent_pid = parent_pid
        self.local = bool(parent_pid) and parent_host == socket.gethostname() and os.getppid() == parent_pid

    def gone(self) -> bool | None:
        return (os.getppid() != self.parent_pid) if self.local else None

    def lost(self, silent_s: float, late_after_s: float, address: object = None,
             hung_after_s: float = float("inf")) -> bool:
        """Whether to take the parent for gone: its acks are late (none for ``silent_s``,
        over ``late_after_s``) and, when it is this process's parent, it no longer is (a
        busy parent acks late but is still there).

        A parent on another host (``address``: its actor address) is gone when its
        acks are late and its port refuses connections (its process exited), or when it
        has been silent past ``hung_after_s`` (its host cut off; a parent that long
        silent is killed by its own supervisor). Late acks alone made every replica on a
        member host drain itself and cancel its tasks while its pool on the leader was
        only busy for 3 s (a code review). Blocks up to 0.5 s (the probe)."""
        if silent_s <= late_after_s:
            return False
        gone = self.gone()
        if gone is not None or address is None:
            return gone is not False
        return silent_s > hung_after_s or refuses_connections(address)


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    max_restarts: int = 5
    window_s: float = 60.0
    #: Seconds a FAILED replica waits before it is tried once more (0: never): a down
    #: replica must not stay down for good because of a bad minute (a burst, a host that
    #: came back, a model directory fixed meanwhile). 300 s: Kubernetes caps its
    #: CrashLoopBackOff delay at 5 minutes.
    failed_retry_s: float = 300.0

    def recent(self, restart_times: list[float], now: float) -> int:
        """How many of ``restart_times`` fall within ``window_s`` of ``now``."""
        return sum(1 for t in restart_times if now - t <= self.window_s)

    def next_delay(self, restart_times: list[float], now: float) -> float | None:
        """Backoff before the next restart, or None when the intensity is exceeded.

        ``restart_times`` are the monotonic times of earlier restarts of the
        same replica; only those within ``window_s`` of ``now`` count.
        """
        recent = self.recent(restart_times, now)
        if recent >= self.max_restarts:
            return None
        return min(self.initial_backoff_s * (2 ** recent), self.max_backoff_s)


@dataclass
class ReplicaHealth:
    """What the pool tracks to judge one replica. Times are monotonic seconds."""

    last_heartbeat: float
    progress: int = 0
    progress_at: float = 0.0
    consecutive_failures: int = 0
    last_failure_at: float = float("-inf")
    history: list[tuple[float, int]] = field(default_factory=list)  # (time, progress) for rates
    #: seconds without progress, with work, of its earlier stretches of work since its last
    #: progress (its tasks all left it, then new ones came): they count towards a stall
    stalled_before_s: float = 0.0

    def on_heartbeat(self, now: float, progress: int, idle_s: float | None = None) -> None:
        """``idle_s``: the engine's own count of seconds since its last progress,
        so the stall clock starts when progress stopped, not when we heard of it."""
        self.last_heartbeat = now
        if progress != self.progress:
            self.stalled_before_s = 0.0  # it made progress: a stall starts over
        if idle_s is not None:
            # The engine's own measure wins: it reports 0 while its tasks only wait on
            # neighbour stages (streaming input, credits), which is no stall of its own.
            self.progress_at = max(self.progress_at, now - idle_s)
        elif progress != self.progress:
            self.progress_at = now
        self.progress = progress
        self.history.append((now, progress))
        del self.history[:-6]

    def on_dispatch(self, now: float, was_idle: bool) -> None:
        """A task was sent; an idle replica's stall clock starts now (time without work
        is no stall), on top of :attr:`stalled_before_s`."""
        if was_idle:
            self.progress_at = now

    def went_idle(self, now: float, answered: bool = False, min_stretch_s: float = 0.0) -> None:
        """Its last task left it (finished, failed, cancelled). The time it had gone
        without progress with work is kept until it makes progress again: a stalled
        replica whose tasks were all cancelled before the stall timeout (a downstream
        stage's chunk timeout of the same 10 s) was otherwise given a fresh 10 s with
        every new task (a trial saw one isolated after 30 s, its requests failing
        meanwhile).

        Not kept: a stretch that ended with the replica's own answer (``answered``: its
        last task refused on its input, a 400), nor one shorter than ``min_stretch_s``
        (the pool gives its heartbeat interval). A healthy replica's quick 400s, or tasks
        cancelled before their first output, otherwise added up, never to be reset while
        it made no tokens, until its next good task was judged stalled at once and the
        replica killed (a code review: 400 refusals of 30 ms made 12 s).
        """
        stretch = max(0.0, now - self.progress_at)
        if not answered and stretch >= min_stretch_s:
            self.stalled_before_s += stretch

    def stalled_s(self, now: float) -> float:
        """Seconds without progress while it had work (this stretch and the earlier ones)."""
        return now - self.progress_at + self.stalled_before_s

    def on_task_done(self, ok: bool, now: float, dispatched_at: float | None = None) -> None:
        """A task ended. Failures count in a row; a success resets the count only
        if its task was dispatched after the last failure: a long task (a
        streaming one waits for its input) that began before the replica broke
        says nothing about its state now."""
        if ok:
            if dispatched_at is None or dispatched_at > self.last_failure_at:
                self.consecutive_failures = 0
            self.progress_at, self.stalled_before_s = now, 0.0  # finishing a task is progress
        else:
            self.consecutive_failures += 1
            # (never back: a late failure of an earlier attempt is dated before its retry, a review)
            self.last_failure_at = max(self.last_failure_at, now)

    def rate(self) -> float:
        """Progress per second over the last few heartbeats: tokens, or outputs for a stage that
        makes none (see :func:`omni_actors.actors.engine.made_units`)."""
        if len(self.history) < 2:
            return 0.0
        (t0, p0), (t1, p1) = self.history[0], self.history[-1]
        return (p1 - p0) / (t1 - t0) if t1 > t0 else 0.0


#: A replica with work that made no progress for ``stall_timeout_s`` and whose heartbeat is
#: this many intervals late (the next one was due and did not come) is silent, not stalled.
LATE_WITH_WORK_INTERVALS = 1.5


@dataclass(frozen=True)
class HealthPolicy:
    heartbeat_interval_s: float = 1.0
    missed_heartbeats: int = 3
    stall_timeout_s: float = 10.0
    breaker_failures: int = 5

    def silent(self, health: ReplicaHealth, now: float, in_flight: int = 0) -> bool:
        """Missed heartbeats, or silent with work (see :meth:`verdict`): the replica
        hung, or its host is gone, which says nothing about the tasks it was running."""
        return (now - health.last_heartbeat > self.missed_heartbeats * self.heartbeat_interval_s
                or self._silent_with_work(health, now, in_flight))

    def _silent_with_work(self, health: ReplicaHealth, now: float, in_flight: int) -> bool:
        return (bool(in_flight) and now - health.last_heartbeat > LATE_WITH_WORK_INTERVALS * self.heartbeat_interval_s
                and health.stalled_s(now) > self.stall_timeout_s)

    def verdict(self, health: ReplicaHealth, now: float, in_flight: int) -> str | None:
        """Why the replica must be isolated now, or None while it is healthy.

        With work in flight and no progress for ``stall_timeout_s``, its heartbeats
        tell a stall (they go on: it runs, but its tasks do not move; they count
        as crashes, the input may be the cause) from silence (they stopped too,
        :data:`LATE_WITH_WORK_INTERVALS` late: hung or its host lost; its tasks
        move uncounted). It was called stalled either way, so a member host
        killed mid-request under the demo's 2 s stall timeout failed its request
        as a poison input."""
        silent = now - health.last_heartbeat
        if silent > self.missed_heartbeats * self.heartbeat_interval_s:
            return f"missed {self.missed_heartbeats} heartbeats (silent {silent:.1f} s)"
        if self._silent_with_work(health, now, in_flight):
            return (f"silent with {in_flight} task(s) in flight: no heartbeat for {silent:.1f} s "
                    f"and no progress for {health.stalled_s(now):.1f} s")
        if in_flight and health.stalled_s(health.last_heartbeat) > self.stall_timeout_s:
            return (f"stalled: {in_flight} task(s) in flight and no progress for "
                    f"{health.stalled_s(now):.1f} s")
        if health.consecutive_failures >= self.breaker_failures:
            return f"circuit breaker: {health.consecutive_failures} task failures in a row"
        return None
