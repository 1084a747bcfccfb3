"""Client throughput against an embedded cluster, next to the raw loopback ceiling.

The cluster runs in a child process together with a raw socket peer, so that the ceiling
(plain ``sendall``/``recv_into`` between the same two processes) and the client's APPEND and
FETCH figures come from one run on one machine state. Targets: FETCH >= 0.5x and APPEND >= 0.35x
of the ceiling in the same direction.

Usage: ``python integration/bench/client_bench.py [--mib 256] [--records 1000000] [--json F]``.
Each ``bench_*`` function returns a dict and can be imported on its own.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pyarrow as pa

from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient
from sbp_spark.protocol.records import (
    body_to_arrow,
    encode_arrow_batch,
    encode_batch,
    make_records_batch,
)

MIB = 1024 * 1024
CHUNK = MIB  # raw sends and benchmark batches: 1 MiB
RECV_PIECE = 256 * 1024  # receive size measured fastest on this machine (PERF_NOTES)
_CMD = struct.Struct(">cQ")  # raw peer command: b"U" (client uploads n bytes) / b"D" (download)


# -- the child process: cluster + raw peer ---------------------------------------------------


def _raw_session(sock: socket.socket) -> None:
    buf = bytearray(RECV_PIECE)
    view = memoryview(buf)
    chunk = b"\x5a" * CHUNK
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            head = sock.recv(_CMD.size, socket.MSG_WAITALL)
            if len(head) < _CMD.size:
                return
            kind, size = _CMD.unpack(head)
            if kind == b"U":
                left = size
                while left:
                    n = sock.recv_into(view[:min(RECV_PIECE, left)])
                    if not n:
                        return
                    left -= n
                sock.sendall(b"k")
            else:
                left = size
                while left:
                    n = min(CHUNK, left)
                    sock.sendall(chunk[:n] if n < CHUNK else chunk)
                    left -= n


def _raw_server(listener: socket.socket) -> None:
    while True:
        try:
            sock, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=_raw_session, args=(sock,), daemon=True).start()


def _child(pipe, data_dir: str, range_servers: int, fsync: str) -> None:
    from sbp_spark.server.cluster import EmbeddedCluster

    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_raw_server, args=(listener,), daemon=True).start()
    with EmbeddedCluster(data_dir, range_servers=range_servers, fsync=fsync) as cluster:
        pipe.send({"pd": cluster.pd_address,
                   "raw": f"127.0.0.1:{listener.getsockname()[1]}"})
        pipe.recv()  # runs until the parent says stop
    listener.close()


@dataclass
class Cluster:
    pd: str
    raw: str


@contextmanager
def cluster_process(data_dir: str | None = None, range_servers: int = 1,
                    fsync: str = "never") -> Iterator[Cluster]:
    """An embedded cluster plus a raw socket peer in a fresh child process."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    with tempfile.TemporaryDirectory(prefix="sbp-client-bench-") as tmp:
        proc = ctx.Process(target=_child, args=(child, data_dir or tmp, range_servers, fsync),
                           daemon=True)
        proc.start()
        try:
            if not parent.poll(60):
                raise RuntimeError("the benchmark cluster did not start within 60 s")
            info = parent.recv()
            yield Cluster(info["pd"], info["raw"])
        finally:
            try:
                parent.send("stop")
            except OSError:
                pass  # the child is already gone
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)


# -- raw ceiling ---------------------------------------------------------------------------


