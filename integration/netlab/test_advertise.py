"""A server listening on every interface of its machine (``--host 0.0.0.0``) hands out the
address it was told to advertise, and clients on another machine reach it there."""

from __future__ import annotations

import subprocess
import sys

import pytest

from integration.netlab.network import Network, unavailable
from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server.cluster import ServerProcess

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"netlab: {REASON}")

CONFIG = ClientConfig(connect_timeout_s=2, request_timeout_s=10, retry_deadline_s=20)
# Connects from inside a node to argv[1]:argv[2]; prints "ok" or the error.
CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()
    print("ok")
except OSError as exc:
    print(exc)
"""


def test_a_server_on_every_interface_is_reached_at_its_advertised_host(tmp_path):
    with Network(["srv"]) as net:
        node = net["srv"]
        server = ServerProcess(["server", "--data-dir", str(tmp_path / "data"), "--host",
                                "0.0.0.0", "--port", "0", "--range-servers", "2",
                                "--advertise-host", node.address],
                               tmp_path / "ready.json", tmp_path / "server.log",
                               prefix=node.prefix)
        try:
            pd = server.info["pd"]
            range_servers = server.info["range_servers"]
            assert pd.startswith(f"{node.address}:"), server.info
            assert all(a.startswith(f"{node.address}:") for a in range_servers), server.info
            # This process is another machine of the network: it reaches the PD and both range
            # servers (a replicated append goes through both) at what the PD handed out.
            with ConnectionPool(CONFIG) as pool:
                client = SbpClient(pd, CONFIG, pool)
                listed = {s.server.advertise_addr for s in client.pd.range_servers()}
                assert listed == set(range_servers)
                stream = client.create_streams(count=1, replicas=2)[0].stream_id
                client.open_stream(stream).append([batch_bytes(b"hello"), batch_bytes(b"!")])
                assert [bytes(b.data[28:]) for b in client.read(stream)] == [b"hello", b"!"]
                assert set(pool.connections()) <= {pd, *range_servers}
            # And the listeners are on every interface of the node: its loopback answers too.
            port = pd.rsplit(":", 1)[1]
            done = subprocess.run([*node.prefix, sys.executable, "-c", CONNECT, "127.0.0.1",
                                   port], capture_output=True, text=True, timeout=30)
            assert done.stdout.strip() == "ok", done.stdout + done.stderr
        finally:
            assert server.terminate() == 0, server.log_tail()
