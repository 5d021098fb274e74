"""``python -m omni_actors.system shell``: an interactive admin shell.

Attaches to the admin of a running system on this host (never starts one, and
never shuts one down: leaving the shell leaves the system as it was) and
offers, with readline history (``~/.omni_actors_history``, or
``$OMNI_ACTORS_HISTORY``), ``help`` and tab completion of command names,
stage names and replica ids:

    nodes                      hosts and what runs there (replicas: pid, devices)
    stages                     every stage: pool pid, replicas ready/total, load
    replicas [STAGE]           every replica (of one stage): state, pid, node, devices, load
    scale STAGE N              run N replicas of STAGE
    launch STAGE [N] [--node NODE] [--devices IDS]
                               add N replicas (default 1) to STAGE, on NODE / pinned to IDS
    drain REPLICA              finish its work, then stop it
    inject FAULT [TARGET] [V]  fault injection; V: slow's factor, raise's count (`help inject`)
    requests                   tasks in flight and waiting, by stage
    logs [N]                   the last N lines (default 20) of the leader's log
    status                     the stage table, as `python -m omni_actors.system status`
    quit / exit / Ctrl-D       leave the shell

Every error prints one line and the shell goes on. ``-c LINE`` (repeatable)
runs lines without the interactive loop; the exit status is then 1 if any of
them failed, as it is for commands piped in. ``;`` separates commands on a line.

``logs`` needs the leader's log as a file: the leader logs to its stderr, so
it reads ``$OMNI_ACTORS_LOG_FILE`` if set, else a ``log_file`` recorded in the
leader's state file, else the leader's stderr itself when that is a regular
file (``start ... 2> leader.log``, found through ``/proc/<pid>/fd/2``).
"""

from __future__ import annotations

import cmd
import inspect
import json
import os
import shlex
import signal
import socket
import sys
import time
from collections import defaultdict
from pathlib import Path

from omni_actors.messages import LIVE_STATES
from omni_actors.system.admin import FAULTS, Admin, AdminError, inject_reply

#: How long the names used for tab completion (stages; replicas not stopped or failed)
#: are reused, within one command line, before asking again.
NAMES_TTL_S = 2.0
DEFAULT_LOG_LINES = 20


def history_file() -> Path:
    return Path(os.environ.get("OMNI_ACTORS_HISTORY") or Path.home() / ".omni_actors_history")


