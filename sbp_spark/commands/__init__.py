"""The ``sbp`` subcommands that talk to a running cluster (streams, ranges, produce, tail,
cluster) and ``sbp bench``; ``sbp_spark.cli`` adds them to its parser.

Each module has an ``add_<name>_command(subparsers)`` that declares the arguments and sets
``handler`` (``args -> exit status``) and ``command`` (its name, for error messages).
"""

from __future__ import annotations

import argparse

from .cluster import add_cluster_command
from .produce import add_produce_command
from .streams import add_ranges_command, add_stream_commands
from .tail import add_tail_command


def bench_command(args: argparse.Namespace) -> int:
    """Hand the arguments to the benchmark harness (which parses and documents them)."""
    from sbp_spark.bench import main as bench_main

    return int(bench_main(list(args.bench_args)))


def add_bench_command(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sbp bench``: every argument goes to ``sbp_spark.bench.main``."""
    # No option of its own: with a prefix character nothing can start, argparse treats every
    # argument, --help included, as one of bench_args and passes it through untouched.
    p = subparsers.add_parser(
        "bench", help="measure throughput (sbp bench --help for its options)",
        add_help=False, prefix_chars="\0")
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(handler=bench_command, command="sbp bench")


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add ranges, produce, tail, cluster and bench to the ``sbp`` subparsers."""
    add_ranges_command(subparsers)
    add_produce_command(subparsers)
    add_tail_command(subparsers)
    add_cluster_command(subparsers)
    add_bench_command(subparsers)


__all__ = ["add_commands", "add_stream_commands"]
