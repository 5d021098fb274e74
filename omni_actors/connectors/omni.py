"""vLLM-Omni's own connectors (Mooncake, ...) carrying stage outputs.

Where a config names a vLLM-Omni connector for a stage's outputs
(:class:`omni_actors.config.OmniConnectors`) and ``vllm_omni`` is importable
in that stage's engine process, the engine's
:class:`~omni_actors.connectors.NodeConnector` runs in mode ``omni:...``
(:func:`encode_mode`): outputs up to the inline threshold still ride inline,
larger ones go through the vLLM-Omni connector, built with vLLM-Omni's own
factory (``OmniConnectorFactory.create_connector(ConnectorSpec(name, extra))``).
Final outputs for the API server stay on our connectors (``put(..., final=True)``).

What is put is our packed form: the array bytes in one ``bytes`` object, laid
out as in a shared-memory segment, while the layout (dtypes, shapes, small
values) rides in the ref. So a ``get`` returns exactly what the other
connectors return (read-only views, dtypes and values as put), and a connector
that takes raw bytes (RDMA) needs no serializer. The ref (kind ``"omni"``)
carries an :class:`~omni_actors.connectors.base.OmniHandle`: the connector's
name and settings (to build the same connector in any process), the stage
identities and key given to its ``put``, and the metadata ``put`` returned.

``get`` and ``release`` work in any process that can build the same connector:
the first one in a process imports ``vllm_omni`` (seconds) and builds it;
built connectors are kept per (name, settings). Where ``vllm_omni`` is not
importable, ``get`` raises :class:`OmniConnectorError` and ``release`` logs
and leaves the data to the connector's own cleanup.

Semantics are the vLLM-Omni connector's (0.30):

- ``SharedMemoryConnector`` (and the transfer engines) hand a payload to its
  first reader: a second ``get`` of one ref finds nothing and raises
  :class:`OmniConnectorError` (a stage output read by two consuming stages, or
  read again by a retry after a replica died, fails the second time).
  It keeps its segments in ``/dev/shm`` whatever ``$OMNI_ACTORS_SHM_DIR`` says;
  keys start with this host's segment prefix, so the data service's reaper and
  the sweeps at start and stop (which go by prefix) free what a dead producer
  left there.
- ``MooncakeStoreConnector``'s ``cleanup`` does nothing (the store evicts):
  ``release`` does not build it in a process that has not (a Mooncake client
  per RequestActor just to do nothing). It needs a Mooncake master and the
  ``mooncake`` package (tested with ``mooncake-transfer-engine-non-cuda``
  0.3.11.post1, its store over TCP on loopback; later ones do not fit
  vLLM-Omni 0.30's connector).
- The transfer-engine connectors (:data:`TRANSFER_ENGINE_CONNECTORS`) need
  per-stage sender/receiver roles and ZMQ ports per replica, which
  vLLM-Omni's stage launcher works out: the config does not apply them.
"""

from __future__ import annotations

import importlib.util
import json
import queue
import threading
import uuid
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np
import structlog

from omni_actors.connectors.base import ConnectorRef, FieldLayout, OmniHandle
from omni_actors.connectors.inline import ConnectorError, pieces, plan, read_outputs

__all__ = ["KIND", "MODE_PREFIX", "OmniAdapter", "OmniConnectorError", "OmniDataMissing", "OmniMode", "OmniUnavailable",
           "SHARED_MEMORY", "TRANSFER_ENGINE_CONNECTORS", "available", "connector", "encode_mode", "get",
           "parse_mode", "release", "settings_json"]

log = structlog.get_logger(__name__)

KIND = "omni"  #: ``ConnectorRef.kind`` of outputs kept by a vLLM-Omni connector
MODE_PREFIX = "omni:"  #: connector modes naming a vLLM-Omni connector start with it
SHARED_MEMORY = "SharedMemoryConnector"
#: vLLM-Omni connectors that need sender/receiver roles resolved per stage and replica: not applied
TRANSFER_ENGINE_CONNECTORS = frozenset({"MooncakeTransferEngineConnector", "MoriTransferEngineConnector",
                                        "YuanrongTransferEngineConnector", "NixlConnector"})
#: vLLM-Omni connectors whose ``cleanup`` is a no-op (0.30): ``release`` does not build them
CLEANUP_IS_NOOP = frozenset({"MooncakeStoreConnector", "MooncakeConnector"})
TO_STAGE = "next"  #: ``to_stage`` of every put: the producer does not know which stage will read


class OmniConnectorError(RuntimeError):
    """A vLLM-Omni connector failed a ``get``, or has nothing for the ref
    (released, expired, or read already by a connector that hands each
    payload to its first reader). Not a :class:`ConnectorError`: an engine
    takes that for inputs released because their request ended and drops the
    task quietly, where this must fail the task with its reason."""


