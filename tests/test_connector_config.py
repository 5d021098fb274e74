"""Connector settings in a config: ``deployment.connector`` (how engines store
their outputs) and vLLM-Omni's own connector settings in legacy ``stage_args``
configs (top-level ``runtime.connectors`` / ``runtime.edges``, per stage
``input_connectors`` / ``output_connectors``): checked, kept, mapped where we
have an equivalent, reported where not. Pure logic: no actor system."""

from __future__ import annotations

import copy
import pickle
import typing
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from omni_actors.config import ConfigError, ConnectorMode, load_config
from omni_actors.connectors import MODES, NodeConnector, list_segments, release_all
from omni_actors.connectors import omni
from omni_actors.connectors.base import ConnectorRef, OmniHandle
from omni_actors.messages import StartEngine, StartPool

from test_config import BASE

NOT_APPLIED = "not applied: needs vLLM-Omni's own connector (e.g. Mooncake)"


def load(tmp_path: Path, data: dict) -> Any:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return load_config(path)


def with_connectors(runtime: Any = None, **per_stage: dict) -> dict:
    """BASE with a top-level ``runtime`` and stage entries' connector fields
    (``per_stage={"s0": {"output_connectors": {...}}}``, by stage index)."""
    data = copy.deepcopy(BASE)
    if runtime is not None:
        data["runtime"] = runtime
    for key, fields in per_stage.items():
        data["stage_args"][int(key[1:])].update(fields)
    return data


SHM = {"name": "SharedMemoryConnector", "extra": {"shm_threshold_bytes": 1024}}
MOONCAKE = {"name": "MooncakeStoreConnector", "extra": {"host": "10.0.0.1"}}


# -- deployment.connector ----------------------------------------------------------------------

def test_modes_are_the_connectors_modes():
    assert typing.get_args(ConnectorMode) == MODES


def test_connector_defaults_to_auto_and_engines_keep_their_process_default(tmp_path):
    cfg = load(tmp_path, BASE)
    assert cfg.deployment.connector == "auto"
    assert all(cfg.connector_mode_of(s) is None for s in cfg.stage_args)
    assert all(cfg.inline_threshold_of(s) == 65536 for s in cfg.stage_args)
    assert cfg.omni_connectors.notes == [] and cfg.omni_connectors.by_edge == {}


@pytest.mark.parametrize("mode", ["inline", "shm", "tcp"])
def test_connector_mode_goes_to_every_stage(tmp_path, mode):
    data = copy.deepcopy(BASE)
    data["deployment"]["connector"] = mode
    cfg = load(tmp_path, data)
    assert [cfg.connector_mode_of(s) for s in cfg.stage_args] == [mode] * 3


@pytest.mark.parametrize("bad", ["rdma", "", 3, None])
def test_bad_connector_names_the_yaml_path(tmp_path, bad):
    data = copy.deepcopy(BASE)
    data["deployment"]["connector"] = bad
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, data)
    assert exc.value.path == "deployment.connector"
    if isinstance(bad, str):
        assert "expected one of: auto, inline, shm, tcp" in str(exc.value)


def test_start_messages_carry_the_mode_and_default_to_none():
    from omni_actors.config import StageDeployment, StageSpec

    stage = StageSpec(stage_id=0, engine_args={"model_stage": "thinker"})
    assert StartEngine("thinker/0", stage, StageDeployment(), 1.0, 65536).connector_mode is None
    msg = StartEngine("thinker/0", stage, StageDeployment(), 1.0, 65536, connector_mode="tcp")
    assert pickle.loads(pickle.dumps(msg)).connector_mode == "tcp"
    assert StartPool(stage, StageDeployment(), 1.0, 10.0, 65536).connector_mode is None


# -- vLLM-Omni's legacy runtime.connectors -----------------------------------------------------

@pytest.fixture
def no_vllm_omni(monkeypatch):
    """As where vllm_omni is not installed (the main venv), wherever the test runs."""
    monkeypatch.setattr(omni, "available", lambda: False)


@pytest.fixture
def with_vllm_omni(monkeypatch):
    """As where vllm_omni is installed (only the config logic: nothing is imported)."""
    monkeypatch.setattr(omni, "available", lambda: True)


