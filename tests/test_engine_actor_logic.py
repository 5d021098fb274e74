"""Pure logic of the actors (EngineActor outbox and tasks, StagePoolActor, RequestActor), no actor system."""

import collections
import dataclasses
import re
import time
from pathlib import Path

import pytest

from omni_actors.actors.outbox import coalesce
from omni_actors.messages import OutputDelta, TaskFinished


def StageDelta(request_id, stage_id, text, **kw):
    """A text delta of one task (the engine sends these straight to the bridge)."""
    return OutputDelta(request_id, text, stage_id=stage_id, **kw)


def test_consecutive_deltas_of_one_task_merge_in_order():
    items = [("ra", StageDelta("r1", 0, " a")), ("ra", StageDelta("r1", 0, " b")),
             ("ra", StageDelta("r1", 0, " c"))]
    assert coalesce(items) == [("ra", StageDelta("r1", 0, " a b c"))]


def test_deltas_of_other_requests_or_targets_stay_apart():
    items = [("ra1", StageDelta("r1", 0, " a")), ("ra2", StageDelta("r2", 0, " x")),
             ("ra1", StageDelta("r1", 0, " b")), ("pool", TaskFinished("t/0", "r1", 0, True)),
             ("ra1", StageDelta("r1", 0, " c")), ("ra1", StageDelta("r1", 0, " d"))]
    out = coalesce(items)
    assert [m.text if isinstance(m, OutputDelta) else "finished" for _, m in out] == [
        " a b", " x", "finished", " c d"]


class Address:
    """Like Thespian's ActorAddress: compared by value, and not hashable."""

    def __init__(self, name):
        self.name = name

    def __eq__(self, other):
        return isinstance(other, Address) and other.name == self.name

    __hash__ = None

    def __str__(self):
        return f"ActorAddr-{self.name}"


def test_deltas_merge_with_real_unhashable_addresses():
    ra = Address("ra")
    items = [(ra, StageDelta("r1", 0, " a")), (Address("ra"), StageDelta("r1", 0, " b"))]
    assert coalesce(items) == [(ra, StageDelta("r1", 0, " a b"))]


def test_address_names_kept_across_drains_name_each_object_once_and_stay_bounded():
    from omni_actors.actors.outbox import AddressNames, bundle

    calls = []

    class Counted(Address):
        def __str__(self):
            calls.append(self.name)
            return super().__str__()

    names = AddressNames(limit=3)
    ra, bridge = Counted("ra"), Counted("bridge")
    for _ in range(5):  # five drains of one task's messages
        items = [(bridge, StageDelta("r1", 0, " a")), (bridge, StageDelta("r1", 0, " b")), (ra, TaskFinished("t/0", "r1", 0, True))]
        out = bundle(coalesce(items, names), names)
        assert [type(m).__name__ for _, m in out] == ["OutputDeltas", "TaskFinished"]
    assert calls == ["bridge"]  # once in five drains (the end message needs no name)
    others = [Counted(f"x{i}") for i in range(4)]
    assert [names[a] for a in others] == [f"ActorAddr-x{i}" for i in range(4)]
    assert len(names) <= 3  # started again when full
    assert names[others[3]] == "ActorAddr-x3"  # (still named right)


def test_an_urgent_message_flushes_the_outbox_and_cancels_the_pending_batch_wakeup(monkeypatch):
    """A text delta waits up to STREAM_FLUSH_S for more; an urgent message behind it
    wakes the actor at once for both, and no second wake-up follows for nothing.
    (STREAM_FLUSH_S made 1 s here, so that "at once" and "no second one" are told apart
    from the batch timer on a loaded machine: at 20 ms they were not.)"""
    import asyncio
    import select

    from omni_actors.actors import engine
    from omni_actors.actors.engine import LoopThread

    monkeypatch.setattr(engine, "STREAM_FLUSH_S", 1.0)
    rt = LoopThread()
    try:
        def wakeups(wait_s):
            woke = select.select([rt.fileno], [], [], wait_s)[0]
            return rt.drain() if woke else None

        t0 = time.monotonic()
        rt.loop.call_soon_threadsafe(lambda: rt.emit("bridge", StageDelta("r1", 0, " a"), urgent=False))
        got = wakeups(10.0)  # the batch timer wakes the actor
        assert [m.text for _, m in got] == [" a"] and time.monotonic() - t0 >= 0.9
        done = TaskFinished("t/0", "r1", 0, True)

        def two():
            rt.emit("bridge", StageDelta("r1", 0, " b"), urgent=False)
            rt.emit("pool", done)

        t0 = time.monotonic()
        rt.loop.call_soon_threadsafe(two)
        got = wakeups(10.0)
        assert [m for _, m in got] == [StageDelta("r1", 0, " b"), done]
        assert time.monotonic() - t0 < 0.5  # at once, not with the delta's timer
        assert wakeups(1.5) is None  # the delta's timer was cancelled
        rt.loop.call_soon_threadsafe(lambda: rt.emit("bridge", StageDelta("r1", 0, " c"), urgent=False))
        assert [m.text for _, m in wakeups(10.0)] == [" c"]  # and a new batch gets one
    finally:
        rt.stop()
        asyncio.set_event_loop(None)


def test_interleaved_deltas_of_concurrent_requests_merge_per_request():
    items = [("ra1", StageDelta("r1", 0, " a")), ("ra2", StageDelta("r2", 0, " x")),
             ("ra1", StageDelta("r1", 0, " b")), ("ra2", StageDelta("r2", 0, " y"))]
    assert coalesce(items) == [("ra1", StageDelta("r1", 0, " a b")), ("ra2", StageDelta("r2", 0, " x y"))]


def test_text_never_moves_past_the_end_of_its_own_request():
    from omni_actors.messages import StageDone

    done = StageDone("r1", 0, "t/0", None, None)
    items = [("ra1", StageDelta("r1", 0, " a")), ("ra1", done), ("ra1", StageDelta("r1", 0, " late"))]
    assert coalesce(items) == items


def test_chunks_of_one_task_merge_into_one_message_that_says_which_it_holds():
    import numpy as np

    from omni_actors.actors.outbox import PendingChunk, Sequencer, coalesce
    from omni_actors.messages import StageChunk, StageDone

    def chunk(i, r="r1"):
        return ("ra", PendingChunk(r, 1, 0, [{"codes": np.full((2, 3), i), "sample_rate": 24000, "text": str(i)}],
                                   first=i))

    items = [chunk(0), ("ra", StageDelta("r1", 1, "a")), chunk(1), chunk(2), chunk(0, "r2"),
             ("ra", StageDelta("r1", 1, "b")), ("ra", StageDone("r1", 1, "t/0", None, None))]
    merged = coalesce(items)
    kinds = [type(m).__name__ for _, m in merged]
    assert kinds == ["PendingChunk", "OutputDelta", "PendingChunk", "StageDone"]
    stored = []
    seq = Sequencer(lambda outputs: stored.append(outputs) or len(stored))
    out = [seq.stamp(m) for _, m in merged]
    first, second = out[0], out[2]
    assert isinstance(first, StageChunk) and first.seq == 0 and first.last == 2 and first.ref == 1
    np.testing.assert_array_equal(stored[0]["codes"][:, 0], [0, 0, 1, 1, 2, 2])
    assert stored[0]["sample_rate"] == 24000 and stored[0]["text"] == "012"
    assert out[1].seq == 0 and out[1].text == "ab"  # the two deltas of r1 merged
    assert second.request_id == "r2" and second.seq == 0 and second.last == 0
    assert (out[3].deltas, out[3].chunks) == (1, 1)


def test_sequence_numbers_start_over_for_a_new_attempt_and_end_with_the_task():
    from omni_actors.actors.outbox import Sequencer
    from omni_actors.messages import StageDone

    seq = Sequencer(put=lambda outputs: None)
    assert [seq.stamp(StageDelta("r", 0, "x", attempt=0)).seq for _ in range(3)] == [0, 1, 2]
    assert seq.stamp(StageDelta("r", 0, "x", attempt=1)).seq == 0
    assert seq.stamp(StageDone("r", 0, "t/0", None, None, attempt=1)).deltas == 1
    seq.stamp(TaskFinished("t/0", "r", 0, True, attempt=1))
    assert seq.stamp(StageDelta("r", 0, "x", attempt=1)).seq == 0


def test_an_earlier_attempt_still_sending_does_not_renumber_the_next_one():
    """A streaming consumer started over on the same replica: the first attempt's
    last chunk and ``StageDone`` go out after the second attempt's first chunk. Each
    attempt's numbers stay its own, so the RequestActor, which takes the second
    attempt's chunks from 0 and waits for ``StageDone.chunks`` of them, gets them all."""
    from omni_actors.actors.outbox import PendingChunk, Sequencer
    from omni_actors.messages import StageDone

    seq = Sequencer(put=lambda outputs: "ref")

    def chunk(attempt):
        return seq.stamp(PendingChunk("r", 1, attempt, [{"codes": [1]}], first=0))

    assert [chunk(0).seq for _ in range(3)] == [0, 1, 2]
    assert chunk(1).seq == 0
    assert chunk(0).seq == 3  # the first attempt's last chunk, after the second began
    assert seq.stamp(StageDone("r", 1, "t/0", None, None, attempt=0)).chunks == 4
    assert chunk(1).seq == 1
    seq.stamp(TaskFinished("t/0", "r", 1, False, cancelled=True, attempt=0))
    assert chunk(1).seq == 2
    assert seq.stamp(StageDone("r", 1, "t/0", None, None, attempt=1)).chunks == 3
    seq.stamp(TaskFinished("t/0", "r", 1, True, attempt=1))
    assert chunk(1).seq == 0  # forgotten with its task


def test_after_a_chunk_is_lost_its_attempt_sends_no_later_chunk_and_no_stage_done():
    """A review: a chunk that could not be stored (shared memory full) failed its task, but
    the next chunk took its number and the StageDone counted without it; a StageDone that
    overtook the failure looked complete, and the request went on without that chunk's
    outputs (a 200 with a hole in its audio). That attempt's later chunks and its StageDone
    are dropped (the StageDone's refs released); another attempt is not touched."""
    from omni_actors.actors.outbox import PendingChunk, Sequencer
    from omni_actors.messages import StageDone

    released, full = [], [False]

    def put(outputs):
        if full[0]:
            raise OSError(28, "No space left on device")
        return "ref"

    seq = Sequencer(put=put, release=released.extend)

    def chunk(attempt):
        return seq.stamp(PendingChunk("r", 1, attempt, [{"codes": [1]}], first=0))

    assert chunk(0).seq == 0
    full[0] = True
    with pytest.raises(OSError):
        chunk(0)
    seq.lost("r", 1, 0)  # (what the engine does on that error, beside failing the task)
    full[0] = False
    assert chunk(0) is None
    assert seq.stamp(StageDone("r", 1, "t/0", "out", "final", attempt=0)) is None
    assert released == ["out", "final"]
    assert chunk(1).seq == 0  # (the retry, on this replica too)
    finished = TaskFinished("t/0", "r", 1, False, attempt=0)
    assert seq.stamp(finished) is finished
    assert chunk(0).seq == 0  # (forgotten with its task)


def test_text_deltas_for_one_bridge_travel_in_one_message_in_order():
    from omni_actors.actors.outbox import bundle
    from omni_actors.messages import OutputDeltas, StageDone

    done = StageDone("r1", 0, "t/0", None, None)
    items = [(Address("bridge"), StageDelta("r1", 0, "a", seq=0)), (Address("ra1"), done),
             (Address("bridge"), StageDelta("r2", 0, "x", seq=3)), (Address("other"), StageDelta("r3", 0, "q")),
             (Address("bridge"), StageDelta("r1", 0, "b", seq=1))]
    out = bundle(items)
    assert [str(a) for a, _ in out] == ["ActorAddr-bridge", "ActorAddr-ra1", "ActorAddr-other"]
    first = out[0][1]
    assert isinstance(first, OutputDeltas)
    assert [(d.request_id, d.text, d.seq) for d in first.deltas] == [("r1", "a", 0), ("r2", "x", 3), ("r1", "b", 1)]
    assert out[1][1] is done and isinstance(out[2][1], OutputDeltas) and len(out[2][1].deltas) == 1


def _deltas(*texts: str, start: int = 0):
    from omni_actors.messages import OutputDeltas

    return OutputDeltas(tuple(OutputDelta("r", t, start + i) for i, t in enumerate(texts)))


def test_a_bridge_that_does_not_answer_gets_at_most_a_window_of_delta_messages():
    """Trial AO: an engine sent a message per token to a frozen API server until
    Thespian's 20 transmits in flight were all to it, and its heartbeats stopped."""
    from omni_actors.actors.outbox import DeltaWindow

    now = [0.0]
    window = DeltaWindow("engine", window=4, ack_every=2, probe_after_s=2.0, probes=1, clock=lambda: now[0])
    sent = [window.admit("bridge", "b", _deltas(str(i), start=i)) for i in range(7)]
    assert [m is not None for m in sent] == [True] * 4 + [False] * 3
    assert [m.ack for m in sent[:4]] == [0, 2, 0, 4] and sent[1].ack_to == "engine" and sent[1].peer == "b"
    assert window.held() == 3
    # the answer for the first two opens the window: the three held leave as one message, in order
    (address, released), = window.acked("b", 2)
    assert address == "bridge" and [d.text for d in released.deltas] == ["4", "5", "6"] and released.ack == 0
    assert window.held() == 0 and window.acked("b", 2) == []  # (a late or repeated answer is nothing new)
    assert window.admit("bridge", "b", _deltas("7", start=7)).ack == 6  # fills the window again: asks
    assert window.admit("bridge", "b", _deltas("8", start=8)) is None
    # no answer: after probe_after_s one more message asks again (an answer lost), once
    now[0] = 1.0
    assert window.due() == []
    now[0] = 2.5
    (_, probe), = window.due()
    assert probe.ack == 7 and [d.text for d in probe.deltas] == ["8"]
    assert window.admit("bridge", "b", _deltas("9", start=9)) is None
    now[0] = 10.0
    assert window.due() == [] and window.held() == 1  # at most `probes` beyond the window ...
    now[0] = 2.5 + 31.0  # ... then one every DELTA_PROBE_SLOW_S (a code review: held ~5 minutes)
    (_, again), = window.due()
    assert [d.text for d in again.deltas] == ["9"] and window.held() == 0
    # another bridge is not held up by this one
    assert window.admit("other", "o", _deltas("x")) is not None
    # a bridge quiet for long, then a burst: the probe clock starts when deltas are first held
    quiet = DeltaWindow("engine", window=2, ack_every=2, probe_after_s=2.0, clock=lambda: now[0])
    assert quiet.admit("bridge", "q", _deltas("a")) is not None
    now[0] += 100
    assert quiet.admit("bridge", "q", _deltas("b", start=1)).ack == 2
    assert quiet.admit("bridge", "q", _deltas("c", start=2)) is None
    now[0] += 1
    assert quiet.due() == []


def test_deltas_held_for_a_bridge_silent_for_long_are_dropped_and_it_is_forgotten():
    from omni_actors.actors.outbox import DeltaWindow

    now = [0.0]
    window = DeltaWindow("engine", window=1, ack_every=1, probes=0, held_limit=3, forget_after_s=60,
                         clock=lambda: now[0])
    assert window.admit("bridge", "b", _deltas("a")) is not None
    assert window.admit("bridge", "b", _deltas("b", "c", start=1)) is None
    assert window.admit("bridge", "b", _deltas("d", "e", start=3)) is None and window.held() == 0  # over the limit
    assert window.admit("bridge", "b", _deltas("f", start=5)) is None and window.held() == 1
    now[0] = 61.0
    assert window.due() == [] and window.held() == 0
    assert window.admit("bridge", "b", _deltas("g", start=6)).ack == 1  # known afresh


def test_a_retry_on_the_same_replica_keeps_its_inputs_when_the_earlier_attempt_ends():
    """Two attempts of one streaming task on one replica (a retry routed back to it):
    the first ending must not drop the second's input queue, credits or task handle,
    or the second's chunks would be dropped and it would time out for want of them."""
    import asyncio
    from types import SimpleNamespace

    from omni_actors.actors.engine import EngineActor
    from omni_actors.messages import StageTask

    actor = EngineActor()
    actor._started.set()  # (ends its orphan watchdog thread)
    sent = []
    actor._spec = SimpleNamespace(replica="talker/0", stage=SimpleNamespace(name="talker"))
    actor._pool = "pool"
    gate = {}

    async def execute(msg):  # registers what the real one does, then waits to be cancelled
        key = (msg.request_id, msg.stage_id)
        actor._inputs[key] = (msg.attempt, asyncio.Queue())
        actor._credits[key] = [msg.attempt, 0, asyncio.Event()]
        gate[msg.attempt] = asyncio.get_running_loop().create_future()
        await gate[msg.attempt]

    actor._execute = execute

    async def main():
        actor._rt = SimpleNamespace(emit=lambda address, message, **kw: sent.append(message))
        task = StageTask("r1", 1, "hi", (), {}, {}, None, False, "ra", stream_source=0)
        first = asyncio.ensure_future(actor._run_task(task))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(actor._run_task(dataclasses.replace(task, attempt=1)))
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        key = ("r1", 1)
        assert actor._inputs[key][0] == 1 and actor._credits[key][0] == 1
        assert actor._tasks[key] is second
        second.cancel()
        await asyncio.gather(second, return_exceptions=True)
        assert key not in actor._inputs and key not in actor._credits and key not in actor._tasks

    asyncio.run(main())
    # each cancelled attempt confirms its cancel to the RequestActor and tells the pool it ended
    assert [(type(m).__name__, m.attempt) for m in sent] == [
        ("StageCancelled", 0), ("TaskFinished", 0), ("StageCancelled", 1), ("TaskFinished", 1)]


def test_a_cancel_handed_over_right_behind_its_task_cancels_it():
    """The pool forwards a StageTask and, the client having gone, its CancelStage right
    behind it. The actor thread hands both to the engine's loop, where the task starts a
    step later than the cancel runs: the cancel found no task and was lost, and the task ran
    until its upstream-chunk timeout (seen by a trial: about 1 in 100 hang-ups under load)."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from omni_actors.actors.engine import EngineActor
    from omni_actors.messages import CancelStage, StageTask

    actor = EngineActor()
    actor._started.set()  # (ends its orphan watchdog thread)
    actor._spec = SimpleNamespace(replica="talker/0", stage=SimpleNamespace(name="talker"))
    actor._pool, actor._ready, actor._draining = "pool", True, False
    actor._watch = lambda: None
    sent: list = []
    started = threading.Event()

    async def execute(msg):  # a task that runs until it is cancelled
        started.set()
        await asyncio.get_running_loop().create_future()

    async def abort(request_id):
        return None

    actor._execute = execute
    actor._backend = SimpleNamespace(abort=abort)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        actor._rt = SimpleNamespace(loop=loop, submit=lambda coro: asyncio.run_coroutine_threadsafe(coro, loop),
                                    emit=lambda address, message, **kw: sent.append(message))
        held = threading.Event()
        loop.call_soon_threadsafe(held.wait, 5)  # (both handed over before the loop runs either)
        actor.receiveMsg_StageTask(StageTask("r1", 1, "hi", (), {}, {}, None, False, "ra"), "pool")
        actor.receiveMsg_CancelStage(CancelStage("r1", 1), "pool")
        held.set()
        deadline = time.monotonic() + 5
        while not any(type(m).__name__ == "TaskFinished" for m in sent) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [type(m).__name__ for m in sent] == ["StageCancelled", "TaskFinished"], sent
        assert sent[1].cancelled and not started.is_set()  # (never ran)
        assert sent[0].asked  # (a CancelStage's: the RequestActor takes it as the cancel it was)
        assert not actor._tasks
        # a task cancelled by a CancelStage says it was asked; one the replica ended itself (its
        # drain ran out) says it was not, which the RequestActor takes for a failure
        sent.clear()
        actor.receiveMsg_StageTask(StageTask("r2", 1, "hi", (), {}, {}, None, False, "ra"), "pool")
        actor.receiveMsg_StageTask(StageTask("r3", 1, "hi", (), {}, {}, None, False, "ra"), "pool")
        deadline = time.monotonic() + 5
        while len(actor._tasks) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        actor.receiveMsg_CancelStage(CancelStage("r2", 1), "pool")
        while not any(type(m).__name__ == "TaskFinished" for m in sent) and time.monotonic() < deadline:
            time.sleep(0.01)
        loop.call_soon_threadsafe(actor._cancel_all, "drain timed out")
        while len([m for m in sent if type(m).__name__ == "TaskFinished"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [(m.request_id, m.asked) for m in sent if type(m).__name__ == "StageCancelled"] == [
            ("r2", True), ("r3", False)], sent
        assert not actor._cancel_asked
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


def test_a_pool_confirms_at_once_a_task_whose_cancel_came_first():
    """A CancelStage that finds no task (it overtook its StageTask, or the task is not there
    yet): the task, when it comes, is not sent to a replica; its cancel is confirmed."""
    from omni_actors.actors.stage_pool import Replica, StagePoolActor
    from omni_actors.messages import CancelStage, StageCancelled, StageTask

    pool = StagePoolActor()
    pool._started.set()
    sent = []
    pool.send = lambda address, message: sent.append((address, message))
    pool._replicas = {"thinker/0": Replica("thinker/0", "engine-address")}
    pool.receiveMsg_CancelStage(CancelStage("r1", 0), "ra")
    assert sent == []
    pool.receiveMsg_StageTask(StageTask("r1", 0, "hi", (), {}, {}, "text", False, "ra"), "ra")
    assert sent == [("ra", StageCancelled("r1", 0, 0))]
    assert not pool._replicas["thinker/0"].in_flight


def test_cancels_that_found_no_task_are_remembered_for_a_while_and_bounded():
    from omni_actors.actors.cancels import CancelledStages

    now = [0.0]
    early = CancelledStages(remember_s=10, most=3, clock=lambda: now[0])
    early.add(("a", 0))
    assert early.take(("a", 0)) and not early.take(("a", 0))  # (once)
    early.add(("b", 0))
    now[0] = 11
    assert not early.take(("b", 0))  # too old
    for rid in "cdef":
        early.add((rid, 0))
    assert len(early) == 3 and not early.take(("c", 0)) and early.take(("f", 0))


def test_a_cancel_of_earlier_attempts_lets_a_later_one_through_and_still_stops_a_late_earlier_one():
    """A code review: a streaming consumer (Code2Wav) whose producer failed is cancelled and
    started again; the cancel, where it found no task (its replica had died too), stopped
    the consumer started again, and the request hung until its deadline. A cancel now says
    which attempts it covers; the consumer starts again as the next attempt."""
    from omni_actors.actors.cancels import CancelledStages
    from omni_actors.actors.stage_pool import Replica, StagePoolActor
    from omni_actors.messages import CancelStage, StageCancelled, StageTask, cancels_attempt

    assert cancels_attempt(None, 5) and cancels_attempt(1, 1) and not cancels_attempt(1, 2)
    early = CancelledStages()
    early.add(("r1", 2), attempt=0)
    assert not early.take(("r1", 2), 1)  # the consumer started again: not cancelled
    assert early.take(("r1", 2), 0) and not early.take(("r1", 2), 0)  # the old one, late: cancelled once
    early.add(("r2", 2), attempt=0)
    early.add(("r2", 2))  # then the request ends: every attempt
    assert early.take(("r2", 2), 7)

    pool = StagePoolActor()
    pool._started.set()
    sent = []
    pool.send = lambda address, message: sent.append((address, message))
    pool._replicas = {"code2wav/0": Replica("code2wav/0", "engine-address")}

    def task(attempt):
        return StageTask("r1", 2, "hi", (), {}, {}, "audio", False, "ra", attempt=attempt, moved=attempt)
    pool.receiveMsg_CancelStage(CancelStage("r1", 2, attempt=0), "ra")  # (its replica died: no task here)
    pool._pending = [(task(1), 1e12)]
    pool.receiveMsg_CancelStage(CancelStage("r1", 2, attempt=0), "ra")
    assert sent == [] and pool._pending == [(task(1), 1e12)]  # the later attempt waits on
    pool.receiveMsg_StageTask(task(0), "ra")  # the old one, late
    assert sent == [("ra", StageCancelled("r1", 2, 0))]
    pool._replicas["code2wav/0"].in_flight[("r1", 2)] = (task(1), 0.0)
    pool.receiveMsg_CancelStage(CancelStage("r1", 2, attempt=0), "ra")
    assert sent[1:] == []  # not passed on to the replica running attempt 1
    pool.receiveMsg_CancelStage(CancelStage("r1", 2), "ra")  # the request ends
    assert sent[1:] == [("ra", StageCancelled("r1", 2, 1)), ("engine-address", CancelStage("r1", 2))]


def _running_request_actor(monkeypatch, stages: tuple, **run):
    """A RequestActor given request ``r1`` over ``stages`` (PlannedStages; ``run``: more
    RunRequest fields), whose sends are recorded and whose releases do nothing: ``(actor, sent)``."""
    from types import SimpleNamespace

    from omni_actors.actors import request
    from omni_actors.messages import RequestPlan, RunRequest

    monkeypatch.setattr(request, "release_all", lambda refs, recycle=False, wait=True: None)
    ra = request.RequestActor()
    sent = []
    ra.send = lambda address, message: sent.append((address, message))
    ra.wakeupAfter = lambda delay, payload=None: None
    ra._myRef = SimpleNamespace(address="ra")
    ra.receiveMsg_RunRequest(RunRequest("r1", "hi", RequestPlan(stages), {}, {}, 60.0, "bridge", **run), "bridge")
    return ra, sent


def test_a_streaming_consumer_started_over_with_its_producer_is_the_next_attempt(monkeypatch):
    """The RequestActor's side of the above: a Talker that fails mid-stream is retried, its
    running Code2Wav is cancelled (attempts up to its own) and sent again, once the new
    Talker's first chunk comes, as attempt 1, not counted as a retry of its own."""
    from omni_actors.messages import CancelStage, ErrorKind, PlannedStage, StageChunk, StageFailed, StageTask

    ra, sent = _running_request_actor(monkeypatch, (
        PlannedStage(1, "talker", (), "pool-talker", None, False, emits_chunks=True),
        PlannedStage(2, "code2wav", (1,), "pool-code2wav", "audio", False, stream_source=1, emits_chunks=True)))

    def tasks(stage_id):
        return [m for _, m in sent if isinstance(m, StageTask) and m.stage_id == stage_id]
    ra.receiveMsg_StageChunk(StageChunk("r1", 1, 0, "ref0", 0), "talker-engine")
    assert [t.attempt for t in tasks(2)] == [0]
    ra.receiveMsg_StageFailed(StageFailed("r1", 1, "talker/0", ErrorKind.UNAVAILABLE, "dead: process exited"),
                              "pool-talker")
    assert [m for _, m in sent if isinstance(m, CancelStage)] == [CancelStage("r1", 2, attempt=0)]
    assert [t.attempt for t in tasks(1)] == [0, 1]
    ra.receiveMsg_StageChunk(StageChunk("r1", 1, 0, "ref0b", 1), "talker-engine-2")
    again = tasks(2)[-1]
    assert (again.attempt, again.moved, again.counted_attempts) == (1, 1, 0)


def test_a_task_that_ends_cancelled_without_being_asked_to_is_a_failure_not_a_hang(monkeypatch):
    """A code review: a task its replica ended as cancelled (its inputs gone, its engine
    aborted it) while its request still waited for it was ignored by the RequestActor, and
    the request waited for its deadline. It is a failure now: tried again, then reported.
    The cancel of an earlier attempt is still ignored."""
    from omni_actors.messages import PlannedStage, RequestFinished, StageCancelled, StageTask

    ra, sent = _running_request_actor(monkeypatch, (PlannedStage(0, "thinker", (), "pool-thinker", "text", False),),
                                      max_attempts=3)
    ra.receiveMsg_StageCancelled(StageCancelled("r1", 0, 0, asked=False), "thinker-engine")
    tasks = [m for _, m in sent if isinstance(m, StageTask)]
    assert [t.attempt for t in tasks] == [0, 1]  # tried again
    ra.receiveMsg_StageCancelled(StageCancelled("r1", 0, 0, asked=False), "thinker-engine")  # (the first, again)
    assert len([m for _, m in sent if isinstance(m, StageTask)]) == 2
    # (a later attempt than its own: the one its pool sent elsewhere itself, a code review: ignored)
    ra.receiveMsg_StageCancelled(StageCancelled("r1", 0, 2, asked=False), "thinker-engine")
    finished = [m for _, m in sent if isinstance(m, RequestFinished)]
    assert len(finished) == 1 and "ended cancelled on its replica" in finished[0].message, finished


def test_a_task_cancelled_by_a_cancel_its_request_actor_did_not_send_ends_the_request(monkeypatch):
    """A code review: an API server that wrote a request off (its hand-over stuck for 3 s, or
    its RequestActor silent for a minute) cancels its stages itself. When the RequestActor
    went on, each such cancel (``asked``) read as a failure of its replica, and the stage was
    tried again: the whole pipeline ran for a client that had had its 500. It ends the
    request now, as cancelled, and its other stages with it."""
    from omni_actors.messages import (CancelStage, ErrorKind, PlannedStage, RequestFinished, StageCancelled,
                                      StageTask)

    ra, sent = _running_request_actor(monkeypatch, (
        PlannedStage(0, "thinker", (), "pool-thinker", "text", False, emits_chunks=True),
        PlannedStage(1, "talker", (0,), "pool-talker", None, False, stream_source=0, emits_chunks=True)),
        max_attempts=3)
    ra.receiveMsg_StageCancelled(StageCancelled("r1", 0, 0, "", asked=True), "pool-thinker")
    assert [t.attempt for _, t in sent if isinstance(t, StageTask)] == [0]  # not tried again
    finished = [m for _, m in sent if isinstance(m, RequestFinished)]
    assert len(finished) == 1 and finished[0].error == ErrorKind.CANCELLED, finished
    assert not [m for _, m in sent if isinstance(m, CancelStage) and m.stage_id == 0]  # (it is cancelled)


def test_a_pool_cancels_a_task_in_flight_long_past_its_request_deadline():
    """A task whose cancel was lost (or overtaken by the task) must not count as in
    flight, nor run, for ever: past its request's deadline (``StageTask.timeout_s``)
    plus a grace, its pool cancels it on its replica and stops counting it."""
    from omni_actors.actors.stage_pool import TASK_OVERDUE_GRACE_S, Replica, StagePoolActor
    from omni_actors.messages import CancelStage, StageTask

    pool = StagePoolActor()
    pool._started.set()
    sent = []
    pool.send = lambda address, message: sent.append((address, message))
    task = StageTask("r1", 0, "hi", (), {}, {}, "text", False, "ra", timeout_s=30.0)
    other = dataclasses.replace(task, request_id="r2", timeout_s=0.0)  # no deadline: left alone
    rep = Replica("thinker/0", "engine-address")
    rep.in_flight = {("r1", 0): (task, 100.0), ("r2", 0): (other, 100.0)}
    pool._replicas = {"thinker/0": rep}
    pool._cancel_overdue(100.0 + 30.0 + TASK_OVERDUE_GRACE_S - 1)
    assert sent == [] and len(rep.in_flight) == 2
    pool._cancel_overdue(100.0 + 30.0 + TASK_OVERDUE_GRACE_S + 1)
    assert sent == [("engine-address", CancelStage("r1", 0))]
    assert list(rep.in_flight) == [("r2", 0)]


def test_a_request_actor_stops_a_producer_that_streams_for_a_request_already_over():
    """A StageChunk for a request this RequestActor no longer runs: the chunk is
    released and its sender (the producing engine) told to cancel that stage."""
    from omni_actors.actors.request import RequestActor
    from omni_actors.connectors import ConnectorRef
    from omni_actors.messages import CancelStage, StageChunk

    ra = RequestActor()
    ra._reset()
    sent = []
    ra.send = lambda address, message: sent.append((address, message))
    ra.receiveMsg_StageChunk(StageChunk("gone", 0, 0, ConnectorRef(kind="inline", size=0, layout=()), 0),
                             "thinker-engine")
    assert sent == [("thinker-engine", CancelStage("gone", 0))]


def test_a_consumers_chunk_timeout_names_the_upstream_stage_where_the_chunks_stopped():
    """A stalled Thinker starves the Talker; on a loaded machine Code2Wav's timeout on
    the Talker can fire before the Talker's on the Thinker (CI saw it). The message
    then also says how long the Thinker, still running, has been silent."""
    import time as _time
    from types import SimpleNamespace

    from omni_actors.actors.request import RequestActor

    ra = RequestActor()
    ra._reset()
    ra._plan = {0: SimpleNamespace(stage="thinker", stream_source=None),
                1: SimpleNamespace(stage="talker", stream_source=0),
                2: SimpleNamespace(stage="code2wav", stream_source=1)}
    now = _time.monotonic()
    ra._chunks = {0: [None] * 5, 1: [None] * 29}
    ra._chunk_at = {0: now - 2.4, 1: now - 2.0}
    ra._sent, ra._consumer = {1: 5, 2: 29}, {1: "talker", 2: "code2wav"}
    assert ra._relay_state(2, 1) == (" [request actor: 29 chunk(s) of stage 1 (talker) in order, stage 1 still "
                                     "running, 29 relayed; upstream of it, stage 0 (thinker) still running, its last "
                                     "chunk 2.4 s ago]")
    assert ra._relay_state(1, 0) == (" [request actor: 5 chunk(s) of stage 0 (thinker) in order, stage 0 still "
                                     "running, 5 relayed]")
    ra._done[0] = object()  # a finished upstream stage is not named
    assert "upstream of it" not in ra._relay_state(2, 1)


