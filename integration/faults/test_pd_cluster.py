"""Faults of a PD cluster on etcd: the PD leader killed under Spark jobs, an etcd member
killed, the leader killed while a range server is also dead.

Every case runs ``ProcessCluster(pd_nodes=3)``: three ``sbp pd --etcd`` processes on a local
etcd (three members unless said otherwise) and ``sbp range-server`` processes given every PD
address. A probe asks the cluster for its streams every 50 ms, through whichever node leads,
and so measures how long metadata was unavailable: from the kill to the first answer of a
request sent after it (the target with default settings, a 3 s lease: under 5 s). Slow: run
with ``pytest integration/faults -m slow -k pd_cluster``.
"""

from __future__ import annotations

import threading
import time

import pytest

from sbp_spark.client import ClientConfig, ConnectionPool, SbpClient
from sbp_spark.client.pd import PdClient
from sbp_spark.protocol.errors import SbpError
from sbp_spark.protocol.records import ENVELOPE_SIZE, batch_bytes, body_to_arrow
from sbp_spark.server.cluster import ProcessCluster
from tests.etcd import require_etcd

from .helpers import RIDE_OUT, Writers, check_body, check_stream, make_body, wait_until
from .relay import failure_cause
from .test_crashes import _holder_index
from .test_spark_streaming import BODY, relay_under_fault

# What the probe's requests may take: a dead node is skipped within half a second.
PROBE = ClientConfig(connect_timeout_s=0.5, request_timeout_s=2.0, retries=3,
                     retry_backoff_ms=10, retry_backoff_max_ms=50, retry_deadline_s=1.0)
# The target for a new leader serving after a kill, with default settings.
TARGET_S = 5.0
ROWS = 200_000
READ_BATCHES, READ_BODY = 2000, 4096
CONNECTOR = {"retries": "60", "requestTimeoutMs": "10000"}


@pytest.fixture(autouse=True)
def _etcd() -> None:
    require_etcd()


class MetadataProbe(threading.Thread):
    """Lists the streams every 50 ms through the PD cluster; keeps when answers came."""

    def __init__(self, pd: str, token: str | None = None) -> None:
        super().__init__(name="metadata-probe", daemon=True)
        config = PROBE.with_token(token)  # a cluster that authenticates needs one
        self.pool = ConnectionPool(config)
        self.pd = PdClient(pd, config, pool=self.pool)
        self.answers: list[tuple[float, float, str]] = []  # (sent, answered, node)
        self.failures = 0
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(0.05):
            sent = time.monotonic()
            try:
                self.pd.list_streams()
            except SbpError:
                self.failures += 1
                continue
            self.answers.append((sent, time.monotonic(), self.pd.leader))

    def serving_after(self, t0: float) -> tuple[float, str] | None:
        """Seconds from ``t0`` to the first answer to a request sent after it, and the node
        that gave it."""
        for sent, answered, node in self.answers:
            if sent > t0:
                return answered - t0, node
        return None

    def longest_gap_after(self, t0: float) -> float:
        """The longest time without an answer from ``t0`` to the last answer."""
        times = [t0] + [a for _, a, _ in self.answers if a > t0]
        return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)

    def stop(self) -> None:
        self.halt.set()
        self.join(5)
        self.pool.close()


def leader_index(cluster: ProcessCluster) -> int:
    """The index of the PD node that leads now (asked as the servers ask each other)."""
    pd = PdClient(cluster.pd_address, PROBE.with_token(cluster.auth.server_token()))
    found: list[int] = []

    def known() -> bool:
        leader = pd.describe_pd_cluster().leader
        if leader is not None:
            found.append(cluster.pd_node_index(leader.advertise_addr))
        return bool(found)

    wait_until(known, 30, "the PD cluster to have a leader")
    return found[-1]


def kill_leader(cluster: ProcessCluster, probe: MetadataProbe, figures: dict,
                wait: bool = True) -> float:
    """kill -9 the leader; with ``wait``, wait for a new one to serve and report how long
    that took. Returns the time of the kill."""
    victim = leader_index(cluster)
    wait_until(lambda: len(probe.answers) > 0, 30, "the probe's first answer")
    killed_at = time.monotonic()
    cluster.kill_pd_node(victim)
    figures["killed"] = f"PD leader pd-{victim}"
    if wait:
        report_takeover(probe, killed_at, figures)
    return killed_at


