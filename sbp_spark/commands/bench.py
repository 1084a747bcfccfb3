"""``sbp bench``: the benchmark harness (``sbp_spark.bench``), which parses and documents its
own arguments."""

from __future__ import annotations

import argparse


def bench_command(args: argparse.Namespace) -> int:
    """Hand the arguments to the benchmark harness."""
    from sbp_spark.bench import main as bench_main

    return int(bench_main(list(args.bench_args)))


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sbp bench``: every argument goes to ``sbp_spark.bench.main``."""
    # No option of its own: with a prefix character nothing can start, argparse treats every
    # argument, --help included, as one of bench_args and passes it through untouched.
    p = subparsers.add_parser(
        "bench", help="measure throughput (sbp bench --help for its options)",
        add_help=False, prefix_chars="\0")
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(handler=bench_command, command="sbp bench")