def test_a_consumers_chunk_timeout_names_a_sibling_consumer_that_holds_the_producer_back():
    """A stage streaming to two consumers is credited as the slower reads: one whose task
    has not started (its replicas busy) starves the other, and the healthy producer took the
    blame (a review)."""
    from types import SimpleNamespace

    from omni_actors.actors.request import RequestActor

    ra = RequestActor()
    ra._reset()
    ra._plan = {0: SimpleNamespace(stage="thinker", stream_source=None),
                1: SimpleNamespace(stage="talker_a", stream_source=0),
                2: SimpleNamespace(stage="talker_b", stream_source=0)}
    ra._stream_consumers = {0: [1, 2]}
    ra._chunks = {0: [None] * 4}
    ra._sent, ra._consumer, ra._consumed = {1: 4}, {1: "talker_a"}, {1: 4}
    assert ra._relay_state(1, 0) == (" [request actor: 4 chunk(s) of stage 0 (thinker) in order, stage 0 still "
                                     "running, 4 relayed; stage 0 makes chunks only as fast as its slowest consumer "
                                     "reads them, and stage 2 (talker_b) has not started]")
    ra._consumer[2], ra._consumed[2] = "talker_b", 1
    assert ra._relay_state(1, 0).endswith("and stage 2 (talker_b) has read 1 of them]")
    ra._consumed[2] = 4  # (caught up: not named)
    assert "slowest" not in ra._relay_state(1, 0)


def test_a_replica_without_a_process_shows_no_load():
    """A stopped (failed, dead) replica's row has no pid and no load: not the running,
    waiting, KV-cache and rate figures of its last heartbeat, which summed per stage
    gave wrong totals in /v1/stages and /metrics."""
    from types import SimpleNamespace

    from omni_actors.actors.stage_pool import Replica, StagePoolActor
    from omni_actors.messages import ReplicaState

    pool = StagePoolActor()
    pool._started.set()
    sent = []
    pool.send = lambda address, message: sent.append(message)
    pool._coordinator, pool._spec = "coordinator", SimpleNamespace(stage=SimpleNamespace(stage_id=1, name="talker"))
    live = Replica("talker/0", "a0", state=ReplicaState.READY, running=2, waiting=1, kv_cache_usage=0.5, pid=11)
    gone = Replica("talker/1", None, state=ReplicaState.STOPPED, running=2, waiting=1, kv_cache_usage=0.5, pid=12)
    pool._replicas = {"talker/0": live, "talker/1": gone}
    pool._publish()
    rows = {r.replica: r for r in sent[-1].replicas}
    assert (rows["talker/0"].running, rows["talker/0"].waiting, rows["talker/0"].pid) == (2, 1, 11)
    assert (rows["talker/1"].running, rows["talker/1"].waiting, rows["talker/1"].pid) == (0, 0, None)
    assert rows["talker/1"].kv_cache_usage is None and rows["talker/1"].rate == 0.0


def test_draining_the_last_replica_of_a_stage_says_what_follows():
    from types import SimpleNamespace

    from omni_actors.actors.stage_pool import Replica, StagePoolActor
    from omni_actors.messages import AdminReply, DrainReplica, ReplicaState

    pool = StagePoolActor()
    pool._started.set()
    sent = []
    pool.send = lambda address, message: sent.append(message)
    pool._spec = SimpleNamespace(stage=SimpleNamespace(stage_id=0, name="thinker"))
    pool._replicas = {"thinker/0": Replica("thinker/0", "a0", state=ReplicaState.READY),
                      "thinker/1": Replica("thinker/1", "a1", state=ReplicaState.READY)}
    pool.receiveMsg_DrainReplica(DrainReplica("thinker/0"), "cli")
    first = [m for m in sent if isinstance(m, AdminReply)][-1]
    assert first.ok and first.message == "draining thinker/0 (0 in flight)"
    pool.receiveMsg_DrainReplica(DrainReplica("thinker/1"), "cli")
    last = [m for m in sent if isinstance(m, AdminReply)][-1]
    assert last.ok and "it was the last replica of stage thinker: its requests get 503" in last.message


def test_scaling_down_retires_a_replica_that_cannot_serve_before_a_ready_one():
    """Trial P: talker/4 pending (pinned to a device its node no longer offers) and talker/5
    ready; `scale 1` stopped the ready one (the newest) and kept the one that could never
    start: NOT READY, every audio request a 503. Now pending, dead, isolated and starting
    replicas go before ready ones."""
    from types import SimpleNamespace

    from omni_actors.actors.stage_pool import Replica, StagePoolActor
    from omni_actors.messages import AdminReply, ReplicaState, ScaleStage

    pool = StagePoolActor()
    pool._started.set()
    sent = []
    pool.send = lambda address, message: sent.append(message)
    pool._spec = SimpleNamespace(stage=SimpleNamespace(stage_id=1, name="talker"))
    pool._replicas = {"talker/4": Replica("talker/4", None, state=ReplicaState.PENDING),
                      "talker/5": Replica("talker/5", "a5", state=ReplicaState.READY),
                      "talker/6": Replica("talker/6", "a6", state=ReplicaState.STARTING)}
    pool.receiveMsg_ScaleStage(ScaleStage("talker", 2), "cli")
    assert pool._replicas["talker/4"].state == ReplicaState.STOPPED
    pool.receiveMsg_ScaleStage(ScaleStage("talker", 1), "cli")
    assert pool._replicas["talker/6"].state == ReplicaState.DRAINING
    assert pool._replicas["talker/5"].state == ReplicaState.READY
    assert [m.message for m in sent if isinstance(m, AdminReply)] == [
        "talker: 3 -> 2 replicas; retiring talker/4 (stopped)",  # (a trial: which ones went was not said)
        "talker: 2 -> 1 replicas; retiring talker/6 (draining)"]


def test_a_pool_shows_only_its_latest_stopped_replicas():
    """Every drain or scale-down used to leave one more stopped row for good (trial: 15 in
    `status`, 448 series in /metrics); a pool keeps the latest MAX_STOPPED_SHOWN."""
    from types import SimpleNamespace

    from omni_actors.actors.stage_pool import MAX_STOPPED_SHOWN, Replica, StagePoolActor
    from omni_actors.messages import ReplicaState

    pool = StagePoolActor()
    pool._started.set()
    sent = []
    pool.send = lambda address, message: sent.append(message)
    pool._coordinator, pool._spec = "coordinator", SimpleNamespace(stage=SimpleNamespace(stage_id=1, name="talker"))
    n = MAX_STOPPED_SHOWN + 5
    pool._replicas = {f"talker/{i}": Replica(f"talker/{i}", None, state=ReplicaState.STOPPED) for i in range(n)}
    pool._replicas["talker/99"] = Replica("talker/99", "a", state=ReplicaState.READY)
    pool._publish()
    shown = [r.replica for r in sent[-1].replicas]
    assert shown == [f"talker/{i}" for i in range(5, n)] + ["talker/99"]


def test_a_request_actor_exits_when_idle_and_its_api_server_went_silent():
    """An idle RequestActor that heard nothing from its API server's bridge for
    ``lost_after_s`` exits (its server was killed); a busy one does not, and a
    BridgeAlive keeps an idle one."""
    import time as _time
    from types import SimpleNamespace

    from thespian.actors import ActorExitRequest

    from omni_actors.actors.request import RequestActor
    from omni_actors.messages import BridgeAlive

    ra = RequestActor()
    sent, wakeups = [], []
    ra.send = lambda address, message: sent.append(message)
    ra.wakeupAfter = lambda delay, payload=None: wakeups.append((delay, payload))
    ra._myRef = SimpleNamespace(address="ra-address")  # (Thespian sets it when it runs the actor)
    ra.receiveMsg_BridgeAlive(BridgeAlive(2.0), "bridge")
    assert wakeups[-1][0] == 1.0  # checks every half of lost_after_s
    ra._check_bridge()
    assert sent == []  # heard just now
    ra._heard_at = _time.monotonic() - 5
    ra._req = object()  # busy: a request in flight is no silence
    ra._check_bridge()
    assert sent == []
    ra._req = None
    ra._check_bridge()
    assert [type(m) for m in sent] == [ActorExitRequest]


def test_a_pool_recovers_from_lost_wakeups():
    """Thespian drops the wake-ups that fall due while an actor drains an excessive transmit
    queue (a trial's storm of client hang-ups): the pool's health tick, which re-arms itself,
    then never came back (status frozen, a SIGSTOPped replica never isolated), and a restart
    asked for then would never happen. A heartbeat now restarts a lost tick chain (the old
    chain's late tick is ignored), and the tick runs a restart whose wake-up is overdue."""
    import time as _time
    from types import SimpleNamespace

    from thespian.actors import WakeupMessage

    from omni_actors.actors.stage_pool import WAKEUP_LOST_AFTER_S, Replica, StagePoolActor
    from omni_actors.messages import Heartbeat, ReplicaState

    pool = StagePoolActor()
    pool._started.set()
    wakeups, ticks, timers = [], [], []
    pool.send = lambda address, message: None
    pool.wakeupAfter = lambda delay, payload=None: wakeups.append(payload)
    pool._tick = lambda: ticks.append(_time.monotonic())
    pool._spec = SimpleNamespace(heartbeat_interval_s=1.0, stage=SimpleNamespace(stage_id=0, name="thinker"))
    pool._start_ticks()
    assert wakeups == [("tick", 1)]
    pool._replicas = {"thinker/0": Replica("thinker/0", "a0", state=ReplicaState.READY)}
    pool._last_tick = _time.monotonic() - 10  # no tick for 10 intervals: its wake-up was lost
    pool.receiveMsg_Heartbeat(Heartbeat("thinker/0", 0, 0, 0, 0), "a0")
    assert len(ticks) == 1 and wakeups[-1] == ("tick", 2)
    pool.receiveMsg_WakeupMessage(WakeupMessage(0.25, ("tick", 1)), None)  # the old chain: ignored
    assert len(ticks) == 1
    pool.receiveMsg_WakeupMessage(WakeupMessage(0.25, ("tick", 2)), None)
    assert len(ticks) == 2 and wakeups[-1] == ("tick", 2)

    pool._on_timer = lambda payload: timers.append(payload)
    pool._after(0.5, ("restart", "thinker/0"))
    pool._run_lost_timers(_time.monotonic())
    assert timers == []  # not due yet
    pool._run_lost_timers(_time.monotonic() + 0.5 + WAKEUP_LOST_AFTER_S + 0.1)
    assert timers == [("restart", "thinker/0")] and pool._timers == {}


def test_a_node_that_left_cleanly_gets_its_replicas_placed_again_at_once_not_restarted():
    """A member stopped on purpose (LEFT_REASON) is not its replicas' fault: they are
    placed again at once, without a restart (RESTARTS stays 0, no back-off, nothing
    counted towards max_restarts). A node lost (missed heartbeats) restarts them."""
    from types import SimpleNamespace

    from omni_actors.actors.stage_pool import Replica, StagePoolActor
    from omni_actors.actors.supervision import RestartPolicy
    from omni_actors.messages import NodeLost, ReplicaState
    from omni_actors.placement import LEFT_REASON

    pool = StagePoolActor()
    pool._started.set()
    placed, timers = [], []
    pool.send = lambda address, message: None
    pool._place = lambda rep: placed.append(rep.replica)
    pool._publish = lambda: None
    pool._after = lambda delay, payload: timers.append((delay, payload))
    pool._restart = RestartPolicy(1.0, 30.0, 5, 300.0, 60.0)
    pool._finished_window_s = 1.0
    pool._pins, pool._orphaned, pool._exiting = {}, False, False
    pool._spec = SimpleNamespace(stage=SimpleNamespace(stage_id=1, name="talker"))
    pool._replicas = {f"talker/{i}": Replica(f"talker/{i}", f"a{i}", state=ReplicaState.READY,
                                             node=node) for i, node in enumerate(("m1", "m2"))}
    pool.receiveMsg_NodeLost(NodeLost("m1", LEFT_REASON), "coordinator")
    rep = pool._replicas["talker/0"]
    assert placed == ["talker/0"] and timers == []
    assert rep.restarts == [] and rep.address is None and rep.state not in (ReplicaState.DEAD,
                                                                           ReplicaState.FAILED)
    assert pool._replicas["talker/1"].state == ReplicaState.READY

    pool.receiveMsg_NodeLost(NodeLost("m2", "missed 3 heartbeats"), "coordinator")
    assert pool._replicas["talker/1"].state == ReplicaState.DEAD
    assert placed == ["talker/0"] and [(d, p[:2]) for d, p in timers] == [(1.0, ("restart", "talker/1"))]

    # A member that stops its actors before it leaves: the exit comes first (a restart is
    # scheduled, not yet counted), then the clean leave: placed again now, and the scheduled
    # restart finds it placed (a trial saw RESTARTS go 0 -> 1 -> 2 over two clean leaves).
    pool._replicas["talker/2"] = Replica("talker/2", "a2", state=ReplicaState.READY, node="m3")
    pool._gone(pool._replicas["talker/2"], "process exited")
    assert pool._replicas["talker/2"].state == ReplicaState.DEAD and timers[-1][1][:2] == ("restart", "talker/2")
    pool.receiveMsg_NodeLost(NodeLost("m3", LEFT_REASON), "coordinator")
    assert placed[-1] == "talker/2" and "m3 left" in pool._replicas["talker/2"].down_cause
    pool._on_timer(timers[-1][1])
    assert placed[-1] == "talker/2" and len(placed) == 2 and pool._replicas["talker/2"].restarts == []
    # the relaunched one dies too: the first death's timer does not restart it before its own
    # back-off (a code review)
    rep2 = pool._replicas["talker/2"]
    rep2.state, rep2.address = ReplicaState.READY, "a2b"
    first = timers[-1][1]
    pool._gone(rep2, "process exited")
    assert rep2.state == ReplicaState.DEAD and timers[-1][1] != first
    pool._on_timer(first)
    assert rep2.state == ReplicaState.DEAD and len(placed) == 2
    pool._on_timer(timers[-1][1])
    assert len(placed) == 3

    # still draining when its node left (its engine's exit not in yet): it says what replaced it
    pool._replicas["talker/5"] = Replica("talker/5", "a5", state=ReplicaState.DRAINING, node="m4",
                                         replaced_by="talker/6")
    pool.receiveMsg_NodeLost(NodeLost("m4", LEFT_REASON), "coordinator")
    assert pool._replicas["talker/5"].reason == "node m4 left the convention (replaced by talker/6)"


def _closing_request_actor(stages=("thinker", "talker")):
    """A RequestActor running one request whose stages (ids 0..) are all still running."""
    from types import SimpleNamespace

    from omni_actors.actors.request import RequestActor

    ra = RequestActor()
    sent, wakeups = [], []
    ra.send = lambda address, message: sent.append((address, message))
    ra.wakeupAfter = lambda delay, payload=None: wakeups.append((delay, payload))
    ra._myRef = SimpleNamespace(address="ra-address")
    plan = tuple(SimpleNamespace(stage_id=i, stage=name) for i, name in enumerate(stages))
    ra._req = SimpleNamespace(request_id="r1", plan=SimpleNamespace(stages=plan), reply_to="bridge",
                              timeout_s=60.0, queued_s=0.0)
    ra._started = time.monotonic()
    ra._pools = {i: f"pool-{name}" for i, name in enumerate(stages)}
    ra._running = {i: SimpleNamespace(attempt=0, streaming=False, emit_chunks=False) for i in range(len(stages))}
    return ra, sent, wakeups


def test_request_finished_is_a_warning_when_the_system_failed_the_request():
    """``request_finished`` is at warning level for a request the system failed (an engine
    error, no replica, a timeout, a crash) and at info for a completed one, a cancel (the
    client left) or a client's bad request (a trial's log filter on warnings missed every
    failed request: only the API server's ``http_request`` line was one)."""
    from structlog.testing import capture_logs

    from omni_actors.messages import ErrorKind

    levels = {}
    for error in (None, ErrorKind.ENGINE_ERROR, ErrorKind.UNAVAILABLE, ErrorKind.TIMEOUT, ErrorKind.CANCELLED,
                  ErrorKind.BAD_REQUEST):
        ra, _, _ = _closing_request_actor(("thinker",))
        ra._running = {}
        with capture_logs() as logs:
            ra._finish(error, "why" if error else None)
        (line,) = [e for e in logs if e["event"] == "request_finished"]
        levels[error.value if error else None] = line["log_level"]
    assert levels == {None: "info", "engine_error": "warning", "unavailable": "warning", "timeout": "warning",
                      "cancelled": "info", "bad_request": "info"}


def test_a_request_actor_stays_busy_until_its_cancelled_stages_confirm():
    """A request that ends with stages still running (here the client left) answers its
    bridge at once but says it is not free; it frees itself once every cancelled stage
    has ended, whichever message says so (a cancel, a late done or failure)."""
    from omni_actors.actors.request import CANCEL_CONFIRM, CANCEL_CONFIRM_S
    from omni_actors.messages import (CancelRequest, CancelStage, ErrorKind, RequestActorFree, RequestFinished,
                                      StageCancelled, StageFailed)

    ra, sent, wakeups = _closing_request_actor()
    ra.receiveMsg_CancelRequest(CancelRequest("r1"), "bridge")
    assert [(a, m) for a, m in sent if isinstance(m, CancelStage)] == [
        ("pool-thinker", CancelStage("r1", 0)), ("pool-talker", CancelStage("r1", 1))]
    finished = [m for _, m in sent if isinstance(m, RequestFinished)]
    assert len(finished) == 1 and finished[0].error == ErrorKind.CANCELLED and finished[0].free is False
    assert wakeups[-1] == (CANCEL_CONFIRM_S, (CANCEL_CONFIRM, "r1"))
    sent.clear()
    ra.receiveMsg_StageCancelled(StageCancelled("other", 0), "engine")  # another request's: no effect
    ra.receiveMsg_StageCancelled(StageCancelled("r1", 0), "thinker-engine")
    assert sent == []  # the talker has not ended yet
    ra.receiveMsg_StageFailed(StageFailed("r1", 1, "talker/0", ErrorKind.ENGINE_ERROR, "boom"), "talker-engine")
    assert sent == [("bridge", RequestActorFree("r1", "ra-address", True))]
    # The time limit of a request already freed does nothing.
    from thespian.actors import WakeupMessage
    sent.clear()
    ra.receiveMsg_WakeupMessage(WakeupMessage(CANCEL_CONFIRM_S, (CANCEL_CONFIRM, "r1")), "ra-address")
    assert sent == []


def test_a_request_actor_stops_waiting_for_confirmations_at_the_time_limit():
    """A stage whose engine never answers (stopped, overloaded) holds its RequestActor
    CANCEL_CONFIRM_S at most; a request that completed frees it at once."""
    from thespian.actors import WakeupMessage

    from omni_actors.actors.request import CANCEL_CONFIRM, CANCEL_CONFIRM_S
    from omni_actors.messages import CancelRequest, RequestActorFree, RequestFinished

    ra, sent, wakeups = _closing_request_actor(("thinker",))
    ra.receiveMsg_CancelRequest(CancelRequest("r1"), "bridge")
    sent.clear()
    ra.receiveMsg_WakeupMessage(WakeupMessage(CANCEL_CONFIRM_S, (CANCEL_CONFIRM, "r1")), "ra-address")
    assert sent == [("bridge", RequestActorFree("r1", "ra-address", False))]

    ra, sent, wakeups = _closing_request_actor(("thinker",))
    ra._running.clear()  # every stage done
    ra._finish(None, "")
    assert [m.free for _, m in sent if isinstance(m, RequestFinished)] == [True]
    assert wakeups == []


def test_with_the_wait_set_to_zero_a_request_actor_is_free_at_once(monkeypatch):
    """``OMNI_ACTORS_CANCEL_CONFIRM_S=0``: the RequestActor frees itself with its
    RequestFinished, as before the wait existed (benchmarks/hangups.py compares)."""
    from omni_actors.actors.request import CANCEL_CONFIRM_ENV
    from omni_actors.messages import CancelRequest, RequestFinished

    monkeypatch.setenv(CANCEL_CONFIRM_ENV, "0")
    ra, sent, wakeups = _closing_request_actor(("thinker",))
    ra.receiveMsg_CancelRequest(CancelRequest("r1"), "bridge")
    assert [m.free for _, m in sent if isinstance(m, RequestFinished)] == [True]
    assert wakeups == [] and ra._closing is None


def test_a_clients_bad_request_is_no_failed_task_of_the_replica():
    """A task failed on the client's input (a 400, e.g. a prompt over max_model_len)
    is not counted in the replica's FAILED column; an engine error is."""
    from types import SimpleNamespace

    from omni_actors.messages import TaskFinished

    pool, rep = _pool_with_one_replica()
    for rid, kw in (("bad", {"input_error": True, "client_error": True}), ("boom", {})):
        rep.in_flight[(rid, 0)] = (SimpleNamespace(request_id=rid, stage_id=0), 0.0)
        pool.receiveMsg_TaskFinished(TaskFinished("thinker/0", rid, 0, ok=False, **kw), "engine")
    assert rep.failed == 1 and rep.in_flight == {}


def test_a_failure_reported_after_its_retry_reached_the_same_replica_is_counted():
    """Trial BV: `inject raise --count 2` on the only Thinker: the request's task failed there
    twice, yet FAILED (and the circuit breaker) counted one: the retry, sent to the same
    replica, was in flight there before the first attempt's end came, which was then taken
    for a stale message and dropped. It counts, as failing before the retry was sent (the
    retry's success still resets the breaker's count)."""
    from types import SimpleNamespace

    from omni_actors.actors.supervision import ReplicaHealth
    from omni_actors.messages import ReplicaState, TaskFinished

    pool, rep = _pool_with_one_replica()
    rep.health = ReplicaHealth(last_heartbeat=0.0)
    rep.state = ReplicaState.STARTING  # (not ready: the breaker's verdict is not asked)
    pool._health = SimpleNamespace(heartbeat_interval_s=1.0)
    rep.in_flight[("r1", 0)] = (SimpleNamespace(request_id="r1", stage_id=0, attempt=1), 10.0)
    pool.receiveMsg_TaskFinished(TaskFinished("thinker/0", "r1", 0, ok=False, attempt=0), "engine")
    assert rep.failed == 1 and ("r1", 0) in rep.in_flight  # (the retry stays in flight)
    assert rep.health.consecutive_failures == 1 and rep.health.last_failure_at < 10.0
    pool.receiveMsg_TaskFinished(TaskFinished("thinker/0", "r1", 0, ok=False, attempt=1), "engine")
    assert rep.failed == 2 and rep.in_flight == {} and rep.health.consecutive_failures == 2
    rep.in_flight[("r2", 0)] = (SimpleNamespace(request_id="r2", stage_id=0, attempt=1), 20.0)
    for ok, cancelled in ((True, False), (False, True)):  # (an earlier attempt's success or cancel: not counted)
        pool.receiveMsg_TaskFinished(TaskFinished("thinker/0", "r2", 0, ok=ok, cancelled=cancelled, attempt=0),
                                     "engine")
    assert (rep.failed, rep.completed) == (2, 0)


def test_tasks_a_replica_lost_by_going_down_count_as_its_failed_tasks():
    """A replica that died, was isolated or failed with tasks in flight lost them: they
    count in its FAILED column (``omni_replica_tasks_failed_total``) and a
    ``replica_tasks_lost`` event names their requests, whether or not they are retried
    elsewhere. A drained or stopped replica's tasks, or those moved while the system
    stops, are no failure. (Trial BE: a SIGKILL under load moved no failed counter.)"""
    from types import SimpleNamespace

    import structlog
    from structlog.testing import capture_logs

    from omni_actors.messages import ReplicaState

    cases = [(ReplicaState.DEAD, True, False, 2), (ReplicaState.ISOLATED, False, False, 2),
             (ReplicaState.FAILED, False, False, 2), (ReplicaState.DRAINING, False, False, 0),
             (ReplicaState.STOPPED, False, False, 0), (ReplicaState.DEAD, True, True, 0)]
    for state, crashed, exiting, lost in cases:
        pool, rep = _pool_with_one_replica()
        pool._log = structlog.get_logger()
        pool._elsewhere = lambda *a, **k: None
        pool._exiting = exiting
        pool.send = lambda *a: None
        rep.state, rep.failed = state, 1
        for rid in ("r1", "r2"):
            rep.in_flight[(rid, 0)] = (SimpleNamespace(request_id=rid, stage_id=0, reply_to="ra", attempt=0, crashed=(),
                                                              moved=0), 0.0)
        with capture_logs() as logs:
            pool._redispatch(rep, crashed=crashed)
        assert rep.in_flight == {} and rep.failed == 1 + lost, (state, crashed, exiting)
        events = [e for e in logs if e["event"] == "replica_tasks_lost"]
        assert events == ([{"event": "replica_tasks_lost", "log_level": "warning", "replica": "thinker/0",
                            "tasks": 2, "request_ids": ["r1", "r2"]}] if lost else []), (state, events)


def _pool_with_one_replica():
    from omni_actors.actors.stage_pool import Replica, StagePoolActor

    pool = StagePoolActor()
    pool._started.set()
    pool.sent = []
    pool.send = lambda address, message: pool.sent.append((address, message))
    pool._finished_window_s = 60.0  # (set from the spec when the pool starts)
    rep = Replica("thinker/0", "engine-address")
    pool._replicas = {"thinker/0": rep}
    return pool, rep


def _coordinator_with_two_nodes():
    """A coordinator with nodes m1 and m2 and a talker pool, recording what it sends (``.sent``)."""
    from omni_actors.actors.coordinator import CoordinatorActor
    from omni_actors.placement import NodeInfo

    co = CoordinatorActor()
    co.sent = []
    co.send = lambda address, message: co.sent.append((address, message))
    co._publish_status = lambda: None
    co._pools = {1: "talker-pool"}
    for name in ("m1", "m2"):
        co._inventory.add(NodeInfo(name, ("0",), ()))
    return co


def test_a_pool_sends_new_tasks_past_replicas_whose_nodes_data_service_is_silent():
    """Trial CG froze a member's process (its data service with it): new requests kept going to
    its replicas, and each waited out the API server's 10 s fetch of their output, or failed.
    The coordinator tells the pools which nodes' data services are silent; a replica there gets
    a task only while no other is ready. It tells them again when the set changes."""
    from types import SimpleNamespace

    from omni_actors.actors.stage_pool import Replica
    from omni_actors.balancing import POLICIES
    from omni_actors.messages import DataServicesSilent, NodeHeartbeat, ReplicaState, StageTask

    pool, frozen = _pool_with_one_replica()
    pool._spec = SimpleNamespace(stage=SimpleNamespace(stage_id=1, name="talker"), supervision=SimpleNamespace(
        max_task_crashes=3, max_task_attempts=5, queue_timeout_s=0.0))
    pool._policy = POLICIES["least_loaded"]
    frozen.state, frozen.node = ReplicaState.READY, "m2"
    other = pool._replicas["thinker/1"] = Replica("thinker/1", "engine-1", state=ReplicaState.READY, node="m1")
    other.in_flight = {(f"busy{i}", 1): (None, 0.0) for i in range(5)}  # (the least loaded: the frozen node's)
    for r in (frozen, other):
        r.health = SimpleNamespace(on_dispatch=lambda *a, **k: None)

    def route(rid: str) -> str:
        pool._route(StageTask(rid, 1, "hi", (), {}, {}, "audio", False, f"ra-{rid}"))
        return pool.sent[-1][0]

    assert route("r1") == "engine-address"
    pool.receiveMsg_DataServicesSilent(DataServicesSilent(("m2",)), "coordinator")
    assert route("r2") == "engine-1"
    other.state = ReplicaState.DEAD  # (with none other ready, it still takes them)
    assert route("r3") == "engine-address"

    co = _coordinator_with_two_nodes()
    co.receiveMsg_NodeHeartbeat(NodeHeartbeat("m2", data_service_silent_s=4.0), "agent-m2")
    assert ("talker-pool", DataServicesSilent(("m2",))) in co.sent
    co.sent.clear()
    co.receiveMsg_NodeHeartbeat(NodeHeartbeat("m1"), "agent-m1")
    assert not any(isinstance(m, DataServicesSilent) for _, m in co.sent)  # (no change: nothing sent)
    co.receiveMsg_NodeHeartbeat(NodeHeartbeat("m2"), "agent-m2")
    assert ("talker-pool", DataServicesSilent(())) in co.sent


def test_replicas_end_their_fetches_from_a_data_service_said_silent(monkeypatch):
    """Trial CG: replicas reading their inputs from a frozen member each waited the fetch's
    10 s (only the API server ended its fetches when the coordinator said the member's data
    service was silent). The coordinator now names the services; a pool passes them on to its
    live replicas (and to one once ready), which end their fetches waiting on them."""
    from omni_actors.actors.engine import EngineActor
    from omni_actors.actors.stage_pool import Replica
    from omni_actors.connectors import data_client
    from omni_actors.messages import DataServicesSilent, EngineReady, NodeHeartbeat, ReplicaState

    co = _coordinator_with_two_nodes()
    co.receiveMsg_NodeHeartbeat(NodeHeartbeat("m2", data_service="127.0.0.1:7002", data_service_silent_s=4.0),
                                "agent-m2")
    silent = DataServicesSilent(("m2",), ("127.0.0.1:7002",))
    assert ("talker-pool", silent) in co.sent

    pool, ready = _pool_with_one_replica()
    ready.state = ReplicaState.READY
    dead = pool._replicas["thinker/1"] = Replica("thinker/1", "engine-1", state=ReplicaState.DEAD)
    starting = pool._replicas["thinker/2"] = Replica("thinker/2", "engine-2", state=ReplicaState.STARTING)
    pool.receiveMsg_DataServicesSilent(silent, "coordinator")
    assert [a for a, m in pool.sent if m == silent] == ["engine-address"], pool.sent
    pool.sent.clear()
    pool.receiveMsg_DataServicesSilent(silent, "coordinator")  # (no change: nothing passed on)
    assert not pool.sent
    pool._spec = None
    monkeypatch.setattr(pool, "_publish", lambda: None)
    monkeypatch.setattr(pool, "_drain_pending", lambda: None)
    pool.receiveMsg_EngineReady(EngineReady("thinker/2", pid=5, node="m1"), "engine-2")
    assert starting.state == ReplicaState.READY and ("engine-2", silent) in pool.sent, pool.sent
    assert dead.address not in [a for a, _ in pool.sent]

    calls = []
    monkeypatch.setattr(data_client, "give_up", lambda service: calls.append(("give_up", service)) or 2)
    monkeypatch.setattr(data_client, "forget_down", lambda service: calls.append(("forget_down", service)) or True)
    engine = EngineActor()
    engine._started.set()  # (ends its orphan watchdog thread)
    engine.receiveMsg_DataServicesSilent(silent, "pool")
    engine.receiveMsg_DataServicesSilent(silent, "pool")  # (once per service said silent)
    assert calls == [("give_up", "127.0.0.1:7002")]
    engine.receiveMsg_DataServicesSilent(DataServicesSilent(), "pool")
    assert calls[1:] == [("forget_down", "127.0.0.1:7002")]

    # (a review) a node lost while silent keeps its service in the set: replicas took its leaving the set
    # for "it answers again", and waited on it
    co.sent.clear()
    co._inventory.nodes["m2"].alive = False
    co.receiveMsg_NodeHeartbeat(NodeHeartbeat("m1"), "agent-m1")
    assert ("talker-pool", DataServicesSilent((), ("127.0.0.1:7002",))) in co.sent, co.sent
    # (and a pool made now hears of it: only the silent nodes were sent to a new pool; a review)
    co.sent.clear()
    co._tell_silent("new-pool")
    assert co.sent == [("new-pool", DataServicesSilent((), ("127.0.0.1:7002",)))], co.sent


def test_a_replica_fetching_from_a_service_said_silent_renews_its_mark_and_probes_it(monkeypatch):
    """A review: `give_up`'s mark runs out after 3 s; each fetch after it, the service still silent,
    waited the fetch's 10 s again. While the coordinator says it is silent, a replica's fetch
    renews the mark and asks once per mark whether it answers now (as the API server does)."""
    from types import SimpleNamespace

    from omni_actors.actors.engine import EngineActor
    from omni_actors.connectors import data_client

    calls = []
    monkeypatch.setattr(data_client, "mark_down", lambda service: calls.append(("mark_down", service)))
    monkeypatch.setattr(data_client, "probe_down", lambda service, s: calls.append(("probe_down", service)))
    engine = EngineActor()
    engine._started.set()  # (ends its orphan watchdog thread)
    engine._connector = SimpleNamespace(get=lambda ref: {"x": ref.service})
    engine._silent_services = frozenset({"10.0.0.2:7002"})
    assert engine._read_remote(SimpleNamespace(service="10.0.0.2:7002")) == {"x": "10.0.0.2:7002"}
    assert calls == [("mark_down", "10.0.0.2:7002"), ("probe_down", "10.0.0.2:7002")]
    calls.clear()
    engine._read_remote(SimpleNamespace(service="10.0.0.3:7002"))  # (not said silent: only a probe if marked)
    assert calls == [("probe_down", "10.0.0.3:7002")]

    def refused(ref):
        raise data_client.DataServiceError(f"data service {ref.service} unreachable (2 time(s) in a row); "
                                           "not tried again for 4.5 s")
    engine._connector = SimpleNamespace(get=refused)
    with pytest.raises(data_client.DataServiceError, match=r"^its data service \(10.0.0.2:7002\) does not answer: "
                                                             r"its node agent says so"):
        engine._read_remote(SimpleNamespace(service="10.0.0.2:7002"))  # (trial CN read only "unreachable")
    with pytest.raises(data_client.DataServiceError, match=r"^data service 10.0.0.3:7002 unreachable"):
        engine._read_remote(SimpleNamespace(service="10.0.0.3:7002"))


