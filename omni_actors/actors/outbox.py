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
for one bridge into one message, whatever request it belongs to.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from omni_actors.messages import OutputDelta, OutputDeltas, StageChunk, StageDone, TaskFinished


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
    full, ``TypeError`` for an unpackable dtype).
    """

    def __init__(self, put: Callable[[dict[str, Any]], Any]) -> None:
        self._put = put
        #: (request, stage) -> [attempt, deltas sent, chunks sent]
        self._sent: dict[tuple[str, int], list[int]] = {}

    def _counts(self, request_id: str, stage_id: int, attempt: int) -> list[int]:
        counts = self._sent.get((request_id, stage_id))
        if counts is None or counts[0] != attempt:
            counts = self._sent[(request_id, stage_id)] = [attempt, 0, 0]
        return counts

    def stamp(self, message: Any) -> Any:
        if isinstance(message, OutputDelta):
            counts = self._counts(message.request_id, message.stage_id, message.attempt)
            counts[1] += 1
            return OutputDelta(message.request_id, message.text, counts[1] - 1, message.stage_id, message.attempt)
        if isinstance(message, PendingChunk):
            ref = self._put(merge_outputs(message.outputs))
            counts = self._counts(message.request_id, message.stage_id, message.attempt)
            counts[2] += 1
            return StageChunk(message.request_id, message.stage_id, counts[2] - 1, ref, message.attempt,
                              last=message.last)
        if isinstance(message, StageDone):
            counts = self._counts(message.request_id, message.stage_id, message.attempt)
            return dataclasses.replace(message, deltas=counts[1], chunks=counts[2])
        if isinstance(message, TaskFinished):  # the task's last message
            self._sent.pop((message.request_id, message.stage_id), None)
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
