"""Config loading and validation: every shipped config loads, and every bad
config is refused with the YAML path of the bad field and what was expected.

Pure logic: no actor system. Bad configs are small YAML files written to
``tmp_path`` from a minimal valid base (Thinker -> Talker -> Code2Wav).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml
from structlog.testing import capture_logs

from omni_actors.config import ConfigError, PipelineConfig, load_config, parse_config
from omni_actors.config_keys import unknown_key_warnings
from omni_actors.placement import parse_devices

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted((ROOT / "configs").glob("*.yaml")) + sorted(
    (ROOT / "tests" / "configs").glob("*.yaml"))
#: ... and the topologies (tests/test_topologies.py loads them).
EVERY_CONFIG = SHIPPED + sorted((ROOT / "configs" / "topologies").glob("*.yaml"))

BASE: dict[str, Any] = {
    "stage_args": [
        {"stage_id": 0, "engine_args": {"model_stage": "thinker"},
         "final_output": True, "final_output_type": "text"},
        {"stage_id": 1, "engine_args": {"model_stage": "talker"}, "engine_input_source": [0],
         "custom_process_input_func": "omni_actors.processors.thinker2talker"},
        {"stage_id": 2, "engine_args": {"model_stage": "code2wav"}, "engine_input_source": [1],
         "custom_process_input_func": "omni_actors.processors.talker2code2wav",
         "final_output": True, "final_output_type": "audio"},
    ],
    "deployment": {
        "served_model_name": "test-model",
        "stages": {"talker": {"replicas": 2, "synthetic": {"max_concurrency": 4}}},
    },
}


def write(tmp_path: Path, data: Any, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def variant(mutate: Callable[[dict], Any]) -> dict:
    """BASE with one change applied."""
    data = copy.deepcopy(BASE)
    mutate(data)
    return data


def refused(tmp_path: Path, data: Any) -> ConfigError:
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    # One line: FILE: PATH: message.
    assert str(err) == f"{path}: {err.path or '<top>'}: {err.message}"
    assert "\n" not in str(err)
    return err


def stage(i: int, **changes: Any) -> Callable[[dict], None]:
    return lambda d: d["stage_args"][i].update(changes)


def stage_deployment(name: str, **changes: Any) -> Callable[[dict], None]:
    return lambda d: d["deployment"]["stages"].setdefault(name, {}).update(changes)


# -- configs that load -----------------------------------------------------


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_config_loads(path: Path) -> None:
    cfg = load_config(path)
    assert isinstance(cfg, PipelineConfig)
    assert cfg.source == str(path)
    assert cfg.output_types()
    for s in cfg.stage_args:
        assert cfg.stage_by_name(s.name) is s
        assert cfg.deployment_of(s).replicas >= 1


def test_shipped_configs_are_found() -> None:
    names = {p.name for p in SHIPPED}
    assert {"cpu_omni_demo.yaml", "cpu_image_demo.yaml", "fanin.yaml"} <= names


def test_base_config_loads_with_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, BASE))
    assert [s.name for s in cfg.stage_args] == ["thinker", "talker", "code2wav"]
    assert cfg.output_types() == {"text", "audio"}
    assert cfg.consumers(0) == [1]
    assert cfg.deployment_of(cfg.stage_by_name("talker")).replicas == 2
    # A stage without a deployment entry gets one synthetic replica.
    thinker = cfg.deployment_of(cfg.stage_by_name("thinker"))
    assert (thinker.replicas, thinker.backend) == (1, "synthetic")
    assert cfg.deployment.heartbeat_interval_s == 1.0


def test_vllm_omni_stage_fields_load_and_are_kept_in_engine_args(tmp_path: Path) -> None:
    """A stage config written the way vLLM-Omni ships them loads unchanged."""
    vllm_engine_args = {
        "model_stage": "thinker",
        "model_arch": "Qwen3OmniMoeForConditionalGeneration",
        "worker_cls": "vllm_omni.worker.gpu_ar_worker.GPUARWorker",
        "scheduler_cls": "vllm_omni.core.sched.omni_ar_scheduler.OmniARScheduler",
        "gpu_memory_utilization": 0.9,
        "enforce_eager": True,
        "trust_remote_code": True,
        "engine_output_type": "latent",
        "distributed_executor_backend": "mp",
        "enable_prefix_caching": False,
        "hf_config_name": "thinker_config",
        "tensor_parallel_size": 1,
    }

    def mutate(d: dict) -> None:
        d["async_chunk"] = True
        d["stage_args"][0].update(
            engine_args=dict(vllm_engine_args),
            runtime={"process": True, "devices": "0,1", "max_batch_size": 1},
            is_comprehension=True,
            default_sampling_params={"temperature": 0.4, "top_p": 0.9, "max_tokens": 2048},
        )

    cfg = load_config(write(tmp_path, variant(mutate)))
    thinker = cfg.stage(0)
    assert thinker.engine_args == vllm_engine_args
    assert thinker.name == "thinker"
    assert thinker.runtime.process is True
    assert thinker.runtime.devices == "0,1"
    assert thinker.default_sampling_params["max_tokens"] == 2048


def test_processor_of_an_engine_package_not_installed_here_is_accepted(tmp_path: Path) -> None:
    """vLLM-Omni's own processors are checked by that engine when it loads."""
    dotted = "vllm_omni.model_executor.stage_input_processors.qwen3_omni.thinker2talker"
    try:
        import vllm_omni  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vllm_omni is installed here")

    def mutate(d):
        d["stage_args"][1]["custom_process_input_func"] = dotted
        d["stage_args"][1]["engine_args"]["model"] = "Qwen/Qwen3-Omni-30B-A3B-Instruct"
        d["deployment"]["stages"]["talker"]["backend"] = "vllm_omni"

    cfg = load_config(write(tmp_path, variant(mutate)))
    assert cfg.stage(1).custom_process_input_func == dotted


@pytest.mark.parametrize("backend", ["synthetic", "vllm"])
def test_a_vllm_omni_processor_needs_the_vllm_omni_backend(tmp_path: Path, backend: str) -> None:
    """vLLM-Omni's processors have vLLM-Omni's signature; only that backend runs them. A
    trial's synthetic stage with one passed check-config, then every request got a 503."""
    dotted = "vllm_omni.model_executor.stage_input_processors.qwen3_omni.thinker2talker"

    def mutate(d):
        d["stage_args"][1]["custom_process_input_func"] = dotted
        d["deployment"]["stages"]["talker"]["backend"] = backend
        if backend == "vllm":
            d["stage_args"][1]["engine_args"]["model"] = "Qwen/Qwen3-Omni-30B-A3B-Instruct"

    err = refused(tmp_path, variant(mutate))
    assert err.path == "stage_args[1].custom_process_input_func"
    assert err.message.startswith(f"`{dotted}` is a vLLM-Omni processor (vLLM-Omni's signature): it runs only "
                                  f"on `backend: vllm_omni`, and stage talker has backend {backend}"), err.message


@pytest.mark.parametrize(("dotted", "expect"), [
    ("os.getcwd", "too many positional arguments"),
    ("omni_actors.config_checks.resolve_processor", "too many positional arguments"),
    ("json.dumps", "too many positional arguments"),  # (obj, *, ...)
    ("omni_actors.processors.default_input", None),
])
def test_a_processor_must_take_upstream_prompt_and_params(tmp_path: Path, dotted: str, expect) -> None:
    """A trial's ``os.getcwd`` passed check-config; every text+audio request got a 500
    ("takes no arguments (3 given)")."""
    if expect is None:
        cfg = load_config(write(tmp_path, variant(stage(1, custom_process_input_func=dotted))))
        assert cfg.stage(1).custom_process_input_func == dotted
        return
    err = refused(tmp_path, variant(stage(1, custom_process_input_func=dotted)))
    assert err.path == "stage_args[1].custom_process_input_func"
    assert "cannot be called as a stage processor `fn(upstream, prompt, params)`" in err.message, err.message
    assert expect in err.message, err.message


# -- the file itself -------------------------------------------------------


def test_missing_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.path == ""
    assert "cannot read config" in info.value.message
    assert str(info.value).startswith(f"{path}: <top>: cannot read config")


def test_directory_instead_of_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert "cannot read config" in info.value.message


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    text = "stage_args:\n  - stage_id: 0\n    engine_args: {model_stage: thinker\ndeployment: {}\n"
    err = refused(tmp_path, text)
    assert err.path.startswith("line ")
    assert int(err.path.split()[1]) in (3, 4)
    assert "not valid YAML" in err.message
    # (trial BT: the mistake is often on the line before the one PyYAML names: it says where the
    # construct it was in began, and what a "mapping values" error usually is)
    assert err.message.endswith("(while parsing a flow mapping from line 3)"), err.message
    err = refused(tmp_path, "deployment:\n  served_model_name x\n  heartbeat_interval_s: 1.0\n")
    assert (err.path, err.message) == ("line 3", "not valid YAML: mapping values are not allowed here (a key above "
                                                 "with no colon after it? a value with `: ` in it, not quoted?)")


