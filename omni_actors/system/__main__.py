"""``python -m omni_actors.system <verb>``: start, stop, status, inject, stage, api, shell, check-config.

Errors print one line on stderr and exit non-zero (2 for bad arguments or
config, 1 for a system that cannot start or cannot be reached, and for a config
that ``check-config`` refuses).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import signal
import sys
import time
from typing import Callable

DEFAULT_ADMIN_PORT = 1900  # Thespian's own default admin port
DEFAULT_HTTP_PORT = 8000  # vLLM's default API port
#: `stop`: seconds beyond the system's drain for its processes to exit (three vLLM engine
#: cores took 5-9 s on 2 cores) before what is left is killed.
STOP_GRACE_S = 20.0
#: `stop`: this long before its timeout runs out (half the timeout, at most 10 s), a second
#: SIGTERM ends the requests still in flight at once, with a 503 or an SSE error event that
#: says why (the leader gives them 2 s to send it), rather than a SIGKILL cutting their
#: connections; the rest is the engines' shutdown (the synthetic demo's about 1 s,
#: vLLM-Omni's about 4 s on 2 cores: a trial's `--timeout 10` killed them, 4 s before).
HURRY_BEFORE_MAX_S = 10.0
#: `stop` on a terminal says what it waits for after this many seconds, then every STOP_PROGRESS_EVERY_S.
STOP_PROGRESS_AFTER_S = 1.0
STOP_PROGRESS_EVERY_S = 5.0
#: Longest `stop --timeout` taken (a day: a drain is minutes at most).
MAX_STOP_TIMEOUT_S = 86400.0
#: `stop` on a system whose state file predates drain_timeout_s in it: the config default.
DEFAULT_DRAIN_TIMEOUT_S = 10.0
#: `status` when the model is not ready, or the leader (its HTTP API) is not running: the
#: table is printed all the same (3: "not running", as `systemctl status` says it).
NOT_READY_EXIT = 3



def port_number(text: str) -> int:
    """A TCP port argument, 1-65535 (argparse turns the ValueError into a one-line error, exit 2)."""
    port = int(text)
    if not 1 <= port <= 65535:
        raise ValueError(text)
    return port


port_number.__name__ = "port (1-65535)"  # (argparse's error: "invalid port (1-65535) value: '99999'")

class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors in one line (``error: ...``, exit 2) as the CLI's own
    checks give them: a trial's `inject bogus` printed a five-line usage block before the error."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (`{self.prog} --help` for usage)\n")

    def parse_args(self, args=None, namespace=None):
        # (trial CE: `check-config bad.yaml` pointed at the top-level --help, not the verb's)
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            verb = getattr(parsed, "verb", None)
            prog = f"{self.prog} {verb}" if verb else self.prog
            self.exit(2, f"error: unrecognized arguments: {' '.join(extras)} (`{prog} --help` for usage)\n")
        return parsed


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m omni_actors.system",
                description="Serve multi-stage omni pipelines on an actor system.")
    sub = p.add_subparsers(dest="verb", required=True)

    start = sub.add_parser("start", help="start a host (the convention leader serves the API)")
    start.add_argument("--convention-leader", action="store_true",
                       help="start the leader: admin, coordinator, stage pools, engines, API server")
    start.add_argument("--convention-address", default=None, metavar="HOST:PORT",
                       help="join the leader's convention at HOST:PORT (its admin port) as a member host")
    start.add_argument("--devices", default="", help="device ids this host offers to replicas, e.g. 0,1,2,3 "
                       "(default: none, a CPU host: replicas are not pinned)")
    start.add_argument("--node-name", default=None,
                       help="this host's node name (default: the hostname; members: hostname-ADMINPORT)")
    start.add_argument("--stages", default="", help="member: only these stages, e.g. talker,code2wav (default any)")
    start.add_argument("--leader-wait", type=float, default=None, metavar="S",
                       help="member: how long to wait for a convention leader that does not answer yet "
                            "(default 60 s; 0: fail at once)")
    start.add_argument("--config", default=None,
                       help="pipeline + deployment YAML (default: configs/cpu_omni_demo.yaml)")
    start.add_argument("--skip-dry-run", action="store_true",
                       help="leader: do not run the dry-run request through the config's synthetic stages")
    start.add_argument("--host", default=None, help="leader: HTTP bind address (default 127.0.0.1)")
    start.add_argument("--port", type=port_number, default=None, help="leader: HTTP port (default 8000)")
    start.add_argument("--admin-port", type=port_number, default=None,
                       help="Thespian admin port (leader: default 1900; a member must give its own)")
    start.add_argument("--api-key", default=os.environ.get("OMNI_ACTORS_API_KEY"),
                       help="require this bearer key on the API (default $OMNI_ACTORS_API_KEY)")
    start.add_argument("--log-level", default=None, choices=("debug", "info", "warning", "error"),
                       help="default: $OMNI_ACTORS_LOG_LEVEL or info")
    start.add_argument("--shm-dir", default=None, metavar="DIR",
                       help="directory (a tmpfs) for this host's shared-memory segments, exported to every "
                            "process it starts as $OMNI_ACTORS_SHM_DIR (default: that variable, else /dev/shm); "
                            "a tmpfs mounted with huge=within_size is faster where /dev/shm has no huge pages")

    def admin_port(sp, remote: bool = False):
        sp.add_argument("--admin-port", type=port_number, default=DEFAULT_ADMIN_PORT,
                        help="admin port of the system on this host (default 1900)")
        if remote:
            sp.add_argument("--convention-address", default=None, metavar="HOST:PORT",
                            help="reach the system through its convention leader's admin at HOST:PORT, "
                                 "from any host, instead of a local --admin-port")

    sp = sub.add_parser("stop", help="stop the system (leader) or member host started on an admin port",
                        description="Stop the leader or member host started on this host with that admin "
                        "port (found in $OMNI_ACTORS_STATE_DIR or ~/.omni-actors), as Ctrl-C does: a leader "
                        "drains its requests in flight, then stops every process of the system on this host; "
                        "a member drains its replicas (replaced on other nodes) and leaves the convention. A "
                        "second SIGTERM goes when --timeout is about to run out, SIGKILL at the end. Exit "
                        "status 0 once stopped; 1 when nothing is recorded on that port.")
    admin_port(sp)
    sp.add_argument("--timeout", type=float, default=None,
                    help="seconds to wait before killing what is left (default: the system's "
                         f"supervision.drain_timeout_s + {STOP_GRACE_S:g}, for its processes to exit)")
    sp = sub.add_parser("status", help="print the stage table of a running system; exit status 0 when its "
                        f"model is ready, {NOT_READY_EXIT} when not (or its leader is not running), 1 when "
                        "nothing answers at its admin port",
                        description="Print the stage table of a running system. Exit status: 0 ready and "
                        f"serving; {NOT_READY_EXIT} the system answers but is not ready (replicas starting, a "
                        "stage without a ready replica), not serving (its leader process is gone) or "
                        "stopping; 1 nothing answers at the admin port (no system there, or not an "
                        "omni-actors admin).")
    admin_port(sp, remote=True)
    sp.add_argument("--json", action="store_true", help="print JSON instead of a table")

    from omni_actors.system.admin import FAULTS
    sp = sub.add_parser("inject", help="inject a fault (for fault-injection tests)")
    admin_port(sp)
    sp.add_argument("fault", choices=FAULTS)
    sp.add_argument("--replica", default="", help="target replica, STAGE/N")
    sp.add_argument("--stage", default="", help="target stage (kill-pool)")
    sp.add_argument("--factor", type=float, default=None, help="slow-down factor for `slow` (default 5)")
    sp.add_argument("--count", type=int, default=None, help="for `raise`: how many next tasks raise (default 1)")
    sp.add_argument("--json", action="store_true", help="print what was done as JSON")

    sp = sub.add_parser("api", help="serve one more API server, attached to a running system on this host "
                        "(--admin-port) or on any host (--convention-address)")
    admin_port(sp)
    sp.add_argument("--host", default="127.0.0.1", help="HTTP bind address (default 127.0.0.1)")
    sp.add_argument("--port", type=port_number, required=True, help="HTTP port")
    sp.add_argument("--api-key", default=os.environ.get("OMNI_ACTORS_API_KEY"),
                    help="require this bearer key on the API (default $OMNI_ACTORS_API_KEY)")
    sp.add_argument("--request-actors", type=int, default=None,
                    help="the most RequestActors (processes) this API server keeps; requests above "
                         "wait in a queue, 429 when it is full (default: the deployment's request_actors)")
    sp.add_argument("--convention-address", default=None, metavar="HOST:PORT",
                    help="the convention leader's admin address, to serve from another host (starts no admin "
                         "here; instead of --admin-port)")
    sp.add_argument("--log-level", default=None, choices=("debug", "info", "warning", "error"),
                    help="default: $OMNI_ACTORS_LOG_LEVEL or info")

    sp = sub.add_parser("shell", help="interactive admin shell (nodes, stages, replicas, scale, drain, ...)")
    admin_port(sp, remote=True)
    sp.add_argument("-c", "--command", action="append", default=[], metavar="LINE",
                    help="run this shell command and exit (repeatable) instead of the interactive loop")

    stage = sub.add_parser("stage", help="act on one stage at runtime").add_subparsers(dest="action", required=True)
    sp = stage.add_parser("drain", help="finish replicas' work, then stop them")
    admin_port(sp, remote=True)
    sp.add_argument("--replica", required=True, action="append", help="STAGE/N (repeatable)")
    sp = stage.add_parser("scale", help="run N replicas of a stage")
    admin_port(sp, remote=True)
    sp.add_argument("--stage", required=True)
    sp.add_argument("--replicas", type=int, required=True)
    sp = stage.add_parser("launch", help="add N replicas to a stage (placed where devices are free, "
                          "or on the --node / --devices you name)")
    admin_port(sp, remote=True)
    sp.add_argument("--stage", required=True)
    sp.add_argument("--replicas", type=int, default=None,
                    help="how many (default 1; with --devices: one per devices_per_replica of them)")
    sp.add_argument("--devices", default="", metavar="IDS",
                    help="exactly these device ids, e.g. 2,3, split devices_per_replica per replica, all on one "
                         "node; the replicas stay pinned to them (restarts included)")
    sp.add_argument("--node", default="", help="only on this node (its --node-name)")
    sp = stage.add_parser("stop", help="drain and stop every replica of a stage")
    admin_port(sp, remote=True)
    sp.add_argument("--stage", required=True)
    node = sub.add_parser("node", help="act on one node (host) at runtime").add_subparsers(dest="action",
                                                                                          required=True)
    sp = node.add_parser("drain", help="move every replica off a node (each finishes its work; a replacement "
                         "starts where there is room) and place nothing new there, its member running on")
    admin_port(sp, remote=True)
    sp.add_argument("--node", required=True, help="the node's name (status: nodes)")
    sp = node.add_parser("undrain", help="let a drained node take new replicas again")
    admin_port(sp, remote=True)
    sp.add_argument("--node", required=True, help="the node's name (status: nodes)")

    sp = sub.add_parser("check-config", help="load and validate a config (processor imports included) and "
                        "say what it serves; starts nothing")
    sp.add_argument("--config", default=None,
                    help="pipeline + deployment YAML (default: configs/cpu_omni_demo.yaml)")
    sp.add_argument("--skip-dry-run", action="store_true",
                    help="do not run the dry-run request through the config's synthetic stages")
    return p


def _fail(message: str, code: int = 1) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def _api_key_problem(key: str | None) -> str | None:
    """Why ``--api-key`` (or ``$OMNI_ACTORS_API_KEY``) cannot be used, or None. An empty
    one is refused: it served every client, unnoticed (a ``--api-key "$KEY"`` with KEY unset)."""
    if key is None:
        return None
    if not key.strip():
        return ("--api-key is empty (or $OMNI_ACTORS_API_KEY is set to an empty string): give the key "
                "clients must send, or set neither to serve every client")
    if any(c.isspace() for c in key):
        return "--api-key has white space in it: a client's `Authorization: Bearer KEY` never matches it"
    return None


def _note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr, flush=True)


def _dry_run(config, skip: bool):
    """The dry run's problem with ``config`` (a :class:`ConfigError`) or None; with ``skip``
    (``--skip-dry-run``) none is run and a note says so (a trial: a skipped one was silent)."""
    from omni_actors.config_dry_run import dry_run_problem

    if skip:
        _note("--skip-dry-run: the synthetic stages and their processors were not tried on a request first "
              "(one that fails shows on the first requests)")
        return None
    return dry_run_problem(config, _note)


def cmd_start(args) -> int:
    from omni_actors.config import DEFAULT_CONFIG, ConfigError, load_config
    from omni_actors.logs import configure_logging
    from omni_actors.system.leader import StartError, run_leader

    devices = args.devices  # checked by main()
    if args.convention_leader == bool(args.convention_address):
        return _fail("give exactly one of --convention-leader or --convention-address HOST:PORT", 2)
    problem = _use_shm_dir(args.shm_dir)
    if problem:
        return _fail(problem, 2)
    if args.convention_address:
        return _start_member(args, devices)
    problem = _api_key_problem(args.api_key)
    if problem:
        return _fail(problem, 2)
    if args.admin_port is None:
        args.admin_port = DEFAULT_ADMIN_PORT
    problem = _state_dir_problem()
    if problem:
        return _fail(problem, 2)
    if args.port == args.admin_port:  # (an argument error, as the ranges are: exit 2)
        return _fail(f"--port and --admin-port must differ (both {args.port})", 2)
    # The config loads once, after the re-exec and with logging set up, so that its
    # warnings (a misspelt stage key) are logged once, as JSON lines like every event,
    # and printed as plain lines too (a trial missed them among the JSON lines).
    _ensure_system_id()
    configure_logging(args.log_level)

    def warn(text: str) -> None:
        from omni_actors.logs import get_logger

        print(f"warning: {text}", file=sys.stderr, flush=True)
        get_logger().warning("config_unknown_key", message=text)

    try:
        config = load_config(args.config or DEFAULT_CONFIG, on_warning=warn)
    except ConfigError as exc:
        return _fail(str(exc), 2)
    problem = _dry_run(config, args.skip_dry_run)  # (trial CE: a stage no request passed)
    if problem:
        return _fail(str(problem), 2)
    pinned = [s.name for s in config.stage_args if s.runtime.devices is not None]
    if devices and pinned:  # (trial BT: its `runtime.devices` were silently not used)
        print(f"note: runtime.devices of {', '.join(pinned)} not used on hosts started with --devices: placement "
              "gives each replica there devices of its own (`stage launch --devices` pins a replica)",
              file=sys.stderr, flush=True)
    try:
        return run_leader(config, host=args.host, port=args.port, admin_port=args.admin_port,
                          api_key=args.api_key, node=args.node_name or "", devices=devices)
    except StartError as exc:
        return _fail(str(exc))


def _start_member(args, devices: tuple[str, ...]) -> int:
    from omni_actors.logs import configure_logging
    from omni_actors.system.leader import StartError
    from omni_actors.system.member import LEADER_WAIT_S, MAX_LEADER_WAIT_S, default_node_name, run_member

    try:
        host, port = _convention(args.convention_address)
    except ValueError as exc:
        return _fail(str(exc), 2)
    if args.admin_port is None:
        return _fail("a member needs its own --admin-port (its Thespian admin on this host; not the "
                     "leader's)", 2)
    problem = _state_dir_problem()  # (a member's unusable one was a traceback: a code review)
    if problem:
        return _fail(problem, 2)
    leader_wait = LEADER_WAIT_S if args.leader_wait is None else args.leader_wait
    if not 0 <= leader_wait <= MAX_LEADER_WAIT_S:  # (also refuses nan)
        return _fail(f"--leader-wait must be from 0 to {MAX_LEADER_WAIT_S:g} s, got {args.leader_wait:g}", 2)
    _ensure_system_id()
    configure_logging(args.log_level)
    stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
    try:
        return run_member((host, int(port)), admin_port=args.admin_port,
                          node=args.node_name or default_node_name(args.admin_port), devices=devices, stages=stages,
                          leader_wait_s=leader_wait)
    except StartError as exc:
        return _fail(str(exc))


def _state_dir_problem() -> str | None:
    """Why a leader or member could not record itself in its state directory (``stop`` and
    ``status`` find it there), or None; checked before anything starts."""
    from omni_actors.system.leader import state_dir

    path = state_dir()
    probe = path / f".probe-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        # (trial CE: a path that is a file read "File exists": mkdir's own words)
        # (os.path.exists, not Path.exists: that raised EACCES under an unreadable parent)
        why = "it is not a directory" if os.path.exists(path) and not os.path.isdir(path) else exc.strerror or exc
        return (f"state directory {str(path)!r} ($OMNI_ACTORS_STATE_DIR, default ~/.omni-actors) is not usable: "
                f"{why}")
    return None


def _use_shm_dir(shm_dir: str | None) -> str | None:
    """Validate the segment directory (``--shm-dir``, else ``$OMNI_ACTORS_SHM_DIR``, else
    ``/dev/shm``) and export it, so that every process this host starts uses it.
    Returns what is wrong, or None."""
    from omni_actors.connectors.shm import DIR_ENV, SegmentDirError, check_segment_dir

    if shm_dir is not None:
        shm_dir = os.path.abspath(shm_dir) if shm_dir else shm_dir
        os.environ[DIR_ENV] = shm_dir
    try:
        check_segment_dir(shm_dir)
    except SegmentDirError as exc:
        return str(exc)
    return None


def _host_port(text: str) -> tuple[str, int] | None:
    """``"HOST:PORT"`` -> ``(HOST, PORT)``, or None when it is not that."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        return None
    return host, int(port)


