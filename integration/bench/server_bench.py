"""Range server throughput per fsync policy, and its memory under many concurrent clients.

The range server runs in a child process (as in production, it does not share the GIL with
the client); the client side is the project's ``Connection`` driving raw APPEND and FETCH
frames, so the figures are the server's, not the connector's.

Measured, for each fsync policy (``never``, ``group``, ``interval``, ``always``):

* APPEND and FETCH MB/s with 1 MiB batches (8 per frame, 4 frames in flight; one streamed FETCH
  for the whole range);
* APPEND and FETCH records/s with 100-byte records in 1,000-record Arrow batches;

each next to its storage ceiling: the same bytes appended to a file on the data directory's
disk, made durable the way that policy acknowledges (``sbp bench``'s definition; APPEND cannot
beat it); and the server's resident memory (RSS) while 64 clients append and long-poll at once.

Usage: ``python integration/bench/server_bench.py [--mib 256] [--records 1000000]
[--clients 64] [--seconds 5] [--policies never,group,interval,always] [--repeats 3]
[--data-root DIR] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pyarrow as pa

from sbp_spark.bench.client import storage_durability
from sbp_spark.bench.loopback import file_append_seconds
from sbp_spark.bench.procmem import status_kib
from sbp_spark.client import ClientConfig, Connection
from sbp_spark.protocol.constants import Opcode
from sbp_spark.protocol.messages import (
    AppendEntry,
    AppendRequest,
    AppendResponse,
    FetchEntry,
    FetchRequest,
    FetchResponse,
    Range,
    RangeReplica,
    RangeServer,
    StreamRanges,
    SyncRangesRequest,
    decode_response,
    request_frame,
)
from sbp_spark.protocol.records import (
    batch_bytes,
    encode_arrow_batch,
    iter_batches,
    make_records_batch,
)

MIB = 1024 * 1024
SERVER_ID = 1
FRAME_BUDGET = 8 * MIB  # APPEND frames of about this size (the connector packs frames too)
INFLIGHT = 4
_CLIENT = ClientConfig(request_timeout_s=120.0)
# Where the server's data directories go (None: the system's temporary directory). Pointing
# it at a tmpfs (/dev/shm) takes the disk out and shows the server's own CPU cost.
DATA_ROOT: str | None = None


# -- the server process ----------------------------------------------------------------------


def _serve(data_dir: str, fsync: str, pipe) -> None:
    from sbp_spark.server.range_server import RangeServer as Server
    from sbp_spark.server.range_server import RangeServerConfig
    from sbp_spark.server.storage import StorageConfig

    server = Server(RangeServerConfig(data_dir=data_dir, server_id=SERVER_ID,
                                      storage=StorageConfig(fsync=fsync))).start()
    pipe.send((server.net.address_str, os.getpid()))
    pipe.recv()  # any message: stop
    server.stop()


@contextmanager
def server_process(fsync: str) -> Iterator[tuple[str, int]]:
    """A range server in a child process; yields (address, pid)."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="sbp-server-bench-", dir=DATA_ROOT) as data_dir:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(data_dir, fsync, child), daemon=True)
        proc.start()
        try:
            if not parent.poll(60):
                raise RuntimeError("the range server did not start within 60 s")
            yield parent.recv()
        finally:
            parent.send("stop")
            proc.join(30)
            if proc.is_alive():
                proc.kill()


def memory_of(pid: int) -> dict[str, int]:
    """RSS figures of a process in bytes: VmRSS, VmHWM (peak), RssAnon, RssFile; and Threads."""
    fields = status_kib(pid, ("VmRSS", "VmHWM", "RssAnon", "RssFile", "Threads"))
    return {k: v if k == "Threads" else v * 1024 for k, v in fields.items()}


# -- client helpers --------------------------------------------------------------------------


def create_range(conn: Connection, stream_id: int) -> None:
    rng = Range(stream_id, 0, 0, 0, -1, [RangeReplica(RangeServer(SERVER_ID, ""), True)])
    response, _ = conn.call(SyncRangesRequest(stream_ranges=[StreamRanges(stream_id, [rng])]))
    response.sync_responses[0].status.raise_for_status()