def report_takeover(probe: MetadataProbe, killed_at: float, figures: dict) -> float:
    """Wait for metadata to be served after ``killed_at``; record and return how long."""
    wait_until(lambda: probe.serving_after(killed_at) is not None, 60,
               "a new PD leader to answer")
    taken, node = probe.serving_after(killed_at) or (0.0, "")
    figures["metadata unavailable (kill to new leader serving)"] = f"{taken:.2f} s ({node})"
    return taken


def pd_cluster(tmp_path, range_servers: int = 3, etcd_members: int = 3) -> ProcessCluster:
    return ProcessCluster(tmp_path, range_servers=range_servers, pd_nodes=3,
                          etcd_members=etcd_members)


def spark_job_running(spark) -> bool:
    return bool(spark.sparkContext.statusTracker().getActiveJobsIds())


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.fault_case(
    "PD leader killed during a Spark batch write",
    f"3 PD nodes on a 3-member etcd, 3 range servers; df.write.format('sbp') of {ROWS:,} rows "
    "in 16 partitions (retries=60) to a 2-replica stream; kill -9 the PD leader while the job "
    "runs (tasks still to start must find their open range through the PD)",
    "the job finishes; the stream holds every row (at least once), offsets without holes; a "
    "new leader serves metadata within the target")
def test_spark_batch_write_while_pd_leader_is_killed(tmp_path, spark, figures):
    with pd_cluster(tmp_path) as cluster, ConnectionPool(RIDE_OUT) as pool:
        client = SbpClient(cluster.pd_address, RIDE_OUT, pool)
        sid = client.create_streams(1, replicas=2)[0].stream_id
        probe = MetadataProbe(cluster.pd_address)
        probe.start()
        df = spark.range(ROWS, numPartitions=16).selectExpr(
            "CAST(id AS STRING) AS key", "CAST(id AS STRING) AS value")
        killed: list[float] = []

        def kill_during_the_job() -> None:
            # The job runs on the main thread: Spark resolves the source in the thread that
            # plans the write, where the session registered it.
            wait_until(lambda: spark_job_running(spark), 120, "the write job to start")
            killed.append(kill_leader(cluster, probe, figures, wait=False))

        killer = threading.Thread(target=kill_during_the_job, daemon=True)
        killer.start()
        started = time.monotonic()
        try:
            df.write.format("sbp").option("pd", cluster.pd_address) \
                .option("stream", str(sid)).options(**CONNECTOR).mode("append").save()
            figures["job"] = f"finished in {time.monotonic() - started:.1f} s"
            killer.join(60)
            assert killed, "the job ended before the leader could be killed"
            taken = report_takeover(probe, killed[0], figures)
        finally:
            probe.stop()
        values: list[int] = []
        holes = []
        expected = 0
        for batch in client.read(sid):
            if batch.header.base_offset != expected:
                holes.append(expected)
            expected = batch.header.end_offset
            body = batch.data[ENVELOPE_SIZE:ENVELOPE_SIZE + batch.header.body_length]
            values.extend(int(v) for v in body_to_arrow(body).column("value").to_pylist())
        figures["stored"] = (f"{len(values):,} records ({len(values) - len(set(values)):,} "
                             "written twice by retried tasks), offsets without holes"
                             if not holes else f"holes at {holes[:5]}")
        assert not holes, f"holes at {holes[:5]}"
        assert set(values) == set(range(ROWS)), "rows missing from the stream"
        assert taken < TARGET_S, f"a new leader served after {taken:.2f} s"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.fault_case(
    "PD leader killed during Spark batch reads",
    f"3 PD nodes on a 3-member etcd; a {READ_BATCHES * READ_BODY >> 20} MiB 2-replica stream "
    "read by spark.read.format('sbp') (4 partitions, retries=60) in a loop; kill -9 the PD "
    "leader during a query",
    "every query returns each offset once with its exact value (planning waits for the new "
    "leader); queries go on after the kill")
