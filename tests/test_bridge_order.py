"""The bridge's receiver logic (no actor system): a request's messages come from
two senders, its RequestActor and its text stage's replica, each numbered on
its own, and the client must see them in a sensible order whatever order they
arrive in."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from omni_actors.connectors import make_connector
from omni_actors.http.bridge import ActorBridge
from omni_actors.http.types import OutputFinal, OutputText, RequestDone, RequestFailed
from omni_actors.messages import OutputDelta, OutputDeltas, OutputReady, RequestFinished


class Loop:
    """Runs what the receiver thread hands to the event loop at once."""

    def call_soon_threadsafe(self, fn, *args):
        fn(*args)


class Stream(list):
    def put_nowait(self, event):
        self.append(event)


@pytest.fixture
def bridge():
    b = ActorBridge(asys=None, coordinator=None)
    b._loop = Loop()
    return b


def _open(bridge: ActorBridge, rid: str) -> Stream:
    stream = bridge._streams[rid] = Stream()
    return stream


def deltas(rid, *items, attempt=0):
    """``items``: (seq, text) pairs, as the engine would send them in one message."""
    return OutputDeltas(tuple(OutputDelta(rid, text, seq, stage_id=0, attempt=attempt) for seq, text in items))


def seen(stream: Stream) -> list:
    out = []
    for ev in stream:
        if isinstance(ev, OutputText):
            out.append(ev.text)
        elif isinstance(ev, OutputFinal):
            out.append(("final", ev.data["text"]))
        elif isinstance(ev, RequestDone):
            out.append("done")
        elif isinstance(ev, RequestFailed):
            out.append(("failed", ev.status))
    return out


def test_text_deltas_are_put_back_in_order_and_the_final_text_and_end_wait_for_them(bridge):
    stream = _open(bridge, "r1")
    final = make_connector().put({"text": "abcd"}, final=True)
    # The RequestActor's messages overtake the engine's last deltas.
    bridge._on_message(deltas("r1", (1, "b")))
    bridge._on_message(OutputReady("r1", 0, "text", final, seq=0, after_text=(0, 4)))
    bridge._on_message(RequestFinished("r1", sent=1, after_text=(0, 4), request_actor="ra"))
    assert seen(stream) == []  # delta 0 has not come: nothing goes out of order
    bridge._on_message(deltas("r1", (0, "a"), (3, "d")))
    assert seen(stream) == ["a", "b"]
    bridge._on_message(deltas("r1", (2, "c")))
    assert seen(stream) == ["a", "b", "c", "d", ("final", "abcd"), "done"]
    assert bridge._outbox("r1").get_nowait() == ("finished", "r1", "ra")  # its RequestActor is free again


def test_a_retried_attempts_text_replaces_an_unseen_one_and_older_text_is_dropped(bridge):
    stream = _open(bridge, "r2")
    bridge._on_message(deltas("r2", (1, "late part of attempt 0")))  # seq 0 never came: nothing went out
    bridge._on_message(deltas("r2", (0, "x"), attempt=1))
    bridge._on_message(deltas("r2", (0, "stale"), attempt=0))
    bridge._on_message(deltas("r2", (1, "y"), attempt=1))
    bridge._on_message(RequestFinished("r2", after_text=(1, 2), request_actor="ra"))
    assert seen(stream) == ["x", "y", "done"]


def test_text_of_a_new_attempt_after_some_text_went_out_fails_the_request(bridge):
    stream = _open(bridge, "r3")
    bridge._on_message(deltas("r3", (0, "hello")))
    bridge._on_message(deltas("r3", (0, "hello again"), attempt=1))
    assert seen(stream) == ["hello", ("failed", 503)]
    assert "reached the client" in stream[-1].message
    assert bridge._outbox("r3").get_nowait() == ("cancel", "r3")  # its RequestActor stops the retry
    bridge._on_message(deltas("r3", (1, "more"), attempt=1))
    bridge._on_message(RequestFinished("r3", after_text=(1, 2), request_actor="ra"))
    assert seen(stream)[:2] == ["hello", ("failed", 503)] and "more" not in seen(stream)
    assert bridge._outbox("r3").get_nowait() == ("finished", "r3", "ra")


def test_the_end_of_a_request_whose_client_left_frees_its_request_actor_at_once(bridge):
    # No stream: the client went away. Text the bridge will never deliver must not hold it.
    bridge._on_message(deltas("gone", (0, "a")))
    bridge._on_message(RequestFinished("gone", after_text=(0, 5), request_actor="ra"))
    assert bridge._outbox("gone").get_nowait() == ("finished", "gone", "ra")


def test_a_request_whose_input_was_lost_with_a_host_may_run_again(bridge):
    """A stage's input lost with its host (INPUT_LOST) fails the request as a lost
    output: the API server runs it again once that host is reported down (see
    test_a_rerun_waits_until_the_host_that_lost_its_output_is_reported_down)."""
    from omni_actors.messages import ErrorKind

    stream = _open(bridge, "r5")
    bridge._on_message(RequestFinished("r5", ErrorKind.INPUT_LOST, "stage code2wav: an input was lost with host m1",
                                       request_actor="ra", lost_on="m1"))
    (failed,) = stream
    assert isinstance(failed, RequestFailed) and failed.status == 500
    assert failed.lost_output and failed.lost_on == "m1" and "lost with host m1" in failed.message
    stream = _open(bridge, "r6")  # other failures do not run again
    bridge._on_message(RequestFinished("r6", ErrorKind.ENGINE_ERROR, "boom", request_actor="ra"))
    assert not stream[0].lost_output and stream[0].lost_on is None


def test_a_request_is_refused_up_front_only_by_what_the_pools_last_reported():
    """``_no_replica``: the published status says a stage the plan needs has no replica ready
    or on its way (the Talker scaled to 0): a 503 before any stream begins. A stage whose
    pool has not reported yet (a coordinator just restarted publishes empty stages) is left
    to its pool, which queues the task for the replicas it is starting: no 503 for it."""
    from pathlib import Path

    from omni_actors.config import load_config
    from omni_actors.messages import PoolState, ReplicaState, ReplicaStatus, Routes, SystemStatus
    from omni_actors.planning import plan_request

    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "cpu_omni_demo.yaml")
    pools = {s.stage_id: f"pool-{s.name}" for s in cfg.stage_args}
    bridge = ActorBridge.__new__(ActorBridge)
    bridge._routes, bridge._published = Routes(cfg, pools), None
    audio = plan_request(cfg, pools, frozenset({"text", "audio"}))
    text = plan_request(cfg, pools, frozenset({"text"}))
    assert bridge._no_replica(audio) is None  # nothing published yet

    def publish(talker: PoolState) -> None:
        ready = [PoolState(s.stage_id, s.name, (ReplicaStatus(f"{s.name}/0", ReplicaState.READY),), pid=10 + i)
                 for i, s in enumerate(cfg.stage_args) if s.name != "talker"]
        bridge._published = SystemStatus("subscription", "m", False, (*ready, talker))

    talker_id = next(s.stage_id for s in cfg.stage_args if s.name == "talker")
    publish(PoolState(talker_id, "talker", (ReplicaStatus("talker/0", ReplicaState.STOPPED, "scaled down"),), pid=7))
    # (and none on its way: a client's own retry would get the same answer)
    assert bridge._no_replica(audio) == ("no ready replica of stage talker (talker/0 stopped: scaled down)", True)
    assert bridge._no_replica(text) is None  # text alone needs no Talker
    publish(PoolState(talker_id, "talker", (ReplicaStatus("talker/1", ReplicaState.STARTING),), pid=7))
    assert bridge._no_replica(audio) is None  # one on its way: the pool queues the task
    cfg.deployment.supervision.queue_timeout_s = 0  # (a review: refused then, but one is on its way)
    assert bridge._no_replica(audio) == ("no ready replica of stage talker (talker/1 starting)", False)
    publish(PoolState(talker_id, "talker", ()))  # not reported yet
    assert bridge._no_replica(audio) is None


def test_a_rerun_waits_until_the_host_that_lost_its_output_is_reported_down():
    """``wait_node_down``: the published status shows the node (by name or by its data
    service's address) lost, or the wait times out (False)."""
    from omni_actors.messages import NodeStatus, SystemStatus

    bridge = ActorBridge.__new__(ActorBridge)
    bridge._published = None

    def publish(alive: bool) -> None:
        node = NodeStatus("m1", alive, ("0",), {}, (), (), data_service="127.0.0.1:4100",
                          down_reason="" if alive else "its member process (pid 9) died")
        bridge._published = SystemStatus("subscription", "m", True, (), nodes=(node,))

    async def main():
        node = NodeStatus("m1", True, ("0",), {}, (), (), data_service="127.0.0.1:4100", data_service_silent_s=4.0)
        bridge._published = SystemStatus("subscription", "m", True, (), nodes=(node,))
        assert await bridge.wait_node_down("m1", 5.0) is True  # (its data service silent: tasks go elsewhere)
        publish(True)
        assert await bridge.wait_node_down("m1", 0.1) is False  # still up: the wait ends at its timeout
        asyncio.get_running_loop().call_later(0.1, publish, False)
        t0 = time.monotonic()
        assert await bridge.wait_node_down("127.0.0.1:4100", 5.0) is True
        assert time.monotonic() - t0 < 2.0  # as soon as it is reported, not at the timeout

    asyncio.run(main())


def test_a_final_output_without_what_its_type_needs_fails_the_request_with_a_reason(bridge):
    """A trial's text final output from a stage that made prior tokens: a KeyError in the
    API server, a bare 500 "The server had an error". Now the 500 says what was missing."""
    import numpy as np

    stream = _open(bridge, "r9")
    final = make_connector().put({"prior_token_ids": np.arange(4, dtype=np.int32)}, final=True)
    bridge._on_message(OutputReady("r9", 0, "text", final, seq=0, after_text=(0, 0)))
    failed = [ev for ev in stream if isinstance(ev, RequestFailed)]
    assert len(failed) == 1 and failed[0].status == 500, stream
    assert failed[0].message == ("stage 0's text output has no `text` (it has: prior_token_ids): its engine "
                                 "makes no text; see its final_output_type in the config")


@pytest.mark.parametrize("message, code", [
    # vLLM 0.32's, for a prompt plus max_tokens over max_model_len
    ("stage thinker (thinker/0): This model's maximum context length is 512 tokens. However, you requested "
     "300 output tokens and your prompt contains at least 301 input tokens, for a total of at least 601 tokens.",
     "context_length_exceeded"),
    # vLLM's, for a prompt alone over it
    ("stage thinker (thinker/0): The decoder prompt (length 900) is longer than the maximum model length of 512.",
     "context_length_exceeded"),
    # the synthetic engine's
    ("stage thinker (thinker/0): the prompt has 9 tokens: over the model's context length of 8 tokens",
     "context_length_exceeded"),
    ("stage talker (talker/0): temperature must be >= 0", None),
])
def test_a_prompt_over_the_context_length_gets_openais_code_for_it(bridge, message, code):
    """A 400 of a prompt over the model's context length carries ``context_length_exceeded``
    (a trial's client found ``code`` null, so it could not tell it from other 400s)."""
    from omni_actors.messages import ErrorKind

    stream = _open(bridge, "r9")
    bridge._on_message(RequestFinished("r9", ErrorKind.BAD_REQUEST, message, request_actor="ra"))
    (failed,) = [ev for ev in stream if isinstance(ev, RequestFailed)]
    assert (failed.status, failed.type, failed.code) == (400, "invalid_request_error", code)


def test_a_finished_request_whose_last_text_deltas_never_come_ends_with_its_final_text(bridge):
    """Trial BD: the Thinker's replica was killed (SIGKILL) 33 ms after its request ended,
    holding text deltas it had not sent yet; the stream waited for them until its client gave
    up (60 s, counted as a 499). After TEXT_GAP_S of waiting (time in which this process runs)
    the end goes on without them: the final text follows, whose missing part the HTTP layer
    sends (see app.py), then the end."""
    from omni_actors.http.bridge import RECEIVER_PAUSED_S, TEXT_GAP_S

    stream = _open(bridge, "r9")
    final = make_connector().put({"text": "abcd"}, final=True)
    bridge._on_message(deltas("r9", (0, "a"), (1, "b")))  # (2 and 3 went down with the replica)
    bridge._on_message(OutputReady("r9", 0, "text", final, seq=0, after_text=(0, 4)))
    bridge._on_message(RequestFinished("r9", sent=1, after_text=(0, 4), request_actor="ra"))
    t = time.monotonic()
    for dt in (0.0, 0.5, 1.0, 1.5, 2.0, 2.5):  # (turns of the receiver, within TEXT_GAP_S)
        bridge.check_text_gaps(t + dt)
    assert seen(stream) == ["a", "b"]
    # a turn long after the last: this process was frozen; the deltas on their way get their time
    bridge.check_text_gaps(t + 2.5 + RECEIVER_PAUSED_S + TEXT_GAP_S)
    assert seen(stream) == ["a", "b"]
    late = t + 2.5 + RECEIVER_PAUSED_S + TEXT_GAP_S
    for dt in (0.5, 1.0, 1.5, 2.0, 2.5, TEXT_GAP_S + 0.01):  # (+0.01: (late + 3) - late can be 2.9999... at a
        bridge.check_text_gaps(late + dt)                      # large monotonic clock: a CI run failed so)
    assert seen(stream) == ["a", "b", ("final", "abcd"), "done"]
    bridge._on_message(deltas("r9", (2, "c")))  # (one that comes after all: over, dropped)
    assert seen(stream) == ["a", "b", ("final", "abcd"), "done"]


def test_text_still_coming_keeps_a_finished_request_waiting(bridge):
    from omni_actors.http.bridge import TEXT_GAP_S

    stream = _open(bridge, "r10")
    final = make_connector().put({"text": "abc"}, final=True)
    bridge._on_message(OutputReady("r10", 0, "text", final, seq=0, after_text=(0, 3)))
    bridge._on_message(RequestFinished("r10", sent=1, after_text=(0, 3), request_actor="ra"))
    t = time.monotonic()
    bridge.check_text_gaps(t)
    bridge.check_text_gaps(t + TEXT_GAP_S - 0.5)
    bridge._on_message(deltas("r10", (1, "b")))  # (slow, but coming: the wait starts again)
    bridge.check_text_gaps(t + TEXT_GAP_S)
    bridge.check_text_gaps(t + TEXT_GAP_S + 1.0)
    assert seen(stream) == []
    bridge._on_message(deltas("r10", (0, "a"), (2, "c")))
    assert seen(stream) == ["a", "b", "c", ("final", "abc"), "done"]


def test_missing_text_deltas_with_no_final_text_to_follow_end_the_request_with_a_503(bridge):
    from omni_actors.http.bridge import TEXT_GAP_S

    stream = _open(bridge, "r11")
    bridge._on_message(deltas("r11", (0, "a")))
    bridge._on_message(RequestFinished("r11", sent=0, after_text=(0, 2), request_actor="ra"))
    t = time.monotonic()
    for dt in (0.0, 1.0, 2.0, TEXT_GAP_S + 0.1):
        bridge.check_text_gaps(t + dt)
    assert seen(stream) == ["a", ("failed", 503)]
    assert "the last 1 text part(s) of the request did not come" in stream[-1].message


class _Address(str):
    """A stand-in for a Thespian ActorAddress: equal by value, and not hashable (as those are
    not: the bridge once put them in a dict, and its route changes failed)."""

    __hash__ = None  # type: ignore[assignment]


def _sender_bridge():
    """A bridge with one sender thread's loop to run by hand, whose tells are recorded, on
    the demo config's routes: ``(bridge, told, config, pools, talker's stage id, a text+audio plan)``."""
    import contextlib
    from pathlib import Path

    from omni_actors.config import load_config
    from omni_actors.messages import Routes
    from omni_actors.planning import plan_request

    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "cpu_omni_demo.yaml")
    pools = {s.stage_id: _Address(f"pool-{s.name}") for s in cfg.stage_args}
    talker = next(s.stage_id for s in cfg.stage_args if s.name == "talker")
    told = []

    class Context:
        def tell(self, address, message):
            told.append((address, message))

    class System:
        def private(self):
            return contextlib.nullcontext(Context())

    b = ActorBridge(asys=System(), coordinator=None, senders=1)
    b._routes = Routes(cfg, pools)
    return b, told, cfg, pools, talker, plan_request(cfg, pools, frozenset({"text", "audio"}))


