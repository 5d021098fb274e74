"""Stage input processors and media encoding (WAV, PNG)."""

from __future__ import annotations

import io
import wave

import numpy as np
import pytest
from PIL import Image

from omni_actors.media import encode_png, encode_wav
from omni_actors.processors import ar2dit, default_input, talker2code2wav, thinker2talker


def thinker_out(n=4, prompt_tokens=3, hidden=8):
    return {"text": "a b c d", "token_ids": np.arange(n, dtype=np.int32),
            "hidden_states": np.ones((prompt_tokens + n, hidden), np.float32)}


# -- processors ------------------------------------------------------------------

def test_thinker2talker():
    out = thinker_out()
    got = thinker2talker({0: out}, "hi", {})
    assert set(got) == {"token_ids", "hidden_states"}
    assert got["token_ids"] is out["token_ids"]  # right dtype already: no copy
    assert got["hidden_states"].shape == (7, 8) and got["hidden_states"].dtype == np.float32
    # other integer / float dtypes are converted
    got = thinker2talker({0: {"token_ids": [1, 2], "hidden_states": np.zeros((2, 3), np.float64)}},
                         "", {})
    assert got["token_ids"].dtype == np.int32 and got["hidden_states"].dtype == np.float32


def test_thinker2talker_errors():
    with pytest.raises(ValueError, match="stage 0 outputs have no `hidden_states`"):
        thinker2talker({0: {"token_ids": np.zeros(2, np.int32)}}, "", {})
    with pytest.raises(ValueError, match="exactly one upstream"):
        thinker2talker({}, "", {})
    with pytest.raises(ValueError, match="exactly one upstream"):
        thinker2talker({0: thinker_out(), 1: thinker_out()}, "", {})
    with pytest.raises(ValueError, match="1-D"):
        thinker2talker({0: {"token_ids": np.zeros((2, 2), np.int32),
                            "hidden_states": np.zeros((2, 2), np.float32)}}, "", {})


def test_talker2code2wav_single_and_fan_in():
    a = np.full((3, 4), 1, np.int32)
    b = np.full((2, 4), 2, np.int32)
    c = np.full((1, 4), 3, np.int32)
    assert talker2code2wav({1: {"codes": a}}, "", {})["codes"] is a
    got = talker2code2wav({2: {"codes": b}, 1: {"codes": a}, 5: {"codes": c}}, "", {})["codes"]
    assert got.shape == (6, 4) and got.dtype == np.int32
    assert got[:, 0].tolist() == [2, 2, 1, 1, 1, 3]  # source order, not stage-id order


def test_talker2code2wav_errors():
    with pytest.raises(ValueError, match="at least one upstream"):
        talker2code2wav({}, "", {})
    with pytest.raises(ValueError, match="stage 2 outputs have no `codes`"):
        talker2code2wav({1: {"codes": np.zeros((1, 4), np.int32)}, 2: {"audio": 1}}, "", {})
    with pytest.raises(ValueError, match="different codebook counts"):
        talker2code2wav({1: {"codes": np.zeros((1, 4), np.int32)},
                         2: {"codes": np.zeros((1, 8), np.int32)}}, "", {})
    with pytest.raises(ValueError, match="2-D"):
        talker2code2wav({1: {"codes": np.zeros(4, np.int32)}}, "", {})


def test_ar2dit():
    prior = np.arange(16, dtype=np.int32)
    got = ar2dit({0: {"prior_token_ids": prior}}, "a cat", {"width": 64})
    assert set(got) == {"prior_token_ids", "prompt"}
    assert got["prompt"] == "a cat" and got["prior_token_ids"] is prior
    with pytest.raises(ValueError, match="prior_token_ids"):
        ar2dit({0: {"codes": prior}}, "a cat", {})


def test_default_input():
    assert default_input({}, "hello", {}) == {"prompt": "hello"}
    got = default_input({0: {"x": 1, "y": 1}, 1: {"y": 2, "prompt": "upstream"}}, "hello", {})
    assert got == {"x": 1, "y": 2, "prompt": "hello"}
    with pytest.raises(ValueError, match="must be a dict"):
        default_input({0: "nope"}, "hello", {})


# -- media -------------------------------------------------------------------------

def test_encode_wav_round_trip():
    pcm = (np.sin(np.arange(2400) / 5.0) * 10000).astype(np.int16)
    data = encode_wav(pcm, 24000)
    with wave.open(io.BytesIO(data)) as w:
        assert w.getnchannels() == 1 and w.getsampwidth() == 2 and w.getframerate() == 24000
        assert w.getnframes() == 2400
        assert w.getnframes() / w.getframerate() == pytest.approx(0.1)
        assert np.frombuffer(w.readframes(2400), "<i2").tolist() == pcm.tolist()


def test_encode_wav_of_synthetic_audio_has_duration():
    import asyncio

    import msgspec

    from omni_actors.config import StageSpec, SyntheticCost
    from omni_actors.engines.base import BackendTask
    from omni_actors.engines.synthetic import SyntheticEngine

    async def main():
        spec = msgspec.convert({"stage_id": 2, "engine_args": {"model_stage": "code2wav"}},
                               StageSpec)
        eng = SyntheticEngine(spec, SyntheticCost(), "code2wav/0")
        await eng.start()
        codes = np.arange(40, dtype=np.int32).reshape(5, 8)
        return [ev async for ev in eng.generate(BackendTask("r", {"codes": codes}))][-1].outputs

    out = asyncio.run(main())
    with wave.open(io.BytesIO(encode_wav(out["audio"], out["sample_rate"]))) as w:
        assert w.getnframes() / w.getframerate() == pytest.approx(5 * 0.08)  # 80 ms frames


@pytest.mark.parametrize("pcm,rate", [
    (np.zeros(10, np.float32), 24000),
    (np.zeros((10, 2), np.int16), 24000),
    ([0, 1, 2], 24000),
    (np.zeros(10, np.int16), 0),
    (np.zeros(10, np.int16), 24000.5),
])
def test_encode_wav_rejects_bad_input(pcm, rate):
    with pytest.raises(ValueError):
        encode_wav(pcm, rate)


def test_encode_png_round_trip():
    img = np.zeros((30, 50, 3), np.uint8)
    img[:, :25, 0] = 255
    data = encode_png(img)
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(io.BytesIO(data)) as im:
        assert im.format == "PNG" and im.size == (50, 30) and im.mode == "RGB"
        assert np.array_equal(np.asarray(im), img)
    # non-contiguous views encode too
    assert Image.open(io.BytesIO(encode_png(img[::2, ::2]))).size == (25, 15)


@pytest.mark.parametrize("image", [
    np.zeros((4, 4, 3), np.float32),
    np.zeros((4, 4), np.uint8),
    np.zeros((4, 4, 4), np.uint8),
    np.zeros((0, 4, 3), np.uint8),
    [[0, 0, 0]],
])
def test_encode_png_rejects_bad_input(image):
    with pytest.raises(ValueError):
        encode_png(image)