@pytest.mark.parametrize("doc", ["- a\n- b\n", "just a string\n", "", "42\n"],
                         ids=["list", "string", "empty", "number"])
def test_top_level_must_be_a_mapping(tmp_path: Path, doc: str) -> None:
    err = refused(tmp_path, doc)
    assert err.path == ""
    assert "expected a mapping" in err.message


@pytest.mark.parametrize("key", ["deployment", "stage_args"])
def test_missing_top_level_section(tmp_path: Path, key: str) -> None:
    err = refused(tmp_path, variant(lambda d: d.pop(key)))
    assert err.path == key
    assert "missing" in err.message


def test_no_stages(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(lambda d: d.update(stage_args=[])))
    assert err.path == "stage_args"
    assert "at least one stage" in err.message


# -- stage_args -------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, "one", 1.5, None], ids=["negative", "string", "float", "null"])
def test_stage_id_must_be_a_non_negative_int(tmp_path: Path, bad: Any) -> None:
    err = refused(tmp_path, variant(stage(1, stage_id=bad)))
    assert err.path == "stage_args[1].stage_id"
    assert "int" in err.message
    if bad == -1:
        assert ">= 0" in err.message


def test_duplicate_stage_id(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(stage(2, stage_id=1)))
    assert err.path == "stage_args[2].stage_id"
    assert "duplicate stage_id 1" in err.message
    assert "stage_args[1]" in err.message


@pytest.mark.parametrize("engine_args",
                         [{}, {"model_stage": ""}, {"model_stage": 3}, {"model": "x"}],
                         ids=["missing", "empty", "not-a-string", "other-keys-only"])
def test_model_stage_is_required(tmp_path: Path, engine_args: dict) -> None:
    err = refused(tmp_path, variant(stage(1, engine_args=engine_args)))
    assert err.path == "stage_args[1].engine_args.model_stage"
    assert "non-empty string" in err.message


def test_engine_args_is_required(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(lambda d: d["stage_args"][1].pop("engine_args")))
    assert (err.path, err.message) == ("stage_args[1].engine_args", "required field is missing")


def test_duplicate_stage_name(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(stage(2, engine_args={"model_stage": "talker"})))
    assert err.path == "stage_args[2].engine_args.model_stage"
    assert "duplicate stage name `talker`" in err.message


@pytest.mark.parametrize("name", ["a b/c", "talker/x", " talker", "tal\tker", "a;b"])
def test_a_stage_name_that_replica_names_cannot_carry_is_refused_where_it_is_given(tmp_path: Path, name: str) -> None:
    """A trial's `model_stage: 'a b/c'` was taken, then blamed on `deployment.stages.thinker`."""
    err = refused(tmp_path, variant(stage(0, engine_args={"model_stage": name})))
    assert err.path == "stage_args[0].engine_args.model_stage"
    assert err.message == f"`{name}` is no usable stage name: no `/`, `;`, spaces or control characters"


@pytest.mark.parametrize("model", [5, "", ["a"]], ids=["int", "empty", "list"])
def test_a_model_that_is_no_id_or_path_is_refused(tmp_path: Path, model: Any) -> None:
    """A trial's deploy file with `model: 5` passed check-config (a vLLM replica then fails to load)."""
    err = refused(tmp_path, variant(stage(0, engine_args={"model_stage": "thinker", "model": model})))
    assert (err.path, err.message) == ("stage_args[0].engine_args.model",
                                       f"expected a model id or path (a non-empty string), got `{model!r}`")
    deploy = yaml.safe_load((ROOT / "configs" / "cpu_vllm_omni_deploy.yaml").read_text())
    deploy["model"] = model
    err = refused(tmp_path, deploy)
    assert (err.path, err.message) == ("model", f"expected a model id or path (a non-empty string), got `{model!r}`")


@pytest.mark.parametrize(("key", "value", "message"), [
    ("tensor_parallel_size", 0, "expected an integer >= 1, got `0`"),
    ("tensor_parallel_size", "two", "expected an integer >= 1, got `'two'`"),
    ("max_num_seqs", True, "expected an integer >= 1, got `True`"),
    ("max_model_len", -5, "expected a token count >= 1 (or such as `32k`), got `-5`"),
    ("max_model_len", "abc", "expected a token count >= 1 (or such as `32k`), got `'abc'`"),
    ("gpu_memory_utilization", 1.5, "expected a fraction of the device's memory, more than 0 and at most 1, "
                                    "got `1.5`"),
    ("dtype", "flaot32", "`flaot32` is not one of vLLM's: auto, half, float16, bfloat16, float, float32"),
])
def test_a_vllm_engine_argument_of_the_wrong_type_or_range_is_refused(tmp_path: Path, key: str, value: Any,
                                                                        message: str) -> None:
    """A trial's `tensor_parallel_size: 0`, `max_model_len: "abc"`, `dtype: flaot32` passed
    check-config; every replica then failed to load."""
    data = yaml.safe_load((ROOT / "configs" / "cpu_vllm_chain.yaml").read_text())
    data["stage_args"][0]["engine_args"][key] = value
    err = refused(tmp_path, data)
    assert (err.path, err.message) == (f"stage_args[0].engine_args.{key}", message)
    data["stage_args"][0]["engine_args"][key] = {"max_model_len": "32k", "dtype": "bfloat16"}.get(key, 1)
    assert load_config(write(tmp_path, data))  # (and what vLLM takes passes: "32k", a count of 1)


def test_a_replica_with_fewer_devices_than_its_engine_shards_over_is_refused(tmp_path: Path) -> None:
    """A trial's `tensor_parallel_size: 2` with the default one device per replica passed
    check-config (on a GPU host the engine would get one device for two shards)."""
    data = yaml.safe_load((ROOT / "configs" / "cpu_vllm_chain.yaml").read_text())
    data["stage_args"][0]["engine_args"]["tensor_parallel_size"] = 2
    err = refused(tmp_path, data)
    assert (err.path, err.message) == (
        "deployment.stages.thinker.devices_per_replica",
        "1, but the stage's engine arguments shard the model over 2 devices (tensor_parallel_size x "
        "pipeline_parallel_size x data_parallel_size): give each replica 2")
    # (a review: data parallelism was not counted, and a replica given TP x PP devices could not start)
    data["stage_args"][0]["engine_args"]["data_parallel_size"] = 2
    data["deployment"]["stages"]["thinker"]["devices_per_replica"] = 2
    assert refused(tmp_path, data).message.startswith("2, but the stage's engine arguments shard the model "
                                                      "over 4 devices")
    data["deployment"]["stages"]["thinker"]["devices_per_replica"] = 4
    data["stage_args"][0]["runtime"]["devices"] = "0,1,2,3"  # (not "0": one id for four)
    assert load_config(write(tmp_path, data))


def test_a_device_list_shorter_than_one_replicas_devices_is_refused(tmp_path: Path) -> None:
    """Trial CE: `runtime.devices: "1"` with `devices_per_replica: 2` passed check-config, and
    every replica of the stage ran on device 1 alone. A template (`"0,1"`) and a pool of several
    replicas' ids (`"0,1,2,3"`) pass."""
    data = yaml.safe_load((ROOT / "configs" / "cpu_omni_demo.yaml").read_text())
    talker = next(i for i, s in enumerate(data["stage_args"]) if s["engine_args"]["model_stage"] == "talker")
    data["deployment"]["stages"]["talker"]["devices_per_replica"] = 2
    data["stage_args"][talker].setdefault("runtime", {})["devices"] = "1"
    err = refused(tmp_path, data)
    assert (err.path, err.message) == (
        f"stage_args[{talker}].runtime.devices",
        "`1` is 1 device id, fewer than deployment.stages.talker.devices_per_replica (2): give each replica's "
        "ids, or all replicas' ids"), err
    for devices in ("0,1", "0,1,2,3", [2, 3]):
        data["stage_args"][talker]["runtime"]["devices"] = devices
        assert load_config(write(tmp_path, data))


