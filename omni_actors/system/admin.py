"""Admin operations on a running system, from another process: status, fault
injection, drain, scale. Used by the CLI verbs and by tests and benchmarks
(through the CLI, since one process can attach to one admin only).

Attaching never starts anything: :func:`attach` refuses when no admin
listens on the port. Never call ``shutdown()`` on an attached system: that
would stop the whole system.
"""

from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from omni_actors.messages import (AdminReply, DrainNode, DrainReplica, FaultKind, GetStatus, InjectFault,
                                  LaunchReplicas, NOT_DEPLOYED, ScaleStage, SignalFault, SystemStatus, UndrainNode)
from omni_actors.actors.supervision import host_identity
from omni_actors.config import MAX_REPLICAS
from omni_actors.placement import parse_devices

#: Faults done from outside the process, with a signal, and the ones an engine does to itself.
SIGNAL_FAULTS = {"sigkill": signal.SIGKILL, "sigstop": signal.SIGSTOP, "sigcont": signal.SIGCONT}
ENGINE_FAULTS = {"raise": FaultKind.RAISE_NEXT, "slow": FaultKind.SLOW, "stall": FaultKind.STALL,
                 "clear": FaultKind.CLEAR}
FAULTS = (*SIGNAL_FAULTS, *ENGINE_FAULTS, "kill-pool", "kill-coordinator")
#: Largest `slow` factor: 1000x turns a 4 ms token into 4 s, slow enough for any test.
MAX_SLOW_FACTOR = 1000.0
#: Largest `raise` count.
MAX_RAISE_COUNT = 1_000_000



def replicas_problem(replicas: int, least: int) -> str | None:
    """Why ``replicas`` is not a replica count from ``least`` to ``config.MAX_REPLICAS``
    (the bound a config's ``replicas`` has), or None. (The admin shell and the CLI
    check with it before they reach the system; the pool checks again.)"""
    if least <= replicas <= MAX_REPLICAS:
        return None
    return f"the replica count must be from {least} to {MAX_REPLICAS} (each replica is a process), got {replicas}"


def inject_problem(fault: str, *, replica: str = "", stage: str = "", factor: float = 1.0,
                   count: int = 1) -> str | None:
    """Why :meth:`Admin.inject` would refuse these arguments without asking the system
    (an unknown fault, a missing target, a ``slow`` factor outside 1..:data:`MAX_SLOW_FACTOR`,
    a ``raise`` count outside 1..:data:`MAX_RAISE_COUNT`), or None."""
    if fault not in FAULTS:
        return f"unknown fault {fault!r}; one of: {', '.join(FAULTS)}"
    if fault == "kill-pool":
        return None if stage else "kill-pool needs a stage (STAGE)"
    if fault == "kill-coordinator":
        return None
    if not replica:
        return f"{fault} needs a replica (STAGE/N)"
    if fault == "raise" and not 1 <= count <= MAX_RAISE_COUNT:
        return f"the count of tasks to raise must be from 1 to {MAX_RAISE_COUNT}, got {count}"
    if fault == "slow" and not (math.isfinite(factor) and 1.0 <= factor <= MAX_SLOW_FACTOR):
        return f"the slow-down factor must be a number from 1 to {MAX_SLOW_FACTOR:g}, got {factor:g}"
    return None

#: An ``ask`` that ends this much (seconds) before its timeout without an answer was not
#: timed out: Thespian gave up on the coordinator (see Admin._unanswered).
NO_ANSWER_SLACK_S = 0.5


class AdminError(RuntimeError):
    """A one-line reason the admin operation could not be done."""


