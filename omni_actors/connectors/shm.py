"""The shared-memory connector: one POSIX segment per ``put`` (same host only).

Lifetimes are ours, not the interpreter's. On Python < 3.13 every
``SharedMemory`` created *or attached* is registered with the process's
``multiprocessing`` resource tracker, which unlinks it when that process
exits (and prints "leaked shared_memory" warnings). A consumer that merely
read a segment would then destroy it for everyone. So we unregister right
after create and attach (3.13+: ``track=False``), and the request owner
calls :meth:`ShmConnector.release`; :func:`sweep_segments` reaps what a
crashed system left, found by its name prefix.
"""

from __future__ import annotations

import _posixshmem  # the C module behind SharedMemory: unlink without the tracker
import os
import sys
import threading
import uuid
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from omni_actors.connectors.base import ConnectorRef, FieldLayout
from omni_actors.connectors.inline import ConnectorError, InlineConnector, plan, \
    read_outputs, write_arrays

PREFIX_ENV = "OMNI_ACTORS_SHM_PREFIX"
DEFAULT_PREFIX = "omni-actors-"
SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shared memory; used to list and sweep

_TRACK_KWARGS = {"track": False} if sys.version_info >= (3, 13) else {}
# Register+unregister must pair up atomically: two threads attaching the same
# name would otherwise make the tracker remove it twice and print a KeyError.
_TRACK_LOCK = threading.Lock()


def default_prefix() -> str:
    """Segment name prefix: ``$OMNI_ACTORS_SHM_PREFIX``, else ``"omni-actors-"``.

    The actor system sets the variable per running system (``oa-<adminport>-``)
    so that its reaper sweeps only its own segments.
    """
    return os.environ.get(PREFIX_ENV) or DEFAULT_PREFIX


def _open(name: str, create: bool = False, size: int = 0) -> SharedMemory:
    with _TRACK_LOCK:
        shm = SharedMemory(name=name, create=create, size=size, **_TRACK_KWARGS)
        if not _TRACK_KWARGS:
            resource_tracker.unregister(shm._name, "shared_memory")
    return shm


def _close(shm: SharedMemory) -> None:
    try:
        shm.close()
    except BufferError:  # a view survived in a traceback; the mapping goes at GC
        pass


def _unlink(name: str) -> bool:
    """Unlink segment ``name``; False if it was already gone. Never touches the tracker."""
    try:
        _posixshmem.shm_unlink("/" + name)
        return True
    except FileNotFoundError:
        return False


class ShmConnector:
    """Outputs live in a shared-memory segment named ``ref.location``.

    ``put`` creates a segment of exactly the packed size; the caller (the
    request owner) must ``release`` the ref, or the segment outlives every
    process until swept. Outputs with no array bytes need no segment and
    come back as inline refs.
    """

    def __init__(self, prefix: str | None = None) -> None:
        self.prefix = default_prefix() if prefix is None else prefix
        if not self.prefix or "/" in self.prefix:
            raise ValueError(f"shared-memory prefix must be non-empty, without '/': {prefix!r}")
        self._inline = InlineConnector()

    def put(self, outputs: dict[str, Any]) -> ConnectorRef:
        """Copy the outputs' arrays into a new segment.

        Raises:
            TypeError: an array's dtype cannot be packed (object, structured).
            OSError: the segment cannot be created (``/dev/shm`` full).
        """
        return self.put_planned(*plan(outputs))

    def put_planned(self, layout: tuple[FieldLayout, ...], size: int,
                    arrays: list[np.ndarray]) -> ConnectorRef:
        """``put`` for a result of :func:`plan` (saves planning twice)."""
        if size == 0:
            return self._inline.put_planned(layout, size, arrays)
        name = f"{self.prefix}{uuid.uuid4().hex[:16]}"
        shm = _open(name, create=True, size=size)
        try:
            write_arrays(shm.buf, layout, arrays)
        except BaseException:
            _close(shm)
            _unlink(name)
            raise
        _close(shm)
        return ConnectorRef(kind="shm", size=size, layout=layout, location=name)

    def get(self, ref: ConnectorRef) -> dict[str, Any]:
        """Attach, copy every array out, and detach: the result owns its memory.

        Raises:
            ConnectorError: the segment is gone (released or swept) or too small.
        """
        if ref.kind == "inline":
            return self._inline.get(ref)
        if ref.kind != "shm" or not ref.location:
            raise ConnectorError(f"not a shared-memory ref: kind={ref.kind!r}")
        try:
            shm = _open(ref.location)
        except FileNotFoundError:
            raise ConnectorError(f"shared-memory segment {ref.location!r} not found: "
                                 "already released, or swept at shutdown") from None
        try:
            return read_outputs(shm.buf, ref.layout)
        finally:
            _close(shm)

    def release(self, ref: ConnectorRef) -> None:
        """Unlink the segment. Idempotent and silent if it is already gone.

        Processes still attached keep their mapping until they close it.
        """
        if ref.kind == "shm" and ref.location:
            _unlink(ref.location)


def list_segments(prefix: str) -> list[str]:
    """Names of the segments under ``/dev/shm`` that start with ``prefix``, sorted."""
    if not prefix:
        raise ValueError("refusing an empty prefix: it would match every segment")
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def sweep_segments(prefix: str) -> int:
    """Unlink every segment whose name starts with ``prefix``; return how many.

    Raises:
        ValueError: ``prefix`` is empty.
    """
    return sum(_unlink(name) for name in list_segments(prefix))
