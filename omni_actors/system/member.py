"""A member host: a Thespian admin that joins the leader's convention and offers
its devices. The coordinator places replicas on it (see ``omni_actors.placement``).

``run_member`` is what ``python -m omni_actors.system start --convention-address
HOST:PORT`` runs in the foreground; Ctrl-C or SIGTERM leave the convention: first
the replicas here are drained (:func:`drain_node`: the coordinator starts their
replacements elsewhere and the work in flight here finishes; a second Ctrl-C skips
the wait), then every process this host started ends.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time

from omni_actors.system.leader import (StartError, _become_subreaper, admin_port_claimed, member_on_port,
                                       member_state_file, node_capabilities, recorded_leaders, start_admin,
                                       start_data_service, update_state, write_state)
from omni_actors.system.processes import (ENV_SYSTEM_ID, child_sessions, handle_stop_signals, kill_system,
                                          port_in_use, remove_ipc_dir,
                                          remove_orphan_semaphores,
                                          resume_stopped, sweep_stale_ipc_dirs)
from omni_actors.system.watchdog import (admin_stops, exit_if_host_gone, identity, mark_host_process, remove_state_file,
                                        start_watchdog, stop_watchdog)

#: seconds between the member's checks that its convention leader's admin still answers
LEADER_CHECK_S = 5.0
#: how long a member that starts before its leader waits for it (``start --leader-wait``):
#: hosts started together (by a scheduler, in any order) join once the leader is up
LEADER_WAIT_S = 60.0
MAX_LEADER_WAIT_S = 86400.0
#: seconds between a waiting member's tries
LEADER_POLL_S = 0.5


def run_member(convention: tuple[str, int], *, admin_port: int, node: str, devices: tuple[str, ...],
               stages: tuple[str, ...], leader_wait_s: float = LEADER_WAIT_S) -> int:
    """Join the convention at ``convention`` and serve until SIGINT/SIGTERM. A leader
    that does not answer yet is waited for, up to ``leader_wait_s`` (default
    :data:`LEADER_WAIT_S`; a port that answers but is no Thespian admin fails at once).

    Returns:
        0 once it has left the convention; 130 if interrupted while it waited.

    Raises:
        StartError: the admin port is taken, the leader cannot be reached, or a live member
            already goes by ``node``.
    """
    import omni_actors.actors  # noqa: F401 - its Thespian fix, before the admin forks
    from omni_actors.actors import device_leases
    from omni_actors.connectors import SegmentDirError, check_segment_dir, sweep_segments
    from omni_actors.connectors.data_service import DEFAULT_REAP_AFTER_S, local_address_towards
    from omni_actors.logs import get_logger

    host, port = convention
    _check_admin_port(admin_port, host, port)
    from omni_actors.system.remote import leader_status, node_name_taken

    stopping, hurry = threading.Event(), threading.Event()
    me, started_at = os.getpid(), time.time()
    def interrupt(signum, frame):
        if os.getpid() == me:
            if stopping.is_set():  # a second Ctrl-C or SIGTERM: leave without waiting for the drain
                hurry.set()
            stopping.set()
        else:  # (a process forked from here: the admin, its logger)
            exit_if_host_gone(signum)

    handle_stop_signals(interrupt)
    # (`stop --admin-port` finds it while it waits for its leader too: it said "no omni-actors
    # system recorded" and the member joined later; a code review. Replaced once it has joined.)
    waiting = member_state_file(admin_port)
    try:
        waiting.parent.mkdir(parents=True, exist_ok=True)
        write_state(waiting, {"pid": me, **identity(), "role": "member", "node": node,
                              "admin_port": admin_port, "convention": f"{host}:{port}",
                              "system_id": os.environ.get(ENV_SYSTEM_ID, ""), "sessions": [],
                              "waiting": True})
        problem = _wait_for_leader(host, port, leader_wait_s, stopping)
        if stopping.is_set():
            print("omni-actors member stopped while it waited for its leader", flush=True)
            remove_state_file(waiting, me)
            return 130
        if problem:
            raise StartError(problem)
        _check_admin_port(admin_port, host, port)  # (again: it may have been taken while this one waited)
        problem = _member_not_leader(host, port)
        if problem:
            raise StartError(problem)
        leader = leader_status(host, port)
        problem = node_name_taken(host, port, node, leader) or _unknown_stages(stages, leader)
        if problem:
            raise StartError(problem)
        try:
            shm_dir = check_segment_dir()  # $OMNI_ACTORS_SHM_DIR (--shm-dir), inherited by every actor
        except SegmentDirError as exc:
            raise StartError(str(exc)) from None
    except BaseException:
        remove_state_file(waiting, me)
        raise
    shm_prefix = f"oa-{admin_port}-"
    os.environ["OMNI_ACTORS_SHM_PREFIX"] = shm_prefix  # this host's buffers, for its reaper
    sweep_segments(shm_prefix)
    log = get_logger(actor="member", node=node)
    caps = node_capabilities(admin_port, node, devices, stages)
    caps["Convention Address.IPv4"] = (host, port)
    device_leases.sweep_stale()  # (of leaders and members killed outright on this host)
    leases = device_leases.use_scope(port, node)
    asys = data = watchdog = None
    sessions: list[int] = []
    try:
        # Bound to the address this host uses to reach the leader; the coordinator's
        # node agent sets the reap age from the config (see actors.node_agent).
        data = start_data_service(node, local_address_towards(host, port), DEFAULT_REAP_AFTER_S)
        mark_host_process("member")  # (inherited by the admin and every actor placed here)
        # (as the leader: the process that forks the admin and exits was left a zombie for the
        # member's whole life, a trial saw; orphaned actors here are reaped too)
        _become_subreaper()
        sweep_stale_ipc_dirs()  # (of systems killed outright on this host)
        asys = start_admin(admin_port, caps)
        sessions = child_sessions()  # the admin's session: every actor placed here lives in it
        sfile = member_state_file(admin_port)
        drain_record(admin_port).unlink(missing_ok=True)  # (an earlier member's on this port)
        watchdog = start_watchdog("member", os.environ.get(ENV_SYSTEM_ID, ""), sessions, shm_prefix=shm_prefix,
                                  state_file=sfile)
        # (`stop --admin-port` finds it there: a trial had to find the member's pid to stop it)
        sfile.parent.mkdir(parents=True, exist_ok=True)
        joined = {"pid": me, **identity(), "role": "member", "node": node, "admin_port": admin_port,
                  "convention": f"{host}:{port}", "system_id": os.environ.get(ENV_SYSTEM_ID, ""),
                  "sessions": sessions, "shm_dir": shm_dir, "waiting": False,
                  "watchdog_pid": watchdog.pid if watchdog else None,
                  # (`stop` waits for the drain, as long as the leader's: it
                  # gave a member 30 s whatever the leader's drain_timeout_s)
                  **({"drain_timeout_s": leader.drain_timeout_s}
                     if leader is not None and leader.drain_timeout_s else {})}
        # (merged over its waiting record: a `stop` meanwhile recorded there that it waits, a review)
        if update_state(sfile, **joined) is None:
            write_state(sfile, joined)
        print(f"omni-actors member {node!r} joined the convention at {host}:{port} "
              f"(admin port {admin_port}, devices {','.join(devices) or 'none (CPU)'}, "
              f"stages {','.join(stages) or 'any'}); Ctrl-C to leave", flush=True)
        log.info("member_started", admin_port=admin_port, devices=list(devices), stages=list(stages),
                 shm_dir=shm_dir)
        threading.Thread(target=_say_if_drained, args=(stopping, host, port, node, log), name="drained-check",
                         daemon=True).start()
        _serve(stopping, host, port, log)
        # (`stop` then waits for this stop, as a leader's: a review saw it hurry a Ctrl-C'd member)
        update_state(sfile, stopping=True)
        warnings: list[str] = []
        undrained: list[str] = []
        drained = drain_node(host, port, node, hurry, log, data_service=data.address, warnings=warnings,
                             undrained=undrained)
        try:  # (`stop` reads it after: it said "drained first" of a member that could not drain)
            if json.loads(sfile.read_text()).get(STOP_WAITS):  # (Ctrl-C: nobody would read or remove it)
                # (trial AT: `stop` did not say that the stages it left had no replica any more)
                write_state(drain_record(admin_port), {"drained": drained, "warnings": warnings,
                                                       "undrained": undrained})
        except (OSError, ValueError):
            pass
        return 0
    finally:
        if asys is not None:
            resume_stopped(os.environ.get(ENV_SYSTEM_ID, ""), sessions)
            admin_stops(watchdog)  # (its admin's exit is no death, for its watchdog)
            asys.shutdown()
        killed = kill_system(os.environ.get(ENV_SYSTEM_ID, ""), sessions=sessions,
                             settle_s=1.0 if asys is not None else 0.0)
        remove_ipc_dir(os.environ.get(ENV_SYSTEM_ID, ""))
        device_leases.sweep(leases)
        sweep_segments(shm_prefix)
        remove_orphan_semaphores(started_at)
        if data is not None:
            data.stop()
        stop_watchdog(watchdog)
        remove_state_file(member_state_file(admin_port), me)
        log.info("member_stopped", processes_killed=killed)
        print("omni-actors member stopped", flush=True)


#: seconds a member waits for its node's replicas to drain when the leader does not say
#: (its ``supervision.drain_timeout_s``, the leader's own drain's bound, in ``status``)
DEFAULT_DRAIN_S = 10.0
#: seconds the member waits beyond that for its replicas to stop once their work is done
DRAIN_GRACE_S = 5.0


def drain_node(host: str, port: int, node: str, hurry: threading.Event, log,
               data_service: str | None = None, warnings: list[str] | None = None,
               undrained: list[str] | None = None) -> bool:
    """Before a member leaves cleanly: have the coordinator at ``host:port`` drain the
    replicas on ``node`` (:class:`~omni_actors.messages.DrainNode`: replacements start
    elsewhere, tasks in flight finish here), and wait until none runs here any more, up
    to the leader's ``supervision.drain_timeout_s`` (+ :data:`DRAIN_GRACE_S`) or until
    ``hurry`` is set (a second Ctrl-C). Says what it does on stdout. A leader that does
    not answer is not waited for: what runs here ends with the member, as before.

    ``data_service``: this member's (its ``host:port``). When the system's node of that
    name has another one, it is another member's now (this one was lost, and a new member
    joined under its name): nothing is drained. (A trial's stuck member, stopped with
    Ctrl-C, drained the healthy member that had replaced it.)

    Returns:
        Whether every replica here stopped in time (True too when none ran here).
    """
    from omni_actors.balancing import stages_left_without_replicas
    from omni_actors.messages import ReplicaState
    from omni_actors.system.admin import AdminError
    from omni_actors.system.remote import attach_remote

    running = (ReplicaState.READY, ReplicaState.STARTING, ReplicaState.DRAINING, ReplicaState.ISOLATED)

    def running_here(status) -> list[str]:
        return [r.replica for s in status.stages for r in s.replicas if r.node == node and r.state in running]

    def not_drained(line: str) -> bool:
        """Say why the replicas here did not all drain (also to ``undrained``: `stop` says it)."""
        print(line, flush=True)
        if undrained is not None:
            undrained.append(line)
        return False

    try:
        admin = attach_remote(host, port)
    except AdminError as exc:
        return not_drained(f"leaving without a drain: {exc}")
    started = False
    try:
        status = admin.status(timeout_s=5.0)
        known = next((n for n in status.nodes if n.name == node), None)
        if data_service and known is not None and known.data_service and known.data_service != data_service:
            log.warning("member_replaced", node=node, data_service=data_service, theirs=known.data_service)
            return not_drained(f"leaving without a drain: node {node} in the system is another member's now (its "
                               f"data service {known.data_service}; this member's {data_service}): this one was lost")
        if not running_here(status):
            return True
        admin.drain_node(node)
        started = True
        wait_s = (status.drain_timeout_s or DEFAULT_DRAIN_S) + DRAIN_GRACE_S
        # (trial AS: "new ones go to other nodes" where no other node had a ready replica of a stage:
        # those linger here, see PoolPlacementMixin.receiveMsg_DrainNode)
        ready = ReplicaState.READY
        last_ones = sorted(s.stage for s in status.stages
                           if any(r.node == node and r.state == ready for r in s.replicas)
                           and not any(r.node != node and r.state == ready for r in s.replicas))
        where = "new ones go to other nodes" + (
            f"; {', '.join(last_ones)} (no ready replica elsewhere) finish here the requests begun before now, and "
            "newer requests wait for a replacement (up to queue_timeout_s)" if last_ones else "")
        print(f"leaving: the replicas on node {node} drain (their requests in flight finish, up to "
              f"{wait_s:g} s; {where}; Ctrl-C again: leave now)", flush=True)
        log.info("member_draining", node=node, timeout_s=wait_s)
        deadline, left, last = time.monotonic() + wait_s, (), None
        while not hurry.is_set():
            last = admin.status(timeout_s=5.0)
            left = running_here(last)
            if not left or time.monotonic() >= deadline:
                break
            hurry.wait(0.2)
        if left:
            why = "second Ctrl-C" if hurry.is_set() else f"still running after {wait_s:g} s"
            lingering = [r.replica for s in (last.stages if last else ()) for r in s.replicas
                         if r.node == node and r.lingering]
            if lingering:  # (trial AT: the names, twice over, when they were all lingering ones)
                who = "they" if set(lingering) == set(left) else ", ".join(lingering)
                why += f"; {who} were the last ready replicas of their stages, still with requests begun before the leave"
            log.warning("member_drain_incomplete", node=node, replicas=left, why=why)
            not_drained(f"leaving with {len(left)} replica(s) not drained ({why}): {', '.join(left)}")
        try:
            after = admin.status(timeout_s=5.0)
        except AdminError:
            after = None
        for stage, line in stages_left_without_replicas(after, node, status):
            print(f"warning: {line}", flush=True)
            if warnings is not None:
                warnings.append(line)
            log.warning("member_leaves_stage_without_replicas", node=node, stage=stage, detail=line)
        return not left
    except AdminError as exc:  # (the leader stopped or was killed meanwhile)
        return not_drained(f"stopped waiting for the drain, the leader no longer answers: {exc}" if started
                           else f"leaving without a drain: {exc}")
    finally:
        admin.asys.close()


def _check_admin_port(admin_port: int, host: str, port: int) -> None:
    """Raise StartError when something listens on this member's ``admin_port`` already, another
    member recorded here has it (one waiting for its leader too, whose admin is not up yet), or
    a leader recorded here that is still starting will serve HTTP there."""
    claimed = admin_port_claimed(admin_port)
    if claimed:
        raise StartError(claimed)
    if port == admin_port and _on_this_host(host):  # (up yet or not: trial BR's waited for nothing)
        raise StartError(f"admin port {admin_port} is the leader's (the convention address {host}:{port}): "
                         "a member on the leader's host needs an --admin-port of its own")
    for other in recorded_leaders() if _on_this_host(host) else ():
        if other.get("port") == port:  # (trial BR: 5 s, then "not a Thespian admin")
            raise StartError(f"{host}:{port} is the HTTP port of the system on admin port {other['admin_port']} "
                             f"(leader pid {other['pid']}): give --convention-address its admin port, "
                             f"{host}:{other['admin_port']}")
    member = member_on_port(admin_port)  # (another one waiting for its leader listens nowhere yet: a code review)
    if member:
        raise StartError(f"admin port {admin_port} is the admin port of {member} on this host: give this one an "
                         "--admin-port of its own")
    if port_in_use(admin_port):
        raise StartError(f"admin port {admin_port} is in use (another system, or a member already running "
                         "on this host: give this one an --admin-port of its own)")


def _member_not_leader(host: str, port: int) -> str | None:
    """Why ``host:port`` is no convention to join: it is a member's admin, not its leader's
    (a code review: such a member said it joined, and the coordinator never saw its node);
    None when it is a leader's, or its admin cannot be asked (the join says what is wrong)."""
    from omni_actors.system.remote import admin_status, is_member_status

    try:
        status = admin_status(host, port)
    except Exception:  # noqa: BLE001 - whatever Thespian raises making its transport
        return None
    if status is None or not is_member_status(status):
        return None
    leader = status.capabilities.get("Convention Address.IPv4")
    where = f" (the leader's is {leader[0]}:{leader[1]})" if isinstance(leader, (tuple, list)) and len(leader) == 2 \
        else ""
    return (f"{host}:{port} is a member's admin, not the convention leader's{where}: give --convention-address "
            "the leader's admin address")


