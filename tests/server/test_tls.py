"""TLS and mutual TLS on every server port, in the client, between the servers, and in the
``sbp`` commands. Certificates are made at test time (tests/certs.py, ``openssl``).
"""

from __future__ import annotations

import os
import re
import select
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sbp_spark.cli import main
from sbp_spark.client import ClientConfig, Connection, ConnectionPool, SbpClient
from sbp_spark.client.pd import PdClient
from sbp_spark.protocol.errors import ConnectTimeoutError, ErrorCode, TransportError
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server.cluster import EmbeddedCluster, ProcessCluster, accepts_connections
from sbp_spark.server.net import FrameServer, NetConfig, RequestHandler
from sbp_spark.server.range_server import RangeServer, RangeServerConfig
from sbp_spark.transport.tls import TlsConfig

from ..certs import Certs
from ..client.fakes import FakeServer, Peer
from ..etcd import require_etcd

FAST = dict(connect_timeout_s=3, request_timeout_s=10, retries=2, retry_deadline_s=10)


def client_config(certs: Certs, cert: str | None = "client", **extra) -> ClientConfig:
    files = {"client": (certs.client_cert, certs.client_key),
             "rogue": (certs.rogue_cert, certs.rogue_key), None: (None, None)}[cert]
    return ClientConfig(tls=True, tls_ca_file=certs.ca, tls_cert_file=files[0],
                        tls_key_file=files[1], **{**FAST, **extra})


class Nothing(RequestHandler):
    """The core answers PING by itself; no other opcode is served."""

    def handle(self, ctx) -> None:  # never called: no opcode is declared
        ctx.system_error(ErrorCode.INVALID_REQUEST, "this test server serves only PING")


@pytest.fixture
def mtls_server(certs):
    with FrameServer(Nothing(), NetConfig(tls=certs.server_tls())) as server:
        yield server


# -- configuration ------------------------------------------------------------------------------


def test_bad_tls_settings_name_the_problem(tmp_path, certs):
    with pytest.raises(ValueError, match="not a readable file"):
        TlsConfig(str(tmp_path / "missing.pem"), certs.key)
    with pytest.raises(ValueError, match="both a certificate file and its key"):
        TlsConfig(cert_file=certs.cert)
    with pytest.raises(ValueError, match="tls"):
        ClientConfig(tls_ca_file=certs.ca)  # files without tls=True
    with pytest.raises(ValueError, match="certificate file and a key file"):
        FrameServer(Nothing(), NetConfig(tls=TlsConfig(ca_file=certs.ca))).start()


# -- one connection -----------------------------------------------------------------------------


def test_ping_over_mutual_tls(mtls_server, certs):
    with Connection(mtls_server.address_str, client_config(certs)) as conn:
        conn.ping(b"x" * (1 << 20))


def test_full_duplex_many_threads_large_frames(mtls_server, certs):
    """Many threads send 2 MiB PINGs on one TLS connection while its reader decrypts the
    answers: the TLS state is shared safely between the reader and the senders."""
    errors: list[BaseException] = []
    with Connection(mtls_server.address_str, client_config(certs)) as conn:
        def worker(seed: int) -> None:
            try:
                for i in range(5):
                    conn.ping(bytes([seed, i]) * (1 << 20))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not errors, errors[:2]


@pytest.mark.parametrize("cert", [None, "rogue"])
def test_client_without_a_valid_certificate_is_refused(mtls_server, certs, cert):
    with pytest.raises(TransportError) as info:
        with Connection(mtls_server.address_str, client_config(certs, cert)) as conn:
            conn.ping()
    # The server's alert says why (TLS 1.3 refuses a client certificate after the handshake).
    assert "certificate required" in str(info.value) or "unknown ca" in str(info.value), \
        info.value
    # ... and the error says what to change.
    hint = ("requires a client certificate and this client presented none: set tls_cert_file "
            "and tls_key_file" if cert is None else
            "does not trust the CA that signed this client's certificate")
    assert hint in str(info.value), info.value
    # The server is unharmed.
    with Connection(mtls_server.address_str, client_config(certs)) as conn:
        conn.ping()


