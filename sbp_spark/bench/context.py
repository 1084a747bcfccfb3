"""Settings of one bench run and the resources its sections share (server process, Spark)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sbp_spark.environment import check_java, use_this_python_for_workers

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
            if self._server.cluster_error:
                self.progress("setup", f"cluster not available: {self._server.cluster_error}")
        return self._server

    def spark(self) -> SparkSession:
        """The run's SparkSession: local[2], no UI, warm Python workers (created on first use)."""
        if self._spark is None:
            self.progress("setup", "starting Spark (local[2])")
            check_java()
            use_this_python_for_workers()
            from pyspark.sql import SparkSession

            # Spark's own WARN lines would drown the progress lines: errors only.
            log_config = self.workdir / "log4j2.properties"
            log_config.write_text(_LOG4J2)

            self._spark = (
                SparkSession.builder.master("local[2]")
                .appName("sbp-bench")
                .config("spark.ui.enabled", "false")
                .config("spark.ui.showConsoleProgress", "false")
                .config("spark.driver.memory", "3g")
                .config("spark.sql.shuffle.partitions", "2")
                # Older checkouts' registered reader implements pushFilters, which fails every
                # read unless pushdown is on; today's default registration pushes nothing, and
                # the bench's reads have no filter to push.
                .config("spark.sql.python.filterPushdown.enabled", "true")
                .config("spark.local.dir", str(self.workdir / "spark-local"))
                .config("spark.sql.warehouse.dir", str(self.workdir / "warehouse"))
                .config("spark.driver.extraJavaOptions",
                        f"-Dlog4j.configurationFile=file:{log_config}")
                .getOrCreate()
            )
            self._spark.sparkContext.setLogLevel("ERROR")
        return self._spark

    def close(self) -> None:
        if self._spark is not None:
            self._spark.stop()
            self._spark = None
        if self._server is not None:
            self._server.stop()
            self._server = None
