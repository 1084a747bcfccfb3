"""PD metadata store and placement rules, without the wire."""

from __future__ import annotations

import sqlite3
import threading
import time

import pytest

from sbp_spark.protocol.errors import (
    InvalidRequestError,
    NotEnoughServersError,
    OffsetOutOfRangeError,
    RangeNotFoundError,
    RangeSealedError,
    StreamAlreadyExistsError,
    StreamNotFoundError,
)
from sbp_spark.server.etcd_client import EtcdClient
from sbp_spark.server.pd.etcd_store import EtcdStore
from sbp_spark.server.pd.meta import UNKNOWN_SERVER_ID, RangeHolder, ServerMeta
from sbp_spark.server.pd.placement import Liveness, Placement, choose_servers
from sbp_spark.server.pd.sqlite_store import PdStore


@pytest.fixture(params=["sqlite", "etcd"])
def store(request, tmp_path):
    """Each store the PD can run on, through the same tests."""
    if request.param == "sqlite":
        with PdStore(tmp_path / "pd.sqlite", fsync=False) as s:
            yield s
        return
    client = EtcdClient(request.getfixturevalue("etcd_endpoints"))
    yield EtcdStore(client, request.getfixturevalue("etcd_prefix"))
    client.close()


def test_create_stream_opens_range_zero_with_primary_first(store):
    stream, rng = store.create_stream(2, 60_000, [3, 1])
    assert stream.stream_id == 1 and stream.replica_nums == 2
    assert stream.retention_period_ms == 60_000 and stream.start_offset == 0
    assert (rng.range_index, rng.start_offset, rng.end_offset, rng.next_offset) == (0, 0, -1, 0)
    assert rng.holders == (RangeHolder(3, True), RangeHolder(1, False))
    assert rng.primary == 3 and rng.is_open
    assert store.list_ranges(stream.stream_id) == [rng]


def test_stream_ids_are_never_reused(store):
    a, _ = store.create_stream(1, -1, [1])
    store.delete_stream(a.stream_id)
    b, _ = store.create_stream(1, -1, [1])
    assert b.stream_id == a.stream_id + 1


def test_delete_marks_deleted_and_drops_ranges(store):
    s, _ = store.create_stream(1, -1, [1])
    deleted, ranges = store.delete_stream(s.stream_id)
    assert deleted.deleted and [r.range_index for r in ranges] == [0]
    with pytest.raises(StreamNotFoundError, match="deleted"):
        store.get_stream(s.stream_id)
    with pytest.raises(StreamNotFoundError):
        store.delete_stream(s.stream_id)
    assert store.ranges_on_server(1) == []
    assert store.list_streams() == [] and len(store.list_streams(include_deleted=True)) == 1


def test_unknown_stream(store):
    with pytest.raises(StreamNotFoundError, match="stream 42 does not exist"):
        store.get_stream(42)
    with pytest.raises(StreamNotFoundError):
        store.list_ranges(42)


def test_update_stream(store):
    s, _ = store.create_stream(1, -1, [1])
    updated = store.update_stream(s.stream_id, 3, 1000)
    assert (updated.replica_nums, updated.retention_period_ms) == (3, 1000)
    assert store.get_stream(s.stream_id) == updated


def test_seal_and_open_next(store):
    s, r0 = store.create_stream(1, -1, [1])
    sealed, r1 = store.seal_range(s.stream_id, 0, 10, next_servers=[2])
    assert (sealed.end_offset, sealed.next_offset) == (10, 10) and not sealed.is_open
    assert r1 is not None
    assert (r1.range_index, r1.start_offset, r1.end_offset, r1.primary) == (1, 10, -1, 2)
    assert [r.range_index for r in store.list_ranges(s.stream_id)] == [0, 1]
    # A retried seal at the same offset is fine, another offset is not.
    again, _ = store.seal_range(s.stream_id, 0, 10)
    assert again == sealed
    with pytest.raises(RangeSealedError, match="already sealed at 10"):
        store.seal_range(s.stream_id, 0, 11)
    with pytest.raises(RangeNotFoundError):
        store.seal_range(s.stream_id, 7, 11)
    with pytest.raises(InvalidRequestError, match="below the start"):
        store.seal_range(s.stream_id, 1, 5)


def test_open_next_requires_sealed_last(store):
    s, _ = store.create_stream(1, -1, [1])
    with pytest.raises(InvalidRequestError, match="still open"):
        store.open_next_range(s.stream_id, [1])
    store.seal_range(s.stream_id, 0, 4)
    r1 = store.open_next_range(s.stream_id, [1])
    assert (r1.range_index, r1.start_offset) == (1, 4)