def test_shared_memory_connector_is_applied_and_others_are_reported(tmp_path, no_vllm_omni):
    data = with_connectors(
        {"enabled": True, "defaults": {"window_size": -1, "max_inflight": 1},
         "connectors": {"shm": SHM, "rdma": MOONCAKE},
         "edges": [{"from": 0, "to": 1, "window_size": -1}, {"from": 1, "to": 2}]},
        s0={"output_connectors": {"to_stage_1": "shm"}},
        s1={"input_connectors": {"from_stage_0": "shm"}, "output_connectors": {"to_stage_2": "rdma"}},
        s2={"input_connectors": {"from_stage_1": "rdma"}})
    cfg = load(tmp_path, data)
    kept = cfg.omni_connectors
    assert kept.connectors == {"shm": SHM, "rdma": MOONCAKE}
    assert kept.edges[0] == {"from": 0, "to": 1, "window_size": -1, "max_inflight": 1}
    assert kept.by_edge == {"0->1": "SharedMemoryConnector", "1->2": "MooncakeStoreConnector"}
    thinker, talker, code2wav = cfg.stage_args
    assert cfg.inline_threshold_of(thinker) == 1024  # its SharedMemoryConnector's shm_threshold_bytes
    assert cfg.inline_threshold_of(talker) == cfg.inline_threshold_of(code2wav) == 65536
    assert cfg.connector_mode_of(talker) is None  # Mooncake: ours carries the edge
    notes = "\n".join(kept.notes)
    assert "runtime.connectors.shm (SharedMemoryConnector): applied to thinker: inline up to 1024 bytes" in notes
    assert f"runtime.connectors.rdma (MooncakeStoreConnector) on edge 1->2: {NOT_APPLIED}" in notes
    assert "runtime.edges: kept, not applied" in notes
    assert pickle.loads(pickle.dumps(cfg)).omni_connectors == kept  # it rides in the Deploy message


def test_inline_connector_definitions_and_no_runtime_block(tmp_path, no_vllm_omni):
    data = with_connectors(None, s1={"output_connectors": {"to_stage_2": MOONCAKE}},
                           s0={"output_connectors": {"to_stage_1": {"name": "SharedMemoryConnector"}}})
    cfg = load(tmp_path, data)
    assert cfg.omni_connectors.by_edge == {"0->1": "SharedMemoryConnector", "1->2": "MooncakeStoreConnector"}
    assert cfg.inline_threshold_of(cfg.stage_args[0]) == 65536  # no shm_threshold_bytes: the deployment's
    assert any(n.startswith("stage_args[1].output_connectors.to_stage_2 (MooncakeStoreConnector)")
               and NOT_APPLIED in n for n in cfg.omni_connectors.notes)


def test_an_explicit_inline_or_shm_connector_wins_over_shm_threshold_bytes(tmp_path):
    data = with_connectors({"connectors": {"shm": SHM}}, s0={"output_connectors": {"to_stage_1": "shm"}})
    data["deployment"]["connector"] = "inline"
    cfg = load(tmp_path, data)
    assert cfg.omni_connectors.applied == {}
    assert cfg.connector_mode_of(cfg.stage_args[0]) == "inline"
    assert "deployment.connector `inline` sets how every stage stores its outputs" in cfg.omni_connectors.notes[0]


# -- vLLM-Omni's own connectors (omni_actors.connectors.omni) ------------------------------------

def test_without_vllm_omni_a_named_connector_is_not_applied_and_says_why(tmp_path, no_vllm_omni):
    data = with_connectors({"connectors": {"rdma": MOONCAKE}}, s1={"output_connectors": {"to_stage_2": "rdma"}})
    cfg = load(tmp_path, data)
    assert [cfg.connector_mode_of(s) for s in cfg.stage_args] == [None, None, None]
    assert cfg.omni_connectors.applied == {}
    (note,) = cfg.omni_connectors.notes
    assert note.startswith("stage_args[1].output_connectors.to_stage_2 -> runtime.connectors.rdma "
                           f"(MooncakeStoreConnector) on edge 1->2: {NOT_APPLIED}; "
                           "vllm_omni is not installed in this process")
    assert "talker's outputs go through omni-actors' connectors" in note


def test_an_engine_without_vllm_omni_keeps_our_connectors(tmp_path, no_vllm_omni):
    """An ``omni:`` mode reaching a process without vllm_omni: plain ``auto``, logged."""
    prefix = f"oa-test-omni-{tmp_path.name[-8:]}-"
    conn = NodeConnector(16, prefix, mode=omni.encode_mode("MooncakeStoreConnector", {"master": "h:1"}, stage=1))
    conn.prepare()  # nothing to build
    assert conn.mode == "auto" and conn.adapter is None
    ref = conn.put({"audio": np.zeros(1000, dtype=np.int16)})
    assert ref.kind == "shm"
    release_all([ref])
    assert list_segments(prefix) == []
    # Releasing a vLLM-Omni connector's ref here: logged, left to the connector's own cleanup.
    handle = OmniHandle("SharedMemoryConnector", "{}", "0", "next", prefix + "vo-x", None)
    theirs = ConnectorRef(kind="omni", size=8, layout=(), location=handle.key, omni=handle)
    release_all([theirs])
    conn.release(theirs)
    with pytest.raises(omni.OmniConnectorError):
        conn.get(theirs)


