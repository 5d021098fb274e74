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
        "the outputs of stage(s) [1] (talker) of the dry run's request (a chat of one user message 'Describe "
        "the sea in one short sentence.', 8 text tokens), as it would for such a request through stage code2wav "
        "(--skip-dry-run: not tried): ValueError: thinker2talker: stage 1 outputs have no `token_ids` "
        "(got fields: ['codes'])")


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


def test_a_processor_that_never_returns_is_refused_in_time_and_named(tmp_path, monkeypatch):
    """Trial CQ: a processor that slept for an hour hung check-config and start for good
    (Ctrl-C included: it ran on the main thread). It runs on a thread of its own, and the
    config is refused after PROCESSOR_TIMEOUT_S, naming it."""
    import time

    from omni_actors import config_dry_run

    (tmp_path / "slow_processor.py").write_text(
        "import time\n"
        "def f(upstream, prompt, params):\n    time.sleep(3600)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(config_dry_run, "NOTE_AFTER_S", 0.2)
    data = _demo(streaming=False)
    data["deployment"].setdefault("supervision", {})["stall_timeout_s"] = 0.6  # (what a replica waits for one)
    data["stage_args"][1]["custom_process_input_func"] = "slow_processor.f"
    notes = []
    t0 = time.monotonic()
    problem = dry_run_problem(parse_config(data, "c.yaml"), notes.append)
    assert time.monotonic() - t0 < 5
    assert str(problem).startswith(
        "c.yaml: stage_args[1].custom_process_input_func: slow_processor.f did not return within 0.6 s "
        "(supervision.stall_timeout_s, what a replica waits) on the outputs of stage(s) [0] (thinker) of the dry "
        "run's request"), problem
    assert notes == ["the dry run waits for slow_processor.f (stage talker) on the outputs of stage(s) [0] (thinker), "
                     "0.6 s at most (supervision.stall_timeout_s; --skip-dry-run: no dry run)"], notes


def test_a_processor_slower_than_the_engines_budget_but_within_the_stall_timeout_passes(tmp_path, monkeypatch):
    """A review: a processor that takes its time on its first call (a lazy load) is judged by
    what a replica allows it (stall_timeout_s), not by the engines' 10 s budget."""
    from omni_actors import config_dry_run

    (tmp_path / "lazy_processor.py").write_text(
        "import time\n"
        "from omni_actors.processors import thinker2talker\n"
        "def f(upstream, prompt, params):\n    time.sleep(0.6)\n    return thinker2talker(upstream, prompt, params)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(config_dry_run, "DRY_RUN_TIMEOUT_S", 0.5)
    data = _demo(streaming=False)
    data["stage_args"][1]["custom_process_input_func"] = "lazy_processor.f"
    data["stage_args"][2]["custom_process_input_func"] = "omni_actors.processors.thinker2talker"  # (wrong: found)
    problem = _problem(data)
    assert problem is not None and "thinker2talker fails on the outputs of stage(s) [1] (talker)" in problem, problem


def test_processors_get_read_only_arrays_as_a_replica_gives_them(tmp_path, monkeypatch):
    """Trial CQ: a processor that scaled the Thinker's hidden states in place passed the dry
    run (its arrays were writable) and then failed every audio request ("output array is
    read-only": a replica's inputs come from the connectors, read-only)."""
    (tmp_path / "inplace_processor.py").write_text(
        "from omni_actors.processors import thinker2talker\n"
        "def f(upstream, prompt, params):\n"
        "    (out,) = upstream.values()\n"
        "    out['hidden_states'] *= 0.5\n"
        "    return thinker2talker(upstream, prompt, params)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for streaming in (False, True):
        data = _demo(streaming=streaming)
        data["stage_args"][1]["custom_process_input_func"] = "inplace_processor.f"
        problem = _problem(data)
        assert problem is not None and "ValueError: output array is read-only" in problem, problem


def test_a_processor_that_refuses_the_dry_runs_request_as_a_clients_gives_no_verdict(tmp_path, monkeypatch):
    """Trial CQ: a DiT processor for a model that takes 256 px and up refused the dry run's
    64x64 request, and the config could not be served. Raised as the client's
    (``processors.InvalidRequest``, a 400 for a request), it is that request's own refusal:
    no verdict, as for an engine that refuses the request itself. Any other error is still
    the config's."""
    (tmp_path / "big_processor.py").write_text(
        "from omni_actors.processors import InvalidRequest, ar2dit\n"
        "def f(upstream, prompt, params):\n"
        "    if params['width'] < 256:\n"
        "        raise InvalidRequest('images below 256 px are not supported')\n"
        "    return ar2dit(upstream, prompt, params)\n"
        "def g(upstream, prompt, params):\n"
        "    if params['width'] < 256:\n"
        "        raise ValueError('images below 256 px are not supported')\n"
        "    return ar2dit(upstream, prompt, params)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = yaml.safe_load((REPO / "configs" / "cpu_image_demo.yaml").read_text())
    dit = next(i for i, s in enumerate(data["stage_args"]) if s.get("engine_input_source"))
    data["stage_args"][dit]["custom_process_input_func"] = "big_processor.f"
    assert _problem(data) is None
    data["stage_args"][dit]["custom_process_input_func"] = "big_processor.g"
    problem = _problem(data)
    assert problem is not None and "an image request for 'Describe the sea in one short sentence.', 64x64" in problem, \
        problem


def test_a_processor_that_holds_the_interpreter_longer_than_a_replica_may_be_silent_is_refused(tmp_path, monkeypatch):
    """Trial CR: a processor whose one C call kept the GIL for 7 s (sum(range(5 * 10**8)))
    passed the dry run; on a replica it stopped the heartbeats, the replica was taken for
    silent and killed, five times, and the stage was given up for 5 minutes, the processor
    named nowhere. The dry run watches its own event loop while a processor runs: one held
    longer than a replica may be silent (missed_heartbeats x heartbeat_interval_s) is refused."""
    (tmp_path / "gil_processor.py").write_text(
        "from omni_actors.processors import thinker2talker\n"
        "def f(upstream, prompt, params):\n"
        "    sum(range(4 * 10**7))  # (a C loop that keeps the GIL)\n"
        "    return thinker2talker(upstream, prompt, params)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = _demo(streaming=False)
    data["deployment"]["heartbeat_interval_s"] = 0.1
    data["deployment"].setdefault("supervision", {})["missed_heartbeats"] = 1
    data["stage_args"][1]["custom_process_input_func"] = "gil_processor.f"
    problem = _problem(data)
    assert problem is not None and "gil_processor.f held the Python interpreter for " in problem, problem
    assert "a replica's heartbeats stop meanwhile, and one silent for 0.1 s" in problem, problem


def test_a_processors_own_timeout_error_is_its_failure(tmp_path, monkeypatch):
    """A review: a TimeoutError a processor raised was taken for the dry run's wait running out."""
    (tmp_path / "timeout_processor.py").write_text(
        "def f(upstream, prompt, params):\n    raise TimeoutError('the feature store did not answer')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = _demo(streaming=False)
    data["stage_args"][1]["custom_process_input_func"] = "timeout_processor.f"
    problem = _problem(data)
    assert problem is not None and problem.endswith("TimeoutError: the feature store did not answer"), problem


def test_a_hold_under_the_silence_limit_but_over_it_with_the_time_since_a_heartbeat_is_refused(tmp_path, monkeypatch):
    """Trial CT: a processor that held the GIL 1.2 s on every call passed the dry run (limit
    missed_heartbeats x heartbeat_interval_s, 1.5 s at 0.5 s intervals), and then isolated
    replicas: the silence a pool sees is the hold plus the time since the replica's last
    heartbeat, up to an interval. The limit is one interval less."""
    (tmp_path / "hold_processor.py").write_text(
        "import ctypes\n"
        "from omni_actors.processors import thinker2talker\n"
        "def f(upstream, prompt, params):\n"
        "    ctypes.pythonapi.usleep(1200000)  # (libc's, called with the GIL kept)\n"
        "    return thinker2talker(upstream, prompt, params)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = _demo(streaming=False)
    data["deployment"]["heartbeat_interval_s"] = 0.5
    data["stage_args"][1]["custom_process_input_func"] = "hold_processor.f"
    problem = _problem(data)
    assert problem is not None and "hold_processor.f held the Python interpreter for 1." in problem, problem
    assert ("one silent for 1.5 s (supervision.missed_heartbeats x heartbeat_interval_s) is taken for dead and "
            "replaced: the hold plus the time since its last heartbeat, up to an interval, so over 1 s may be") \
        in problem, problem