def test_a_processor_that_returns_no_dict_is_the_pipelines_fault_naming_it():
    """A processor's `[]` reached the engine, whose error was about missing fields (or a
    TypeError): it is a StageInputError (a 500 naming the processor) before the engine."""
    import asyncio
    from types import SimpleNamespace

    import pytest as _pytest

    from omni_actors.actors.engine import EngineActor
    from omni_actors.engines.base import StageInputError
    from omni_actors.messages import StageTask

    actor = EngineActor()
    actor._started.set()  # (ends its orphan watchdog thread)
    actor._spec = SimpleNamespace(stage=SimpleNamespace(custom_process_input_func="mine.to_talker"))
    actor._processor = lambda upstream, prompt, params: []
    task = StageTask("r1", 1, "hi", (), {}, {}, "audio", False, "ra")
    with _pytest.raises(StageInputError, match=r"^mine.to_talker returned list, not a dict"):
        asyncio.run(actor._process_input({0: {"text": "x"}}, task))
    actor._processor = lambda upstream, prompt, params: {"token_ids": [1]}
    assert asyncio.run(actor._process_input({0: {"text": "x"}}, task)) == {"token_ids": [1]}


def test_an_engine_that_cannot_take_what_a_processor_made_names_the_processor():
    """Trial CQ: a processor whose dict lacked a field the DiT reads gave a 500 reading only
    "dit: engine_input has no `prior_token_ids`". It names the processor too, and the log
    line of a processor's own failure says where it raised."""
    import asyncio
    from types import SimpleNamespace

    import pytest as _pytest

    from omni_actors.actors.engine import EngineActor, _raised_at
    from omni_actors.engines.base import StageInputError
    from omni_actors.messages import StageTask

    actor = EngineActor()
    actor._started.set()  # (ends its orphan watchdog thread)
    actor._spec = SimpleNamespace(stage=SimpleNamespace(custom_process_input_func="mine.to_dit"))

    async def engine_events():
        raise StageInputError("dit: engine_input has no `prior_token_ids`")
        yield  # (an async generator)

    async def drain(msg):
        async for _ in actor._naming_processor(engine_events(), msg):
            pass

    task = StageTask("r1", 1, "hi", ((0, "ref"),), {}, {}, "image", False, "ra")
    with _pytest.raises(StageInputError) as err:
        asyncio.run(drain(task))
    assert str(err.value) == ("dit: engine_input has no `prior_token_ids` (in what mine.to_dit made of the "
                              "outputs of stage(s) [0])")
    with _pytest.raises(StageInputError) as err:  # (a root stage: its input is the prompt, no processor's)
        asyncio.run(drain(StageTask("r1", 0, "hi", (), {}, {}, "image", False, "ra")))
    assert str(err.value) == "dit: engine_input has no `prior_token_ids`"
    with _pytest.raises(StageInputError) as err:  # (an edge that streams: no inputs, chunks of stage 0; trial CS)
        asyncio.run(drain(StageTask("r1", 1, "hi", (), {}, {}, "image", False, "ra", stream_source=0)))
    assert str(err.value) == ("dit: engine_input has no `prior_token_ids` (in what mine.to_dit made of the "
                              "outputs of stage(s) [0])")

    def processor():
        raise ValueError("no")
    try:
        processor()
    except ValueError as exc:
        where = _raised_at(exc)
    assert where.endswith(f"test_engine_actor_logic.py:{processor.__code__.co_firstlineno + 1} in processor"), where

    def numpy_processor():
        import numpy as np

        return np.linalg.inv(np.zeros((2, 3)))  # (raises in NumPy's Python code: the processor's line is named)
    try:
        numpy_processor()
    except ValueError as exc:
        where = _raised_at(exc)
    assert where.endswith(f":{numpy_processor.__code__.co_firstlineno + 3} in numpy_processor"), where
    assert _raised_at(None) is None


def _processor_engine(processor, timeout_s: float):
    """An EngineActor (no backend) whose user processor runs on its threads."""
    from types import SimpleNamespace

    from omni_actors.actors.engine import EngineActor
    from omni_actors.actors.processor_threads import ProcessorThreads

    actor = EngineActor()
    actor._started.set()  # (ends its orphan watchdog thread)
    actor._spec = SimpleNamespace(processor_timeout_s=timeout_s,
                                  stage=SimpleNamespace(custom_process_input_func="mine.f"))
    actor._processor, actor._processor_threads, actor._backend = processor, ProcessorThreads(), None
    return actor


def test_a_quick_processor_call_does_not_make_a_stalled_replica_look_fresh():
    """A review: time in a processor counted as work for the whole replica, and each call's
    end restarted its idle clock, so a replica stuck on one task that kept taking new ones
    was never found stalled. A processor's time is no stall only while every task is in one
    (or waits on a neighbour stage), as a parked task's is."""
    import asyncio

    from omni_actors.messages import StageTask

    from types import SimpleNamespace

    actor = _processor_engine(lambda up, p, params: {"x": 1}, 10.0)
    actor._backend, actor._ready = SimpleNamespace(load=lambda: SimpleNamespace(waiting=0)), True
    actor._tasks = {("stuck", 1): object(), ("new", 1): object()}
    actor._progress_at = time.monotonic() - 9.5  # the stuck task: 9.5 s without progress
    task = StageTask("new", 1, "hi", ((0, "r"),), {}, {}, "audio", False, "ra")
    asyncio.run(actor._process_input({0: {"t": 1}}, task))
    assert actor._idle_s() >= 9.5
    # ... while a replica whose only task is in its processor is no stall (it works), and its end
    # starts the idle clock afresh
    actor._tasks = {("new", 1): object()}
    seen = []
    actor._processor = lambda up, p, params: seen.append(actor._idle_s()) or {"x": 1}
    asyncio.run(actor._process_input({0: {"t": 1}}, task))
    assert seen == [0.0] and actor._idle_s() < 1.0


def test_a_processors_own_timeout_error_is_its_failure_not_a_wait_that_ran_out():
    """A review: a processor that raised a TimeoutError of its own (a socket's, a lock's) was
    reported as one that "did not return within 10 s", its error lost."""
    import asyncio

    from omni_actors.engines.base import StageInputError
    from omni_actors.messages import StageTask

    def processor(up, prompt, params):
        raise TimeoutError("the feature store did not answer")

    actor = _processor_engine(processor, 10.0)
    with pytest.raises(StageInputError, match="^mine.f failed on the outputs of stage.s. .0.: TimeoutError: the "
                                              "feature store did not answer$"):
        asyncio.run(actor._process_input({0: {}}, StageTask("r", 1, "hi", ((0, "r"),), {}, {}, "audio", False, "ra")))


def test_processor_threads_all_held_by_calls_that_never_return_break_the_replica(monkeypatch):
    """A review: a processor call given up on keeps its thread; with all four held, every
    later task waited its timeout in vain ("did not return") and the replica, whose failures
    are its inputs' and not its own, was never restarted. Such a task now says it did not
    start, and the replica reports itself broken (its pool restarts it): once four calls have
    not returned for hung_after_s (here the timeout itself; by default 3 timeouts, 30 s more
    than one at least: trial CR's four calls merely slower than the timeout restarted it)."""
    import asyncio
    import threading

    from omni_actors.actors import engine as engine_module
    from omni_actors.actors.processor_threads import ProcessorsBusy, hung_after_s

    assert (hung_after_s(3.0), hung_after_s(10.0), hung_after_s(60.0)) == (33.0, 40.0, 180.0)
    monkeypatch.setattr(engine_module, "hung_after_s", lambda timeout_s: 0.0)  # (every call held counts)

    from omni_actors.engines.base import StageInputError
    from omni_actors.messages import StageTask

    release = threading.Event()

    def processor(up, prompt, params):
        if up[0].get("hang"):
            release.wait(30)
        return {"ok": 1}

    actor = _processor_engine(processor, 0.3)
    task = StageTask("r", 1, "hi", ((0, "r"),), {}, {}, "audio", False, "ra")

    async def main():
        for i in range(4):
            with pytest.raises(StageInputError, match="did not return within 0.3 s"):
                await actor._process_input({0: {"hang": True}}, task)
            assert bool(actor._processors_failure) == (i == 3), (i, actor._processors_failure)
        # (not the request's fault: an engine error, retried on another replica; trial CS's innocent
        # request got a 500 that said not to retry)
        with pytest.raises(ProcessorsBusy, match=r"mine.f did not start within 0.3 s \(supervision.stall_timeout_s\): "
                                               r"all 4 processor threads of this replica are busy \(4 with calls "
                                               r"over that time, of other requests\)") as busy:
            await actor._process_input({0: {}}, task)
        assert not isinstance(busy.value, StageInputError)
    try:
        asyncio.run(main())
    finally:
        release.set()
    assert actor._processors_failure == ("all 4 of its processor threads are held by calls of mine.f that have not "
                                         "returned for 0 s")


def test_a_pool_confirms_the_cancel_of_a_task_still_in_its_queue():
    """A cancelled task that never left the pool's queue is dropped and its cancel
    confirmed to the RequestActor at once (no engine will); one in flight is passed on."""
    from omni_actors.messages import CancelStage, StageCancelled, StageTask

    pool, rep = _pool_with_one_replica()
    queued = StageTask("r1", 0, "hi", (), {}, {}, "text", False, "ra-1", attempt=1)
    running = StageTask("r2", 0, "hi", (), {}, {}, "text", False, "ra-2")
    pool._pending = [(queued, 1e12)]
    rep.in_flight[("r2", 0)] = (running, 0.0)
    pool.receiveMsg_CancelStage(CancelStage("r1", 0), "ra-1")
    pool.receiveMsg_CancelStage(CancelStage("r2", 0), "ra-2")
    assert pool._pending == []
    assert pool.sent == [("ra-1", StageCancelled("r1", 0, 1)), ("engine-address", CancelStage("r2", 0))]


def test_a_cancelled_task_of_a_replica_that_goes_is_confirmed_cancelled_not_run_elsewhere():
    """A code review: a task whose cancel was passed on to its replica stayed in that
    replica's tasks in flight; when the replica went (isolated, died) or refused the task
    before it confirmed the cancel, the task was sent to another replica, which ran the
    whole abandoned request. Now it is confirmed cancelled to its RequestActor instead; a
    new attempt of the same stage sent to that replica later is not taken for it."""
    from omni_actors.actors.stage_pool import Replica
    from omni_actors.messages import CancelStage, ReplicaState, StageCancelled, StageTask, TaskFinished

    def task(rid, attempt=0):
        return StageTask(rid, 0, "hi", (), {}, {}, "text", False, f"ra-{rid}", attempt=attempt)

    from types import SimpleNamespace

    from omni_actors.balancing import POLICIES

    pool, rep = _pool_with_one_replica()
    pool._spec = SimpleNamespace(stage=SimpleNamespace(stage_id=0, name="thinker"), supervision=SimpleNamespace(
        max_task_crashes=3, max_task_attempts=5, queue_timeout_s=0.0))
    pool._policy = POLICIES["least_loaded"]
    other = pool._replicas["thinker/1"] = Replica("thinker/1", "engine-1", state=ReplicaState.READY)
    for r in (rep, other):
        r.health = SimpleNamespace(on_dispatch=lambda *a, **k: None, went_idle=lambda *a: None,
                                   on_task_done=lambda *a, **k: None)
    rep.in_flight = {("r1", 0): (task("r1"), 0.0), ("r2", 0): (task("r2"), 0.0)}
    pool.receiveMsg_CancelStage(CancelStage("r1", 0), "ra-r1")
    pool.sent.clear()
    rep.state = ReplicaState.ISOLATED
    pool._redispatch(rep, crashed=True)
    assert ("ra-r1", StageCancelled("r1", 0, 0)) in pool.sent
    assert [m.request_id for a, m in pool.sent if a == "engine-1"] == ["r2"]  # only the one still wanted
    assert rep.failed == 1 and not rep.cancelling

    # refused (draining) after its cancel came: confirmed, not moved
    pool.sent.clear()
    other.in_flight = {("r3", 0): (task("r3"), 0.0)}
    pool.receiveMsg_CancelStage(CancelStage("r3", 0), "ra-r3")
    pool.receiveMsg_TaskFinished(TaskFinished("thinker/1", "r3", 0, ok=False, rejected=True, reason="draining"),
                                 "engine-1")
    assert pool.sent[-1] == ("ra-r3", StageCancelled("r3", 0, 0)) and not other.cancelling
    assert other.state == ReplicaState.ISOLATED  # (it drained itself: isolated all the same)
    other.state = ReplicaState.READY

    # a retry of a cancelled stage on the same replica is not taken for the cancelled one
    pool.sent.clear()
    other.in_flight = {("r4", 0): (task("r4"), 0.0)}
    pool.receiveMsg_CancelStage(CancelStage("r4", 0), "ra-r4")
    pool._route(task("r4", attempt=1))
    assert other.in_flight[("r4", 0)][0].attempt == 1 and not other.cancelling
    other.state = ReplicaState.DEAD
    rep.state = ReplicaState.READY
    pool._redispatch(other, crashed=True)
    assert [(a, m.request_id, m.attempt) for a, m in pool.sent if isinstance(m, StageTask)][-1] == \
        ("engine-address", "r4", 2)


def test_a_request_ended_while_a_stage_done_waits_for_its_last_chunks_releases_its_outputs(monkeypatch):
    """A streaming producer's StageDone that overtook its last chunks waits in the
    RequestActor; if the request ends then (the client left), its output and final
    refs are released with the rest. They used to be dropped unreleased: a segment
    left in use for ever (a rare leak seen in the no-segment-left tests)."""
    from omni_actors.actors import request as request_module
    from omni_actors.connectors import ConnectorRef
    from omni_actors.messages import CancelRequest, StageDone

    released = []
    monkeypatch.setattr(request_module, "release_all",
                        lambda refs, recycle=False, wait=True: released.extend(r for r in refs if r is not None))
    ra, sent, wakeups = _closing_request_actor(("thinker", "talker"))
    ra._running[0].emit_chunks = ra._running[0].streaming = True
    output = ConnectorRef(kind="shm", size=8, layout=(), location="oa-1-output")
    final = ConnectorRef(kind="shm", size=8, layout=(), location="oa-1-final")
    ra._chunks[0] = []
    ra.receiveMsg_StageDone(StageDone("r1", 0, "thinker/0", output, final, chunks=3), "thinker-engine")
    assert ra._done_waiting and released == []  # waits for its 3 chunks
    ra.receiveMsg_CancelRequest(CancelRequest("r1"), "bridge")
    assert output in released and final in released


def test_a_late_heartbeat_cannot_bring_back_a_node_that_left():
    """A member's node agent sends its last heartbeat, then its leave notice; the heartbeat
    can arrive second. The node stays LEFT (CI once saw it marked back, then lost for missed
    heartbeats); a member that really comes back rejoins the convention instead. A node that
    was lost (missed heartbeats) is still back on its next heartbeat."""
    from omni_actors.actors.coordinator import CoordinatorActor
    from omni_actors.messages import NodeHeartbeat, NodeHeartbeatAck, NodeLeaving
    from omni_actors.placement import LEFT_REASON, NodeInfo

    coord = CoordinatorActor()
    coord.sent = []
    coord.send = lambda address, message: coord.sent.append((address, message))
    coord._inventory.add(NodeInfo("m1", ("0",), ()))
    coord._inventory.add(NodeInfo("m2", ("0",), ()))
    coord.receiveMsg_NodeLeaving(NodeLeaving("m1"), "agent-m1")
    coord.receiveMsg_NodeHeartbeat(NodeHeartbeat("m1"), "agent-m1")
    m1 = coord._inventory.nodes["m1"]
    assert (m1.alive, m1.down_reason) == (False, LEFT_REASON)
    assert ("agent-m1", NodeHeartbeatAck()) in coord.sent  # (answered all the same)
    coord._lose_node("m2", "missed 3 node heartbeats")
    coord.receiveMsg_NodeHeartbeat(NodeHeartbeat("m2"), "agent-m2")
    assert coord._inventory.nodes["m2"].alive


def test_after_a_host_loss_the_stage_left_with_no_replica_is_placed_before_a_second_one_of_another():
    """Trial K: a host with a Talker and the only Code2Wav was lost; the Talker pool's
    re-placement came first and took the last free device, and every audio request got
    a 503. The coordinator now keeps that device for Code2Wav (its pool's last report
    still shows it ready, on the lost node), whichever request comes first; the Talker's
    replacement waits, and gets the next device to come free."""
    from types import SimpleNamespace

    from omni_actors.actors.coordinator import CoordinatorActor
    from omni_actors.messages import (NodesChanged, PlaceReplica, Placement, PlacementFailed, PoolState,
                                      ReplicaState, ReplicaStatus)
    from omni_actors.placement import NodeInfo

    co = CoordinatorActor()
    co.sent = []
    co.send = lambda address, message: co.sent.append((address, message))
    co._inventory.add(NodeInfo("m1", ("0", "1", "2"), ()))
    co._inventory.add(NodeInfo("m2", ("0", "1"), ()))
    ready = ReplicaState.READY
    placed = {"thinker/0": "m1", "talker/0": "m1", "talker/1": "m2", "code2wav/0": "m2"}
    for replica, node in placed.items():
        co._inventory.place(replica.split("/")[0], replica, 1, (node,))
    co._config = SimpleNamespace(stage_by_name=lambda name: name,  # every stage: TP1, any node
                                 deployment_of=lambda stage: SimpleNamespace(devices_per_replica=1, nodes=[]))
    for sid, stage in enumerate(("thinker", "talker", "code2wav")):
        co._states[sid] = PoolState(sid, stage, tuple(ReplicaStatus(r, ready, node=n)
                                                      for r, n in placed.items() if r.startswith(stage)))
    co._inventory.lose("m2", "missed 3 node heartbeats")
    co.receiveMsg_PlaceReplica(PlaceReplica("talker", "talker/2", 1, (), ()), "talker-pool")
    refused = co.sent[-1][1]
    assert isinstance(refused, PlacementFailed) and refused.replica == "talker/2"
    assert "kept for stage code2wav, which has no replica running" in refused.reason
    co.receiveMsg_PlaceReplica(PlaceReplica("code2wav", "code2wav/1", 1, (), ()), "code2wav-pool")
    assert co.sent[-2:] == [("code2wav-pool", Placement("code2wav/1", "m1", ("2",))),
                            ("talker-pool", NodesChanged())]  # (it retries: no longer kept for code2wav)
    co._inventory.add(NodeInfo("m3", ("0",), ()))  # a device comes free: the Talker takes it
    co.receiveMsg_PlaceReplica(PlaceReplica("talker", "talker/2", 1, (), ()), "talker-pool")
    assert co.sent[-1] == ("talker-pool", Placement("talker/2", "m3", ("0",)))


def test_admin_requests_to_a_coordinator_without_its_config_say_it_is_being_redeployed():
    """Trial S: right after `inject kill-coordinator`, `stage scale --stage talker` said
    "no stage named 'talker'" and `status` printed an empty table with "model : NOT READY"."""
    import io

    from omni_actors.actors.coordinator import CoordinatorActor
    from omni_actors.messages import (NOT_DEPLOYED, AdminReply, DrainReplica, FaultKind, InjectFault,
                                      LaunchReplicas, ScaleStage)
    from omni_actors.system.leader import print_status_table

    co = CoordinatorActor()
    co.sent = []
    co.send = lambda address, message: co.sent.append((address, message))
    co.receiveMsg_ScaleStage(ScaleStage("talker", 2), "cli")
    co.receiveMsg_DrainReplica(DrainReplica("talker/1"), "cli")
    co.receiveMsg_InjectFault(InjectFault("talker/0", FaultKind.STALL), "cli")
    co.receiveMsg_LaunchReplicas(LaunchReplicas("talker", 1), "cli")
    assert co.sent == [("cli", AdminReply(False, NOT_DEPLOYED))] * 4
    out = io.StringIO()
    print_status_table(co._status("q"), out)
    assert out.getvalue().splitlines()[-1] == f"NOT READY: {NOT_DEPLOYED}"


def test_admin_requests_for_a_stopped_replica_its_pool_forgot_and_a_drain_of_the_only_node():
    """Trial BF: a replica `status` listed as stopped, unknown to the pool made after its own
    was replaced, read "no replica named" to `stage drain` and "no live replica" to `inject`;
    now both say it is stopped, without asking the pool. And `node drain` of the only node
    said its replicas were "each replaced on another node" where there was none."""
    from types import SimpleNamespace

    from omni_actors.actors.coordinator import CoordinatorActor
    from omni_actors.messages import (AdminReply, DrainNode, DrainReplica, FaultKind, InjectFault, PoolState,
                                      ReplicaState, ReplicaStatus)
    from omni_actors.placement import NodeInfo

    co = CoordinatorActor()
    co.sent = []
    co.send = lambda address, message: co.sent.append((address, message))
    co._config = SimpleNamespace(stage_args=[SimpleNamespace(name="talker", stage_id=1)])
    co._pools[1] = "talker-pool"
    co._states[1] = PoolState(1, "talker", (ReplicaStatus("talker/0", ReplicaState.STOPPED),
                                            ReplicaStatus("talker/1", ReplicaState.READY)))
    co.receiveMsg_DrainReplica(DrainReplica("talker/0"), "cli")
    co.receiveMsg_InjectFault(InjectFault("talker/0", FaultKind.STALL), "cli")
    assert co.sent == [("cli", AdminReply(False, "talker/0 is stopped, not ready or starting: nothing to drain")),
                       ("cli", AdminReply(False, "talker/0 is stopped, not running (see `status`)"))]
    co.sent.clear()
    co.receiveMsg_DrainReplica(DrainReplica("talker/1"), "cli")  # a live one: its pool answers
    assert co.sent == [("talker-pool", DrainReplica("talker/1", reply_to="cli"))]

    co.sent.clear()
    co._config = None  # (nothing to publish)
    co._inventory.add(NodeInfo("vm", ("0",), ()))
    co.receiveMsg_DrainNode(DrainNode("vm", operator=True), "cli")
    reply = co.sent[-1][1].message
    assert "no other node takes replicas" in reply and "each replaced" not in reply, reply
    co._inventory.undrain("vm")
    co._inventory.add(NodeInfo("m2", ("0",), ()))
    co.receiveMsg_DrainNode(DrainNode("vm", operator=True), "cli")
    assert "each replaced on another node where one has room" in co.sent[-1][1].message


def test_a_recreated_coordinator_sends_its_routes_to_the_api_servers_of_the_one_before():
    """Trial BF: for 1.8 s after `inject kill-coordinator` the API server kept sending new
    requests to the old, exiting pools (it learned the new ones at its next subscription
    renewal), and their streams failed part-way. The leader's watchdog hands the API
    servers subscribed before (and the drained nodes) to the new coordinator, which sends
    them its routes at once."""
    import itertools

    from conftest import CONFIGS

    from omni_actors.actors.coordinator import CoordinatorActor
    from omni_actors.config import load_config
    from omni_actors.messages import WATCHDOG_QUERY, Deploy, NodeInfo, Routes, Subscribe

    def coordinator():
        co = CoordinatorActor()
        co.sent, names = [], itertools.count()
        co.send = lambda address, message: co.sent.append((address, message))
        co.createActor = lambda cls, **kw: f"actor-{next(names)}"
        co.wakeupAfter = lambda delay, payload=None: None
        co.notifyOnSystemRegistrationChanges = lambda on: None
        return co

    config = load_config(CONFIGS / "cpu_omni_demo.yaml")
    old = coordinator()
    old.receiveMsg_Deploy(Deploy(config, NodeInfo("vm")), "leader")
    old.receiveMsg_Subscribe(Subscribe("api-1"), "api-1")
    last = old._status(WATCHDOG_QUERY)
    assert last.subscribers == ("api-1",) and old._status("cli").subscribers == ()
    new = coordinator()
    new.receiveMsg_Deploy(Deploy(config, NodeInfo("vm"), previous=last.stages, subscribers=last.subscribers),
                          "leader")
    routes = [m for a, m in new.sent if a == "api-1" and isinstance(m, Routes)]
    assert routes and set(routes[-1].pools.values()) == set(new._pools.values()), new.sent
    # its first pools replace ones not seen to die: their tasks in flight are waited for
    assert routes[-1].inherited == frozenset(new._pools) and old._routes().inherited == frozenset()


def test_a_stage_whose_pool_was_given_up_ends_its_requests_at_once(monkeypatch):
    """A code review: a pool that exited past its restart budget is tried again only after
    failed_retry_s (300 s), and a RequestActor with a task there, or one still to send
    there, waited for its deadline: no new routes came. They end at once with a 503 now."""
    from omni_actors.messages import (CancelStage, ErrorKind, PlannedStage, RequestFinished, Routes, RoutesChanged,
                                      StageDone, StageTask)

    why = "stage pool exited; gave up after 6 restarts in 60 s; next try in 300 s"
    stages = (PlannedStage(0, "thinker", (), "pool-thinker", "text", False),
              PlannedStage(1, "talker", (0,), "pool-talker", None, False),
              PlannedStage(2, "code2wav", (1,), "pool-code2wav", "audio", False))
    pools = {0: "pool-thinker", 1: "pool-talker", 2: "pool-code2wav"}
    ra, sent = _running_request_actor(monkeypatch, stages)
    assert [m.stage_id for _, m in sent if isinstance(m, StageTask)] == [0]
    ra.receiveMsg_RoutesChanged(RoutesChanged(Routes(None, pools, 1, given_up=((0, why),))), "bridge")
    (_, done), = [(a, m) for a, m in sent if isinstance(m, RequestFinished)]
    assert done.error == ErrorKind.UNAVAILABLE and done.message == f"stage thinker: {why}"

    # its task is still to be sent there: it ends at once too, its running Thinker cancelled
    ra, sent = _running_request_actor(monkeypatch, stages)
    ra.receiveMsg_RoutesChanged(RoutesChanged(Routes(None, pools, 1, given_up=((1, why),))), "bridge")
    (_, done), = [(a, m) for a, m in sent if isinstance(m, RequestFinished)]
    assert done.error == ErrorKind.UNAVAILABLE and done.message == f"stage talker: {why}"
    assert [(a, m.stage_id) for a, m in sent if isinstance(m, CancelStage)] == [("pool-thinker", 0)]

    # given up, then started again (a `stage launch`) before its turn: it goes to the new pool
    ra, sent = _running_request_actor(monkeypatch, stages)
    ra.receiveMsg_RoutesChanged(RoutesChanged(Routes(None, {**pools, 1: "pool-talker-2"}, 2)), "bridge")
    ra.receiveMsg_StageDone(StageDone("r1", 0, "thinker/0", output=None, final=None), "thinker-engine")
    assert [a for a, m in sent if isinstance(m, StageTask) and m.stage_id == 1] == ["pool-talker-2"]
    assert not [m for _, m in sent if isinstance(m, RequestFinished)]


def test_a_task_on_a_lost_coordinators_pool_is_waited_for_not_run_again():
    """Trial BG: every stream in flight when its API server switched to a recreated
    coordinator's pools failed (`the pool of stage thinker was replaced`), though the old
    pools drain and finish their tasks. A task on a pool the new routes mark inherited is
    waited for (``INHERITED_WAIT_S``, then treated as lost); a pool replaced because it died
    (not inherited) still has its task run again at once."""
    from types import SimpleNamespace

    from omni_actors.actors.request import INHERITED, INHERITED_WAIT_S
    from omni_actors.messages import CancelRequest, Routes, RoutesChanged, StageTask
    from thespian.actors import WakeupMessage

    def request_actor():
        ra, sent, wakeups = _closing_request_actor(("thinker",))
        ra._plan = {0: SimpleNamespace(stage="thinker")}
        ra._running = {0: StageTask("r1", 0, "hi", (), {}, {}, "text", False, "ra-address", attempt=0)}
        ra._pools = {0: "old-pool"}
        ra._left = lambda: 30.0
        return ra, sent, wakeups

    routes = Routes(None, {0: "new-pool"}, 0, inherited=frozenset({0}))
    ra, sent, wakeups = request_actor()
    ra.receiveMsg_RoutesChanged(RoutesChanged(routes), "bridge")
    assert sent == [] and ra._pools == {0: "new-pool"}  # waited for; what comes next goes to the new pool
    assert wakeups == [(INHERITED_WAIT_S, (INHERITED, "r1", 0, 0))]
    ra.receiveMsg_WakeupMessage(WakeupMessage(INHERITED_WAIT_S, wakeups[0][1]), "ra-address")
    # not finished there in time: stopped there (a code review: it ran on; every attempt: that pool may
    # have moved it on its own, as attempt 1, a review) and run again
    assert [(a, type(m).__name__, m.attempt) for a, m in sent] == [("old-pool", "CancelStage", None),
                                                                   ("new-pool", "StageTask", 1)]

    ra, sent, wakeups = request_actor()  # a second coordinator lost meanwhile: the task is still on the first's
    ra.receiveMsg_RoutesChanged(RoutesChanged(routes), "bridge")
    ra.receiveMsg_RoutesChanged(RoutesChanged(Routes(None, {0: "newer-pool"}, 0, inherited=frozenset({0}))), "bridge")
    assert ra._left_on == {0: "old-pool"} and ra._pools == {0: "newer-pool"}

    ra, sent, wakeups = request_actor()  # the client leaves meanwhile: the cancel goes where the task runs
    ra.receiveMsg_RoutesChanged(RoutesChanged(routes), "bridge")
    ra._confirm_s = 0  # (not waiting for the confirmation here)
    ra.receiveMsg_CancelRequest(CancelRequest("r1"), "bridge")
    assert [(a, type(m).__name__) for a, m in sent][:1] == [("old-pool", "CancelStage")], sent

    ra, sent, wakeups = request_actor()  # finished meanwhile: the wake-up changes nothing
    ra.receiveMsg_RoutesChanged(RoutesChanged(routes), "bridge")
    ra._running = {}
    ra.receiveMsg_WakeupMessage(WakeupMessage(INHERITED_WAIT_S, wakeups[0][1]), "ra-address")
    assert sent == []

    ra, sent, wakeups = request_actor()  # a pool that died: run again at once
    ra.receiveMsg_RoutesChanged(RoutesChanged(dataclasses.replace(routes, inherited=frozenset())), "bridge")
    assert [(a, m.attempt, m.moved) for a, m in sent] == [("new-pool", 1, 1)] and wakeups == []


def test_a_pool_that_exits_keeps_its_replicas_counts_and_only_those_that_ran_restart():
    """Trial W: right after `kill-pool` every replica read `dead` with DONE and RESTARTS 0 (a
    pending one too), and the new pool's replica that had only waited for placement said
    "restarted ...; it was down: its stage pool was lost and recreated"."""
    from types import SimpleNamespace

    from thespian.actors import ChildActorExited

    from omni_actors.actors.coordinator import CoordinatorActor
    from omni_actors.messages import PoolState, ReplicaState, ReplicaStatus

    co = CoordinatorActor()
    co.sent, co.wakeups = [], []
    co.send = lambda address, message: co.sent.append((address, message))
    co.wakeupAfter = lambda delay, payload=None: co.wakeups.append((delay, payload))
    co._publish_status = lambda: None
    co._config = SimpleNamespace(deployment=SimpleNamespace(supervision=SimpleNamespace()))
    co._restart = SimpleNamespace(next_delay=lambda restarts, now: 1.0)
    co._pools, co._pool_restarts = {1: "pool-1"}, {1: []}
    report = PoolState(1, "code2wav", (ReplicaStatus("code2wav/0", ReplicaState.READY, completed=60, restarts=2,
                                                     pid=11, node="m2"),
                                       ReplicaStatus("code2wav/1", ReplicaState.PENDING, reason="no room")))
    co._states[1] = co._reported[1] = report
    co.receiveMsg_ChildActorExited(ChildActorExited("pool-1"), None)
    rows = {r.replica: r for r in co._states[1].replicas}
    assert (rows["code2wav/0"].state, rows["code2wav/0"].completed, rows["code2wav/0"].restarts,
            rows["code2wav/0"].pid) == (ReplicaState.DEAD, 60, 2, None)
    assert rows["code2wav/1"].state == ReplicaState.PENDING and rows["code2wav/1"].reason == "stage pool exited"
    assert [(rid, ran) for rid, *_, ran, _was_on in co._layout(1)] == [("code2wav/0", True), ("code2wav/1", False)]


def test_a_busy_request_actor_tells_its_bridge_it_is_alive_until_it_is_free():
    """A busy RequestActor tells its bridge every alive_every_s that it still runs its
    request (silence means its process is gone), while it runs the request and while it
    waits for its stages' cancels; once free it stops."""
    from omni_actors.actors.request import ALIVE_BEAT
    from omni_actors.messages import CancelRequest, RequestActorAlive, StageCancelled

    ra, sent, wakeups = _closing_request_actor()
    ra._req.alive_every_s = 0.75
    ra._alive_beats.start(ra, 0.75)
    ra._beat()
    assert sent == [("bridge", RequestActorAlive("r1"))]
    assert [w for w in wakeups if w[1][0] == ALIVE_BEAT] == [(0.75, (ALIVE_BEAT, 1))] * 2
    ra.receiveMsg_CancelRequest(CancelRequest("r1"), "bridge")  # over; its stages still cancelling
    sent.clear()
    ra._beat()
    assert sent == [("bridge", RequestActorAlive("r1"))]
    ra.receiveMsg_StageCancelled(StageCancelled("r1", 0, 0), "engine")
    ra.receiveMsg_StageCancelled(StageCancelled("r1", 1, 0), "engine")  # free now
    sent.clear()
    wakeups.clear()
    ra._beat()
    assert sent == [] and wakeups == []