def test_with_vllm_omni_a_named_connector_carries_its_stages_outputs(tmp_path, with_vllm_omni):
    data = with_connectors({"connectors": {"shm": SHM, "rdma": MOONCAKE}},
                           s0={"output_connectors": {"to_stage_1": "shm"}},
                           s1={"output_connectors": {"to_stage_2": "rdma"}})
    cfg = load(tmp_path, data)
    thinker, talker, code2wav = cfg.stage_args
    assert cfg.connector_mode_of(thinker) is None  # SharedMemoryConnector: ours, its threshold
    assert cfg.inline_threshold_of(thinker) == 1024
    mine = omni.parse_mode(cfg.connector_mode_of(talker))
    assert (mine.name, mine.extra, mine.stage, mine.inputs) == (
        "MooncakeStoreConnector", omni.settings_json(MOONCAKE["extra"]), "1", ())
    reader = omni.parse_mode(cfg.connector_mode_of(code2wav))  # opens the Talker's connector at start
    assert reader.name is None and reader.inputs == (("MooncakeStoreConnector", mine.extra),)
    assert cfg.omni_connectors.applied["talker"].omni == MOONCAKE
    assert any(n.startswith("stage_args[1].output_connectors.to_stage_2 -> runtime.connectors.rdma "
                            "(MooncakeStoreConnector): applied to talker: its outputs over 65536 bytes")
               for n in cfg.omni_connectors.notes), cfg.omni_connectors.notes
    assert pickle.loads(pickle.dumps(cfg)).omni_connectors == cfg.omni_connectors
    # The mode travels to the engines in StartPool / StartEngine as any mode does.
    from omni_actors.config import StageDeployment
    msg = StartEngine("talker/0", talker, StageDeployment(), 1.0, 65536, connector_mode=cfg.connector_mode_of(talker))
    assert omni.parse_mode(pickle.loads(pickle.dumps(msg)).connector_mode) == mine


@pytest.mark.parametrize("case,expect", [
    ("transfer_engine", "vLLM-Omni's transfer-engine connectors need sender/receiver roles"),
    ("tcp", "not applied: deployment.connector `tcp` sets how every stage stores its outputs"),
    ("two", "different vLLM-Omni connectors (MooncakeStoreConnector, YuanrongConnector)"),
])
def test_with_vllm_omni_what_is_still_not_applied(tmp_path, with_vllm_omni, case, expect):
    connectors = {"rdma": MOONCAKE, "te": {"name": "MooncakeTransferEngineConnector"},
                  "yr": {"name": "YuanrongConnector", "extra": {}}}
    outputs = {"transfer_engine": {"to_stage_1": "te"}, "tcp": {"to_stage_1": "rdma"},
               "two": {"to_stage_1": "rdma", "to_stage_2": "yr"}}[case]
    data = with_connectors({"connectors": connectors}, s0={"output_connectors": outputs})
    data["stage_args"][2]["engine_input_source"] = [0, 1] if case == "two" else [1]
    if case == "tcp":
        data["deployment"]["connector"] = "tcp"
    cfg = load(tmp_path, data)
    assert cfg.omni_connectors.applied == {}
    assert cfg.connector_mode_of(cfg.stage_args[0]) == ("tcp" if case == "tcp" else None)
    assert any(expect in n and "not applied" in n for n in cfg.omni_connectors.notes), cfg.omni_connectors.notes


def test_edge_outside_the_graph_is_ignored_with_a_note(tmp_path):
    data = with_connectors({"connectors": {"shm": SHM}}, s0={"output_connectors": {"to_stage_2": "shm"}})
    cfg = load(tmp_path, data)
    assert cfg.omni_connectors.applied == {}
    assert "edge 0->2 is not in the stage graph" in cfg.omni_connectors.notes[0]


