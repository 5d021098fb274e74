"""Placement rules (omni_actors.placement.Inventory), pure: no actors, no processes.

The invariants checked on random sequences: a device is never given to two
replicas, a replica's devices are all on one node (its own), it gets exactly
the devices it asked for on a GPU node and none on a CPU node, and a lost
node holds nothing.
"""

from __future__ import annotations

import random
import re
from types import SimpleNamespace

import pytest

from omni_actors.messages import NodeInfo
from omni_actors.placement import LEFT_REASON, FirstInLine, Inventory, PlacementError


def inventory(*nodes: NodeInfo) -> Inventory:
    inv = Inventory()
    for n in nodes:
        inv.add(n)
    return inv


def holdings(inv: Inventory) -> dict[str, tuple[str, tuple[str, ...]]]:
    """replica -> (node, devices), from the inventory's own books."""
    out: dict[str, tuple[str, list[str]]] = {}
    for name, node in inv.nodes.items():
        for replica in node.replicas:
            assert replica not in out, f"{replica} is on two nodes: {out[replica][0]} and {name}"
            out[replica] = (name, sorted(d for d, r in node.used.items() if r == replica))
    return {r: (n, tuple(d)) for r, (n, d) in out.items()}


def check_invariants(inv: Inventory, given: dict[str, tuple[str, tuple[str, ...]]],
                     wanted: dict[str, int]) -> None:
    """``given``: what place() returned for each replica still held."""
    seen: dict[tuple[str, str], str] = {}
    for replica, (node, devices) in given.items():
        n = inv.nodes[node]
        assert n.alive, f"{replica} is held on lost node {node}"
        assert replica in n.replicas
        if n.info.devices:
            assert len(devices) == wanted[replica], (replica, devices)
            assert len(set(devices)) == len(devices), (replica, devices)
        else:
            assert devices == (), f"a CPU node pinned devices {devices} to {replica}"
        for d in devices:
            assert d in n.info.devices, f"{replica} got {d}, which {node} does not offer"
            assert (node, d) not in seen, f"device {node}:{d} given to {seen[(node, d)]} and {replica}"
            seen[(node, d)] = replica
            assert n.used[d] == replica
    assert holdings(inv) == {r: (n, tuple(sorted(d))) for r, (n, d) in given.items()}
    for name, n in inv.nodes.items():
        assert set(n.used) <= set(n.info.devices)
        assert set(n.used.values()) <= set(n.replicas), f"{name} holds devices for unknown replicas"
        if not n.alive:
            assert not n.used and not n.replicas, f"lost node {name} still holds {n.used} {n.replicas}"


def test_random_place_release_lose_never_overlaps():
    """2000 random operations on 5 nodes (GPU and CPU), TP 1, 2 and 4, a few stage rules."""
    rng = random.Random(1234)
    stages = ("thinker", "talker", "code2wav")
    node_specs = [
        NodeInfo("a", ("0", "1", "2", "3")),
        NodeInfo("b", ("0", "1", "2", "3", "4", "5", "6", "7")),  # same ids as a: (node, id) is the device
        NodeInfo("c", ("4", "5"), stages=("talker",)),
        NodeInfo("d", ("8", "9", "10")),
        NodeInfo("cpu"),
    ]
    inv = inventory(*node_specs)
    given: dict[str, tuple[str, tuple[str, ...]]] = {}
    wanted: dict[str, int] = {}
    placed = refused = lost_nodes = 0
    for step in range(2000):
        op = rng.random()
        if op < 0.55:
            stage = rng.choice(stages)
            replica = f"{stage}/{rng.randrange(12)}"
            tp = rng.choice((1, 1, 2, 4))
            allowed = rng.choice(((), (), ("a", "b"), ("c", "cpu"), ("d",)))
            before = holdings(inv)
            try:
                node, devices = inv.place(stage, replica, tp, allowed)
            except PlacementError as exc:
                refused += 1
                # (no alive node allowed: it says it waits for one)
                article = "an" if stage[0] in "aeiou" else "a"
                assert (f"no node has {tp} free device(s) for {article} {stage} replica" in str(exc)
                        or f"no node takes {article} {stage} replica now" in str(exc)
                        or f"{replica} may run only on node" in str(exc)), str(exc)
                # a refused re-placement still released what the replica held
                given.pop(replica, None)
                before.pop(replica, None)
                assert holdings(inv) == before, "a refused placement changed what others hold"
            else:
                placed += 1
                assert not allowed or node in allowed
                assert inv.nodes[node].accepts(stage)
                given[replica], wanted[replica] = (node, devices), tp
        elif op < 0.85:
            if given:
                replica = rng.choice(sorted(given))
                inv.release(replica)
                given.pop(replica)
        elif op < 0.93:
            name = rng.choice(node_specs).name
            was_alive = inv.nodes[name].alive
            held = sorted(r for r, (n, _) in given.items() if n == name)
            lost = inv.lose(name)
            assert sorted(lost) == (held if was_alive else [])
            for r in held:
                given.pop(r)
            lost_nodes += 1
        else:
            spec = rng.choice(node_specs)
            if not inv.nodes[spec.name].alive:
                inv.add(spec)  # it came back: empty
        check_invariants(inv, given, wanted)
    assert placed > 300 and refused > 50 and lost_nodes > 50, (placed, refused, lost_nodes)


