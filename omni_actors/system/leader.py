"""The convention leader: admin, coordinator, pools, engines and the API server.

``run_leader`` is what ``python -m omni_actors.system start --convention-leader``
runs in the foreground. It ends on SIGINT/SIGTERM (Ctrl-C or ``stop``) by
stopping HTTP, shutting the actor system down, ending any process of this
system still alive, and unlinking its shared-memory segments.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

from omni_actors.config import PipelineConfig
from omni_actors.system.processes import (ENV_SYSTEM_ID, child_sessions, cli, handle_stop_signals, kill_system,
                                          port_in_use,
                                          remove_ipc_dir, remove_orphan_semaphores, resume_stopped, sweep_stale_ipc_dirs,
                                          serve_args_error)
from omni_actors.system.watchdog import (admin_stops, exit_if_host_gone, identity, is_watchdog, mark_host_process,
                                         recorded_process_runs, start_watchdog, stop_watchdog, successor_runs)

ACTOR_BASE = "multiprocTCPBase"
PR_SET_CHILD_SUBREAPER = 36


class StartError(RuntimeError):
    """The leader could not start; the message is one line for the CLI."""


def state_dir() -> Path:
    """Where leaders record themselves: ``$OMNI_ACTORS_STATE_DIR`` or ``~/.omni-actors``."""
    return Path(os.environ.get("OMNI_ACTORS_STATE_DIR") or Path.home() / ".omni-actors")


def state_file(admin_port: int) -> Path:
    return state_dir() / f"leader-{admin_port}.json"


def write_state(path: Path, state: dict) -> None:
    """Write a state file whole (a temporary file renamed over it): the host and `stop`
    both update one while the other may read it, and a reader of a file being rewritten
    in place found it empty (a member then left no drain record for its `stop`).

    Raises:
        OSError: the directory cannot be written.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


#: The lock file of a state directory's updates (see :func:`update_state`).
STATE_LOCK = ".state.lock"


def hold_lock(path: Path) -> int | None:
    """An open descriptor of lock file ``path`` (made if need be) holding an exclusive POSIX
    lock (``lockf``, which NFS honours too), waited for; closing it releases the lock. None
    where the file cannot be opened; where no lock can be had (a review's NFS without a lock
    daemon) the descriptor comes unlocked, as before."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None
    with contextlib.suppress(OSError):
        fcntl.lockf(fd, fcntl.LOCK_EX)
    return fd


def update_state(path: Path, **fields) -> dict | None:
    """Add ``fields`` to the state file ``path`` (read, merged and written whole under an
    exclusive POSIX lock on the directory's :data:`STATE_LOCK`, which NFS honours too, so that
    two processes updating it at once, the host marking that it stops and `stop` recording
    its signal, both keep their fields; where no lock can be had, unlocked, as before); the
    state written, or None where the file is gone (its host exited: not written again)
    or cannot be read or written."""
    lock_fd = hold_lock(path.parent / STATE_LOCK)
    try:
        state = {**json.loads(path.read_text()), **fields}
        write_state(path, state)
        return state
    except (OSError, ValueError):
        return None
    finally:
        if lock_fd is not None:
            os.close(lock_fd)


def member_state_file(admin_port: int) -> Path:
    """Where a member host records itself (``member-<admin port>.json`` in :func:`state_dir`),
    so that ``stop --admin-port`` finds and stops it as it does a leader."""
    return state_dir() / f"member-{admin_port}.json"


def _become_subreaper() -> None:
    """Adopt orphaned actor processes so their exits are reaped (no zombies)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        return
    def reap() -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid = 0
            if pid == 0:
                time.sleep(0.2)
    threading.Thread(target=reap, name="reaper", daemon=True).start()


def print_status_table(status, out=sys.stdout, api_down: bool = False, stopping: bool = False,
                       frozen: bool = False) -> None:
    """Print a ``SystemStatus`` as a table: stage, replica, state, load, reason; with
    ``api_down`` (its leader process is gone) or ``frozen`` (it is stopped: SIGSTOP) the last
    line says it does not serve, with ``stopping`` (its leader drains) that it is stopping."""
    # (IN_FLIGHT: the pool's tasks on it; RUN/WAIT: its engine's own requests running and waiting, as
    # its last heartbeat said: a trial had to read /v1/stages to see an abort reach the engine)
    rows = [("STAGE", "REPLICA", "STATE", "NODE", "DEVICES", "PID", "IN_FLIGHT", "RUN/WAIT", "DONE", "FAILED",
             "RESTARTS", "REASON")]
    for st in status.stages:
        for r in st.replicas:
            engine = f"{r.running}/{r.waiting}" if r.pid else "-"
            rows.append((st.stage, r.replica, r.state.value, r.node or "-", r.devices_label(), str(r.pid or "-"),
                         str(r.in_flight), engine, str(r.completed), str(r.failed), str(r.restarts),
                         r.reason_label()))
        if not st.replicas:
            # (a pool that has not reported yet, as just after a redeploy, is no stage without replicas)
            rows.append((st.stage, "-", "no replicas" if st.pid else "pool starting", *[""] * 9))
    widths = [max(len(row[i]) for row in rows) for i in range(11)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[11], file=out)
    down = [n.name for n in status.nodes if n.state != "alive"]
    if len(status.nodes) > 1 or down:
        print("nodes: " + ", ".join(_node_label(n) for n in status.nodes), file=out)
    for note in getattr(status, "notes", ()):
        print(f"note: {note}", file=out)
    print(model_line(status, api_down=api_down, stopping=stopping, frozen=frozen), file=out)


