"""A stage input processor that fails on its upstream outputs: the pipeline's fault, not the client's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request

import pytest

from omni_actors.system.local import LeaderStartError, LocalLeader

CONFIG = """
stage_args:
  - stage_id: 0
    engine_args: {model_stage: thinker}
    final_output: true
    final_output_type: text
  - stage_id: 1
    engine_args: {model_stage: talker}
    engine_input_source: [0]
    custom_process_input_func: broken_processor.thinker2talker
  - stage_id: 2
    engine_args: {model_stage: code2wav}
    engine_input_source: [1]
    custom_process_input_func: omni_actors.processors.talker2code2wav
    final_output: true
    final_output_type: audio
deployment:
  served_model_name: broken-processor-test
  heartbeat_interval_s: 0.5
  max_tokens_limit: 16
  supervision: {circuit_breaker_failures: 3}
  stages:
    thinker: {synthetic: {decode_ms_per_token: 1}}
    talker: {replicas: 1}
    code2wav: {}
"""

# Fails on 4-token texts only: the dry run at start (8 tokens) passes it, these requests (4) do not.
PROCESSOR = '''
from omni_actors.processors import thinker2talker as shipped


def thinker2talker(upstream, prompt, params):
    if len(upstream[0]["token_ids"]) == 4:
        raise ValueError("wants hidden states of width 4096")
    return shipped(upstream, prompt, params)
'''


def _chat(leader: LocalLeader, modalities: list[str]) -> tuple[int, dict]:
    status, answer, _ = _post_chat(leader, 4, modalities)
    return status, answer


def _post_chat(leader: LocalLeader, max_tokens: int, modalities=("text", "audio"),
               timeout: float = 30) -> tuple[int, dict, dict]:
    """A chat completion of ``max_tokens`` text tokens (the processors above tell requests apart
    by it): (HTTP status, JSON body, headers)."""
    body = json.dumps({"model": "broken-processor-test", "max_tokens": max_tokens, "modalities": list(modalities),
                       "messages": [{"role": "user", "content": "hello"}]}).encode()
    req = urllib.request.Request(leader.base_url + "/chat/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), dict(err.headers)


def test_a_processor_failing_on_upstream_outputs_is_a_500_and_spares_the_replica(tmp_path):
    """The Talker's processor raises ValueError on the Thinker's outputs of these requests (4 tokens).

    That is not the client's input: each request gets a 500 naming the processor and the
    upstream stage (it was a 400 before), it is not retried on another replica, and the
    failures do not count towards the Talker's circuit breaker (3 here): 5 in a row leave
    the replica ready with no restart (before, it was isolated and restarted over and over,
    for a fault no restart cures). Text-only requests, which skip the Talker, are served.
    """
    (tmp_path / "broken_processor.py").write_text(textwrap.dedent(PROCESSOR))
    (tmp_path / "config.yaml").write_text(CONFIG)
    pythonpath = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    leader = LocalLeader(tmp_path / "config.yaml", env={"PYTHONPATH": pythonpath}).start()
    try:
        for _ in range(5):
            status, answer = _chat(leader, ["text", "audio"])
            assert status == 500, answer
            message = answer["error"]["message"]
            assert ("broken_processor.thinker2talker failed on the outputs of stage(s) [0]: "
                    "ValueError: wants hidden states of width 4096") in message, message
        status, answer = _chat(leader, ["text"])
        assert status == 200 and answer["choices"][0]["message"]["content"], answer
        deadline = time.monotonic() + 5  # (the table is published once per heartbeat interval)
        while True:
            with urllib.request.urlopen(leader.base_url + "/stages", timeout=10) as r:
                talker = next(st for st in json.loads(r.read())["stages"] if st["stage"] == "talker")
            (replica,) = talker["replicas"]
            if replica["failed"] >= 5 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert (replica["state"], replica["restarts"], replica["failed"]) == ("ready", 0, 5), replica
    finally:
        leader.stop()


def test_a_stage_whose_engine_does_not_fit_its_inputs_is_refused_at_start_and_by_check_config(tmp_path):
    """Trial CE: a Talker given the synthetic `dit` kind (it reads `prior_token_ids`; the
    Talker's processor makes `hidden_states` and `token_ids`) passed check-config and
    started, and every audio request failed. Both now run one small request through the
    synthetic stages first (omni_actors.config_dry_run) and refuse the config: one line
    naming the field to fix and what the stage lacks (start: exit 2, as for any config error)."""
    config = (CONFIG.replace("broken_processor.thinker2talker", "omni_actors.processors.thinker2talker")
              .replace("talker: {replicas: 1}", "talker: {replicas: 1, synthetic: {kind: dit}}"))
    (tmp_path / "config.yaml").write_text(config)
    want = (f"error: {tmp_path / 'config.yaml'}: deployment.stages.talker.synthetic.kind: stage talker's "
            "synthetic `dit` engine cannot take what omni_actors.processors.thinker2talker makes of the "
            "outputs of stage(s) [0] (thinker), as for every request through it: dit: engine_input has no "
            "`prior_token_ids`")
    env = {**os.environ, "OMNI_ACTORS_STATE_DIR": str(tmp_path)}
    check = subprocess.run([sys.executable, "-m", "omni_actors.system", "check-config", "--config",
                            str(tmp_path / "config.yaml")], capture_output=True, text=True, timeout=60, env=env)
    assert check.returncode == 1 and check.stderr.startswith(want), check
    # (--skip-dry-run: for a processor that fails only on the dry run's own request: trial CQ's refused
    # 64x64 images, the dry run's size, where its model takes 256 and up)
    skipped = subprocess.run([sys.executable, "-m", "omni_actors.system", "check-config", "--skip-dry-run", "--config",
                              str(tmp_path / "config.yaml")], capture_output=True, text=True, timeout=60, env=env)
    assert skipped.returncode == 0 and skipped.stdout.startswith("ok: 3 stages"), skipped
    assert "note: --skip-dry-run: the synthetic stages and their processors were not tried" in skipped.stderr
    leader = LocalLeader(tmp_path / "config.yaml")
    try:
        with pytest.raises(LeaderStartError, match="leader exited with 2") as err:
            leader.start()
        assert want in str(err.value), err.value
    finally:
        leader.stop()  # (were it served)


# Sleeps 30 s on 4-token texts, refuses 5-token ones as the client's (the dry run's 8 pass at once).
SLOW_PROCESSOR = '''
import time

from omni_actors.processors import InvalidRequest, thinker2talker as shipped


def thinker2talker(upstream, prompt, params):
    if len(upstream[0]["token_ids"]) == 4:
        time.sleep(30)
    if len(upstream[0]["token_ids"]) == 5:
        raise InvalidRequest("this voice needs at least 6 tokens of text")
    return shipped(upstream, prompt, params)
'''


def test_a_slow_processor_fails_its_own_request_naming_it_and_holds_up_no_other(tmp_path):
    """Trial CQ: a processor that took 8 s ran on the replica's event loop; the replica's stall
    watchdog (5 s) isolated it, and an innocent request on the same replica got "2 replicas
    died while running this request ... it may be what crashes them", the processor named
    nowhere. A processor of the user's runs on a thread: the slow request gets a 500 naming
    it after the stage's stall_timeout_s, a request beside it on the same (only) replica is
    served meanwhile, and the replica is neither isolated nor restarted."""
    import threading

    (tmp_path / "broken_processor.py").write_text(textwrap.dedent(SLOW_PROCESSOR))
    (tmp_path / "config.yaml").write_text(CONFIG.replace("supervision: {circuit_breaker_failures: 3}",
                                                         "supervision: {stall_timeout_s: 2}"))
    pythonpath = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    leader = LocalLeader(tmp_path / "config.yaml", env={"PYTHONPATH": pythonpath}).start()
    try:
        slow: dict = {}

        def send_slow() -> None:
            t0 = time.monotonic()
            slow["answer"] = _chat(leader, ["text", "audio"])
            slow["took"] = time.monotonic() - t0

        sender = threading.Thread(target=send_slow)
        sender.start()
        time.sleep(0.5)  # (its processor is asleep by now)
        body = json.dumps({"model": "broken-processor-test", "max_tokens": 6, "modalities": ["text", "audio"],
                           "messages": [{"role": "user", "content": "hello"}]}).encode()
        req = urllib.request.Request(leader.base_url + "/chat/completions", body,
                                     {"Content-Type": "application/json"})
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=30) as r:
            other = json.loads(r.read())
        assert other["choices"][0]["message"]["audio"]["data"], other
        assert time.monotonic() - t0 < 1.5  # (not held until the slow one's processor gave up)
        sender.join(30)
        status, answer = slow["answer"]
        assert status == 500, answer
        message = answer["error"]["message"]
        assert ("broken_processor.thinker2talker did not return within 2 s (supervision.stall_timeout_s) "
                "on the outputs of stage(s) [0]") in message, message
        assert slow["took"] < 10, slow
        with urllib.request.urlopen(leader.base_url + "/stages", timeout=10) as r:
            talker = next(st for st in json.loads(r.read())["stages"] if st["stage"] == "talker")
        (replica,) = talker["replicas"]
        assert (replica["state"], replica["restarts"]) == ("ready", 0), replica
        # A processor that refuses what the client asked (processors.InvalidRequest): a 400 with its message.
        body = json.dumps({"model": "broken-processor-test", "max_tokens": 5, "modalities": ["text", "audio"],
                           "messages": [{"role": "user", "content": "hello"}]}).encode()
        req = urllib.request.Request(leader.base_url + "/chat/completions", body,
                                     {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=30)
        error = json.loads(refused.value.read())["error"]
        assert refused.value.code == 400 and error["type"] == "invalid_request_error", error
        assert "this voice needs at least 6 tokens of text" in error["message"], error
    finally:
        leader.stop()


# Holds the interpreter for 4 s (a C call that keeps the GIL) on the first 4-token text only.
GIL_PROCESSOR = '''
import ctypes
import os

from omni_actors.processors import thinker2talker as shipped


def hold_the_gil():
    ctypes.pythonapi.sleep(4)  # (libc's sleep, called through the API that keeps the GIL)


def thinker2talker(upstream, prompt, params):
    if len(upstream[0]["token_ids"]) == 4 and not os.path.exists(os.environ["HELD_ONCE"]):
        open(os.environ["HELD_ONCE"], "w").close()
        hold_the_gil()
    if len(upstream[0]["token_ids"]) == 5:  # (every time: a poison request)
        ctypes.pythonapi.sleep(3)
    return shipped(upstream, prompt, params)
'''


def test_a_replica_silenced_by_its_processor_holding_the_gil_names_the_processor(tmp_path):
    """Trial CR: a processor's C call that kept the GIL stopped its replica's heartbeats; the
    pool took the replica for hung and killed it, and nothing named the processor. The
    replica's faulthandler watchdog writes its threads' stacks before the pool's silence
    limit; the pool's reason names the processor and where it was, its log line carries the
    stacks, and the request is served on the replica that replaces it (once: the silence
    counts as one crash by it). One that holds it every time fails after two."""
    (tmp_path / "broken_processor.py").write_text(textwrap.dedent(GIL_PROCESSOR))
    (tmp_path / "config.yaml").write_text(CONFIG)
    pythonpath = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    leader = LocalLeader(tmp_path / "config.yaml",
                         env={"PYTHONPATH": pythonpath, "HELD_ONCE": str(tmp_path / "held")}).start()
    try:
        status, answer = _chat(leader, ["text", "audio"])
        assert status == 200 and answer["choices"][0]["message"]["audio"]["data"], answer
        assert (tmp_path / "held").exists()
        isolated = [json.loads(line) for line in leader.log_path.read_text().splitlines()
                    if '"replica_isolated"' in line]
        assert len(isolated) == 1, isolated
        reason = isolated[0]["reason"]
        assert reason.startswith("missed 3 heartbeats"), reason
        assert ("; it went silent in its processor broken_processor.thinker2talker (broken_processor.py:15, in "
                "hold_the_gil at broken_processor.py:9): a call that holds the GIL stops heartbeats") in reason, reason
        assert 'File "' + str(tmp_path / "broken_processor.py") + '", line 9 in hold_the_gil' in isolated[0]["stacks"]
        with urllib.request.urlopen(leader.base_url + "/stages", timeout=10) as r:
            talker = next(st for st in json.loads(r.read())["stages"] if st["stage"] == "talker")
        (replica,) = talker["replicas"]
        assert (replica["state"], replica["restarts"]) == ("ready", 1), replica
        # A request whose processor call holds the GIL every time (trial CS: uncounted, as a lost host's
        # tasks are, one took 11 replicas down in turn and its stage out for 5 minutes): the silences in
        # its processor calls count as crashes by it, and after max_task_crashes (2) it fails, a 500.
        t0 = time.monotonic()
        status, answer, headers = _post_chat(leader, 5, timeout=60)
        error = answer["error"]
        assert status == 500 and headers["x-should-retry"] == "false", error
        assert "stage talker: 2 replicas died while running this request" in error["message"], error
        assert "it went silent in its processor broken_processor.thinker2talker" in error["message"], error
        assert time.monotonic() - t0 < 30
        isolated = [json.loads(line) for line in leader.log_path.read_text().splitlines()
                    if '"replica_isolated"' in line]
        assert len(isolated) == 3, isolated  # (the one above, and two for this request)
        status, answer = _chat(leader, ["text", "audio"])  # (the stage serves on)
        assert status == 200, answer
    finally:
        leader.stop()


# Computes for about 3 s in one C call that keeps the GIL on 5-token texts (calibrated at import);
# sleeps 2 s (the GIL let go) on 6-token ones.
COMPUTING_PROCESSOR = '''
import time

from omni_actors.processors import thinker2talker as shipped

_t0 = time.perf_counter()
sum(range(10**7))
N = int(3.0 / max(time.perf_counter() - _t0, 1e-3) * 10**7)


def thinker2talker(upstream, prompt, params):
    n = len(upstream[0]["token_ids"])
    if n == 5:
        sum(range(N))  # (one C call: the GIL kept about 3 s)
    elif n == 6:
        time.sleep(2)
    return shipped(upstream, prompt, params)
'''


def test_a_request_whose_processor_call_ran_beside_one_that_held_the_gil_is_served(tmp_path):
    """Trial CT: an innocent request whose processor call was sleeping on the replica that
    another request's call silenced (holding the GIL) was failed with it, a 500 "2 replicas
    died while running this request": every call running counted as the culprit. Only the
    call whose thread computed is blamed: the innocent is retried and served, the other fails."""
    import threading

    (tmp_path / "broken_processor.py").write_text(textwrap.dedent(COMPUTING_PROCESSOR))
    (tmp_path / "config.yaml").write_text(CONFIG)
    pythonpath = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    leader = LocalLeader(tmp_path / "config.yaml", env={"PYTHONPATH": pythonpath}).start()

    def chat(tokens: int, into: dict) -> None:
        into["status"], into["body"], _ = _post_chat(leader, tokens, timeout=90)

    try:
        innocent, poison = {}, {}
        first = threading.Thread(target=chat, args=(6, innocent))
        first.start()
        time.sleep(0.3)  # (its call sleeps on the only Talker when the other's begins)
        chat(5, poison)
        first.join(90)
        assert poison["status"] == 500, poison
        assert "2 replicas died while running this request" in poison["body"]["error"]["message"], poison
        assert innocent["status"] == 200 and innocent["body"]["choices"][0]["message"]["audio"]["data"], innocent
    finally:
        leader.stop()