def _wait_for_leader(host: str, port: int, wait_s: float, stopping: threading.Event) -> str | None:
    """Probe the leader's admin until it answers, for up to ``wait_s`` (saying so once on
    stdout) or until ``stopping`` is set; why it did not answer, or None when it did."""
    from omni_actors.system.remote import NO_LEADER, probe_admin

    deadline, said = time.monotonic() + wait_s, False
    while True:
        problem = probe_admin(host, port)  # (an HTTP port would accept the connection, then never answer)
        if problem is None or not problem.startswith(NO_LEADER) or stopping.is_set():
            return problem
        if time.monotonic() >= deadline:
            return problem + (f" (waited {wait_s:g} s: --leader-wait)" if wait_s > 0 else "")
        if not said:
            print(f"{problem}: waiting up to {wait_s:g} s for it (--leader-wait; Ctrl-C to give up)", flush=True)
            said = True
        stopping.wait(min(LEADER_POLL_S, max(deadline - time.monotonic(), 0.0)))


#: seconds after it joins that a member looks for its node in the leader's status (to say it
#: is drained), and how often
DRAINED_CHECK_S, DRAINED_CHECK_EVERY_S = 15.0, 1.0


def _say_if_drained(stopping: threading.Event, host: str, port: int, node: str, log) -> None:
    """Once the coordinator has taken this member's node in: say so if an operator had drained
    it (``node drain``, which outlives a member's restart), as it then takes no replica (trial
    BK: the member said only that it joined, and `status` said DRAINED)."""
    from omni_actors.system.remote import leader_status

    deadline = time.monotonic() + DRAINED_CHECK_S
    while not stopping.wait(DRAINED_CHECK_EVERY_S) and time.monotonic() < deadline:
        status = leader_status(host, port)
        mine = next((n for n in (status.nodes if status else ()) if n.name == node and n.alive), None)
        if mine is None:
            continue
        if mine.drained:
            print(f"node {node} is drained (`node drain`, before this member started): it takes no replica "
                  f"until `node undrain --node {node}`", flush=True)
            log.warning("member_node_drained", node=node)
        return