def test_seal_is_atomic_when_next_range_is_invalid(store):
    s, _ = store.create_stream(1, -1, [1])
    with pytest.raises(InvalidRequestError):
        store.seal_range(s.stream_id, 0, 4, next_servers=[1, 1])
    assert store.get_range(s.stream_id, 0).is_open


def test_trim_drops_and_shrinks(store):
    s, _ = store.create_stream(1, -1, [1])
    store.seal_range(s.stream_id, 0, 10, next_servers=[1])
    store.seal_range(s.stream_id, 1, 20, next_servers=[1])
    stream, first = store.trim_stream(s.stream_id, 15, end_offset=25)
    assert stream.start_offset == 15
    assert (first.range_index, first.start_offset, first.end_offset) == (1, 15, 20)
    assert [r.range_index for r in store.list_ranges(s.stream_id)] == [1, 2]
    # Lower trim points are a no-op; beyond the end is refused.
    stream, first = store.trim_stream(s.stream_id, 3, end_offset=25)
    assert stream.start_offset == 15 and first.range_index == 1
    with pytest.raises(OffsetOutOfRangeError, match="ends at 25"):
        store.trim_stream(s.stream_id, 26, end_offset=25)
    # Trimming into the open range moves its start.
    stream, first = store.trim_stream(s.stream_id, 22, end_offset=25)
    assert (first.range_index, first.start_offset, first.end_offset) == (2, 22, -1)
    assert first.next_offset == 22
    # Range servers still know the range by where it began.
    assert first.base_start_offset == 20
    assert store.get_range(s.stream_id, 2).base_start_offset == 20


def test_trim_keeps_last_sealed_range(store):
    s, _ = store.create_stream(1, -1, [1])
    store.seal_range(s.stream_id, 0, 10)
    _, first = store.trim_stream(s.stream_id, 10)
    assert (first.range_index, first.start_offset, first.end_offset) == (0, 10, 10)
    assert store.open_next_range(s.stream_id, [1]).start_offset == 10


def test_trim_rejects_negative(store):
    s, _ = store.create_stream(1, -1, [1])
    with pytest.raises(InvalidRequestError):
        store.trim_stream(s.stream_id, -1)


def test_open_range_counts_and_ranges_on_server(store):
    a, _ = store.create_stream(2, -1, [1, 2])
    b, _ = store.create_stream(1, -1, [2])
    store.seal_range(b.stream_id, 0, 0, next_servers=[3])
    assert store.open_range_counts() == {1: 1, 2: 1, 3: 1}
    on2 = store.ranges_on_server(2)
    assert [(r.stream_id, r.range_index) for r in on2] == [(a.stream_id, 0), (b.stream_id, 0)]
    store.delete_stream(a.stream_id)
    assert store.open_range_counts() == {3: 1}


def test_update_next_offset_never_goes_back(store):
    s, _ = store.create_stream(1, -1, [1])
    store.update_next_offset(s.stream_id, 0, 9)
    store.update_next_offset(s.stream_id, 0, 4)
    assert store.get_range(s.stream_id, 0).next_offset == 9


def test_server_ids_heartbeats_and_metrics(store):
    assert store.allocate_server_id("h1") == 1
    assert store.allocate_server_id("h2") == 2
    meta = store.record_heartbeat(1, "127.0.0.1:5000", now_ms=123)
    assert (meta.advertise_addr, meta.last_heartbeat_ms, meta.registered) == (
        "127.0.0.1:5000", 123, True)
    store.record_heartbeat(1, "127.0.0.1:6000")
    assert store.get_server(1).advertise_addr == "127.0.0.1:6000"
    assert not store.get_server(2).registered
    # An id this PD never allocated is refused, naming the id, and not recorded.
    with pytest.raises(InvalidRequestError, match="id 10 .* never issued") as refused:
        store.record_heartbeat(10, "127.0.0.1:7000")
    assert refused.value.detail == UNKNOWN_SERVER_ID
    assert store.get_server(10) is None
    assert store.allocate_server_id() == 3
    store.record_metrics(1, {"disk_free_space": 5})
    assert store.get_server(1).metrics == {"disk_free_space": 5}
    with pytest.raises(InvalidRequestError, match="not registered"):
        store.record_metrics(99, {})
    with pytest.raises(InvalidRequestError):
        store.record_heartbeat(-1, "x:1")
    assert [m.server_id for m in store.list_servers()] == [1, 2, 3]


