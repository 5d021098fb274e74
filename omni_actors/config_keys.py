"""Config keys that are probably typos: warned about, never refused.

vLLM-Omni keeps keys of a stage it does not know (a legacy stage config's
``yaml_extras`` such as ``tts_args``; a deploy file's stage keys are engine
arguments, passed on), and vLLM's engine arguments number in the hundreds and
change between releases: the set of valid keys is open. So a key is never
refused for being unknown; one that is not known here but is a near miss of a
key that is (a typo: ``final_ouput``) is warned about, with the key meant.
The top level of a legacy config is the exception: its keys are few and
known, so any other one there is warned about (still not refused).
"""

from __future__ import annotations

import difflib
from typing import Any


#: Keys of a legacy ``stage_args`` entry: ours, and those vLLM-Omni's legacy stage
#: configs (and its ``StageConfig.to_omegaconf``) use.
_STAGE_KEYS = frozenset({
    "stage_id", "engine_args", "engine_input_source", "custom_process_input_func", "final_output",
    "final_output_type", "default_sampling_params", "runtime",
    "stage_type", "session_mode", "is_comprehension", "sampling_constraints", "input_connectors",
    "output_connectors", "default_pooling_params", "subtalker_sampling_params", "tts_args",
    "prompt_transform_func", "prompt_expand_func", "cfg_kv_collect_func", "async_chunk"})
#: Keys of a stage's ``runtime`` block (legacy configs; a deploy file's stages).
_RUNTIME_KEYS = frozenset({"devices", "process", "max_batch_size", "num_replicas", "env",
                           "requires_multimodal_data"})
#: Engine arguments this project reads or sees most. Only near misses of these are
#: warned about: a larger set made legitimate vLLM 0.32 / vLLM-Omni 0.30 arguments
#: (``ec_transfer_config``, ``mm_processor_cache_type``) look like typos of shipped keys.
_ENGINE_KEYS = frozenset({
    "model_stage", "model", "model_arch", "worker_type", "stage_type", "hf_config_name",
    "engine_output_type", "model_subdir", "tokenizer_subdir", "requires_multimodal_data",
    "custom_process_next_stage_input_func", "requires_full_payload_input", "is_comprehension",
    "omni_kv_config", "stage_id", "final_output", "final_output_type", "vllm_omni_pipeline", "tensor_parallel_size",
    "pipeline_parallel_size", "data_parallel_size", "gpu_memory_utilization", "max_model_len",
    "max_num_seqs", "max_num_batched_tokens", "enforce_eager", "trust_remote_code", "dtype",
    "enable_prefix_caching", "enable_chunked_prefill", "distributed_executor_backend",
    "quantization", "worker_cls", "scheduler_cls", "tokenizer", "seed"})
#: Sampling parameters (vLLM's ``SamplingParams`` and OpenAI's): near misses of these in a
#: stage's ``default_sampling_params`` are warned about (trial BT: `max_token: 32` on a synthetic
#: stage, which ignores what it does not know, passed in silence; a vLLM stage refuses it).
_SAMPLING_KEYS = frozenset({
    "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p",
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs",
    "prompt_logprobs", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "bad_words", "logit_bias", "allowed_token_ids", "truncate_prompt_tokens",
    "structured_outputs", "extra_args"})
#: Top-level keys of a legacy config: ours, and those vLLM-Omni's legacy stage configs carry.
_TOP_KEYS = frozenset({"stage_args", "deployment", "runtime", "async_chunk", "env"})
#: Top-level keys of a deploy-format file: ours, and those vLLM-Omni's deploy files carry
#: (besides the engine arguments set there for every stage, see ``PIPELINE_WIDE``). Only
#: near misses are warned about: the deploy format is vLLM-Omni's, and grows.
_DEPLOY_TOP_KEYS = frozenset({
    "stages", "base_config", "pipeline", "topology", "deployment", "model", "env", "async_chunk",
    "connectors", "edges", "platforms", "session_mode", "model_runner", "duplex_session",
    "forced_aligner", "active_stream_window"})
#: Keys of a legacy config's top-level ``runtime`` block (vLLM-Omni's stage configs).
_LEGACY_RUNTIME_KEYS = frozenset({"enabled", "defaults", "connectors", "edges"})
#: Keys of a ``SharedMemoryConnector``'s ``extra`` that this project reads.
_SHM_EXTRA_KEYS = frozenset({"shm_threshold_bytes"})
_SAMPLING_FATE = "vLLM refuses it; the synthetic engine ignores it"
#: Stage keys of the other format, and this format's key for the same thing.
_OTHER_FORMAT = {"input_sources": "engine_input_source"}


def near_miss(key: str, known: frozenset[str]) -> str | None:
    """The known key ``key`` is probably a typo of: close by difflib (ratio >= 0.85) and
    within 2 characters in length (``data_parallel_size_local`` is not a typo of
    ``data_parallel_size``); None when ``key`` is known or close to none."""
    if key in known:
        return None
    swapped = next((k for k in sorted(known) if _one_swap(key, k)), None)
    if swapped:  # (`modle`: difflib rates a swap in a short key below the cutoff)
        return swapped
    close = difflib.get_close_matches(key, sorted(known), n=3, cutoff=0.85)
    return next((k for k in close if abs(len(k) - len(key)) <= 2), None)


def _one_swap(a: str, b: str) -> bool:
    """``a`` is ``b`` with two neighbouring characters swapped."""
    if len(a) != len(b) or a == b:
        return False
    diff = [i for i in range(len(a)) if a[i] != b[i]]
    return len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]]


