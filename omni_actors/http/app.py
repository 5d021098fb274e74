"""The OpenAI-compatible aiohttp application over a :class:`Bridge`.

Handlers are thin: parse and validate (:mod:`omni_actors.http.protocol`),
``bridge.submit(PipelineRequest(...))``, shape the answer. Every error,
aiohttp's own 404/405/413 included, leaves as OpenAI error JSON.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import math
import os
import socket
import struct
import time
import uuid
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_urldispatcher import _default_expect_handler  # (100 Continue, as aiohttp answers)

from omni_actors.http import metrics as M
from omni_actors.http import protocol as P
from omni_actors.http.types import (
    CONTEXT_LENGTH_CODE, Bridge, BridgeEvent, OutputFinal, OutputPart, OutputText, PipelineRequest, RequestDone,
    RequestFailed, within,
)

__all__ = ["create_app", "start_http", "refuse_new_requests", "BRIDGE_KEY"]



def _log() -> Any:
    from omni_actors.logs import get_logger

    return get_logger(component="http")

BRIDGE_KEY: web.AppKey[Any] = web.AppKey("bridge", object)
_API_KEY: web.AppKey[Any] = web.AppKey("api_key", object)
_CREATED: web.AppKey[int] = web.AppKey("created", int)
_MAX_BODY: web.AppKey[int] = web.AppKey("max_body_bytes", int)
_STOPPING: web.AppKey[Any] = web.AppKey("stopping", object)
_TRANSCRIPTS: web.AppKey[P.AudioTranscripts] = web.AppKey("audio_transcripts", P.AudioTranscripts)
_RID: web.RequestKey[str] = web.RequestKey("request_id", str)
#: the message of the error a request was answered with, or that ended its stream (logged)
_ERROR: web.RequestKey[str] = web.RequestKey("error_message", str)
# Only /health and /ready (which names stages, nothing more) are open. /metrics needs the
# key when one is set: it shows pids, nodes, devices, failure reasons and traffic volume,
# and Prometheus sends a bearer token per scrape job (``authorization: {credentials: ...}``),
# so keeping it closed costs nothing; liveness and readiness probes, which cannot, have
# /health and /ready.
OPEN_PATHS = frozenset({"/health", "/ready"})
CHAT_PATH, IMAGES_PATH = "/v1/chat/completions", "/v1/images/generations"
DEADLINE_GRACE_S = 5.0
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _enc_hook(obj: Any) -> Any:
    for attr in ("tolist", "item"):  # numpy arrays and scalars
        if hasattr(obj, attr):
            return getattr(obj, attr)()
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    return str(obj)


_encoder = msgspec.json.Encoder(enc_hook=_enc_hook)


def _json(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    try:
        body = _encoder.encode(data)
    except UnicodeEncodeError:  # (a lone surrogate, e.g. a file name's bad bytes in an engine's error
        # in a replica's reason: `/v1/stages` was a 500; JSON's \u escape carries it, a code review)
        body = json.dumps(data, default=lambda o: o.item() if hasattr(o, "item") else str(o)).encode()
    return web.Response(body=body, status=status, headers=headers, content_type="application/json")


def _error(err: P.ApiError, headers: dict[str, str] | None = None) -> web.Response:
    return _json(err.body(), err.status, {**err.headers, **(headers or {})} or None)


#: Seconds a connection may stay idle, between requests or before its first request's
#: headers are complete (a client that sends half its headers and stops is cut off):
#: nginx's keepalive_timeout default, 75 s; aiohttp's own is an hour.
IDLE_CONNECTION_TIMEOUT_S = 75.0
#: Seconds ``runner.cleanup()`` lets handlers still running finish before it cancels them
#: (aiohttp's default is 60; ours run after a drain that already ended them with a 503).
CLEANUP_TIMEOUT_S = 5.0
#: Seconds a client has to send its whole request body once the headers are in; a
#: client that stalls mid-body gets 408 (aiohttp itself would wait for ever). 30 s:
#: 1 MiB (the body limit) at about 35 KB/s.
BODY_READ_TIMEOUT_S = 30.0
#: Seconds one write of a stream may wait for the client to read (its socket buffers full)
#: before the stream is cut and its output freed: a client that reads nothing would
#: otherwise keep its whole reply in the API server's memory (a trial: 13 MB per stalled
#: audio stream, for as long as the connection stayed open). nginx's send_timeout is 60 s;
#: ``$OMNI_ACTORS_SEND_TIMEOUT_S`` sets another.
SEND_TIMEOUT_S = 60.0
SEND_TIMEOUT_ENV = "OMNI_ACTORS_SEND_TIMEOUT_S"


#: A JSON reply bigger than this (bytes: a non-streamed audio reply, an image) is written under
#: the send timeout too (:func:`_reply_json`); aiohttp writes a plain response with none.
LARGE_REPLY_BYTES = 256 * 1024


async def _send_within(request: web.Request, write: Awaitable[Any], limit_s: float, what: str) -> None:
    """Await ``write`` (a write to the client) at most ``limit_s``; past it, the client read
    nothing for that long: its connection is aborted (its output freed) and
    ConnectionResetError raised (the request is logged with status 499)."""
    try:
        await within(write, limit_s)
    except asyncio.TimeoutError:
        _log().warning("client_stalled", request_id=request.get(_RID), waited_s=limit_s,
                       message=f"the client read nothing of its {what} for this long: the connection is cut "
                               "and its output freed")
        if request.transport is not None:
            _reset(request.transport)
        raise ConnectionResetError(f"the client read nothing for {limit_s:g} s") from None


def _reset(transport: asyncio.BaseTransport) -> None:
    """Abort ``transport`` with a TCP reset: a socket closed with bytes still in its send
    queue sends them first (trial BU: a client cut off for reading nothing read megabytes of
    its dead stream afterwards, over minutes, then an end with no error), unless it lingers 0 s."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    transport.abort()


