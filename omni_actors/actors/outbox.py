"""What an EngineActor does with its outbox before sending: merge, number, store.

The engine's loop thread queues ``(address, message)`` pairs; the actor thread
drains them whenever it is free. Each actor message costs about 1 ms of CPU
here, so the drain first merges what piled up for one task since the last
drain (:func:`coalesce`): text deltas into one delta, output chunks into one
chunk. Under load fewer, larger messages go out; unloaded, every token and
chunk goes out on its own. Then :class:`Sequencer` numbers each task's deltas
and chunks (Thespian keeps up to 20 transmits in flight per sender, so two
messages can overtake each other: the receiver reorders by number), puts
each chunk's outputs into the connector, and tells the task's ``StageDone``
how many of each went before it. Last, :func:`bundle` puts every text delta
for one bridge into one message, whatever request it belongs to, and
:class:`DeltaWindow` keeps only a few such messages in flight per bridge.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from omni_actors.messages import OutputDelta, OutputDeltas, StageChunk, StageDone, TaskFinished

#: :class:`OutputDeltas` messages an engine keeps in flight to one bridge (see DeltaWindow).
DELTA_WINDOW = 6
#: ... of which every this many asks the bridge for a :class:`~omni_actors.messages.DeltasAck`.
DELTA_ACK_EVERY = 3
#: With the window full and no answer for this long, one more message goes, asking again
#: (an answer lost with a replaced RequestActorSupervisor), at most ``DELTA_PROBES`` times.
DELTA_PROBE_AFTER_S = 2.0
DELTA_PROBES = 2
#: ... then one every this many seconds (a code review: after two lost answers, a replica held
#: every text delta for that API server until it forgot it, about 5 minutes later).
DELTA_PROBE_SLOW_S = 30.0
#: Text deltas held for one bridge beyond which they are dropped (a bridge frozen for long).
DELTA_HELD_LIMIT = 50_000
#: A bridge that answered nothing for this long is forgotten, with what was held for it
#: (Thespian gives up on a transmit after 5 minutes: its messages in flight failed by then).
DELTA_FORGET_AFTER_S = 300.0


@dataclass
class PendingChunk:
    """An output chunk not sent yet: its outputs, and which of the task's chunks
    (``first`` .. ``last``, counted as the backend made them) it holds."""

    request_id: str
    stage_id: int
    attempt: int
    outputs: list[dict[str, Any]]
    first: int
    last: int = field(default=-1)

    def __post_init__(self) -> None:
        if self.last < 0:
            self.last = self.first


def merge_outputs(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """Join consecutive chunks of one stage's outputs: each is the next slice
    along axis 0 (tokens, hidden-state rows, frames, samples), so arrays are
    concatenated, strings joined, other values (a sample rate) taken from the
    first chunk that has them."""
    if len(parts) == 1:
        return parts[0]
    out: dict[str, Any] = {}
    for key in dict.fromkeys(k for p in parts for k in p):
        values = [p[key] for p in parts if key in p]
        if all(isinstance(v, np.ndarray) and v.ndim >= 1 for v in values):
            out[key] = np.concatenate(values)
        elif all(isinstance(v, str) for v in values):
            out[key] = "".join(values)
        else:
            out[key] = values[0]
    return out


def coalesce(items: list[tuple[Any, Any]], names: AddressNames | None = None) -> list[tuple[Any, Any]]:
    """Merge each task's consecutive text deltas, and its consecutive output
    chunks, queued since the last drain. One merges into an earlier one of the
    same task (target, request, stage, attempt) only while no other message for
    that request came in between, so nothing moves past a ``StageDone`` and
    text and chunks keep their order relative to each other's neighbours.

    Runs once per drain over every token queued since the last (tens per drain
    under load): a merged delta is built once, from the list of its texts.
    ``names``: an :class:`AddressNames` kept across drains (default: a new one)."""
    out: list[tuple[Any, Any]] = []
    open_at: dict[tuple, int] = {}  # (kind, address, request, stage, attempt) -> index in out
    texts: dict[int, list[str]] = {}  # index in out of a text delta -> the texts merged into it
    names = AddressNames() if names is None else names
    for address, message in items:
        request_id = getattr(message, "request_id", None)
        delta = isinstance(message, OutputDelta)
        if delta or isinstance(message, PendingChunk):
            key = (delta, names[address], request_id, message.stage_id, message.attempt)
            i = open_at.get(key)
            if i is not None:
                if delta:
                    texts[i].append(message.text)
                else:
                    first = out[i][1]
                    first.outputs.extend(message.outputs)
                    first.last = message.last
                continue
            open_at[key] = len(out)
            if delta:
                texts[len(out)] = [message.text]
        elif request_id is not None and open_at:
            for key in [k for k in open_at if k[2] == request_id]:
                del open_at[key]
        out.append((address, message))
    for i, parts in texts.items():
        if len(parts) > 1:
            address, first = out[i]
            out[i] = (address, OutputDelta(first.request_id, "".join(parts), first.seq, first.stage_id,
                                           first.attempt))
    return out


class AddressNames:
    """``str(address)`` of actor addresses, computed once per address object:
    Thespian's ActorAddress is not hashable and its ``str()`` is not cheap (a
    profile of a replica streaming 8 requests found it in 4% of the process's
    CPU when computed on every drain); the messages of one task all carry the
    same address object, unpickled with its task.

    Keeps each object it named (so its ``id`` cannot be reused for another while
    it is known), at most ``limit`` of them: beyond that it starts again empty.
    """

    def __init__(self, limit: int = 1024) -> None:
        self._limit = limit
        self._names: dict[int, tuple[Any, str]] = {}

    def __getitem__(self, address: Any) -> str:
        known = self._names.get(id(address))
        if known is not None:
            return known[1]
        if len(self._names) >= self._limit:
            self._names.clear()
        name = str(address)
        self._names[id(address)] = (address, name)
        return name

    def __len__(self) -> int:
        return len(self._names)


class Sequencer:
    """Numbers each task's text deltas and chunks as they are sent, stores
    chunk outputs with ``put`` (outputs dict -> ConnectorRef), and stamps each
    ``StageDone`` with how many deltas and chunks went before it.

    ``stamp`` raises what ``put`` raises (``OSError`` when shared memory is
    full, ``TypeError`` for an unpackable dtype). After a chunk of an attempt is
    lost (:meth:`lost`: its task was failed), that attempt's later chunks and its
    ``StageDone`` are dropped (``stamp`` returns None; the StageDone's refs are
    released with ``release``): numbered without the lost chunk, a StageDone that
    overtook the failure looked complete, and the request went on without that
    chunk's outputs (a review).
    """

    def __init__(self, put: Callable[[dict[str, Any]], Any],
                 release: Callable[[list], None] = lambda refs: None) -> None:
        self._put = put
        self._release = release
        self._lost: set[tuple[str, int, int]] = set()  # (request, stage, attempt) that lost a chunk
        #: (request, stage, attempt) -> [deltas sent, chunks sent]. By attempt: a task
        #: started over on this replica can overlap its earlier attempt, whose last
        #: messages must not reset (or take numbers from) the new one's counts.
        self._sent: dict[tuple[str, int, int], list[int]] = {}

    def _counts(self, request_id: str, stage_id: int, attempt: int) -> list[int]:
        counts = self._sent.get((request_id, stage_id, attempt))
        if counts is None:
            counts = self._sent[(request_id, stage_id, attempt)] = [0, 0]
        return counts

    def lost(self, request_id: str, stage_id: int, attempt: int) -> None:
        """A chunk of that attempt could not be stored: drop what it sends after."""
        self._lost.add((request_id, stage_id, attempt))

    def stamp(self, message: Any) -> Any:
        if isinstance(message, (PendingChunk, StageDone)) and \
                (message.request_id, message.stage_id, message.attempt) in self._lost:
            if isinstance(message, StageDone):
                self._release([message.output, message.final])
            return None
        if isinstance(message, OutputDelta):
            counts = self._counts(message.request_id, message.stage_id, message.attempt)
            counts[0] += 1
            return OutputDelta(message.request_id, message.text, counts[0] - 1, message.stage_id, message.attempt)
        if isinstance(message, PendingChunk):
            ref = self._put(merge_outputs(message.outputs))
            counts = self._counts(message.request_id, message.stage_id, message.attempt)
            counts[1] += 1
            return StageChunk(message.request_id, message.stage_id, counts[1] - 1, ref, message.attempt,
                              last=message.last)
        if isinstance(message, StageDone):
            counts = self._counts(message.request_id, message.stage_id, message.attempt)
            return dataclasses.replace(message, deltas=counts[0], chunks=counts[1])
        if isinstance(message, TaskFinished):  # the attempt's last message (an engine's names its attempt)
            self._sent.pop((message.request_id, message.stage_id, message.attempt), None)
            self._lost.discard((message.request_id, message.stage_id, message.attempt))
        return message


def bundle(items: list[tuple[Any, Any]], names: AddressNames | None = None) -> list[tuple[Any, Any]]:
    """Every :class:`OutputDelta` for one address, in order, as one
    :class:`OutputDeltas` where the first of them was; other messages keep
    their places. (Only text deltas go from an engine to a bridge, so nothing
    else to that address is overtaken.)"""
    out: list[tuple[Any, Any]] = []
    batches: dict[str, list[OutputDelta]] = {}  # str(address): ActorAddress is not hashable
    names = AddressNames() if names is None else names
    for address, message in items:
        if isinstance(message, OutputDelta):
            batch = batches.get(names[address])
            if batch is None:
                batch = batches[names[address]] = []
                out.append((address, batch))
            batch.append(message)
        else:
            out.append((address, message))
    return [(a, OutputDeltas(tuple(m)) if isinstance(m, list) else m) for a, m in out]


@dataclass
class _Peer:
    """One bridge, as a :class:`DeltaWindow` sees it."""

    address: Any
    sent: int = 0  #: OutputDeltas sent to it
    acked: int = 0  #: ... of which it said it has the first ``acked``
    heard_at: float = 0.0  #: its last answer (or when we first sent to it)
    held_since: float | None = None  #: since when deltas are held for it (reset by an answer or a probe)
    probes: int = 0  #: messages sent beyond the window since its last answer
    held: list[OutputDelta] = field(default_factory=list)


class DeltaWindow:
    """Flow control of an engine's text deltas, per bridge (API server).

    Thespian's TCP transport keeps at most 20 transmits in flight per sending
    actor, and one to a peer that never acknowledges (an API server stopped
    with SIGSTOP, or a host gone silent) stays in flight up to 5 minutes. With
    a message per token, 20 of them to one frozen API server left the
    engine's heartbeats queued behind them: the pool took the replica for
    silent and restarted it, breaking every stream it served (trial AO).

    So at most ``window`` :class:`OutputDeltas` go to one bridge unanswered;
    every ``ack_every``-th asks the bridge for a
    :class:`~omni_actors.messages.DeltasAck` saying how many it has. While the
    window is full, that bridge's deltas are held (already numbered: the
    requests' ``StageDone`` counts them) and leave together, as one message,
    when an answer opens the window. A frozen bridge then holds at most
    ``window`` + ``probes`` of the engine's transmits, and the engine serves on.

    Not thread-safe: the engine's actor thread calls every method.
    """

    def __init__(self, me: Any, *, window: int = DELTA_WINDOW, ack_every: int = DELTA_ACK_EVERY,
                 probe_after_s: float = DELTA_PROBE_AFTER_S, probes: int = DELTA_PROBES,
                 held_limit: int = DELTA_HELD_LIMIT, forget_after_s: float = DELTA_FORGET_AFTER_S,
                 clock: Callable[[], float] = time.monotonic, log: Any = None) -> None:
        if not 1 <= ack_every <= window:
            raise ValueError(f"ack_every ({ack_every}) must be between 1 and window ({window})")
        self._me, self._window, self._ack_every = me, window, ack_every
        self._probe_after_s, self._probes, self._held_limit = probe_after_s, probes, held_limit
        self._forget_after_s, self._clock, self._log = forget_after_s, clock, log
        self._peers: dict[str, _Peer] = {}

    def admit(self, address: Any, name: str, message: OutputDeltas) -> OutputDeltas | None:
        """``message`` for the bridge at ``address`` (``name``: its ``str()``), with
        what was held for it before, if the window has room (then stamped for an
        answer where due); else None: it is held."""
        peer = self._peers.get(name)
        if peer is None:
            peer = self._peers[name] = _Peer(address, heard_at=self._clock())
        deltas = peer.held + list(message.deltas) if peer.held else list(message.deltas)
        peer.held = []
        if peer.sent - peer.acked < self._window:
            return self._stamp(peer, name, deltas, probe=False)
        if peer.held_since is None:
            peer.held_since = self._clock()
        peer.held = deltas
        if len(deltas) > self._held_limit:
            self._drop(name, peer, f"more than {self._held_limit} text deltas held for it")
        return None

    def acked(self, name: str, upto: int) -> list[tuple[Any, OutputDeltas]]:
        """The bridge ``name`` has our first ``upto`` messages: what was held for it,
        as one message, if the window now has room."""
        peer = self._peers.get(name)
        if peer is None or upto <= peer.acked:
            return []
        peer.acked, peer.heard_at, peer.probes = min(upto, peer.sent), self._clock(), 0
        peer.held_since = peer.heard_at if peer.held else None
        if peer.held and peer.sent - peer.acked < self._window:
            deltas, peer.held, peer.held_since = peer.held, [], None
            return [(peer.address, self._stamp(peer, name, deltas, probe=False))]
        return []

    def due(self) -> list[tuple[Any, OutputDeltas]]:
        """Called now and then (each heartbeat): a probe for each bridge whose full
        window went unanswered for ``probe_after_s``; bridges silent for
        ``forget_after_s`` are forgotten."""
        now, out = self._clock(), []
        for name, peer in list(self._peers.items()):
            silent = now - peer.heard_at
            held_s = 0.0 if peer.held_since is None else now - peer.held_since
            if silent >= self._forget_after_s and (not peer.held or held_s >= self._forget_after_s):
                self._drop(name, peer, f"no answer for {silent:.0f} s")
                del self._peers[name]
            elif peer.held and held_s >= self._probe_after_s and (
                    peer.probes < self._probes or held_s >= DELTA_PROBE_SLOW_S):
                deltas, peer.held = peer.held, []
                peer.probes += 1
                peer.held_since = None
                if self._log is not None:
                    self._log.warning("api_server_not_answering", peer=name, unanswered=peer.sent - peer.acked,
                                      held=len(deltas), silent_s=round(silent, 1))
                out.append((peer.address, self._stamp(peer, name, deltas, probe=True)))
        return out

    def flush(self) -> list[tuple[Any, OutputDeltas]]:
        """Everything held, one message per bridge, window or not: the replica is about to
        exit (a code review: a drained replica exited with text it held for a slow API server,
        already counted in its tasks' ``StageDone``; their streams stopped 3 s mid-text)."""
        out = []
        for name, peer in self._peers.items():
            if peer.held:
                deltas, peer.held, peer.held_since = peer.held, [], None
                out.append((peer.address, self._stamp(peer, name, deltas, probe=False)))
        return out

    def held(self) -> int:
        """Text deltas held, over all bridges."""
        return sum(len(p.held) for p in self._peers.values())

    def _stamp(self, peer: _Peer, name: str, deltas: list[OutputDelta], probe: bool) -> OutputDeltas:
        peer.sent += 1
        n = peer.sent
        if probe or n % self._ack_every == 0 or n - peer.acked >= self._window:
            return OutputDeltas(tuple(deltas), ack=n, ack_to=self._me, peer=name)
        return OutputDeltas(tuple(deltas))

    def _drop(self, name: str, peer: _Peer, why: str) -> None:
        if peer.held and self._log is not None:
            self._log.error("api_server_deltas_dropped", peer=name, dropped=len(peer.held), why=why,
                            requests=len({d.request_id for d in peer.held}))
        peer.held = []