def _raw_connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def bench_raw(address: str, total_bytes: int) -> dict:
    """Plain loopback copy to and from the child: 1 MiB sends, 256 KiB receives."""
    chunk = b"\xa5" * CHUNK
    buf = bytearray(RECV_PIECE)
    view = memoryview(buf)
    with _raw_connect(address) as sock:
        began = time.perf_counter()
        sock.sendall(_CMD.pack(b"U", total_bytes))
        left = total_bytes
        while left:
            n = min(CHUNK, left)
            sock.sendall(chunk if n == CHUNK else chunk[:n])
            left -= n
        assert sock.recv(1) == b"k"
        upload_s = time.perf_counter() - began
        began = time.perf_counter()
        sock.sendall(_CMD.pack(b"D", total_bytes))
        left = total_bytes
        while left:
            n = sock.recv_into(view[:min(RECV_PIECE, left)])
            if not n:
                raise ConnectionError("raw peer closed early")
            left -= n
        download_s = time.perf_counter() - began
    return {"bytes": total_bytes,
            "upload_MBps": total_bytes / upload_s / 1e6,
            "download_MBps": total_bytes / download_s / 1e6}


# -- client --------------------------------------------------------------------------------


def _client(pd: str, pool: ConnectionPool) -> SbpClient:
    return SbpClient(pd, ClientConfig(max_inflight_frames=4), pool)