#: Bytes handed to aiohttp per write of a large body: each write waits for the client to
#: read about that much, so the send timeout bounds a stretch without reading, not the whole
#: transfer (one write of a whole 11 MB reply cut a client slower than 1.5 Mbit/s; a code review).
WRITE_SLICE_BYTES = 64 * 1024


async def _write_within(request: web.Request, resp: web.StreamResponse, data: bytes, limit_s: float,
                        what: str) -> None:
    """Write ``data`` to ``resp`` in slices of :data:`WRITE_SLICE_BYTES`, each under
    :func:`_send_within`: a client that reads nothing for ``limit_s`` is cut, one that
    reads slowly is not. Raises ConnectionResetError as it does."""
    view = memoryview(data)
    for start in range(0, max(len(view), 1), WRITE_SLICE_BYTES):
        await _send_within(request, resp.write(view[start:start + WRITE_SLICE_BYTES]), limit_s, what)


async def _reply_json(request: web.Request, data: Any) -> web.StreamResponse:
    """``data`` as the JSON reply; a large one (over :data:`LARGE_REPLY_BYTES`) is written
    here under the send timeout: a client that read none of it held it in this server's
    memory for as long as it kept its connection (a code review: 13 MB per audio reply)."""
    body = _encoder.encode(data)
    if len(body) <= LARGE_REPLY_BYTES:
        return web.Response(body=body, content_type="application/json")
    resp = web.StreamResponse(headers={"X-Request-Id": request[_RID]})
    resp.content_type, resp.content_length = "application/json", len(body)
    await resp.prepare(request)
    limit_s = send_timeout_s()
    await _write_within(request, resp, body, limit_s, "reply")
    await _send_within(request, resp.write_eof(), limit_s, "reply")
    return resp


def send_timeout_s() -> float:
    """:data:`SEND_TIMEOUT_S`, or ``$OMNI_ACTORS_SEND_TIMEOUT_S`` when it is a number > 0."""
    try:
        value = float(os.environ.get(SEND_TIMEOUT_ENV) or SEND_TIMEOUT_S)
    except ValueError:
        return SEND_TIMEOUT_S
    return value if 0 < value < float("inf") else SEND_TIMEOUT_S


async def _read_json(request: web.Request) -> Any:
    limit = request.app[_MAX_BODY]
    if request.content_length is not None and request.content_length > limit:
        # Declared too large: refused at once, not after waiting for a body we would refuse.
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    try:  # raises HTTPRequestEntityTooLarge over client_max_size
        body = await within(request.read(), BODY_READ_TIMEOUT_S)
    except asyncio.TimeoutError:
        # (or it came with a malformed chunked encoding: aiohttp's C parser then queues its own
        # 400 and leaves the body's reader waiting; a review)
        raise P.ApiError(408, f"The request body did not arrive within {BODY_READ_TIMEOUT_S:g} s (or its "
                              f"chunked transfer encoding could not be read).", code="request_timeout") from None
    except asyncio.CancelledError:
        # The client left mid-body and aiohttp cancelled us (when the read fails first, aiohttp
        # logs its ConnectionResetError, which logs.py turns into this same one line).
        _log().info("client_connection_lost", message="the client left while its request body was being read")
        raise
    except (web.RequestPayloadError, HttpProcessingError) as exc:
        # (HttpProcessingError: a malformed chunked body, from aiohttp's pure-Python parser; it
        # was a 500 with a traceback, a review)
        # A body that cannot be decoded (a Content-Encoding: gzip body that is not gzip): the
        # client's mistake, a 400 (aiohttp then closes the connection: reading on through the
        # rest of that body fails again, logged as one bad_http_request event).
        why = str(exc).split("message:", 1)[-1].strip() or "it could not be decoded"
        if isinstance(exc, HttpProcessingError):
            why = f"its chunked transfer encoding is malformed (at {why[:40]!r})"
        raise P.ApiError(400, f"We could not read the body of your request: {why}") from None
    return decode_json(body)


