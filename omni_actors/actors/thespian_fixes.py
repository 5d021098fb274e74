"""A fix to Thespian 4.0.1's multiprocess bases: a parent hears of every child that exits.

A parent actor learns that a child exited from two sources: the child's own goodbye
(a ``ChildActorExited`` it sends as it exits) and ``SIGCHLD``, on which Thespian checks
its child processes and sends itself a ``ChildActorExited`` for each dead one. Each
time the parent handles a ``ChildActorExited``, Thespian also checks its child
processes (``MultiProcReplicator._childExited``) and forgets the dead ones *without*
a notice: a child that died since the last ``SIGCHLD`` check is then missed by the
next one. When that child's goodbye was lost as well (seen here in a debug trace:
a stage pool's goodbye sent, never received by the coordinator), the parent never
hears of it. An exiting parent waits for all its children, so the coordinator did not
exit and the leader's stop took 13 s, not 0.1-0.7 s: Thespian's 10 s system shutdown
timeout, then the kill of what was left. Seen in 3 of about 40 leader stops of one
``make test`` run on the two cores and 2 of 33 in three runs of the topology tests
beside it; a CI run failed on it (``test_lifecycle``'s drain test). With the fix:
none in 42 stops of the same ``make test`` part and 47 of those tests.

:func:`apply` makes that check send the notice for every other child it finds dead,
as the ``SIGCHLD`` check does. A second notice for one child is harmless: Thespian and
our actors already get one from each source.
"""

from __future__ import annotations

import logging

_applied = False


def apply() -> None:
    """Patch ``thespian.system.multiprocCommon.MultiProcReplicator._childExited`` (once
    per process; a no-op where Thespian has no such method). Call it before the actor
    system starts: its admin and actors are forked from this process and inherit it."""
    global _applied
    if _applied:
        return
    _applied = True
    try:
        from thespian.actors import ChildActorExited
        from thespian.system.addressManager import CannotPickleAddress
        from thespian.system.multiprocCommon import MultiProcReplicator
        from thespian.system.transport import TransmitIntent
    except ImportError:  # another Thespian layout: leave it as it is
        return
    if not hasattr(MultiProcReplicator, "_childExited"):
        return

    def _child_exited(self, childAddr):
        alive, dead = [], []
        for child in getattr(self, "_child_procs", []):
            (alive if MultiProcReplicator._checkChildLiveness(child) else dead).append(child)
        self._child_procs = alive
        for child in dead:
            addr = getattr(child, "childRealAddr", child.childAddr)
            if addr == childAddr:
                continue  # the one being handled now
            try:
                self.transport.scheduleTransmit(None, TransmitIntent(self.transport.myAddress,
                                                                     ChildActorExited(addr)))
            except CannotPickleAddress:
                logging.getLogger(__name__).error("child %s exited; its address cannot be resolved", addr)

    MultiProcReplicator._childExited = _child_exited
