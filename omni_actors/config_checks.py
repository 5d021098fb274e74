"""Checks of a parsed config that span fields: the stage graph (ids, names, edges,
cycles, a final output), devices, per-stage settings against the deployment, CPU
lists, and that each stage's processor imports. Each raises a
:class:`~omni_actors.config.ConfigError` with the YAML path of the field at fault.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import threading

from omni_actors.config import SEED_MIN, ConfigError, PipelineConfig, StageSpec


def _check_cpus(cfg: PipelineConfig, source: str) -> None:
    """``deployment.stages.<stage>.cpus`` parses as a CPU list (whether the node has
    those CPUs is checked where the replica starts); on a backend that cannot pin
    its engine it is noted as not applied (``status`` shows the notes)."""
    from omni_actors.engines.vllm_core import _cpu_list

    for s in cfg.stage_args:
        dep = cfg.deployment_of(s)
        if isinstance(dep.cpus, int):
            if dep.cpus < 0:
                raise ConfigError(source, f"deployment.stages.{s.name}.cpus", f"{dep.cpus} is not a CPU number")
            dep.cpus = str(dep.cpus)
        if not dep.cpus:
            continue
        try:
            _cpu_list(dep.cpus)
        except ValueError as exc:
            raise ConfigError(source, f"deployment.stages.{s.name}.cpus", str(exc)) from None
        if dep.backend != "vllm":
            note = (f"deployment.stages.{s.name}.cpus: not applied: only the vllm backend pins its engine "
                    f"(backend: {dep.backend})")
            if note not in cfg.omni_connectors.notes:
                cfg.omni_connectors.notes.append(note)


def _note_runner_handover(cfg: PipelineConfig) -> None:
    """A note (``status``, ``check-config``) on the outputs this config cannot serve: those
    whose stages include one fed by vLLM-Omni's model-runner hand-over
    (:meth:`~omni_actors.config.PipelineConfig.runner_handover_stages`); their requests get
    a 400 (:func:`~omni_actors.planning.plan_request`). A review: Qwen3-Omni's Talker ran its
    processor's placeholder prompt without the Thinker's payload, and its engine failed."""
    for s in cfg.stage_args:  # (a KV cache handed over the same way: not refused, said; trial CA)
        kv = s.engine_args.get("omni_kv_config")
        if isinstance(kv, dict) and kv.get("need_recv_cache") is True and s.engine_input_source \
                and cfg.deployment_of(s).backend == "vllm_omni":
            note = (f"stage {s.name}: `omni_kv_config.need_recv_cache`: the KV cache vLLM-Omni hands to it "
                    f"from stage(s) {', '.join(cfg.stage(i).name for i in s.engine_input_source)} between its "
                    "own stage engines does not reach another replica's engine: it runs without it (not tried "
                    "on a GPU here)")
            if note not in cfg.omni_connectors.notes:
                cfg.omni_connectors.notes.append(note)
    handover = cfg.runner_handover_stages()
    if not handover:
        return
    from omni_actors.planning import stages_for

    blocked = {s.stage_id for s in handover}
    refused, served = [], []
    for out in sorted(cfg.output_types()):
        (refused if stages_for(cfg, [out]) & blocked else served).append(out)
    names = ", ".join(s.name for s in handover)
    many = len(handover) > 1
    note = (f"stage{'s' if many else ''} {names}: `requires_full_payload_input`: {'their' if many else 'its'} "
            f"input comes through vLLM-Omni's "
            f"model-runner hand-over, which omni-actors does not carry between replicas yet: requests "
            f"for {' or '.join(refused)} output are refused (HTTP 400)"
            # (trial CA: qwen3_tts's only output refused, and nothing said the config served nothing)
            + (f"; {' and '.join(served)} is served" if served else ": this config serves no request here"))
    if note not in cfg.omni_connectors.notes:
        cfg.omni_connectors.notes.append(note)


def _check_graph(cfg: PipelineConfig, source: str) -> None:
    ids: dict[int, int] = {}
    names: dict[str, int] = {}
    for i, s in enumerate(cfg.stage_args):
        p = f"stage_args[{i}]"
        if s.stage_id in ids:
            raise ConfigError(source, f"{p}.stage_id",
                              f"duplicate stage_id {s.stage_id} (also stage_args[{ids[s.stage_id]}])")
        ids[s.stage_id] = i
        stage = s.engine_args.get("model_stage")
        if not isinstance(stage, str) or not stage:
            raise ConfigError(source, f"{p}.engine_args.model_stage",
                              "required: the stage name as a non-empty string (e.g. `thinker`)")
        if "/" in stage or ";" in stage or not stage.isprintable() or stage != stage.strip() or " " in stage:
            # (a trial's `a b/c` was taken, then blamed on deployment.stages: replica names
            # are `<stage>/<index>`, and the CLI and shell split them on the slash; the shell
            # splits its commands on `;`)
            raise ConfigError(source, f"{p}.engine_args.model_stage",
                              f"`{stage}` is no usable stage name: no `/`, `;`, spaces or control characters")
        model = s.engine_args.get("model")
        if model is not None and (not isinstance(model, str) or not model.strip()):
            raise ConfigError(source, f"{p}.engine_args.model",
                              f"expected a model id or path (a non-empty string), got `{model!r}`")
        if stage in names:
            raise ConfigError(source, f"{p}.engine_args.model_stage",
                              f"duplicate stage name `{stage}` (also stage_args[{names[stage]}])")
        names[stage] = i
        if s.final_output and s.final_output_type is None:
            raise ConfigError(source, f"{p}.final_output_type",
                              "required when final_output is true: one of text, audio, image")
        _check_devices(s, source, f"{p}.runtime.devices")
    if not cfg.stage_args:
        raise ConfigError(source, "stage_args", "expected at least one stage")
    consumed = {src for s in cfg.stage_args for src in s.engine_input_source}
    for i, s in enumerate(cfg.stage_args):
        for j, src in enumerate(s.engine_input_source):
            if src not in ids:
                raise ConfigError(source, f"stage_args[{i}].engine_input_source[{j}]",
                                  f"unknown stage_id {src}; known: {sorted(ids)}")
            if src == s.stage_id:
                raise ConfigError(source, f"stage_args[{i}].engine_input_source[{j}]",
                                  "a stage cannot take its own output as input")
            if src in s.engine_input_source[:j]:
                raise ConfigError(source, f"stage_args[{i}].engine_input_source[{j}]",
                                  f"stage_id {src} is named twice")
        if s.custom_process_input_func is not None and not s.custom_process_input_func.strip():
            # (trial CQ's "" was taken, in silence, for no processor at all)
            raise ConfigError(source, f"stage_args[{i}].custom_process_input_func",
                              "empty: name a processor (a dotted path, module.function), or leave the key out "
                              "for the default input processor")
        # (A trial's graph with these mistakes passed check-config; every request that needed the
        # stage then failed at run time, with a 400 that blamed the client.)
        if s.custom_process_input_func and not s.engine_input_source:
            raise ConfigError(source, f"stage_args[{i}].engine_input_source",
                              f"empty, but custom_process_input_func `{s.custom_process_input_func}` makes "
                              "this stage's input from upstream stages' outputs: name the stage_id(s) it "
                              "takes them from")
        if s.custom_process_input_func:
            _check_processor(s.custom_process_input_func, cfg.deployment_of(s).backend, s.name, source,
                             f"stage_args[{i}].custom_process_input_func")
    if not any(s.final_output for s in cfg.stage_args):
        raise ConfigError(source, "stage_args", "no stage has final_output: true")
    finals: dict[str, int] = {}
    for i, s in enumerate(cfg.stage_args):
        if not s.final_output:
            continue
        k = finals.setdefault(s.final_output_type, i)
        if k != i:
            # (trial BA: two Code2Wavs, both final audio, both ran; a reply carried one's audio)
            raise ConfigError(source, f"stage_args[{i}].final_output_type",
                              f"`{s.final_output_type}`, as stage `{cfg.stage_args[k].name}` "
                              f"(stage_args[{k}]): a reply carries one output of each type (text in "
                              "message.content, audio in message.audio, one image), so one of them would be "
                              "thrown away: keep one final stage per output type (serve the other in a config of its own)")
    for i, s in enumerate(cfg.stage_args):
        if not s.final_output and s.stage_id not in consumed:
            raise ConfigError(source, f"stage_args[{i}]",
                              f"stage `{s.engine_args.get('model_stage')}` is not a final output "
                              "(final_output) and no stage takes its outputs (engine_input_source): "
                              "its work would be thrown away")
    _check_acyclic(cfg, source)
    for name, dep in cfg.deployment.stages.items():
        if name not in names:
            raise ConfigError(source, f"deployment.stages.{name}",
                              f"no stage named `{name}`; stages: {sorted(names)}")
    _check_stage_settings(cfg, source)
    restart = cfg.deployment.supervision.restart
    if restart.initial_backoff_s > restart.max_backoff_s:
        raise ConfigError(source, "deployment.supervision.restart.initial_backoff_s",
                          f"{restart.initial_backoff_s:g} s is over max_backoff_s ({restart.max_backoff_s:g} s): "
                          "the backoff doubles from the first up to the most")


def _check_devices(s: StageSpec, source: str, path: str) -> None:
    """``runtime.devices``: a device id list such as ``"0,1"`` (or one id as a number, or a
    YAML list of ids);
    kept as its canonical string (``"0,1"``), which becomes ``CUDA_VISIBLE_DEVICES``."""
    from omni_actors.placement import parse_devices  # (placement imports this module's users)

    devices = s.runtime.devices
    if devices is None:
        return
    if isinstance(devices, list):  # a YAML list [0, 1]: the same ids
        devices = ",".join(str(d) for d in devices)
    try:
        ids = parse_devices(str(devices))
    except ValueError as exc:
        raise ConfigError(source, path, str(exc)) from None
    if not ids:
        raise ConfigError(source, path, "empty: give device ids such as \"0,1\", or leave `devices` out")
    s.runtime.devices = ",".join(ids)


def _check_stage_settings(cfg: PipelineConfig, source: str) -> None:
    """Per-stage settings that only make sense together with the deployment."""
    from omni_actors.engines.synthetic import SUPPORTED_STAGES
    from omni_actors.vllm_omni_deploy import engine_devices

    if not cfg.deployment.served_model_name.strip():  # ("  " passed: a model no client could name)
        raise ConfigError(source, "deployment.served_model_name", "blank: give the model name clients ask for")
    limit = cfg.deployment.max_tokens_limit
    for i, s in enumerate(cfg.stage_args):
        max_tokens = s.default_sampling_params.get("max_tokens")
        path = f"stage_args[{i}].default_sampling_params.max_tokens"
        if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool)
                                       or max_tokens < 1):
            raise ConfigError(source, path, f"expected an integer >= 1, got `{max_tokens!r}`")
        # Only text the client receives is bound by the API's limit: a Talker's or
        # Code2Wav's own budget (4096, 65536 in vLLM-Omni's Qwen3-Omni YAML) is not.
        if max_tokens is not None and max_tokens > limit and s.final_output_type == "text":
            raise ConfigError(source, path, f"{max_tokens} is over deployment.max_tokens_limit ({limit})")
        dep = cfg.deployment_of(s)
        if dep.backend in ("vllm", "vllm_omni"):
            _check_engine_args(s.engine_args, source, f"stage_args[{i}].engine_args")
        if dep.backend in ("vllm", "vllm_omni"):
            need, how = engine_devices(s.engine_args.get, s.engine_args.get("stage_type") == "diffusion")
            if need > dep.devices_per_replica:  # (its engine would get fewer devices than it shards over)
                # (the stage's engine arguments, not `stage_args[i]`: a deploy-format file has none)
                raise ConfigError(source, f"deployment.stages.{s.name}.devices_per_replica",
                                  f"{dep.devices_per_replica}, but the stage's engine arguments shard the model "
                                  f"over {need} devices ({how}): give each replica {need}")
        ids = s.runtime.devices.split(",") if s.runtime.devices else []
        if ids and len(ids) < dep.devices_per_replica:
            # (trial CE: `"1"` with 2 per replica gave every "two-device" replica device 1 alone)
            raise ConfigError(source, f"stage_args[{i}].runtime.devices",
                              f"`{s.runtime.devices}` is {len(ids)} device id{'s' if len(ids) > 1 else ''}, "
                              f"fewer than deployment.stages.{s.name}.devices_per_replica "
                              f"({dep.devices_per_replica}): give each replica's ids, or all replicas' ids")
        if dep.backend in ("vllm", "vllm_omni") and not s.engine_args.get("model"):
            # (its replicas fail to start without; a review: a vLLM-Omni deploy file, which names
            # no model, loaded, and every replica failed its start every 5 minutes)
            raise ConfigError(source, f"stage_args[{i}].engine_args.model",
                              f"a {dep.backend} stage needs `model` (a model directory or a model id)")
        if dep.backend == "synthetic":
            kind = dep.synthetic.kind or s.name
            makes = _SYNTHETIC_OUTPUT.get(kind)
            if s.final_output and kind in SUPPORTED_STAGES and makes != s.final_output_type:
                # (a trial's text final output on a synthetic `ar` stage: every chat request a bare 500)
                raise ConfigError(source, f"stage_args[{i}].final_output_type",
                                  f"{s.final_output_type}, but the synthetic `{kind}` stage makes "
                                  + (f"{makes}" if makes else "no final output a client can take (it feeds "
                                                              "another stage)"))
            if kind not in SUPPORTED_STAGES:
                where = (f"deployment.stages.{s.name}.synthetic.kind" if dep.synthetic.kind
                         else f"stage_args[{i}].engine_args.model_stage")
                raise ConfigError(source, where,
                                  f"the synthetic engine has no `{kind}` stage; one of: "
                                  f"{', '.join(SUPPORTED_STAGES)} (or set "
                                  f"deployment.stages.{s.name}.synthetic.kind)")
            _check_synthetic_stage(s, i, kind, dep.synthetic, source)
        _check_stop(s.default_sampling_params, i, source)
        _check_sampling_numbers(s.default_sampling_params, i, source)


#: Synthetic stage kinds that take another stage's outputs (a prompt alone gives them nothing).
_SYNTHETIC_NEEDS_INPUT = ("talker", "code2wav", "dit")


def _check_stop(params: dict, i: int, source: str) -> None:
    """A stage's default ``stop``: a non-empty string or a list of them, as the API takes
    a request's (a review: a mapping passed, and vLLM's check of it, an assertion with no
    message, was a traceback in check-config and a replica that could not start)."""
    stop = params.get("stop")
    if stop is not None and not (isinstance(stop, str) and stop or isinstance(stop, list) and all(
            isinstance(x, str) and x for x in stop)):
        raise ConfigError(source, f"stage_args[{i}].default_sampling_params.stop",
                          f"expected a non-empty string or a list of them, got `{stop!r}`")


#: Sampling parameters that are numbers (OpenAI's and vLLM's), and those of them that are integers.
_SAMPLING_NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty")
_SAMPLING_INTEGERS = ("top_k", "min_tokens", "n", "logprobs")


def _check_sampling_numbers(params: dict, i: int, source: str) -> None:
    """The plain sampling parameters are numbers, on any backend (trial BT: `temperature: hot`
    passed on a synthetic stage, which ignores it, and read as vLLM's "TypeError: '<' not
    supported between instances of 'int' and 'str'" on a vLLM one, naming no field)."""
    for key in _SAMPLING_NUMBERS + _SAMPLING_INTEGERS:
        value = params.get(key)
        if value is None:
            continue
        integer = key in _SAMPLING_INTEGERS
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            raise ConfigError(source, f"stage_args[{i}].default_sampling_params.{key}",
                              f"expected {'an integer' if integer else 'a number'}, got `{value!r}`")


def _check_synthetic_stage(s, i: int, kind: str, synthetic, source: str) -> None:
    """What the synthetic engine would refuse on every request, refused here (a code review:
    a bad ``seed`` in a stage's defaults read as the client's 400 on each request; a Talker
    with no input source failed every audio request; an AR stage whose prior grid fills its
    context failed every image request)."""
    seed = s.default_sampling_params.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < SEED_MIN):
        raise ConfigError(source, f"stage_args[{i}].default_sampling_params.seed",
                          f"expected an integer >= {SEED_MIN}, got `{seed!r}`")
    if kind == "ar" and synthetic.prior_grid ** 2 >= synthetic.max_model_len:
        raise ConfigError(source, f"deployment.stages.{s.name}.synthetic.prior_grid",
                          f"{synthetic.prior_grid}: its {synthetic.prior_grid ** 2} prior tokens leave no room for "
                          f"a prompt in synthetic.max_model_len ({synthetic.max_model_len}): every image request "
                          "would be refused")
    if kind in _SYNTHETIC_NEEDS_INPUT and not s.engine_input_source and not s.custom_process_input_func:
        raise ConfigError(source, f"stage_args[{i}].engine_input_source",
                          f"empty, but the synthetic `{kind}` stage takes another stage's outputs: name the "
                          "stage(s) it takes them from")


