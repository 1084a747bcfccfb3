"""What a PD node exports to Prometheus (``--metrics-port``), read when scraped: whether it
leads, how often it took office, range server failovers, streams, ranges and range servers,
and per named consumer its positions and lag. Only the leader knows the cluster's state: a
follower exports its own leadership and counters alone. Every name is documented in
docs/metrics.md."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from sbp_spark.protocol.errors import SbpError

from .consumers import ConsumerMeta
from .meta import RangeMeta, ServerMeta, StreamMeta

log = logging.getLogger(__name__)


class ClusterRecords(Protocol):
    """What the collector reads of the metadata (``meta.MetadataStore``)."""

    def list_streams(self, include_deleted: bool = False) -> list[StreamMeta]: ...

    def list_ranges(self, stream_id: int) -> list[RangeMeta]: ...

    def list_servers(self) -> list[ServerMeta]: ...


class ConsumerLag(Protocol):
    """One consumer's lag on one stream (``client.consumers.StreamLag``)."""

    @property
    def records_behind(self) -> int: ...

    @property
    def time_behind_ms(self) -> int: ...

    @property
    def end_offset(self) -> int: ...

    @property
    def lost(self) -> int: ...


@dataclass
class PdCounters:
    """Events the PD counts for its metrics."""

    took_office: int = 0
    range_server_failovers: int = 0


class NetCounters(Protocol):
    """The frame server's counters (``net.NetStats``)."""

    bytes_in: int
    bytes_out: int
    requests: int


@dataclass
class PdSources:
    """Where the exported figures come from (the PD's parts)."""

    net: NetCounters
    connections: Callable[[], int]
    is_leader: Callable[[], bool]
    counters: PdCounters
    records: ClusterRecords
    is_live: Callable[[int], bool]
    consumers: Callable[[], list[ConsumerMeta]]
    # The lag of a consumer at an offset of a stream: (stream_id, committed, commit time).
    lag: Callable[[int, int, int], ConsumerLag]


class PdCollector:
    """The PD node's metric families (a ``prometheus_client`` collector)."""

    def __init__(self, sources: PdSources) -> None:
        self._s = sources

    def collect(self) -> Iterator[Any]:
        s = self._s
        leading = s.is_leader()
        leader = GaugeMetricFamily("sbp_pd_leader", "1 while this PD node leads, else 0")
        leader.add_metric([], 1 if leading else 0)
        yield leader
        yield CounterMetricFamily("sbp_pd_took_office", "Times this PD node became the leader",
                                  value=s.counters.took_office)
        yield CounterMetricFamily(
            "sbp_pd_range_server_failovers", "Range servers this node failed over while "
            "leading (their open ranges sealed on live replicas)",
            value=s.counters.range_server_failovers)
        yield CounterMetricFamily("sbp_pd_requests", "Requests received", value=s.net.requests)
        yield CounterMetricFamily("sbp_pd_received_bytes", "Bytes received",
                                  value=s.net.bytes_in)
        yield CounterMetricFamily("sbp_pd_sent_bytes", "Bytes sent", value=s.net.bytes_out)
        connections = GaugeMetricFamily("sbp_pd_connections", "Open connections")
        connections.add_metric([], s.connections())
        yield connections
        if not leading:
            return
        try:
            yield from self._cluster()
            yield from self._consumers()
        except SbpError as exc:  # the metadata store out of reach: what is known so far
            log.warning("metrics: reading the PD's metadata failed: %s", exc)

    def _cluster(self) -> Iterator[Any]:
        s = self._s
        streams = s.records.list_streams()
        count = GaugeMetricFamily("sbp_pd_streams", "Live streams")
        count.add_metric([], len(streams))
        yield count
        open_ranges = sealed = 0
        for stream in streams:
            try:
                ranges = s.records.list_ranges(stream.stream_id)
            except SbpError:
                continue  # deleted meanwhile
            open_ranges += sum(1 for r in ranges if r.is_open)
            sealed += sum(1 for r in ranges if not r.is_open)
        ranges_family = GaugeMetricFamily("sbp_pd_ranges", "Ranges of live streams",
                                          labels=["state"])
        ranges_family.add_metric(["open"], open_ranges)
        ranges_family.add_metric(["sealed"], sealed)
        yield ranges_family
        servers = [srv for srv in s.records.list_servers() if srv.registered]
        live = sum(1 for srv in servers if s.is_live(srv.server_id))
        servers_family = GaugeMetricFamily("sbp_pd_range_servers", "Range servers that "
                                           "registered, live or not", labels=["state"])
        servers_family.add_metric(["live"], live)
        servers_family.add_metric(["not_live"], len(servers) - live)
        yield servers_family

    def _consumers(self) -> Iterator[Any]:
        s = self._s
        consumers = s.consumers()
        labels = ["consumer", "stream_id"]
        generation = GaugeMetricFamily("sbp_consumer_generation", "The consumer's current "
                                       "generation", labels=["consumer"])
        committed = GaugeMetricFamily("sbp_consumer_committed_offset", "The consumer's "
                                      "recorded position on the stream", labels=labels)
        end = GaugeMetricFamily("sbp_consumer_stream_end_offset", "The end of a stream the "
                                "consumer recorded a position of", labels=labels)
        records = GaugeMetricFamily("sbp_consumer_lag_records", "Records of the stream "
                                    "after the consumer's position", labels=labels)
        millis = GaugeMetricFamily(
            "sbp_consumer_lag_ms", "The newest record's timestamp minus that of the first "
            "record the consumer has not read (0 when caught up; -1 when not readable)",
            labels=labels)
        lost = GaugeMetricFamily("sbp_consumer_lost_records", "Records below the stream's "
                                 "start that the consumer had not read (trimmed away)",
                                 labels=labels)
        for consumer in consumers:
            generation.add_metric([consumer.name], consumer.generation)
            for sid, position in sorted(consumer.positions.items()):
                lag = s.lag(sid, position.committed_offset, position.commit_time_ms)
                key = [consumer.name, str(sid)]
                committed.add_metric(key, position.committed_offset)
                end.add_metric(key, lag.end_offset)
                records.add_metric(key, lag.records_behind)
                millis.add_metric(key, lag.time_behind_ms)
                lost.add_metric(key, lag.lost)
        yield from (generation, committed, end, records, millis, lost)