def _serve(stopping: threading.Event, host: str, port: int, log) -> None:
    """Wait for ``stopping``; meanwhile say (stdout and log) when the convention leader's
    admin stops answering and when it answers again. The member stays up either way:
    Thespian joins it to a leader that starts again at that address."""
    answering, next_check = True, time.monotonic() + LEADER_CHECK_S
    while not stopping.wait(0.2):
        if time.monotonic() < next_check:
            continue
        now = port_in_use(port, host)
        next_check = time.monotonic() + LEADER_CHECK_S
        if now == answering:
            continue
        answering = now
        if now:
            print(f"the convention leader at {host}:{port} answers again: this member joins it", flush=True)
            log.info("leader_answers", convention=f"{host}:{port}")
        else:
            print(f"the convention leader at {host}:{port} does not answer: this member keeps running and "
                  "joins it when it starts again (Ctrl-C to leave)", flush=True)
            log.warning("leader_not_answering", convention=f"{host}:{port}")


def _on_this_host(host: str) -> bool:
    """Whether ``host`` (a convention address's host) names this machine: loopback, its
    name, or one of its addresses."""
    import socket

    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    if any(a.startswith("127.") or a == "::1" for a in addresses):
        return True
    try:
        mine = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        mine = set()
    return bool(addresses & mine)