def _connector_extras(connectors: Any, path: str) -> list[tuple[str, str]]:
    """Near misses in the ``extra`` of each ``SharedMemoryConnector`` of ``connectors``
    (name -> ``{name, extra}``): a misspelt ``shm_threshold_bytes`` left the default."""
    out: list[tuple[str, str]] = []
    for key, spec in (connectors.items() if isinstance(connectors, dict) else ()):
        if isinstance(spec, dict) and spec.get("name") == "SharedMemoryConnector":
            out += _check_keys(spec.get("extra"), _SHM_EXTRA_KEYS, f"{path}.{key}.extra", "ignored")
    return out


def _check_keys(mapping: Any, known: frozenset[str], path: str, fate: str,
                aliases: dict[str, str] | None = None, every: bool = False) -> list[tuple[str, str]]:
    """Warnings for the keys of ``mapping`` that are near misses of ``known`` ones; with
    ``every`` (a closed set of keys: a legacy config's top level) for every unknown key."""
    out: list[tuple[str, str]] = []
    if not isinstance(mapping, dict):
        return out
    for key in mapping:
        if not isinstance(key, str):
            continue
        meant = (aliases or {}).get(key) or near_miss(key, known)
        where = f"{path}.{key}" if path else key
        if meant is not None and meant != key:
            out.append((where, f"unknown key ({fate}); did you mean `{meant}`?"))
        elif every and key not in known:  # (trial BA: `colour: blue` at the top passed in silence)
            out.append((where, f"unknown key ({fate}); expected one of: {', '.join(sorted(known))}"))
    return out


def unknown_key_warnings(data: Any) -> list[tuple[str, str]]:
    """``(YAML path, message)`` for each key of a decoded config that is probably a
    typo (see above): at the top of a legacy config (ignored), in a ``stage_args`` entry (ignored), its
    ``runtime`` (ignored) and its ``engine_args`` (passed to the engine as they
    are); at the top of a deploy file (ignored) and in its ``stages`` entries (and each
    platform's), whose other keys are engine arguments. Pure: nothing is logged."""
    out: list[tuple[str, str]] = []
    if not isinstance(data, dict):
        return out
    if "stages" not in data and "base_config" not in data:  # (a trial's `runtim:` took its connectors away)
        # (every unknown key of a legacy config's; a document without `stage_args` is none:
        # vLLM-Omni ships YAMLs of other settings, such as its forced aligner's)
        out += _check_keys(data, _TOP_KEYS, "", "ignored", every="stage_args" in data)
        runtime = data.get("runtime")  # (trial CH: `conectors:`, `edgs:` there passed in silence)
        out += _check_keys(runtime, _LEGACY_RUNTIME_KEYS, "runtime", "ignored")
        out += _connector_extras(runtime.get("connectors") if isinstance(runtime, dict) else None,
                                 "runtime.connectors")
    stage_args = data.get("stage_args")
    if isinstance(stage_args, list) and "stages" not in data:
        for i, entry in enumerate(stage_args):
            p = f"stage_args[{i}]"
            if not isinstance(entry, dict):
                continue
            out += _check_keys(entry, _STAGE_KEYS, p, "ignored", _OTHER_FORMAT)
            out += _check_keys(entry.get("runtime"), _RUNTIME_KEYS, f"{p}.runtime", "ignored")
            out += _check_keys(entry.get("engine_args"), _ENGINE_KEYS, f"{p}.engine_args",
                               "passed to the engine, which may refuse it")
            out += _check_keys(entry.get("default_sampling_params"), _SAMPLING_KEYS,
                               f"{p}.default_sampling_params", _SAMPLING_FATE)
        return out
    if "stages" not in data and "base_config" not in data:
        return out
    lists = [("stages", data.get("stages"))]
    platforms = data.get("platforms")
    if isinstance(platforms, dict):
        lists += [(f"platforms.{name}.stages", p.get("stages")) for name, p in platforms.items()
                  if isinstance(p, dict)]
    from omni_actors.vllm_omni_deploy import _STAGE_OWN, PIPELINE_WIDE  # (stage keys not engine arguments)

    # (a deploy file's `async_chunks:` or `conectors:` at the top passed in silence)
    out += _check_keys(data, _DEPLOY_TOP_KEYS | frozenset(PIPELINE_WIDE), "", "ignored")
    out += _connector_extras(data.get("connectors"), "connectors")
    if "runtime" in data:  # (trial CH: a legacy config's `runtime.connectors` here went unread, unsaid)
        out.append(("runtime", "ignored: the `stage_args` format's block; a deploy file names its connectors "
                               "and edges at the top level (`connectors:`, `edges:`)"))

    for where, stages in lists:
        if not isinstance(stages, list):
            continue
        for i, entry in enumerate(stages):
            p = f"{where}[{i}]"
            if not isinstance(entry, dict):
                continue
            out += _check_keys(entry, _ENGINE_KEYS | _STAGE_OWN, p, "passed to the engine, which may refuse it")
            out += _check_keys(entry.get("runtime"), _RUNTIME_KEYS, f"{p}.runtime", "ignored")
            for sub in ("engine_args", "engine_extras"):
                out += _check_keys(entry.get(sub), _ENGINE_KEYS, f"{p}.{sub}", "passed to the engine, which may refuse it")
            out += _check_keys(entry.get("default_sampling_params"), _SAMPLING_KEYS,
                               f"{p}.default_sampling_params", _SAMPLING_FATE)
    return out
