"""Connectors: stage outputs travel between actors by reference.

Use :func:`make_connector` for same-host traffic: small outputs ride inline
in the ref, larger ones go through shared memory. Whoever owns a request
releases its refs (:func:`release_all`) however the request ends.
"""

from __future__ import annotations

from typing import Any, Iterable

import structlog

from omni_actors.connectors.base import Connector, ConnectorRef, FieldLayout
from omni_actors.connectors.inline import ConnectorError, InlineConnector, plan
from omni_actors.connectors.shm import ShmConnector, default_prefix, list_segments, \
    sweep_segments

__all__ = [
    "Connector", "ConnectorError", "ConnectorRef", "FieldLayout", "InlineConnector",
    "LocalConnector", "ShmConnector", "default_prefix", "list_segments", "make_connector",
    "release_all", "sweep_segments",
]

log = structlog.get_logger(__name__)

DEFAULT_INLINE_THRESHOLD = 65536  # bytes; a 64 KiB message costs little next to a shm round trip


class LocalConnector:
    """Same-host connector: inline up to ``inline_threshold_bytes`` of packed
    array data, shared memory above. ``get``/``release`` dispatch on
    ``ref.kind``, so any process can read or release any local ref.
    """

    def __init__(self, inline_threshold_bytes: int = DEFAULT_INLINE_THRESHOLD,
                 prefix: str | None = None) -> None:
        if inline_threshold_bytes < 0:
            raise ValueError(f"inline_threshold_bytes must be >= 0, got {inline_threshold_bytes}")
        self.inline_threshold_bytes = inline_threshold_bytes
        self.inline = InlineConnector()
        self.shm = ShmConnector(prefix)

    def put(self, outputs: dict[str, Any]) -> ConnectorRef:
        """Raises TypeError (unpackable dtype) or OSError (shm full)."""
        layout, size, arrays = plan(outputs)
        target = self.inline if size <= self.inline_threshold_bytes else self.shm
        return target.put_planned(layout, size, arrays)

    def get(self, ref: ConnectorRef) -> dict[str, Any]:
        """Raises ConnectorError if the data is gone or the kind is unknown."""
        return self._for(ref).get(ref)

    def release(self, ref: ConnectorRef) -> None:
        """Idempotent; a no-op for inline refs."""
        self._for(ref).release(ref)

    def _for(self, ref: ConnectorRef) -> InlineConnector | ShmConnector:
        if ref.kind == "inline":
            return self.inline
        if ref.kind == "shm":
            return self.shm
        raise ConnectorError(f"unknown connector kind {ref.kind!r}")


def make_connector(inline_threshold_bytes: int = DEFAULT_INLINE_THRESHOLD,
                   prefix: str | None = None) -> Connector:
    """The connector engines use: see :class:`LocalConnector`.

    ``prefix`` names new shm segments; default ``$OMNI_ACTORS_SHM_PREFIX``,
    else ``"omni-actors-"``.
    """
    return LocalConnector(inline_threshold_bytes, prefix)


def release_all(refs: Iterable[ConnectorRef | None]) -> None:
    """Release every ref (None entries skipped); logs failures, never raises."""
    connector = None
    for ref in refs:
        if ref is None or ref.kind == "inline":
            continue
        try:
            connector = connector or LocalConnector()
            connector.release(ref)
        except Exception:
            log.warning("connector_release_failed", location=ref.location, exc_info=True)