def model_line(status, *, api_down: bool = False, stopping: bool = False, frozen: bool = False) -> str:
    """The last line of a status table: whether the model serves (its stages ready, and its
    leader's HTTP API up: ``api_down``, ``frozen`` and ``stopping`` as ``leader_api`` says)."""
    stages = 'ready' if status.ready else 'not ready'
    if api_down:
        return (f"model {status.model}: NOT SERVING (its stages are {stages}, but its leader is not running: the "
                "HTTP API is down)")
    if frozen:
        return (f"model {status.model}: NOT SERVING (its stages are {stages}, but its leader process is stopped: "
                "the HTTP API answers nothing until it is resumed)")
    if stopping:
        return (f"model {status.model}: STOPPING (the leader takes no new requests while those in flight "
                "finish, up to supervision.drain_timeout_s)")
    if not status.model:  # (a trial read an empty table and "model : NOT READY")
        from omni_actors.messages import NOT_DEPLOYED

        return f"NOT READY: {NOT_DEPLOYED}"
    return f"model {status.model}: {'ready' if status.ready else 'NOT READY'}"


def admin_start_error(admin_port: int, exc: BaseException) -> str:
    """The one line for an ``ActorSystem(...)`` that did not start on ``admin_port``. Thespian's
    "... is not a valid or useable ActorSystem Admin" means that the admin it forked did not
    answer within its wait (about 10 s): said in words, with what to do."""
    text = str(exc)
    if "not a valid or useable ActorSystem Admin" in text:
        return (f"the actor system did not start on admin port {admin_port}: its admin process did not "
                f"answer within Thespian's start-up wait (a machine busy with other work, or another "
                f"program took the port meanwhile); try again, or pick another --admin-port")
    return f"the actor system did not start on admin port {admin_port}: {text}"


#: Seconds :func:`start_admin` looks for the admin it forked among this process's children.
OWN_ADMIN_WAIT_S = 5.0


def start_admin(admin_port: int, capabilities: dict):
    """This host's Thespian admin on ``admin_port``, forked by this process, and the
    ``ActorSystem`` that talks to it.

    Raises:
        StartError: it did not start (:func:`admin_start_error`), or another process's admin
            answers on ``admin_port``: one started there after this process found the port free
            (a member waiting for its leader, a code review). Thespian then uses that admin
            instead of starting its own, and this host's shutdown would stop that other system.
    """
    from thespian.actors import ActorSystem

    from omni_actors.logs import thespian_log_defs
    from omni_actors.system.watchdog import find_admin

    try:
        asys = ActorSystem(ACTOR_BASE, capabilities, logDefs=thespian_log_defs())
    except Exception as exc:  # noqa: BLE001 - Thespian raises several kinds here
        raise StartError(admin_start_error(admin_port, exc)) from None
    # (Thespian forks its admin twice: the admin becomes this process's child, as its subreaper,
    # only once the process between has exited, which a loaded host delays: CI saw a leader
    # refuse its own admin. So it is looked for a while.)
    deadline = time.monotonic() + OWN_ADMIN_WAIT_S
    while find_admin(os.getpid()) is None:
        if time.monotonic() >= deadline:  # (not shut down: it is the other system's)
            raise StartError(f"admin port {admin_port} was taken by another system while this one started: "
                             "give this one an --admin-port of its own")
        time.sleep(0.05)
    return asys


def _node_label(node) -> str:
    """``m1``, ``m2 (LEAVING, 1 of 4 devices free, 3 buffers)``, ``m3 (LEFT)``: a node of the
    ``nodes:`` line (free devices: a trial could not tell from ``status`` where room was left)."""
    parts = [] if node.state == "alive" else [_down_label(node)]
    if node.alive and node.devices:
        parts.append(f"{len(node.devices) - len(node.used)} of {len(node.devices)} devices free")
    if node.alive and node.buffers is not None:
        parts.append(f"{node.buffers} buffers")
    if node.alive and node.data_service_silent_s:  # (trial BX: its member process frozen, and nothing said)
        parts.append(f"DATA SERVICE SILENT {node.data_service_silent_s:g} s")
    return node.name + (f" ({', '.join(parts)})" if parts else "")


def _down_label(node) -> str:
    """``LEAVING`` (its member stops: it drains), ``LEFT``, or ``LOST: <why>``
    (``LOST: missed 3 node heartbeats``)."""
    label = node.state.upper()
    label = f"{label}: {node.down_reason}" if node.state == "lost" and node.down_reason else label
    # (trial BK: a drained node whose member stopped read LEFT, with no word that it stays drained)
    return f"{label}, still drained: `node undrain`" if node.drained and not node.alive else label