def decode_json(body: bytes) -> Any:
    """A request body as JSON (msgspec).

    Raises:
        ApiError: 400 that says why it is not JSON.
    """
    try:
        return msgspec.json.decode(body)
    except msgspec.MsgspecError as e:
        why = str(e)
        if not body.strip():
            why = "the body is empty (send a JSON object)"
        elif ("truncated" in why or "surrogate" in why) and _whole_but_a_lone_surrogate(body):
            # (msgspec's words for a \ud800-\udfff escape with no partner: "Input data was truncated"
            # at the body's end, "unexpected end of escaped utf-16 surrogate pair" before more
            # text, "invalid utf-16 surrogate pair"; trial BZ read the second as malformed JSON)
            why = ("a string has an unpaired utf-16 surrogate escape (\\ud800-\\udfff with no partner), "
                   "which is no text: send the character, or its pair")
        raise P.ApiError(400, f"We could not parse the JSON body of your request: {why}") from None
    except RecursionError:
        raise P.ApiError(400, "We could not parse the JSON body of your request: nested too deeply") from None


def _whole_but_a_lone_surrogate(body: bytes) -> bool:
    """Whether ``body`` is complete JSON that Python's ``json`` reads (it takes lone surrogates)."""
    import json

    try:
        json.loads(body)
    except (ValueError, RecursionError):
        return False
    return True


# ---------------------------------------------------------------- middlewares

#: (a 404 is OpenAI's `invalid_request_error`, an unknown route's as an unknown model's: trial BL)
_HTTP_TYPES = {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
               429: "rate_limit_error"}


def _http_error(request: web.Request, exc: web.HTTPException) -> web.Response:
    status = exc.status
    if status == 404:
        msg = f"Unknown request URL: {request.method} {request.path}"  # (no period: read as the URL's)
    elif status == 405:
        msg = f"Method {request.method} is not allowed for {request.path}."
    elif status == 413:
        msg = f"Request body too large: the limit is {request.app[_MAX_BODY]} bytes."
    else:
        msg = exc.text or exc.reason
    etype = _HTTP_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    request[_ERROR] = msg
    headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
    return _error(P.ApiError(status, msg, etype), headers)