def test_a_request_that_waited_for_a_request_actor_is_sent_to_the_pools_of_the_routes_now():
    """A code review: a request's plan is made before it waits for a free RequestActor,
    and a pool replaced meanwhile is told only to the requests already running; one that
    waited went to the old pool and hung until its deadline. The sender gives it the
    pools of the routes it has when it hands the request over."""
    from omni_actors.messages import Routes, RunRequest

    b, told, cfg, old, talker, plan = _sender_bridge()
    b._routes = Routes(cfg, {**old, talker: "pool-talker-new"}, version=1)  # (while it waited)
    run = RunRequest("r1", "hi", plan, {}, {}, 30.0, "bridge")
    b._outboxes[0].put(("run", run, "request-actor"))
    b._outboxes[0].put(None)
    b._send_loop(0, 0)
    (address, sent), = told
    assert address == "request-actor"
    assert {s.stage_id: s.pool for s in sent.plan.stages} == {**old, talker: "pool-talker-new"}
    assert b._stages[0]["r1"] == tuple((s.pool, s.stage_id) for s in sent.plan.stages)  # (cancels go there)


def test_a_request_the_bridge_fails_itself_is_cancelled_and_what_comes_after_is_dropped(bridge):
    """A code review: an output the API server could not fetch (its segment gone), or not
    use, ended the client's request with a 500, but the pipeline was never cancelled: the
    RequestActor held its later outputs for a client that had gone and its producers
    stalled on their output window until the chunk timeout or the deadline. Now the
    bridge cancels the request, and releases what is still on its way or waiting."""
    import numpy as np

    from omni_actors.connectors import ConnectorRef
    from omni_actors.messages import OutputChunk

    connector = make_connector()
    stream = _open(bridge, "r7")
    gone = ConnectorRef(kind="shm", size=16, layout=(), location="oa-missing-segment-r7")
    waiting = connector.put({"audio": np.ones(40000, dtype=np.float32)})  # (seq 2: waits for seq 1)
    later = connector.put({"audio": np.ones(40000, dtype=np.float32)})
    bridge._on_message(OutputChunk("r7", 2, "audio", waiting, seq=1))
    bridge._on_message(OutputChunk("r7", 2, "audio", gone, seq=0))
    failed = [ev for ev in stream if isinstance(ev, RequestFailed)]
    assert len(failed) == 1 and failed[0].status == 500 and "streamed output lost" in failed[0].message, stream
    assert bridge._outbox("r7").get_nowait() == ("cancel", "r7")
    bridge._on_message(OutputChunk("r7", 2, "audio", later, seq=2))
    assert len(stream) == 1  # nothing after the failure
    for ref in (waiting, later):  # both released
        with pytest.raises(Exception):
            connector.get(ref)


