"""Throughput off loopback: the client and the connector over slow links (needs root).

A PD, one range server and a client machine each on a network namespace of their own
(``integration/netlab``). For each link profile the client's links to the range server are
shaped by the delay line (added round trip, bandwidth cap; the PD's link is left alone), and a
fresh process on the client machine measures, each next to the raw TCP ceiling of the same
link (plain ``sendall``/``recv_into`` through the same delay line, ``sbp_spark.bench.loopback``):

* client APPEND and FETCH of 1 MiB batches (``SbpClient``, as ``sbp bench``'s client section);
* Spark batch ``write.format("sbp")`` and ``read.format("sbp")`` + an aggregation of
  ``--spark-rows`` rows of 100-byte values (local[2], as ``sbp bench``'s Spark section).

Profiles: the namespaces' own link (no delay line), the delay line adding nothing (what the
proxy itself costs), +5 ms and +50 ms round trips, and a 100 Mbit/s cap. Each figure is the
median of ``--runs`` timed runs after a warm-up; the table shows MB/s, the client's next to
the raw TCP ceiling of the same link, Spark's next to its own figure on the unshaped link.

    python -m integration.bench.slow_links [run] [--client-mib 64] [--spark-rows 500000]
                                           [--runs 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from integration.netlab.network import REPO, Network, remove_leftovers, unavailable
from sbp_spark.server.cluster import ProcessCluster, write_ready_file

MIB = 1024 * 1024
MB = 1_000_000
RECORD_SIZE = 100
SPARK_PARTITIONS = 4
APPEND_CALL_BATCHES = 64


@dataclass(frozen=True)
class Profile:
    """A link between the client and the range server."""

    name: str
    rtt_ms: float | None  # None: no delay line at all
    rate_mbit: float | None = None


PROFILES = (
    Profile("namespace link, no delay line", None),
    Profile("delay line, +0 ms", 0.0),
    Profile("+5 ms round trip", 5.0),
    Profile("+50 ms round trip", 50.0),
    Profile("100 Mbit/s cap", 0.0, 100.0),
)


# -- on the client machine ----------------------------------------------------------------------


def _median_rate(total: int, times: list[float]) -> float:
    return total / MB / statistics.median(times)


def _ceilings(address: str, total: int, runs: int) -> dict[str, float]:
    from sbp_spark.bench.loopback import LoopbackClient

    pushes, pulls = [], []
    with LoopbackClient(address) as lo:
        lo.send(min(total, 8 * MIB))  # warm-up: the connection's windows open
        lo.receive(min(total, 8 * MIB))
        for _ in range(runs):
            pushes.append(lo.send(total))
            pulls.append(lo.receive(total))
    return {"tcp push MB/s": _median_rate(total, pushes),
            "tcp pull MB/s": _median_rate(total, pulls)}


def _client(pd: str, total: int, runs: int) -> dict[str, float]:
    from sbp_spark.bench.client import timed_append, timed_read
    from sbp_spark.client import SbpClient
    from sbp_spark.protocol.records import encode_batch

    client = SbpClient(pd)
    body = memoryview(os.urandom(MIB - 28))  # 1 MiB batches with their envelope
    batches = [encode_batch(body) for _ in range(APPEND_CALL_BATCHES)]
    count = total // MIB
    appends, fetches = [], []
    for run in range(runs + 1):
        [stream] = client.create_streams(1)
        appended = timed_append(client, stream.stream_id, batches, count)
        fetched, nbytes, _ = timed_read(client, stream.stream_id)
        if nbytes != count * MIB:
            raise RuntimeError(f"FETCH returned {nbytes} bytes, {count * MIB} appended")
        if run:  # the first run is the warm-up
            appends.append(appended)
            fetches.append(fetched)
    return {"APPEND MB/s": _median_rate(count * MIB, appends),
            "FETCH MB/s": _median_rate(count * MIB, fetches)}


def _spark(pd: str, rows: int, runs: int, workdir: Path) -> dict[str, float]:
    from sbp_spark.bench.context import BenchConfig, BenchContext
    from sbp_spark.bench.spark_batch import aggregate, check_rows, write_input
    from sbp_spark.bench.spark_sources import ArrowCeilingSource
    from sbp_spark.bench.timing import Progress
    from sbp_spark.client import SbpClient

    ctx = BenchContext(BenchConfig.quick_run(), workdir, Progress())
    spark = ctx.spark()
    spark.dataSource.register(ArrowCeilingSource)
    client = SbpClient(pd)
    source = write_input(spark, rows, RECORD_SIZE, SPARK_PARTITIONS).cache()
    if source.count() != rows:
        raise RuntimeError("the cached write input lost rows")
    writes, reads = [], []
    for run in range(runs + 1):
        stream = client.create_streams(1)[0].stream_id
        began = time.perf_counter()
        (source.write.format("sbp").option("pd", pd).option("stream", str(stream))
         .mode("append").save())
        wrote = time.perf_counter() - began
        df = (spark.read.format("sbp").option("pd", pd).option("streams", str(stream))
              .option("minPartitions", SPARK_PARTITIONS).load())
        began = time.perf_counter()
        check_rows("sbp read", aggregate(df), rows, RECORD_SIZE)
        read = time.perf_counter() - began
        if run:
            writes.append(wrote)
            reads.append(read)
    spark.stop()
    payload = rows * RECORD_SIZE
    return {"Spark write MB/s": _median_rate(payload, writes),
            "Spark read MB/s": _median_rate(payload, reads)}


def measure(args: argparse.Namespace) -> int:
    """One profile's figures, as one JSON object on stdout."""
    total = args.client_mib * MIB
    out = _ceilings(args.loopback, total, args.runs)
    out.update(_client(args.pd, total, args.runs))
    with tempfile.TemporaryDirectory(prefix="slow-links-spark-") as workdir:
        out.update(_spark(args.pd, args.spark_rows, args.runs, Path(workdir)))
    print(json.dumps(out))
    return 0


