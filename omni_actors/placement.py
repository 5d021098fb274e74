"""Placement: which node and which devices each replica gets. Pure logic, kept
by the coordinator (never in Thespian capabilities: updating a capability on a
member was seen to kill an actor already running there).

Rules:

- a replica that needs ``k`` devices (its tensor-parallel size) gets ``k``
  free devices of ONE node; a device is never given to two replicas;
- a node that offers no devices is a CPU node: it takes any number of
  replicas and pins none;
- a node takes only the stages it offers (``--stages``), and a stage only the
  nodes its config allows (``deployment.stages.<stage>.nodes``);
- among the nodes that fit, the one with the fewest replicas of that stage
  wins (spread), then the one with the most free devices, then by name;
- a stage with no replica running goes first: while one waits for devices
  (its host was lost, say), another replica of a stage that still has one
  running is not given the free devices it would fit in now (:class:`FirstInLine`;
  only free devices are kept, nothing running is stopped for it).

A replica launched with explicit devices (``stage launch --devices 2,3
--node N``) is *pinned*: :meth:`Inventory.plan_launch` checks the request
against the inventory (one line per reason it cannot be done), and every
placement of that replica, its restarts included, takes exactly those devices
of that node or none (it then waits, pending, with the reason).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from omni_actors.messages import NodeInfo, NodeStatus


class PlacementError(RuntimeError):
    """No node can take the replica; the message says what was free."""


class KeptForOthers(PlacementError):
    """The free devices are kept for stages that have no replica running (``first``):
    the replica may be placed once one of those has one, or wants none."""


@dataclass(frozen=True)
class FirstInLine:
    """A stage that has no replica running and wants one: until it has, its
    ``devices`` (per replica) on one of ``allowed`` nodes (empty: any) are kept
    from the other replicas of stages that still have one running. Without it the
    pools' re-placements after a host loss race, and a second Talker could take
    the last device while the only Code2Wav waits (every audio request a 503)."""

    stage: str
    devices: int
    allowed: tuple[str, ...] = ()


#: Largest device id taken (hosts have up to 8-16 GPUs; MIG and multi-host ids stay far below).
MAX_DEVICE_ID = 1023


def _a(word: str) -> str:
    """``word`` after its indefinite article: ``a talker``, ``an ar`` (trial CE read "a ar")."""
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"


def parse_devices(text: str) -> tuple[str, ...]:
    """A device id list (``--devices``, ``runtime.devices``): ``"0, 2,3"`` ->
    ``("0", "2", "3")``, the ids as ``CUDA_VISIBLE_DEVICES`` takes them; blank is
    none (a CPU host).

    Raises:
        ValueError: an empty item (``0,,1``, a trailing comma), an id that is not a
            non-negative integer or is over :data:`MAX_DEVICE_ID`, or an id given twice;
            the message says which.
    """
    if not text.strip():
        return ()
    items = [item.strip() for item in text.split(",")]
    expected = "expected comma-separated non-negative integers such as 0,1"
    if "" in items:
        raise ValueError(f"empty item in {text!r}: {expected}")
    bad = [item for item in items if not re.fullmatch(r"[0-9]+", item)]
    if bad:
        what = "is not a device id" if len(bad) == 1 else "are not device ids"
        raise ValueError(f"{', '.join(map(repr, bad))} {what} in {text!r}: {expected}")
    ids = tuple(str(int(item)) for item in items)
    big = [d for d in ids if int(d) > MAX_DEVICE_ID]
    if big:
        raise ValueError(f"device id {big[0]} in {text!r} is not one a host has (0 to {MAX_DEVICE_ID})")
    twice = sorted({d for d in ids if ids.count(d) > 1}, key=int)
    if twice:
        raise ValueError(f"device{'s' if len(twice) > 1 else ''} {','.join(twice)} given twice in {text!r}")
    return ids


def replica_devices(devices: str | None, index: int, per_replica: int) -> str | None:
    """The devices of the replica in slot ``index`` (its place among the stage's live
    replicas, 0, 1, ...: ``StartEngine.slot``; not its name's index, which grows with every
    replacement) of a stage that runs without placement (its host was started without
    ``--devices``): its share of the stage's ``runtime.devices``, as vLLM-Omni splits a
    stage's devices among its ``num_replicas``. ``per_replica``:
    ``deployment.stages.<stage>.devices_per_replica`` (P).

    - P x k ids (k > 1), a pool: replica ``index`` takes the ``index % k``-th P of them
      (``"1,2"``, P 1: replica 0 ``"1"``, replica 1 ``"2"``);
    - P ids below P, a template: replica ``index`` takes them offset by ``index`` x P
      (``"0,1"``, P 2: replica 1 ``"2,3"``);
    - anything else (``"1"`` for P 1, an id list of another length): every replica takes
      them all, as before (None stays None: the host's own ``CUDA_VISIBLE_DEVICES``).

    A review: a deploy file's ``devices: "1,2"`` with ``num_replicas: 2`` ran both replicas
    on GPU 1 (vLLM-Omni puts one on each)."""
    if devices is None:
        return None
    try:
        ids = parse_devices(str(devices))
    except ValueError:
        return devices  # (checked at load: not here)
    p = max(1, per_replica)
    if len(ids) > p and len(ids) % p == 0:
        k = (index % (len(ids) // p)) * p
        return ",".join(ids[k:k + p])
    if is_device_template(ids, p):
        return ",".join(str(int(d) + index * p) for d in ids)
    return devices


def is_device_template(ids: tuple[str, ...], per_replica: int) -> bool:
    """Whether a stage's device ids are one replica's template (vLLM-Omni's): ``per_replica``
    ids, each below that count, offset by each replica's place (see :func:`replica_devices`)."""
    return len(ids) == per_replica and all(int(d) < per_replica for d in ids)


@dataclass
class Node:
    info: NodeInfo
    alive: bool = True
    down_reason: str = ""  # why it is not alive: LEFT_REASON (it left cleanly), or what was missed
    last_seen: float = field(default_factory=time.monotonic)
    used: dict[str, str] = field(default_factory=dict)  # device -> replica
    replicas: dict[str, str] = field(default_factory=dict)  # replica -> stage
    data_service: str | None = None  # host:port of its data service (from its heartbeats)
    buffers: int | None = None  # its live shared-memory segments (from its heartbeats)
    free_buffers: int | None = None  # its free (recycled) segments, and their bytes
    free_bytes: int | None = None
    leaving: bool = False  # its member stops (it drains): nothing new is placed here
    drained: bool = False  # an operator drained it (`node drain`): nothing new is placed here
    data_service_silent_s: float = 0.0  # its data service has not answered for this long (its heartbeats)

    @property
    def gone(self) -> str:
        """How a node that is not alive went: ``"left"`` (its member stopped cleanly) or
        ``"lost"``; ``"leaving"`` for one that is alive but whose member stops, ``"drained"``
        for one an operator drained."""
        if self.alive:
            return "leaving" if self.leaving else "drained"
        return "left" if self.down_reason == LEFT_REASON else "lost"

    @property
    def open(self) -> bool:
        """Whether new replicas may be placed here: alive, its member not leaving, not drained."""
        return self.alive and not self.leaving and not self.drained

    @property
    def free(self) -> list[str]:
        return [d for d in self.info.devices if d not in self.used]

    def accepts(self, stage: str) -> bool:
        return not self.info.stages or stage in self.info.stages


#: Why a node that left the convention cleanly (its member stopped) is down.
LEFT_REASON = "left the convention"
#: In the reason of a replica drained because its node's member stops (and so not a crash).
LEAVING = "is leaving"


class Inventory:
    """The coordinator's node inventory and who holds what."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}

    def add(self, info: NodeInfo) -> None:
        """A node joined (or came back: what it held before is gone)."""
        self.nodes[info.name] = Node(info)

    def lose(self, name: str, reason: str = "") -> list[str]:
        """A node is gone (``reason``: :data:`LEFT_REASON` when it left cleanly): free
        what it held. Returns the replicas it held."""
        node = self.nodes.get(name)
        if node is None:
            return []
        lost = list(node.replicas)
        node.alive, node.down_reason, node.used, node.replicas = False, reason, {}, {}
        # (what it last reported of its shared memory no longer says anything: unknown; a trial
        # read a left member's free bytes in `status --json`, memory long gone)
        node.buffers = node.free_buffers = node.free_bytes = None
        node.leaving = False  # (it has left, or was lost while it drained)
        return lost

    def drain(self, name: str, operator: bool = False) -> bool:
        """Node ``name``'s member stops cleanly (``operator``: an operator drains it, and
        it may be undrained): nothing new is placed there from now on (what it holds stays
        held until its replicas stop). False if it is not alive."""
        node = self.nodes.get(name)
        if node is None or not node.alive:
            return False
        if operator:
            node.drained = True
        else:
            node.leaving = True
        return True

    def undrain(self, name: str) -> bool:
        """Node ``name``, drained by an operator, takes new replicas again (one that left,
        was lost or is leaving: once a member joins under its name again). False if there
        is no such node or it was not drained so."""
        node = self.nodes.get(name)
        if node is None or not node.drained:
            return False
        node.drained = False
        return True

    def place(self, stage: str, replica: str, devices: int, allowed: tuple[str, ...] = (),
              pin: tuple[str, ...] = (), first: tuple[FirstInLine, ...] = (),
              prefer: tuple = (), reserved: Mapping[tuple[str, str], str] = {}) -> tuple[str, tuple[str, ...]]:
        """Choose ``(node, devices)`` for ``replica``; releases what it held before.

        With ``pin`` (device ids), the replica takes exactly those devices of
        the one node in ``allowed``, or nothing. ``first``: stages with no replica
        running, whose devices this one may not take (a pinned replica ignores it).
        ``prefer``: ``(node, devices)`` where the replica ran before; chosen when that
        node would be a candidate anyway and those devices (``devices`` of them) are
        all free, over the usual order. ``reserved``: ``(node, device) -> replica``, the
        devices pinned to other replicas that are not placed now (:func:`pinned_devices`):
        an unpinned replica does not take them (a review: one took a pinned replica's
        device while that one was down, and it waited for it for good).

        Raises:
            PlacementError: no alive node that accepts the stage has enough free devices
                (pinned: the node is lost, or a pinned device is held by another replica),
                or every node that has them would leave a stage of ``first`` without room.
        """
        self.release(replica)
        if pin:
            return self._place_pinned(stage, replica, allowed[0] if allowed else "", pin)
        # (the devices free for this replica: not those kept for pinned replicas that are down)
        free = {name: [d for d in node.free if reserved.get((name, d), replica) == replica]
                for name, node in self.nodes.items()}
        fits = []
        for node in self.nodes.values():
            if not node.open or not node.accepts(stage) or (allowed and node.info.name not in allowed):
                continue
            if node.info.devices and len(free[node.info.name]) < devices:
                continue
            same_stage = sum(1 for s in node.replicas.values() if s == stage)
            fits.append((same_stage, -len(free[node.info.name]), node.info.name, node))
        if not fits:
            raise PlacementError(self._why_not(stage, replica, devices, allowed, free))
        if first:
            fits = self._leave_room(fits, devices, first, free)
        node = min(fits, key=lambda f: f[:3])[3]
        chosen = tuple(free[node.info.name][:devices]) if node.info.devices else ()
        again = self._again(fits, devices, prefer, free)
        if again is not None:
            node, chosen = again
        for d in chosen:
            node.used[d] = replica
        node.replicas[replica] = stage
        return node.info.name, chosen

    @staticmethod
    def _again(fits: list, devices: int, prefer: tuple, free_of: dict[str, list[str]]):
        """``(node, devices)`` of ``prefer`` if its node is among ``fits`` (candidate rows)
        and, on a node with devices, exactly ``devices`` of them, all free (``free_of``: the
        devices free for it, by node); else None."""
        if len(prefer) != 2:
            return None
        name, wanted = prefer[0], tuple(prefer[1])
        node = next((f[3] for f in fits if f[3].info.name == name), None)
        if node is None:
            return None
        if not node.info.devices:
            return node, ()
        free = set(free_of.get(name, ()))
        if len(wanted) != devices or len(set(wanted)) != devices or not free.issuperset(wanted):
            return None
        return node, wanted

    def _leave_room(self, fits: list, devices: int, first: tuple[FirstInLine, ...],
                    free: dict[str, list[str]]) -> list:
        """The candidate nodes (``fits`` rows) whose taking ``devices`` still lets every
        stage of ``first`` that can be placed now be placed (``free``: the devices free by
        node, less those kept for pinned replicas)."""
        could = self._placeable(first, free)
        ok = [f for f in fits if self._placeable(first, free, f[3].info.name, devices) >= could]
        if ok:
            return ok
        stages = sorted({need.stage for need in first})
        which = (f"stage {stages[0]}, which has" if len(stages) == 1
                 else f"stages {', '.join(stages)}, which have")
        raise KeptForOthers(f"the free devices are kept for {which} no replica running "
                             f"(a stage with none goes first); waiting for more")

    def _placeable(self, first: tuple[FirstInLine, ...], free_of: dict[str, list[str]], taken_on: str = "",
                   taken: int = 0) -> int:
        """How many of ``first`` fit at once (greedily, in order) in the free devices
        (``free_of``, by node), less ``taken`` of them on node ``taken_on``."""
        free = {name: len(free_of[name]) - (taken if name == taken_on else 0)
                for name, n in self.nodes.items() if n.open and n.info.devices}
        placed = 0
        for need in first:
            for name, node in self.nodes.items():
                if not node.open or not node.accepts(need.stage) or (need.allowed and name not in need.allowed):
                    continue
                if not node.info.devices:
                    placed += 1  # a CPU node takes any number
                    break
                if free[name] >= need.devices:
                    free[name] -= need.devices
                    placed += 1
                    break
        return placed

    def _place_pinned(self, stage: str, replica: str, name: str, pin: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
        node = self.nodes.get(name)
        if node is None or not node.open:
            raise PlacementError(f"{replica} is pinned to devices {','.join(pin)} of node {name or '?'}, "
                                 f"which {_is(node.gone) if node is not None else 'is not known'}")
        missing, held = _missing_and_held(node, pin)
        if missing:
            raise PlacementError(f"node {name} no longer offers device(s) {','.join(missing)} "
                                 f"that {replica} is pinned to")
        if held:
            raise PlacementError(f"{replica} is pinned to devices {','.join(pin)} of node {name}; "
                                 f"waiting for device {', '.join(held)}")
        for d in pin:
            node.used[d] = replica
        node.replicas[replica] = stage
        return name, tuple(pin)

    def plan_launch(self, stage: str, replicas: int | None, devices_per_replica: int, *,
                    allowed: tuple[str, ...] = (), node: str = "", devices: tuple[str, ...] = (),
                    reserved: Mapping[tuple[str, str], str] = {}) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """Check a ``stage launch`` that names a node and/or devices; return one
        ``(node, devices)`` pin per new replica (in order; ``devices`` empty when
        only the node is pinned). Nothing is taken yet: each replica takes its pin
        when it is placed.

        ``replicas`` None means ``len(devices) / devices_per_replica`` (1 without devices).
        ``allowed`` is the stage's own node rule (``deployment.stages.<stage>.nodes``).
        ``reserved``: as :meth:`place`'s; such devices are taken (a review: two launches
        pinned to one device at once were both accepted).

        Raises:
            PlacementError: the count does not divide, a device is given twice, is not on the
                node, or is held by another replica; the node is unknown, lost, does not take
                the stage, is outside the stage's node rule, or has no room.
        """
        k = devices_per_replica
        if len(set(devices)) != len(devices):
            twice = sorted({d for d in devices if devices.count(d) > 1})
            raise PlacementError(f"device(s) {','.join(twice)} given twice")
        if devices:
            if len(devices) % k:
                raise PlacementError(f"{len(devices)} device(s) ({','.join(devices)}) do not split into "
                                     f"replicas of {k} device(s) each (devices_per_replica of {stage})")
            if replicas is None:
                replicas = len(devices) // k
            elif replicas * k != len(devices):
                raise PlacementError(f"{replicas} replica(s) of {stage} at {k} device(s) each need "
                                     f"{replicas * k} device(s); --devices gives {len(devices)}")
        replicas = 1 if replicas is None else replicas
        if replicas < 1:
            raise PlacementError("--replicas must be >= 1")
        if not node:
            if not devices:
                return ()  # nothing pinned: placement decides
            node = self._node_offering(stage, devices, allowed)
        n = self.nodes.get(node)
        if n is None:
            known = ", ".join(sorted(self.nodes)) or "none"
            raise PlacementError(f"no node named {node!r} (nodes: {known})")
        if not n.open:
            raise PlacementError(f"node {node} {_is(n.gone)}")
        if not n.accepts(stage):
            raise PlacementError(f"node {node} does not take {stage} (it takes {','.join(n.info.stages)})")
        if allowed and node not in allowed:
            raise PlacementError(f"{stage} may run only on {', '.join(allowed)} "
                                 f"(deployment.stages.{stage}.nodes), not on {node}")
        if devices:
            if not n.info.devices:
                raise PlacementError(f"node {node} offers no devices (a CPU node): drop --devices")
            missing, held = _missing_and_held(n, devices)
            held += [f"{d} (kept for {reserved[(node, d)]}, pinned to it)" for d in devices
                     if d not in n.used and (node, d) in reserved]
            if missing:
                raise PlacementError(f"device(s) {','.join(missing)} not on node {node} "
                                     f"(it offers {','.join(n.info.devices)})")
            if held:
                raise PlacementError(f"device(s) already taken on node {node}: {', '.join(held)}")
            return tuple((node, tuple(devices[i:i + k])) for i in range(0, len(devices), k))
        if n.info.devices and len(n.free) < replicas * k:
            raise PlacementError(f"node {node} has {len(n.free)} free device(s); {replicas} replica(s) of "
                                 f"{stage} need {replicas * k}")
        return tuple((node, ()) for _ in range(replicas))

    def _node_offering(self, stage: str, devices: tuple[str, ...], allowed: tuple[str, ...]) -> str:
        """The one alive node that offers all ``devices`` (device ids repeat across hosts)."""
        offering = [n.info.name for n in self.nodes.values()
                    if n.open and all(d in n.info.devices for d in devices)]
        if len(offering) > 1:
            fit = [name for name in offering if self.nodes[name].accepts(stage) and (not allowed or name in allowed)]
            offering = fit if len(fit) == 1 else offering
        if not offering:
            closed = [n for n in self.nodes.values() if n.alive and all(d in n.info.devices for d in devices)]
            if len(closed) == 1:  # (a review: "no node offers device(s) 6 (...; m2: 4,5,6,7)" of a drained m2)
                raise PlacementError(f"node {closed[0].info.name} {_is(closed[0].gone)}")
            where = "; ".join(f"{n.info.name}: {','.join(n.info.devices) or 'none'}"
                              for n in self.nodes.values() if n.alive) or "no nodes"
            raise PlacementError(f"no node offers device(s) {','.join(devices)} ({where})")
        if len(offering) > 1:
            raise PlacementError(f"device(s) {','.join(devices)} are on several nodes ({', '.join(sorted(offering))}): "
                                 f"say which with --node")
        return offering[0]

    def release(self, replica: str) -> None:
        for node in self.nodes.values():
            if node.replicas.pop(replica, None) is not None:
                node.used = {d: r for d, r in node.used.items() if r != replica}

    def _why_not(self, stage: str, replica: str, devices: int, allowed: tuple[str, ...],
                 free: dict[str, list[str]]) -> str:
        if allowed and all(n not in self.nodes or not self.nodes[n].open for n in allowed):
            # (a replica pinned to its node, or a stage's `nodes` rule: it waits for them, which
            # "no node has N free devices" hid; trials AT, AV: also where they never joined)
            state = {n: self.nodes[n].gone if n in self.nodes else NOT_JOINED for n in allowed}
            # (trial BR: a leader started without --node-name is named after its host; the nodes
            # there are says which names the config's `nodes` could have meant)
            there = ", ".join(n.info.name for n in self.nodes.values() if n.alive) or "none"
            if len(allowed) == 1:
                gone = state[allowed[0]]
                return (f"{replica} may run only on node {allowed[0]}, which "
                        + (f"has not joined: it waits for a member of that name (--node-name; the nodes now: "
                           f"{there})" if gone == NOT_JOINED
                           else f"{_is(gone)}: " + ("it waits for `node undrain`" if gone == "drained" else
                                                    "it waits for the node to come back")))
            gone = ", ".join(f"{n} ({state[n]})" for n in allowed)
            undrain = " (or `node undrain`)" if "drained" in state.values() else ""
            if all(v == NOT_JOINED for v in state.values()):
                return (f"{replica} may run only on nodes {gone}: it waits for a member of one of those names to "
                        f"join (the nodes now: {there})")
            join = " or join" if NOT_JOINED in state.values() else ""
            return f"{replica} may run only on nodes {gone}: it waits for one of them to come back{join}{undrain}"
        seen, takers, drained = [], 0, False
        for node in self.nodes.values():
            if allowed and node.info.name not in allowed:
                continue
            if not node.open:
                drained |= node.gone == "drained"
                seen.append(f"{node.info.name}: {node.gone}")
            elif not node.accepts(stage):
                seen.append(f"{node.info.name}: does not take {stage}")
            else:
                takers += 1
                mine = free[node.info.name]
                kept = len(node.free) - len(mine)  # (kept for pinned replicas that are down)
                seen.append(f"{node.info.name}: {len(mine)} of {len(node.info.devices)} devices free"
                            + (f", {kept} more kept for pinned replicas" if kept else ""))
        where = "; ".join(seen) or ("no node named " + ", ".join(allowed) if allowed else "no nodes")
        if not takers and seen:  # (trial BV: a drained CPU node read "no node has 1 free device(s)")
            undrain = "; `node undrain` gives a drained one back" if drained else ""
            return f"no node takes {_a(stage)} replica now ({where}{undrain})"
        return f"no node has {devices} free device(s) for {_a(stage)} replica ({where})"

    def status(self) -> tuple[NodeStatus, ...]:
        now = time.monotonic()
        return tuple(
            NodeStatus(n.info.name, n.alive, n.info.devices, dict(n.used), n.info.stages,
                       tuple(sorted(n.replicas)), round(now - n.last_seen, 3), n.data_service, n.buffers,
                       n.free_buffers, n.free_bytes, n.down_reason, n.leaving, n.drained,
                       n.data_service_silent_s if n.alive else 0.0)
            for n in sorted(self.nodes.values(), key=lambda n: n.info.name))


#: How :meth:`Inventory._why_not` names an allowed node that has never joined.
NOT_JOINED = "not joined"


def pinned_devices(pins: Iterable[tuple[str, tuple, str]]) -> dict[tuple[str, str], str]:
    """``(node, device) -> replica`` from ``(replica, (node, devices), state)`` rows: the
    devices pinned to replicas (``stage launch --devices``) that are not stopped, for
    :meth:`Inventory.place`'s ``reserved`` (a failed or dead one keeps them while it waits
    to start again)."""
    out: dict[tuple[str, str], str] = {}
    for replica, pin, state in pins:
        if len(pin) == 2 and pin[1] and state != "stopped":
            for d in pin[1]:
                out[(pin[0], d)] = replica
    return out


def _is(gone: str) -> str:
    """``"lost"`` -> ``"is lost"``, ``"left"`` -> ``"has left"``."""
    return "has left" if gone == "left" else f"is {gone}"


def _missing_and_held(node, devices) -> tuple[list[str], list[str]]:
    """Of ``devices``: those ``node`` does not offer, and those another replica
    holds there (as ``"D (held by REPLICA)"``)."""
    return ([d for d in devices if d not in node.info.devices],
            [f"{d} (held by {node.used[d]})" for d in devices if d in node.used])
