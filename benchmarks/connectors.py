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
- **shared memory**: put into a segment, get maps it in place (zero copy; a
  second row has the reader touch every page, as a consumer does).
  Each repetition's segment is released as the owner of a completed request
  on the same host releases it: recycled (``release(ref, recycle=True)``,
  a ``rename`` in this process), so the next put claims it and
  writes over pages already there, through the mapping it kept, and the get
  reads it through the mapping it kept of that file (page tables and all:
  segment recycling, :mod:`omni_actors.connectors.recycling`, and
  :mod:`omni_actors.connectors.mappings`). Those rows are timed in
  that steady state: two untimed repetitions first (the first makes the
  segment, the second reuses it with ``pwrite`` and maps it). A third row
  releases with an unlink instead, after unlinking the free segments and
  dropping the mappings kept of them (a fresh segment every put: what a cancelled request's segments cost, and what every
  put cost before recycling);
- **cross-host (loopback)**: put into a segment, get fetches it from the
  node's data service, which runs in another process
  (``python -m omni_actors.connectors.data_service``), over loopback TCP;
  released (recycled) through that service, as a request owner on another
  node does, and timed in the same steady state; each repetition follows a
  raw-socket transfer of the same size (the row "raw loopback socket, in turns
  with cross-host"), the baseline of the cross-host ratios;
- **actor message**: the array itself sent from one Thespian actor to another
  (multiprocTCPBase), timed from the send to the receiver's acknowledgement;
- **raw socket**: the bytes sent over loopback TCP by another process and
  received with ``recv_into`` into a preallocated (reused) buffer; once on
  its own per size, and in turns with each directory's cross-host rows.

The shared-memory and cross-host rows are measured twice where it can be:
with segments in ``/dev/shm`` (the default) and in a **huge-page tmpfs**, a
private tmpfs mounted with ``huge=within_size`` in a temporary folder for the
run (``$OMNI_ACTORS_SHM_DIR`` pointing at it, for this process and its data
service). Writing a fresh segment costs a page fault per page: per 4 KiB page
in a ``/dev/shm`` without huge pages (``shmem_enabled`` ``never``, the header
says), per 2 MiB in the huge-page tmpfs. Mounting needs root; otherwise (or
with ``--no-huge-tmpfs``) that variant is skipped and the output says why.

Each figure is the median (and best) of ``--reps`` repetitions; releases are
not timed. The raw socket and the data services send with the host's TCP
congestion control (the header says which) unless ``--tcp-congestion`` names
another: with ``bbr``, which paces, a loopback flow was seen to run at half
speed for minutes at a time, so those rows vary between runs (hence the raw transfers in turns with the
cross-host ones). Ratios, per segment directory: shared memory / memory copy
(target >= 0.5) and cross-host / raw socket in turns (target >= 0.5), both on
best-of-N, plus the cross-host get alone (the transfer, without the put) /
raw socket, and the fresh-segment row / memory copy.

Section ``first_audio``: time to first audio with and without streaming
between stages (``benchmarks/first_audio.py``; target: streaming <= 0.3x).

    python benchmarks/connectors.py                   # every section, default sizes
    python benchmarks/connectors.py --sizes 1,16 --reps 3 --skip-first-audio
    python benchmarks/connectors.py --sizes 1 --skip-first-audio --tcp-congestion cubic
    python benchmarks/connectors.py --sections first_audio
    python benchmarks/connectors.py --json out.json

Everything it starts (the data services, the socket sender, the actor system,
the leaders of the first-audio section) is stopped, every segment it made is
unlinked and the tmpfs it mounted is unmounted, whatever happens (Ctrl-C and
SIGTERM included).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing
import os
import pickle
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # runnable as `python benchmarks/connectors.py` without installing
    sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
from thespian.actors import Actor, ActorSystem  # noqa: E402

from omni_actors.connectors import NodeConnector, sweep_segments  # noqa: E402
from omni_actors.connectors import data_service  # noqa: E402
from omni_actors.connectors.shm import DIR_ENV, SHM_DIR, drop_mappings, purge_free_segments  # noqa: E402

MB = 1 << 20
DEFAULT_SIZES = (1, 16, 64, 256)
TARGET = 0.5
#: The raw-socket row measured in turns with a directory's cross-host rows (their ratios' baseline).
RAW_ALTERNATED = "raw loopback socket, in turns with cross-host"
#: An actor message of this many MB or more is not sent (~70 ms per MB measured here): the row says so.
ACTOR_MAX_MB = 64


# --------------------------------------------------------------------- measuring

def measure(fn: Callable[[], Any], reps: int, after: Callable[[Any], None] | None = None,
            warmup: int = 0, before: Callable[[], Any] | None = None,
            before_times: list[float] | None = None) -> dict:
    """Time ``fn`` ``reps`` times, after ``warmup`` untimed runs (``after(result)``
    runs untimed after each): ``{"median_s", "best_s"}``. With ``before``, it runs
    before each repetition, timed on its own into ``before_times``: two rows
    compared as a ratio then see the same moments of a machine (or of a TCP
    flow) whose speed swings between runs."""
    times = []
    for i in range(warmup + reps):
        if before is not None:
            t0 = time.perf_counter()
            before()
            if i >= warmup and before_times is not None:
                before_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        if after is not None:
            after(out)
        del out
    return timing_of(times)


def timing_of(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "best_s": min(times)}


def row(path: str, nbytes: int, timing: dict | None, note: str = "", segdir: str | None = None) -> dict:
    r = {"path": path, "bytes": nbytes, "note": note, "segdir": segdir}
    if timing:
        r.update(timing, median_gbps=nbytes / timing["median_s"] / 1e9, best_gbps=nbytes / timing["best_s"] / 1e9)
    return r


# --------------------------------------------------------------------- raw socket baseline

def _socket_sender(port: int, max_bytes: int, congestion: str | None = None) -> None:
    """In another process: send the first N bytes of a warm buffer each time N is asked."""
    data = np.ones(max_bytes, dtype=np.uint8)
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if congestion:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, congestion.encode())
        while True:
            head = sock.recv(8, socket.MSG_WAITALL)
            if len(head) < 8:
                return
            (n,) = struct.unpack("!Q", head)
            sock.sendall(memoryview(data)[:n])