def _coordinator_taking_members():
    """A CoordinatorActor whose sends are recorded (``.sent``) and whose node agents are made
    at ``agent-address``, with the config figures a member's join reads."""
    from types import SimpleNamespace

    from omni_actors.actors.coordinator import CoordinatorActor

    coord = CoordinatorActor()
    coord.sent = []
    coord.send = lambda address, message: coord.sent.append((address, message))
    coord.createActor = lambda cls, **kw: "agent-address"
    coord._publish_status = lambda: None
    coord._config = SimpleNamespace(deployment=SimpleNamespace(heartbeat_interval_s=0.5, request_timeout_s=60))
    return coord


def test_a_member_reported_joining_takes_work_only_once_its_node_agent_answers():
    """Thespian reported a member that had just stopped as joining again, 9 s after it
    left (CI; nobody was there): it was alive at once, then lost for missed heartbeats.
    Now a joining member is alive from its new agent's first heartbeat; heartbeats of
    an earlier join's agent do not count."""
    from thespian.actors import ActorSystemConventionUpdate

    from omni_actors.messages import NodeHeartbeat, NodeLeaving, StartNodeAgent
    from omni_actors.placement import LEFT_REASON

    coord = _coordinator_taking_members()
    caps = {"omni_node": "m1", "omni_devices": "0,1"}
    coord.receiveMsg_ActorSystemConventionUpdate(ActorSystemConventionUpdate("admin-m1", caps, True), None)
    assert "m1" not in coord._inventory.nodes  # not until its agent answers
    start = next(m for _, m in coord.sent if isinstance(m, StartNodeAgent))
    coord.receiveMsg_NodeHeartbeat(NodeHeartbeat("m1", join=start.join), "agent-address")
    assert coord._inventory.nodes["m1"].alive and coord._inventory.nodes["m1"].info.devices == ("0", "1")
    coord.receiveMsg_NodeLeaving(NodeLeaving("m1"), "agent-address")
    coord.receiveMsg_ActorSystemConventionUpdate(ActorSystemConventionUpdate("admin-m1", caps, True), None)
    coord.receiveMsg_NodeHeartbeat(NodeHeartbeat("m1", join=start.join), "agent-address")  # (the old agent's)
    m1 = coord._inventory.nodes["m1"]
    assert (m1.alive, m1.down_reason) == (False, LEFT_REASON)
    coord.receiveMsg_NodeHeartbeat(NodeHeartbeat("m1", join=start.join + 1), "agent-address")
    assert coord._inventory.nodes["m1"].alive


def _pool_routing(replicas: dict[str, str]):
    """A pool with READY replicas (name -> node) that routes for real (least-loaded,
    the default supervision figures of config.py: 3 attempts, 2 crashes)."""
    from types import SimpleNamespace

    from omni_actors.actors.stage_pool import Replica, StagePoolActor
    from omni_actors.actors.supervision import HealthPolicy, ReplicaHealth, RestartPolicy
    from omni_actors.balancing import POLICIES
    from omni_actors.config import Supervision
    from omni_actors.messages import ReplicaState

    pool = StagePoolActor()
    pool._started.set()
    pool.sent = []
    pool.send = lambda address, message: pool.sent.append((address, message))
    pool._place = lambda rep: None
    pool._publish = lambda: None
    pool._after = lambda delay, payload: None
    pool._restart = RestartPolicy(1.0, 30.0, 5, 300.0, 60.0)
    pool._health = HealthPolicy(1.0, 3, 10.0, 5)
    pool._policy = POLICIES["least_loaded"]
    pool._finished_window_s = 1.0
    pool._pins, pool._orphaned, pool._exiting, pool._pending = {}, False, False, []
    pool._spec = SimpleNamespace(stage=SimpleNamespace(stage_id=1, name="talker"), supervision=Supervision())
    pool._replicas = {name: Replica(name, f"addr-{name}", state=ReplicaState.READY, node=node,
                                    health=ReplicaHealth(0.0)) for name, node in replicas.items()}
    return pool


def test_a_task_moved_off_replicas_of_a_lost_host_is_not_out_of_attempts():
    """A member host SIGKILLed under a 1:N:M pipeline: its replicas go one by one (missed
    heartbeats, then the node declared lost) before the pool knows the host is gone, and a
    task can land on each of them. Those moves are not the task's fault: it still runs on
    the surviving replica (a trial saw 'gave up after 3 attempts' 503s, about 1 in 50)."""
    from omni_actors.messages import NodeLost, StageFailed, StageTask

    pool = _pool_routing({"talker/0": "m1", "talker/1": "m2", "talker/2": "m2", "talker/3": "m2"})
    for name in ("talker/0",):
        pool._replicas[name].in_flight = {(f"busy{i}", 1): (None, 0.0) for i in range(3)}  # m1 is busy
    pool.receiveMsg_StageTask(StageTask("r1", 1, "hi", (), {}, {}, "audio", False, "ra-1"), "ra-1")
    for step in range(3):  # m2's replicas fall silent one after another, the node last
        (where, task), = [(a, m) for a, m in pool.sent if isinstance(m, StageTask)][-1:]
        rep = next(r for r in pool._replicas.values() if r.address == where)
        assert rep.node == "m2", f"step {step}: sent to {rep.replica}"
        if step < 2:
            pool._isolate(rep, "missed 3 heartbeats (silent 3.1 s)", crashed=False)
        else:
            pool.receiveMsg_NodeLost(NodeLost("m2", "missed 3 heartbeats"), "coordinator")
    failed = [m for _, m in pool.sent if isinstance(m, StageFailed)]
    assert failed == []
    where, task = pool.sent[-1]
    assert where == "addr-talker/0" and task.attempt == 3 and task.moved == 3


def test_a_pools_own_503_for_a_stage_with_none_on_its_way_tells_clients_not_to_retry():
    """The API server refuses up front a request whose stage has no replica ready and none
    on its way, with ``x-should-retry: false``; a request that got past it (its view of the
    stages a moment old) was refused by the pool with a 503 that left OpenAI's clients to
    retry twice for the same answer (a session's note). The pool's refusal says none is
    coming, the RequestActor and the API server pass it on; with a replica starting (and
    ``queue_timeout_s: 0``, so no wait) the client may retry."""
    from omni_actors.actors.request import RequestActor
    from omni_actors.http.app import _failed
    from omni_actors.http.bridge import ActorBridge
    from types import SimpleNamespace

    from omni_actors.messages import ErrorKind, ReplicaState, RequestFinished, StageFailed, StageTask

    headers = {}
    for starting in (False, True):
        pool = _pool_routing({"talker/0": "m1", "talker/1": "m1"})
        pool._replicas["talker/0"].state = ReplicaState.STOPPED
        pool._replicas["talker/1"].state = ReplicaState.STARTING if starting else ReplicaState.FAILED
        pool._spec.supervision.queue_timeout_s = 0.0
        pool.receiveMsg_StageTask(StageTask("r1", 1, "hi", (), {}, {}, "audio", False, "ra-1"), "ra-1")
        (to_ra, refused), = pool.sent
        assert to_ra == "ra-1" and isinstance(refused, StageFailed) and refused.kind == ErrorKind.UNAVAILABLE
        assert refused.none_coming is not starting, refused

        ra, sent, _ = _closing_request_actor(stages=("thinker", "talker"))
        ra._req.max_attempts = 3
        del ra._running[0]
        ra._running[1] = SimpleNamespace(attempt=0, streaming=False, stream_source=None, moved=0, exclude=(),
                                         crashed=(), emit_chunks=False)
        RequestActor.receiveMsg_StageFailed(ra, refused, "pool-talker")
        (finished,) = [m for _, m in sent if isinstance(m, RequestFinished)]
        assert finished.error == ErrorKind.UNAVAILABLE and finished.none_coming is not starting

        bridge = ActorBridge(asys=None, coordinator=None)
        delivered = []
        bridge._deliver = lambda rid, event: delivered.append(event)
        bridge._end(finished)
        (event,) = delivered
        assert event.status == 503 and event.message.startswith("no ready replica of stage talker"), event
        headers[starting] = _failed(event).headers or {}
    assert headers[False].get("x-should-retry") == "false"
    assert "x-should-retry" not in headers[True]


def test_replicas_that_crash_under_a_task_still_use_up_its_attempts():
    """What the moves do not cover: replicas that die running the task (it may be what
    kills them) fail it after supervision.max_task_crashes (2), and a pool that keeps
    refusing it fails it after MAX_TASK_MOVES moves instead of passing it on until its
    deadline."""
    from omni_actors.messages import MAX_TASK_MOVES, ErrorKind, StageFailed, StageTask, TaskFinished

    pool = _pool_routing({"talker/0": "m1", "talker/1": "m1", "talker/2": "m1"})
    pool.receiveMsg_StageTask(StageTask("r1", 1, "hi", (), {}, {}, "audio", False, "ra-1"), "ra-1")
    for _ in range(2):
        where, _task = pool.sent[-1]
        rep = next(r for r in pool._replicas.values() if r.address == where)
        pool._gone(rep, "process exited")  # crashed while running it
    failed = pool.sent[-1][1]
    assert isinstance(failed, StageFailed) and failed.kind == ErrorKind.CRASHED

    pool = _pool_routing({"talker/0": "m1", "talker/1": "m1"})
    pool.receiveMsg_StageTask(StageTask("r2", 1, "hi", (), {}, {}, "audio", False, "ra-2"), "ra-2")
    for _ in range(MAX_TASK_MOVES + 1):
        where, task = pool.sent[-1]
        if isinstance(task, StageFailed):
            break
        name = next(r.replica for r in pool._replicas.values() if r.address == where)
        pool.receiveMsg_TaskFinished(TaskFinished(name, "r2", 1, ok=False, rejected=True, reason="not ready"),
                                     where)
    failed = pool.sent[-1][1]
    assert isinstance(failed, StageFailed) and failed.kind == ErrorKind.UNAVAILABLE
    assert f"{MAX_TASK_MOVES + 1} moves" in failed.message and failed.moved == MAX_TASK_MOVES + 1


def test_a_request_actor_ends_its_request_and_frees_itself_when_those_wakeups_are_lost():
    """Thespian drops wake-ups that fall due while an actor drains a long transmit queue.
    A RequestActor whose deadline wake-up was lost would have held its request (and its
    slot in the API server) until its stages ended; one whose cancel-confirmation wake-up
    was lost, for good. Its alive beat now runs both, WAKEUP_LOST_AFTER_S late at most."""
    import time as _time

    from omni_actors.actors.request import CANCEL_CONFIRM_S
    from omni_actors.actors.supervision import WAKEUP_LOST_AFTER_S
    from omni_actors.messages import CancelStage, ErrorKind, RequestActorFree, RequestFinished

    ra, sent, wakeups = _closing_request_actor(("thinker",))
    ra._req.timeout_s, ra._req.alive_every_s = 3.0, 1.0
    ra._started = _time.monotonic() - 3.0 - WAKEUP_LOST_AFTER_S / 2
    ra._beat()  # late, not yet lost: the wake-up may still come
    assert [m for _, m in sent if isinstance(m, RequestFinished)] == []
    ra._started -= WAKEUP_LOST_AFTER_S
    ra._beat()
    finished = [m for _, m in sent if isinstance(m, RequestFinished)]
    assert len(finished) == 1 and finished[0].error == ErrorKind.TIMEOUT
    assert "request deadline of 3 s passed" in finished[0].message and finished[0].free is False
    assert ("pool-thinker", CancelStage("r1", 0)) in sent
    sent.clear()
    ra._beat()  # the stage never confirms its cancel, and that wake-up is lost too
    assert not any(isinstance(m, RequestActorFree) for _, m in sent)
    ra._closing_since -= CANCEL_CONFIRM_S + WAKEUP_LOST_AFTER_S + 0.1
    ra._beat()
    assert ("bridge", RequestActorFree("r1", "ra-address", False)) in sent
    assert ra._closing is None and ra._req is None


def test_a_coordinator_that_did_not_run_for_a_while_does_not_lose_its_member_nodes():
    """A code review: a coordinator stopped (SIGSTOP, starved) for more than three heartbeat
    intervals took every member node for lost at its first check, before the heartbeats
    waiting in its queue: their replicas were killed and placed again. The time its check
    ran late is not the nodes' silence, as for its pools; a node silent on top of it is lost."""
    import time as _time
    from types import SimpleNamespace

    from omni_actors.actors.coordinator import CoordinatorActor
    from omni_actors.messages import NodeInfo

    co = CoordinatorActor()
    lost = []
    co.send = lambda address, message: None
    co._lose_node = lambda name, reason: lost.append(name)
    co._config = SimpleNamespace(deployment=SimpleNamespace(heartbeat_interval_s=1.0))
    co._leader_node = "leader"
    for name in ("leader", "m1", "m2"):
        co._inventory.add(NodeInfo(name))
    now = _time.monotonic()
    co._last_node_check = now - 6.0  # (stopped for 5 s past its interval)
    co._inventory.nodes["m1"].last_seen = now - 6.2  # heard just before the pause
    co._inventory.nodes["m2"].last_seen = now - 10.0  # silent for 4 s before it too
    co._check_nodes()
    assert lost == ["m2"]


def _coordinator_with_leader():
    """A CoordinatorActor with the leader's node, a 1 s heartbeat interval and its sends and
    node agents recorded: ``(coordinator, the createActor calls)``; ``coordinator.sent``."""
    from types import SimpleNamespace

    from omni_actors.actors.coordinator import CoordinatorActor
    from omni_actors.messages import NodeInfo

    co = CoordinatorActor()
    co.sent, made = [], []
    co.send = lambda address, message: co.sent.append((address, message))
    co.createActor = lambda cls, **kw: made.append(kw) or f"agent-{len(made)}"
    co.wakeupAfter = lambda *a, **kw: None
    co._publish_status = lambda: None
    co._config = SimpleNamespace(deployment=SimpleNamespace(heartbeat_interval_s=1.0, request_timeout_s=60))
    co._leader_node = "leader"
    co._inventory.add(NodeInfo("leader"))
    return co, made


def test_a_node_back_through_its_old_agent_keeps_its_placements_when_its_member_is_announced_again():
    """Trial BO: a member frozen for 30 s was lost, came back through its old agent (its
    devices free again: its replicas had been told to exit) and had a replica placed on
    device 1; Thespian then announced the member again, its new agent's first heartbeat
    added the node anew, all its devices free, and a second replica was placed on device 1
    (killing the first as the holder of its lease)."""
    import time as _time

    from thespian.actors import ActorSystemConventionUpdate

    from omni_actors.messages import NodeHeartbeat

    co, made = _coordinator_with_leader()
    caps = {"omni_node": "m1", "omni_devices": "0,1", "omni_member": "a"}
    co.receiveMsg_ActorSystemConventionUpdate(ActorSystemConventionUpdate("admin-m1", caps, True), None)
    co.receiveMsg_NodeHeartbeat(NodeHeartbeat("m1", join=1), "agent-1")
    co._registered.discard("m1")  # (Thespian's registration of the frozen member lapsed: no probe)
    co._last_node_check = _time.monotonic() - 1.0
    co._inventory.nodes["m1"].last_seen -= 3.5
    co._check_nodes()
    assert not co._inventory.nodes["m1"].alive
    co.receiveMsg_NodeHeartbeat(NodeHeartbeat("m1", join=1), "agent-1")  # resumed: back
    m1 = co._inventory.nodes["m1"]
    assert m1.alive
    m1.used["1"] = "talker/2"  # (placed there since)
    co.receiveMsg_ActorSystemConventionUpdate(ActorSystemConventionUpdate("admin-m1", caps, True), None)
    co.receiveMsg_NodeHeartbeat(NodeHeartbeat("m1", join=2), "agent-2")
    assert co._inventory.nodes["m1"].used == {"1": "talker/2"}


def test_two_nodes_on_one_machine_offering_a_device_are_noted_in_status():
    """A leader and a member started on one host with node names of their own and overlapping
    `--devices`: placement counts each node's devices apart, so two replicas could load on one
    GPU, with no word of it."""
    from thespian.actors import ActorSystemConventionUpdate

    from omni_actors.messages import NodeHeartbeat, NodeInfo

    co, _ = _coordinator_with_leader()
    co._inventory.add(NodeInfo("gpu-a", ("0", "1"), host="box/b1"))
    for name, devices, host in [("m1", "1,2", "box/b1"), ("m2", "1", "other/b2"), ("m3", "5", "box/b1")]:
        caps = {"omni_node": name, "omni_devices": devices, "omni_member": name, "omni_host": host}
        co.receiveMsg_ActorSystemConventionUpdate(ActorSystemConventionUpdate(f"admin-{name}", caps, True), None)
        co.receiveMsg_NodeHeartbeat(NodeHeartbeat(name, join=1), f"agent-{name}")
    assert co._shared_devices() == [
        "nodes gpu-a and m1 run on one machine (box/b1) and both offer device(s) 1: if those ids name the same GPUs "
        "(not containers given GPUs of their own), a replica on each could load on one GPU; give each node devices "
        "of its own (--devices)"]
    co._inventory.lose("m1", "left the convention")
    assert co._shared_devices() == []


def test_a_node_lost_for_missed_heartbeats_whose_member_is_still_in_the_convention_is_asked_to_join_again():
    """A code review: a network cut (or a stalled coordinator) of 5-15 s: the coordinator
    lost the node after 3 intervals, its agent, unacknowledged for 5, exited, and Thespian,
    whose registration of the member had not lapsed, never announced it again: LOST for
    good. The coordinator now starts a new agent there while the member is registered,
    and the node is back on that agent's first heartbeat; not once Thespian dropped it."""
    import time as _time

    from thespian.actors import ActorSystemConventionUpdate

    from omni_actors.messages import NodeHeartbeat, StartNodeAgent

    co, made = _coordinator_with_leader()
    caps = {"omni_node": "m1", "omni_devices": "0,1"}
    co.receiveMsg_ActorSystemConventionUpdate(ActorSystemConventionUpdate("admin-m1", caps, True), None)
    co.receiveMsg_NodeHeartbeat(NodeHeartbeat("m1", join=1), "agent-1")
    m1 = co._inventory.nodes["m1"]
    assert m1.alive and len(made) == 1

    def check(after_s):
        co._last_node_check = _time.monotonic() - 1.0  # (on time)
        co._inventory.nodes["m1"].last_seen -= after_s
        for node, at in co._rejoin_at.items():
            co._rejoin_at[node] = at - after_s
        co._check_nodes()

    check(3.5)  # silent for more than 3 intervals: lost
    assert not co._inventory.nodes["m1"].alive and len(made) == 1
    check(6.0)  # the agent has exited meanwhile; not asked yet
    assert len(made) == 1
    check(4.5)
    assert len(made) == 2 and made[1]["targetActorRequirements"] == made[0]["targetActorRequirements"]
    start = [m for a, m in co.sent if a == "agent-2" and isinstance(m, StartNodeAgent)]
    assert [m.join for m in start] == [2]
    co.receiveMsg_NodeHeartbeat(NodeHeartbeat("m1", join=1), "agent-1")  # the old agent, late: ignored
    assert not co._inventory.nodes["m1"].alive
    co.receiveMsg_NodeHeartbeat(NodeHeartbeat("m1", join=2), "agent-2")
    m1 = co._inventory.nodes["m1"]
    assert m1.alive and m1.info.devices == ("0", "1")
    # lost again; a new member joins under its name (another admin) before the probe: the probe
    # does not make the new member's agent stale, and the old member's registration lapsing after
    # is not the new one's (a review: m2 stayed LOST, its new member running)
    check(3.5)
    assert not co._inventory.nodes["m1"].alive and "m1" in co._rejoin_at
    caps_b = {"omni_node": "m1", "omni_devices": "0,1", "omni_member": "b"}
    co.receiveMsg_ActorSystemConventionUpdate(ActorSystemConventionUpdate("admin-b", caps_b, True), None)
    assert "m1" not in co._rejoin_at and len(made) == 3
    co.receiveMsg_ActorSystemConventionUpdate(ActorSystemConventionUpdate("admin-m1", caps, False), None)
    assert "m1" in co._registered
    co.receiveMsg_NodeHeartbeat(NodeHeartbeat("m1", join=3), "agent-3")
    assert co._inventory.nodes["m1"].alive and co._inventory.nodes["m1"].info.admin == "admin-b"
    # lost again, then dropped from the convention: nobody is asked (it joins when announced)
    check(3.5)
    assert not co._inventory.nodes["m1"].alive
    co.receiveMsg_ActorSystemConventionUpdate(ActorSystemConventionUpdate("admin-b", caps_b, False), None)
    check(10.5)
    check(10.5)
    assert len(made) == 3


def test_a_drained_node_whose_member_joins_again_is_still_drained():
    """A code review: `node drain m2`, then its member restarted (a new join): m2 took new
    replicas without `node undrain`. It is drained still, with a ``node_still_drained``
    warning; once undrained, a join is a plain join."""
    from structlog.testing import capture_logs

    from omni_actors.actors.coordinator import CoordinatorActor
    from omni_actors.placement import LEFT_REASON, NodeInfo

    co = CoordinatorActor()
    co._add_node(NodeInfo("m2", ("0",), ()))
    assert co._inventory.drain("m2", operator=True)
    co._inventory.lose("m2", LEFT_REASON)  # (its member stopped)
    with capture_logs() as logs:
        co._add_node(NodeInfo("m2", ("0",), ()))  # (and started again)
    assert co._inventory.nodes["m2"].drained and not co._inventory.nodes["m2"].open
    assert [e["event"] for e in logs] == ["node_still_drained"]
    assert co._inventory.undrain("m2")
    co._inventory.lose("m2", LEFT_REASON)
    co._add_node(NodeInfo("m2", ("0",), ()))
    assert co._inventory.nodes["m2"].open


def test_a_drained_node_that_left_or_is_leaving_can_be_undrained_for_its_next_member():
    """Code reviews: `status` said "LEFT, still drained: `node undrain`" and `node undrain`
    then said "no alive node named 'm2'"; undrained while its member was leaving, the pools
    retired the replacements of the replicas leaving with it. Now either is undrained for
    the member that joins next under its name, and nothing else changes."""
    from omni_actors.actors.coordinator import CoordinatorActor
    from omni_actors.messages import AdminReply, NodesChanged, UndrainNode
    from omni_actors.placement import LEFT_REASON, NodeInfo

    co = CoordinatorActor()
    co.sent = []
    co.send = lambda address, message: co.sent.append((address, message))
    co._publish_status = lambda: None
    co._pools = {1: "talker-pool"}
    co._add_node(NodeInfo("m2", ("0",), ()))
    co._add_node(NodeInfo("m3", ("1",), ()))
    for name in ("m2", "m3"):
        assert co._inventory.drain(name, operator=True)
    co._inventory.lose("m2", LEFT_REASON)  # (its member stopped)
    co._inventory.drain("m3")  # (its member is stopping)
    co.receiveMsg_UndrainNode(UndrainNode("m2"), "operator")
    co.receiveMsg_UndrainNode(UndrainNode("m3"), "operator")
    replies = [m for a, m in co.sent if a == "operator"]
    assert [r.ok for r in replies] == [True, True], replies
    assert "node m2 is no longer drained; it is left" in replies[0].message
    assert "node m3 is no longer drained; it is leaving" in replies[1].message
    assert not [m for _, m in co.sent if isinstance(m, NodesChanged)]  # (the pools keep what they have)
    co._add_node(NodeInfo("m2", ("0",), ()))  # its member joins again: open
    assert co._inventory.nodes["m2"].open
    co.receiveMsg_UndrainNode(UndrainNode("m2"), "operator")
    assert co.sent[-1] == ("operator", AdminReply(False, "node m2 is not drained (it is alive)"))


def test_the_coordinator_restarts_its_node_checks_when_their_wakeup_is_lost():
    """The coordinator's node check re-arms itself; had its wake-up been lost, a member
    host killed later would never be found lost. A pool's report now restarts it when it
    is TICK_LOST_AFTER_INTERVALS late (the old chain's late wake-up is then ignored)."""
    import time as _time
    from types import SimpleNamespace

    from thespian.actors import WakeupMessage

    from omni_actors.actors.coordinator import CoordinatorActor
    from omni_actors.actors.supervision import TICK_LOST_AFTER_INTERVALS
    from omni_actors.messages import NodeInfo, PoolState

    co = CoordinatorActor()
    wakeups, lost = [], []
    co.send = lambda address, message: None
    co.wakeupAfter = lambda delay, payload=None: wakeups.append(payload)
    co._lose_node = lambda name, reason: lost.append((name, reason))
    co._config = SimpleNamespace(deployment=SimpleNamespace(heartbeat_interval_s=1.0))
    co._leader_node = "leader"
    for name in ("leader", "m1"):
        co._inventory.add(NodeInfo(name))
    co._last_node_check = _time.monotonic()
    co._node_checks.start(co, 1.0)
    assert wakeups == [("node_check", 1)]
    co._inventory.nodes["m1"].last_seen = _time.monotonic() - 10  # killed, silent since
    co.receiveMsg_PoolState(PoolState(0, "thinker", ()), "old-pool")  # checks not late: nothing
    assert lost == [] and len(wakeups) == 1
    co._last_node_check -= TICK_LOST_AFTER_INTERVALS * 1.0 + 0.1  # the wake-up was lost
    co.receiveMsg_PoolState(PoolState(0, "thinker", ()), "old-pool")
    assert [name for name, _ in lost] == ["m1"] and wakeups[-1] == ("node_check", 2)
    co.receiveMsg_WakeupMessage(WakeupMessage(1.0, ("node_check", 1)), None)  # the old chain's, late
    assert wakeups[-1] == ("node_check", 2) and len(wakeups) == 2
    co.receiveMsg_WakeupMessage(WakeupMessage(1.0, ("node_check", 2)), None)
    assert wakeups[-1] == ("node_check", 2) and len(wakeups) == 3


def test_a_replica_starting_again_says_why_it_was_down():
    """A restart can take a minute (vLLM loads its model): `status` said nothing while it
    was STARTING (a trial); it now says why the replica was down, as READY does after."""
    from types import SimpleNamespace

    from omni_actors.config import Supervision
    from omni_actors.messages import Placement, ReplicaState

    pool = _pool_routing({"talker/0": "m1"})
    pool.createActor = lambda cls, targetActorRequirements=None: "new-address"
    pool.wakeupAfter = lambda delay, payload=None: None
    pool._coordinator = "coordinator"
    pool._spec = SimpleNamespace(stage=SimpleNamespace(stage_id=1, name="talker"), deployment=None,
                                 heartbeat_interval_s=1.0, inline_threshold_bytes=65536, connector_mode="auto",
                                 supervision=Supervision(), ready_timeout_s=60.0)
    pool._gone(pool._replicas["talker/0"], "process exited")
    pool._on_timer(("restart", "talker/0", pool._replicas["talker/0"].restart_tag))  # (its back-off over)
    rep = pool._replicas["talker/0"]
    assert rep.state == ReplicaState.PENDING
    pool.receiveMsg_Placement(Placement("talker/0", "m1", ()), "coordinator")
    assert rep.state == ReplicaState.STARTING and rep.reason == "starting again; it was down: process exited"


def test_a_stalled_replica_taking_a_new_tasks_input_shows_no_progress():
    """A stalled replica (here: `inject stall`) still takes a new streaming task's input
    chunk before it stalls on it. That must neither count as progress in its heartbeats
    nor start its idle clock afresh while an earlier task is stuck, or the pool's stall
    clock starts over with every new task (trial L: a stalled Talker isolated after
    20-30 s instead of its 10 s stall timeout). Time waiting for input is no stall; a
    healthy replica counts the events its backend makes."""
    import asyncio
    from types import SimpleNamespace

    from omni_actors.actors.engine import EngineActor
    from omni_actors.engines.base import OutputChunk
    from omni_actors.messages import InputChunk, StageTask

    actor = consumed = None

    def replica() -> None:
        nonlocal actor, consumed
        actor, consumed = EngineActor(), []
        actor._started.set()  # (ends its orphan watchdog thread)
        actor._spec = SimpleNamespace(replica="talker/0", stage=SimpleNamespace(name="talker",
                                                                                default_sampling_params={}))
        actor._connector = SimpleNamespace(get=lambda ref: {"codes": ref.payload}, reads_remotely=lambda ref: False)
        actor._processor = lambda upstream, prompt, params: {"codes": upstream[0]["codes"]}
        actor._rt = SimpleNamespace(emit=lambda address, message, **kw: None)

        async def generate(task):  # one output per input chunk
            async for engine_input in task.input_stream:
                consumed.append(engine_input["codes"])
                yield OutputChunk({"codes": engine_input["codes"]})

        actor._backend = SimpleNamespace(generate=generate)

    def start(request_id: str) -> None:
        task = StageTask(request_id, 1, "", (), {}, {}, None, False, "ra", stream_source=0)
        actor._tasks[(request_id, 1)] = asyncio.ensure_future(actor._execute(task))

    def chunk(request_id: str, codes: list) -> None:
        actor._on_input_chunk(InputChunk(request_id, 1, 0, 0, SimpleNamespace(size=3, payload=codes), 0))

    async def stop() -> None:
        for running in actor._tasks.values():
            running.cancel()
        await asyncio.gather(*actor._tasks.values(), return_exceptions=True)

    async def stalled() -> None:
        replica()
        actor._stalled = asyncio.Event()
        start("r1")
        await asyncio.sleep(0.2)
        assert actor._idle_s() == 0.0  # waiting for input: no stall of its own
        chunk("r1", [1])
        await asyncio.sleep(0.3)  # took it, and stalled on it
        start("r2")
        await asyncio.sleep(0.05)
        chunk("r2", [2])
        await asyncio.sleep(0.05)
        assert consumed == [[1], [2]] and actor._progress == 0  # took input, made nothing: no progress
        assert actor._idle_s() >= 0.35  # since r1's input came, not r2's
        await stop()

    async def healthy() -> None:
        replica()
        start("r1")
        await asyncio.sleep(0.05)
        chunk("r1", [1])
        await asyncio.sleep(0.05)
        assert consumed == [[1]] and actor._progress == 1
        await stop()

    asyncio.run(stalled())
    asyncio.run(healthy())


def test_a_second_notice_of_a_pools_exit_starts_no_second_pool():
    """A pool's exit can be reported twice (its own goodbye and Thespian's SIGCHLD check):
    the coordinator handles it once, so one new pool starts, not two (the first of which
    no one would track)."""
    from thespian.actors import ChildActorExited, WakeupMessage

    from omni_actors.actors.coordinator import CoordinatorActor
    from omni_actors.actors.supervision import RestartPolicy
    from omni_actors.messages import PoolState, ReplicaState, ReplicaStatus

    co = CoordinatorActor()
    wakeups, started = [], []
    co.send = lambda address, message: None
    co.wakeupAfter = lambda delay, payload=None: wakeups.append(payload)
    co._publish_status = co._publish_routes = lambda: None
    co._start_pool = lambda stage, why=None: started.append(stage.stage_id)
    co._restart = RestartPolicy()
    co._config = type("Config", (), {"stage": lambda self, stage_id: type("Stage", (), {"stage_id": stage_id,
                                                                                       "name": "talker"})()})()
    co._pools, co._pool_restarts = {1: "pool-a"}, {1: []}
    co._states[1] = PoolState(1, "talker", (ReplicaStatus("talker/0", ReplicaState.READY, ""),))
    for _ in range(2):
        co.receiveMsg_ChildActorExited(ChildActorExited("pool-a"), None)
    assert wakeups == [("restart_pool", 1, 1)]
    assert co._states[1].replicas[0].state == ReplicaState.DEAD
    co.receiveMsg_WakeupMessage(WakeupMessage(0.5, wakeups[0]), None)
    assert started == [1]


def _task_whose_input_read_raises(error: Exception, ref) -> tuple[object, list]:
    """An engine running one task (code2wav, stage 2) whose one input ``ref`` its connector
    cannot read (``get`` raises ``error``), as the real ``_execute`` starts: the engine and
    what it sent (``(address, message)``: to the RequestActor "ra", then the pool "pool")."""
    import asyncio
    from types import SimpleNamespace

    from omni_actors.actors.engine import EngineActor
    from omni_actors.messages import StageTask

    actor = EngineActor()
    actor._started.set()  # (ends its orphan watchdog thread)
    actor._spec = SimpleNamespace(replica="code2wav/0", stage=SimpleNamespace(name="code2wav"))
    actor._pool = "pool"

    def get(ref):
        raise error

    actor._connector = SimpleNamespace(get=get, reads_remotely=lambda ref: False)

    async def execute(msg):  # as the real one starts: fetch the inputs
        return {sid: await actor._fetch(r) for sid, r in msg.inputs}

    actor._execute = execute
    sent = []

    async def main():
        actor._rt = SimpleNamespace(emit=lambda address, message, **kw: sent.append((address, message)))
        await actor._run_task(StageTask("r1", 2, "", ((1, ref),), {}, {}, None, False, "ra"))

    asyncio.run(main())
    return actor, sent


