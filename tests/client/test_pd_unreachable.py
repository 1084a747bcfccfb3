"""A client whose PD never answered says so, naming the address it was given."""

from __future__ import annotations

import socket

import pytest

from sbp_spark.client import ClientConfig, SbpClient
from sbp_spark.protocol.errors import PdUnreachableError, TransportError
from tests.client.private_cluster import client_of, private_cluster


def _closed_port() -> int:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_pd_that_never_answered_is_named_as_the_pd():
    # A wrong 'pd' option failed with "cannot connect to 127.0.0.1:1: Connection refused",
    # which said neither that it was the PD nor that the address may be wrong.
    address = f"127.0.0.1:{_closed_port()}"
    with SbpClient(address, ClientConfig(retries=1)) as client:
        with pytest.raises(PdUnreachableError) as raised:
            client.list_streams()
    message = str(raised.value)
    assert message.startswith(f"no PD answered at {address} (is a PD running there"), message
    assert "Connection refused" in message
    assert isinstance(raised.value, TransportError)  # retriable, as before


def test_a_pd_that_answered_before_fails_as_a_connection(tmp_path):
    # Once a PD answered, a failure later is the connection's (the PD stopped), not a wrong
    # address.
    with private_cluster(tmp_path, range_servers=0) as running:
        with client_of(running, ClientConfig(retries=1)) as client:
            client.list_streams()
            running.pd.stop()
            with pytest.raises(TransportError) as raised:
                client.list_streams()
    assert not isinstance(raised.value, PdUnreachableError), raised.value
