"""Media encoding of final stage outputs: PCM -> WAV bytes, RGB array -> PNG bytes."""

from __future__ import annotations

import io
import numbers
import wave

import numpy as np

__all__ = ["encode_wav", "encode_png"]


def _describe(x: object) -> str:
    if isinstance(x, np.ndarray):
        return f"shape {x.shape} dtype {x.dtype}"
    return type(x).__name__


def encode_wav(pcm: np.ndarray, sample_rate: int) -> bytes:
    """Encode mono 16-bit PCM as a WAV file (stdlib :mod:`wave`).

    Args:
        pcm: ``int16[samples]`` (1-D, mono). An empty array gives a valid WAV
            with no frames.
        sample_rate: samples per second (Hz), a positive integer.

    Returns:
        The ``.wav`` file bytes (RIFF, PCM, 1 channel, 2-byte samples).

    Raises:
        ValueError: ``pcm`` is not a 1-D int16 array, or ``sample_rate`` is
            not a positive integer.
    """
    if not isinstance(pcm, np.ndarray) or pcm.dtype != np.int16 or pcm.ndim != 1:
        raise ValueError("encode_wav: pcm must be a 1-D int16 numpy array (mono), "
                         f"got {_describe(pcm)}")
    if (isinstance(sample_rate, bool) or not isinstance(sample_rate, numbers.Integral)
            or sample_rate <= 0):
        raise ValueError("encode_wav: sample_rate must be a positive integer (Hz), "
                         f"got {sample_rate!r}")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(sample_rate))
        w.writeframes(pcm.astype("<i2", copy=False).tobytes())
    return buf.getvalue()


def encode_png(image: np.ndarray) -> bytes:
    """Encode an RGB image as PNG (Pillow).

    Args:
        image: ``uint8[height, width, 3]``, height and width >= 1.

    Returns:
        The ``.png`` file bytes.

    Raises:
        ValueError: ``image`` is not a uint8 ``[H, W, 3]`` array with H, W >= 1.
    """
    if (not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3
            or image.shape[2] != 3 or image.shape[0] == 0 or image.shape[1] == 0):
        raise ValueError("encode_png: image must be a uint8 numpy array [height, width, 3] with "
                         f"height, width >= 1, got {_describe(image)}")
    from PIL import Image  # imported here: Pillow is only needed when images are served

    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image)).save(buf, format="PNG")
    return buf.getvalue()
