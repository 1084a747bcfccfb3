"""Key files and tokens for the authentication tests."""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from sbp_spark.server.auth.authenticator import AuthSettings
from sbp_spark.server.auth.tokens import create_token


class Keys:
    """A shared secret (HS256) and an RSA key pair (RS256) in ``directory``, and tokens made
    with them."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.secret = secrets.token_urlsafe(48).encode()
        self.secret_file = directory / "secret"
        self.secret_file.write_bytes(self.secret + b"\n")
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.private_pem = key.private_bytes(serialization.Encoding.PEM,
                                             serialization.PrivateFormat.PKCS8,
                                             serialization.NoEncryption())
        self.private_file = directory / "private.pem"
        self.private_file.write_bytes(self.private_pem)
        self.public_file = directory / "public.pem"
        self.public_file.write_bytes(key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))

    def token(self, subject: str, expires_s: int | None = 3600, role: str | None = None) -> str:
        return create_token(subject, secret=self.secret, expires_s=expires_s, role=role)

    def rs_token(self, subject: str, expires_s: int | None = 3600) -> str:
        return create_token(subject, private_key=self.private_pem, expires_s=expires_s)

    def settings(self, superusers: Iterable[str] = ("root",), **more: Any) -> AuthSettings:
        """A cluster's settings: tokens signed with the shared secret, these superusers."""
        return AuthSettings(token_secret_file=str(self.secret_file),
                            superusers=frozenset(superusers), **more)
