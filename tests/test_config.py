"""Config loading and validation: every shipped config loads, and every bad
config is refused with the YAML path of the bad field and what was expected.

Pure logic: no actor system. Bad configs are small YAML files written to
``tmp_path`` from a minimal valid base (Thinker -> Talker -> Code2Wav).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from omni_actors.config import ConfigError, PipelineConfig, load_config

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted((ROOT / "configs").glob("*.yaml")) + sorted(
    (ROOT / "tests" / "configs").glob("*.yaml"))

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
    cfg = load_config(write(tmp_path, variant(stage(1, custom_process_input_func=dotted))))
    assert cfg.stage(1).custom_process_input_func == dotted


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
    assert err.path == "stage_args[1]"
    assert "engine_args" in err.message


def test_duplicate_stage_name(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(stage(2, engine_args={"model_stage": "talker"})))
    assert err.path == "stage_args[2].engine_args.model_stage"
    assert "duplicate stage name `talker`" in err.message


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
    assert "no function `DEFAULT_CONFIG`" in err.message


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
    assert ">= 1" in err.message


def test_typo_in_a_stage_deployment_names_the_field(tmp_path: Path) -> None:
    def mutate(d: dict) -> None:
        d["deployment"]["stages"]["talker"] = {"replica": 2}

    err = refused(tmp_path, variant(mutate))
    assert err.path == "deployment.stages.talker.replica"
    assert "unknown field `replica`" in err.message
    assert "replicas" in err.message.split("expected")[1]


def test_unknown_backend(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(stage_deployment("code2wav", backend="torch")))
    assert err.path == "deployment.stages.code2wav.backend"
    assert "torch" in err.message
    assert "synthetic, vllm, vllm_omni" in err.message


@pytest.mark.parametrize("value", [-1, 0])
def test_heartbeat_interval_must_be_positive(tmp_path: Path, value: float) -> None:
    err = refused(tmp_path, variant(lambda d: d["deployment"].update(heartbeat_interval_s=value)))
    assert err.path == "deployment.heartbeat_interval_s"
    assert "> 0" in err.message


def test_unknown_field_in_synthetic_cost(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(stage_deployment("talker", synthetic={"decode_ms": 3})))
    assert err.path == "deployment.stages.talker.synthetic.decode_ms"
    assert "unknown field `decode_ms`" in err.message
    assert "decode_ms_per_token" in err.message


def test_bad_value_in_synthetic_cost(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(stage_deployment("talker", synthetic={"max_concurrency": 0})))
    assert err.path == "deployment.stages.talker.synthetic.max_concurrency"
    assert ">= 1" in err.message


def test_unknown_field_in_deployment(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(lambda d: d["deployment"].update(heartbeat_s=1)))
    assert err.path == "deployment.heartbeat_s"
    assert "heartbeat_interval_s" in err.message


def test_served_model_name_is_required(tmp_path: Path) -> None:
    err = refused(tmp_path, variant(lambda d: d["deployment"].pop("served_model_name")))
    assert err.path == "deployment"
    assert "served_model_name" in err.message


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