def _append_frames(stream_id: int, batch: bytes, count: int) -> Iterator[tuple[list, bytes]]:
    per_frame = max(1, FRAME_BUDGET // len(batch))
    payload_cache: dict[int, bytes] = {}
    sent = 0
    while sent < count:
        k = min(per_frame, count - sent)
        if k not in payload_cache:
            payload_cache[k] = batch * k
        entries = [AppendEntry(stream_id, sent + i, len(batch)) for i in range(k)]
        yield entries, payload_cache[k]
        sent += k


def append_all(conn: Connection, stream_id: int, batch: bytes, count: int) -> float:
    """Append ``count`` copies of ``batch``, ``INFLIGHT`` frames at a time; returns seconds."""
    pending: deque = deque()

    def finish(stream) -> None:
        with stream:
            msg = decode_response(next(stream))
        assert isinstance(msg, AppendResponse), msg
        for r in msg.append_responses:
            r.status.raise_for_status()

    began = time.perf_counter()
    for entries, payload in _append_frames(stream_id, batch, count):
        if len(pending) >= INFLIGHT:
            finish(pending.popleft())
        req = AppendRequest(timeout_ms=60_000, append_requests=entries)
        pending.append(conn.start(Opcode.APPEND,
                                  lambda sid, r=req, p=payload: request_frame(sid, r, p)))
    while pending:
        finish(pending.popleft())
    return time.perf_counter() - began


def fetch_all(conn: Connection, stream_id: int, end_offset: int) -> tuple[float, int, int]:
    """Stream the whole range with one FETCH; returns (seconds, payload bytes, frames)."""
    req = FetchRequest(0, 0, [FetchEntry(stream_id, 0, 0, (1 << 31) - 1, end_offset)])
    began = time.perf_counter()
    nbytes = frames = 0
    with conn.start(Opcode.FETCH, lambda sid: request_frame(sid, req)) as stream:
        for frame in stream:
            msg = decode_response(frame)
            assert isinstance(msg, FetchResponse), msg
            for r in msg.fetch_responses:
                r.status.raise_for_status()
            nbytes += len(frame.payload)
            frames += 1
    return time.perf_counter() - began, nbytes, frames


def records_batch(records: int = 1000, size: int = 100) -> bytes:
    values = pa.array([os.urandom(size) for _ in range(records)], pa.binary())
    return b"".join(bytes(b) for b in encode_arrow_batch(make_records_batch(values)))


# -- benchmarks ------------------------------------------------------------------------------


def bench_policy(fsync: str, mib: int, records: int) -> dict:
    """APPEND/FETCH throughput for one fsync policy."""
    big = batch_bytes(os.urandom(MIB - 28))
    small = records_batch()
    n_small = max(1, records // 1000)
    out: dict = {"fsync": fsync, "storage_MBps": bench_storage(fsync, mib)}
    with server_process(fsync) as (address, _pid), Connection(address, _CLIENT) as conn:
        create_range(conn, 1)
        create_range(conn, 2)
        secs = append_all(conn, 1, big, mib)
        out["append_MBps"] = mib * len(big) / secs / 1e6
        secs, nbytes, frames = fetch_all(conn, 1, mib)
        assert nbytes == mib * len(big), (nbytes, mib * len(big))
        out["fetch_MBps"] = nbytes / secs / 1e6
        out["fetch_frames"] = frames
        secs = append_all(conn, 2, small, n_small)
        out["append_records_per_s"] = n_small * 1000 / secs
        out["append_records_MBps"] = n_small * len(small) / secs / 1e6
        secs, nbytes, _ = fetch_all(conn, 2, n_small * 1000)
        out["fetch_records_per_s"] = n_small * 1000 / secs
        out["fetch_records_MBps"] = nbytes / secs / 1e6
    return out


def bench_storage(fsync: str, mib: int) -> float:
    """The ceiling APPEND cannot beat under ``fsync``, in MB/s: the same bytes appended to a
    file where the server's data goes, made durable the way the server acknowledges (the
    definition ``sbp bench`` uses)."""
    interval_ms, _ = storage_durability(fsync)
    with tempfile.TemporaryDirectory(prefix="sbp-server-bench-", dir=DATA_ROOT) as d:
        seconds = file_append_seconds(d, mib * MIB, os.urandom(MIB), interval_ms)
    return mib * MIB / seconds / 1e6


def _long_poll_tail(address: str, stream_id: int, stop: threading.Event) -> None:
    """Read ``stream_id`` from offset 0 with FETCH long polls until ``stop`` is set."""
    offset = 0
    with Connection(address, _CLIENT) as conn:
        while not stop.is_set():
            req = FetchRequest(500, 1, [FetchEntry(stream_id, 0, offset, 4 * MIB)])
            with conn.start(Opcode.FETCH, lambda sid, r=req: request_frame(sid, r)) as stream:
                for frame in stream:
                    msg = decode_response(frame)
                    for r in msg.fetch_responses:
                        r.status.raise_for_status()
                    for header, _ in iter_batches(memoryview(frame.payload)):
                        offset = header.end_offset


def _peak_memory(pid: int, idle: dict[str, int], seconds: float) -> dict[str, int]:
    """The ``memory_of(pid)`` sample with the highest RSS over ``seconds`` (``idle`` when
    none is higher), sampled every 0.1 s."""
    peak = dict(idle)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        now = memory_of(pid)
        if now["VmRSS"] > peak["VmRSS"]:
            peak = now
        time.sleep(0.1)
    return peak


def bench_rss(clients: int, seconds: float, fsync: str = "group") -> dict:
    """Server RSS while ``clients`` connections each append 64 KiB batches and a reader per
    client long-polls its stream."""
    batch = batch_bytes(os.urandom(64 * 1024 - 28))
    with server_process(fsync) as (address, pid):
        idle = memory_of(pid)
        with Connection(address, _CLIENT) as admin:
            for sid in range(clients):
                create_range(admin, 100 + sid)
        stop = threading.Event()
        counts = [0] * clients
        errors: list[BaseException] = []

        def writer(i: int) -> None:
            try:
                with Connection(address, _CLIENT) as conn:
                    while not stop.is_set():
                        append_all(conn, 100 + i, batch, 16)
                        counts[i] += 16
            except BaseException as exc:  # reported below
                errors.append(exc)

        def reader(i: int) -> None:
            try:
                _long_poll_tail(address, 100 + i, stop)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=f, args=(i,), daemon=True)
                   for i in range(clients) for f in (writer, reader)]
        for t in threads:
            t.start()
        peak = _peak_memory(pid, idle, seconds)
        stop.set()
        for t in threads:
            t.join(60)
        hwm = memory_of(pid)["VmHWM"]
        time.sleep(1.0)  # let the server finish with the departed clients
        after = memory_of(pid)
        if errors:
            raise RuntimeError(f"{len(errors)} client errors, first: {errors[0]!r}")
    total = sum(counts)
    return {"clients": clients, "idle_rss_MiB": idle["VmRSS"] / MIB,
            "peak_rss_MiB": peak["VmRSS"] / MIB, "peak_anon_MiB": peak["RssAnon"] / MIB,
            "peak_file_MiB": peak["RssFile"] / MIB, "peak_threads": peak["Threads"],
            "hwm_rss_MiB": hwm / MIB, "after_rss_MiB": after["VmRSS"] / MIB,
            "appended_MiB": total * len(batch) / MIB,
            "append_MBps": total * len(batch) / seconds / 1e6}