def test_a_written_off_requests_cancels_go_to_the_new_pools_too_and_closing_does_not_leak():
    """A code review: (1) the bridge kept the pools a request started on for the cancels it
    sends when it writes the request off; after a pool was replaced, and the task moved to
    the new one, the cancel went to the old pool only. (2) A RequestActorFree that overtook
    its RequestFinished left the request counted as closing for good."""
    from omni_actors.messages import CancelStage, RequestActorFree, RequestFinished, Routes, RunRequest

    b, told, cfg, old, talker, plan = _sender_bridge()
    new = Routes(cfg, {**old, talker: "pool-talker-new"}, version=1)
    for item in (("run", RunRequest("r1", "hi", plan, {}, {}, 30.0, "bridge"), "request-actor"),
                 ("routes", new), ("abandon", "r1", False), None):
        b._outboxes[0].put(item)
    b._send_loop(0, 0)
    cancels = sorted((a, m.stage_id) for a, m in told if isinstance(m, CancelStage))
    assert cancels == sorted([(pool, sid) for sid, pool in old.items()] + [("pool-talker-new", talker)])

    b._loop = Loop()
    b._held["r2"] = object()
    b._on_message(RequestActorFree("r2", "ra-2"))  # (overtook its RequestFinished)
    b._on_message(RequestFinished("r2", error=None, free=False, request_actor="ra-2"))
    assert b.request_actors()["closing"] == 0
    b._held["r3"] = object()
    b._on_message(RequestFinished("r3", error=None, free=False, request_actor="ra-3"))
    assert b.request_actors()["closing"] == 1