#: What each synthetic stage kind makes that a client can take as a final output.
_SYNTHETIC_OUTPUT = {"thinker": "text", "code2wav": "audio", "dit": "image"}
#: vLLM's ``dtype`` choices (``--dtype``).
VLLM_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
#: Engine arguments that vLLM takes as counts of at least 1.
_COUNT_ARGS = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "max_num_seqs",
               "max_num_batched_tokens")


def _check_engine_args(args: dict, source: str, path: str) -> None:
    """The vLLM engine arguments whose type or range is plain, checked as vLLM would
    when a replica starts (a trial's `tensor_parallel_size: 0`, `max_model_len: "abc"`
    and `dtype: flaot32` passed check-config, then every replica failed to load)."""
    for key in _COUNT_ARGS:
        value = args.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(source, f"{path}.{key}", f"expected an integer >= 1, got `{value!r}`")
    value = args.get("max_model_len")
    if value is not None:  # (vLLM also takes "32k", "1.5M")
        ok = (isinstance(value, int) and not isinstance(value, bool) and value >= 1) or (
            isinstance(value, str) and re.fullmatch(r"[0-9]+(\.[0-9]+)?[kKmMgG]?", value.strip()) is not None)
        if not ok:
            raise ConfigError(source, f"{path}.max_model_len",
                              f"expected a token count >= 1 (or such as `32k`), got `{value!r}`")
    value = args.get("gpu_memory_utilization")
    if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool)
                              or not 0 < value <= 1):
        raise ConfigError(source, f"{path}.gpu_memory_utilization",
                          f"expected a fraction of the device's memory, more than 0 and at most 1, got `{value!r}`")
    value = args.get("dtype")
    if value is not None and value not in VLLM_DTYPES:
        raise ConfigError(source, f"{path}.dtype", f"`{value}` is not one of vLLM's: {', '.join(VLLM_DTYPES)}")


