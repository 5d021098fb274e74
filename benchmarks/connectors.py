"""Data-plane benchmarks: how fast stage outputs move between stages.

Section ``transfer``: put+get throughput of one float32 array (1, 16, 64 and
256 MB by default) through every way the system can move it, beside two
baselines measured in the same run:

- **memory copy**: ``np.copy`` of the array (the floor for "one copy"; numpy
  asks for transparent huge pages for big arrays), and the same copy with
  numpy's huge-page advice off (4 KiB pages, as shared memory gets wherever
  ``shmem_enabled`` is ``never``: printed in the header);
- **inline**: the bytes ride in the ref (put, the ref pickled and unpickled as
  an actor message carries it, get);
- **shared memory**: put into a segment, get maps it in place (zero copy;
  the reader pays the page faults on first touch: a second row includes them);
- **cross-host (loopback)**: put into a segment, get fetches it from the
  node's data service, which runs in another process
  (``python -m omni_actors.connectors.data_service``), over loopback TCP;
- **actor message**: the array itself sent from one Thespian actor to another
  (multiprocTCPBase), timed from the send to the receiver's acknowledgement;
- **raw socket**: the bytes sent over loopback TCP by another process and
  received with ``recv_into`` into a preallocated (reused) buffer.

Each figure is the median (and best) of ``--reps`` repetitions; releases are
not timed. Ratios: shared memory / memory copy (target >= 0.5) and cross-host
/ raw socket (target >= 0.5), both on best-of-N, plus the cross-host get alone
(the transfer, without the put) / raw socket.

    python benchmarks/connectors.py                   # every section, default sizes
    python benchmarks/connectors.py --sizes 1,16 --reps 3
    python benchmarks/connectors.py --json out.json

Everything it starts (the data service, the socket sender, the actor system)
is stopped and every segment it made is unlinked, whatever happens.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import pickle
import socket
import statistics
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # runnable as `python benchmarks/connectors.py` without installing
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
from thespian.actors import Actor, ActorSystem  # noqa: E402

from omni_actors.connectors import NodeConnector, release_all, sweep_segments  # noqa: E402
from omni_actors.connectors import data_service  # noqa: E402

MB = 1 << 20
DEFAULT_SIZES = (1, 16, 64, 256)
TARGET = 0.5
#: An actor message of this many MB or more is not sent (~70 ms per MB measured here): the row says so.
ACTOR_MAX_MB = 64


# --------------------------------------------------------------------- measuring

def measure(fn: Callable[[], Any], reps: int, after: Callable[[Any], None] | None = None) -> dict:
    """Time ``fn`` ``reps`` times (``after(result)`` runs untimed after each):
    ``{"median_s", "best_s"}``."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        if after is not None:
            after(out)
        del out
    return {"median_s": statistics.median(times), "best_s": min(times)}


def row(path: str, nbytes: int, timing: dict | None, note: str = "") -> dict:
    r = {"path": path, "bytes": nbytes, "note": note}
    if timing:
        r.update(timing, median_gbps=nbytes / timing["median_s"] / 1e9, best_gbps=nbytes / timing["best_s"] / 1e9)
    return r


# --------------------------------------------------------------------- raw socket baseline

def _socket_sender(port: int, max_bytes: int) -> None:
    """In another process: send the first N bytes of a warm buffer each time N is asked."""
    data = np.ones(max_bytes, dtype=np.uint8)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            head = sock.recv(8, socket.MSG_WAITALL)
            if len(head) < 8:
                return
            (n,) = struct.unpack("!Q", head)
            sock.sendall(memoryview(data)[:n])


class RawSocket:
    def __init__(self, max_bytes: int) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(target=_socket_sender, args=(self._listener.getsockname()[1], max_bytes),
                                 daemon=True)
        self._proc.start()
        self._listener.settimeout(60)
        self._sock, _ = self._listener.accept()
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = np.ones(max_bytes, dtype=np.uint8)  # preallocated, reused, warm

    def transfer(self, n: int) -> None:
        self._sock.sendall(struct.pack("!Q", n))
        view, got = memoryview(self._buf)[:n], 0
        while got < n:
            k = self._sock.recv_into(view[got:], min(n - got, data_service.RECV_CHUNK))
            if not k:
                raise ConnectionError("sender went away")
            got += k

    def close(self) -> None:
        self._sock.close()
        self._listener.close()
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


# --------------------------------------------------------------------- data service in another process

