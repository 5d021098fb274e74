"""vLLM-Omni's deploy format (``stages:`` + ``num_replicas``) loads as a config.

Hand-written samples of the format (our own, small) load into ``stage_args``
and ``deployment`` terms; bad ones are refused with ``FILE: YAML.PATH:
message``. Then vLLM-Omni's own shipped files: each deploy YAML of the
installed vllm-omni (found in ``.venv-omni`` when this venv has none), with a
deployment block appended, loads, or fails only for a reason the README gives
(no topology without vLLM-Omni's registry, an output type our API does not
serve). Pure logic: no actor system.
"""

from __future__ import annotations

import copy
import importlib.util
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from omni_actors.config import ConfigError, load_config
from omni_actors.vllm_omni_deploy import ConnectorSpec, DeployPipelineConfig, is_deploy_format

ROOT = Path(__file__).resolve().parent.parent

#: A Thinker -> Talker -> Code2Wav deploy file with its topology and our block.
SAMPLE: dict[str, Any] = {
    "async_chunk": True,
    "dtype": "bfloat16",
    "trust_remote_code": True,
    "connectors": {"fast_path": {"name": "SharedMemoryConnector", "extra": {"shm_threshold_bytes": 4096}}},
    "edges": [{"from": 0, "to": 1, "window_size": -1, "max_inflight": 2}],
    "stages": [
        {"stage_id": 0, "devices": "0", "max_num_seqs": 32, "dtype": "float16",
         "default_sampling_params": {"temperature": 0.0, "max_tokens": 64},
         "output_connectors": {"to_stage_1": "fast_path"}},
        {"stage_id": 1, "num_replicas": 3, "tensor_parallel_size": 2,
         "engine_args": {"gpu_memory_utilization": 0.5}, "engine_extras": {"custom_knob": 7},
         "env": {"SOME_FLAG": "1"},
         "input_connectors": {"from_stage_0": "fast_path"},
         "default_sampling_params": {"stop_token_ids": [5], "top_k": 20}},
        {"stage_id": 2, "runtime": {"devices": "2,3", "num_replicas": 2},
         "input_connectors": {"from_stage_1": {"name": "SharedMemoryConnector"}}},
    ],
    "platforms": {"rocm": {"stages": [{"stage_id": 2, "enforce_eager": True}]}},
    "model": "example/omni-model",
    "topology": {
        "model_arch": "ExampleOmniForConditionalGeneration",
        "stages": [
            {"stage_id": 0, "model_stage": "thinker", "final_output": True, "final_output_type": "text",
             "owns_tokenizer": True, "requires_multimodal_data": True, "hf_config_name": "thinker_config",
             "custom_process_next_stage_input_func": "omni_actors.processors.default_input",
             "async_chunk_process_next_stage_input_func": "omni_actors.processors.ar2dit"},
            {"stage_id": 1, "model_stage": "talker", "input_sources": [0],
             "custom_process_input_func": "omni_actors.processors.ar2dit",
             "sync_process_input_func": "omni_actors.processors.thinker2talker",
             "sampling_constraints": {"stop_token_ids": [9], "detokenize": False}},
            {"stage_id": 2, "model_stage": "code2wav", "execution_type": "llm_generation",
             "input_sources": [1], "custom_process_input_func": "omni_actors.processors.talker2code2wav",
             "final_output": True, "final_output_type": "audio"},
        ],
    },
    "deployment": {
        "served_model_name": "sample",
        "stages": {"code2wav": {"replicas": 4, "backend": "synthetic"}},
    },
}


def write(tmp_path: Path, data: Any, name: str = "deploy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def variant(mutate: Callable[[dict], Any]) -> dict:
    data = copy.deepcopy(SAMPLE)
    mutate(data)
    return data


def refused(path: Path) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    assert str(err) == f"{err.source}: {err.path or '<top>'}: {err.message}"
    assert "\n" not in str(err)
    return err


def refused_sample(tmp_path: Path, mutate: Callable[[dict], Any]) -> ConfigError:
    path = write(tmp_path, variant(mutate))
    err = refused(path)
    assert err.source == str(path)
    return err


# -- a sample of the format loads --------------------------------------------


def test_sample_becomes_stage_args_and_deployment(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, SAMPLE))
    assert isinstance(cfg, DeployPipelineConfig)
    assert [s.name for s in cfg.stage_args] == ["thinker", "talker", "code2wav"]
    assert [s.engine_input_source for s in cfg.stage_args] == [[], [0], [1]]
    assert cfg.output_types() == {"text", "audio"}
    thinker, talker, code2wav = cfg.stage_args
    # Topology fields, pipeline-wide settings, then the stage's own (the stage's win).
    assert thinker.engine_args == {
        "model_stage": "thinker", "model": "example/omni-model",
        "model_arch": "ExampleOmniForConditionalGeneration", "worker_type": "ar",
        "hf_config_name": "thinker_config",
        "custom_process_next_stage_input_func": "omni_actors.processors.default_input",
        "requires_multimodal_data": True, "is_comprehension": True,
        "trust_remote_code": True, "dtype": "float16", "max_num_seqs": 32}
    assert talker.engine_args["gpu_memory_utilization"] == 0.5
    assert talker.engine_args["custom_knob"] == 7
    assert talker.engine_args["tensor_parallel_size"] == 2
    assert talker.engine_args["dtype"] == "bfloat16"
    assert code2wav.engine_args["worker_type"] == "generation"
    assert thinker.runtime.devices == "0" and code2wav.runtime.devices == "2,3"
    assert talker.runtime.devices is None


