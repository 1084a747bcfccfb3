"""Signed tokens: JWTs signed with a shared secret (HS256) or a private key (RS256), as
Pulsar's token authentication. PyJWT does the cryptography; this module says which claims we
write and require, and turns every failure into a reason a user can act on.

A token's ``sub`` claim is the principal; ``exp`` (optional) when it stops being accepted;
``role`` (ours, optional) is ``server`` for a range server's or a PD's token. Tokens are
secrets: no message here ever contains one.
"""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from pathlib import Path

import jwt
from cryptography.hazmat.primitives.asymmetric.rsa import RSAPublicKey

from sbp_spark.protocol.errors import UnauthenticatedError

from .principals import ROLES

HS256 = "HS256"
RS256 = "RS256"
# A shared secret shorter than this is refused: HS256 with a short secret can be guessed
# offline from any token (RFC 7518 section 3.2 asks for at least the hash's 256 bits).
MIN_SECRET_BYTES = 32
# Clock difference between the machine that made a token and the one checking it that is
# forgiven on ``exp`` (seconds).
LEEWAY_S = 5
_DURATION = re.compile(r"^\s*(\d+)\s*([smhd])\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> int:
    """``30s``, ``15m``, ``1h``, ``7d`` -> seconds; ``ValueError`` naming the value."""
    match = _DURATION.match(text)
    if not match or int(match.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a duration: write a positive number and a unit "
                         f"(s, m, h or d), e.g. 1h")
    return int(match.group(1)) * _UNITS[match.group(2)]


def read_key(path: str | Path, what: str) -> bytes:
    """The bytes of a key file, ``ValueError`` naming the file when it cannot be used."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the {what} {str(path)!r}: {exc.strerror}") from None
    if not data.strip():
        raise ValueError(f"the {what} {str(path)!r} is empty")
    return data.strip()


def create_token(subject: str, *, secret: bytes | None = None,
                 private_key: bytes | None = None, expires_s: int | None = None,
                 role: str | None = None) -> str:
    """A token for ``subject``, signed with ``secret`` (HS256) or ``private_key`` (RS256, PEM),
    valid for ``expires_s`` seconds (None: no end) and claiming ``role`` (None or ``server``)."""
    if not subject:
        raise ValueError("a token needs a subject (the principal's name)")
    if (secret is None) == (private_key is None):
        raise ValueError("sign a token with a secret key (HS256) or a private key (RS256), "
                         "exactly one")
    if role is not None and role not in ROLES:
        raise ValueError(f"role {role!r} is not known: use {', '.join(ROLES)}")
    claims: dict[str, object] = {"sub": subject}
    now = datetime.datetime.now(datetime.timezone.utc)
    claims["iat"] = now
    if expires_s is not None:
        claims["exp"] = now + datetime.timedelta(seconds=expires_s)
    if role is not None:
        claims["role"] = role
    if secret is not None:
        _check_secret(secret)
        return jwt.encode(claims, secret, algorithm=HS256)
    assert private_key is not None
    try:
        return jwt.encode(claims, private_key, algorithm=RS256)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"the private key is not a PEM RSA private key: {exc}") from None


def _check_secret(secret: bytes) -> None:
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"the secret key has {len(secret)} bytes; HS256 needs at least "
                         f"{MIN_SECRET_BYTES} (e.g. `head -c 32 /dev/urandom | base64`)")


@dataclass(frozen=True, slots=True)
class Claims:
    """What a checked token says: its subject, its role ("" for none), and when it expires
    (a POSIX time, None for never)."""

    subject: str
    role: str
    expires: float | None


class TokenVerifier:
    """Checks tokens signed with one shared secret (HS256) or one key pair (RS256)."""

    def __init__(self, *, secret: bytes | None = None, public_key: bytes | None = None) -> None:
        if (secret is None) == (public_key is None):
            raise ValueError("check tokens with a secret key (HS256) or a public key (RS256), "
                             "exactly one")
        self._key: bytes | RSAPublicKey
        if secret is not None:
            _check_secret(secret)
            self._key = secret
            self.algorithm = HS256
        else:
            assert public_key is not None
            try:
                key = jwt.algorithms.RSAAlgorithm(jwt.algorithms.RSAAlgorithm.SHA256
                                                  ).prepare_key(public_key)
            except (ValueError, TypeError, jwt.InvalidKeyError) as exc:
                raise ValueError(f"the public key is not a PEM RSA public key: {exc}") from None
            if not isinstance(key, RSAPublicKey):
                raise ValueError("the public key is an RSA private key: give the servers the "
                                 "public half (--auth-token-public-key)")
            self._key = key
            self.algorithm = RS256

    def __repr__(self) -> str:
        return f"TokenVerifier({self.algorithm})"  # never the key

    def verify(self, token: str) -> Claims:
        """The claims of ``token``; ``UnauthenticatedError`` saying why it is refused (expired,
        not signed by this cluster's key, malformed) without repeating the token."""
        try:
            claims = jwt.decode(token, self._key, algorithms=[self.algorithm],
                                leeway=LEEWAY_S,
                                options={"require": ["sub"], "verify_exp": True})
        except jwt.ExpiredSignatureError:
            raise UnauthenticatedError("the token has expired: ask for a new one") from None
        except jwt.InvalidAlgorithmError:
            raise UnauthenticatedError(
                f"the token is not signed with {self.algorithm}, which this cluster "
                f"accepts") from None
        except jwt.InvalidSignatureError:
            raise UnauthenticatedError(
                "the token's signature does not match this cluster's key (forged, or made "
                "for another cluster)") from None
        except jwt.MissingRequiredClaimError:
            raise UnauthenticatedError("the token names no subject (claim 'sub')") from None
        except jwt.DecodeError:
            raise UnauthenticatedError("the token is malformed: not a signed JWT") from None
        except jwt.InvalidTokenError as exc:
            raise UnauthenticatedError(f"the token is refused: {exc}") from None
        subject = claims.get("sub")
        role = claims.get("role", "")
        if not isinstance(subject, str) or not subject:
            raise UnauthenticatedError("the token's subject (claim 'sub') is not a name")
        if role and role not in ROLES:
            raise UnauthenticatedError(f"the token claims role {role!r}, which is not known")
        exp = claims.get("exp")
        return Claims(subject, role or "", float(exp) if exp is not None else None)


__all__ = ["HS256", "MIN_SECRET_BYTES", "RS256", "Claims", "TokenVerifier", "create_token",
           "parse_duration", "read_key"]