def test_state_survives_reopen(tmp_path):
    path = tmp_path / "pd.sqlite"
    with PdStore(path) as s:
        stream, _ = s.create_stream(1, 500, [1])
        s.seal_range(stream.stream_id, 0, 7, next_servers=[1])
        sid = s.allocate_server_id()
    with PdStore(path) as s:
        assert s.get_stream(stream.stream_id).retention_period_ms == 500
        assert [(r.start_offset, r.end_offset) for r in s.list_ranges(stream.stream_id)] == [
            (0, 7), (7, -1)]
        assert s.allocate_server_id() == sid + 1


def test_refuses_unknown_schema_version(tmp_path):
    path = tmp_path / "pd.sqlite"
    PdStore(path).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value='99' WHERE key='schema_version'")
    db.commit()
    db.close()
    with pytest.raises(ValueError, match="schema version 99"):
        PdStore(path)


def test_concurrent_creates_get_distinct_ids(store):
    ids: list[int] = []
    lock = threading.Lock()

    def work():
        for _ in range(20):
            s, _ = store.create_stream(1, -1, [1])
            with lock:
                ids.append(s.stream_id)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(ids) == list(range(1, 81))


# -- placement --------------------------------------------------------------------------------

def test_choose_servers_least_loaded_first():
    assert choose_servers([1, 2, 3], {1: 5, 2: 0, 3: 1}, 2) == [2, 3]
    assert choose_servers([3, 1, 2], {}, 3) == [1, 2, 3]
    with pytest.raises(NotEnoughServersError, match="3 replicas requested but only 2 range"):
        choose_servers([1, 2], {}, 3)
    with pytest.raises(NotEnoughServersError, match="only 0 range servers are live"):
        choose_servers([], {}, 1)
    with pytest.raises(InvalidRequestError):
        choose_servers([1], {}, 0)


def test_the_range_after_a_seal_moves_away_from_the_sealed_ranges_primary():
    # Spare servers: the old primary (least loaded, lowest id) is left out altogether.
    assert choose_servers([1, 2, 3, 4], {}, 3, succeeding=[1]) == [2, 3, 4]
    assert choose_servers([1, 2, 3], {}, 1, succeeding=[1]) == [2]
    # Every live server is needed: the old primary only as a secondary.
    assert choose_servers([1, 2, 3], {}, 3, succeeding=[1]) == [2, 3, 1]
    assert choose_servers([1, 2, 3], {2: 4}, 3, succeeding=[3]) == [1, 2, 3]
    # Alone, it stays; dead (not live), it changes nothing.
    assert choose_servers([1], {}, 1, succeeding=[1]) == [1]
    assert choose_servers([2, 3], {}, 2, succeeding=[1]) == [2, 3]
    with pytest.raises(NotEnoughServersError):
        choose_servers([1, 2], {}, 3, succeeding=[1])


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_liveness_timeout_and_expiry():
    clock = FakeClock()
    live = Liveness(3.0, clock=clock)
    assert live.beat(1, "a:1") is True
    assert live.beat(1, "a:2") is False
    live.beat(2, "b:1")
    assert [s.server_id for s in live.live()] == [1, 2]
    assert live.address(1) == "a:2"
    clock.now += 2
    live.beat(2, "b:1")
    clock.now += 2
    assert live.is_live(2) and not live.is_live(1)
    assert live.expire() == []  # nobody was heard since 1 went silent for the timeout
    live.beat(2, "b:1")
    assert [s.server_id for s in live.expire()] == [1]
    assert live.expire() == []  # reported once
    assert live.beat(1, "a:3") is True  # back again
    live.forget(2)
    assert [s.server_id for s in live.live()] == [1]
    with pytest.raises(ValueError):
        Liveness(0)


def test_liveness_says_a_server_went_silent_only_on_evidence():
    clock = FakeClock()
    live = Liveness(3.0, clock=clock)
    assert not live.went_silent(1)  # never heard in this view: unknown, not silent
    live.beat(1, "a:1")
    live.beat(2, "b:1")
    clock.now += 2.5
    live.beat(2, "b:1")
    assert not live.went_silent(1)  # quiet for less than the timeout
    clock.now += 1.0
    live.beat(2, "b:1")
    assert live.went_silent(1) and not live.went_silent(2)
    clock.now += 3.5  # nobody heard for the timeout: the PD may be the one cut off
    assert not live.went_silent(1)
    live.beat(1, "a:1")
    assert not live.went_silent(1)
    live.clear()  # a PD taking office knows nobody yet
    assert not live.went_silent(1) and not live.went_silent(2)