def test_an_input_lost_with_its_host_ends_the_task_without_counting_against_the_replica():
    """A consumer whose upstream output lives on a host that just died (its data service
    refuses connections) fails with INPUT_LOST and the host's name; the replica is not
    at fault: its TaskFinished is not a failure (no circuit breaker). A trial saw a
    healthy Code2Wav retried 5 times in 50 ms against the dead service and isolated."""
    from omni_actors.connectors import ConnectorRef, DataServiceError
    from omni_actors.messages import ErrorKind, StageFailed, TaskFinished

    ref = ConnectorRef(kind="shm", size=4096, layout=(), location="oa-x-1", node="m1", service="127.0.0.1:43709")
    actor, sent = _task_whose_input_read_raises(
        DataServiceError("data service 127.0.0.1:43709 unreachable: [Errno 111] Connection refused"), ref)
    (to_ra, failed), (to_pool, finished) = sent
    assert to_ra == "ra" and isinstance(failed, StageFailed) and failed.kind == ErrorKind.INPUT_LOST
    assert failed.lost_on == "m1" and "lost with host m1" in failed.message and "Connection refused" in failed.message
    assert to_pool == "pool" and isinstance(finished, TaskFinished) and not finished.ok and finished.cancelled
    assert actor._failed == 0


def test_a_vllm_omni_connector_with_nothing_for_an_input_fails_the_task_without_counting_against_the_replica():
    """A code review: in an ``omni:`` connector mode, an input read already (a connector that
    hands data to its first reader, and a replica that died after reading it) or expired
    failed the task as the replica's engine error: retried on other healthy replicas, where
    it failed the same, each failure a mark on their circuit breakers. It is the pipeline's
    input now (STAGE_INPUT: a 500 with the connector's words, not retried, not counted).
    One that cannot be built or reached here (a review of that) is this replica's."""
    from omni_actors.connectors import ConnectorRef
    from omni_actors.connectors.omni import OmniDataMissing, OmniUnavailable
    from omni_actors.messages import ErrorKind, StageFailed, TaskFinished

    ref = ConnectorRef(kind="omni", size=4096, layout=(), location="k1", node="m1")
    actor, sent = _task_whose_input_read_raises(OmniDataMissing(
        "vLLM-Omni's SharedMemoryConnector has nothing for k1 (released, expired, or read already: some of its "
        "connectors hand data to the first reader)"), ref)
    (_, failed), (_, finished) = sent
    assert isinstance(failed, StageFailed) and failed.kind == ErrorKind.STAGE_INPUT
    assert "has nothing for k1" in failed.message
    assert isinstance(finished, TaskFinished) and not finished.ok and finished.input_error
    assert actor._failed == 1 and not finished.client_error  # (a failed task, not the replica's fault)

    _, sent = _task_whose_input_read_raises(
        OmniUnavailable("vLLM-Omni's MooncakeConnector: vllm_omni is not importable in this process"), ref)
    (_, failed), (_, finished) = sent
    assert failed.kind == ErrorKind.ENGINE_ERROR and not finished.input_error


def test_a_request_actor_does_not_retry_a_stage_whose_input_was_lost_and_says_where():
    from omni_actors.messages import ErrorKind, RequestFinished, StageFailed, StageTask

    ra, sent, _ = _closing_request_actor(("talker", "code2wav"))
    for task in ra._running.values():
        task.moved = 0
    ra._req.max_attempts = 3
    ra.receiveMsg_StageFailed(StageFailed("r1", 1, "code2wav/0", ErrorKind.INPUT_LOST,
                                          "stage code2wav (code2wav/0): an input was lost with host m1: ...",
                                          lost_on="m1"), "code2wav-engine")
    assert not [m for _, m in sent if isinstance(m, StageTask)], sent  # not retried
    finished = [m for _, m in sent if isinstance(m, RequestFinished)]
    assert len(finished) == 1 and finished[0].error == ErrorKind.INPUT_LOST and finished[0].lost_on == "m1"


def test_vllm_requests_abort_every_engine_request_of_a_pipeline_request_and_only_those():
    """The bookkeeping both vLLM backends share: a retry on the same replica gets a new
    engine request id; an abort reaches every engine request of its pipeline request and
    each one's output loop learns it was aborted, once."""
    from omni_actors.engines.vllm_requests import VllmRequests

    book = VllmRequests(stage_id=1)
    first, retry, other = book.start("r1"), book.start("r1"), book.start("r2")
    assert len({first, retry, other}) == 3 and first.startswith("r1:1:") and len(book) == 3
    assert sorted(book.abort("r1")) == sorted([first, retry]) and book.abort("nope") == []
    assert book.aborted(first) and book.aborted(retry) and not book.aborted(other)
    assert book.end("r1", first) is True and book.end("r1", retry) is True
    assert book.end("r2", other) is False
    assert len(book) == 0 and book.requests() == [] and not book.aborted(first)


def test_a_stage_failed_after_its_text_went_out_tells_the_bridge_so():
    """A streaming stage that fails after its text left for the API server is not retried
    (the client may have part of it), and the RequestFinished says so (``output_sent``):
    the API server, which knows whether it sent any, may then run the request again."""
    from types import SimpleNamespace

    from omni_actors.messages import ErrorKind, RequestFinished, StageFailed

    ra, sent, _ = _closing_request_actor(stages=("thinker",))
    ra._req.max_attempts = 3
    ra._running = {0: SimpleNamespace(attempt=0, streaming=True, stream_source=None, moved=0, exclude=(),
                                      crashed=False)}
    ra._to_client, ra._stream_consumers = {0}, {0: []}
    ra.receiveMsg_StageFailed(StageFailed("r1", 0, "thinker/0", ErrorKind.UNAVAILABLE, "dead: process exited"),
                              "pool")
    finished = [m for _, m in sent if isinstance(m, RequestFinished)]
    assert len(finished) == 1 and finished[0].output_sent is True, sent
    assert finished[0].message == ("dead: process exited; part of the output had already reached the client, "
                                   "so it was not retried")


def test_a_vllm_omni_engine_dead_error_marks_the_replica_failed_for_its_next_heartbeat():
    """Trial AA: a SIGKILLed vLLM-Omni stage engine left its replica `ready` until the circuit
    breaker tripped after 5 failed tasks (its backend never set `failure`). Recognised by
    name (its module moves between versions), also as the cause of another error."""
    from omni_actors.engines.vllm_omni import _engine_dead

    class OmniEngineDeadError(Exception):
        pass

    assert _engine_dead(OmniEngineDeadError("Stage-0 has no live replica"))
    try:
        try:
            raise OmniEngineDeadError("gone")
        except OmniEngineDeadError as exc:
            raise RuntimeError("generate failed") from exc
    except RuntimeError as wrapped:
        assert _engine_dead(wrapped)
    assert _engine_dead(RuntimeError("OmniEngineDeadError: Stage-0 has no live replica"))
    assert not _engine_dead(ValueError("prompt too long")) and not _engine_dead(RuntimeError("oom"))


def test_a_task_that_finds_its_engine_dead_has_the_pool_told_at_once():
    """Trial V: a SIGKILLed vLLM engine core failed the tasks sent to its replica until the
    next heartbeat told the pool; under load five failed first and the circuit breaker,
    not the engine's death, restarted the replica. The first task that finds the engine
    dead now tells the pool (once). The tasks themselves end with no word: the pool sends
    every task in flight on the replica elsewhere, counting the crash (a code review: their
    RequestActors also retried each, a second copy that did not count the crash)."""
    import asyncio
    from types import SimpleNamespace

    from omni_actors.actors.engine import EngineActor
    from omni_actors.messages import EngineFailed, StageTask

    actor = EngineActor()
    actor._started.set()  # (ends its orphan watchdog thread)
    actor._spec = SimpleNamespace(replica="thinker/0", heartbeat_interval_s=1.0,
                                  stage=SimpleNamespace(name="thinker", default_sampling_params={}))
    actor._pool, actor._ready = "pool", True
    actor._processor = lambda upstream, prompt, params: {"prompt": prompt}
    emitted = []
    actor._rt = SimpleNamespace(emit=lambda address, message, **kw: emitted.append((address, message)))

    class DeadEngine:
        failure = None

        async def generate(self, task):
            self.failure = "EngineCore died (SIGKILL)"
            raise RuntimeError(f"vLLM engine thinker/0 died: {self.failure}")
            yield  # (an async generator)

    actor._backend = DeadEngine()

    async def run(*request_ids):
        await asyncio.gather(*(actor._run_task(StageTask(rid, 0, "hi", (), {}, {}, None, False, "ra"))
                               for rid in request_ids))

    asyncio.run(run("r1", "r2", "r3"))  # three tasks in flight when it died
    to_pool = [type(m) for a, m in emitted if a == "pool"]
    assert to_pool == [EngineFailed], to_pool
    assert [m for a, m in emitted if a == "pool"][0] == EngineFailed("thinker/0", "EngineCore died (SIGKILL)")
    assert [type(m) for a, m in emitted if a == "ra"] == []
    assert not actor._ready  # takes no more work


def test_a_replica_isolated_by_its_breaker_whose_engine_then_dies_is_restarted_not_failed():
    """Trial V, second run: six tasks failed at once on a killed engine core, the circuit
    breaker isolated the replica, then its EngineFailed came: the pool took that for a load
    failure and set it `failed` for 300 s (every request a 503). A replica that loaded and
    is being isolated is restarted as the isolation says."""
    from omni_actors.messages import EngineFailed, ReplicaState

    pool = _pool_routing({"talker/0": "m1"})
    rep = pool._replicas["talker/0"]
    pool._isolate(rep, "circuit breaker: 5 task failures in a row", hard=False)  # (as the breaker does)
    assert rep.state == ReplicaState.ISOLATED
    pool.receiveMsg_EngineFailed(EngineFailed("talker/0", "engine core gone"), rep.address)
    assert rep.state != ReplicaState.FAILED and "circuit breaker" in rep.reason


def test_a_replica_that_loaded_before_and_fails_to_load_once_on_restart_is_restarted_not_failed():
    """Trial W: an engine core killed while its replica was being restarted left the replica
    `failed` for 300 s, as if its config could not load. One that was ready before is
    restarted (as a crash, within the restart budget); a second load failure in a row, or
    one that never loaded, is `failed` as before."""
    from omni_actors.messages import EngineFailed, EngineReady, ReplicaState

    pool = _pool_routing({"talker/0": "m1", "talker/1": "m1"})
    for name in ("talker/0", "talker/1"):
        rep = pool._replicas[name]
        rep.state = ReplicaState.STARTING
        if name == "talker/0":
            pool.receiveMsg_EngineReady(EngineReady(name, 1234, "m1"), rep.address)
            assert rep.state == ReplicaState.READY
            rep.state = ReplicaState.STARTING  # (it died and is loading again)
        pool.receiveMsg_EngineFailed(EngineFailed(name, "Engine core initialization failed"), rep.address)
    again, never = pool._replicas["talker/0"], pool._replicas["talker/1"]
    assert again.state == ReplicaState.ISOLATED and "failed to load on restart" in again.reason
    assert never.state == ReplicaState.FAILED
    again.placed = ("m1", ("3",))
    pool._launch("talker/0", again.restarts)  # restarted (a new Replica record), and fails to load again
    again = pool._replicas["talker/0"]
    # (not sent back to the device it failed to load on: a bad GPU would fail it again)
    assert again.was_on == ()
    again.state = ReplicaState.STARTING
    pool.receiveMsg_EngineFailed(EngineFailed("talker/0", "Engine core initialization failed"), again.address)
    assert again.state == ReplicaState.FAILED


def test_a_request_actor_keeps_one_deadline_wake_up_pending_not_one_per_request(monkeypatch):
    """Thespian cannot cancel a wake-up and sorts its pending ones on every wakeupAfter:
    a RequestActor that asked for one deadline and one alive-beat chain per request made
    each request cost CPU in proportion to the requests of the last two minutes. Now
    1,000 requests in a row leave at most two wake-ups pending, and a deadline still
    ends its request (504) when it comes, whichever earlier request's wake-up it rides on."""
    from types import SimpleNamespace

    from thespian.actors import WakeupMessage

    from omni_actors.actors import request as request_module
    from omni_actors.actors.request import ALIVE_BEAT, DEADLINE, RequestActor
    from omni_actors.messages import ErrorKind, RequestFinished, RunRequest, StageDone
    from omni_actors.planning import PlannedStage, RequestPlan

    clock = [1000.0]
    monkeypatch.setattr(request_module.time, "monotonic", lambda: clock[0])
    ra = RequestActor()
    sent, pending = [], []
    ra.send = lambda address, message: sent.append((address, message))
    ra.wakeupAfter = lambda delay, payload=None: pending.append((clock[0] + delay, payload))
    ra._myRef = SimpleNamespace(address="ra-address")
    plan = RequestPlan((PlannedStage(0, "thinker", (), "pool0", "text", True),))

    def fire_due() -> None:
        for wake in sorted(w for w in pending if w[0] <= clock[0]):
            pending.remove(wake)
            ra.receiveMsg_WakeupMessage(WakeupMessage(0, wake[1]), None)

    for i in range(1000):  # 20 requests a second, each done in 10 ms
        ra.receiveMsg_RunRequest(RunRequest(f"r{i}", "hi", plan, {}, {}, 120.0, "bridge"), "bridge")
        clock[0] += 0.01
        ra.receiveMsg_StageDone(StageDone(f"r{i}", 0, "thinker/0", None, None), "engine")
        clock[0] += 0.04
        fire_due()
    assert [m.error for _, m in sent if isinstance(m, RequestFinished)] == [None] * 1000
    assert len(pending) <= 3, sorted({str(w[1])[:20] for w in pending})  # deadline, alive beat, bridge check
    assert len([w for w in pending if w[1] == DEADLINE]) == 1
    assert len([w for w in pending if isinstance(w[1], tuple) and w[1][0] == ALIVE_BEAT]) == 1

    # A request whose deadline is later than the pending wake-up's: that wake-up comes
    # (it was an earlier request's), arms the next, and the request ends at its deadline.
    sent.clear()
    start = clock[0]
    ra.receiveMsg_RunRequest(RunRequest("slow", "hi", plan, {}, {}, 120.0, "bridge"), "bridge")
    while clock[0] < start + 119.9:
        clock[0] += 1.0 if clock[0] < start + 119.0 else 0.05
        fire_due()
    assert not [m for _, m in sent if isinstance(m, RequestFinished)]
    clock[0] = start + 120.0
    fire_due()
    finished = [m for _, m in sent if isinstance(m, RequestFinished)]
    assert [(m.request_id, m.error) for m in finished] == [("slow", ErrorKind.TIMEOUT)]

    # A shorter deadline than the pending wake-up's gets a wake-up of its own.
    sent.clear()
    start = clock[0]
    ra.receiveMsg_RunRequest(RunRequest("short", "hi", plan, {}, {}, 2.0, "bridge"), "bridge")
    clock[0] = start + 2.0
    fire_due()
    assert [(m.request_id, m.error) for _, m in sent if isinstance(m, RequestFinished)] == [
        ("short", ErrorKind.TIMEOUT)]


def test_a_subscriber_that_does_not_renew_is_sent_at_most_a_backlog_and_the_latest_when_it_renews():
    """A frozen API server's bridge never renews: the coordinator's publications to it stay
    in flight (Thespian: 20 per sender, up to 5 minutes each), and a burst of them would
    silence the coordinator. At most SUBSCRIBER_BACKLOG go between two renewals."""
    from types import SimpleNamespace

    from omni_actors.actors import coordinator
    from omni_actors.messages import PublicationsReceived, Routes, Subscribe, SystemStatus

    co = coordinator.CoordinatorActor()
    co.sent = []
    co.send = lambda address, message: co.sent.append((address, message))
    co._routes = lambda: Routes(None, {})
    co._status = lambda query_id: SystemStatus(query_id, "m", True, ())
    co._config = SimpleNamespace()
    co.receiveMsg_Subscribe(Subscribe("frozen"), "frozen")
    co.receiveMsg_Subscribe(Subscribe("healthy"), "healthy")
    co.sent.clear()
    for _ in range(coordinator.SUBSCRIBER_BACKLOG + 5):
        co._publish_status()
    counts = collections.Counter(address for address, _ in co.sent)
    assert counts == {"frozen": coordinator.SUBSCRIBER_BACKLOG, "healthy": coordinator.SUBSCRIBER_BACKLOG}
    co.sent.clear()
    co.receiveMsg_Subscribe(Subscribe("healthy"), "healthy")  # it renews: the latest, then on as before
    assert [(a, type(m).__name__) for a, m in co.sent] == [("healthy", "Routes"), ("healthy", "SystemStatus")]
    co.sent.clear()
    co._publish_status()
    assert [a for a, _ in co.sent] == ["healthy"]

    # A healthy one says every few that they came (PublicationsReceived): one that fell behind
    # in a burst gets the latest at once, not at its next renewal (up to 2 s of a stale status).
    co.sent.clear()
    for _ in range(coordinator.SUBSCRIBER_BACKLOG + 5):
        co._publish_status()
    assert [a for a, _ in co.sent].count("healthy") == coordinator.SUBSCRIBER_BACKLOG - 1
    co.sent.clear()
    co.receiveMsg_PublicationsReceived(PublicationsReceived("healthy", 4), "healthy")
    assert [(a, type(m).__name__) for a, m in co.sent] == [("healthy", "Routes"), ("healthy", "SystemStatus")]
    co.sent.clear()
    co.receiveMsg_PublicationsReceived(PublicationsReceived("healthy", 4), "healthy")
    co.receiveMsg_PublicationsReceived(PublicationsReceived("unknown", 4), "unknown")  # (not subscribed)
    assert co.sent == []
    co._publish_status()
    assert [a for a, _ in co.sent] == ["healthy"]


def test_a_bridge_says_every_few_publications_that_they_came():
    """The bridge's side of PublicationsReceived: one message per PUBLICATIONS_ACK_EVERY
    publications (routes or subscription status), through its first sender's outbox."""
    import queue
    from types import SimpleNamespace

    from omni_actors.http import bridge as bridge_module
    from omni_actors.messages import SUBSCRIPTION, PublicationsReceived, Routes, SystemStatus

    b = bridge_module.ActorBridge.__new__(bridge_module.ActorBridge)
    b._publications, b._address, b._outboxes = 0, "me", [queue.SimpleQueue()]
    b._routes, b._published = Routes(None, {}), None
    b._loop = SimpleNamespace(call_soon_threadsafe=lambda *a: None)
    for _ in range(3):
        b._on_message(SystemStatus(SUBSCRIPTION, "m", True, ()))
    b._on_message(SystemStatus("an admin's query", "m", True, ()))  # (an answer, not a publication)
    assert b._outboxes[0].empty()
    b._on_message(Routes(None, {}))
    assert b._outboxes[0].get_nowait() == ("coordinator", PublicationsReceived("me", 4))
    assert b._outboxes[0].empty() and b._publications == 0


def test_lingering_replicas_are_released_once_no_pool_has_had_work_for_a_while(monkeypatch):
    """The last ready replicas of a stage on a leaving node take tasks until no request is in
    flight: the coordinator tells their pools after LINGER_QUIET_S of quiet pool reports."""
    from omni_actors.actors import coordinator
    from omni_actors.messages import NoRequestsInFlight, PoolState, ReplicaState, ReplicaStatus

    now = [100.0]
    monkeypatch.setattr(coordinator.time, "monotonic", lambda: now[0])
    co = coordinator.CoordinatorActor()
    co.sent = []
    co.send = lambda address, message: co.sent.append((address, message))
    co._pools = {0: "thinker-pool", 1: "code2wav-pool"}
    ready = ReplicaState.READY

    lingered_at = 1000.0  # (wall clock: StageTask.began_at, ReplicaStatus.lingering_since)

    def report(thinker_in_flight: int, lingering: bool = True, feeding: bool = True,
               code2wav_in_flight: int = 0, began: float = lingered_at - 1) -> None:
        busy = began if thinker_in_flight else None
        co._states[0] = PoolState(0, "thinker", (ReplicaStatus("thinker/0", ready, in_flight=thinker_in_flight),),
                                  feeding_began=busy if feeding else None, oldest_began=busy)
        co._states[1] = PoolState(1, "code2wav", (ReplicaStatus("code2wav/0", ready, lingering=lingering,
                                                                lingering_since=lingered_at if lingering else 0.0,
                                                                in_flight=code2wav_in_flight),),
                                  oldest_began=began if code2wav_in_flight else None)
        co._end_lingering()

    report(1)  # a request in the thinker will need code2wav
    now[0] += 5
    report(1)
    assert co.sent == []
    report(0)  # quiet from now...
    now[0] += coordinator.LINGER_QUIET_S / 2
    report(1)  # (...not for long: a request between two stages, say)
    report(0)
    now[0] += coordinator.LINGER_QUIET_S / 2
    report(0)
    assert co.sent == []
    now[0] += coordinator.LINGER_QUIET_S / 2
    report(0)
    assert co.sent == [("code2wav-pool", NoRequestsInFlight())]
    co.sent.clear()
    report(0, lingering=False)
    now[0] += 10
    report(0, lingering=False)
    assert co.sent == []

    # Text-only requests in the thinker (their tasks feed no other stage) do not hold a
    # lingering code2wav (trial AR: it lingered until the member's drain timeout); its own
    # task in flight does.
    co._quiet_since = None
    report(3, feeding=False, code2wav_in_flight=1)
    now[0] += 5
    report(3, feeding=False, code2wav_in_flight=1)
    assert co.sent == []
    report(3, feeding=False)
    now[0] += coordinator.LINGER_QUIET_S
    report(3, feeding=False)
    assert co.sent == [("code2wav-pool", NoRequestsInFlight())]

    # Requests begun after the replicas lingered (trial AS: steady text+audio load held them
    # until the member's drain timeout) do not hold them: the lingering ones never take theirs.
    co.sent.clear()
    co._quiet_since = None
    report(3, began=lingered_at - 0.5)
    now[0] += 5
    report(3, began=lingered_at - 0.5)
    assert co.sent == []  # (one began before)
    report(3, began=lingered_at + 0.5)
    now[0] += coordinator.LINGER_QUIET_S
    report(3, began=lingered_at + 0.5)
    assert co.sent == [("code2wav-pool", NoRequestsInFlight())]


def _pool_of_stage(stage_id: int, name: str, *replicas):
    """A StagePoolActor of stage ``name`` with ``replicas`` (healthy), whose sends are recorded
    and whose launches add a PENDING replica by name: ``(pool, sent, launched)``."""
    from types import SimpleNamespace

    from omni_actors.actors.stage_pool import Replica, StagePoolActor
    from omni_actors.actors.supervision import ReplicaHealth
    from omni_actors.balancing import least_loaded
    from omni_actors.messages import ReplicaState

    pool = StagePoolActor()
    pool._started.set()
    sent, launched = [], []
    pool.send = lambda address, message: sent.append((address, message))
    pool._coordinator, pool._policy = "coordinator", least_loaded
    pool._spec = SimpleNamespace(stage=SimpleNamespace(stage_id=stage_id, name=name),
                                 supervision=SimpleNamespace(max_task_attempts=3, queue_timeout_s=20,
                                                             max_task_crashes=2))
    pool._replicas = {r.replica: r for r in replicas}
    for r in replicas:
        r.health = ReplicaHealth(last_heartbeat=0.0, progress_at=0.0)
    pool._launch = lambda rid, *a: (launched.append(rid), pool._replicas.__setitem__(
        rid, Replica(rid, None, state=ReplicaState.PENDING)))
    pool._new_replica_id = lambda: f"{name}/{len(pool._replicas)}"
    return pool, sent, launched


def test_a_second_drain_a_scale_and_an_engine_death_while_draining_keep_the_stage_its_size():
    """A code review: (1) a second DrainNode of a node whose last ready replica lingers (the
    member's leave after `node drain`) launched a second replacement; (2) `stage scale 1`
    counted the lingering replica and its replacement, and retired the replacement: none
    was left once the lingering one went; (3) a draining replica whose engine died went
    FAILED, and was started again after failed_retry_s."""
    from types import SimpleNamespace

    from omni_actors.actors.stage_pool import Replica
    from omni_actors.messages import AdminReply, DrainNode, EngineFailed, ReplicaState, ScaleStage

    rep = Replica("talker/0", "e0", state=ReplicaState.READY, node="m1")
    pool, sent, launched = _pool_of_stage(1, "talker", rep)
    pool.receiveMsg_DrainNode(DrainNode("m1", operator=True), "coordinator")
    pool.receiveMsg_DrainNode(DrainNode("m1"), "coordinator")  # (its member leaves)
    assert launched == ["talker/1"] and rep.linger
    pool.receiveMsg_ScaleStage(ScaleStage("talker", 1), "cli")
    assert sent[-1] == ("cli", AdminReply(True, "talker: 1 -> 1 replicas")) and launched == ["talker/1"]
    assert pool._replicas["talker/1"].state == ReplicaState.PENDING

    other = pool._replicas["talker/1"]
    other.state, other.address, other.reason = ReplicaState.DRAINING, "e1", "scaled down"
    pool._set_down = lambda *a: (_ for _ in ()).throw(AssertionError("not FAILED"))
    pool.receiveMsg_EngineFailed(EngineFailed("talker/1", "engine core died"), "e1")
    assert other.state == ReplicaState.DRAINING and "its engine died while it drained" in other.reason
    pool.receiveMsg_ChildActorExited(SimpleNamespace(childAddress="e1"), "e1")
    assert other.state == ReplicaState.STOPPED


def test_a_drained_replica_that_stopped_answering_is_stopped_and_its_finished_tasks_handed_back():
    """A code review: a replica frozen and then drained with no task in flight was never
    checked again (only draining replicas with tasks were): `draining` for ever, its devices
    held. Silent past its missed heartbeats and the time its engine gets to stop (when it
    sends none), it is killed, and the tasks it finished lately are handed back, as a dead
    replica's are (one killed or lost while it drained left their requests waiting for
    their deadline)."""
    from types import SimpleNamespace

    from omni_actors.actors.stage_pool import Replica
    from omni_actors.actors.supervision import HealthPolicy
    from omni_actors.messages import DrainReplica, ErrorKind, ReplicaState, StageFailed, StageTask

    frozen = Replica("talker/0", "e0", state=ReplicaState.DRAINING, reason="drained on request")
    pool, sent, launched = _pool_of_stage(1, "talker", frozen)
    pool._health = HealthPolicy(heartbeat_interval_s=1.0, missed_heartbeats=3)
    pool._spec.heartbeat_interval_s = 1.0
    for name in ("_run_lost_timers", "_cancel_overdue", "_retry_placements", "_refuse_pending_if_none_comes",
                 "_wind_down_if_orphaned", "_publish"):
        setattr(pool, name, lambda *a: None)
    pool._finished_window_s = 60.0
    killed = []
    pool._kill = lambda rep: killed.append(rep.replica) or True
    task = StageTask("r1", 1, "hi", (), {}, {}, "audio", False, "ra-1")
    frozen.finished[("r1", 1)] = (task, time.monotonic())
    limit = pool._drain_exit_s()  # (3 missed beats and one more, the 10 s its engine gets to stop, its exit)
    assert limit > 4 + 10
    frozen.health.last_heartbeat = time.monotonic() - limit + 2  # (stopping its engine: no heartbeats)
    pool._tick()
    assert killed == [] and sent[-1] == ("e0", DrainReplica("talker/0"))
    frozen.health.last_heartbeat = time.monotonic() - 30
    pool._tick()
    assert killed == ["talker/0"] and frozen.reason == "no heartbeat for 30 s while draining (drained on request)"
    pool._tick()  # (killed: not again before its exit is heard of)
    assert killed == ["talker/0"] and frozen.reason == "no heartbeat for 30 s while draining (drained on request)"
    (handed,) = [m for a, m in sent if isinstance(m, StageFailed)]
    assert (handed.request_id, handed.kind) == ("r1", ErrorKind.UNAVAILABLE) and "right after this task" in \
        handed.message
    pool.receiveMsg_ChildActorExited(SimpleNamespace(childAddress="e0"), "e0")
    assert frozen.state == ReplicaState.STOPPED and launched == []

    # one killed while it drained (the OOM killer): its finished tasks handed back when it is gone
    dying = Replica("talker/1", "e1", state=ReplicaState.DRAINING, reason="scaled down")
    pool._replicas["talker/1"] = dying
    dying.finished[("r2", 1)] = (dataclasses.replace(task, request_id="r2"), time.monotonic())
    pool._gone(dying, "process exited (killed by SIGKILL)")
    assert dying.state == ReplicaState.STOPPED and [m.request_id for a, m in sent if isinstance(m, StageFailed)] \
        == ["r1", "r2"]
    clean = Replica("talker/2", "e2", state=ReplicaState.DRAINING, reason="scaled down")
    pool._replicas["talker/2"] = clean
    clean.finished[("r3", 1)] = (dataclasses.replace(task, request_id="r3"), time.monotonic())
    pool._gone(clean, "process exited (exit status 0)", exited_cleanly=True)  # (its results went out first)
    assert clean.state == ReplicaState.STOPPED and len([m for a, m in sent if isinstance(m, StageFailed)]) == 2
    # drained while it started, and never ready (no heartbeat yet): stopped at its ready deadline
    loading = Replica("talker/3", "e3", state=ReplicaState.DRAINING, reason="scaled down")
    pool._replicas["talker/3"] = loading
    pool._spec.ready_timeout_s = 300
    pool._on_timer(("ready_deadline", "talker/3", "e3"))
    assert killed[-1] == "talker/3" and loading.reason.startswith("did not become ready within 300 s while draining")


def test_tasks_waiting_for_a_replica_get_their_503_once_none_is_on_its_way():
    """A code review: tasks queued for a starting replica waited out queue_timeout_s (20 s
    here) after it failed to load, while a new task got its 503 at once."""
    from omni_actors.actors.stage_pool import Replica
    from omni_actors.messages import ErrorKind, ReplicaState, StageFailed, StageTask

    rep = Replica("talker/0", "e0", state=ReplicaState.STARTING)
    pool, sent, _ = _pool_of_stage(1, "talker", rep)
    pool.receiveMsg_StageTask(StageTask("r1", 1, "", (), {}, {}, "audio", False, "ra"), "ra")
    assert len(pool._pending) == 1 and sent == []
    pool._refuse_pending_if_none_comes()
    assert len(pool._pending) == 1 and sent == []  # (it is still on its way)
    rep.state, rep.reason = ReplicaState.FAILED, "cannot load: no such model directory"
    pool._refuse_pending_if_none_comes()
    (address, failed), = sent
    assert address == "ra" and isinstance(failed, StageFailed) and failed.kind == ErrorKind.UNAVAILABLE
    assert failed.message == ("no ready replica of stage talker (talker/0 failed: cannot load: no such model "
                              "directory)") and pool._pending == []


def test_an_orphaned_pool_hands_the_tasks_of_a_dead_engine_back_to_their_request_actors():
    """A code review: a pool whose coordinator was lost only drains; the tasks of an engine
    that died there were routed to its other replicas, which refuse new work: a 503. They go
    back to their RequestActors now, the dead replica named, to be sent to the new pool."""
    from omni_actors.actors.stage_pool import Replica
    from omni_actors.messages import EngineFailed, ErrorKind, ReplicaState, StageFailed, StageTask

    task = StageTask("r1", 1, "", (), {}, {}, "audio", False, "ra")
    dead = Replica("talker/0", "e0", state=ReplicaState.READY)
    dead.in_flight[("r1", 1)] = (task, time.monotonic())
    pool, sent, _ = _pool_of_stage(1, "talker", dead, Replica("talker/1", "e1", state=ReplicaState.READY))
    pool._spec.supervision.max_task_crashes = 2
    pool._orphaned, pool._finished_window_s = True, 1.0
    pool.receiveMsg_EngineFailed(EngineFailed("talker/0", "engine core died"), "e0")
    assert not [m for _, m in sent if isinstance(m, StageTask)]
    (address, failed), = [(a, m) for a, m in sent if isinstance(m, StageFailed)]
    assert address == "ra" and (failed.replica, failed.kind, failed.crashed) == (
        "talker/0", ErrorKind.UNAVAILABLE, ("talker/0",))
    assert "its pool's coordinator was lost" in failed.message