def test_synthetic_settings_that_would_refuse_every_request_are_refused(tmp_path: Path) -> None:
    """A review: an AR stage whose prior grid fills its context (`prior_grid: 200`, 40,000
    tokens against 32,768) passed, then every image request got a 400; so did a seed below
    the engine's least; and a `stop` that is a mapping on a vLLM stage was vLLM's bare
    assertion, a traceback in check-config."""
    data = yaml.safe_load((ROOT / "configs" / "cpu_image_demo.yaml").read_text())
    data["deployment"]["stages"]["ar"]["synthetic"]["prior_grid"] = 200
    err = refused(tmp_path, data)
    assert err.path == "deployment.stages.ar.synthetic.prior_grid", err
    assert "its 40000 prior tokens leave no room for a prompt in synthetic.max_model_len (32768)" in err.message
    data["deployment"]["stages"]["ar"]["synthetic"]["prior_grid"] = 181  # (32,761 + a prompt of 7 words)
    assert load_config(write(tmp_path, data))
    data["stage_args"][0]["default_sampling_params"]["seed"] = -(2 ** 63) - 1
    err = refused(tmp_path, data)
    assert (err.path, err.message) == ("stage_args[0].default_sampling_params.seed",
                                       f"expected an integer >= {-(2 ** 63)}, got `{-(2 ** 63) - 1}`")
    vllm = yaml.safe_load((ROOT / "configs" / "cpu_vllm_chain.yaml").read_text())
    vllm["stage_args"][0].setdefault("default_sampling_params", {})["stop"] = {"a": 1}
    err = refused(tmp_path, vllm)
    assert (err.path, err.message) == ("stage_args[0].default_sampling_params.stop",
                                       "expected a non-empty string or a list of them, got `{'a': 1}`")


def test_a_vllm_stage_without_a_model_is_refused(tmp_path: Path) -> None:
    """A trial's vLLM stage with no `model` passed check-config; every replica then failed
    ("engine_args has no 'model'")."""
    data = yaml.safe_load((ROOT / "configs" / "cpu_vllm_chain.yaml").read_text())
    del data["stage_args"][1]["engine_args"]["model"]
    err = refused(tmp_path, data)
    assert (err.path, err.message) == ("stage_args[1].engine_args.model",
                                       "a vllm stage needs `model` (a model directory or a model id)")


def test_a_final_output_type_the_synthetic_stage_does_not_make_is_refused(tmp_path: Path) -> None:
    """A trial's text final output on a synthetic `ar` stage passed check-config; every
    chat request then got a bare 500 (a KeyError in the API server)."""
    def mutate(d: dict) -> None:
        d["deployment"]["stages"]["thinker"] = {"replicas": 1, "synthetic": {"kind": "ar"}}
    err = refused(tmp_path, variant(mutate))
    assert err.path == "stage_args[0].final_output_type"
    assert err.message == ("text, but the synthetic `ar` stage makes no final output a client can take "
                           "(it feeds another stage)")


def test_a_first_restart_backoff_over_the_longest_is_refused(tmp_path: Path) -> None:
    """A trial's initial_backoff_s 10 with max_backoff_s 1 passed check-config."""
    def mutate(d: dict) -> None:
        d["deployment"]["supervision"] = {"restart": {"initial_backoff_s": 10, "max_backoff_s": 1}}
    err = refused(tmp_path, variant(mutate))
    assert err.path == "deployment.supervision.restart.initial_backoff_s"
    assert err.message.startswith("10 s is over max_backoff_s (1 s)")


def test_input_source_naming_an_unknown_stage(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(stage(1, engine_input_source=[7])))
    assert err.path == "stage_args[1].engine_input_source[0]"
    assert "unknown stage_id 7" in err.message
    assert "[0, 1, 2]" in err.message


def test_input_source_error_names_the_list_position(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(stage(2, engine_input_source=[1, 9])))
    assert err.path == "stage_args[2].engine_input_source[1]"


def test_stage_fed_by_itself(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(stage(1, engine_input_source=[1])))
    assert err.path == "stage_args[1].engine_input_source[0]"
    assert "its own output" in err.message


def test_cycle_is_refused_and_shown(tmp_path: Path) -> None:
    # thinker <- code2wav <- talker <- thinker
    err = refused(tmp_path, variant(stage(0, engine_input_source=[2])))
    assert err.path == "stage_args"
    assert "cycle" in err.message
    cycle = err.message.split("cycle:")[1].strip()
    ids = [int(x) for x in cycle.split(" -> ")]
    assert ids[0] == ids[-1]
    assert set(ids) == {0, 1, 2}


def test_final_output_needs_a_type(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(stage(1, final_output=True)))
    assert err.path == "stage_args[1].final_output_type"
    assert "text, audio, image" in err.message


def test_unknown_final_output_type(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(stage(2, final_output_type="video")))
    assert err.path == "stage_args[2].final_output_type"
    assert "video" in err.message
    assert "text, audio, image" in err.message


def test_two_final_stages_of_one_output_type_are_refused(tmp_path: Path) -> None:
    """Trial BA: two final audio stages both ran, and a reply carried the audio of one of them."""
    err = refused(tmp_path, variant(stage(1, final_output=True, final_output_type="audio")))
    assert err.path == "stage_args[2].final_output_type"
    assert err.message.startswith("`audio`, as stage `talker` (stage_args[1]): a reply carries one output of "
                                  "each type"), err.message


def test_a_final_audio_stage_with_no_final_text_stage_is_warned_about(tmp_path: Path) -> None:
    """Trial CQ: a Thinker made no final text (final_output: false) beside a final audio
    branch: check-config said ok, the Talker and Code2Wav replicas ran, and every chat
    request got a 400 (audio is only served by chat, whose reply has a text). A warning
    (vLLM-Omni's own text-to-audio pipelines must still load)."""
    warnings: list[str] = []
    load_config(write(tmp_path, variant(stage(0, final_output=False))), on_warning=warnings.append)
    assert [w for w in warnings if "final_output_type" in w] == [
        f"{tmp_path / 'cfg.yaml'}: stage_args[2].final_output_type: `audio` with no final `text` stage: this server "
        "serves audio only in chat completions, whose reply carries a text, so no request reaches stage code2wav "
        "(or those before it that feed only it): make the stage that writes the reply's text final_output: true, "
        "final_output_type: text"], warnings
    warnings.clear()
    load_config(write(tmp_path, BASE), on_warning=warnings.append)
    assert not [w for w in warnings if "final_output_type" in w]


def test_an_empty_processor_is_refused(tmp_path: Path) -> None:
    """Trial CQ: `custom_process_input_func: ""` was taken for no processor, in silence."""
    err = refused(tmp_path, variant(stage(1, custom_process_input_func="")))
    assert err.path == "stage_args[1].custom_process_input_func" and err.message.startswith("empty: "), err


def test_no_final_stage(tmp_path: Path) -> None:
    def mutate(d: dict) -> None:
        for s in d["stage_args"]:
            s["final_output"] = False

    err = refused(tmp_path, variant(mutate))
    assert err.path == "stage_args"
    assert "final_output" in err.message


@pytest.mark.parametrize(
    ("dotted", "expect"),
    [
        ("omni_actors.no_such_module.thinker2talker", "cannot import `omni_actors.no_such_module`"),
        ("omni_actors.processors.no_such_function", "has no function `no_such_function`"),
        ("thinker2talker", "expected a dotted path"),
    ],
    ids=["module-not-importable", "no-such-function", "not-dotted"],
)
def test_custom_process_input_func_must_resolve(tmp_path: Path, dotted: str, expect: str) -> None:
    err = refused(tmp_path, variant(stage(1, custom_process_input_func=dotted)))
    assert err.path == "stage_args[1].custom_process_input_func"
    assert expect in err.message


def test_custom_process_input_func_must_be_callable(tmp_path: Path) -> None:
    not_a_function = "omni_actors.config.DEFAULT_CONFIG"
    err = refused(tmp_path, variant(stage(1, custom_process_input_func=not_a_function)))
    assert err.path == "stage_args[1].custom_process_input_func"
    assert err.message == "`omni_actors.config.DEFAULT_CONFIG` is a PosixPath, not a function"


# -- deployment -------------------------------------------------------------


def test_deployment_for_an_unknown_stage(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(stage_deployment("nosuch", replicas=1)))
    assert err.path == "deployment.stages.nosuch"
    assert "no stage named `nosuch`" in err.message
    assert "talker" in err.message


@pytest.mark.parametrize("replicas", [0, -2])
def test_replicas_must_be_at_least_one(tmp_path: Path, replicas: int) -> None:
    err = refused(tmp_path, variant(stage_deployment("talker", replicas=replicas)))
    assert err.path == "deployment.stages.talker.replicas"
    assert err.message == f"must be an integer >= 1 and <= 1024, got {replicas}"


def test_typo_in_a_stage_deployment_names_the_field(tmp_path: Path) -> None:
    def mutate(d: dict) -> None:
        d["deployment"]["stages"]["talker"] = {"replica": 2}

    err = refused(tmp_path, variant(mutate))
    assert err.path == "deployment.stages.talker.replica"
    assert "unknown field `replica` (did you mean `replicas`?)" in err.message
    assert "replicas" in err.message.split("expected")[1]


def test_unknown_backend(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(stage_deployment("code2wav", backend="torch")))
    assert err.path == "deployment.stages.code2wav.backend"
    assert "torch" in err.message
    assert "synthetic, vllm, vllm_omni" in err.message


