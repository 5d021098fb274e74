"""The supervision policy, as pure rules (no actor system)."""

import pytest

from omni_actors.actors.supervision import HealthPolicy, ReplicaHealth, RestartPolicy


def test_restart_backoff_doubles_up_to_the_cap():
    policy = RestartPolicy(initial_backoff_s=0.5, max_backoff_s=2.0, max_restarts=10, window_s=60)
    delays = []
    history: list[float] = []
    for i in range(5):
        delays.append(policy.next_delay(history, now=100.0 + i))
        history.append(100.0 + i)
    assert delays == [0.5, 1.0, 2.0, 2.0, 2.0]


def test_too_many_restarts_in_the_window_gives_up_and_old_ones_age_out():
    policy = RestartPolicy(initial_backoff_s=0.1, max_backoff_s=1, max_restarts=3, window_s=10)
    assert policy.next_delay([1.0, 2.0, 3.0], now=5.0) is None
    assert policy.next_delay([1.0, 2.0, 3.0], now=12.5) == pytest.approx(0.2)  # two aged out, one left


def test_a_silent_replica_is_isolated_after_the_missed_heartbeats():
    policy = HealthPolicy(heartbeat_interval_s=1.0, missed_heartbeats=3)
    health = ReplicaHealth(last_heartbeat=10.0, progress_at=10.0)
    assert policy.verdict(health, now=12.9, in_flight=0) is None
    assert "missed 3 heartbeats" in policy.verdict(health, now=13.1, in_flight=0)


def test_a_busy_replica_without_progress_is_stalled_but_an_idle_one_is_not():
    policy = HealthPolicy(heartbeat_interval_s=1.0, missed_heartbeats=3, stall_timeout_s=2.0)
    health = ReplicaHealth(last_heartbeat=0.0, progress_at=0.0)
    for t in (1.0, 2.0, 3.0):
        health.on_heartbeat(t, progress=0)  # heartbeats keep coming, progress does not move
    assert policy.verdict(health, now=3.0, in_flight=0) is None
    assert policy.verdict(health, now=3.0, in_flight=2).startswith("stalled: 2 task(s)")


def test_progress_and_dispatch_to_an_idle_replica_reset_the_stall_clock():
    policy = HealthPolicy(heartbeat_interval_s=1.0, stall_timeout_s=2.0)
    health = ReplicaHealth(last_heartbeat=0.0, progress_at=0.0)
    health.on_dispatch(now=5.0, was_idle=True)  # idle for 5 s, then a task: not a stall
    health.on_heartbeat(5.5, progress=0)
    assert policy.verdict(health, now=6.0, in_flight=1) is None
    health.on_heartbeat(6.9, progress=7)
    health.on_heartbeat(7.9, progress=7)
    health.on_heartbeat(8.8, progress=7)
    assert policy.verdict(health, now=8.85, in_flight=1) is None
    health.on_heartbeat(8.95, progress=7)  # its heartbeats say: no progress for over 2 s
    assert policy.verdict(health, now=9.0, in_flight=1) is not None


def test_a_replica_that_falls_silent_with_work_is_silent_not_stalled():
    """Its host killed (or the process frozen) with tasks in flight: its heartbeats stop
    with its progress. Under a stall timeout shorter than the silence (2 s against
    3 x 1 s) it was called stalled first, and its tasks counted as crashes (a trial's
    member host SIGKILLed: "stalled: 2 task(s) in flight", then a 500 blaming the input).
    Only heartbeats that go on without progress make a stall; silence with work is
    found as soon (no progress for the stall timeout), and is not counted as a crash."""
    policy = HealthPolicy(heartbeat_interval_s=1.0, missed_heartbeats=3, stall_timeout_s=2.0)
    health = ReplicaHealth(last_heartbeat=0.0, progress_at=0.0)
    health.on_dispatch(now=0.0, was_idle=True)
    health.on_heartbeat(1.0, progress=3, idle_s=0.0)  # working
    health.on_heartbeat(2.0, progress=6, idle_s=0.0)  # then gone: no more heartbeats
    for now in (2.5, 3.9):
        assert policy.verdict(health, now=now, in_flight=2) is None, now
    assert policy.verdict(health, now=4.1, in_flight=2) == (
        "silent with 2 task(s) in flight: no heartbeat for 2.1 s and no progress for 2.1 s")
    assert policy.silent(health, now=4.1, in_flight=2)  # (its tasks move uncounted)
    assert policy.verdict(health, now=4.1, in_flight=0) is None  # idle: only missed heartbeats tell
    assert policy.verdict(health, now=5.1, in_flight=0).startswith("missed 3 heartbeats")


