"""Connectors: stage outputs round-trip by reference, across processes and
nodes, every get is a read-only view (zero copy), and every shared-memory
segment goes away exactly when its owner releases it (locally or through the
owning node's data service)."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from omni_actors.connectors import ConnectorError, ConnectorRef, DataService, DataServiceError, \
    NodeConnector, list_segments, make_connector, release_all, sweep_segments
from omni_actors.connectors import data_service
from omni_actors.connectors.data_service import NODE_ENV, SERVICE_ENV
from omni_actors.connectors.inline import ALIGN
from omni_actors.connectors.shm import PREFIX_ENV, ShmConnector

#: These tests are about per-put segments; slots are tested in test_shm_slots.py.
pytestmark = pytest.mark.usefixtures("segments_not_slots")

REPO = Path(__file__).resolve().parents[1]


def sample_outputs() -> dict:
    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((7, 64)).astype(np.float32)
    return {
        "text": "hi",
        "token_ids": np.arange(7, dtype=np.int32),
        "hidden_states": hidden,
        "audio": (rng.standard_normal(24_001) * 3000).astype(np.int16),
        "sample_rate": 24000,
        "image": rng.integers(0, 255, (5, 6, 3), dtype=np.uint8),
        "latents": rng.standard_normal((2, 3)).astype(np.float16),
        "mask": np.array([True, False, True]),
        "phase": np.array([1 + 2j, 3 - 4j], dtype=np.complex64),
        "big_endian": np.arange(5, dtype=">i4"),
        "times": np.array(["2024-01-01", "2025-06-30"], dtype="datetime64[ns]"),
        "labels": np.array(["cat", "horse"]),
        "scale": np.float64(0.5) * np.ones(()),           # a numpy scalar (not an array)
        "sample_rate_0d": np.array(24000),                 # 0-d array
        "gain_0d": np.asarray(np.float16(0.25)).view(type("Sub", (np.ndarray,), {})),  # 0-d, of a subclass
        "empty": np.empty((0, 64), dtype=np.float32),
        "transposed": hidden.T,                            # non-contiguous (F order)
        "strided": hidden[::2, 1::3],                      # non-contiguous slice
        "finish_reason": None,
        "final": True,
        "temperature": 0.7,
        "raw": b"\x00\x01",
        "long_text": "ünïcode text " * 200,                # packed in the buffer, as an array is
        "long_raw": bytes(range(256)) * 8,
    }


def assert_same_outputs(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        if isinstance(value, np.ndarray):
            assert got[key].dtype == value.dtype, key
            assert got[key].shape == value.shape, key
            np.testing.assert_array_equal(got[key], value, err_msg=key)
            assert got[key].flags.c_contiguous and not got[key].flags.writeable, key
            assert not np.shares_memory(got[key], value), key
        else:
            assert got[key] == value and type(got[key]) is type(value), key


@pytest.fixture
def service(prefix):
    """A data service for ``prefix`` on loopback, in this process (node ``far``)."""
    with DataService("127.0.0.1", 0, prefix, node="far") as svc:
        yield svc
    data_service.close_connections()


@pytest.mark.parametrize("threshold,kind", [(10**9, "inline"), (0, "shm")])
def test_round_trip_preserves_every_dtype_shape_and_value(prefix, threshold, kind):
    connector = make_connector(threshold, prefix=prefix)
    outputs = sample_outputs()
    ref = connector.put(outputs)
    assert ref.kind == kind
    assert_same_outputs(connector.get(ref), outputs)
    assert_same_outputs(connector.get(pickle.loads(pickle.dumps(ref))), outputs)
    connector.release(ref)


def test_remote_round_trip_through_the_data_service_of_another_node(prefix, service):
    producer = NodeConnector(0, prefix, node="far", service=service.address)
    consumer = NodeConnector(node="near", service="127.0.0.1:1")  # its own service is never asked
    outputs = sample_outputs()
    ref = pickle.loads(pickle.dumps(producer.put(outputs)))
    assert (ref.kind, ref.node, ref.service) == ("shm", "far", service.address)
    assert_same_outputs(consumer.get(ref), outputs)
    assert_same_outputs(consumer.get(ref), outputs)  # the connection is reused
    assert service.stats()["gets"] == 2
    consumer.release(ref)
    assert list_segments(prefix) == [] and service.stats()["releases"] == 1
    with pytest.raises(ConnectorError, match=f"{ref.location}.*not found.*released"):
        consumer.get(ref)


def test_same_node_reads_in_place_and_tcp_mode_always_goes_through_the_service(prefix, service):
    local = NodeConnector(0, prefix, node="far", service=service.address)
    ref = local.put({"x": np.arange(1000.0)})
    assert local.get(ref)["x"].sum() == np.arange(1000.0).sum()
    assert service.stats()["gets"] == 0  # same node: mapped, no transfer
    forced = NodeConnector(0, prefix, mode="tcp", node="far", service=service.address)
    tref = forced.put({"x": np.arange(1000.0)})
    assert tref.kind == "tcp"
    np.testing.assert_array_equal(local.get(tref)["x"], np.arange(1000.0))
    assert service.stats()["gets"] == 1
    release_all([ref, tref])
    assert list_segments(prefix) == []


@pytest.mark.parametrize("mode,threshold,kind", [("inline", 0, "inline"), ("shm", 10**9, "shm"),
                                                 ("auto", 10**9, "inline"), ("auto", 0, "shm")])
def test_mode_forces_a_connector_whatever_the_size(prefix, mode, threshold, kind):
    ref = make_connector(threshold, prefix=prefix, mode=mode).put({"x": np.ones(3000)})
    assert ref.kind == kind
    release_all([ref])
    with pytest.raises(ValueError, match="mode"):
        make_connector(mode="rdma")


def test_node_and_service_come_from_the_environment(monkeypatch, prefix, service):
    monkeypatch.setenv(NODE_ENV, "far")
    monkeypatch.setenv(SERVICE_ENV, service.address)
    ref = make_connector(0, prefix=prefix).put({"x": np.ones(10)})
    assert (ref.node, ref.service) == ("far", service.address)
    monkeypatch.setenv(NODE_ENV, "near")  # a reader on another node fetches it
    assert make_connector().get(ref)["x"].tolist() == [1.0] * 10
    assert service.stats()["gets"] == 1
    release_all([ref])  # through the service: one request
    assert list_segments(prefix) == [] and service.stats()["releases"] == 1
    monkeypatch.delenv(NODE_ENV)
    monkeypatch.delenv(SERVICE_ENV)
    plain = make_connector(0, prefix=prefix).put({"x": np.ones(10)})
    assert (plain.node, plain.service) == (None, None)
    release_all([plain])


def test_release_all_batches_remote_refs_per_service_and_never_raises(prefix, service):
    producer = NodeConnector(0, prefix, node="far", service=service.address)
    refs = [producer.put({"x": np.full(100, i)}) for i in range(5)]
    local = make_connector(0, prefix=prefix + "here-").put({"x": np.ones(4)})
    dead = ConnectorRef(kind="shm", size=8, layout=(), location=prefix + "dead", node="gone",
                        service="127.0.0.1:1")
    orphan = ConnectorRef(kind="shm", size=8, layout=(), location=prefix + "orphan", node="gone")
    release_all([None, *refs, refs[0], local, dead, orphan])  # logs the dead and the orphan
    assert list_segments(prefix) == []
    stats = service.stats()
    assert stats["releases"] == 5 and stats["segments"] == 0


def test_get_from_an_unreachable_service_raises_data_service_error(prefix):
    ref = ConnectorRef(kind="shm", size=8, layout=(), location=prefix + "x", node="gone",
                       service="127.0.0.1:1")
    with pytest.raises(DataServiceError, match="127.0.0.1:1"):
        NodeConnector(node="near").get(ref)
    no_service = ConnectorRef(kind="shm", size=8, layout=(), location=prefix + "x", node="gone")
    with pytest.raises(ConnectorError, match="no data service"):
        NodeConnector(node="near").get(no_service)


def test_get_is_zero_copy_read_only_and_outlives_release(prefix):
    connector = make_connector(0, prefix=prefix)
    big = np.arange(1 << 20, dtype=np.float32)
    ref = connector.put({"big": big, "small": np.arange(3)})
    out = connector.get(ref)
    again = connector.get(ref)["big"]
    with pytest.raises(ValueError, match="read-only"):
        out["big"][0] = 1
    assert not out["big"].flags.owndata and not out["big"].flags.writeable
    assert not np.shares_memory(out["big"], again)  # two mappings, one segment
    connector.release(ref)
    assert list_segments(prefix) == []
    np.testing.assert_array_equal(out["big"], big)  # the mapping keeps the pages
    writable = np.array(out["big"])  # what a consumer that must write does
    writable[0] = 7
    assert writable.flags.writeable and out["big"][0] == 0


def test_arrays_are_packed_at_64_byte_aligned_offsets(prefix):
    ref = make_connector(0, prefix=prefix).put(sample_outputs())
    arrays = [f for f in ref.layout if f.kind in ("array", "str", "bytes")]
    assert {f.kind for f in arrays} == {"array", "str", "bytes"}
    assert all(f.offset % ALIGN == 0 for f in arrays)
    assert ref.size == arrays[-1].offset + arrays[-1].nbytes
    release_all([ref])


def test_threshold_picks_inline_up_to_and_including_it_and_shm_above(prefix):
    outputs = {"x": np.zeros(1024, dtype=np.uint8)}
    assert make_connector(1024, prefix=prefix).put(outputs).kind == "inline"
    ref = make_connector(1023, prefix=prefix).put(outputs)
    assert ref.kind == "shm" and ref.location.startswith(prefix)
    assert list_segments(prefix) == [ref.location]
    release_all([ref])


@pytest.mark.parametrize("outputs", [{}, {"text": "hi"}, {"empty": np.empty((0, 3))}])
def test_outputs_without_array_bytes_need_no_segment(prefix, outputs):
    connector = ShmConnector(prefix)
    ref = connector.put(outputs)
    assert ref.kind == "inline" and list_segments(prefix) == []
    assert list(connector.get(ref)) == list(outputs)


def test_a_long_text_counts_towards_the_inline_threshold_and_rides_in_no_message(prefix):
    """A review: a 200 kB text went inline under a 64 KiB threshold (only array bytes
    counted), in every actor message that carried its ref."""
    connector = make_connector(65536, prefix=prefix)
    ref = connector.put({"text": "a" * 200_000, "token_ids": np.zeros(10, np.int32)})
    assert ref.kind == "shm" and ref.size > 200_000
    assert len(pickle.dumps(ref)) < 2048
    assert connector.get(ref)["text"] == "a" * 200_000
    connector.release(ref)
    small = connector.put({"text": "a" * 2000})
    assert small.kind == "inline" and connector.get(small)["text"] == "a" * 2000
    # numpy's str_ and bytes_ scalars are str and bytes: packed the same, read back as str and bytes
    ref = connector.put({"a": np.str_("é" * 800), "b": np.bytes_(b"x" * 3000), "c": np.arange(3)})
    got = connector.get(ref)
    assert (got["a"], got["b"], got["c"].tolist()) == ("é" * 800, b"x" * 3000, [0, 1, 2])


def test_ref_pickles_small_even_for_a_10mb_payload(prefix):
    connector = make_connector(prefix=prefix)
    ref = connector.put({"audio": np.ones(5_000_000, dtype=np.int16), "sample_rate": 24000})
    assert ref.kind == "shm" and ref.size == 10_000_000
    assert len(pickle.dumps(ref)) < 2048
    connector.release(ref)


def _child_checksum(ref: ConnectorRef, queue) -> None:
    out = make_connector().get(ref)
    queue.put(float(out["hidden_states"].sum()))


def test_get_in_forked_child_sees_same_bytes_and_segment_outlives_child(prefix):
    connector = make_connector(0, prefix=prefix)
    hidden = np.random.default_rng(1).standard_normal((128, 64)).astype(np.float32)
    ref = connector.put({"hidden_states": hidden})
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_checksum, args=(ref, queue))
    child.start()
    assert queue.get(timeout=30) == float(hidden.sum())
    child.join(30)
    assert child.exitcode == 0
    assert list_segments(prefix) == [ref.location]
    np.testing.assert_array_equal(connector.get(ref)["hidden_states"], hidden)
    connector.release(ref)
    assert list_segments(prefix) == []


def run_python(code: str, stdin: bytes = b"", prefix: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), PREFIX_ENV: prefix}
    return subprocess.run([sys.executable, "-c", code], input=stdin, capture_output=True,
                          env=env, timeout=60, check=False)


CONCURRENT_GETS = """
import pickle, sys, threading
from omni_actors.connectors import make_connector
ref = pickle.loads(sys.stdin.buffer.read())
connector = make_connector()
sums = []
def read():
    for _ in range(20):
        sums.append(int(connector.get(ref)["audio"].astype("int64").sum()))
