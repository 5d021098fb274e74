"""The engine backend protocol: what an EngineActor drives.

A backend owns one engine (synthetic, vLLM ``AsyncLLM``, or one vLLM-Omni
stage). It lives on the EngineActor's own asyncio loop, on its own thread, so
every method here is called from that loop only.

Data shapes: a stage's output is an :data:`Outputs` mapping of field name to a
numpy array or a small scalar/str. Those are the fields that connectors carry
between stages (see ``omni_actors.connectors``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping, Protocol, Union

import numpy as np

#: A stage's output fields: arrays (hidden states, codes, PCM, images) or small
#: scalars / strings (text, sample rate).
Outputs = Mapping[str, Union[np.ndarray, str, int, float]]


@dataclass
class BackendTask:
    """One stage task as the backend sees it.

    Attributes:
        request_id: the request this task belongs to.
        engine_input: what the stage processor built from the prompt and the
            upstream stages' outputs (for the first stage: ``{"prompt": str}``).
        sampling_params: the stage's ``default_sampling_params`` overlaid with
            the request's (``max_tokens``, ``temperature``, ``seed``...).
        params: request-level parameters (image ``width``/``height``...).
        input_stream: streaming between stages: the processed input arrives
            in chunks from this async iterator (``engine_input`` is then
            empty); it ends when the upstream stage is done, and raises
            :class:`UpstreamTimeout` when a chunk is late.
        emit_chunks: send outputs as :class:`OutputChunk` events as they are
            made (a backend that cannot simply never does).
        chunk_tokens: Thinker tokens per output chunk.
        max_tokens_asked: the client's own ``max_tokens`` (None: not given,
            or not this stage's to take). A prompt that leaves fewer tokens
            of the model's context than that fails (see
            :func:`context_exceeded`), as in OpenAI's and vLLM's servers; the
            stage's default ``max_tokens`` is cut at the context instead.
    """

    request_id: str
    engine_input: dict[str, Any]
    sampling_params: dict[str, Any] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    input_stream: AsyncIterator[dict[str, Any]] | None = None
    emit_chunks: bool = False
    chunk_tokens: int = 8
    max_tokens_asked: int | None = None


def missing_model_dir(model: str) -> bool:
    """Whether ``model`` is a local path (``/``, ``.``, ``~``) with no directory there on this
    host (a model id, ``Qwen/...``, is the engine's to fetch: never missing here)."""
    from pathlib import Path

    if not str(model).startswith(("/", ".", "~")):
        return False
    try:
        return not Path(str(model)).expanduser().is_dir()
    except RuntimeError:  # (`~alice/...` with no user alice here: a traceback in check-config; a review)
        return True


#: A replica's process name (``multiprocessing``'s, which vLLM's log lines give: ``(replica pid=...)``).
REPLICA_PROCESS_NAME = "replica"


def replica_log_prefix(replica: str, environ: Mapping[str, str] | None = None) -> str:
    """The ``VLLM_LOGGING_PREFIX`` of a replica's process: ``"[thinker/0] "`` after any
    prefix the operator set (``$VLLM_LOGGING_PREFIX``, inherited from the leader or member).

    vLLM puts it before each of its log lines, in the replica's process and its engine
    core's (a child), so that the lines of several replicas on one stdout say whose they
    are. It takes effect only if vLLM is first imported after it is set.
    """
    env = os.environ if environ is None else environ
    return f"{env.get('VLLM_LOGGING_PREFIX', '')}[{replica}] "


def context_exceeded(max_model_len: int, prompt_tokens: int, max_tokens: int | None,
                     room_for_one: bool = False) -> str | None:
    """Why a request with a prompt of ``prompt_tokens`` tokens that asked for ``max_tokens``
    (:attr:`BackendTask.max_tokens_asked`) does not fit the model's context of
    ``max_model_len`` tokens, or None when it does. (The HTTP API answers it with a 400, code
    ``context_length_exceeded``; vLLM's engine alone would stop at the context, with
    ``finish_reason`` "length": a trial read 50 tokens where it asked for 100.) Without
    ``max_tokens`` and with ``room_for_one`` (an engine that would make nothing of such a
    prompt: the synthetic Thinker), a prompt that leaves no room for one token does not fit
    (as vLLM answers it; trial CL's prompt of exactly the context got a 200 with an empty
    text and an empty audio)."""
    if max_tokens is None:
        if not room_for_one or prompt_tokens != max_model_len:
            return None  # (a longer one: the engine's own refusal says so)
        return (f"the prompt has {prompt_tokens} tokens: no room is left for a completion in this model's "
                f"maximum context length of {max_model_len} tokens; shorten the messages")
    if prompt_tokens + max_tokens <= max_model_len:
        return None
    return (f"this model's maximum context length is {max_model_len} tokens, and the request asks for "
            f"{prompt_tokens + max_tokens}: {prompt_tokens} in the prompt and {max_tokens} in the completion "
            f"(max_tokens); shorten the messages or lower max_tokens")


class UpstreamTimeout(TimeoutError):
    """No chunk came from the upstream stage within ``chunk_timeout_s``."""


class StageInputError(RuntimeError):
    """A stage's input processor failed on its upstream stages' outputs: the pipeline's
    fault (its processor, or what the stage before produced), not the client's input,
    nor its replica's (a 500 naming the processor, not retried, not counted against the
    replica)."""


class InputLost(RuntimeError):
    """An upstream stage's output (or chunk) could not be fetched: the data service of
    the host it lives on is unreachable. ``node``: that host's name, else the service's
    ``host:port``."""

    def __init__(self, node: str, message: str) -> None:
        super().__init__(message)
        self.node = node


@dataclass
class TextDelta:
    """New text produced by a text stage (one or more tokens)."""

    text: str
    token_ids: tuple[int, ...] = ()


@dataclass
class OutputChunk:
    """Part of a stage's outputs, made so far and not sent before (same fields
    as the stage's final outputs, covering the next slice: tokens, frames,
    samples). The :class:`StageFinal` that follows still holds everything."""

    outputs: dict[str, Any]


@dataclass
class StageFinal:
    """The last event of a task: the stage's full outputs."""

    outputs: dict[str, Any]
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    #: why generation stopped: "stop" (end of sequence / stop string) or "length"
    #: (``max_tokens`` reached); None when the backend does not say (then the
    #: EngineActor infers it from the token count).
    finish_reason: str | None = None


BackendEvent = Union[TextDelta, OutputChunk, StageFinal]


@dataclass
class BackendLoad:
    """Load snapshot for heartbeats. ``kv_cache_usage`` is 0..1 where known."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float | None = None


class EngineBackend(Protocol):
    """What an EngineActor needs from an engine.

    Errors: ``start`` raises on any load failure (the message reaches
    ``status``); ``generate`` raises on a task failure (the task fails, the
    replica stays up); ``abort`` never raises.

    A backend may also have ``active_at`` (``time.monotonic()`` of its last
    work that yields no event: a prefill step): the stall watchdog counts it
    as progress, so a long prompt is not taken for a hang.
    """

    async def start(self) -> None: ...

    def generate(self, task: BackendTask) -> AsyncIterator[BackendEvent]: ...

    async def abort(self, request_id: str) -> None: ...

    def load(self) -> BackendLoad: ...

    async def shutdown(self) -> None: ...
