"""Permissions kept by the PD (issue 44 item 2): grants and revocations in SQLite and etcd alike,
the PD's authorizer refusing what a principal lacks with a status that says what is missing,
and streams named by name in grants."""

from __future__ import annotations

import pytest

from sbp_spark.client import ConnectionPool, SbpClient
from sbp_spark.protocol.errors import InvalidRequestError, PermissionDeniedError
from sbp_spark.protocol.messages import Permission, Stream
from sbp_spark.server.auth.acl import AclEntry, AclTable
from sbp_spark.server.cluster import EmbeddedCluster
from sbp_spark.server.etcd_client import EtcdClient
from sbp_spark.server.pd.etcd_store import EtcdStore
from sbp_spark.server.pd.sqlite_store import PdStore


@pytest.fixture(params=["sqlite", "etcd"])
def store(request, tmp_path):
    if request.param == "sqlite":
        with PdStore(tmp_path / "pd.sqlite", fsync=False) as s:
            yield s
        return
    client = EtcdClient(request.getfixturevalue("etcd_endpoints"))
    yield EtcdStore(client, request.getfixturevalue("etcd_prefix"))
    client.close()


def test_both_stores_keep_grants_and_revocations_with_a_version(store):
    assert store.acl() == (0, [])
    a, b = AclEntry("alice", "read", "7"), AclEntry("bob", "create")
    assert store.change_acl(True, [a, b]) == 1
    assert store.change_acl(True, [a]) == 2  # granted already: nothing new, a new version
    assert store.acl() == (2, [a, b])
    assert store.change_acl(False, [a, AclEntry("carol", "write", "*")]) == 3
    assert store.acl() == (3, [b])


def test_a_table_matches_ids_names_and_every_stream():
    table = AclTable.of(1, [AclEntry("r", "read", "7"), AclEntry("r", "write", "*"),
                            AclEntry("r", "admin", "orders"), AclEntry("c", "create")],
                        resolved={"orders": 9})
    assert table.allows("r", "read", 7) and not table.allows("r", "read", 8)
    assert table.allows("r", "write", 12345)
    assert table.allows("r", "admin", 9)  # the id the name had when the table was made
    assert table.allows("r", "admin", 11, "orders")  # the name the caller knows
    assert not table.allows("r", "admin", 7)
    assert table.allows("c", "create") and not table.allows("r", "create")


@pytest.mark.parametrize("entry,problem", [
    (AclEntry("a", "delete", "1"), "not known"),
    (AclEntry("a", "read", ""), "needs streams"),
    (AclEntry("a", "create", "1"), "cluster-wide"),
    (AclEntry("", "read", "1"), "not a name"),
    (AclEntry("a", "read", "bad name!"), "stream 'bad name!'"),
])
def test_invalid_entries_say_why(entry, problem):
    assert problem in entry.problem()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, keys):
    auth = keys.settings()
    with EmbeddedCluster(tmp_path_factory.mktemp("perm-cluster"), range_servers=1,
                         auth=auth) as c:
        yield c


def test_creating_streams_needs_create(as_):
    with pytest.raises(PermissionDeniedError) as refused:
        as_("nobody").create_streams(1)
    assert "principal 'nobody' may not CREATE_STREAMS" in str(refused.value)
    assert "'create' permission" in str(refused.value)
    as_("root").pd.grant_permissions([Permission("maker", "create")])
    [stream] = as_("maker").create_streams(1)
    assert stream.stream_id >= 0


def test_only_superusers_change_permissions(as_):
    with pytest.raises(PermissionDeniedError, match="only superusers may"):
        as_("alice").pd.grant_permissions([Permission("alice", "admin", "*")])
    with pytest.raises(InvalidRequestError, match="operation 'own' is not known"):
        as_("root").pd.grant_permissions([Permission("alice", "own", "*")])
    # A principal may see its own permissions, not another's.
    as_("root").pd.grant_permissions([Permission("alice", "read", "12345")])
    _, mine = as_("alice").pd.describe_permissions("alice")
    assert [(p.operation, p.stream) for p in mine] == [("read", "12345")]
    with pytest.raises(PermissionDeniedError, match="only its own"):
        as_("alice").pd.describe_permissions("")


def test_stream_admin_and_listing_follow_the_grants(as_):
    root = as_("root")
    [mine, other] = root.create_streams(2)
    root.pd.grant_permissions([Permission("ops", "admin", str(mine.stream_id))])
    ops = as_("ops")
    ops.update_stream(mine.stream_id, retention_ms=60_000)
    with pytest.raises(PermissionDeniedError) as refused:
        ops.pd.update_streams([Stream(other.stream_id, 1, 60_000)])
    message = str(refused.value)
    assert f"principal 'ops' may not UPDATE_STREAMS on stream {other.stream_id}" in message
    assert "'admin' permission" in message
    listed = {s.stream_id for s in ops.list_streams()}
    assert mine.stream_id in listed and other.stream_id not in listed
    assert ops.describe_stream(mine.stream_id).retention_period_ms == 60_000
    with pytest.raises(PermissionDeniedError):
        ops.describe_stream(other.stream_id)
    ops.delete_streams([mine.stream_id])


def test_grants_may_name_streams_by_name(as_):
    root = as_("root")
    root.pd.grant_permissions([Permission("namer", "read", "audit-log")])
    stream = root.create_stream("audit-log")
    namer = as_("namer")
    assert namer.describe_stream("audit-log").stream_id == stream.stream_id
    assert namer.stream_id("audit-log") == stream.stream_id
    assert {s.name for s in namer.list_streams()} == {"audit-log"}
    _, permissions = root.pd.describe_permissions("namer")
    assert [(p.stream, p.stream_id) for p in permissions] == [("audit-log", stream.stream_id)]


def test_permissions_outlive_a_pd_restart(tmp_path, keys):
    auth = keys.settings()
    with EmbeddedCluster(tmp_path, range_servers=1, auth=auth) as cluster:
        with ConnectionPool() as pool:
            SbpClient(cluster.pd_address, pool=pool, token=keys.token("root")
                      ).pd.grant_permissions([Permission("maker", "create")])
        cluster.restart()
        with ConnectionPool() as pool:
            SbpClient(cluster.pd_address, pool=pool, token=keys.token("maker")).create_streams(1)


def test_every_opcode_has_a_rule_and_one_without_is_refused():
    from sbp_spark.protocol.constants import Opcode
    from sbp_spark.server.auth.authorizer import Authorizer
    from sbp_spark.server.auth.principals import Principal
    from sbp_spark.server.auth.rules import PD, RULES

    assert set(RULES) == set(Opcode)  # a new opcode needs its rule (fail closed otherwise)
    rules = {op: rule for op, rule in RULES.items() if op != Opcode.DESCRIBE_PD_CLUSTER}
    authorizer = Authorizer(PD, AclTable, rules=rules)
    with pytest.raises(PermissionDeniedError, match="no permission rule for it"):
        authorizer.authorize(Principal("anyone"), Opcode.DESCRIBE_PD_CLUSTER, None)
    authorizer.authorize(Principal("anyone"), Opcode.HEARTBEAT, _client_heartbeat())


def _client_heartbeat():
    from sbp_spark.protocol.messages import ClientRole, HeartbeatRequest

    return HeartbeatRequest(client_id="c", client_role=ClientRole.CLIENT)