def test_fill_every_device_then_refuse():
    inv = inventory(NodeInfo("m1", ("0", "1", "2")), NodeInfo("m2", ("3", "4", "5")))
    got = [inv.place("talker", f"talker/{i}", 1) for i in range(6)]
    assert sorted(d for _, ds in got for d in ds) == ["0", "1", "2", "3", "4", "5"]
    with pytest.raises(PlacementError) as err:
        inv.place("talker", "talker/6", 1)
    assert str(err.value) == ("no node has 1 free device(s) for a talker replica "
                              "(m1: 0 of 3 devices free; m2: 0 of 3 devices free)")
    inv.release("talker/4")
    node, devices = inv.place("talker", "talker/6", 1)
    assert (node, devices) == got[4]  # the one freed, nothing else


def test_tp4_takes_four_devices_on_one_node():
    inv = inventory(NodeInfo("m1", ("0", "1", "2")), NodeInfo("m2", ("3", "4", "5", "6", "7")))
    node, devices = inv.place("dit", "dit/0", 4)
    assert node == "m2" and devices == ("3", "4", "5", "6")
    assert inv.nodes["m2"].free == ["7"]


def test_tp4_is_refused_when_no_single_node_has_four_free_even_if_the_total_does():
    inv = inventory(NodeInfo("m1", ("0", "1", "2")), NodeInfo("m2", ("3", "4", "5")))
    assert sum(len(n.free) for n in inv.nodes.values()) == 6
    with pytest.raises(PlacementError) as err:
        inv.place("dit", "dit/0", 4)
    message = str(err.value)
    assert message.startswith("no node has 4 free device(s) for a dit replica")
    assert "m1: 3 of 3 devices free" in message and "m2: 3 of 3 devices free" in message
    assert all(not n.used and not n.replicas for n in inv.nodes.values())  # nothing half-taken


def test_tp4_after_fragmentation():
    """Two TP1 replicas on an 8-device node leave 6: one TP4 fits, a second does not."""
    inv = inventory(NodeInfo("big", tuple(str(i) for i in range(8))))
    inv.place("talker", "talker/0", 1)
    inv.place("talker", "talker/1", 1)
    node, devices = inv.place("ar", "ar/0", 4)
    assert node == "big" and len(devices) == 4 and not {"0", "1"} & set(devices)
    with pytest.raises(PlacementError, match=r"big: 2 of 8 devices free"):
        inv.place("ar", "ar/1", 4)


def test_error_names_lost_nodes_filtered_nodes_and_empty_inventories():
    inv = inventory(NodeInfo("m1", ("0",)), NodeInfo("m2", ("1",), stages=("talker",)), NodeInfo("m3", ("2",)))
    inv.place("code2wav", "code2wav/0", 1)  # on m1 or m3
    inv.place("code2wav", "code2wav/1", 1)
    inv.lose("m3")
    with pytest.raises(PlacementError) as err:
        inv.place("code2wav", "code2wav/2", 1)
    assert "m2: does not take code2wav" in str(err.value)
    assert "m3: lost" in str(err.value)
    assert "m1: 0 of 1 devices free" in str(err.value)
    # (trial AV: `nodes: [no-such-node]` read "no node has 1 free device(s) ... (no node named ...)")
    with pytest.raises(PlacementError) as err:
        inv.place("talker", "talker/0", 1, ("gpu9",))
    assert str(err.value) == ("talker/0 may run only on node gpu9, which has not joined: it waits for a member of "
                              "that name (--node-name; the nodes now: m1, m2)")  # (trial BR: which names there are)
    with pytest.raises(PlacementError, match=r"\(no nodes\)"):
        Inventory().place("talker", "talker/0", 1)


def test_node_stage_filter_is_honoured():
    inv = inventory(NodeInfo("talkers", ("0", "1"), stages=("talker",)), NodeInfo("any", ("2",)))
    assert inv.place("code2wav", "code2wav/0", 1) == ("any", ("2",))
    with pytest.raises(PlacementError, match="talkers: does not take code2wav"):
        inv.place("code2wav", "code2wav/1", 1)
    assert inv.place("talker", "talker/0", 1)[0] == "talkers"


def test_allowed_nodes_rule_is_honoured():
    inv = inventory(NodeInfo("leader", ("0", "1", "2", "3")), NodeInfo("m1", ("4",)), NodeInfo("m2", ("5",)))
    for i in range(2):
        node, _ = inv.place("talker", f"talker/{i}", 1, ("m1", "m2"))
        assert node in ("m1", "m2")
    with pytest.raises(PlacementError) as err:  # the leader has 4 free, but is not allowed
        inv.place("talker", "talker/2", 1, ("m1", "m2"))
    assert "leader" not in str(err.value)
    assert inv.place("thinker", "thinker/0", 1, ("leader",))[0] == "leader"


