"""The mappings a process keeps of shared-memory segments (issue 6, the 1 MB path):
a consumer reads a segment whose file it mapped before through that mapping,
a producer claims the free segments it keeps mapped by their names (named after
their inodes) with one rename; neither ever uses a mapping of another file than
the one a name points at now, and both stay bounded and let go of unlinked
segments. Plus the data service's send path and its congestion-control setting."""

from __future__ import annotations

import os
import socket
import threading
import time

import numpy as np
import pytest

from omni_actors.connectors import ConnectorError, DataService, list_free_segments, list_segments, \
    make_connector, release_all, size_class
from omni_actors.connectors import data_service as ds
from omni_actors.connectors import mappings, recycling, shm
from omni_actors.connectors.shm import SHM_DIR

#: These tests are about per-put segments; slots are tested in test_shm_slots.py.
pytestmark = pytest.mark.usefixtures("segments_not_slots")

MB = 1 << 20


def _ino(ref) -> int:
    return os.stat(os.path.join(SHM_DIR, ref.location)).st_ino


def _read_keys(ino: int) -> list:
    return [key for key in mappings._reads._entries if key == (SHM_DIR, ino)]


# -- the consumer's mappings ---------------------------------------------------------------------

def test_a_get_of_a_recycled_segment_reads_through_the_mapping_kept_of_its_file(prefix):
    connector = make_connector(0, prefix=prefix)
    payloads = [np.random.default_rng(i).standard_normal(250_000).astype(np.float32) for i in range(5)]
    inodes, mms = set(), set()
    for i, data in enumerate(payloads):
        ref = connector.put({"x": data})
        inodes.add(_ino(ref))
        got = connector.get(ref)["x"]
        np.testing.assert_array_equal(got, data)  # this request's bytes, each time
        assert not got.flags.writeable
        if i == 0:
            assert not _read_keys(_ino(ref))  # a file read once is not kept
        else:
            mms.add(id(mappings._reads._entries[(SHM_DIR, _ino(ref))].mm))
        del got
        release_all([ref], recycle=True)
    assert len(inodes) == 1 and len(mms) == 1  # one file, mapped once for the last four gets


def test_a_ref_whose_segment_was_recycled_is_not_found_though_its_file_is_still_mapped(prefix):
    connector = make_connector(0, prefix=prefix)
    old = connector.put({"x": np.full(100_000, 1.0, dtype=np.float32)})
    connector.get(old)
    connector.get(old)  # (read again: kept)
    ino = _ino(old)
    release_all([old], recycle=True)
    new = connector.put({"x": np.full(100_000, 2.0, dtype=np.float32)})
    assert _ino(new) == ino and _read_keys(ino)  # the reader keeps a mapping of that very file
    with pytest.raises(ConnectorError, match="not found"):
        connector.get(old)  # but the old name is gone: no bytes of the other request
    assert connector.get(new)["x"][0] == 2.0


def test_a_kept_mapping_of_another_file_with_that_inode_number_is_never_used(prefix):
    """As after the inode counter wrapped: the kept entry's key names the inode the
    segment has now, but its mapping is of another file (ctime differs)."""
    connector = make_connector(0, prefix=prefix)
    other = connector.put({"x": np.full(50_000, 7, dtype=np.int64)})
    ref = connector.put({"x": np.full(50_000, 3, dtype=np.int64)})
    mappings.drop_mappings()
    connector.get(other)
    connector.get(other)  # a kept mapping of `other`
    (key, entry), = mappings._reads._entries.items()
    del mappings._reads._entries[key]
    mappings._reads._entries[(SHM_DIR, _ino(ref))] = entry  # filed under ref's inode number
    assert connector.get(ref)["x"][0] == 3  # checked (inode, device, ctime), dropped, mapped anew
    assert mappings._reads._entries.get((SHM_DIR, _ino(ref))) is not entry
    release_all([ref, other])