def _check_acyclic(cfg: PipelineConfig, source: str) -> None:
    state: dict[int, int] = {}  # 1 visiting, 2 done
    by_id = {s.stage_id: s for s in cfg.stage_args}

    def visit(sid: int, trail: list[int]) -> None:
        if state.get(sid) == 2:
            return
        if state.get(sid) == 1:
            cycle = " -> ".join(str(x) for x in trail + [sid])
            raise ConfigError(source, "stage_args", f"engine_input_source forms a cycle: {cycle}")
        state[sid] = 1
        for src in by_id[sid].engine_input_source:
            visit(src, trail + [sid])
        state[sid] = 2

    for sid in by_id:
        visit(sid, [])


#: Engine packages whose processors are checked by their engine at load time
#: when the package is not installed where the config is validated.
ENGINE_PACKAGES = ("vllm_omni", "vllm")


def _check_processor(dotted: str, backend: str, stage: str, source: str, path: str) -> None:
    """A stage's ``custom_process_input_func``: importable (see :func:`_check_importable`)
    and, unless the vLLM-Omni backend runs it (vLLM-Omni's own signature), callable as
    ``fn(upstream, prompt, params)``; a vLLM-Omni processor needs that backend.

    Raises:
        ConfigError: at ``path``. (A trial's ``os.getcwd`` and a ``vllm_omni`` processor on a
            synthetic stage passed ``check-config``; every request then got a 500 or a 503.)
    """
    top = dotted.split(".")[0]
    if top == "vllm_omni" and backend != "vllm_omni":
        raise ConfigError(source, path, f"`{dotted}` is a vLLM-Omni processor (vLLM-Omni's signature): it runs "
                                        f"only on `backend: vllm_omni`, and stage {stage} has backend {backend} "
                                        "(deployment.stages.<stage>.backend); name a processor of this project's "
                                        "form, such as omni_actors.processors.thinker2talker")
    func = _check_importable(dotted, source, path)
    if func is None or backend == "vllm_omni":
        return
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # (some builtins have none: called as they are)
        return
    try:
        signature.bind(None, None, None)
    except TypeError as exc:
        raise ConfigError(source, path, f"`{dotted}{signature}` cannot be called as a stage processor "
                                        f"`fn(upstream, prompt, params)`: {exc}") from None


