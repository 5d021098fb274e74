"""Thespian's multiprocess base, with our fixes (omni_actors.actors.thespian_fixes): a parent
hears of every child that exits, even one that dies while the parent handles another
child's exit. Without the fix Thespian forgets that child silently; an exiting parent
then waits for it until the system's 10 s shutdown timeout (the leader's stop took 13 s).

A real multiprocTCPBase system on a free port: the race is in its process handling."""

from __future__ import annotations

import errno
import os
import selectors
import signal
import socket
import time
from pathlib import Path

import pytest
from thespian.actors import ActorSystem, ActorTypeDispatcher, ChildActorExited, ThespianWatch

import omni_actors.actors  # noqa: F401 - applies the fix in this process, before the admin forks
from omni_actors.actors.thespian_fixes import PollSelector
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


# -- the transport's selector: one poll per loop turn -------------------------------------------

def test_the_poll_selector_reports_what_is_ready_and_waits_when_nothing_is():
    reader, writer = socket.socketpair()
    with reader, writer:
        sel = PollSelector()
        sel.register(reader.fileno(), selectors.EVENT_READ)
        sel.register(writer.fileno(), selectors.EVENT_WRITE)
        assert [(k.fd, ev) for k, ev in sel.select(0)] == [(writer.fileno(), selectors.EVENT_WRITE)]
        writer.send(b"x")
        assert sorted((k.fd, ev) for k, ev in sel.select(1)) == sorted(
            [(reader.fileno(), selectors.EVENT_READ), (writer.fileno(), selectors.EVENT_WRITE)])
        reader.recv(1)
        sel = PollSelector()
        sel.register(reader.fileno(), selectors.EVENT_READ)
        t0 = time.monotonic()
        assert sel.select(0.1) == []
        assert time.monotonic() - t0 >= 0.09


def test_the_poll_selector_raises_ebadf_for_a_closed_descriptor_as_epoll_does():
    """Thespian's loop handles that error by dropping the bad watch; a poll that reported
    it as ready instead would make the loop spin."""
    reader, writer = socket.socketpair()
    fd = reader.fileno()
    reader.close()
    with writer:
        sel = PollSelector()
        sel.register(fd, selectors.EVENT_READ)
        with pytest.raises(OSError) as err:
            sel.select(1)
        assert err.value.errno == errno.EBADF
        for selector in (PollSelector(), selectors.DefaultSelector()):  # (a closed socket's fileno())
            with pytest.raises(ValueError):
                selector.register(-1, selectors.EVENT_READ)


class Watcher(ActorTypeDispatcher):
    """``"selector"``: the transport's selector class here; ``"watch"``: watch a socket;
    ``"close"``: close it, still watched; ``"cpu"``: this process's CPU seconds."""

    sock = None

    def receiveMsg_str(self, msg, sender):
        from thespian.system.transport import TCPTransport

        if msg == "selector":
            self.send(sender, TCPTransport.selectors.DefaultSelector.__name__)
        elif msg == "watch":
            self.sock, self.peer = socket.socketpair()
            self.fd = self.sock.fileno()
            self.send(sender, "watching")
        elif msg == "close":
            self.sock.close()
            self.peer.close()
            self.send(sender, "closed")
        elif msg == "cpu":
            self.send(sender, time.process_time())
        return self._watch()

    def receiveMsg_WatchMessage(self, msg, sender):
        return self._watch()  # (as the EngineActor does: every handler returns its watch)

    def _watch(self):
        return ThespianWatch([self.fd]) if self.sock is not None else None


def test_actors_poll_and_drop_a_watched_descriptor_that_was_closed(actor_system):
    actor = actor_system.createActor(Watcher)
    assert actor_system.ask(actor, "selector", 10) == "PollSelector"  # (inherited from this process)
    assert actor_system.ask(actor, "watch", 10) == "watching"
    assert actor_system.ask(actor, "close", 10) == "closed"
    cpu0 = actor_system.ask(actor, "cpu", 10)
    time.sleep(1.0)
    cpu1 = actor_system.ask(actor, "cpu", 10)
    assert cpu0 is not None and cpu1 is not None, "the actor stopped answering after its watch was closed"
    assert cpu1 - cpu0 < 0.3, f"the actor spun on its closed watch: {cpu1 - cpu0:.2f} s of CPU in 1 s"