def test_lost_node_frees_its_devices_and_reports_its_replicas():
    inv = inventory(NodeInfo("m1", ("0", "1", "2", "3")), NodeInfo("m2", ("4", "5", "6", "7")))
    placed = {f"talker/{i}": inv.place("talker", f"talker/{i}", 1) for i in range(4)}
    on_m2 = sorted(r for r, (n, _) in placed.items() if n == "m2")
    assert len(on_m2) == 2  # spread
    m2 = inv.nodes["m2"]
    m2.data_service, m2.buffers, m2.free_buffers, m2.free_bytes = "127.0.0.1:4000", 0, 1, 4 << 20
    assert sorted(inv.lose("m2")) == on_m2
    assert inv.lose("m2") == []  # lost once
    assert inv.lose("nosuch") == []
    status = {s.name: s for s in inv.status()}
    assert status["m2"].alive is False and status["m2"].used == {} and status["m2"].replicas == ()
    # what it last said of its shared memory is unknown now (a trial read a left member's free
    # bytes in `status --json`); its data service's address stays (who was there)
    assert (status["m2"].buffers, status["m2"].free_buffers, status["m2"].free_bytes) == (None, None, None)
    assert status["m2"].data_service == "127.0.0.1:4000"
    # the lost replicas are re-placed on what is left
    for r in on_m2:
        assert inv.place("talker", r, 1)[0] == "m1"
    assert len(inv.nodes["m1"].free) == 0
    # m2 comes back, empty, and takes work again
    inv.add(NodeInfo("m2", ("4", "5", "6", "7")))
    assert inv.place("talker", "talker/4", 1) == ("m2", ("4",))


def test_rejoined_node_offers_its_new_device_list():
    inv = inventory(NodeInfo("m1", ("0", "1")))
    inv.place("talker", "talker/0", 2)
    inv.lose("m1")
    inv.add(NodeInfo("m1", ("2", "3", "4")))
    assert inv.place("talker", "talker/0", 3) == ("m1", ("2", "3", "4"))


def test_cpu_nodes_take_any_number_of_replicas_and_pin_nothing():
    inv = inventory(NodeInfo("cpu"))
    for i in range(50):
        assert inv.place("talker", f"talker/{i}", 4) == ("cpu", ())  # TP is ignored on a CPU node
    assert len(inv.nodes["cpu"].replicas) == 50
    inv.release("talker/7")
    assert len(inv.nodes["cpu"].replicas) == 49


def test_spread_prefers_the_node_with_fewer_replicas_of_the_stage():
    inv = inventory(NodeInfo("m1", ("0", "1", "2", "3")), NodeInfo("m2", ("4", "5", "6", "7")))
    nodes = [inv.place("talker", f"talker/{i}", 1)[0] for i in range(4)]
    assert sorted(nodes) == ["m1", "m1", "m2", "m2"]
    # code2wav spreads by its own count: it does not avoid the talkers' nodes
    nodes = [inv.place("code2wav", f"code2wav/{i}", 1)[0] for i in range(2)]
    assert sorted(nodes) == ["m1", "m2"]


def test_spread_ties_go_to_most_free_devices_then_name():
    inv = inventory(NodeInfo("b", ("0", "1")), NodeInfo("a", ("2", "3")), NodeInfo("c", ("4", "5", "6")))
    assert inv.place("talker", "talker/0", 1)[0] == "c"  # most free
    assert inv.place("code2wav", "code2wav/0", 1)[0] == "a"  # a, b, c all 2 free: by name
    assert inv.place("code2wav", "code2wav/1", 1)[0] == "b"  # b and c tie (no code2wav, 2 free): by name


def test_spread_beats_free_devices():
    inv = inventory(NodeInfo("big", tuple(str(i) for i in range(8))), NodeInfo("small", ("8", "9")))
    assert inv.place("talker", "talker/0", 1)[0] == "big"  # most free
    assert inv.place("talker", "talker/1", 1)[0] == "small"  # 7 free on big, but it has a talker already


def test_spread_with_a_cpu_node():
    inv = inventory(NodeInfo("cpu"), NodeInfo("gpu", ("0",)))
    nodes = [inv.place("talker", f"talker/{i}", 1)[0] for i in range(4)]
    assert nodes.count("gpu") == 1 and nodes.count("cpu") == 3  # gpu full after one


def test_placing_again_releases_what_the_replica_held():
    inv = inventory(NodeInfo("m1", ("0", "1")))
    assert inv.place("talker", "talker/0", 1) == ("m1", ("0",))
    assert inv.place("talker", "talker/0", 2) == ("m1", ("0", "1"))  # its old device counts as free
    assert inv.nodes["m1"].used == {"0": "talker/0", "1": "talker/0"}
    inv.release("talker/0")
    inv.release("talker/0")  # twice: harmless
    assert inv.nodes["m1"].used == {} and inv.nodes["m1"].replicas == {}