class OmniDataMissing(OmniConnectorError):
    """The connector has nothing for the ref (released, expired, or read already by a
    connector that hands each payload to its first reader): the same on any replica."""


class OmniUnavailable(OmniConnectorError):
    """``vllm_omni`` is not importable in this process."""


def available() -> bool:
    """Whether ``vllm_omni`` is installed here (found, not imported: cheap)."""
    try:
        return importlib.util.find_spec("vllm_omni") is not None
    except (ImportError, ValueError):
        return False


def settings_json(extra: dict[str, Any] | None) -> str:
    """A connector's ``extra`` settings as canonical JSON (sorted keys): what refs carry."""
    return json.dumps(extra or {}, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True)
class OmniMode:
    """A parsed ``omni:`` connector mode (see :func:`encode_mode`)."""

    name: str | None  #: the connector outputs go through; None: ours (only ``inputs`` to open)
    extra: str = "{}"  #: its settings, :func:`settings_json`
    stage: str = "any"  #: ``from_stage`` of its puts (the producing stage's id)
    inputs: tuple[tuple[str, str], ...] = ()  #: (name, settings) of connectors whose refs it reads


def encode_mode(name: str | None, extra: dict[str, Any] | None = None, *, stage: Any = None,
                inputs: Iterable[tuple[str, dict[str, Any] | None]] = ()) -> str:
    """The connector mode of an engine whose outputs go through vLLM-Omni
    connector ``name`` with settings ``extra`` (None: through ours), as stage
    ``stage``, and which reads refs of the connectors ``inputs`` (opened at
    start, so the first read does not import vLLM-Omni in the middle of a task).

    ``omni:<Name>`` alone (for ``$OMNI_ACTORS_CONNECTOR``) means no settings,
    stage ``any``."""
    body = {"name": name, "extra": extra or {}, "stage": "any" if stage is None else str(stage),
            "inputs": [[n, e or {}] for n, e in inputs]}
    return MODE_PREFIX + json.dumps(body, sort_keys=True, separators=(",", ":"))


def parse_mode(mode: str | None) -> OmniMode | None:
    """The :class:`OmniMode` of ``mode``; None when it is not an ``omni:`` mode.

    Raises:
        ValueError: an ``omni:`` mode that does not parse.
    """
    if not mode or not mode.startswith(MODE_PREFIX):
        return None
    rest = mode[len(MODE_PREFIX):]
    if not rest.startswith("{"):
        if not rest or not rest.isidentifier():
            raise ValueError(f"connector mode {mode!r}: expected omni:<ConnectorName> or omni:{{json}}")
        return OmniMode(rest)
    try:
        body = json.loads(rest)
        name = body.get("name")
        if name is not None and not isinstance(name, str):
            raise TypeError("name")
        inputs = tuple((str(n), settings_json(e)) for n, e in body.get("inputs") or ())
        return OmniMode(name, settings_json(body.get("extra")), str(body.get("stage", "any")), inputs)
    except (TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"connector mode {mode!r} does not parse: {exc}") from None


# -- the connectors of this process ---------------------------------------------------------------

_lock = threading.Lock()
_built: dict[tuple[str, str], Any] = {}


def connector(name: str, extra: str = "{}") -> Any:
    """This process's vLLM-Omni connector ``name`` with settings ``extra``
    (:func:`settings_json`), built with vLLM-Omni's factory on first use.

    Raises:
        OmniUnavailable: ``vllm_omni`` is not importable here.
        ValueError: vLLM-Omni's factory could not build it (its message says why:
            an unknown name, a missing package, a master it cannot reach).
    """
    key = (name, extra)
    with _lock:
        built = _built.get(key)
        if built is None:
            try:
                from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory
                from vllm_omni.distributed.omni_connectors.utils.config import ConnectorSpec
            except ImportError as exc:
                raise OmniUnavailable(f"vLLM-Omni's {name}: vllm_omni is not importable in this "
                                      f"process ({exc})") from exc
            built = _built[key] = OmniConnectorFactory.create_connector(
                ConnectorSpec(name=name, extra=json.loads(extra)))
            log.info("omni_connector_built", connector=name)
    return built


def close_all() -> None:
    """Close every vLLM-Omni connector built in this process (tests; a
    ``SharedMemoryConnector`` then unlinks what it put and nobody read)."""
    with _lock:
        built = list(_built.values())
        _built.clear()
    for c in built:
        try:
            c.close()
        except Exception:  # noqa: BLE001
            log.warning("omni_connector_close_failed", exc_info=True)


