"""Stage input processors: build a stage's ``engine_input`` from upstream outputs.

A stage names one in its config as ``custom_process_input_func`` (a dotted
path, as in vLLM-Omni, e.g. ``omni_actors.processors.thinker2talker``); a
stage without one uses :func:`default_input`.

Every processor has the signature ``fn(upstream, prompt, params) -> dict``:

- ``upstream``: ``{source stage_id: that stage's outputs dict}``, in the order
  of the consuming stage's ``engine_input_source``;
- ``prompt``: the request's prompt text;
- ``params``: request-level parameters (``width``, ``height``...).

Arrays are passed through without copying when they already have the
expected dtype. Errors are :class:`ValueError` naming the processor, the
source stage and the missing or malformed field (a 500 naming the processor:
the pipeline's fault); a processor that refuses what the client asked for
raises :class:`InvalidRequest` (a 400 with its message).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["thinker2talker", "talker2code2wav", "ar2dit", "default_input",
           "thinker_tokens_to_talker", "talker_tokens_to_code2wav", "InvalidRequest"]

Upstream = dict[int, dict[str, Any]]


def read_only_hint(exc: BaseException) -> str:
    """A hint to add to a processor's error that wrote into an upstream array (they are
    read-only): ``""`` for any other error."""
    return " (upstream arrays are read-only: copy one first, np.array(a))" if "read-only" in str(exc) else ""


class InvalidRequest(ValueError):
    """Raised by a processor to refuse the request for what the client asked (an image size
    its model does not take, say): the client gets a 400 (``invalid_request_error``) with
    its message, and the request is not retried. Any other exception of a processor on
    upstream outputs is the pipeline's fault: a 500 naming the processor. The dry run at
    load takes it for its own request's refusal (no verdict on the config)."""


def _single(upstream: Upstream, fn: str) -> tuple[int, dict[str, Any]]:
    _check_upstream(upstream, fn)
    if len(upstream) != 1:
        raise ValueError(f"{fn}: expects exactly one upstream stage, got {len(upstream)} "
                         f"(stage ids {list(upstream)})")
    return next(iter(upstream.items()))


def _check_upstream(upstream: Upstream, fn: str) -> None:
    if not isinstance(upstream, dict):
        raise ValueError(f"{fn}: upstream must be a dict of stage_id -> outputs, "
                         f"got {type(upstream).__name__}")
    for sid, out in upstream.items():
        if not isinstance(out, dict):
            raise ValueError(f"{fn}: outputs of stage {sid} must be a dict, "
                             f"got {type(out).__name__}")


def _array(out: dict[str, Any], key: str, sid: int, fn: str, ndim: int, dtype: type) -> np.ndarray:
    if key not in out:
        raise ValueError(f"{fn}: stage {sid} outputs have no `{key}` (got fields: {sorted(out)})")
    arr = np.asarray(out[key])
    kinds = "iu" if np.issubdtype(dtype, np.integer) else "f"
    if arr.ndim != ndim or arr.dtype.kind not in kinds:
        raise ValueError(f"{fn}: stage {sid} `{key}` must be a {ndim}-D "
                         f"{np.dtype(dtype).name}-compatible array, got shape {arr.shape} "
                         f"dtype {arr.dtype}")
    return arr.astype(dtype, copy=False)


def thinker2talker(upstream: Upstream, prompt: str, params: dict[str, Any]) -> dict[str, Any]:
    """Thinker outputs -> talker input.

    Args:
        upstream: exactly one source (the thinker) with ``token_ids``
            (int[T]) and ``hidden_states`` (float[T2, H]).

    Returns:
        ``{"token_ids": int32[T], "hidden_states": float32[T2, H]}``.

    Raises:
        ValueError: not exactly one source, or a field is missing or has the
            wrong rank/dtype kind.
    """
    sid, out = _single(upstream, "thinker2talker")
    return {
        "token_ids": _array(out, "token_ids", sid, "thinker2talker", 1, np.int32),
        "hidden_states": _array(out, "hidden_states", sid, "thinker2talker", 2, np.float32),
    }