def test_status_shows_who_holds_what():
    inv = inventory(NodeInfo("m2", ("3", "4")), NodeInfo("m1", ("0",)))
    inv.place("talker", "talker/0", 1, ("m1",))
    inv.place("dit", "dit/0", 2, ("m2",))
    status = inv.status()
    assert [s.name for s in status] == ["m1", "m2"]
    assert status[0].used == {"0": "talker/0"} and status[0].replicas == ("talker/0",)
    assert status[1].used == {"3": "dit/0", "4": "dit/0"} and status[1].alive
    assert status[1].last_seen_age_s is not None and status[1].last_seen_age_s >= 0


# -- stage launch --node / --devices (pinned replicas) ---------------------------------------------
def test_launch_with_devices_splits_them_per_replica_on_the_node_that_offers_them():
    inv = inventory(NodeInfo("m1", ("0", "1", "2", "3")), NodeInfo("m2", ("4", "5", "6", "7")))
    assert inv.plan_launch("talker", None, 1, devices=("5", "6")) == (("m2", ("5",)), ("m2", ("6",)))
    assert inv.plan_launch("dit", None, 2, devices=("0", "1", "2", "3")) == (("m1", ("0", "1")), ("m1", ("2", "3")))
    assert inv.plan_launch("dit", 2, 2, node="m2", devices=("7", "6", "5", "4")) == (
        ("m2", ("7", "6")), ("m2", ("5", "4")))  # in the order given
    # the pins are taken by placement, exactly, and kept by the replica's next placement (a restart)
    for i, (node, devs) in enumerate(inv.plan_launch("talker", None, 1, devices=("5", "6"))):
        assert inv.place("talker", f"talker/{i}", 1, (node,), pin=devs) == (node, devs)
    assert inv.place("talker", "talker/1", 1, ("m2",), pin=("6",)) == ("m2", ("6",))
    assert holdings(inv) == {"talker/0": ("m2", ("5",)), "talker/1": ("m2", ("6",))}


def test_launch_errors_are_one_clear_line_each():
    inv = inventory(NodeInfo("m1", ("0", "1", "2", "3")), NodeInfo("m2", ("0", "1")),
                    NodeInfo("cpu"), NodeInfo("talkers", ("8",), stages=("talker",)))
    inv.place("talker", "talker/0", 1, ("m1",), pin=("2",))
    cases = [
        (dict(replicas=None, k=2, devices=("0", "1", "3")), r"3 device\(s\) \(0,1,3\) do not split into replicas of 2"),
        (dict(replicas=2, k=1, devices=("0",)), r"2 replica\(s\) of talker at 1 device\(s\) each need 2 device\(s\); "
                                                r"--devices gives 1"),
        (dict(replicas=None, k=1, devices=("1", "1")), r"device\(s\) 1 given twice"),
        (dict(replicas=None, k=1, devices=("0",)),
         r"device\(s\) 0 are on several nodes \(m1, m2\): say which with --node"),
        (dict(replicas=None, k=1, devices=("9",)), r"no node offers device\(s\) 9 \(m1: 0,1,2,3; m2: 0,1; cpu: none"),
        (dict(replicas=None, k=1, devices=("5",), node="m2"), r"device\(s\) 5 not on node m2 \(it offers 0,1\)"),
        (dict(replicas=None, k=1, devices=("2", "3"), node="m1"), r"already taken on node m1: 2 \(held by talker/0\)"),
        (dict(replicas=None, k=1, devices=("0",), node="cpu"), r"node cpu offers no devices"),
        (dict(replicas=1, k=1, node="nope"), r"no node named 'nope' \(nodes: cpu, m1, m2, talkers\)"),
        (dict(replicas=3, k=1, node="m2"), r"node m2 has 2 free device\(s\); 3 replica\(s\) of talker need 3"),
    ]
    for kw, pattern in cases:
        with pytest.raises(PlacementError, match=pattern):
            inv.plan_launch("talker", kw["replicas"], kw["k"], node=kw.get("node", ""), devices=kw.get("devices", ()))
    with pytest.raises(PlacementError, match="node talkers does not take code2wav"):
        inv.plan_launch("code2wav", 1, 1, node="talkers")
    with pytest.raises(PlacementError,
                       match=r"talker may run only on m2 \(deployment.stages.talker.nodes\), not on m1"):
        inv.plan_launch("talker", 1, 1, allowed=("m2",), node="m1")
    inv.lose("m2")
    with pytest.raises(PlacementError, match="node m2 is lost"):
        inv.plan_launch("talker", 1, 1, node="m2")
    # devices that repeat across hosts: a lost host does not count, so m1 is the only one
    assert inv.plan_launch("talker", None, 1, devices=("0",)) == (("m1", ("0",)),)


def test_launch_on_a_node_only_pins_the_node_and_cpu_nodes_take_any_number():
    inv = inventory(NodeInfo("m1", ("0", "1")), NodeInfo("cpu"))
    assert inv.plan_launch("talker", 2, 1, node="m1") == (("m1", ()), ("m1", ()))
    assert inv.plan_launch("talker", 5, 1, node="cpu") == (("cpu", ()),) * 5
    assert inv.plan_launch("talker", 3, 1) == ()  # nothing named: placement decides
    assert inv.place("talker", "talker/0", 1, ("cpu",)) == ("cpu", ())


