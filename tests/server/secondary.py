"""Driving a range server the way the PD and a range's primary would, over a plain connection:
SYNC_RANGES for one open range, and a primary's forwards (test_read_cap.py, test_cap_notice.py);
and a primary's calls to its secondaries that hear from some of them only once the test lets
them (``HeldAnswers``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from sbp_spark.client.connection import Connection
from sbp_spark.protocol.messages import (
    AppendEntry,
    AppendRequest,
    AppendResponse,
    Range,
    RangeReplica,
    StreamRanges,
    SyncRangesRequest,
)
from sbp_spark.protocol.records import batch_bytes
from sbp_spark.server.range_server import RangeServer
from sbp_spark.server.range_server.replication import (
    NOTICE_TIMEOUT_S,
    Forward,
    NoticeAnswer,
    ReplicationProblem,
    Replicator,
)
from sbp_spark.server.storage.range_log import RangeLog


def sync_range(server: RangeServer, stream_id: int, replicas: list[RangeReplica],
               end_offset: int = -1, range_index: int = 0, start_offset: int = 0) -> None:
    """Tell ``server`` that range ``range_index`` of ``stream_id`` (from ``start_offset``) has
    ``replicas`` (and ends at ``end_offset``, -1: open)."""
    request = SyncRangesRequest(stream_ranges=[StreamRanges(stream_id, [
        Range(stream_id, range_index, start_offset, start_offset, end_offset, replicas)])])
    with Connection(server.advertise_addr) as conn:
        response, _ = conn.call(request)
    assert response.sync_responses[0].status.ok


def send_append(server: RangeServer, request: AppendRequest,
                payload: list[bytes] | None = None) -> AppendResponse:
    with Connection(server.advertise_addr) as conn:
        response, _ = conn.call(request, payload or [])
    return response


def forward_of(stream_id: int, first: int, count: int, committed: int, range_index: int = 0
               ) -> tuple[AppendRequest, list[bytes]]:
    """A primary's forward: ``count`` one-record batches at ``first`` with ``committed``, of
    range ``range_index`` (a secondary takes no forward that leaves its range unnamed)."""
    batches = [batch_bytes(b"r%d" % (first + i), base_offset=first + i) for i in range(count)]
    return AppendRequest(timeout_ms=5000, committed_offset=committed, range_index=range_index,
                         append_requests=[AppendEntry(stream_id, i, len(b))
                                          for i, b in enumerate(batches)]), batches


class HeldAnswers(Replicator):
    """A primary's calls to its secondaries (``RangeServer(replicator=...)``) that take in
    nothing from a secondary whose id has an event in ``gates`` until that event is set: to
    the primary, that secondary answers neither forwards nor cap notices until then."""

    def __init__(self, gates: dict[int, threading.Event]) -> None:
        super().__init__()
        self.gates = gates

    def _held_by(self, replicas: Sequence[RangeReplica]) -> None:
        for replica in replicas:
            gate = self.gates.get(replica.server.server_id)
            if gate is not None:
                gate.wait(30)

    def wait(self, rlog: RangeLog, forwards: Sequence[Forward]) -> ReplicationProblem | None:
        self._held_by([fw.replica for fw in forwards])
        return super().wait(rlog, forwards)

    def notify(self, rlog: RangeLog, secondaries: Sequence[RangeReplica], committed: int,
               timeout_s: float = NOTICE_TIMEOUT_S) -> list[NoticeAnswer]:
        self._held_by(secondaries)
        return super().notify(rlog, secondaries, committed, timeout_s)
