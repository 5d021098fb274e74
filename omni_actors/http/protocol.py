"""The OpenAI wire protocol: request validation and response shaping.

Pure functions, no aiohttp and no actor types: every validation failure is
an :class:`ApiError` carrying the HTTP status and OpenAI error fields, and
every response is a plain dict ready to be JSON-encoded.
"""

from __future__ import annotations

import base64
import collections
import json
import re
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from omni_actors.http.types import Bridge

__all__ = [
    "ApiError",
    "AudioTranscripts",
    "ChatRequest",
    "ImageRequest",
    "error_body",
    "parse_chat_request",
    "parse_image_request",
    "render_prompt",
    "finish_reason",
    "usage_dict",
    "audio_payload",
    "chat_completion",
    "chat_chunk",
    "usage_chunk",
    "image_response",
    "model_card",
    "models_list",
    "now",
]

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
#: Most stop sequences a request may give (OpenAI's limit).
MAX_STOP = 4
AUDIO_FORMATS = frozenset({"wav", "pcm16"})  #: pcm16: raw int16 little-endian samples, as streamed parts are
DEFAULT_SIZE = "256x256"
MIN_SIDE, MAX_SIDE, SIDE_MULTIPLE = 64, 1024, 8
AUDIO_TTL_S = 3600  #: seconds an audio reply's id can be replayed (its ``expires_at``), as OpenAI's
#: Most audio replies' transcripts an API server keeps for replays by id, and most characters
#: of them (the oldest go first).
MAX_KEPT_AUDIO = 10_000
MAX_KEPT_AUDIO_CHARS = 64 << 20
#: Most characters a request's replayed audio turns may add to its prompt (as the 1 MiB a
#: body may carry by default: a review's 1 MiB body of one id replayed 12,777 times made a
#: prompt of 131 MB).
MAX_REPLAYED_CHARS = 1 << 20
_SIZE_RE = re.compile(r"([1-9]\d{0,4})x([1-9]\d{0,4})", re.ASCII)  # (fullmatch: no trailing newline; ASCII digits, no leading 0)