def test_a_pinned_replica_waits_for_its_own_devices_and_node():
    inv = inventory(NodeInfo("m1", ("0", "1")), NodeInfo("m2", ("2", "3")))
    inv.place("talker", "talker/0", 1, ("m1",), pin=("0",))
    with pytest.raises(PlacementError, match=r"talker/1 is pinned to devices 0 of node m1; waiting for device "
                                             r"0 \(held by talker/0\)"):
        inv.place("talker", "talker/1", 1, ("m1",), pin=("0",))
    assert holdings(inv) == {"talker/0": ("m1", ("0",))}  # a refused placement holds nothing
    inv.lose("m1")
    with pytest.raises(PlacementError, match="pinned to devices 0 of node m1, which is lost"):
        inv.place("talker", "talker/0", 1, ("m1",), pin=("0",))
    inv.add(NodeInfo("m1", ("0", "1")))  # back: the pinned replica returns to its device
    assert inv.place("talker", "talker/0", 1, ("m1",), pin=("0",)) == ("m1", ("0",))
    inv.add(NodeInfo("m1", ("1",)))  # back without device 0
    with pytest.raises(PlacementError, match=r"node m1 no longer offers device\(s\) 0 that talker/0 is pinned to"):
        inv.place("talker", "talker/0", 1, ("m1",), pin=("0",))


def test_a_replica_allowed_only_on_nodes_that_are_gone_or_leaving_says_it_waits_for_them():
    """(It said "no node has 1 free device(s) ... (m2: lost)" while other nodes had room.)"""
    inv = inventory(NodeInfo("m1", ("0", "1")), NodeInfo("m2", ("2", "3")), NodeInfo("m3", ("4",)))
    inv.lose("m2", "missed 3 heartbeats")
    with pytest.raises(PlacementError) as err:
        inv.place("code2wav", "code2wav/1", 1, ("m2",))
    assert str(err.value) == "code2wav/1 may run only on node m2, which is lost: it waits for the node to come back"
    assert inv.drain("m3") and not inv.drain("m2")
    with pytest.raises(PlacementError, match=r"only on nodes m2 \(lost\), m3 \(leaving\): it waits for one of them"):
        inv.place("code2wav", "code2wav/1", 1, ("m2", "m3"))
    # a leaving node takes nothing new, pinned or not; the others still do
    assert inv.place("talker", "talker/0", 1)[0] == "m1"
    assert inv.place("talker", "talker/1", 1)[0] == "m1"
    with pytest.raises(PlacementError, match=r"m3: leaving"):
        inv.place("talker", "talker/2", 1)
    with pytest.raises(PlacementError, match="of node m3, which is leaving"):
        inv.place("talker", "talker/2", 1, ("m3",), pin=("4",))
    with pytest.raises(PlacementError, match="node m3 is leaving"):
        inv.plan_launch("talker", 1, 1, node="m3")
    assert {n.name: n.state for n in inv.status()} == {"m1": "alive", "m2": "lost", "m3": "leaving"}
    # (trial AT: with one of its nodes never joined, it read "no node has 1 free device(s) ... (m2: lost)")
    with pytest.raises(PlacementError) as err:
        inv.place("code2wav", "code2wav/1", 1, ("m2", "m9"))
    assert str(err.value) == ("code2wav/1 may run only on nodes m2 (lost), m9 (not joined): it waits for one of them "
                              "to come back or join")


def test_status_and_the_shell_name_a_leaving_node():
    """`status` and the shell's `nodes` labelled only nodes that were down: a leaving one (alive,
    draining) looked like any other, though `status --json` said `leaving`."""
    import io

    from omni_actors.messages import PoolState, ReplicaState, ReplicaStatus, SystemStatus
    from omni_actors.system.leader import print_status_table
    from omni_actors.system.shell import AdminShell

    inv = inventory(NodeInfo("leader"), NodeInfo("m1", ("0",)), NodeInfo("m2", ("1",)))
    assert inv.place("talker", "talker/0", 1, ("m2",)) == ("m2", ("1",))
    inv.drain("m2")
    inv.lose("m1", LEFT_REASON)
    status = SystemStatus("q", "m", True, (PoolState(1, "talker", (
        ReplicaStatus("talker/0", ReplicaState.DRAINING, node="m2", devices="1"),
        ReplicaStatus("talker/1", ReplicaState.PENDING, pin=("m1", ())),
        ReplicaStatus("talker/2", ReplicaState.PENDING))),), nodes=inv.status())
    out = io.StringIO()
    print_status_table(status, out)
    # (free devices too: trial AY could not tell from `status` where room was left)
    assert "nodes: leader, m1 (LEFT), m2 (LEAVING, 0 of 1 devices free)" in out.getvalue(), out.getvalue()

    class Admin:
        leader_port = None

        def status(self, timeout_s=5.0):
            return status

    shell_out = io.StringIO()
    AdminShell(Admin(), 1900, stdout=shell_out).onecmd("nodes")
    text = shell_out.getvalue()
    assert "m2 LEAVING: 1 replicas" in text and "m1 LEFT: 1 replicas" in text, text  # (talker/1 waits for m1)
    # A node that is gone offers nothing (a trial read "devices 1 (1 free)" on a LOST node), and
    # the replicas not placed yet are no CPU host.
    assert "m1 LEFT: 1 replicas, 0 ready, devices 0 (none offered while it is left)" in text, text
    assert "m2 LEAVING: 1 replicas, 0 ready, devices 1 (0 free)" in text, text
    assert "(not placed yet): 1 replicas, 0 ready, waiting for placement (`replicas` says why)" in text, text


