"""Packing stage outputs into one buffer, and the inline connector.

A stage output dict maps field names to numpy arrays or other values
(scalars, str, bytes, None). :func:`plan` lays the arrays out back to back in
one buffer (C order, each at a 64-byte aligned offset), and str and bytes
values over :data:`SMALL_VALUE_BYTES` too (a long completion's text), and
describes every field with a :class:`FieldLayout`; other values ride in the
layout itself. Arrays are never pickled: only their raw bytes are copied.

Every ``get`` (inline, shared memory, remote) returns **read-only** arrays
that are views on the buffer they arrived in: consumers must copy what they
want to modify (``np.array(x)``).

The inline connector carries that buffer in ``ConnectorRef.payload``, so the
bytes travel inside the actor message. Use it only for small outputs (a 10 MB
actor message takes about 0.5 s between two actors here).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from omni_actors.connectors.base import PACKED_KINDS, ConnectorRef, FieldLayout

ALIGN = 64  # bytes; a cache line, and enough for any numpy dtype's alignment
#: A str (its UTF-8) or bytes value longer than this is packed in the buffer, as an array is,
#: not carried in the layout (which rides in actor messages whatever its size: a review
#: found a 200 kB text inline under a 64 KiB threshold).
SMALL_VALUE_BYTES = 1024


class ConnectorError(LookupError):
    """The data a ref points at cannot be read (released, swept, or corrupt)."""


def plan(outputs: dict[str, Any]) -> tuple[tuple[FieldLayout, ...], int, list[np.ndarray]]:
    """Lay out ``outputs`` in one buffer without copying anything yet.

    Returns ``(layout, size, arrays)``: one :class:`FieldLayout` per field in
    dict order, the buffer size in bytes (0 when there is no array data), and
    the C-contiguous arrays to write, in the order of the array fields.

    Raises:
        TypeError: a key is not a str, or an array has an object,
            structured or void dtype (those have no portable raw-byte form;
            ml_dtypes' bfloat16 is a void one to numpy).
    """
    layout: list[FieldLayout] = []
    arrays: list[np.ndarray] = []
    size = 0
    for key, value in outputs.items():
        if not isinstance(key, str):
            raise TypeError(f"output field names must be str, got {key!r}")
        kind = "array"
        if isinstance(value, (str, bytes)) and len(value) > SMALL_VALUE_BYTES // 4:
            raw = value.encode() if isinstance(value, str) else value
            if len(raw) > SMALL_VALUE_BYTES:
                # (by isinstance: numpy's str_ and bytes_ scalars are str and bytes too)
                value, kind = np.frombuffer(raw, dtype=np.uint8), "str" if isinstance(value, str) else "bytes"
        if not isinstance(value, np.ndarray):
            layout.append(FieldLayout(key=key, kind="value", value=value))
            continue
        dtype = value.dtype
        if dtype.hasobject or dtype.fields is not None:
            raise TypeError(f"field {key!r}: dtype {dtype} cannot be packed as raw bytes")
        if dtype.kind == "V":  # (ml_dtypes' bfloat16 reads '<V2': it would come back as bare bytes)
            raise TypeError(f"field {key!r}: dtype {dtype.name} is not one of numpy's own and would come back "
                            "as raw bytes (void); convert it first (bfloat16: .astype(np.float32))")
        # (ascontiguousarray would return such an array itself; it makes a subclass's instance, a
        # memmap or a matrix, a plain ndarray, and a 0-d array 1-d: its shape is put back, a code
        # review found a 0-d array read back with shape (1,))
        arr = value if type(value) is np.ndarray and value.flags.c_contiguous \
            else np.ascontiguousarray(value).reshape(value.shape)
        offset = -(-size // ALIGN) * ALIGN
        nbytes = arr.nbytes
        layout.append(FieldLayout(key, kind, arr.dtype.str, arr.shape, offset, nbytes))
        arrays.append(arr)
        size = offset + nbytes
    return tuple(layout), size, arrays


def array_bytes(arr: np.ndarray) -> np.ndarray:
    """The raw bytes of a C-contiguous array from :func:`plan`, as a flat uint8
    view (no copy; works for every packable dtype, datetime64 included)."""
    return arr.reshape(-1).view(np.uint8)


def pieces(layout: tuple[FieldLayout, ...], arrays: list[np.ndarray]) -> list[np.ndarray | bytes]:
    """The packed buffer as a list of byte pieces (zero padding and array views):
    ``b"".join(pieces(...))`` builds it with a single copy."""
    out: list[np.ndarray | bytes] = []
    pos = 0
    for field, arr in zip([f for f in layout if f.kind in PACKED_KINDS], arrays):
        if not field.nbytes:
            continue
        if field.offset > pos:
            out.append(bytes(field.offset - pos))
        out.append(array_bytes(arr))
        pos = field.offset + field.nbytes
    return out


def write_arrays(buf: memoryview | bytearray, layout: tuple[FieldLayout, ...],
                 arrays: list[np.ndarray]) -> None:
    """Copy ``arrays`` (from :func:`plan`) into ``buf`` at their offsets."""
    fields = [f for f in layout if f.kind in PACKED_KINDS]
    for field, arr in zip(fields, arrays):
        if field.nbytes:
            dst = np.frombuffer(buf, dtype=np.uint8, count=field.nbytes, offset=field.offset)
            dst[:] = array_bytes(arr)
            del dst  # drop the export so a shared-memory buffer can close


def read_outputs(buf: Any, layout: tuple[FieldLayout, ...]) -> dict[str, Any]:
    """Rebuild the outputs dict from ``buf`` (anything with the buffer protocol:
    bytes, an mmap, a numpy uint8 array) without copying: every array is a
    read-only view on ``buf`` and keeps it alive.

    Raises:
        ConnectorError: a field lies beyond the end of ``buf``.
    """
    out: dict[str, Any] = {}
    size = buf.nbytes if isinstance(buf, (memoryview, np.ndarray)) else memoryview(buf).nbytes
    for field in layout:
        if field.kind == "value":
            out[field.key] = field.value
            continue
        dtype = np.dtype(field.dtype)
        if field.offset + field.nbytes > size:
            raise ConnectorError(f"field {field.key!r} ends at byte "
                                 f"{field.offset + field.nbytes}, buffer has {size}")
        if field.kind in ("str", "bytes"):  # (a copy: nothing of it keeps the buffer)
            raw = bytes(memoryview(buf)[field.offset:field.offset + field.nbytes]) if field.nbytes else b""
            out[field.key] = raw.decode() if field.kind == "str" else raw
            continue
        if field.nbytes == 0 or dtype.itemsize == 0:
            arr = np.empty(field.shape, dtype=dtype)
        else:
            count = field.nbytes // dtype.itemsize
            arr = np.frombuffer(buf, dtype=dtype, count=count, offset=field.offset)
            if field.shape != (count,):
                arr = arr.reshape(field.shape)
        arr.flags.writeable = False
        out[field.key] = arr
    return out


class InlineConnector:
    """Outputs ride inside the ref: ``kind="inline"``, bytes in ``payload``.

    ``release`` is a no-op: the bytes go when the last ref is dropped.
    """

    def put(self, outputs: dict[str, Any]) -> ConnectorRef:
        """Raises TypeError if an array's dtype cannot be packed (see :func:`plan`)."""
        return self.put_planned(*plan(outputs))

    def put_planned(self, layout: tuple[FieldLayout, ...], size: int,
                    arrays: list[np.ndarray]) -> ConnectorRef:
        """``put`` for a result of :func:`plan` (saves planning twice)."""
        payload = b"".join(pieces(layout, arrays))  # one copy of the array bytes
        if len(payload) < size:  # a trailing empty array sits at an aligned offset past the data
            payload += bytes(size - len(payload))
        return ConnectorRef(kind="inline", size=size, layout=layout, payload=payload)

    def get(self, ref: ConnectorRef) -> dict[str, Any]:
        """Read-only views on ``ref.payload``. Raises ConnectorError if ``ref``
        is not an inline ref."""
        if ref.kind != "inline" or ref.payload is None:
            raise ConnectorError(f"not an inline ref: kind={ref.kind!r}")
        return read_outputs(ref.payload, ref.layout)

    def release(self, ref: ConnectorRef) -> None:
        pass
