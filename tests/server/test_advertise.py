"""What servers tell clients to connect to: the advertise address or host, never a wildcard."""

from __future__ import annotations

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server import EmbeddedCluster
from sbp_spark.server.advertise import advertised, check_advertised, format_address
from sbp_spark.server.pd import PdConfig
from sbp_spark.server.range_server import RangeServerConfig


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", ""])
def test_a_wildcard_listener_without_an_advertised_address_is_refused(tmp_path, host):
    for make in (lambda: RangeServerConfig(str(tmp_path), host=host),
                 lambda: PdConfig(tmp_path, host=host),
                 lambda: EmbeddedCluster(tmp_path, host=host)):
        with pytest.raises(ValueError, match=r"every interface\) gives clients no address.*"
                                             r"--advertise-host"):
            make()


@pytest.mark.parametrize("addr, host, problem", [
    ("0.0.0.0:2380", None, "advertise address '0.0.0.0:2380' is not one clients can connect"),
    ("[::]:2380", None, "is not one clients can connect"),
    (None, "0.0.0.0", "advertise host '0.0.0.0' must be a host name or an IP"),
    (None, "rs1:2380", "advertise host 'rs1:2380' must be .* \\(no port\\)"),
    (None, "two words", "advertise host 'two words'"),
    ("rs1:2380", "rs1", "give an advertise address \\('rs1:2380'\\) or an advertise host"),
    ("rs1", None, "is not of the form host:port"),
])
def test_an_advertised_address_clients_cannot_use_is_refused(addr, host, problem):
    with pytest.raises(ValueError, match=problem):
        check_advertised("0.0.0.0", addr, host, "range server")


def test_what_clients_are_told():
    assert advertised(("0.0.0.0", 2380), "rs1:9000", None) == "rs1:9000"
    assert advertised(("0.0.0.0", 2380), None, "rs1") == "rs1:2380"
    assert advertised(("::", 2380), None, "fd00::1") == "[fd00::1]:2380"
    assert advertised(("::", 2380), None, "[fd00::1]") == "[fd00::1]:2380"
    assert advertised(("127.0.0.1", 2380), None, None) == "127.0.0.1:2380"
    assert format_address("::1", 7) == "[::1]:7"
    # Listening on one address needs nothing more; IPv6 literals are hosts, not host:port.
    check_advertised("127.0.0.1", None, None, "range server")
    check_advertised("::", None, "2001:db8::1", "range server")


def test_a_cluster_hands_out_its_advertised_host_and_clients_reach_it_there(tmp_path):
    config = ClientConfig(connect_timeout_s=2, request_timeout_s=10)
    with EmbeddedCluster(tmp_path, range_servers=2, advertise_host="localhost") as cluster, \
            ConnectionPool(config) as pool:
        assert cluster.pd_address.startswith("localhost:")
        rs_addresses = cluster.range_server_addresses
        assert all(a.startswith("localhost:") for a in rs_addresses), rs_addresses
        client = SbpClient(cluster.pd_address, config, pool)
        # The PD's own view: every live range server under its advertised address.
        listed = {s.server.advertise_addr for s in client.pd.range_servers()}
        assert listed == set(rs_addresses)
        stream = client.create_streams(count=1, replicas=2)[0].stream_id
        client.open_stream(stream).append([batch_bytes(b"one"), batch_bytes(b"two")])
        assert [bytes(b.data[28:]) for b in client.read(stream)] == [b"one", b"two"]
        # Every connection the client opened went to an advertised address.
        assert set(pool.connections()) <= {cluster.pd_address, *rs_addresses}
