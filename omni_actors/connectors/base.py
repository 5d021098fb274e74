"""The connector protocol: stage outputs travel by reference.

The producing engine ``put``s its outputs and sends only the returned
:class:`ConnectorRef` in actor messages; the consumer ``get``s them; the
owner ``release``s the buffer when its request ends, however it ends.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class FieldLayout:
    """Where one output field lives inside a buffer.

    ``kind`` is ``"array"`` (``dtype``/``shape``/``offset``/``nbytes`` locate
    it), ``"str"`` or ``"bytes"`` (a large one, packed as its UTF-8 or raw bytes: ``offset``
    and ``nbytes`` locate them), or ``"value"`` (a small scalar, str or bytes, carried in
    ``value``).
    """

    key: str
    kind: str
    dtype: str = ""
    shape: tuple[int, ...] = ()
    offset: int = 0
    nbytes: int = 0
    value: Any = None


#: The kinds of :class:`FieldLayout` whose bytes are in the buffer.
PACKED_KINDS = frozenset({"array", "str", "bytes"})


@dataclass(frozen=True)
class OmniHandle:
    """Where a vLLM-Omni connector keeps one ``put`` (a ref of kind ``"omni"``).

    ``connector`` and ``extra`` (its settings as JSON, sorted keys) are what
    any process needs to build the same connector with vLLM-Omni's factory;
    ``from_stage``/``to_stage``/``key`` are what its ``put`` was called with;
    ``metadata`` is what that ``put`` returned (transport handles, or None).
    """

    connector: str
    extra: str
    from_stage: str
    to_stage: str
    key: str
    metadata: Any = None


@dataclass(frozen=True)
class ConnectorRef:
    """A reference to stage outputs.

    Attributes:
        kind: ``"inline"`` (bytes ride in ``payload``), ``"shm"`` (a
            shared-memory segment, a file in the node's ``$OMNI_ACTORS_SHM_DIR``,
            named ``location`` on node ``node``: mapped there, fetched from
            ``service`` elsewhere) or ``"tcp"`` (such a segment, always
            fetched from ``service``, even on its own node) or ``"omni"``
            (the packed array bytes kept by a vLLM-Omni connector, see ``omni``).
        size: bytes of array data.
        layout: one :class:`FieldLayout` per output field.
        location: the segment name for ``shm``/``tcp``, the key for
            ``omni``; None for inline.
        payload: the packed array bytes for ``inline``; None otherwise.
        node: the node the segment lives on (``$OMNI_ACTORS_NODE`` of its
            producer); None: a single-host system, every reader is local.
        service: ``"host:port"`` of that node's data service
            (``$OMNI_ACTORS_DATA_SERVICE`` of the producer), or None.
        omni: for ``omni`` refs, the vLLM-Omni connector and what its ``put``
            returned (:mod:`omni_actors.connectors.omni`); None otherwise.
    """

    kind: str
    size: int
    layout: tuple[FieldLayout, ...]
    location: str | None = None
    payload: bytes | None = None
    node: str | None = None
    service: str | None = None
    omni: OmniHandle | None = None


class Connector(Protocol):
    def put(self, outputs: dict[str, Any]) -> ConnectorRef: ...

    def get(self, ref: ConnectorRef) -> dict[str, Any]: ...

    def release(self, ref: ConnectorRef) -> None: ...

    def reads_remotely(self, ref: ConnectorRef) -> bool: ...


# -- the segment directory: where shared-memory segments (shm.py) and free ones (recycling.py) live
DIR_ENV = "OMNI_ACTORS_SHM_DIR"  #: the directory segments live in (a tmpfs); default SHM_DIR
SHM_DIR = "/dev/shm"  #: the default directory: where Linux keeps POSIX shared memory


def segment_dir() -> str:
    """The directory segments live in: ``$OMNI_ACTORS_SHM_DIR``, else ``/dev/shm``.

    Read from the environment on every call (not validated here: see
    :func:`~omni_actors.connectors.shm.check_segment_dir`)."""
    return os.environ.get(DIR_ENV) or SHM_DIR


def pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` to file ``fd`` at ``offset`` (one ``pwrite`` writes at most
    ~2 GiB). Raises OSError: the write failed (a full tmpfs: ENOSPC)."""
    done, total = 0, data.nbytes
    while done < total:
        n = os.pwrite(fd, data[done:], offset + done)
        if n <= 0:
            raise OSError(f"pwrite to shared memory wrote {n} bytes")
        done += n


def _unlink_in(directory: str, name: str) -> bool:
    try:
        os.unlink(os.path.join(directory, name))
        return True
    except (FileNotFoundError, IsADirectoryError):  # (a free directory is no segment)
        return False
