"""A "poison" request, one that crashes every engine it runs on, takes down at
most ``supervision.max_task_crashes`` (2) replicas, then fails with a clear 500;
the stage recovers and keeps serving.

The Thinker of the demo pipeline runs 2 replicas here, on a synthetic engine
whose process exits (``os._exit(70)``, as a segfault would end it) when a
prompt contains ``POISON-PILL`` (``synthetic.crash_on``).
"""

from __future__ import annotations

import time

import openai
import pytest
import yaml

from omni_actors.system.faultlab import assert_clean_exit, replicas, stages, wait_ready
from omni_actors.system.local import LocalLeader

from .conftest import CONFIG, REQUEST_TIMEOUT_S

pytestmark = [pytest.mark.system, pytest.mark.serial]

POISON = "POISON-PILL"


@pytest.fixture(scope="module")
def leader(request, tmp_path_factory) -> LocalLeader:
    data = yaml.safe_load(CONFIG.read_text())
    thinker = data["deployment"]["stages"]["thinker"]
    thinker["replicas"] = 2
    thinker["synthetic"]["crash_on"] = POISON
    path = tmp_path_factory.mktemp("poison") / "poison.yaml"
    path.write_text(yaml.safe_dump(data))
    leader = LocalLeader(path)
    request.addfinalizer(lambda: assert_clean_exit(leader))
    leader.start()
    return leader


def _thinker_restarts(leader) -> dict[str, int]:
    return {name: rep["restarts"] for name, rep in replicas(stages(leader)).items() if name.startswith("thinker/")}


def _client(leader) -> openai.OpenAI:
    return openai.OpenAI(base_url=leader.base_url, api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S * 3)


def _wait_restarts(leader, total: int, timeout_s: float = 10.0) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        now = _thinker_restarts(leader)
        if sum(now.values()) >= total or time.monotonic() > deadline:
            return now


@pytest.mark.parametrize("modalities", [["text"], ["text", "audio"]], ids=["text-only", "streaming-stages"])
def test_a_poison_request_crashes_two_replicas_then_fails_with_500(leader, modalities):
    """Text only: the pool re-sends the dead replica's task itself. Text + audio:
    the Thinker streams its chunks to the Talker, so its RequestActor retries the
    streaming stages together; either way the second death ends the request."""
    wait_ready(leader)
    before = _thinker_restarts(leader)
    client = _client(leader)
    # With the openai client's default retries (two more tries of a 5xx): the 500 tells it not
    # to (a trial: without that, each of its retries crashed two more replicas).
    retrying = openai.OpenAI(base_url=leader.base_url, api_key="unused", timeout=REQUEST_TIMEOUT_S * 3)
    with pytest.raises(openai.InternalServerError) as err:
        retrying.chat.completions.create(model="qwen3-omni-cpu-demo", max_tokens=8, modalities=modalities,
                                       messages=[{"role": "user", "content": f"tell me about {POISON} please"}])
    assert err.value.status_code == 500
    assert err.value.response.headers.get("x-should-retry") == "false"
    message = err.value.body["message"] if isinstance(err.value.body, dict) else str(err.value)
    assert "2 replicas died while running this request" in message, message
    assert "thinker/0" in message and "thinker/1" in message, message
    assert "not retried" in message, message

    # Exactly two deaths, one per replica (not a third on a restarted one), and both come back.
    after = _wait_restarts(leader, sum(before.values()) + 2)
    time.sleep(2.0)  # (a third crash would show by now: the restart backoff is 0.5 s)
    after = _thinker_restarts(leader)
    assert sum(after.values()) - sum(before.values()) == 2, (before, after)
    assert all(after[name] - before[name] == 1 for name in before), (before, after)
    table = wait_ready(leader)
    assert all(rep["state"] == "ready" for rep in replicas(table).values()), table

    # The stage keeps serving.
    ok = client.chat.completions.create(model="qwen3-omni-cpu-demo", max_tokens=8, modalities=modalities,
                                        messages=[{"role": "user", "content": "tell me about the sea"}])
    assert ok.choices[0].message.content
    assert "Traceback" not in leader.log_path.read_text()
