"""vLLM's engine-core child process, as a replica needs it: tied to us, and telling why it died.

``AsyncLLM`` (vLLM 0.32) always runs its ``EngineCore`` in a child process
started with ``spawn`` (also with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, which
only keeps the model runner inside that child). Two things a replica needs
that vLLM does not give:

- **No orphans.** Seen here: SIGKILL the parent and the EngineCore (1.7 GiB
  for the tiny model) lives on, re-parented to init. :class:`CoreWatch`
  makes the child ask the kernel for SIGKILL when the *thread* that spawned it
  exits (``PR_SET_PDEATHSIG``, Linux only; elsewhere nothing changes), so the
  engine must be started from the thread that keeps serving it (the
  backend's loop thread). A core that replaces that signal (vLLM-Omni's asks
  for SIGTERM) is killed by a thread of its own once its parent has been gone
  ``ORPHANED_CORE_GRACE_S``.
- **The root cause.** A start-up or fatal engine error reaches the parent as
  "Engine core initialization failed. See root cause above" or
  ``EngineDeadError``; the cause is only in the child's log. The child writes
  its exception, as one line, to a file the parent reads. A child that was
  killed (SIGKILL, the OOM killer) writes nothing: the parent then says how
  the process ended, as soon as it has ended, instead of waiting for a file.

How: while :meth:`CoreWatch.spawning` is active, ``EngineCoreProc.run_engine_core``
(the target vLLM passes to ``Process``) is a picklable :class:`_CoreLauncher`
that does both, then runs vLLM's own entry point. If a vLLM version renames
that entry point, the patch is skipped and only these two extras are lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["CoreWatch", "keep_off", "one_line", "parse_cpus", "pinned"]


#: The highest CPU number a CPU list may name (Linux's own limit, ``NR_CPUS``, is at most 8192):
#: "0-99999999999" built a set of that many numbers, gigabytes, before any check (a code review).
MAX_CPU = 8191


def _cpu_list(text: str) -> set[int]:
    """Raises ValueError: not a list of CPU numbers and ranges, or a number above MAX_CPU."""
    cpus: set[int] = set()
    for part in filter(None, text.replace(" ", "").split(",")):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or int(hi or lo) < int(lo):
            raise ValueError(f"{part!r} is not a CPU number or range")
        if int(hi or lo) > MAX_CPU:
            raise ValueError(f"{part!r} names CPU {int(hi or lo)}, above {MAX_CPU}, the most Linux has")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def node_cpus() -> frozenset[int]:
    """The CPUs processes of this node may run on: the cgroup's cpuset where there is
    one, else the online CPUs (not this thread's affinity, which a parent or
    :func:`keep_off` may have narrowed)."""
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/devices/system/cpu/online"):
        try:
            with open(path) as f:
                cpus = _cpu_list(f.read().strip())
        except (OSError, ValueError):
            continue
        if cpus:
            return frozenset(cpus)
    return frozenset(range(os.cpu_count() or 1))


def parse_cpus(text: str) -> frozenset[int]:
    """A Linux CPU list (``"1"``, ``"0-3"``, ``"0,2-3"``) as a set; empty for ``""``.

    Raises:
        ValueError: it does not parse, a range runs backwards, or a CPU is not
            on this node (:func:`node_cpus`; the message names those it has).
    """
    try:
        cpus = _cpu_list(text)
    except ValueError as exc:
        raise ValueError(f"cpus {text!r}: {exc}") from None
    allowed = node_cpus()
    if cpus - allowed:
        raise ValueError(f"cpus {text!r}: CPU {min(cpus - allowed)} is not available here "
                         f"(this node has {','.join(map(str, sorted(allowed)))})")
    return frozenset(cpus)


def keep_off(cpus: frozenset[int]) -> None:
    """Move every thread of this process off ``cpus`` (onto the others it may use),
    so that the kernel does not wake them on the CPUs an engine core computes on;
    nothing happens when ``cpus`` is empty or covers every CPU of the node.
    Threads started later inherit the mask of the thread that starts them."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return
    others = (os.sched_getaffinity(0) - cpus) or (node_cpus() - cpus)
    if not others:
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), others)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that just ended


