"""Segment recycling (issue 6): a released segment whose owner knows nobody reads
it any more goes back to its node's free segments, and a later ``put`` of its
size class claims it (its pages already allocated) instead of making a fresh
one. Claims are atomic across processes, free segments are bounded (idle
trim, byte budget, a full tmpfs), sweeps remove them, and every path where a
reader may still be at work unlinks as before."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import numpy as np
import pytest

from omni_actors.actors.request import RequestActor
from omni_actors.connectors import ConnectorError, DataService, NodeConnector, free_usage, list_free_segments, \
    list_segments, make_connector, release_all, size_class, sweep_segments
from omni_actors.connectors import data_client
from omni_actors.connectors import data_service as ds
from omni_actors.connectors import shm
from omni_actors.connectors.shm import DIR_ENV, FREE_BYTES_ENV, SHM_DIR
from omni_actors.http.bridge import ActorBridge
from omni_actors.http.types import RequestFailed
from omni_actors.messages import (CancelRequest, ErrorKind, OutputReady, PlannedStage, RequestFinished,
                                  RequestPlan, RunRequest, StageDone, StageTask)

#: These tests are about per-put segments; slots are tested in test_shm_slots.py.
pytestmark = pytest.mark.usefixtures("segments_not_slots")

REPO = Path(__file__).resolve().parents[1]
MB = 1 << 20


def _ino(ref) -> int:
    return os.stat(os.path.join(shm.segment_dir(), ref.location)).st_ino


def _bytes(ref) -> bytes:
    with open(os.path.join(shm.segment_dir(), ref.location), "rb") as f:
        return f.read(ref.size)


# -- size classes -------------------------------------------------------------------------------

def test_size_classes_round_up_by_at_most_a_quarter_above_a_page():
    assert size_class(1) == size_class(4096) == 4096
    for size in [4097, 65_536, 100_000, MB - 1, MB, MB + 1, 3 * MB + 5, 256 * MB, 10**9]:
        cls = size_class(size)
        assert size <= cls <= size * 1.25 + 4096 and cls % 4096 == 0 and size_class(cls) == cls
    assert len({size_class(s) for s in range(MB + 1, 2 * MB + 1, 4096)}) == 4  # four classes per doubling


# -- recycle and claim --------------------------------------------------------------------------

def test_a_recycled_segment_is_claimed_by_the_next_put_of_its_class(prefix):
    connector = make_connector(0, prefix=prefix)
    first = connector.put({"x": np.full(300_000, 1.0, dtype=np.float32)})
    ino = _ino(first)
    assert os.path.getsize(os.path.join(SHM_DIR, first.location)) == size_class(first.size)
    connector.release(first, recycle=True)
    assert list_segments(prefix) == [] and len(list_free_segments(prefix)) == 1
    assert free_usage(prefix) == (1, size_class(first.size))
    with pytest.raises(ConnectorError, match="not found"):
        connector.get(first)  # its name is gone, as after an unlink

    # A slightly different size of the same class takes the same pages (same inode).
    again = connector.put({"x": np.full(290_001, 2.0, dtype=np.float32), "n": np.arange(3)})
    assert _ino(again) == ino and list_free_segments(prefix) == [] and list_segments(prefix) == [again.location]
    got = connector.get(again)
    np.testing.assert_array_equal(got["x"], np.full(290_001, 2.0, dtype=np.float32))
    np.testing.assert_array_equal(got["n"], np.arange(3))
    # Padding between fields reads as zeros, not the previous payload's bytes.
    layout = [f for f in again.layout if f.kind == "array"]
    gap = _bytes(again)[layout[0].offset + layout[0].nbytes:layout[1].offset]
    assert gap == bytes(len(gap)) and len(gap) > 0
    del got

    # Another class does not take it; the default release unlinks.
    connector.release(again, recycle=True)
    other = connector.put({"x": np.ones(10_000, dtype=np.float32)})
    assert _ino(other) != ino and len(list_free_segments(prefix)) == 1
    connector.release(other)
    assert list_segments(prefix) == [] and len(list_free_segments(prefix)) == 1
    assert sweep_segments(prefix) == 1
    assert list_free_segments(prefix) == [] and not os.path.exists(shm.free_dir(prefix))


def test_the_producer_writes_again_through_the_mapping_it_kept(prefix):
    connector = make_connector(0, prefix=prefix)
    payloads = [np.random.default_rng(i).standard_normal(400_000).astype(np.float32) for i in range(4)]
    inodes = set()
    for data in payloads:  # fresh, then reused with pwrite (and mapped), then through the mapping
        ref = connector.put({"x": data})
        inodes.add(_ino(ref))
        np.testing.assert_array_equal(connector.get(ref)["x"], data)
        release_all([ref], recycle=True)
    assert len(inodes) == 1
    assert any(ino in inodes for _, ino in shm._maps._entries)
    # A bigger payload of the same class than the mapping covers: written with pwrite, mapped anew.
    bigger = np.random.default_rng(9).standard_normal(450_000).astype(np.float32)
    assert size_class(bigger.nbytes) == size_class(payloads[0].nbytes)
    ref = connector.put({"x": bigger})
    assert _ino(ref) in inodes
    np.testing.assert_array_equal(connector.get(ref)["x"], bigger)
    # Unlinked (trimmed, swept, or released without recycling): the producer drops its mapping
    # soon (it would keep the pages alive).
    release_all([ref])
    deadline = time.monotonic() + 3 * shm.MAP_CHECK_S + 2
    while any(ino in inodes for _, ino in shm._maps._entries) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(ino in inodes for _, ino in shm._maps._entries)


def test_recycling_under_a_reader_that_kept_its_views_shows_why_it_is_opt_in(prefix):
    connector = make_connector(0, prefix=prefix)
    ref = connector.put({"x": np.zeros(100_000, dtype=np.float32)})
    kept = connector.get(ref)["x"]  # a reader still holding views on the mapping
    connector.release(ref, recycle=True)
    connector.put({"x": np.ones(100_000, dtype=np.float32)})  # claims the same pages
    assert kept[0] == 1.0  # what the views see now: hence recycle only when nobody reads


def test_take_copies_what_it_maps_so_the_segment_can_be_recycled(prefix):
    connector = make_connector(0, prefix=prefix)
    audio = np.arange(200_000, dtype=np.int16)
    ref = connector.put({"audio": audio, "sample_rate": 24000})
    got = connector.take(ref)
    assert got["sample_rate"] == 24000 and len(list_free_segments(prefix)) == 1 and list_segments(prefix) == []
    connector.put({"audio": np.zeros(200_000, dtype=np.int16)})  # takes those pages
    np.testing.assert_array_equal(got["audio"], audio)  # ours: a copy
    with pytest.raises(ConnectorError):
        connector.take(ref)  # gone: the error, nothing recycled
    assert len(list_segments(prefix)) == 1 and list_free_segments(prefix) == []


def test_the_bridge_copies_outputs_before_recycling_their_segment(prefix):
    """ActorBridge._take: the event it hands to the HTTP side must not read a
    segment that was released (and may now hold another request's output)."""
    import queue

    bridge = ActorBridge.__new__(ActorBridge)
    bridge._connector = NodeConnector(0, prefix)
    bridge._inbox, bridge._ended, bridge._outboxes = {}, {}, [queue.SimpleQueue()]
    events = []
    bridge._deliver = lambda request_id, event: events.append((request_id, event))
    audio = np.arange(100_000, dtype=np.float32)
    ref = bridge._connector.put({"audio": audio})
    data = bridge._take(OutputReady("r1", 2, "audio", ref))
    assert list_segments(prefix) == [] and len(list_free_segments(prefix)) == 1  # recycled
    bridge._connector.put({"audio": np.zeros(100_000, dtype=np.float32)})  # another request's output
    np.testing.assert_array_equal(data["audio"], audio)
    assert events == []
    # A ref that is gone: the request fails with a 500 that says so.
    assert bridge._take(OutputReady("r2", 2, "audio", ref)) is None
    assert events[0][0] == "r2" and isinstance(events[0][1], RequestFailed) and events[0][1].status == 500
    assert bridge._outboxes[0].get_nowait() == ("cancel", "r2")  # (its pipeline is cancelled)


def _claim_in_child(prefix: str, start, n: int, queue) -> None:
    connector = make_connector(0, prefix=prefix)
    start.wait(30)
    refs = [connector.put({"x": np.full(50_000, os.getpid(), dtype=np.int64)}) for _ in range(n)]
    queue.put([(r.location, os.stat(os.path.join(SHM_DIR, r.location)).st_ino) for r in refs])


def test_two_processes_claiming_at_once_never_get_the_same_segment(prefix):
    n = 12
    producer = make_connector(0, prefix=prefix)
    release_all([producer.put({"x": np.zeros(50_000, dtype=np.int64)}) for _ in range(n)], recycle=True)
    free_inodes = {shm._free_ino(name) for name in list_free_segments(prefix)}
    assert len(free_inodes) == n
    ctx = multiprocessing.get_context("spawn")
    start, queue = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_claim_in_child, args=(prefix, start, n, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    try:
        start.wait(60)
        got = [queue.get(timeout=60), queue.get(timeout=60)]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    claimed = [ino for held in got for _, ino in held]
    assert len(claimed) == len(set(claimed)) == 2 * n  # every segment held by one process only
    assert free_inodes <= set(claimed)  # each free one claimed exactly once; the rest were made fresh
    assert list_free_segments(prefix) == []
    for held in got:  # each process's bytes are intact
        names = {name for name, _ in held}
        values = {int(np.frombuffer(_file_bytes(name), dtype=np.int64)[0]) for name in names}
        assert len(values) == 1


def _file_bytes(name: str) -> bytes:
    with open(os.path.join(SHM_DIR, name), "rb") as f:
        return f.read(8)


# -- bounds -------------------------------------------------------------------------------------

def test_a_release_over_the_budget_unlinks(prefix, monkeypatch):
    monkeypatch.setenv(FREE_BYTES_ENV, str(3 * 65536))
    connector = make_connector(0, prefix=prefix)
    refs = [connector.put({"x": np.ones(8192)}) for _ in range(5)]  # 64 KiB each
    release_all(refs, recycle=True)
    assert list_segments(prefix) == [] and free_usage(prefix) == (3, 3 * 65536)


def test_the_data_service_trims_idle_free_segments_then_to_the_budget(prefix):
    connector = make_connector(0, prefix=prefix)
    refs = [connector.put({"x": np.ones(8192)}) for _ in range(4)]  # 64 KiB each
    release_all(refs, recycle=True)
    names = list_free_segments(prefix)
    now = time.time()
    for age, name in zip((100, 30, 20, 10), names):  # released 100, 30, 20, 10 s ago
        os.utime(os.path.join(shm.free_dir(prefix), name), (now - age, now - age))
    svc = DataService("127.0.0.1", 0, prefix, free_idle_s=60, free_budget_bytes=2 * 65536)
    assert svc.trim(now=now) == 2  # the idle one, then the oldest over the budget
    assert list_free_segments(prefix) == sorted(names[2:])
    assert svc.stats()["trimmed"] == 2 and svc.stats()["free_segments"] == 2
    assert svc.trim(now=now + 61) == 2 and list_free_segments(prefix) == []


def test_the_reaper_thread_trims_free_segments_soon_after_they_go_idle(prefix):
    connector = make_connector(0, prefix=prefix)
    # (2 s idle: at 0.2 s a test process starved a moment found it trimmed already, a review)
    with DataService("127.0.0.1", 0, prefix, free_idle_s=2.0) as svc:
        release_all([connector.put({"x": np.ones(10_000)})], recycle=True)
        assert svc.stats()["free_segments"] == 1 and svc.stats()["segments"] == 0
        deadline = time.monotonic() + 12
        while svc.stats()["trimmed"] < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert list_free_segments(prefix) == [] and svc.stats()["trimmed"] == 1


def test_the_reaper_leaves_free_segments_to_the_trim_and_in_use_ones_to_their_age(prefix):
    connector = make_connector(0, prefix=prefix)
    young, old = connector.put({"x": np.ones(10_000)}), connector.put({"x": np.ones(10_000)})
    release_all([young], recycle=True)
    svc = DataService("127.0.0.1", 0, prefix, reap_after_s=60, free_idle_s=600)
    assert svc.reap(now=time.time() + 120) == 1  # the in-use one only
    assert list_segments(prefix) == [] and len(list_free_segments(prefix)) == 1
    del old


def test_a_segment_claimed_after_a_long_time_free_is_not_reaped_as_old(prefix):
    """A code review: a claim (a rename) kept the time the segment was released, and a put
    through a kept mapping does not touch it; with free segments kept longer than
    ``reap_after_s``, one claimed after that long was reaped in the middle of its request."""
    connector = make_connector(0, prefix=prefix)
    first = connector.put({"x": np.ones(10_000)})
    inode = _ino(first)
    release_all([first], recycle=True)
    second = connector.put({"x": np.ones(10_000)})  # (written with pwrite, and mapped: the next goes through it)
    assert _ino(second) == inode
    release_all([second], recycle=True)
    from omni_actors.connectors.recycling import free_dir

    (free,) = list_free_segments(prefix)
    long_ago = time.time() - 3600
    os.utime(os.path.join(free_dir(prefix, SHM_DIR), free), (long_ago, long_ago))  # (free for an hour)
    again = connector.put({"x": np.full(10_000, 2.0)})
    assert _ino(again) == inode  # (the same segment, claimed)
    svc = DataService("127.0.0.1", 0, prefix, reap_after_s=60, free_idle_s=7200)
    assert svc.reap() == 0 and list_segments(prefix) == [again.location]
    assert connector.get(again)["x"][0] == 2.0
    release_all([again])


def test_a_full_tmpfs_gives_back_free_segments_then_fails_cleanly(prefix, tiny_tmpfs, monkeypatch):
    mnt = tiny_tmpfs("1m")
    monkeypatch.setenv(DIR_ENV, str(mnt))
    monkeypatch.setenv(FREE_BYTES_ENV, str(MB))
    connector = make_connector(0, prefix=prefix)
    ref = connector.put({"x": np.ones(600_000, dtype=np.uint8)})
    connector.release(ref, recycle=True)
    assert len(list_free_segments(prefix)) == 1
    # Another class: no room beside the free one, which is given back; the put succeeds.
    big = connector.put({"x": np.full(700_000, 7, dtype=np.uint8)})
    assert list_free_segments(prefix) == [] and list_segments(prefix) == [big.location]
    assert connector.get(big)["x"][-1] == 7
    # No room at all: OSError, nothing left behind.
    with pytest.raises(OSError):
        connector.put({"x": np.ones(900_000, dtype=np.uint8)})
    assert list_segments(prefix) == [big.location] and list_free_segments(prefix) == []
    connector.release(big)
    # The pages of a segment unlinked while this producer still maps it (to write it again)
    # are given back too when the tmpfs is full.
    first = connector.put({"x": np.ones(600_000, dtype=np.uint8)})
    connector.release(first, recycle=True)
    again = connector.put({"x": np.ones(600_000, dtype=np.uint8)})  # reused: now mapped here
    connector.release(again)
    other = connector.put({"x": np.full(700_000, 3, dtype=np.uint8)})
    assert connector.get(other)["x"][0] == 3
    connector.release(other)
    sweep_segments(prefix)
    assert os.listdir(mnt) == []


# -- through the data service --------------------------------------------------------------------

@pytest.fixture
def service_process(prefix):
    """A data service in a process of its own (another host's): its address."""
    from test_data_service import data_service_process

    with data_service_process(prefix, "--free-idle-s", "600") as address:
        yield address


def test_a_remote_owner_recycles_through_the_segments_data_service(prefix, service_process):
    producer = NodeConnector(0, prefix, node="far", service=service_process)
    reader = NodeConnector(node="near")
    data = np.random.default_rng(0).standard_normal(100_000).astype(np.float32)
    ref = producer.put({"x": data})
    ino = _ino(ref)
    np.testing.assert_array_equal(reader.get(ref)["x"], data)  # fetched: a buffer of its own
    reader.release(ref, recycle=True)
    stats = ds.stats(service_process)
    assert (stats["segments"], stats["free_segments"], stats["recycled"], stats["releases"]) == (0, 1, 1, 1)
    assert stats["free_bytes"] == size_class(ref.size) and stats["free_idle_s"] == 600
    again = producer.put({"x": data[::-1].copy()})
    assert _ino(again) == ino
    # release_all batches per service; without recycle (the old request), it unlinks.
    more = producer.put({"x": data})
    release_all([again], recycle=True)
    release_all([more])
    stats = ds.stats(service_process)
    assert (stats["segments"], stats["free_segments"], stats["recycled"], stats["releases"]) == (0, 1, 2, 3)
    # Taken by a reader on another node: its copy was received, the segment is recycled.
    last = producer.put({"x": data})
    np.testing.assert_array_equal(reader.take(last)["x"], data)
    assert ds.stats(service_process)["recycled"] == 3


def test_a_bad_recycle_flag_is_a_bad_request_and_releases_nothing(prefix, service_process):
    ref = NodeConnector(0, prefix, node="far", service=service_process).put({"x": np.ones(10_000)})
    status, body = data_client._request(service_process, {"op": "release", "names": [ref.location],
                                                          "recycle": "yes"})
    assert status == ds.BAD_REQUEST and b"recycle" in body
    assert list_segments(prefix) == [ref.location]


# -- the request owner's rule ------------------------------------------------------------------

class _Driven(RequestActor):
    """A RequestActor driven by hand: what it sends is recorded."""

    myAddress = "request-actor"

    def __init__(self):
        super().__init__()
        self.sent = []

    def send(self, to, msg):
        self.sent.append((to, msg))

    def wakeupAfter(self, *args, **kwargs):
        pass


def _two_stage_request(prefix: str) -> tuple[_Driven, NodeConnector]:
    """Thinker (0) -> Talker (1, final audio); the Thinker's output is in a segment."""
    actor = _Driven()
    plan = RequestPlan((PlannedStage(0, "thinker", (), "pool0", None, True),
                        PlannedStage(1, "talker", (0,), "pool1", "audio", False)))
    actor.receiveMsg_RunRequest(RunRequest("r1", "hi", plan, {}, {}, 60.0, "bridge"), "bridge")
    return actor, NodeConnector(0, prefix)


def _thinker_done(actor: _Driven, connector: NodeConnector, attempt: int = 0):
    ref = connector.put({"hidden": np.ones(50_000, dtype=np.float32)})
    actor.receiveMsg_StageDone(StageDone("r1", 0, "thinker/0", ref, None, attempt=attempt), "engine0")
    assert isinstance(actor.sent[-1][1], StageTask) and actor.sent[-1][1].stage_id == 1
    return ref


def test_a_completed_request_recycles_its_intermediate_segments(prefix):
    actor, connector = _two_stage_request(prefix)
    _thinker_done(actor, connector)
    final = connector.put({"audio": np.ones(40_000, dtype=np.float32)})
    actor.receiveMsg_StageDone(StageDone("r1", 1, "talker/0", None, final), "engine1")
    finished = [m for _, m in actor.sent if isinstance(m, RequestFinished)]
    assert finished and finished[0].error is None
    # The Thinker's output came back for reuse; the final one is the bridge's (still in use).
    assert len(list_free_segments(prefix)) == 1 and list_segments(prefix) == [final.location]


@pytest.mark.parametrize("end", ["cancel", "timeout", "retried", "redispatched", "stale"])
def test_a_request_that_did_not_complete_cleanly_unlinks(prefix, end):
    actor, connector = _two_stage_request(prefix)
    if end == "redispatched":  # the pool sent the Thinker's task to another replica on its own
        _thinker_done(actor, connector, attempt=1)
    else:
        _thinker_done(actor, connector)
    if end == "cancel":
        actor.receiveMsg_CancelRequest(CancelRequest("r1"), "bridge")
    elif end == "timeout":
        actor._finish(ErrorKind.TIMEOUT, "deadline")
    elif end == "retried":  # the Talker was tried again: its first attempt may still read its input
        from omni_actors.messages import StageFailed
        actor.receiveMsg_StageFailed(StageFailed("r1", 1, "talker/0", ErrorKind.ENGINE_ERROR, "boom", 0),
                                     "engine1")
        actor.receiveMsg_StageDone(StageDone("r1", 1, "talker/1", None, None, attempt=1), "engine1b")
    elif end in ("redispatched",):
        actor.receiveMsg_StageDone(StageDone("r1", 1, "talker/0", None, None), "engine1")
    elif end == "stale":  # a StageDone for a request that is over: its refs were never read
        actor.receiveMsg_CancelRequest(CancelRequest("r1"), "bridge")
        late = connector.put({"hidden": np.ones(50_000, dtype=np.float32)})
        actor.receiveMsg_StageDone(StageDone("r1", 0, "thinker/0", late, None), "engine0")
    assert any(isinstance(m, RequestFinished) for _, m in actor.sent)
    assert list_segments(prefix) == [] and list_free_segments(prefix) == []
