"""Slots: a producer's segment files written again and again (omni_actors.connectors.slots).

What a user of the connectors sees: a put after a recycled release lands in
the same file under a new generation, an old ref reads nothing, an unrecycled
release unlinks the file while arrays read from it keep their bytes, readers
and releasers in other processes and on other nodes (through the data
service) work, and idle or orphaned slots go away.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import numpy as np
import pytest

from omni_actors.connectors import ConnectorError, DataService, NodeConnector, free_usage, list_segments, \
    segment_dir, slots
from omni_actors.connectors.shm import MAP_CHECK_S, list_segment_files

from test_connectors import assert_same_outputs, sample_outputs

MB = 1 << 20


def _payload(seed: int, n: int = MB // 4) -> dict:
    return {"x": np.random.default_rng(seed).standard_normal(n).astype(np.float32), "step": seed}


def _file(ref) -> str:
    name, gen = slots.split(ref.location)
    return name


def test_a_recycled_slot_takes_the_next_put_and_an_old_ref_reads_nothing(prefix):
    conn = NodeConnector(0, prefix)
    first = conn.put(_payload(1))
    assert slots.split(first.location)[1] == 1 and first.location.startswith(prefix)
    assert_same_outputs(conn.get(first), _payload(1))
    assert list_segments(prefix) == [_file(first)]

    conn.release(first, recycle=True)
    assert list_segments(prefix) == []  # (free: not in use)
    assert free_usage(prefix)[0] == 1

    second = conn.put(_payload(2))
    assert _file(second) == _file(first) and slots.split(second.location)[1] == 2
    assert_same_outputs(conn.get(second), _payload(2))
    with pytest.raises(ConnectorError, match="already released"):
        conn.get(first)
    conn.release(first, recycle=True)  # a late release of the old generation changes nothing
    assert_same_outputs(conn.get(second), _payload(2))
    assert list_segments(prefix) == [_file(second)]


def test_every_dtype_round_trips_through_a_slot(prefix):
    conn = NodeConnector(0, prefix)
    ref = conn.put(sample_outputs())
    assert "@" in ref.location
    assert_same_outputs(conn.get(ref), sample_outputs())
    conn.release(ref, recycle=True)
    ref = conn.put(sample_outputs())  # (again, through the producer's mapping)
    assert slots.split(ref.location)[1] == 2
    assert_same_outputs(conn.get(ref), sample_outputs())


def test_an_unrecycled_release_unlinks_and_arrays_read_before_keep_their_bytes(prefix):
    conn = NodeConnector(0, prefix)
    ref = conn.put(_payload(3))
    conn.release(conn.put(_payload(9)), recycle=True)  # (a free slot beside it)
    got = conn.get(ref)
    conn.release(ref)
    assert _file(ref) not in list_segment_files(prefix)
    np.testing.assert_array_equal(got["x"], _payload(3)["x"])
    with pytest.raises(ConnectorError):
        conn.get(ref)
    again = conn.put(_payload(4))
    assert _file(again) != _file(ref)  # (the free one, never the retired one)
    np.testing.assert_array_equal(got["x"], _payload(3)["x"])


def test_every_payload_of_a_size_class_fits_the_slots_of_that_class(prefix):
    conn = NodeConnector(0, prefix)
    small = conn.put(_payload(1, n=MB // 4 - 4096))
    conn.release(small, recycle=True)
    big = conn.put(_payload(2))  # (the same class, 16 KiB more)
    assert _file(big) == _file(small)
    assert_same_outputs(conn.get(big), _payload(2))
    conn.release(big, recycle=True)
    again = conn.put(_payload(3, n=MB // 4 - 4096))
    assert_same_outputs(conn.get(again), _payload(3, n=MB // 4 - 4096))


def _read_and_release(location_ref, recycle, queue) -> None:
    try:
        conn = NodeConnector()
        got = conn.get(location_ref)
        queue.put(float(got["x"].sum()))
        del got
        conn.release(location_ref, recycle=recycle)
        queue.put("released")
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        queue.put(repr(exc))


def test_a_reader_in_another_process_releases_the_slot_back_to_its_producer(prefix):
    conn = NodeConnector(0, prefix)
    ctx = multiprocessing.get_context("fork")
    for step in range(3):
        ref = conn.put(_payload(step))
        queue = ctx.Queue()
        child = ctx.Process(target=_read_and_release, args=(ref, True, queue))
        child.start()
        try:
            assert queue.get(timeout=30) == pytest.approx(float(_payload(step)["x"].sum()))
            assert queue.get(timeout=30) == "released"
        finally:
            child.join(30)
        assert slots.split(ref.location)[1] == step + 1  # (the same slot, again and again)
    assert len(list_segment_files(prefix)) == 1 and list_segments(prefix) == []


def test_through_the_data_service_a_far_reader_gets_and_recycles_slots(prefix):
    with DataService(prefix=prefix, node="far", free_idle_s=600) as service:
        producer = NodeConnector(0, prefix, node="far", service=service.address)
        reader = NodeConnector(node="near")
        ref = producer.put(sample_outputs())
        assert "@" in ref.location
        assert_same_outputs(reader.get(ref), sample_outputs())
        stats = service.stats()
        assert (stats["segments"], stats["free_segments"]) == (1, 0)
        reader.release(ref, recycle=True)
        stats = service.stats()
        assert (stats["segments"], stats["free_segments"], stats["recycled"]) == (0, 1, 1)
        with pytest.raises(ConnectorError, match="already released"):
            reader.get(ref)
        again = producer.put(sample_outputs())
        assert _file(again) == _file(ref)
        assert_same_outputs(reader.get(again), sample_outputs())
        reader.release(again)  # (unrecycled: unlinked there)
        assert list_segment_files(prefix) == []


def test_a_service_in_another_process_sends_a_rewritten_slot_from_its_mapping_and_lets_go_once_unlinked(prefix):
    """From a slot's second generation on, the data service sends it from a mapping it
    keeps (no copy through a buffer of its own): each generation's bytes arrive, a
    released one is refused, and once the slot is unlinked the service unmaps it
    within a few seconds (it would hold the file's memory)."""
    from test_data_service import data_service_popen

    with data_service_popen(prefix) as (address, proc):
        producer, reader = NodeConnector(0, prefix, node="far", service=address), NodeConnector(node="near")

        def payload_mapped(name: str) -> bool:
            """Whether the service maps the slot to read it (a releaser maps its header page read-write)."""
            return any(line.split()[1] == "r--s" and line.endswith(name)
                       for line in Path(f"/proc/{proc.pid}/maps").read_text().splitlines())
        refs = []
        for step in range(1, 5):
            ref = producer.put(_payload(step))
            assert_same_outputs(reader.get(ref), _payload(step))
            refs.append(ref)
            if step == 1:
                assert not payload_mapped(_file(ref))  # (a first generation is copied out)
            reader.release(ref, recycle=True)
        assert {_file(r) for r in refs} == {_file(refs[0])}  # (one slot, generations 1-4)
        assert payload_mapped(_file(refs[0]))
        with pytest.raises(ConnectorError, match="already released"):
            reader.get(refs[-1])
        last = producer.put(_payload(9))
        assert _file(last) == _file(refs[0])
        assert_same_outputs(reader.get(last), _payload(9))
        reader.release(last)  # (not recycled: retired and unlinked there)
        deadline = time.monotonic() + 5 + MAP_CHECK_S
        while payload_mapped(_file(last)):
            assert time.monotonic() < deadline, "the data service still maps an unlinked slot"
            time.sleep(0.1)
        assert list_segment_files(prefix) == []


def test_an_empty_get_of_a_slot_says_whether_that_generation_is_there(prefix):
    """A get of 0 bytes asks only whether a segment is there: for a slot, whether its
    generation is in use (it looked for a file named after the whole location, and so
    said every slot was gone)."""
    from omni_actors.connectors import data_service as ds

    with DataService(prefix=prefix, node="far", free_idle_s=600) as service:
        ref = NodeConnector(0, prefix, node="far", service=service.address).put(_payload(1, n=1000))
        assert "@" in ref.location
        assert ds.fetch(service.address, ref.location, 0).nbytes == 0
        NodeConnector(node="near").release(ref, recycle=True)
        with pytest.raises(ConnectorError, match="not found"):
            ds.fetch(service.address, ref.location, 0)
        ds.close_connections()


def test_a_malformed_slot_location_is_a_clear_error(prefix):
    conn = NodeConnector(0, prefix)
    name = _file(conn.put(_payload(1, n=1000)))
    for bad in (f"{prefix}0123@2", f"{name}@\u0661", f"{name}@\u00b2", f"{name}@{'9' * 20}",
                f"../../tmp/x/{name}@1"):
        with pytest.raises(ConnectorError, match="malformed slot location"):
            slots.split(bad)
    assert slots.split(f"{prefix}0123456789abcdef") is None


def test_a_full_tmpfs_gives_back_slots_unlinked_under_a_reader_and_a_releaser(prefix, tiny_tmpfs, monkeypatch):
    """A process that reads and releases keeps mappings of slots unlinked since (for a
    second at most): a put that finds the tmpfs full closes them and tries again."""
    from omni_actors.connectors import DIR_ENV

    monkeypatch.setenv(DIR_ENV, str(tiny_tmpfs("8m")))
    conn = NodeConnector(0, prefix)
    for step in range(12):
        # A slot's second generation (its reader keeps the mapping), then released unrecycled
        # (unlinked, its 2 MB still mapped here): the next step needs a new slot.
        conn.release(conn.put(_payload(step, n=MB // 2)), recycle=True)
        ref = conn.put(_payload(step, n=MB // 2))
        np.testing.assert_array_equal(conn.get(ref)["x"], _payload(step, n=MB // 2)["x"])
        conn.release(ref)
    assert list_segments(prefix) == []


def test_a_full_tmpfs_gives_back_slots_that_a_data_service_in_another_process_maps(prefix, tiny_tmpfs, monkeypatch):
    """The data service keeps mappings of the slots it serves (from their second
    generation on) and of the header pages of those it releases. Slots it unlinks itself
    (an unrecycled release through it) are unmapped at once; a producer's free slots
    that it maps are unlinked by the producer's give-back when the tmpfs is full, and
    the put waits (0.3 s at most) for the service to let go of them (it failed: their
    pages stayed mapped there, for up to a second)."""
    from omni_actors.connectors import DIR_ENV
    from test_data_service import data_service_popen

    monkeypatch.setenv(DIR_ENV, str(tiny_tmpfs("4m")))
    monkeypatch.setenv(slots.SLOT_BYTES_ENV, str(64 * MB))  # (not the small tmpfs's free budget)
    with data_service_popen(prefix) as (address, _):
        producer, reader = NodeConnector(0, prefix, node="far", service=address), NodeConnector(node="near")

        def served_twice(step: int, count: int = 1) -> list:
            """The second generation of ``count`` slots of 1 MB (files of 1.1 MB), read through the
            service (which keeps them mapped)."""
            for ref in [producer.put(_payload(step)) for _ in range(count)]:
                reader.release(ref, recycle=True)
            refs = [producer.put(_payload(step + i)) for i in range(count)]
            for i, ref in enumerate(refs):
                np.testing.assert_array_equal(reader.get(ref)["x"], _payload(step + i)["x"])
            return refs

        for step in range(8):  # unlinked by the service: 9 MB through a 4 MB tmpfs
            reader.release(served_twice(step)[0])
        assert list_segment_files(prefix) == []
        for ref in served_twice(0, count=3):  # 3.4 MB of free slots, mapped by the service
            reader.release(ref, recycle=True)
        assert len(list_segment_files(prefix)) == 3
        t0 = time.monotonic()
        big = producer.put(_payload(9, n=3 * MB // 8))  # (1.5 MB, another size class: no free slot fits)
        assert time.monotonic() - t0 < 5
        np.testing.assert_array_equal(reader.get(big)["x"], _payload(9, n=3 * MB // 8)["x"])
        reader.release(big)


def test_the_producer_unlinks_its_slots_idle_past_free_idle_s(prefix, monkeypatch):
    monkeypatch.setenv("OMNI_ACTORS_SHM_FREE_IDLE_S", "0.2")
    conn = NodeConnector(0, prefix)
    ref = conn.put(_payload(1))
    conn.release(ref, recycle=True)
    in_use = conn.put(_payload(2, n=1000))
    deadline = time.monotonic() + 10
    while _file(ref) in list_segment_files(prefix) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert list_segment_files(prefix) == [_file(in_use)]  # (the one in use stays)
    assert_same_outputs(conn.get(in_use), _payload(2, n=1000))


def _make_and_exit(prefix: str, queue) -> None:
    conn = NodeConnector(0, prefix)
    kept = conn.put(_payload(1))
    conn.release(conn.put(_payload(2, n=1000)), recycle=True)
    queue.put(kept)
    queue.close()
    queue.join_thread()
    os._exit(0)  # (no trim: as a producer that was killed)


def test_the_data_service_trims_the_free_slots_of_an_exited_producer_and_reaps_old_ones_in_use(prefix):
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_make_and_exit, args=(prefix, queue))
    child.start()
    kept = queue.get(timeout=30)
    child.join(30)
    assert len(list_segment_files(prefix)) == 2
    with DataService(prefix=prefix, reap_after_s=3600, free_idle_s=600) as service:
        assert service.trim() == 1
        assert list_segment_files(prefix) == [_file(kept)]  # (in use: a request may still read it)
        reader = NodeConnector()
        assert_same_outputs(reader.get(kept), _payload(1))
        assert service.reap(now=time.time() + 7200) == 1
        assert list_segment_files(prefix) == []
        with pytest.raises(ConnectorError):
            reader.get(kept)  # (the reader kept no mapping of a first generation; a kept one says released)
        assert service.stats()["reaped"] == 1


def test_over_the_slot_budget_a_put_takes_a_segment_of_its_own(prefix, monkeypatch):
    monkeypatch.setenv(slots.SLOT_BYTES_ENV, str(MB))
    conn = NodeConnector(0, prefix)
    first = conn.put(_payload(1, n=MB // 8))  # (half a MB, and the header: within the budget)
    second = conn.put(_payload(2, n=MB // 8))
    assert "@" in first.location and "@" not in second.location
    assert_same_outputs(conn.get(second), _payload(2, n=MB // 8))
    conn.release(second)
    assert os.path.exists(os.path.join(segment_dir(), _file(first)))


def test_a_producer_that_drops_its_mappings_leaves_no_slot_behind(prefix):
    from omni_actors.connectors.mappings import drop_mappings

    conn = NodeConnector(0, prefix)
    free = conn.put(_payload(1))
    conn.release(free, recycle=True)
    in_use = conn.put(_payload(2, n=1000))
    drop_mappings()
    assert list_segment_files(prefix) == [_file(in_use)]  # (the free one went with the mapping)
    assert_same_outputs(conn.get(in_use), _payload(2, n=1000))
    conn.release(in_use, recycle=True)
    with DataService(prefix=prefix, free_idle_s=600) as service:
        assert service.trim() == 1  # (nobody will claim it again: the data service takes it)
    assert list_segment_files(prefix) == []
    assert "@1" in conn.put(_payload(3)).location  # (a new slot)


def _stop_then_put(prefix: str, pipe) -> None:
    import signal

    conn = NodeConnector(0, prefix)
    ref = conn.put(_payload(1))
    conn.release(ref, recycle=True)
    pipe.send(_file(ref))
    os.kill(os.getpid(), signal.SIGSTOP)  # (as `inject sigstop`: its trim thread stops too)
    again = conn.put(_payload(2))
    pipe.send((again.location, float(conn.get(again)["x"].sum())))
    conn.release(again, recycle=True)
    os._exit(0)


def test_the_free_slots_of_a_stopped_producer_are_trimmed_and_never_claimed_after(prefix, monkeypatch):
    import signal

    monkeypatch.setenv("OMNI_ACTORS_SHM_FREE_IDLE_S", "0.1")
    ctx = multiprocessing.get_context("fork")
    here, there = ctx.Pipe()
    child = ctx.Process(target=_stop_then_put, args=(prefix, there))
    child.start()
    try:
        assert here.poll(30)
        first = here.recv()
        time.sleep(0.2 * slots.TRIM_AFTER)
        with DataService(prefix=prefix, free_idle_s=0.1) as service:
            assert service.trim() == 1
        assert first not in list_segment_files(prefix)
        os.kill(child.pid, signal.SIGCONT)
        assert here.poll(30)
        location, total = here.recv()
        assert not location.startswith(first) and total == pytest.approx(float(_payload(2)["x"].sum()))
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.join(30)


def test_a_nodes_buffer_counts_take_slots_and_segments_in_one_pass(prefix, monkeypatch):
    """What a node's heartbeat reports (`status`: buffers, free_buffers, free_bytes)."""
    from omni_actors.connectors import buffer_counts, size_class

    conn = NodeConnector(0, prefix)
    in_use_slot = conn.put(_payload(1))
    conn.release(conn.put(_payload(2, n=1000)), recycle=True)  # a free slot
    monkeypatch.setenv(slots.SLOT_BYTES_ENV, "0")
    in_use_segment = conn.put(_payload(3))
    conn.release(conn.put(_payload(4, n=2000)), recycle=True)  # a recycled segment
    assert "@" in in_use_slot.location and "@" not in in_use_segment.location
    assert buffer_counts(prefix) == (2, 2, size_class(4000) + size_class(8000))
    assert free_usage(prefix) == buffer_counts(prefix)[1:]


def test_a_full_tmpfs_put_gives_back_a_slot_its_own_process_released(prefix, tiny_tmpfs, monkeypatch):
    """A producer that released its own 24 MiB slot (recycled: it keeps a mapping of the
    slot's header page to release it again) and then needs 20 MiB of another size class
    on a 40 MiB tmpfs: its put gives the free slot back and succeeds (a review's failed
    with ENOSPC: the header page's mapping, dropped before the slot was unlinked, kept
    the whole file's pages)."""
    from omni_actors.connectors import DIR_ENV

    monkeypatch.setenv(DIR_ENV, str(tiny_tmpfs("40m")))
    monkeypatch.setenv(slots.SLOT_BYTES_ENV, str(64 * MB))
    conn = NodeConnector(0, prefix)
    first = conn.put({"x": np.ones(24 * MB, np.uint8)})
    assert "@" in first.location
    conn.release(first, recycle=True)
    t0 = time.monotonic()
    second = conn.put({"x": np.full(20 * MB, 7, np.uint8)})
    assert time.monotonic() - t0 < 0.25  # (no wait for anyone: this process held it)
    assert int(conn.get(second)["x"][-1]) == 7
    conn.release(second)
    assert list_segment_files(prefix) == []


def test_a_malformed_slot_location_in_a_release_batch_is_skipped_and_refused_by_a_data_service(prefix, monkeypatch):
    """A name with an ``@`` that is no slot location stopped a release batch where it
    stood (the names after it stayed until reaped, 15 minutes), and a data service asked
    to release it closed the connection with no answer (the client's retries then tried
    the batch every second until they gave up). Locally it is skipped; a data service
    refuses the batch with a 400 naming it (nothing released, as for any bad name), and
    serves the next request on the same connection."""
    from omni_actors.connectors import data_service as ds
    from omni_actors.connectors.shm import release_segments

    monkeypatch.setenv(slots.SLOT_BYTES_ENV, "0")  # (plain segments)
    conn = NodeConnector(0, prefix)
    a, b = (conn.put({"x": np.ones(100_000, np.uint8)}).location for _ in range(2))
    bad = f"{prefix}0123456789abcdef@7"
    assert release_segments([a, bad, b]) == (2, 0)
    assert list_segment_files(prefix) == []
    with DataService(prefix=prefix, node="far") as service:
        a = conn.put({"x": np.ones(100_000, np.uint8)}).location
        with pytest.raises(ConnectorError, match="malformed slot location"):
            ds.release(service.address, [a, bad])
        assert ds.release(service.address, [a]) == 1
        assert list_segment_files(prefix) == []
    ds.close_connections()


def test_an_unrecycled_release_of_a_slot_whose_header_the_watcher_closes_meanwhile_is_no_error(prefix):
    """A process keeps the header mappings of slots it released. An unrecycled release of a
    slot reaped meanwhile took the entry under the lock, let go of it, and used it again:
    the watcher (dropping mappings of unlinked files) closed it in between, and the release
    raised ``ValueError: operation forbidden on released memoryview object`` (a review
    forced that interleaving, as here). It now says the generation is not there (False)."""
    conn = NodeConnector(0, prefix)
    first = conn.put(_payload(1, n=1 << 14))
    conn.release(first, recycle=True)  # (its header page kept mapped here)
    second = conn.put(_payload(2, n=1 << 14))
    name, gen = slots.split(second.location)
    directory = segment_dir()
    assert slots.retire_and_unlink(directory, name, gen)  # the data service's reaper took it

    real = slots._headers._lock
    closed = []

    class Gap:
        """The cache's lock; once first let go, the watcher's pass runs."""

        def __enter__(self):
            real.acquire()
            return self

        def __exit__(self, *exc):
            real.release()
            if not closed:
                closed.append(None)  # (its own use of the lock runs no pass)
                closed[0] = slots._headers.drop_unlinked()

        def acquire(self, *a, **k):
            return real.acquire(*a, **k)

        def release(self):
            return real.release()

    slots._headers._lock = Gap()
    try:
        assert slots.release(directory, (name, gen), recycle=False) is False
    finally:
        slots._headers._lock = real
    assert closed == [0]  # (the release had taken it out of the cache: nothing for the watcher to close)


def test_a_slot_file_with_no_header_is_unlinked_once_stale(prefix):
    """A producer killed between creating a slot's file and writing its header left a file
    that no reap, trim or count saw (only the sweep at the system's stop): the data
    service's pass now unlinks it once untouched as long as a stale free slot."""
    directory = segment_dir()
    name = f"{prefix}slot-{os.urandom(8).hex()}"
    path = f"{directory}/{name}"
    with open(path, "wb") as f:
        f.truncate(slots.HEADER + MB)
    fresh = f"{prefix}slot-{os.urandom(8).hex()}"  # (one being made now: left alone)
    with open(f"{directory}/{fresh}", "wb") as f:
        f.truncate(slots.HEADER + MB)
    old = time.time() - 3600
    os.utime(path, (old, old))
    try:
        # (a header that cannot be read now, e.g. no file descriptor to spare, is no missing header:
        # the slot may be in use; a review)
        real_open = os.open

        def no_fd(*args, **kwargs):
            raise OSError(24, "Too many open files")
        os.open = no_fd
        try:
            assert slots.reap_slots([name], directory, reap_after_s=900, idle_s=2.0) == ([], 0)
        finally:
            os.open = real_open
        assert os.path.exists(path)
        reaped, trimmed = slots.reap_slots([name, fresh], directory, reap_after_s=900, idle_s=2.0)
        assert (reaped, trimmed) == ([], 1)
        assert not os.path.exists(path) and os.path.exists(f"{directory}/{fresh}")
    finally:
        for n in (name, fresh):
            try:
                os.unlink(f"{directory}/{n}")
            except FileNotFoundError:
                pass
