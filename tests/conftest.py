"""Shared fixtures: real leaders (multiprocTCPBase on free ports), one per config per session.

Each leader is the real CLI in a child process; its finaliser stops it with
SIGINT (as Ctrl-C) and kills anything of that system left behind.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
from pathlib import Path

import pytest

from omni_actors.system.local import LocalLeader

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
TEST_CONFIGS = Path(__file__).resolve().parent / "configs"

#: Modules whose tests run real vLLM engines (or build models with torch). Under pytest-xdist
#: (``make test``) they go to one worker, one after the other (two vLLM engines at once on 2 cores
#: starve each other and any timing around them), and first, as the longest share of the run.
HEAVY_MODULES = ("test_vllm_backend.py", "test_vllm_chain.py", "test_models.py")
#: Single tests of other modules that run real vLLM engines, in the same unit (CI: the vLLM
#: benchmark's two engines beside the vLLM chain's starved a chain test into a false failure).
HEAVY_TESTS = ("test_benchmarks.py::test_vllm_overhead_runs",)


def _heavy(nodeid: str) -> bool:
    """Whether the test ``nodeid`` (``tests/x.py::name[...]``) or module (``tests/x.py``) is heavy."""
    path, _, name = nodeid.partition("::")
    module = path.rsplit("/", 1)[-1]
    return module in HEAVY_MODULES or f"{module}::{name.split('[', 1)[0]}" in HEAVY_TESTS


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Whole modules per worker (their tests share module-scoped leaders and some follow
    on from each other), :data:`HEAVY_MODULES` and :data:`HEAVY_TESTS` as one unit."""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "heavy" if _heavy(nodeid) else nodeid.split("::", 1)[0]

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist, :data:`HEAVY_MODULES` first (every worker collects in this order)."""
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: not _heavy(item.nodeid))  # (stable: the order is kept within)


#: Why a vLLM-Omni test is skipped where vllm_omni does not import.
OMNI_SKIP_REASON = ("vllm_omni is not importable here: vLLM-Omni needs its own venv "
                    "(on a GPU host: pip install -e '.[vllm-omni]'; on this CPU: make test-vllm-omni)")


def omni_importable(module: str = "vllm_omni") -> bool:
    """Whether ``module`` (a part of vLLM-Omni) imports here: vllm_omni is installed and
    its dependencies load (it fails beside a torchvision built for another torch)."""
    import importlib.util

    if importlib.util.find_spec("vllm_omni") is None:
        return False
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001
        return False
    return True


class BackendLoop:
    """An asyncio loop on a daemon thread, as the EngineActor runs its backend (for tests
    that drive an engine backend directly); ``run`` waits ``timeout_s`` by default."""

    def __init__(self, timeout_s: float = 120.0):
        self.timeout_s = timeout_s
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout or self.timeout_s)

    def stop(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


async def collect_events(engine, task) -> tuple[list, object]:
    """A backend's events for ``task``: ``(its TextDeltas, its last other event)``."""
    from omni_actors.engines.base import TextDelta

    deltas, final = [], None
    async for ev in engine.generate(task):
        if isinstance(ev, TextDelta):
            deltas.append(ev)
        else:
            final = ev
    return deltas, final


def marker_line(proc: subprocess.Popen, marker: str) -> list[str]:
    """Read ``proc``'s stdout (text) until a line that starts with ``marker`` (vLLM logs to
    stdout too): the words after it. Fails the test if the stream ends first."""
    line = ""
    for line in proc.stdout:
        if line.startswith(marker):
            break
    assert line.startswith(marker), line
    return line.split()[1:]


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM ``proc`` and reap it; SIGKILL if it has not exited within ``timeout_s``."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(autouse=True)
def _no_release_retries_left_over():
    """Releases a test sent to a data service it had stopped are tried again for minutes
    (omni_actors.connectors.release_retry): not in the next test of this process."""
    yield
    from omni_actors.connectors.release_retry import release_retries

    release_retries.clear()


@pytest.fixture(scope="module")
def vllm_ipc_in_a_temp_dir(tmp_path_factory):
    """For a module whose vLLM engines run in the test's process (outside any system, whose
    replicas use the system's directory): their IPC sockets, and their engine cores' temporary
    files (vLLM's FileStore, ``vllm_dist_<uuid>``: ``$TMPDIR`` of the spawned core), go to a
    directory of the test session's, not to the temp directory, where vLLM leaves them."""
    path = str(tmp_path_factory.mktemp("vllm-ipc"))
    before = {name: os.environ.get(name) for name in ("VLLM_RPC_BASE_PATH", "TMPDIR")}
    os.environ.update(VLLM_RPC_BASE_PATH=path, TMPDIR=path)
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _leader(request, config: Path) -> LocalLeader:
    leader = LocalLeader(config)
    request.addfinalizer(leader.stop)
    leader.start()
    return leader


@pytest.fixture(scope="session")
def omni_leader(request) -> LocalLeader:
    """configs/cpu_omni_demo.yaml: Thinker:Talker:Code2Wav at 1:2:1."""
    return _leader(request, CONFIGS / "cpu_omni_demo.yaml")


@pytest.fixture(scope="session")
def image_leader(request) -> LocalLeader:
    """configs/cpu_image_demo.yaml: AR:DiT at 1:2."""
    return _leader(request, CONFIGS / "cpu_image_demo.yaml")


@pytest.fixture(scope="session")
def fanin_leader(request) -> LocalLeader:
    """tests/configs/fanin.yaml: Code2Wav takes two Talkers; everything through shared memory."""
    return _leader(request, TEST_CONFIGS / "fanin.yaml")


@pytest.fixture()
def openai_client(omni_leader):
    import openai

    client = openai.OpenAI(base_url=omni_leader.base_url, api_key="unused", max_retries=0, timeout=60)
    yield client
    client.close()


@pytest.fixture
def prefix():
    """A segment prefix no other test (or parallel run) uses; its segments are swept
    afterwards and this process's kept segment mappings dropped. (test_shm_dir and the
    vLLM-Omni connector tests have their own.)"""
    import os
    import uuid

    from omni_actors.connectors import sweep_segments
    from omni_actors.connectors.mappings import drop_mappings

    p = f"oa-test-{os.getpid()}-{uuid.uuid4().hex[:8]}-"
    yield p
    sweep_segments(p)
    drop_mappings()


@pytest.fixture
def segments_not_slots(monkeypatch):
    """Every put takes a segment of its own (recycled or new), as when a producer's
    slots are over their budget: ``$OMNI_ACTORS_SHM_SLOT_BYTES`` 0 (slots are
    tested in test_shm_slots.py)."""
    from omni_actors.connectors.slots import SLOT_BYTES_ENV

    monkeypatch.setenv(SLOT_BYTES_ENV, "0")


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """``mount(size)``: a tmpfs of ``size`` (e.g. ``"1m"``) mounted under ``tmp_path``, its
    path; skips the test where this process cannot mount one (not root). Unmounted
    afterwards, once this process's segment mappings are dropped."""
    import subprocess

    from omni_actors.connectors.mappings import drop_mappings

    mounted = []

    def mount(size: str):
        if os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root")
        mnt = tmp_path / f"tiny-{len(mounted)}"
        mnt.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "oa-test-tiny", str(mnt)],
                          capture_output=True).returncode != 0:
            pytest.skip("cannot mount a tmpfs here")
        mounted.append(mnt)
        return mnt

    yield mount
    if mounted:
        drop_mappings()  # (a producer keeps mappings of reused segments and slots: the mount must go)
        for mnt in mounted:
            subprocess.run(["umount", str(mnt)], capture_output=True)
