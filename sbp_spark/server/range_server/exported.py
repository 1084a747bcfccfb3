"""What a range server exports to Prometheus (``--metrics-port``): read from its counters when
scraped. Every name is documented in docs/metrics.md."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..latency import LatencyHistogram
from ..metrics_http import histogram_family
from .metrics import Metrics


class LocalRange(Protocol):
    """A range this server holds (``storage.RangeLog``), as the metrics see it."""

    stream_id: int

    @property
    def next_offset(self) -> int: ...


class NetCounters(Protocol):
    """The frame server's counters (``net.NetStats``)."""

    bytes_in: int
    bytes_out: int
    requests: int


@dataclass
class RangeServerSources:
    """Where the exported figures come from (the range server's parts)."""

    metrics: Metrics
    fsync_seconds: LatencyHistogram
    net: NetCounters
    connections: Callable[[], int]
    ranges: Callable[[], Sequence[LocalRange]]
    server_id: Callable[[], int]


class RangeServerCollector:
    """The range server's metric families (a ``prometheus_client`` collector)."""

    def __init__(self, sources: RangeServerSources) -> None:
        self._s = sources

    def collect(self) -> Iterator[Any]:
        s = self._s
        m = s.metrics
        yield histogram_family("sbp_range_server_append_seconds",
                               "Time from an APPEND's arrival to its answer", m.append_seconds)
        yield histogram_family("sbp_range_server_fsync_seconds",
                               "Time one range's fsync took", s.fsync_seconds)
        yield _counter("sbp_range_server_appends", "Record batches received in APPENDs",
                       m.appends)
        yield _counter("sbp_range_server_failed_appends", "Record batches refused or failed",
                       m.failed_appends)
        yield _counter("sbp_range_server_fetches", "FETCH requests served", m.fetches)
        yield _counter("sbp_range_server_received_bytes", "Bytes received on client and "
                       "peer connections", s.net.bytes_in)
        yield _counter("sbp_range_server_sent_bytes", "Bytes sent on client and peer "
                       "connections", s.net.bytes_out)
        yield _counter("sbp_range_server_requests", "Requests received", s.net.requests)
        connections = GaugeMetricFamily("sbp_range_server_connections", "Open connections")
        connections.add_metric([], s.connections())
        yield connections
        server = GaugeMetricFamily("sbp_range_server_id", "This range server's id (-1 before "
                                   "the PD issued one)")
        server.add_metric([], s.server_id())
        yield server
        ends: dict[int, int] = {}
        for rng in s.ranges():
            ends[rng.stream_id] = max(ends.get(rng.stream_id, 0), rng.next_offset)
        end = GaugeMetricFamily("sbp_stream_end_offset", "The offset after the last record "
                                "of the stream this server holds", labels=["stream_id"])
        for sid, offset in sorted(ends.items()):
            end.add_metric([str(sid)], offset)
        yield end
        for name, doc, values in (
                ("sbp_stream_appended_records", "Records of the stream's client batches "
                 "stored here (its append rate: rate() of this)", m.appended_records),
                ("sbp_stream_appended_bytes", "Bytes of the stream's client batches stored "
                 "here", m.appended_bytes)):
            family = CounterMetricFamily(name, doc, labels=["stream_id"])
            for sid, value in sorted(dict(values).items()):
                family.add_metric([str(sid)], value)
            yield family


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)