@web.middleware
async def request_id_middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Answer with ``X-Request-Id``: the pipeline request id when the handler made
    one (a chat completion's ``chatcmpl-...``, its body's ``id``), else a fresh
    ``req-...`` id. A client's own ``X-Request-Id`` is logged as ``client_request_id``
    and never taken as the id: clients' ids may collide, and a trial found a refused
    request logged under the client's id and an accepted one under ours.

    Also the access log: one ``http_request`` event per request (every POST; a GET only
    when it fails: monitors poll them) with ``method``, ``path``, ``status`` (a stream's
    outcome when it failed after its 200 header; 499: the client left), ``duration_ms``,
    ``request_id``, the client's ``client_request_id`` and, from 400 up, ``error`` (the
    message the client got); a warning for a 5xx. (A trial
    found 400s, 404s, 429s and 503s in no log, and ``request_finished`` without a status.)"""
    incoming = request.headers.get("X-Request-Id", "")
    request[_RID] = f"req-{uuid.uuid4().hex}"
    t0, status = time.perf_counter(), 500
    try:
        resp = await handler(request)
        status = resp.status
        if not resp.prepared:
            resp.headers["X-Request-Id"] = request[_RID]
        return resp
    except web.HTTPException as exc:
        status = exc.status
        raise
    except (ConnectionResetError, asyncio.CancelledError):
        status = M.CLIENT_CLOSED
        request[_ERROR] = "the client closed the connection"  # (trial CK read `"error": null` for a 499)
        raise
    finally:
        status = request.get(M.OUTCOME_KEY, status)
        if request.method == "POST" and request.path in (CHAT_PATH, IMAGES_PATH):
            M.count_refused(request, request.path, status, time.perf_counter() - t0)
        if request.method != "GET" or status >= 400:
            (_log().warning if status >= 500 else _log().info)(
                "http_request", method=request.method, path=request.path, status=status,
                duration_ms=round((time.perf_counter() - t0) * 1000, 2), request_id=request[_RID],
                client_request_id=incoming[:128] or None, error=request.get(_ERROR) if status >= 400 else None)


class _Stopping:
    """Whether the server stops (set once by :func:`refuse_new_requests`; event loop only)."""

    def __init__(self) -> None:
        self.set = False


#: Paths still answered on a connection left open while the server stops (once each: the
#: answer closes it, and new connections are refused): a monitor's last true scrape.
_WHILE_STOPPING = ("/v1/stages", "/metrics")


def refuse_new_requests(app: web.Application) -> None:
    """From now on (a stop: ``omni_actors.system.leader.drain_http``), a request that
    arrives on a connection still open (keep-alive) gets a 503, ``/health`` included (a
    load balancer stops sending here), except ``/v1/stages`` and ``/metrics``; every
    response closes its connection, those of requests in flight included. (Only new
    connections were refused: a trial's clients went on sending on their pooled ones
    through the whole drain and after it, and the stop took 25 s instead of 10.)"""
    app[_STOPPING].set = True


@web.middleware
async def stopping_middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """See :func:`refuse_new_requests`."""
    stopping = request.app[_STOPPING]
    if stopping.set and request.path not in _WHILE_STOPPING:
        err = P.ApiError(503, "The server is shutting down and takes no new requests; "
                         "send them to another server, or again once it is back.", "server_error",
                         code="service_unavailable")
        request[_ERROR] = err.message
        resp = _error(err)
        resp.force_close()
        return resp
    resp = await handler(request)
    if stopping.set:  # (it began while this request ran: its connection goes with it)
        resp.force_close()
    return resp


@web.middleware
async def error_middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Turn every error into OpenAI error JSON with the right status."""
    try:
        return await handler(request)
    except P.ApiError as e:
        request[_ERROR] = e.message
        return _error(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _http_error(request, e)
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception:
        _log().exception("http_unhandled_error", method=request.method, path=request.path,
                         request_id=request.get(_RID))
        request[_ERROR] = "The server had an error while processing your request. (http_unhandled_error)"
        return _error(P.ApiError(500, "The server had an error while processing your "
                                 "request.", "server_error"))


#: The challenge of a 401 (RFC 6750: the scheme the server takes; ``invalid_token`` for a wrong key).
CHALLENGE = 'Bearer realm="omni-actors"'


@web.middleware
async def auth_middleware(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Bearer API key check (when configured); ``/health`` stays open. A 401 carries
    ``WWW-Authenticate`` (:data:`CHALLENGE`), as HTTP asks of one."""
    key = request.app[_API_KEY]
    if key is not None and request.path not in OPEN_PATHS:
        auth = request.headers.get("Authorization", "")
        scheme, _, token = auth.partition(" ")
        if not auth.strip():
            raise P.ApiError(401, "You didn't provide an API key. Provide it in the "
                             "Authorization header as 'Bearer YOUR_KEY'.", headers={"WWW-Authenticate": CHALLENGE})
        if scheme.lower() != "bearer" or not token.strip():  # (a trial's `Basic ...` read "didn't provide")
            raise P.ApiError(401, "The Authorization header is not 'Bearer YOUR_KEY' (it has "
                             f"{'scheme ' + repr(scheme[:20]) if scheme else 'no scheme'}).",
                             headers={"WWW-Authenticate": CHALLENGE})
        # (surrogateescape: aiohttp keeps a header's non-UTF-8 bytes so; a plain encode raised, a 500)
        if not hmac.compare_digest(token.strip().encode("utf-8", "surrogateescape"), key.encode()):
            raise P.ApiError(401, "Incorrect API key provided.", code="invalid_api_key",
                             headers={"WWW-Authenticate": CHALLENGE + ', error="invalid_token"'})
    return await handler(request)


# ------------------------------------------------------------------- running

#: How many times a request runs again when its output was lost with its host, or when a
#: stage failed mid-stream and none of the request had reached the client yet.
MAX_RERUNS = 1
#: Before it does, at most this long (seconds, within its deadline) it waits for the
#: coordinator to report that host down, so that the rerun is not routed to its replicas:
#: a host whose main process died is reported within about a second (its watchdog), one
#: that vanished after 3 missed node heartbeats (``heartbeat_interval_s``: 1 s by default).
RERUN_NODE_DOWN_WAIT_S = 5.0

@dataclasses.dataclass(frozen=True)
class Rerun:
    """The request runs again from the start under ``request_id`` (its output was
    lost with its host, :attr:`RequestFailed.lost_output`, or a stage failed after its
    text went out, :attr:`RequestFailed.output_sent`, and none reached the client):
    drop what came before."""

    request_id: str
    why: str


class _Run:
    """One pipeline request's event stream. Use as ``async with``: leaving
    before ``RequestDone``/``RequestFailed`` (early return, exception, client
    gone, cancellation) calls ``bridge.cancel(request_id)``, shielded.

    Guards against a stuck bridge: past ``timeout_s`` plus a grace period
    it yields ``RequestFailed(504)`` itself.

    A request whose output was lost with its host after it ran (a member host
    killed between making its stage's output and the API server reading it), or
    whose stage failed mid-stream after its text had gone to this API server
    (:attr:`RequestFailed.output_sent`: the RequestActor does not retry that stage)
    runs once more, within the same deadline, when ``can_rerun()`` says nothing of
    it reached the client yet: a :class:`Rerun` event says so first. (It got a 500,
    or a 503 that said part of the output had reached the client when none had.)
    """

    def __init__(self, bridge: Bridge, preq: PipelineRequest,
                 can_rerun: Callable[[], bool] = lambda: False) -> None:
        self.bridge, self.preq, self.finished, self.can_rerun = bridge, preq, False, can_rerun
        self._events: AsyncIterator[BridgeEvent] | None = None
        self.reruns = 0
        self._first_failure: RequestFailed | None = None  #: what made it run again

    async def __aenter__(self) -> "_Run":
        self._events = self.bridge.submit(self.preq)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        try:
            if not self.finished:
                _log().info("http_request_cancel", request_id=self.preq.request_id)
                try:
                    await asyncio.shield(self.bridge.cancel(self.preq.request_id))
                except Exception:
                    _log().exception("http_cancel_failed", request_id=self.preq.request_id)
        finally:  # (also when this task is cancelled while it waits for the cancel: the handler's)
            await self._close_events()

    async def _close_events(self) -> None:
        aclose = getattr(self._events, "aclose", None)
        if aclose is not None:
            try:
                await aclose()
            except Exception:
                _log().exception("http_events_close_failed", request_id=self.preq.request_id)

    async def __aiter__(self) -> AsyncIterator[BridgeEvent]:
        loop = asyncio.get_running_loop()
        timeout = self.preq.timeout_s
        deadline = None if timeout is None else loop.time() + timeout + DEADLINE_GRACE_S
        it = self._events.__aiter__()
        while True:
            try:
                remaining = None if deadline is None else max(0.0, deadline - loop.time())
                event = await within(it.__anext__(), remaining)
            except StopAsyncIteration:
                raise P.ApiError(500, "The pipeline ended without a result.",
                                 "server_error") from None
            except asyncio.TimeoutError:
                yield RequestFailed(504, "The request timed out.", code="timeout")
                return
            if (isinstance(event, RequestFailed) and (event.lost_output or event.output_sent or event.not_started)
                    and self.reruns < MAX_RERUNS and self.can_rerun()
                    and (deadline is None or deadline - loop.time() > DEADLINE_GRACE_S)):
                self.reruns += 1
                self._first_failure = event
                if event.lost_on is not None:  # (else the rerun may go to the dying host's replicas)
                    wait = RERUN_NODE_DOWN_WAIT_S if deadline is None else min(
                        RERUN_NODE_DOWN_WAIT_S, max(0.0, deadline - loop.time() - 2 * DEADLINE_GRACE_S))
                    t0 = loop.time()
                    down = await self.bridge.wait_node_down(event.lost_on, wait)
                    _log().info("http_rerun_waited_for_node", request_id=self.preq.request_id,
                                node=event.lost_on, down=down, waited_s=round(loop.time() - t0, 2))
                    goes_back = getattr(self.bridge, "rerun_goes_back", None)
                    if goes_back is not None and goes_back(event.lost_on, self.preq):
                        _log().warning("http_request_not_rerun", request_id=self.preq.request_id,
                                       node=event.lost_on, why=event.message)
                        self.finished = True
                        yield dataclasses.replace(event, message=(
                            f"{event.message} (not run again: node {event.lost_on}'s data service does not "
                            "answer, and a stage this request needs has its ready replicas there alone)"))
                        return
                left = None if deadline is None else deadline - loop.time() - DEADLINE_GRACE_S
                # (one its RequestActor never took goes to a new one: trial CC's rerun went to another
                # idle RequestActor, stopped as the first was, and failed with a 500)
                old, self.preq = self.preq, dataclasses.replace(
                    self.preq, request_id=f"{self.preq.request_id}-rerun{self.reruns}", timeout_s=left,
                    fresh_actor=event.not_started)
                _log().warning("http_request_rerun", request_id=old.request_id, rerun_id=self.preq.request_id,
                               why=event.message)
                await self._close_events()
                self._events = self.bridge.submit(self.preq)
                it = self._events.__aiter__()
                yield Rerun(self.preq.request_id, event.message)
                continue
            if isinstance(event, (RequestDone, RequestFailed)):
                self.finished = True
                if isinstance(event, RequestFailed) and event.lost_output and not self.reruns \
                        and not self.can_rerun():  # (trial CJ: a stream's error did not say why)
                    event = dataclasses.replace(event, message=f"{event.message} (not run again: part of "
                                                               "the reply had reached the client)")
                if isinstance(event, RequestFailed) and self.reruns:
                    why = ("an output of its first run was lost with its host" if self._first_failure.lost_output
                           else "its first RequestActor never took it" if self._first_failure.not_started
                           else "its first run failed before any of it reached the client")
                    event = dataclasses.replace(event, message=f"{event.message} (after the request ran again: "
                                                               f"{why})")
                yield event
                return
            yield event


def _pipeline_request(request: web.Request, prefix: str, prompt: str,
                      output_types: frozenset[str], sampling: dict, params: dict,
                      stream: bool = False) -> PipelineRequest:
    rid = f"{prefix}-{uuid.uuid4().hex}"
    request[_RID] = rid
    return PipelineRequest(rid, prompt, output_types, sampling, params,
                           request.app[BRIDGE_KEY].request_timeout_s, stream)


def _failed(ev: RequestFailed, prompt_param: str = "messages") -> P.ApiError:
    """The error to answer for ``ev``; a refusal for load (the bridge's ``RequestRejected``,
    429) keeps its ``code`` and gets a ``Retry-After`` header. A 504 (the request's
    deadline passed) and a 500 of the pipeline (its stage failed on every replica it was
    tried on, or crashed them: the server retried it already) get ``x-should-retry:
    false``, the header with which OpenAI's clients skip their own retries (by default
    two more tries of any 5xx: three deadlines' wait, or a poison request crashing
    replicas again). A lost output's 500, and one for a request this server lost (its
    RequestActor exited or could not take it), are left to retry: nothing in the request caused them.
    So is a 503, but for a stage with no replica ready and none on its way, which would be
    the same a second later (``RequestFailed.none_coming``).
    A prompt over the context length (code ``context_length_exceeded``) names the request's
    ``prompt_param`` (``messages``; ``prompt`` for images) as its ``param``, as OpenAI's does."""
    headers = {}
    retry_after = getattr(ev, "retry_after_s", None)
    if retry_after is not None:  # (OpenAI's clients read retry-after-ms first: the wait to the ms)
        headers["Retry-After"] = str(math.ceil(retry_after))
        headers["retry-after-ms"] = str(round(retry_after * 1000))
    if ev.status == 504 or (ev.status == 500 and not ev.lost_output and not ev.lost_by_server) or ev.none_coming:
        headers["x-should-retry"] = "false"
    param = prompt_param if ev.code == CONTEXT_LENGTH_CODE else None
    return P.ApiError(ev.status, ev.message, ev.type, param=param, code=ev.code, headers=headers or None)


async def _wav(ev: OutputFinal, fmt: str = "wav") -> bytes:
    """The whole audio output as ``fmt``: a WAV file, or (``"pcm16"``) its raw int16
    little-endian samples."""
    from omni_actors.media import encode_wav

    if fmt == "pcm16":
        import numpy as np

        return np.asarray(ev.data["audio"], dtype="<i2").tobytes()
    return await asyncio.to_thread(encode_wav, ev.data["audio"], int(ev.data["sample_rate"]))


# ------------------------------------------------------------------ handlers

async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions`` (JSON or SSE with ``stream: true``)."""
    bridge: Bridge = request.app[BRIDGE_KEY]
    transcripts = request.app[_TRANSCRIPTS]
    creq = P.parse_chat_request(await _read_json(request), bridge, transcripts)
    preq = _pipeline_request(request, "chatcmpl", creq.prompt, creq.output_types,
                             creq.sampling_params(), creq.params(), creq.stream)
    if creq.stream:
        return await _stream_chat(request, bridge, creq, preq)
    created, deltas, text, audio, done = P.now(), [], None, None, RequestDone()
    async with _Run(bridge, preq, can_rerun=lambda: True) as run:  # (nothing is sent before the end)
        async for ev in run:
            if isinstance(ev, Rerun):
                deltas, text, audio, done = [], None, None, RequestDone()
            elif isinstance(ev, OutputText):
                if ev.text:
                    M.first_text(request, CHAT_PATH, stream=False)
                deltas.append(ev.text)
            elif isinstance(ev, OutputFinal) and ev.output_type == "text":
                if ev.data["text"]:
                    M.first_text(request, CHAT_PATH, stream=False)
                text = ev.data["text"]
            elif isinstance(ev, OutputFinal) and ev.output_type == "audio":
                audio = ev
            elif isinstance(ev, RequestDone):
                done = ev
            elif isinstance(ev, RequestFailed):
                raise _failed(ev)
    text = "".join(deltas) if text is None else text
    payload = None
    if audio is not None:
        payload = P.audio_payload(await _wav(audio, creq.audio_format), text, created)
        transcripts.keep(payload["id"], text, payload["expires_at"])
    elif "audio" in creq.output_types:
        _log().warning("http_no_audio", request_id=preq.request_id)
    finish = done.finish_reason or P.finish_reason(done.completion_tokens, creq.max_tokens)
    return await _reply_json(request, P.chat_completion(
        preq.request_id, creq.model, created, text, payload, finish,
        P.usage_dict(done.prompt_tokens, done.completion_tokens)))


async def _stream_chat(request: web.Request, bridge: Bridge, creq: P.ChatRequest,
                       preq: PipelineRequest) -> web.StreamResponse:
    """SSE: role chunk, content deltas, audio delta(s), finish chunk, usage, [DONE].

    Audio goes out as deltas of base64 PCM16 (mono, little-endian, at the
    stage's sample rate, at most 1 s each), the first with the audio's ``id``: as the last
    stage makes them when the pipeline streams between stages, else all at
    once when the whole audio is done; then a last audio delta with the
    transcript and ``expires_at``. A whole audio at another sample rate than
    the parts' 24 kHz goes out as one delta with a WAV, which says its rate.

    The response starts on the first event, so a failure before it is still
    a plain error response with its status.
    """
    rid, created, iu = preq.request_id, P.now(), creq.include_usage
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache", "X-Request-Id": rid})

    limit_s = send_timeout_s()

    async def write(data: bytes) -> None:
        await _write_within(request, resp, data, limit_s, "stream")

    async def send(obj: Any) -> None:
        await write(b"data: " + _encoder.encode(obj) + b"\n\n")

    def chunk(delta: dict, finish: str | None = None) -> dict:
        return P.chat_chunk(rid, creq.model, created, delta, finish, iu)

    streamed, audio, done, audio_id, held = [], None, None, None, ()
    async with _Run(bridge, preq, can_rerun=lambda: not resp.prepared) as run:
        try:
            async for ev in run:
                if isinstance(ev, Rerun):
                    audio = done = None  # (nothing was sent: the stream begins with the rerun's events)
                    continue
                if isinstance(ev, RequestFailed) and not resp.prepared:
                    raise _failed(ev)
                if not resp.prepared:
                    await resp.prepare(request)
                    await send(chunk({"role": "assistant", "content": ""}))
                if isinstance(ev, OutputText):
                    if ev.text:
                        streamed.append(ev.text)
                        await send(chunk({"content": ev.text}))
                        M.first_text(request, CHAT_PATH, stream=True)
                elif isinstance(ev, OutputFinal) and ev.output_type == "text":
                    # A final text that no delta carried (or only partly) goes out now.
                    so_far, final = "".join(streamed), ev.data["text"]
                    rest = final[len(so_far):] if final.startswith(so_far) else ""
                    if rest:
                        streamed.append(rest)
                        await send(chunk({"content": rest}))
                        M.first_text(request, CHAT_PATH, stream=True)
                elif isinstance(ev, OutputFinal) and ev.output_type == "audio" \
                        and int(ev.data.get("sample_rate") or P.AUDIO_PART_RATE) != P.AUDIO_PART_RATE:
                    audio = ev  # (parts are 24 kHz: a whole audio at another rate goes as one WAV, which says it)
                elif isinstance(ev, OutputPart | OutputFinal) and ev.output_type == "audio":
                    # (a whole audio too, as parts: one delta of it, tens of MB of base64 in one SSE
                    # line with long replies, was over some clients' line limits: a trial)
                    first = audio_id is None
                    audio_id = audio_id or P.audio_id()
                    pcm, held = P.whole_base64(ev.data["audio"], held)
                    for part in P.audio_parts(audio_id if first else None, pcm):
                        await send(chunk({"audio": part}))
                elif isinstance(ev, RequestDone):
                    done = ev
                elif isinstance(ev, RequestFailed):
                    M.set_outcome(request, ev.status)  # the 200 is sent; count the failure
                    request[_ERROR] = ev.message
                    await send(P.error_body(ev.message, ev.type, code=ev.code))
            if done is not None:
                if audio is not None:
                    payload = P.audio_payload(await _wav(audio, creq.audio_format), "".join(streamed), created)
                    request.app[_TRANSCRIPTS].keep(payload["id"], payload["transcript"], payload["expires_at"])
                    await send(chunk({"audio": payload}))
                elif audio_id is not None:
                    if len(held):  # (the last samples: their base64's padding ends the joined data)
                        await send(chunk({"audio": P.audio_part(None, held)}))
                    end = P.audio_end("".join(streamed), created)
                    request.app[_TRANSCRIPTS].keep(audio_id, end["transcript"], end["expires_at"])
                    await send(chunk({"audio": end}))
                finish = done.finish_reason or P.finish_reason(done.completion_tokens, creq.max_tokens)
                await send(chunk({}, finish))
                if iu:
                    await send(P.usage_chunk(rid, creq.model, created, P.usage_dict(
                        done.prompt_tokens, done.completion_tokens)))
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception as e:
            if not resp.prepared:
                raise
            if isinstance(e, P.ApiError):
                err = e
            else:
                _log().exception("http_stream_error", request_id=rid)
                err = P.ApiError(500, "The server had an error while streaming.", "server_error")
            M.set_outcome(request, err.status)
            request[_ERROR] = err.message
            await send(err.body())
    await write(b"data: [DONE]\n\n")
    await _send_within(request, resp.write_eof(), limit_s, "stream")
    return resp


async def images_generations(request: web.Request) -> web.Response:
    """``POST /v1/images/generations`` (one image, ``b64_json``)."""
    bridge: Bridge = request.app[BRIDGE_KEY]
    ireq = P.parse_image_request(await _read_json(request), bridge)
    preq = _pipeline_request(request, "img", ireq.prompt, frozenset({"image"}),
                             ireq.sampling_params(), ireq.params())
    image = None
    async with _Run(bridge, preq, can_rerun=lambda: True) as run:
        async for ev in run:
            if isinstance(ev, Rerun):
                image = None
            elif isinstance(ev, OutputFinal) and ev.output_type == "image":
                image = ev.data["image"]
            elif isinstance(ev, RequestFailed):
                raise _failed(ev, "prompt")
    if image is None:
        raise P.ApiError(500, "The pipeline produced no image.", "server_error")
    from omni_actors.media import encode_png

    png = await asyncio.to_thread(encode_png, image)
    return await _reply_json(request, P.image_response(P.now(), png))


async def list_models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the one served model."""
    return _json(P.models_list(request.app[BRIDGE_KEY].model_name, request.app[_CREATED]))


async def get_model(request: web.Request) -> web.Response:
    """``GET /v1/models/{model}``: the model card, or 404 ``model_not_found``."""
    name = request.match_info["model"]
    if name != request.app[BRIDGE_KEY].model_name:
        raise P.ApiError(404, f"The model '{name}' does not exist.", "invalid_request_error",
                         "model", "model_not_found")
    return _json(P.model_card(name, request.app[_CREATED]))


async def health(request: web.Request) -> web.Response:
    """``GET /health``: the HTTP layer is up."""
    return _json({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """``GET /ready``: a readiness probe (open, as ``/health``, which only says the HTTP
    layer is up: a trial's leader served ``/health`` 200 with a Thinker that could not
    load). 200 ``{"status": "ready"}`` when every stage has a ready replica (``status``'s
    ready); else 503 ``{"status": "not ready", "stages": [names without one]}`` (`status`
    says why: this route is open, so it tells nothing more),
    or ``{"status": "unknown", "error": ...}`` when the coordinator does not answer
    within 5 s. While the server stops, 503 as every route."""
    try:
        table = await request.app[BRIDGE_KEY].stages()
    except Exception as exc:  # noqa: BLE001 - a probe answers, whatever the bridge raised
        return _json({"status": "unknown", "error": str(exc) or type(exc).__name__}, status=503)
    if table.get("ready"):
        return _json({"status": "ready"})
    missing = [st["stage"] for st in table.get("stages", ()) if not st.get("ready_replicas")]
    return _json({"status": "not ready", "stages": missing}, status=503)


async def stages(request: web.Request) -> web.Response:
    """``GET /v1/stages``: the bridge's view of stages and replicas; a 503 when the
    coordinator does not answer in time (frozen, busy, being recreated: it was a 500 with a
    traceback in the log; a code review)."""
    try:
        return _json(await request.app[BRIDGE_KEY].stages())
    except asyncio.TimeoutError:
        raise P.ApiError(503, "the coordinator did not answer in time (busy, or being recreated); try again",
                         "server_error", code="service_unavailable") from None


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text (see :mod:`omni_actors.http.metrics`).

    The stage table is fetched first (collectors are synchronous); when the
    bridge fails or times out the answer is still 200, with the request
    metrics and ``omni_scrape_error 1``.
    """
    m: M.Metrics = request.app[M.METRICS_KEY]
    table = await m.fetch(request.app[BRIDGE_KEY])
    return web.Response(body=m.render(table), headers={"Content-Type": M.CONTENT_TYPE_LATEST})


async def _expect_handler(request: web.Request) -> None:
    """``Expect: 100-continue``: no ``100 Continue`` for a body its ``Content-Length``
    declares over the limit; the handler then refuses it at once (413, :func:`_read_json`),
    through the middlewares (logged, counted, after the key check) (trial BZ: curl, which
    asks so for bodies over 1 MB, uploaded the whole body to be refused); otherwise
    aiohttp's own answer."""
    if request.content_length is not None and request.content_length > request.app[_MAX_BODY]:
        return None
    return await _default_expect_handler(request)


ROUTES = [
    web.post(CHAT_PATH, M.timed(CHAT_PATH, chat_completions), expect_handler=_expect_handler),
    web.post(IMAGES_PATH, M.timed(IMAGES_PATH, images_generations), expect_handler=_expect_handler),
    web.get("/v1/models", list_models),
    web.get("/v1/models/{model:.+}", get_model),  # (ids such as zai-org/GLM-Image: a slash, unescaped)
    web.get("/v1/stages", stages),
    web.get("/health", health),
    web.get("/ready", ready),
    web.get("/metrics", metrics),
]


def create_app(bridge: Bridge, *, max_body_bytes: int = 1 << 20,
               api_key: str | None = None) -> web.Application:
    """Build the OpenAI-compatible app over ``bridge``.

    ``max_body_bytes`` bounds request bodies (413 beyond); ``api_key``, when
    set, is required as ``Authorization: Bearer <key>`` except on /health and /ready
    (``/metrics`` included). Each app has its own metrics registry.
    """
    app = web.Application(client_max_size=max_body_bytes, middlewares=[
        request_id_middleware, stopping_middleware, error_middleware, auth_middleware])
    app[BRIDGE_KEY] = bridge
    app[_API_KEY] = api_key or None
    app[_CREATED] = getattr(bridge, "created", 0) or P.now()  # (the pipeline's deploy time: one for all servers)
    app[_MAX_BODY] = max_body_bytes
    app[_STOPPING] = _Stopping()
    app[_TRANSCRIPTS] = P.AudioTranscripts()
    app[M.METRICS_KEY] = M.Metrics()
    app[M.METRICS_KEY].registry.register(M.RequestActorCollector(bridge))
    app.add_routes(ROUTES)
    return app


async def start_http(bridge: Bridge, host: str, port: int,
                     **create_app_kwargs: Any) -> web.AppRunner:
    """Serve ``create_app(bridge, **create_app_kwargs)`` on ``host:port``.

    Client disconnects cancel handlers (``handler_cancellation=True``), so
    abandoned requests are cancelled in the bridge. A connection idle for
    :data:`IDLE_CONNECTION_TIMEOUT_S`, between requests or before the first
    one's headers are complete, is closed. ``runner.cleanup()`` cancels the
    handlers still running :data:`CLEANUP_TIMEOUT_S` after it starts (the caller
    drains first: see ``omni_actors.system.leader.drain_http``). Returns the started
    runner (``runner.addresses[0][1]`` is the bound port, useful with port
    0); the caller calls ``await runner.cleanup()``.
    """
    runner = web.AppRunner(create_app(bridge, **create_app_kwargs),
                           handler_cancellation=True, access_log=None, keepalive_timeout=IDLE_CONNECTION_TIMEOUT_S,
                           shutdown_timeout=CLEANUP_TIMEOUT_S)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