def node_capabilities(admin_port: int, node: str, devices: tuple[str, ...], stages: tuple[str, ...]) -> dict:
    """Thespian capabilities of a host: where placement finds it (see actors.node_agent)."""
    from omni_actors.actors.node_agent import HOST_CAPABILITY, MEMBER_CAPABILITY, NODE_CAPABILITY
    from omni_actors.actors.supervision import host_identity

    return {"Admin Port": admin_port, NODE_CAPABILITY: node, MEMBER_CAPABILITY: uuid.uuid4().hex[:16],
            "omni_devices": ",".join(devices), "omni_stages": ",".join(stages), HOST_CAPABILITY: host_identity()}


def start_data_service(node: str, default_host: str, reap_after_s: float):
    """Start this host's data service (``omni_actors.connectors.data_service``) before
    its Thespian admin, so that every actor forked from the admin stamps its
    connector refs with this node and service. Raises StartError."""
    from omni_actors.connectors.data_service import start_node_service

    try:
        return start_node_service(node, default_host, reap_after_s=reap_after_s)
    except OSError as exc:
        raise StartError(f"the data service could not start on {default_host}: {exc}") from None


def member_on_port(port: int) -> str | None:
    """``member 'm1' (pid 4711)`` when a member recorded in :func:`state_dir` whose process
    runs, other than this process, has its admin on ``port`` (``(pid 4711, waiting for its
    leader)`` while its admin is not up yet: a code review's second member, and a leader,
    took the port of one waiting, as nothing listened there yet); else None."""
    try:
        state = json.loads(member_state_file(port).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or state.get("pid") == os.getpid() or not recorded_process_runs(state):
        return None
    waiting = ", waiting for its leader" if state.get("waiting") else ""
    return f"member {state.get('node')!r} (pid {state.get('pid')}{waiting})"


def _admin_port_taken(admin_port: int) -> str:
    """Why the leader cannot have ``admin_port``: another system, a member host (trial BR:
    "another system? `stop --admin-port`", which would have stopped the member), or what a
    leader that died there left, which its watchdog is stopping (a few seconds)."""
    member = member_on_port(admin_port)
    if member:
        return f"admin port {admin_port} is the admin port of {member} on this host: give another --admin-port"
    try:
        state = json.loads(state_file(admin_port).read_text())
    except (OSError, ValueError):
        state = {}
    pid, stop = state.get("pid"), f"`{cli('stop')} --admin-port {admin_port}`"
    if isinstance(pid, int) and not recorded_process_runs(state):
        watchdog = state.get("watchdog_pid")
        return (f"admin port {admin_port} is still held by what the leader (pid {pid}) that died there left: "
                + ("its watchdog is stopping it; try again in a few seconds"
                   if isinstance(watchdog, int) and is_watchdog(watchdog) else f"{stop} stops it"))
    if isinstance(pid, int):  # (trial CE: a running leader recorded there was not named)
        port = state.get("port")
        return (f"admin port {admin_port} is in use by the system on admin port {admin_port} (leader pid {pid}"
                + (f", HTTP port {port}" if isinstance(port, int) else "")
                + f"): give another --admin-port, or {stop} stops it")
    return f"admin port {admin_port} is in use (another system? {stop})"


def _same_interface(a: str, b: str, port: int) -> bool:
    """Whether two ``--host`` values overlap for listening on ``port``: either is a
    wildcard, or they resolve to a common address (``localhost`` and ``127.0.0.1``)."""
    if {a, b} & {"", "0.0.0.0", "::"}:
        return True

    def addresses(host: str) -> set[str]:
        try:
            return {ai[4][0] for ai in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)}
        except (OSError, UnicodeError):
            return {host}
    return a == b or bool(addresses(a) & addresses(b))


def recorded_leaders() -> list[dict]:
    """The state files (see :func:`state_file`) in :func:`state_dir` of leaders whose
    process still runs, by admin port."""
    found = []
    for path in sorted(state_dir().glob("leader-*.json")):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(state.get("admin_port"), int) and recorded_process_runs(state):
            found.append(state)
    return sorted(found, key=lambda state: state["admin_port"])


def other_leaders_hint(admin_port: int, flag: str = "--admin-port {}") -> str:
    """``"; the leader recorded in DIR runs on admin port 23101 (--admin-port 23101)"``
    when leaders other than one on ``admin_port`` are recorded running here, else ""
    (a trial's `status` without --admin-port said only that nothing listened on 1900).
    ``flag``: how to name one of them (``"--convention-address 127.0.0.1:{}"``)."""
    others = [state["admin_port"] for state in recorded_leaders() if state["admin_port"] != admin_port]
    if not others:
        return ""
    if len(others) == 1:
        return (f"; the leader recorded in {state_dir()} runs on admin port {others[0]} "
                f"({flag.format(others[0])})")
    return (f"; leaders recorded in {state_dir()} run on admin ports {', '.join(map(str, others))} "
            f"(give {flag.split()[0]})")


def _is_stopping(state: dict) -> bool:
    """Whether a leader's record says that it stops: it drains (``stopping``), `stop` asked it
    (``stop_asked_at``), or its start-up was interrupted."""
    return bool(state.get("stopping")) or state.get("stop_asked_at") is not None


