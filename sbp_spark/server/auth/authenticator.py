"""Turning a connection's credential into a principal: a signed token (AUTHENTICATE) or, under
mutual TLS, the client certificate the handshake verified.

``AuthSettings`` is what a server's flags say (``--auth-token-secret``,
``--auth-token-public-key``, ``--tls-ca``, ``--superusers``); ``Authenticator`` is the part the
network core asks. A server built without one stays open, as before authentication existed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from sbp_spark.protocol.errors import UnauthenticatedError

from .principals import SERVER_ROLE, Principal
from .tokens import TokenVerifier, create_token, read_key

# The AUTHENTICATE method of a signed token.
TOKEN_METHOD = "token"
# A connection that has not authenticated this long after it was accepted is closed: it holds
# a reader thread and a connection slot, and may only PING meanwhile.
DEFAULT_AUTH_TIMEOUT_S = 10.0
# The name a server's own token has when the server makes it from the shared secret.
SERVER_SUBJECT = "sbp-server"


@dataclass(frozen=True)
class AuthSettings:
    """How a server authenticates (none of the fields set: it does not, the cluster is open).

    ``token_secret_file`` (HS256) or ``token_public_key_file`` (RS256) turns tokens on;
    ``certificates``: under mutual TLS a verified client certificate authenticates its
    connection (its subject's CN, else its first subject alternative name, is the principal);
    ``superusers`` may do everything; ``server_token_file`` is the token this server presents
    to the others (made from the secret when not given)."""

    token_secret_file: str | None = None
    token_public_key_file: str | None = None
    certificates: bool = False
    superusers: frozenset[str] = field(default_factory=frozenset)
    server_token_file: str | None = None
    timeout_s: float = DEFAULT_AUTH_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.token_secret_file and self.token_public_key_file:
            raise ValueError("give --auth-token-secret or --auth-token-public-key, not both")
        if self.timeout_s <= 0:
            raise ValueError(f"the authentication timeout {self.timeout_s!r} must be > 0")
        if self.superusers and not self.enabled:
            raise ValueError("--superusers needs authentication: --auth-token-secret, "
                             "--auth-token-public-key or --tls-ca")

    @property
    def tokens(self) -> bool:
        return bool(self.token_secret_file or self.token_public_key_file)

    @property
    def enabled(self) -> bool:
        """Whether connections must authenticate."""
        return self.tokens or self.certificates

    def server_token(self) -> str | None:
        """The token this server presents when it calls another server: the file's; else
        none under mutual TLS (its certificate authenticates it); else one made from the
        shared secret (a role-``server`` token without an end)."""
        if self.server_token_file:
            return read_key(self.server_token_file, "server token").decode().strip()
        if self.certificates:
            return None
        if self.token_secret_file:
            return create_token(SERVER_SUBJECT, secret=read_key(self.token_secret_file,
                                                                 "secret key"),
                                role=SERVER_ROLE)
        if self.token_public_key_file:
            raise ValueError("with --auth-token-public-key a server needs --server-token FILE "
                             "(a token with role server), or mutual TLS (--tls-ca)")
        return None

    def authenticator(self) -> Authenticator | None:
        """The part that checks credentials (None when the cluster is open); bad key files
        fail here, at start, with ``ValueError``."""
        if not self.enabled:
            return None
        verifier = None
        if self.token_secret_file:
            verifier = TokenVerifier(secret=read_key(self.token_secret_file, "secret key"))
        elif self.token_public_key_file:
            verifier = TokenVerifier(public_key=read_key(self.token_public_key_file,
                                                         "public key"))
        return Authenticator(verifier, self.superusers, self.certificates, self.timeout_s)


def parse_superusers(text: str) -> frozenset[str]:
    """``alice,bob`` -> the names; ``ValueError`` for an empty name."""
    names = [n.strip() for n in text.split(",")]
    if not text.strip() or any(not n for n in names):
        raise ValueError(f"{text!r}: give principal names separated by commas")
    return frozenset(names)


class Authenticator:
    """Checks credentials: tokens through ``verifier`` (None: tokens are not accepted), TLS
    client certificates when ``certificates``."""

    def __init__(self, verifier: TokenVerifier | None, superusers: Iterable[str],
                 certificates: bool, timeout_s: float = DEFAULT_AUTH_TIMEOUT_S) -> None:
        self._verifier = verifier
        self._superusers = frozenset(superusers)
        self._certificates = certificates
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return (f"Authenticator(tokens={self._verifier!r}, certificates={self._certificates}, "
                f"superusers={sorted(self._superusers)})")

    def principal(self, name: str, role: str = "") -> Principal:
        return Principal(name, server=role == SERVER_ROLE or name in self._superusers,
                         superuser=name in self._superusers)

    def authenticate(self, method: str, data: bytes) -> Principal:
        """The principal ``data`` proves under ``method``; ``UnauthenticatedError`` saying
        why not."""
        if method != TOKEN_METHOD:
            raise UnauthenticatedError(f"authentication method {method!r} is not known: "
                                       f"use {TOKEN_METHOD!r}")
        if self._verifier is None:
            raise UnauthenticatedError("this cluster does not accept tokens: connect with "
                                       "a TLS client certificate")
        try:
            token = bytes(data).decode("ascii")
        except UnicodeDecodeError:
            raise UnauthenticatedError("the token is malformed: not ASCII") from None
        claims = self._verifier.verify(token.strip())
        return self.principal(claims.subject, claims.role)

    def of_certificate(self, cert: dict | None) -> Principal | None:
        """The principal of a verified client certificate (``ssl.getpeercert()``): its
        subject's CN, else its first subject alternative name; None when certificates do not
        authenticate here, or the certificate names nobody."""
        if not self._certificates or not cert:
            return None
        for rdn in cert.get("subject", ()):
            for key, value in rdn:
                if key == "commonName" and value:
                    return self.principal(value)
        for _kind, value in cert.get("subjectAltName", ()):
            if value:
                return self.principal(value)
        return None


__all__ = ["DEFAULT_AUTH_TIMEOUT_S", "SERVER_SUBJECT", "TOKEN_METHOD", "AuthSettings",
           "Authenticator", "parse_superusers"]