def _table(rows: list[tuple], out) -> None:
    """Left-aligned columns; the last column is not padded."""
    rows = [tuple(str(c) for c in row) for row in rows]
    if not rows:
        return
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print(("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1]).rstrip(), file=out)


class AdminShell(cmd.Cmd):
    intro = ("omni-actors admin shell on admin port {port}. `help` lists the commands; "
             "Tab completes; `quit` leaves (the system keeps running).")
    prompt = "omni> "
    remote = False  #: attached from another host (see run_shell)

    def __init__(self, admin: Admin, admin_port: int, stdin=None, stdout=None):
        super().__init__(stdin=stdin, stdout=stdout)
        self.admin = admin
        self.admin_port = admin_port
        self.intro = self.intro.format(port=admin_port)
        self.failed = False  # set when a command printed an error
        self._names: tuple[float, list[str], list[str]] = (0.0, [], [])
        self._history_loaded = False

    # -- plumbing ---------------------------------------------------------
    def _out(self, *parts) -> None:
        print(*parts, file=self.stdout)

    def _error(self, message: str) -> None:
        self.failed = True
        self.stdout.flush()
        print(f"error: {message}", file=sys.stderr, flush=True)

    def onecmd(self, line: str):
        if ";" in line:  # (`a; b` runs a, then b, as a shell does: trial CE's `-c 'scale dit 2; stages'`
            # was read as scale's arguments)
            for part in line.split(";"):
                if part.strip() and self.onecmd(part.strip()):
                    return True
            return False
        try:
            return super().onecmd(line)
        except AdminError as exc:
            self._error(str(exc))
        except (ValueError, KeyError) as exc:
            self._error(str(exc).strip("'\""))
        except BrokenPipeError:
            raise  # (its reader went away, `shell -c ... | head`: the command line drops the rest quietly)
        except Exception as exc:  # noqa: BLE001 - one line, and the shell goes on
            self._error(f"{type(exc).__name__}: {exc}")
        return False

    def postcmd(self, stop, line):
        self._names = (0.0, [], [])  # names for completion are reused within one line only
        return stop

    def emptyline(self):
        return False  # never repeat the last command (it may be `scale` or `inject`)

    def default(self, line: str):
        word = line.split()[0]
        if word == "stage":  # (trial CI: `stage stop --stage code2wav`, the command line's verb)
            self._error("`stage ...` is the command line's verb (python -m omni_actors.system stage ...); here: "
                        "`scale STAGE N` (`scale STAGE 0` stops a stage), `launch STAGE`, `drain REPLICA`; "
                        "`help` lists the commands")
            return
        self._error(f"unknown command {word!r}; `help` lists the commands")
        return False

    def get_names(self):
        return [n for n in super().get_names() if n != "do_EOF"]

    def do_help(self, arg):
        """help [COMMAND]: list the commands, or describe one."""
        doc = getattr(getattr(self, f"do_{arg.strip()}", None), "__doc__", None) if arg.strip() else None
        if doc:
            self._out(inspect.cleandoc(doc))
        elif arg.strip() and not hasattr(self, f"do_{arg.strip()}"):
            self._error(f"no command {arg.strip()!r}; `help` lists the commands")
        else:
            super().do_help(arg)

    def preloop(self):
        if self._history_loaded:
            return
        self._history_loaded = True
        try:
            import readline
        except ImportError:
            return
        readline.set_completer_delims(" \t\n")  # replica ids hold '/', faults '-'
        try:
            readline.read_history_file(history_file())
        except (OSError, ValueError):
            pass
        readline.set_history_length(1000)

    def postloop(self):
        if not self.use_rawinput:
            return
        try:
            import readline

            readline.write_history_file(history_file())
        except (ImportError, OSError):
            pass

    def _status(self):
        return self.admin.status()

    def _stage_names(self, status) -> list[str]:
        return [st.stage for st in status.stages]

    def _stage(self, status, name: str):
        st = next((s for s in status.stages if s.stage == name), None)
        if st is None:
            raise AdminError(f"no stage named {name!r} (stages: {', '.join(self._stage_names(status))})")
        return st

    @staticmethod
    def _args(arg: str, low: int, high: int, usage: str) -> list[str]:
        words = shlex.split(arg)
        if not low <= len(words) <= high:
            raise AdminError(f"usage: {usage}")
        return words

    @staticmethod
    def _int(word: str, what: str) -> int:
        try:
            return int(word)
        except ValueError:
            raise AdminError(f"{what} must be an integer, not {word!r}") from None

    # -- completion ---------------------------------------------------------
    def _known(self) -> tuple[list[str], list[str]]:
        at, stages, replicas = self._names
        if time.monotonic() - at > NAMES_TTL_S:
            try:
                status = self.admin.status(timeout_s=2.0)
                stages = self._stage_names(status)
                replicas = [r.replica for st in status.stages for r in st.replicas
                            if r.state.value not in ("stopped", "failed")]
            except Exception:  # noqa: BLE001 - completion must never fail loudly
                stages, replicas = [], []
            self._names = (time.monotonic(), stages, replicas)
        return stages, replicas

    @staticmethod
    def _match(text: str, names: list[str]) -> list[str]:
        """Names starting with ``text``; a single one gets a trailing space (readline here adds none)."""
        found = [n for n in names if n.startswith(text)]
        return [found[0] + " "] if len(found) == 1 else found

    def completenames(self, text, *ignored):
        return self._match(text, [n[3:] for n in self.get_names() if n.startswith("do_")])

    def _position(self, line: str, begidx: int) -> int:
        """Which argument (0-based) the word being completed is."""
        return len(line[:begidx].split()) - 1

    def _complete_stage_first(self, text, line, begidx, endidx):
        return self._match(text, self._known()[0]) if self._position(line, begidx) == 0 else []

    complete_replicas = complete_scale = _complete_stage_first

    def complete_launch(self, text, line, begidx, endidx):
        if self._position(line, begidx) == 0:
            return self._match(text, self._known()[0])
        before = line[:begidx].split()
        if before and before[-1] == "--node":
            try:
                nodes = [n.name for n in self.admin.status(timeout_s=2.0).nodes if n.alive]
            except Exception:  # noqa: BLE001 - completion must never fail loudly
                nodes = []
            return self._match(text, nodes)
        return self._match(text, ["--node", "--devices"]) if text.startswith("-") else []

    def complete_drain(self, text, line, begidx, endidx):
        return self._match(text, self._known()[1]) if self._position(line, begidx) == 0 else []

    def complete_inject(self, text, line, begidx, endidx):
        pos = self._position(line, begidx)
        if pos == 0:
            return self._match(text, list(FAULTS))
        if pos == 1:
            fault = line.split()[1]
            stages, replicas = self._known()
            if fault == "kill-pool":
                return self._match(text, stages)
            if fault == "kill-coordinator":
                return []
            return self._match(text, replicas)
        return []

    # -- commands -------------------------------------------------------------
    def _api(self) -> dict[str, bool]:
        """How the leader's HTTP API is (``leader_api``), as :func:`print_status_table` takes it;
        nothing to say from a shell attached through a member (`--convention-address`)."""
        from omni_actors.system.admin import leader_api

        api = None if self.remote else leader_api(self.admin.leader_port or self.admin_port)
        return {"api_down": bool(api and api.down), "stopping": bool(api and api.stopping),
                "frozen": bool(api and api.frozen)}

    def do_status(self, arg):
        """status: the stage table (as `python -m omni_actors.system status`)."""
        from omni_actors.system.leader import print_status_table

        self._args(arg, 0, 0, "status")
        status = self._status()
        # (its last line says NOT SERVING or STOPPING as the command's does: a code review)
        print_status_table(status, out=self.stdout, **self._api())

    def do_nodes(self, arg):
        """nodes: every host and what runs there: replicas (state, pid, devices) and, on this
        host, the control plane (coordinator and stage pools)."""
        self._args(arg, 0, 0, "nodes")
        status = self._status()
        here = socket.gethostname()
        by_node: dict[str, list] = defaultdict(list)
        stopped = 0
        for st in status.stages:
            for r in st.replicas:
                if r.state.value == "stopped":
                    stopped += 1
                    continue
                # (a replica pinned to a node that is away waits for it: listed under that node)
                by_node[r.node or (r.pin[0] if r.pin else "") or "(not placed yet)"].append(r)
        control = [("coordinator", "-", status.coordinator_pid or "-", "-")]
        control += [(f"pool {st.stage}", "-", st.pid or "-", "-") for st in status.stages]
        # The coordinator's node inventory: every host, idle or lost ones too.
        inventory = {n.name: n for n in status.nodes}
        # (a review: taken to be the node named as this machine, or the first by name, it was a
        # member's with `--node-name leader` and a member `gpu1`, or from a member's shell)
        leader = status.leader_node or (next(iter(inventory), here) if len(inventory) == 1 else (
            here if here in inventory else next(iter(inventory), here)))
        nodes = sorted(set(by_node) | set(inventory), key=lambda n: (n != leader, n))
        for node in nodes:
            reps = by_node.get(node, [])
            inv = inventory.get(node)
            ready = sum(1 for r in reps if r.state.value == "ready")
            if inv is None:
                devices = "waiting for placement (`replicas` says why)"  # (the replicas not placed yet)
            elif inv.devices and inv.state in ("alive", "leaving"):
                devices = f"devices {','.join(inv.devices)} ({len(inv.devices) - len(inv.used)} free)"
            elif inv.devices:
                devices = f"devices {','.join(inv.devices)} (none offered while it is {inv.state})"
            else:
                devices = "no devices (CPU)"
            alive = "" if inv is None or inv.state == "alive" else f" {inv.state.upper()}"
            # (attached through a member's admin port: the leader's own is not that one)
            leader_port = self.admin.leader_port or self.admin_port
            port = "" if getattr(self, "remote", False) else "admin port %d, " % leader_port
            extra = f" ({port}control plane)" if node == leader else ""
            self._out(f"{node}{alive}{extra}: {len(reps)} replicas, {ready} ready, {devices}")
            rows = [("  WHAT", "STATE", "PID", "DEVICES")]
            if node == leader:
                rows += [(f"  {w}", s, p, d) for w, s, p, d in control]
            rows += [(f"  {r.replica}", r.state.value, r.pid or "-", r.devices_label()) for r in reps]
            _table(rows, self.stdout)
        if stopped:
            self._out(f"({stopped} stopped replicas not shown; `replicas` lists them)")

    def do_stages(self, arg):
        """stages: every stage with its pool pid; READY replicas and LIVE ones (with a process: starting,
        ready, draining or isolated); tasks IN_FLIGHT on replicas and PENDING (waiting for a ready one);
        how often the stage's pool was recreated."""
        from omni_actors.system.leader import model_line

        self._args(arg, 0, 0, "stages")
        status = self._status()
        rows = [("STAGE", "ID", "POOL_PID", "READY", "LIVE", "IN_FLIGHT", "PENDING", "POOL_RESTARTS")]
        for st in status.stages:
            live = [r for r in st.replicas if r.state in LIVE_STATES]
            # (READY as `status` and /v1/stages count it, and the last line as `status` says it: a
            # review read READY 1 and "NOT READY" with the only Talker lingering on a leaving member,
            # and "ready" with the leader killed)
            rows.append((st.stage, st.stage_id, st.pid or "-",
                         sum(1 for r in st.replicas if r.state.value == "ready" and not r.lingering), len(live),
                         sum(r.in_flight for r in st.replicas), st.pending, st.restarts))
        _table(rows, self.stdout)
        self._out(model_line(status, **self._api()))

    def do_replicas(self, arg):
        """replicas [STAGE]: every replica (of STAGE): state, pid, node, devices, load, counters, reason."""
        words = self._args(arg, 0, 1, "replicas [STAGE]")
        status = self._status()
        stages = [self._stage(status, words[0])] if words else status.stages
        rows = [("REPLICA", "STATE", "PID", "NODE", "DEVICES", "IN_FLIGHT", "DONE", "FAILED", "RESTARTS",
                 "REASON")]
        for st in stages:
            for r in st.replicas:
                rows.append((r.replica, r.state.value, r.pid or "-", r.node or "-", r.devices_label(),
                             r.in_flight, r.completed, r.failed, r.restarts, r.reason_label()))
        _table(rows, self.stdout)

    def do_scale(self, arg):
        """scale STAGE N: run N replicas of STAGE (launches new ones or drains the least busy)."""
        stage, n = self._args(arg, 2, 2, "scale STAGE N")
        before = self.admin.status()
        reply = self.admin.scale(stage, self._int(n, "N"))
        self._out(reply)
        for line in self.admin.unplaced(stage, before, reply):
            self._out(f"warning: {line}")

    def do_launch(self, arg):
        """launch STAGE [N] [--node NODE] [--devices IDS]: add N replicas to STAGE (default 1; with
        --devices, one per devices_per_replica of them). --node: only on that node. --devices 2,3:
        exactly those devices (on one node), which the replicas keep across restarts."""
        usage = "launch STAGE [N] [--node NODE] [--devices IDS]"
        words, options = _options(self._args(arg, 1, 6, usage), ("--node", "--devices"), usage)
        if not 1 <= len(words) <= 2:
            raise AdminError(f"usage: {usage}")
        n = self._int(words[1], "N") if len(words) > 1 else None
        if n is not None and n < 1:
            raise AdminError("N must be >= 1")
        before = self._status()
        self._stage(before, words[0])
        reply = self.admin.launch(words[0], n, node=options.get("--node", ""), devices=options.get("--devices", ""))
        self._out(reply)
        for line in self.admin.unplaced(words[0], before, reply):
            self._out(f"warning: {line}")

    def do_drain(self, arg):
        """drain REPLICA... | drain --node NODE: stop routing to each REPLICA (STAGE/N), let its
        work finish, then stop it; --node: so for every replica on NODE, each replaced where
        there is room, and place nothing new on NODE until `undrain NODE` (its member runs on)."""
        usage = "drain REPLICA... | drain --node NODE"
        words = self._args(arg, 1, 64, usage)
        if words[0].startswith("--node="):  # (as `launch` takes it; it was taken for a replica's name)
            words = ["--node", words[0].partition("=")[2], *words[1:]]
        if words[0].startswith("-") and words[0] != "--node":
            raise AdminError(f"usage: {usage}")
        if words[0] == "--node":
            if len(words) != 2:
                raise AdminError(f"usage: {usage}")
            before = self._status()
            self._out(self.admin.drain_node(words[1], operator=True))
            for line in self.admin.left_without_replicas(words[1], before):
                self._out(f"warning: {line}")
            return
        if any(w.startswith("-") for w in words):
            raise AdminError(f"usage: {usage}")
        for replica in dict.fromkeys(words):  # (several, as `stage drain --replica A --replica B`: trial BY)
            self._out(self.admin.drain(replica))

    def do_undrain(self, arg):
        """undrain NODE: let NODE, drained with `drain --node`, take new replicas again."""
        (node,) = self._args(arg, 1, 1, "undrain NODE")
        if "/" in node:  # (trial BB: `undrain talker/1` read "no alive node named 'talker/1'")
            stage = node.split("/")[0]
            raise AdminError(f"undrain takes a node, not a replica: a drained replica stops for good; "
                             f"`scale {stage} N` or `launch {stage}` starts new ones")
        self._out(self.admin.undrain_node(node))

    def do_inject(self, arg):
        """inject FAULT [TARGET] [VALUE]: inject a fault (for fault-injection tests).
        FAULT: sigkill, sigstop, sigcont, raise, slow, stall, clear (TARGET: a replica, STAGE/N);
        kill-pool (TARGET: a stage); kill-coordinator (no target).
        VALUE: for `raise`, how many next tasks raise (default 1); for `slow`, the factor (default 5)."""
        usage = "inject FAULT [REPLICA|STAGE] [VALUE]"
        if any(w.startswith("--") for w in shlex.split(arg)):  # (the CLI's --factor/--count: a trial's guess)
            raise AdminError(f"usage: {usage} (the value goes last, without a flag: `inject slow talker/0 2`)")
        words = self._args(arg, 1, 3, usage)
        fault, target = words[0], (words[1] if len(words) > 1 else "")
        if fault not in FAULTS:
            raise AdminError(f"unknown fault {fault!r}; one of: {', '.join(FAULTS)}")
        kwargs = {"factor": 5.0, "count": 1}
        if len(words) > 2:
            if fault == "slow":
                try:
                    kwargs["factor"] = float(words[2])
                except ValueError:
                    raise AdminError(f"the factor must be a number, not {words[2]!r}") from None
            elif fault == "raise":
                kwargs["count"] = self._int(words[2], "the count")
            else:
                raise AdminError(f"{fault} takes no value")
        if fault == "kill-pool":
            if not target:
                raise AdminError("kill-pool needs a STAGE")
            done = self.admin.inject(fault, stage=target, **kwargs)
        elif fault == "kill-coordinator":
            if target:  # (trial BF: a kill-pool mistyped on the CLI killed the coordinator)
                raise AdminError(f"kill-coordinator takes no target (it kills the coordinator), not {target!r}")
            done = self.admin.inject(fault, **kwargs)
        else:
            if not target:
                raise AdminError(f"{fault} needs a replica, STAGE/N")
            if "/" not in target:
                raise AdminError(f"{fault} targets a replica (STAGE/N), not {target!r}")
            done = self.admin.inject(fault, replica=target, **kwargs)
        self._out(inject_reply(done))

    def do_requests(self, arg):
        """requests: stage tasks in flight (on replicas) and pending (waiting for a ready replica), by stage."""
        self._args(arg, 0, 0, "requests")
        status = self._status()
        rows = [("STAGE", "IN_FLIGHT", "PENDING")]
        total_in, total_pending = 0, 0
        for st in status.stages:
            in_flight = sum(r.in_flight for r in st.replicas)
            total_in, total_pending = total_in + in_flight, total_pending + st.pending
            rows.append((st.stage, in_flight, st.pending))
        rows.append(("(all)", total_in, total_pending))
        _table(rows, self.stdout)

    def do_logs(self, arg):
        """logs [N]: the last N lines (default 20) of the leader's log ($OMNI_ACTORS_LOG_FILE, the state
        file's log_file, or the leader's stderr when it is a file)."""
        words = self._args(arg, 0, 1, "logs [N]")
        n = self._int(words[0], "N") if words else DEFAULT_LOG_LINES
        if n < 1:
            raise AdminError("N must be >= 1")
        path = self._log_file()
        if path is None:
            raise AdminError("no leader log file known: the leader logs to its stderr (a terminal?); start "
                             "it with `2> PATH`, or set OMNI_ACTORS_LOG_FILE=PATH here naming the file "
                             "its stderr goes to")
        for line in _tail(path, n):
            self._out(line)

    def _log_file(self) -> Path | None:
        env = os.environ.get("OMNI_ACTORS_LOG_FILE")
        if env:
            return Path(env)
        if getattr(self, "remote", False):
            return None  # the leader's log is on its host
        try:
            from omni_actors.system.leader import state_file

            # (attached through a member's admin port: the leader's own, when it runs here)
            state = json.loads(state_file(self.admin.leader_port or self.admin_port).read_text())
        except (OSError, ValueError, ImportError):
            return None
        if state.get("log_file"):
            return Path(state["log_file"])
        try:  # the leader's stderr, when it was sent to a regular file
            stderr = Path(os.readlink(f"/proc/{int(state['pid'])}/fd/2"))
            if stderr.is_file():
                return stderr
        except (OSError, KeyError, ValueError, TypeError):
            pass
        return None

    def do_quit(self, arg):
        """quit: leave the shell (the system keeps running)."""
        return True

    do_exit = do_quit

    def do_EOF(self, arg):
        self._out()
        return True


def _options(words: list[str], names: tuple[str, ...], usage: str) -> tuple[list[str], dict[str, str]]:
    """Split ``--name VALUE`` / ``--name=VALUE`` options (of ``names``) from positional words."""
    rest, options = [], {}
    i = 0
    while i < len(words):
        word = words[i]
        name, eq, value = word.partition("=")
        if name in names:
            if not eq:
                if i + 1 >= len(words):
                    raise AdminError(f"{name} needs a value; usage: {usage}")
                i += 1
                value = words[i]
            options[name] = value
        elif word.startswith("--"):
            raise AdminError(f"unknown option {name}; usage: {usage}")
        else:
            rest.append(word)
        i += 1
    return rest, options


def _tail(path: Path, n: int, block: int = 65536) -> list[str]:
    """The last ``n`` lines of a file, reading from its end."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            pos = f.tell()
            data = b""
            while pos > 0 and data.count(b"\n") <= n:
                step = min(block, pos)
                pos -= step
                f.seek(pos)
                data = f.read(step) + data
    except OSError as exc:
        raise AdminError(f"cannot read the log {path}: {exc.strerror}") from None
    return data.decode(errors="replace").splitlines()[-n:]


def run_shell(admin_port: int, commands: list[str] | tuple[str, ...] = (), *, admin: Admin | None = None,
              remote: bool = False) -> int:
    """Run the shell (or just ``commands``) on ``admin``, else on the admin of
    ``admin_port`` on this host. ``remote``: attached from another host
    (``logs`` then has no local file to read). Returns the exit code."""
    from omni_actors.system.admin import attach

    if admin is None:
        try:
            admin = attach(admin_port)
        except AdminError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    shell = AdminShell(admin, admin_port)
    shell.remote = remote
    if remote:
        shell.intro = shell.intro.replace(f"on admin port {admin_port}", "attached through the convention leader")
    if commands:
        for line in commands:
            if shell.onecmd(line):
                break
        return 1 if shell.failed else 0
    intro = shell.intro
    # Ctrl-C must reach the loop below even when this process was started with SIGINT
    # ignored (as a background job of a non-interactive shell is, and Python then installs
    # no KeyboardInterrupt handler): the shell would not react to it at all.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    while True:
        try:
            shell.cmdloop(intro)
            # (commands piped in are a script: one that failed fails it, as with -c; trial CE)
            return 1 if shell.failed and not sys.stdin.isatty() else 0
        except KeyboardInterrupt:  # Ctrl-C drops the line being typed, as a shell does
            print("^C", file=shell.stdout)
            intro = ""