#: How the port checks name a leader that stops (see :func:`_is_stopping`).
STOPPING_HINT = "which is stopping; try again once it has exited"


def http_port_claimed(host: str, port: int, admin_port: int, api: bool = False) -> str | None:
    """Why ``host:port`` is taken by a leader recorded in :func:`state_dir`, or None.

    One still starting opens its HTTP port only once every replica is ready, so a
    connect finds nothing there yet (a trial started a second leader on the port of one
    still loading: the second served there, and the first, after its whole start-up,
    could not bind and exited). One serving there: the answer says how to stop it (a
    trial ran `make run` twice and read only "HTTP port 8000 on 127.0.0.1 is in use").
    One that stops: that it does (a code review read "serves there once its replicas are
    ready" of a leader draining)."""
    for other in recorded_leaders():
        pid, other_admin = other["pid"], other["admin_port"]
        if other.get("port") != port or pid == os.getpid() \
                or not _same_interface(str(other.get("host", "")), host, port):
            continue
        who = f"the system on admin port {other_admin} (leader pid {pid})"
        serving = port_in_use(port)
        taken = f"HTTP port {port} on {host} is {'in use' if serving else 'taken'} by {who}"
        if _is_stopping(other):
            return f"{taken}, {STOPPING_HINT}" + (" (or give this API server another --port)" if api else "")
        if api:  # (trial BR: told to stop the system it was to serve, or to change its --admin-port)
            return (taken + ("" if serving else ", which serves there once its replicas are ready")
                    + ": give this API server another --port")
        if serving:
            return (f"{taken}: stop it first (`{cli('stop')} --admin-port {other_admin}`), or give other ports "
                    "(--port" + (", --admin-port)" if other_admin == admin_port else ")"))
        return f"{taken}, which serves there once its replicas are ready"
    return None


def http_port_problem(host: str, port: int, admin_port: int | None, api: bool = False) -> str | None:
    """Why an HTTP server may not serve on ``host:port`` (see
    :func:`~omni_actors.system.processes.serve_args_error`), a leader still starting that
    will serve there included (:func:`http_port_claimed`; a code review: an `api` server
    took the port of a leader still loading, which then exited once its replicas were
    ready), or a member's admin port named (trial BR); None when it may. ``api``: for an
    API server, which can change only its ``--port``."""
    problem = serve_args_error(host, port, admin_port)
    if problem is None or problem.endswith(" is in use"):  # (by which system, where it is one of ours)
        problem = http_port_claimed(host, port, admin_port or 0, api=api) or problem
    # (None too: a member waiting for its leader has no admin listening yet, a code review)
    member = member_on_port(port) if problem is None or problem.endswith(" is in use") else None
    if member:
        problem = f"HTTP port {port} on {host} is the admin port of {member} on this host: give another --port"
    return problem


def admin_port_claimed(admin_port: int) -> str | None:
    """Why ``admin_port`` may not be an admin's: it is the HTTP port of a leader recorded
    here, which may still be starting (it opens that port once its replicas are ready, so
    nothing listens there yet); None otherwise."""
    for other in recorded_leaders():
        if other.get("port") == admin_port and other["pid"] != os.getpid():
            if _is_stopping(other):
                return (f"admin port {admin_port} is the HTTP port of the system on admin port "
                        f"{other['admin_port']} (leader pid {other['pid']}), {STOPPING_HINT} (or give another "
                        "--admin-port)")
            return (f"admin port {admin_port} is the HTTP port of the system on admin port {other['admin_port']} "
                    f"(leader pid {other['pid']})" + ("" if port_in_use(admin_port)
                                                      else ", which serves there once its replicas are ready")
                    + ": give another --admin-port")
    return None