def test_whole_output_processors_are_chosen(tmp_path: Path) -> None:
    """Stages hand over whole outputs here, so the non-chunked processors apply."""
    cfg = load_config(write(tmp_path, SAMPLE))
    assert cfg.stage_by_name("talker").custom_process_input_func == "omni_actors.processors.thinker2talker"
    assert (cfg.stage_by_name("thinker").engine_args["custom_process_next_stage_input_func"]
            == "omni_actors.processors.default_input")
    assert cfg.vllm_omni.async_chunk is True  # kept, not applied


def test_sampling_constraints_go_on_top_of_the_stage_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, SAMPLE))
    assert cfg.stage_by_name("talker").default_sampling_params == {
        "stop_token_ids": [5, 9], "top_k": 20, "detokenize": False}
    assert cfg.stage_by_name("thinker").default_sampling_params == {"temperature": 0.0, "max_tokens": 64}


def test_num_replicas_becomes_replicas_unless_the_deployment_block_says(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, SAMPLE))
    dep = {s.name: cfg.deployment_of(s) for s in cfg.stage_args}
    assert dep["thinker"].replicas == 1
    assert dep["talker"].replicas == 3          # num_replicas
    assert dep["code2wav"].replicas == 4        # ours wins over runtime.num_replicas: 2
    # ... and says so (a trial's 5 over 2 went unsaid); none for the stages where only one is set
    assert [n for n in cfg.omni_connectors.notes if "num_replicas" in n] == [
        "deployment.stages.code2wav.replicas (4) is used, not stages[2].num_replicas (2)"]
    assert dep["talker"].devices_per_replica == 2   # tensor_parallel_size
    assert dep["thinker"].backend == "vllm_omni"    # the default for a deploy file
    assert dep["code2wav"].backend == "synthetic"   # ours wins


def test_a_note_of_the_deployment_block_is_kept_beside_the_connectors_notes(tmp_path: Path) -> None:
    """A review: `cpus` on a vllm_omni stage (which never pins) was noted as not applied in a
    stage_args config, and the note was lost in a deploy file's (its connectors' notes
    replaced it): the operator believed the engine pinned."""
    cfg = load_config(write(tmp_path, variant(lambda d: d["deployment"]["stages"].update(talker={"cpus": "0"}))))
    assert "deployment.stages.talker.cpus: not applied: only the vllm backend pins its engine (backend: " \
           "vllm_omni)" in cfg.omni_connectors.notes
    assert any("replicas" in n for n in cfg.omni_connectors.notes)  # (and the others are still there)


def _diffusion_code2wav(parallel_config: dict, ours: dict) -> Callable[[dict], None]:
    def mutate(d: dict) -> None:
        d["topology"]["stages"][2]["execution_type"] = "diffusion"
        d["stages"][2]["parallel_config"] = parallel_config
        d["stages"][2]["runtime"].pop("devices")  # (placement decides: its count is what is tested)
        d["deployment"]["stages"]["code2wav"] = ours
    return mutate


def test_a_diffusion_stage_takes_its_parallel_configs_world_size_in_devices(tmp_path: Path) -> None:
    """vLLM-Omni's HunyuanImage-3 DiT: `parallel_config: {tensor_parallel_size: 2}` (a review: one
    device per replica was placed, for an engine sharded over two)."""
    for parallel, size in [({"tensor_parallel_size": 2, "enable_expert_parallel": True}, 2),
                           ({"ulysses_degree": 2, "ring_degree": 2, "cfg_parallel_size": 2}, 8),
                           ({"allgather_degree": 2, "ulysses_degree": 4}, 2),
                           ({"use_hsdp": True, "hsdp_shard_size": 4, "hsdp_replicate_size": 2}, 8),
                           ({"use_hsdp": True, "hsdp_shard_size": 1, "hsdp_replicate_size": 2}, 2),
                           ({"world_size": 3}, 3), ({}, 1)]:
        cfg = load_config(write(tmp_path, variant(_diffusion_code2wav(parallel, {"backend": "vllm_omni"}))))
        assert cfg.deployment.stages["code2wav"].devices_per_replica == size, parallel


def test_a_diffusion_stage_given_fewer_devices_than_it_shards_over_is_refused(tmp_path: Path) -> None:
    err = refused_sample(tmp_path, _diffusion_code2wav({"tensor_parallel_size": 2},
                                                       {"backend": "vllm_omni", "devices_per_replica": 1}))
    assert err.path == "deployment.stages.code2wav.devices_per_replica"
    assert "over 2 devices (parallel_config's world size): give each replica 2" in err.message


