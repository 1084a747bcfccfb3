"""Certificates for TLS tests, made at test time with the ``openssl`` command.

``make_certs(directory)`` writes a CA, a certificate for 127.0.0.1/localhost signed by it that
serves both as a server and as a client certificate (the servers' own calls to each other use
it too), a second client certificate from the same CA, a "rogue" client certificate from
another CA that no server trusts, a certificate from the right CA for another name, one for
servers only (no clientAuth key usage), one naming localhost but not 127.0.0.1, and an expired
one (when this openssl makes one: ``expired_cert`` is None otherwise). Keys are P-256 (fast to
make).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

_EXTENSIONS = """\
basicConstraints = CA:FALSE
keyUsage = digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
"""


@dataclass(frozen=True)
class Certs:
    ca: str
    cert: str  # 127.0.0.1 / localhost, server and client use
    key: str
    client_cert: str
    client_key: str
    rogue_ca: str
    rogue_cert: str  # signed by rogue_ca, which nobody trusts
    rogue_key: str
    elsewhere_cert: str  # signed by ca, but for the name elsewhere.invalid only
    elsewhere_key: str
    server_only_cert: str  # signed by ca, for 127.0.0.1/localhost, serverAuth only
    server_only_key: str
    localhost_cert: str  # signed by ca, for the name localhost only (no IP address)
    localhost_key: str
    expired_cert: str | None  # signed by ca, for 127.0.0.1/localhost, expired a day ago
    expired_key: str

    def server_tls(self, mutual: bool = True):
        """A server's TLS settings with ``cert``; ``mutual``: clients must present a
        certificate signed by ``ca``."""
        from sbp_spark.transport.tls import TlsConfig

        return TlsConfig(self.cert, self.key, self.ca if mutual else None)


def _openssl(*args: str, cwd: Path) -> None:
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args)} failed: {done.stderr.strip()}")


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2",
             "-subj", f"/CN={name}", cwd=d)


def _leaf(d: Path, name: str, ca: str, extensions: str = "ext.cnf", days: int = 2) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", str(days), "-extfile", extensions,
             cwd=d)


def make_certs(directory: Path) -> Certs:
    """Write the test PKI into ``directory``; skips the test when openssl is missing."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "ext.cnf").write_text(_EXTENSIONS)
    (d / "elsewhere.cnf").write_text(
        _EXTENSIONS.replace("IP:127.0.0.1, DNS:localhost", "DNS:elsewhere.invalid"))
    (d / "server-only.cnf").write_text(
        _EXTENSIONS.replace("serverAuth, clientAuth", "serverAuth"))
    (d / "localhost.cnf").write_text(
        _EXTENSIONS.replace("IP:127.0.0.1, DNS:localhost", "DNS:localhost"))
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    _leaf(d, "node", "ca")
    _leaf(d, "client", "ca")
    _leaf(d, "rogue", "rogue-ca")
    _leaf(d, "elsewhere", "ca", "elsewhere.cnf")
    _leaf(d, "server-only", "ca", "server-only.cnf")
    _leaf(d, "localhost", "ca", "localhost.cnf")
    try:  # ends a day before it starts, so expired already; some openssl refuse -days -1
        _leaf(d, "expired", "ca", days=-1)
        expired: str | None = str(d / "expired.pem")
    except RuntimeError:
        expired = None
    return Certs(ca=str(d / "ca.pem"), cert=str(d / "node.pem"), key=str(d / "node.key"),
                 client_cert=str(d / "client.pem"), client_key=str(d / "client.key"),
                 rogue_ca=str(d / "rogue-ca.pem"), rogue_cert=str(d / "rogue.pem"),
                 rogue_key=str(d / "rogue.key"), elsewhere_cert=str(d / "elsewhere.pem"),
                 elsewhere_key=str(d / "elsewhere.key"),
                 server_only_cert=str(d / "server-only.pem"),
                 server_only_key=str(d / "server-only.key"),
                 localhost_cert=str(d / "localhost.pem"), localhost_key=str(d / "localhost.key"),
                 expired_cert=expired, expired_key=str(d / "expired.key"))