class OmniAdapter:
    """Puts packed outputs through vLLM-Omni connector ``name`` (settings
    ``extra``) as stage ``stage``; refs are ``kind="omni"``.

    The connector is built on the first :meth:`open` or put."""

    def __init__(self, name: str, extra: dict[str, Any] | str | None = None, *, stage: Any = "any",
                 prefix: str = "omni-actors-", node: str | None = None) -> None:
        self.name = name
        self.extra = extra if isinstance(extra, str) else settings_json(extra)
        self.stage = str(stage)
        self.prefix = prefix
        self.node = node

    def open(self) -> Any:
        """Build the connector now (raises what :func:`connector` raises)."""
        return connector(self.name, self.extra)

    def put(self, outputs: dict[str, Any]) -> ConnectorRef:
        return self.put_planned(*plan(outputs))

    def put_planned(self, layout: tuple[FieldLayout, ...], size: int, arrays: list[np.ndarray]) -> ConnectorRef:
        """Raises OSError when the vLLM-Omni connector refuses the put (it logs why)."""
        payload = b"".join(pieces(layout, arrays))  # one copy of the array bytes
        if len(payload) < size:  # a trailing empty array sits at an aligned offset past the data
            payload += bytes(size - len(payload))
        key = f"{self.prefix}vo-{uuid.uuid4().hex}"
        ok, _, metadata = self.open().put(self.stage, TO_STAGE, key, payload)
        if not ok:
            raise OSError(f"vLLM-Omni's {self.name} refused a put of {size} bytes (see its log)")
        handle = OmniHandle(self.name, self.extra, self.stage, TO_STAGE, key, metadata)
        return ConnectorRef(kind=KIND, size=size, layout=layout, location=key, node=self.node, omni=handle)


def get(ref: ConnectorRef) -> dict[str, Any]:
    """The outputs of an ``omni`` ref (read-only arrays, as every connector's ``get``).

    Raises:
        OmniConnectorError: the connector has nothing for it (released, expired,
            read already) or cannot be built here (:class:`OmniUnavailable`:
            no ``vllm_omni`` in this process).
    """
    h = _handle(ref)
    try:
        got = connector(h.connector, h.extra).get(h.from_stage, h.to_stage, h.key, h.metadata)
    except ValueError as exc:  # the factory could not build it
        raise OmniConnectorError(str(exc)) from exc
    if got is None:
        raise OmniDataMissing(f"vLLM-Omni's {h.connector} has nothing for {h.key} (released, expired, "
                                 f"or read already: some of its connectors hand data to the first reader)")
    data = got[0]
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise OmniConnectorError(f"vLLM-Omni's {h.connector} returned {type(data).__name__} for {h.key}, "
                                 f"not the bytes put")
    return read_outputs(data, ref.layout)


_unavailable_logged = False
_background: queue.Queue | None = None
_background_lock = threading.Lock()


def release(ref: ConnectorRef) -> None:
    """Ask the ref's connector to free its data (``cleanup(key)``). Never raises.

    Where ``vllm_omni`` is not importable it logs (once per process) and
    leaves the data to the connector's own cleanup; a connector whose cleanup
    is a no-op (:data:`CLEANUP_IS_NOOP`) is not built for this. Where the
    connector is not built yet in this process (a RequestActor), building it
    (importing vLLM-Omni: seconds) and the cleanup run on a worker thread, so
    the caller does not wait."""
    global _unavailable_logged
    try:
        h = _handle(ref)
        if (h.connector, h.extra) in _built:
            _cleanup(h)
        elif h.connector in CLEANUP_IS_NOOP:
            return
        elif not available():
            if not _unavailable_logged:
                _unavailable_logged = True
                log.warning("omni_release_skipped", connector=h.connector, key=h.key,
                            reason="vllm_omni is not installed in this process: left to the "
                                   "connector's own cleanup")
        else:
            _release_later(h)
    except Exception:  # noqa: BLE001
        log.warning("connector_release_failed", location=ref.location, exc_info=True)


def _cleanup(h: OmniHandle) -> None:
    try:
        connector(h.connector, h.extra).cleanup(h.key)
    except Exception:  # noqa: BLE001
        log.warning("connector_release_failed", connector=h.connector, key=h.key, exc_info=True)


def _release_later(h: OmniHandle) -> None:
    global _background
    with _background_lock:  # not _lock: a build may hold that for seconds
        if _background is None:
            _background = queue.Queue()
            threading.Thread(target=_release_worker, args=(_background,), name="omni-release",
                             daemon=True).start()
    _background.put(h)


def _release_worker(q: queue.Queue) -> None:
    while True:
        _cleanup(q.get())


def _handle(ref: ConnectorRef) -> OmniHandle:
    if ref.kind != KIND or ref.omni is None:
        raise ConnectorError(f"not a vLLM-Omni connector ref: kind={ref.kind!r}")
    return ref.omni