def test_connectors_edges_env_and_platforms_are_kept(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, SAMPLE))
    kept = cfg.vllm_omni
    assert kept.pipeline is None and kept.files == [str(tmp_path / "deploy.yaml")]
    assert kept.connectors == {"fast_path": ConnectorSpec(name="SharedMemoryConnector",
                                                          extra={"shm_threshold_bytes": 4096})}
    assert [(e.from_stage, e.to_stage, e.max_inflight) for e in kept.edges] == [(0, 1, 2)]
    assert kept.stages["talker"].input_connectors == {"from_stage_0": "fast_path"}
    assert kept.stages["thinker"].output_connectors == {"to_stage_1": "fast_path"}
    assert kept.stages["code2wav"].input_connectors["from_stage_1"].name == "SharedMemoryConnector"
    assert kept.stages["talker"].env == {"SOME_FLAG": "1"}
    assert (kept.stages["talker"].num_replicas, kept.stages["code2wav"].num_replicas) == (3, 2)
    assert kept.platforms["rocm"]["stages"][0]["enforce_eager"] is True
    # Nothing of it leaks into the engines' arguments.
    for s in cfg.stage_args:
        assert not {"input_connectors", "output_connectors", "env", "num_replicas", "runtime"} & set(s.engine_args)


def test_connectors_are_applied_as_a_legacy_configs_are(tmp_path: Path, monkeypatch) -> None:
    """As ``runtime.connectors`` (tests/test_connector_config.py), notes naming the file's paths:
    a SharedMemoryConnector's threshold applies; another connector goes to the engines where
    vllm_omni is installed (here pretended), with the producer's ``omni:`` mode."""
    from omni_actors.connectors import omni

    monkeypatch.setattr(omni, "available", lambda: True)
    mooncake = {"name": "MooncakeStoreConnector", "extra": {"master": "10.0.0.1:50051"}}
    cfg = load_config(write(tmp_path, variant(lambda d: (
        d["connectors"].update(rdma=mooncake), d["stages"][2]["input_connectors"].update(from_stage_1="rdma")))))
    thinker, talker, code2wav = cfg.stage_args
    assert cfg.inline_threshold_of(thinker) == 4096
    assert omni.parse_mode(cfg.connector_mode_of(talker)).name == "MooncakeStoreConnector"
    assert omni.parse_mode(cfg.connector_mode_of(code2wav)).inputs[0][0] == "MooncakeStoreConnector"
    notes = cfg.omni_connectors.notes
    assert any(n.startswith("stages[0].output_connectors.to_stage_1 -> connectors.fast_path (SharedMemory"
                            "Connector): applied to thinker: inline up to 4096 bytes") for n in notes), notes
    assert any(n.startswith("stages[2].input_connectors.from_stage_1 -> connectors.rdma (MooncakeStore"
                            "Connector): applied to talker") for n in notes), notes
    assert any(n.startswith("edges: kept, not applied") for n in notes), notes
    monkeypatch.setattr(omni, "available", lambda: False)
    cfg = load_config(write(tmp_path, variant(lambda d: (
        d["connectors"].update(rdma=mooncake), d["stages"][2]["input_connectors"].update(from_stage_1="rdma")))))
    assert cfg.connector_mode_of(cfg.stage_args[1]) is None
    assert any("(MooncakeStoreConnector) on edge 1->2: not applied" in n for n in cfg.omni_connectors.notes)
    with pytest.raises(ConfigError) as exc:
        load_config(write(tmp_path, variant(lambda d: d["connectors"]["fast_path"]["extra"].update(
            shm_threshold_bytes=-1))))
    assert exc.value.path == "connectors.fast_path.extra.shm_threshold_bytes"


def test_a_stage_the_deploy_file_does_not_list_gets_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, variant(lambda d: d["stages"].pop(2))))
    code2wav = cfg.stage_by_name("code2wav")
    assert code2wav.runtime.devices is None
    assert code2wav.engine_args["dtype"] == "bfloat16"


def test_base_config_is_merged_by_stage_id(tmp_path: Path) -> None:
    base = {k: v for k, v in copy.deepcopy(SAMPLE).items() if k not in ("topology", "deployment")}
    write(tmp_path, base, "base.yaml")
    overlay = {
        "base_config": "base.yaml",
        "dtype": "float32",
        "connectors": {"fast_path": {"extra": {"shm_threshold_bytes": 1}}},
        "stages": [{"stage_id": 1, "num_replicas": 5, "default_sampling_params": {"top_k": 1}}],
        "topology": SAMPLE["topology"], "deployment": {"served_model_name": "overlay"},
        "model": "org/overlay-model",
    }
    path = write(tmp_path, overlay, "overlay.yaml")
    cfg = load_config(path)
    talker = cfg.stage_by_name("talker")
    assert cfg.deployment_of(talker).replicas == 5
    assert talker.default_sampling_params["top_k"] == 1
    assert 5 in talker.default_sampling_params["stop_token_ids"]   # kept from the base
    assert talker.engine_args["gpu_memory_utilization"] == 0.5     # kept from the base
    assert cfg.stage_by_name("code2wav").engine_args["dtype"] == "float32"
    assert cfg.vllm_omni.connectors["fast_path"] == ConnectorSpec(
        name="SharedMemoryConnector", extra={"shm_threshold_bytes": 1})
    assert cfg.vllm_omni.files == [str(tmp_path / "base.yaml"), str(path)]
    assert talker.engine_args["model"] == "org/overlay-model"  # our keys are read from the loaded file only


def test_shipped_deploy_demo_config_loads() -> None:
    cfg = load_config(ROOT / "configs" / "cpu_vllm_omni_deploy.yaml")
    assert [(s.name, cfg.deployment_of(s).replicas, cfg.deployment_of(s).backend) for s in cfg.stage_args] == [
        ("thinker", 1, "synthetic"), ("talker", 2, "synthetic"), ("code2wav", 1, "synthetic")]


# -- bad files are refused with the YAML path -------------------------------------


