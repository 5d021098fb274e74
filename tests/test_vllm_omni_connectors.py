"""vLLM-Omni's own connectors carrying stage outputs (issue 6): the adapter
(:mod:`omni_actors.connectors.omni`) round-trips packed outputs through a
connector built by vLLM-Omni's factory, across processes, and releases them;
a config naming one gives its engines an ``omni:`` connector mode.

The connector used is vLLM-Omni's ``SharedMemoryConnector``, the one that
runs without infrastructure (a config naming it gets ours instead; these
tests name it in the mode directly), and ``MooncakeStoreConnector`` against a
real Mooncake master started here, its store over TCP on loopback (the
``mooncake`` package, ``mooncake-transfer-engine-non-cuda``, which
``scripts/install_vllm_omni_cpu.sh`` installs; skipped without it). The
master's metadata and metrics servers listen on every interface (Mooncake
0.3.11 binds them so whatever host it is given); everything connects to
127.0.0.1.

Skips where ``vllm_omni`` is not importable (the main venv): run with
``make test-vllm-omni``. Importing vLLM-Omni takes 5-15 s per process.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import io
import json
import importlib.util
import multiprocessing
import os
import pickle
import socket
import subprocess
import time
import uuid
import wave
from pathlib import Path

import numpy as np
import pytest
import yaml

from omni_actors.config import load_config
from omni_actors.connectors import NodeConnector, list_segments, make_connector, release_all, sweep_segments
from omni_actors.connectors import omni
from omni_actors.connectors.omni import OmniConnectorError, encode_mode, parse_mode

from conftest import OMNI_SKIP_REASON as SKIP_REASON, omni_importable, stop_process
from test_config import BASE


def _omni_importable() -> bool:
    return omni_importable("vllm_omni.distributed.omni_connectors.factory")


pytestmark = pytest.mark.skipif(not _omni_importable(), reason=SKIP_REASON)

SHM_MODE = encode_mode("SharedMemoryConnector", stage=0)
SHM_DIR = Path("/dev/shm")  # vLLM-Omni's SharedMemoryConnector always uses it


@pytest.fixture
def prefix():
    """A segment prefix of this test only; afterwards nothing of it may be left in
    /dev/shm (vLLM-Omni's segments and its lock files ``shm_<key>_lockfile.lock``)."""
    p = f"oa-vo-test-{os.getpid()}-{uuid.uuid4().hex[:8]}-"
    yield p
    omni.close_all()
    left = sorted(n for n in os.listdir(SHM_DIR) if n.startswith(p) or n.startswith(f"shm_{p}"))
    sweep_segments(p, str(SHM_DIR))
    for n in left:
        if n.startswith("shm_"):
            (SHM_DIR / n).unlink(missing_ok=True)
    assert not left, left


def sample_outputs() -> dict:
    rng = np.random.default_rng(1)
    return {
        "text": "hi",
        "token_ids": np.arange(9, dtype=np.int32),
        "hidden_states": rng.standard_normal((9, 256)).astype(np.float32),
        "audio": (rng.standard_normal(24_000) * 3000).astype(np.int16),
        "sample_rate": 24000,
        "shape_hint": (3, 4),
        "latents": rng.standard_normal((2, 3)).astype(np.float16),
        "big_endian": np.arange(5, dtype=">i4"),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        if isinstance(v, np.ndarray):
            assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
            assert got[k].tobytes() == v.tobytes(), k
            assert not got[k].flags.writeable, k
        else:
            assert got[k] == v and type(got[k]) is type(v), k


def vo_files(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix) or n.startswith(f"shm_{prefix}"))


# -- the adapter -----------------------------------------------------------------------------------

def test_round_trip_through_vllm_omnis_shared_memory_connector(prefix):
    conn = NodeConnector(1024, prefix, mode=SHM_MODE)
    conn.prepare()
    outputs = sample_outputs()
    ref = conn.put(outputs)
    assert ref.kind == "omni" and ref.omni.connector == "SharedMemoryConnector"
    assert ref.omni.from_stage == "0" and ref.location == ref.omni.key and ref.location.startswith(prefix)
    assert ref.omni.metadata["shm"]["name"] == ref.location  # what vLLM-Omni's put returned
    assert ref.size >= outputs["hidden_states"].nbytes + outputs["audio"].nbytes
    assert len(pickle.dumps(ref)) < 2048  # small: the array bytes stay in the connector
    ref = pickle.loads(pickle.dumps(ref))
    assert vo_files(prefix) == sorted([ref.location, f"shm_{ref.location}_lockfile.lock"])

    assert_same(conn.get(ref), outputs)
    # vLLM-Omni's SharedMemoryConnector hands a payload to its first reader only.
    assert vo_files(prefix) == []
    with pytest.raises(OmniConnectorError, match="read already"):
        conn.get(ref)
    conn.release(ref)  # nothing left to free: a no-op


def test_small_and_final_outputs_stay_on_our_connectors(prefix):
    conn = NodeConnector(1024, prefix, mode=SHM_MODE)
    small = {"token_ids": np.arange(4, dtype=np.int32), "text": "x"}
    assert conn.put(small).kind == "inline"
    final = conn.put(sample_outputs(), final=True)  # for the API server: ours
    assert final.kind == "shm"
    assert_same(conn.get(final), sample_outputs())
    release_all([final])
    assert list_segments(prefix) == []


def test_release_frees_what_nobody_read(prefix):
    conn = NodeConnector(0, prefix, mode=SHM_MODE)
    refs = [conn.put(sample_outputs()) for _ in range(3)]
    assert len(vo_files(prefix)) == 6  # a segment and a lock file each
    conn.release(refs[0])
    release_all([None, refs[1], refs[2], refs[2]])  # twice: idempotent
    assert vo_files(prefix) == []
    with pytest.raises(OmniConnectorError):
        conn.get(refs[1])


def test_release_where_the_connector_is_not_built_yet_runs_off_the_callers_thread(prefix):
    conn = NodeConnector(0, prefix, mode=SHM_MODE)
    ref = conn.put(sample_outputs())
    kept = dict(omni._built)  # as in a process that never used it (kept: dropping it would close it)
    omni._built.clear()
    try:
        release_all([ref])  # queued: the worker thread builds the connector, then frees the data
        deadline = time.monotonic() + 30
        while vo_files(prefix) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert vo_files(prefix) == []
        assert ("SharedMemoryConnector", "{}") in omni._built
    finally:
        omni.close_all()
        omni._built.update(kept)


def test_a_connector_is_built_once_per_process_and_settings(prefix):
    a = omni.connector("SharedMemoryConnector", omni.settings_json({"x": 1}))
    assert omni.connector("SharedMemoryConnector", '{"x":1}') is a
    assert omni.connector("SharedMemoryConnector", "{}") is not a
    with pytest.raises(ValueError, match="Unknown connector"):
        omni.connector("NoSuchConnector")


def _read_and_release(ref_bytes: bytes, release_bytes: bytes, results) -> None:
    """In a spawned process: read one ref, release another, through a fresh connector."""
    try:
        conn = make_connector()
        got = conn.get(pickle.loads(ref_bytes))
        release_all([pickle.loads(release_bytes)])
        results.put({k: (v.dtype.str, v.shape, v.tobytes()) if isinstance(v, np.ndarray) else v
                     for k, v in got.items()})
    except BaseException as exc:  # noqa: BLE001
        results.put(f"{type(exc).__name__}: {exc}")


def test_a_ref_is_read_and_released_from_another_process(prefix):
    conn = NodeConnector(0, prefix, mode=SHM_MODE)
    outputs = sample_outputs()
    read, other = conn.put(outputs), conn.put(outputs)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_read_and_release, args=(pickle.dumps(read), pickle.dumps(other), results))
    proc.start()
    try:
        got = results.get(timeout=180)
    finally:
        proc.join(60)
    assert proc.exitcode == 0
    assert isinstance(got, dict), got
    for k, v in outputs.items():
        assert got[k] == ((v.dtype.str, v.shape, v.tobytes()) if isinstance(v, np.ndarray) else v), k
    assert vo_files(prefix) == []  # read (consumed) there, and the other released there