#: Key that `stop` sets in a member's state file before it signals it: the member then says,
#: in its :func:`drain_record`, whether its replicas drained (otherwise it writes none: a
#: member stopped with Ctrl-C left one that nobody removed, trial AR).
STOP_WAITS = "stop_waits"


def drain_record(admin_port: int):
    """The file where the member on ``admin_port`` says, as it leaves, whether its replicas
    drained (``drained`` or ``not drained``), when `stop` asked (:data:`STOP_WAITS`); `stop`
    reads and removes it."""
    sfile = member_state_file(admin_port)
    return sfile.with_name(sfile.stem + ".drain")


def _unknown_stages(stages: tuple[str, ...], status) -> str | None:
    """Why ``--stages`` cannot be right for the system whose ``status`` the leader gave (a
    name none of its stages has: trial AP's member joined with ``talkr`` and could never be
    given a replica), or None (also when the leader did not answer: it is not known then)."""
    known = [s.stage for s in (status.stages if status is not None else ())]
    unknown = [s for s in stages if known and s not in known]
    if unknown:
        return (f"--stages: no stage named {', '.join(map(repr, unknown))} in the system this member joins "
                f"(its stages: {', '.join(known)})")
    return None


def default_node_name(admin_port: int) -> str:
    """``<hostname>-<admin port>``: unique per admin, also for several on one machine."""
    return f"{socket.gethostname()}-{admin_port}"
