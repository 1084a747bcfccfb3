"""What the size of one write call costs a durable append, in a bare file and in the server.

The range server writes each APPEND frame's entries to its segment file with ``pwritev``. On
this machine one call of 4 MiB or more into a new part of a file ran erratically slower than
the same bytes written 1-2 MiB per call, so the server cuts its writes at
``sbp_spark.server.storage.segment.WRITE_CALL_BYTES``. This script shows both sides, variants run
alternately:

* ``file N``: ``sbp bench``'s storage ceiling (a new file, fsynced every 10 ms) written ``N``
  MiB per ``pwritev`` call, for each of ``--sizes``;
* ``server N`` (with ``--server``): one client appending 1 MiB batches to a bench cluster, its
  APPEND frames closed at ``N`` MiB (the client's default is 1), so each frame reaches the
  server's storage as one write of ``N`` MiB.

The report is each variant's median MB/s, its range, and its ratio to the 1 MiB variant of
the same kind.

Measured here (2026-11-27, 2 vCPUs, 512 MiB per run): see integration/bench/RESULTS.md, the
twelfth session.

Usage: ``python integration/bench/write_sizes.py [--mib 512] [--rounds 5] [--sizes 1,2,4,8]
[--server] [--dir DIR]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

from sbp_spark.bench.loopback import file_append_seconds

MIB = 1024 * 1024
# The storage ceiling's fsync interval under ``group`` (see sbp_spark/bench/client.py).
FSYNC_INTERVAL_MS = 10


def file_run(total: int, size_mib: int, directory: str) -> float:
    """MB/s of appending ``total`` bytes to a new file ``size_mib`` MiB per call."""
    return total / 1e6 / file_append_seconds(directory, total, os.urandom(size_mib * MIB),
                                             FSYNC_INTERVAL_MS)


class ServerRuns:
    """A bench cluster and one client per frame size, kept across rounds."""

    def __init__(self, directory: str, sizes: list[int]) -> None:
        from sbp_spark.bench.client import _opaque_batches
        from sbp_spark.bench.server_proc import ServerProcess
        from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient

        self._scratch = tempfile.TemporaryDirectory(prefix="write-sizes-", dir=directory)
        self._server = ServerProcess(Path(self._scratch.name) / "data").start()
        self._batches = _opaque_batches(64)
        self._clients = {size: SbpClient(self._server.pd, pool=ConnectionPool(),
                                         config=ClientConfig(append_frame_bytes=size * MIB))
                         for size in sizes}

    def run(self, total: int, size_mib: int) -> float:
        """MB/s of appending ``total`` bytes in 1 MiB batches to a new stream."""
        from sbp_spark.bench.client import timed_append

        client = self._clients[size_mib]
        stream_id = int(client.create_streams(count=1)[0].stream_id)
        return total / 1e6 / timed_append(client, stream_id, self._batches, total // MIB)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._server.stop()
        self._scratch.cleanup()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="MiB per run (default 512)")
    parser.add_argument("--rounds", type=int, default=5, help="runs of each variant (default 5)")
    parser.add_argument("--sizes", default="1,2,4,8",
                        help="MiB per write call (or per APPEND frame), comma list; 1 is "
                             "always included (default 1,2,4,8)")
    parser.add_argument("--server", action="store_true",
                        help="also append through a bench cluster with frames of each size")
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="where the scratch files go (the disk under test)")
    args = parser.parse_args(argv)
    try:
        sizes = sorted({1, *(int(s) for s in args.sizes.split(",") if s.strip())})
    except ValueError:
        parser.error(f"--sizes {args.sizes!r}: not a comma list of whole MiB")
    if min(args.mib, args.rounds, *sizes) < 1:
        parser.error("--mib, --rounds and every size must be >= 1")
    if args.mib % max(sizes):
        parser.error(f"--mib {args.mib} is not a multiple of the largest size {max(sizes)}")
    total = args.mib * MIB
    kinds = ["file", "server"] if args.server else ["file"]
    rates: dict[tuple[str, int], list[float]] = {(k, s): [] for k in kinds for s in sizes}
    server = ServerRuns(args.dir, sizes) if args.server else None
    try:
        for r in range(args.rounds):
            for kind in kinds:
                for size in sizes:
                    mbs = (file_run(total, size, args.dir) if kind == "file"
                           else server.run(total, size))  # type: ignore[union-attr]
                    rates[(kind, size)].append(mbs)
                    print(f"round {r + 1} {kind} {size} MiB {mbs:7,.0f} MB/s", flush=True)
    finally:
        if server is not None:
            server.close()
    for kind in kinds:
        base = statistics.median(rates[(kind, 1)])
        for size in sizes:
            runs = rates[(kind, size)]
            median = statistics.median(runs)
            print(f"{kind} {size} MiB {median:7,.0f} MB/s ({min(runs):,.0f}-{max(runs):,.0f})  "
                  f"{median / base:.2f}x 1 MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
