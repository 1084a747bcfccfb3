"""`sbp ranges seal` on a range whose push has not reached its primary yet.

The PD recorded the new range of a seal, released the stream's lock and only then pushed the
range to its servers (SYNC_RANGES). A second seal right behind the first (`sbp ranges seal` in
a loop, several sealers on a replicas=2 stream of a 3-server cluster) reached the new range's
primary before the push and failed with RANGE_NOT_FOUND: "range S/R is not on server N".

The PD's seal path runs here on its own parts (the metadata in SQLite, placement over
heartbeats, the pushes, the seal-then-open-next), with fakes of the two small interfaces
through which it reaches range servers: sealing a range on its replicas, and pushing ranges to
their servers. The fake servers refuse to seal a range nobody pushed them, as real ones do.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence

from sbp_spark.protocol import messages as m
from sbp_spark.protocol.errors import RangeNotFoundError
from sbp_spark.server.pd.meta import RangeMeta, SealedEnd
from sbp_spark.server.pd.placement import Liveness, Placement
from sbp_spark.server.pd.pushes import RangePushes
from sbp_spark.server.pd.ranges import RangeOperations
from sbp_spark.server.pd.sqlite_store import PdStore
from sbp_spark.server.pd.succession import StreamLocks, Succession
from tests.polling import wait_until


class FakeRangeServers:
    """Range servers as the PD's seal path sees them (``pushes.PushLink`` and
    ``ranges.SealCalls``): the ranges each was pushed, and seals of those alone (a primary
    that was not pushed the range refuses), each ending where the range's records end (here:
    its start, nothing was appended)."""

    def __init__(self) -> None:
        self.held: dict[int, dict[tuple[int, int], RangeMeta]] = {}
        self.lock = threading.Lock()
        self.before_sync: Callable[[int, Sequence[RangeMeta]], None] = lambda sid, ranges: None
        self.before_seal: Callable[[RangeMeta], None] = lambda rng: None
        self.missed: tuple[int, ...] = ()  # secondaries that do not answer a seal
        # secondaries the primary says it could not reach (its answer to the seal)
        self.unreachable: tuple[int, ...] = ()

    def sync(self, server_id: int, ranges: Sequence[RangeMeta],
             timeout_s: float | None = None) -> None:
        self.before_sync(server_id, ranges)
        with self.lock:
            for rng in ranges:
                self.held.setdefault(server_id, {})[(rng.stream_id, rng.range_index)] = rng

    def delete_streams(self, server_id: int, streams: Sequence[m.Stream],
                       timeout_s: float | None = None) -> None:
        raise AssertionError("no stream is deleted here")

    def seal_on_servers(self, rng: RangeMeta, timeout_s: float | None = None,
                        skip: Iterable[int] = ()) -> SealedEnd:
        self.before_seal(rng)
        primary = rng.primary
        assert primary is not None
        if self.holding(primary, rng.stream_id, rng.range_index) is None:
            raise RangeNotFoundError(f"range {rng.stream_id}/{rng.range_index} is not on "
                                     f"server {primary}")
        return SealedEnd(rng.start_offset,
                         unreachable=tuple(s for s in self.unreachable if s in rng.server_ids),
                         missed=tuple(sid for sid in self.missed if sid in rng.server_ids))

    def holding(self, server_id: int, stream_id: int, range_index: int) -> RangeMeta | None:
        with self.lock:
            return self.held.get(server_id, {}).get((stream_id, range_index))


class Outcome(threading.Thread):
    """``fn()`` on a thread of its own; ``result`` or ``error`` once joined."""

    def __init__(self, fn: Callable[[], RangeMeta]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: RangeMeta | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # handed to the test, which fails with it
            self.error = exc


def test_a_seal_right_behind_another_finds_the_range_on_its_servers(tmp_path):
    servers = FakeRangeServers()
    with PdStore(tmp_path / "pd.sqlite", fsync=False) as store:
        liveness = Liveness(30.0)
        for _ in range(3):
            server_id = store.allocate_server_id("test")
            liveness.beat(server_id, f"127.0.0.1:{7000 + server_id}")
        placement = Placement(liveness, store)
        pushes = RangePushes(servers, store)
        ranges = RangeOperations(store, servers, Succession(store, placement, pushes),
                                 StreamLocks(), liveness.went_silent)
        stream, first_range = placement.place(2, lambda chosen: store.create_stream(2, -1,
                                                                                   chosen))
        pushes.push([first_range])
        sid = stream.stream_id

        # The first seal's push of range 1 is held until a second seal reached the PD, and
        # then until that seal reached range 1's servers (or 2 s passed: it waits for the
        # push, as it should).
        second_arrived, sealing_range_1 = threading.Event(), threading.Event()
        held: list[int] = []

        def late_sync(server_id: int, pushed: Sequence[RangeMeta]) -> None:
            if not held and any(r.stream_id == sid and r.range_index == 1 for r in pushed):
                held.append(server_id)
                assert second_arrived.wait(30), "the second seal never reached the PD"
                sealing_range_1.wait(2.0)

        def noted_seal(rng: RangeMeta) -> None:
            if rng.range_index == 1:
                sealing_range_1.set()

        servers.before_sync, servers.before_seal = late_sync, noted_seal
        first = Outcome(lambda: ranges.seal(sid, 0))
        wait_until(lambda: held, "the PD to push range 1")
        try:
            second = Outcome(lambda: ranges.seal(sid, 1))
        finally:
            second_arrived.set()
            first.join(30)
        second.join(30)
        assert first.error is None and second.error is None, (first.error, second.error)
        assert first.result is not None and first.result.range_index == 1
        assert second.result is not None and second.result.range_index == 2

        stored = store.list_ranges(sid)
        assert [(r.range_index, r.end_offset) for r in stored] == [(0, 0), (1, 0), (2, -1)]
        # Every replica of range 1 holds it sealed.
        for server_id in stored[1].server_ids:
            held_range = servers.holding(server_id, sid, 1)
            assert held_range is not None and held_range.end_offset == 0, server_id
        # and the stream goes on: range 2 is on its servers, ready for appends
        assert all(servers.holding(server_id, sid, 2) == stored[2]
                   for server_id in stored[2].server_ids)