@pytest.mark.parametrize("value", [-1, 0, 0.001, 0.099])
def test_heartbeat_interval_must_be_at_least_a_tenth_of_a_second(tmp_path: Path, value: float) -> None:
    """A trial's 0.001 s swamped the pools with heartbeats until the coordinator stopped
    answering and the leader exited without serving."""
    err = refused(tmp_path, variant(lambda d: d["deployment"].update(heartbeat_interval_s=value)))
    assert err.path == "deployment.heartbeat_interval_s"
    assert err.message == ("must be a finite number of seconds >= 0.1 and <= 600 (10 minutes), "
                           f"got {value}")


def test_unknown_field_in_synthetic_cost(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(stage_deployment("talker", synthetic={"decode_ms": 3})))
    assert err.path == "deployment.stages.talker.synthetic.decode_ms"
    assert "unknown field `decode_ms`" in err.message
    assert "decode_ms_per_token" in err.message


def test_bad_value_in_synthetic_cost(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(stage_deployment("talker", synthetic={"max_concurrency": 0})))
    assert err.path == "deployment.stages.talker.synthetic.max_concurrency"
    assert ">= 1" in err.message  # a field without documented bounds keeps msgspec's message


def test_unknown_field_in_deployment(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(lambda d: d["deployment"].update(heartbeat_s=1)))
    assert err.path == "deployment.heartbeat_s"
    assert "heartbeat_interval_s" in err.message


def test_served_model_name_is_required(tmp_path: Path) -> None:
    # (named by its own path: trial BA read `deployment: Object missing required field ...`)
    err = refused(tmp_path, variant(lambda d: d["deployment"].pop("served_model_name")))
    assert (err.path, err.message) == ("deployment.served_model_name", "required field is missing")


def test_stage_deployment_must_be_a_mapping(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(lambda d: d["deployment"]["stages"].update(talker=[2])))
    assert err.path == "deployment.stages.talker"
    assert "object" in err.message


def test_empty_served_model_name(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(lambda d: d["deployment"].update(served_model_name="")))
    assert err.path == "deployment.served_model_name"


def test_default_max_tokens_over_the_limit(tmp_path: Path) -> None:
    def mutate(d):
        d["deployment"]["max_tokens_limit"] = 8
        d["stage_args"][0]["default_sampling_params"] = {"max_tokens": 32}
    err = refused(tmp_path, variant(mutate))
    assert err.path == "stage_args[0].default_sampling_params.max_tokens"
    assert "over deployment.max_tokens_limit (8)" in err.message


def test_duplicate_yaml_key_names_its_line(tmp_path: Path) -> None:
    text = yaml.safe_dump(BASE, sort_keys=False) + "deployment:\n  served_model_name: again\n"
    err = refused(tmp_path, text)
    assert err.path.startswith("line ")
    assert err.message == "duplicate key `deployment`"


def test_yaml_merge_keys_are_taken_and_overridden_by_the_mappings_own(tmp_path: Path) -> None:
    """``<<: *common`` (YAML's merge key, which PyYAML and vLLM-Omni's OmegaConf take) was
    refused by the duplicate-key check (a review)."""
    text = yaml.safe_dump(BASE, sort_keys=False).replace(
        "stage_args:\n", "common: &common {dtype: float32, model_stage: nothing}\nstage_args:\n", 1)
    text = text.replace("engine_args:\n    model_stage: thinker",
                        "engine_args:\n    <<: *common\n    model_stage: thinker", 1)
    assert "<<: *common" in text
    cfg = load_config(write(tmp_path, text))
    assert cfg.stage_args[0].engine_args["dtype"] == "float32"
    assert cfg.stage_args[0].engine_args["model_stage"] == "thinker"
    err = refused(tmp_path, text.replace("    <<: *common\n", "    <<: *common\n    dtype: x\n    dtype: y\n"))
    assert err.message == "duplicate key `dtype`"  # (still refused where the mapping itself repeats one)


def test_a_control_character_in_a_config_is_one_line_naming_its_line(tmp_path: Path) -> None:
    """A stray Ctrl-Z was PyYAML's two lines, the second `in "<unicode string>", position 155`."""
    text = yaml.safe_dump(BASE, sort_keys=False).replace("stage_id: 1", "stage_id: 1\x1a", 1)
    line = text[:text.index("\x1a")].count("\n") + 1
    err = refused(tmp_path, text)
    assert (err.path, err.message) == (f"line {line}", "not valid YAML: character U+001A is not allowed (YAML "
                                       "allows no control character but tab and line breaks)")


def test_synthetic_stage_name_it_cannot_emulate(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(lambda d: (d["stage_args"][1]["engine_args"].update(model_stage="bogus"),
                                               d["deployment"]["stages"].pop("talker"))))
    assert err.path == "stage_args[1].engine_args.model_stage"
    assert "no `bogus` stage" in err.message and "synthetic.kind" in err.message


def test_non_text_stage_budgets_are_not_bound_by_the_api_limit(tmp_path: Path) -> None:
    def mutate(d):
        d["deployment"]["max_tokens_limit"] = 2048
        d["stage_args"][2]["default_sampling_params"] = {"max_tokens": 65536}  # Code2Wav, as vLLM-Omni ships
    assert load_config(write(tmp_path, variant(mutate))).stage(2).default_sampling_params["max_tokens"] == 65536



# -- durations and counts: finite, bounded ----------------------------------

DAY = "must be a finite number of seconds > 0 and <= 86400 (a day), got"


def deployment(*keys: str, value: Any) -> Callable[[dict], None]:
    """Set ``deployment.<keys...>`` to ``value``."""
    def mutate(d: dict) -> None:
        node = d["deployment"]
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
    return mutate


@pytest.mark.parametrize(("keys", "value", "message"), [
    (("request_timeout_s",), float("inf"), f"{DAY} inf"),
    (("ready_timeout_s",), float("nan"), f"{DAY} nan"),
    (("request_timeout_s",), 1e30, f"{DAY} 1e+30"),
    (("heartbeat_interval_s",), float("inf"),
     "must be a finite number of seconds >= 0.1 and <= 600 (10 minutes), got inf"),
    (("supervision", "stall_timeout_s"), 86401.0, f"{DAY} 86401.0"),
    (("supervision", "queue_timeout_s"), float("-inf"),
     "must be a finite number of seconds >= 0 and <= 86400 (a day), got -inf"),
    (("supervision", "drain_timeout_s"), float("inf"),
     "must be a finite number of seconds >= 0 and <= 86400 (a day), got inf"),
    (("supervision", "restart", "initial_backoff_s"), float("inf"),
     "must be a finite number of seconds >= 0 and <= 3600 (an hour), got inf"),
    (("supervision", "restart", "max_backoff_s"), 1e12,
     "must be a finite number of seconds >= 0 and <= 3600 (an hour), got 1000000000000.0"),
    (("supervision", "restart", "window_s"), float("inf"), f"{DAY} inf"),
    (("streaming", "chunk_timeout_s"), float("inf"),
     "must be a finite number of seconds > 0 and <= 3600 (an hour), got inf"),
    (("request_actors",), 10 ** 30, "must be an integer >= 1 and <= 1024, got about 10^30"),
    (("supervision", "missed_heartbeats"), 10 ** 6, "must be an integer >= 1 and <= 100, got 1000000"),
    (("supervision", "restart", "max_restarts"), 5000, "must be an integer >= 0 and <= 1000, got 5000"),
    (("supervision", "circuit_breaker_failures"), 10 ** 30, "must be an integer >= 1 and <= 1000, got about 10^30"),
    (("supervision", "max_task_attempts"), 101, "must be an integer >= 1 and <= 100, got 101"),
    (("supervision", "max_task_crashes"), 0, "must be an integer >= 1 and <= 100, got 0"),
    (("max_tokens_limit",), 10 ** 30, "must be an integer >= 1 and <= 1048576, got about 10^30"),
    (("inline_threshold_bytes",), 1 << 30, "must be an integer >= 0 and <= 67108864, got 1073741824"),
], ids=lambda v: ".".join(v) if isinstance(v, tuple) else None)
def test_infinite_or_huge_durations_and_counts_are_refused_with_their_bounds(
        tmp_path: Path, keys: tuple[str, ...], value: Any, message: str) -> None:
    err = refused(tmp_path, variant(deployment(*keys, value=value)))
    assert err.path == "deployment." + ".".join(keys)
    assert err.message == message


def test_inf_written_in_yaml_names_the_field(tmp_path: Path) -> None:
    text = yaml.safe_dump(BASE, sort_keys=False).replace(
        "served_model_name: test-model", "served_model_name: test-model\n  request_timeout_s: .inf")
    err = refused(tmp_path, text)
    assert str(err).endswith(f"deployment.request_timeout_s: {DAY} inf")


