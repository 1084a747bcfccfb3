"""The Spark suite's read, write and streaming paths on a PD cluster: three PD nodes on a
three-member etcd, three range servers, each its own process.

The tests are the suite's own, imported here, so pytest runs them once more with this module's
``pd`` and ``sbp_client`` fixtures: the connector and the client are given every PD node,
followers first, and so meet PD_NOT_LEADER and follow it to the leader. Only these paths run
twice; the rest of the suite runs on the embedded cluster alone.
"""

from __future__ import annotations

import pytest

from sbp_spark.client import SbpClient
from sbp_spark.client.pd import PdClient
from sbp_spark.server.cluster import ProcessCluster
from tests.etcd import require_etcd

# Collected by pytest here, against this module's fixtures.
from .streaming.test_stream_read import (  # noqa: F401
    test_processing_time_follows_new_records_and_seals,
    test_restart_from_checkpoint_reads_exactly_the_new_records,
)
from .streaming.test_stream_write import (  # noqa: F401
    test_idempotent_sink_replays_a_failed_micro_batch_without_duplicates,
    test_stream_to_sbp_to_stream,
)
from .test_batch import (  # noqa: F401
    test_opaque_records_and_create_if_missing,
    test_records_round_trip_across_ranges_and_servers,
    test_starting_and_ending_offsets,
    three_ranges,
)


@pytest.fixture(scope="module")
def pd_cluster(tmp_path_factory):
    require_etcd()
    with ProcessCluster(tmp_path_factory.mktemp("pd-cluster"), range_servers=3, pd_nodes=3,
                        etcd_members=3) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def pd(pd_cluster) -> str:
    """Every PD node's address, the followers first."""
    nodes = pd_cluster.pd_address.split(",")
    leader = PdClient(nodes).describe_pd_cluster().leader
    assert leader is not None, "the PD cluster has no leader"
    return ",".join(sorted(nodes, key=lambda a: a == leader.advertise_addr))


@pytest.fixture(scope="module")
def sbp_client(pd) -> SbpClient:
    return SbpClient(pd)