@dataclass
class Admin:
    """An attached admin: the actor system handle and the coordinator's address."""

    asys: object
    coordinator: object
    #: the convention leader's admin port when it was found through a member's admin on
    #: this host and runs on this host too (its state file, and so its log, is here); else None
    leader_port: int | None = None

    def status(self, timeout_s: float = 5.0) -> SystemStatus:
        return self._ask_coordinator(GetStatus("admin"), SystemStatus, timeout_s)

    def _ask(self, msg, timeout_s: float = 5.0) -> str:
        reply = self._ask_coordinator(msg, AdminReply, timeout_s)
        if not reply.ok:
            raise AdminError(reply.message)
        return reply.message

    def _ask_coordinator(self, msg, kind: type, timeout_s: float):
        """The coordinator's answer (of type ``kind``) to ``msg``. Without one, where another
        coordinator is registered now (the old one was killed, or hung and replaced), that
        one is asked (an admin shell kept asking the dead one, "could not be reached", for
        good: trial BO). Raises AdminError when none answers."""
        t0 = time.monotonic()
        answer = self.asys.ask(self.coordinator, msg, timeout_s)
        if not isinstance(answer, kind):
            current = self._registered_coordinator()
            if current is not None and current != self.coordinator:
                self.coordinator = current
                answer = self.asys.ask(current, msg, max(timeout_s - (time.monotonic() - t0), 1.0))
        if not isinstance(answer, kind):
            raise self._unanswered(timeout_s, t0)
        return answer

    def _registered_coordinator(self):
        """The coordinator registered under its global name at the admin now, or None."""
        from thespian.system.messages.status import Thespian_StatusReq, Thespian_SystemStatus

        from omni_actors.actors.coordinator import COORDINATOR_NAME

        admin = getattr(self.asys, "admin_address", None)
        if admin is None:
            return None
        try:
            status = self.asys.ask(admin, Thespian_StatusReq(), 2.0)
        except Exception:  # noqa: BLE001 - Thespian raises several kinds here
            return None
        return status.globalActors.get(COORDINATOR_NAME) if isinstance(status, Thespian_SystemStatus) else None

    def _unanswered(self, timeout_s: float, t0: float) -> AdminError:
        """Why the coordinator gave no answer to an ``ask`` begun at ``t0``: its system's admin
        is gone (stopped, killed), or Thespian gave up before ``timeout_s`` (its system is going
        away), or it was silent for all of ``timeout_s``. (A trial's member said "did not answer
        within 5 s" as its leader stopped, 1.6 s after it asked.)"""
        waited = time.monotonic() - t0
        alive = getattr(self.asys, "admin_alive", None)
        if alive is not None and not alive():
            return AdminError("the convention leader's admin no longer listens: its system stopped or was killed")
        if waited < timeout_s - NO_ANSWER_SLACK_S:
            return AdminError(f"the coordinator could not be reached ({waited:.1f} s, no answer: it may be being "
                              "recreated, or its system stopping)")
        return AdminError(f"the coordinator did not answer within {timeout_s:g} s")

    def inject(self, fault: str, *, replica: str = "", stage: str = "", factor: float = 1.0,
               count: int = 1) -> dict:
        """Inject ``fault`` (one of :data:`FAULTS`). Returns what was done and when
        (``at``: Unix time, seconds), for scripts that measure reaction times.

        Signal faults (``sigkill``, ``sigstop``, ``sigcont``, ``kill-pool``,
        ``kill-coordinator``) signal the target's process from this process, so they
        work only on the machine that process runs on (any admin port of the system
        there will do); elsewhere a pid would name another process.

        Raises:
            AdminError: unknown fault or target, a ``slow`` factor outside 1..``MAX_SLOW_FACTOR``,
            a signal fault whose target runs on another machine, or the system did not answer.
        """
        problem = inject_problem(fault, replica=replica, stage=stage, factor=factor, count=count)
        if problem:
            raise AdminError(problem)
        if fault in SIGNAL_FAULTS or fault in ("kill-pool", "kill-coordinator"):
            pid, target, host = self._pid_of(fault, replica, stage)
            here = host_identity()
            if host != here:
                raise AdminError(f"{fault} signals a process, and {target} runs on another machine "
                                 f"({_hostname(host)}) than this one ({_hostname(here)}): run it there")
            try:  # (the leader's log says so first; best effort: the signal is what was asked for)
                self._ask(SignalFault(fault, target, pid), timeout_s=2.0)
            except AdminError:
                pass
            at = time.time()
            # (a trial's `sigcont` after a `sigstop` went to the process that had replaced the
            # stopped one, isolated and killed meanwhile, and said only "injected")
            note = "" if fault != "sigcont" or _stopped(pid) else (
                f"; {target} (pid {pid}) was not stopped: a process stopped before may have been "
                "isolated and replaced (see `status`)")
            try:
                os.kill(pid, SIGNAL_FAULTS.get(fault, signal.SIGKILL))
            except ProcessLookupError:
                raise AdminError(f"{target} (pid {pid}) is not running any more") from None
            except PermissionError:  # (a traceback; a code review)
                raise AdminError(f"not allowed to signal {target} (pid {pid}): it runs as another user; "
                                 "run this as that user (or root)") from None
            return {"fault": fault, "target": target, "pid": pid, "at": at, "note": note}
        at = time.time()
        inject = InjectFault(replica, ENGINE_FAULTS[fault], factor, count)
        answer = self._ask(inject)  # (its pool's reply: for a clear, what there was to clear)
        message = answer if fault == "clear" else f"injected {inject.describe()} into {replica}"
        return {"fault": fault, "target": replica, "at": at, "message": message}

    def _pid_of(self, fault: str, replica: str, stage: str) -> tuple[int, str, str]:
        """``(pid, what it is, the machine it runs on)`` of the process ``fault`` signals."""
        status = self.status()
        if fault == "kill-coordinator":
            return status.coordinator_pid, "coordinator", status.coordinator_host
        if not status.model:  # (a coordinator just recreated: its stages are not known yet, not absent)
            raise AdminError(NOT_DEPLOYED)
        if fault == "kill-pool":
            pool = next((s for s in status.stages if s.stage == stage), None)
            if pool is None:  # (trial AN's `--stage talkr` read "no running pool")
                raise AdminError(f"no stage named {stage!r} (stages: {', '.join(s.stage for s in status.stages)})")
            if not pool.pid:
                raise AdminError(f"no running pool for stage {stage!r}")
            return pool.pid, f"pool {stage}", pool.host
        rep = next((r for s in status.stages for r in s.replicas if r.replica == replica), None)
        if rep is None:
            raise AdminError(f"no replica named {replica!r} (see `status`)")
        if not rep.pid:
            raise AdminError(f"{replica} is {rep.state.value}, not running (see `status`)")
        if rep.state.value not in ("ready", "starting", "draining", "isolated") and fault != "sigcont":
            raise AdminError(f"{replica} is {rep.state.value}, not running (see `status`)")
        return rep.pid, replica, rep.host

    def drain(self, replica: str) -> str:
        return self._ask(DrainReplica(replica))

    def drain_node(self, node: str, operator: bool = False) -> str:
        """Drain every replica on ``node`` (its member stops; ``operator``: ``node drain``,
        the member runs on and :meth:`undrain_node` undoes it): see :class:`DrainNode`.

        Raises:
            AdminError: no alive node by that name, or no answer.
        """
        return self._ask(DrainNode(node, operator=operator))

    def left_without_replicas(self, node: str, before, settle_s: float = 3.0) -> list[str]:
        """After ``drain_node(node, operator=True)`` (``before``: the status just before it):
        one line per stage left with no replica on its way anywhere else (see
        :func:`omni_actors.balancing.stages_left_without_replicas`). Waits up to ``settle_s``
        seconds for the pools to take the drain in (no replica of the node ready or starting)
        and for the replacements to be placed or found no room (a trial's drain took the last
        Code2Wav in silence; another's, from the shell, every stage of the only node)."""
        from omni_actors.balancing import stages_left_without_replicas
        from omni_actors.messages import PLACING, ReplicaState

        deadline, after = time.monotonic() + settle_s, None
        while time.monotonic() < deadline:
            after = self.status()
            reps = [r for st in after.stages for r in st.replicas]
            if not any(r.reason.startswith(PLACING) or (r.node == node and r.state in (
                    ReplicaState.READY, ReplicaState.STARTING)) for r in reps):
                break
            time.sleep(0.1)
        return [line for _, line in stages_left_without_replicas(after, node, before, drained=True)]

    def undrain_node(self, node: str) -> str:
        """Let ``node``, drained with ``node drain``, take new replicas again.

        Raises:
            AdminError: no alive node by that name, it is not drained, or no answer.
        """
        return self._ask(UndrainNode(node))

    def scale(self, stage: str, replicas: int, why: str = "scaled down") -> str:
        """Run ``replicas`` replicas of ``stage`` (0 to ``config.MAX_REPLICAS``, as the config);
        those retired give ``why`` as their reason.

        Raises:
            AdminError: a count out of range, an unknown stage, or no answer.
        """
        problem = replicas_problem(replicas, 0)
        if problem:
            raise AdminError(problem)
        return self._ask(ScaleStage(stage, replicas, why=why))

    def unplaced(self, stage: str, before, reply: str, settle_s: float = 3.0) -> list[str]:
        """After a ``scale`` or ``launch`` of ``stage`` that answered ``reply``: one line per
        new replica (not in the status ``before``) that no node could take, ``"talker/3 is
        pending, not started: <why>"`` (a trial read "launched code2wav/4" for a replica that
        found no room). Waits up to ``settle_s`` seconds for the new replicas to show and for
        the coordinator to answer their placement; nothing when ``reply`` launched none."""
        from omni_actors.messages import PLACING, ReplicaState

        if "; launched " not in reply:
            return []
        known = {r.replica for st in before.stages for r in st.replicas}
        deadline = time.monotonic() + settle_s
        while True:
            new = [r for st in self.status().stages if st.stage == stage for r in st.replicas
                   if r.replica not in known]
            placing = [r for r in new if r.state == ReplicaState.PENDING and r.reason.startswith(PLACING)]
            if (new and not placing) or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        return [f"{r.replica} is pending, not started: {r.reason}" for r in new
                if r.state == ReplicaState.PENDING and not r.reason.startswith(PLACING)]

    def launch(self, stage: str, replicas: int | None = None, *, node: str = "",
               devices: tuple[str, ...] | str = ()) -> str:
        """Add replicas to ``stage``: ``replicas`` of them (default 1, or one per
        ``devices_per_replica`` of ``devices``), only on ``node`` if given, on exactly
        ``devices`` if given (they stay pinned there, restarts included).

        Raises:
            AdminError: the reason it cannot be done (``devices`` not a list of device ids,
                see ``placement.parse_devices``; a device not on the node or taken,
                a count that does not divide, an unknown stage or node, ...).
        """
        if isinstance(devices, str):
            try:
                devices = parse_devices(devices)
            except ValueError as exc:
                raise AdminError(f"--devices: {exc}") from None
        problem = None if replicas is None else replicas_problem(replicas, 1)
        if problem:
            raise AdminError(problem)
        return self._ask(LaunchReplicas(stage, replicas, node=node, devices=tuple(devices)))