class ServiceProcess:
    """``python -m omni_actors.connectors.data_service`` for ``prefix``: another host's service."""

    def __init__(self, prefix: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omni_actors.connectors.data_service", "--host", "127.0.0.1", "--port", "0",
             "--prefix", prefix, "--node", "bench-far"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)})
        line = self.proc.stdout.readline()
        if not line.startswith("READY "):
            self.close()
            raise RuntimeError(f"the data service did not start: {line!r}")
        self.address = line.split()[1]

    def close(self) -> None:
        data_service.close_connections()
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# --------------------------------------------------------------------- actor message

class Payload:
    def __init__(self, array: np.ndarray) -> None:
        self.array = array


class Receiver(Actor):
    def receiveMessage(self, msg, sender):
        if isinstance(msg, Payload):
            self.send(sender, ("got", msg.array.nbytes))


class Sender(Actor):
    """Asked ``("send", receiver, nbytes)``: sends a Payload of that size to the
    receiver and answers the asker with the seconds until the receiver's ack."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._pending = None

    def receiveMessage(self, msg, sender):
        if isinstance(msg, tuple) and msg[0] == "send":
            _, receiver, nbytes = msg
            array = np.ones(nbytes // 4, dtype=np.float32)
            self._pending = (sender, time.perf_counter())
            self.send(receiver, Payload(array))
        elif isinstance(msg, tuple) and msg[0] == "got" and self._pending is not None:
            asker, t0 = self._pending
            self._pending = None
            self.send(asker, time.perf_counter() - t0)


def _set_madvise_hugepage(enabled: bool) -> bool:
    """numpy's huge-page advice for new big arrays on/off; returns the previous setting."""
    try:
        from numpy._core.multiarray import _set_madvise_hugepage as setter
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _set_madvise_hugepage as setter
    return setter(enabled)


