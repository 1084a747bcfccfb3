"""The client section of ``sbp bench``, plus the client's cost per batch.

The APPEND/FETCH figures (1 MiB batches, next to the raw loopback ceiling measured right before
and after each run) and the records/s figures are ``sbp_spark.bench.client``'s, run here against
the same server process (``sbp_spark.bench.server_proc``) as ``sbp bench --sections client``.
This script adds batches/s with one 100-byte record per batch, where the client's work per
batch, not the bytes, is the limit.

Usage: ``python integration/bench/client_bench.py [--mib 512] [--runs 3]
[--small-batches 20000] [--fsync never|group|interval|always] [--json FILE]``.
Exit code 1 if a figure could not be measured (missed targets show in the table).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from sbp_spark.bench.context import BenchConfig, BenchContext
from sbp_spark.bench.harness import run_sections
from sbp_spark.bench.report import Figure, format_table, machine_info, to_json
from sbp_spark.bench.timing import Progress
from sbp_spark.protocol.records import encode_batch

SECTION = "client"
RECORD_BYTES = 100
# Batches handed to one StreamWriter.append call.
BATCHES_PER_CALL = 1000


def per_batch_figures(ctx: BenchContext, batches: int) -> list[Figure]:
    """APPEND and FETCH batches/s with one ``RECORD_BYTES`` record per batch."""
    batch = encode_batch(b"s" * RECORD_BYTES)
    stream_id = ctx.create_stream()
    with ctx.client() as client:
        writer = client.open_stream(stream_id)
        began = time.perf_counter()
        done = 0
        while done < batches:
            n = min(BATCHES_PER_CALL, batches - done)
            writer.append([batch] * n)
            done += n
        append_s = time.perf_counter() - began
        began = time.perf_counter()
        got = sum(1 for _ in client.read(stream_id))
        fetch_s = time.perf_counter() - began
    if got != batches:
        raise RuntimeError(f"read back {got} batches, appended {batches}")
    ctx.progress("per-batch", f"one record per batch: APPEND {batches / append_s:,.0f}/s, "
                          f"FETCH {batches / fetch_s:,.0f}/s")
    return [Figure(SECTION, f"{op} one {RECORD_BYTES} B record per batch", "batches/s",
                   batches / seconds, extra={"batches": batches, "seconds": seconds})
            for op, seconds in (("APPEND", append_s), ("FETCH", fetch_s))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=None,
                        help="MiB per timed APPEND/FETCH run (default: sbp bench's, 512)")
    parser.add_argument("--runs", type=int, default=None,
                        help="timed APPEND/FETCH runs (default: sbp bench's, 3)")
    parser.add_argument("--small-batches", type=int, default=20_000,
                        help="one-record batches for the per-batch figures")
    parser.add_argument("--fsync", choices=("never", "group", "interval", "always"), default=None,
                        help="the cluster's fsync policy (default: the cluster's default)")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args(argv)

    config = BenchConfig.full()
    if args.mib is not None:
        config.client_bytes = args.mib * 1024 * 1024
    if args.runs is not None:
        config.client_runs = args.runs
    config.fsync = args.fsync
    progress = Progress()
    with tempfile.TemporaryDirectory(prefix="sbp-client-bench-") as workdir:
        ctx = BenchContext(config, Path(workdir), progress)
        try:
            figures = run_sections(ctx, [SECTION, "per-batch"], runners={
                "per-batch": lambda c: per_batch_figures(c, args.small_batches)})
        finally:
            ctx.close()
    print(format_table(figures))
    if args.json is not None:
        meta = {"command": "client_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
                "config": dict(vars(config)), "machine": machine_info()}
        args.json.write_text(to_json(figures, meta) + "\n")
    return 1 if any(f.value is None for f in figures) else 0


if __name__ == "__main__":
    sys.exit(main())