def test_a_stall_between_two_heartbeats_waits_for_the_next_one_to_say_so():
    """No progress for the stall timeout, the next heartbeat not due yet: neither a stall
    nor silence until that heartbeat says which (one interval at most)."""
    policy = HealthPolicy(heartbeat_interval_s=1.0, missed_heartbeats=3, stall_timeout_s=2.0)
    health = ReplicaHealth(last_heartbeat=0.0, progress_at=0.0)
    health.on_dispatch(now=0.0, was_idle=True)
    for t in (0.5, 1.5):
        health.on_heartbeat(t, progress=0, idle_s=t)
    assert policy.verdict(health, now=2.1, in_flight=1) is None
    health.on_heartbeat(2.5, progress=0, idle_s=2.5)
    assert policy.verdict(health, now=2.5, in_flight=1).startswith("stalled: 1 task(s)")
    assert not policy.silent(health, now=2.5, in_flight=1)  # (its tasks count as crashes)


def test_a_stalled_replica_whose_tasks_were_cancelled_keeps_its_stall_clock():
    """Stalled with tasks in flight for 9.9 s of a 10 s stall timeout, its tasks cancelled
    (a downstream stage timed out on them first), then a new task: it is stalled at once,
    not given another 10 s (a trial saw a stalled Talker isolated only after 30 s). A
    healthy replica idle between tasks starts each with a clean clock."""
    policy = HealthPolicy(heartbeat_interval_s=1.0, stall_timeout_s=10.0)
    health = ReplicaHealth(last_heartbeat=0.0, progress_at=0.0)
    health.on_dispatch(now=0.0, was_idle=True)
    for t in range(1, 10):
        health.on_heartbeat(float(t), progress=5, idle_s=float(t))  # it makes no progress
    health.on_heartbeat(9.5, progress=5, idle_s=9.5)
    health.went_idle(9.9, min_stretch_s=1.0)  # its task was cancelled (as the pool calls it)
    health.on_heartbeat(10.0, progress=5, idle_s=0.0)  # (an engine with no task reports 0)
    health.on_dispatch(now=10.0, was_idle=True)
    health.on_heartbeat(10.2, progress=5, idle_s=0.0)  # (its new task waits for its input first)
    assert policy.verdict(health, now=10.05, in_flight=1) is None
    health.on_heartbeat(10.4, progress=5, idle_s=0.2)  # its input came; no progress on it
    assert policy.verdict(health, now=10.4, in_flight=1).startswith("stalled: 1 task(s)")
    health.on_heartbeat(10.5, progress=6, idle_s=0.0)  # progress at last: a stall starts over
    assert policy.verdict(health, now=12.0, in_flight=1) is None

    health = ReplicaHealth(last_heartbeat=0.0, progress_at=0.0)
    health.on_dispatch(now=0.0, was_idle=True)
    health.on_task_done(True, now=4.0)
    health.went_idle(4.0)
    health.on_heartbeat(60.0, progress=9, idle_s=56.0)
    health.on_dispatch(now=60.0, was_idle=True)  # idle for 56 s, then a task: not a stall
    health.on_heartbeat(61.5, progress=9, idle_s=57.5)  # (its first token not out yet)
    assert policy.verdict(health, now=62.0, in_flight=1) is None