threads = [threading.Thread(target=read) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
assert len(set(sums)) == 1 and len(sums) == 160
print(sums[0])
"""


def test_child_that_attached_exits_without_leak_warning_and_segment_survives(prefix):
    connector = make_connector(0, prefix=prefix)
    audio = np.arange(-30_000, 30_000, dtype=np.int16)
    ref = connector.put({"audio": audio, "sample_rate": 24000})
    proc = run_python(CONCURRENT_GETS, pickle.dumps(ref))
    assert proc.returncode == 0, proc.stderr.decode()
    assert int(proc.stdout) == int(audio.astype(np.int64).sum())
    assert proc.stderr.decode() == ""  # no "leaked shared_memory", no tracker KeyError
    assert list_segments(prefix) == [ref.location]
    connector.release(ref)


PRODUCER = """
import sys, pickle, numpy as np
from omni_actors.connectors import make_connector
ref = make_connector(0).put({"codes": np.arange(4096, dtype=np.int64), "text": "ok"})
sys.stdout.buffer.write(pickle.dumps(ref))
"""


def test_segment_put_by_a_child_outlives_it_until_the_owner_releases(prefix):
    proc = run_python(PRODUCER, prefix=prefix)
    assert proc.returncode == 0 and proc.stderr.decode() == "", proc.stderr.decode()
    ref = pickle.loads(proc.stdout)
    assert ref.location.startswith(prefix) and list_segments(prefix) == [ref.location]
    out = make_connector().get(ref)
    np.testing.assert_array_equal(out["codes"], np.arange(4096))
    assert out["text"] == "ok"
    release_all([ref])
    assert list_segments(prefix) == []


def test_release_is_idempotent_and_leaves_no_segment(prefix):
    connector = make_connector(0, prefix=prefix)
    ref = connector.put({"x": np.ones(1000)})
    connector.release(ref)
    connector.release(ref)
    assert list_segments(prefix) == [] and not os.path.exists(f"/dev/shm/{ref.location}")
    inline = make_connector(prefix=prefix).put({"x": np.ones(3)})
    connector.release(inline)  # inline release is a no-op
    assert connector.get(inline)["x"].tolist() == [1.0, 1.0, 1.0]


def test_get_after_release_raises_connector_error_naming_the_segment(prefix):
    connector = make_connector(0, prefix=prefix)
    ref = connector.put({"x": np.ones(10)})
    connector.release(ref)
    with pytest.raises(ConnectorError, match=ref.location):
        connector.get(ref)
    with pytest.raises(LookupError):
        connector.get(ref)


def test_sweep_removes_leftovers_of_one_system_only(prefix):
    other = prefix + "other-"
    mine = make_connector(0, prefix=prefix)
    leftovers = [mine.put({"x": np.full(100, i)}) for i in range(3)]
    theirs = make_connector(0, prefix=other).put({"x": np.ones(5)})
    sweep_segments(other)  # first sweep the longer prefix; it must not touch ours
    assert sorted(r.location for r in leftovers) == list_segments(prefix)
    assert sweep_segments(prefix) == 3
    assert list_segments(prefix) == [] and sweep_segments(prefix) == 0
    with pytest.raises(ConnectorError):
        mine.get(theirs)
    with pytest.raises(ValueError):
        sweep_segments("")


def test_release_all_skips_none_and_never_raises(prefix):
    connector = make_connector(0, prefix=prefix)
    ref = connector.put({"x": np.ones(10)})
    bogus = ConnectorRef(kind="rdma", size=1, layout=(), location="nowhere")
    gone = ConnectorRef(kind="shm", size=1, layout=(), location=prefix + "gone")
    release_all([None, make_connector().put({"t": "x"}), ref, ref, gone, bogus])
    assert list_segments(prefix) == []


def test_unpackable_dtype_raises_type_error_and_leaves_nothing(prefix):
    with pytest.raises(TypeError, match="obj"):
        make_connector(0, prefix=prefix).put({"x": np.ones(10), "obj": np.array([{}, 1])})
    # a void dtype (what ml_dtypes' bfloat16 is to numpy: '<V2') came back as bare bytes (a code review)
    with pytest.raises(TypeError, match="'raw'.*would come back as raw bytes"):
        make_connector(0, prefix=prefix).put({"x": np.ones(10), "raw": np.zeros(4, dtype="V2")})
    assert list_segments(prefix) == []


def test_default_prefix_comes_from_the_environment(monkeypatch, prefix):
    monkeypatch.setenv(PREFIX_ENV, prefix + "env-")
    ref = make_connector(0).put({"x": np.ones(10)})
    assert ref.location.startswith(prefix + "env-")
    release_all([ref])
    monkeypatch.delenv(PREFIX_ENV)
    assert ShmConnector().prefix == "omni-actors-"


def test_a_large_put_round_trips_exactly(prefix):
    rng = np.random.default_rng(3)
    outputs = {"a": rng.integers(0, 255, 9_000_001, dtype=np.uint8),  # odd sizes: parts end mid-page
               "meta": "x", "b": rng.standard_normal((1031, 2049)).astype(np.float32)}
    connector = make_connector(0, prefix=prefix)
    ref = connector.put(outputs)
    assert ref.size > 16 << 20
    got = connector.get(ref)
    np.testing.assert_array_equal(got["a"], outputs["a"])
    np.testing.assert_array_equal(got["b"], outputs["b"])
    connector.release(ref)