def test_the_consumer_cache_is_bounded_and_skips_files_over_its_bound(prefix, monkeypatch):
    cache = mappings._ReadCache()
    cache.max_bytes = 3 * 65536
    connector = make_connector(0, prefix=prefix)
    refs = [connector.put({"x": np.full(8192, i, dtype=np.float64)}) for i in range(5)]  # 64 KiB each
    views = [cache.view(SHM_DIR, r.location, r.size) for r in refs]  # read once: none kept
    assert [int(np.frombuffer(v, dtype=np.float64)[0]) for v in views] == [0, 1, 2, 3, 4]
    assert not cache._entries
    views += [cache.view(SHM_DIR, r.location, r.size) for r in refs]  # read again: kept, within bounds
    assert [int(np.frombuffer(v, dtype=np.float64)[0]) for v in views[5:]] == [0, 1, 2, 3, 4]
    assert len(cache._entries) == 3 and cache._held == 3 * 65536  # the three most recent
    big = connector.put({"x": np.ones(300_000, dtype=np.float32)})  # over the bound: mapped, not kept
    for _ in range(2):
        assert np.frombuffer(cache.view(SHM_DIR, big.location, big.size), dtype=np.float32)[-1] == 1.0
    assert len(cache._entries) == 3
    monkeypatch.setattr(mappings._ReadCache, "ENTRIES", 2)
    cache.view(SHM_DIR, refs[0].location, refs[0].size)
    cache.view(SHM_DIR, refs[0].location, refs[0].size)
    assert len(cache._entries) == 2 and len(cache._seen) <= mappings.SEEN_PER_ENTRY * 2
    del views
    cache.clear()
    release_all(refs + [big])


def test_a_gone_or_short_segment_raises_connector_error(prefix):
    connector = make_connector(0, prefix=prefix)
    ref = connector.put({"x": np.ones(10_000, dtype=np.float32)})
    with pytest.raises(ConnectorError, match="bytes, the ref says"):
        mappings._reads.view(SHM_DIR, ref.location, size_class(ref.size) + 1)
    os.mkdir(os.path.join(SHM_DIR, prefix + "0123456789abcdef"))  # not a segment: a directory
    try:
        with pytest.raises(ConnectorError, match="not found"):
            mappings._reads.view(SHM_DIR, prefix + "0123456789abcdef", 8)
    finally:
        os.rmdir(os.path.join(SHM_DIR, prefix + "0123456789abcdef"))
    release_all([ref])
    with pytest.raises(ConnectorError, match="not found"):
        connector.get(ref)


def test_mappings_of_unlinked_segments_are_let_go(prefix):
    connector = make_connector(0, prefix=prefix)
    ref = connector.put({"x": np.ones(100_000, dtype=np.float32)})
    connector.get(ref)
    got = connector.get(ref)["x"]
    ino = _ino(ref)
    assert _read_keys(ino)
    release_all([ref])  # unlinked: the kept mapping would hold its pages
    deadline = time.monotonic() + 3 * mappings.MAP_CHECK_S + 2
    while _read_keys(ino) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _read_keys(ino)
    assert got[-1] == 1.0  # arrays still out keep their mapping (closed once they go)
    ref = connector.put({"x": np.ones(100_000, dtype=np.float32)})
    connector.get(ref)
    connector.get(ref)
    ino = _ino(ref)
    release_all([ref])
    assert mappings.drop_unlinked_mappings() >= 1 and not _read_keys(ino)  # at once, as a full tmpfs does


