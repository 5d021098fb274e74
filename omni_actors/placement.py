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
  wins (spread), then the one with the most free devices, then by name.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from omni_actors.messages import NodeInfo, NodeStatus


class PlacementError(RuntimeError):
    """No node can take the replica; the message says what was free."""


@dataclass
class Node:
    info: NodeInfo
    alive: bool = True
    last_seen: float = field(default_factory=time.monotonic)
    used: dict[str, str] = field(default_factory=dict)  # device -> replica
    replicas: dict[str, str] = field(default_factory=dict)  # replica -> stage

    @property
    def free(self) -> list[str]:
        return [d for d in self.info.devices if d not in self.used]

    def accepts(self, stage: str) -> bool:
        return not self.info.stages or stage in self.info.stages


class Inventory:
    """The coordinator's node inventory and who holds what."""

    def __init__(self) -> None:
        self.nodes: dict[str, Node] = {}

    def add(self, info: NodeInfo) -> None:
        """A node joined (or came back: what it held before is gone)."""
        self.nodes[info.name] = Node(info)

    def lose(self, name: str) -> list[str]:
        """A node is gone: free what it held. Returns the replicas it held."""
        node = self.nodes.get(name)
        if node is None:
            return []
        lost = list(node.replicas)
        node.alive, node.used, node.replicas = False, {}, {}
        return lost

    def place(self, stage: str, replica: str, devices: int, allowed: tuple[str, ...] = ()) -> tuple[str, tuple[str, ...]]:
        """Choose ``(node, devices)`` for ``replica``; releases what it held before.

        Raises:
            PlacementError: no alive node that accepts the stage has enough free devices.
        """
        self.release(replica)
        fits = []
        for node in self.nodes.values():
            if not node.alive or not node.accepts(stage) or (allowed and node.info.name not in allowed):
                continue
            if node.info.devices and len(node.free) < devices:
                continue
            same_stage = sum(1 for s in node.replicas.values() if s == stage)
            fits.append((same_stage, -len(node.free), node.info.name, node))
        if not fits:
            raise PlacementError(self._why_not(stage, devices, allowed))
        node = min(fits, key=lambda f: f[:3])[3]
        chosen = tuple(node.free[:devices]) if node.info.devices else ()
        for d in chosen:
            node.used[d] = replica
        node.replicas[replica] = stage
        return node.info.name, chosen

    def release(self, replica: str) -> None:
        for node in self.nodes.values():
            if node.replicas.pop(replica, None) is not None:
                node.used = {d: r for d, r in node.used.items() if r != replica}

    def _why_not(self, stage: str, devices: int, allowed: tuple[str, ...]) -> str:
        seen = []
        for node in self.nodes.values():
            if allowed and node.info.name not in allowed:
                continue
            if not node.alive:
                seen.append(f"{node.info.name}: lost")
            elif not node.accepts(stage):
                seen.append(f"{node.info.name}: does not take {stage}")
            else:
                seen.append(f"{node.info.name}: {len(node.free)} of {len(node.info.devices)} devices free")
        where = "; ".join(seen) or ("no node named " + ", ".join(allowed) if allowed else "no nodes")
        return f"no node has {devices} free device(s) for a {stage} replica ({where})"

    def status(self) -> tuple[NodeStatus, ...]:
        now = time.monotonic()
        return tuple(
            NodeStatus(n.info.name, n.alive, n.info.devices, dict(n.used), n.info.stages,
                       tuple(sorted(n.replicas)), round(now - n.last_seen, 3))
            for n in sorted(self.nodes.values(), key=lambda n: n.info.name))