class RawSocket:
    def __init__(self, max_bytes: int, congestion: str | None = None) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        ctx = multiprocessing.get_context("spawn")
        self._proc = ctx.Process(target=_socket_sender,
                                 args=(self._listener.getsockname()[1], max_bytes, congestion), daemon=True)
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
    """``python -m omni_actors.connectors.data_service`` for ``prefix``: another host's service,
    serving the segments of ``shm_dir`` (its ``$OMNI_ACTORS_SHM_DIR``, as a host's actors inherit it)."""

    def __init__(self, prefix: str, shm_dir: str = SHM_DIR, congestion: str | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "omni_actors.connectors.data_service", "--host", "127.0.0.1", "--port", "0",
             "--prefix", prefix, "--node", "bench-far"]
            + (["--tcp-congestion", congestion] if congestion else []),
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO), DIR_ENV: shm_dir})
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


# --------------------------------------------------------------------- huge-page tmpfs

HUGE_LABEL = "huge-page tmpfs"


@contextlib.contextmanager
def huge_tmpfs(size_bytes: int, disabled: bool = False) -> Iterator[tuple[str | None, str]]:
    """A private tmpfs with ``huge=within_size`` in a temporary folder, for the ``with`` block:
    ``(path, mount options)``, or ``(None, why it was skipped)``. Unmounted (lazily if
    still busy) and removed afterwards, whatever happens."""
    if disabled:
        yield None, "--no-huge-tmpfs"
        return
    if not sys.platform.startswith("linux"):
        yield None, "not Linux"
        return
    if os.geteuid() != 0:
        yield None, "mounting a tmpfs needs root (run as root, or mount one yourself and set OMNI_ACTORS_SHM_DIR)"
        return
    path = tempfile.mkdtemp(prefix="oa-bench-huge-")
    size_mb = max(64, -(-size_bytes // MB))
    options = f"size={size_mb}m,huge=within_size,mode=0700"
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "oa-bench-huge", path],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        os.rmdir(path)
        yield None, f"mount failed: {exc}"
        return
    if done.returncode != 0:
        os.rmdir(path)
        yield None, f"mount failed: {(done.stderr or done.stdout).strip() or f'exit {done.returncode}'}"
        return
    try:
        yield path, _mount_options(path) or options
    finally:
        with signals_deferred():
            gc.collect()  # drop mappings of its (unlinked) segments, or the unmount finds it busy
            drop_mappings()  # (and those a producer keeps to write recycled segments again)
            if subprocess.run(["umount", path], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", path], capture_output=True)
            with contextlib.suppress(OSError):
                os.rmdir(path)


def _mount_options(path: str) -> str:
    """The options ``/proc/mounts`` shows for the mount at ``path`` ("" if none)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) > 3 and fields[1] == path:
                return fields[3]
    return ""


@contextlib.contextmanager
def _segment_dir(path: str) -> Iterator[None]:
    """``$OMNI_ACTORS_SHM_DIR`` = ``path`` in this process for the ``with`` block."""
    before = os.environ.get(DIR_ENV)
    os.environ[DIR_ENV] = path
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(DIR_ENV, None)
        else:
            os.environ[DIR_ENV] = before


# --------------------------------------------------------------------- section: transfer

def section_transfer(args) -> dict:
    sizes = args.sizes
    reps = args.reps
    prefix = f"oa-bench-{os.getpid()}-{uuid.uuid4().hex[:6]}-"
    rows: list[dict] = []
    dirs: dict[str, str] = {"/dev/shm": SHM_DIR}  # label -> directory of the segments
    services: dict[str, ServiceProcess] = {}
    raw = asys = None
    # Room for the largest payload a few times over (a put, a get's segment, one being released,
    # a recycled one waiting for the next put).
    with huge_tmpfs(4 * max(sizes) * MB + 64 * MB, disabled=args.no_huge_tmpfs) as (huge, huge_note):
        try:
            if huge is not None:
                dirs[HUGE_LABEL] = huge
            for label, path in dirs.items():
                services[label] = ServiceProcess(prefix, path, args.tcp_congestion)
            raw = RawSocket(max(sizes) * MB, args.tcp_congestion)
            inline = NodeConnector(mode="inline", node="bench-far")
            shm = {label: NodeConnector(0, prefix, node="bench-far", service=services[label].address)
                   for label in dirs}
            near = NodeConnector(node="bench-near")  # a reader on another node
            port = _free_port()
            asys = ActorSystem("multiprocTCPBase", {"Admin Port": port},
                               logDefs={"version": 1, "disable_existing_loggers": False,
                                        "root": {"level": "CRITICAL"}})
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
                    rows.append(row("memory copy, 4 KiB pages (no THP)", nbytes,
                                    measure(lambda: np.copy(arr), n)))
                finally:
                    _set_madvise_hugepage(previous)

                def inline_put_get():
                    ref = pickle.loads(pickle.dumps(inline.put(out), protocol=pickle.HIGHEST_PROTOCOL))
                    return inline.get(ref)
                rows.append(row("inline (put, ref pickled+unpickled, get)", nbytes, measure(inline_put_get, n)))

                for label, path in dirs.items():
                    with _segment_dir(path):
                        rows.extend(_segment_rows(label, shm[label], near, out, arr, nbytes, n, raw))

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
            with signals_deferred():
                for path in dirs.values():
                    sweep_segments(prefix, path)
                if asys is not None:
                    asys.shutdown()
                if raw is not None:
                    raw.close()
                for service in services.values():
                    service.close()
                for path in dirs.values():  # (and what a service freed meanwhile)
                    sweep_segments(prefix, path)
    return {"rows": rows, "dirs": list(dirs), "huge_tmpfs": {"mounted": huge is not None, "note": huge_note},
            "ratios": _ratios(rows, sizes, list(dirs))}


def _segment_rows(label: str, shm: NodeConnector, near: NodeConnector, out: dict, arr: np.ndarray,
                  nbytes: int, n: int, raw: RawSocket) -> list[dict]:
    """The shared-memory and cross-host rows with segments in the directory ``label``
    (``$OMNI_ACTORS_SHM_DIR`` is set to it around this call). The cross-host rows
    alternate with raw-socket transfers of the same size (one before each
    repetition): their ratio compares moments of the same loopback flow."""
    rows = []

    def recycle_here(r) -> None:
        """What the owner of a completed request on this host does: the reader is
        done (its views dropped first), so the segment goes back for the next put,
        renamed here (``shm`` is on the segment's node)."""
        r[1].clear()
        shm.release(r[0], recycle=True)

    def recycle_there(r) -> None:
        """The same for a request owner on another node: released through the
        segment's data service."""
        r[1].clear()
        near.release(r[0], recycle=True)

    def unlink(r) -> None:
        r[1].clear()
        shm.release(r[0])

    def shm_put_get():
        ref = shm.put(out)
        return ref, shm.get(ref)
    rows.append(row("shared memory (put, get maps)", nbytes, measure(shm_put_get, n, after=recycle_here, warmup=2),
                    segdir=label))

    def shm_put_get_touch():
        ref = shm.put(out)
        got = shm.get(ref)
        int(got["x"].view(np.uint8)[::4096].sum())  # the page faults a reader pays on first touch
        return ref, got
    rows.append(row("shared memory + reader touches every page", nbytes,
                    measure(shm_put_get_touch, n, after=recycle_here, warmup=2), segdir=label))
    purge_free_segments(shm.shm.prefix)  # (no put of this row may claim a recycled segment,
    drop_mappings()  # and no mapping of one may hold tmpfs pages: the producer drops them within 1 s)
    rows.append(row("shared memory, fresh segment each put (unlinked)", nbytes,
                    measure(shm_put_get, n, after=unlink), segdir=label))

    def cross_put_get():
        ref = shm.put(out)
        return ref, near.get(ref)

    def raw_transfer() -> None:
        raw.transfer(nbytes)
    raw_times: list[float] = []
    rows.append(row("cross-host, loopback (put, get fetches)", nbytes,
                    measure(cross_put_get, n, after=recycle_there, warmup=2, before=raw_transfer,
                            before_times=raw_times), segdir=label))
    ref = shm.put(out)
    try:
        got = near.get(ref)["x"]
        assert np.array_equal(got, arr), "cross-host bytes differ"
        del got
        rows.append(row("cross-host get alone (the transfer)", nbytes,
                        measure(lambda: near.get(ref), n, before=raw_transfer, before_times=raw_times),
                        segdir=label))
    finally:
        shm.release(ref)
    rows.append(row(RAW_ALTERNATED, nbytes, timing_of(raw_times), segdir=label))
    return rows


def _ratios(rows: list[dict], sizes, dirs: list[str]) -> dict[str, list[dict]]:
    """Per segment directory: per size, the ratios (best-of-N)."""
    def best(path_start: str, nbytes: int, segdir: str | None = None) -> float | None:
        for r in rows:
            if (r["bytes"] == nbytes and r["path"].startswith(path_start) and "best_gbps" in r
                    and r.get("segdir") == segdir):
                return r["best_gbps"]
        return None

    out: dict[str, list[dict]] = {}
    for label in dirs:
        out[label] = []
        for size in sizes:
            nbytes = size * MB
            copy, copy4k, raw = best("memory copy (", nbytes), best("memory copy, 4 KiB", nbytes), \
                best("raw loopback", nbytes)
            shm, cross, get = best("shared memory (", nbytes, label), best("cross-host, loopback", nbytes, label), \
                best("cross-host get alone", nbytes, label)
            raw = best(RAW_ALTERNATED, nbytes, label) or raw
            fresh = best("shared memory, fresh", nbytes, label)
            out[label].append({"size_mb": size, "shm_over_copy": shm / copy, "cross_over_raw": cross / raw,
                               "cross_get_over_raw": get / raw, "shm_over_copy_4k": shm / copy4k,
                               "shm_fresh_over_copy": fresh / copy})
    return out


def print_transfer(result: dict) -> None:
    print("\n== transfer: put+get throughput (median of reps; best in brackets) ==")
    huge = result["huge_tmpfs"]
    if huge["mounted"]:
        print(f"segments in /dev/shm, and in a {HUGE_LABEL} mounted for this run ({huge['note']})")
    else:
        print(f"segments in /dev/shm only; the {HUGE_LABEL} variant was skipped: {huge['note']}")
    def label(r: dict) -> str:
        return r["path"] + (f" [{r['segdir']}]" if r.get("segdir") else "")
    width = max(len(label(r)) for r in result["rows"])
    print(f"{'size':>7}  {'path':<{width}} {'ms':>9} {'GB/s':>7} {'(best)':>8}")
    last = None
    for r in result["rows"]:
        size = f"{r['bytes'] // MB} MB"
        if last is not None and size != last:
            print()
        last = size
        path = label(r)
        if "median_s" in r:
            print(f"{size:>7}  {path:<{width}} {r['median_s'] * 1e3:9.2f} {r['median_gbps']:7.2f} "
                  f"({r['best_gbps']:6.2f})")
        else:
            print(f"{size:>7}  {path:<{width}} {'-':>9} {'-':>7} {'':>8}  {r['note']}")

    def fmt(v):
        return f"{v:.2f} {'ok' if v >= TARGET else 'MISS'}"

    verdicts = []
    for label, ratios in result["ratios"].items():
        print(f"\nratios, segments in {label} (best-of-N; target >= {TARGET}):")
        print(f"{'size':>7}  {'shm / memory copy':>18}  {'cross-host / raw socket':>24}  "
              f"{'cross-host get / raw':>21}  {'(shm / 4 KiB copy)':>19}  {'(fresh shm / copy)':>19}")
        for q in ratios:
            print(f"{q['size_mb']:>4} MB  {fmt(q['shm_over_copy']):>18}  {fmt(q['cross_over_raw']):>24}  "
                  f"{fmt(q['cross_get_over_raw']):>21}  {q['shm_over_copy_4k']:>19.2f}  "
                  f"{q['shm_fresh_over_copy']:>19.2f}")
        verdicts.append((label, [q["size_mb"] for q in ratios if q["shm_over_copy"] < TARGET],
                         [q["size_mb"] for q in ratios if q["cross_over_raw"] < TARGET]))
    print(f"\ntargets (>= {TARGET} at every size):")
    for label, shm_miss, cross_miss in verdicts:
        def said(miss):
            return "met" if not miss else f"NOT met (at {', '.join(f'{m} MB' for m in miss)})"
        print(f"  segments in {label + ':':<{max(len(v[0]) for v in verdicts) + 1}} "
              f"shared memory / memory copy {said(shm_miss)}; cross-host / raw socket {said(cross_miss)}")
    both = [label for label, shm_miss, cross_miss in verdicts if not shm_miss and not cross_miss]
    print(f"  both targets met with segments in: {', '.join(both) if both else 'neither'}")
    if not huge["mounted"]:
        print(f"  ({HUGE_LABEL} not measured: {huge['note']})")


# --------------------------------------------------------------------- section: first_audio

def section_first_audio(args) -> dict:
    """Time to first audio, streaming vs whole outputs (benchmarks/first_audio.py); it prints its table."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    from first_audio import print_first_audio

    print("\n== first audio: streaming between stages vs whole outputs ==", flush=True)
    ratio = print_first_audio(args.first_audio_requests, args.first_audio_max_tokens)
    return {"streaming_over_whole": ratio, "target": 0.3, "met": ratio <= 0.3}


def print_first_audio_result(result: dict) -> None:
    pass  # printed as it ran (print_first_audio)


# --------------------------------------------------------------------- main

#: name -> (run(args) -> result, print(result)); run in this order.
SECTIONS: dict[str, tuple[Callable[[Any], dict], Callable[[dict], None]]] = {
    "transfer": (section_transfer, print_transfer),
    "first_audio": (section_first_audio, print_first_audio_result),
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
    p.add_argument("--no-huge-tmpfs", action="store_true",
                   help="do not mount a huge-page tmpfs for the segments (only /dev/shm)")
    p.add_argument("--tcp-congestion", default=None, metavar="NAME",
                   help="TCP congestion control of the raw socket's sender and of the data services "
                        "(e.g. cubic; default: the host's, printed in the header)")
    p.add_argument("--skip-first-audio", action="store_true", help="leave out the first_audio section")
    p.add_argument("--first-audio-requests", type=int, default=10,
                   help="streamed requests per mode in first_audio (default 10)")
    p.add_argument("--first-audio-max-tokens", type=int, default=64,
                   help="Thinker tokens per request in first_audio (default 64)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    args.sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    if args.skip_first_audio:
        args.sections = [s for s in args.sections if s != "first_audio"]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown or not args.sizes or min(args.sizes) <= 0:
        p.error(f"unknown section(s) {unknown}" if unknown else "sizes must be positive")
    return args


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Run a clean-up whole: Ctrl-C and SIGTERM during it (a second Ctrl-C, or ``timeout``,
    which signals the child and then its group) take effect after it, as KeyboardInterrupt."""
    got: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: got.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if got:
            raise KeyboardInterrupt


def _interrupt(signum, frame):
    """SIGTERM unwinds like Ctrl-C, so every ``finally`` runs (data services, leaders, the tmpfs mount)."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}, {os.cpu_count()} CPUs; transparent huge pages: "
          f"anon {_sysfs('/sys/kernel/mm/transparent_hugepage/enabled')}, "
          f"shmem {_sysfs('/sys/kernel/mm/transparent_hugepage/shmem_enabled')}; "
          f"/dev/shm mounted {_mount_options('/dev/shm') or '?'}; TCP congestion control "
          f"{args.tcp_congestion or _sysfs('/proc/sys/net/ipv4/tcp_congestion_control') + ' (the host default)'}",
          flush=True)
    signal.signal(signal.SIGTERM, _interrupt)
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