def test_threads_reading_while_entries_are_evicted_read_the_right_bytes(prefix, monkeypatch):
    monkeypatch.setattr(mappings._ReadCache, "ENTRIES", 3)
    connector = make_connector(0, prefix=prefix)
    refs = [connector.put({"x": np.full(20_000, i, dtype=np.int32)}) for i in range(8)]
    errors = []

    def read(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(300):
                i = int(rng.integers(len(refs)))
                x = connector.get(refs[i])["x"]
                if x[0] != i or x[-1] != i:
                    errors.append((i, int(x[0])))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=read, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == [] and len(mappings._reads._entries) <= 3
    release_all(refs)


def test_a_forked_child_starts_with_no_mappings(prefix):
    connector = make_connector(0, prefix=prefix)
    for _ in range(3):
        ref = connector.put({"x": np.ones(100_000, dtype=np.float32)})
        connector.get(ref)
        release_all([ref], recycle=True)
    assert mappings._reads._entries and mappings._maps._entries
    pid = os.fork()
    if pid == 0:
        os._exit(0 if not mappings._reads._entries and not mappings._maps._entries else 1)
    assert os.waitpid(pid, 0)[1] == 0


# -- the producer's claim ------------------------------------------------------------------------

def test_a_free_segment_is_named_after_its_inode_and_its_producer_claims_it_without_listing(prefix,
                                                                                            monkeypatch):
    connector = make_connector(0, prefix=prefix)
    for _ in range(2):  # fresh, then reused with pwrite (and mapped)
        release_all([connector.put({"x": np.ones(100_000, dtype=np.float32)})], recycle=True)
    (free,) = list_free_segments(prefix)
    ino = os.stat(os.path.join(shm.free_dir(prefix), free)).st_ino
    assert free == f"{size_class(400_000):x}-{ino:x}"
    listings = []
    monkeypatch.setattr(recycling, "_relist", lambda fdir: listings.append(fdir) or False)
    ref = connector.put({"x": np.full(100_000, 5.0, dtype=np.float32)})
    assert _ino(ref) == ino and listings == [] and list_free_segments(prefix) == []
    assert connector.get(ref)["x"][0] == 5.0
    release_all([ref])


def test_a_free_segment_with_an_old_style_name_is_still_claimed(prefix):
    connector = make_connector(0, prefix=prefix)
    ref = connector.put({"x": np.ones(100_000, dtype=np.float32)})
    ino, cls = _ino(ref), size_class(ref.size)
    os.mkdir(shm.free_dir(prefix), 0o700)
    os.rename(os.path.join(SHM_DIR, ref.location), os.path.join(shm.free_dir(prefix), f"{cls:x}-{ino:x}-0a1b2c"))
    again = connector.put({"x": np.full(100_000, 2.0, dtype=np.float32)})
    assert _ino(again) == ino and connector.get(again)["x"][0] == 2.0
    release_all([again])


def test_a_producer_never_writes_through_its_mapping_of_another_file(prefix):
    """The free name carries an inode number this producer keeps mapped, but the file
    under it is another one (as after the inode counter wrapped): the claim takes
    that file and writes it with pwrite; the mapped file, in use elsewhere, keeps
    its bytes."""
    connector = make_connector(0, prefix=prefix)
    for _ in range(2):
        release_all([connector.put({"x": np.ones(100_000, dtype=np.float32)})], recycle=True)
    in_use = connector.put({"x": np.full(100_000, 9.0, dtype=np.float32)})  # claims the mapped file
    ino, cls = _ino(in_use), size_class(in_use.size)
    impostor = connector.put({"x": np.zeros(100_000, dtype=np.float32)})  # another file, fresh
    os.rename(os.path.join(SHM_DIR, impostor.location), os.path.join(shm.free_dir(prefix), f"{cls:x}-{ino:x}"))
    ref = connector.put({"x": np.full(100_000, 4.0, dtype=np.float32)})
    assert _ino(ref) != ino  # the impostor's file, claimed
    assert connector.get(ref)["x"][0] == 4.0 and connector.get(in_use)["x"][0] == 9.0
    release_all([ref, in_use])
    assert list_segments(prefix) == []


# -- the data service ----------------------------------------------------------------------------

def test_an_empty_segment_get_is_answered_at_once(prefix):
    """Its header goes without MSG_MORE (no payload follows to push it out: held back, each
    such get took 0.2 s). The fastest of three is timed (a loaded machine delays any one)."""
    ref = make_connector(0, prefix=prefix).shm.put({"x": np.ones(2000, dtype=np.float32)})
    with DataService("127.0.0.1", 0, prefix, node="far") as svc:
        took = []
        for _ in range(3):
            t0 = time.monotonic()
            body = ds.fetch(svc.address, ref.location, 0)
            took.append(time.monotonic() - t0)
            assert body.nbytes == 0
        assert min(took) < 0.15, took
        got = ds.fetch(svc.address, ref.location, ref.size)
        np.testing.assert_array_equal(got[:8].view(np.float32), np.ones(2, dtype=np.float32))
    ds.close_connections()
    release_all([ref])


def test_the_data_service_sends_with_the_congestion_control_it_is_given(prefix, monkeypatch):
    if not hasattr(socket, "TCP_CONGESTION"):
        pytest.skip("no TCP_CONGESTION here")
    ref = make_connector(0, prefix=prefix).shm.put({"x": np.ones(300_000, dtype=np.float32)})
    monkeypatch.setenv(ds.CONGESTION_ENV, "reno")  # (always allowed)
    with DataService("127.0.0.1", 0, prefix, node="far") as svc:
        assert svc.tcp_congestion == "reno"
        assert ds.fetch(svc.address, ref.location, ref.size).nbytes == ref.size
        (conn,) = list(svc._conns)
        assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0") == b"reno"
    ds.close_connections()
    with DataService("127.0.0.1", 0, prefix, node="far", tcp_congestion="no-such-algorithm") as svc:
        assert ds.fetch(svc.address, ref.location, ref.size).nbytes == ref.size  # served all the same
        assert svc.tcp_congestion is None
    ds.close_connections()
    release_all([ref])
