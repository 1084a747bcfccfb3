"""``sbp acl grant|revoke|list``: who may do what on which streams (docs/wire.md, "Who may do
what"). Granting and revoking are for superusers."""

from __future__ import annotations

import argparse
import json

from .common import (
    CommandError,
    add_pd_argument,
    cli_errors,
    connect,
    json_flag,
    named,
    print_table,
)


def _operations(text: str) -> list[str]:
    from sbp_spark.server.auth.acl import OPERATIONS

    ops = [o.strip() for o in text.split(",")]
    unknown = [o for o in ops if o not in OPERATIONS]
    if not text.strip() or unknown:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give operations separated by commas, from {', '.join(OPERATIONS)}")
    return ops


def _streams(text: str) -> list[str]:
    streams = [s.strip() for s in text.split(",")]
    if not text.strip() or any(not s for s in streams):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give stream ids or names separated by commas, or '*'")
    return streams


def _permissions(args: argparse.Namespace) -> list:
    from sbp_spark.protocol.messages import Permission

    cluster_wide = [o for o in args.operations if o == "create"]
    on_streams = [o for o in args.operations if o != "create"]
    if on_streams and not args.streams:
        raise CommandError(f"{','.join(on_streams)} need --streams (ids, names or '*')")
    if cluster_wide and args.streams and not on_streams:
        raise CommandError("create is cluster-wide: leave --streams out")
    out = [Permission(args.principal, "create", "") for _ in cluster_wide[:1]]
    out += [Permission(args.principal, op, stream)
            for op in on_streams for stream in args.streams or ()]
    return out


@cli_errors
def grant_command(args: argparse.Namespace) -> int:
    with connect(args) as client:
        version = client.pd.grant_permissions(_permissions(args))
    print(f"granted (permissions version {version})")
    return 0


@cli_errors
def revoke_command(args: argparse.Namespace) -> int:
    with connect(args) as client:
        version = client.pd.revoke_permissions(_permissions(args))
    print(f"revoked (permissions version {version})")
    return 0


@cli_errors
def list_command(args: argparse.Namespace) -> int:
    with connect(args) as client:
        version, permissions = client.pd.describe_permissions(args.principal or "")
    if args.json:
        for p in permissions:
            print(json.dumps({"principal": p.principal, "operation": p.operation,
                              "stream": p.stream or None,
                              "stream_id": p.stream_id if p.stream_id >= 0 else None}))
        return 0
    print_table([[p.principal, p.operation, p.stream or "-",
                  str(p.stream_id) if p.stream_id >= 0 and p.stream != str(p.stream_id)
                  else "-"] for p in permissions],
                ["PRINCIPAL", "OPERATION", "STREAM", "NOW ID"])
    print(f"(permissions version {version})")
    return 0


def _add_change(sub: argparse._SubParsersAction, name: str, help_text: str, handler) -> None:
    p = sub.add_parser(name, help=help_text, description=help_text + ". Superusers only.")
    add_pd_argument(p)
    p.add_argument("--principal", required=True, metavar="NAME",
                   help="the principal (a token's subject, a certificate's name)")
    p.add_argument("--operations", required=True, type=_operations,
                   metavar="read,write,admin|create",
                   help="read (FETCH, listings), write (APPEND), admin (update, trim, "
                        "delete, seal) on --streams; create (CREATE_STREAMS) cluster-wide")
    p.add_argument("--streams", type=_streams, default=None, metavar="1,2|NAME|'*'",
                   help="stream ids or names, comma-separated, or '*' for every stream")
    named(p, f"acl {name}", handler)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sbp acl grant|revoke|list``."""
    acl = subparsers.add_parser(
        "acl", help="grant, revoke and list permissions",
        description="Permissions of principals on streams, kept by the PD; range servers "
                    "enforce them too.")
    sub = acl.add_subparsers(dest="acl_command", metavar="{grant,revoke,list}", required=True)
    _add_change(sub, "grant", "grant a principal operations", grant_command)
    _add_change(sub, "revoke", "revoke operations of a principal", revoke_command)
    p = sub.add_parser("list", help="list the permissions granted",
                       description="List the permissions granted: every principal's "
                                   "(superusers), or one's (--principal; its own for anyone).")
    add_pd_argument(p)
    p.add_argument("--principal", default=None, metavar="NAME",
                   help="only this principal's permissions")
    json_flag(p)
    named(p, "acl list", list_command)
