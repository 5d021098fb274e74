"""Structured logs: structlog, one JSON event per line.

Every actor process inherits this configuration (actors are forked from the
process that started the actor system). Events carry ``request_id``,
``stage`` and ``replica`` as fields where they apply.
"""

from __future__ import annotations

import logging
import os
import re
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


def _add_pid(logger, method_name: str, event_dict: dict) -> dict:
    """Every event says which process logged it: module-level loggers (the connectors') bind
    none (trial CN could not tell which process skipped releases)."""
    event_dict.setdefault("pid", os.getpid())
    return event_dict


def configure_logging(level: str | None = None, stream=None) -> None:
    """Configure structlog for this process and its future forks.

    ``level`` defaults to ``$OMNI_ACTORS_LOG_LEVEL`` or ``info``; ``stream``
    to ``sys.stderr``.
    """
    name = (level or os.environ.get("OMNI_ACTORS_LOG_LEVEL") or "info").lower()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _add_pid,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(name, logging.INFO)),
        # One write per event, newline included (PrintLogger's print() makes two when the
        # stream is unbuffered, PYTHONUNBUFFERED=1): every actor process shares the file,
        # and two writes let another process's line in between (seen: two events merged
        # on one line, unparseable).
        logger_factory=structlog.WriteLoggerFactory(_Tolerant(stream or sys.stderr)),
        cache_logger_on_first_use=False,
    )
    for logger_name in JSON_STDLIB_LOGGERS:
        logger = logging.getLogger(logger_name)
        if not any(isinstance(f, _StdlibToJson) for f in logger.filters):
            logger.addFilter(_StdlibToJson())


class _Tolerant:
    """A log stream whose writes fail silently once nobody reads it: a closed terminal
    (EIO), a pipe whose reader exited (``start ... | tee``, Ctrl-C killing ``tee`` too). A
    log line is not worth a stop: the leader's drain raised at its first line, and its
    requests in flight were cut with no answer (a code review)."""

    def __init__(self, stream) -> None:
        self._stream = stream

    def write(self, text: str) -> None:
        try:
            self._stream.write(text)
        except (OSError, ValueError):  # (ValueError: the stream was closed)
            pass

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (OSError, ValueError):
            pass


