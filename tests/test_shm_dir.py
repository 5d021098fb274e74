"""The segment directory is configurable (``$OMNI_ACTORS_SHM_DIR`` / ``start --shm-dir``):
segments are plain files there, and everything that makes, reads, lists, sweeps,
reaps or serves them uses the directory of its own process, read when used.

Unit tests on a temporary directory (any directory works; a tmpfs with huge
pages is what makes it fast), plus one system test: a leader started with
``--shm-dir`` puts its actors' segments there (they inherit the variable),
with ``deployment.connector: shm`` and a legacy vLLM-Omni ``runtime.connectors``
block reported by ``status``.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import yaml

from omni_actors.connectors import DIR_ENV, ConnectorError, DataService, NodeConnector, SegmentDirError, \
    check_segment_dir, list_segments, make_connector, release_all, segment_dir, segment_usage, sweep_segments
from omni_actors.connectors import data_service as ds
from omni_actors.connectors.shm import SHM_DIR

from test_connectors import assert_same_outputs, sample_outputs

#: These tests are about per-put segments; slots are tested in test_shm_slots.py.
pytestmark = pytest.mark.usefixtures("segments_not_slots")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def prefix():
    p = f"oa-test-{os.getpid()}-{uuid.uuid4().hex[:8]}-"
    yield p
    sweep_segments(p, SHM_DIR)  # none should be there; in case a test fails half-way


@pytest.fixture
def shm_dir(tmp_path, monkeypatch, prefix) -> Path:
    """A fresh segment directory, set as this process's ``$OMNI_ACTORS_SHM_DIR``."""
    d = tmp_path / "segments"
    d.mkdir()
    monkeypatch.setenv(DIR_ENV, str(d))
    yield d
    sweep_segments(prefix, str(d))


def _files(d: Path) -> list[str]:
    return sorted(os.listdir(d))


def test_default_is_dev_shm_and_the_variable_is_read_when_used(monkeypatch, tmp_path):
    monkeypatch.delenv(DIR_ENV, raising=False)
    assert segment_dir() == SHM_DIR == "/dev/shm"
    monkeypatch.setenv(DIR_ENV, str(tmp_path))
    assert segment_dir() == str(tmp_path)


def test_put_get_release_list_sweep_in_the_directory(shm_dir, prefix):
    connector = make_connector(0, prefix=prefix)
    outputs = sample_outputs()
    ref = connector.put(outputs)
    assert ref.kind == "shm" and _files(shm_dir) == [ref.location]
    assert not os.path.exists(os.path.join(SHM_DIR, ref.location))
    assert list_segments(prefix) == [ref.location] == list_segments(prefix, str(shm_dir))
    assert list_segments(prefix, SHM_DIR) == []
    assert segment_usage(prefix) == (1, os.stat(shm_dir / ref.location).st_size)
    got = connector.get(pickle.loads(pickle.dumps(ref)))
    assert_same_outputs(got, outputs)
    connector.release(ref)
    assert _files(shm_dir) == [] and list_segments(prefix) == []
    assert_same_outputs(got, outputs)  # arrays read before the release stay valid (their mapping)
    connector.release(ref)  # idempotent

    refs = [connector.put({"x": np.full(100, i)}) for i in range(3)]
    assert sweep_segments(prefix) == 3 and _files(shm_dir) == []
    release_all(refs)  # already gone: silent


def test_a_process_looking_in_another_directory_does_not_find_the_segment(shm_dir, prefix, monkeypatch, tmp_path):
    connector = make_connector(0, prefix=prefix)
    ref = connector.put({"x": np.arange(10)})
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.setenv(DIR_ENV, str(other))
    with pytest.raises(ConnectorError, match=f"{ref.location}.*not found in {other}"):
        connector.get(ref)
    monkeypatch.setenv(DIR_ENV, str(shm_dir))
    np.testing.assert_array_equal(connector.get(ref)["x"], np.arange(10))
    release_all([ref])
    assert _files(shm_dir) == []


def test_data_service_serves_releases_and_reaps_the_directory(shm_dir, prefix):
    with DataService("127.0.0.1", 0, prefix, node="far", reap_after_s=60) as svc:
        try:
            producer = NodeConnector(0, prefix, node="far", service=svc.address)
            consumer = NodeConnector(node="near")
            outputs = sample_outputs()
            ref = producer.put(outputs)
            assert svc.stats()["dir"] == str(shm_dir) and svc.stats()["segments"] == 1
            assert_same_outputs(consumer.get(ref), outputs)  # fetched from the file in shm_dir
            consumer.release(ref)  # through the service
            assert _files(shm_dir) == [] and svc.stats()["releases"] == 1

            old = producer.put({"x": np.ones(10)})
            past = time.time() - 120
            os.utime(shm_dir / old.location, (past, past))
            young = producer.put({"x": np.ones(10)})
            assert svc.reap() == 1 and _files(shm_dir) == [young.location]
            release_all([young])
        finally:
            ds.close_connections()


