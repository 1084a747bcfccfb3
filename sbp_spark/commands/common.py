"""What the ``sbp`` command groups share: the ``--pd`` option, argument types, the client,
exit statuses, and turning errors into one line on stderr with a non-zero exit status.

Errors a user can cause (an unknown stream, a bad offset, a PD that is not running, a file that
cannot be read) print one line and exit 1; argparse already prints usage errors and exits 2, as
does a ``UsageError`` (a command line argparse cannot judge alone).
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import functools
import os
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypedDict

from sbp_spark.protocol.constants import MAX_REPLICAS
from sbp_spark.protocol.errors import (
    PdUnreachableError,
    SbpError,
    SbpTimeoutError,
    ServerError,
    TransportError,
    UnauthenticatedError,
)
from sbp_spark.protocol.names import parse_stream_ref

if TYPE_CHECKING:
    from sbp_spark.client import SbpClient

PD_ENV = "SBP_PD"
# The token the client commands present when neither --token nor --token-file is given.
TOKEN_ENV = "SBP_TOKEN"
# TLS for the admin commands, from the environment: CA file, and for clusters that require
# client certificates (mutual TLS), certificate and key. Any of them turns TLS on.
TLS_ENV = {"tls_ca_file": "SBP_TLS_CA", "tls_cert_file": "SBP_TLS_CERT",
           "tls_key_file": "SBP_TLS_KEY"}
# Stream ids, offsets and retention are signed 64-bit integers on the wire.
MAX_INT64 = (1 << 63) - 1
# The port `sbp server` and `sbp pd` listen on when none is given, so `sbp streams ...` finds a
# local `sbp server` unasked.
DEFAULT_PD_PORT = 2378
DEFAULT_PD = f"127.0.0.1:{DEFAULT_PD_PORT}"

# An admin command talks to a PD a person just named: if it is not there, say so within
# seconds instead of retrying for the client's usual minute.
CLI_CONNECT_TIMEOUT_S = 3.0
CLI_RETRIES = 3
CLI_RETRY_DEADLINE_S = 15.0


# Exit statuses: 1 = the operation failed, 2 = the command line was wrong (as argparse does).
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

Handler = Callable[[argparse.Namespace], int]


class CommandError(Exception):
    """A user-facing failure: printed as one line, exit status 1."""


class UsageError(CommandError):
    """A command line that makes no sense (as argparse's usage errors): exit status 2."""


def default_pd() -> str:
    """The PD address used without ``--pd``: $SBP_PD, else 127.0.0.1:2378."""
    return os.environ.get(PD_ENV) or DEFAULT_PD


def _checked(text: str, parse: Callable[[str], object]) -> str:
    """``text`` once ``parse`` accepts it; its ValueError becomes argparse's usage error."""
    try:
        parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def int_in(low: int, high: int | None = None,
           also: Sequence[int] = ()) -> Callable[[str], int]:
    """argparse type: an integer from ``low`` to ``high`` (no bound: None), or one of
    ``also``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value in also:
            return value
        if value < low or (high is not None and value > high):
            span = f"between {low} and {high}" if high is not None else f">= {low}"
            extra = "".join(f" or {a}" for a in also)
            raise argparse.ArgumentTypeError(f"{value} must be {span}{extra}")
        return value

    return parse


def pd_addresses_arg(text: str) -> str:
    """argparse type: ``host:port[,host:port...]``."""
    from sbp_spark.client.pd import parse_pd_addresses

    return _checked(text, parse_pd_addresses)


def address_arg(text: str) -> str:
    """argparse type: one ``host:port``."""
    from sbp_spark.client.connection import parse_address

    return _checked(text, parse_address)


def add_pd_argument(parser: argparse.ArgumentParser) -> None:
    """``--pd HOST:PORT[,HOST:PORT...]`` with the documented default, and the credential
    (``--token``, ``--token-file``, else ``$SBP_TOKEN``) every client command takes."""
    parser.add_argument(
        "--pd", default=None, type=pd_addresses_arg, metavar="HOST:PORT",
        help=f"placement driver address(es), comma-separated (default: ${PD_ENV}, "
             f"else {DEFAULT_PD})")
    credential = parser.add_mutually_exclusive_group()
    credential.add_argument("--token", default=None, metavar="TOKEN",
                            help=f"authenticate with this signed token (default: "
                                 f"${TOKEN_ENV}); visible to other users of this machine in "
                                 f"the process list: prefer --token-file")
    credential.add_argument("--token-file", default=None, metavar="FILE",
                            help="authenticate with the token kept in FILE")


def token_of(args: argparse.Namespace) -> str | None:
    """The token a client command presents: --token, the file of --token-file, else
    $SBP_TOKEN; None when none is given (an open cluster needs none)."""
    from sbp_spark.client.config import read_token_file

    if getattr(args, "token", None):
        return str(args.token).strip()
    if getattr(args, "token_file", None):
        try:
            return read_token_file(args.token_file)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
    return os.environ.get(TOKEN_ENV, "").strip() or None


# The namespace attribute naming a command's list positional (see ``more_positionals``).
MORE_POSITIONALS = "more_positionals"


def more_positionals(parser: argparse.ArgumentParser, dest: str,
                     convert: Callable[[str], object] = str) -> None:
    """Let ``dest``, a list positional, also take values given after an option
    (``sbp produce 7 --key k a.txt b.txt``): argparse fills a command's positionals in one go
    and would refuse the later ones as unrecognized; ``collect_more_positionals`` adds them."""
    parser.set_defaults(**{MORE_POSITIONALS: (dest, convert)})


def collect_more_positionals(args: argparse.Namespace, extra: list[str]) -> str | None:
    """Add the arguments argparse left over to the command's list positional; the usage
    error to report when that cannot be done (None: done)."""
    target = getattr(args, MORE_POSITIONALS, None)
    unknown = [a for a in extra if a.startswith("-") and a != "-"]
    if target is None or unknown:
        return f"unrecognized arguments: {' '.join(unknown or extra)}"
    dest, convert = target
    try:
        getattr(args, dest).extend(convert(a) for a in extra)
    except argparse.ArgumentTypeError as exc:
        return f"argument {dest}: {exc}"
    return None


def pd_of(args: argparse.Namespace) -> str:
    return args.pd or default_pd()


def stream_arg(text: str) -> int | str:
    """argparse type: a stream, by id (digits: an integer from 0 to 2**63-1) or by name
    (``protocol.names``)."""
    try:
        ref = parse_stream_ref(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if isinstance(ref, int) and ref > MAX_INT64:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a stream id (an integer from 0 to {MAX_INT64})")
    return ref


def stream_text(ref: int | str) -> str:
    """A stream as messages name it: ``stream 7`` or ``stream 'orders'``."""
    return f"stream {ref}" if isinstance(ref, int) else f"stream {ref!r}"


def resolve_streams(client: Any, refs: list[int | str], args: argparse.Namespace
                    ) -> tuple[list[tuple[int | str, int]], list[str]]:
    """(each stream found with its id, an error message per name no live stream has), each
    stream once, in the order given; names are looked up in one PD request, ids taken as
    they are."""
    refs = list(dict.fromkeys(refs))
    names = [r for r in refs if isinstance(r, str)]
    ids: dict[str, int] = {}
    failures = []
    if names:
        for name, result in zip(names, client.pd.describe_streams([], names), strict=True):
            error = result.exception()
            if error is None:
                ids[name] = result.unwrap().stream_id
            else:
                failures.append(item_failure(error, name, args))
    found = [(r, r if isinstance(r, int) else ids[r]) for r in refs
             if isinstance(r, int) or r in ids]
    return found, failures


def non_negative_int(text: str) -> int:
    """argparse type: an integer >= 0 that fits the wire's signed 64 bits."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
    if value > MAX_INT64:
        raise argparse.ArgumentTypeError(f"{text!r} must be at most {MAX_INT64}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def replicas_arg(text: str) -> int:
    """argparse type: a replica count, 1-127 (a byte on the wire)."""
    value = positive_int(text)
    if value > MAX_REPLICAS:
        raise argparse.ArgumentTypeError(f"{text!r} must be at most {MAX_REPLICAS}")
    return value


def retention_arg(text: str) -> int:
    """argparse type: retention in milliseconds (>= 1), or -1 for forever."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of milliseconds") from None
    if (value < 1 and value != -1) or value > MAX_INT64:
        raise argparse.ArgumentTypeError(
            f"{text!r}: use -1 (forever) or a value from 1 to {MAX_INT64}")
    return value


class TlsArgs(TypedDict, total=False):
    """ClientConfig's TLS fields, as keyword arguments."""

    tls: bool
    tls_ca_file: str | None
    tls_cert_file: str | None
    tls_key_file: str | None


def tls_from_env() -> TlsArgs:
    """ClientConfig TLS arguments from $SBP_TLS_CA, $SBP_TLS_CERT and $SBP_TLS_KEY."""
    ca, cert, key = (os.environ.get(TLS_ENV[field]) or None
                     for field in ("tls_ca_file", "tls_cert_file", "tls_key_file"))
    if ca is None and cert is None and key is None:
        return {}
    return {"tls": True, "tls_ca_file": ca, "tls_cert_file": cert, "tls_key_file": key}


@contextmanager
def connect(args: argparse.Namespace) -> Iterator[SbpClient]:
    """An SbpClient for the command's PD with the command line's short timeouts."""
    from sbp_spark.client import ClientConfig, SbpClient
    from sbp_spark.client.pd import parse_pd_addresses

    # What comes from the environment is checked here, and a bad value names its variable:
    # nothing on the command line shows where it came from.
    tls = tls_from_env()
    try:
        config = ClientConfig(connect_timeout_s=CLI_CONNECT_TIMEOUT_S, retries=CLI_RETRIES,
                              retry_deadline_s=CLI_RETRY_DEADLINE_S, token=token_of(args),
                              **tls)
    except ValueError as exc:
        names = ", ".join(f"${TLS_ENV[f]}" for f in TLS_ENV if tls.get(f) is not None)
        raise CommandError(f"{exc} (from {names})" if tls else str(exc)) from None
    if not args.pd:
        try:
            parse_pd_addresses(default_pd())
        except ValueError as exc:
            raise CommandError(f"{exc} (from ${PD_ENV})") from None
    client = SbpClient(pd_of(args), config)
    try:
        yield client
    finally:
        client.close()


def _reachable(address: str) -> bool:
    host, _, port = address.strip().rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), CLI_CONNECT_TIMEOUT_S):
            return True
    except (OSError, ValueError):
        return False