# -- main ------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB appended/fetched per policy")
    ap.add_argument("--records", type=int, default=1_000_000,
                    help="100-byte records appended/fetched per policy")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--policies", default="never,group,interval,always")
    ap.add_argument("--repeats", type=int, default=3, help="runs per policy (median shown)")
    ap.add_argument("--data-root", help="parent of the data directories (e.g. /dev/shm)")
    ap.add_argument("--json", help="also write the results to this file")
    args = ap.parse_args(argv)
    global DATA_ROOT
    DATA_ROOT = args.data_root
    results: dict = {"policies": [], "machine_cpus": os.cpu_count(),
                     "data_root": args.data_root or tempfile.gettempdir()}
    print(f"{'fsync':9} {'storage MB/s':>13} {'APPEND MB/s':>12} {'FETCH MB/s':>11} "
          f"{'APPEND rec/s':>13} {'FETCH rec/s':>12}")
    for policy in args.policies.split(","):
        runs = [bench_policy(policy.strip(), args.mib, args.records)
                for _ in range(args.repeats)]
        # Medians: this machine's disk and neighbours make single runs swing 2-5x.
        r = {k: (statistics.median(run[k] for run in runs) if isinstance(v, float) else v)
             for k, v in runs[0].items()}
        r["runs"] = runs
        results["policies"].append(r)
        print(f"{r['fsync']:9} {r['storage_MBps']:13.0f} {r['append_MBps']:12.0f} "
              f"{r['fetch_MBps']:11.0f} "
              f"{r['append_records_per_s']:13,.0f} {r['fetch_records_per_s']:12,.0f}",
              flush=True)
    if args.clients > 0:
        r = bench_rss(args.clients, args.seconds)
        results["rss"] = r
        print(f"RSS with {r['clients']} clients appending + long-polling for {args.seconds:g} "
              f"s: idle {r['idle_rss_MiB']:.0f} MiB, peak {r['peak_rss_MiB']:.0f} MiB "
              f"(anonymous {r['peak_anon_MiB']:.0f}, file-backed {r['peak_file_MiB']:.0f}; "
              f"{r['peak_threads']} threads; high-water {r['hwm_rss_MiB']:.0f} MiB; "
              f"{r['after_rss_MiB']:.0f} MiB after the clients left); "
              f"{r['append_MBps']:.0f} MB/s appended")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
