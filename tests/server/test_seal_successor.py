"""Where the range after a writer's seal goes when a secondary did not answer the seal.

A secondary the PD still counts live (heard within the liveness timeout) may be stopped all
the same: it did not answer the seal in time. The next range must not land on it, or its
first appends wait on it and the primary gives up on it again; it is kept away as the
secondaries the primary said it could not reach are. Run on the PD's own seal path, with the
fakes of ``test_seal_before_push``.
"""

from __future__ import annotations

from sbp_spark.server.pd.placement import Liveness, Placement
from sbp_spark.server.pd.pushes import RangePushes
from sbp_spark.server.pd.ranges import RangeOperations
from sbp_spark.server.pd.sqlite_store import PdStore
from sbp_spark.server.pd.succession import StreamLocks, Succession

from .test_seal_before_push import FakeRangeServers


def test_a_secondary_that_did_not_seal_is_kept_away_from_the_next_range(tmp_path):
    servers = FakeRangeServers()
    with PdStore(tmp_path / "pd.sqlite", fsync=False) as store:
        liveness = Liveness(30.0)
        ids = [store.allocate_server_id("test") for _ in range(4)]
        for server_id in ids:
            liveness.beat(server_id, f"127.0.0.1:{7000 + server_id}")
        primary, stopped, busy_a, busy_b = ids
        pushes = RangePushes(servers, store)
        ranges = RangeOperations(store, servers,
                                 Succession(store, Placement(liveness, store), pushes),
                                 StreamLocks(), liveness.went_silent)
        stream, first = store.create_stream(2, -1, [primary, stopped])
        # The two other servers carry more ranges: by load alone, the next range would pair
        # the stopped secondary with one of them.
        for _ in range(2):
            store.create_stream(2, -1, [busy_a, busy_b])
        pushes.push([first])
        servers.missed = (stopped,)

        opened = ranges.seal(stream.stream_id, 0, timeout_s=1.0)

        assert sorted(opened.server_ids) == [busy_a, busy_b]
        # Not pushed the end it did not answer for: owed a resync on its next heartbeat.
        assert pushes.resync_owed(stopped)
        held = servers.holding(stopped, stream.stream_id, 0)
        assert held is not None and held.is_open