def describe_error(exc: BaseException, args: argparse.Namespace) -> str | None:
    """The one-line message for a failure a user can cause; None for a bug."""
    from sbp_spark.environment import JavaNotFoundError, PysparkNotFoundError

    if isinstance(exc, CommandError):
        return str(exc)
    if isinstance(exc, (JavaNotFoundError, PysparkNotFoundError)):
        return str(exc)
    if isinstance(exc, ServerError):
        message = exc.message or str(exc)
        # The client prefixes what it was doing ("stream 7: ..."); skip it when the server's
        # own words already say the same.
        context, sep, rest = message.partition(": ")
        message = rest if sep and context in rest else message
        if isinstance(exc, UnauthenticatedError):
            given = (getattr(args, "token", None) or getattr(args, "token_file", None)
                     or os.environ.get(TOKEN_ENV, "").strip())
            hint = "" if given else " (give a token: --token, --token-file or $SBP_TOKEN)"
            return f"UNAUTHENTICATED: {message}{hint}"
        return message
    if isinstance(exc, PdUnreachableError) and exc.__cause__ is not None:
        exc = exc.__cause__  # said below, naming where the address came from
    if isinstance(exc, (TransportError, SbpTimeoutError)):
        pd = getattr(args, "pd", None) or default_pd()
        addresses = [a for a in pd.split(",") if a.strip()]
        if not any(_reachable(a) for a in addresses):
            return f"cannot reach PD at {pd}{_pd_source(args)} ({exc})"
        return str(exc)
    if isinstance(exc, SbpError):
        return str(exc)
    if isinstance(exc, ValueError):
        return str(exc)
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror}"
    return None