class ApiError(Exception):
    """An error answered as OpenAI error JSON with HTTP ``status``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}  #: extra response headers (``Retry-After`` of a 429)

    def body(self) -> dict[str, Any]:
        """The ``{"error": {...}}`` JSON body."""
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    """OpenAI error JSON: ``{"error": {message, type, param, code}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


# --------------------------------------------------------------------- checks

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt_int(body: dict, key: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_int(v):
        raise _bad(f"Invalid type for '{key}': expected an integer, got {type(v).__name__}.", key)
    if lo is not None and v < lo:
        raise _bad(f"Invalid '{key}': {v} is below the minimum of {lo}.", key)
    if hi is not None and v > hi:
        raise _bad(f"Invalid '{key}': {v} is above the maximum of {hi}.", key)
    return v


def _opt_bool(body: dict, key: str, path: str | None = None) -> bool | None:
    """``body[key]`` if a bool or absent; ``path``: how errors name it (default ``key``)."""
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise _bad(f"Invalid type for '{path or key}': expected a boolean.", path or key)
    return v


def _require_str(body: dict, key: str) -> str:
    v = body.get(key)
    if v is None:
        raise _bad(f"Missing required parameter: '{key}'.", key)
    if not isinstance(v, str):
        raise _bad(f"Invalid type for '{key}': expected a string.", key)
    return v


def _check_body(body: Any) -> dict:
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object.")
    return body


def _clip(text: str, limit: int = 100) -> str:
    """``text`` as an error message quotes it: at most ``limit`` characters, then an ellipsis."""
    return text if len(text) <= limit else text[:limit] + "..."


def _check_model(body: dict, bridge: Bridge, output: str, endpoint: str) -> str:
    model = _require_str(body, "model")
    if model != bridge.model_name:
        raise ApiError(
            404, f"The model '{_clip(model)}' does not exist. This server serves "
            f"'{bridge.model_name}'.", "invalid_request_error", "model", "model_not_found")
    if output not in bridge.output_types:
        serves = "/v1/images/generations" if "image" in bridge.output_types \
            else "/v1/chat/completions"
        raise _bad(f"The model '{model}' does not support {endpoint}; it serves {serves}.",
                   "model", "unsupported_endpoint")
    return model


# ----------------------------------------------------------------------- chat

@dataclass
class ChatRequest:
    """A validated ``/v1/chat/completions`` request."""

    model: str
    prompt: str
    output_types: frozenset[str]
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int | None = None
    voice: str | None = None
    stream: bool = False
    include_usage: bool = False
    audio_format: str = "wav"  #: of a whole audio output: "wav" or "pcm16" (streamed parts are always pcm16)
    top_p: float | None = None  #: nucleus sampling, in (0, 1] (vLLM's range)
    #: strings that end the text where they first appear (not included), at most
    #: :data:`MAX_STOP` (OpenAI's limit)
    stop: list[str] | None = None
    #: the other sampling fields given (:data:`EXTRA_SAMPLING`: OpenAI's penalties, vLLM's own)
    extra_sampling: dict[str, Any] | None = None

    def sampling_params(self) -> dict[str, Any]:
        """``max_tokens`` / ``temperature`` / ``top_p`` / ``seed`` / ``stop`` and the
        :data:`EXTRA_SAMPLING` fields, only those given."""
        sp = {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p,
              "seed": self.seed, "stop": self.stop, **(self.extra_sampling or {})}
        return {k: v for k, v in sp.items() if v is not None}

    def params(self) -> dict[str, Any]:
        """Stage parameters: ``voice`` when the client asked for one and for audio (without
        audio output, ``audio`` is unused)."""
        return {"voice": self.voice} if self.voice is not None and "audio" in self.output_types else {}


class AudioTranscripts:
    """The transcripts of this API server's audio replies by audio id, so that a conversation
    can replay an audio turn as OpenAI's API takes it (an assistant message
    ``{"role": "assistant", "audio": {"id": ...}}``): until its ``expires_at``
    (:data:`AUDIO_TTL_S` after the reply), at most :data:`MAX_KEPT_AUDIO` of them, the
    oldest going first, and :data:`MAX_KEPT_AUDIO_CHARS` characters of them. Trial CL:
    such a turn was taken and dropped from the prompt. Used on the app's event loop only."""

    def __init__(self, max_kept: int = MAX_KEPT_AUDIO, max_chars: int = MAX_KEPT_AUDIO_CHARS) -> None:
        self._kept: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()
        self._max, self._max_chars, self._chars = max_kept, max_chars, 0

    def keep(self, audio_id_: str, transcript: str, expires_at: float) -> None:
        """Keep ``transcript`` for ``audio_id_`` until ``expires_at`` (Unix seconds)."""
        old = self._kept.pop(audio_id_, None)
        self._chars += len(transcript) - (len(old[0]) if old else 0)
        self._kept[audio_id_] = (transcript, expires_at)
        while self._kept and (len(self._kept) > self._max or self._chars > self._max_chars):
            self._chars -= len(self._kept.popitem(last=False)[1][0])

    def get(self, audio_id_: str) -> str | None:
        """The transcript of ``audio_id_``; None when unknown here or expired."""
        kept = self._kept.get(audio_id_)
        if kept is None or kept[1] <= time.time():
            return None
        return kept[0]


def _replayed_audio(msg: dict, i: int, transcripts: AudioTranscripts | None) -> str:
    """The transcript of an assistant message's ``audio: {"id"}`` (a replayed audio turn).

    Raises ApiError (400) naming ``messages[i].audio`` or its ``id``."""
    param = f"messages[{i}].audio"
    audio = msg["audio"]
    if not isinstance(audio, dict):
        raise _bad(f"Invalid type for '{param}': expected an object.", param)
    if not isinstance(audio.get("id"), str):
        raise _bad(f"Missing required parameter: '{param}.id'." if audio.get("id") is None
                   else f"Invalid type for '{param}.id': expected a string.", f"{param}.id")
    transcript = transcripts.get(audio["id"]) if transcripts is not None else None
    if transcript is None:
        raise _bad(f"Invalid value for '{param}.id': no audio reply {audio['id']!r} is known to this server (an "
                   f"audio reply can be replayed by id for {AUDIO_TTL_S // 60} minutes, on the API server that "
                   "made it); give the turn's transcript as its 'content' instead.", f"{param}.id")
    return transcript


def _message_text(content: Any, i: int, role: str) -> str:
    param = f"messages[{i}].content"
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":
        return ""
    if not isinstance(content, list):
        raise _bad(f"Invalid type for '{param}': expected a string or an array of "
                   "content parts.", param)
    if not content:
        raise _bad(f"Invalid '{param}': empty array. Expected an array with minimum length 1.",
                   param, "empty_array")
    texts = []
    for j, part in enumerate(content):
        pp = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise _bad(f"Invalid type for '{pp}': expected an object.", pp)
        # (an assistant turn replayed from OpenAI may hold a `refusal` part: its words are the turn's)
        key = "refusal" if role == "assistant" and part.get("type") == "refusal" else "text"
        if "type" not in part:  # (trial BZ read "Invalid value ...: None")
            raise _bad(f"Missing required parameter: '{pp}.type'.", f"{pp}.type")
        if part.get("type") != key:
            raise _bad(f"Invalid value for '{pp}.type': {part.get('type')!r}; only 'text' content parts "
                       "(and 'refusal' in an assistant message) are supported.", f"{pp}.type")
        if not isinstance(part.get(key), str):
            raise _bad(f"Invalid type for '{pp}.{key}': expected a string.", f"{pp}.{key}")
        texts.append(part[key])
    return "\n".join(texts)


def render_prompt(messages: Any, transcripts: AudioTranscripts | None = None) -> str:
    """Validate ``messages`` and render them as ``role: text`` lines. An assistant message
    with no content and an ``audio: {"id"}`` (an audio reply replayed) is its transcript, from
    ``transcripts``; one not there is a 400."""
    if messages is None:
        raise _bad("Missing required parameter: 'messages'.", "messages")
    if not isinstance(messages, list):
        raise _bad("Invalid type for 'messages': expected an array.", "messages")
    if not messages:
        raise _bad("Invalid 'messages': empty array. Expected an array with minimum "
                   "length 1.", "messages", "empty_array")
    lines, replayed = [], 0
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise _bad(f"Invalid type for 'messages[{i}]': expected an object.", f"messages[{i}]")
        role = msg.get("role")
        if role is None:  # (it said "Invalid value ...: None", Python's word: trial X)
            raise _bad(f"Missing required parameter: 'messages[{i}].role'.", f"messages[{i}].role")
        if not isinstance(role, str) or role not in ROLES:  # (a list here was a 500: unhashable)
            shown = json.dumps(role) if isinstance(role, (str, int, float, bool)) else type(role).__name__
            raise _bad(f"Invalid value for 'messages[{i}].role': {shown}. Supported values "
                       f"are: {', '.join(sorted(ROLES))}.", f"messages[{i}].role")
        if "name" in msg and not isinstance(msg["name"], str):  # (as OpenAI checks it; it was taken: trial X)
            raise _bad(f"Invalid type for 'messages[{i}].name': expected a string.", f"messages[{i}].name")
        if role == "tool" and not isinstance(msg.get("tool_call_id"), str):
            raise _bad(f"Missing required parameter: 'messages[{i}].tool_call_id'.", f"messages[{i}].tool_call_id")
        content = msg.get("content")
        if role == "assistant" and msg.get("audio") is not None and content in (None, ""):
            content = _replayed_audio(msg, i, transcripts)
            replayed += len(content)
            if replayed > MAX_REPLAYED_CHARS:
                raise _bad(f"Invalid 'messages': the replayed audio turns' transcripts come to more than "
                           f"{MAX_REPLAYED_CHARS} characters, the most a request may add to its prompt that way.",
                           f"messages[{i}].audio")
        lines.append(f"{role}: {_message_text(content, i, role)}")
    return "\n".join(lines)


def _modalities(body: dict, bridge: Bridge) -> frozenset[str]:
    mods = body.get("modalities")
    if mods is None:
        return frozenset({"text"})
    if not isinstance(mods, list) or not all(isinstance(m, str) for m in mods):
        raise _bad("Invalid type for 'modalities': expected an array of strings.", "modalities")
    if sorted(mods) not in (["text"], ["audio", "text"]):
        raise _bad(f"Invalid value for 'modalities': {json.dumps(mods)}. Supported values are "
                   "[\"text\"] and [\"text\", \"audio\"].", "modalities")
    if "audio" in mods and "audio" not in bridge.output_types:
        raise _bad(f"The model '{bridge.model_name}' does not produce audio; use "
                   "modalities [\"text\"].", "modalities")
    return frozenset(mods)


def _audio(body: dict) -> tuple[str | None, str]:
    """``(voice, format)`` from the ``audio`` object (format default ``"wav"``)."""
    audio = body.get("audio")
    if audio is None:
        return None, "wav"
    if not isinstance(audio, dict):
        raise _bad("Invalid type for 'audio': expected an object.", "audio")
    fmt = audio.get("format", "wav")
    if not isinstance(fmt, str) or fmt not in AUDIO_FORMATS:  # (a list here was a 500: unhashable)
        raise _bad(f"Invalid value for 'audio.format': {json.dumps(fmt)}. Supported values are: "
                   f"{', '.join(sorted(AUDIO_FORMATS))}.", "audio.format")
    voice = audio.get("voice")
    if voice is not None and (not isinstance(voice, str) or not voice):
        raise _bad("Invalid type for 'audio.voice': expected a non-empty string.", "audio.voice")
    return voice, fmt


#: ``seed`` range: a signed 64-bit integer, as OpenAI documents it and vLLM takes it.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
#: ``response_format`` types OpenAI defines; only ``text`` is served (no constrained decoding here).
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def _check_unserved(body: dict) -> None:
    """OpenAI fields this server does not act on: checked for type and range as OpenAI
    does, and refused (400) where the reply would lack what the client asked for
    (log-probabilities, JSON output, a required tool or function call). The rest
    (``tools``/``functions`` with ``tool_choice``/``function_call`` auto or none,
    penalties, ``user``) are accepted and ignored.

    Raises:
        ApiError: 400 naming the field.
    """
    if _opt_bool(body, "logprobs"):
        raise _bad("'logprobs' is not supported by this server: its stages return no log-probabilities.",
                   "logprobs")
    if _opt_int(body, "top_logprobs", 0, 20):
        raise _bad("'top_logprobs' is only allowed with 'logprobs': true, which this server does not support: "
                   "its stages return no log-probabilities.", "top_logprobs")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise _bad("Invalid type for 'user': expected a string.", "user")
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind not in RESPONSE_FORMATS:
            raise _bad("Invalid 'response_format': expected an object with 'type' one of "
                       f"{', '.join(RESPONSE_FORMATS)}.", "response_format")
        if kind != "text":
            raise _bad(f"response_format '{kind}' is not supported by this server: its stages do not "
                       "constrain their output; use 'text'.", "response_format.type")
    # (``functions`` / ``function_call``: OpenAI's deprecated form of ``tools`` / ``tool_choice``)
    _check_calls(body, "tools", "tool_choice", "tool", ("required",))
    _check_calls(body, "functions", "function_call", "function", ())


def _check_calls(body: dict, listed: str, choice_key: str, what: str, forcing: tuple[str, ...]) -> None:
    """``listed`` must be an array of objects; ``choice_key`` may be "none" or "auto": an
    object (a named call) or one of ``forcing`` asks for a call this server cannot make
    (400), anything else is invalid (400)."""
    items = body.get(listed)
    if items is not None and (not isinstance(items, list) or not all(isinstance(i, dict) for i in items)):
        raise _bad(f"Invalid type for '{listed}': expected an array of objects.", listed)
    for i, item in enumerate(items or ()):
        # (each function named, as OpenAI checks it: trial CL's tool with no `function` got a 200)
        if listed == "tools":
            if item.get("type") != "function":
                continue  # (another kind of tool: not ours to check)
            where = f"tools[{i}].function"
            if item.get("function") is None:
                raise _bad(f"Missing required parameter: '{where}'.", where)
            item = item["function"]
            if not isinstance(item, dict):
                raise _bad(f"Invalid type for '{where}': expected an object.", where)
        else:
            where = f"{listed}[{i}]"
        if item.get("name") is None:
            raise _bad(f"Missing required parameter: '{where}.name'.", f"{where}.name")
        if not isinstance(item["name"], str):
            raise _bad(f"Invalid type for '{where}.name': expected a string.", f"{where}.name")
    choice = body.get(choice_key)
    if choice is None or choice in ("none", "auto"):
        return
    if not isinstance(choice, dict) and not (isinstance(choice, str) and choice in forcing):
        allowed = "', '".join(("none", "auto", *forcing))
        raise _bad(f"Invalid '{choice_key}': expected '{allowed}' or an object.", choice_key)
    raise _bad(f"{what} calls are not supported by this server: '{choice_key}' may be 'none' or 'auto' "
               "(the reply is text).", choice_key)


def parse_chat_request(body: Any, bridge: Bridge, transcripts: AudioTranscripts | None = None) -> ChatRequest:
    """Validate a chat-completions JSON body against ``bridge`` (replayed audio turns:
    their transcripts from ``transcripts``).

    Raises :class:`ApiError` (400, or 404 ``model_not_found``). Unknown
    fields are ignored.
    """
    body = _check_body(body)
    model = _check_model(body, bridge, "text", "/v1/chat/completions")
    prompt = render_prompt(body.get("messages"), transcripts)
    output_types = _modalities(body, bridge)
    voice, audio_format = _audio(body)
    limit = bridge.max_tokens_limit
    max_tokens = _opt_int(body, "max_tokens", 1, limit)
    mct = _opt_int(body, "max_completion_tokens", 1, limit)
    if mct is not None:
        max_tokens = mct
    temperature = _opt_number(body, "temperature", 0.0, 2.0, "[0, 2]")
    top_p = _opt_number(body, "top_p", 0.0, 1.0, "(0, 1]", low_open=True)
    seed = _opt_int(body, "seed", SEED_MIN, SEED_MAX)
    if _opt_int(body, "n", 1) not in (None, 1):
        raise _bad("Only n=1 is supported.", "n")
    _check_unserved(body)
    stream = bool(_opt_bool(body, "stream"))
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _bad("Invalid type for 'stream_options': expected an object.", "stream_options")
    if opts is not None and not stream:  # (as OpenAI and vLLM answer: the client expected a stream's usage chunk)
        raise _bad("'stream_options' is only allowed when 'stream' is true.", "stream_options")
    include_usage = bool(_opt_bool(opts or {}, "include_usage", "stream_options.include_usage"))
    return ChatRequest(model, prompt, output_types, max_tokens, temperature, seed, voice,
                       stream, include_usage, audio_format, top_p, _stop(body),
                       _extra_sampling(body, max_tokens, limit) or None)


#: Sampling fields a chat request may give beyond OpenAI's core ones, with their ranges:
#: OpenAI's penalties, and those vLLM's own OpenAI server takes in the body (its
#: ``SamplingParams``' names and checks). They go to the stage that makes the text, as
#: ``temperature`` does (a vLLM engine applies them; the synthetic engine ignores them).
#: The largest ``top_k`` taken (vLLM treats any top_k over the vocabulary as the vocabulary).
TOP_K_MAX = 2**31 - 1
EXTRA_SAMPLING = ("presence_penalty", "frequency_penalty", "top_k", "min_p", "repetition_penalty", "min_tokens")


def _extra_sampling(body: dict, max_tokens: int | None, limit: int) -> dict[str, Any]:
    """The :data:`EXTRA_SAMPLING` fields given, checked. Raises :class:`ApiError` (400)."""
    out: dict[str, Any] = {
        "presence_penalty": _opt_number(body, "presence_penalty", -2.0, 2.0, "[-2, 2]"),
        "frequency_penalty": _opt_number(body, "frequency_penalty", -2.0, 2.0, "[-2, 2]"),
        # (-1 and 0: no top-k, as vLLM takes them; at most 2**31 - 1: a review's 2**64 passed vLLM's
        # checks, then broke its request encoding, a 500 retried until the circuit breaker tripped)
        "top_k": _opt_int(body, "top_k", -1, TOP_K_MAX),
        "min_p": _opt_number(body, "min_p", 0.0, 1.0, "[0, 1]"),
        "repetition_penalty": _opt_number(body, "repetition_penalty", 0.0, sys.float_info.max, "(0, inf)",
                                          low_open=True),
        "min_tokens": _opt_int(body, "min_tokens", 0, limit)}
    if out["min_tokens"] is not None and max_tokens is not None and out["min_tokens"] > max_tokens:
        raise _bad(f"Invalid 'min_tokens': {out['min_tokens']} is above max_tokens ({max_tokens}).", "min_tokens")
    return {k: v for k, v in out.items() if v is not None}


def _stop(body: dict) -> list[str] | None:
    """``stop``: null, a string, or an array of 1 to :data:`MAX_STOP` non-empty strings."""
    stop = body.get("stop")
    if stop is None:
        return None
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
        raise _bad("Invalid type for 'stop': expected a string or an array of strings.", "stop")
    if not 1 <= len(stop) <= MAX_STOP:
        raise _bad(f"Invalid 'stop': {len(stop)} sequences. Expected 1 to {MAX_STOP}.", "stop")
    if not all(stop):
        raise _bad("Invalid 'stop': empty string. Each stop sequence needs at least one character.", "stop")
    return stop


def _opt_number(body: dict, key: str, lo: float, hi: float, shown: str, *,
                low_open: bool = False) -> float | None:
    """``body[key]`` as a float in ``[lo, hi]`` (``(lo, hi]`` with ``low_open``),
    or None when absent or null. Raises :class:`ApiError` (400) naming ``key``."""
    val = body.get(key)
    if val is None:
        return None
    if not isinstance(val, (int, float)) or isinstance(val, bool):
        raise _bad(f"Invalid type for '{key}': expected a number.", key)
    if not (lo < val <= hi if low_open else lo <= val <= hi):  # (NaN, inf: outside)
        raise _bad(f"Invalid '{key}': {val} is outside {shown}.", key)
    return float(val)


# --------------------------------------------------------------------- images

@dataclass
class ImageRequest:
    """A validated ``/v1/images/generations`` request."""

    model: str
    prompt: str
    width: int
    height: int
    seed: int | None = None

    def sampling_params(self) -> dict[str, Any]:
        """``seed`` when given."""
        return {"seed": self.seed} if self.seed is not None else {}

    def params(self) -> dict[str, Any]:
        """``width`` and ``height`` for the image stages."""
        return {"width": self.width, "height": self.height}


def _size(body: dict) -> tuple[int, int]:
    size = body.get("size")
    if size is None:
        size = DEFAULT_SIZE
    m = _SIZE_RE.fullmatch(size) if isinstance(size, str) else None
    sides = (int(m.group(1)), int(m.group(2))) if m else None
    if sides is None or not all(
            MIN_SIDE <= s <= MAX_SIDE and s % SIDE_MULTIPLE == 0 for s in sides):
        raise _bad(f"Invalid value for 'size': {size!r}. Expected 'WIDTHxHEIGHT' with each "
                   f"side in {MIN_SIDE}..{MAX_SIDE} and a multiple of {SIDE_MULTIPLE}.", "size")
    return sides


def parse_image_request(body: Any, bridge: Bridge) -> ImageRequest:
    """Validate an images-generations JSON body against ``bridge``.

    Raises :class:`ApiError` (400, or 404 ``model_not_found``).
    """
    body = _check_body(body)
    if body.get("model") is None:  # (optional in OpenAI's images API: the model served here)
        body = {**body, "model": bridge.model_name}
    model = _check_model(body, bridge, "image", "/v1/images/generations")
    prompt = _require_str(body, "prompt")
    if not prompt.strip():
        raise _bad("Invalid 'prompt': must be a non-empty string.", "prompt")
    if _opt_int(body, "n", 1) not in (None, 1):
        raise _bad("Only n=1 is supported.", "n")
    width, height = _size(body)
    fmt = body.get("response_format")
    if fmt == "url":
        raise _bad("response_format 'url' is not supported; use 'b64_json'.",
                   "response_format")
    if fmt not in (None, "b64_json"):
        raise _bad(f"Invalid value for 'response_format': {fmt!r}. Supported value is "
                   "'b64_json'.", "response_format")
    # Fields that would change what the returned bytes are: refused rather than ignored
    # (a client that asked for a JPEG or a transparent background must not get an opaque PNG).
    for key, ok in (("output_format", ("png",)), ("background", ("auto", "opaque"))):
        if body.get(key) not in (None, *ok):
            raise _bad(f"Invalid value for '{key}': {body.get(key)!r}. Supported: "
                       f"{', '.join(repr(v) for v in ok)} (the image is an opaque RGB PNG).", key)
    if _opt_bool(body, "stream"):  # (a client that asked for partial images would wait for events)
        raise _bad("Streaming is not supported for image generation: leave 'stream' out or false.", "stream")
    seed = _opt_int(body, "seed", SEED_MIN, SEED_MAX)
    return ImageRequest(model, prompt, width, height, seed)


# ------------------------------------------------------------------ responses

def finish_reason(completion_tokens: int, max_tokens: int | None) -> str:
    """``"length"`` when the completion reached ``max_tokens``, else ``"stop"``."""
    if max_tokens is not None and completion_tokens >= max_tokens:
        return "length"
    return "stop"


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """OpenAI ``usage`` object."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def audio_id() -> str:
    """A new audio id (``audio_<hex>``)."""
    return f"audio_{uuid.uuid4().hex}"


def audio_payload(wav: bytes, transcript: str, created: int) -> dict[str, Any]:
    """``message.audio`` / ``delta.audio``: id, base64 WAV, expiry, transcript."""
    return {"id": audio_id(), "data": base64.b64encode(wav).decode("ascii"),
            "expires_at": created + AUDIO_TTL_S, "transcript": transcript}


def audio_part(audio_id_: str | None, pcm: Any) -> dict[str, Any]:
    """A streamed ``delta.audio``: ``{"id", "data"}`` for the first part of an audio,
    ``{"data"}`` for the others (``audio_id_`` None), data = base64 of int16 little-endian
    PCM samples (``pcm``: an int16 array [samples]). The id goes once, as in OpenAI's
    streams: clients join each string field across deltas (trial CL: the ``openai``
    package's stream helper gave the id five times over)."""
    import numpy as np

    data = base64.b64encode(np.asarray(pcm, dtype="<i2").tobytes()).decode("ascii")
    return {"id": audio_id_, "data": data} if audio_id_ else {"data": data}


#: Samples of audio in one streamed part at most (1 s at 24 kHz: 64 KB of base64 in one
#: SSE line). A busy engine merges its chunks, and one part of many seconds made SSE lines
#: of half a megabyte, over the line limit of some clients (aiohttp's reader: 512 KiB).
AUDIO_PART_MAX_SAMPLES = 24000
#: Samples per second of streamed audio parts (the README's promise to clients).
AUDIO_PART_RATE = 24000


def audio_parts(audio_id_: str | None, pcm: Any) -> list[dict[str, Any]]:
    """:func:`audio_part` s of ``pcm`` (int16 [samples]) in order, each at most
    :data:`AUDIO_PART_MAX_SAMPLES` samples long; the first with ``audio_id_`` (the audio's
    first part: None for the parts after it)."""
    import numpy as np

    pcm = np.asarray(pcm, dtype="<i2")
    step = AUDIO_PART_MAX_SAMPLES
    return [audio_part(audio_id_ if i == 0 else None, pcm[i:i + step]) for i in range(0, max(len(pcm), 1), step)]


def whole_base64(pcm: Any, held: Any) -> tuple[Any, Any]:
    """``(to send, to hold)``: ``held`` (int16 samples kept from the part before) and ``pcm``
    joined, cut where the bytes sent are a multiple of 3 (3 samples), so that each part's
    base64 has no padding and the parts' ``data`` strings joined decode as one (the
    ``openai`` package's stream helper joins them: a review saw parts of 1,000 samples
    break it). The rest (up to 2 samples) waits for the next part, or for the end."""
    import numpy as np

    pcm = np.concatenate((held, np.asarray(pcm, dtype="<i2"))) if len(held) else np.asarray(pcm, dtype="<i2")
    cut = len(pcm) - len(pcm) % 3
    return pcm[:cut], pcm[cut:]


def audio_end(transcript: str, created: int) -> dict[str, Any]:
    """The last streamed ``delta.audio``: transcript and expiry (no data; the id went with
    the first part)."""
    return {"transcript": transcript, "expires_at": created + AUDIO_TTL_S}


def chat_completion(
    request_id: str, model: str, created: int, text: str, audio: dict[str, Any] | None,
    finish: str, usage: dict[str, int],
) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` object."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if audio is not None:
        message["audio"] = audio
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": finish}],
            "usage": usage}


def chat_chunk(
    request_id: str, model: str, created: int, delta: dict[str, Any],
    finish: str | None = None, include_usage: bool = False,
) -> dict[str, Any]:
    """One ``chat.completion.chunk`` with a single choice."""
    chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created,
             "model": model, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": finish}]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(request_id: str, model: str, created: int,
                usage: dict[str, int]) -> dict[str, Any]:
    """The final streaming chunk with empty ``choices`` and the ``usage``."""
    return {"id": request_id, "object": "chat.completion.chunk", "created": created,
            "model": model, "choices": [], "usage": usage}


def image_response(created: int, png: bytes) -> dict[str, Any]:
    """``/v1/images/generations`` response with one ``b64_json`` image."""
    return {"created": created, "data": [{"b64_json": base64.b64encode(png).decode("ascii")}]}


def model_card(model: str, created: int) -> dict[str, Any]:
    """One OpenAI ``model`` object."""
    return {"id": model, "object": "model", "created": created, "owned_by": "omni-actors"}


def models_list(model: str, created: int) -> dict[str, Any]:
    """``/v1/models``: a list holding the one served model."""
    return {"object": "list", "data": [model_card(model, created)]}


def now() -> int:
    """Unix time in whole seconds (``created`` fields)."""
    return int(time.time())