def sink(args: argparse.Namespace) -> int:
    """The raw TCP ceiling's far end, on the range server's machine, until killed."""
    from sbp_spark.bench.loopback import LoopbackServer

    server = LoopbackServer(args.host)
    write_ready_file(args.ready_file, {"address": server.address})
    while True:
        time.sleep(3600)


# -- the orchestrator ---------------------------------------------------------------------------


def _wait_ready(path: Path, proc: subprocess.Popen, what: str) -> dict:
    deadline = time.monotonic() + 30
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start (exit status {proc.poll()})")
        time.sleep(0.05)
    return json.loads(path.read_text())


def run_profiles(args: argparse.Namespace) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory(prefix="slow-links-") as tmp, \
            Network(["pd", "rs0", "client"], log_dir=Path(tmp)) as net:
        placements = {"pd": net["pd"].placement(), "rs-0": net["rs0"].placement()}
        with ProcessCluster(Path(tmp) / "cluster", range_servers=1,
                            placements=placements) as cluster:
            ready = Path(tmp) / "sink.ready"
            sink_proc = net.popen("rs0", [sys.executable, "-m", "integration.bench.slow_links",
                                          "sink", "--host", net["rs0"].address,
                                          "--ready-file", str(ready)])
            try:
                loopback = _wait_ready(ready, sink_proc, "the TCP sink")["address"]
                for profile in PROFILES:
                    if profile.rtt_ms is not None:
                        net.shape("client", ["rs0"], profile.rtt_ms, profile.rate_mbit)
                    print(f"profile {profile.name}: measuring", file=sys.stderr, flush=True)
                    # Spark's driver binds to this machine's own address (the namespace has
                    # no other name for itself).
                    env = dict(os.environ, SPARK_LOCAL_IP="127.0.0.1")
                    done = subprocess.run(
                        [*net["client"].prefix, sys.executable, "-m",
                         "integration.bench.slow_links", "measure", "--pd", cluster.pd_address,
                         "--loopback", loopback, "--client-mib", str(args.client_mib),
                         "--spark-rows", str(args.spark_rows), "--runs", str(args.runs)],
                        capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
                    net.unshape("client")
                    if done.returncode != 0:
                        raise RuntimeError(f"profile {profile.name} failed:\n"
                                           f"{done.stderr[-3000:]}")
                    figures = json.loads(done.stdout.strip().splitlines()[-1])
                    results.append({"profile": profile.name, "rtt_ms": profile.rtt_ms,
                                    "rate_mbit": profile.rate_mbit, **figures})
                    print(f"profile {profile.name}: {figures}", file=sys.stderr, flush=True)
            finally:
                sink_proc.kill()
                sink_proc.wait()
    return results


def table(results: list[dict]) -> str:
    """The results as a markdown table: MB/s, and a ratio. The client's figures are set
    against the raw TCP ceiling of the same link; Spark, whose CPU bounds it well below any
    of these links, against its own figure on the first profile (no delay line)."""
    head = ("| link between client and range server | raw TCP push / pull | client APPEND "
            "(x TCP push) | client FETCH (x TCP pull) | Spark write (x unshaped) | "
            "Spark read (x unshaped) |")
    lines = [head, "|---|---|---|---|---|---|"]
    base = results[0]

    def cell(value: float, ceiling: float) -> str:
        return f"{value:,.1f} MB/s ({value / ceiling:.2f}x)"

    for r in results:
        push, pull = r["tcp push MB/s"], r["tcp pull MB/s"]
        lines.append(
            f"| {r['profile']} | {push:,.1f} / {pull:,.1f} MB/s | "
            f"{cell(r['APPEND MB/s'], push)} | {cell(r['FETCH MB/s'], pull)} | "
            f"{cell(r['Spark write MB/s'], base['Spark write MB/s'])} | "
            f"{cell(r['Spark read MB/s'], base['Spark read MB/s'])} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    for name in ("run", "measure"):
        p = sub.add_parser(name)
        p.add_argument("--client-mib", type=int, default=64)
        p.add_argument("--spark-rows", type=int, default=500_000)
        p.add_argument("--runs", type=int, default=2)
    sub.choices["run"].add_argument("--json", type=Path)
    sub.choices["measure"].add_argument("--pd", required=True)
    sub.choices["measure"].add_argument("--loopback", required=True)
    sink_parser = sub.add_parser("sink")
    sink_parser.add_argument("--host", required=True)
    sink_parser.add_argument("--ready-file", type=Path, required=True)
    argv = list(argv or [])
    if not argv or argv[0].startswith("-"):
        argv.insert(0, "run")  # the default command
    args = parser.parse_args(argv)
    if args.command == "measure":
        return measure(args)
    if args.command == "sink":
        return sink(args)
    reason = unavailable()
    if reason is not None:
        print(f"slow_links: cannot build the network: {reason}", file=sys.stderr)
        return 2
    remove_leftovers()  # of runs that were killed
    began = time.monotonic()
    results = run_profiles(args)
    print(table(results))
    print(f"\n{time.monotonic() - began:.0f} s; {args.client_mib} MiB per client run, "
          f"{args.spark_rows:,} x {RECORD_SIZE} B Spark rows, median of {args.runs} runs")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