def _sysfs(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return "?"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------- section: transfer

def section_transfer(args) -> dict:
    sizes = args.sizes
    reps = args.reps
    prefix = f"oa-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}-"
    rows: list[dict] = []
    service = raw = asys = None
    try:
        service = ServiceProcess(prefix)
        raw = RawSocket(max(sizes) * MB)
        inline = NodeConnector(mode="inline", node="bench-far")
        shm = NodeConnector(0, prefix, node="bench-far", service=service.address)
        near = NodeConnector(node="bench-near")  # a reader on another node
        port = _free_port()
        asys = ActorSystem("multiprocTCPBase", {"Admin Port": port},
                           logDefs={"version": 1, "disable_existing_loggers": False, "root": {"level": "CRITICAL"}})
        receiver, sender = asys.createActor(Receiver), asys.createActor(Sender)

        for size in sizes:
            nbytes = size * MB
            n = max(2, reps // 2) if size >= 256 else reps * 3 if size <= 4 else reps
            arr = np.random.default_rng(size).standard_normal(nbytes // 4, dtype=np.float32)
            out = {"x": arr}
            print(f"  {size} MB ...", file=sys.stderr, flush=True)

            rows.append(row("memory copy (np.copy)", nbytes, measure(lambda: np.copy(arr), n)))
            previous = _set_madvise_hugepage(False)
            try:
                rows.append(row("memory copy, 4 KiB pages (no THP)", nbytes, measure(lambda: np.copy(arr), n)))
            finally:
                _set_madvise_hugepage(previous)

            def inline_put_get():
                ref = pickle.loads(pickle.dumps(inline.put(out), protocol=pickle.HIGHEST_PROTOCOL))
                return inline.get(ref)
            rows.append(row("inline (put, ref pickled+unpickled, get)", nbytes, measure(inline_put_get, n)))

            def shm_put_get():
                ref = shm.put(out)
                return ref, shm.get(ref)
            rows.append(row("shared memory (put, get maps)", nbytes,
                            measure(shm_put_get, n, after=lambda r: release_all([r[0]]))))

            def shm_put_get_touch():
                ref = shm.put(out)
                got = shm.get(ref)
                int(got["x"].view(np.uint8)[::4096].sum())  # the page faults a reader pays on first touch
                return ref, got
            rows.append(row("shared memory + reader touches every page", nbytes,
                            measure(shm_put_get_touch, n, after=lambda r: release_all([r[0]]))))

            def cross_put_get():
                ref = shm.put(out)
                return ref, near.get(ref)
            rows.append(row("cross-host, loopback (put, get fetches)", nbytes,
                            measure(cross_put_get, n, after=lambda r: release_all([r[0]]))))
            ref = shm.put(out)
            try:
                got = near.get(ref)["x"]
                assert np.array_equal(got, arr), "cross-host bytes differ"
                del got
                rows.append(row("cross-host get alone (the transfer)", nbytes, measure(lambda: near.get(ref), n)))
            finally:
                release_all([ref])

            rows.append(row("raw loopback socket (recv_into)", nbytes, measure(lambda: raw.transfer(nbytes), n)))

            if size <= args.actor_max_mb:
                times = []
                for _ in range(max(1, min(n, 3 if size < 64 else 2))):
                    took = asys.ask(sender, ("send", receiver, nbytes), 300)
                    if not isinstance(took, float):
                        raise RuntimeError(f"the actor message of {size} MB got no answer")
                    times.append(took)
                rows.append(row("actor message (Thespian TCP)", nbytes,
                                {"median_s": statistics.median(times), "best_s": min(times)}))
            else:
                rows.append(row("actor message (Thespian TCP)", nbytes, None,
                                note=f"not sent: over {args.actor_max_mb} MB (see the smaller sizes' rate)"))
    finally:
        if asys is not None:
            asys.shutdown()
        if raw is not None:
            raw.close()
        if service is not None:
            service.close()
        sweep_segments(prefix)
    return {"rows": rows, "ratios": _ratios(rows, sizes)}


def _ratios(rows: list[dict], sizes) -> list[dict]:
    def best(path_start: str, nbytes: int) -> float | None:
        for r in rows:
            if r["bytes"] == nbytes and r["path"].startswith(path_start) and "best_gbps" in r:
                return r["best_gbps"]
        return None

    out = []
    for size in sizes:
        nbytes = size * MB
        copy, shm = best("memory copy", nbytes), best("shared memory", nbytes)
        raw, cross, get = best("raw loopback", nbytes), best("cross-host, loopback", nbytes), \
            best("cross-host get alone", nbytes)
        out.append({"size_mb": size, "shm_over_copy": shm / copy, "cross_over_raw": cross / raw,
                    "cross_get_over_raw": get / raw, "shm_over_copy_4k": shm / best("memory copy, 4 KiB", nbytes)})
    return out


def print_transfer(result: dict) -> None:
    print("\n== transfer: put+get throughput (median of reps; best in brackets) ==")
    print(f"{'size':>7}  {'path':<44} {'ms':>9} {'GB/s':>7} {'(best)':>8}")
    last = None
    for r in result["rows"]:
        size = f"{r['bytes'] // MB} MB"
        if last is not None and size != last:
            print()
        last = size
        if "median_s" in r:
            print(f"{size:>7}  {r['path']:<44} {r['median_s'] * 1e3:9.2f} {r['median_gbps']:7.2f} "
                  f"({r['best_gbps']:6.2f})")
        else:
            print(f"{size:>7}  {r['path']:<44} {'-':>9} {'-':>7} {'':>8}  {r['note']}")
    print(f"\nratios (best-of-N; target >= {TARGET}):")
    print(f"{'size':>7}  {'shm / memory copy':>18}  {'cross-host / raw socket':>24}  {'cross-host get / raw':>21}"
          f"  {'(shm / 4 KiB copy)':>19}")
    for q in result["ratios"]:
        def fmt(v):
            return f"{v:.2f} {'ok' if v >= TARGET else 'MISS'}"
        print(f"{q['size_mb']:>4} MB  {fmt(q['shm_over_copy']):>18}  {fmt(q['cross_over_raw']):>24}  "
              f"{fmt(q['cross_get_over_raw']):>21}  {q['shm_over_copy_4k']:>19.2f}")


# --------------------------------------------------------------------- main

#: name -> (run(args) -> result, print(result)); run in this order.
SECTIONS: dict[str, tuple[Callable[[Any], dict], Callable[[dict], None]]] = {
    "transfer": (section_transfer, print_transfer),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated, from: {', '.join(SECTIONS)} (default: all)")
    p.add_argument("--sizes", default=",".join(map(str, DEFAULT_SIZES)),
                   help="payload sizes in MB, comma-separated (default: 1,16,64,256)")
    p.add_argument("--reps", type=int, default=7,
                   help="repetitions per figure (up to 4 MB: three times as many; 256 MB and up: half)")
    p.add_argument("--actor-max-mb", type=int, default=ACTOR_MAX_MB,
                   help="largest actor message sent, in MB")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown or not args.sizes or min(args.sizes) <= 0:
        p.error(f"unknown section(s) {unknown}" if unknown else "sizes must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, {os.cpu_count()} CPUs; transparent huge pages: "
          f"anon {_sysfs('/sys/kernel/mm/transparent_hugepage/enabled')}, "
          f"shmem {_sysfs('/sys/kernel/mm/transparent_hugepage/shmem_enabled')}", flush=True)
    results = {}
    for name in args.sections:
        run, show = SECTIONS[name]
        results[name] = run(args)
        show(results[name])
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
