"""``sbp token create``: a signed token for a principal (docs/wire.md, "Who may do what")."""

from __future__ import annotations

import argparse

from .common import CommandError, cli_errors, named


@cli_errors
def create_command(args: argparse.Namespace) -> int:
    from sbp_spark.server.auth.tokens import create_token, parse_duration, read_key

    try:
        expires_s = parse_duration(args.expires) if args.expires else None
        if args.secret_key:
            token = create_token(args.subject, secret=read_key(args.secret_key, "secret key"),
                                 expires_s=expires_s, role=args.role)
        else:
            token = create_token(args.subject,
                                 private_key=read_key(args.private_key, "private key"),
                                 expires_s=expires_s, role=args.role)
    except ValueError as exc:
        raise CommandError(str(exc)) from None
    print(token)
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``sbp token create``."""
    token = subparsers.add_parser(
        "token", help="make signed tokens for clusters that authenticate",
        description="Tokens are JWTs naming a principal; servers started with "
                    "--auth-token-secret or --auth-token-public-key accept them.")
    sub = token.add_subparsers(dest="token_command", metavar="{create}", required=True)
    p = sub.add_parser("create", help="print a signed token for a principal",
                       description="Print a token for --subject, signed with a shared secret "
                                   "(HS256) or a private key (RS256). Keep it secret: it is "
                                   "the principal's password.")
    key = p.add_mutually_exclusive_group(required=True)
    key.add_argument("--secret-key", metavar="FILE",
                     help="sign with this shared secret (HS256; the servers' "
                          "--auth-token-secret)")
    key.add_argument("--private-key", metavar="FILE",
                     help="sign with this RSA private key (RS256, PEM; the servers hold its "
                          "public key, --auth-token-public-key)")
    p.add_argument("--subject", required=True, metavar="NAME",
                   help="the principal the token proves")
    p.add_argument("--expires", default=None, metavar="DURATION",
                   help="how long the token is accepted, e.g. 30m, 1h, 7d (default: no end)")
    p.add_argument("--role", choices=("server",), default=None,
                   help="'server': the token of a range server or PD (--server-token)")
    named(p, "token create", create_command)
