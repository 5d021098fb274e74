"""Thespian's multiprocess base, with our fix (omni_actors.actors.thespian_fixes): a parent
hears of every child that exits, even one that dies while the parent handles another
child's exit. Without the fix Thespian forgets that child silently; an exiting parent
then waits for it until the system's 10 s shutdown timeout (the leader's stop took 13 s).

A real multiprocTCPBase system on a free port: the race is in its process handling."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from thespian.actors import ActorSystem, ActorTypeDispatcher, ChildActorExited

import omni_actors.actors  # noqa: F401 - applies the fix in this process, before the admin forks
from omni_actors.system.local import free_port


def _wait_until_dead(pid: int, timeout_s: float = 5.0) -> None:
    """Until ``pid`` is a zombie or gone, without reaping it (its parent's Thespian must)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] in ("Z", "X"):
                return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.01)


class Child(ActorTypeDispatcher):
    def receiveMsg_str(self, msg, sender):
        self.send(sender, ("pid", os.getpid()))


class Parent(ActorTypeDispatcher):
    """``"start"``: two children; ``"kill"``: SIGKILL the first, and while handling its
    exit, SIGKILL the second and wait until it is dead; ``"heard"``: the children whose
    ``ChildActorExited`` came."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.children, self.pids, self.heard = [], [None, None], []

    def receiveMsg_str(self, msg, sender):
        if msg == "start":
            self.children = [self.createActor(Child) for _ in range(2)]
            for child in self.children:
                self.send(child, "pid")
        elif msg == "ready":
            self.send(sender, None not in self.pids)
        elif msg == "kill":
            os.kill(self.pids[0], signal.SIGKILL)
        elif msg == "heard":
            self.send(sender, sorted(self.heard))

    def receiveMsg_tuple(self, msg, sender):
        self.pids[self.children.index(sender)] = msg[1]

    def receiveMsg_ChildActorExited(self, msg: ChildActorExited, sender):
        which = self.children.index(msg.childAddress)
        if which not in self.heard:
            self.heard.append(which)
        if which == 0:
            os.kill(self.pids[1], signal.SIGKILL)
            _wait_until_dead(self.pids[1])  # dead before Thespian checks its children after this handler


@pytest.fixture
def actor_system():
    asys = ActorSystem("multiprocTCPBase", {"Admin Port": free_port()})
    asys.stopped = False
    try:
        yield asys
    finally:
        if not asys.stopped:
            asys.shutdown()


def test_a_child_that_dies_while_its_parent_handles_another_childs_exit_is_not_missed(actor_system):
    parent = actor_system.createActor(Parent)
    actor_system.tell(parent, "start")
    deadline = time.monotonic() + 20
    while not actor_system.ask(parent, "ready", 5) and time.monotonic() < deadline:
        time.sleep(0.05)
    actor_system.tell(parent, "kill")
    heard: list[int] = []
    deadline = time.monotonic() + 5
    while len(heard) < 2 and time.monotonic() < deadline:
        heard = actor_system.ask(parent, "heard", 5) or []
        time.sleep(0.05)
    assert heard == [0, 1], f"the parent heard of child {heard} only: the other's exit was missed"
    # and the system stops at once: the parent waits for no child (without the fix:
    # Thespian's 10 s shutdown timeout, the parent process left running)
    t0 = time.monotonic()
    actor_system.stopped = True
    actor_system.shutdown()
    assert time.monotonic() - t0 < 5
