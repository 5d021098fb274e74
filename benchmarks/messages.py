"""CPU cost of one actor message on the TCP base: with and without a short ``str()``,
with Thespian's own per-loop epoll selector or our poll one, and with its full
description of each transmit or our short one.

Thespian formats every message it sends or receives for its debug log
(``str(message)``, evaluated whether or not that log is on). Our messages
(:class:`omni_actors.messages.Message`) have a short ``str()``; this script
measures what that saves, side by side in one run: a driver actor and an echo
actor (two processes, ``multiprocTCPBase``, a free admin port) play ping-pong
with a :class:`~omni_actors.messages.StageTask` (a ref, sampling parameters,
two actor addresses, as a RequestActor sends one) answered by a
:class:`~omni_actors.messages.StageDone` (two refs), ``--round-trips`` times:

- ``short str`` : the messages as they are;
- ``dataclass repr``: subclasses whose ``str()`` is the dataclass ``repr``
  (what every message cost before);
- ``epoll per loop``: the messages as they are, with Thespian's TCP transport
  making its default (epoll) selector anew for each turn of its loop, as it
  does unpatched, instead of :class:`~omni_actors.actors.thespian_fixes.PollSelector`
  (one ``poll`` call; what the system uses, see
  :mod:`omni_actors.actors.thespian_fixes`). The driver sets it in its process
  before it makes the echo, which inherits it;
- ``full identify``: the messages as they are, with Thespian describing each
  transmit in full for its debug log (the message, the target, the timers)
  whether or not that log is on, as it does unpatched, instead of the short
  description of :func:`~omni_actors.actors.thespian_fixes.use_short_identify`.

The four alternate ``--runs`` times; printed: per round trip (two messages),
the driver's and the echo's CPU time (``time.process_time``, the whole actor
process: Thespian's threads included) and the wall time, medians, and the
ratios. The actor system is shut down whatever happens.

    .venv/bin/python benchmarks/messages.py [--round-trips 2000] [--runs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from thespian.actors import Actor, ActorExitRequest, ActorSystem

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # runnable as `python benchmarks/messages.py` without installing
    sys.path.insert(0, str(REPO))

from omni_actors.actors import thespian_fixes  # noqa: E402 - (importing the package applies the fixes)
from omni_actors.connectors import make_connector  # noqa: E402
from omni_actors.messages import StageDone, StageTask  # noqa: E402
from omni_actors.system.local import free_port  # noqa: E402


@dataclass(frozen=True)
class ReprStageTask(StageTask):
    """A StageTask whose ``str()`` is the dataclass ``repr`` (the cost before)."""

    def __str__(self) -> str:
        return repr(self)


@dataclass(frozen=True)
class ReprStageDone(StageDone):
    def __str__(self) -> str:
        return repr(self)


#: The refs every message carries (a small packed output, as a Thinker's tokens + text).
_REF = None


def _ref():
    global _REF
    if _REF is None:
        _REF = make_connector().put({"token_ids": np.arange(8, dtype=np.int32), "text": "hello world " * 4})
    return _REF


class Echo(Actor):
    """Answers each task with a StageDone of the same family; reports its CPU time on request."""

    def receiveMessage(self, msg, sender):
        if isinstance(msg, StageTask):
            done = ReprStageDone if isinstance(msg, ReprStageTask) else StageDone
            self.send(msg.reply_to, done(request_id=msg.request_id, stage_id=msg.stage_id, replica="talker/0",
                                         output=_ref(), final=_ref()))
        elif msg == "cpu":
            self.send(sender, time.process_time())


class Driver(Actor):
    """``(task class, n, fixes)``: n round trips with a new Echo, both with our Thespian
    fixes (``"fixed"``), or all but one (``"epoll"``, ``"full identify"``); answers (wall s,
    own CPU s, echo CPU s)."""

    def receiveMessage(self, msg, sender):
        if isinstance(msg, tuple) and len(msg) == 3:
            self.cls, self.left, self.client = msg[0], msg[1], sender
            thespian_fixes.use_poll_selector(msg[2] != "epoll")  # (before the echo is forked: it inherits it)
            thespian_fixes.use_short_identify(msg[2] != "full identify")
            self.echo = self.createActor(Echo)
            self.send(self.echo, "cpu")  # (the echo is up before the clock starts)
        elif isinstance(msg, float) and not hasattr(self, "t0"):
            self.echo_cpu0 = msg
            self.t0, self.c0 = time.perf_counter(), time.process_time()
            self.send(self.echo, self._task())
        elif isinstance(msg, StageDone):
            self.left -= 1
            if self.left > 0:
                self.send(self.echo, self._task())
            else:
                self.wall, self.cpu = time.perf_counter() - self.t0, time.process_time() - self.c0
                self.send(self.echo, "cpu")
        elif isinstance(msg, float):
            self.send(self.client, (self.wall, self.cpu, msg - self.echo_cpu0))

    def _task(self):
        return self.cls(request_id="chatcmpl-5f0c3a9e8d7b4c21a6e0f9b8", stage_id=1,
                        prompt="Tell me a short story about a lighthouse keeper and a whale",
                        inputs=((0, _ref()),), sampling_params={"max_tokens": 8, "temperature": 0.0},
                        params={"modalities": ["text", "audio"]}, final_output_type="audio", needs_output=True,
                        reply_to=self.myAddress, text_to=self.myAddress)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--round-trips", type=int, default=2000, help="per measurement (default: %(default)s)")
    p.add_argument("--runs", type=int, default=3, help="measurements per variant, alternated (default: %(default)s)")
    args = p.parse_args(argv)
    variants = {"short str": (StageTask, "fixed"), "dataclass repr": (ReprStageTask, "fixed"),
                "epoll per loop": (StageTask, "epoll"), "full identify": (StageTask, "full identify")}
    results: dict[str, list[tuple[float, float, float]]] = {v: [] for v in variants}
    n = args.round_trips
    asys = ActorSystem("multiprocTCPBase", {"Admin Port": free_port()})
    try:
        for _ in range(args.runs):
            for name, (cls, fixes) in variants.items():
                driver = asys.createActor(Driver)
                got = asys.ask(driver, (cls, n, fixes), max(60, n * 0.05))
                if got is None:
                    raise SystemExit(f"{name}: no answer from the driver")
                results[name].append(got)
                asys.tell(driver, ActorExitRequest())  # (and its echo, a child)
    finally:
        asys.shutdown()
    print(f"ping-pong StageTask -> StageDone, {n} round trips per run, median of {args.runs} runs "
          f"(us per round trip = two messages)")
    print(f"{'messages':16s} {'driver CPU':>11s} {'echo CPU':>10s} {'wall':>8s}")
    med = {}
    for name, rows in results.items():
        w, c, e = (statistics.median(r[i] for r in rows) / n * 1e6 for i in range(3))
        med[name] = (w, c, e)
        print(f"{name:16s} {c:11.0f} {e:10.0f} {w:8.0f}")
    s, r, e, f = med["short str"], med["dataclass repr"], med["epoll per loop"], med["full identify"]
    print(f"short / repr:    {s[1] / r[1]:11.2f} {s[2] / r[2]:10.2f} {s[0] / r[0]:8.2f}")
    print(f"poll / epoll:    {s[1] / e[1]:11.2f} {s[2] / e[2]:10.2f} {s[0] / e[0]:8.2f}")
    print(f"short / full id: {s[1] / f[1]:11.2f} {s[2] / f[2]:10.2f} {s[0] / f[0]:8.2f}")


if __name__ == "__main__":
    main()