def thespian_admin_pid(admin_port: int) -> int | None:
    """The pid of this host's Thespian admin process on ``admin_port`` (its process title is
    ``MultiProcAdmin ActorAddr-(T|:PORT)``), where one is found; else None."""
    from omni_actors.system.processes import process_title
    from omni_actors.system.watchdog import ADMIN_TITLE

    title = f"{ADMIN_TITLE} ActorAddr-(T|:{admin_port})"
    return next((int(entry.name) for entry in Path("/proc").iterdir()
                 if entry.name.isdigit() and process_title(int(entry.name)).startswith(title)), None)


def _stopped(pid: int) -> bool:
    """Whether process ``pid`` (on this machine) is stopped (SIGSTOP: state ``T``)."""
    from omni_actors.system.processes import proc_stat

    stat = proc_stat(Path(f"/proc/{pid}"))
    return bool(stat) and stat[0] in ("T", "t")


@dataclass(frozen=True)
class LeaderApi:
    """What the leader on an admin port of this host recorded (``state``, see
    ``leader.state_file``) and whether its HTTP API serves now: ``down``, its process is
    gone; ``frozen``, it is stopped (SIGSTOP, a debugger); ``closed``, its port takes no
    connection (``stopping`` when the leader recorded that it stops, else still starting).
    ``host`` is where this host reaches the API (loopback for a wildcard bind)."""

    state: dict
    down: bool
    frozen: bool
    closed: bool
    stopping: bool
    host: str

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.state['port']}/v1"