def test_a_refusal_where_no_node_takes_the_stage_says_so_not_that_devices_are_short():
    """Trial BV: with the only node, a CPU host, drained, a replica waited with "no node has
    1 free device(s) for a thinker replica (vm: drained)": the node offers no devices at all."""
    inv = inventory(NodeInfo("vm"))
    inv.drain("vm", operator=True)
    with pytest.raises(PlacementError) as err:
        inv.place("thinker", "thinker/1", 1)
    assert str(err.value) == ("no node takes a thinker replica now (vm: drained; `node undrain` gives a drained "
                              "one back)")


def test_the_status_table_labels_a_node_whose_data_service_is_silent():
    """Trial BX: a node whose data service does not answer looked like any other in `status`."""
    import dataclasses
    import io

    from omni_actors.messages import SystemStatus
    from omni_actors.system.leader import print_status_table

    inv = inventory(NodeInfo("leader"), NodeInfo("m1", ("0",)))
    nodes = tuple(dataclasses.replace(n, data_service_silent_s=4.2 if n.name == "m1" else 0.0) for n in inv.status())
    out = io.StringIO()
    print_status_table(SystemStatus("q", "m", True, (), nodes=nodes), out)
    assert "nodes: leader, m1 (1 of 1 devices free, DATA SERVICE SILENT 4.2 s)" in out.getvalue(), out.getvalue()


def test_the_shell_puts_the_control_plane_under_the_leaders_node_and_counts_ready_as_status_does(monkeypatch):
    """A review: the shell's `nodes` took the leader to be the node named as this machine, else
    the first by name: with `--node-name leader` beside a member `gpu1`, the coordinator and
    pools were listed under gpu1. Its `stages` counted a lingering replica READY while the last
    line said NOT READY, and said "ready" with the leader killed (its `status` said NOT SERVING);
    a failed replica showed its old devices."""
    import io

    from omni_actors.messages import PoolState, ReplicaState, ReplicaStatus, SystemStatus
    from omni_actors.system import admin
    from omni_actors.system.shell import AdminShell

    inv = inventory(NodeInfo("leader"), NodeInfo("gpu1", ("0", "1")))
    status = SystemStatus("q", "m", False, (PoolState(1, "talker", (
        ReplicaStatus("talker/0", ReplicaState.READY, node="gpu1", devices="0", lingering=True),
        ReplicaStatus("talker/1", ReplicaState.FAILED, node="gpu1", devices="1"))),),
        coordinator_pid=42, nodes=inv.status(), leader_node="leader")

    class Admin:
        leader_port = None

        def status(self, timeout_s=5.0):
            return status

    monkeypatch.setattr(admin, "leader_api", lambda port: SimpleNamespace(down=True, stopping=False, frozen=False))
    out = io.StringIO()
    shell = AdminShell(Admin(), 1900, stdout=out)
    shell.onecmd("nodes")
    text = out.getvalue()
    assert text.startswith("leader (admin port 1900, control plane): 0 replicas"), text
    assert "gpu1: 2 replicas" in text and "coordinator" in text.split("gpu1")[0], text
    assert re.search(r"talker/1 +failed +- +-\n", text), text  # (its devices are no longer held)
    out.truncate(0)
    out.seek(0)
    shell.onecmd("stages")
    lines = out.getvalue().splitlines()
    assert lines[1].split()[:5] == ["talker", "1", "-", "0", "1"], lines  # (READY 0: it lingers; LIVE 1)
    assert lines[-1] == ("model m: NOT SERVING (its stages are not ready, but its leader is not running: the HTTP "
                         "API is down)"), lines