@pytest.mark.parametrize(("stage_keys", "value", "message"), [
    (("replicas",), 10 ** 30, "must be an integer >= 1 and <= 1024, got about 10^30"),
    (("replicas",), 1025, "must be an integer >= 1 and <= 1024, got 1025"),
    (("devices_per_replica",), 4096, "must be an integer >= 1 and <= 1024, got 4096"),
    (("synthetic", "startup_s"), float("inf"),
     "must be a finite number of seconds >= 0 and <= 3600 (an hour), got inf"),
    (("synthetic", "decode_ms_per_token"), float("nan"),
     "must be a finite number of milliseconds >= 0 and <= 60000 (a minute), got nan"),
], ids=lambda v: ".".join(v) if isinstance(v, tuple) else None)
def test_stage_deployment_bounds(tmp_path: Path, stage_keys: tuple[str, ...], value: Any, message: str) -> None:
    def mutate(d: dict) -> None:
        node = d["deployment"]["stages"]["talker"]
        for k in stage_keys[:-1]:
            node = node.setdefault(k, {})
        node[stage_keys[-1]] = value
    err = refused(tmp_path, variant(mutate))
    assert err.path == "deployment.stages.talker." + ".".join(stage_keys)
    assert err.message == message


def test_the_bounds_themselves_are_accepted(tmp_path: Path) -> None:
    def mutate(d: dict) -> None:
        d["deployment"].update(request_timeout_s=86400, ready_timeout_s=86400, heartbeat_interval_s=600,
                               request_actors=1024, supervision={"queue_timeout_s": 0, "drain_timeout_s": 0})
        d["deployment"]["stages"]["talker"]["replicas"] = 1024
    warnings = []
    cfg = load_config(write(tmp_path, variant(mutate)), on_warning=warnings.append)
    assert cfg.deployment.request_timeout_s == 86400 and cfg.deployment.heartbeat_interval_s == 600
    assert cfg.deployment_of(cfg.stage_by_name("talker")).replicas == 1024
    # (accepted, but said to be more than a host like this one can start: trial AV's 1,000
    # replicas on 2 CPUs passed `check-config`, and were not ready after 110 s)
    assert [w for w in warnings if "replicas in all" in w] == [
        f"{cfg.source}: deployment.stages.talker.replicas: {sum(cfg.deployment_of(s).replicas for s in cfg.stage_args)} "
        f"replicas in all (talker: 1024), each a process with its own engine: a host of {os.cpu_count()} CPU(s) like "
        "this one that runs them all takes minutes to start them and may run out of memory (more than 16 per CPU); "
        "member hosts share them out"], warnings


def test_the_shipped_cpu_demos_get_no_warning_about_their_replica_count_even_on_one_cpu() -> None:
    from omni_actors.config import _replica_count_warnings

    for name in ("cpu_omni_demo.yaml", "cpu_image_demo.yaml"):
        assert _replica_count_warnings(load_config(ROOT / "configs" / name), cpus=1) == [], name


def test_an_exponent_float_is_a_float_as_in_yaml_1_2(tmp_path: Path) -> None:
    """PyYAML reads ``1e3`` as the string "1e3" (YAML 1.1); a user means 1000 s."""
    text = yaml.safe_dump(BASE, sort_keys=False).replace(
        "served_model_name: test-model", "served_model_name: test-model\n  request_timeout_s: 1e3")
    path = tmp_path / "exp.yaml"
    path.write_text(text)
    assert load_config(path).deployment.request_timeout_s == 1000.0


def test_a_wrong_type_says_what_was_given_and_what_is_wanted(tmp_path: Path) -> None:
    """Trial BA: `request_timeout_s: 60s` read only "Expected `float`, got `str`"."""
    err = refused(tmp_path, variant(deployment("request_timeout_s", value="60s")))
    assert err.path == "deployment.request_timeout_s"
    assert err.message == "must be a finite number of seconds > 0 and <= 86400 (a day), got '60s'"
    err = refused(tmp_path, variant(deployment("load_balancing", value=3)))  # (a field with no bounds)
    assert (err.path, err.message) == ("deployment.load_balancing", "Expected `str`, got `int`: 3")


# -- unknown stage keys: a warning with the key meant --------------------------


def warnings_of(data: Any, tmp_path: Path) -> tuple[list[dict], Any]:
    """The structlog events of loading ``data``, and the config (or the ConfigError)."""
    with capture_logs() as logs:
        try:
            result: Any = load_config(write(tmp_path, data))
        except ConfigError as exc:
            result = exc
    return [e for e in logs if e["event"] == "config_unknown_key"], result


@pytest.mark.parametrize(("mutate", "path", "meant"), [
    (stage(1, engine_input_sources=[0]), "stage_args[1].engine_input_sources", "engine_input_source"),
    (stage(0, final_ouput=True), "stage_args[0].final_ouput", "final_output"),
    (stage(1, custom_process_input_fn="omni_actors.processors.thinker2talker"),
     "stage_args[1].custom_process_input_fn", "custom_process_input_func"),
    (stage(1, input_sources=[0]), "stage_args[1].input_sources", "engine_input_source"),  # the deploy format's name
    (stage(0, runtime={"device": "0"}), "stage_args[0].runtime.device", "devices"),
    (stage(0, engine_args={"model_stage": "thinker", "tensor_paralel_size": 2}),
     "stage_args[0].engine_args.tensor_paralel_size", "tensor_parallel_size"),
    (lambda d: d.update(runtim={"edges": [{"from": 0, "to": 1}]}), "runtim", "runtime"),  # (a trial's: silent)
    # two letters swapped in a short key (a trial's `modle`: difflib rates it below its cutoff)
    (stage(1, engine_args={"model_stage": "talker", "modle": "x"}), "stage_args[1].engine_args.modle", "model"),
], ids=["engine_input_sources", "final_ouput", "custom_process_input_fn", "input_sources", "runtime.device",
        "engine_args.tensor_paralel_size", "top-level runtim", "engine_args.modle"])
def test_a_misspelt_stage_key_is_loaded_with_a_warning_naming_the_key_meant(
        tmp_path: Path, mutate: Callable[[dict], None], path: str, meant: str) -> None:
    events, cfg = warnings_of(variant(mutate), tmp_path)
    assert isinstance(cfg, PipelineConfig)
    assert [(e["path"], e["log_level"]) for e in events] == [(path, "warning")]
    assert events[0]["config"] == str(tmp_path / "cfg.yaml")
    assert events[0]["message"].endswith(f"did you mean `{meant}`?")


def test_the_warning_comes_before_the_error_it_explains(tmp_path: Path) -> None:
    """``final_ouput`` on the only final stage: the graph has no final stage."""
    def mutate(d: dict) -> None:
        d["stage_args"] = d["stage_args"][:1]
        d["stage_args"][0].pop("final_output")
        d["stage_args"][0]["final_ouput"] = True
        d["deployment"]["stages"] = {}
    events, err = warnings_of(variant(mutate), tmp_path)
    assert isinstance(err, ConfigError) and "no stage has final_output" in err.message
    assert [e["path"] for e in events] == ["stage_args[0].final_ouput"]


def test_unknown_keys_that_are_no_near_miss_are_kept_quietly(tmp_path: Path) -> None:
    """vLLM-Omni keeps keys it does not know (``tts_args``...), and engine arguments are open-ended."""
    def mutate(d: dict) -> None:
        d["stage_args"][0].update(tts_args={"x": 1}, my_own_note="kept", is_comprehension=True,
                                  runtime={"process": True, "max_batch_size": 1})
        d["stage_args"][0]["engine_args"].update(data_parallel_size_local=1, ec_transfer_config={},
                                                 mm_processor_cache_type="lru", async_scheduling=True)
    events, cfg = warnings_of(variant(mutate), tmp_path)
    assert isinstance(cfg, PipelineConfig) and events == []


def test_any_unknown_top_level_key_is_warned_about(tmp_path: Path) -> None:
    """The top level of a legacy config takes a few known keys (trial BA: `colour: blue` there
    passed in silence, where `deploymnt:` was warned about): any other one is warned about,
    and the config still loads."""
    lines: list[str] = []
    path = write(tmp_path, variant(lambda d: d.update(colour="blue")))
    assert isinstance(load_config(path, on_warning=lines.append), PipelineConfig)
    assert lines == [f"{path}: colour: unknown key (ignored); expected one of: async_chunk, deployment, env, "
                     "runtime, stage_args"]


def test_on_warning_gets_one_line_per_warning_instead_of_the_log(tmp_path: Path) -> None:
    lines: list[str] = []
    path = write(tmp_path, variant(stage(0, final_ouput=True)))
    with capture_logs() as logs:
        load_config(path, on_warning=lines.append)
    assert logs == []
    assert lines == [f"{path}: stage_args[0].final_ouput: unknown key (ignored); did you mean `final_output`?"]


