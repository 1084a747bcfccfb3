"""Driving a range server the way the PD and a range's primary would, over a plain connection:
SYNC_RANGES for one open range, and a primary's forwards (test_read_cap.py, test_cap_notice.py).
"""

from __future__ import annotations

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
