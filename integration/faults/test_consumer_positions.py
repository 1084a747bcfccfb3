"""Named consumers through a PD leader change: two streaming queries record their positions
(option ``consumer``) while a writer appends, and the PD leader is killed (kill -9) while they
commit. The cluster's record of each consumer must be neither lost nor moved back: a watcher
reads the records every 50 ms through whichever node leads and every reading is at or after the
one before; after the queries catch up, each record equals its query's checkpoint, under the
generation the query joined with (no query was fenced by the failover)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient
from sbp_spark.protocol.errors import SbpError
from sbp_spark.server.cluster import ProcessCluster
from sbp_spark.spark.streaming.offsets import from_spark
from tests.etcd import require_etcd

from .helpers import RIDE_OUT, Writer, wait_until
from .test_pd_cluster import MetadataProbe, kill_leader

# What the watcher's reads may take: a dead node is skipped within half a second.
WATCH = ClientConfig(connect_timeout_s=0.5, request_timeout_s=2.0, retries=3,
                     retry_backoff_ms=10, retry_backoff_max_ms=50, retry_deadline_s=1.0)
CONSUMERS = ("positions-a", "positions-b")


@pytest.fixture(autouse=True)
def _etcd() -> None:
    require_etcd()


class RecordWatcher(threading.Thread):
    """Reads every consumer's record every 50 ms; keeps each reading per (consumer, stream)
    and counts the reads that found no leader."""

    def __init__(self, pd: str) -> None:
        super().__init__(name="consumer-watcher", daemon=True)
        self.pool = ConnectionPool(WATCH)
        self.client = SbpClient(pd, WATCH, self.pool)
        self.readings: dict[tuple[str, int], list[int]] = {}
        self.generations: dict[str, set[int]] = {}
        self.unanswered = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.05):
            try:
                found = self.client.consumers.list_all()
            except SbpError:
                self.unanswered += 1
                continue
            for consumer in found:
                self.generations.setdefault(consumer.name, set()).add(consumer.generation)
                for p in consumer.positions:
                    self.readings.setdefault((consumer.name, p.stream_id), []).append(
                        p.committed_offset)

    def stop(self) -> None:
        self.halt.set()
        self.join(10)
        self.pool.close()


def checkpoint_committed(checkpoint: Path) -> dict[int, int]:
    """The end offsets of the last micro-batch the checkpoint holds as committed."""
    last = max(int(p.name) for p in (checkpoint / "commits").iterdir() if p.name.isdigit())
    lines = (checkpoint / "offsets" / str(last)).read_text().splitlines()
    return from_spark(json.loads(lines[2]))


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.fault_case(
    "PD leader killed while streaming queries commit consumer positions",
    "3 PD nodes on a 3-member etcd, 2 range servers; a writer appends to a stream that two "
    "readStream.format('sbp') queries read, each under option consumer; kill -9 the PD "
    "leader while they run",
    "every reading of each consumer's record (every 50 ms, through whichever node leads) is "
    "at or after the one before; once the queries caught up, each record equals its "
    "query's checkpoint and its generation is still the one the query joined with; both "
    "queries keep running")
def test_pd_leader_killed_while_queries_commit(tmp_path, spark, figures):
    with ProcessCluster(tmp_path / "cluster", range_servers=2, pd_nodes=3,
                        etcd_members=3) as cluster, ConnectionPool(RIDE_OUT) as pool:
        client = SbpClient(cluster.pd_address, RIDE_OUT, pool)
        source = client.create_stream("positions-input").stream_id
        writer = Writer(client, source, batches_per_append=4, body_size=256, pause_s=0.02)
        writer.start()
        watcher = RecordWatcher(cluster.pd_address)
        probe = MetadataProbe(cluster.pd_address)
        queries = []
        try:
            for name in CONSUMERS:
                queries.append(
                    spark.readStream.format("sbp").option("pd", cluster.pd_address)
                    .option("streams", str(source)).option("consumer", name)
                    .option("startingOffsets", "earliest").option("retries", "60")
                    .load().writeStream.format("noop").queryName(name)
                    .option("checkpointLocation", str(tmp_path / name))
                    .trigger(processingTime="200 milliseconds").start())
            wait_until(lambda: all(client.consumers.describe([n])[0].ok and
                                   client.consumers.get(n).positions for n in CONSUMERS),
                       120, "both queries to record a position")
            watcher.start()
            probe.start()
            writer.wait_for_more(200, timeout=120)
            killed_at = kill_leader(cluster, probe, figures)
            before_kill = sum(len(r) for r in watcher.readings.values())
            writer.wait_for_more(200, timeout=120)
            writer.finish()
            ranges = client.list_ranges(source)
            end = client.open_range_end(ranges[-1])
            for query in queries:
                query.processAllAvailable()
                assert query.isActive, query.exception()
            wait_until(lambda: all(
                {p.stream_id: p.committed_offset for p in client.consumers.get(n).positions}
                == checkpoint_committed(tmp_path / n) for n in CONSUMERS), 60,
                "each record to reach its checkpoint")
            caught_up_s = time.monotonic() - killed_at
        finally:
            watcher.stop()
            probe.stop()
            writer.stop.set()
            for query in queries:
                query.stop()
        records = {n: client.consumers.get(n) for n in CONSUMERS}

    moved_back = [(key, a, b) for key, seen in watcher.readings.items()
                  for a, b in zip(seen, seen[1:], strict=False) if b < a]
    readings = sum(len(r) for r in watcher.readings.values())
    figures["records read"] = f"{readings} ({before_kill} before the kill)"
    figures["reads that found no leader"] = watcher.unanswered
    figures["input"] = f"offsets [0, {end})"
    figures["final records"] = ", ".join(
        f"{n}: {[p.committed_offset for p in c.positions]} (generation {c.generation})"
        for n, c in records.items())
    figures["from the kill to both records at their checkpoints"] = f"{caught_up_s:.1f} s"
    assert readings > before_kill > 0  # the watcher saw the records on both leaders
    assert not moved_back, f"a record moved back: {moved_back[:5]}"
    for name, consumer in records.items():
        assert consumer.generation == 1, (name, watcher.generations.get(name))
        assert watcher.generations.get(name) == {1}
        assert [p.committed_offset for p in consumer.positions] == [
            checkpoint_committed(tmp_path / name)[source]]
        assert consumer.positions[0].committed_offset == end