def test_deploy_format_stage_typos_are_warned_with_the_files_paths() -> None:
    data = yaml.safe_load((ROOT / "configs" / "cpu_vllm_omni_deploy.yaml").read_text())
    data["stages"][1]["num_replica"] = 3
    data["stages"][0]["engine_args"] = {"max_num_seq": 4}
    lines: list[str] = []
    cfg = parse_config(data, "deploy.yaml", on_warning=lines.append)
    assert cfg.stage_args
    assert lines == [
        "deploy.yaml: stages[0].engine_args.max_num_seq: unknown key (passed to the engine, which may refuse it); "
        "did you mean `max_num_seqs`?",
        "deploy.yaml: stages[1].num_replica: unknown key (passed to the engine, which may refuse it); "
        "did you mean `num_replicas`?"]


def test_sampling_parameter_typos_are_warned_about_and_numbers_checked_on_any_backend(tmp_path: Path) -> None:
    """Trial BT: `max_token: 32` and `temperature: hot` on a synthetic stage (which ignores
    what it does not use) passed in silence; on a vLLM stage the second read "TypeError:
    '<' not supported between instances of 'int' and 'str'", naming no field."""
    lines: list[str] = []
    path = write(tmp_path, variant(stage(0, default_sampling_params={"max_token": 32, "temperature": 0.5})))
    load_config(path, on_warning=lines.append)
    assert lines == [f"{path}: stage_args[0].default_sampling_params.max_token: unknown key (vLLM refuses it; "
                     "the synthetic engine ignores it); did you mean `max_tokens`?"]
    for key, value, expected in (("temperature", "hot", "a number"), ("top_k", 2.5, "an integer"),
                                 ("top_p", True, "a number")):
        err = refused(tmp_path, variant(stage(0, default_sampling_params={key: value})))
        assert (err.path, err.message) == (f"stage_args[0].default_sampling_params.{key}",
                                           f"expected {expected}, got `{value!r}`")
    data = yaml.safe_load((ROOT / "configs" / "cpu_vllm_omni_deploy.yaml").read_text())
    data["stages"][0]["default_sampling_params"] = {"temprature": 0.0}
    lines = []
    parse_config(data, "deploy.yaml", on_warning=lines.append)
    assert lines == ["deploy.yaml: stages[0].default_sampling_params.temprature: unknown key (vLLM refuses it; the "
                     "synthetic engine ignores it); did you mean `temperature`?"]


def test_deploy_format_top_level_typos_are_warned_about() -> None:
    """A deploy file's top level is vLLM-Omni's and open (``session_mode``, ``model_runner``...):
    near misses of its keys are warned about, other keys kept quietly."""
    data = yaml.safe_load((ROOT / "configs" / "cpu_vllm_omni_deploy.yaml").read_text())
    data.update(async_chunks=True, conectors={}, trust_remote_cod=True, session_mode="x", my_note=1)
    lines: list[str] = []
    cfg = parse_config(data, "deploy.yaml", on_warning=lines.append)
    assert cfg.vllm_omni.async_chunk is data["async_chunk"]  # (the misspelt one changed nothing)
    assert lines == [f"deploy.yaml: {key}: unknown key (ignored); did you mean `{meant}`?" for key, meant in
                     [("async_chunks", "async_chunk"), ("conectors", "connectors"),
                      ("trust_remote_cod", "trust_remote_code")]]
    # (trial CH: a legacy config's `runtime` block in a deploy file was dropped without a word)
    data = yaml.safe_load((ROOT / "configs" / "cpu_vllm_omni_deploy.yaml").read_text())
    data["runtime"] = {"connectors": {"x": {"name": "SharedMemoryConnector"}}}
    lines = []
    parse_config(data, "deploy.yaml", on_warning=lines.append)
    assert lines == ["deploy.yaml: runtime: ignored: the `stage_args` format's block; a deploy file names its "
                     "connectors and edges at the top level (`connectors:`, `edges:`)"]


def test_typos_in_the_top_level_runtime_and_a_shared_memory_connectors_extra_are_warned_about(
        tmp_path: Path) -> None:
    """Trial CH: `conectors:` and `edgs:` under the top-level `runtime`, and `shm_threshold_byte`
    in a SharedMemoryConnector's `extra`, each left a setting out without a word."""
    def mutate(d: dict) -> None:
        d["runtime"] = {"enabled": True, "conectors": {}, "edgs": [],
                        "connectors": {"c1": {"name": "SharedMemoryConnector",
                                              "extra": {"shm_threshold_byte": 1024}}}}
    lines: list[str] = []
    path = write(tmp_path, variant(mutate))
    cfg = load_config(path, on_warning=lines.append)
    assert cfg.inline_threshold_of(cfg.stage(0)) == cfg.deployment.inline_threshold_bytes
    assert lines == [f"{path}: {key}: unknown key (ignored); did you mean `{meant}`?" for key, meant in [
        ("runtime.conectors", "connectors"), ("runtime.edgs", "edges"),
        ("runtime.connectors.c1.extra.shm_threshold_byte", "shm_threshold_bytes")]]


def test_a_stages_runtime_num_replicas_is_its_replica_count_unless_the_deployment_says(tmp_path: Path) -> None:
    """vLLM-Omni's per-stage `runtime.num_replicas` in a `stage_args` config was ignored without
    a word (trial CH: 3 asked, 1 ran). It counts as a deploy file's does: where
    `deployment.stages.<stage>.replicas` is not given; where both are and differ, ours, noted."""
    def mutate(d: dict) -> None:
        d["stage_args"][0]["runtime"] = {"num_replicas": 3}
        d["stage_args"][1]["runtime"] = {"num_replicas": 5}  # (deployment: talker replicas 2)
        d["stage_args"][2]["runtime"] = {"num_replicas": 4}  # (an entry without replicas: a review's)
        d["deployment"]["stages"]["code2wav"] = {"synthetic": {"max_concurrency": 2}}
    cfg = load_config(write(tmp_path, variant(mutate)))
    assert [cfg.deployment_of(s).replicas for s in cfg.stage_args] == [3, 2, 4]
    assert cfg.deployment_of(cfg.stage(1)).synthetic.max_concurrency == 4  # (the rest of its entry kept)
    assert cfg.deployment_of(cfg.stage(2)).synthetic.max_concurrency == 2
    assert cfg.omni_connectors.notes == [
        "stage_args[0].runtime.num_replicas (3): applied as deployment.stages.thinker.replicas",
        "deployment.stages.talker.replicas (2) is used, not stage_args[1].runtime.num_replicas (5)",
        "stage_args[2].runtime.num_replicas (4): applied as deployment.stages.code2wav.replicas"]
    for bad in (0, "3", True, 2000):
        err = refused(tmp_path, variant(stage(0, runtime={"num_replicas": bad})))
        assert err.path == "stage_args[0].runtime.num_replicas" and "from 1 to 1024" in err.message, err


def test_vllm_omni_keys_not_applied_in_a_stage_args_config_are_noted(tmp_path: Path) -> None:
    """Trial CH: a top-level `env` and `async_chunk: true` passed in silence (a deploy file's got a note)."""
    def mutate(d: dict) -> None:
        d.update(env={"FOO": "1"}, async_chunk=True)
        d["stage_args"][2]["runtime"] = {"env": {"A": "b"}}
    notes = load_config(write(tmp_path, variant(mutate))).omni_connectors.notes
    assert [n.split(":")[0] for n in notes] == ["stage_args[2].runtime.env", "env", "async_chunk"], notes
    assert all("not applied" in n for n in notes)


