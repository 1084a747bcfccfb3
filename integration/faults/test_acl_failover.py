"""Permissions changed while the PD leader is killed (issue 44 item 6): every change a
superuser saw acknowledged holds after the new leader takes over, on the PD and at the range
servers, and nothing else was granted.

``ProcessCluster(pd_nodes=3)`` with authentication on (a shared secret, superuser ``root``):
one thread grants and revokes ``read`` on a stream for ten principals in turn, through
whichever node leads, while the leader is killed with SIGKILL. A change whose answer was lost
(its outcome unknown) may hold or not; grants and revocations are idempotent, so the client's
retries cannot make them hold twice. Slow: ``pytest integration/faults -m slow -k acl``.
"""

from __future__ import annotations

import threading

import pytest

from sbp_spark.client import ConnectionPool, SbpClient
from sbp_spark.protocol.errors import PermissionDeniedError, SbpError
from sbp_spark.protocol.messages import Permission
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server.auth.authenticator import AuthSettings
from sbp_spark.server.cluster import ProcessCluster
from tests.etcd import require_etcd
from tests.server.auth.keys import Keys

from .helpers import RIDE_OUT, wait_until
from .test_pd_cluster import MetadataProbe, kill_leader, report_takeover

PRINCIPALS = [f"reader-{i}" for i in range(10)]
# How long a revocation may take to reach the range servers after it was acknowledged (a
# heartbeat interval and the fetch of the permissions, with room for a loaded machine).
PROPAGATION_S = 10.0


@pytest.fixture(autouse=True)
def _etcd() -> None:
    require_etcd()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.fault_case(
    "PD leader killed while permissions change",
    "3 PD nodes on a 3-member etcd with token authentication, 1 range server; a superuser "
    "grants and revokes read on a stream for 10 principals in turn; kill -9 the PD leader "
    "during the changes",
    "every acknowledged change holds after the new leader takes over, in the PD's listing and "
    "at the range server (a principal last granted reads, one last revoked is refused); "
    "nothing else is granted")
def test_permissions_change_while_the_pd_leader_is_killed(tmp_path, figures):
    keys = Keys(tmp_path / "keys")
    auth = AuthSettings(token_secret_file=str(keys.secret_file), superusers=frozenset({"root"}))
    with ProcessCluster(tmp_path / "cluster", range_servers=1, pd_nodes=3, etcd_members=3,
                        auth=auth) as cluster, ConnectionPool(RIDE_OUT) as pool:
        root = SbpClient(cluster.pd_address, RIDE_OUT, pool, token=keys.token("root"))
        sid = root.create_streams(1)[0].stream_id
        root.append(sid, [batch_bytes(b"guarded")])
        probe = MetadataProbe(cluster.pd_address, token=keys.token("root"))
        probe.start()
        last: dict[str, bool] = {}  # principal -> its last acknowledged change: granted?
        in_doubt: set[str] = set()
        changes = [0]
        halt = threading.Event()

        def change() -> None:
            i = 0
            while not halt.is_set():
                principal, grant = PRINCIPALS[i % len(PRINCIPALS)], (i // len(PRINCIPALS)) % 2 == 0
                permission = [Permission(principal, "read", str(sid))]
                try:
                    if grant:
                        root.pd.grant_permissions(permission)
                    else:
                        root.pd.revoke_permissions(permission)
                except SbpError:
                    in_doubt.add(principal)
                else:
                    last[principal] = grant
                    in_doubt.discard(principal)
                    changes[0] += 1
                i += 1

        changer = threading.Thread(target=change, daemon=True)
        changer.start()
        try:
            wait_until(lambda: changes[0] >= 20, 60, "the first changes")
            killed_at = kill_leader(cluster, probe, figures, wait=False)
            taken = report_takeover(probe, killed_at, figures)
            before = changes[0]
            wait_until(lambda: changes[0] >= before + 20, 60, "changes through the new leader")
        finally:
            halt.set()
            changer.join(60)
            probe.stop()
        figures["changes"] = (f"{changes[0]} acknowledged, {len(in_doubt)} principals with "
                              f"an unknown last outcome")
        _, listed = root.pd.describe_permissions()
        granted = {p.principal for p in listed if p.operation == "read"}
        for principal, grant in last.items():
            if principal in in_doubt:
                continue
            assert (principal in granted) == grant, (principal, grant)
        assert granted <= set(PRINCIPALS), f"granted to others: {granted - set(PRINCIPALS)}"
        # The range server enforces the same, once the last change reached it.
        for principal, grant in last.items():
            if principal in in_doubt:
                continue
            reader = SbpClient(cluster.pd_address, RIDE_OUT, pool,
                               token=keys.token(principal))
            if grant:
                wait_until(lambda r=reader: _reads(r, sid), PROPAGATION_S,
                           f"{principal} to read")
            else:
                wait_until(lambda r=reader: not _reads(r, sid), PROPAGATION_S,
                           f"{principal} to be refused")
        figures["kill to new leader serving"] = f"{taken:.2f} s"


def _reads(client: SbpClient, stream_id: int) -> bool:
    try:
        return len(list(client.read(stream_id))) == 1
    except PermissionDeniedError:
        return False