class _StdlibToJson(logging.Filter):
    """Re-emits a stdlib logger's records (aiohttp's "Error handling request" with a
    40-line traceback, when a client hangs up mid-request) as one JSON event each, so
    that the log stays one event per line. A connection the client reset is an
    ``info`` event without a traceback: a client leaving is not a server error."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        log = get_logger(logger=record.name)
        if isinstance(exc, ConnectionResetError):
            log.info("client_connection_lost", message=record.getMessage(), error=str(exc) or type(exc).__name__)
        elif _is_bad_http(exc):
            # A client that does not speak HTTP (a bad Content-Length, a broken request line): it
            # got its 400 from aiohttp's parser; one line, not a server error with a traceback.
            text = " ".join(redact_credentials(str(getattr(exc, "message", "") or exc)).split())
            if len(text) > BAD_HTTP_TEXT_MAX:
                text = text[:BAD_HTTP_TEXT_MAX] + f"... ({len(text)} characters)"
            log.info("bad_http_request", error=text or type(exc).__name__)
        else:
            emit = {logging.DEBUG: log.debug, logging.INFO: log.info,
                    logging.WARNING: log.warning}.get(record.levelno, log.error)
            emit("stdlib_log", message=record.getMessage(), exc_info=record.exc_info or None)
        return False  # (its own handler would print it again, as plain text)


#: Characters of a malformed request's parse error logged (aiohttp quotes the request's head,
#: up to 8 KiB of it: trial CP's flood of them made a line each that long).
BAD_HTTP_TEXT_MAX = 400
#: A header that carries a credential (``Authorization``, ``Cookie``, ``X-Api-Key``,
#: ``X-Auth-Token``...) and what follows it up to the end of its line (a real line end, or
#: the ``\\n`` of a quoted one), or a Bearer token anywhere.
_CREDENTIAL = re.compile(r"(?i)((?:proxy-)?authorization|cookie|[a-z-]*api[-_]?key|[a-z-]*token)(\s*:\s*)"
                         r"(?:(?!\\r|\\n|[\r\n]).)*|\b(bearer\s+)[^\s'\"]+")
#: A bytes literal aiohttp quotes from the request (``b'...'``; backslash escapes inside).
_QUOTED = re.compile(r"b(['\"])((?:\\.|(?!\1).)*)\1", re.S)
#: What a quoted part of a request may start with to be logged: a request line (its method and
#: what follows), or a header's name and a space. Anything else may be a header's value alone
#: (a folded line, a line over the limit, the pure-Python parser's bad value: trial CR and a
#: review found API keys logged so).
_LOGGABLE = re.compile(r"(?:[A-Z]+ \S|[A-Za-z0-9!#$%&*+.^_`|~-]+: )")
#: A credential in a URL's query (``?api_key=...``).
_QUERY_CREDENTIAL = re.compile(r"(?i)([?&;](?:api[_-]?key|key|token|access_token|auth)=)[^&;\s'\"\\]*")


def _redact(text: str) -> str:
    text = _QUERY_CREDENTIAL.sub(r"\1<redacted>", text)
    return _CREDENTIAL.sub(lambda m: (m.group(1) + m.group(2) if m.group(1) else m.group(3)) + "<redacted>", text)


def redact_credentials(text: str) -> str:
    """``text`` with the values of credential headers (``Authorization``, ``Cookie``,
    ``*Api-Key``, ``*Token``), Bearer tokens and credentials in a URL's query replaced by
    ``<redacted>``, and every quoted part of the request that starts with neither a request
    line nor a header's name (a value quoted alone) left out: aiohttp's error for a
    malformed request quotes its head, and trial CP found the API key in the log."""
    out, at = [], 0
    for m in _QUOTED.finditer(text):
        q, body = m.group(1), m.group(2)
        out.append(_redact(text[at:m.start()]))
        out.append(f"b{q}{_redact(body)}{q}" if _LOGGABLE.match(body) else f"b{q}<{len(body)} characters not logged>{q}")
        at = m.end()
    out.append(_redact(text[at:]))
    return "".join(out)


def _is_bad_http(exc: BaseException | None) -> bool:
    """Whether ``exc`` is aiohttp's parse error for a malformed HTTP request (or a body
    that does not decode: a payload error caused by one)."""
    if exc is None:
        return False
    try:
        from aiohttp.http_exceptions import BadHttpMessage
    except ImportError:  # pragma: no cover - aiohttp is a dependency
        return False
    return isinstance(exc, BadHttpMessage) or isinstance(exc.__cause__, BadHttpMessage)


#: Stdlib loggers whose records are re-emitted as JSON events (:class:`_StdlibToJson`).
JSON_STDLIB_LOGGERS = ("aiohttp.server", "aiohttp.web", "aiohttp.internal")


def get_logger(**fields):
    """A bound logger; add ``pid`` so events from forked actors can be told apart."""
    return structlog.get_logger().bind(pid=os.getpid(), **fields)


#: In Thespian's "Pending Actor create for ... failed (3585): ..." (3585 is its
#: ``ERROR_ActorSystem_Shutting_Down``): a child asked for while the system stops.
SHUTTING_DOWN_CREATE = "failed (3585)"
#: ... "failed (3586)" (``ERROR_No_Compatible_ActorSystem``): no host of the convention offers the
#: capabilities the actor requires (an agent asked for on a member that has gone).
NO_HOST_CREATE = "failed (3586)"


class ThespianJsonFormatter(logging.Formatter):
    """Thespian's own log records (its logger process) as JSON events like ours: event
    ``thespian``, its ``level`` and ``message``, a UTC ``timestamp``, the ``pid`` of the
    process that logged it. (They were plain text lines among the JSON ones.)"""

    def format(self, record: logging.LogRecord) -> str:
        import datetime
        import json

        when = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        message = record.getMessage()
        level = record.levelname.lower()
        if SHUTTING_DOWN_CREATE in message:
            # An actor asked for a child while the system stopped (a pool placing a replica):
            # Thespian logs it as an error at every clean stop with member replicas (trial AP).
            level = "info"
            message += " (the system was stopping: an actor asked for then is not made; no fault)"
        elif NO_HOST_CREATE in message:
            # (trial CD: a bare error line after each member SIGKILLed, from the agent asked for there;
            # an error still: an actor no host can take may be a replica that never starts)
            message = message.rstrip()
            message += (" " if message.endswith(":") else "; ") + (
                "no host of the convention offers what the actor requires (a member it was asked for on has gone?)")
        event = {"event": "thespian", "level": level, "message": message,
                 "pid": record.process, "timestamp": when.isoformat().replace("+00:00", "Z")}
        if record.exc_info:
            event["exception"] = self.formatException(record.exc_info)
        return json.dumps(event)


def thespian_log_defs(level: str = "WARNING") -> dict:
    """``logDefs`` for ``ActorSystem``: Thespian's own stdlib logging to stderr
    at WARNING, instead of its default file, as JSON events (:class:`ThespianJsonFormatter`)."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": ThespianJsonFormatter}},
        "handlers": {"err": {"class": "logging.StreamHandler", "formatter": "json",
                             "stream": "ext://sys.stderr", "level": level}},
        "root": {"handlers": ["err"], "level": level},
    }