def test_liveness_says_how_long_ago_it_heard_each_server():
    clock = FakeClock()
    live = Liveness(3.0, clock=clock)
    assert live.silent_for(1) is None  # never heard in this view
    live.beat(1, "a:1")
    clock.now += 1.5
    assert live.silent_for(1) == 1.5
    clock.now += 2.0  # past the timeout: no longer live, still known
    assert live.silent_for(1) == 3.5 and not live.is_live(1)
    live.beat(1, "a:1")
    assert live.silent_for(1) == 0.0
    live.clear()  # a PD taking office has heard nobody yet
    assert live.silent_for(1) is None


def test_liveness_blames_nobody_while_it_hears_nobody():
    # The PD cut off from every server: silence everywhere is no evidence against any of them.
    clock = FakeClock()
    live = Liveness(3.0, clock=clock)
    for sid in (1, 2, 3):
        live.beat(sid, f"s:{sid}")
    clock.now += 30
    assert live.live() == [] and live.expire() == []
    # The network heals: each server gets one timeout from the first heartbeat to be heard.
    live.beat(1, "s:1")
    clock.now += 2
    live.beat(2, "s:2")
    clock.now += 0.9
    live.beat(1, "s:1")
    assert live.expire() == []  # 3 is silent, but only 2.9 s since the PD hears again
    live.beat(3, "s:3")
    for _ in range(2):
        clock.now += 1.75
        live.beat(1, "s:1")
    # 2 and 3 fell silent again while 1 was heard: now that is evidence.
    assert [s.server_id for s in live.expire()] == [2, 3]


def test_liveness_counts_contact_from_the_first_heartbeat():
    # A PD taking office hears nobody at first; the grace for servers that have not found it
    # yet runs from the first heartbeat, and a silence longer than the timeout restarts it.
    clock = FakeClock()
    live = Liveness(3.0, clock=clock)
    clock.now += 10
    assert live.in_contact_for() == 0.0
    live.beat(1, "s:1")
    clock.now += 2
    live.beat(1, "s:1")
    assert live.in_contact_for() == pytest.approx(2.0)
    clock.now += 3.5
    assert live.in_contact_for() == 0.0  # nobody heard for longer than the timeout
    live.beat(1, "s:1")
    clock.now += 1
    assert live.in_contact_for() == pytest.approx(1.0)
    live.clear()
    assert live.in_contact_for() == 0.0


def test_a_young_view_waits_for_known_servers_it_has_not_heard():
    # A PD that just started or took office has heard from nobody yet: a placement waits for
    # the servers it issued ids to, for the rest of one timeout, not for anyone else.
    clock = FakeClock()
    live = Liveness(3.0, clock=clock)
    beats = threading.Timer(0.05, lambda: (live.beat(1, "s:1"), live.beat(2, "s:2")))
    beats.start()
    start = time.monotonic()
    assert live.wait_for_live(2, known=[1, 2, 3]) is True
    assert time.monotonic() - start < 2.0
    beats.join()
    # Two known servers cannot make three: no wait.
    start = time.monotonic()
    assert live.wait_for_live(3, known=[1, 2]) is False
    # Heard and then gone in this view (said goodbye, or silent): not waited for either.
    live.forget(2)
    assert live.wait_for_live(2, known=[1, 2]) is False
    clock.now += 3.5
    live.beat(1, "s:1")
    assert live.wait_for_live(2, known=[1, 2]) is False
    assert time.monotonic() - start < 0.5
    # An old view waits for nobody; clearing it (taking office) starts a new one that does.
    clock.now += 10
    live.clear()
    later = threading.Timer(0.05, live.beat, (2, "s:2"))
    later.start()
    assert live.wait_for_live(1, known=[2]) is True
    later.join()


def test_a_young_view_waits_no_longer_than_the_timeout():
    live = Liveness(0.3)
    start = time.monotonic()
    assert live.wait_for_live(1, known=[7]) is False  # 7 never heartbeats
    assert 0.2 <= time.monotonic() - start < 2.0
    start = time.monotonic()
    assert live.wait_for_live(1, known=[7]) is False  # the view is old now: no wait
    assert time.monotonic() - start < 0.1


class CountingLoad:
    """The metadata placement reads, counting how often it asks for the registered servers."""

    def __init__(self, registered: list[int]) -> None:
        self.registered = registered
        self.server_reads = 0

    def open_range_counts(self) -> dict[int, int]:
        return {}

    def list_servers(self) -> list[ServerMeta]:
        self.server_reads += 1
        return [ServerMeta(sid, "test", f"s:{sid}", 0) for sid in self.registered]


