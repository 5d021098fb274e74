"""A Talker replica slowed down 5x under load."""

from __future__ import annotations

import pytest

from omni_actors.system.faultlab import assert_no_request_lost, inject_cli, replicas, run_scenario, wait_no_segments

from .conftest import CLIENTS, REQUEST_TIMEOUT_S

pytestmark = [pytest.mark.system, pytest.mark.serial]


def test_replica_slowed_5x_fails_nothing_and_gets_less_work(leader):
    """talker/0 takes 5x as long per step; it still heartbeats and progresses.

    Isolation is not expected: a slow replica is not a broken one. Nothing
    fails, and least-loaded routing (fewest tasks in flight) sends it less
    work than talker/1, since its tasks stay in flight longer.
    """
    # 64 tokens a request (not 16): the Talker's steps, not the actor messages around them,
    # make up most of a task's time, so that the slow-down shows on a loaded machine too
    r = run_scenario(leader, "slow", target="talker/0", factor=5.0, clients=CLIENTS, max_tokens=64,
                     request_timeout_s=REQUEST_TIMEOUT_S, hold_s=4.0, expect_disturbance=False)

    assert_no_request_lost(r)
    assert all(o.status == 200 for o in r.outcomes)
    assert r.isolated_at is None and r.target_states == ["ready"] and not r.disturbed
    before, after = replicas(r.before), replicas(r.after)
    done = {name: after[name]["completed"] - before[name]["completed"] for name in ("talker/0", "talker/1")}
    assert 0 < done["talker/0"] < done["talker/1"], done
    assert after["talker/0"]["pid"] == before["talker/0"]["pid"] and after["talker/0"]["restarts"] == 0
    assert wait_no_segments(leader) == []


def test_slow_really_slows_a_self_pacing_engine(leader):
    """The synthetic engine keeps to deadlines, so a delay added between its events
    was made up at once (a 5x "slow" Thinker answered as fast as before); now the
    engine itself runs slower. 50 tokens at the demo's 4 ms each, 5x: at least 1 s
    by construction (a lower bound: a busy machine only adds to it)."""
    import time

    import openai

    client = openai.OpenAI(base_url=leader.base_url, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)

    def ask() -> float:
        t0 = time.monotonic()
        out = client.chat.completions.create(model="qwen3-omni-cpu-demo", max_tokens=50, modalities=["text"],
                                             messages=[{"role": "user", "content": "hi"}])
        assert out.usage.completion_tokens == 50
        return time.monotonic() - t0

    assert inject_cli(leader.admin_port, "slow", "--replica", "thinker/0", "--factor", "5").returncode == 0
    try:
        slowed = ask()
    finally:
        assert inject_cli(leader.admin_port, "clear", "--replica", "thinker/0").returncode == 0
    assert slowed >= 1.0, f"50 tokens at 5 x 4 ms took {slowed:.2f} s"


@pytest.mark.parametrize("factor", ["nan", "-2", "0.5", "inf"])
def test_slow_rejects_a_factor_that_is_not_a_slow_down(leader, factor):
    """A NaN, negative, speed-up or infinite factor is refused in one line, before anything is sent."""
    out = inject_cli(leader.admin_port, "slow", "--replica", "thinker/0", "--factor", factor)
    assert out.returncode == 2
    assert out.stderr.strip().startswith("error: --factor: the slow-down factor must be a number from 1 to 1000"), out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
