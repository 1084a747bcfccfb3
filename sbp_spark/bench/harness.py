"""``sbp bench``: every figure in one run, on the same data and machine, next to its ceiling."""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from .context import BenchConfig, BenchContext
from .report import Figure, format_table, machine_info, to_json
from .streaming import WARMUP_S as STREAM_WARMUP_S
from .timing import Progress

# Sections in run order: name -> module with ``run(ctx) -> list[Figure]``. Spark comes after
# the client so the client figures are not disturbed by the JVM; streaming last.
SECTIONS: dict[str, str] = {
    "codec": "sbp_spark.bench.codec",
    "client": "sbp_spark.bench.client",
    "latency": "sbp_spark.bench.latency",
    "memory": "sbp_spark.bench.concurrency",
    "planning": "sbp_spark.bench.time_planning",
    "names": "sbp_spark.bench.name_planning",
    "auth": "sbp_spark.bench.auth",
    "spark": "sbp_spark.bench.spark_batch",
    "scaling": "sbp_spark.bench.scaling",
    "streaming": "sbp_spark.bench.streaming",
}
# The sections that run the connector's Spark code (planning calls its reader directly); the
# others measure the codec, client and servers, which need no pyspark.
NEEDS_PYSPARK = ("planning", "names", "auth", "spark", "scaling", "streaming")


def _section_runner(name: str) -> Callable[[BenchContext], list[Figure]]:
    return importlib.import_module(SECTIONS[name]).run