#: Seconds a processor's module may take to import before the CLI says what it waits for.
IMPORT_NOTE_AFTER_S = 2.0


def _check_importable(dotted: str, source: str, path: str):
    """The function ``dotted`` names; None for one of an engine package not installed here
    (:data:`ENGINE_PACKAGES`). Raises ConfigError at ``path`` when it cannot be had."""
    module, _, attr = dotted.rpartition(".")
    if not module:
        raise ConfigError(source, path, f"expected a dotted path `package.module.function`, got `{dotted}`")
    # (trial CR: a module that loads a model at import held check-config and start, silent)
    note = threading.Timer(IMPORT_NOTE_AFTER_S, lambda: print(
        f"note: importing {module} ({path}) takes a while: check-config and start wait for it", file=sys.stderr,
        flush=True))
    note.daemon = True
    note.start()
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        # Processors of an engine package that is not installed here (vllm_omni on a
        # CPU-only host) are checked by that engine when it loads.
        top = (exc.name or "").split(".")[0]
        # (only where the package itself is missing: a misspelt module of one installed here
        # passed, and every replica of its stage failed to load; a code review)
        if top in ENGINE_PACKAGES and dotted.startswith(top + ".") and exc.name == top:
            return None
        raise ConfigError(source, path, f"cannot import `{module}`: {_one_line(exc)}") from None
    except (Exception, SystemExit) as exc:  # the module's own code failed: a SyntaxError, its imports...
        raise ConfigError(source, path,
                          f"cannot import `{module}`: {type(exc).__name__}: {_one_line(exc)}") from None
    finally:
        note.cancel()
    try:
        func = getattr(mod, attr, None)
    except Exception as exc:  # a module __getattr__ that raises
        raise ConfigError(source, path, f"`{module}.{attr}`: {type(exc).__name__}: {_one_line(exc)}") from None
    if func is None:
        raise ConfigError(source, path, f"`{module}` has no function `{attr}`")
    if not callable(func):
        raise ConfigError(source, path, f"`{module}.{attr}` is a {type(func).__name__}, not a function")
    return func


def _one_line(exc: BaseException) -> str:
    """An exception's message on one line (its first non-empty line; the type's name if none)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def resolve_processor(dotted: str):
    """Import a ``custom_process_input_func`` by dotted path."""
    module, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module), attr)