def test_quick_refusals_and_short_cancelled_tasks_do_not_add_up_to_a_stall():
    """A code review: a healthy replica's tasks refused on their input (400s of 30 ms) or
    cancelled before their first output (0.35 s each) added up towards a stall, never reset
    while it made no tokens: 400 refusals made 12 s, and its next good task was judged
    stalled at once (the replica killed, the task counted as a crash)."""
    policy = HealthPolicy(heartbeat_interval_s=1.0, stall_timeout_s=10.0)
    health = ReplicaHealth(last_heartbeat=0.0, progress_at=0.0)
    t = 0.0
    for i in range(400):
        health.on_dispatch(now=t, was_idle=True)
        t += 0.03
        health.went_idle(t, answered=True, min_stretch_s=1.0)  # refused: the client's 400
    for i in range(40):
        health.on_dispatch(now=t, was_idle=True)
        t += 0.35
        health.went_idle(t, min_stretch_s=1.0)  # its client went away before the first output
    health.on_heartbeat(t, progress=0, idle_s=0.0)
    health.on_dispatch(now=t, was_idle=True)
    assert health.stalled_before_s == 0.0
    assert policy.verdict(health, now=t + 0.25, in_flight=1) is None


def test_circuit_breaker_opens_after_consecutive_failures_only():
    policy = HealthPolicy(breaker_failures=3)
    health = ReplicaHealth(last_heartbeat=0.0, progress_at=0.0)
    for ok in (False, False, True, False, False):
        health.on_task_done(ok, now=0.0)
    assert policy.verdict(health, now=0.1, in_flight=0) is None
    health.on_task_done(False, now=0.0)
    assert "circuit breaker: 3 task failures" in policy.verdict(health, now=0.1, in_flight=0)


def test_a_success_of_a_task_sent_before_the_failures_does_not_close_the_breaker():
    """Long (streaming) tasks that began while the replica was fine may end
    fine between its failures: only a task sent after the last failure
    vouches for the replica now."""
    policy = HealthPolicy(breaker_failures=3)
    health = ReplicaHealth(last_heartbeat=4.0, progress_at=0.0)
    health.on_task_done(False, now=1.0)
    health.on_task_done(False, now=2.0)
    health.on_task_done(True, now=2.5, dispatched_at=0.5)  # sent before the failures
    health.on_task_done(False, now=3.0)
    assert "3 task failures" in policy.verdict(health, now=3.1, in_flight=0)
    health.on_task_done(True, now=4.0, dispatched_at=3.5)  # sent after the last failure
    assert policy.verdict(health, now=4.1, in_flight=0) is None


def test_rate_is_units_per_second_over_recent_heartbeats():
    health = ReplicaHealth(last_heartbeat=0.0)
    for t, p in ((1.0, 0), (2.0, 50), (3.0, 100)):
        health.on_heartbeat(t, p)
    assert health.rate() == pytest.approx(50.0)


