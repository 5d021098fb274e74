"""The RequestActors of one API server: making them, watching them, writing them off.

:class:`RequestActorKeeping` is the part of :class:`~omni_actors.http.bridge.ActorBridge`
that keeps its RequestActors alive and accounted for (how many there are is the
bridge's :class:`~omni_actors.http.admission.RequestActorPool`):

- they are made by one :class:`~omni_actors.actors.request_supervisor.RequestActorSupervisor`
  (:class:`~omni_actors.messages.MakeRequestActor`), which hears Thespian's
  ``ChildActorExited`` for each at once: a busy one's request fails with a 500 and its
  stages are cancelled; an idle one leaves the pool and is replaced up to the minimum;
- messages to them (cancels, route changes, BridgeAlive, exit requests) go through that
  supervisor (:class:`~omni_actors.messages.Relay`): an API server's ``tell`` to a
  stopped one held a sender thread for up to 60 s; only a request's start goes
  straight to its RequestActor, and a sender stuck there for :data:`HAND_OVER_STUCK_S`
  is replaced (the request is written off);
- the supervisor says it is alive every :data:`~omni_actors.messages.SUPERVISOR_ALIVE_EVERY_S`;
  one not heard from for :data:`~omni_actors.messages.SUPERVISOR_MISSED` of those is
  replaced, and its RequestActors with it;
- a busy RequestActor says it is alive every ``alive_every_s``; one silent for
  ``silent_s``, or that has not said its request ended :data:`LOST_AFTER_S` after the
  deadline, is written off.

Every method here runs on the bridge's event loop unless its docstring names a thread.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import time
from typing import Any, Callable

from omni_actors.actors.request import RequestActor
from omni_actors.actors.request_supervisor import RequestActorSupervisor
from omni_actors.http.types import RequestFailed
from omni_actors.messages import (BRIDGE_LOST_AFTER_S, SUPERVISOR_ALIVE_EVERY_S, SUPERVISOR_MISSED, BridgeAlive,
                                  CancelRequest, CancelStage, DeltasAck, OutputsAck,
                                  MakeRequestActor, Relay, RequestActorMade, SuperviseRequestActors)

#: A RequestActor that has not said its request ended this long after the request's
#: deadline is written off (it died or hangs): told to exit, its place given to another.
LOST_AFTER_S = 30.0
#: How often (seconds, at most) a busy RequestActor tells its bridge it still runs its
#: request (:class:`~omni_actors.messages.RequestActorAlive`).
REQUEST_ACTOR_ALIVE_EVERY_S = 5.0
#: A busy RequestActor not heard from for this long (seconds) is written off: its process
#: is gone (killed, crashed) or hangs. Its request fails with a 500 and its stages are
#: cancelled, instead of the client waiting for the deadline. Generous: a RequestActor
#: blocks while it first loads vLLM-Omni's connector (15-20 s measured here).
REQUEST_ACTOR_SILENT_S = 60.0
#: Seconds to wait for the RequestActorSupervisor to make a RequestActor.
MAKE_TIMEOUT_S = 10.0
#: A sender thread still handing a request to its (idle) RequestActor after this long
#: is stuck: that RequestActor is stopped or hangs (a hand-over takes milliseconds).
HAND_OVER_STUCK_S = 3.0

#: Messages relayed through our supervisor that are sent again through its successor when
#: it is lost, those relayed since shortly before it last said it was alive (a killed one
#: drops them unseen, and Thespian tells no error: a code review saw acks lost meanwhile
#: hold every stream's text back for 30 s, and cancels lost leave pipelines running for
#: clients gone): later ones of each kind supersede earlier ones, or are ignored by a
#: request that has ended. At most :data:`RELAY_BACKLOG` are kept.
RESENT_RELAYS = (CancelRequest, CancelStage, DeltasAck, OutputsAck)
RELAY_BACKLOG = 4096
#: Seconds before its last SupervisorAlive from which relays are kept for a resend (those
#: older had reached it: it handles its messages in turn, the alive after them).
RELAY_KEPT_S = 2.0

#: Environment variable: seconds after which an idle RequestActor that hears nothing from
#: this API server exits (default :data:`~omni_actors.messages.BRIDGE_LOST_AFTER_S`).
LOST_AFTER_ENV = "OMNI_ACTORS_BRIDGE_LOST_AFTER_S"


@dataclasses.dataclass
class _Held:
    """A request on a RequestActor, from its start to its RequestFinished (event loop only)."""

    due: float  #: when its RequestActor is written off if it has not said the request ended
    heard: float  #: when its RequestActor was last heard from (or the request started)
    actor: Any = None  #: the RequestActor's address, once known


#: A tick of the bridge's RequestActor keeping this late (seconds) means the server did not
#: run meanwhile: the silences it measures are moved on by as much (see _tick).
TICK_LATE_S = 1.0

#: Seconds an attached API server waits, after one of its RequestActors exited, before it
#: looks whether its whole system went (the watchdog of a killed leader takes a second).
EXITED_RECHECK_S = 1.5


class RequestActorKeeping:
    """The bridge's RequestActor keeping (a mixin of :class:`~omni_actors.http.bridge.ActorBridge`,
    which provides ``_pool``, ``_outbox``, ``_put``, ``_loop``, ``_stop``, ``_log``,
    ``_address``, ``_handing`` and ``_start_sender``)."""

    def _init_request_actors(self, silent_s: float, idle_exit_s: float) -> None:
        #: an attached API server's check that its system still runs (blocking; None: the
        #: leader's own server, which goes with its system)
        self.system_alive: Callable[[], bool] | None = None
        #: the requests on a RequestActor (event loop only)
        self._held: dict[str, _Held] = {}
        #: requests over whose RequestActor still waits for its stages' cancels (event loop only)
        self._closing: set[str] = set()
        #: the parent of our RequestActors: tells us when one exits (see request_supervisor);
        #: None: not made (yet), or lost (RequestActors are then made unsupervised)
        self._supervisor = None
        #: (monotonic) when the receiver thread last came back from a read (0: not known)
        self._receiver_turn_at = 0.0
        #: seconds the receiver thread was held up between reads, in all (it alone adds to it),
        #: and how much of it _tick has credited to the silences it judges
        self._receiver_stalled_s = 0.0
        self._receiver_stall_credited = 0.0
        self._supervise_again_at = 0.0  # (monotonic) when to try again to make a supervisor (0: not)
        #: when it last said it runs (SupervisorAlive); RequestActors of a lost one (event loop)
        self._supervisor_heard = 0.0
        self._orphans: list = []  # (addresses: unhashable)
        self._silent_s = silent_s
        self._alive_every_s = min(REQUEST_ACTOR_ALIVE_EVERY_S, silent_s / 4)
        #: how often the event loop ends idle RequestActors and writes off lost ones
        self._tick_s = min(1.0, max(0.05, idle_exit_s / 4), self._alive_every_s)
        self._ticked_at = 0.0  # (monotonic) the last _tick
        self._paused_s = 0.0  # seconds this server did not run, in all (see _tick, _running_clock)
        #: an idle RequestActor of ours that hears nothing for this long exits (BridgeAlive);
        #: ``$OMNI_ACTORS_BRIDGE_LOST_AFTER_S`` changes it (tests), default BRIDGE_LOST_AFTER_S
        self._lost_after_s = float(os.environ.get(LOST_AFTER_ENV) or BRIDGE_LOST_AFTER_S)
        self._alive_due = 0.0
        self._tick_handle: asyncio.TimerHandle | None = None
        #: (monotonic, actor, message) of recent relays (see :data:`RESENT_RELAYS`), oldest first
        self._relay_backlog: collections.deque = collections.deque(maxlen=RELAY_BACKLOG)

    def _tell_request_actor(self, ctx, actor: Any, message: Any) -> None:
        """Sender thread: ``message`` to a RequestActor, busy or idle (or a pool), through
        our supervisor (see :class:`~omni_actors.messages.Relay`: a stopped or hung one must
        not hold this thread; a busy one's cancel, an idle one's BridgeAlive held it up to
        60 s). Only a request's start goes straight to its RequestActor (see _send_loop)."""
        supervisor = self._supervisor
        if supervisor is not None and actor != supervisor:
            if isinstance(message, RESENT_RELAYS):
                self._relay_backlog.append((time.monotonic(), actor, message))  # (see _take_relays)
            ctx.tell(supervisor, Relay(actor, message))
        else:
            ctx.tell(actor, message)

    def _take_relays(self) -> list:
        """Sender thread: the relays (:data:`RESENT_RELAYS`) a lost supervisor may not have
        passed on, ``(when, actor, message)``, taken out of the backlog, to go through the new
        one (see ``ActorBridge._supervise_again``)."""
        taken = []
        while True:
            try:
                taken.append(self._relay_backlog.popleft())
            except IndexError:
                return taken

    def _make_supervisor(self, ctx) -> None:
        """Sender or receiver thread: a new RequestActorSupervisor, ours from now on (none
        if it cannot be made: RequestActors are then made unsupervised)."""
        try:
            supervisor = ctx.createActor(RequestActorSupervisor)
            ctx.tell(supervisor, SuperviseRequestActors(self._address, self._lost_after_s))
        except Exception as exc:  # noqa: BLE001
            self._log.warning("request_supervisor_not_made", error=str(exc))
            self._supervise_again_at = time.monotonic() + SUPERVISOR_ALIVE_EVERY_S * SUPERVISOR_MISSED
            return
        self._supervisor_heard = time.monotonic()  # (before it is ours: _tick must not take it for lost)
        self._supervisor = supervisor

    def _make_request_actor(self, ctx) -> Any:
        """Sender thread: a new RequestActor, made by our supervisor (made directly if there
        is none, or it does not answer: it is then given up). One made directly is nobody's
        to watch: it runs one request at most, and leaves the pool when a supervisor is back
        (as a lost supervisor's RequestActors do; trial BS: killed, such a RequestActor's
        request waited 60 s for its end)."""
        supervisor = self._supervisor
        if supervisor is not None:
            t0 = time.monotonic()
            made = ctx.ask(supervisor, MakeRequestActor(), MAKE_TIMEOUT_S)
            if isinstance(made, RequestActorMade):
                return made.address
            self._log.warning("request_supervisor_unanswered",
                              error=f"no answer within {MAKE_TIMEOUT_S:g} s" if made is None and
                              time.monotonic() - t0 >= MAKE_TIMEOUT_S else f"no answer: {made!r}"[:200])
            # (lost, and replaced as any lost one: a code review saw it set to None here, for good,
            # or a new one made meanwhile thrown away)
            self._loop.call_soon_threadsafe(self._supervisor_lost_if, supervisor)
        actor = ctx.createActor(RequestActor)
        self._loop.call_soon_threadsafe(self._orphans.append, actor)  # (unwatched, as a lost one's)
        return actor

    def _retire_idle_orphans(self) -> None:
        """Event loop: a new supervisor is ours: the idle RequestActors nobody watches (made
        while there was none) leave the pool, replaced by watched ones."""
        for actor in self._pool.idle_actors():
            if actor in self._orphans and self._pool.discard(actor):
                self._orphans.remove(actor)
                self._outbox().put(("exit", actor))
        self._refill()

    def _supervisor_lost_if(self, supervisor: Any) -> None:
        """Event loop: ``supervisor`` did not answer; lost if it is still ours."""
        if self._supervisor is not None and self._supervisor == supervisor:
            self._supervisor_lost(time.monotonic())

    # -- the RequestActor pool (event loop) ---------------------------------
    def _tick(self) -> None:
        """Every ``_tick_s``: end RequestActors idle too long, write off lost ones."""
        if self._stop.is_set():
            return
        try:
            now = time.monotonic()
            late = now - self._ticked_at - self._tick_s if self._ticked_at else 0.0
            self._ticked_at = now
            if late > TICK_LATE_S:
                # This server did not run for a while (frozen with SIGSTOP, a paused VM, starved
                # of CPU): what it did not hear meanwhile is its own silence, not its supervisor's
                # or its RequestActors' (a trial's server, resumed after 8 s, took its supervisor
                # for lost and ended it, and with it the RequestActor of a stream in flight).
                self._log.warning("api_server_tick_late", late_s=round(late, 2))
                self._paused_s += late
                self._supervisor_heard = min(now, self._supervisor_heard + late)
                for held in self._held.values():
                    held.heard = min(now, held.heard + late)
            stalled = self._receiver_stalled_s - self._receiver_stall_credited
            if stalled > 0:  # (the receiver was held up: what it had not read is no one's silence)
                self._receiver_stall_credited += stalled
                self._supervisor_heard = min(now, self._supervisor_heard + stalled)
                for held in self._held.values():
                    held.heard = min(now, held.heard + stalled)
            for rid in [rid for rid, held in self._held.items() if now >= held.due]:
                self._write_off(rid, f"no end of the request {LOST_AFTER_S:g} s after its deadline")
            read_up_to = min(now, self._receiver_turn_at or now)
            for rid in [rid for rid, held in self._held.items() if read_up_to - held.heard > self._silent_s]:
                # (not told to exit: a tell to a dead actor blocks a sender thread for up to 60 s;
                # a hung one exits by itself once idle, hearing no BridgeAlive)
                self._write_off(rid, f"its RequestActor was not heard from for {self._silent_s:g} s "
                                     "(stopped, hung, or its process gone?)", tell_exit=False)
            self._unstick_senders(now)
            idle = self._pool.reap()
            for actor in idle:
                self._outbox().put(("exit", actor))
            if idle:
                self._log.info("request_actors_idle_exit", ended=len(idle), left=self._pool.total)
            # (silence counts only up to the receiver thread's last read: one held up, by a fetch
            # from a vanished host, hears nothing, and a healthy supervisor was taken for lost)
            read_up_to = min(now, self._receiver_turn_at or now)
            if self._supervisor is not None and \
                    read_up_to - self._supervisor_heard > SUPERVISOR_ALIVE_EVERY_S * SUPERVISOR_MISSED:
                self._supervisor_lost(now)
            elif self._supervisor is None and self._supervise_again_at and now >= self._supervise_again_at:
                self._supervise_again_at = 0.0  # (none could be made: try again, now and then)
                self._outbox().put(("supervise", (), None))
            if now >= self._alive_due:  # tell the idle ones we still run (see BridgeAlive)
                self._alive_due = now + self._lost_after_s / 4
                for actor in [*self._pool.idle_actors(), *([self._supervisor] if self._supervisor else [])]:
                    self._outbox().put(("tell", actor, BridgeAlive(self._lost_after_s)))
        finally:
            self._tick_handle = self._loop.call_later(self._tick_s, self._tick)

    def _running_clock(self) -> float:
        """Monotonic seconds less the time this server did not run (see :meth:`_tick`)."""
        return time.monotonic() - self._paused_s

    def _unstick_senders(self, now: float) -> None:
        """A sender thread that has been handing a request to its RequestActor for
        :data:`HAND_OVER_STUCK_S` is stuck (the RequestActor is stopped or hangs): the
        request is written off and the outbox gets a new sender, so the requests behind
        it in that outbox are not held up as long as Thespian tries (up to 60 s). So is
        one stuck relaying a message through our supervisor (stopped or hung: its
        request id is None), the message lost (the supervisor's silence replaces it
        within :data:`~omni_actors.messages.SUPERVISOR_MISSED` beats). Time this server
        did not run does not count (a server frozen with a hand-over under way wrote its
        request off as it resumed)."""
        now = now - self._paused_s
        for i, handing in enumerate(self._handing):
            if handing is not None and now - handing[0] > HAND_OVER_STUCK_S:
                self._handing[i] = None
                self._start_sender(i)
                if handing[1] is None:
                    self._log.warning("bridge_relay_stuck", sender=i, stuck_s=round(now - handing[0], 1))
                    continue
                self._write_off(handing[1], f"its RequestActor did not take the request within "
                                            f"{HAND_OVER_STUCK_S:g} s (stopped or hung?)", tell_exit=False,
                                not_started=True)

    def _supervisor_lost(self, now: float) -> None:
        """Our RequestActorSupervisor went silent (its process was killed, or is held up): a
        new one is made; the RequestActors of the lost one are ended (unwatched) and replaced
        up to the minimum: the idle ones at once (told through the new supervisor: a tell
        from here to one that died with it would hold a sender thread), the busy ones when
        they finish; the lost one is told to exit the same way."""
        self._log.warning("request_supervisor_lost", silent_s=round(now - self._supervisor_heard, 1))
        lost, self._supervisor = self._supervisor, None
        self._orphans += [held.actor for held in self._held.values() if held.actor is not None]
        idle = self._pool.idle_actors()
        for actor in idle:
            self._pool.discard(actor)
        # (the lost one is told to exit too: one only held up, by a frozen coordinator in a trial,
        # stayed on with no RequestActors until its own 120 s without word from us ran out)
        self._outbox().put(("supervise", tuple(idle), lost))
        self._refill()

    def _supervisor_alive(self, address: Any) -> None:
        if address == self._supervisor:
            self._supervisor_heard = time.monotonic()
            backlog, kept_from = self._relay_backlog, self._supervisor_heard - RELAY_KEPT_S
            try:
                while backlog[0][0] < kept_from:
                    backlog.popleft()
            except IndexError:  # (empty; or a sender thread resending emptied it meanwhile)
                pass

    def _refill(self) -> None:
        """Make RequestActors up to the pool's minimum."""
        missing = self._pool.minimum - self._pool.total
        if missing > 0 and not self._stop.is_set():
            self._pool.reserve(missing)
            for _ in range(missing):
                self._outbox().put(("create",))

    def _closing_begins(self, request_id: str) -> None:
        """The request is over, its RequestActor busy until its stages confirm their cancels
        (``closing``), unless it said it is free already: its RequestActorFree can overtake
        the RequestFinished (a code review: the request then counted as closing for good)."""
        if request_id in self._held:
            self._closing.add(request_id)

    def _unhold(self, request_id: str) -> bool:
        """Forget that a RequestActor holds ``request_id``; False if none did (any more)."""
        self._closing.discard(request_id)
        return self._held.pop(request_id, None) is not None

    def _write_off(self, request_id: str, why: str, tell_exit: bool = True, not_started: bool = False) -> None:
        """The RequestActor of ``request_id`` is dead or hangs: its stages cancelled, its
        place given to another (it is told to exit if ``tell_exit``; one is made in its place
        while fewer than the minimum are left); the request (if its client still waits)
        fails with a 500 that says ``why``. Once: a request no RequestActor holds any more
        (written off already, or returned) is left alone (a code review: an actor that died
        with a sender stuck on it was counted lost twice, by its exit notice and by the
        stuck sender, and the pool then made one more than ``request_actors``)."""
        if not self._unhold(request_id):
            return
        self._log.warning("request_actor_lost", request_id=request_id, error=why)
        self._outbox(request_id).put(("abandon", request_id, tell_exit))
        self._pool.lost()
        self._refill()  # (it was made up only at the next request: a helper saw the pool below its minimum)
        self._put(request_id, RequestFailed(500, f"the request was lost: {why}", "server_error",
                                            not_started=not_started, lost_by_server=True))

    def _bind(self, request_id: str, actor: Any) -> None:
        """The sender thread made ``actor`` for ``request_id``."""
        held = self._held.get(request_id)
        if held is not None:
            held.actor = actor

    def _exited(self, actor: Any) -> None:
        """A RequestActor of ours exited (our supervisor says): its request, if it had one,
        fails at once; an idle one leaves the pool (replaced up to the minimum)."""
        for rid, held in list(self._held.items()):
            if held.actor == actor:
                if self.system_alive is not None:  # (an attached API server: see _exited_unless_gone)
                    asyncio.ensure_future(self._exited_unless_gone(rid, actor))
                else:
                    self._write_off(rid, "its RequestActor exited (its process was killed?)", tell_exit=False)
                return
        if self._pool.discard(actor):
            self._log.warning("request_actor_exited", state="idle", left=self._pool.total)
            self._refill()

    async def _exited_unless_gone(self, request_id: str, actor: Any) -> None:
        """A RequestActor of an attached API server exited: unless the whole system went
        (killed: its RequestActors go first, and the request read "lost: its RequestActor
        exited" rather than the server's "system is gone" 503, trial AO), write it off. Looked
        at after :data:`EXITED_RECHECK_S`: its admin may outlive it by a moment."""
        await asyncio.sleep(EXITED_RECHECK_S)
        if not await asyncio.get_running_loop().run_in_executor(None, self.system_alive):
            return  # (the API server ends it, saying the system is gone, within a second)
        held = self._held.get(request_id)
        if held is not None and held.actor == actor:
            self._write_off(request_id, "its RequestActor exited (its process was killed?)", tell_exit=False)

    def _alive(self, request_id: str) -> None:
        """The RequestActor of ``request_id`` said it still runs it."""
        held = self._held.get(request_id)
        if held is not None:
            held.heard = time.monotonic()

    def _returned(self, request_id: str, actor: Any) -> None:
        """The RequestActor of ``request_id`` said the request ended: it is free again."""
        if not self._unhold(request_id):
            if actor is not None:  # written off (hung, then back): it runs, so a tell cannot block
                self._outbox(request_id).put(("exit", actor))
            return
        if actor is None or actor in self._orphans:  # (one of a lost supervisor's: not used again)
            if actor is not None:
                self._orphans.remove(actor)
                self._outbox(request_id).put(("exit", actor))  # (it runs: it just said so)
            self._pool.lost()
            self._refill()
        else:
            self._pool.release(actor)

    def _not_started(self, request_id: str, error: str) -> None:
        """The request could not be started on a RequestActor (making or telling it failed)."""
        if self._unhold(request_id):
            self._pool.lost()
            self._refill()
        # (nothing of it ran: it may run again on another RequestActor; a code review saw it fail at once)
        self._put(request_id, RequestFailed(500, f"could not start the request on a RequestActor: {error}",
                                            not_started=True, lost_by_server=True))