def test_an_output_fetched_from_another_host_holds_up_only_its_own_request(bridge):
    """Trial CG froze a member's process: each fetch of an output made there waited out the
    data service's 10 s timeout on the receiver thread, and every other request (text-only
    ones, ``/ready``) waited behind it. Such a fetch runs on a fetch thread now: another
    request's messages go through meanwhile, and this request's end waits for its output."""
    import threading

    import numpy as np

    release = threading.Event()
    ref = make_connector().put({"text": np.array("hi")}, final=True)
    fetched = bridge._fetch

    def slow_fetch(r):
        assert release.wait(10)
        return fetched(r)

    bridge._connector.reads_remotely = lambda r: r is ref  # (as made on another host)
    bridge._fetch = slow_fetch
    far, near = _open(bridge, "far"), _open(bridge, "near")
    bridge._on_message(deltas("far", (0, "h")))
    bridge._on_message(OutputReady("far", 0, "text", ref, seq=0, after_text=(0, 1)))
    bridge._on_message(RequestFinished("far", sent=1, request_actor="ra"))
    bridge._on_message(deltas("near", (0, "ok")))  # (the receiver is not held up)
    bridge._on_message(RequestFinished("near", request_actor="rb"))
    assert seen(near) == ["ok", "done"]
    assert seen(far) == ["h"]  # its end waits for its output
    release.set()
    deadline = time.monotonic() + 5
    while len(far) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen(far) == ["h", ("final", "hi"), "done"]
    bridge._fetcher.close()


