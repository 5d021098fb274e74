"""The dry run at load (omni_actors.config_dry_run): one small request through a config's
synthetic stages, so that a stage no request could pass is refused before it is served."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from omni_actors.config import load_config, parse_config
from omni_actors.config_dry_run import dry_run_problem

REPO = Path(__file__).resolve().parent.parent
SHIPPED = sorted((REPO / "configs").glob("*.yaml")) + sorted((REPO / "configs" / "topologies").glob("*.yaml"))
#: Thinker -> Talker -> Code2Wav, streaming between stages on.
DEMO = yaml.safe_load((REPO / "configs" / "cpu_omni_demo.yaml").read_text())


def _problem(data: dict) -> str | None:
    problem = dry_run_problem(parse_config(data, "c.yaml"))
    return None if problem is None else str(problem)


def _demo(streaming: bool = True) -> dict:
    data = copy.deepcopy(DEMO)
    data["deployment"]["streaming"]["enabled"] = streaming
    return data


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_config_passes_the_dry_run(path):
    """Including those with real engines (their stages, and those after them, are not run)."""
    assert dry_run_problem(load_config(path)) is None


@pytest.mark.parametrize("streaming", [False, True])
def test_a_consumer_whose_processor_does_not_fit_what_the_stage_before_makes_is_found(streaming):
    """Code2Wav given the Talker's processor: it reads a Thinker's fields. With streaming on it
    runs on each of the Talker's chunks (the whole-output path is not taken there)."""
    assert _problem(_demo(streaming)) is None
    data = _demo(streaming)
    data["stage_args"][2]["custom_process_input_func"] = "omni_actors.processors.thinker2talker"
    assert _problem(data) == (
        "c.yaml: stage_args[2].custom_process_input_func: omni_actors.processors.thinker2talker fails on "
        "the outputs of stage(s) [1] (talker), as it would for every request through stage code2wav: "
        "ValueError: thinker2talker: stage 1 outputs have no `token_ids` (got fields: ['codes'])")


def test_a_kind_that_does_not_fit_its_input_names_the_kind():
    """The model_stage picks the behaviour where no synthetic.kind is given: that is the field named."""
    data = _demo()
    data["stage_args"][2]["engine_args"]["model_stage"] = "dit"
    data["stage_args"][2]["final_output_type"] = "image"
    data["deployment"]["stages"]["dit"] = data["deployment"]["stages"].pop("code2wav")
    problem = _problem(data)
    assert problem.startswith("c.yaml: stage_args[2].engine_args.model_stage: stage dit's synthetic `dit` "
                              "engine cannot take what omni_actors.processors.talker2code2wav makes of the "
                              "outputs of stage(s) [1] (talker)"), problem


def test_stages_after_a_real_engine_are_not_run():
    """A Code2Wav whose processor could not take a synthetic Talker's outputs is not judged when
    its Talker is a vLLM engine (what that makes is only known by running it)."""
    data = _demo(streaming=False)
    data["stage_args"][2]["custom_process_input_func"] = "omni_actors.processors.thinker2talker"
    data["stage_args"][1]["engine_args"]["model"] = "/no/model"
    data["deployment"]["stages"]["talker"]["backend"] = "vllm"
    assert _problem(data) is None
    del data["deployment"]["stages"]["talker"]["backend"]
    assert _problem(data) is not None


def test_a_processor_that_returns_no_dict_is_named(tmp_path, monkeypatch):
    (tmp_path / "list_processor.py").write_text("def f(upstream, prompt, params):\n    return []\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = _demo(streaming=False)
    data["stage_args"][1]["custom_process_input_func"] = "list_processor.f"
    assert _problem(data) == ("c.yaml: stage_args[1].custom_process_input_func: list_processor.f returns list on "
                              "the outputs of stage(s) [0] (thinker), not a dict (the stage's engine input)")


def test_processors_get_the_prompt_as_a_chat_renders_it(tmp_path, monkeypatch):
    """A review: a processor that reads the chat's `user: ...` line (every chat prompt has one)
    was refused, the dry run's prompt being a bare sentence."""
    (tmp_path / "chat_processor.py").write_text(
        "from omni_actors.processors import thinker2talker\n"
        "def f(upstream, prompt, params):\n"
        "    [line] = [x for x in prompt.splitlines() if x.startswith('user: ')]\n"
        "    return thinker2talker(upstream, prompt, params)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = _demo(streaming=False)
    data["stage_args"][1]["custom_process_input_func"] = "chat_processor.f"
    assert _problem(data) is None


def test_an_engine_that_refuses_the_request_itself_gives_no_verdict():
    """A review: an AR stage whose context holds its 256 prior tokens and a short prompt (260)
    was refused for the dry run's prompt; what a stage refuses of a request is the client's
    400, not the config's fault. Only a stage that cannot take its input is refused."""
    data = yaml.safe_load((REPO / "configs" / "cpu_image_demo.yaml").read_text())
    data["deployment"]["stages"]["ar"].setdefault("synthetic", {}).update(prior_grid=16, max_model_len=260)
    assert _problem(data) is None