def _convention(text: str) -> tuple[str, int]:
    """``--convention-address``: ``(HOST, PORT)`` with HOST resolvable.

    Raises:
        ValueError: not HOST:PORT, or HOST does not resolve (the message is the CLI's one line).
    """
    convention = _host_port(text)
    if convention is None:
        raise ValueError(f"--convention-address must be HOST:PORT, got {text!r}")
    try:
        socket.getaddrinfo(convention[0], convention[1], type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(f"--convention-address {text!r}: cannot resolve {convention[0]!r} "
                         f"({exc.strerror or exc})") from None
    try:  # (Thespian's TCP transport is IPv4 only: `::1:1900` was a traceback, a code review)
        socket.getaddrinfo(convention[0], convention[1], socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        raise ValueError(f"--convention-address {text!r}: {convention[0]!r} has no IPv4 address (Thespian's "
                         "transport is IPv4 only)") from None
    return convention


def _ensure_system_id() -> None:
    """Re-exec once with a fresh ``OMNI_ACTORS_SYSTEM_ID`` in the environment.

    ``/proc/<pid>/environ`` shows the environment a process was exec'd with,
    not later changes, so the marker that names this system's processes must be
    there at exec time; every admin and actor forked later inherits it.
    """
    import uuid

    from omni_actors.system.processes import ENV_SYSTEM_ID

    if os.environ.get(ENV_SYSTEM_ID):
        return
    env = {**os.environ, ENV_SYSTEM_ID: uuid.uuid4().hex,
           # Thespian's convention timers (read at import, "M:S"): a member that stops
           # re-registering is dropped in seconds, not its default minutes. Our own node
           # heartbeats detect a lost host faster still.
           "CONVENTION_REREGISTRATION_PERIOD": os.environ.get("CONVENTION_REREGISTRATION_PERIOD", "0:05"),
           "CONVENTION_RESTART_PERIOD": os.environ.get("CONVENTION_RESTART_PERIOD", "0:05")}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, list(sys.orig_argv), env)


def _read_state(admin_port: int, member: bool = False) -> dict | None:
    """What the leader (or with ``member``, the member host) on ``admin_port`` recorded
    about itself (see ``leader.state_file``, ``leader.member_state_file``); None if nothing."""
    from omni_actors.system.leader import member_state_file, state_file

    try:
        return json.loads((member_state_file if member else state_file)(admin_port).read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs. A zombie (exited, not yet reaped by its parent, as
    a leader started by a supervisor or a test) does not: ``stop`` waited out its whole
    timeout, then SIGKILLed the zombie, for a leader that had stopped in 0.2 s."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):  # (no /proc: as before)
        return True


#: Key of a leader's or member's state file: when (Unix time) `stop` asked it to stop.
STOP_ASKED = "stop_asked_at"


def _stop_lock(sfile) -> list[int]:
    """The state directory's ``.stop.lock`` (``leader.hold_lock``), waited for: held by a
    `stop` from its read of the state file until its signal is recorded there
    (:func:`_unlock`); ``[fd]``, or ``[]`` where it cannot be opened (as before: unlocked)."""
    from omni_actors.system.leader import hold_lock

    fd = hold_lock(sfile.parent / ".stop.lock")
    return [] if fd is None else [fd]


def _unlock(held: list[int]) -> None:
    """Release a :func:`_stop_lock` (the first call only: its descriptor is closed once)."""
    while held:
        with contextlib.suppress(OSError):
            os.close(held.pop())  # (closing it releases the lock)


def cmd_stop(args) -> int:
    from omni_actors.connectors import sweep_segments
    from omni_actors.system.leader import member_state_file, other_leaders_hint, state_dir, state_file, update_state
    from omni_actors.system.processes import cli, kill_system

    if args.timeout is not None and not 0 <= args.timeout <= MAX_STOP_TIMEOUT_S:  # (also refuses nan)
        return _fail(f"--timeout must be from 0 to {MAX_STOP_TIMEOUT_S:g} s, got {args.timeout:g}", 2)
    state, sfile = _read_state(args.admin_port), state_file(args.admin_port)
    if state is None:
        state, sfile = _read_state(args.admin_port, member=True), member_state_file(args.admin_port)
    if state is None:
        return _fail(f"no omni-actors system recorded on admin port {args.admin_port} in {state_dir()}"
                     + ("; something listens there: a leader or member that records itself elsewhere (started "
                        "with another OMNI_ACTORS_STATE_DIR or HOME: set the same one here; a member started "
                        "before members were recorded: stop it with Ctrl-C or SIGTERM to its process) or "
                        "another program" if _listening(args.admin_port) else "")
                     + "; `stop` stops a leader or member started on this host" + other_leaders_hint(args.admin_port))
    pid = state["pid"]
    from omni_actors.system.watchdog import boot_id, recorded_process_runs

    other_boot = bool(state.get("boot_id")) and state["boot_id"] != boot_id()
    if other_boot or (_alive(pid) and not recorded_process_runs(state)):
        # A record of a system gone, whose pid names another process now (a reboot; a leader and
        # its watchdog killed together): that process is not signalled, nor the sessions it
        # recorded (others' now); a process of the system still here goes by its system id
        # (a code review: `stop` would have SIGTERMed, then SIGKILLed, whoever had the pid).
        sfile.unlink(missing_ok=True)
        killed = 0 if other_boot else kill_system(state["system_id"])
        why = ("it ran before this host last booted" if other_boot else
               f"its {state.get('role', 'leader')} process {pid} has exited, and the pid is another process's now")
        return _fail(f"no omni-actors system runs on admin port {args.admin_port}: the one recorded in "
                     f"{state_dir()} is gone ({why}); its record is removed"
                     + (f" ({killed} leftover processes of it killed)" if killed else ""))
    # (a member drains its replicas for as long as the leader's drain_timeout_s: it records the
    # one it read when it joined; the default's if the leader did not answer then)
    timeout = args.timeout if args.timeout is not None else \
        float(state.get("drain_timeout_s", DEFAULT_DRAIN_TIMEOUT_S)) + STOP_GRACE_S
    whose = "member" if state.get("role") == "member" else "leader"
    # (trial BR: a second `stop` while the first waited was the second SIGTERM, which ends the
    # requests in flight at once, and the member said "second Ctrl-C"; it now waits for that stop.
    # From this read to the record of its signal one `stop` at a time: two started together both
    # read no stop and both signalled, a review)
    stop_lock = _stop_lock(sfile)
    with contextlib.suppress(OSError, ValueError):
        state = {**state, **json.loads(sfile.read_text())}
    asked = state.get(STOP_ASKED) if isinstance(state.get(STOP_ASKED), (int, float)) else None
    already = asked is not None or bool(state.get("stopping"))
    if already:
        since = f" {max(0.0, time.time() - asked):.0f} s ago" if asked is not None else ""
        print(f"the {whose} on admin port {args.admin_port} is stopping already (asked{since}): waiting for "
              f"it, at most {timeout:g} s (a second SIGTERM would end its requests in flight at once)",
              file=sys.stderr, flush=True)
    if state.get("role") == "member":  # (it says how its drain went, for us: see member.drain_record)
        from omni_actors.system.member import STOP_WAITS

        update_state(sfile, **{STOP_WAITS: True})  # (before the signal: the member reads it as it leaves)

    def note_asked() -> None:  # (once its SIGTERM went: a record of a stop never sent would hold the next back)
        update_state(sfile, **{STOP_ASKED: asked if asked is not None else time.time()})
        _unlock(stop_lock)
    try:
        forced, hurried_after = _terminate(pid, timeout, progress=(
            f"stopping the {'member' if whose == 'member' else 'system'} on admin port {args.admin_port}: its "
            f"{whose} (pid {pid}) drains its requests in flight and stops its replicas (at most {timeout:g} s)"),
            asked=already, signalled=note_asked)
    except PermissionError:  # (a traceback; a code review)
        return _fail(f"not allowed to stop the {whose} on admin port {args.admin_port} (pid {pid}): it runs as "
                     "another user; run `stop` as that user (or root)")
    except KeyboardInterrupt:  # (Ctrl-C while it waited: a traceback, a code review)
        if state.get("role") == "member" and not already:  # (its drain record would be left to nobody)
            from omni_actors.system.member import STOP_WAITS, drain_record

            update_state(sfile, **{STOP_WAITS: False})
            drain_record(args.admin_port).unlink(missing_ok=True)
        print(f"interrupted: the stop goes on without this command (the {whose} on admin port {args.admin_port}, "
              f"pid {pid}, drains and exits by itself; `{cli('stop')} --admin-port {args.admin_port}` waits for "
              "it again)", file=sys.stderr, flush=True)
        return INTERRUPTED_EXIT
    finally:
        _unlock(stop_lock)  # (where it was not signalled: gone meanwhile, or not ours to signal)
    killed = kill_system(state["system_id"], sessions=state.get("sessions", ()))
    sweep_segments(f"oa-{args.admin_port}-", state.get("shm_dir"))
    sfile.unlink(missing_ok=True)
    what = "the member" if state.get("role") == "member" else "its leader"
    warnings: list[str] = []  # (a member's: the stages it left with no replica running)
    if state.get("role") == "member":
        from omni_actors.system.member import drain_record

        record = drain_record(args.admin_port)
        try:
            said = json.loads(record.read_text())
            if not already:  # (left for the stop that asked first, which removes it)
                record.unlink()
            drained, warnings = said["drained"] is True, [str(w) for w in said.get("warnings", ())]
            undrained = "; ".join(str(w) for w in said.get("undrained", ()))
        except (OSError, ValueError, TypeError, KeyError):
            drained, warnings, undrained = False, [], ""
            # (a review: a second `stop` read "did not all drain" when the first had taken the record)
            said = None if already else {}
        # (trial AY: "it left the convention at ..." of a member whose leader was gone, which said
        # itself "leaving without a drain: no convention leader answers at ...")
        without = "leaving without a drain: "
        how = (f"it had not joined the convention at {state.get('convention')}: it was waiting for its leader"
               if state.get("waiting") else
               "it left without a drain: " + undrained[len(without):] if undrained.startswith(without) else
               f"it left the convention at {state.get('convention')}; the stop under way says how its drain went"
               if said is None else
               f"it left the convention at {state.get('convention')}; " + (
                   "its replicas drained first" if drained else "its replicas did not all drain first: "
                   + (undrained or "see its output")))
        print(f"stopped member {state.get('node')!r} on admin port {args.admin_port} ({how})", end="")
    else:
        print(f"stopped the system on admin port {args.admin_port}", end="")
    # (trial AV: "still draining ... told to end the requests still running" of a leader with no
    # request, still stopping its 1,000 replicas)
    print((f" ({what} had not exited after {hurried_after:.1f} s of --timeout {timeout:g}, draining its requests "
           "or stopping its replicas: told to hurry, which ends the requests still running, if any; the "
           "`drain_ended_requests` log line says how many)"
           if hurried_after is not None else "")
          + (f" ({what} did not exit within {timeout:g} s: killed)" if forced else "")
          + (f" ({killed} leftover processes killed)" if killed else ""))
    for line in warnings:
        print(f"warning: {line}", file=sys.stderr)
    return 0


def _terminate(pid: int, timeout: float, progress: str = "", asked: bool = False,
               signalled: Callable[[], None] | None = None) -> tuple[bool, float | None]:
    """SIGTERM ``pid`` (a leader or member: it drains, then exits; not when ``asked``, its stop
    under way already), call ``signalled`` (even when ``asked``), and wait for it, at most
    ``timeout`` seconds; a second SIGTERM (no more drain) when the wait is about to run out;
    SIGKILL at the end. Returns ``(killed, seconds after which the second SIGTERM went, or None)``.

    On a terminal (stderr), a wait longer than :data:`STOP_PROGRESS_AFTER_S` says ``progress``,
    then how long it has waited every :data:`STOP_PROGRESS_EVERY_S` (trial BI: `stop` of a
    leader draining a long stream said nothing for 8 s)."""
    hurried_after = None
    if _alive(pid):
        if not asked:
            os.kill(pid, signal.SIGTERM)
        if signalled is not None:
            signalled()
        _resume(pid)  # (a stopped leader gets its SIGTERM only once resumed: it was killed undrained)
        started = time.monotonic()
        deadline = started + timeout
        hurry_at = deadline - min(HURRY_BEFORE_MAX_S, timeout / 2)
        say_at = started + STOP_PROGRESS_AFTER_S if progress and sys.stderr.isatty() else None
        said = False
        while _alive(pid) and time.monotonic() < deadline:
            now = time.monotonic()
            if say_at is not None and now >= say_at:
                print(f"still stopping after {now - started:.0f} s ..." if said else f"{progress} ...",
                      file=sys.stderr, flush=True)
                said, say_at = True, now + STOP_PROGRESS_EVERY_S
            if hurry_at is not None and time.monotonic() >= hurry_at:
                os.kill(pid, signal.SIGTERM)  # a second one: no more drain
                _resume(pid)
                hurried_after = timeout - (deadline - time.monotonic())
                hurry_at = None
            time.sleep(0.1)
    forced = _alive(pid)
    if forced:
        os.kill(pid, signal.SIGKILL)
    return forced, hurried_after


def _resume(pid: int) -> None:
    """SIGCONT ``pid`` (a leader SIGSTOPped, by hand or a debugger, takes no signal before it)."""
    try:
        os.kill(pid, signal.SIGCONT)
    except OSError:
        pass


def _listening(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on ``host:port`` (default: this host's loopback)."""
    import socket

    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _attach(args):
    """The admin named by ``--convention-address`` (any host) or ``--admin-port`` (this host).

    Raises:
        AdminError: nothing answers there.
        ValueError: a malformed --convention-address.
    """
    from omni_actors.system.admin import attach

    address = getattr(args, "convention_address", None)
    if address is not None:
        from omni_actors.system.remote import attach_remote

        return attach_remote(*_convention(address))
    return attach(args.admin_port)


def _admin_verb(fn):
    """Run ``fn(admin, args)`` against the attached admin; AdminError -> one line, exit 1."""
    def run(args) -> int:
        from omni_actors.system.admin import AdminError

        try:
            return fn(_attach(args), args)
        except ValueError as exc:
            return _fail(str(exc), 2)
        except AdminError as exc:
            if fn.__name__ == "cmd_status" and args.json:  # (a script reading it gets JSON either way)
                print(json.dumps({"serving": False, "reachable": False, "error": str(exc)}, indent=2))
            return _fail(str(exc))
    return run


@_admin_verb
def cmd_status(admin, args) -> int:
    from omni_actors.http.bridge import status_to_dict
    from omni_actors.system.admin import leader_api
    from omni_actors.system.leader import print_status_table
    from omni_actors.system.processes import cli

    status = admin.status()
    # (the leader's record: through a member's admin on this host, the leader's port's, a code
    # review: it said ready, exit 0, with the leader gone)
    port = admin.leader_port or args.admin_port
    api = None if getattr(args, "convention_address", None) and not admin.leader_port else leader_api(port)
    api_down, frozen = api is not None and api.down, api is not None and api.frozen
    if frozen:
        print(f"warning: the leader (pid {api.state['pid']}) is stopped (SIGSTOP, or a debugger), so its HTTP API "
              f"answers nothing until it is resumed (`kill -CONT {api.state['pid']}`)", file=sys.stderr)
    if api_down:
        print(f"warning: the leader (pid {api.state['pid']}) is not running, so the HTTP API is down; "
              f"`{cli('stop')} --admin-port {port}` cleans up",
              file=sys.stderr)
    stopping = api is not None and api.stopping
    serving = status.ready and not api_down and not frozen and not (api is not None and api.closed)
    if args.json:
        doc = status_to_dict(status)
        doc["serving"] = serving  # (as the exit status: 0 when true)
        if api is not None and api.state.get("port"):
            doc["api"] = {"url": api.url,
                          "state": ("down" if api_down else "frozen" if frozen else "stopping" if stopping
                                    else "starting" if api.closed else "up")}
        print(json.dumps(doc, indent=2))
    elif api_down and not status.stages:  # (its coordinator is gone too: as while its watchdog is at work)
        from omni_actors.system.watchdog import is_watchdog

        watched = bool(api.state.get("watchdog_pid")) and is_watchdog(api.state["watchdog_pid"])
        print(f"NOT SERVING: the leader (pid {api.state['pid']}) is not running and neither is its coordinator; "
              + ("its watchdog stops what is left within seconds" if watched else
                 f"`{cli('stop')} --admin-port {port}` stops what is left"))
    else:
        print_status_table(status, api_down=api_down, stopping=stopping, frozen=frozen)
        if api is not None and api.closed and not stopping:
            print(f"the HTTP API ({api.url}) is not up yet: the leader opens it "
                  f"once every replica is ready or has failed")
    return 0 if serving else NOT_READY_EXIT


@_admin_verb
def cmd_inject(admin, args) -> int:
    from omni_actors.system.admin import inject_reply

    done = admin.inject(args.fault, replica=args.replica, stage=args.stage, factor=args.factor,
                        count=args.count)
    print(json.dumps(done) if args.json else inject_reply(done))
    return 0


@_admin_verb
def cmd_stage(admin, args) -> int:
    """(Replica counts were checked by main, before attaching: :func:`_usage_problem`.)"""
    if args.action == "drain":
        for replica in dict.fromkeys(args.replica):
            print(admin.drain(replica))
    elif args.action in ("scale", "launch"):
        before = admin.status()
        reply = (admin.scale(args.stage, args.replicas) if args.action == "scale" else
                 admin.launch(args.stage, args.replicas, node=args.node, devices=args.devices))
        print(reply)
        for line in admin.unplaced(args.stage, before, reply):
            print(f"warning: {line}", file=sys.stderr)
    else:
        print(admin.scale(args.stage, 0, why="stage stopped"))
    return 0


@_admin_verb
def cmd_node(admin, args) -> int:
    if args.action == "undrain":
        print(admin.undrain_node(args.node))
        return 0
    before = admin.status()
    print(admin.drain_node(args.node, operator=True))
    for line in admin.left_without_replicas(args.node, before):
        print(f"warning: {line}", file=sys.stderr)
    return 0


def cmd_api(args) -> int:
    from omni_actors.logs import configure_logging
    from omni_actors.system.api_server import ApiServerError, run_api

    problem = _api_key_problem(args.api_key)
    if problem:
        return _fail(problem, 2)

    convention = None
    if args.convention_address is not None:
        try:
            convention = _convention(args.convention_address)
        except ValueError as exc:
            return _fail(str(exc), 2)
        if args.admin_port != DEFAULT_ADMIN_PORT:
            return _fail("give --convention-address HOST:PORT or --admin-port, not both", 2)
    from omni_actors.config import MAX_REPLICAS

    if args.request_actors is not None and not 1 <= args.request_actors <= MAX_REPLICAS:
        return _fail(f"--request-actors must be from 1 to {MAX_REPLICAS} (each is a process), "
                     f"got {args.request_actors}", 2)
    configure_logging(args.log_level)
    try:
        return run_api(host=args.host, port=args.port, admin_port=args.admin_port, convention=convention,
                       api_key=args.api_key, request_actors=args.request_actors)
    except ApiServerError as exc:
        return _fail(str(exc))


def cmd_shell(args) -> int:
    from omni_actors.system.shell import run_shell

    from omni_actors.system.admin import AdminError

    try:
        admin = _attach(args)
    except ValueError as exc:
        return _fail(str(exc), 2)
    except AdminError as exc:
        return _fail(str(exc))
    return run_shell(args.admin_port, commands=args.command, admin=admin,
                     remote=bool(args.convention_address))


def _missing_model_dirs(config) -> list[str]:
    """One line per real-engine stage whose model is a local path (``/``, ``.``, ``~``) with no
    directory there on this host: its replicas fail to start on such a host (a warning, not an
    error: the config may be checked on another host than the ones that run it). Trial BC's
    `check-config` said ok to a Thinker model that did not exist; `start` failed its replica."""
    from omni_actors.engines.base import missing_model_dir

    out = []
    for i, s in enumerate(config.stage_args):
        model = s.engine_args.get("model")
        if config.deployment_of(s).backend in ("vllm", "vllm_omni") and isinstance(model, str) \
                and missing_model_dir(model):
            out.append(f"{config.source}: stage_args[{i}].engine_args.model: no directory {model} on this host: "
                       f"stage {s.name}'s replicas fail to start on a host without it")
    return out


def cmd_check_config(args) -> int:
    """Load and validate a config as ``start`` would (processor imports included, and the
    dry run of its synthetic stages: :mod:`omni_actors.config_dry_run`):
    ``ok: N stages (NAME xREPLICAS, ...)`` and exit 0, or the one-line error and
    exit 1. Warnings (misspelt stage keys) and the config's notes go to stderr,
    one line each."""
    from omni_actors.config import DEFAULT_CONFIG, ConfigError, load_config
    from omni_actors.logs import configure_logging

    configure_logging("error")  # the config's own warnings are printed below, not logged
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # (vLLM-Omni's import logs to stdout)
    logging.getLogger("vllm").setLevel(logging.ERROR)  # (its import warns about Triton on CPUs, before
    # its own logging is set up: our one line stays the only one)
    try:
        config = load_config(args.config or DEFAULT_CONFIG,
                             on_warning=lambda text: print(f"warning: {text}", file=sys.stderr))
    except ConfigError as exc:
        return _fail(str(exc))
    # (the connector names before the notes, which call them applied)
    problem = _dry_run(config, args.skip_dry_run) or _check_omni_connector_names(config)
    if problem:
        return _fail(problem)
    for note in config.omni_connectors.notes:
        print(f"note: {note}", file=sys.stderr)
    problem = _check_vllm_sampling_defaults(config) or _check_vllm_engine_args(config)
    if problem:
        return _fail(problem)
    for line in _missing_model_dirs(config):
        print(f"warning: {line}", file=sys.stderr)
    stages = ", ".join(f"{s.name} x{config.deployment_of(s).replicas}" for s in config.stage_args)
    n = len(config.stage_args)
    print(f"ok: {n} stage{'' if n == 1 else 's'} ({stages})")
    return 0


def _check_vllm_sampling_defaults(config) -> str | None:
    """The vLLM stages' ``default_sampling_params``, by vLLM's own rules where it is
    installed (a replica would fail its start on them); a note on stderr where it is
    not. Returns the first problem as ``"<config>: stage_args[i].default_sampling_params: ..."``."""
    from omni_actors.engines.vllm_omni import is_diffusion_stage

    stages = [(i, s) for i, s in enumerate(config.stage_args)
              if s.default_sampling_params and (config.deployment_of(s).backend == "vllm" or (
                  config.deployment_of(s).backend == "vllm_omni" and not is_diffusion_stage(s)))]
    if not stages:
        return None
    try:
        from omni_actors.engines.vllm import check_default_sampling_params
        for i, s in stages:
            try:
                check_default_sampling_params(s.default_sampling_params)
            except ValueError as exc:
                detail = str(exc).removeprefix("default_sampling_params: ")
                return f"{config.source}: stage_args[{i}].default_sampling_params: {detail}"
    except ImportError:
        names = ", ".join(s.name for _, s in stages)
        print(f"note: vLLM is not installed here: default_sampling_params of {names} not checked "
              "(a replica checks them when it starts)", file=sys.stderr)
    return None


def _check_vllm_engine_args(config) -> str | None:
    """The vllm stages' ``engine_args`` keys against vLLM's ``AsyncEngineArgs`` where vLLM
    is installed (a replica refuses unknown ones when it starts: a trial's misspelt key
    passed check-config); a note where it is not, and for vllm_omni stages where vLLM-Omni
    is not. Returns the first problem as ``"<config>: stage_args[i].engine_args: ..."``."""
    import dataclasses
    import difflib

    from omni_actors.connectors import omni

    omni_stages = [s.name for s in config.stage_args if config.deployment_of(s).backend == "vllm_omni"]
    if omni_stages and not omni.available():
        print(f"note: vLLM-Omni is not installed here: the replicas of {', '.join(omni_stages)} "
              "(backend vllm_omni) cannot start in this environment", file=sys.stderr)
    stages = [(i, s) for i, s in enumerate(config.stage_args) if config.deployment_of(s).backend == "vllm"]
    if not stages:
        return None
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs

        from omni_actors.engines.vllm import split_engine_args
    except ImportError:
        print(f"note: vLLM is not installed here: engine_args of {', '.join(s.name for _, s in stages)} "
              "not checked against it (a replica checks them when it starts)", file=sys.stderr)
        return None
    accepted = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    for i, s in stages:
        unknown = split_engine_args(s.engine_args, accepted)[1]
        if unknown:
            near = difflib.get_close_matches(unknown[0], sorted(accepted), n=1)
            return (f"{config.source}: stage_args[{i}].engine_args: keys unknown to vLLM: {', '.join(unknown)}"
                    + (f" (did you mean `{near[0]}`?)" if near else ""))
    return None


def _check_omni_connector_names(config) -> str | None:
    """The vLLM-Omni connectors the config names, against those vLLM-Omni's factory has, where
    ``vllm_omni`` is installed (a misspelt one passed, noted as applied); the first unknown one as
    ``"<config>: connector `key`: vLLM-Omni has no connector ..."``, or None (nothing named, all
    known, or no vllm_omni)."""
    import difflib

    from omni_actors.connector_config import SHARED_MEMORY_CONNECTORS
    from omni_actors.connectors import omni

    named = {key: spec.get("name") for key, spec in config.omni_connectors.connectors.items()}
    named.update({f"edge {edge}": name for edge, name in config.omni_connectors.by_edge.items()
                  if name not in named.values()})
    if not named or not omni.available():
        return None
    try:
        from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory
    except Exception as exc:  # noqa: BLE001 - vllm_omni found but not importable here
        print(f"note: vLLM-Omni's connectors not checked: vllm_omni cannot be imported here ({exc})",
              file=sys.stderr)
        return None
    known = set(OmniConnectorFactory.list_registered_connectors()) | set(SHARED_MEMORY_CONNECTORS)
    for key, name in named.items():
        if name not in known:
            near = difflib.get_close_matches(str(name), sorted(known), n=1)
            return (f"{config.source}: connector `{key}`: vLLM-Omni has no connector `{name}`"
                    + (f" (did you mean `{near[0]}`?)" if near else "") + f"; it has: {', '.join(sorted(known))}")
    return None


def _usage_problem(args) -> str | None:
    """What is wrong with a verb's arguments that the system need not be asked about
    (a usage error: one line, exit 2, before any admin is reached), or None."""
    from omni_actors.system.admin import ENGINE_FAULTS, SIGNAL_FAULTS, inject_problem, replicas_problem

    if getattr(args, "config", None) is not None and not args.config.strip():
        # (a review: `--config "$CFG"` with CFG unset served the CPU demo, and check-config said ok)
        return "--config is empty: give the config file's path (or leave --config out for the CPU demo)"
    if args.verb == "inject":
        # (a trial's `inject stall --count 3` was taken, the count silently ignored)
        for flag, value, fault in (("--factor", args.factor, "slow"), ("--count", args.count, "raise")):
            if value is not None and args.fault != fault:
                return f"{flag} applies only to `{fault}`, not to `{args.fault}`"
        # (trial BF: `inject kill-coordinator --stage talker`, a kill-pool mistyped, killed the coordinator)
        takes = "--stage" if args.fault == "kill-pool" else None if args.fault == "kill-coordinator" else "--replica"
        for flag, value in (("--replica", args.replica), ("--stage", args.stage)):
            if value and flag != takes:
                return (f"{flag} does not apply to `{args.fault}`, which takes "
                        + (f"{takes} only" if takes else "no target (it kills the coordinator)"))
        if takes == "--replica" and args.replica and "/" not in args.replica:
            return f"--replica takes a replica, STAGE/N (such as {args.replica}/0), not {args.replica!r}"
        args.factor = 5.0 if args.factor is None else args.factor
        args.count = 1 if args.count is None else args.count
        if args.fault == "kill-pool" and not args.stage:
            return "kill-pool needs --stage STAGE"
        if (args.fault in SIGNAL_FAULTS or args.fault in ENGINE_FAULTS) and not args.replica:
            return f"{args.fault} needs --replica STAGE/N"
        problem = inject_problem(args.fault, replica=args.replica, stage=args.stage, factor=args.factor,
                                 count=args.count)
        return problem and f"--{'factor' if args.fault == 'slow' else 'count'}: {problem}"
    if args.verb == "stage" and args.action in ("scale", "launch") and args.replicas is not None:
        problem = replicas_problem(args.replicas, 0 if args.action == "scale" else 1)
        return problem and f"--replicas: {problem}"
    if args.verb == "start":
        return _start_flags_problem(args)
    return None


def _start_flags_problem(args) -> str | None:
    """``start``: flags given to the other kind of host (a trial's member took ``--host
    192.0.2.7`` and said nothing: a member serves no HTTP); fills in the leader's HTTP defaults."""
    from omni_actors.system.processes import cli

    if args.convention_address:
        given = [flag for flag, value in (("--host", args.host), ("--port", args.port), ("--config", args.config),
                                          ("--skip-dry-run", args.skip_dry_run or None))
                 if value is not None]
        if given:
            return (f"{', '.join(given)}: a member host takes no {' or '.join(given)} (the leader serves the HTTP "
                    f"API and holds the config); for an API server on this host run `{cli('api')} "
                    f"--convention-address {args.convention_address} --port P [--host H]`")
        if args.stages and not any(s.strip() for s in args.stages.split(",")):
            # (trial CE: `--stages ','` was taken as "any stage")
            return (f"--stages {args.stages!r} names no stage: give stage names (talker,code2wav), "
                    "or leave it out for any")
        return None
    given = [flag for flag, value in (("--stages", args.stages or None), ("--leader-wait", args.leader_wait))
             if value is not None]
    if args.convention_leader and given:
        return f"{', '.join(given)}: only a member host (--convention-address HOST:PORT) takes {' or '.join(given)}"
    args.host = "127.0.0.1" if args.host is None else args.host
    args.port = DEFAULT_HTTP_PORT if args.port is None else args.port
    return None


def _repeated_flag(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """A flag that takes one value given twice (or as two spellings of it: argparse takes
    unique prefixes), where argparse keeps the last silently (trial CE: `check-config
    --config A --config B` checked B alone); what to say, or None. Flags that collect
    every value (``append``: the shell's ``-c``, ``stage drain --replica``) may repeat."""
    i = 0
    while True:  # (down to the verb's own parser: `stage drain`, `check-config`)
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or i >= len(argv) or argv[i] not in sub.choices:
            break
        parser, i = sub.choices[argv[i]], i + 1
    options = parser._option_string_actions
    seen: dict[str, str] = {}
    for token in argv[i:]:
        if token == "--":
            break
        flag = token.split("=", 1)[0]
        if not flag.startswith("--"):
            continue
        action = options.get(flag)
        if action is None:
            prefixed = {a for opt, a in options.items() if opt.startswith("--") and opt.startswith(flag)}
            action = prefixed.pop() if len(prefixed) == 1 else None
        if action is None or action.nargs == 0 or isinstance(action, argparse._AppendAction):
            continue
        name = next(o for o in action.option_strings if o.startswith("--"))
        if action.dest in seen:
            return f"{name} is given twice: it takes one value (give it once)"
        seen[action.dest] = name
    return None


def _verb_first(argv: list[str]) -> str | None:
    """``stage --admin-port 1901 scale ...``: the sub-verb must come first (argparse took the
    port for the sub-verb: "invalid choice: '1901'"); what to say, or None."""
    actions = {"stage": "{drain,scale,launch,stop}", "node": "{drain,undrain}"}
    if len(argv) > 1 and argv[0] in actions and argv[1].startswith("-") and argv[1] not in ("-h", "--help"):
        return (f"`{argv[0]}` takes its action first, then {argv[1]}: "
                f"python -m omni_actors.system {argv[0]} {actions[argv[0]]} [options]")
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser()
    problem = _verb_first(argv) or _repeated_flag(parser, argv)
    if problem:
        return _fail(problem, 2)
    args = parser.parse_args(argv)
    problem = _usage_problem(args)
    if problem:
        return _fail(problem, 2)
    if isinstance(getattr(args, "devices", None), str):  # start, stage launch
        from omni_actors.placement import parse_devices

        try:
            args.devices = parse_devices(args.devices)
        except ValueError as exc:
            return _fail(f"--devices: {exc}", 2)
    verbs = {"start": cmd_start, "stop": cmd_stop, "status": cmd_status, "inject": cmd_inject, "stage": cmd_stage,
             "node": cmd_node, "api": cmd_api, "shell": cmd_shell, "check-config": cmd_check_config}
    try:
        return verbs[args.verb](args)
    except KeyboardInterrupt:  # (Ctrl-C: a traceback, a code review; `stop` says more while it waits)
        print("interrupted", file=sys.stderr, flush=True)
        return INTERRUPTED_EXIT


#: The exit status of a command interrupted by Ctrl-C (128 + SIGINT, as a shell's).
INTERRUPTED_EXIT = 130


def _main_piped() -> int:
    """``main``, quiet when its reader goes away (``status --json | head``): the rest of the
    output is dropped, no traceback (Python's documented way: stdout to /dev/null)."""
    try:
        code = main()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(_main_piped())