@pytest.mark.parametrize("runtime,per_stage,path,message", [
    ("yes", {}, "runtime", "expected a mapping"),
    ({"connectors": ["shm"]}, {}, "runtime.connectors", "expected a mapping"),
    ({"connectors": {"shm": {"extra": {}}}}, {}, "runtime.connectors.shm.name", "required field is missing"),
    ({"connectors": {"shm": {"name": "SharedMemoryConnector", "extras": {}}}}, {},
     "runtime.connectors.shm.extras", "unknown field `extras`"),
    ({"edges": [{"from": 0, "to": 7}]}, {}, "runtime.edges[0].to", "unknown stage_id 7"),
    ({"edges": [{"from": 0}]}, {}, "runtime.edges[0].to", "required field is missing"),
    ({"edges": [{"from": "thinker", "to": 1}]}, {}, "runtime.edges[0].from",
     "expected a stage_id (an integer), got `'thinker'`: stage thinker has stage_id 0"),
    # (trial CH: a quoted number read "got `0`", as if 0 were refused)
    ({"edges": [{"from": "0", "to": 1}]}, {}, "runtime.edges[0].from",
     "expected a stage_id (an integer), got `'0'`; known: [0, 1, 2]"),
    ({}, {"s0": {"output_connectors": {"to_stage_1": "nope"}}}, "stage_args[0].output_connectors.to_stage_1",
     "no connector `nope` under `runtime.connectors`"),
    ({}, {"s0": {"output_connectors": {"stage_1": "shm"}}}, "stage_args[0].output_connectors.stage_1",
     "expected a key `to_stage_N`"),
    ({}, {"s1": {"input_connectors": {"from_stage_9": "shm"}}}, "stage_args[1].input_connectors.from_stage_9",
     "unknown stage_id 9"),
    ({}, {"s1": {"input_connectors": ["shm"]}}, "stage_args[1].input_connectors", "expected a mapping"),
    ({"connectors": {"shm": {"name": "SharedMemoryConnector", "extra": {"shm_threshold_bytes": -1}}}},
     {"s0": {"output_connectors": {"to_stage_1": "shm"}}}, "runtime.connectors.shm.extra.shm_threshold_bytes",
     "expected an integer >= 0"),
    # above 64 MiB (as deployment.inline_threshold_bytes), or bad while no stage names it yet
    ({"connectors": {"shm": {"name": "SharedMemoryConnector", "extra": {"shm_threshold_bytes": 99999999999}}}},
     {"s0": {"output_connectors": {"to_stage_1": "shm"}}}, "runtime.connectors.shm.extra.shm_threshold_bytes",
     "<= 67108864"),
    ({"connectors": {"shm": {"name": "SharedMemoryConnector", "extra": {"shm_threshold_bytes": "abc"}}}}, {},
     "runtime.connectors.shm.extra.shm_threshold_bytes", "got `'abc'`"),
    ({"connectors": {"shm": SHM, "rdma": MOONCAKE}},
     {"s0": {"output_connectors": {"to_stage_1": "shm"}}, "s1": {"input_connectors": {"from_stage_0": "rdma"}}},
     "stage_args[1].input_connectors.from_stage_0",
     "edge 0->1 has connector `MooncakeStoreConnector` here but `SharedMemoryConnector`"),
    # (trial CH: a misspelt class was noted as "needs vLLM-Omni's own connector", with vllm_omni or not)
    ({"connectors": {"shm": {"name": "SharedMemoryConector"}}}, {}, "runtime.connectors.shm.name",
     "`SharedMemoryConector` is no vLLM-Omni connector; did you mean `SharedMemoryConnector`?"),
    ({}, {"s0": {"output_connectors": {"to_stage_1": {"name": "MooncakeStoreConector"}}}},
     "stage_args[0].output_connectors.to_stage_1.name", "did you mean `MooncakeStoreConnector`?"),
])
def test_bad_connector_settings_name_the_yaml_path(tmp_path, runtime, per_stage, path, message):
    data = with_connectors(runtime, **per_stage)
    with pytest.raises(ConfigError) as exc:
        load(tmp_path, data)
    assert exc.value.path == path, str(exc.value)
    assert message in exc.value.message


@pytest.mark.parametrize("edge", [{"from": 2, "to": 0}, {"from": 1, "to": 1}])
def test_an_edge_that_is_not_in_the_stage_graph_gets_a_note(tmp_path, no_vllm_omni, edge):
    """A reversed edge or a self-loop in `runtime.edges` was kept without a word (the same
    edge named by a stage's output_connectors gets one)."""
    cfg = load(tmp_path, with_connectors({"edges": [{"from": 0, "to": 1}, edge]}))
    assert (f"runtime.edges[1]: edge {edge['from']}->{edge['to']} is not in the stage graph "
            f"(stage {edge['to']}'s engine_input_source)") in cfg.omni_connectors.notes
    assert not any(n.startswith("runtime.edges[0]") for n in cfg.omni_connectors.notes)