def test_thespians_own_log_records_are_json_events_like_ours():
    """Thespian's records ("Pending Actor create ... failed", seen at a stop after members
    left) were plain-text lines among the JSON events on stderr."""
    import json
    import logging

    from omni_actors.logs import ThespianJsonFormatter, thespian_log_defs

    assert thespian_log_defs()["formatters"]["json"]["()"] is ThespianJsonFormatter
    record = logging.LogRecord("thespian", logging.ERROR, __file__, 1, "Pending Actor create for %s failed (%d)",
                               ("ActorAddr-(T|:35313)", 3585), None)
    event = json.loads(ThespianJsonFormatter().format(record))
    assert event["event"] == "thespian"
    # (trial CM grepped for "failed" after a clean stop: it says what it means)
    assert event["message"] == ("Pending Actor create for ActorAddr-(T|:35313) failed (3585) (the system was "
                                "stopping: an actor asked for then is not made; no fault)")
    assert event["timestamp"].endswith("Z") and event["pid"] == record.process
    # 3585: the system was shutting down (at every clean stop with member replicas; trial AP):
    # no error, or it would set off alerts. Any other failure stays an error.
    assert event["level"] == "info"
    other = logging.LogRecord("thespian", logging.ERROR, __file__, 1, "Pending Actor create for %s failed (%d): ",
                              ("ActorAddr-(T|:35313)", 3586), None)
    event = json.loads(ThespianJsonFormatter().format(other))
    # 3586 (no compatible actor system): said in words (trial CD read a bare line after each member
    # was SIGKILLed: the node agent asked for there)
    assert event["level"] == "error" and event["message"] == (
        "Pending Actor create for ActorAddr-(T|:35313) failed (3586): no host of the convention offers what the "
        "actor requires (a member it was asked for on has gone?)")


def test_an_admin_that_does_not_answer_at_start_is_said_in_words():
    """Thespian's "ActorAddr-(T|:58140) is not a valid or useable ActorSystem Admin" (its admin
    did not answer in time, seen on a loaded machine) was the whole start-up error."""
    from omni_actors.system.leader import admin_start_error

    text = admin_start_error(58140, RuntimeError("ActorAddr-(T|:58140) is not a valid or useable ActorSystem Admin"))
    assert text.startswith("the actor system did not start on admin port 58140: its admin process did not answer")
    assert "try again" in text and "ActorAddr" not in text
    assert admin_start_error(1900, OSError("boom")) == "the actor system did not start on admin port 1900: boom"


def test_a_transmits_description_is_short_unless_thespians_debug_log_is_on(monkeypatch):
    """Thespian describes every transmit for two debug lines, whether or not its debug log
    is on: in full, that reads the intent's timers from the clock (7-8% of an actor's time
    per message, profiled). Off, the description keeps only the target and the message."""
    import logging

    from thespian.system import utilis
    from thespian.system.transport import TransmitIntent

    from omni_actors.actors import thespian_fixes
    from omni_actors.messages import CancelStage

    intent = TransmitIntent("the-target", CancelStage("chatcmpl-1", 2))
    short = intent.identify()
    assert short == f"TransportIntent(the-target-{CancelStage('chatcmpl-1', 2)})", short
    monkeypatch.setattr(utilis, "_thesplog_control_settings", (logging.DEBUG, False, 50 * 1024))
    full = intent.identify()
    assert full.startswith("TransportIntent(the-target-pending-ExpiresIn_") and "quit_" in full, full
    monkeypatch.undo()
    thespian_fixes.use_short_identify(False)  # (Thespian's own: the full description again)
    try:
        assert intent.identify().startswith("TransportIntent(the-target-pending-ExpiresIn_")
    finally:
        thespian_fixes.use_short_identify(True)
    assert intent.identify() == short
