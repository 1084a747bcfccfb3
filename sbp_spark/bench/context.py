"""Settings of one bench run and the resources its sections share (server process, Spark)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sbp_spark.client import ConnectionPool, SbpClient
from sbp_spark.environment import local_spark_session

from .server_proc import ServerProcess
from .timing import Progress

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


_LOG4J2 = """\
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
"""


@dataclass
class BenchConfig:
    """Sizes and repetitions of a run; ``BenchConfig.full()`` / ``.quick_run()`` are the presets."""

    quick: bool
    # Spark batch: rows of ``record_size`` value bytes, timed runs per query (after a warm-up).
    spark_rows: int
    spark_runs: int
    # Untimed write rounds before the timed ones: the connector's writes take three to settle
    # (the server's and the JVM's CPU per write falls for the first three; see spark_batch).
    spark_write_warmups: int = 3
    record_size: int = 100
    spark_partitions: int = 4
    # Client: bytes moved per timed run, runs per figure.
    client_bytes: int = 512 * 1024 * 1024
    client_runs: int = 3
    # Records per Arrow batch in the client records/s figure.
    client_batch_records: int = 10_000
    # Streaming: offered rate and how long it is held; catch-up backlog size.
    stream_rate: int = 10_000
    stream_seconds: float = 20.0
    stream_backlog: int = 1_000_000
    # Memory: concurrent clients against the server.
    concurrent_clients: int = 64
    concurrent_seconds: float = 5.0
    # Planning by time: records and ranges of the stream searched, timed runs.
    planning_records: int = 10_000_000
    planning_ranges: int = 1_000
    planning_runs: int = 5
    # Planning a read by a pattern over names: how many streams it matches (--quick too).
    pattern_streams: int = 1_000
    # Latency: seconds one writer appends under each fsync policy, in this many rounds.
    latency_seconds: float = 6.0
    latency_rounds: int = 3
    # Scaling: seconds of each load per count of active streams, loads per policy, the counts.
    scaling_seconds: float = 4.0
    scaling_rounds: int = 2
    scaling_streams: tuple[int, ...] = (1, 8, 64, 256)
    # Spark reads of the same rows spread over this many ranges, and the rows.
    scaling_ranges: tuple[int, ...] = (1, 4, 16, 64)
    scaling_read_rows: int = 1 << 21
    # fsync policy handed to the cluster; None keeps the cluster's default.
    fsync: str | None = None

    @classmethod
    def full(cls) -> BenchConfig:
        return cls(quick=False, spark_rows=4_000_000, spark_runs=5)

    @classmethod
    def quick_run(cls) -> BenchConfig:
        return cls(quick=True, spark_rows=2_000_000, spark_runs=2, spark_write_warmups=1,
                   client_bytes=128 * 1024 * 1024, client_runs=2,
                   stream_seconds=8.0, stream_backlog=300_000, concurrent_seconds=2.0,
                   planning_records=1_000_000, planning_ranges=100, planning_runs=3,
                   latency_seconds=3.0, latency_rounds=2, scaling_seconds=2.0, scaling_rounds=1,
                   scaling_read_rows=1 << 20)


class BenchContext:
    """What sections share: settings, progress, a work dir, the server process and Spark."""

    def __init__(self, config: BenchConfig, workdir: Path, progress: Progress) -> None:
        self.config = config
        self.workdir = workdir
        self.progress = progress
        self._server: ServerProcess | None = None
        self._spark: SparkSession | None = None

    @property
    def server(self) -> ServerProcess:
        """The server child process (started on first use)."""
        if self._server is None:
            self.progress("setup", "starting the server process (EmbeddedCluster + loopback)")
            self._server = ServerProcess(self.workdir / "cluster", log_path=self.workdir /
                                         "server.log", fsync=self.config.fsync).start()
        return self._server

    @contextmanager
    def client(self, private: bool = False) -> Iterator[SbpClient]:
        """An ``SbpClient`` of the bench cluster.

        ``private`` gives it a connection pool of its own, closed on exit, so concurrent bench
        clients really use separate connections; otherwise it shares the process-wide pool.
        """
        pool = ConnectionPool() if private else None
        try:
            yield SbpClient(self.server.pd, pool=pool)
        finally:
            if pool is not None:
                pool.close()

    def create_streams(self, count: int) -> list[int]:
        """``count`` new, empty streams on the bench cluster; returns their ids."""
        with self.client() as client:
            return [int(s.stream_id) for s in client.create_streams(count=count)]

    def create_stream(self) -> int:
        """A new, empty stream on the bench cluster; returns its id."""
        return self.create_streams(1)[0]

    def spark(self) -> SparkSession:
        """The run's SparkSession: local[2], no UI, ``format("sbp")`` registered, warm Python
        workers (created on first use)."""
        if self._spark is None:
            self.progress("setup", "starting Spark (local[2])")
            # Spark's own WARN lines would drown the progress lines: errors only.
            log_config = self.workdir / "log4j2.properties"
            log_config.write_text(_LOG4J2)
            self._spark = local_spark_session("sbp-bench", **{
                "spark.ui.showConsoleProgress": "false",
                "spark.driver.memory": "3g",
                "spark.local.dir": str(self.workdir / "spark-local"),
                "spark.sql.warehouse.dir": str(self.workdir / "warehouse"),
                "spark.driver.extraJavaOptions": f"-Dlog4j.configurationFile=file:{log_config}",
            })
            self._spark.sparkContext.setLogLevel("ERROR")
        return self._spark

    def close(self) -> None:
        if self._spark is not None:
            self._spark.stop()
            self._spark = None
        if self._server is not None:
            self._server.stop()
            self._server = None