def run_leader(config: PipelineConfig, *, host: str, port: int, admin_port: int,
               api_key: str | None = None, node: str = "", devices: tuple[str, ...] = ()) -> int:
    """Run the leader in the foreground until SIGINT/SIGTERM. Returns the exit code.

    Raises:
        StartError: the admin or HTTP port is taken, or the coordinator did not answer.
    """
    from omni_actors.actors import device_leases
    from omni_actors.actors.coordinator import COORDINATOR_NAME, CoordinatorActor
    from omni_actors.connectors import SegmentDirError, check_segment_dir, sweep_segments
    from omni_actors.logs import get_logger
    from omni_actors.messages import Deploy, NodeInfo, ReplicaState, SystemStatus

    problem = http_port_problem(host, port, admin_port) or admin_port_claimed(admin_port)
    if problem:
        raise StartError(problem)
    if port_in_use(admin_port) or member_on_port(admin_port):  # (a member waiting for its leader: not listening)
        raise StartError(_admin_port_taken(admin_port))
    try:
        shm_dir = check_segment_dir()  # $OMNI_ACTORS_SHM_DIR (--shm-dir), inherited by every actor
    except SegmentDirError as exc:
        raise StartError(str(exc)) from None
    # Set at exec time by the CLI (see __main__._ensure_system_id), so /proc shows it.
    system_id = os.environ.get(ENV_SYSTEM_ID) or uuid.uuid4().hex
    os.environ[ENV_SYSTEM_ID] = system_id
    shm_prefix = f"oa-{admin_port}-"
    os.environ["OMNI_ACTORS_SHM_PREFIX"] = shm_prefix
    sfile = state_file(admin_port)
    if not successor_runs(sfile, os.getpid()):  # (not another leader's, started on this port meanwhile)
        sweep_segments(shm_prefix)  # what a killed predecessor on this port left
    log = get_logger(actor="leader")
    _become_subreaper()
    stale = sweep_stale_ipc_dirs()
    if stale:  # (systems killed outright on this host, watchdog and all, left them)
        log.info("stale_ipc_dirs_removed", dirs=len(stale))

    stopping = threading.Event()
    leader_pid = os.getpid()

    def interrupt(signum, frame):
        # Until the API serves, a signal aborts start-up (the finally below cleans up);
        # after that it asks the serve loop to stop. Processes forked from here (the
        # Thespian admin) inherit this handler: they leave their own shutdown to the leader.
        if os.getpid() != leader_pid:
            exit_if_host_gone(signum)
            return
        if serving.is_set():
            if stopping.is_set():
                hurry.set()  # a second Ctrl-C: do not wait for the drain
            stopping.set()
        elif not stopping.is_set():  # (a second one must not break off the clean-up)
            stopping.set()
            raise KeyboardInterrupt

    serving, hurry = threading.Event(), threading.Event()
    handle_stop_signals(interrupt)

    t0, started_at = time.monotonic(), time.time()
    from omni_actors.actors.supervision import host_identity

    leader_node = NodeInfo(node or socket.gethostname(), tuple(devices), host=host_identity())
    device_leases.sweep_stale()  # (of leaders and members killed outright on this host)
    leases = device_leases.use_scope(admin_port, leader_node.name)
    asys = data = watchdog = None
    sessions: list[int] = []
    try:
        data = start_data_service(leader_node.name, host, config.deployment.request_timeout_s + 30)
        mark_host_process("leader")  # (inherited by the admin and every actor)
        asys = start_admin(admin_port, node_capabilities(admin_port, leader_node.name, devices, ()))
        sessions = child_sessions()  # the admin's session: the whole actor tree lives in it
        watchdog = start_watchdog("leader", system_id, sessions, shm_prefix=shm_prefix, state_file=sfile)
        # (before the deployment, which waits for every replica: `stop` finds the leader by it)
        sfile.parent.mkdir(parents=True, exist_ok=True)
        write_state(sfile, {"pid": os.getpid(), **identity(), "admin_port": admin_port, "host": host,
                            "watchdog_pid": watchdog.pid if watchdog else None,
                            "sessions": sessions, "shm_dir": shm_dir,
                            "drain_timeout_s": config.deployment.supervision.drain_timeout_s,
                            "port": port, "system_id": system_id, "config": config.source,
                            "model": config.deployment.served_model_name})
        coordinator = asys.createActor(CoordinatorActor, globalName=COORDINATOR_NAME)
        deployed_at = int(time.time())  # (`created` of /v1/models: kept by a recreated coordinator)
        deployed = threading.Event()
        threading.Thread(target=_report_start_progress, args=(asys, coordinator, deployed, t0),
                         name="start-progress", daemon=True).start()
        try:
            status = asys.ask(coordinator, Deploy(config, leader_node, deployed_at=deployed_at),
                              config.deployment.ready_timeout_s + 15)
        finally:
            deployed.set()
        if not isinstance(status, SystemStatus):
            raise StartError("the coordinator did not answer the deployment in time")
        print_status_table(status)
        if not status.ready:
            # (trial BC: "some stages", where the Thinker, which every request needs, had failed)
            unready = [st.stage for st in status.stages if not any(r.state == ReplicaState.READY for r in st.replicas)]
            print(f"warning: {'stage' if len(unready) == 1 else 'stages'} {', '.join(unready)} "
                  f"{'has' if len(unready) == 1 else 'have'} no ready replica (REASON above); the requests "
                  f"that need {'it' if len(unready) == 1 else 'them'} get HTTP 503", file=sys.stderr)
        log.info("leader_started", admin_port=admin_port, shm_dir=shm_dir,
                 startup_s=round(time.monotonic() - t0, 2))
        serving.set()
        threading.Thread(target=_watch_coordinator, args=(asys, config, leader_node, stopping, deployed_at),
                         name="coordinator-watchdog",
                         daemon=True).start()
        def mark_stopping() -> None:  # (`status` then says so, not that the HTTP API is not up yet)
            update_state(sfile, stopping=True)

        asyncio.run(_serve(asys, coordinator, config, host, port, api_key, stopping, hurry, mark_stopping,
                           admin_port=admin_port))
        return 0
    except KeyboardInterrupt:
        if not successor_runs(sfile, os.getpid()):  # (its own record: a start on its ports says it stops)
            update_state(sfile, stopping=True)
        print("interrupted during start-up", file=sys.stderr)
        return 130
    finally:
        stopping.set()  # ends the coordinator watchdog before the system goes away
        t1 = time.monotonic()
        try:
            if asys is not None:
                resume_stopped(system_id, sessions)
                if serving.is_set():
                    _stop_pools(asys, log)
                admin_stops(watchdog)  # (its admin's exit is no death, for its watchdog)
                asys.shutdown()
        finally:
            killed: list[str] = []
            left = kill_system(system_id, sessions=sessions, titles=killed, settle_s=1.0 if asys is not None else 0.0)
            remove_ipc_dir(system_id)
            device_leases.sweep(leases)
            # (a code review: a leader that lost its admin port to another one started at the same
            # moment, "taken by another system", removed that one's record and segments)
            theirs = successor_runs(sfile, os.getpid())
            removed = 0 if theirs else sweep_segments(shm_prefix)
            semaphores = remove_orphan_semaphores(started_at)
            if data is not None:
                data.stop()
            try:
                if not theirs:
                    sfile.unlink(missing_ok=True)
            except OSError:
                pass  # (an unusable state directory: nothing was recorded there)
            stop_watchdog(watchdog)
            log.info("leader_stopped", shutdown_s=round(time.monotonic() - t1, 2),
                     processes_killed=left, killed=killed[:20], shm_segments_removed=removed,
                     semaphores_removed=len(semaphores))
            print("omni-actors stopped", flush=True)