def test_a_placement_on_an_old_view_reads_no_registered_servers():
    # Only a young view waits for servers it has not heard: once the view is a timeout old, a
    # placement short of other servers places at once, without a metadata read (an etcd
    # round trip) on every seal whose sealed primaries it should avoid.
    clock = FakeClock()
    live = Liveness(3.0, clock=clock)
    load = CountingLoad([1, 2, 3])
    for sid in (1, 2, 3):
        live.beat(sid, f"s:{sid}")
    placement = Placement(live, load)
    assert live.young()
    placement.place_if_possible(3, lambda servers: servers, wait=True, succeeding=[1])
    assert load.server_reads == 1  # young: it looked for registered servers not heard yet
    clock.now += 3.5
    for sid in (1, 2, 3):
        live.beat(sid, f"s:{sid}")
    assert not live.young()
    start = time.monotonic()
    servers, refusal = placement.place_if_possible(3, lambda servers: servers, wait=True,
                                                   succeeding=[1])
    assert time.monotonic() - start < 0.5
    assert refusal is None and servers == [2, 3, 1]
    assert load.server_reads == 1  # old: no read
    live.clear()  # taking office again starts a young view, which looks again
    assert live.young()


def test_create_with_explicit_id(store):
    s, _ = store.create_stream(1, -1, [1], stream_id=40)
    assert s.stream_id == 40
    assert store.create_stream(1, -1, [1])[0].stream_id == 41
    with pytest.raises(StreamAlreadyExistsError, match="stream 40 exists"):
        store.create_stream(1, -1, [1], stream_id=40)
    # The PD asks first, before it waits for servers to place the stream on.
    with pytest.raises(StreamAlreadyExistsError, match="stream 40 exists"):
        store.check_stream_id_free(40)
    store.check_stream_id_free(42)
    store.delete_stream(40)
    with pytest.raises(StreamAlreadyExistsError, match="never reused"):
        store.create_stream(1, -1, [1], stream_id=40)
    with pytest.raises(StreamAlreadyExistsError, match="never reused"):
        store.check_stream_id_free(40)
    with pytest.raises(InvalidRequestError):
        store.create_stream(1, -1, [1], stream_id=-5)
    with pytest.raises(InvalidRequestError):
        store.check_stream_id_free(-5)


def test_the_range_after_two_seals_moves_away_from_both_primaries():
    # Range 0 on 1 sealed (a writer could not reach 1), range 1 on 2 sealed too: range 2 goes
    # to 3, not back to 1, even where every server is needed.
    assert choose_servers([1, 2, 3], {}, 3, succeeding=[2, 1]) == [3, 1, 2]
    assert choose_servers([1, 2, 3, 4], {}, 2, succeeding=[2, 1]) == [3, 4]
    # Every live server sealed lately: the one sealed longest ago is the primary.
    assert choose_servers([1, 2], {}, 2, succeeding=[2, 1]) == [1, 2]
    assert choose_servers([1, 2], {}, 1, succeeding=[1, 2]) == [2]


def test_recent_primaries_are_kept_for_the_windows_newest_first():
    from sbp_spark.server.pd.succession import RecentPrimaries

    clock = FakeClock()
    recent = RecentPrimaries(stream_s=60, any_stream_s=15, clock=lambda: clock.now)
    recent.add(7, 1)
    clock.now += 10
    recent.add(7, 2)
    recent.add(8, 3)
    # Its own seals, and another stream's seal of the last 15 s.
    assert recent.of(7) == [3, 2, 1]
    assert recent.of(8) == [3, 2, 1]
    assert recent.of(9) == [3, 2, 1]
    clock.now += 6  # stream 7's seal of server 1 is 16 s old: for others it has passed
    assert recent.of(7) == [3, 2, 1] and recent.of(8) == [3, 2]
    recent.add(7, 1)  # sealed again: newest, once
    assert recent.of(7) == [1, 3, 2]
    clock.now += 20
    assert recent.of(7) == [1, 2] and recent.of(8) == [3] and recent.of(9) == []
    clock.now += 45
    assert recent.of(7) == [] and recent.of(8) == []


def test_recent_primaries_count_the_secondaries_a_primary_could_not_reach():
    from sbp_spark.server.pd.succession import RecentPrimaries

    clock = FakeClock()
    recent = RecentPrimaries(stream_s=60, any_stream_s=15, clock=lambda: clock.now)
    recent.add(7, 1, unreachable=[4, 1])  # the primary itself named too: counted once
    assert sorted(recent.of(7)) == [1, 4] and sorted(recent.of(8)) == [1, 4]
    assert choose_servers([1, 2, 3, 4, 5], {}, 3, succeeding=recent.of(7)) == [2, 3, 5]
    clock.now += 16
    assert sorted(recent.of(7)) == [1, 4] and recent.of(8) == []