def bench_append_fetch(pd: str, total_bytes: int, batch_bytes: int = CHUNK,
                       batches_per_call: int = 64) -> dict:
    """APPEND then FETCH (one streamed read) of ``total_bytes`` in opaque batches."""
    with ConnectionPool() as pool:
        client = _client(pd, pool)
        (stream,) = client.create_streams()
        writer = client.open_stream(stream.stream_id)
        batch = encode_batch(b"\x42" * (batch_bytes - 28))
        count = max(1, total_bytes // batch_bytes)
        began = time.perf_counter()
        done = 0
        while done < count:
            n = min(batches_per_call, count - done)
            writer.append([batch] * n)
            done += n
        append_s = time.perf_counter() - began
        written = count * batch_bytes
        began = time.perf_counter()
        fetched = records = 0
        for fetched_batch in client.read(stream.stream_id):
            fetched += fetched_batch.header.batch_length
            records += fetched_batch.header.record_count
        fetch_s = time.perf_counter() - began
        if fetched != written or records != count:
            raise AssertionError(f"read back {fetched} bytes / {records} records, wrote "
                                 f"{written} / {count}")
    return {"bytes": written, "batch_bytes": batch_bytes,
            "append_MBps": written / append_s / 1e6, "fetch_MBps": written / fetch_s / 1e6}


def bench_records(pd: str, records: int, record_bytes: int = 100,
                  records_per_batch: int = 10_000, batches_per_call: int = 16) -> dict:
    """Records/s with ``record_bytes``-byte values packed in Arrow record batches (the
    connector's layout); the read side opens every body as Arrow."""
    values = pa.array([b"v" * record_bytes] * records_per_batch, pa.binary())
    arrow_batch = make_records_batch(values)
    encoded = encode_arrow_batch(arrow_batch)
    count = max(1, records // records_per_batch)
    with ConnectionPool() as pool:
        client = _client(pd, pool)
        (stream,) = client.create_streams()
        writer = client.open_stream(stream.stream_id)
        began = time.perf_counter()
        done = 0
        while done < count:
            n = min(batches_per_call, count - done)
            writer.append([encoded] * n)
            done += n
        append_s = time.perf_counter() - began
        began = time.perf_counter()
        rows = 0
        for fetched in client.read(stream.stream_id):
            rows += body_to_arrow(fetched.data[28:]).num_rows
        fetch_s = time.perf_counter() - began
    total = count * records_per_batch
    if rows != total:
        raise AssertionError(f"read back {rows} records, wrote {total}")
    return {"records": total, "record_bytes": record_bytes,
            "records_per_batch": records_per_batch,
            "append_records_per_s": total / append_s, "fetch_records_per_s": total / fetch_s}


def bench_small_batches(pd: str, batches: int = 20_000, record_bytes: int = 100,
                        batches_per_call: int = 1000) -> dict:
    """Batches/s with one 100-byte record per batch: the per-batch cost of the client."""
    batch = encode_batch(b"s" * record_bytes)
    with ConnectionPool() as pool:
        client = _client(pd, pool)
        (stream,) = client.create_streams()
        writer = client.open_stream(stream.stream_id)
        began = time.perf_counter()
        done = 0
        while done < batches:
            n = min(batches_per_call, batches - done)
            writer.append([batch] * n)
            done += n
        append_s = time.perf_counter() - began
        began = time.perf_counter()
        got = sum(1 for _ in client.read(stream.stream_id))
        fetch_s = time.perf_counter() - began
    if got != batches:
        raise AssertionError(f"read back {got} batches, wrote {batches}")
    return {"batches": batches, "append_batches_per_s": batches / append_s,
            "fetch_batches_per_s": batches / fetch_s}


def run(total_mib: int = 256, records: int = 1_000_000, small_batches: int = 20_000,
        repeats: int = 5) -> dict:
    """Every figure in one run against one cluster.

    Each round measures the raw ceiling right before APPEND and FETCH, so a ratio compares
    figures taken under the same machine load; the reported ratios are medians of the
    per-round ratios (and the MB/s figures medians of the rounds).
    """
    total = total_mib * MIB
    raw: list[dict] = []
    data: list[dict] = []
    with cluster_process() as cluster:
        for _ in range(repeats):
            raw.append(bench_raw(cluster.raw, total))
            data.append(bench_append_fetch(cluster.pd, total))
        recs = bench_records(cluster.pd, records)
        small = bench_small_batches(cluster.pd, small_batches)
    return {
        "raw_upload_MBps": _median(r["upload_MBps"] for r in raw),
        "raw_download_MBps": _median(r["download_MBps"] for r in raw),
        "append_MBps": _median(d["append_MBps"] for d in data),
        "fetch_MBps": _median(d["fetch_MBps"] for d in data),
        "append_vs_ceiling": _median(d["append_MBps"] / r["upload_MBps"]
                                     for r, d in zip(raw, data, strict=True)),
        "fetch_vs_ceiling": _median(d["fetch_MBps"] / r["download_MBps"]
                                    for r, d in zip(raw, data, strict=True)),
        "append_target": 0.35, "fetch_target": 0.5,
        "records": recs, "small_batches": small,
        "runs": {"raw": raw, "data": data},
    }


def _median(values) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB per APPEND/FETCH run")
    parser.add_argument("--records", type=int, default=1_000_000,
                        help="100-byte records for the records/s figure")
    parser.add_argument("--small-batches", type=int, default=20_000,
                        help="one-record batches for the per-batch figure")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    result = run(args.mib, args.records, args.small_batches, args.repeats)
    rows = [
        ("raw loopback upload (ceiling for APPEND)", f"{result['raw_upload_MBps']:,.0f} MB/s"),
        ("raw loopback download (ceiling for FETCH)", f"{result['raw_download_MBps']:,.0f} MB/s"),
        ("APPEND, 1 MiB batches", f"{result['append_MBps']:,.0f} MB/s "
                                  f"({result['append_vs_ceiling']:.2f}x, target 0.35x)"),
        ("FETCH, 1 MiB batches", f"{result['fetch_MBps']:,.0f} MB/s "
                                 f"({result['fetch_vs_ceiling']:.2f}x, target 0.5x)"),
        ("APPEND, 100 B records in Arrow batches",
         f"{result['records']['append_records_per_s']:,.0f} records/s"),
        ("FETCH + Arrow open, 100 B records",
         f"{result['records']['fetch_records_per_s']:,.0f} records/s"),
        ("APPEND, one 100 B record per batch",
         f"{result['small_batches']['append_batches_per_s']:,.0f} batches/s"),
        ("FETCH, one 100 B record per batch",
         f"{result['small_batches']['fetch_batches_per_s']:,.0f} batches/s"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    ok = result["append_vs_ceiling"] >= 0.35 and result["fetch_vs_ceiling"] >= 0.5
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