@pytest.mark.parametrize("path", EVERY_CONFIG, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_shipped_config_loads_without_warnings(path: Path) -> None:
    with capture_logs() as logs:
        load_config(path)
    assert logs == []


def _vllm_omni_yamls() -> list[Path]:
    spec = importlib.util.find_spec("vllm_omni")
    roots = ([Path(p) for p in spec.submodule_search_locations] if spec and spec.submodule_search_locations
             else sorted(ROOT.glob(".venv-omni/lib/python*/site-packages/vllm_omni"))[-1:])
    return [p for root in roots for p in sorted(root.rglob("*.yaml"))]


@pytest.mark.skipif(not _vllm_omni_yamls(), reason="no vllm_omni here nor in .venv-omni (make test-vllm-omni)")
def test_vllm_omnis_shipped_yamls_have_no_key_that_looks_misspelt() -> None:
    found = {}
    for path in _vllm_omni_yamls():
        data = yaml.safe_load(path.read_text())
        if isinstance(data, dict) and (warnings := unknown_key_warnings(data)):
            found[path.name] = warnings
    assert found == {}


# -- processors whose module fails to import ---------------------------------


@pytest.mark.parametrize(("source", "cause"), [
    ("def thinker2talker(:\n    pass\n", "SyntaxError: "),
    ("import no_such_dependency_here\n", "cannot import `{mod}`: No module named 'no_such_dependency_here'"),
    ("from os import no_such_name\n", "ImportError: cannot import name 'no_such_name' from 'os'"),
    ("raise RuntimeError('needs a GPU\\nsecond line')\n", "RuntimeError: needs a GPU"),
    ("import sys\nsys.exit(3)\n", "SystemExit: 3"),
], ids=["syntax-error", "missing-dependency", "import-error", "raises", "exits"])
def test_processor_module_that_fails_to_import_is_a_config_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest, source: str,
        cause: str) -> None:
    mod = f"broken_processor_{request.node.callspec.id.replace('-', '_')}"
    (tmp_path / f"{mod}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    err = refused(tmp_path, variant(stage(1, custom_process_input_func=f"{mod}.thinker2talker")))
    assert err.path == "stage_args[1].custom_process_input_func"
    assert err.message.startswith(f"cannot import `{mod}`: ")
    assert cause.format(mod=mod) in err.message
    if cause == "SyntaxError: ":
        assert f"({mod}.py, line 1)" in err.message


# -- device lists ------------------------------------------------------------------


@pytest.mark.parametrize(("devices", "message"), [
    ("gpu0,,x", "empty item in 'gpu0,,x'"),
    ("0,0", "device 0 given twice in '0,0'"),
    ("a,b", "'a', 'b' are not device ids in 'a,b'"),
    ("0,-1", "'-1' is not a device id in '0,-1'"),
    (-1, "'-1' is not a device id in '-1'"),
    ("", "empty: give device ids"),
    ("99999999999999999999", "device id 99999999999999999999 in '99999999999999999999' is not one a host has"),
    ([0, 0], "device 0 given twice in '0,0'"),
], ids=["empty-item", "twice", "not-integers", "negative", "negative-number", "blank", "huge", "list-twice"])
def test_runtime_devices_must_be_a_device_id_list(tmp_path: Path, devices: Any, message: str) -> None:
    err = refused(tmp_path, variant(stage(2, runtime={"devices": devices})))
    assert err.path == "stage_args[2].runtime.devices"
    assert err.message.startswith(message)


def test_runtime_devices_are_kept_canonical(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, variant(lambda d: (stage(0, runtime={"devices": " 0, 1"})(d),
                                                         stage(1, runtime={"devices": 3})(d),
                                                         stage(2, runtime={"devices": [2, 4]})(d)))))
    assert (cfg.stage(0).runtime.devices, cfg.stage(1).runtime.devices, cfg.stage(2).runtime.devices) == \
        ("0,1", "3", "2,4")


@pytest.mark.parametrize(("text", "ids"), [("", ()), (" ", ()), ("0", ("0",)), ("3, 1,2", ("3", "1", "2"))])
def test_parse_devices(text: str, ids: tuple[str, ...]) -> None:
    assert parse_devices(text) == ids


# -- the command line: --devices and check-config -------------------------------------


def _run_cli(*args: str, tmp_path: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "omni_actors.system", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, stdin=subprocess.DEVNULL,
                          env={**os.environ, "OMNI_ACTORS_STATE_DIR": str(tmp_path)})


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize(("devices", "why"), [
    ("0,0", "device 0 given twice"), ("a,b", "'a', 'b' are not device ids"), ("0,,1", "empty item")],
    ids=["duplicate", "not-integers", "empty-item"])
def test_start_with_a_bad_device_list_fails_fast_with_one_line_and_starts_nothing(
        tmp_path: Path, devices: str, why: str) -> None:
    from omni_actors.system.local import free_port

    port, admin_port = free_port(), free_port()
    t0 = time.monotonic()
    out = _run_cli("start", "--convention-leader", "--devices", devices, "--port", str(port),
                   "--admin-port", str(admin_port), tmp_path=tmp_path)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert out.stderr.count("\n") == 1 and out.stderr.startswith(f"error: --devices: {why}"), out.stderr
    assert time.monotonic() - t0 < 30
    # nothing was started: no state file, no admin, no HTTP server
    assert list(tmp_path.iterdir()) == []
    assert _port_is_free(admin_port) and _port_is_free(port)


def test_member_and_stage_launch_check_devices_before_reaching_anything(tmp_path: Path) -> None:
    from omni_actors.system.local import free_port

    out = _run_cli("start", "--convention-address", "127.0.0.1:9", "--admin-port", str(free_port()),
                   "--devices", "1,1", tmp_path=tmp_path)
    assert (out.returncode, out.stderr) == (2, "error: --devices: device 1 given twice in '1,1'\n")
    # no admin listens on that port: the device list is refused before anything is asked
    out = _run_cli("stage", "launch", "--stage", "talker", "--devices", "2,x", "--admin-port", str(free_port()),
                   tmp_path=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith("error: --devices: 'x' is not a device id"), out.stderr
    assert list(tmp_path.iterdir()) == []


def test_check_config_says_what_a_good_config_serves(tmp_path: Path) -> None:
    out = _run_cli("check-config", "--config", str(ROOT / "configs" / "cpu_omni_demo.yaml"), tmp_path=tmp_path)
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout == "ok: 3 stages (thinker x1, talker x2, code2wav x1)\n"


def test_check_config_prints_warnings_then_ok(tmp_path: Path) -> None:
    path = write(tmp_path, variant(stage(1, engine_input_sources=[0])))
    out = _run_cli("check-config", "--config", str(path), tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stderr == (f"warning: {path}: stage_args[1].engine_input_sources: unknown key (ignored); "
                          "did you mean `engine_input_source`?\n")
    assert out.stdout.startswith("ok: 3 stages")


def test_check_config_refuses_a_bad_config_with_one_line_and_exit_1(tmp_path: Path) -> None:
    (tmp_path / "bad_syntax_processor.py").write_text("def f(:\n")
    path = write(tmp_path, variant(stage(1, custom_process_input_func="bad_syntax_processor.f")))
    out = subprocess.run([sys.executable, "-m", "omni_actors.system", "check-config", "--config", str(path)],
                         capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])})
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1, out.stderr  # one line, no traceback
    assert out.stderr.startswith(f"error: {path}: stage_args[1].custom_process_input_func: "
                                 "cannot import `bad_syntax_processor`: SyntaxError: ")


# ------------------------------------------------------- from a trial's broken configs

def test_a_config_that_is_not_utf8_is_refused_with_its_line(tmp_path: Path) -> None:
    """A trial's non-UTF-8 byte in a config ended `check-config` and `start` in a
    UnicodeDecodeError traceback."""
    text = yaml.safe_dump(BASE, sort_keys=False).replace("test-model", "mi\udcff\udcfene")
    path = tmp_path / "cfg.yaml"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    line = next(n for n, row in enumerate(text.splitlines(), 1) if "mi" in row and "served" in row)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    assert (err.path, "\n" in str(err)) == (f"line {line}", False), str(err)
    assert err.message.startswith("not UTF-8 text: byte ") and "invalid start byte" in err.message, err.message