def test_a_data_service_said_to_answer_again_is_tried_at_once_and_a_rerun_is_judged_by_where_replicas_are():
    """Trial CI: resumed after a long freeze, a member's outputs were refused for 7 s more (3
    failures in a row had its data service skipped for 12 s) though the coordinator said it
    answered. And a rerun went back to the frozen member that held every Code2Wav."""
    from pathlib import Path

    from omni_actors.config import load_config
    from omni_actors.connectors import data_client
    from omni_actors.http.types import PipelineRequest
    from omni_actors.logs import get_logger
    from omni_actors.messages import NodeStatus, PoolState, ReplicaState, ReplicaStatus, Routes, SystemStatus

    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "cpu_omni_demo.yaml")
    bridge = ActorBridge.__new__(ActorBridge)
    bridge._routes, bridge._published = Routes(cfg, {s.stage_id: f"pool-{s.name}" for s in cfg.stage_args}), None
    bridge._log = get_logger(actor="bridge")

    def status(silent: float, code2wav_nodes: tuple[str, ...]) -> SystemStatus:
        nodes = (NodeStatus("m1", True, (), {}, (), (), data_service="127.0.0.1:4101"),
                 NodeStatus("m2", True, (), {}, (), (), data_service="127.0.0.1:4102", data_service_silent_s=silent))
        stages = tuple(PoolState(s.stage_id, s.name, tuple(
            ReplicaStatus(f"{s.name}/{i}", ReplicaState.READY, node=n)
            for i, n in enumerate(code2wav_nodes if s.name == "code2wav" else ("m1",)))) for s in cfg.stage_args)
        return SystemStatus("subscription", "m", True, stages, nodes=nodes)

    audio = PipelineRequest("r1", "hi", frozenset({"text", "audio"}), {}, {}, 30.0)
    text = PipelineRequest("r2", "hi", frozenset({"text"}), {}, {}, 30.0)
    bridge._published = status(5.0, ("m2",))
    assert bridge.rerun_goes_back("m2", audio) and bridge.rerun_goes_back("127.0.0.1:4102", audio)
    assert not bridge.rerun_goes_back("m2", text)  # (it needs no Code2Wav)
    bridge._published = status(5.0, ("m2", "m1"))
    assert not bridge.rerun_goes_back("m2", audio)  # (the pools send it to m1's)
    both = status(5.0, ("m2", "m1"))  # (trial CJ froze both members: the rerun went to the other)
    both = dataclasses.replace(both, nodes=tuple(dataclasses.replace(n, data_service_silent_s=3.0)
                                                 for n in both.nodes))
    bridge._published = both
    assert bridge.rerun_goes_back("m2", audio)
    bridge._published = status(0.0, ("m2",))
    assert not bridge.rerun_goes_back("m2", audio)  # (it answers: worth a try)

    from omni_actors.http import bridge as bridge_module

    given_up: list[str] = []
    real_give_up, bridge_module.give_up = bridge_module.give_up, given_up.append
    try:
        bridge._data_services_changed(status(0.0, ("m2",)), status(5.0, ("m2",)))
        bridge._data_services_changed(status(5.0, ("m2",)), status(6.0, ("m2",)))  # (once per silence)
        assert given_up == ["127.0.0.1:4102"]  # (its fetches waiting now end at once)
    finally:
        bridge_module.give_up = real_give_up
    data_client._down["127.0.0.1:4102"] = (time.monotonic() + 12, 3)
    try:
        bridge._data_services_changed(status(0.0, ("m2",)), status(0.0, ("m2",)))
        assert "127.0.0.1:4102" in data_client._down  # (not said silent before: our own view stands)
        bridge._data_services_changed(status(5.0, ("m2",)), status(0.0, ("m2",)))
        assert "127.0.0.1:4102" not in data_client._down
    finally:
        data_client._down.pop("127.0.0.1:4102", None)


