"""A PD cluster whose etcd is gone: no node names a leader it can no longer confirm."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sbp_spark.server.cluster import ProcessCluster
from tests.etcd import require_etcd
from tests.polling import wait_until


def sbp(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sbp_spark.cli", *args], capture_output=True,
                          text=True, timeout=60)


def leader_seen_by(address: str) -> str | None:
    """The leader ``sbp cluster`` shows when asked of the PD node at ``address`` alone."""
    shown = sbp("cluster", "--json", "--pd-only", "--pd", address)
    # (status 1 with no leader: "unhealthy: no PD node leads right now")
    assert shown.returncode in (0, 1) and shown.stdout, shown.stderr
    leaders = [m["name"] for m in json.loads(shown.stdout)["members"] if m["leader"]]
    assert len(leaders) <= 1
    return leaders[0] if leaders else None


@pytest.mark.slow
def test_with_etcd_gone_no_node_names_the_old_leader(tmp_path):
    # With etcd down the leader stepped down (its lease could not be renewed), but the
    # followers went on naming it, in `sbp cluster` and in their PD_NOT_LEADER answers: clients
    # were sent back to a node that could no longer act, again and again.
    require_etcd()
    with ProcessCluster(tmp_path, range_servers=0, pd_nodes=3, etcd_members=1) as cluster:
        nodes = cluster.pd_address.split(",")
        wait_until(lambda: len({leader_seen_by(a) for a in nodes}) == 1
                   and leader_seen_by(nodes[0]) is not None,
                   "every node to name the same leader", timeout=20)
        assert cluster.etcd is not None
        cluster.etcd.kill(0)
        # The leader's lease (3 s) runs out; after that no node can confirm any leader.
        wait_until(lambda: all(leader_seen_by(a) is None for a in nodes),
                   "every node to say no leader is known", timeout=20)
        listed = sbp("streams", "list", "--pd", cluster.pd_address)
        assert listed.returncode == 1
        assert "no PD node served as leader" in listed.stderr
        assert "the leader is" not in listed.stderr, listed.stderr