def test_plain_tcp_client_is_refused_and_the_server_survives(mtls_server, certs):
    failures = mtls_server.stats.tls_failures
    with pytest.raises(TransportError):
        with Connection(mtls_server.address_str, ClientConfig(**FAST)) as conn:
            conn.ping()
    with socket.create_connection(mtls_server.address, timeout=5) as raw:
        raw.sendall(b"\0\0\0\x10" + b"\x17" * 16)  # an SBP frame, not a TLS hello
        answer = b""
        while chunk := raw.recv(100):  # a TLS alert (record type 21) at most, then EOF
            answer += chunk
        assert answer == b"" or answer[0] == 21, answer
    assert mtls_server.stats.tls_failures >= failures + 2
    with Connection(mtls_server.address_str, client_config(certs)) as conn:
        conn.ping()


def test_plain_tcp_client_is_told_the_server_may_require_tls(mtls_server, certs, capsys):
    # The server drops a peer whose first bytes are no TLS handshake, without a word.
    hint = r"(closed by the server|Broken pipe|reset) \(before any answer: .* may require TLS"
    with pytest.raises(TransportError, match=hint) as info:
        with Connection(mtls_server.address_str, ClientConfig(**FAST)) as conn:
            conn.ping()
    assert info.value.retriable  # retried as before: the hint changes only the words
    with ConnectionPool(ClientConfig(**FAST)) as pool:
        with pytest.raises(TransportError, match=hint):
            SbpClient(mtls_server.address_str, ClientConfig(**FAST), pool).list_streams()
    assert main(["streams", "list", "--pd", mtls_server.address_str]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "$SBP_TLS_CA" in err, err


def test_a_server_closing_after_answers_gets_no_tls_hint():
    def answer_once(peer: Peer) -> None:
        ping = peer.read_frame(pings=True)
        peer.reply(ping, bytes(ping.header), bytes(ping.payload))  # then the server closes

    with FakeServer(answer_once) as server, \
            Connection(server.address, ClientConfig(**FAST)) as conn:
        conn.ping()
        deadline = time.monotonic() + 10
        while not conn.closed and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(TransportError, match=r"closed by the server$"):
            conn.ping()


def test_tls_client_to_a_plain_server_fails_cleanly(certs):
    with FrameServer(Nothing(), NetConfig()) as server:
        with pytest.raises(TransportError):
            with Connection(server.address_str, client_config(certs)) as conn:
                conn.ping()


def test_server_without_client_verification_accepts_any_tls_client(certs):
    with FrameServer(Nothing(), NetConfig(tls=certs.server_tls(mutual=False))) as server:
        with Connection(server.address_str, client_config(certs, None)) as conn:
            conn.ping()


def test_server_name_is_checked(certs):
    """A client checks that the server's certificate names the host it dialled."""
    with FrameServer(Nothing(), NetConfig(tls=certs.server_tls())) as server:
        with Connection(f"localhost:{server.address[1]}", client_config(certs)) as conn:
            conn.ping()  # the certificate names 127.0.0.1 and localhost
    elsewhere = TlsConfig(certs.elsewhere_cert, certs.elsewhere_key, certs.ca)
    with FrameServer(Nothing(), NetConfig(tls=elsewhere)) as server:
        with pytest.raises(TransportError, match="(?i)hostname|match"):
            with Connection(server.address_str, client_config(certs)) as conn:
                conn.ping()


# -- whole clusters -----------------------------------------------------------------------------


def test_embedded_cluster_with_mutual_tls_replicates_and_refuses_strangers(tmp_path, certs):
    with EmbeddedCluster(tmp_path, range_servers=2, tls=certs.server_tls()) as cluster, \
            ConnectionPool(client_config(certs)) as pool:
        client = SbpClient(cluster.pd_address, client_config(certs), pool)
        [stream] = client.create_streams(1, replicas=2)  # PD -> range servers over mTLS
        done = client.open_stream(stream.stream_id).append(
            [batch_bytes(b"secret %d" % i) for i in range(20)])  # primary -> secondary too
        assert [a.base_offset for a in done] == list(range(20))
        # A secondary serves what settled once the next forward tells it (read cap).
        client.open_stream(stream.stream_id).append([batch_bytes(b"one more")])
        [rng] = client.list_ranges(stream.stream_id)
        for replica in rng.servers:  # every replica holds the data
            got = list(client.range_server(replica.server.advertise_addr).fetch(
                stream.stream_id, 0, 20))
            assert len(got) == 20
        with ConnectionPool(client_config(certs, "rogue")) as rogue_pool:
            rogue = SbpClient(cluster.pd_address, client_config(certs, "rogue"), rogue_pool)
            with pytest.raises(TransportError):
                rogue.list_streams()
        assert not accepts_connections(cluster.pd_address)  # plain TCP
        assert accepts_connections(cluster.pd_address, config=client_config(certs))


def test_sbp_commands_serve_mutual_tls(tmp_path, certs):
    with ProcessCluster(tmp_path, range_servers=1, tls=certs.server_tls()) as cluster, \
            ConnectionPool(client_config(certs)) as pool:
        client = SbpClient(cluster.pd_address, client_config(certs), pool)
        [stream] = client.create_streams(1)
        client.open_stream(stream.stream_id).append([batch_bytes(b"over tls")])
        assert [bytes(b.data[28:]) for b in client.read(stream.stream_id)] == [b"over tls"]
        with ConnectionPool(client_config(certs, None)) as anonymous:
            with pytest.raises(TransportError):
                SbpClient(cluster.pd_address, client_config(certs, None), anonymous
                          ).list_streams()
        # The admin commands take their TLS files from the environment.
        command = [sys.executable, "-m", "sbp_spark.cli", "streams", "create", "--pd",
                   cluster.pd_address]
        env = {**os.environ, "SBP_TLS_CA": certs.ca, "SBP_TLS_CERT": certs.client_cert,
               "SBP_TLS_KEY": certs.client_key}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and done.stdout.strip().isdigit(), done.stderr
        env = {k: v for k, v in env.items() if not k.startswith("SBP_TLS_")}
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_sbp_server_commands_check_their_tls_options(tmp_path, certs):
    for args, message in (
            (["--tls-ca", certs.ca], "--tls-ca needs --tls-cert and --tls-key"),
            (["--tls-cert", certs.cert], "--tls-cert and --tls-key go together"),
            (["--tls-cert", str(tmp_path / "none.pem"), "--tls-key", certs.key],
             "not a readable file")):
        done = subprocess.run(
            [sys.executable, "-m", "sbp_spark.cli", "pd", "--data-dir", str(tmp_path / "pd"),
             "--port", "0", *args], capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and message in done.stderr, done.stderr


def test_servers_refuse_certificates_they_could_not_call_each_other_with(tmp_path, certs):
    """The servers call each other with their own certificate: one that fails there (no
    clientAuth key usage, no CA file for a private CA, not naming the advertised host, from
    another CA) is refused at start, naming the problem, instead of a cluster whose range
    servers retry registering forever."""
    cases = [
        (TlsConfig(certs.server_only_cert, certs.server_only_key, certs.ca),
         "unsuitable certificate purpose: .* needs the clientAuth extended key usage"),
        (TlsConfig(certs.cert, certs.key),
         "without a CA file .* system's trust store, which does not trust this one"),
        (TlsConfig(certs.localhost_cert, certs.localhost_key, certs.ca),
         "not valid for '127.0.0.1': the other servers call this one at 127.0.0.1"),
        (TlsConfig(certs.rogue_cert, certs.rogue_key, certs.ca),
         f"not signed by a CA in '{certs.ca}'"),
    ]
    if certs.expired_cert is not None:
        cases.append((TlsConfig(certs.expired_cert, certs.expired_key, certs.ca),
                      r"certificate has expired \(not valid after \d{4}-\d\d-\d\d "))
    for i, (tls, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message) as info:
            EmbeddedCluster(tmp_path / str(i), range_servers=1, tls=tls,
                            start_timeout_s=10).start()
        assert repr(tls.cert_file) in str(info.value), info.value
    # Advertising the name the certificate holds is the way out.
    tls = TlsConfig(certs.localhost_cert, certs.localhost_key, certs.ca)
    with EmbeddedCluster(tmp_path / "named", range_servers=1, tls=tls,
                         advertise_host="localhost") as cluster, \
            ConnectionPool(client_config(certs)) as pool:
        client = SbpClient(cluster.pd_address, client_config(certs), pool)
        [stream] = client.create_streams(1)
        client.open_stream(stream.stream_id).append([batch_bytes(b"by name")])
        assert [bytes(b.data[28:]) for b in client.read(stream.stream_id)] == [b"by name"]


def test_sbp_server_refuses_a_certificate_without_client_auth(tmp_path, certs):
    done = subprocess.run(
        [sys.executable, "-m", "sbp_spark.cli", "server", "--data-dir", str(tmp_path / "d"),
         "--port", "0", "--tls-cert", certs.server_only_cert, "--tls-key",
         certs.server_only_key, "--tls-ca", certs.ca],
        capture_output=True, text=True, timeout=120)
    assert done.returncode != 0, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("sbp server: error:") and "clientAuth" in last \
        and certs.server_only_cert in last, done.stderr


def test_a_server_certificate_the_client_cannot_verify_names_the_ca_setting(mtls_server, certs):
    untrusted = ClientConfig(tls=True, tls_ca_file=certs.rogue_ca, **FAST)
    with pytest.raises(TransportError) as info:
        with Connection(mtls_server.address_str, untrusted) as conn:
            conn.ping()
    assert mtls_server.address_str in str(info.value)
    assert f"not signed by a CA in tls_ca_file {certs.rogue_ca!r}" in str(info.value), \
        info.value
    with pytest.raises(TransportError) as info:  # the system's trust store knows not our CA
        with Connection(mtls_server.address_str, ClientConfig(tls=True, **FAST)) as conn:
            conn.ping()
    assert "system's trust store" in str(info.value) and "tls.caFile" in str(info.value), \
        info.value


def test_an_expired_client_certificate_is_named_with_its_end(mtls_server, certs):
    if certs.expired_cert is None:
        pytest.skip("this openssl makes no expired certificate")
    expired = ClientConfig(tls=True, tls_ca_file=certs.ca, tls_cert_file=certs.expired_cert,
                           tls_key_file=certs.expired_key, **FAST)
    with pytest.raises(TransportError) as info:
        with Connection(mtls_server.address_str, expired) as conn:
            conn.ping()
    assert mtls_server.address_str in str(info.value)
    assert re.search(rf"certificate {re.escape(repr(certs.expired_cert))} expired \(not valid "
                     r"after \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC\)", str(info.value)), info.value


def test_a_plain_range_server_is_told_its_pd_may_require_tls(mtls_server, tmp_path, caplog):
    """A range server started without the TLS options against a TLS PD logs, on every retry of
    its registration, the options that would fix it, not only the client settings."""
    caplog.set_level("WARNING", logger="sbp_spark.server.range_server.registration")
    config = RangeServerConfig(data_dir=str(tmp_path / "rs"),
                               pd_addresses=[mtls_server.address_str])
    with RangeServer(config):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not [
                r for r in caplog.records if "may require TLS" in r.getMessage()]:
            time.sleep(0.05)
    [first, *_] = [r.getMessage() for r in caplog.records if "may require TLS" in r.getMessage()]
    assert "--tls-cert, --tls-key and --tls-ca" in first, first


def test_a_pd_cluster_on_etcd_serves_mutual_tls(tmp_path, certs):
    """``sbp server --pd-nodes N`` with the TLS options: the PD nodes form their cluster (the
    start-up check asks them over TLS), and a client that dials a follower first is sent on
    to the leader, which places replicated streams on the range servers, all over mTLS."""
    require_etcd()
    with ProcessCluster(tmp_path, range_servers=2, pd_nodes=2, tls=certs.server_tls(),
                        start_timeout_s=30) as cluster, \
            ConnectionPool(client_config(certs)) as pool:
        leader = PdClient(cluster.pd_address, client_config(certs), pool
                          ).describe_pd_cluster().leader
        assert leader is not None
        followers_first = sorted(cluster.pd_address.split(","),
                                 key=lambda a: a == leader.advertise_addr)
        client = SbpClient(",".join(followers_first), client_config(certs), pool)
        [stream] = client.create_streams(1, replicas=2)
        client.open_stream(stream.stream_id).append([batch_bytes(b"over tls")])
        assert [bytes(b.data[28:]) for b in client.read(stream.stream_id)] == [b"over tls"]


# -- renewed certificates -----------------------------------------------------------------------


def _install(target: dict[str, Path], **sources: str | bytes) -> None:
    """Replace the named files (cert, key, ca) as renewals do: a new file, renamed over the old
    one. A source is a path to copy, or the bytes to write."""
    for name, source in sources.items():
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
        replacement = target[name].with_suffix(".new")
        replacement.write_bytes(data)
        replacement.replace(target[name])


def _server_files(tmp_path: Path, certs: Certs) -> tuple[dict[str, Path], TlsConfig]:
    files = {"cert": tmp_path / "server.pem", "key": tmp_path / "server.key",
             "ca": tmp_path / "ca.pem"}
    _install(files, cert=certs.cert, key=certs.key, ca=certs.ca)
    return files, TlsConfig(str(files["cert"]), str(files["key"]), str(files["ca"]))


def _served_name(address: str, ca: str, cert: str, key: str) -> str:
    """The common name of the certificate the server at ``address`` presents to a new
    connection (as ``openssl s_client`` would show it)."""
    host, port = address.rsplit(":", 1)
    context = ssl.create_default_context(cafile=ca)
    context.load_cert_chain(cert, key)
    with socket.create_connection((host, int(port)), timeout=5) as raw, \
            context.wrap_socket(raw, server_hostname=host) as tls:
        peer = tls.getpeercert()
    assert peer is not None
    return dict(item[0] for item in peer["subject"])["commonName"]


def test_servers_serve_renewed_certificates_to_new_connections(tmp_path, certs):
    """Certificates are renewed by replacing their files: the PD and the range servers serve
    the new certificate to the next connection, without a restart; open connections go on."""
    files, tls = _server_files(tmp_path, certs)
    old_client = (certs.ca, certs.client_cert, certs.client_key)
    with EmbeddedCluster(tmp_path / "cluster", range_servers=1, tls=tls) as cluster:
        servers = [cluster.pd_address, *cluster.range_server_addresses]
        assert [_served_name(a, *old_client) for a in servers] == ["node", "node"]
        opened = Connection(cluster.pd_address, client_config(certs))
        opened.ping()

        _install(files, cert=certs.client_cert, key=certs.client_key)  # same CA, new pair
        assert [_served_name(a, *old_client) for a in servers] == ["client", "client"]
        opened.ping()  # the session it made goes on
        with ConnectionPool(client_config(certs)) as pool:
            client = SbpClient(cluster.pd_address, client_config(certs), pool)
            [stream] = client.create_streams(1)  # the PD calls the range server: renewed too
            client.open_stream(stream.stream_id).append([batch_bytes(b"renewed")])

        # A new CA: clients that trust only it (with a certificate it signed) get in.
        _install(files, cert=certs.rogue_cert, key=certs.rogue_key, ca=certs.rogue_ca)
        new_ca = ClientConfig(tls=True, tls_ca_file=certs.rogue_ca, tls_cert_file=certs.rogue_cert,
                              tls_key_file=certs.rogue_key, **FAST)
        with ConnectionPool(new_ca) as pool:
            client = SbpClient(cluster.pd_address, new_ca, pool)
            assert [s.stream_id for s in client.list_streams()] == [stream.stream_id]
            assert [bytes(b.data[28:]) for b in client.read(stream.stream_id)] == [b"renewed"]
        with pytest.raises(TransportError, match="certificate verify failed"):
            with Connection(cluster.pd_address, client_config(certs)) as conn:
                conn.ping()
        opened.ping()
        opened.close()


def test_a_renewal_that_cannot_be_loaded_keeps_the_last_certificate(tmp_path, certs, caplog):
    """A renewal that cannot be used (a key that is not the certificate's, a file half
    written, a file missing) leaves the server serving the certificate it had, says why once
    per bad version of the files, naming the file, and the next good version is served."""
    caplog.set_level("INFO", logger="sbp_spark.transport.tls")
    files, tls = _server_files(tmp_path, certs)
    client = (certs.ca, certs.client_cert, certs.client_key)

    def errors() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]

    with FrameServer(Nothing(), NetConfig(tls=tls, name="renewing")) as server:
        address = server.address_str
        _install(files, cert=certs.client_cert)  # the key is still node's
        for _ in range(3):
            assert _served_name(address, *client) == "node"
        with Connection(address, client_config(certs)) as conn:
            conn.ping()
        [mismatch] = errors()
        assert mismatch.startswith("renewing: the renewed TLS files cannot be used") and \
            f"the key file {str(files['key'])!r} is not the private key of the certificate" \
            in mismatch, mismatch

        pem = Path(certs.client_cert).read_bytes()
        _install(files, cert=pem[:len(pem) // 2], key=certs.client_key)  # half written
        for _ in range(2):
            assert _served_name(address, *client) == "node"
        assert len(errors()) == 2
        assert f"the certificate file {str(files['cert'])!r} holds no PEM certificate" in \
            errors()[1], errors()

        files["key"].unlink()
        assert _served_name(address, *client) == "node"
        assert len(errors()) == 3 and f"the key file {str(files['key'])!r} is missing" in \
            errors()[2], errors()

        _install(files, cert=certs.client_cert, key=certs.client_key)
        assert _served_name(address, *client) == "client"
        assert _served_name(address, *client) == "client"
        assert len(errors()) == 3, errors()
        assert server.stats.tls_failures == 0


# -- handshakes that do not complete ------------------------------------------------------------


def test_a_tls_client_gives_up_on_a_silent_server_after_one_connect_timeout(certs):
    """A server that accepts the TCP connection and never answers the TLS handshake (its
    process stopped or hung, or another service on that port): every retry dialled it again
    and waited the connect timeout out again (5 s became 31 s, the error saying 5 s). It is
    dialled once; the retries fail at once, and the error names the likely causes."""
    accepted: list[socket.socket] = []
    stop = threading.Event()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(0.05)

        def accept() -> None:
            while not stop.is_set():
                try:
                    accepted.append(listener.accept()[0])
                except TimeoutError:
                    continue

        acceptor = threading.Thread(target=accept)
        acceptor.start()
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        config = client_config(certs, connect_timeout_s=2, retries=5, retry_deadline_s=60)
        try:
            with ConnectionPool(config) as pool:
                with pytest.raises(ConnectTimeoutError) as info:
                    SbpClient(address, config, pool).list_streams()
        finally:
            stop.set()
            acceptor.join()
            for conn in accepted:
                conn.close()
    assert len(accepted) == 1, f"dialled {len(accepted)} times"
    message = str(info.value)
    assert f"TLS handshake with {address} timed out after 2s" in message, message
    assert "stopped or hung" in message and "no SBP server with TLS" in message, message


def test_a_tls_server_drops_a_peer_whose_handshake_does_not_complete_in_time(certs):
    """A peer that sends its ClientHello a byte at a time held the server's reader thread
    (and a connection slot) for as long as it kept sending: the handshake timeout bounded
    each wait, not the handshake. ``NetConfig.tls_handshake_timeout_s`` bounds the whole
    handshake now; the peer is dropped and counted in ``tls_failures``."""
    outgoing = ssl.MemoryBIO()
    client_side = ssl.create_default_context(cafile=certs.ca).wrap_bio(
        ssl.MemoryBIO(), outgoing, server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        client_side.do_handshake()
    hello = outgoing.read()  # a real ClientHello, as a client sends it
    config = NetConfig(tls=certs.server_tls(), tls_handshake_timeout_s=1.0)
    with FrameServer(Nothing(), config) as server:
        closed_after = None
        with socket.create_connection(server.address, timeout=10) as peer:
            for sent in range(1, len(hello)):  # never the last byte; one each 0.2 s
                try:
                    peer.sendall(hello[sent - 1:sent])
                    readable, _, _ = select.select([peer], [], [], 0.2)
                    if readable and peer.recv(100) == b"":
                        closed_after = sent
                        break
                except ConnectionResetError:
                    closed_after = sent
                    break
        assert closed_after is not None, "the server waited for the whole trickled hello"
        assert closed_after < 15, f"the server took {closed_after} bytes, 0.2 s apart"
        assert server.stats.tls_failures == 1
        with Connection(server.address_str, client_config(certs)) as conn:
            conn.ping()
    with pytest.raises(ValueError, match="tls_handshake_timeout_s"):
        NetConfig(tls_handshake_timeout_s=0)