@pytest.mark.parametrize("mutate, path, words", [
    (lambda d: d["stages"][1].update(num_replicas=0), "stages[1].num_replicas", ">= 1"),
    (lambda d: d["stages"][1].update(devices=[0, 1]), "stages[1].devices", "Expected"),
    (lambda d: d["stages"][2].update(runtime={"num_replicas": "two"}), "stages[2].runtime.num_replicas", "int"),
    (lambda d: d["stages"][2].update(runtime={"devices": "x"}), "stages[2].runtime.devices", "device"),
    (lambda d: d["stages"][0].update(devices="x"), "stages[0].devices", "device"),
    (lambda d: d["topology"]["stages"][1]["sampling_constraints"].update(max_tokens=0),
     "topology.stages[1].sampling_constraints.max_tokens", ">= 1"),
    # (msgspec names a mapping's key `[...]`: a review read `platforms[...]`)
    (lambda d: d.update(platforms={"rocm": {"stages": []}, "cuda": None}), "platforms.cuda", "Expected `object`"),
    (lambda d: d["stages"][1].update(input_connectors={"from_stage_0": {"name": "X", "bogus": 1}}),
     "stages[1].input_connectors.from_stage_0.bogus", "unknown field `bogus`"),
    # (the entry at fault, not the first one: a review's `cuda` took the blame for `rocm`)
    (lambda d: d.update(platforms={"cuda": {"stages": [{"stage_id": 0}]}, "rocm": {"stages": [{"stage_id": "x"}]}},
                        model_runner="v3"),  # (a second error, further on)
     "platforms.rocm.stages[0].stage_id", "Expected `int`"),
    (lambda d: d["stages"][1].update(input_connectors={"from_stage_0": "fast_path",
                                                       "from_stage_2": {"name": "X", "bogus": 1}}),
     "stages[1].input_connectors.from_stage_2.bogus", "unknown field `bogus`"),
    (lambda d: d["stages"][2].update(stage_id=7), "stages[2].stage_id", "no stage 7 in the topology"),
    (lambda d: d["stages"][2].update(stage_id=1), "stages[2].stage_id", "duplicate stage_id 1"),
    (lambda d: d["stages"].append("oops"), "stages[3]", "Expected `object`"),
    (lambda d: d.update(stages={"0": {}}), "stages", "Expected `array"),
    (lambda d: d["stages"][1].update(input_connectors={"from_stage_0": "nope"}),
     "stages[1].input_connectors.from_stage_0", "no connector `nope`"),
    (lambda d: d["stages"][1].update(input_connectors={"stage0": "fast_path"}),
     "stages[1].input_connectors.stage0", "from_stage_N"),
    (lambda d: d["stages"][0].update(output_connectors={"to_stage_9": "fast_path"}),
     "stages[0].output_connectors.to_stage_9", "no stage 9"),
    (lambda d: d["connectors"]["fast_path"].pop("name"), "connectors.fast_path.name", "required field is missing"),
    (lambda d: d["connectors"]["fast_path"].update(speed=1), "connectors.fast_path.speed", "unknown field"),
    (lambda d: d.update(edges=[{"from": 0, "to": 5}]), "edges[0].to", "no stage 5"),
    (lambda d: d.update(edges=[{"from": 0}]), "edges[0].to", "required field is missing"),
    (lambda d: d.update(model_runner="v3"), "model_runner", "v1, v2"),
    (lambda d: d.update(trust_remote_code="yes"), "trust_remote_code", "bool"),
    (lambda d: d["stages"][0]["default_sampling_params"].update(max_tokens=10**6),
     "stages[0].default_sampling_params.max_tokens", "max_tokens_limit"),
    (lambda d: d["topology"]["stages"][0].update(colour="red"), "topology.stages[0].colour", "unknown field"),
    (lambda d: d["topology"]["stages"][2].update(final_output_type="video"),
     "topology.stages[2].final_output_type", "text, audio, image"),
    (lambda d: d["topology"]["stages"][2].update(execution_type="gan"),
     "topology.stages[2].execution_type", "diffusion"),
    (lambda d: d["topology"]["stages"][1].update(input_sources=[4]),
     "topology.stages[1].input_sources[0]", "unknown stage_id 4"),
    (lambda d: d["topology"]["stages"][0].update(input_sources=[2]), "topology.stages", "cycle"),
    # (trial CH: read "stages[1].", the deploy stages' list, with a trailing dot)
    (lambda d: d["topology"]["stages"][2].update(input_sources=[0]), "topology.stages[1]",
     "stage `talker` is not a final output"),
    (lambda d: d["topology"]["stages"][1].update(model_stage="thinker"),
     "topology.stages[1].model_stage", "duplicate stage name"),
    (lambda d: d["topology"]["stages"][1].update(sync_process_input_func="omni_actors.processors.nope"),
     "topology.stages[1].sync_process_input_func", "no function"),
    (lambda d: d["topology"]["stages"][2].update(custom_process_input_func="omni_actors.nowhere.f"),
     "topology.stages[2].custom_process_input_func", "cannot import"),
    (lambda d: [s.update(final_output=False) for s in d["topology"]["stages"]], "topology.stages",
     "no stage has final_output"),
    (lambda d: d["deployment"]["stages"].update(vocoder={"replicas": 1}), "deployment.stages.vocoder",
     "no stage named `vocoder`"),
    (lambda d: d["deployment"]["stages"]["code2wav"].update(replicas=0), "deployment.stages.code2wav.replicas",
     ">= 1"),
    (lambda d: d.pop("deployment"), "deployment", "missing"),
    (lambda d: d.update(stage_args=[]), "stage_args", "not both"),
    (lambda d: d.update(env=5), "env", "expected a mapping, got `5`"),  # (a trial's: accepted)
    (lambda d: d.update(platforms=["rocm"]), "platforms", "Expected `object | null`, got `array`"),
    # (a review: a copied topology stage's id was blamed on the `stages:` entry of the stage it hid)
    (lambda d: d["topology"]["stages"][1].update(stage_id=0), "topology.stages[1].stage_id",
     "0 is the id of an earlier stage"),
    # (a review: named `deployment.stages.talker.devices_per_replica`, which the file does not set)
    (lambda d: d["stages"][1].update(tensor_parallel_size=2000), "stages[1]",
     "stage 1 `talker`: its engine arguments shard it over 2000 devices (tensor_parallel_size x "
     "pipeline_parallel_size x data_parallel_size), more than a replica may have (1024)"),
    # (a review: "stage_args[1].engine_args shard the model", in a file with no stage_args)
    (lambda d: d["deployment"]["stages"].update(talker={"devices_per_replica": 1}),
     "deployment.stages.talker.devices_per_replica", "1, but the stage's engine arguments shard the model over 2"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_deploy_file_is_refused_with_its_yaml_path(tmp_path: Path, mutate, path: str, words: str) -> None:
    err = refused_sample(tmp_path, mutate)
    assert err.path == path
    assert words in err.message


def test_error_in_a_base_file_names_that_file(tmp_path: Path) -> None:
    base = write(tmp_path, {"stages": [{"stage_id": 0}, {"stage_id": 1, "num_replicas": -2}]}, "base.yaml")
    write(tmp_path, variant(lambda d: d.update(base_config="base.yaml")), "overlay.yaml")
    err = refused(tmp_path / "overlay.yaml")
    assert (err.source, err.path) == (str(base), "stages[1].num_replicas")


def test_missing_base_config_is_refused(tmp_path: Path) -> None:
    err = refused_sample(tmp_path, lambda d: d.update(base_config="nowhere.yaml"))
    assert err.path == "base_config" and "no `nowhere.yaml` beside this file" in err.message
    err = refused_sample(tmp_path, lambda d: d.update(base_config="sub/nowhere.yaml"))
    assert err.path == "base_config" and "cannot read" in err.message


def test_a_base_config_is_read_as_the_config_itself(tmp_path: Path) -> None:
    """A code review: a base file in UTF-16 with its BOM (which a config may be), one with a
    byte that is not UTF-8, or one nested thousands deep was a traceback (exit 1)."""
    base = tmp_path / "base.yaml"
    base.write_bytes(yaml.safe_dump({"stages": [{"stage_id": 0}]}).encode("utf-16"))
    path = write(tmp_path, variant(lambda d: d.update(base_config="base.yaml")), "overlay.yaml")
    load_config(path)  # (UTF-16 with its BOM: read)
    base.write_bytes(b"stages: []  # caf\xe9\n")
    err = refused(path)
    assert (err.source, err.path) == (str(base), "line 1") and "not UTF-8 text" in err.message
    base.write_text("[" * 5000)
    err = refused(path)
    assert err.source == str(base) and "nested too deeply" in err.message


def test_a_bad_engine_argument_is_named_where_the_file_sets_it(tmp_path: Path) -> None:
    """A code review: a top-level `dtype` (one for every stage) read as `stages[0].dtype`,
    and `stages[0].engine_args.tensor_parallel_size` as `stages[0].tensor_parallel_size`."""
    err = refused_sample(tmp_path, lambda d: d.update(dtype="flaot32"))
    assert err.path == "dtype" and "flaot32" in err.message
    err = refused_sample(tmp_path, lambda d: d["stages"][0].update(engine_args={"tensor_parallel_size": 0}))
    assert err.path == "stages[0].engine_args.tensor_parallel_size"
    err = refused_sample(tmp_path, lambda d: d["stages"][1]["engine_args"].update(dtype="flaot32"))
    assert err.path == "stages[1].engine_args.dtype"
    err = refused_sample(tmp_path, lambda d: d["stages"][0].update(dtype="flaot32"))
    assert err.path == "stages[0].dtype"


def test_base_config_cycle_is_refused(tmp_path: Path) -> None:
    write(tmp_path, {"base_config": "b.yaml", "stages": []}, "a.yaml")
    write(tmp_path, {"base_config": "a.yaml", "stages": []}, "b.yaml")
    path = write(tmp_path, variant(lambda d: d.update(base_config="a.yaml")))
    err = refused(path)
    assert err.source == str(tmp_path / "b.yaml")
    assert err.path == "base_config" and "already in the chain" in err.message


@pytest.mark.skipif(importlib.util.find_spec("vllm_omni") is not None, reason="vllm_omni is installed here")
def test_without_topology_or_vllm_omni_the_error_says_what_to_add(tmp_path: Path) -> None:
    err = refused_sample(tmp_path, lambda d: d.pop("topology"))
    assert err.path == "topology"
    assert "add a `topology:` block" in err.message and "install vllm-omni" in err.message
    err = refused_sample(tmp_path, lambda d: (d.pop("topology"), d.update(pipeline="qwen3_omni_moe")))
    assert err.path == "pipeline" and "`qwen3_omni_moe`" in err.message


def test_legacy_config_is_not_taken_for_a_deploy_file() -> None:
    assert not is_deploy_format({"stage_args": [], "deployment": {}})
    assert is_deploy_format({"stages": [], "deployment": {}})
    assert is_deploy_format({"base_config": "x.yaml"})


# -- vLLM-Omni's own shipped files ---------------------------------------------------


def _omni_package() -> Path | None:
    spec = importlib.util.find_spec("vllm_omni")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    found = sorted(ROOT.glob(".venv-omni/lib/python*/site-packages/vllm_omni"))
    return found[-1] if found else None


def _registry_importable() -> bool:
    from conftest import omni_importable

    return omni_importable("vllm_omni.config.pipeline_registry")


PACKAGE = _omni_package()
needs_package = pytest.mark.skipif(PACKAGE is None,
                                   reason="no vllm_omni here nor in .venv-omni (make test-vllm-omni)")
needs_registry = pytest.mark.skipif(not _registry_importable(),
                                    reason="needs vllm_omni's pipeline registry (make test-vllm-omni)")
#: What a minimal deployment block needs for every shipped file: some text stages allow 18k tokens.
#: What a shipped deploy file needs to be a config: a model (vLLM-Omni takes it from its command
#: line) and our deployment block.
DEPLOYMENT_BLOCK = "\n\nmodel: some-org/some-model\ndeployment:\n  served_model_name: shipped\n  max_tokens_limit: 32768\n"


def _shipped_with_deployment(tmp_path: Path) -> list[Path]:
    """Each shipped deploy YAML, unchanged, with a model and a deployment block appended
    (the whole folder is copied, so `base_config` finds its base)."""
    out = []
    for src in sorted((PACKAGE / "deploy").glob("*.yaml")):
        text = src.read_text()
        dst = tmp_path / src.name
        if is_deploy_format(yaml.safe_load(text)):
            dst.write_text(text + DEPLOYMENT_BLOCK)
            out.append(dst)
        else:  # e.g. a stage add-on file, not a pipeline's deploy file: a base at most
            shutil.copy(src, dst)
    return out


@needs_package
def test_shipped_legacy_stage_configs_load_with_a_deployment_block(tmp_path: Path) -> None:
    legacy = [p for p in sorted(PACKAGE.rglob("*.yaml"))
              if isinstance(doc := yaml.safe_load(p.read_text()), dict) and "stage_args" in doc]
    if not legacy:
        pytest.skip(f"the vllm-omni at {PACKAGE} ships no legacy `stage_args` YAML "
                    "(0.30 ships only the deploy format)")
    for src in legacy:
        cfg = load_config(write(tmp_path, src.read_text() + DEPLOYMENT_BLOCK, src.name))
        assert cfg.stage_args


@needs_package
def test_every_shipped_deploy_file_passes_the_deploy_checks(tmp_path: Path) -> None:
    """Without vLLM-Omni's registry the stage graph is missing, and that is the
    only thing: every file's deploy part (shape, base_config) is accepted."""
    files = _shipped_with_deployment(tmp_path)
    assert len(files) > 50
    if _registry_importable():
        pytest.skip("vllm_omni is importable here: test_every_shipped_deploy_file_loads covers it")
    for path in files:
        err = refused(path)
        assert (err.path, err.source) in {("topology", str(path)), ("pipeline", str(path))}, str(err)
        assert "has no stage graph" in err.message, str(err)


@needs_registry
def test_every_shipped_deploy_file_loads(tmp_path: Path) -> None:
    """With vLLM-Omni's registry: every shipped deploy file loads, except those
    whose pipeline the registry cannot name from the file alone and those
    whose final output our API does not serve (video, robot actions)."""
    loaded, no_topology, unserved = [], [], []
    for path in _shipped_with_deployment(tmp_path):
        try:
            cfg = load_config(path)
        except ConfigError as err:
            if err.path == "topology" and "no registered pipeline has" in err.message:
                no_topology.append(path.name)
            elif err.path == "pipeline" and "Invalid enum value" in err.message:
                unserved.append(path.name)
            else:
                raise
            continue
        loaded.append(path.name)
        assert cfg.vllm_omni.pipeline
        for s in cfg.stage_args:
            kept = cfg.vllm_omni.stages.get(s.name)
            if kept is not None and kept.num_replicas is not None:
                assert cfg.deployment_of(s).replicas == kept.num_replicas
    print(f"\nloaded {len(loaded)}; no topology from the file alone {len(no_topology)}: {no_topology}; "
          f"output type not served {len(unserved)}: {unserved}")
    assert {"qwen3_omni_moe.yaml", "glm_image.yaml", "qwen3_tts.yaml", "ming_flash_omni.yaml",
            "minicpmo_4_5_3gpu_stage1_replicas.yaml"} <= set(loaded)
    assert len(loaded) > len(no_topology) + len(unserved)


@needs_registry
def test_shipped_qwen3_omni_deploy_file_matches_our_hand_written_config(tmp_path: Path) -> None:
    """vLLM-Omni's deploy/qwen3_omni_moe.yaml plus its registered pipeline give
    the stage_args of configs/gpu_qwen3_omni.yaml (written by hand from both)."""
    text = (PACKAGE / "deploy" / "qwen3_omni_moe.yaml").read_text()
    cfg = load_config(write(tmp_path, text + DEPLOYMENT_BLOCK.replace("some-org/some-model", "Qwen/Qwen3-Omni-30B-A3B-Instruct"),
                            "qwen3_omni_moe.yaml"))
    ours = load_config(ROOT / "configs" / "gpu_qwen3_omni.yaml")
    assert cfg.vllm_omni.pipeline == "qwen3_omni_moe"
    cuda = {s["stage_id"]: s for s in cfg.vllm_omni.platforms["cuda"]["stages"]}
    assert cuda[0]["compilation_config"] == {"custom_ops": ["+rotary_embedding"]}
    for mine, theirs in zip(ours.stage_args, cfg.stage_args, strict=True):
        assert (mine.stage_id, mine.name, mine.engine_input_source) == (
            theirs.stage_id, theirs.name, theirs.engine_input_source)
        assert mine.custom_process_input_func == theirs.custom_process_input_func
        assert (mine.final_output, mine.final_output_type) == (theirs.final_output, theirs.final_output_type)
        assert mine.default_sampling_params == theirs.default_sampling_params
        assert mine.runtime.devices == theirs.runtime.devices
        # (ours has the file's CUDA overlay, `platforms.cuda`, which a deploy file's load keeps, not applies)
        overlay = {k: v for k, v in cuda.get(theirs.stage_id, {}).items() if k != "stage_id"}
        expected = {**theirs.engine_args, **overlay}
        assert {k: expected.get(k) for k in mine.engine_args} == mine.engine_args


@pytest.mark.skipif(importlib.util.find_spec("vllm_omni") is None, reason="needs vllm_omni (make test-vllm-omni)")
def test_check_config_refuses_a_connector_vllm_omni_does_not_have(tmp_path: Path) -> None:
    """A misspelt connector class passed `check-config` (noted as applied) where vLLM-Omni is
    installed: now one line naming the connector, the nearest name, exit 1."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    text = (root / "configs" / "cpu_vllm_omni_deploy.yaml").read_text()
    assert "name: SharedMemoryConnector" in text
    path = tmp_path / "typo.yaml"
    path.write_text(text.replace("name: SharedMemoryConnector", "name: SharedMemConnector"))

    def check(p: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "omni_actors.system", "check-config", "--config", str(p)],
                              capture_output=True, text=True, timeout=300, cwd=root)

    out = check(path)
    assert out.returncode == 1 and out.stdout == "", out
    assert out.stderr.splitlines()[-1].startswith(
        f"error: {path}: connector `local_shm`: vLLM-Omni has no connector `SharedMemConnector` "
        f"(did you mean `SharedMemoryConnector`?); it has: "), out.stderr
    path.write_text(text)
    good = check(path)
    assert good.returncode == 0 and good.stdout.startswith("ok: "), good


@pytest.mark.parametrize("ids", [8294, "8294", [[1]], [1, "2"], [-1], {"a": 1}])
def test_stop_token_ids_that_are_not_a_list_of_ids_are_refused(tmp_path: Path, ids: Any) -> None:
    """They join the topology's (a review: `8294` was a TypeError, `"8294"` four stop tokens)."""
    err = refused_sample(tmp_path, lambda d: d["stages"][1]["default_sampling_params"].update(stop_token_ids=ids))
    assert err.path == "stages[1].default_sampling_params.stop_token_ids"
    assert err.message == f"expected a list of token ids (integers >= 0), got `{ids!r}`"
    err = refused_sample(tmp_path, lambda d: d["topology"]["stages"][1]["sampling_constraints"].update(
        stop_token_ids=ids))
    assert err.path == "topology.stages[1].sampling_constraints.stop_token_ids"



@pytest.mark.parametrize("devices, replicas, per_replica", [
    ("1,2", 2, 1), ("1,2,3,4", 2, 2), ("0,1", 3, 2), ("0", 4, 1), ("3", 1, 1), ("0,1", 1, 2)])
def test_runtime_devices_are_shared_out_as_vllm_omni_shares_them(devices, replicas, per_replica):
    """Our split of a stage's devices among its replicas (placement.replica_devices, hosts
    without --devices) is vLLM-Omni's own (split_devices_for_replicas), shape for shape."""
    split = pytest.importorskip("vllm_omni.engine.stage_init_utils").split_devices_for_replicas
    from omni_actors.placement import replica_devices

    assert [replica_devices(devices, i, per_replica) for i in range(replicas)] == \
        split(devices, replicas, per_replica, 1)


def test_a_deploy_file_with_no_model_is_refused_at_model(tmp_path: Path) -> None:
    """A review: vLLM-Omni's deploy files name no model (its server takes it from `vllm serve
    MODEL`); one loaded as it ships, and every replica then failed its start ("engine_args has
    no `model`") every 5 minutes. Refused at load, at the top-level `model` it needs; a stage
    that names its own model, or a stage our block runs on the synthetic engine, needs none."""
    err = refused_sample(tmp_path, lambda d: d.pop("model"))
    assert err.path == "model", err
    assert "the file names no model (vLLM-Omni takes it from `vllm serve MODEL`): add a top-level `model: " \
           in err.message, err.message

    def own_models(d: dict) -> None:
        d.pop("model")
        for stage in d["stages"]:
            stage.setdefault("engine_args", {})["model"] = "org/own"
    cfg = load_config(write(tmp_path, variant(own_models)))
    assert {s.engine_args["model"] for s in cfg.stage_args} == {"org/own"}


def test_a_vllm_omni_stage_with_no_model_is_refused_at_its_path(tmp_path: Path) -> None:
    text = (ROOT / "configs" / "gpu_glm_image.yaml").read_text()
    doc = yaml.safe_load(text)
    del doc["stage_args"][1]["engine_args"]["model"]
    path = write(tmp_path, doc)
    err = refused(path)
    assert (err.path, err.message) == ("stage_args[1].engine_args.model",
                                       "a vllm_omni stage needs `model` (a model directory or a model id)")


@needs_registry
def test_the_registrys_other_stage_fields_reach_each_stages_pipeline(tmp_path: Path) -> None:
    """A review: a registered pipeline's stage fields beyond the graph (IndexTTS2's and the TTS
    models' `extras`, Ming-Image's `model_path_resolver`, VoxCPM2's `scheduler_cls`, the CFG
    hooks...) were dropped without a word. Each shipped deploy file's stages now carry them,
    and a replica's one-stage pipeline (`VllmOmniEngine._pipeline`) has them as the registry
    does."""
    import dataclasses

    from omni_actors.config import StageSpec
    from omni_actors.engines.vllm_omni import VllmOmniEngine
    from omni_actors.vllm_omni_deploy.topology import PASSED_ON, PIPELINE_EXTRA

    registry = importlib.import_module("vllm_omni.config.pipeline_registry")
    checked = 0
    for path in _shipped_with_deployment(tmp_path):
        try:
            cfg = load_config(path)
        except ConfigError:
            continue  # (those that do not load: test_every_shipped_deploy_file_loads)
        pipe = registry.OMNI_PIPELINES.get(cfg.vllm_omni.pipeline)
        if not hasattr(pipe, "stages"):
            continue  # (behind a resolver)
        theirs = {ps.model_stage: ps for ps in pipe.stages}
        for s in cfg.stage_args:
            ps = theirs[s.name]
            want = {f: getattr(ps, f) for f in PASSED_ON if getattr(ps, f) not in (None, False, (), {})}
            if not want:
                continue
            checked += 1
            eng = VllmOmniEngine(StageSpec(stage_id=s.stage_id, engine_args=s.engine_args), f"{s.name}/0")
            eng._import()
            mine = eng._pipeline("p", dict(s.engine_args), "m").stages[0]
            assert {f: getattr(mine, f) for f in want} == want, (path.name, s.name)
            assert dataclasses.asdict(mine)["extras"] == ps.extras
            assert PIPELINE_EXTRA in s.engine_args
    assert checked >= 5, checked


@pytest.mark.parametrize("devices, replicas", [("1,2,3", 2), ("1,2", 3), ("1", 2)])
def test_devices_that_do_not_split_among_the_replicas_are_refused_as_vllm_omni_refuses_them(tmp_path: Path,
                                                                                         devices, replicas):
    """Trial CA: `devices: "1,2,3"` for 2 replicas left GPU 3 out, `"1,2"` for 3 put two on GPU
    1, without a word (vLLM-Omni's split_devices_for_replicas refuses both); refused at the
    stage's devices. A template (ids below the count per replica) and one id list per replica
    load."""
    def mutate(d: dict) -> None:
        d["stages"][0].update(devices=devices, num_replicas=replicas)
    err = refused_sample(tmp_path, mutate)
    assert err.path == "stages[0].devices" and "as vLLM-Omni splits them" in err.message, err

    for ok in ("0", "4,5"):
        def fine(d: dict, ok=ok) -> None:
            d["stages"][0].update(devices=ok, num_replicas=2)
        load_config(write(tmp_path, variant(fine)))


def test_a_kv_cache_handed_over_inside_vllm_omni_and_what_a_deploy_file_keeps_are_noted(tmp_path: Path) -> None:
    """Trial CA: nothing said that HunyuanImage-3.0's DiT gets no KV cache from its AR stage
    here (vLLM-Omni hands it over between its own stage engines), nor that a deploy file's
    `platforms` overlays and `async_chunk: true` are kept, not applied."""
    cfg = load_config(ROOT / "configs" / "gpu_hunyuan_image3.yaml")
    assert any(n.startswith("stage dit: `omni_kv_config.need_recv_cache`: the KV cache vLLM-Omni hands to it from "
                            "stage(s) AR") for n in cfg.omni_connectors.notes), cfg.omni_connectors.notes
    def overlay(d: dict) -> None:
        d["platforms"] = {"cuda": {"stages": [{"stage_id": 0, "compilation_config": {"custom_ops": ["+x"]}}]}}
    notes = load_config(write(tmp_path, variant(overlay))).omni_connectors.notes
    assert any(n.startswith("platforms (cuda): kept, not applied") for n in notes), notes
    assert any(n.startswith("async_chunk: true: not applied") for n in notes), notes  # (SAMPLE's)

    def env(d: dict) -> None:  # (trial CH: the README said a note tells `env` is not applied; none did)
        d["env"] = {"FOO": "1"}
        d["stages"][1]["runtime"] = {"env": {"A": "b"}}
    notes = load_config(write(tmp_path, variant(env))).omni_connectors.notes
    assert any(n.startswith("env: kept, not applied") for n in notes), notes
    assert any(n.startswith("stages[1].runtime.env (stage 1): kept, not applied") for n in notes), notes