def test_a_config_in_utf16_with_its_bom_loads_as_yaml_allows(tmp_path: Path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_bytes(yaml.safe_dump(BASE, sort_keys=False).encode("utf-16"))
    assert load_config(path).deployment.served_model_name == "test-model"


def test_a_processor_stage_with_no_upstream_is_refused(tmp_path: Path) -> None:
    """A trial's Code2Wav with `engine_input_source: []` passed check-config; every audio
    request then failed with a 400 ("talker2code2wav: needs at least one upstream stage")."""
    err = refused(tmp_path, variant(stage(2, engine_input_source=[])))
    assert err.path == "stage_args[2].engine_input_source"
    assert err.message.startswith("empty, but custom_process_input_func "
                                  "`omni_actors.processors.talker2code2wav` makes this stage's input"), err.message


def test_a_stage_whose_outputs_nobody_takes_is_refused(tmp_path: Path) -> None:
    def mutate(d: dict) -> None:  # code2wav takes the Thinker's outputs: nothing takes the Talker's
        d["stage_args"][2].update(engine_input_source=[0], custom_process_input_func=None)

    err = refused(tmp_path, variant(mutate))
    assert err.path == "stage_args[1]"
    assert err.message == ("stage `talker` is not a final output (final_output) and no stage takes its "
                           "outputs (engine_input_source): its work would be thrown away")


def test_a_source_named_twice_is_refused(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(stage(2, engine_input_source=[1, 1])))
    assert (err.path, err.message) == ("stage_args[2].engine_input_source[1]", "stage_id 1 is named twice")


def test_an_unknown_edge_field_lists_the_yaml_names(tmp_path: Path) -> None:
    """It said "unknown field `from_stage` (did you mean `from_stage`?); expected one of:
    from_stage, to_stage, ...": the Python names, not the YAML keys `from` and `to`."""
    err = refused(tmp_path, variant(lambda d: d.update(runtime={"edges": [{"from_stage": 0, "to_stage": 1}]})))
    assert err.path == "runtime.edges[0].from_stage"
    assert err.message == "unknown field `from_stage`; expected one of: from, to, window_size, max_inflight"


def test_a_stage_with_a_model_but_no_deployment_entry_is_warned_that_it_runs_synthetic() -> None:
    """Trial Y: the Thinker left out of `deployment.stages` of the vLLM chain ran the synthetic
    engine (the default backend) and `check-config` said ok; it still loads (a deliberate
    synthetic stand-in), with one warning naming the model that is not loaded."""
    data = yaml.safe_load((ROOT / "configs" / "cpu_vllm_chain.yaml").read_text())
    del data["deployment"]["stages"]["thinker"]
    lines: list[str] = []
    cfg = parse_config(data, "chain.yaml", on_warning=lines.append)
    assert cfg.deployment.stages.get("thinker") is None
    assert lines == [
        "chain.yaml: deployment.stages.thinker: missing: stage thinker runs the synthetic engine, and its model "
        "'~/.cache/omni-actors/tiny-s0-v1000-h256-l2-a4-r1' (stage_args engine_args.model) is not loaded; "
        "give it `backend: vllm` or `vllm_omni`"]


@pytest.mark.parametrize("text", ["", "# only a comment\n", "---\n"])
def test_an_empty_config_file_says_it_is_empty(tmp_path: Path, text: str) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == (f"{path}: <top>: the file is empty, or holds only comments (expected a mapping "
                              "with `stage_args` and `deployment`)")


@pytest.mark.parametrize(("text", "path", "expect"), [
    # (a trial's deploy-format file without a `stages:` list was told that `stage_args` was missing)
    ("topology:\n  stages: []\ndeployment: {served_model_name: x}\n", "topology.stages", "expected at least one stage"),
    ("pipeline: qwen3_omni\ndeployment: {served_model_name: x}\n", "pipeline", "a deploy file has no stage graph"),
    ("deployment: {served_model_name: x}\n", "stage_args",
     "required field is missing: the stage graph, as a `stage_args` list (vLLM-Omni's stage configs) or in "
     "vLLM-Omni's deploy format (a `stages:` list with a `topology:` block or a `pipeline:` key)"),
], ids=["topology-only", "pipeline-only", "neither"])
def test_a_config_without_a_stage_graph_says_which_forms_it_may_take(tmp_path: Path, text, path, expect) -> None:
    try:
        import vllm_omni  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("vllm_omni is installed here (its registry would give the pipeline a stage graph)")
    err = refused(tmp_path, text)
    assert err.path == path and expect in err.message, (err.path, err.message)


def test_a_bound_without_a_unit_says_what_was_given(tmp_path: Path) -> None:
    """(A trial's ``chunk_tokens: 0`` said only "Expected `int` >= 1"; other bounds say "got".)"""
    err = refused(tmp_path, variant(lambda d: d["deployment"].update(streaming={"chunk_tokens": 0})))
    assert (err.path, err.message) == ("deployment.streaming.chunk_tokens", "Expected `int` >= 1, got 0")


def test_check_config_warns_of_a_real_engines_local_model_directory_missing_here(tmp_path: Path) -> None:
    """Trial BC: `check-config` said ok to a Thinker whose model directory did not exist, and
    `start` then failed its replica. A warning (the config may be checked on another host than
    the ones that run it) for local paths only: a model id is the engine's to fetch."""
    from omni_actors.system.__main__ import _missing_model_dirs

    data = yaml.safe_load((ROOT / "configs" / "cpu_vllm_chain.yaml").read_text())
    data["stage_args"][0]["engine_args"]["model"] = str(tmp_path / "nope")
    data["stage_args"][1]["engine_args"]["model"] = str(tmp_path)  # (there)
    path = write(tmp_path, data)
    assert _missing_model_dirs(load_config(path)) == [
        f"{path}: stage_args[0].engine_args.model: no directory {tmp_path / 'nope'} on this host: stage thinker's "
        "replicas fail to start on a host without it"]
    data["stage_args"][0]["engine_args"]["model"] = "~no-such-user-here/models/x"  # (it was a traceback)
    assert _missing_model_dirs(load_config(write(tmp_path, data)))[0].startswith(
        f"{path}: stage_args[0].engine_args.model: no directory ~no-such-user-here/models/x on this host")
    data["stage_args"][0]["engine_args"]["model"] = "Qwen/Qwen3-Omni-30B-A3B-Instruct"  # (an id: not checked)
    assert _missing_model_dirs(load_config(write(tmp_path, data))) == []


# -- a code review's configs (session 38) -------------------------------------------


@pytest.mark.parametrize(("mutate", "path", "message"), [
    (stage(1, default_sampling_params={"seed": "42"}), "stage_args[1].default_sampling_params.seed",
     f"expected an integer >= {-(2 ** 63)}, got `'42'`"),
    (stage(0, default_sampling_params={"stop": 5}), "stage_args[0].default_sampling_params.stop",
     "expected a non-empty string or a list of them, got `5`"),
    (stage(1, engine_input_source=[], custom_process_input_func=None), "stage_args[1].engine_input_source",
     "empty, but the synthetic `talker` stage takes another stage's outputs"),
], ids=["seed", "stop", "no-source"])
def test_what_the_synthetic_engine_would_refuse_on_every_request_is_refused_here(tmp_path: Path, mutate, path,
                                                                                 message) -> None:
    """A code review: a bad default `seed` or `stop` of a synthetic stage read as the
    client's 400 on every request; a Talker with no input source failed every audio request."""
    err = refused(tmp_path, variant(mutate))
    assert err.path == path and err.message.startswith(message), err


def test_a_misspelt_module_of_an_engine_package_installed_here_is_refused(tmp_path: Path) -> None:
    """Only a processor of an engine package not installed here is left to that engine; a
    misspelt module of one that is installed passed (a code review), and every replica of
    its stage then failed to load."""
    pytest.importorskip("vllm", reason="needs vllm installed here (make test)")
    err = refused(tmp_path, variant(stage(1, custom_process_input_func="vllm.no_such_module.thinker2talker")))
    assert err.path == "stage_args[1].custom_process_input_func" and "cannot import" in err.message, err


def test_a_key_that_is_not_a_string_a_complex_key_and_deep_nesting_are_one_line_errors(tmp_path: Path) -> None:
    """A code review: a number as a key read `<top>` and msgspec's own words; a complex key
    (`? [a, b]`) and thousands of nested `[` were tracebacks."""
    err = refused(tmp_path, variant(stage(0, default_sampling_params={5: 1})))
    assert err.path == "stage_args[0].default_sampling_params" and "keys must be strings" in err.message, err
    err = refused(tmp_path, "? [a, b]\n: 1\n")
    assert err.path == "line 1" and "a key must be a plain value, not a list" in err.message, err
    err = refused(tmp_path, "[" * 3000 + "]" * 3000 + "\n")
    assert "nested too deeply" in err.message, err


def test_synthetic_sizes_have_upper_bounds(tmp_path: Path) -> None:
    """A code review: `hidden_size: 100000000000` passed, and the first request asked for a
    tensor of that many floats per prompt token."""
    err = refused(tmp_path, variant(stage_deployment("thinker", synthetic={"hidden_size": 10 ** 11})))
    assert err.path == "deployment.stages.thinker.synthetic.hidden_size"
    assert err.message == "must be an integer >= 1 and <= 65536, got 100000000000", err


@pytest.mark.parametrize(("text", "problem"), [
    ("1:30", "`1:30` is a YAML 1.1 base-60 number, which reads as 90"),
    ("010", "`010` is a YAML 1.1 octal number, which reads as 8"),
])
def test_yaml_11_base_60_and_octal_numbers_are_refused(tmp_path: Path, text: str, problem: str) -> None:
    """A code review: `request_timeout_s: 1:30` read as 90 and `cpus: 010` as CPU 8 (YAML 1.1
    forms that YAML 1.2 has not); refused with the line and how to write it. `0x1F`, `1e3`,
    `1_000`, `0` and a quoted `'010'` read as before."""
    good = yaml.safe_dump(BASE, sort_keys=False)
    err = refused(tmp_path, good.replace("served_model_name: test-model",
                                         f"served_model_name: test-model\n  request_timeout_s: {text}"))
    assert err.path.startswith("line ") and problem in err.message, err
    cfg = load_config(write(tmp_path, good.replace("served_model_name: test-model",
                                                   "served_model_name: test-model\n  request_timeout_s: 1_000")))
    assert cfg.deployment.request_timeout_s == 1000


def test_a_blank_model_name_and_an_empty_node_name_are_refused(tmp_path: Path) -> None:
    """A code review: `served_model_name: "  "` (no client could name it) and `nodes: [""]`
    (a node that never joins) passed."""
    err = refused(tmp_path, variant(lambda d: d["deployment"].update(served_model_name="  ")))
    assert (err.path, err.message) == ("deployment.served_model_name", "blank: give the model name clients ask for")
    err = refused(tmp_path, variant(stage_deployment("talker", nodes=[""])))
    assert err.path == "deployment.stages.talker.nodes[0]", err