def leader_api(admin_port: int) -> LeaderApi | None:
    """The :class:`LeaderApi` of the leader recorded on ``admin_port`` here; None if none is."""
    import json

    from omni_actors.system.leader import state_file
    from omni_actors.system.processes import port_in_use
    from omni_actors.system.watchdog import recorded_process_runs

    try:
        state = json.loads(state_file(admin_port).read_text())
    except (OSError, ValueError):
        return None
    down = not recorded_process_runs(state)
    bound = state.get("host")
    host = "127.0.0.1" if bound in (None, "", "0.0.0.0", "::") else bound  # (a wildcard: reach it on loopback)
    # (trial BH: with the leader stopped by SIGSTOP, `status` said ready while its HTTP API answered nothing)
    frozen = not down and _stopped(state["pid"])
    closed = bool(state.get("port") and not down and not frozen and not port_in_use(state["port"], host))
    return LeaderApi(state, down, frozen, closed, closed and bool(state.get("stopping")), host)


def _hostname(host: str) -> str:
    """The hostname part of a ``supervision.host_identity()``; "unknown" for ""."""
    return host.rsplit("/", 1)[0] or "unknown"


def inject_reply(done: dict) -> str:
    """What :meth:`Admin.inject` did (its dict), as the one line the CLI and the shell print,
    in one form for every fault (a trial met three): ``injected sigstop into talker/0 (pid
    4711)``, ``injected kill-pool into pool talker (pid 812)``, ``injected slow x5 into
    talker/0``, ``cleared faults of talker/0 (slow x5)``."""
    if done.get("message"):
        return done["message"]
    pid = f" (pid {done['pid']})" if "pid" in done else ""
    return f"injected {done['fault']} into {done['target']}{pid}{done.get('note', '')}"