def test_spark_batch_read_while_pd_leader_is_killed(tmp_path, spark, figures):
    with pd_cluster(tmp_path) as cluster, ConnectionPool(RIDE_OUT) as pool:
        client = SbpClient(cluster.pd_address, RIDE_OUT, pool)
        sid = client.create_streams(1, replicas=2)[0].stream_id
        writer = client.open_stream(sid)
        for start in range(0, READ_BATCHES, 100):
            writer.append([batch_bytes(make_body(sid, i, READ_BODY))
                           for i in range(start, start + 100)])
        df = (spark.read.format("sbp").option("pd", cluster.pd_address)
              .option("streams", str(sid)).options(**CONNECTOR)
              .option("minPartitions", "4").load().select("offset", "value"))
        finished: list[float] = []
        failed: list[str] = []
        stop = threading.Event()

        def queries() -> None:
            while not stop.is_set():
                try:
                    rows = df.collect()
                except Exception as exc:  # Py4J wraps the executor's error: keep its cause
                    failed.append(failure_cause(str(exc)))
                    continue
                assert sorted(r.offset for r in rows) == list(range(READ_BATCHES))
                for r in rows:
                    assert check_body(bytes(r.value)) == (sid, r.offset)
                finished.append(time.monotonic())

        probe = MetadataProbe(cluster.pd_address)
        probe.start()
        t = threading.Thread(target=queries, daemon=True)
        t.start()
        try:
            wait_until(lambda: finished or failed, 120, "a first query")
            wait_until(lambda: spark_job_running(spark), 30, "a query to run")
            killed_at = kill_leader(cluster, probe, figures)
            wait_until(lambda: len([f for f in finished if f > killed_at]) >= 2 or failed or
                       not t.is_alive(), 180, "two queries after the kill")
        finally:
            stop.set()
            t.join(180)
            probe.stop()
        figures["queries finished"] = len(finished)
        figures["queries failed"] = len(failed)
        assert not failed, failed[:2]
        taken = probe.serving_after(killed_at)
        assert taken is not None and taken[0] < TARGET_S, taken


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.fault_case(
    "PD leader killed during a Spark streaming query",
    f"3 PD nodes on a 3-member etcd, 3 range servers; a writer appends {BODY} B batches to a "
    "2-replica input stream while readStream.format('sbp') relays it into an output stream "
    "with writeStream.format('sbp') idempotent=true, checkpointed; kill -9 the PD leader "
    "during a micro-batch",
    "the query processes through the input's end; the output holds every input record "
    "exactly once with its exact bytes, no holes; every acknowledged input batch is stored")
def test_spark_streaming_relay_while_pd_leader_is_killed(tmp_path, spark, figures):
    probe: list[MetadataProbe] = []

    def fault(cluster: ProcessCluster) -> None:
        probe.append(MetadataProbe(cluster.pd_address))
        probe[0].start()
        killed_at = kill_leader(cluster, probe[0], figures, wait=False)
        threading.Thread(target=report_takeover, args=(probe[0], killed_at, figures),
                         daemon=True).start()

    try:
        relay_under_fault(tmp_path, spark, figures, replicas=2, servers=3, fault=fault,
                          pd_nodes=3, etcd_members=3)
    finally:
        for p in probe:
            p.stop()
    assert "metadata unavailable (kill to new leader serving)" in figures


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.fault_case(
    "etcd member killed (3-member etcd)",
    "3 PD nodes on a 3-member etcd, 2 range servers; 2 writers append to 2-replica streams "
    "and streams are created meanwhile; kill -9 the etcd member every PD node talks to "
    "first; restart it later",
    "the PD cluster keeps serving (its etcd clients move to another member): metadata calls "
    "and writes go on; acked batches intact, no holes; the member rejoins")