def test_the_last_ready_replicas_on_a_leaving_node_linger_until_released_or_undrained():
    """Trial AP: draining the only node with a ready Code2Wav stopped its idle replicas at
    once, and a request still upstream then found none. They linger now: ready, routed to,
    not told to drain, until the coordinator says no request is in flight, a replacement
    is ready, or the operator undrains the node."""
    from omni_actors.actors.stage_pool import Replica, StagePoolActor
    from omni_actors.messages import (DrainNode, DrainReplica, EngineReady, NodesChanged, NoRequestsInFlight,
                                      ReleasePlacement, ReplicaState, StageFailed, StageTask)

    def pool_with(*replicas: Replica) -> tuple[StagePoolActor, list]:
        return _pool_of_stage(2, "code2wav", *replicas)[:2]

    ready = ReplicaState.READY
    pool, sent = pool_with(Replica("code2wav/0", "e0", state=ready, node="m1"),
                           Replica("code2wav/1", "e1", state=ready, node="m1"))
    pool.receiveMsg_DrainNode(DrainNode("m1"), "coordinator")
    reps = pool._replicas
    assert [reps[r].state for r in ("code2wav/0", "code2wav/1")] == [ready, ready]
    assert "the last ready replica of stage code2wav" in reps["code2wav/0"].reason
    assert not [m for _, m in sent if isinstance(m, DrainReplica)]
    assert [r.lingering for r in sent[-1][1].replicas if r.replica.endswith(("/0", "/1"))] == [True, True]
    assert "it finishes the requests begun before, and takes no new ones" in reps["code2wav/0"].reason
    pool.receiveMsg_StageTask(StageTask("r1", 2, "", (), {}, {}, "audio", False, "ra",
                                        began_at=reps["code2wav/0"].linger_since - 1), "ra")
    assert [a for a, m in sent if isinstance(m, StageTask)] in (["e0"], ["e1"])  # it takes the task
    busy = next(r for r in reps.values() if r.in_flight)
    # A request begun after they lingered (trial AS: cut off when the member left) waits for the
    # replacement, which is starting; with none on its way, it gets a 503 at once.
    sent.clear()
    late = StageTask("r2", 2, "", (), {}, {}, "audio", False, "ra", began_at=reps["code2wav/0"].linger_since + 1)
    pool.receiveMsg_StageTask(late, "ra")
    assert not [m for _, m in sent if isinstance(m, (StageTask, StageFailed))] and len(pool._pending) == 1
    pool._pending.clear()
    replacements = {r.replica: r.state for r in reps.values() if r.node != "m1"}
    for name in replacements:
        reps[name].state = ReplicaState.STOPPED
    pool.receiveMsg_StageTask(late, "ra")
    failed = [m for _, m in sent if isinstance(m, StageFailed)]
    assert len(failed) == 1 and failed[0].message.startswith("no replica of stage code2wav takes new requests ("), \
        failed
    for name, state in replacements.items():
        reps[name].state = state
    sent.clear()
    pool.receiveMsg_NoRequestsInFlight(NoRequestsInFlight(), "coordinator")  # the idle one drains
    assert [m.replica for _, m in sent if isinstance(m, DrainReplica)] == [
        r for r in ("code2wav/0", "code2wav/1") if r != busy.replica]
    assert busy.state == ready and busy.linger
    # the replacement gets ready: the busy one drains too (once its task is done)
    replacement = reps["code2wav/2"]
    replacement.state, replacement.address = ReplicaState.STARTING, "e2"
    pool.receiveMsg_EngineReady(EngineReady("code2wav/2", 7, "m2", "stale-engine"), "e-old")  # (not its engine)
    assert replacement.state == ReplicaState.STARTING
    pool.receiveMsg_EngineReady(EngineReady("code2wav/2", 7, "m2", "synthetic"), "e2")
    assert busy.state == ReplicaState.DRAINING and not busy.linger

    # With a ready replica elsewhere, a node's replicas drain at once, as before.
    pool, sent = pool_with(Replica("code2wav/0", "e0", state=ready, node="m1"),
                           Replica("code2wav/1", "e1", state=ready, node="m2"))
    pool.receiveMsg_DrainNode(DrainNode("m1"), "coordinator")
    assert [m.replica for _, m in sent if isinstance(m, DrainReplica)] == ["code2wav/0"]

    # An operator's undrain keeps a lingering replica, as a ready one.
    pool, sent = pool_with(Replica("code2wav/0", "e0", state=ready, node="m1"))
    pool.receiveMsg_DrainNode(DrainNode("m1", operator=True), "coordinator")
    pool._retry_placements = lambda: None
    pool.receiveMsg_NodesChanged(NodesChanged(undrained="m1"), "coordinator")
    pool.receiveMsg_NoRequestsInFlight(NoRequestsInFlight(), "coordinator")
    assert pool._replicas["code2wav/0"].state == ready and not pool._replicas["code2wav/0"].linger
    assert not [m for _, m in sent if isinstance(m, DrainReplica)]
    # ... and its replacement, not placed yet, is not needed (trial AW: a drain and an undrain
    # 0.5 s apart doubled every stage): stopped, its placement released; one starting drains
    replacement = pool._replicas["code2wav/1"]
    assert replacement.state == ReplicaState.STOPPED, replacement
    assert replacement.reason == "not needed: code2wav/0, which it was to replace, stays (node m1 undrained)"
    assert ("coordinator", ReleasePlacement("code2wav/1")) in sent
    pool, sent = pool_with(Replica("code2wav/0", "e0", state=ready, node="m1"))
    pool.receiveMsg_DrainNode(DrainNode("m1", operator=True), "coordinator")
    pool._replicas["code2wav/1"] = Replica("code2wav/1", "e1", state=ReplicaState.STARTING, node="m2")
    pool._retry_placements = lambda: None
    pool.receiveMsg_NodesChanged(NodesChanged(undrained="m1"), "coordinator")
    assert pool._replicas["code2wav/1"].state == ReplicaState.DRAINING
    assert ("e1", DrainReplica("code2wav/1")) in sent
    assert [r.state for r in pool._replicas.values()].count(ready) == 1


def test_a_stop_tells_every_pool_its_replicas_exits_are_planned_before_anything_exits():
    """CI: at a leader stop, member-side replicas' exits were logged as crashes. Thespian's
    admin reports every remote child exited as soon as the system shuts down, and that could
    reach a pool before its own exit request. The coordinator now answers ShutdownSystem
    (and tells the pools to exit) only once each pool has noted the stop, or after
    PLANNED_STOP_WAIT_S; a pool that has noted it logs a replica's exit at info, and neither
    restarts it nor re-runs its work as after a crash."""
    from types import SimpleNamespace

    from thespian.actors import ActorExitRequest, WakeupMessage

    from omni_actors.actors import coordinator
    from omni_actors.actors.stage_pool import Replica, StagePoolActor
    from omni_actors.messages import (ErrorKind, PlannedStop, PlannedStopNoted, ReplicaState, ShutdownSystem,
                                      StageFailed, StageTask)

    co = coordinator.CoordinatorActor()
    co.sent, wakeups = [], []
    co.send = lambda address, message: co.sent.append((address, type(message).__name__))
    co.wakeupAfter = lambda delay, payload=None: wakeups.append((delay, payload))
    co._pools = {0: "thinker-pool", 1: "talker-pool"}
    co.receiveMsg_ShutdownSystem(ShutdownSystem(), "leader")
    assert co.sent == [("thinker-pool", "PlannedStop"), ("talker-pool", "PlannedStop")]
    co.receiveMsg_PlannedStopNoted(PlannedStopNoted(0), "thinker-pool")
    assert len(co.sent) == 2  # the talker pool has not noted it yet: nothing exits
    co.receiveMsg_PlannedStopNoted(PlannedStopNoted(1), "talker-pool")
    assert co.sent[2:] == [("thinker-pool", "ActorExitRequest"), ("talker-pool", "ActorExitRequest"),
                           ("leader", "ShutdownDone")]
    # a pool that never answers: the stop goes on at the deadline, once
    co = coordinator.CoordinatorActor()
    co.sent = []
    co.send = lambda address, message: co.sent.append((address, type(message).__name__))
    co.wakeupAfter = lambda delay, payload=None: wakeups.append((delay, payload))
    co._pools = {0: "thinker-pool"}
    co.receiveMsg_ShutdownSystem(ShutdownSystem(), "leader")
    assert wakeups[-1] == (coordinator.PLANNED_STOP_WAIT_S, "planned_stop_deadline")
    co.receiveMsg_WakeupMessage(WakeupMessage(coordinator.PLANNED_STOP_WAIT_S, "planned_stop_deadline"), None)
    co.receiveMsg_PlannedStopNoted(PlannedStopNoted(0), "thinker-pool")  # (late: nothing more)
    assert co.sent == [("thinker-pool", "PlannedStop"), ("thinker-pool", "ActorExitRequest"),
                       ("leader", "ShutdownDone")]

    pool = StagePoolActor()
    sent = []
    pool.send = lambda address, message: sent.append((address, message))
    pool._coordinator = "coordinator"
    pool._spec = SimpleNamespace(stage=SimpleNamespace(stage_id=1, name="talker"))
    pool._replicas = {"talker/1": Replica("talker/1", "e1", state=ReplicaState.READY, node="m1")}
    pool._finished_window_s = 5.0
    launched, logged = [], []
    pool._launch = lambda rid, *a: launched.append(rid)
    pool._log = SimpleNamespace(info=lambda event, **kw: logged.append(("info", event, kw)),
                                error=lambda event, **kw: logged.append(("error", event, kw)))
    task = StageTask("r1", 1, "", (), {}, {}, None, False, "ra", emit_chunks=True)
    pool._replicas["talker/1"].in_flight[("r1", 1)] = (task, 0.0)
    pool.receiveMsg_PlannedStop(PlannedStop(), "co")
    assert ("co", PlannedStopNoted(1)) in sent
    pool._gone(pool._replicas["talker/1"], "process exited")  # (Thespian: its node's system went)
    assert [(level, event, kw["pool_exiting"]) for level, event, kw in logged] == [("info", "replica_exited", True)]
    # stopped with the system, not failed (trial AX: an orderly stop logged every replica as
    # "failed ... not restarted: its pool lost the coordinator")
    rep = pool._replicas["talker/1"]
    assert (rep.state, rep.reason) == (ReplicaState.STOPPED, "stopped with the system") and launched == []
    assert not any(isinstance(m, ActorExitRequest) for _, m in sent)
    # Its task fails with the stop, not as a crash (trial AT: the request of a frozen API server
    # read "replica thinker/0 went down mid-stream (dead: process exited)"); no replica named,
    # so its RequestActor does not retry it.
    failed = [m for a, m in sent if a == "ra"]
    assert failed == [StageFailed("r1", 1, "", ErrorKind.UNAVAILABLE,
                                  "the omni-actors system is stopping: replica talker/1 stopped with it")], failed


def test_a_request_actor_keeps_a_window_of_outputs_to_its_bridge_and_credits_audio_it_has(monkeypatch):
    """Trial AQ: streamed audio went straight to a frozen API server; after Thespian's 20
    transmits in flight, the Thinker chunks the RequestActor relays queued behind them. Now
    at most OUTPUT_WINDOW outputs go unanswered (every third asks the bridge), the rest are
    held in order, Code2Wav is credited only for what the bridge has, a beat asks a silent
    bridge (twice, then every OUTPUT_PROBE_SLOW_S; the other beats pause), and held outputs
    are sent at a success and released at a failure."""
    from types import SimpleNamespace

    from omni_actors.actors import request
    from omni_actors.messages import (ChunkAck, ErrorKind, OutputChunk, OutputReady, OutputsAck, PlannedStage,
                                      RequestActorAlive, RequestFinished, RequestPlan, RunRequest, StageChunk,
                                      StageDone, StageFailed)

    released = []
    monkeypatch.setattr(request, "release_all", lambda refs, recycle=False, wait=True: released.extend(refs))

    def started(window: int = 16) -> tuple[request.RequestActor, list]:
        ra = request.RequestActor()
        sent = []
        ra.send = lambda address, message: sent.append((address, message))
        ra.wakeupAfter = lambda delay, payload=None: None
        ra._myRef = SimpleNamespace(address="ra")
        plan = RequestPlan((PlannedStage(2, "code2wav", (), "pool", "audio", False, emits_chunks=True),))
        ra.receiveMsg_RunRequest(RunRequest("r1", "hi", plan, {}, {}, 60.0, "bridge", stream_outputs=True,
                                            chunk_window=window), "bridge")
        return ra, sent

    def outputs(sent) -> list:
        return [m for a, m in sent if a == "bridge" and isinstance(m, (OutputChunk, OutputReady))]

    ra, sent = started()
    for seq in range(10):
        ra.receiveMsg_StageChunk(StageChunk("r1", 2, seq, f"ref{seq}", 0, last=seq), "engine")
    out = outputs(sent)
    assert [m.seq for m in out] == list(range(request.OUTPUT_WINDOW))
    assert [m.ack_to for m in out] == [None, None, "ra", None, None, "ra"]
    assert not [m for _, m in sent if isinstance(m, ChunkAck)]  # the bridge has none of it yet
    sent.clear()
    ra.receiveMsg_OutputsAck(OutputsAck("r1", 3), "supervisor")  # room for three more, in order
    assert [m.ref for m in outputs(sent)] == ["ref6", "ref7", "ref8"]
    ra.receiveMsg_OutputsAck(OutputsAck("r1", 9), "supervisor")  # 9 of the producer's chunks: credited
    assert [(a, m.upto) for a, m in sent if isinstance(m, ChunkAck)] == [("engine", 9)]
    assert [m.ref for m in outputs(sent)][3:] == ["ref9"]

    # a bridge that does not answer: outputs held, beats ask twice, then pause
    for seq in range(10, 20):
        ra.receiveMsg_StageChunk(StageChunk("r1", 2, seq, f"ref{seq}", 0, last=seq), "engine")
    sent.clear()
    ra._out_heard -= ra._req.alive_every_s
    for _ in range(4):
        ra._beat()
    assert [m.ack_to for _, m in sent if isinstance(m, RequestActorAlive)] == ["ra", "ra"]
    ra._out_probed_at -= request.OUTPUT_PROBE_SLOW_S  # (then one every OUTPUT_PROBE_SLOW_S)
    ra._beat()
    ra._beat()
    assert [m.ack_to for _, m in sent if isinstance(m, RequestActorAlive)] == ["ra", "ra", "ra"]
    held = [ref for _, ref, _ in ra._out_held]
    assert held and set(held) < {f"ref{i}" for i in range(10, 20)}
    # the stage fails: what was held is released, not sent
    sent.clear()
    ra.receiveMsg_StageFailed(StageFailed("r1", 2, "code2wav/0", ErrorKind.ENGINE_ERROR, "boom", 0), "engine")
    assert not outputs(sent) and set(held) <= set(released)
    assert [m.error for _, m in sent if isinstance(m, RequestFinished)] == [ErrorKind.ENGINE_ERROR]

    # a success with outputs held: they all go before the end, which counts them
    ra, sent = started(window=2)  # (a window of 2: every output asks, so the producer is credited)
    for seq in range(8):
        ra.receiveMsg_StageChunk(StageChunk("r1", 2, seq, f"ref{seq}", 0, last=seq), "engine")
    assert all(m.ack_to == "ra" for m in outputs(sent))
    ra.receiveMsg_StageDone(StageDone("r1", 2, "code2wav/0", None, None, chunks=8), "engine")
    assert [m.seq for m in outputs(sent)] == list(range(8))
    assert [m.sent for _, m in sent if isinstance(m, RequestFinished)] == [8]


def test_a_stop_does_not_wait_for_the_drain_of_an_api_server_that_stopped_renewing(monkeypatch):
    """Trial AQ: an attached API server frozen during a stop held the stop for its whole
    drain timeout (16.9 s). A server that has not renewed its subscription (every 2 s) for
    API_DRAIN_SILENT_S is no longer waited for; the answer counts it as silent."""
    from omni_actors.actors import coordinator
    from omni_actors.messages import ApiServerDrained, ApiServersDrained, DrainApiServers, Subscribe

    now = [100.0]
    monkeypatch.setattr(coordinator.time, "monotonic", lambda: now[0])
    co = coordinator.CoordinatorActor()
    co.sent = []
    co.send = lambda address, message: co.sent.append((address, message))
    co.wakeupAfter = lambda delay, payload=None: None
    co._publish_routes = lambda: None
    for server in ("frozen", "healthy"):
        co.receiveMsg_Subscribe(Subscribe(server), server)
    co.receiveMsg_DrainApiServers(DrainApiServers(30.0, 25.0, "leader-bridge"), "leader")
    now[0] += coordinator.API_DRAIN_SILENT_S / 2
    co.receiveMsg_Subscribe(Subscribe("healthy"), "healthy")  # (draining, it still renews)
    now[0] += coordinator.API_DRAIN_SILENT_S / 2 + 0.5
    co._check_api_drain()
    assert co._api_drain is not None and co._api_drain.left == ["healthy"]
    co.receiveMsg_ApiServerDrained(ApiServerDrained("healthy", 0), "healthy")
    answers = [m for a, m in co.sent if a == "leader"]
    assert answers == [ApiServersDrained(told=2, late=0, ended=0, silent=1)]


def test_a_stage_task_says_whether_another_stage_of_its_request_takes_its_outputs():
    """``StageTask.feeds``: what lets a lingering replica go while text-only requests run."""
    from types import SimpleNamespace

    from omni_actors.actors.request import RequestActor
    from omni_actors.messages import PlannedStage, RequestPlan, RunRequest, StageTask

    def first_task(*stages: PlannedStage) -> StageTask:
        ra = RequestActor()
        sent = []
        ra.send = lambda address, message: sent.append(message)
        ra.wakeupAfter = lambda delay, payload=None: None
        ra._myRef = SimpleNamespace(address="ra")
        ra.receiveMsg_RunRequest(RunRequest("r1", "hi", RequestPlan(stages), {}, {}, 60.0, "bridge"), "bridge")
        return next(m for m in sent if isinstance(m, StageTask))

    thinker = PlannedStage(0, "thinker", (), "p0", "text", False, emits_chunks=True)
    assert not first_task(thinker).feeds  # text only
    assert first_task(thinker, PlannedStage(1, "talker", (0,), "p1", None, False)).feeds  # whole outputs
    assert first_task(thinker, PlannedStage(1, "talker", (0,), "p1", None, False, stream_source=0)).feeds


def test_an_admin_says_whether_the_coordinator_was_silent_or_its_system_is_going_away():
    """Trial AR: a member leaving as its leader stopped printed "the coordinator did not
    answer within 5 s" 1.6 s after it asked. The admin now tells a silent coordinator (the
    whole timeout) from one Thespian gave up on early, and from an admin that is gone."""
    import time as _time
    from types import SimpleNamespace

    from omni_actors.system.admin import Admin, AdminError

    def error(ask, alive=None) -> str:
        asys = SimpleNamespace(ask=ask, **({"admin_alive": alive} if alive else {}))
        try:
            Admin(asys, "coordinator").status(timeout_s=0.6)
        except AdminError as exc:
            return str(exc)
        raise AssertionError("no error")

    def silent(*args):
        _time.sleep(0.6)

    assert error(silent) == "the coordinator did not answer within 0.6 s"
    early = error(lambda *a: None)  # (the time it took, 0.0 s when not preempted)
    assert re.match(r"the coordinator could not be reached \(0\.\d s, no answer", early), early
    assert error(lambda *a: None, alive=lambda: False) == \
        "the convention leader's admin no longer listens: its system stopped or was killed"


def test_tasks_queued_behind_tasks_held_by_neighbours_are_no_stall_of_the_replica():
    """Trial AS: a Thinker at its max_concurrency (4), every stream held back by a frozen
    API server (waiting for credits), took one more request: that task waited for a slot,
    the heartbeats counted idle time, and the pool isolated the Thinker as stalled, breaking
    the 4 streams. Tasks queued in the backend behind held tasks are held too; a replica
    whose running tasks are not held still shows its idle time."""
    import time as _time
    from types import SimpleNamespace

    from omni_actors.actors.engine import EngineActor
    from omni_actors.engines.base import BackendLoad

    actor = EngineActor()
    actor._started.set()  # (ends its orphan watchdog thread)
    actor._ready, actor._progress_at = True, _time.monotonic() - 5
    actor._tasks = {(f"r{i}", 0): None for i in range(5)}
    actor._backend = SimpleNamespace(load=lambda: BackendLoad(running=4, waiting=1))
    actor._parked = 4  # the 4 running ones wait for credits; the fifth for a slot
    assert actor._idle_s() == 0.0
    actor._parked = 3  # one running task is not held: the replica should be making progress
    assert actor._idle_s() >= 5
    actor._parked = 0  # stalled with a queue: as before
    actor._backend = SimpleNamespace(load=lambda: BackendLoad(running=1, waiting=4))
    assert actor._idle_s() >= 5


def test_a_starting_replicas_reason_gives_its_engines_phase_from_its_heartbeats():
    """A vLLM replica starts for a minute or more: its heartbeats' ``phase`` shows in its
    ``status`` reason (and the leader's start progress line), after why it was down; a wait
    for devices, when there is one, is shown instead (the engine has not begun to load)."""
    from omni_actors.actors.stage_pool import Replica, StagePoolActor
    from omni_actors.messages import Heartbeat, ReplicaState

    pool = StagePoolActor()
    pool._started.set()
    pool.send = lambda address, message: None
    published = []
    pool._publish = lambda: published.append(pool._replicas["thinker/0"].reason)
    rep = Replica("thinker/0", "engine-address", state=ReplicaState.STARTING, down_cause="engine died: boom")
    pool._replicas = {"thinker/0": rep}

    def beat(**kw):
        pool.receiveMsg_Heartbeat(Heartbeat("thinker/0", 0, 0, 0, 0, pid=42, **kw), "engine-address")

    beat(phase="importing vLLM")
    assert rep.reason == "starting again; it was down: engine died: boom; importing vLLM"
    beat(phase="importing vLLM")
    beat(phase="loading the vLLM engine")
    assert published[-1] == "starting again; it was down: engine died: boom; loading the vLLM engine"
    assert len([r for r in published if r.endswith("importing vLLM")]) == 1  # (news only)
    beat(phase="loading the vLLM engine", waiting_for="device 1 to be freed")
    assert rep.reason == "starting again; it was down: engine died: boom; waiting for device 1 to be freed"


def test_a_pool_shares_sequential_tasks_evenly_with_a_replica_back_from_a_restart():
    """Trial AY: a Talker back after a restart (its counters, tasks sent included, go on)
    beside two new ones took 5 tasks in 12 s where they took 55-70 each."""
    from types import SimpleNamespace

    from omni_actors.actors.stage_pool import Replica, StagePoolActor
    from omni_actors.actors.supervision import ReplicaHealth
    from omni_actors.balancing import least_loaded
    from omni_actors.messages import ReplicaState, StageTask

    pool = StagePoolActor()
    pool._started.set()
    sent = []
    pool.send = lambda address, message: sent.append(address)
    pool._policy = least_loaded
    pool._spec = SimpleNamespace(stage=SimpleNamespace(stage_id=1, name="talker"),
                                 supervision=SimpleNamespace(max_task_attempts=3, queue_timeout_s=20))
    pool._replicas = {r.replica: r for r in (
        Replica("talker/2", "e2", state=ReplicaState.READY, dispatched=700),
        Replica("talker/4", "e4", state=ReplicaState.READY), Replica("talker/5", "e5", state=ReplicaState.READY))}
    for r in pool._replicas.values():
        r.health = ReplicaHealth(last_heartbeat=0.0, progress_at=0.0)
    for i in range(30):
        pool.receiveMsg_StageTask(StageTask(f"r{i}", 1, "", (), {}, {}, "audio", False, "ra"), "ra")
        for r in pool._replicas.values():
            r.in_flight.clear()  # (done before the next)
    assert {a: sent.count(a) for a in ("e2", "e4", "e5")} == {"e2": 10, "e4": 10, "e5": 10}


def test_a_pinned_replica_back_on_its_node_says_why_it_was_down_in_the_past():
    """Trial AY: `ready ... restarted at 23:42:23; it was down: node m2 drained (`node drain`);
    it starts again when the node is undrained`, of a replica running again."""
    import re

    from omni_actors.actors.stage_pool import Replica, StagePoolActor
    from omni_actors.messages import EngineReady, ReplicaState

    pool = StagePoolActor()
    pool._started.set()
    pool.send = lambda address, message: None
    pool._publish = pool._drain_pending = lambda: None
    cause = "node m2 drained (`node drain`); it starts again when the node is undrained"
    rep = Replica("talker/2", "e2", state=ReplicaState.STARTING, down_cause=cause)
    pool._replicas = {"talker/2": rep}
    pool._show_start(rep, "", "importing vLLM")
    # (trial BK: "restarted ...; it was down" of a drain read as a crash: it was placed again)
    assert rep.reason == "starting again; it was stopped: node m2 drained (`node drain`); importing vLLM"
    pool.receiveMsg_EngineReady(EngineReady("talker/2", 7, "m2", "synthetic"), "e2")
    assert rep.state == ReplicaState.READY
    assert re.fullmatch(r"placed again at \d\d:\d\d:\d\d UTC; it was stopped: node m2 drained \(`node drain`\)",
                        rep.reason), rep.reason
    rep = Replica("talker/3", "e3", state=ReplicaState.STARTING, down_cause="node m2 is leaving (replaced by talker/3)")
    pool._replicas = {"talker/3": rep}
    pool.receiveMsg_EngineReady(EngineReady("talker/3", 8, "m1", "synthetic"), "e3")
    assert rep.reason.endswith("; it was stopped: node m2 was leaving (replaced by talker/3)"), rep.reason


def test_a_pool_given_up_is_tried_again_after_failed_retry_s():
    """A code review: a pool that used up its restarts stayed down for good (its replicas
    `failed`, every admin request for its stage refused) where a FAILED replica is tried
    again every ``failed_retry_s``. Now the pool is too, and its status says when."""
    from types import SimpleNamespace

    from thespian.actors import ChildActorExited, WakeupMessage

    from omni_actors.actors.coordinator import CoordinatorActor
    from omni_actors.actors.supervision import RestartPolicy
    from omni_actors.messages import PoolState, ReplicaState, ReplicaStatus

    def coordinator(failed_retry_s: float):
        co = CoordinatorActor()
        co.sent, co.wakeups, co.started = [], [], []
        co.send = lambda address, message: co.sent.append((address, message))
        co.wakeupAfter = lambda delay, payload=None: co.wakeups.append((delay, payload))
        co._publish_status = lambda: None
        co.routes = []
        co._publish_routes = lambda: co.routes.append(co._routes())
        stage = SimpleNamespace(stage_id=1, name="code2wav")
        co._config = SimpleNamespace(deployment=SimpleNamespace(supervision=SimpleNamespace(
            restart=SimpleNamespace(failed_retry_s=failed_retry_s))), stage=lambda stage_id: stage,
                                      stage_args=[stage])
        co._start_pool = lambda st, why=None: (co.started.append(st.name), co._pools.__setitem__(1, "pool-2"))
        co._restart = RestartPolicy(max_restarts=2, window_s=60.0)
        now = time.monotonic()
        # (its budget used up; and a restart long before, outside the window, which the reason
        # counted: a review read "gave up after 8 restarts in 60 s" of a budget of 5)
        co._pools, co._pool_restarts = {1: "pool-1"}, {1: [now - 600, now - 2, now - 1]}
        report = PoolState(1, "code2wav", (ReplicaStatus("code2wav/0", ReplicaState.READY, pid=11),
                                           ReplicaStatus("code2wav/1", ReplicaState.STOPPED, reason="drained")))
        co._states[1] = co._reported[1] = report
        co.receiveMsg_ChildActorExited(ChildActorExited("pool-1"), None)
        return co

    co = coordinator(300.0)
    rows = {r.replica: r for r in co._states[1].replicas}
    assert rows["code2wav/0"].state == ReplicaState.FAILED, rows
    assert "stage pool exited; gave up after 2 restarts in 60 s; next try in 300 s (at " in rows["code2wav/0"].reason
    assert rows["code2wav/1"].state == ReplicaState.STOPPED  # (not failed: it was not meant to run)
    assert co.wakeups == [(300.0, ("restart_pool", 1, 1))]
    assert "next try in 300 s" in co._pool_down("pool-1")  # what `stage scale` and the like answer meanwhile
    # the RequestActors with a task there are told (they waited for their deadlines: a code review)
    assert [r.given_up for r in co.routes] == [((1, co._pools_down[1]),)]
    co.receiveMsg_WakeupMessage(WakeupMessage(300.0, ("restart_pool", 1, 1)), None)
    assert co.started == ["code2wav"] and 1 not in co._pools_down
    assert co.routes[-1].given_up == () and co.routes[-1].pools == {1: "pool-2"}
    co.receiveMsg_WakeupMessage(WakeupMessage(300.0, ("restart_pool", 1, 1)), None)  # (a second one: nothing)
    assert co.started == ["code2wav"]
    # given up again: the wake-up set for the first exit does not restart it early (a code review)
    co._pool_restarts[1] = [time.monotonic()] * 2
    co.receiveMsg_ChildActorExited(ChildActorExited("pool-2"), None)
    assert co.wakeups[-1] == (300.0, ("restart_pool", 1, 2))
    co.receiveMsg_WakeupMessage(WakeupMessage(300.0, ("restart_pool", 1, 1)), None)
    assert co.started == ["code2wav"] and 1 in co._pools_down
    # its wake-up lost (Thespian drops some): the node check restarts it once it is overdue
    co._pool_restart_due[1] = (2, time.monotonic() - 300)
    co._restart_lost_pools()
    assert co.started == ["code2wav", "code2wav"] and 1 not in co._pools_down

    assert "), or at a `stage scale` or `stage launch`" in rows["code2wav/0"].reason

    co = coordinator(0.0)  # failed_retry_s 0: never, as for a replica
    assert co.wakeups == [] and co._states[1].replicas[0].reason == (
        "stage pool exited; gave up after 2 restarts in 60 s; a `stage scale` or `stage launch` starts it again")
    # an operator's `stage scale` starts it at once, and is passed to the new pool
    from omni_actors.messages import ScaleStage
    co.receiveMsg_ScaleStage(ScaleStage("code2wav", 1), "cli")
    assert co.started == ["code2wav"] and 1 not in co._pools_down and co.sent[-1] == ("pool-2", ScaleStage(
        "code2wav", 1, reply_to="cli"))


def test_a_lingering_pinned_replica_counts_for_a_scale():
    """A code review: a pinned replica lingers with no replacement (it starts again on its
    node once undrained), but `stage scale 1` did not count it and launched another: two
    replicas where one was asked for after `node undrain`."""
    from omni_actors.actors.stage_pool import Replica
    from omni_actors.messages import AdminReply, DrainNode, ReplicaState, ScaleStage

    rep = Replica("talker/0", "e0", state=ReplicaState.READY, node="m1")
    pool, sent, launched = _pool_of_stage(1, "talker", rep)
    pool._pins = {"talker/0": ("m1", ("2",))}
    pool.receiveMsg_DrainNode(DrainNode("m1", operator=True), "coordinator")
    assert rep.linger and rep.relaunch and launched == []
    pool.receiveMsg_ScaleStage(ScaleStage("talker", 1), "cli")
    assert sent[-1] == ("cli", AdminReply(True, "talker: 1 -> 1 replicas")) and launched == []


def test_a_stage_whose_only_ready_replicas_linger_is_not_ready():
    """Trial BK: with every Talker lingering on a leaving member (taking no new request),
    `status` said ready and exited 0, `/ready` 200, while new audio requests waited for a
    replacement. A lingering replica counts as ready nowhere now: not in `ready`, not in
    `ready_replicas`, not in `omni_stage_ready_replicas`."""
    from types import SimpleNamespace

    from omni_actors.actors.coordinator import CoordinatorActor
    from omni_actors.http.bridge import status_to_dict
    from omni_actors.http.metrics import Metrics
    from omni_actors.messages import PoolState, ReplicaState, ReplicaStatus

    co = CoordinatorActor()
    co._config = SimpleNamespace(
        stage_args=[SimpleNamespace(stage_id=0, name="thinker"), SimpleNamespace(stage_id=1, name="talker")],
        deployment=SimpleNamespace(served_model_name="m", supervision=SimpleNamespace(drain_timeout_s=30.0),
                                   heartbeat_interval_s=1.0),
        omni_connectors=SimpleNamespace(notes=()))
    co._states = {0: PoolState(0, "thinker", (ReplicaStatus("thinker/0", ReplicaState.READY),)),
                  1: PoolState(1, "talker", (ReplicaStatus("talker/0", ReplicaState.READY, lingering=True),
                                             ReplicaStatus("talker/1", ReplicaState.PENDING)))}
    status = co._status("q")
    assert not status.ready
    table = status_to_dict(status)
    assert [st["ready_replicas"] for st in table["stages"]] == [1, 0]
    text = Metrics().render(table).decode()
    assert 'omni_stage_ready_replicas{stage="talker"} 0.0' in text, text
    co._states[1] = PoolState(1, "talker", (ReplicaStatus("talker/0", ReplicaState.READY, lingering=True),
                                            ReplicaStatus("talker/1", ReplicaState.READY)))
    assert co._status("q").ready


def test_an_earlier_attempts_end_leaves_the_later_attempt_in_flight_on_the_same_replica():
    """A code review: a streaming consumer started over as attempt 1 on the replica where its
    attempt 0 was being cancelled; attempt 0's TaskFinished took attempt 1's in-flight entry,
    so the request's final cancel found nothing to pass on, and the replica's death would not
    have moved it."""
    from types import SimpleNamespace

    from omni_actors.messages import TaskFinished

    pool, rep = _pool_with_one_replica()
    rep.in_flight[("r1", 2)] = (SimpleNamespace(request_id="r1", stage_id=2, attempt=1, reply_to="ra"), 0.0)
    pool.receiveMsg_TaskFinished(TaskFinished("thinker/0", "r1", 2, ok=False, cancelled=True, attempt=0), "engine")
    assert ("r1", 2) in rep.in_flight
    pool.receiveMsg_TaskFinished(TaskFinished("thinker/0", "r1", 2, ok=True, attempt=1), "engine")
    assert rep.in_flight == {} and rep.completed == 1


def test_a_late_cancel_of_an_earlier_attempt_still_reaches_it_and_spares_the_later_one():
    """A code review: a later attempt of a task on the same replica took the earlier one's
    place in the engine's tasks, and a cancel of the earlier attempt that came after it
    found nothing to cancel: the earlier attempt ran on (an abandoned consumer)."""
    import asyncio
    from types import SimpleNamespace

    from omni_actors.actors.engine import EngineActor
    from omni_actors.messages import StageTask

    actor = EngineActor()
    actor._started.set()  # (ends its orphan watchdog thread)
    sent = []
    actor._spec = SimpleNamespace(replica="code2wav/0", stage=SimpleNamespace(name="code2wav"))
    actor._pool = "pool"

    async def execute(msg):  # runs until cancelled
        await asyncio.get_running_loop().create_future()

    async def abort(request_id):
        return None

    actor._execute = execute
    actor._backend = SimpleNamespace(abort=abort)

    async def main():
        actor._rt = SimpleNamespace(emit=lambda address, message, **kw: sent.append(message),
                                    loop=asyncio.get_running_loop())
        task = StageTask("r1", 2, "hi", (), {}, {}, None, False, "ra", stream_source=1)
        first = asyncio.ensure_future(actor._run_task(task))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(actor._run_task(dataclasses.replace(task, attempt=1)))
        await asyncio.sleep(0)
        actor._cancel("r1", 2, 0, asked=True)  # (late: attempt 1 runs here already)
        await asyncio.sleep(0.01)
        assert first.done() and not second.done()
        actor._cancel("r1", 2, None, asked=True)  # (the request is over)
        await asyncio.gather(first, second, return_exceptions=True)
        assert not actor._superseded and not actor._tasks

    asyncio.run(main())
    assert [(type(m).__name__, m.attempt) for m in sent if type(m).__name__ == "StageCancelled"] == [
        ("StageCancelled", 0), ("StageCancelled", 1)]