def _pd_source(args: argparse.Namespace) -> str:
    if getattr(args, "pd", None):
        return ""
    if os.environ.get(PD_ENV):
        return f" (from ${PD_ENV})"
    return f" (the default; pass --pd HOST:PORT or set ${PD_ENV})"


def cli_errors(handler: Handler) -> Handler:
    """Wrap a subcommand handler: user errors become one stderr line and exit status 1
    (2 for a ``UsageError``)."""

    @functools.wraps(handler)
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
        except BrokenPipeError:
            # The reader went away (`sbp tail ... | head`): stop quietly, as Unix tools do.
            _silence_stdout()
            return EXIT_OK
        except Exception as exc:
            message = describe_error(exc, args)
            if message is None:
                raise
            print(f"{getattr(args, 'command', 'sbp')}: error: {message}", file=sys.stderr)
            return EXIT_USAGE if isinstance(exc, UsageError) else EXIT_ERROR

    return wrapper


def _silence_stdout() -> None:
    # Python flushes stdout at exit; a closed pipe would raise again there.
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    finally:
        os.close(devnull)


def usage(parser: argparse.ArgumentParser) -> int:
    """The handler of a command group named without its command: its help, exit status 2."""
    parser.print_help(sys.stderr)
    return EXIT_USAGE


def named(parser: argparse.ArgumentParser, name: str, handler: Handler) -> None:
    """Make ``handler`` run ``sbp NAME``, whose error lines start with ``sbp NAME``."""
    parser.set_defaults(handler=handler, command=f"sbp {name}")


def json_flag(parser: argparse.ArgumentParser) -> None:
    """``--json``: one JSON object per line instead of a table."""
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per line instead of a table")


def item_failure(error: Exception, stream_id: int | str, args: argparse.Namespace) -> str:
    """The error line's message for one stream of a batch (by id or name), naming it."""
    message = describe_error(error, args) or str(error)
    return message if str(stream_id) in message else f"{stream_text(stream_id)}: {message}"


def report_failures(failures: list[str], args: argparse.Namespace) -> int:
    """One error line per stream that failed; the exit status."""
    for message in failures:
        print(f"{args.command}: error: {message}", file=sys.stderr)
    return EXIT_ERROR if failures else EXIT_OK


def print_table(rows: list[list[str]], header: list[str], out=None) -> None:
    """Left-aligned columns separated by two spaces (numbers right-aligned)."""
    out = out or sys.stdout
    table = [header] + rows
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    numeric = [all(_is_number(r[i]) for r in rows) and bool(rows) for i in range(len(header))]
    for row in table:
        cells = [cell.rjust(w) if num else cell.ljust(w)
                 for cell, w, num in zip(row, widths, numeric, strict=True)]
        print("  ".join(cells).rstrip(), file=out)


def _is_number(text: str) -> bool:
    return text.replace(",", "").lstrip("-").isdigit()
