"""Where the range after a writer's seal goes when a secondary did not answer the seal.

A secondary the PD still counts live (heard within the liveness timeout) may be stopped all
the same: it did not answer the seal in time. The next range must not land on it, or its
first appends wait on it and the primary gives up on it again; it is kept away as the
secondaries the primary said it could not reach are. Run on the PD's own seal path, with the
fakes of ``test_seal_before_push``.
"""

from __future__ import annotations

import threading
import time

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


def test_a_new_leader_waits_for_a_server_it_has_not_heard_before_reusing_the_sealed_ones(
        tmp_path):
    # A primary cut off from its secondaries, and the PD leader killed as the writers asked for
    # the seal: the new leader had heard those three servers first (a quarter second after
    # taking office) and put the next range back on them, so its primary could not reach the
    # old one either, and the writers waited out a second give-up (the fault suite: 9.6 s).
    servers = FakeRangeServers()
    with PdStore(tmp_path / "pd.sqlite", fsync=False) as store:
        liveness = Liveness(3.0)  # a view that just began: this PD just took office
        ids = [store.allocate_server_id("test") for _ in range(4)]
        primary, second, third, unheard = ids
        for server_id in ids:  # all four heartbeated to the old leader
            store.record_heartbeat(server_id, f"127.0.0.1:{7000 + server_id}")
        for server_id in (primary, second, third):
            liveness.beat(server_id, f"127.0.0.1:{7000 + server_id}")
        ranges = RangeOperations(store, servers,
                                 Succession(store, Placement(liveness, store),
                                            RangePushes(servers, store)),
                                 StreamLocks(), liveness.went_silent)
        stream, first = store.create_stream(3, -1, [primary, second, third])
        RangePushes(servers, store).push([first])
        servers.unreachable = (second, third)
        later = threading.Timer(0.3, liveness.beat, (unheard, f"127.0.0.1:{7000 + unheard}"))
        later.start()
        began = time.monotonic()
        opened = ranges.seal(stream.stream_id, 0, timeout_s=1.0)
        waited = time.monotonic() - began
        later.join()

        assert opened.server_ids[0] == unheard, opened.server_ids
        assert 0.2 <= waited < 2.5