def test_a_pool_recreated_during_a_node_drain_keeps_the_stage_its_size():
    """A code review: a pool (or the coordinator) recreated while a drained node's last ready
    replica lingered started it again beside its replacement (one replica too many, for
    good); a pinned replica draining off its node, to start there again, was left out (one
    too few after `node undrain`)."""
    from omni_actors.actors.coordinator import CoordinatorActor
    from omni_actors.messages import PoolState, ReplicaState, ReplicaStatus

    co = CoordinatorActor()
    co._reported[1] = PoolState(1, "talker", (
        ReplicaStatus("talker/0", ReplicaState.READY, node="m1", lingering=True),  # (replaced by talker/1)
        ReplicaStatus("talker/1", ReplicaState.PENDING),
        ReplicaStatus("talker/2", ReplicaState.READY, node="m1", lingering=True, pin=("m1", ("2",)), relaunch=True),
        ReplicaStatus("talker/3", ReplicaState.DRAINING, node="m1", pin=("m1", ("3",)), relaunch=True),
        ReplicaStatus("talker/4", ReplicaState.DRAINING, node="m2", reason="scaled down"),
        ReplicaStatus("talker/5", ReplicaState.STOPPED)))
    assert [rid for rid, *_ in co._layout(1)] == ["talker/1", "talker/2", "talker/3"]


def test_scaling_or_draining_a_pinned_replica_off_a_drained_node_sticks():
    """A code review: a pinned replica drained off its node (lingering or draining, to start
    there again once undrained) came back after `stage scale 0` or `stage drain`, and a
    draining one was not counted by `stage scale 2` (three replicas after undrain)."""
    from omni_actors.actors.stage_pool import Replica
    from omni_actors.messages import AdminReply, DrainReplica, ReplicaState, ScaleStage

    pinned = Replica("talker/0", "e0", state=ReplicaState.DRAINING, node="m1")
    pinned.relaunch = True
    other = Replica("talker/1", "e1", state=ReplicaState.READY, node="m2")
    pool, sent, launched = _pool_of_stage(1, "talker", pinned, other)
    pool._pins = {"talker/0": ("m1", ("2",))}
    pool.receiveMsg_ScaleStage(ScaleStage("talker", 2), "cli")
    assert sent[-1] == ("cli", AdminReply(True, "talker: 2 -> 2 replicas")) and launched == []
    pool.receiveMsg_ScaleStage(ScaleStage("talker", 1), "cli")
    assert not pinned.relaunch and pinned.state == ReplicaState.DRAINING, pinned  # (retired: it stays off)

    lingering = Replica("talker/0", "e0", state=ReplicaState.READY, node="m1")
    lingering.relaunch, lingering.linger = True, "node m1 drained (`node drain`)"
    pool, sent, launched = _pool_of_stage(1, "talker", lingering)
    pool._pins = {"talker/0": ("m1", ("2",))}
    pool.receiveMsg_DrainReplica(DrainReplica("talker/0"), "cli")
    assert lingering.state == ReplicaState.DRAINING and not lingering.relaunch and not lingering.linger


def _a_listening_and_a_closed_port():
    """``(listening socket, a port nobody listens on, at)``: ``at(port)`` is a Thespian-like
    address of that loopback port (``addressDetails.connectArgs``)."""
    import socket
    from types import SimpleNamespace

    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen(8)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    gone_port = closed.getsockname()[1]
    closed.close()

    def at(port):
        return SimpleNamespace(addressDetails=SimpleNamespace(connectArgs=[("127.0.0.1", port)]))

    return listening, gone_port, at


def test_a_request_actor_whose_api_server_is_gone_cancels_its_request():
    """Trial BM: an API server killed with SIGKILL mid-stream left its requests' stages
    stalled (their text deltas unacknowledged), holding engine slots until the deadline (120
    s). The RequestActor's beat finds the server's address refusing connections (a frozen
    server's still accepts: not cancelled) and cancels the request."""

    from omni_actors.actors.supervision import refuses_connections
    from omni_actors.messages import CancelStage, ErrorKind, PlannedStage, RequestFinished

    listening, gone_port, at = _a_listening_and_a_closed_port()
    try:
        assert refuses_connections(at(gone_port)) and not refuses_connections(at(listening.getsockname()[1]))
        assert not refuses_connections("no-address")

        import pytest
        monkeypatch = pytest.MonkeyPatch()
        try:
            for port, cancelled in ((listening.getsockname()[1], False), (gone_port, True)):
                ra, sent = _running_request_actor(
                    monkeypatch, (PlannedStage(0, "thinker", (), "pool-thinker", "text", False),))
                ra._req = dataclasses.replace(ra._req, reply_to=at(port))
                ra._started -= ra._req.alive_every_s
                ra._beat()
                finished = [m for _, m in sent if isinstance(m, RequestFinished)]
                assert bool(finished) == cancelled, sent
                if cancelled:
                    assert finished[0].error == ErrorKind.CANCELLED and "its API server is gone" in finished[0].message
                    assert ("pool-thinker", CancelStage("r1", 0)) in sent
        finally:
            monkeypatch.undo()
    finally:
        listening.close()


def test_a_pinned_replica_drained_off_its_node_starts_again_there():
    """A code review of the change above: a node's drain (and a lingering replica's end)
    went through the same drain as an operator's, which now cleared the pinned replica's
    relaunch: it stopped for good, and the stage stayed one short after `node undrain`."""
    from types import SimpleNamespace

    from omni_actors.actors.stage_pool import Replica
    from omni_actors.messages import DrainNode, NoRequestsInFlight, ReplicaState

    for alone in (False, True):  # (with another ready replica elsewhere; as the last, lingering first)
        pinned = Replica("talker/0", "e0", state=ReplicaState.READY, node="m1")
        others = () if alone else (Replica("talker/1", "e1", state=ReplicaState.READY, node="m2"),)
        pool, sent, launched = _pool_of_stage(1, "talker", pinned, *others)
        pool._pins = {"talker/0": ("m1", ("2",))}
        pool.receiveMsg_DrainNode(DrainNode("m1", operator=True), "coordinator")
        if alone:
            assert pinned.linger and pinned.state == ReplicaState.READY
            pool.receiveMsg_NoRequestsInFlight(NoRequestsInFlight(), "coordinator")
        assert pinned.state == ReplicaState.DRAINING and pinned.relaunch, pinned
        pool.receiveMsg_ChildActorExited(SimpleNamespace(childAddress="e0"), "e0")
        assert launched == ["talker/0"], (alone, launched, pinned)


def test_a_dead_pools_replicas_show_no_load_and_a_silent_pools_replicas_age():
    """A code review: replicas whose pool died kept their rate, KV usage and heartbeat age in
    the metrics for the whole restart back-off (up to failed_retry_s once given up); a frozen
    pool's last report served every scrape with heartbeat ages near 0."""
    from types import SimpleNamespace

    from thespian.actors import ChildActorExited

    from omni_actors.actors.coordinator import CoordinatorActor
    from omni_actors.http.bridge import status_to_dict
    from omni_actors.http.metrics import Metrics
    from omni_actors.messages import PoolState, ReplicaState, ReplicaStatus

    co = CoordinatorActor()
    co.send = co.wakeupAfter = lambda *a, **k: None
    co._publish_status = lambda: None
    co._config = SimpleNamespace(
        stage_args=[SimpleNamespace(stage_id=1, name="talker")],
        deployment=SimpleNamespace(served_model_name="m", supervision=SimpleNamespace(drain_timeout_s=30.0),
                                   heartbeat_interval_s=1.0),
        omni_connectors=SimpleNamespace(notes=()))
    co._restart = SimpleNamespace(next_delay=lambda restarts, now: 1.0)
    co._pools, co._pool_restarts = {1: "pool-1"}, {1: []}
    busy = ReplicaStatus("talker/0", ReplicaState.READY, pid=11, rate=150.0, kv_cache_usage=0.8,
                         last_heartbeat_age_s=0.4)
    co._states[1] = co._reported[1] = PoolState(1, "talker", (busy,))
    co._pool_heard[1] = time.monotonic() - 0.5  # (between two reports: trial CK read the same age at each scrape)
    assert 0.9 <= co._status("q").stages[0].replicas[0].last_heartbeat_age_s < 2.0
    co._pool_heard[1] = time.monotonic() - 5.0  # (frozen 5 s)
    assert co._status("q").stages[0].replicas[0].last_heartbeat_age_s >= 5.0
    co.receiveMsg_ChildActorExited(ChildActorExited("pool-1"), None)
    text = Metrics().render(status_to_dict(co._status("q"))).decode()
    assert 'omni_replica_rate{replica="talker/0",stage="talker"} 0.0' in text, text
    assert "omni_replica_kv_cache_usage{" not in text and "omni_replica_last_heartbeat_age_seconds{" not in text


def test_a_reason_with_a_lone_surrogate_does_not_fail_the_scrape():
    """A code review: an engine error naming a file with bad bytes (a lone surrogate in
    Python) in a replica's reason made every `/metrics` scrape a 500."""
    from omni_actors.http.metrics import Metrics

    table = {"stages": [{"stage": "talker", "pending": 0, "restarts": 0, "ready_replicas": 0, "replicas": [
        {"replica": "talker/0", "state": "failed", "reason": "cannot open /models/bad\udc80name"}]}]}
    text = Metrics().render(table).decode()
    assert 'reason="cannot open /models/bad\\\\udc80name"' in text, text


def test_a_replicas_info_label_has_no_clock_times_or_countdowns():
    """Trial CK: `omni_replica_info`'s reason carried "restarted at 17:53:48 UTC" and "restarting
    in 8 s": a new series at each restart and each second of a back-off. `status` keeps them."""
    from omni_actors.http.metrics import Metrics

    reasons = {"talker/0": "restarted at 17:53:48 UTC; it was down: process exited (killed by SIGKILL)",
               "talker/1": "process exited (exit status 1); restarting in 8 s",
               "talker/2": "engine failed: no such model; next try in 60 s (at 17:54:48 UTC)",
               "talker/3": "failed: gave up after 5 restarts in 300 s"}  # (a window, not a countdown: kept)
    table = {"stages": [{"stage": "talker", "pending": 0, "restarts": 0, "replicas": [
        {"replica": name, "state": "dead", "reason": reason} for name, reason in reasons.items()]}]}
    text = Metrics().render(table).decode()
    for label in ('reason="restarted; it was down: process exited (killed by SIGKILL)"',
                  'reason="process exited (exit status 1); restarting"',
                  'reason="engine failed: no such model; next try"', 'reason="failed: gave up after 5 restarts in 300 s"'):
        assert label in text, text


def test_a_request_actor_asks_for_the_answer_that_credits_its_producers_when_none_was_asked(monkeypatch):
    """A code review: outputs ask the API server for an answer only every OUTPUT_ACK_EVERY, and
    with merged chunks the last producer could be out of credit with no answer asked for: the
    chain blocked until the deadline. The beat asks while outputs wait to credit producers."""
    from omni_actors.messages import PlannedStage, RequestActorAlive

    ra, sent = _running_request_actor(monkeypatch, (PlannedStage(0, "thinker", (), "pool-thinker", "text", False),))
    ra._out_credit = [(0, 2, 6)]  # (an output sent, its producer's chunks not yet credited)
    ra._out_heard -= ra._req.alive_every_s
    sent.clear()
    ra._beat()
    alive = [m for _, m in sent if isinstance(m, RequestActorAlive)]
    assert alive and alive[0].ack_to == "ra", sent


def test_a_replica_on_another_host_than_its_pool_drains_itself_only_when_the_pool_is_really_gone():
    """A code review: a replica on a member host decided by late acks alone that its pool
    (on the leader) was gone: a pool busy for 3 s (a burst, `tests/faults/test_busy_pool.py`)
    made every remote replica drain itself and cancel its tasks. Now late acks count only
    with the pool's port refusing connections (its process exited), or past the time its
    coordinator kills a hung pool (POOL_HUNG_INTERVALS, plus 2)."""
    import os
    import time as _time
    from types import SimpleNamespace

    from omni_actors.actors.engine import EngineActor
    from omni_actors.actors.supervision import POOL_HUNG_INTERVALS, ParentWatch

    listening, gone_port, at = _a_listening_and_a_closed_port()

    def beat(pool, silent_s):
        actor = EngineActor()
        actor._started.set()  # (ends its orphan watchdog thread)
        actor._spec = SimpleNamespace(replica="talker/0", heartbeat_interval_s=1.0, orphan_after_s=3.0)
        actor._parent = ParentWatch(os.getpid(), "another-host")  # (not this process's parent)
        actor._pool, actor._last_ack = pool, _time.monotonic() - silent_s
        actor._heartbeats = SimpleNamespace(owns=lambda p: True, current=lambda p: True, again=lambda *a: None)
        actor._check_engine = actor._watch = lambda: None
        actor._deltas = SimpleNamespace(due=lambda: [])
        actor.send = actor.wakeupAfter = lambda *a, **kw: None
        actor.receiveMsg_WakeupMessage(SimpleNamespace(payload="hb"), None)
        return actor._orphaned, actor._draining

    try:
        assert not ParentWatch(os.getpid(), "another-host").local
        assert beat(at(listening.getsockname()[1]), 4.0) == (False, False)  # busy: kept
        assert beat(at(gone_port), 4.0) == (True, True)  # its process exited
        assert beat(at(gone_port), 2.0) == (False, False)  # (acks not late yet)
        hung = POOL_HUNG_INTERVALS + 2
        assert beat(at(listening.getsockname()[1]), hung + 0.5) == (True, True)  # (host cut off, or hung)
    finally:
        listening.close()


def test_a_small_input_on_another_node_is_read_off_the_replicas_event_loop():
    """A code review: a streamed chunk under 1 MiB was read on the engine's event loop,
    also from another node's data service: from a host cut off that read waited its
    timeouts (10 s, then 5 s per chunk) and froze every other stream of the replica, which
    its pool then killed as stalled. A read from another node now runs on a worker thread;
    a local one stays on the loop (no thread hop per chunk)."""
    import asyncio
    import threading
    import time as _time
    from types import SimpleNamespace

    from omni_actors.actors.engine import EngineActor

    actor = EngineActor()
    actor._started.set()  # (ends its orphan watchdog thread)
    loop_thread = []

    def get(ref):
        loop_thread.append(threading.current_thread() is threading.main_thread())
        if ref.node == "far":
            _time.sleep(0.3)
        return {"x": ref.node}

    actor._connector = SimpleNamespace(get=get, reads_remotely=lambda ref: ref.node == "far")

    async def main():
        ticks = []

        async def ticker():
            for _ in range(20):
                ticks.append(_time.monotonic())
                await asyncio.sleep(0.01)

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        far = await actor._fetch(SimpleNamespace(size=1000, node="far", service="10.0.0.9:7002"))
        during = len(ticks)
        here = await actor._fetch(SimpleNamespace(size=1000, node="here"))
        await tick
        return far, here, during

    far, here, during = asyncio.run(main())
    assert far == {"x": "far"} and here == {"x": "here"}
    assert during >= 10  # the loop kept running while the far read waited
    assert loop_thread == [False, True]


def test_a_drained_replica_sends_the_text_it_held_for_a_slow_api_server_before_it_exits():
    """A code review: text deltas held for an API server whose window was full (already
    counted in their tasks' StageDone) went with a drained replica's process: the
    client's stream stopped mid-text for 3 s, then the bridge filled the gap from the
    final text. The exit now sends them first, and waits its grace again."""
    from types import SimpleNamespace

    from thespian.actors import ActorExitRequest

    from omni_actors.actors.engine import EXIT_GRACE_S, EngineActor
    from omni_actors.actors.outbox import DeltaWindow
    from omni_actors.messages import OutputDeltas

    actor = EngineActor()
    actor._started.set()  # (ends its orphan watchdog thread)
    sent, timers = [], []
    actor.send = lambda address, message: sent.append((address, message))
    actor.wakeupAfter = lambda delay, payload=None: timers.append((delay, payload))
    actor._watch = lambda: None
    actor._myRef = SimpleNamespace(address="me")
    actor._deltas = DeltaWindow("me", window=1, ack_every=1)
    assert actor._deltas.admit("bridge", "b", OutputDeltas((OutputDelta("r", "a", 0),))) is not None
    for i, t in enumerate(("b", "c"), start=1):  # (window full: held)
        assert actor._deltas.admit("bridge", "b", OutputDeltas((OutputDelta("r", t, i),))) is None
    actor._draining, actor._tasks = True, {}
    actor.receiveMsg_WakeupMessage(SimpleNamespace(payload="exit"), None)
    (address, message), = sent
    assert address == "bridge" and [d.text for d in message.deltas] == ["b", "c"]
    assert timers == [(EXIT_GRACE_S, "exit")]
    actor.receiveMsg_WakeupMessage(SimpleNamespace(payload="exit"), None)
    assert isinstance(sent[-1][1], ActorExitRequest)


def test_a_replicas_progress_counts_the_tokens_it_made_not_its_events():
    """``rate`` in `status` is tokens (or outputs) per second: a vLLM Thinker's deltas merge
    under load, and a Talker that does not stream makes one event per task (a review: its
    rate read 1-2 while it made thousands of codes a second)."""
    import numpy as np

    from omni_actors.actors.engine import made_units
    from omni_actors.engines.base import OutputChunk, StageFinal, TextDelta

    def progress(events) -> int:
        made, texted = 0, False
        for event in events:
            units = made_units(event, made, texted)
            # (the stall watchdog sees every other event; a text stage's chunks come with its deltas)
            assert units >= 1 or isinstance(event, StageFinal) or texted
            made += units
            texted = texted or isinstance(event, TextDelta)
        return made

    thinker = [TextDelta("Hi", (1, 2, 3)), TextDelta(" there", (4,)), StageFinal({}, 5, num_output_tokens=4)]
    assert progress(thinker) == 4
    assert progress([StageFinal({"codes": [0] * 300}, 4, num_output_tokens=300)]) == 300  # a whole Talker task
    streamed = [OutputChunk({"token_ids": np.arange(8)}), OutputChunk({"codes": [1, 2]}),
                StageFinal({}, 4, num_output_tokens=12)]
    assert progress(streamed) == 12  # (the final's 2 not in a chunk)
    # a streaming Thinker: each token in a delta to the client and again in a chunk to the Talker
    thinker_streaming = [TextDelta("a", (1, 2)), OutputChunk({"token_ids": np.array([1, 2])}), TextDelta("b", (3,)),
                         OutputChunk({"token_ids": np.array([3])}), StageFinal({}, 5, num_output_tokens=3)]
    assert progress(thinker_streaming) == 3  # (a review: it read 6)
    audio = [OutputChunk({"audio": np.zeros(4800)}), OutputChunk({"audio": np.zeros(4800)}),
             StageFinal({"audio": np.zeros(9600)}, 20)]
    assert progress(audio) == 2  # outputs, where no tokens are counted
    assert progress([StageFinal({"image": b""}, 7)]) == 1


def test_at_start_up_a_stage_whose_pool_has_not_reported_is_placed_before_a_second_replica_of_another():
    """Trial BT: thinker x1, talker x3 and code2wav x1 on three devices: the Talker pool asked
    for its replicas before Code2Wav's pool had reported anything, the second Talker took the
    last device, and every audio request waited out queue_timeout_s for a 503. A stage whose
    pool has not reported yet wants its config's replicas: the last device is kept for it."""
    from types import SimpleNamespace

    from omni_actors.actors.coordinator import CoordinatorActor
    from omni_actors.messages import NodesChanged, PlaceReplica, Placement, PlacementFailed, PoolState
    from omni_actors.placement import NodeInfo

    co = CoordinatorActor()
    co.sent = []
    co.send = lambda address, message: co.sent.append((address, message))
    co._inventory.add(NodeInfo("vm", ("0", "1", "2"), ()))
    co._config = SimpleNamespace(stage_by_name=lambda name: name,  # every stage: TP1, any node
                                 deployment_of=lambda stage: SimpleNamespace(devices_per_replica=1, nodes=[]))
    for sid, stage in enumerate(("thinker", "talker", "code2wav")):
        co._states[sid] = PoolState(sid, stage, ())  # (as deployed: nothing reported yet)
    for replica, device in (("thinker/0", "0"), ("talker/0", "1")):
        co.receiveMsg_PlaceReplica(PlaceReplica(replica.split("/")[0], replica, 1, (), ()), "pool")
        assert co.sent[-1] == ("pool", Placement(replica, "vm", (device,)))
    co.receiveMsg_PlaceReplica(PlaceReplica("talker", "talker/1", 1, (), ()), "talker-pool")
    refused = co.sent[-1][1]
    assert isinstance(refused, PlacementFailed) and "kept for stage code2wav" in refused.reason, refused
    co.receiveMsg_PlaceReplica(PlaceReplica("code2wav", "code2wav/0", 1, (), ()), "code2wav-pool")
    # (the refused pool retries at once, no longer refused for code2wav: trial CE's start-up table
    # showed such a reason beside the stage's ready replica until the pool's own retry, 8 ticks on)
    assert co.sent[-2:] == [("code2wav-pool", Placement("code2wav/0", "vm", ("2",))),
                            ("talker-pool", NodesChanged())]
    co.receiveMsg_PlaceReplica(PlaceReplica("talker", "talker/1", 1, (), ()), "talker-pool")
    assert co.sent[-1] == ("talker-pool", PlacementFailed(
        "talker/1", "no node has 1 free device(s) for a talker replica (vm: 0 of 3 devices free)"))


def test_a_pool_refused_for_a_stage_that_then_wants_no_replica_retries_when_that_stage_reports():
    """The devices kept for Code2Wav (no replica running) go to the Talker's pending replica once
    Code2Wav's pool reports its replica failed (it wants none now): the coordinator tells the
    refused pool to retry at that report, not at the pool's own retry 8 heartbeat intervals on."""
    from types import SimpleNamespace

    from omni_actors.actors.coordinator import CoordinatorActor
    from omni_actors.messages import (NodesChanged, PlaceReplica, PlacementFailed, PoolState, ReplicaState,
                                      ReplicaStatus)
    from omni_actors.placement import NodeInfo

    co = CoordinatorActor()
    co.sent = []
    co.send = lambda address, message: co.sent.append((address, message))
    co._publish_status = lambda: None
    co._inventory.add(NodeInfo("vm", ("0", "1"), ()))
    co._config = SimpleNamespace(stage_by_name=lambda name: name,  # every stage: TP1, any node
                                 deployment_of=lambda stage: SimpleNamespace(devices_per_replica=1, nodes=[]))
    co._node_checks_lost = co._answer_deploy_waiters = co._end_lingering = lambda: None  # (not these)
    co._pools = {0: "talker-pool", 1: "code2wav-pool"}
    co._states[1] = PoolState(1, "code2wav", (ReplicaStatus("code2wav/0", ReplicaState.STARTING),))
    co._states[0] = PoolState(0, "talker", ())
    co.receiveMsg_PlaceReplica(PlaceReplica("talker", "talker/0", 1, (), ()), "talker-pool")
    co._states[0] = PoolState(0, "talker", (ReplicaStatus("talker/0", ReplicaState.STARTING, node="vm"),))
    co._states[1] = PoolState(1, "code2wav", (ReplicaStatus("code2wav/0", ReplicaState.PENDING),))
    co.receiveMsg_PlaceReplica(PlaceReplica("talker", "talker/1", 1, (), ()), "talker-pool")
    assert isinstance(co.sent[-1][1], PlacementFailed) and "kept for stage code2wav" in co.sent[-1][1].reason
    co.receiveMsg_PoolState(PoolState(1, "code2wav", (ReplicaStatus("code2wav/0", ReplicaState.FAILED),)),
                            "code2wav-pool")
    assert ("talker-pool", NodesChanged()) in co.sent
    sent = len(co.sent)
    co.receiveMsg_PoolState(PoolState(1, "code2wav", (ReplicaStatus("code2wav/0", ReplicaState.FAILED,
                                                                    reason="again"),)), "code2wav-pool")
    assert ("talker-pool", NodesChanged()) not in co.sent[sent:]  # (told once per refusal)


def test_an_output_whose_answer_would_credit_its_producer_asks_for_it(monkeypatch):
    """A review: outputs ask the bridge for an answer every third one; a busy Code2Wav merged
    its chunks (1, then 15 in one message) and reached its window of 16 between two outputs
    that asked, and the whole chain waited for the RequestActor's next beat (5 s) for its
    credit. An output that would credit its producer (half a window more) asks too."""
    from omni_actors.messages import ChunkAck, OutputChunk, OutputsAck, PlannedStage, StageChunk

    ra, sent = _running_request_actor(monkeypatch, (PlannedStage(2, "code2wav", (), "pool", "audio", False,
                                                                 emits_chunks=True),),
                                      stream_outputs=True, chunk_window=16)
    ra.receiveMsg_StageChunk(StageChunk("r1", 2, 0, "ref0", 0, last=0), "engine")
    ra.receiveMsg_StageChunk(StageChunk("r1", 2, 1, "ref1", 0, last=15), "engine")  # (15 backend chunks merged)
    assert [m.ack_to for a, m in sent if isinstance(m, OutputChunk)] == [None, "ra"]
    ra.receiveMsg_OutputsAck(OutputsAck("r1", 2), "bridge")
    assert [(a, m.upto) for a, m in sent if isinstance(m, ChunkAck)] == [("engine", 16)]


def test_a_dead_replica_shows_only_the_devices_still_reserved_for_it():
    """A review: an unpinned replica killed (SIGKILL) gives its devices back while it waits to
    restart, yet `status` and `omni_replica_info{devices}` showed them held, beside another
    replica placed on them meanwhile. One whose pool exited keeps its reservation: shown."""
    from types import SimpleNamespace

    from omni_actors.actors.coordinator import CoordinatorActor
    from omni_actors.messages import PoolState, ReplicaState, ReplicaStatus
    from omni_actors.placement import NodeInfo

    co = CoordinatorActor()
    co._inventory.add(NodeInfo("m1", ("0", "1", "2"), ()))
    co._config = SimpleNamespace(stage_args=[SimpleNamespace(stage_id=1)], deployment=SimpleNamespace(
        served_model_name="m", heartbeat_interval_s=1.0, supervision=SimpleNamespace(drain_timeout_s=10.0)),
        omni_connectors=SimpleNamespace(notes=[]))
    for replica in ("talker/0", "talker/1"):
        co._inventory.place("talker", replica, 1, ("m1",))
    co._inventory.release("talker/0")  # (its pool's `_gone`: not pinned, its device goes back)
    co._inventory.place("talker", "talker/2", 1, ("m1",))  # (and is given to another)
    dead = ReplicaState.DEAD
    co._states[1] = PoolState(1, "talker", (ReplicaStatus("talker/0", dead, node="m1", devices="0"),
                                            ReplicaStatus("talker/1", dead, node="m1", devices="1"),
                                            ReplicaStatus("talker/2", ReplicaState.STARTING, node="m1", devices="0")))
    co._pool_heard[1] = time.monotonic()
    rows = {r.replica: r for r in co._status("q").stages[0].replicas}
    assert (rows["talker/0"].devices, rows["talker/1"].devices, rows["talker/2"].devices) == ("", "1", "0")


def test_a_stage_done_after_its_task_went_out_twice_cancels_the_other_copy(monkeypatch):
    """A review: a stage's task can run twice (the RequestActor's retry beside its pool's own
    re-dispatch off a replica its breaker isolated; a killed pool's orphaned engine finishing
    the task its replacement also got): the first StageDone was taken and the other copy ran
    to max_tokens for nobody. Once a stage sent again is done, every copy of it left is
    cancelled; one sent once is not (no cancel for it)."""
    from omni_actors.messages import CancelStage, ErrorKind, PlannedStage, StageDone, StageFailed, StageTask

    ra, sent = _running_request_actor(monkeypatch, (
        PlannedStage(0, "thinker", (), "pool-thinker", None, False),
        PlannedStage(1, "talker", (0,), "pool-talker", "text", False)))
    ra.receiveMsg_StageFailed(StageFailed("r1", 0, "thinker/0", ErrorKind.ENGINE_ERROR, "boom"), "thinker-engine")
    assert [m.attempt for a, m in sent if isinstance(m, StageTask) and m.stage_id == 0] == [0, 1]
    sent.clear()
    ra.receiveMsg_StageDone(StageDone("r1", 0, "thinker/1", "out0", None, attempt=1), "thinker-engine")
    assert ("pool-thinker", CancelStage("r1", 0)) in sent, sent
    sent.clear()
    ra.receiveMsg_StageDone(StageDone("r1", 1, "talker/0", "out1", "final1"), "talker-engine")
    assert not [m for _, m in sent if isinstance(m, CancelStage)], sent


def test_a_cancel_of_every_attempt_that_found_an_ended_attempt_still_stops_the_retry_on_its_way():
    """A review: attempt 0 failed on A, whose end had not reached the pool; the client hung
    up and the request's cancel (every attempt) came before the retry: it found attempt 0's
    stale entry, was passed to A (where nothing ran) and forgotten, and the retry then ran on
    B to max_tokens for nobody. Such a cancel is kept: the retry is cancelled when it comes."""
    from types import SimpleNamespace

    from omni_actors.messages import CancelStage, StageCancelled, StageTask

    pool, rep = _pool_with_one_replica()
    rep.in_flight[("r1", 0)] = (SimpleNamespace(request_id="r1", stage_id=0, attempt=0), 0.0)
    pool.receiveMsg_CancelStage(CancelStage("r1", 0), "ra")
    assert ("engine-address", CancelStage("r1", 0)) in pool.sent
    pool.sent.clear()
    pool.receiveMsg_StageTask(StageTask("r1", 0, "hi", (), {}, {}, "text", False, "ra", attempt=1), "ra")
    assert pool.sent == [("ra", StageCancelled("r1", 0, 1))], pool.sent


def test_request_finished_says_where_a_stage_failed(monkeypatch):
    """Trial BX: a request that failed mid-stream logged `replicas: {}` (only finished stages
    are listed), where its replicas were wanted most. It says where each stage last failed."""
    from structlog.testing import capture_logs

    from omni_actors.messages import ErrorKind, PlannedStage, StageFailed

    ra, sent = _running_request_actor(monkeypatch, (PlannedStage(0, "thinker", (), "pool-thinker", "text", False),),
                                      max_attempts=1)
    with capture_logs() as logs:
        ra.receiveMsg_StageFailed(StageFailed("r1", 0, "thinker/3", ErrorKind.UNAVAILABLE, "went down mid-stream"),
                                  "thinker-engine")
    (line,) = [e for e in logs if e["event"] == "request_finished"]
    assert line["failed_on"] == {"thinker": "thinker/3"} and line["replicas"] == {}, line


def test_a_read_from_another_hosts_data_service_is_no_stall_of_the_replica_that_waits():
    """A review: a member's frozen main process (its data service) held a consumer's read of
    an input for the 10 s timeout; the consumer's heartbeats counted that as idle time, and
    with stall_timeout_s 2 the pool killed it as stalled, then the next one (the request
    failed as a "poison" input). While a read from another host waits, the task is parked (no
    idle time reported), as while it waits on a neighbour's chunks; a local read is not."""
    import asyncio
    from types import SimpleNamespace

    from omni_actors.actors.engine import EngineActor

    actor = EngineActor()
    actor._started.set()  # (ends its orphan watchdog thread)
    parked_during: list[int] = []

    def get(ref):
        parked_during.append(actor._parked)
        return {"x": ref.node}

    actor._connector = SimpleNamespace(get=get, reads_remotely=lambda ref: ref.node == "far")

    async def main():
        await actor._fetch(SimpleNamespace(size=1000, node="far", service="10.0.0.9:7002"))
        await actor._fetch(SimpleNamespace(size=64 << 20, node="here"))  # (large: on a thread too)
        return actor._parked

    assert asyncio.run(main()) == 0
    assert parked_during == [1, 0]