def test_a_fetch_from_a_node_said_silent_takes_its_data_service_for_down_again(monkeypatch):
    """A review: the API server's own down mark of a frozen host's data service runs out after
    3 s, and each fetch after that waited its 10 s again, though the coordinator still said the
    service was silent. The mark is renewed from what it says (then probed once per mark)."""
    from types import SimpleNamespace

    from omni_actors.http import bridge as bridge_module
    from omni_actors.messages import NodeStatus, SystemStatus

    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(bridge_module, "mark_down", lambda service: calls.append(("mark", service)))
    monkeypatch.setattr(bridge_module, "probe_down", lambda service, timeout_s: calls.append(("probe", service)))
    bridge = ActorBridge.__new__(ActorBridge)
    bridge._connector = SimpleNamespace(take=lambda ref: {"x": 1})
    ref = SimpleNamespace(node="m2", service="127.0.0.1:4102")
    for silent, expected in ((4.0, [("mark", ref.service), ("probe", ref.service)]), (0.0, [("probe", ref.service)])):
        node = NodeStatus("m2", True, (), {}, (), (), data_service=ref.service, data_service_silent_s=silent)
        bridge._published = SystemStatus("subscription", "m", True, (), nodes=(node,))
        calls.clear()
        assert bridge._fetch(ref) == {"x": 1}
        assert calls == expected
