"""The dry run at load (omni_actors.config_dry_run): one small request through a config's
synthetic stages, so that a stage no request could pass is refused before it is served."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from omni_actors.config import load_config, parse_config
from omni_actors.config_dry_run import dry_run_problem

REPO = Path(__file__).resolve().parent.parent
SHIPPED = sorted((REPO / "configs").glob("*.yaml")) + sorted((REPO / "configs" / "topologies").glob("*.yaml"))

OMNI = """
stage_args:
  - stage_id: 0
    engine_args: {model_stage: thinker}
    final_output: true
    final_output_type: text
  - stage_id: 1
    engine_args: {model_stage: talker}
    engine_input_source: [0]
    custom_process_input_func: omni_actors.processors.thinker2talker
  - stage_id: 2
    engine_args: {model_stage: code2wav}
    engine_input_source: [1]
    custom_process_input_func: omni_actors.processors.talker2code2wav
    final_output: true
    final_output_type: audio
deployment:
  served_model_name: dry-run-test
  stages: {}
"""


def _problem(text: str) -> str | None:
    problem = dry_run_problem(parse_config(yaml.safe_load(text), "c.yaml"))
    return None if problem is None else str(problem)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_config_passes_the_dry_run(path):
    """Including those with real engines (their stages, and those after them, are not run)."""
    assert dry_run_problem(load_config(path)) is None


def test_a_consumer_whose_processor_does_not_fit_what_a_streamed_chunk_holds_is_found():
    """With streaming on, Code2Wav's processor runs on each of the Talker's chunks: one that
    reads a Thinker's fields fails on them (the whole-output path is not taken there)."""
    text = OMNI.replace("omni_actors.processors.talker2code2wav", "omni_actors.processors.thinker2talker")
    streamed = text.replace("deployment:\n", "deployment:\n  streaming: {enabled: true}\n")
    for config in (text, streamed):
        assert _problem(config) == (
            "c.yaml: stage_args[2].custom_process_input_func: omni_actors.processors.thinker2talker fails on "
            "the outputs of stage(s) [1] (talker), as it would for every request through stage code2wav: "
            "ValueError: thinker2talker: stage 1 outputs have no `token_ids` (got fields: ['codes'])")
    assert _problem(OMNI) is None
    assert _problem(OMNI.replace("deployment:\n", "deployment:\n  streaming: {enabled: true}\n")) is None


def test_a_kind_that_does_not_fit_its_input_names_the_kind():
    """The model_stage picks the behaviour where no synthetic.kind is given: that is the field named."""
    text = OMNI.replace("model_stage: code2wav", "model_stage: dit").replace("final_output_type: audio",
                                                                            "final_output_type: image")
    problem = _problem(text)
    assert problem.startswith("c.yaml: stage_args[2].engine_args.model_stage: stage dit's synthetic `dit` "
                              "engine cannot take what omni_actors.processors.talker2code2wav makes of the "
                              "outputs of stage(s) [1] (talker)"), problem


def test_stages_after_a_real_engine_are_not_run():
    """A Code2Wav whose processor could not take a synthetic Talker's outputs is not judged when
    its Talker is a vLLM engine (what that makes is only known by running it)."""
    text = (OMNI.replace("omni_actors.processors.talker2code2wav", "omni_actors.processors.thinker2talker")
            .replace("  stages: {}\n", "  stages:\n    talker: {backend: vllm}\n")
            .replace("engine_args: {model_stage: talker}", "engine_args: {model_stage: talker, model: /no/model}"))
    assert _problem(text) is None