def test_a_process_orphaned_before_its_start_message_exits(tmp_path):
    """An engine or pool whose parent dies before sending StartEngine/StartPool has no
    heartbeat watch yet; ``exit_if_orphaned_before_start`` ends it (it lived on, re-parented
    to init, after the system stopped). Here: a parent process starts a child that calls
    it and waits, and is SIGKILLed; the child is gone within a few poll periods. A sibling
    whose start message came (the event set) stays."""
    import os
    import signal
    import subprocess
    import sys
    import time

    child = (
        "import sys, threading, time\n"
        "from omni_actors.actors.supervision import exit_if_orphaned_before_start\n"
        "started = threading.Event()\n"
        "if sys.argv[1] == 'started':\n"
        "    started.set()\n"
        "exit_if_orphaned_before_start(started, poll_s=0.1)\n"
        "print('up', flush=True)\n"
        "time.sleep(30)\n")
    parent = (
        "import subprocess, sys, time\n"
        f"kids = [subprocess.Popen([sys.executable, '-c', {child!r}, how], stdout=subprocess.PIPE)\n"
        "        for how in ('waiting', 'started')]\n"
        "for k in kids:\n"
        "    k.stdout.readline()\n"
        "print(' '.join(str(k.pid) for k in kids), flush=True)\n"
        "time.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    waiting, started = (int(p) for p in proc.stdout.readline().split())
    try:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)

        def alive(pid: int) -> bool:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0] != "Z"
            except OSError:
                return False

        deadline = time.monotonic() + 5
        while alive(waiting) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(waiting), "the child orphaned before its start message is still running"
        assert alive(started), "the child that had its start message exited"
    finally:
        for pid in (waiting, started):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_signal_fault_is_refused_when_its_target_runs_on_another_machine(monkeypatch):
    """``inject sigkill`` signals a pid from the process that runs it: for a replica on
    another machine that pid names some other process there, so it is refused, and
    nothing is signalled; on this machine it is sent."""
    import signal as sig

    from omni_actors.actors.supervision import host_identity
    from omni_actors.messages import PoolState, ReplicaState, ReplicaStatus, SystemStatus
    from omni_actors.system import admin as admin_mod

    here = host_identity()
    assert here.startswith(__import__("socket").gethostname() + "/")
    status = SystemStatus("q", "m", True, (PoolState(1, "talker", (
        ReplicaStatus("talker/0", ReplicaState.READY, pid=4242, node="m1", host="gpu-host-7/0b5e"),
        ReplicaStatus("talker/1", ReplicaState.READY, pid=4343, node="", host=here)), pid=99, host=here),),
        coordinator_pid=98, coordinator_host="gpu-host-7/0b5e")

    class Asys:
        def ask(self, to, msg, timeout):
            return status

    sent = []
    monkeypatch.setattr(admin_mod.os, "kill", lambda pid, signum: sent.append((pid, signum)))
    adm = admin_mod.Admin(Asys(), object())
    with pytest.raises(admin_mod.AdminError) as err:
        adm.inject("sigkill", replica="talker/0")
    assert str(err.value) == ("sigkill signals a process, and talker/0 runs on another machine "
                              f"(gpu-host-7) than this one ({here.rsplit('/', 1)[0]}): run it there")
    with pytest.raises(admin_mod.AdminError, match="coordinator runs on another machine"):
        adm.inject("kill-coordinator")
    assert sent == []
    assert adm.inject("sigstop", replica="talker/1")["pid"] == 4343
    assert adm.inject("kill-pool", stage="talker")["pid"] == 99
    assert sent == [(4343, sig.SIGSTOP), (99, sig.SIGKILL)]
    with pytest.raises(admin_mod.AdminError) as err:  # (trial AN's typo read "no running pool")
        adm.inject("kill-pool", stage="talkr")
    assert str(err.value).startswith("no stage named 'talkr' (stages: "), str(err.value)
    assert "talker" in str(err.value)


def test_an_orphaned_pool_whose_exit_thespian_holds_exits_hard_after_the_grace():
    """A pool orphaned by a killed coordinator drains its replicas, then asks to exit;
    Thespian holds that exit until every child confirms, and a child whose creation went
    towards a member that is gone never does (trial: two old pools alive until the system
    stopped). Here the exit request goes nowhere, as then: the process still ends once
    ORPHAN_EXIT_GRACE_S has passed, and says so (once, however many ticks asked)."""
    import subprocess
    import sys

    child = (
        "import time\n"
        "from types import SimpleNamespace\n"
        "import omni_actors.actors.stage_pool as sp\n"
        "sp.ORPHAN_EXIT_GRACE_S = 0.5\n"
        "pool = sp.StagePoolActor()\n"
        "pool._started.set()\n"
        "pool.send = lambda address, message: print('sent', type(message).__name__, flush=True)\n"
        "pool._myRef = SimpleNamespace(address='pool')\n"
        "pool._spec = SimpleNamespace(heartbeat_interval_s=0.5)\n"
        "pool._parent = SimpleNamespace(lost=lambda silent_s, late_after_s: True)\n"
        "for _ in range(3):\n"
        "    pool._wind_down_if_orphaned(time.monotonic())\n"
        "time.sleep(30)\n"
        "print('still here', flush=True)\n")
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out
    lines = out.stdout.splitlines()
    assert lines.count("sent ActorExitRequest") == 3 and "still here" not in lines, out
    forced = [line for line in lines if "exit_forced" in line]  # (console log format: no log config here)
    assert len(forced) == 1 and "after_s=0.5" in forced[0] and "reason='coordinator lost'" in forced[0], out