def _exit_cleanly_on_sigterm():
    """Turn SIGTERM (``timeout``, a CI runner) into SystemExit, so the server process, Spark
    and the temporary work dir are cleaned up as on Ctrl-C; returns the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="sbp bench",
        description="Measure codec, client, Spark batch and streaming throughput next to their "
                    "ceilings, in one run on this machine.")
    parser.add_argument("--quick", action="store_true",
                        help="smaller sizes and fewer runs (about 5 minutes on two cores)")
    parser.add_argument("--json", metavar="FILE", type=Path, help="write the results as JSON")
    parser.add_argument("--plot", metavar="FILE", type=Path,
                        help="write a PNG chart of throughput next to the ceilings "
                             "(needs matplotlib)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma list of sections to run (default: all of "
                             f"{','.join(SECTIONS)})")
    parser.add_argument("--rows", type=int, help="Spark batch rows (default 4M, --quick 2M)")
    parser.add_argument("--runs", type=int,
                        help="timed runs per Spark query (after warm-up rounds)")
    parser.add_argument("--client-mib", type=int, help="MiB moved per timed client run")
    parser.add_argument("--clients", type=int,
                        help="concurrent clients in the server memory figure (default 64)")
    parser.add_argument("--stream-seconds", type=float,
                        help="how long the streaming latency test offers its load")
    parser.add_argument("--planning-records", type=int,
                        help="records of the stream a read by time is planned on (default 10M, "
                             "--quick 1M)")
    parser.add_argument("--planning-ranges", type=int,
                        help="ranges of that stream (default 1000, --quick 100)")
    parser.add_argument("--pattern-streams", type=int,
                        help="streams a read by name pattern plans (default 1000, --quick too)")
    parser.add_argument("--latency-seconds", type=float,
                        help="seconds one writer appends under each fsync policy (default 6, "
                             "--quick 3)")
    parser.add_argument("--scaling-seconds", type=float,
                        help="seconds of APPEND load per count of active streams (default 4, "
                             "--quick 2)")
    parser.add_argument("--scaling-rows", type=int,
                        help="rows of the Spark reads spread over 1-64 ranges (default 2M, "
                             "--quick 1M; a multiple of 8192 x 64)")
    parser.add_argument("--fsync", help="fsync policy for the bench cluster (default: the "
                                        "cluster's own default)")
    parser.add_argument("--workdir", type=Path,
                        help="keep the cluster data, parquet files and server log here "
                             "(default: a temporary directory, removed afterwards)")
    args = parser.parse_args(argv)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown or not sections:
        parser.error(f"--sections {args.sections!r}: unknown {', '.join(unknown) or '(none)'}; "
                     f"choose from {', '.join(SECTIONS)}")
    args.sections = sections
    for name in ("rows", "runs", "client_mib", "clients", "planning_records",
                 "planning_ranges", "pattern_streams", "scaling_rows"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} {value}: must be >= 1")
    for name in ("latency_seconds", "scaling_seconds"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} {value}: must be > 0")
    if args.stream_seconds is not None and args.stream_seconds <= STREAM_WARMUP_S:
        parser.error(f"--stream-seconds {args.stream_seconds}: must be above the "
                     f"{STREAM_WARMUP_S:g} s whose latencies are dropped as warm-up")
    return args


# Options that set a BenchConfig field as given: option -> field.
_SETTINGS = {"rows": "spark_rows", "runs": "spark_runs", "clients": "concurrent_clients",
             "stream_seconds": "stream_seconds", "planning_records": "planning_records",
             "planning_ranges": "planning_ranges", "pattern_streams": "pattern_streams",
             "latency_seconds": "latency_seconds",
             "scaling_seconds": "scaling_seconds", "scaling_rows": "scaling_read_rows"}


def build_config(args: argparse.Namespace) -> BenchConfig:
    config = BenchConfig.quick_run() if args.quick else BenchConfig.full()
    for option, setting in _SETTINGS.items():
        value = getattr(args, option)
        if value is not None:
            setattr(config, setting, value)
    if args.client_mib is not None:
        config.client_bytes = args.client_mib * 1024 * 1024
    config.fsync = args.fsync
    return config


def run_sections(ctx: BenchContext, sections: list[str],
                 runners: dict[str, Callable[[BenchContext], list[Figure]]] | None = None,
                 ) -> list[Figure]:
    """Run each section; a section that raises becomes one ``error:`` row, the rest go on."""
    figures: list[Figure] = []
    for name in sections:
        runner = (runners or {}).get(name) or _section_runner(name)
        ctx.progress(name, "starting")
        start = time.monotonic()
        try:
            got = runner(ctx)
        except Exception as exc:  # one broken section must not hide the others' figures
            traceback.print_exc(file=sys.stderr)
            got = [Figure(name, "section", "", note=f"error: {exc.__class__.__name__}: {exc}")]
        figures.extend(got)
        ctx.progress(name, f"done in {time.monotonic() - start:.1f} s")
    return figures


def _check_pyspark_for(sections: list[str]) -> None:
    """Fail before measuring anything when a chosen section needs pyspark and there is none."""
    from sbp_spark.environment import check_pyspark

    spark_sections = [s for s in sections if s in NEEDS_PYSPARK]
    if spark_sections:
        others = ",".join(s for s in SECTIONS if s not in NEEDS_PYSPARK)
        check_pyspark(f"the Spark part of sbp bench (sections {', '.join(spark_sections)})",
                      f"--sections {others} runs without it")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``sbp bench`` / ``python -m sbp_spark.bench``; returns the exit code.

    Exit code 0: every figure measured (targets may still be missed: see the table);
    1: some figure failed with an error.
    """
    args = parse_args(argv)
    config = build_config(args)
    progress = Progress()
    _check_pyspark_for(args.sections)
    if args.plot is not None:
        from .plot import require_matplotlib

        require_matplotlib()  # fail now, not after minutes of measuring
    previous_sigterm = _exit_cleanly_on_sigterm()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="sbp-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc)
    load_before = _load_average()
    ctx = BenchContext(config, workdir, progress)
    progress("setup", f"{'quick' if config.quick else 'full'} run, sections "
                      f"{','.join(args.sections)}, work dir {workdir}")
    try:
        figures = run_sections(ctx, args.sections)
    finally:
        ctx.close()
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
        if previous_sigterm is not None:
            signal.signal(signal.SIGTERM, previous_sigterm)
    duration_s = round(progress.elapsed, 1)
    machine = machine_info()
    # Other work on the machine skews every figure: say how busy it was.
    load = {"start": load_before, "end": _load_average()}
    meta = {
        "started": started.isoformat(timespec="seconds"),
        "duration_s": duration_s,
        "command": "sbp bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "quick": config.quick,
        "config": {k: v for k, v in vars(config).items()},
        "machine": machine,
        "load_average_1m": load,
    }
    print(format_table(figures))
    passed = sum(1 for f in figures if f.passed)
    missed = sum(1 for f in figures if f.passed is False)
    missing = sum(1 for f in figures if f.value is None)
    print(f"\n{passed} targets met, {missed} missed, {missing} figures not measured; "
          f"{duration_s} s; load average {load['start']} at start, {load['end']} at end "
          f"on {machine['nproc']} cores")
    if args.json is not None:
        args.json.write_text(to_json(figures, meta) + "\n")
        progress("output", f"wrote {args.json}")
    if args.plot is not None:
        from .plot import plot

        plot(figures, args.plot, title=f"sbp bench ({'quick' if config.quick else 'full'}, "
                                       f"{machine['nproc']} cores)")
        progress("output", f"wrote {args.plot}")
    return 1 if any(f.note.startswith("error") for f in figures) else 0
