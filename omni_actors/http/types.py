"""What the HTTP layer and the actor bridge exchange (no actor types here)."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Protocol, TypeVar, Union

T = TypeVar("T")


async def within(aw: Awaitable[T], timeout_s: float | None) -> T:
    """``await aw`` for at most ``timeout_s`` seconds, like ``asyncio.wait_for``.

    Raises:
        asyncio.TimeoutError: it took longer. asyncio.CancelledError: the caller
            was cancelled, always: Python 3.11's ``wait_for`` drops a cancel that
            comes as ``aw`` finishes (a client that hung up just then was served
            in full and counted a 200); ``asyncio.timeout`` (3.11+) does not.
    """
    if sys.version_info < (3, 11):
        return await asyncio.wait_for(aw, timeout_s)
    async with asyncio.timeout(timeout_s):
        return await aw


@dataclass
class PipelineRequest:
    """One pipeline request, already validated by the HTTP layer.

    Attributes:
        request_id: unique id (``chatcmpl-...`` / ``img-...``).
        prompt: the rendered prompt text.
        output_types: final outputs wanted, e.g. ``{"text"}``, ``{"text", "audio"}``, ``{"image"}``.
        sampling_params: per-request overrides (``max_tokens``, ``temperature``, ``seed``).
        params: request parameters for stages (``width``, ``height`` for images).
        timeout_s: deadline for the whole request, seconds.
        stream: the client reads a stream (SSE): final audio may arrive in
            parts (:class:`OutputPart`) when the pipeline streams between stages.
        fresh_actor: run it on a new RequestActor, not an idle one (where one more may be
            made): a rerun of a request that its first RequestActor never took (stopped or
            hung), as the idle ones may be too.
    """

    request_id: str
    prompt: str
    output_types: frozenset[str]
    sampling_params: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    timeout_s: float | None = None
    stream: bool = False
    fresh_actor: bool = False


@dataclass
class OutputText:
    """A text delta of a final text stage."""

    text: str


@dataclass
class OutputFinal:
    """A final stage's whole output, already fetched from its connector.

    ``data`` for ``text``: ``{"text": str}``; ``audio``: ``{"audio": int16
    ndarray [samples], "sample_rate": int}``; ``image``: ``{"image": uint8
    ndarray [H, W, 3]}``.
    """

    stage_id: int
    output_type: str
    data: dict[str, Any]


@dataclass
class OutputPart:
    """A part of a final output, in order, as the last stage makes it
    (streamed audio: ``{"audio": int16 ndarray [samples], "sample_rate": int}``).
    When parts came, no :class:`OutputFinal` follows for that output."""

    stage_id: int
    output_type: str
    data: dict[str, Any]


@dataclass
class RequestDone:
    """The request finished; token counts for ``usage``."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None  #: "stop" or "length" when the pipeline says


@dataclass
class RequestFailed:
    """The request failed. ``status`` is the HTTP status to answer with
    (503 no ready replica, 504 deadline, 500 engine error)."""

    status: int
    message: str
    type: str = "server_error"  #: OpenAI's error type: ``server_error`` for every 5xx
    #: the pipeline ran, but an output it made was lost with its host (the node's data
    #: service unreachable) before it was read: nothing in the request caused it, and it
    #: may run again as long as nothing of it reached the client
    lost_output: bool = False
    #: with ``lost_output``: the node (or data service address) the output was lost on
    lost_on: str | None = None
    #: a stage failed mid-stream and was not retried because its text had gone to the API
    #: server: the request may run again as long as none of it reached the client (a trial's
    #: stream got this 503 before any event: its text never arrived, the replica died with it)
    output_sent: bool = False
    #: its RequestActor never took it (stopped or hung: the hand-over timed out), so nothing of
    #: it ran: it may run again on another RequestActor (trial BM: a 500 for a request that
    #: had not begun)
    not_started: bool = False
    #: this server lost it (its RequestActor exited, hung, or could not be made or told):
    #: nothing in the request caused it, so the client may try it again (no
    #: ``x-should-retry: false``, which a pipeline's 500 gets)
    lost_by_server: bool = False
    #: a 503 for a stage with no replica ready and none on its way (stopped, scaled to 0,
    #: failed): a client's own retries a second later would get it again (trial CL's
    #: ``openai`` client tried twice more), so it gets ``x-should-retry: false``
    none_coming: bool = False
    #: the error's ``code``: ``service_unavailable`` (503), ``timeout`` (504),
    #: :data:`CONTEXT_LENGTH_CODE` (400), or None
    code: str | None = None


#: OpenAI's error ``code`` for a prompt over the model's context length.
CONTEXT_LENGTH_CODE = "context_length_exceeded"


BridgeEvent = Union[OutputText, OutputPart, OutputFinal, RequestDone, RequestFailed]


class Bridge(Protocol):
    """The HTTP layer's whole view of the actor system.

    ``submit`` returns an async iterator of events that ends after one
    ``RequestDone`` or ``RequestFailed``. ``cancel`` is idempotent and safe
    for finished requests. Neither blocks the event loop.
    """

    model_name: str
    output_types: frozenset[str]
    max_tokens_limit: int
    request_timeout_s: float
    #: the model's ``created`` in ``/v1/models`` (Unix seconds; 0: the app's start)
    created: int = 0

    def submit(self, request: PipelineRequest) -> AsyncIterator[BridgeEvent]: ...

    async def cancel(self, request_id: str) -> None: ...

    async def stages(self) -> dict[str, Any]: ...

    async def wait_node_down(self, node: str, timeout_s: float) -> bool:
        """Wait until the coordinator reports ``node`` (a node name or data service
        address) down, or its data service silent (new tasks then go elsewhere), at most
        ``timeout_s``; whether it did (False: still up, or unknown)."""
        ...