def test_a_lingering_replica_isolated_ends_stopped_and_a_draining_one_killed_counts_its_lost_tasks():
    """A review: a replica lingering on a drained node (its replacement launched) that was then
    isolated (frozen, stalled) was restarted as a crash beside its replacement: the stage ran
    one replica more than configured for good. It ends `stopped`, as a drained one. Trial BY: a
    draining replica SIGKILLed with tasks in flight lost them unsaid (FAILED 0, no
    replica_tasks_lost, its reason "drained on request"): counted and said as a ready one's."""
    from types import SimpleNamespace

    from omni_actors.actors.stage_pool import Replica
    from omni_actors.actors.thespian_fixes import EXIT_CODE_ATTR
    from omni_actors.messages import DrainNode, ReplicaState, StageTask

    rep = Replica("talker/0", "e0", state=ReplicaState.READY, node="m1")
    pool, sent, launched = _pool_of_stage(1, "talker", rep)
    pool.receiveMsg_DrainNode(DrainNode("m1", operator=True), "coordinator")
    assert launched == ["talker/1"] and rep.linger and rep.replaced_by == "talker/1"
    pool._kill = lambda r: True
    pool._isolate(rep, "no heartbeat for 3 s")
    pool.receiveMsg_ChildActorExited(SimpleNamespace(childAddress="e0"), "e0")
    assert rep.state == ReplicaState.STOPPED and launched == ["talker/1"], (rep, launched)
    assert rep.reason.startswith("no heartbeat for 3 s") and rep.reason.endswith("(replaced by talker/1)"), rep.reason

    draining = Replica("talker/0", "e0", state=ReplicaState.DRAINING, reason="drained on request")
    pool, sent, launched = _pool_of_stage(1, "talker", draining)
    task = StageTask("r1", 1, "hi", (), {}, {}, "audio", False, "ra-1")
    draining.in_flight[("r1", 1)] = (task, time.monotonic())
    pool._finished_window_s = 60.0
    pool.receiveMsg_ChildActorExited(SimpleNamespace(childAddress="e0", **{EXIT_CODE_ATTR: -9}), "e0")
    assert draining.state == ReplicaState.STOPPED and draining.failed == 1, draining
    assert draining.reason == "drained on request; then process exited (killed by SIGKILL)", draining.reason
    # (one that drains and exits by itself, its tasks done, is not)
    done = Replica("talker/0", "e0", state=ReplicaState.DRAINING, reason="drained on request")
    pool, sent, launched = _pool_of_stage(1, "talker", done)
    pool.receiveMsg_ChildActorExited(SimpleNamespace(childAddress="e0"), "e0")
    assert (done.state, done.reason, done.failed) == (ReplicaState.STOPPED, "drained on request", 0)


def test_a_task_held_back_for_a_starting_replica_goes_to_the_ready_one_when_its_wait_ends():
    """A review: tasks kept back for replicas still starting (their share of a backlog, for
    up to an interval) whose queue_timeout_s ended meanwhile were refused "no ready replica
    ... (thinker/0 ready; thinker/1 starting)". The ready one takes them; a task no replica
    may take (a lingering one takes only requests begun before) still gets its 503."""
    from omni_actors.actors.stage_pool import Replica
    from omni_actors.actors.supervision import HealthPolicy
    from omni_actors.messages import ReplicaState, StageFailed, StageTask

    ready = Replica("thinker/0", "e0", state=ReplicaState.READY)
    pool, sent, launched = _pool_of_stage(0, "thinker", ready, Replica("thinker/1", "e1", state=ReplicaState.STARTING))
    pool._health = HealthPolicy(heartbeat_interval_s=1.0, missed_heartbeats=3)
    pool._spec.heartbeat_interval_s = 1.0
    for name in ("_run_lost_timers", "_cancel_overdue", "_retry_placements", "_wind_down_if_orphaned", "_publish"):
        setattr(pool, name, lambda *a: None)
    ready.health.last_heartbeat = ready.health.progress_at = time.monotonic()
    now = time.monotonic()
    held = StageTask("r1", 0, "hi", (), {}, {}, "text", False, "ra-1", began_at=now - 30)
    pool._pending = [(held, now - 0.1)]
    pool._hold_until = now + 0.9
    pool._tick()
    assert [(a, m.request_id) for a, m in sent if isinstance(m, StageTask)] == [("e0", "r1")], sent
    assert not [m for _, m in sent if isinstance(m, StageFailed)] and pool._pending == []

    sent.clear()
    ready.linger, ready.linger_since = "node m1 drained", now - 10  # (began after: not its to take)
    late = StageTask("r2", 0, "hi", (), {}, {}, "text", False, "ra-2", began_at=now - 5)
    pool._pending = [(late, now - 0.1)]
    pool._tick()
    failed = [m for _, m in sent if isinstance(m, StageFailed)]
    assert len(failed) == 1 and failed[0].message.startswith("no ready replica of stage thinker within 20 s"), sent
    assert pool._pending == []


def test_an_undrain_retires_a_replacement_that_failed_its_start():
    """A review: a lingering replica kept by `node undrain` had its replacement retired only if
    that one was pending, starting or dead; one that had failed to load was tried again
    failed_retry_s later, and the stage ran one replica more than configured. It is retired."""
    from omni_actors.actors.stage_pool import Replica
    from omni_actors.messages import DrainNode, NodesChanged, ReplicaState

    rep = Replica("talker/0", "e0", state=ReplicaState.READY, node="m1")
    pool, sent, launched = _pool_of_stage(1, "talker", rep)
    pool.receiveMsg_DrainNode(DrainNode("m1", operator=True), "coordinator")
    assert launched == ["talker/1"]
    new = pool._replicas["talker/1"]
    new.state, new.reason = ReplicaState.FAILED, "engine failed to load; next try in 300 s"
    pool._retry_placements = lambda: None
    pool.receiveMsg_NodesChanged(NodesChanged(undrained="m1"), "coordinator")
    assert rep.state == ReplicaState.READY and not rep.linger
    assert new.state == ReplicaState.STOPPED and new.reason.startswith("not needed: talker/0"), new


def test_a_pinned_replicas_devices_are_kept_for_it_while_it_is_down_and_while_its_launch_is_planned():
    """A review: (1) a replica pinned to device 4 of m2, down (drained with its node, failed,
    restarting), had its device taken by an unpinned replica placed meanwhile, and then waited
    for it for good while m2's other devices were free; (2) two `stage launch --devices 6` at
    once were both accepted (the first's replica takes its pin only when it asks), and the
    second's replica waited for good. Pinned devices are kept for their replica; a launch's
    until its replicas ask (then as theirs)."""
    from types import SimpleNamespace

    from omni_actors.actors.coordinator import CoordinatorActor
    from omni_actors.messages import (AdminReply, LaunchReplicas, PlaceReplica, Placement, PoolState,
                                      ReplicaState, ReplicaStatus)
    from omni_actors.placement import NodeInfo

    co = CoordinatorActor()
    co.sent = []
    co.send = lambda address, message: co.sent.append((address, message))
    co._inventory.add(NodeInfo("m2", ("4", "5", "6", "7"), ()))
    co._config = SimpleNamespace(stage_args=[SimpleNamespace(stage_id=1, name="talker"),
                                             SimpleNamespace(stage_id=2, name="code2wav")],
                                 stage_by_name=lambda name: name,
                                 deployment_of=lambda stage: SimpleNamespace(devices_per_replica=1, nodes=[]))
    co._pools = {1: "talker-pool", 2: "code2wav-pool"}
    co._states[1] = PoolState(1, "talker", (ReplicaStatus("talker/3", ReplicaState.DEAD, "restarting", node="m2",
                                                          pin=("m2", ("4",))),))
    co._states[2] = PoolState(2, "code2wav", ())
    co.receiveMsg_PlaceReplica(PlaceReplica("code2wav", "code2wav/5", 1, (), ()), "code2wav-pool")
    assert co.sent[-1] == ("code2wav-pool", Placement("code2wav/5", "m2", ("5",))), co.sent[-1]
    co.receiveMsg_PlaceReplica(PlaceReplica("talker", "talker/3", 1, ("m2",), ("4",)), "talker-pool")
    assert co.sent[-1] == ("talker-pool", Placement("talker/3", "m2", ("4",))), co.sent[-1]
    # (stopped for good, it keeps nothing)
    co._inventory.release("talker/3")
    co._states[1] = PoolState(1, "talker", (ReplicaStatus("talker/3", ReplicaState.STOPPED, "scaled down",
                                                          node="m2", pin=("m2", ("4",))),))
    co.receiveMsg_PlaceReplica(PlaceReplica("code2wav", "code2wav/6", 1, (), ()), "code2wav-pool")
    assert co.sent[-1] == ("code2wav-pool", Placement("code2wav/6", "m2", ("4",))), co.sent[-1]

    co.sent.clear()
    co.receiveMsg_LaunchReplicas(LaunchReplicas("talker", node="m2", devices=("6",)), "cli-1")
    assert co.sent[-1][0] == "talker-pool" and co.sent[-1][1].pins == (("m2", ("6",)),)
    co.receiveMsg_LaunchReplicas(LaunchReplicas("code2wav", node="m2", devices=("6",)), "cli-2")
    assert co.sent[-1] == ("cli-2", AdminReply(False, "device(s) already taken on node m2: 6 (kept for a talker "
                                                      "replica being launched, pinned to it)")), co.sent[-1]
    co.receiveMsg_PlaceReplica(PlaceReplica("code2wav", "code2wav/7", 1, (), ()), "code2wav-pool")
    assert co.sent[-1] == ("code2wav-pool", Placement("code2wav/7", "m2", ("7",))), co.sent[-1]


def test_a_lost_member_resumed_after_another_took_its_node_name_is_not_taken():
    """A review: member A of node m1, frozen past its heartbeats, was lost; member B joined as
    m1 and got replicas; A, resumed, was announced by Thespian again: its new agent made B's
    stale, and on its answer m1 was added afresh (every device free under B's replicas). The
    registration of another member of a node that is alive is not taken."""
    from thespian.actors import ActorSystemConventionUpdate

    from omni_actors.messages import NodeHeartbeat, StartNodeAgent

    coord = _coordinator_taking_members()
    b = {"omni_node": "m1", "omni_devices": "0,1", "omni_member": "member-b"}
    coord.receiveMsg_ActorSystemConventionUpdate(ActorSystemConventionUpdate("admin-b", b, True), None)
    start = next(m for _, m in coord.sent if isinstance(m, StartNodeAgent))
    coord.receiveMsg_NodeHeartbeat(NodeHeartbeat("m1", join=start.join), "agent-address")
    coord._inventory.place("talker", "talker/0", 1, ("m1",))
    coord.sent.clear()
    a = {**b, "omni_member": "member-a"}
    coord.receiveMsg_ActorSystemConventionUpdate(ActorSystemConventionUpdate("admin-a", a, True), None)
    assert not [m for _, m in coord.sent if isinstance(m, StartNodeAgent)]  # (no agent for A)
    coord.receiveMsg_NodeHeartbeat(NodeHeartbeat("m1", join=start.join), "agent-address")  # (B's still counts)
    m1 = coord._inventory.nodes["m1"]
    assert m1.alive and m1.info.member == "member-b" and m1.used == {"0": "talker/0"}
    # (and if the running member is lost after all, the other is taken: a member restarted at once
    # after its process died registers before the dead one's heartbeats are missed)
    coord._lose_node("m1", "missed 3 node heartbeats")
    start_a = next(m for _, m in coord.sent if isinstance(m, StartNodeAgent))
    coord.receiveMsg_NodeHeartbeat(NodeHeartbeat("m1", join=start_a.join), "agent-address")
    m1 = coord._inventory.nodes["m1"]
    assert m1.alive and m1.info.member == "member-a", m1.info


def test_a_replica_takes_the_lowest_slot_no_live_replica_has():
    """A diff review: a replica's share of its stage's runtime.devices (a host without
    --devices) was keyed to its name's index, which grows with every replacement: talker/2,
    replacing talker/1 of `devices: "1,2"`, went to GPU 1 beside talker/0. Each replica
    takes the lowest place (slot) that no live replica of the stage holds."""
    from types import SimpleNamespace

    from omni_actors.actors.stage_pool import Replica
    from omni_actors.messages import Placement, ReplicaState, StartEngine

    ready = Replica("talker/0", "e0", state=ReplicaState.READY, node="n")
    gone = Replica("talker/1", None, state=ReplicaState.STOPPED, node="n")
    gone.slot = 1  # (stopped: its place is free again)
    new = Replica("talker/2", None, state=ReplicaState.PENDING)
    pool, sent, _ = _pool_of_stage(1, "talker", ready, gone, new)
    pool._spec.deployment = SimpleNamespace(devices_per_replica=1)
    pool._spec.heartbeat_interval_s = pool._spec.inline_threshold_bytes = 1
    pool._spec.connector_mode, pool._spec.ready_timeout_s = None, 60
    pool._spec.supervision.missed_heartbeats, pool._spec.supervision.stall_timeout_s = 3, 10.0
    pool.createActor = lambda *a, **kw: "e2"
    pool.wakeupAfter = lambda *a, **kw: None
    pool._publish = lambda: None
    pool.receiveMsg_Placement(Placement("talker/2", "n", ()), "coordinator")
    start = next(m for a, m in sent if isinstance(m, StartEngine))
    assert (start.replica, start.slot, new.slot) == ("talker/2", 1, 1)


def test_a_task_waiting_for_a_pinned_lingering_replica_is_routed_when_its_node_is_undrained():
    """A diff review: a new request's task waits for a replica pinned to a drained node (it
    starts again there when the node is undrained); `node undrain` kept the lingering replica
    but left the task waiting out queue_timeout_s beside it. It is routed at the undrain."""
    from omni_actors.actors.stage_pool import Replica
    from omni_actors.messages import DrainNode, NodesChanged, ReplicaState, StageTask

    rep = Replica("code2wav/5", "e5", state=ReplicaState.READY, node="vm")
    pool, sent, launched = _pool_of_stage(2, "code2wav", rep)
    pool._pins["code2wav/5"] = ("vm", ())
    pool.receiveMsg_DrainNode(DrainNode("vm", operator=True), "coordinator")
    assert rep.linger and rep.relaunch and launched == []
    task = StageTask("r9", 2, "", (), {}, {}, "audio", False, "ra", began_at=rep.linger_since + 1)
    pool.receiveMsg_StageTask(task, "ra")
    assert len(pool._pending) == 1 and not [m for _, m in sent if isinstance(m, StageTask)]
    pool._retry_placements = lambda: None
    pool.receiveMsg_NodesChanged(NodesChanged(undrained="vm"), "coordinator")
    assert [a for a, m in sent if isinstance(m, StageTask)] == ["e5"] and pool._pending == []


def test_a_task_that_reaches_a_pool_before_its_start_is_routed_once_it_starts():
    """A recreated pool's address reaches the RequestActors (routes published by the
    coordinator, relayed by the API server) on other connections than the pool's own
    StartPool, so a task re-sent there can come first: routing it raised, Thespian gave it
    back to its RequestActor, and the request hung. It waits, and is routed at StartPool
    (queued for the replicas the pool launches, then taken by the first ready one)."""
    from omni_actors.actors.stage_pool import StagePoolActor
    from omni_actors.actors.supervision import ReplicaHealth
    from omni_actors.config import load_config
    from omni_actors.messages import ReplicaState, StageTask, StartPool

    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "cpu_omni_demo.yaml")
    stage, dep = cfg.stage_args[1], cfg.deployment
    pool = StagePoolActor()
    sent, placed = [], []
    pool.send = lambda address, message: sent.append((address, message))
    pool.wakeupAfter = lambda delay, payload=None: None
    pool._place = placed.append
    pool._publish = lambda: None
    task = StageTask("r1", stage.stage_id, "hi", (), {}, {}, None, False, "ra-1", attempt=1)
    pool.receiveMsg_StageTask(task, "ra-1")
    assert sent == []
    pool.receiveMsg_StartPool(StartPool(stage, cfg.deployment_of(stage), dep.heartbeat_interval_s,
                                        dep.ready_timeout_s, 65536, dep.load_balancing, dep.supervision), "coord")
    assert len(placed) == cfg.deployment_of(stage).replicas == 2
    assert [t for t, _ in pool._pending] == [task] and sent == []  # (no 503: its replicas are on their way)
    rep = placed[0]
    rep.address, rep.state, rep.health = "engine-0", ReplicaState.READY, ReplicaHealth(0.0)
    for other in placed[1:]:
        other.state = ReplicaState.FAILED  # (none other on its way: the ready one takes all)
    pool._drain_pending()
    assert sent == [("engine-0", task)]


def test_a_stage_task_a_pool_gave_back_as_poison_is_retried_not_left_waiting(monkeypatch):
    """A pool that raised on a task (Thespian retries once, then returns it to its sender as
    a PoisonMessage) never runs it: the RequestActor ignored that and waited for its
    deadline. It is a failure of the stage: tried again, then the request's error."""
    from thespian.actors import PoisonMessage

    from omni_actors.messages import ErrorKind, PlannedStage, RequestFinished, StageTask

    ra, sent = _running_request_actor(monkeypatch, (PlannedStage(0, "thinker", (), "pool-thinker", "text", True),),
                                      max_attempts=2)
    first = [m for _, m in sent if isinstance(m, StageTask)]
    assert len(first) == 1
    ra.receiveMsg_PoisonMessage(PoisonMessage(first[0], "Traceback ...\nAttributeError: 'NoneType' object"),
                                "pool-thinker")
    tasks = [m for _, m in sent if isinstance(m, StageTask)]
    assert [t.attempt for t in tasks] == [0, 1]
    # a stale attempt's poison changes nothing; the last attempt's ends the request, saying why
    ra.receiveMsg_PoisonMessage(PoisonMessage(first[0], "again"), "pool-thinker")
    assert len([m for _, m in sent if isinstance(m, StageTask)]) == 2
    ra.receiveMsg_PoisonMessage(PoisonMessage(tasks[1], "Traceback ...\nAttributeError: boom"), "pool-thinker")
    done = [m for _, m in sent if isinstance(m, RequestFinished)]
    assert len(done) == 1 and done[0].error == ErrorKind.ENGINE_ERROR
    assert "pool of stage thinker failed to take the task (AttributeError: boom)" in done[0].message


def test_a_replica_whose_ready_deadline_wake_up_was_lost_fails_at_the_next_tick():
    """A review: only the ready deadline's wake-up failed a replica that never got ready,
    and Thespian drops wake-ups while an actor drains a long transmit queue: the replica
    stayed STARTING for good, holding its devices, its stage's tasks waiting for it. The
    tick fails it once that deadline is past by WAKEUP_LOST_AFTER_S; not before, and not a
    replica that got ready."""
    from omni_actors.actors.stage_pool import Replica
    from omni_actors.actors.supervision import WAKEUP_LOST_AFTER_S, HealthPolicy, RestartPolicy
    from omni_actors.messages import ReplicaState

    stuck = Replica("talker/0", "e0", state=ReplicaState.STARTING, reason="starting")
    pool, sent, launched = _pool_of_stage(1, "talker", stuck)
    stuck.health = None  # (it never sent a heartbeat)
    pool._health = HealthPolicy(heartbeat_interval_s=1.0, missed_heartbeats=3)
    pool._restart = RestartPolicy(1.0, 30.0, 5, 300.0, 60.0)
    pool._spec.heartbeat_interval_s, pool._spec.ready_timeout_s = 1.0, 30.0
    for name in ("_cancel_overdue", "_retry_placements", "_refuse_pending_if_none_comes",
                 "_wind_down_if_orphaned", "_publish", "_after"):
        setattr(pool, name, lambda *a: None)
    killed = []
    pool._kill = lambda rep: killed.append(rep.replica) or True
    stuck.ready_by = time.monotonic() - WAKEUP_LOST_AFTER_S + 0.5  # (its wake-up may still come)
    pool._tick()
    assert stuck.state == ReplicaState.STARTING and killed == []
    stuck.ready_by = time.monotonic() - WAKEUP_LOST_AFTER_S - 0.5
    pool._tick()
    assert stuck.state == ReplicaState.FAILED and killed == ["talker/0"], stuck
    assert "did not become ready within 30 s" in stuck.reason

    # One drained while it started, whose wake-up came (it is killed): not stopped again by the
    # tick while its exit is on its way (a review: a second replica_isolated, a nested reason)
    drained = Replica("talker/1", "e1", state=ReplicaState.DRAINING, reason="drained on request")
    drained.health, pool._replicas["talker/1"] = None, drained
    pool._finished_window_s = 60.0
    drained.ready_by = time.monotonic() - 0.1
    pool._on_timer(("ready_deadline", "talker/1", "e1"))
    assert killed == ["talker/0", "talker/1"] and drained.reason.count("did not become ready") == 1
    drained.ready_by = time.monotonic() - WAKEUP_LOST_AFTER_S - 0.5  # (as if it had not been cleared)
    pool._tick()
    assert killed == ["talker/0", "talker/1"] and drained.reason.count("did not become ready") == 1, drained.reason


def test_a_task_refused_by_a_lost_coordinators_pool_waits_for_the_new_pool(monkeypatch):
    """A review: a pool whose coordinator was lost drains, and refuses what it is sent; its
    refusal came before the new routes, so the retry went to the same pool (or, a refusal
    naming no replica, was not made) and the request got a 503. The task waits for the new
    pool of its stage and goes there when the routes say which; one refused after the routes
    moved on goes to the new pool at once; none coming within NEW_POOL_WAIT_S: a 503."""
    from types import SimpleNamespace

    from omni_actors.actors.request import NEW_POOL_WAIT_S, PARKED
    from omni_actors.messages import (ErrorKind, PlannedStage, RequestFinished, RoutesChanged, StageDone,
                                      StageFailed, StageTask)

    def start(*more):
        ra, sent = _running_request_actor(monkeypatch, (
            PlannedStage(0, "thinker", (), "old-thinker", "text", True), *more))
        woken = []
        ra.wakeupAfter = lambda delay, payload=None: woken.append((delay, payload))
        return ra, sent, woken

    def tasks(sent):
        return [(a, m.attempt) for a, m in sent if isinstance(m, StageTask)]

    routes = SimpleNamespace(pools={0: "new-thinker"}, inherited=(), given_up=())
    ra, sent, woken = start()
    refused = StageFailed("r1", 0, "", ErrorKind.UNAVAILABLE, "no ready replica of stage thinker; its pool's "
                          "coordinator was lost", 0, coordinator_lost=True)
    ra.receiveMsg_StageFailed(refused, "old-thinker")
    assert tasks(sent) == [("old-thinker", 0)] and woken[-1][0] == NEW_POOL_WAIT_S  # (waits: not sent again)
    assert not [m for _, m in sent if isinstance(m, RequestFinished)]
    ra.receiveMsg_RoutesChanged(RoutesChanged(routes), "bridge")
    assert tasks(sent) == [("old-thinker", 0), ("new-thinker", 1)]
    ra.receiveMsg_WakeupMessage(SimpleNamespace(payload=woken[-1][1]), "ra")  # (sent: the wait's end does nothing)
    assert not [m for _, m in sent if isinstance(m, RequestFinished)]

    ra, sent, woken = start()  # refused after the routes moved on (a replica named): to the new pool at once
    ra.receiveMsg_RoutesChanged(RoutesChanged(SimpleNamespace(pools={0: "new-thinker"}, inherited=(0,),
                                                              given_up=())), "bridge")
    ra.receiveMsg_StageFailed(StageFailed("r1", 0, "thinker/0", ErrorKind.UNAVAILABLE, "replica thinker/0 is "
                                          "draining; its pool's coordinator was lost", 0, moved=1,
                                          coordinator_lost=True), "old-thinker")
    assert tasks(sent) == [("old-thinker", 0), ("new-thinker", 1)]

    ra, sent, woken = start()  # no new pool comes
    ra.receiveMsg_StageFailed(refused, "old-thinker")
    (payload,) = [p for _, p in woken if isinstance(p, tuple) and p[0] == PARKED]
    ra.receiveMsg_WakeupMessage(SimpleNamespace(payload=payload), "ra")
    (done,) = [m for _, m in sent if isinstance(m, RequestFinished)]
    assert done.error == ErrorKind.UNAVAILABLE and done.message == (
        f"stage thinker: its pool's coordinator was lost, and no new pool of it came within {NEW_POOL_WAIT_S:g} s")

    # A review: the refused task finished after all (its replica's StageDone came after the refusal
    # of its pool, which had given it up): done, not run again on the new pool, and the end of the
    # wait does nothing (it raised a KeyError). The crash its pool counted goes with a resend.
    ra, sent, woken = start(PlannedStage(1, "talker", (0,), "talker-pool", "audio", False))
    ra.receiveMsg_StageFailed(dataclasses.replace(refused, crashed=("thinker/0",)), "old-thinker")
    assert ra._parked[0].crashed == ("thinker/0",)
    ra.receiveMsg_StageDone(StageDone("r1", 0, "thinker/0", output=None, final=None, attempt=0), "thinker-engine")
    assert tasks(sent) == [("old-thinker", 0), ("talker-pool", 0)]  # (the request goes on)
    ra.receiveMsg_RoutesChanged(RoutesChanged(routes), "bridge")
    (payload,) = [p for _, p in woken if isinstance(p, tuple) and p[0] == PARKED]
    ra.receiveMsg_WakeupMessage(SimpleNamespace(payload=payload), "ra")
    assert tasks(sent) == [("old-thinker", 0), ("talker-pool", 0)], tasks(sent)
    assert not [m for _, m in sent if isinstance(m, RequestFinished)]


def test_a_draining_replica_found_silent_with_tasks_counts_them_failed_as_a_ready_one_does():
    """Trial CC: talker/1 frozen with 2 tasks in flight went FAILED 0 -> 2 when it was isolated;
    talker/5 frozen and then drained, with 2 tasks in flight too, stayed at FAILED 0 when it was
    found silent while it drained and killed: the same loss, counted the same."""
    from omni_actors.actors.stage_pool import Replica
    from omni_actors.actors.supervision import HealthPolicy, ReplicaHealth
    from omni_actors.messages import ReplicaState, StageTask

    frozen = Replica("talker/5", "e5", state=ReplicaState.DRAINING, reason="drained on request")
    ready = Replica("talker/0", "e0", state=ReplicaState.READY)
    pool, sent, launched = _pool_of_stage(1, "talker", frozen, ready)
    pool._health = HealthPolicy(heartbeat_interval_s=1.0, missed_heartbeats=3, stall_timeout_s=2.0)
    pool._spec.heartbeat_interval_s = 1.0
    for name in ("_run_lost_timers", "_cancel_overdue", "_retry_placements", "_refuse_pending_if_none_comes",
                 "_wind_down_if_orphaned", "_publish"):
        setattr(pool, name, lambda *a: None)
    pool._finished_window_s = 60.0
    pool._kill = lambda rep: True
    now = time.monotonic()
    for i in range(2):
        frozen.in_flight[(f"r{i}", 1)] = (StageTask(f"r{i}", 1, "hi", (), {}, {}, "audio", False, f"ra-{i}"), now - 9)
    frozen.health = ReplicaHealth(last_heartbeat=now - 9, progress_at=now - 9)
    ready.health = ReplicaHealth(last_heartbeat=now, progress_at=now)
    pool._tick()
    assert frozen.killed and "while draining" in frozen.reason, frozen.reason
    assert frozen.failed == 2 and not frozen.in_flight
    assert sorted(m.request_id for a, m in sent if a == "e0" and isinstance(m, StageTask)) == ["r0", "r1"]


def test_a_lost_wake_up_of_a_stage_waiting_for_a_new_pool_is_run_by_the_beat(monkeypatch):
    """A review: the wait of a stage on a lost coordinator's pool (INHERITED) had only its
    wake-up, which Thespian drops under a long transmit queue: the request then waited for its
    deadline (a 504). The PARKED wait is the same. The request's beat runs such a wake-up once
    it is WAKEUP_LOST_AFTER_S late."""
    from omni_actors.actors.request import NEW_POOL_WAIT_S
    from omni_actors.actors.supervision import WAKEUP_LOST_AFTER_S
    from omni_actors.messages import ErrorKind, PlannedStage, RequestFinished, StageFailed

    ra, sent = _running_request_actor(monkeypatch, (PlannedStage(0, "thinker", (), "old-thinker", "text", True),))
    monkeypatch.setattr("omni_actors.actors.request.refuses_connections", lambda address: False)
    ra.receiveMsg_StageFailed(StageFailed("r1", 0, "", ErrorKind.UNAVAILABLE, "refused; its pool's coordinator "
                                          "was lost", 0, coordinator_lost=True), "old-thinker")
    (payload,) = ra._stage_wakeups  # (its wake-up never comes)
    ra._stage_wakeups[payload] = time.monotonic() - WAKEUP_LOST_AFTER_S + 0.5
    ra._beat()
    assert not [m for _, m in sent if isinstance(m, RequestFinished)]
    ra._stage_wakeups[payload] = time.monotonic() - WAKEUP_LOST_AFTER_S - 0.5
    ra._beat()
    (done,) = [m for _, m in sent if isinstance(m, RequestFinished)]
    assert done.error == ErrorKind.UNAVAILABLE and f"no new pool of it came within {NEW_POOL_WAIT_S:g} s" in \
        done.message


def test_a_consumer_timeout_says_when_the_request_actor_itself_did_not_run(monkeypatch):
    """Trial CC: with a request's RequestActor stopped for 25 s, the Code2Wav waiting for the
    chunks it relays timed out, and the request's error read "no chunk from upstream stage 1
    within 10 s ...: its replica died or stalled" of a healthy Talker. Its beat, which Thespian
    runs first when it resumes (its wake-up fell due meanwhile), came that late: the error says
    it did not run. A beat on time, or none (its wake-up lost), says nothing of it."""
    from omni_actors.messages import ErrorKind, PlannedStage, RequestFinished, StageChunk, StageFailed

    monkeypatch.setattr("omni_actors.actors.request.refuses_connections", lambda address: False)

    def timed_out(beat_late_s: float | None) -> str:
        ra, sent = _running_request_actor(monkeypatch, (
            PlannedStage(1, "talker", (), "pool-talker", None, False, emits_chunks=True),
            PlannedStage(2, "code2wav", (1,), "pool-code2wav", "audio", False, stream_source=1, emits_chunks=True)))
        ra.receiveMsg_StageChunk(StageChunk("r1", 1, 0, "ref0", 0), "talker-engine")
        ra._alive_beats.due = time.monotonic() - (beat_late_s or 30.0)
        if beat_late_s is not None:  # (None: its wake-up was lost, and no beat came)
            ra._beat()
        ra.receiveMsg_StageFailed(StageFailed("r1", 2, "code2wav/0", ErrorKind.TIMEOUT, "stage code2wav "
                                              "(code2wav/0): no chunk from upstream stage 1 within 10 s"), "c2w")
        (done,) = [m for _, m in sent if isinstance(m, RequestFinished)]
        assert done.error == ErrorKind.TIMEOUT
        return done.message

    assert "this request's RequestActor itself did not run for about 25 s (stopped or starved of CPU)" in \
        timed_out(25.0)
    assert "RequestActor itself" not in timed_out(0.5)
    assert "RequestActor itself" not in timed_out(None)


def test_a_heartbeat_sent_before_its_engine_applied_an_injected_fault_does_not_hide_it():
    """CI: `status` right after `inject slow` showed no fault: the replica's heartbeat sent
    before it applied the fault reached the pool after the pool had recorded the fault, and
    overwrote it until the next heartbeat. Heartbeats now say which fault they follow."""
    from types import SimpleNamespace

    from omni_actors.actors.stage_pool import Replica, StagePoolActor
    from omni_actors.actors.supervision import ReplicaHealth
    from omni_actors.messages import AdminReply, FaultKind, Heartbeat, InjectFault, ReplicaState

    pool = StagePoolActor()
    pool._started.set()
    sent = []
    pool.send = lambda address, message: sent.append((address, message))
    pool._publish = lambda: None
    pool._spec = SimpleNamespace(heartbeat_interval_s=1.0, stage=SimpleNamespace(stage_id=0, name="thinker"))
    pool._last_tick = 0
    rep = Replica("thinker/0", "a0", state=ReplicaState.READY)
    rep.health = ReplicaHealth(last_heartbeat=0.0, progress_at=0.0)
    pool._replicas = {"thinker/0": rep}
    pool.receiveMsg_InjectFault(InjectFault("thinker/0", FaultKind.SLOW, factor=3.0), "cli")
    (_, passed), (_, reply) = sent
    assert passed.seq == 1 and isinstance(reply, AdminReply) and rep.fault == "slow x3"
    pool.receiveMsg_Heartbeat(Heartbeat("thinker/0", 0, 0, 0, 0, fault="", fault_seq=0), "a0")  # (sent before)
    assert rep.fault == "slow x3"
    pool.receiveMsg_Heartbeat(Heartbeat("thinker/0", 0, 0, 0, 0, fault="slow x3", fault_seq=1), "a0")
    assert rep.fault == "slow x3"
    pool.receiveMsg_Heartbeat(Heartbeat("thinker/0", 0, 0, 0, 0, fault="", fault_seq=1), "a0")  # (a raise used up)
    assert rep.fault == ""


def test_a_request_actor_answers_before_it_releases_and_takes_silent_services_for_down(monkeypatch):
    """Trial CN: each request that failed on a frozen member ended 2 s late, its RequestActor
    releasing its buffers there (a release waits up to 2 s) before it answered. It answers
    first; and it takes the services the API server says are silent for down, so that those
    releases go to the retries at once."""
    from omni_actors.actors import request
    from omni_actors.connectors import data_client
    from omni_actors.messages import ErrorKind, PlannedStage, RequestFinished

    marked, forgotten = [], []
    monkeypatch.setattr(data_client, "mark_down", marked.append)
    monkeypatch.setattr(data_client, "forget_down", forgotten.append)
    ra, sent = _running_request_actor(monkeypatch, (PlannedStage(0, "thinker", (), "pool-thinker", "text", False),),
                                      silent_services=("10.0.0.2:7002",))
    assert marked == ["10.0.0.2:7002"] and not forgotten
    order = []
    ra.send = lambda address, message: order.append(type(message).__name__)
    monkeypatch.setattr(request, "release_all", lambda refs, recycle=False, wait=True: order.append("release"))
    ra._owned = ["ref"]
    ra._finish(ErrorKind.INPUT_LOST, "lost")
    assert order.index("RequestFinished") < order.index("release"), order
    assert RequestFinished.__name__ in order
    # (the next request's RunRequest no longer names it: it answers again, and is tried at once: trial CO's
    # RequestActor refused releases there 5 s more)
    from omni_actors.messages import RequestPlan, RunRequest
    ra.receiveMsg_RunRequest(RunRequest("r2", "hi", RequestPlan(()), {}, {}, 60.0, "bridge"), "bridge")
    assert forgotten == ["10.0.0.2:7002"]
