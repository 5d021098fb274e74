"""The synthetic engine: a deterministic CPU emulator of one omni-model stage.

It is the built-in default backend: it needs no GPU and no weights, produces
outputs of the right kind, shape and dtype for each stage, and spends time
according to a :class:`~omni_actors.config.SyntheticCost` cost model
(simulated with ``asyncio.sleep``). Stage behaviour is chosen by
``engine_args.model_stage``:

- thinker: ``{prompt: str}`` -> ``text: str``, ``token_ids: int32[n]``,
  ``hidden_states: float32[P + n, hidden_size]`` (streams one TextDelta per token);
- talker: ``{token_ids: int[T], hidden_states: float[T2, H]}`` ->
  ``codes: int32[T * frames_per_token, num_codebooks]`` in [0, codebook_size);
- code2wav: ``{codes: int[F, C]}`` -> ``audio: int16[F * samples_per_frame]``
  (24 kHz mono PCM), ``sample_rate: 24000``;
- ar: ``{prompt: str}`` -> ``prior_token_ids: int32[prior_grid ** 2]`` in [0, 16384);
- dit: ``{prior_token_ids: int[N], prompt: str}`` -> ``image: uint8[height, width, 3]``.

``n`` is ``sampling_params["max_tokens"]`` (default 32), or fewer where a
``sampling_params["stop"]`` string ends the text (cut where it begins, the
tokens up to the one that completed it, as vLLM's), ``P`` the number of
whitespace-separated prompt words; ``width``/``height`` come from
``task.params`` (default 256). Only the thinker streams :class:`TextDelta` s
(one per token). Outputs depend only on the input and
``sampling_params["seed"]`` (default 0), through sha256 and numpy's PCG64
(never ``hash()``), so they are byte-identical across processes (code2wav
audio uses float32 ``sin``, whose last bit may differ between CPU types).

Streaming between stages: with ``task.emit_chunks`` thinker yields an
:class:`OutputChunk` every ``task.chunk_tokens`` tokens (``token_ids``,
``text`` and the matching ``hidden_states`` rows, the prompt rows in the
first), talker one per input chunk (or per ``chunk_tokens`` tokens of a
whole input) and code2wav one per input chunk of frames. With
``task.input_stream`` talker and code2wav start on the first input chunk.
Talker codes and code2wav audio are computed token by token and frame by
frame (phase carried exactly in integers), so the outputs are the same
however the input was chunked.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import math
import numbers
import os
import sys
import time
import zlib
from dataclasses import dataclass
from typing import Any, AsyncIterator

import numpy as np

from omni_actors.config import SEED_MIN, StageSpec, SyntheticCost
from omni_actors.logs import get_logger
from omni_actors.engines.base import (BackendEvent, BackendLoad, BackendTask, OutputChunk, StageFinal,
                                      StageInputError, TextDelta, context_exceeded)

__all__ = ["SyntheticEngine", "SUPPORTED_STAGES", "SAMPLE_RATE", "token_id", "CHUNK_INPUT_STAGES",
           "CHUNK_OUTPUT_STAGES"]

SUPPORTED_STAGES = ("thinker", "talker", "code2wav", "ar", "dit")
#: Stages that can send their outputs in chunks, and start on chunks of their input.
CHUNK_OUTPUT_STAGES = ("thinker", "talker", "code2wav")
CHUNK_INPUT_STAGES = ("talker", "code2wav")
#: Sample rate of code2wav audio (Hz, mono int16 PCM).
SAMPLE_RATE = 24000
#: Token id space of the thinker (ids are ``crc32(word) % VOCAB_SIZE``).
VOCAB_SIZE = 32000
#: Value range of AR prior tokens: [0, PRIOR_VOCAB).
PRIOR_VOCAB = 16384
#: Denoising steps the DiT stage spends ``decode_ms_per_token`` on, each.
DIT_STEPS = 20
_MAX_IMAGE_SIDE = 4096
_MIN_SLEEP_S = 0.001  # shorter waits are folded into the next one
_MAX_SLEEP_S = 0.05  # longest sleep between abort checks

_VOCAB = tuple("""
the a and of to in is it that was for on are with as his they be at one have this from or had by
word but what some we can out other were all there when up use your how said an each she which
do their time if will way about many then them write would like so these her long make thing see
him two has look more day could go come did number sound no most people my over know water than
call first who may down side been now find any new work part take get place made live where
after back little only round man year came show every good me give our under name very through
just form sentence great think say help low line differ turn cause much mean before move right
boy old too same tell does set three want air well also play small end put home read hand port
large spell add even land here must big high such follow act why ask men change went light kind
off need house picture try us again animal point mother world near build self earth father head
stand own page
""".split())  # 200 words


def token_id(word: str) -> int:
    """The synthetic tokenizer: ``zlib.crc32(utf-8 word) % 32000``."""
    return zlib.crc32(word.encode("utf-8")) % VOCAB_SIZE


_VOCAB_IDS = np.array([token_id(w) for w in _VOCAB], dtype=np.int32)


def _rng(tag: str, *parts: bytes | str | int) -> np.random.Generator:
    """A PCG64 generator seeded from sha256 of the parts (never ``hash()``)."""
    h = hashlib.sha256(tag.encode())
    for p in parts:
        b = p if isinstance(p, bytes) else str(p).encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return np.random.default_rng(int.from_bytes(h.digest()[:8], "little"))


@dataclass
class _Plan:
    """What a task will produce and how much simulated work it costs."""

    prefill_units: int
    decode_units: int
    final: StageFinal | None
    deltas: list[TextDelta] | None = None  # one per decode unit (thinker only)
    chunks: dict[int, OutputChunk] | None = None  # sent after decode unit k (streaming)


class SyntheticEngine:
    """A deterministic stage emulator implementing ``EngineBackend``.

    Args:
        stage: the stage spec; ``stage.name`` picks the behaviour.
        cost: the cost model (sleep times, concurrency, output sizes).
        replica: the replica name, for messages only.

    Cost model: ``start`` sleeps ``startup_s``; each task sleeps
    ``prefill_ms_per_token`` per input unit (thinker/ar: prompt words; talker:
    tokens; code2wav: frames; dit: prior tokens), then ``decode_ms_per_token``
    per output unit (thinker/ar: tokens; talker/code2wav: frames; dit: 20
    steps), paced against deadlines from the moment the task got its slot, so
    the total stays accurate (time spent computing the outputs counts). At most
    ``max_concurrency`` tasks run at once; the rest wait in FIFO order.
    """

    def __init__(self, stage: StageSpec, cost: SyntheticCost, replica: str):
        self.stage = stage
        self.cost = cost
        self.replica = replica
        #: Fault injection (``inject slow``): every cost is this many times higher.
        self.slowdown = 1.0
        # `synthetic.kind` lets two stages of one graph (e.g. two talkers) share a behaviour.
        self.stage_name = cost.kind or str(stage.engine_args.get("model_stage", ""))
        self._started = False
        self._running = 0
        self._waiters: collections.deque[tuple[str, asyncio.Future[bool]]] = collections.deque()
        self._inflight: dict[str, int] = {}
        self._aborted: set[str] = set()
        self.active_at = 0.0  #: monotonic time of the last prefill slice (see EngineBackend)

    # -- lifecycle -------------------------------------------------------
    async def start(self) -> None:
        """Load the "model".

        Raises:
            ValueError: the stage name is not one of :data:`SUPPORTED_STAGES`
                (raised at once, before the start-up sleep).
            RuntimeError: ``cost.fail_startup`` is set (after the sleep).
        """
        if self.stage_name not in SUPPORTED_STAGES:
            raise ValueError(
                f"synthetic engine {self.replica}: unknown stage `{self.stage_name}`; "
                f"supported: {', '.join(SUPPORTED_STAGES)}")
        if self.cost.startup_s > 0 and self.cost.startup_blocks:
            time.sleep(self.cost.startup_s)  # (as a vLLM engine's start holds its loop)
        elif self.cost.startup_s > 0:
            await asyncio.sleep(self.cost.startup_s)
        if self.cost.fail_startup:
            raise RuntimeError(self.cost.fail_startup)
        self._started = True

    async def shutdown(self) -> None:
        """Abort every running and waiting task; the engine must be started again."""
        for rid in list(self._inflight):
            await self.abort(rid)
        self._started = False

    def load(self) -> BackendLoad:
        """Tasks holding a concurrency slot (running) and queued for one (waiting)."""
        return BackendLoad(running=self._running, waiting=len(self._waiters))

    async def abort(self, request_id: str) -> None:
        """Stop the running and waiting tasks of ``request_id``: their ``generate``
        iterators end without a :class:`StageFinal`. Unknown ids are ignored;
        never raises."""
        if request_id not in self._inflight:
            return
        self._aborted.add(request_id)
        for rid, fut in self._waiters:
            if rid == request_id and not fut.done():
                fut.set_result(False)
        self._waiters = collections.deque(e for e in self._waiters if e[0] != request_id)

    # -- tasks -----------------------------------------------------------
    async def generate(self, task: BackendTask) -> AsyncIterator[BackendEvent]:
        """Run one task: thinker yields a :class:`TextDelta` per token, every stage
        ends with one :class:`StageFinal` (none when aborted).

        Raises:
            RuntimeError: the engine is not started.
            ValueError: ``engine_input``, ``sampling_params`` or ``params`` are
                missing a field or have the wrong type/shape.
        """
        if not self._started:
            raise RuntimeError(f"synthetic engine {self.replica} is not started")
        poison = self.cost.crash_on
        if poison and poison in str(task.engine_input.get("prompt", "")):
            # (fault injection: the process ends here, as an engine that segfaults on an input)
            get_logger(replica=self.replica).error("synthetic_crash_on_prompt", request_id=task.request_id)
            sys.stderr.flush()
            os._exit(70)
        parse, compute = _STAGE_FNS[self.stage_name]
        streamed = task.input_stream is not None
        if streamed and self.stage_name not in CHUNK_INPUT_STAGES:
            raise ValueError(f"{self.stage_name}: cannot take its input in chunks")
        args = None if streamed else parse(task)  # validate before queueing
        if self.stage_name == "thinker" and args is not None:  # (its prompt's tokens are its words)
            too_long = context_exceeded(self.cost.max_model_len, len(args[0].split()), task.max_tokens_asked,
                                        room_for_one=True)
            if too_long:
                raise ValueError(too_long)
        rid = task.request_id
        self._inflight[rid] = self._inflight.get(rid, 0) + 1
        try:
            if not await self._acquire(rid):
                return
            try:
                if streamed:
                    async for ev in self._run_streamed(task, parse):
                        yield ev
                else:
                    t0 = asyncio.get_running_loop().time()  # compute time counts as cost
                    plan = compute(self.cost, *args)
                    if task.emit_chunks:
                        _add_chunks(plan, self.stage_name, self.cost, task.chunk_tokens)
                    async for ev in self._run(rid, plan, t0):
                        yield ev
            finally:
                self._release()
        finally:
            left = self._inflight[rid] - 1
            if left:
                self._inflight[rid] = left
            else:
                del self._inflight[rid]
                self._aborted.discard(rid)

    async def _run_streamed(self, task: BackendTask, parse) -> AsyncIterator[BackendEvent]:
        """Talker / code2wav on an input that arrives in chunks: each chunk is
        paid for and answered (one :class:`OutputChunk`) as it comes."""
        loop, rid = asyncio.get_running_loop(), task.request_id
        state = _STREAM_STATES[self.stage_name](self.cost, task)
        async for engine_input in task.input_stream:
            piece = BackendTask(rid, engine_input, task.sampling_params, task.params)
            t0 = loop.time()
            prefill, decode, outputs = state.feed(*parse(piece)[:state.nargs])
            plan = _Plan(prefill, decode, None,
                         chunks={decode - 1: OutputChunk(outputs)} if task.emit_chunks and decode else None)
            async for ev in self._run(rid, plan, t0):
                yield ev
            if rid in self._aborted:
                return
        await asyncio.sleep(0)
        if rid not in self._aborted:
            yield state.final()

    async def _run(self, rid: str, plan: _Plan, t0: float) -> AsyncIterator[BackendEvent]:
        cost, aborted, deltas, chunks = self.cost, self._aborted, plan.deltas, plan.chunks or {}
        slow = max(1.0, self.slowdown)
        per = cost.decode_ms_per_token / 1000.0 * slow
        loop = asyncio.get_running_loop()
        hot = cost.prefill_ms_per_token == 0 and per == 0  # zero cost: one yield to the loop
        if hot:
            await asyncio.sleep(0)
        else:
            deadline = t0 + cost.prefill_ms_per_token * plan.prefill_units / 1000.0 * slow
            if not await self._sleep_until(rid, deadline):
                return
        n = plan.decode_units if (deltas or chunks or not hot) else 0
        for k in range(n):
            if per:
                deadline += per
                delay = deadline - loop.time()
                if delay >= _MIN_SLEEP_S or (k == n - 1 and delay > 0):
                    if not await self._sleep_until(rid, deadline):
                        return
            if rid in aborted:
                return
            if deltas is not None:
                yield deltas[k]
            if k in chunks:
                yield chunks[k]
        if rid in aborted or plan.final is None:
            return
        yield plan.final

    async def _sleep_until(self, rid: str, deadline: float) -> bool:
        """Sleep until ``deadline`` (loop time); False as soon as ``rid`` is aborted."""
        loop = asyncio.get_running_loop()
        while True:
            delay = deadline - loop.time()
            if delay <= 0:
                return rid not in self._aborted
            await asyncio.sleep(min(delay, _MAX_SLEEP_S))
            self.active_at = time.monotonic()  # a long prefill is work, not a hang
            if rid in self._aborted:
                return False

    async def _acquire(self, rid: str) -> bool:
        """Take a concurrency slot (FIFO). False when aborted while waiting."""
        if self._running < self.cost.max_concurrency and not self._waiters:
            self._running += 1
            return True
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        entry = (rid, fut)
        self._waiters.append(entry)
        try:
            return await fut
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.result():
                self._release()  # granted, then cancelled: pass the slot on
            else:
                fut.cancel()
                try:
                    self._waiters.remove(entry)
                except ValueError:
                    pass
            raise

    def _release(self) -> None:
        self._running -= 1
        while self._waiters:
            _, fut = self._waiters.popleft()
            if not fut.done():
                self._running += 1
                fut.set_result(True)
                break


# -- input validation ------------------------------------------------------

# A stage's engine_input is what its input processor made (of the client's prompt, or of the
# upstream stages' outputs), never the client's own fields: one without the fields this stage
# reads, or of the wrong shape, is the pipeline's fault (a processor or a synthetic `kind` that
# does not fit the stage before: trial CE's Talker of kind `dit`), a StageInputError (500), not
# the client's (it was a 400 saying `invalid_request_error`).

def _field(task: BackendTask, key: str, stage: str) -> Any:
    if key not in task.engine_input:
        raise StageInputError(f"{stage}: engine_input has no `{key}` "
                              f"(got fields: {sorted(task.engine_input)})")
    return task.engine_input[key]


def _str_field(task: BackendTask, key: str, stage: str) -> str:
    value = _field(task, key, stage)
    if not isinstance(value, str):
        raise StageInputError(f"{stage}: engine_input `{key}` must be a str, got {type(value).__name__}")
    return value


def _array_field(task: BackendTask, key: str, stage: str, ndim: int, kind: str) -> np.ndarray:
    try:
        value = np.asarray(_field(task, key, stage))
    except ValueError as exc:  # (a ragged list: numpy's "inhomogeneous shape")
        raise StageInputError(f"{stage}: engine_input `{key}` is no array: {exc}") from None
    kinds = {"int": "iu", "float": "f"}[kind]
    if value.ndim != ndim or value.dtype.kind not in kinds:
        raise StageInputError(f"{stage}: engine_input `{key}` must be a {ndim}-D {kind} array, "
                              f"got shape {value.shape} dtype {value.dtype}")
    return value


def _int_param(params: dict, key: str, default: int, lo: int, hi: int | None, stage: str) -> int:
    value = params.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{stage}: `{key}` must be an integer, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        top = hi if hi is not None else "inf"
        raise ValueError(f"{stage}: `{key}` must be in [{lo}, {top}], got {value}")
    return int(value)


def _seed(task: BackendTask, stage: str) -> int:
    return _int_param(task.sampling_params, "seed", 0, SEED_MIN, None, stage)


# -- stages (parse: validate the task; compute: build the plan) --------------

def _parse_thinker(task: BackendTask) -> tuple:
    return (_str_field(task, "prompt", "thinker"),
            _int_param(task.sampling_params, "max_tokens", 32, 0, None, "thinker"),
            _seed(task, "thinker"), _stop_strings(task.sampling_params))


def _stop_strings(params: dict) -> tuple[str, ...]:
    """``sampling_params["stop"]``: None, a string, or a list of non-empty strings."""
    stop = params.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) and x for x in stop):
        raise ValueError("thinker: sampling_params `stop` must be a string or a list of non-empty strings")
    return tuple(stop)


def _cut_at_stop(texts: list[str], stop: tuple[str, ...]) -> tuple[int, list[str]] | None:
    """Where generation ends on a stop string, as vLLM's: at the token that completes the
    first stop string to be completed, the text cut where that string begins. Returns
    ``(tokens generated, their texts cut there)``, or None when no stop string occurs."""
    full = "".join(texts)
    found = [(i + len(x), i) for x in stop if (i := full.find(x)) >= 0]
    if not found:
        return None
    done, cut = min(found)
    kept, pos = [], 0
    for t in texts:
        kept.append(t[:max(0, cut - pos)])
        pos += len(t)
        if pos >= done:
            break
    return len(kept), kept


def _check_context(cost: SyntheticCost, num_prompt: int, n: int) -> None:
    """Raises ValueError (a 400) when the prompt and the ``n`` tokens it must get exceed
    ``max_model_len`` (the message does not name the stage: the replica's error says which)."""
    if num_prompt + n > cost.max_model_len:
        asked = f" and {n} more are needed, {num_prompt + n} in all:" if n else ":"
        raise ValueError(f"the prompt has {num_prompt} tokens{asked} over the model's context length "
                         f"of {cost.max_model_len} tokens (synthetic.max_model_len); shorten the prompt")


def _compute_thinker(cost: SyntheticCost, prompt: str, n: int, seed: int, stop: tuple[str, ...] = ()) -> _Plan:
    num_prompt = len(prompt.split())
    if num_prompt > cost.max_model_len:  # (a longer prompt fails, a shorter one stops there: vLLM's engine)
        _check_context(cost, num_prompt, 0)
    clamped = num_prompt + n > cost.max_model_len
    n = min(n, cost.max_model_len - num_prompt)
    rng = _rng("thinker", prompt, seed)
    idx = rng.integers(0, len(_VOCAB), size=n)
    hidden = rng.standard_normal((num_prompt + n, cost.hidden_size), dtype=np.float32)
    texts = [(w if k == 0 else " " + w) for k, w in enumerate(_VOCAB[i] for i in idx.tolist())]
    stopped = _cut_at_stop(texts, stop) if stop else None
    if stopped is not None:  # (the same tokens as without it, up to the stop)
        n, texts = stopped
        idx, hidden = idx[:n], hidden[:num_prompt + n]
    ids = _VOCAB_IDS[idx]
    deltas = [TextDelta(text=t, token_ids=(int(i),)) for t, i in zip(texts, ids.tolist())]
    final = StageFinal(outputs={"text": "".join(texts), "token_ids": ids, "hidden_states": hidden},
                       num_prompt_tokens=num_prompt, num_output_tokens=n,
                       finish_reason="stop" if stopped is not None else "length" if clamped else None)
    return _Plan(num_prompt, n, final, deltas)


def _parse_talker(task: BackendTask) -> tuple:
    return (_array_field(task, "token_ids", "talker", 1, "int"),
            _array_field(task, "hidden_states", "talker", 2, "float"),
            _seed(task, "talker"))


def _compute_talker(cost: SyntheticCost, token_ids: np.ndarray, hidden: np.ndarray,
                    seed: int) -> _Plan:
    state = _TalkerState(cost, seed)
    units, frames, _ = state.feed(token_ids, hidden)
    return _Plan(units, frames, state.final())


class _TalkerState:
    """Talker codes token by token: frame codes of token ``i`` come from
    sha256(position i, token id, its hidden-state row, seed), so chunking the
    input does not change them. Hidden rows: the last ``T`` rows of each
    input belong to its ``T`` tokens (earlier rows are the prompt's)."""

    nargs = 2

    def __init__(self, cost: SyntheticCost, task_or_seed: Any) -> None:
        self.cost = cost
        self.seed = task_or_seed if isinstance(task_or_seed, int) else _seed(task_or_seed, "talker")
        self.pos = 0
        self.parts: list[np.ndarray] = []

    def feed(self, token_ids: np.ndarray, hidden: np.ndarray) -> tuple[int, int, dict[str, Any]]:
        cost, n = self.cost, len(token_ids)
        rows = hidden[max(0, len(hidden) - n):].astype("<f4")
        codes = np.empty((n * cost.frames_per_token, cost.num_codebooks), dtype=np.int32)
        for j in range(n):
            row = rows[j - (n - len(rows))].tobytes() if j >= n - len(rows) else b""
            rng = _rng("talker", self.pos + j, int(token_ids[j]), row, self.seed)
            codes[j * cost.frames_per_token:(j + 1) * cost.frames_per_token] = rng.integers(
                0, cost.codebook_size, size=(cost.frames_per_token, cost.num_codebooks), dtype=np.int32)
        self.pos += n
        self.parts.append(codes)
        return n, len(codes), {"codes": codes}

    def final(self) -> StageFinal:
        codes = (np.concatenate(self.parts) if self.parts
                 else np.empty((0, self.cost.num_codebooks), dtype=np.int32))
        return StageFinal(outputs={"codes": codes}, num_prompt_tokens=self.pos,
                          num_output_tokens=len(codes))


def _parse_code2wav(task: BackendTask) -> tuple:
    codes = _array_field(task, "codes", "code2wav", 2, "int")
    if codes.shape[1] == 0:
        raise StageInputError("code2wav: engine_input `codes` has no codebooks (shape "
                              f"{codes.shape}); expected [frames, codebooks >= 1]")
    return (codes,)


def _compute_code2wav(cost: SyntheticCost, codes: np.ndarray) -> _Plan:
    state = _Code2WavState(cost)
    units, frames, _ = state.feed(codes)
    return _Plan(units, frames, state.final())


class _Code2WavState:
    """Audio frame by frame: each frame is ``k`` sinusoids at integer
    frequencies 110..1050 Hz picked by its first ``k`` codes, phase-continuous
    across frames. The phase is carried as an exact integer (cycles times the
    sample rate), so audio made chunk by chunk equals audio made at once."""

    nargs = 1

    def __init__(self, cost: SyntheticCost, task: Any = None) -> None:
        self.cost = cost
        self.acc: np.ndarray | None = None  # [k] int64: sum of freq * samples so far, mod SAMPLE_RATE
        self.parts: list[np.ndarray] = []
        self.frames = 0

    def feed(self, codes: np.ndarray) -> tuple[int, int, dict[str, Any]]:
        frames, spf = codes.shape[0], self.cost.samples_per_frame
        k = min(3, codes.shape[1])
        if self.acc is None:
            self.acc = np.zeros(k, dtype=np.int64)
        k = len(self.acc)
        freqs = 110 + (codes[:, :k].T.astype(np.int64) % 48) * 20  # [k, F] integer Hz
        adv = freqs * spf  # each frame advances the phase by freq*spf / SR cycles
        start_int = (self.acc[:, None] + np.cumsum(adv, axis=1) - adv) % SAMPLE_RATE
        if frames:
            self.acc = (self.acc + adv.sum(axis=1)) % SAMPLE_RATE
        step = (freqs * (2.0 * np.pi / SAMPLE_RATE)).astype(np.float32)  # radians per sample
        start = (start_int * (2.0 * np.pi / SAMPLE_RATE)).astype(np.float32)
        t = np.arange(spf, dtype=np.float32)
        wave = np.zeros(frames * spf, dtype=np.float32)
        for j in range(k):
            ph = step[j][:, None] * t[None, :]
            ph += start[j][:, None]
            np.sin(ph, out=ph)
            wave += ph.reshape(-1)
        wave *= np.float32(0.6 * 32767.0 / max(k, 1))
        audio = np.rint(wave).astype(np.int16)
        self.parts.append(audio)
        self.frames += frames
        return frames, frames, {"audio": audio, "sample_rate": SAMPLE_RATE}

    def final(self) -> StageFinal:
        audio = np.concatenate(self.parts) if self.parts else np.empty(0, dtype=np.int16)
        return StageFinal(outputs={"audio": audio, "sample_rate": SAMPLE_RATE},
                          num_prompt_tokens=self.frames, num_output_tokens=0)


def _parse_ar(task: BackendTask) -> tuple:
    return (_str_field(task, "prompt", "ar"), _seed(task, "ar"))


def _compute_ar(cost: SyntheticCost, prompt: str, seed: int) -> _Plan:
    n = cost.prior_grid ** 2
    num_prompt = len(prompt.split())
    _check_context(cost, num_prompt, n)
    prior = _rng("ar", prompt, seed).integers(0, PRIOR_VOCAB, size=n, dtype=np.int32)
    final = StageFinal(outputs={"prior_token_ids": prior}, num_prompt_tokens=num_prompt,
                       num_output_tokens=n)
    return _Plan(num_prompt, n, final)


def _parse_dit(task: BackendTask) -> tuple:
    prior = _array_field(task, "prior_token_ids", "dit", 1, "int")
    if prior.size == 0:
        raise StageInputError("dit: engine_input `prior_token_ids` is empty")
    return (prior, _str_field(task, "prompt", "dit"),
            _int_param(task.params, "width", 256, 1, _MAX_IMAGE_SIDE, "dit"),
            _int_param(task.params, "height", 256, 1, _MAX_IMAGE_SIDE, "dit"))


def _axis(out: int, grid: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bilinear sample positions of ``out`` pixel centres over ``grid`` cells."""
    pos = np.clip((np.arange(out) + 0.5) * grid / out - 0.5, 0, grid - 1)
    lo = np.floor(pos).astype(np.intp)
    hi = np.minimum(lo + 1, grid - 1)
    return lo, hi, (pos - lo).astype(np.float32)


def _compute_dit(cost: SyntheticCost, prior: np.ndarray, prompt: str, width: int,
                 height: int) -> _Plan:
    n = prior.size
    g = math.isqrt(n)
    g += g * g < n
    tokens = np.resize(prior.astype(np.uint64), g * g)
    tint = int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:4], "little")
    h = ((tokens * np.uint64(2654435761)) ^ np.uint64(tint)) & np.uint64(0xFFFFFF)
    rgb = np.stack([(h >> np.uint64(s)) & np.uint64(255) for s in (0, 8, 16)], axis=-1)
    cells = rgb.astype(np.float32).reshape(g, g, 3)
    y0, y1, wy = _axis(height, g)
    x0, x1, wx = _axis(width, g)
    wy, wx = wy[:, None, None], wx[None, :, None]
    top = cells[y0][:, x0] * (1 - wx) + cells[y0][:, x1] * wx
    bottom = cells[y1][:, x0] * (1 - wx) + cells[y1][:, x1] * wx
    image = np.clip(np.rint(top * (1 - wy) + bottom * wy), 0, 255).astype(np.uint8)
    final = StageFinal(outputs={"image": image}, num_prompt_tokens=n, num_output_tokens=0)
    return _Plan(n, DIT_STEPS, final)


_STAGE_FNS = {name: (globals()[f"_parse_{name}"], globals()[f"_compute_{name}"])
              for name in SUPPORTED_STAGES}
_STREAM_STATES = {"talker": _TalkerState, "code2wav": _Code2WavState}


def _add_chunks(plan: _Plan, stage: str, cost: SyntheticCost, chunk_tokens: int) -> None:
    """Split a whole-input plan's outputs into :class:`OutputChunk` s sent along
    the way: thinker every ``chunk_tokens`` tokens, talker every
    ``chunk_tokens`` tokens' frames, code2wav every ``chunk_tokens *
    frames_per_token`` frames. ar and dit send none."""
    out, n = plan.final.outputs, plan.decode_units
    if stage not in CHUNK_OUTPUT_STAGES or n == 0:
        return
    step = chunk_tokens if stage == "thinker" else chunk_tokens * cost.frames_per_token
    chunks: dict[int, OutputChunk] = {}
    for a in range(0, n, step):
        b = min(n, a + step)
        if stage == "thinker":
            prompt_rows = len(out["hidden_states"]) - n
            rows = out["hidden_states"][(0 if a == 0 else prompt_rows + a):prompt_rows + b]
            text = "".join(d.text for d in plan.deltas[a:b])
            part = {"text": text, "token_ids": out["token_ids"][a:b], "hidden_states": rows}
        elif stage == "talker":
            part = {"codes": out["codes"][a:b]}
        else:
            spf = cost.samples_per_frame
            part = {"audio": out["audio"][a * spf:b * spf], "sample_rate": out["sample_rate"]}
        chunks[b - 1] = OutputChunk(part)
    plan.chunks = chunks
