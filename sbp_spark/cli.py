"""The ``sbp`` command: builds the parser from the command groups of ``sbp_spark.commands``
and runs the handler of the command given.

Handlers return the exit status. Those of the server commands raise ``ValueError`` for bad
input and let ``SbpError``/``OSError`` through; ``main`` turns those into one line on stderr
and a non-zero exit status, never a traceback (``--log-level debug`` adds it to the log). The
other commands do the same themselves (``commands.common.cli_errors``).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from sbp_spark.commands import (
    acl,
    bench,
    consumers,
    demo,
    health,
    produce,
    ranges,
    servers,
    streams,
    tail,
    tokens,
)
from sbp_spark.commands.common import EXIT_ERROR, EXIT_USAGE, collect_more_positionals, usage
from sbp_spark.protocol.errors import SbpError

log = logging.getLogger("sbp_spark.cli")

# The command groups, in the order `sbp --help` lists them.
GROUPS = (servers, streams, ranges, consumers, produce, tail, health, tokens, acl, bench, demo)


def build_parser() -> argparse.ArgumentParser:
    """The ``sbp`` argument parser with every subcommand."""
    from sbp_spark import __version__

    parser = argparse.ArgumentParser(
        prog="sbp", description="Streaming Batch Protocol (SBP) tools: run a cluster, manage "
                                "its streams, try the Spark connector.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"),
                        help="how much to log on stderr (default info)")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    for group in GROUPS:
        group.add_parser(commands)
    parser.set_defaults(handler=lambda _args: usage(parser))
    return parser


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # py4j logs every call to the JVM at INFO: thousands of lines that would bury what the
    # commands that start Spark (demo, bench) say. Only at --log-level debug do they show.
    if level != "debug":
        logging.getLogger("py4j").setLevel(logging.WARNING)


def _pd_after_command(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``argv`` with a ``--pd`` given before the command (``sbp --pd H:P streams list``, as
    etcdctl and kubectl take their endpoints) moved after it, where the command takes it;
    argparse would take its value for the command's name. Stops at the first word that is not
    a command: past it, argparse decides."""
    out: list[str] = []
    moved: list[str] = []
    current: argparse.ArgumentParser | None = parser
    i = 0
    while i < len(argv) and current is not None:
        word = argv[i]
        commands = next((a.choices for a in current._actions
                         if isinstance(a, argparse._SubParsersAction)), None)
        if word == "--pd" and i + 1 < len(argv):
            moved += argv[i:i + 2]
            i += 2
            continue
        if word.startswith("--pd="):
            moved.append(word)
        elif word.startswith("-"):
            out.append(word)
            action = current._option_string_actions.get(word)
            if action is not None and action.nargs is None and i + 1 < len(argv):
                i += 1  # the option's value (``--log-level debug``)
                out.append(argv[i])
        else:
            out.append(word)
            current = commands.get(word) if commands else None
        i += 1
    return out + argv[i:] + moved


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``sbp`` with ``argv`` (default: the process arguments); returns the exit status."""
    parser = build_parser()
    argv = _pd_after_command(parser, list(sys.argv[1:] if argv is None else argv))
    args, extra = parser.parse_known_args(argv)
    if extra:
        problem = collect_more_positionals(args, extra)
        if problem is not None:
            parser.error(problem)
    _configure_logging(args.log_level)
    prog = getattr(args, "command", "sbp")
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        return 130
    except ValueError as exc:
        return _fail(prog, exc, EXIT_USAGE)
    except (SbpError, OSError, TimeoutError, RuntimeError) as exc:
        return _fail(prog, exc, EXIT_ERROR)


def _fail(prog: str, exc: BaseException, status: int) -> int:
    log.debug("%s failed", prog, exc_info=exc)
    message = str(exc) or type(exc).__name__
    print(f"{prog}: error: {message}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
