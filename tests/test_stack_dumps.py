"""What a pool reads from a silent replica's stack dump (actors.stack_dumps): pure logic on
dumps written by faulthandler itself, in a child process that holds the GIL."""

from __future__ import annotations

import os
import subprocess
import threading
import time
import sys
import textwrap
from pathlib import Path

import pytest

from omni_actors.actors.processor_threads import ProcessorThreads
from omni_actors.actors.stack_dumps import StackDumps, calls_of, culprits, dump_path, remove_dump, where_silent
from omni_actors.system.processes import remove_ipc_dir

ROOT = Path(__file__).resolve().parents[1]

HOLDER = """
import ctypes, os, sys, threading
sys.path.insert(0, sys.argv[1])
from omni_actors.actors.stack_dumps import StackDumps
import {module} as procs
dumps = StackDumps(silent_after_s=0.6, interval_s=0.2, processor=True)  # (writes 0.25 s after its last arm)
dumps.arm()
dumps.marks.mark(2, "chatcmpl-held", 1)  # (as its processor thread 2 does before the call: left, as while it runs)
t = threading.Thread(target=procs.thinker2talker, args=({{}}, "", {{}}))
t.start()
t.join()
print(os.getpid())
"""


def _held(tmp_path: Path, module: str, source: str, system_id: str) -> int:
    """Run a process whose processor holds the GIL for 1.5 s under an armed watchdog; its pid."""
    path = tmp_path / (module.replace(".", "/") + ".py")
    path.parent.mkdir(parents=True, exist_ok=True)
    for parent in list(path.parents)[: module.count(".")]:
        (parent / "__init__.py").touch()
    path.write_text(textwrap.dedent(source))
    out = subprocess.run([sys.executable, "-c", HOLDER.format(module=module), str(tmp_path)], capture_output=True,
                         text=True, timeout=60, cwd=ROOT, env={**os.environ, "OMNI_ACTORS_SYSTEM_ID": system_id})
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


@pytest.fixture
def system_id(monkeypatch):
    """A system id of this test's own, its ipc directory removed after it."""
    system_id = f"stackdumptest{os.getpid()}"
    monkeypatch.setenv("OMNI_ACTORS_SYSTEM_ID", system_id)
    yield system_id
    remove_ipc_dir(system_id)


SOURCE = """
import ctypes

def inner():
    ctypes.pythonapi.usleep(1500000)

def thinker2talker(upstream, prompt, params):
    inner()
"""


def test_the_processor_a_thread_was_in_is_named_with_its_innermost_frame(tmp_path, system_id):
    pid = _held(tmp_path, "mine.procs", SOURCE, system_id)
    try:
        where, stacks, calls = where_silent(pid, "mine.procs.thinker2talker")
        assert where == ("; it went silent in its processor mine.procs.thinker2talker (procs.py:8, in inner at "
                         "procs.py:5): a call that holds the GIL stops heartbeats"), where
        assert stacks.startswith("Timeout (0:00:00.250000)!") and 'procs.py", line 5 in inner' in stacks, stacks
        assert calls == {("chatcmpl-held", 1)}  # (the task its call was for: it counts as crashed by it)
        # (another processor, or none: the stacks only, said to be in the log line)
        assert where_silent(pid, "mine.other.thinker2talker")[0] == \
            "; its threads' stacks are in the replica_isolated log line"
        assert where_silent(pid, "thinker2talker")[1] == stacks
    finally:
        remove_dump(pid)
    assert not os.path.exists(dump_path(pid))
    assert where_silent(pid, "mine.procs.thinker2talker") == ("", "", set())  # (none written: nothing to say)


def test_a_replica_that_stays_armed_writes_nothing_and_a_closed_one_leaves_no_file(system_id, monkeypatch):
    dumps = StackDumps(silent_after_s=3.0, interval_s=1.0)
    assert dumps.after_s == 2.5  # (half an interval before the pool's limit)
    try:
        dumps.arm()
        assert os.path.getsize(dumps.path) == 0
        assert where_silent(os.getpid(), "a.b") == ("", "", set())
    finally:
        dumps.close()
    assert not os.path.exists(dumps.path)
    assert StackDumps().path is None  # (inert until its replica starts)
    monkeypatch.delenv("OMNI_ACTORS_SYSTEM_ID")
    assert StackDumps(3.0, 1.0).path is None and dump_path(1) is None  # (outside any system)


def test_processor_threads_mark_the_task_of_each_call_while_it_runs(system_id):
    """What a pool reads of a silent replica's processor calls: each thread's task while its
    call runs, nothing once it returned (calls_of), and nothing without marks."""
    dumps = StackDumps(silent_after_s=3.0, interval_s=1.0, processor=True)
    try:
        assert dumps.after_s == 1.25  # (a quarter interval before a replica with work may be taken for silent)
        threads = ProcessorThreads(marks=dumps.marks)
        seen = threads.submit(lambda: (calls_of(os.getpid()), threading.get_native_id()),
                              task=("chatcmpl-a", 1)).result(10)
        assert seen[0] == {("chatcmpl-a", 1): seen[1]}  # (its thread's native id: see culprits)
        assert calls_of(os.getpid()) == {}  # (cleared as the call returned)
        assert ProcessorThreads().submit(calls_of, os.getpid()).result(10) == {}  # (no marks)
    finally:
        dumps.close()
    assert calls_of(os.getpid()) == {} and not os.path.exists(dumps.path)
    assert StackDumps(3.0, 1.0).after_s == 2.5 and StackDumps(3.0, 1.0).marks._fd is None  # (no user's processor)


def test_of_several_calls_only_the_one_that_computes_is_blamed(system_id):
    """Trial CT: an innocent request whose processor call slept (the GIL let go) on the replica
    that another's call silenced was failed with it as a poison input. Of several calls, those
    whose threads computed over a short window are blamed; calls that sleep or wait are not,
    and where none computes (a call that holds the GIL and sleeps, beside others) none is."""
    dumps = StackDumps(silent_after_s=3.0, interval_s=1.0, processor=True)
    stop = threading.Event()

    def busy():  # (computes: as a long C call that keeps the GIL does)
        while not stop.is_set():
            sum(range(10_000))

    try:
        threads = ProcessorThreads(marks=dumps.marks)
        threads.submit(busy, task=("chatcmpl-poison", 1))
        threads.submit(stop.wait, 30, task=("chatcmpl-innocent", 1))
        deadline = time.monotonic() + 10
        while len(calls_of(os.getpid())) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        calls = calls_of(os.getpid())
        assert set(calls) == {("chatcmpl-poison", 1), ("chatcmpl-innocent", 1)}
        assert culprits(os.getpid(), calls, window_s=0.3) == {("chatcmpl-poison", 1)}
        asleep = {("chatcmpl-innocent", 1): calls[("chatcmpl-innocent", 1)],
                  ("chatcmpl-b", 1): threading.get_native_id()}
        assert culprits(os.getpid(), asleep, window_s=0.1) == set()  # (none computes: none blamed)
        assert culprits(os.getpid(), {("chatcmpl-only", 1): 1}) == {("chatcmpl-only", 1)}  # (the only one)
    finally:
        stop.set()
        dumps.close()