@pytest.mark.parametrize("how", ["env", "flag"])
def test_data_service_process_uses_its_directory(shm_dir, prefix, how):
    """Another host's data service (its own process) serves the segments of its own directory."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [sys.executable, "-m", "omni_actors.connectors.data_service", "--host", "127.0.0.1", "--port", "0",
            "--prefix", prefix, "--node", "far"]
    if how == "flag":
        env.pop(DIR_ENV)
        args += ["--shm-dir", str(shm_dir)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("READY "), line
        address = line.split()[1]
        producer = NodeConnector(0, prefix, node="far", service=address)
        ref = producer.put({"x": np.arange(100_000, dtype=np.float32)})
        got = NodeConnector(node="near").get(ref)
        np.testing.assert_array_equal(got["x"], np.arange(100_000, dtype=np.float32))
        assert ds.stats(address)["dir"] == str(shm_dir)
        assert ds.release(address, [ref.location]) == 1 and _files(shm_dir) == []
    finally:
        ds.close_connections()
        proc.terminate()
        proc.wait(10)


def test_an_unusable_directory_is_a_clear_error(tmp_path, monkeypatch, prefix):
    missing, a_file = tmp_path / "missing", tmp_path / "file"
    a_file.write_text("")
    for path, why in [(missing, "does not exist"), (a_file, "is not a directory"),
                      (Path("relative/dir"), "must be an absolute path")]:
        with pytest.raises(SegmentDirError, match=f"segment directory '{path}'.*{why}"):
            check_segment_dir(str(path))
    monkeypatch.setenv(DIR_ENV, str(missing))
    with pytest.raises(SegmentDirError, match=f"'{missing}' .*OMNI_ACTORS_SHM_DIR.*does not exist"):
        make_connector(0, prefix=prefix).put({"x": np.ones(10)})
    assert make_connector(10**6, prefix=prefix).put({"x": np.ones(10)}).kind == "inline"  # no segment needed
    assert list_segments(prefix) == [] and sweep_segments(prefix) == 0  # nothing there: nothing to list
    with pytest.raises(SegmentDirError, match="does not exist"):
        DataService("127.0.0.1", 0, prefix).start()
    monkeypatch.setenv(DIR_ENV, str(tmp_path))
    assert check_segment_dir() == str(tmp_path)


def test_start_refuses_a_bad_shm_dir(tmp_path):
    missing = tmp_path / "missing"
    for extra in (["--convention-leader"], ["--convention-address", "127.0.0.1:1", "--admin-port", "1"]):
        done = subprocess.run([sys.executable, "-m", "omni_actors.system", "start", *extra,
                               "--shm-dir", str(missing)], capture_output=True, text=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip() == (f"error: segment directory '{missing}' ($OMNI_ACTORS_SHM_DIR / --shm-dir) "
                                       "does not exist")


@pytest.mark.system
def test_leader_started_with_shm_dir_puts_every_segment_there(tmp_path):
    """--shm-dir reaches every actor (engines put there, the API server reads there),
    deployment.connector: shm puts every output with array data in a segment, and a legacy
    vLLM-Omni runtime.connectors block is accepted and reported by `status`."""
    from omni_actors.system.faultlab import assert_clean_exit
    from omni_actors.system.local import LocalLeader

    import httpx

    data = yaml.safe_load((REPO / "configs" / "cpu_omni_demo.yaml").read_text())
    data["deployment"]["connector"] = "shm"
    data["runtime"] = {"connectors": {"rdma": {"name": "MooncakeStoreConnector", "extra": {"host": "x"}}}}
    talker = next(i for i, s in enumerate(data["stage_args"]) if s["engine_args"]["model_stage"] == "talker")
    data["stage_args"][talker]["output_connectors"] = {"to_stage_2": "rdma"}
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(data))
    segments = tmp_path / "segments"
    segments.mkdir()

    leader = LocalLeader(config, extra_args=["--shm-dir", str(segments)])
    try:
        leader.start()
        assert leader.shm_dir == str(segments)
        os.utime(segments, (0, 0))  # creating (or unlinking) a segment there moves this
        body = {"model": data["deployment"]["served_model_name"], "max_tokens": 8,
                "modalities": ["text", "audio"], "messages": [{"role": "user", "content": "hello"}]}
        r = httpx.post(leader.base_url + "/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["audio"]["data"]
        assert os.stat(segments).st_mtime > 0, "no segment was made in --shm-dir"
        assert list_segments(f"oa-{leader.admin_port}-", SHM_DIR) == []

        status = subprocess.run([sys.executable, "-m", "omni_actors.system", "status", "--json",
                                 "--admin-port", str(leader.admin_port)],
                                capture_output=True, text=True, timeout=60, cwd=REPO)
        notes = json.loads(status.stdout)["notes"]
        assert any(f"stage_args[{talker}].output_connectors.to_stage_2" in n and "MooncakeStoreConnector" in n
                   and "not applied: needs vLLM-Omni's own connector (e.g. Mooncake)" in n for n in notes), notes
    finally:
        assert_clean_exit(leader)