#: Seconds between the start-up progress lines while the replicas start (vLLM: a minute).
START_PROGRESS_EVERY_S = 10.0
#: Longest a stop waits for the coordinator to tell its pools to exit (:func:`_stop_pools`).
STOP_POOLS_TIMEOUT_S = 3.0
#: A recreated coordinator that still has no config this long after the watchdog sent it one
#: is sent it again (the first was lost); sooner, it is making its pools.
REDEPLOY_AFTER_S = 10.0


def _stop_pools(asys, log) -> None:
    """At a stop, before the actor system goes: the coordinator tells its stage pools to exit,
    so each pool knows its replicas' exits are planned (logged at info; a trial read a clean
    stop's ``replica_exited`` events at error: the replicas had exited before their pools heard
    of the stop). A coordinator that does not answer within :data:`STOP_POOLS_TIMEOUT_S` is left
    to the shutdown."""
    from omni_actors.actors.coordinator import COORDINATOR_NAME, CoordinatorActor
    from omni_actors.messages import ShutdownDone, ShutdownSystem

    try:
        coordinator = asys.createActor(CoordinatorActor, globalName=COORDINATOR_NAME)
        done = asys.ask(coordinator, ShutdownSystem(), STOP_POOLS_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - stopping anyway
        done = exc
    if not isinstance(done, ShutdownDone):
        log.warning("stop_pools_unanswered", answer=repr(done)[:200], timeout_s=STOP_POOLS_TIMEOUT_S)


def _report_start_progress(asys, coordinator, deployed: threading.Event, t0: float,
                           every_s: float = START_PROGRESS_EVERY_S) -> None:
    """(A thread) Until ``deployed`` is set, every ``every_s`` print which replicas are
    not ready yet: ``starting (20 s): 2 of 4 replicas ready; waiting for thinker/0
    starting, talker/1 pending: no node has ...``. A leader starting real engines
    printed nothing of its own for a minute (only the engines' log)."""
    from omni_actors.balancing import describe_replicas
    from omni_actors.messages import GetStatus, ReplicaState, SystemStatus

    with asys.private() as ctx:
        while not deployed.wait(every_s):
            try:
                status = ctx.ask(coordinator, GetStatus("start-progress"), 5.0)
            except Exception:  # noqa: BLE001 - progress is best effort
                continue
            if deployed.is_set() or not isinstance(status, SystemStatus):
                continue
            reps = [r for s in status.stages for r in s.replicas if r.state != ReplicaState.STOPPED]
            # (trial BC read "waiting for thinker/0 failed: ...": a failed replica is not waited for)
            failed = [r for r in reps if r.state == ReplicaState.FAILED]
            waiting = [r for r in reps if r.state not in (ReplicaState.READY, ReplicaState.FAILED)]
            if waiting or failed:
                print(f"starting ({time.monotonic() - t0:.0f} s): {len(reps) - len(waiting) - len(failed)} of "
                      f"{len(reps)} replicas ready" + (f"; waiting for {describe_replicas(waiting)}" if waiting else "")
                      + (f"; not waited for: {describe_replicas(failed)}" if failed else ""), flush=True)


def _watch_coordinator(asys, config: PipelineConfig, leader_node, stopping: threading.Event,
                       deployed_at: int = 0) -> None:
    """Keep one deployed coordinator alive (the leader supervises the top of the tree).

    Every heartbeat interval: look the coordinator up by ``globalName`` (Thespian
    drops the name when its process dies, so a dead one is recreated by the
    lookup itself), ask its status, and deploy the config to a new, empty one.
    One that does not answer three times in a row is killed, to be recreated.
    """
    from omni_actors.actors.coordinator import COORDINATOR_NAME, CoordinatorActor
    from omni_actors.logs import get_logger
    from omni_actors.messages import WATCHDOG_QUERY, Deploy, GetStatus, SystemStatus

    log = get_logger(actor="leader")
    interval = config.deployment.heartbeat_interval_s
    misses, last_pid, last = 0, None, None
    deployed = (None, 0.0)  # (the coordinator pid last sent a Deploy, when: monotonic)
    with asys.private() as ctx:
        while not stopping.wait(interval):
            try:
                address = ctx.createActor(CoordinatorActor, globalName=COORDINATOR_NAME)
                status = ctx.ask(address, GetStatus(WATCHDOG_QUERY), 2 * interval)
                if isinstance(status, SystemStatus) and status.model:
                    misses, last_pid, last = 0, status.coordinator_pid, status
                elif isinstance(status, SystemStatus) and status.coordinator_pid == deployed[0] \
                        and time.monotonic() - deployed[1] < REDEPLOY_AFTER_S:
                    misses = 0  # (deployed a moment ago: its pools are being made; trial BG read the
                    # restart logged, and the Deploy sent, two or three times per coordinator)
                elif isinstance(status, SystemStatus):
                    log.warning("coordinator_restarted", coordinator_pid=status.coordinator_pid,
                                previous_pid=last.coordinator_pid if last else None)
                    deployed = (status.coordinator_pid, time.monotonic())
                    # what ran before, as it was (a trial saw launched replicas gone, counters and
                    # restarts back at 0 and no reason saying why every replica was new)
                    drained = tuple(n.name for n in last.nodes if n.drained) if last else ()
                    ctx.tell(address, Deploy(config, leader_node, previous=last.stages if last else (),
                                             drained_nodes=drained, deployed_at=deployed_at,
                                             subscribers=last.subscribers if last else ()))
                    misses, last_pid = 0, status.coordinator_pid
                else:
                    misses += 1
                    if misses >= 3 and last_pid:
                        log.error("coordinator_hung_killing", coordinator_pid=last_pid)
                        os.kill(last_pid, signal.SIGKILL)
                        misses = 0
            except Exception as exc:  # noqa: BLE001 - the watchdog must outlive what it watches
                if stopping.is_set():
                    return
                log.warning("coordinator_watchdog_error", error=str(exc))


async def _serve(asys, coordinator, config, host, port, api_key, stopping: threading.Event,
                 hurry: threading.Event | None = None, on_stop=None, admin_port: int | None = None) -> None:
    from omni_actors.http.app import start_http
    from omni_actors.http.bridge import ActorBridge, BridgeError

    bridge = ActorBridge(asys, coordinator, request_actors=config.deployment.request_actors)
    try:
        bridge.start(asyncio.get_running_loop())
    except BridgeError as exc:  # (one line and exit 2, as every start-up failure: it was a traceback)
        raise StartError(f"the API server could not start: {exc}") from None
    try:
        runner = await start_http(bridge, host, port, api_key=api_key)
    except OSError as exc:
        bridge.close()
        raise StartError(f"cannot serve HTTP on {host}:{port}: {exc.strerror}") from None
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    # (the port always: a `stop` without it asks the default admin port, another system's or none)
    stop = cli("stop") + (f" --admin-port {admin_port}" if admin_port is not None else "")
    print(f"omni-actors serving model {config.deployment.served_model_name!r} at http://{shown}:{port}/v1 "
          f"(admin port {admin_port if admin_port is not None else '?'}); Ctrl-C or `{stop}` to stop", flush=True)
    try:
        while not stopping.is_set():
            await asyncio.sleep(0.2)
        if on_stop is not None:
            on_stop()
        drain_s = config.deployment.supervision.drain_timeout_s
        others = asyncio.get_running_loop().run_in_executor(
            None, _drain_api_servers, asys, coordinator, drain_s, bridge.address)
        await drain_http(runner, bridge, drain_s, hurry)
        # (the coordinator answers at once when no API server is attached, or none has a
        # request in flight: then there is nothing to say; a trial read this line with none)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(others), ATTACHED_DRAIN_QUIET_S)
        if not others.done() and not (hurry and hurry.is_set()):
            print("draining: waiting for the requests of the attached API servers to finish (up to "
                  f"{drain_s:g} s from the stop, supervision.drain_timeout_s)", file=sys.stderr, flush=True)
        while not others.done() and not (hurry and hurry.is_set()):
            await asyncio.sleep(0.05)
        if not others.done():  # a second stop signal: the attached servers end their requests too
            await asyncio.get_running_loop().run_in_executor(None, _hurry_api_servers, asys, coordinator, drain_s)
            deadline = time.monotonic() + ABORT_GRACE_S + 1.0
            while not others.done() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
    finally:
        await runner.cleanup()
        bridge.close()


#: How long the stop waits for the attached API servers' drain before it says that it waits for them.
ATTACHED_DRAIN_QUIET_S = 1.0

#: After the drain, how long the requests it ended get to send their 503 to their clients.
ABORT_GRACE_S = 2.0


def _drain_api_servers(asys, coordinator, drain_timeout_s: float, exclude) -> None:
    """(A thread, at a stop, beside the leader's own drain) Have the coordinator tell the
    attached API servers (``api``) that the system stops, and wait until their requests
    are over: up to ``drain_timeout_s`` (``supervision.drain_timeout_s``) plus the time their
    503s take. The leader's drain counted only its own requests, and a stop cut off the
    attached servers' streams about 1 s after it began (a trial)."""
    from omni_actors.logs import get_logger
    from omni_actors.messages import ApiServersDrained, DrainApiServers

    log = get_logger(actor="leader")
    wait_s = drain_timeout_s + ABORT_GRACE_S + 1.0
    try:
        with asys.private() as ctx:
            answer = ctx.ask(_coordinator_now(ctx, coordinator), DrainApiServers(wait_s, drain_timeout_s, exclude),
                             wait_s + 2.0)
    except Exception as exc:  # noqa: BLE001 - stopping anyway
        answer = exc
    if isinstance(answer, ApiServersDrained):
        if answer.told:
            (log.warning if answer.late or answer.ended or answer.silent else log.info)(
                "api_servers_drained", api_servers=answer.told, late=answer.late, requests_ended=answer.ended,
                silent=answer.silent)
        if answer.silent:
            print(f"draining: {answer.silent} attached API server(s) stopped renewing their subscription "
                  "(frozen, or gone): not waited for", file=sys.stderr, flush=True)
    else:
        log.warning("api_servers_drain_unanswered", answer=repr(answer)[:200])


def _hurry_api_servers(asys, coordinator, drain_timeout_s: float) -> None:
    """(At a second stop signal) Have the coordinator tell the attached API servers still
    draining to end their requests now, as the leader's own server does (a trial's attached
    servers drained on for the whole ``drain_timeout_s``)."""
    from omni_actors.messages import DrainApiServers

    try:
        with asys.private() as ctx:
            ctx.tell(_coordinator_now(ctx, coordinator), DrainApiServers(0.0, drain_timeout_s, hurry=True))
    except Exception:  # noqa: BLE001 - stopping anyway
        pass


def _coordinator_now(ctx, first):
    """The coordinator running now (by its ``globalName``): the one the leader made at its start
    (``first``) may have been replaced (trial BV: after `inject kill-coordinator`, a stop asked
    the dead one to drain the attached API servers, got no answer, and cut their streams)."""
    from omni_actors.actors.coordinator import COORDINATOR_NAME, CoordinatorActor

    try:
        return ctx.createActor(CoordinatorActor, globalName=COORDINATOR_NAME)
    except Exception:  # noqa: BLE001 - the admin is going: the first one, as before
        return first


async def drain_http(runner, bridge, timeout_s: float, hurry: threading.Event | None = None,
                     gone: str = "", stopping: str = "", went=None) -> int:
    """Stop accepting connections and requests, then let requests in flight finish (up to ``timeout_s``,
    ``supervision.drain_timeout_s``, or until ``hurry`` is set: a second Ctrl-C or SIGTERM). Those
    still running then end with a 503 that says the server stopped, and their stages are
    cancelled, so that neither the HTTP server nor the engines wait on them any longer.

    ``gone`` (an attached API server whose system went away): why none of them can finish;
    they end at once with a 503 saying it, and nothing is sent to the gone system.

    ``stopping`` (an attached API server whose system stops): said in the 503 of the requests
    still running at the timeout; ``went`` (a callable) returns a ``gone`` text once the
    system went away during the drain. Returns how many requests were ended with a 503."""
    from omni_actors.http.app import refuse_new_requests
    from omni_actors.logs import get_logger

    refuse_new_requests(runner.app)  # (requests on connections still open: 503)
    for site in list(runner.sites):
        await site.stop()
    deadline = time.monotonic() + timeout_s
    in_flight = bridge.in_flight()
    log = get_logger(actor="api")
    log.info("stopping", requests_in_flight=in_flight)
    if in_flight and not gone and not stopping:  # (an attached server whose system stops has said it)
        log.info("draining", requests_in_flight=in_flight, timeout_s=timeout_s)
        print(f"draining: {in_flight} request(s) in flight get up to {timeout_s:g} s to finish "
              f"(supervision.drain_timeout_s; Ctrl-C again, or a `stop --timeout` running out, ends them "
              f"sooner)", file=sys.stderr, flush=True)  # (a trial's `stop --timeout 8` read "up to 10 s")
    while bridge.in_flight() and time.monotonic() < deadline and not (hurry and hurry.is_set()) and not gone:
        await asyncio.sleep(0.05)
        gone = went() if went is not None else ""
    if bridge.in_flight():
        hurried = hurry is not None and hurry.is_set()
        if gone:
            ended = bridge.abort_all(gone, cancel=False)
        else:
            ended = bridge.abort_all((stopping or "the server is shutting down") + ": " + (
                "stopped at once (a second Ctrl-C or SIGTERM, which `stop` also sends when its "
                "--timeout is about to run out) while the request ran" if hurried else
                f"the request was still running {timeout_s:g} s after the stop (supervision.drain_timeout_s)"))
        log.warning("drain_ended_requests", requests=ended,
                    why="system stopped or gone" if gone else "second stop signal" if hurried else "drain_timeout_s",
                    after_s=round(timeout_s - (deadline - time.monotonic()), 1), drain_timeout_s=timeout_s)
        deadline = time.monotonic() + ABORT_GRACE_S
        while bridge.in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return ended
    return 0