def test_modes_round_trip_and_bad_ones_are_refused():
    mode = encode_mode("MooncakeStoreConnector", {"master": "h:1"}, stage=2,
                       inputs=[("SharedMemoryConnector", None)])
    spec = parse_mode(mode)
    assert (spec.name, json.loads(spec.extra), spec.stage) == ("MooncakeStoreConnector", {"master": "h:1"}, "2")
    assert spec.inputs == (("SharedMemoryConnector", "{}"),)
    assert parse_mode("omni:SharedMemoryConnector").name == "SharedMemoryConnector"
    assert parse_mode("auto") is None
    for bad in ("omni:", "omni:{nope", "omni:a b"):
        with pytest.raises(ValueError):
            NodeConnector(mode=bad)


# -- a config naming a vLLM-Omni connector ---------------------------------------------------------

MOONCAKE = {"name": "MooncakeStoreConnector",
            "extra": {"host": "127.0.0.1", "master": "127.0.0.1:1", "metadata_server": "http://127.0.0.1:1/m"}}


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # its __del__ after a failed init
def test_a_config_naming_mooncake_gives_its_engines_an_omni_mode(tmp_path, monkeypatch):
    # Mooncake's client tries a master 20 times, about 4.5 s each (90 s here), before it fails:
    # once is enough to see the failure.
    monkeypatch.setenv("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    data = copy.deepcopy(BASE)
    data["runtime"] = {"connectors": {"rdma": MOONCAKE}}
    data["stage_args"][1]["output_connectors"] = {"to_stage_2": "rdma"}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    cfg = load_config(path)
    thinker, talker, code2wav = cfg.stage_args
    assert cfg.connector_mode_of(thinker) is None
    mine = parse_mode(cfg.connector_mode_of(talker))
    assert (mine.name, json.loads(mine.extra), mine.stage) == ("MooncakeStoreConnector", MOONCAKE["extra"], "1")
    reader = parse_mode(cfg.connector_mode_of(code2wav))  # reads the Talker's refs: opens it at start
    assert reader.name is None and reader.inputs == (("MooncakeStoreConnector", mine.extra),)
    assert any("(MooncakeStoreConnector): applied to talker" in n for n in cfg.omni_connectors.notes)
    assert not any("not applied" in n for n in cfg.omni_connectors.notes)
    # The engine really asks vLLM-Omni for it: here it fails (no mooncake package, no master),
    # and the engine reports that as its load failure.
    conn = make_connector(mode=cfg.connector_mode_of(talker))
    with pytest.raises(ValueError, match="MooncakeStoreConnector"):
        conn.prepare()


# -- a pipeline served with every stage output through vLLM-Omni's connector ---------------------

DATAPLANE = Path(__file__).resolve().parent / "configs" / "dataplane.yaml"
PROMPTS = ["Tell me about the sea.", "one two three four five"]


def _pipeline_config(tmp: Path) -> Path:
    data = yaml.safe_load(DATAPLANE.read_text())
    for stage in data["deployment"]["stages"].values():
        stage.pop("nodes", None)
    data["deployment"].update(ready_timeout_s=300, request_timeout_s=240, request_actors=2)
    data["deployment"]["supervision"] = {"queue_timeout_s": 200, "stall_timeout_s": 60}
    path = tmp / "dataplane_one_host.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


async def _answers(base_url: str, *, stream: bool) -> list[dict]:
    import aiohttp

    out = []
    async with aiohttp.ClientSession() as s:
        for prompt in PROMPTS:
            body = {"model": "dataplane-test", "messages": [{"role": "user", "content": prompt}],
                    "stream": stream, "modalities": ["text", "audio"]}
            async with s.post(base_url + "/chat/completions", json=body) as r:
                if not stream:
                    payload = await r.json()
                    assert r.status == 200, payload
                    message = payload["choices"][0]["message"]
                    with wave.open(io.BytesIO(base64.b64decode(message["audio"]["data"]))) as w:
                        out.append({"text": message["content"], "pcm": w.readframes(w.getnframes())})
                    continue
                text, pcm = "", b""
                async for line in r.content:
                    line = line.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    obj = json.loads(line[6:])
                    assert "error" not in obj, obj
                    delta = obj["choices"][0]["delta"] if obj.get("choices") else {}
                    text += delta.get("content") or ""
                    pcm += base64.b64decode(delta.get("audio", {}).get("data", ""))
                out.append({"text": text, "pcm": pcm})
    return out


@pytest.fixture(scope="module")
def ours(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The one-host pipeline config and its answers on our own connectors (served once for
    the module: what vLLM-Omni's connectors must reproduce byte for byte)."""
    from omni_actors.system.local import LocalLeader

    config = _pipeline_config(tmp_path_factory.mktemp("ours"))
    with LocalLeader(config) as leader:
        want = asyncio.run(_answers(leader.base_url, stream=False))
    assert all(w["text"] and len(w["pcm"]) > 0 for w in want)
    return config, want


@pytest.mark.system
def test_pipeline_through_vllm_omnis_connector_is_byte_identical(ours):
    from omni_actors.system.local import LocalLeader

    config, want = ours
    # Every engine (and every other process) defaults to vLLM-Omni's SharedMemoryConnector:
    # inline_threshold_bytes 0 puts every output and streamed chunk with array data through it.
    with LocalLeader(config, env={"OMNI_ACTORS_CONNECTOR": "omni:SharedMemoryConnector"},
                     start_timeout_s=400) as theirs:
        got = asyncio.run(_answers(theirs.base_url, stream=False))
        streamed = asyncio.run(_answers(theirs.base_url, stream=True))
        prefix = f"oa-{theirs.admin_port}-"
        log = theirs.log_path.read_text()
    for w, g, s in zip(want, got, streamed):
        assert g == w and s == w
    assert log.count('"omni_connector_built"') >= 5, "every engine built vLLM-Omni's connector"
    assert '"omni_connector_not_applied"' not in log
    assert [n for n in os.listdir(SHM_DIR) if n.startswith(prefix) or n.startswith(f"shm_{prefix}")] == []


# -- a real Mooncake store (MooncakeStoreConnector over TCP on loopback) -----------------------------

def _mooncake_master() -> str | None:
    """The ``mooncake_master`` binary of an importable ``mooncake.store``; None if there is none."""
    try:
        import mooncake.store  # noqa: F401 - (its C++ library needs libibverbs)
    except ImportError:
        return None
    spec = importlib.util.find_spec("mooncake")
    binary = Path(spec.origin).parent / "mooncake_master" if spec and spec.origin else None
    return str(binary) if binary is not None and os.access(binary, os.X_OK) else None


@pytest.fixture(scope="module")
def mooncake(request) -> tuple[dict, str]:
    """A Mooncake master (with its HTTP metadata server) on free loopback ports, for this
    module: the settings of a ``MooncakeStoreConnector`` that uses it over TCP, and the URL
    of the master's Prometheus metrics."""
    from omni_actors.system.local import free_port

    binary = _mooncake_master()
    if binary is None:
        pytest.skip("the mooncake package (mooncake-transfer-engine-non-cuda, with libibverbs) is not "
                    "installed: scripts/install_vllm_omni_cpu.sh installs it")
    rpc, meta, metrics = free_port(), free_port(), free_port()
    proc = subprocess.Popen([binary, f"-rpc_port={rpc}", "-rpc_address=127.0.0.1",
                             "-enable_http_metadata_server=true", "-http_metadata_server_host=127.0.0.1",
                             f"-http_metadata_server_port={meta}", f"-metrics_port={metrics}",
                             "-enable_metric_reporting=false"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    request.addfinalizer(lambda: stop_process(proc))
    deadline = time.monotonic() + 20
    for port in (rpc, meta):
        while True:
            assert proc.poll() is None, f"mooncake_master exited with {proc.returncode}"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, f"mooncake_master is not listening on {port}"
                time.sleep(0.1)
    return ({"host": "127.0.0.1", "master": f"127.0.0.1:{rpc}", "metadata_server": f"http://127.0.0.1:{meta}/metadata",
             "proto": "tcp", "segment": 64 << 20, "localbuf": 16 << 20}, f"http://127.0.0.1:{metrics}/metrics")


def _master_counts(url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {k: float(v) for k, _, v in (line.partition(" ") for line in lines if line and not line.startswith("#"))}


def _get_from_another_process(ref_bytes: bytes, results) -> None:
    try:
        got = NodeConnector().get(pickle.loads(ref_bytes))
        results.put({k: (v.dtype.str, v.shape, v.tobytes()) if isinstance(v, np.ndarray) else v
                     for k, v in got.items()})
    except BaseException as exc:  # noqa: BLE001
        results.put(f"{type(exc).__name__}: {exc}")
    finally:
        omni.close_all()


def test_outputs_go_through_a_mooncake_store_and_are_read_in_another_process(mooncake, prefix):
    settings, _ = mooncake
    conn = NodeConnector(0, prefix, mode=encode_mode("MooncakeStoreConnector", settings, stage=1))
    outputs = sample_outputs()
    ref = conn.put(outputs)
    assert ref.kind == omni.KIND and ref.omni.connector == "MooncakeStoreConnector"
    assert vo_files(prefix) == []  # nothing of it in shared memory: it is in the store
    assert_same(conn.get(ref), outputs)  # the store keeps it: it reads again (no first-reader hand-off)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_get_from_another_process, args=(pickle.dumps(ref), results))
    proc.start()
    try:
        got = results.get(timeout=180)
    finally:
        proc.join(60)
    assert isinstance(got, dict), got
    for k, v in outputs.items():
        assert got[k] == ((v.dtype.str, v.shape, v.tobytes()) if isinstance(v, np.ndarray) else v), k
    release_all([ref])  # vLLM-Omni's cleanup is a no-op for it: the store evicts


@pytest.mark.system
def test_pipeline_with_a_config_naming_a_mooncake_store_is_byte_identical(mooncake, ours, tmp_path):
    """vLLM-Omni's config form (``runtime.connectors`` and a stage's ``output_connectors``) names
    the Mooncake store for the Talker's codec codes: Code2Wav reads them from the store, and the
    answers equal those of the same pipeline on our connectors."""
    from omni_actors.system.local import LocalLeader

    config, want = ours
    data = yaml.safe_load(config.read_text())
    settings, metrics = mooncake
    before = _master_counts(metrics)
    data["runtime"] = {"connectors": {"store": {"name": "MooncakeStoreConnector", "extra": settings}}}
    talker = next(s for s in data["stage_args"] if s["engine_args"]["model_stage"] == "talker")
    talker["output_connectors"] = {"to_stage_2": "store"}
    named = tmp_path / "mooncake.yaml"
    named.write_text(yaml.safe_dump(data, sort_keys=False))
    with LocalLeader(named, start_timeout_s=400) as theirs:
        got = asyncio.run(_answers(theirs.base_url, stream=False))
        log = theirs.log_path.read_text()
        after = _master_counts(metrics)
    assert got == want
    # the store saw the Talker's outputs go in and Code2Wav read them (one each per prompt at least)
    for counter in ("master_put_end_requests_total", "master_get_replica_list_requests_total"):
        assert after[counter] - before.get(counter, 0) >= len(PROMPTS), (counter, before, after)
    built = [json.loads(line) for line in log.splitlines() if '"omni_connector_built"' in line]
    assert any(b.get("connector") == "MooncakeStoreConnector" for b in built), built
    assert '"omni_connector_not_applied"' not in log