def test_etcd_member_killed(tmp_path, figures):
    with pd_cluster(tmp_path, range_servers=2) as cluster, ConnectionPool(RIDE_OUT) as pool:
        assert cluster.etcd is not None
        client = SbpClient(cluster.pd_address, RIDE_OUT, pool)
        streams = [s.stream_id for s in client.create_streams(2, replicas=2)]
        probe = MetadataProbe(cluster.pd_address)
        probe.start()
        leader_before = leader_index(cluster)
        try:
            with Writers(client, streams) as writers:
                writers.wait_for_more(50)
                killed_at = time.monotonic()
                cluster.etcd.kill(0)
                created = client.create_streams(2)  # admin calls during the outage
                writers.wait_for_more(100)
                wait_until(lambda: probe.serving_after(killed_at + 3) is not None, 30,
                           "metadata answers after the kill")
                gap = probe.longest_gap_after(killed_at)
                cluster.etcd.start_member(0)
                writers.wait_for_more(50)
        finally:
            probe.stop()
        figures["longest time without a metadata answer after the kill"] = f"{gap:.2f} s"
        figures["PD leader"] = ("unchanged" if leader_index(cluster) == leader_before
                                else "changed")
        figures["streams created during the outage"] = len(created)
        check_writers(client, writers, figures)
        assert gap < TARGET_S, f"metadata unavailable for {gap:.2f} s"


def check_writers(client: SbpClient, writers: Writers, figures: dict) -> None:
    """Every writer's stream: acknowledged batches intact, no holes, nothing corrupt."""
    for w in writers:
        check = check_stream(client, w.stream_id, w.acked)
        figures[f"stream {w.stream_id}"] = check.summary()
        assert check.ok, check.summary()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.fault_case(
    "PD leader killed while a range server is dead",
    "3 PD nodes on etcd, 3 range servers, 2-replica streams, a writer on each; kill -9 the "
    "primary of a stream's open range, then at once the PD leader (before it could fail the "
    "server over)",
    "the new leader, after its grace period, fails the dead server's ranges over; the writers "
    "carry on on new ranges; acked batches intact, no holes")
def test_pd_leader_killed_while_a_range_server_is_dead(tmp_path, figures):
    with pd_cluster(tmp_path, etcd_members=1) as cluster, ConnectionPool(RIDE_OUT) as pool:
        client = SbpClient(cluster.pd_address, RIDE_OUT, pool)
        streams = [s.stream_id for s in client.create_streams(2, replicas=2)]
        victim = _holder_index(cluster, client, streams[0], primary=True)
        probe = MetadataProbe(cluster.pd_address)
        probe.start()
        try:
            with Writers(client, streams, pause_s=0.02) as writers:
                writers.wait_for_more(50)
                cluster.kill_range_server(victim)
                killed_at = kill_leader(cluster, probe, figures)
                writers.wait_for_more(100, timeout=90)
                resumed = max(w.last_ack for w in writers) - killed_at
        finally:
            probe.stop()
        figures["also killed"] = f"range server {victim} (primary of stream {streams[0]})"
        figures["writes resumed after the kills"] = f"{resumed:.1f} s"
        figures["ranges of the first stream"] = len(client.list_ranges(streams[0]))
        assert len(client.list_ranges(streams[0])) >= 2, "the dead primary's range stayed open"
        check_writers(client, writers, figures)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.fault_case(
    "PD leader and a primary killed, writers on the client's default settings",
    "as 'PD leader killed while a range server is dead', the writers with ClientConfig() as "
    "it comes (retries bounded by the one-minute deadline alone)",
    "no append gives up: each waits out the election, the new leader's grace period and the "
    "failover, and carries on on a new range; acked batches intact, no holes")
def test_default_client_rides_out_the_pd_leader_and_a_primary_killed(tmp_path, figures):
    defaults = ClientConfig()
    with pd_cluster(tmp_path, etcd_members=1) as cluster, ConnectionPool(defaults) as pool:
        client = SbpClient(cluster.pd_address, defaults, pool)
        streams = [s.stream_id for s in client.create_streams(2, replicas=2)]
        victim = _holder_index(cluster, client, streams[0], primary=True)
        probe = MetadataProbe(cluster.pd_address)
        probe.start()
        try:
            with Writers(client, streams, pause_s=0.02) as writers:
                writers.wait_for_more(50)
                cluster.kill_range_server(victim)
                killed_at = kill_leader(cluster, probe, figures)
                writers.wait_for_more(100, timeout=90)
                resumed = max(w.last_ack for w in writers) - killed_at
        finally:
            probe.stop()
        figures["writes resumed after the kills"] = f"{resumed:.1f} s"
        figures["appends given up"] = sum(len(w.failures) for w in writers)
        assert [f for w in writers for f in w.failures] == []
        assert len(client.list_ranges(streams[0])) >= 2, "the dead primary's range stayed open"
        check_writers(client, writers, figures)