def test_killing_a_system_unlinks_the_semaphores_its_killed_processes_left():
    """A trial's `stop` while vLLM engines were loading left `/dev/shm/sem.mp-*` files: a
    process and the resource tracker that would unlink its semaphores were both killed.
    Here a process of system ``sid`` makes a multiprocessing (spawn) lock, its tracker is
    SIGKILLed, then ``kill_system`` ends the process: the semaphore file is gone after."""
    import os
    import signal
    import subprocess
    import sys
    import uuid

    from omni_actors.system.processes import ENV_SYSTEM_ID, kill_system

    sid = f"test-sem-{uuid.uuid4().hex[:8]}"
    child = ("import multiprocessing as mp, time\n"
             "lock = mp.get_context('spawn').Lock()\n"
             "import importlib\n"  # (not the module's name whole: a cmdline with it is taken for a tracker)
             "rt = importlib.import_module('multiprocessing.resource_' + 'tracker')\n"
             "print(lock._semlock.name, getattr(rt, '_resource_' + 'tracker')._pid, flush=True)\n"
             "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, ENV_SYSTEM_ID: sid})
    try:
        name, tracker = proc.stdout.readline().split()
        path = f"/dev/shm/sem.{name.lstrip('/')}"
        assert os.path.exists(path), path
        os.kill(int(tracker), signal.SIGKILL)  # (as a kill of the whole tree may)
        assert kill_system(sid, grace_s=1.0) == 1
        proc.wait(5)
        assert not os.path.exists(path), f"{path} was left behind"
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_watchdog_deploys_a_recreated_coordinator_once():
    """Trial BG: each coordinator kill logged ``coordinator_restarted`` two or three times, and
    the watchdog sent its Deploy as often, while the new coordinator was still making its
    pools (its answers said no model yet). One line and one Deploy per new coordinator, with
    the pid before it; the Deploy hands over the drained nodes and the subscribed API servers."""
    import threading
    from types import SimpleNamespace

    from structlog.testing import capture_logs

    from omni_actors.messages import Deploy, NodeStatus, SystemStatus
    from omni_actors.system.leader import _watch_coordinator

    stopping = threading.Event()
    node = NodeStatus("vm", True, (), {}, (), (), drained=True)
    answers = [SystemStatus("w", "m", True, (), coordinator_pid=1, nodes=(node,), subscribers=("api-1",))] \
        + [SystemStatus("w", "", False, (), coordinator_pid=2)] * 3 \
        + [SystemStatus("w", "m", True, (), coordinator_pid=2)]
    told = []

    class Ctx:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def createActor(self, cls, globalName=None):
            return "coordinator"

        def ask(self, address, message, timeout):
            if len(answers) == 1:
                stopping.set()
            return answers.pop(0)

        def tell(self, address, message):
            told.append(message)

    config = SimpleNamespace(deployment=SimpleNamespace(heartbeat_interval_s=0.001))
    with capture_logs() as logs:
        _watch_coordinator(SimpleNamespace(private=Ctx), config, None, stopping)
    assert [(e["coordinator_pid"], e["previous_pid"]) for e in logs if e["event"] == "coordinator_restarted"] \
        == [(2, 1)], logs
    assert len(told) == 1 and isinstance(told[0], Deploy)
    assert told[0].drained_nodes == ("vm",) and told[0].subscribers == ("api-1",)


def test_a_late_failure_dated_before_a_later_one_does_not_move_the_last_failure_back():
    """A review: a failure of an earlier attempt reported late is dated before its retry was sent;
    recorded after a later failure, it moved the last failure back, and a task sent between the
    two reset the breaker's count by succeeding."""
    from omni_actors.actors.supervision import ReplicaHealth

    h = ReplicaHealth(last_heartbeat=0.0)
    h.on_task_done(False, 10.002)
    h.on_task_done(False, 9.999)
    assert (h.consecutive_failures, h.last_failure_at) == (2, 10.002)
    h.on_task_done(True, 10.5, dispatched_at=10.001)  # (sent before the last failure: says nothing)
    assert h.consecutive_failures == 2
