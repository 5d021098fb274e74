"""Load balancing (least_loaded) and request planning (plan_request): pure
functions, tested without an actor system."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_actors.balancing import POLICIES, ReplicaLoad, least_loaded, no_replica_reason
from omni_actors.config import load_config
from omni_actors.messages import PlannedStage, ReplicaState, ReplicaStatus, RequestPlan
from omni_actors.planning import PlanError, plan_request

ROOT = Path(__file__).resolve().parent.parent
OMNI = ROOT / "configs" / "cpu_omni_demo.yaml"
IMAGE = ROOT / "configs" / "cpu_image_demo.yaml"
FANIN = ROOT / "tests" / "configs" / "fanin.yaml"


# -- least_loaded ------------------------------------------------------------


def load(replica: str, in_flight: int = 0, last_dispatch: float = 0.0) -> ReplicaLoad:
    return ReplicaLoad(replica=replica, in_flight=in_flight, last_dispatch=last_dispatch)


def test_least_loaded_is_the_registered_policy() -> None:
    assert POLICIES["least_loaded"] is least_loaded


def test_picks_the_replica_with_fewest_in_flight() -> None:
    replicas = [load("talker/0", 3, 3), load("talker/1", 1, 9), load("talker/2", 2, 0)]
    assert least_loaded(replicas) == "talker/1"


def test_tie_on_in_flight_goes_to_the_least_recently_dispatched() -> None:
    replicas = [load("talker/0", 1, 5.0), load("talker/1", 1, 2.0), load("talker/2", 4, 0.0)]
    assert least_loaded(replicas) == "talker/1"


def test_full_tie_goes_to_the_first() -> None:
    replicas = [load("talker/0", 1, 2), load("talker/1", 1, 2)]
    assert least_loaded(replicas) == "talker/0"
    assert least_loaded(list(reversed(replicas))) == "talker/1"


def test_no_candidates_gives_none() -> None:
    assert least_loaded([]) is None


def test_single_candidate_is_picked_however_loaded() -> None:
    assert least_loaded([load("thinker/0", 100, 1000)]) == "thinker/0"


def test_sequential_requests_alternate_between_equal_replicas() -> None:
    """At concurrency 1 (each task done before the next), equal replicas share
    the work instead of the first taking it all."""
    last = {"talker/0": 0.0, "talker/1": 0.0}
    picks = []
    for step in range(1, 7):
        choice = least_loaded([load(r, 0, t) for r, t in last.items()])
        picks.append(choice)
        last[choice] = float(step)  # dispatched, and finished before the next request
    assert picks == ["talker/0", "talker/1"] * 3


def test_a_replica_back_from_a_restart_takes_its_turn_at_once() -> None:
    """Trial AY: a pinned Talker back after a restart, beside two new ones, took 5 tasks in
    12 s where they took 55-70 each: ties went to the fewest tasks ever sent, and it had
    been sent many before. It is now one of the turns (never sent a task since it started)."""
    last = {"talker/2": 0.0, "talker/4": 0.0, "talker/5": 0.0}
    picks = []
    for step in range(1, 31):
        choice = least_loaded([load(r, 0, t) for r, t in last.items()])
        picks.append(choice)
        last[choice] = float(step)
    assert {r: picks.count(r) for r in last} == {"talker/2": 10, "talker/4": 10, "talker/5": 10}


def test_concurrent_requests_spread_by_in_flight() -> None:
    in_flight = {"dit/0": 0, "dit/1": 0, "dit/2": 0}
    last = dict.fromkeys(in_flight, 0.0)
    for step in range(1, 10):
        choice = least_loaded([load(r, in_flight[r], last[r]) for r in in_flight])
        in_flight[choice] += 1
        last[choice] = float(step)
    assert in_flight == {"dit/0": 3, "dit/1": 3, "dit/2": 3}


# -- plan_request -------------------------------------------------------------


@pytest.fixture()
def omni():
    return load_config(OMNI)  # fresh per test: some tests change it


@pytest.fixture(scope="module")
def omni_pools():
    return {0: "pool-thinker", 1: "pool-talker", 2: "pool-code2wav"}


def by_name(plan: RequestPlan) -> dict[str, PlannedStage]:
    return {s.stage: s for s in plan.stages}


def _replicas(*states: ReplicaState) -> list[ReplicaStatus]:
    return [ReplicaStatus(f"talker/{i}", s, "scaled down" if s == ReplicaState.STOPPED else "")
            for i, s in enumerate(states)]


@pytest.mark.parametrize("states, wait_s, refused", [
    ((ReplicaState.READY, ReplicaState.STOPPED), 30.0, False),
    ((ReplicaState.STARTING,), 30.0, False),  # one on its way: the task waits for it
    ((ReplicaState.PENDING, ReplicaState.FAILED), 30.0, False),
    ((ReplicaState.DEAD,), 30.0, False),  # restarting
    ((ReplicaState.ISOLATED,), 30.0, False),
    ((ReplicaState.STARTING,), 0.0, True),  # queue_timeout_s 0: no waiting
    ((ReplicaState.STOPPED, ReplicaState.DRAINING), 30.0, True),
    ((ReplicaState.FAILED,), 30.0, True),
    ((), 30.0, True),
])
def test_a_stage_refuses_a_task_only_with_no_replica_ready_or_on_its_way(states, wait_s, refused) -> None:
    reason = no_replica_reason("talker", _replicas(*states), wait_s)
    assert (reason is not None) == refused, reason


def test_the_refusal_names_each_replica_and_why() -> None:
    reason = no_replica_reason("talker", _replicas(ReplicaState.STOPPED, ReplicaState.DRAINING), 30.0)
    assert reason == "no ready replica of stage talker (talker/1 draining; 1 stopped)"
    # Stopped ones are counted beside others (a trial's 503 listed five); with nothing else
    # the latest two say why the stage has nothing.
    reason = no_replica_reason("talker", _replicas(*[ReplicaState.STOPPED] * 5), 30.0)
    assert reason == "no ready replica of stage talker (talker/0, talker/1, talker/2 and 2 more stopped: scaled down)"
    # Grouped by reason: a trial's 503 named two scaled down long before and folded the
    # three it had just drained into "3 more stopped".
    mixed = [ReplicaStatus(f"talker/{i}", ReplicaState.STOPPED, "drained on request") for i in range(3)] + \
        _replicas(ReplicaState.READY, ReplicaState.READY, ReplicaState.STOPPED, ReplicaState.STOPPED)[3:]
    assert no_replica_reason("talker", mixed, 30.0) == (
        "no ready replica of stage talker (talker/0, talker/1, talker/2 stopped: drained on request; "
        "talker/3 stopped: scaled down)")
    assert no_replica_reason("dit", [], 30.0) == "no ready replica of stage dit (no replicas)"
    # Those replaced by one listed are history (trial CG: after `stage stop`, the 503 began with
    # replicas of nodes left and drained long before, and the cause came last).
    history = [ReplicaStatus("code2wav/1", ReplicaState.STOPPED, "node m1 left the convention (replaced by code2wav/3)"),
               ReplicaStatus("code2wav/3", ReplicaState.STOPPED, "node m2 drained (replaced by code2wav/4)"),
               ReplicaStatus("code2wav/4", ReplicaState.STOPPED, "stage stopped"),
               ReplicaStatus("code2wav/5", ReplicaState.STOPPED, "stage stopped")]
    assert no_replica_reason("code2wav", history, 30.0) == (
        "no ready replica of stage code2wav (code2wav/4, code2wav/5 stopped: stage stopped)")
    # (one replaced by a replica not listed, gone since, is kept: it is the stage's story)
    assert no_replica_reason("code2wav", history[:2], 30.0) == (
        "no ready replica of stage code2wav (code2wav/3 stopped: node m2 drained (replaced by code2wav/4))")


def test_a_new_request_is_not_taken_by_replicas_that_linger_on_a_leaving_node() -> None:
    """The API server's check (``new_request``): a lingering replica takes only the requests
    begun before it lingered (trial AS), so a new one waits for a replacement on its way, and
    with none gets a 503 that says so at once."""
    why = "node m1 is leaving; the last ready replica of stage talker: it finishes the requests begun before"
    lingering = ReplicaStatus("talker/0", ReplicaState.READY, why, lingering=True, lingering_since=1.0)
    assert no_replica_reason("talker", [lingering], 30.0) is None  # (a task of an earlier request)
    assert no_replica_reason("talker", [lingering], 30.0, new_request=True) == (
        f"no replica of stage talker takes new requests (talker/0 ready: {why})")
    starting = ReplicaStatus("talker/1", ReplicaState.STARTING, "replacing talker/0")
    assert no_replica_reason("talker", [lingering, starting], 30.0, new_request=True) is None
    ready = ReplicaStatus("talker/2", ReplicaState.READY)
    assert no_replica_reason("talker", [lingering, ready], 30.0, new_request=True) is None


def test_text_only_runs_the_thinker_alone(omni, omni_pools) -> None:
    plan = plan_request(omni, omni_pools, {"text"})
    assert isinstance(plan, RequestPlan)
    assert [s.stage for s in plan.stages] == ["thinker"]
    (thinker,) = plan.stages
    assert thinker == PlannedStage(stage_id=0, stage="thinker", sources=(), pool="pool-thinker",
                                   final_output_type="text", needs_output=False)


def test_text_and_audio_runs_the_whole_chain(omni, omni_pools) -> None:
    omni.deployment.streaming.enabled = False  # (streamed edges: tests/test_streaming.py)
    plan = plan_request(omni, omni_pools, {"text", "audio"})
    assert [s.stage for s in plan.stages] == ["thinker", "talker", "code2wav"]
    stages = by_name(plan)
    assert stages["thinker"].needs_output is True
    assert stages["thinker"].final_output_type == "text"
    assert stages["talker"].needs_output is True
    assert stages["talker"].final_output_type is None
    assert stages["talker"].sources == (0,)
    assert stages["code2wav"].needs_output is False
    assert stages["code2wav"].final_output_type == "audio"
    assert stages["code2wav"].sources == (1,)


def test_audio_only_still_runs_the_thinker_but_does_not_return_its_text(omni, omni_pools) -> None:
    omni.deployment.streaming.enabled = False
    stages = by_name(plan_request(omni, omni_pools, ["audio"]))
    assert list(stages) == ["thinker", "talker", "code2wav"]
    assert stages["thinker"].final_output_type is None
    assert stages["thinker"].needs_output is True
    assert stages["code2wav"].final_output_type == "audio"


def test_pools_are_carried_into_the_plan(omni, omni_pools) -> None:
    plan = plan_request(omni, omni_pools, {"text", "audio"})
    assert {s.stage_id: s.pool for s in plan.stages} == omni_pools


def test_stage_without_a_pool_is_planned_with_none(omni) -> None:
    plan = plan_request(omni, {0: "pool-thinker"}, {"text", "audio"})
    assert [s.pool for s in plan.stages] == ["pool-thinker", None, None]


def test_output_the_pipeline_cannot_produce_is_refused(omni, omni_pools) -> None:
    with pytest.raises(PlanError, match="image"):
        plan_request(omni, omni_pools, {"image"})


def test_refusal_names_only_the_missing_output(omni, omni_pools) -> None:
    with pytest.raises(PlanError) as info:
        plan_request(omni, omni_pools, {"text", "image"})
    assert "image" in str(info.value)
    assert "text" not in str(info.value)


def test_fan_in_keeps_source_order() -> None:
    cfg = load_config(FANIN)
    pools = {0: "t", 1: "a", 2: "b", 3: "c"}
    plan = plan_request(cfg, pools, {"text", "audio"})
    stages = by_name(plan)
    assert list(stages) == ["thinker", "talker_a", "talker_b", "code2wav"]
    assert stages["code2wav"].sources == (1, 2)
    assert stages["code2wav"].final_output_type == "audio"
    assert stages["talker_a"].needs_output and stages["talker_b"].needs_output
    assert stages["thinker"].needs_output is True
    assert stages["talker_a"].final_output_type is None


def test_fan_in_text_only_prunes_both_branches() -> None:
    cfg = load_config(FANIN)
    plan = plan_request(cfg, {}, {"text"})
    assert [(s.stage, s.needs_output) for s in plan.stages] == [("thinker", False)]


def test_image_pipeline_plans_ar_then_dit() -> None:
    cfg = load_config(IMAGE)
    plan = plan_request(cfg, {0: "ar", 1: "dit"}, {"image"})
    assert [(s.stage, s.needs_output, s.final_output_type) for s in plan.stages] == [
        ("ar", True, None), ("dit", False, "image")]
    with pytest.raises(PlanError, match="text"):
        plan_request(cfg, {}, {"text"})


def test_replicas_in_the_same_state_for_the_same_reason_are_named_together() -> None:
    """Trial AY: a drained node's warning gave every pending replica's long placement reason,
    one after the other."""
    from types import SimpleNamespace

    from omni_actors.balancing import describe_replicas
    from omni_actors.messages import ReplicaState

    why = "no node has 1 free device(s) (m1: drained; m2: 0 of 4 devices free)"
    reps = [SimpleNamespace(replica=f"talker/{i}", state=ReplicaState.PENDING, reason=why) for i in range(5)]
    reps.insert(1, SimpleNamespace(replica="talker/9", state=ReplicaState.STARTING, reason=""))
    reps.append(SimpleNamespace(replica="talker/7", state=ReplicaState.STOPPED, reason="scaled down"))
    assert describe_replicas(reps) == (f"talker/0, talker/1, talker/2 and 2 more pending: {why}; talker/9 starting; "
                                       "1 stopped")


def test_outputs_that_need_vllm_omnis_model_runner_handover_are_refused_and_noted() -> None:
    """A review: Qwen3-Omni's Talker and Code2Wav take the Thinker's hidden states through
    vLLM-Omni's model-runner hand-over (`requires_full_payload_input`), which does not reach
    another replica's engine: the Talker's processor builds only a placeholder prompt, and
    every audio request ran its engine on an empty payload. Audio is refused with a reason
    (the API's 400) and noted at load; text, which needs the Thinker only, is planned."""
    cfg = load_config(ROOT / "configs" / "gpu_qwen3_omni.yaml")
    pools = {0: "t", 1: "a", 2: "c"}
    assert [s.stage for s in plan_request(cfg, pools, {"text"}).stages] == ["thinker"]
    for outputs in ({"text", "audio"}, {"audio"}):
        with pytest.raises(PlanError, match=r"cannot produce .*audio.* stages talker, code2wav take their input "
                                            r"through vLLM-Omni's model-runner hand-over"):
            plan_request(cfg, pools, outputs)
    assert [n for n in cfg.omni_connectors.notes if "requires_full_payload_input" in n] == [
        "stages talker, code2wav: `requires_full_payload_input`: their input comes through vLLM-Omni's "
        "model-runner hand-over, which omni-actors does not carry between replicas yet: requests for audio "
        "output are refused (HTTP 400); text is served"]
    # (the CPU twin, synthetic stages with the same graph, serves audio)
    twin = load_config(ROOT / "configs" / "topologies" / "cpu_qwen3_omni_1_1_1.yaml")
    assert [s.stage for s in plan_request(twin, pools, {"text", "audio"}).stages] == ["thinker", "talker", "code2wav"]


def test_a_new_request_waits_for_replicas_pinned_to_a_drained_node_as_the_drains_warning_says() -> None:
    """Trial BY: with a stage's replicas pinned to node vm (`stage launch --node vm`), `node
    drain --node vm` warned that requests wait up to queue_timeout_s; they got a 503 at once
    while the pinned replicas lingered or drained, and waited once those were pending for the
    node. A replica that starts again on its node when it is undrained (`relaunch`) counts as
    on its way throughout; without a queue timeout, or unpinned, as before."""
    from omni_actors.balancing import stages_left_without_replicas
    from omni_actors.messages import NodeStatus, PoolState, SystemStatus

    why = "node vm drained (`node drain`); it starts again when the node is undrained"
    lingering = ReplicaStatus("code2wav/5", ReplicaState.READY, why, lingering=True, lingering_since=1.0,
                              relaunch=True, node="vm", pin=("vm", ()))
    draining = ReplicaStatus("code2wav/6", ReplicaState.DRAINING, why, relaunch=True, node="vm", pin=("vm", ()))
    for reps in ([lingering], [draining], [lingering, draining]):
        assert no_replica_reason("code2wav", reps, 30.0, new_request=True) is None, reps
    assert no_replica_reason("code2wav", [draining], 0.0, new_request=True).startswith("no ready replica")
    unpinned = ReplicaStatus("code2wav/7", ReplicaState.DRAINING, "drained on request", node="vm")
    assert no_replica_reason("code2wav", [unpinned], 30.0, new_request=True).startswith("no ready replica")
    # (and the warning says there is none elsewhere, not "no replicas")
    before = SystemStatus("q", "m", False, (PoolState(2, "code2wav", (lingering, draining)),),
                          nodes=(NodeStatus("vm", True, (), {}, ("code2wav",), ("code2wav/5", "code2wav/6"),
                                            drained=True),))
    ((stage, warning),) = stages_left_without_replicas(before, "vm", drained=True)
    assert stage == "code2wav" and "has no replica running while node vm is drained (none on another node " \
                                   "than vm); requests that need it wait up to its queue_timeout_s" in warning, warning