@contextlib.contextmanager
def pinned(cpus: frozenset[int]):
    """Processes this thread starts inside run on ``cpus``, with one OpenMP
    thread per CPU (``OMP_NUM_THREADS``); nothing changes for an empty set.

    The calling thread's affinity (a thread's own, on Linux) and the variable
    are set for the block only; a child inherits both when it is created.
    """
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    affinity, omp = os.sched_getaffinity(0), os.environ.get("OMP_NUM_THREADS")
    os.sched_setaffinity(0, cpus)
    os.environ["OMP_NUM_THREADS"] = str(len(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, affinity)
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = omp


#: vLLM's pointer to its own log, at the end of EngineDeadError's message.
SEE_ABOVE = re.compile(r"\s*See (?:stack trace \(above\) for the root cause|root cause above)\.?")
#: vLLM's word for its engine cores that ended during start-up: ``Failed core proc(s): {'EngineCore_DP0': -9}``
#: (multiprocessing's exit codes: ``-N`` killed by signal N).
FAILED_CORES = re.compile(r"Failed core proc\(s\): (\{[^}]*\})")


def one_line(exc: BaseException) -> str:
    """``"Type: message"`` with all whitespace runs folded to one space."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def is_client_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or its cause) is the client's mistake, a 400 as vLLM's own server
    answers it: vLLM's request validation errors (``VLLMClientError``, such as a prompt
    over ``max_model_len``; not ValueErrors in recent vLLM) and ValueErrors/TypeErrors."""
    for e in (exc, exc.__cause__):
        if e is None:
            continue
        if isinstance(e, (ValueError, TypeError)):
            return True
        if any(c.__name__ == "VLLMClientError" for c in type(e).__mro__):
            return True
    return False


#: vLLM's data-parallel coordinator's process name (``VLLM::DPCoordinator``) as /proc/PID/comm
#: gives it (15 characters): a process of vLLM's beside the engine cores, not one of them.
_DP_COORDINATOR_COMM = "VLLM::DPCoordin"


def _core_pids() -> set[int]:
    """Pids of this process's descendants named ``VLLM::...`` (vLLM's engine cores), but
    for vLLM's data-parallel coordinator."""
    from omni_actors.system.processes import descendants

    pids = set()
    for pid in descendants():
        try:
            comm = Path(f"/proc/{pid}/comm").read_text()
            if comm.startswith("VLLM::") and not comm.startswith(_DP_COORDINATOR_COMM):
                pids.add(pid)
        except OSError:
            pass
    return pids


class CoreWatch:
    """The error file and the spawn-time patch for one engine.

    The file is ``/tmp/omni-actors-vllm-<tag>-*.err``, unlinked at once on Linux
    and reached as ``/proc/<our pid>/fd/<fd>`` (by the child too), so even a
    SIGKILLed replica leaves nothing behind.

    Args:
        tag: put in the error file's name.
    """

    def __init__(self, tag: str = "engine"):
        safe = "".join(c if c.isalnum() else "-" for c in tag)
        fd, path = tempfile.mkstemp(prefix=f"omni-actors-vllm-{safe}-", suffix=".err")
        proc_path = f"/proc/{os.getpid()}/fd/{fd}"
        if os.path.exists(proc_path):
            # Unlinked at once and reached through our fd: nothing is left behind
            # however this process ends (the child opens the same path).
            os.unlink(path)
            self._fd: int | None = fd
            self.error_file = proc_path
        else:
            os.close(fd)
            self._fd = None
            self.error_file = path
        #: engine core pids (:meth:`note_cores`)
        self.cores: set[int] = set()
        #: core processes that ran here before this engine spawned (other engines' cores)
        self._others: set[int] = set()

    @contextlib.contextmanager
    def spawning(self, engine_core_proc: type, entry: str = "run_engine_core"):
        """Patch ``engine_core_proc.<entry>`` (the target its process manager spawns: vLLM's
        ``EngineCoreProc.run_engine_core``, vLLM-Omni's ``StageEngineCoreProc.run_stage_core``)
        while the engine is created. The child runs it from a fresh import of
        ``engine_core_proc``'s module (vLLM spawns its cores)."""
        self._others = _core_pids()
        original = engine_core_proc.__dict__.get(entry)
        if original is None:
            yield
            return
        launcher = _CoreLauncher(self.error_file, os.getpid(),
                                 (engine_core_proc.__module__, engine_core_proc.__qualname__, entry))
        launcher.original = getattr(engine_core_proc, entry)
        setattr(engine_core_proc, entry, staticmethod(launcher))
        try:
            yield
        finally:
            setattr(engine_core_proc, entry, original)

    @contextlib.contextmanager
    def spawning_all(self, engine_core_proc: type | None = None, entry: str = "run_engine_core"):
        """:meth:`spawning` for every process an engine starts: its engine cores
        (``engine_core_proc.<entry>``, vLLM's ``EngineCoreProc`` where None) and, with
        ``data_parallel_size > 1``, vLLM's data-parallel coordinator (``DPCoordinatorProc``;
        SIGKILLed with its replica, it lived on, re-parented to init, a review)."""
        if engine_core_proc is None:
            from vllm.v1.engine.core import EngineCoreProc as engine_core_proc
        try:
            from vllm.v1.engine.coordinator import DPCoordinatorProc
        except ImportError:  # (another vLLM: the cores are still watched)
            DPCoordinatorProc = None  # noqa: N806
        with contextlib.ExitStack() as stack:
            stack.enter_context(self.spawning(engine_core_proc, entry))
            if DPCoordinatorProc is not None:
                stack.enter_context(self.spawning(DPCoordinatorProc, "run_coordinator"))
            yield

    def note_cores(self) -> None:
        """Remember the engine core processes this engine started (this process's
        descendants named ``VLLM::...`` that were not there before :meth:`spawning`:
        another engine in the same process keeps its own), to say how they ended if
        they die without a word."""
        self.cores |= _core_pids() - self._others

    def _ended(self) -> list[str]:
        """How the noted engine cores ended (see :func:`exit_description`); empty
        while any of them still runs, or when none was noted."""
        ends = [(pid, exit_description(pid)) for pid in sorted(self.cores)]
        if not ends or any(end is None for _, end in ends):
            return []
        return [f"vLLM's engine core process (pid {pid}) "
                f"{end or 'is gone (killed, or it exited without writing a cause)'}" for pid, end in ends]

    def root_cause(self, exc: BaseException) -> str:
        """What the child wrote; else how it ended (killed by a signal, exited with a
        status) and ``exc`` as one line; else ``exc`` as one line."""
        try:
            text = Path(self.error_file).read_text().strip()
        except OSError:
            text = ""
        if text:
            return text
        ended = self._ended() or _failed_cores(one_line(exc))
        if not ended:
            return one_line(exc)
        # (vLLM's "See stack trace (above) ..." points at its log, where a killed core wrote
        # nothing: trial W read it in `status` as if the cause were there)
        detail = SEE_ABOVE.sub("", one_line(exc)).rstrip(" .")
        return f"{'; '.join(ended)} ({detail})"

    async def await_root_cause(self, exc: BaseException, timeout_s: float = 5.0) -> str:
        """:meth:`root_cause`, waiting up to ``timeout_s`` for a dying child to write it;
        no longer once the noted engine cores have all ended (a killed one writes nothing:
        the wait held the engine's death back 5 s from the pool, and from the clients)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if Path(self.error_file).stat().st_size:
                    break
            except OSError:
                break
            if self.cores and all(exit_description(pid) is not None for pid in self.cores):
                break
            await asyncio.sleep(0.05)
        return self.root_cause(exc)

    def close(self) -> None:
        """Remove the error file."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        else:
            Path(self.error_file).unlink(missing_ok=True)


def _failed_cores(text: str) -> list[str]:
    """How the engine cores vLLM names in ``text`` ended (``Failed core proc(s): {...}``):
    those killed by a signal or that exited with a status; [] where it names none. (A core
    killed while it loaded, before :meth:`CoreWatch.note_cores`, read only vLLM's "See
    root cause above", and ``-9``; a review.)"""
    import ast

    m = FAILED_CORES.search(text)
    try:
        codes = ast.literal_eval(m.group(1)) if m else {}
    except (ValueError, SyntaxError):
        return []
    return [f"vLLM's engine core process {name} {_how_ended(-code if code < 0 else 0, max(code, 0))}"
            for name, code in (codes.items() if isinstance(codes, dict) else ())
            if isinstance(code, int) and code != 0]


def _how_ended(signo: int, status: int) -> str:
    """``"was killed by SIGKILL"`` (``signo``, when not 0), else ``"exited with status N"``."""
    if signo:
        try:
            return f"was killed by {signal.Signals(signo).name}"
        except ValueError:
            return f"was killed by signal {signo}"
    return f"exited with status {status}"


def exit_description(pid: int) -> str | None:
    """How child process ``pid`` ended: None while it runs; ``"was killed by SIGKILL"``
    or ``"exited with status 1"`` while it is a zombie (not yet reaped); ``""`` once it is
    gone (reaped: how is no longer known)."""
    from omni_actors.system.processes import proc_stat

    fields = proc_stat(Path(f"/proc/{pid}"))
    if fields is None:
        return ""
    if fields[0] != "Z":
        return None
    try:
        status = int(fields[49])  # (field 52 of /proc/PID/stat: the exit status, as waitpid gives it)
    except (IndexError, ValueError):
        return ""
    return _how_ended(status & 0x7F, status >> 8)


class _CoreLauncher:
    """Stands in for ``EngineCoreProc.run_engine_core`` (or the ``entry``, ``(module, class,
    attribute)``, named); pickled into the child."""

    def __init__(self, error_file: str, parent_pid: int,
                 entry: tuple[str, str, str] = ("vllm.v1.engine.core", "EngineCoreProc", "run_engine_core")):
        self.error_file = error_file
        self.parent_pid = parent_pid
        self.entry = entry
        #: the entry point itself, for a child that vLLM forks (``VLLM_WORKER_MULTIPROC_METHOD``
        #: fork, its default where nothing forces spawn): its class is still patched there, and
        #: the launcher found itself by name (a recursion). Not pickled (spawn: looked up by name).
        self.original = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "original": None}

    def __call__(self, *args, **kwargs):
        _set_parent_death_signal()
        if os.getppid() != self.parent_pid:  # the parent died before prctl took effect
            os._exit(1)
        _exit_when_orphaned(self.parent_pid)
        from omni_actors.system.processes import use_ipc_dir_for_temp_files

        use_ipc_dir_for_temp_files()  # (vLLM's FileStore: removed with the system)
        from vllm.v1.engine.core import EngineCoreProc

        send_dead = getattr(EngineCoreProc, "_send_engine_dead", None)
        if send_dead is not None:
            # A fatal error in the busy loop: write it before the parent hears of the
            # death (it may stop this process before the exception reaches us below).
            def _send_engine_dead(core, *a, **kw):
                self._write(sys.exc_info()[1])
                return send_dead(core, *a, **kw)

            EngineCoreProc._send_engine_dead = _send_engine_dead
        import importlib

        module, cls, attr = self.entry
        run = getattr(getattr(importlib.import_module(module), cls), attr)
        if isinstance(run, _CoreLauncher):  # forked while the class was patched
            run = self.original
        try:
            return run(*args, **kwargs)
        except SystemExit as exc:
            # vLLM has torn the engine down (its entry point's `finally`); what is left is the
            # interpreter's own finalization: about 2 s for a tiny model's core here, over 5 s
            # on a loaded host, where vLLM's process manager SIGKILLs the core instead (trial BQ:
            # every stop and scale-down took 5 s more). Measured: a replica's shutdown 3.3 s ->
            # 1.1 s. Logs and stdio are flushed first.
            import logging

            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            code = exc.code
            os._exit(0 if code is None else code if isinstance(code, int) else 1)
        except Exception as exc:  # a start-up failure: the parent waits for our exit
            self._write(exc)
            raise

    def _write(self, exc: BaseException | None) -> None:
        if exc is None:
            return
        try:
            path = Path(self.error_file)
            if not path.stat().st_size:
                path.write_text(one_line(exc))
        except OSError:
            pass


#: Seconds an engine core whose replica process is gone may take to end on its own before it
#: is killed (:func:`_exit_when_orphaned`); a tiny model's core tears down in about 0.2 s here.
ORPHANED_CORE_GRACE_S = 2.0
#: How often an engine core checks that its replica process is still there, in seconds.
PARENT_POLL_S = 0.25


def _exit_when_orphaned(parent_pid: int, grace_s: float = ORPHANED_CORE_GRACE_S,
                        poll_s: float = PARENT_POLL_S) -> None:
    """Start a daemon thread that SIGKILLs this process ``grace_s`` seconds after its parent
    ``parent_pid`` is gone (this process re-parented). The backstop of the parent-death
    signal: vLLM-Omni's ``run_stage_core`` replaces it with SIGTERM, for its own tear-down,
    which did not always end (CI: a SIGKILLed replica's core still ran 10 s later)."""
    import threading

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        time.sleep(grace_s)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="omni-actors-parent-watch", daemon=True).start()


def _set_parent_death_signal() -> None:
    """``prctl(PR_SET_PDEATHSIG, SIGKILL)``; a no-op where there is no prctl."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
