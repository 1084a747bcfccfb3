"""A client's TLS files are checked when its configuration is made: a file OpenSSL cannot load
is a configuration error naming it, not a "handshake failed" with every server, retried."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from sbp_spark.cli import main
from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient
from sbp_spark.protocol.errors import ErrorCode, TransportError
from sbp_spark.server.cluster import EmbeddedCluster
from sbp_spark.server.net import FrameServer, NetConfig, RequestHandler
from sbp_spark.transport.tls import TlsConfig


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory, certs):
    with EmbeddedCluster(tmp_path_factory.mktemp("tls-cluster"), range_servers=1,
                         tls=certs.server_tls()) as running:
        yield running


def test_unusable_tls_files_are_refused_naming_them(tls_cluster, certs, tmp_path):
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    for files in ({"tls_ca_file": str(junk)},
                  {"tls_cert_file": certs.client_key, "tls_key_file": certs.client_cert},
                  {"tls_cert_file": certs.client_cert, "tls_key_file": certs.rogue_key}):
        settings = {"tls_ca_file": certs.ca, "tls_cert_file": certs.client_cert,
                    "tls_key_file": certs.client_key, **files}
        with pytest.raises(ValueError, match="TLS files cannot be used") as info:
            ClientConfig(tls=True, **settings)
        for path in files.values():
            assert path in str(info.value)
    config = ClientConfig(tls=True, tls_ca_file=certs.ca, tls_cert_file=certs.client_cert,
                          tls_key_file=certs.client_key, connect_timeout_s=3)
    with ConnectionPool(config) as pool:
        assert SbpClient(tls_cluster.pd_address, config, pool).list_streams() == []


def test_sbp_names_an_unusable_tls_file_from_the_environment(tls_cluster, certs, capsys,
                                                             monkeypatch):
    monkeypatch.setenv("SBP_TLS_CA", certs.ca)
    monkeypatch.setenv("SBP_TLS_CERT", certs.client_key)  # swapped with the key
    monkeypatch.setenv("SBP_TLS_KEY", certs.client_cert)
    assert main(["streams", "list", "--pd", tls_cluster.pd_address]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert certs.client_key in err and "handshake" not in err, err


def test_tls_files_renewed_on_disk_are_used_by_new_connections(tls_cluster, certs, tmp_path):
    """Certificates are renewed by replacing their files (cert-manager, certbot...): a process
    that keeps running (a Spark driver, a streaming job's workers) must present the renewed
    certificate, and trust the renewed CA file, on its next connection."""
    cert, key, ca = tmp_path / "me.pem", tmp_path / "me.key", tmp_path / "ca.pem"

    def install(cert_src: str, key_src: str, ca_src: str) -> None:
        for target, source in ((cert, cert_src), (key, key_src), (ca, ca_src)):
            replacement = target.with_suffix(".new")
            replacement.write_bytes(open(source, "rb").read())
            replacement.replace(target)  # how renewals land: a new file under the old name

    def list_streams() -> list:
        config = ClientConfig(tls=True, tls_ca_file=str(ca), tls_cert_file=str(cert),
                              tls_key_file=str(key), connect_timeout_s=3, retries=0)
        with ConnectionPool(config) as pool:
            return SbpClient(tls_cluster.pd_address, config, pool).list_streams()

    install(certs.rogue_cert, certs.rogue_key, certs.ca)  # a certificate the cluster refuses
    with pytest.raises(TransportError, match="does not trust the CA"):
        list_streams()
    install(certs.client_cert, certs.client_key, certs.ca)  # renewed
    assert list_streams() == []
    install(certs.client_cert, certs.client_key, certs.rogue_ca)  # a CA file that lost the CA
    with pytest.raises(TransportError, match="certificate verify failed"):
        list_streams()
    install(certs.client_cert, certs.client_key, certs.ca)
    assert list_streams() == []


class _Nothing(RequestHandler):
    def handle(self, ctx) -> None:  # never called: no opcode is declared
        ctx.system_error(ErrorCode.INVALID_REQUEST, "this test server serves only PING")


def test_a_key_file_with_a_passphrase_is_refused_naming_it(certs, tmp_path):
    """A passphrase-protected key cannot be used (no option takes a passphrase): it is refused
    naming the file, instead of OpenSSL asking for the passphrase on the terminal (a server or
    a Spark driver then waits for typing) or failing with '[Errno 22] Invalid argument'."""
    locked = tmp_path / "locked.key"
    subprocess.run(["openssl", "pkey", "-in", certs.client_key, "-aes256", "-passout",
                    "pass:secret", "-out", str(locked)], check=True, capture_output=True)
    with pytest.raises(ValueError, match="passphrase") as info:
        ClientConfig(tls=True, tls_ca_file=certs.ca, tls_cert_file=certs.client_cert,
                     tls_key_file=str(locked))
    assert str(locked) in str(info.value)
    with pytest.raises(ValueError, match="passphrase") as info:
        FrameServer(_Nothing(), NetConfig(
            tls=TlsConfig(certs.client_cert, str(locked), certs.ca))).start()
    assert str(locked) in str(info.value)
    done = subprocess.run(
        [sys.executable, "-m", "sbp_spark.cli", "pd", "--data-dir", str(tmp_path / "pd"),
         "--port", "0", "--tls-cert", certs.client_cert, "--tls-key", str(locked)],
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
        start_new_session=True)  # no terminal to ask on
    assert done.returncode != 0, done.stderr
    assert "pass phrase" not in done.stderr and "passphrase" in done.stderr \
        and str(locked) in done.stderr, done.stderr


def _without_file_privileges() -> list[str]:
    """A command prefix under which file permissions hold (root bypasses them)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("root ignores file permissions, and setpriv (to drop that) is missing")
    caps = "-dac_override,-dac_read_search"
    return [setpriv, "--bounding-set", caps, "--inh-caps", caps]


def test_an_unreadable_key_file_is_named(certs, tmp_path):
    """A key file the user may not read (owned by another account, mode 600) is named, by the
    servers and the sbp commands, instead of a bare '[Errno 13] Permission denied'."""
    key = tmp_path / "other-users.key"
    shutil.copy(certs.client_key, key)
    key.chmod(0)
    prefix = _without_file_privileges()
    server = subprocess.run(
        [*prefix, sys.executable, "-m", "sbp_spark.cli", "pd", "--data-dir",
         str(tmp_path / "pd"), "--port", "0", "--tls-cert", certs.client_cert, "--tls-key",
         str(key)], capture_output=True, text=True, timeout=60)
    client = subprocess.run(
        [*prefix, sys.executable, "-m", "sbp_spark.cli", "streams", "list", "--pd",
         "127.0.0.1:1"], capture_output=True, text=True, timeout=60,
        env={**os.environ, "SBP_TLS_CA": certs.ca, "SBP_TLS_CERT": certs.client_cert,
             "SBP_TLS_KEY": str(key)})
    for done in (server, client):
        assert done.returncode != 0, done.stderr
        last = done.stderr.strip().splitlines()[-1]
        assert f"TLS key file {str(key)!r} is not a readable file (Permission denied)" in last, \
            done.stderr