def test_a_stage_with_no_replica_running_goes_first_for_the_last_devices():
    """Trial: after a host loss the Talker's replacement took the last free device and
    the only Code2Wav waited (every audio request a 503). A stage in ``first`` keeps
    the devices it needs; a node that leaves them is still used; a stage in ``first``
    that cannot be placed anyway keeps nothing."""
    inv = inventory(NodeInfo("m1", ("0", "1")), NodeInfo("m2", ("2",)))
    inv.place("talker", "talker/0", 1)  # m1 (spread: most free)
    need = (FirstInLine("code2wav", 1),)
    assert inv.place("talker", "talker/1", 1, first=need)[0] == "m2"  # one free on each node: room left
    with pytest.raises(PlacementError) as err:
        inv.place("talker", "talker/2", 1, first=need)
    assert str(err.value) == ("the free devices are kept for stage code2wav, which has no replica running "
                              "(a stage with none goes first); waiting for more")
    assert "talker/2" not in {r for n in inv.nodes.values() for r in n.replicas}  # nothing half-taken
    assert inv.place("code2wav", "code2wav/0", 1)[1]  # and the stage that goes first gets it
    # A first stage that cannot fit anywhere (TP2, or only on a lost node) holds nothing back:
    inv = inventory(NodeInfo("m1", ("0",)), NodeInfo("m2", ("1",)))
    inv.place("talker", "talker/0", 1)
    assert inv.place("talker", "talker/1", 1, first=(FirstInLine("dit", 2),))[0] == "m2"
    inv = inventory(NodeInfo("m1", ("0", "1")), NodeInfo("m3", ("2",)))
    inv.lose("m3")
    inv.place("talker", "talker/0", 1)
    assert inv.place("talker", "talker/1", 1, first=(FirstInLine("code2wav", 1, ("m3",)),))[0] == "m1"
    # Two first stages and two free devices: the second-last is not given away either.
    inv = inventory(NodeInfo("m1", ("0", "1", "2")))
    inv.place("talker", "talker/0", 1)
    with pytest.raises(PlacementError, match="kept for stages code2wav, thinker"):
        inv.place("talker", "talker/1", 1, first=(FirstInLine("thinker", 1), FirstInLine("code2wav", 1)))
    # A CPU node takes any number: nothing to keep.
    inv = inventory(NodeInfo("cpu"))
    assert inv.place("talker", "talker/1", 1, first=need)[0] == "cpu"


def test_a_replica_goes_back_to_the_devices_it_ran_on_when_they_are_free():
    """A recreated coordinator's inventory starts empty: without ``prefer`` the replicas land
    in a new order, each new engine then waiting for another replica's old engine (trial AK)."""
    def fresh() -> Inventory:
        return inventory(NodeInfo("a", ("0", "1", "2", "3")), NodeInfo("b", ("4", "5")))

    assert fresh().place("talker", "talker/0", 1) == ("a", ("0",))  # (the usual order)
    assert fresh().place("talker", "talker/0", 1, prefer=("a", ("2",))) == ("a", ("2",))
    assert fresh().place("talker", "talker/0", 1, prefer=("b", ("5",))) == ("b", ("5",))
    assert fresh().place("thinker", "thinker/0", 2, prefer=("a", ("3", "1"))) == ("a", ("3", "1"))
    # the wrong count, a device the node does not offer, a node it may not use or that is gone:
    # placed as usual
    assert fresh().place("talker", "talker/0", 1, prefer=("b", ("4", "5"))) == ("a", ("0",))
    assert fresh().place("talker", "talker/0", 1, prefer=("a", ("7",))) == ("a", ("0",))
    assert fresh().place("talker", "talker/0", 1, ("b",), prefer=("a", ("2",))) == ("b", ("4",))
    inv = fresh()
    inv.lose("b", "lost")
    assert inv.place("talker", "talker/0", 1, prefer=("b", ("5",))) == ("a", ("0",))
    # taken by another replica since: placed as usual
    inv = fresh()
    assert inv.place("talker", "talker/0", 1, prefer=("a", ("2",))) == ("a", ("2",))
    assert inv.place("talker", "talker/1", 1, prefer=("a", ("2",))) == ("b", ("4",))
    # a CPU node: the node alone
    cpu = inventory(NodeInfo("x"), NodeInfo("y"))
    assert cpu.place("talker", "talker/0", 1, prefer=("y", ("0",))) == ("y", ())


def test_the_devices_cell_says_which_devices_a_pinned_replica_waits_for():
    from omni_actors.messages import ReplicaState, ReplicaStatus

    def cell(state, devices="", pin=()):
        return ReplicaStatus("talker/3", state, devices=devices, pin=pin).devices_label()

    assert cell(ReplicaState.READY, "2") == "2"
    assert cell(ReplicaState.READY, "2", ("m1", ("2",))) == "2 (pinned)"
    # pending on a lost node (a trial read "- (pinned)", with nothing saying which devices)
    assert cell(ReplicaState.PENDING, "", ("m1", ("6", "7"))) == "- (pinned to 6,7)"
    assert cell(ReplicaState.FAILED, "6", ("m1", ("6",))) == "- (pinned to 6)"
    assert cell(ReplicaState.PENDING, "", ("m1", ())) == "- (node pinned)"
    assert cell(ReplicaState.STOPPED, "2") == "-"


def test_the_status_table_shows_each_engines_running_and_waiting_requests():
    """Trial AU: `status` had only IN_FLIGHT (the pool's tasks); to see an abort reach the engine
    a user read /v1/stages. RUN/WAIT is the engine's own count, from its last heartbeat."""
    import io

    from omni_actors.messages import PoolState, ReplicaState, ReplicaStatus, SystemStatus
    from omni_actors.system.leader import print_status_table

    status = SystemStatus("q", "m", True, (PoolState(0, "thinker", (
        ReplicaStatus("thinker/0", ReplicaState.READY, in_flight=3, running=2, waiting=1, pid=41),
        ReplicaStatus("thinker/1", ReplicaState.PENDING, reason="no node has room"))),))
    out = io.StringIO()
    print_status_table(status, out)
    header, busy, pending = (line.split() for line in out.getvalue().splitlines()[:3])
    assert header[6:8] == ["IN_FLIGHT", "RUN/WAIT"] and busy[6:8] == ["3", "2/1"], out.getvalue()
    assert pending[1:3] == ["thinker/1", "pending"] and pending[7] == "-", out.getvalue()