def _waiting_member(admin_port: int) -> str | None:
    """The convention address a member recorded on ``admin_port`` here waits for (its
    leader does not answer yet), where that member still runs; else None."""
    import json

    from omni_actors.system.leader import member_state_file
    from omni_actors.system.watchdog import recorded_process_runs

    try:
        state = json.loads(member_state_file(admin_port).read_text())
    except (OSError, ValueError):
        return None
    return str(state.get("convention")) if state.get("waiting") and recorded_process_runs(state) else None


def attach(admin_port: int) -> Admin:
    """Attach to the admin on ``admin_port`` of this host (a member host's: to its
    convention leader), as from another host (:func:`~omni_actors.system.remote.attach_remote`):
    Thespian's own ``ActorSystem()`` starts an admin of its own when the one it was to join
    has just gone (a ``status`` racing a ``stop`` left one running on the port, a code review).

    Raises:
        AdminError: nothing listens there, or not an omni-actors admin.
    """
    from omni_actors.system.leader import other_leaders_hint
    from omni_actors.system.processes import port_in_use

    if not port_in_use(admin_port):  # (and where a leader recorded here runs: status, stop, api, shell)
        waiting = _waiting_member(admin_port)
        if waiting:  # (trial BO: "no actor system is listening" of a member `stop` then found)
            raise AdminError(f"the member on admin port {admin_port} is still waiting for its leader at {waiting}: "
                             "it has no admin yet")
        raise AdminError(f"no actor system is listening on admin port {admin_port}" + other_leaders_hint(admin_port))
    from omni_actors.system.remote import admin_status, attach_remote

    try:
        status = admin_status("127.0.0.1", admin_port)
    except Exception:  # noqa: BLE001 - Thespian raises several kinds here
        status = None
    if status is None:  # (checked first: Thespian takes about 15 s to give up on such a port)
        api = leader_api(admin_port)
        admin = thespian_admin_pid(admin_port)
        stopped = admin is not None and _stopped(admin)
        if api is not None and not api.down:  # (trial BO: a busy leader's admin read as not one of ours)
            raise AdminError(f"the leader's admin on port {admin_port} did not answer within 5 s ("
                             + (f"its process, pid {admin}, is stopped: SIGSTOP; `kill -CONT {admin}` resumes it"
                                if stopped else "busy or stuck")
                             + f"; its HTTP API may still serve; `stop --admin-port {admin_port}` stops it)")
        if admin is not None:  # (trial CC: a frozen admin read as "not ... an omni-actors admin (the HTTP port?)")
            from omni_actors.system.leader import member_state_file, state_dir

            # (what is recorded on that port here: a member's, or a leader whose process is gone)
            recorded = ("; the member recorded on that port has it" if member_state_file(admin_port).exists() else
                        f"; the leader recorded on that port (pid {api.state.get('pid')}) is gone" if api is not None
                        else f"; no leader or member is recorded on that port in {state_dir()} (started with "
                             "another OMNI_ACTORS_STATE_DIR or HOME?)")
            raise AdminError(f"the Thespian admin on port {admin_port} (pid {admin}) did not answer within 5 s ("
                             + (f"stopped: SIGSTOP; `kill -CONT {admin}` resumes it" if stopped
                                else "busy or stuck") + f"){recorded}")
        raise AdminError(f"port {admin_port} is in use, but not by an omni-actors admin (the HTTP port? see "
                         "--admin-port)")
    return attach_remote("127.0.0.1", admin_port)