def talker2code2wav(upstream: Upstream, prompt: str, params: dict[str, Any]) -> dict[str, Any]:
    """Talker outputs -> code2wav input. Fan-in: with several talker sources,
    their ``codes`` are concatenated along frames, in source order.

    Args:
        upstream: one or more sources, each with ``codes`` (int[F_i, C]); all
            must have the same number of codebooks C.

    Returns:
        ``{"codes": int32[sum(F_i), C]}``.

    Raises:
        ValueError: no source, a source without ``codes``, a ``codes`` that is
            not a 2-D integer array, or sources with different codebook counts.
    """
    fn = "talker2code2wav"
    _check_upstream(upstream, fn)
    if not upstream:
        raise ValueError(f"{fn}: needs at least one upstream stage with `codes`")
    parts = [(sid, _array(out, "codes", sid, fn, 2, np.int32)) for sid, out in upstream.items()]
    if len(parts) == 1:
        return {"codes": parts[0][1]}
    widths = {sid: a.shape[1] for sid, a in parts}
    if len(set(widths.values())) != 1:
        raise ValueError(f"{fn}: upstream `codes` have different codebook counts: {widths}")
    return {"codes": np.concatenate([a for _, a in parts], axis=0)}


def ar2dit(upstream: Upstream, prompt: str, params: dict[str, Any]) -> dict[str, Any]:
    """AR outputs -> DiT input.

    Args:
        upstream: exactly one source (the AR stage) with ``prior_token_ids``
            (int[N]).
        prompt: the request prompt, passed on for conditioning.

    Returns:
        ``{"prior_token_ids": int32[N], "prompt": str}``.

    Raises:
        ValueError: not exactly one source, or ``prior_token_ids`` is missing
            or not a 1-D integer array.
    """
    sid, out = _single(upstream, "ar2dit")
    return {"prior_token_ids": _array(out, "prior_token_ids", sid, "ar2dit", 1, np.int32),
            "prompt": prompt}


def default_input(upstream: Upstream, prompt: str, params: dict[str, Any]) -> dict[str, Any]:
    """The input of a stage without ``custom_process_input_func``.

    Returns:
        With no upstream: ``{"prompt": prompt}``. Otherwise every upstream
        outputs dict merged in source order (a later source wins on a shared
        field), plus ``"prompt"`` set to the request prompt (it overrides an
        upstream ``prompt`` field).

    Raises:
        ValueError: ``upstream`` is not a dict of dicts.
    """
    _check_upstream(upstream, "default_input")
    merged: dict[str, Any] = {}
    for out in upstream.values():
        merged.update(out)
    merged["prompt"] = prompt
    return merged


# -- real engines (vLLM text stages) -------------------------------------------

#: Codec shape of :func:`talker_tokens_to_code2wav`: the synthetic Talker's
#: defaults (``SyntheticCost.num_codebooks`` / ``codebook_size``).
TOKEN_CODEBOOKS = 8
TOKEN_CODEBOOK_SIZE = 2048


def thinker_tokens_to_talker(upstream: Upstream, prompt: str,
                             params: dict[str, Any]) -> dict[str, Any]:
    """Thinker outputs -> a vLLM Talker's input: the Thinker's output tokens are
    the Talker's prompt.

    Args:
        upstream: exactly one source (the thinker) with ``token_ids`` (int[T]).

    Returns:
        ``{"prompt_token_ids": list[int]}`` of length T (a list: what vLLM's
        ``TokensPrompt`` takes).

    Raises:
        ValueError: not exactly one source, ``token_ids`` missing or not a 1-D
            integer array, or empty (vLLM rejects an empty prompt).
    """
    fn = "thinker_tokens_to_talker"
    sid, out = _single(upstream, fn)
    ids = _array(out, "token_ids", sid, fn, 1, np.int64)
    if ids.size == 0:
        raise ValueError(f"{fn}: stage {sid} produced no tokens; the talker needs at least one")
    return {"prompt_token_ids": ids.tolist()}


def talker_tokens_to_code2wav(upstream: Upstream, prompt: str,
                              params: dict[str, Any]) -> dict[str, Any]:
    """A vLLM Talker's output tokens -> code2wav input, so the synthetic Code2Wav
    can follow a real Talker: token ``t`` becomes one frame whose codebook ``k``
    (0..7) holds ``(t * (2k + 1) + 97k) % 2048``.

    Args:
        upstream: exactly one source (the talker) with ``token_ids`` (int[T]).

    Returns:
        ``{"codes": int32[T, 8]}`` in [0, 2048) (T may be 0).

    Raises:
        ValueError: not exactly one source, or ``token_ids`` missing or not a
            1-D integer array.
    """
    fn = "talker_tokens_to_code2wav"
    sid, out = _single(upstream, fn)
    ids = _array(out, "token_ids", sid, fn, 1, np.int64)
    k = np.arange(TOKEN_CODEBOOKS, dtype=np.int64)
    codes = (ids[:, None] * (2 * k + 1) + 97 * k) % TOKEN_CODEBOOK_SIZE
    return {"codes": codes.astype(np.int32)}