def test_a_drained_node_that_left_says_it_stays_drained_and_a_drain_warning_names_every_drained_node():
    """Trial BK: a drained node whose member stopped read `LEFT`, with no hint that it stays
    drained; after `node drain` of m1 then m2, the warning said "while node m2 is drained"."""
    import io

    from omni_actors.balancing import stages_left_without_replicas
    from omni_actors.messages import PoolState, ReplicaState, ReplicaStatus, SystemStatus
    from omni_actors.system.leader import print_status_table

    inv = inventory(NodeInfo("leader"), NodeInfo("m1", ("0",)), NodeInfo("m2", ("1",)), NodeInfo("m3", ("2",)))
    inv.drain("m1", operator=True)
    inv.drain("m2", operator=True)
    before = SystemStatus("q", "m", True, (PoolState(1, "talker", (
        ReplicaStatus("talker/0", ReplicaState.READY, node="m2", devices="1"),)),), nodes=inv.status())
    after = SystemStatus("q", "m", False, (PoolState(1, "talker", (
        ReplicaStatus("talker/0", ReplicaState.STOPPED, node="m2"),
        ReplicaStatus("talker/1", ReplicaState.PENDING, reason="no room"))),), nodes=inv.status())
    [(stage, line)] = stages_left_without_replicas(after, "m2", before, drained=True)
    assert "has no replica running while nodes m2, m1 are drained (" in line, line
    inv.lose("m1", LEFT_REASON)
    out = io.StringIO()
    print_status_table(SystemStatus("q", "m", True, (), nodes=inv.status()), out)
    assert "m1 (LEFT, still drained: `node undrain`)" in out.getvalue(), out.getvalue()


@pytest.mark.parametrize("devices, per_replica, expected", [
    ("1,2", 1, ["1", "2", "1"]),            # a pool of 2 x 1: one each (a third wraps round)
    ("1,2,3,4", 2, ["1,2", "3,4"]),         # a pool of 2 x 2
    ("0,1", 2, ["0,1", "2,3", "4,5"]),      # a template of 2: offset by the replica's index x 2
    ("0", 1, ["0", "1", "2"]),              # a template of 1
    ("1", 1, ["1", "1"]),                   # neither: every replica's (the CPU demo's Talkers)
    ("0,1,2", 2, ["0,1,2", "0,1,2"]),       # neither
    (None, 1, [None, None]),                # none: the host's own CUDA_VISIBLE_DEVICES
])
def test_a_stages_runtime_devices_are_shared_out_among_its_replicas(devices, per_replica, expected):
    """A review: a vLLM-Omni deploy file's stage with `devices: "1,2"` and `num_replicas: 2`, on a
    host started without --devices, ran both replicas on GPU 1; vLLM-Omni gives each one."""
    from omni_actors.placement import replica_devices

    assert [replica_devices(devices, i, per_replica) for i in range(len(expected))] == expected


def test_a_launch_on_a_drained_nodes_devices_says_the_node_is_drained():
    """A review: `stage launch --devices 6` with m2 drained read "no node offers device(s) 6
    (m1: 0,1; m2: 4,5,6,7)"."""
    inv = inventory(NodeInfo("m1", ("0", "1")), NodeInfo("m2", ("4", "5", "6", "7")))
    inv.drain("m2", operator=True)
    with pytest.raises(PlacementError, match=r"^node m2 is drained$"):
        inv.plan_launch("talker", None, 1, devices=("6",))


def test_devices_kept_for_a_pinned_replica_are_not_counted_free_for_a_stage_first_in_line():
    """A diff review: with GPU 2 kept for a pinned Talker that is down, an unpinned Talker
    took GPU 1, the last device free for Code2Wav (which had none running and is first in
    line), because the first-in-line count took the kept device for free; and the refusal
    said "1 of 3 devices free" of a node with none free for it."""
    inv = inventory(NodeInfo("m1", ("0", "1", "2")))
    inv.place("thinker", "thinker/0", 1)
    kept = {("m1", "2"): "talker/0"}
    with pytest.raises(PlacementError, match="kept for stage code2wav"):
        inv.place("talker", "talker/1", 1, first=(FirstInLine("code2wav", 1, ()),), reserved=kept)
    assert inv.place("code2wav", "code2wav/0", 1, reserved=kept) == ("m1", ("1",))
    with pytest.raises(PlacementError) as err:
        inv.place("talker", "talker/1", 1, reserved=kept)
    assert "(m1: 0 of 3 devices free, 1 more kept for pinned replicas)" in str(err.value), err.value
    assert inv.place("talker", "talker/0", 1, pin=("2",), allowed=("m1",)) == ("m1", ("2",))
