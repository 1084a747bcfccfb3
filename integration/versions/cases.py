"""The version matrix's cases, run inside one platform's virtualenv (integration/versions).

It imports only what that virtualenv has: pyspark, the installed sbp-spark wheel and the
standard library (started with ``python -I``, so nothing of the checkout is on its path), and
must run on the oldest Python the package supports. Every case prints one line::

    CASE {"case": NAME, "status": "ok" | "refused" | "fail", "detail": TEXT, "seconds": S}

and the run starts with ``PLATFORM {...}`` (the versions it found).

    python -I cases.py classic PD WORKDIR          # one local[2] session, the cases in turn
    python -I cases.py connect PD WORKDIR [DIR]    # one Spark Connect round trip; DIR holds
                                                   # pyspark[connect]'s extra packages
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

# The Python workers Spark starts must use this interpreter: it has the wheel.
os.environ["PYSPARK_PYTHON"] = os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")

QUERY_TIMEOUT_S = 180
DETAIL_CHARS = 1500


def emit(kind: str, payload: dict) -> None:
    print(f"{kind} {json.dumps(payload)}", flush=True)


def pyspark_version() -> tuple[int, int]:
    import pyspark

    major, minor = pyspark.__version__.split(".")[:2]
    return int(major), int(minor)


def platform_info() -> dict:
    import pyarrow
    import pyspark

    import sbp_spark

    try:
        from importlib.metadata import version

        isal = version("isal")
    except Exception as exc:  # reported, not fatal: the cases say what breaks
        isal = f"unknown ({exc})"
    return {"python": sys.version.split()[0], "pyspark": pyspark.__version__,
            "pyarrow": pyarrow.__version__, "isal": isal, "sbp_spark": sbp_spark.__version__,
            "sbp_spark_file": sbp_spark.__file__}


class Refused(Exception):
    """The case met the clear refusal this pyspark is expected to give."""


class Failed(Exception):
    """The case ran and found something wrong."""


def check(condition: bool, what: str) -> None:
    if not condition:
        raise Failed(what)


def run_case(name: str, case, *args) -> None:
    start = time.monotonic()
    try:
        detail = case(*args) or ""
        status = "ok"
    except Refused as exc:
        status, detail = "refused", str(exc)
    except Failed as exc:
        status, detail = "fail", str(exc)
    except Exception as exc:  # any error of the connector or Spark is this case's failure
        status = "fail"
        detail = f"{type(exc).__name__}: {exc}"[:DETAIL_CHARS] + "\n" + \
            "".join(traceback.format_exc().splitlines(keepends=True)[-12:])
    emit("CASE", {"case": name, "status": status, "detail": detail[:DETAIL_CHARS * 2],
                  "seconds": round(time.monotonic() - start, 1)})


def new_streams(pd: str, count: int) -> list[int]:
    from sbp_spark.client import SbpClient

    with SbpClient(pd) as client:
        return [s.stream_id for s in client.create_streams(count)]


def append_values(pd: str, stream: int, values: list[str]) -> None:
    """Append ``values`` to ``stream`` as one payload=records batch, through the client."""
    import pyarrow as pa

    from sbp_spark.client import SbpClient
    from sbp_spark.protocol.records import encode_arrow_batch, make_records_batch

    batch = make_records_batch(pa.array([v.encode() for v in values], pa.binary()))
    with SbpClient(pd) as client:
        client.open_stream(stream).append([encode_arrow_batch(batch)])


def reader(spark, pd: str, streams, **options):
    r = spark.read.format("sbp").option("pd", pd).option("streams", str(streams))
    for key, value in options.items():
        r = r.option(key, str(value))
    return r.load()


def stream_reader(spark, pd: str, stream: int, **options):
    r = (spark.readStream.format("sbp").option("pd", pd).option("streams", str(stream))
         .option("startingOffsets", "earliest"))
    for key, value in options.items():
        r = r.option(key, str(value))
    return r.load()


def finish(query) -> None:
    """Wait for an availableNow query; fail with its error or when it does not end in time."""
    if not query.awaitTermination(QUERY_TIMEOUT_S):
        query.stop()
        raise Failed(f"the query did not finish within {QUERY_TIMEOUT_S} s")
    if query.exception() is not None:
        raise Failed(f"the query failed: {query.exception()}")


# -- the classic cases (one local session) --------------------------------------------------


def register(spark) -> None:
    """sbp_spark.register(spark): each case after discovery starts with it, so a case fails on
    its own account, not because registering failed in an earlier one."""
    import sbp_spark

    sbp_spark.register(spark)


# Another Python data source installed beside ours (``neighbour_source``): pyspark's discovery
# imports every pyspark_* module in one loop, so one that fails to import hides the others.
NEIGHBOUR = '''
from pyspark.sql.datasource import DataSource, DataSourceReader


class NeighbourReader(DataSourceReader):
    def read(self, partition):
        yield (1, "neighbour")


class DefaultSource(DataSource):
    @classmethod
    def name(cls):
        return "neighbour"

    def schema(self):
        return "id INT, who STRING"

    def reader(self, schema):
        return NeighbourReader()
'''


def neighbour_source(work: Path) -> None:
    """Write ``pyspark_neighbour`` (a data source of someone else's) where this process and the
    Python workers Spark starts (through PYTHONPATH) import it; before the session starts, so
    pyspark's one discovery pass sees it."""
    directory = work / "neighbour"
    (directory / "pyspark_neighbour").mkdir(parents=True, exist_ok=True)
    (directory / "pyspark_neighbour" / "__init__.py").write_text(NEIGHBOUR)
    sys.path.insert(0, str(directory))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(directory), os.environ.get("PYTHONPATH")) if p)


def case_discovery(spark, pd: str, work: Path) -> str:
    """format("sbp") with nothing registered: pyspark finds the wheel's pyspark_sbp, and the
    pyspark_neighbour source beside it."""
    [stream] = new_streams(pd, 1)
    (spark.range(10).selectExpr("CAST(id AS STRING) AS value").write.format("sbp")
     .option("pd", pd).option("stream", str(stream)).mode("append").save())
    count = reader(spark, pd, stream).count()
    check(count == 10, f"read {count} records back, wrote 10")
    neighbour = [tuple(r) for r in spark.read.format("neighbour").load().collect()]
    check(neighbour == [(1, "neighbour")],
          f"the pyspark_neighbour source beside ours read {neighbour}, not [(1, 'neighbour')]")
    return "10 records written and read through the discovered source; pyspark_neighbour found too"


def case_batch_round_trip(spark, pd: str, work: Path) -> str:
    """df.write and spark.read, payload=records and payload=arrow (typed columns)."""
    register(spark)
    records, typed_stream = new_streams(pd, 2)
    rows = 2000
    (spark.range(rows).selectExpr("CAST(id AS STRING) AS key",
                                  "CONCAT('v', CAST(id AS STRING)) AS value")
     .repartition(2).write.format("sbp").option("pd", pd).option("stream", str(records))
     .mode("append").save())
    back = reader(spark, pd, records).selectExpr("CAST(key AS STRING) AS k",
                                                 "CAST(value AS STRING) AS v").collect()
    check(len(back) == rows, f"read {len(back)} records, wrote {rows}")
    wrong = [r for r in back if r.v != "v" + r.k]
    check(not wrong, f"{len(wrong)} records came back changed, e.g. {wrong[:3]}")

    typed = spark.range(300).selectExpr(
        "id", "CAST(id AS DECIMAL(12, 2)) AS amount",
        "named_struct('n', id, 's', CAST(id AS STRING)) AS nested", "array(id, id + 1) AS arr",
        "TIMESTAMP '2026-01-01 00:00:00' + make_dt_interval(0, 0, 0, id) AS at")
    (typed.write.format("sbp").option("pd", pd).option("stream", str(typed_stream))
     .option("payload", "arrow").mode("append").save())
    got = reader(spark, pd, typed_stream, payload="arrow").select(*typed.columns).collect()
    check(sorted(got) == sorted(typed.collect()),
          f"payload=arrow read {len(got)} rows that differ from the 300 written")
    return f"{rows} records and 300 typed rows (payload=arrow) round trip"


def case_sql_table(spark, pd: str, work: Path) -> str:
    """CREATE TABLE ... USING sbp, INSERT INTO, SELECT, DROP TABLE. On pyspark 4.0 the INSERT
    gives every column (the README: Spark 4.0 fills none a column list leaves out)."""
    register(spark)
    [stream] = new_streams(pd, 1)
    table = f"events_{stream}"
    spark.sql(f"CREATE TABLE {table} USING sbp OPTIONS (pd '{pd}', stream '{stream}')")
    try:
        rows = ("CAST(CAST(id AS STRING) AS BINARY), "
                "CAST(CONCAT('t', CAST(id AS STRING)) AS BINARY) FROM range(50)")
        if pyspark_version() >= (4, 1):
            spark.sql(f"INSERT INTO {table} (key, value) SELECT {rows}")
        else:
            metadata = len(spark.table(table).columns) - 2  # every column before key, value
            spark.sql(f"INSERT INTO {table} SELECT {'NULL, ' * metadata}{rows}")
        count = spark.sql(f"SELECT count(*) FROM {table}").first()[0]
        check(count == 50, f"SELECT count(*) gave {count} after inserting 50 rows")
        stored = dict(spark.sql(f"SELECT offset, CAST(value AS STRING) FROM {table}").collect())
        check(sorted(stored.values()) == sorted(f"t{i}" for i in range(50)),
              f"SELECT gave {sorted(stored.values())}, not the 50 rows inserted")
        # The two tasks of the INSERT append concurrently: offsets do not follow the ids.
        late = dict(spark.sql(f"SELECT offset, CAST(value AS STRING) FROM {table} "
                              "WHERE offset >= 40").collect())
        check(late == {o: v for o, v in stored.items() if o >= 40},
              f"SELECT ... WHERE offset >= 40 gave {late}")
    finally:
        spark.sql(f"DROP TABLE IF EXISTS {table}")
    return "50 rows inserted and selected through a catalog table"


def _progress_rows(query) -> list[int]:
    return [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]


def one_time_runs_one_batch() -> bool:
    """Whether a one-time trigger runs a single micro-batch: pyspark before 4.2 has no
    admission control for Python sources, and Spark falls back to one micro-batch per run
    (docs/streaming.md, "Triggers on each pyspark")."""
    return pyspark_version() < (4, 2)


def runs_until_caught_up(run, limit: int = 20) -> list[int]:
    """Run a one-time query (``run()`` returns it) again and again from its checkpoint until a
    run reads nothing; the records each micro-batch read, over all runs. On a pyspark where a
    run is one micro-batch, each run must be exactly one."""
    read: list[int] = []
    for _ in range(limit):
        rows = _progress_rows(run())
        check(len(rows) <= 1, f"one run on this pyspark read {rows}: more than one micro-batch")
        if not rows:
            return read
        read += rows
    raise Failed(f"{limit} runs did not catch up: they read {read}")


def case_streaming_restart(spark, pd: str, work: Path) -> str:
    """maxRecordsPerTrigger under availableNow, then a restart from the checkpoint."""
    register(spark)
    [source] = new_streams(pd, 1)
    append_values(pd, source, [f"s{i}" for i in range(1000)])
    output, checkpoint = work / "stream-out", work / "stream-checkpoint"

    def run():
        query = (stream_reader(spark, pd, source, maxRecordsPerTrigger=300)
                 .selectExpr("CAST(value AS STRING) AS v", "offset")
                 .writeStream.format("parquet").option("path", str(output))
                 .option("checkpointLocation", str(checkpoint))
                 .trigger(availableNow=True).start())
        finish(query)
        return query

    # Where a run is one micro-batch, the query runs again from its checkpoint until it has
    # caught up (as sbp demo does there); the limits hold either way.
    runs = runs_until_caught_up if one_time_runs_one_batch() else (lambda r: _progress_rows(r()))
    first = runs(run)
    check(first == [300, 300, 300, 100],
          f"micro-batches read {first} records, expected [300, 300, 300, 100]")
    append_values(pd, source, [f"s{i}" for i in range(1000, 1500)])
    second = runs(run)
    check(second == [300, 200], f"the restarted query read {second}, expected [300, 200]")
    stored = spark.read.parquet(str(output))
    offsets = sorted(r.offset for r in stored.select("offset").collect())
    check(offsets == list(range(1500)),
          f"the output holds {len(offsets)} rows, not offsets 0..1499 once each")
    return "1000 records in 4 micro-batches, then exactly the 500 new ones after a restart"


def case_idempotent_sink(spark, pd: str, work: Path) -> str:
    """writeStream.format("sbp") with idempotent=true: a re-run micro-batch adds nothing."""
    register(spark)
    source, target = new_streams(pd, 2)
    append_values(pd, source, [f"i{i}" for i in range(100)])
    checkpoint = work / "idempotent-checkpoint"

    def run():
        query = (stream_reader(spark, pd, source, maxRecordsPerTrigger=50)
                 .selectExpr("key", "value").writeStream.format("sbp").option("pd", pd)
                 .option("stream", str(target)).option("idempotent", "true")
                 .option("checkpointLocation", str(checkpoint))
                 .trigger(availableNow=True).start())
        finish(query)
        return query

    def stored() -> list[str]:
        return [r.v for r in reader(spark, pd, target)
                .selectExpr("CAST(value AS STRING) AS v").collect()]

    if one_time_runs_one_batch():
        runs_until_caught_up(run)
    else:
        run()
    check(sorted(stored()) == sorted(f"i{i}" for i in range(100)),
          f"the relay stored {len(stored())} records, expected the 100 of the source")
    # As if the driver died after the sink wrote batch 1 and before Spark committed it: the
    # restarted query runs batch 1 again.
    commits = checkpoint / "commits"
    last = max(int(p.name) for p in commits.iterdir() if p.name.isdigit())
    for name in (str(last), f".{last}.crc"):
        (commits / name).unlink(missing_ok=True)
    rerun = [(p["batchId"], p["numInputRows"]) for p in run().recentProgress]
    check((last, 50) in rerun, f"Spark did not run micro-batch {last} again: {rerun}")
    values = stored()
    check(len(values) == 100 and sorted(values) == sorted(f"i{i}" for i in range(100)),
          f"after re-running micro-batch {last} the target holds {len(values)} records, "
          "expected the same 100")
    return f"micro-batch {last} re-run: still 100 records, none twice"


def case_filter_pushdown(spark, pd: str, work: Path) -> str:
    """register(spark, filter_pushdown=True): pushed on 4.1+, a clear refusal on 4.0."""
    import sbp_spark

    [stream] = new_streams(pd, 1)
    append_values(pd, stream, [f"p{i}" for i in range(1000)])
    supported = pyspark_version() >= (4, 1)
    try:
        sbp_spark.register(spark, filter_pushdown=True)
        df = reader(spark, pd, stream).where("offset >= 900")
        plan = io.StringIO()
        with contextlib.redirect_stdout(plan):
            df.explain("formatted")
        count = df.count()
    except Exception as exc:
        if supported:
            raise
        message = str(exc)
        lowered = message.lower()
        check("pushdown" in lowered.replace(" ", "") and "4.1" in message,
              f"pyspark {pyspark_version()} failed, but not with a refusal that names filter "
              f"pushdown and pyspark 4.1: {type(exc).__name__}: {message[:DETAIL_CHARS]}")
        raise Refused(message.splitlines()[0][:300]) from None
    finally:
        with contextlib.suppress(Exception):
            spark.conf.unset("spark.sql.python.filterPushdown.enabled")
            sbp_spark.register(spark)
    check(supported, "pyspark 4.0 has no filter pushdown for Python sources, yet "
                     "register(spark, filter_pushdown=True) and a filtered read ran")
    check(count == 100, f"offset >= 900 counted {count} records, expected 100")
    check("GreaterThanOrEqual(offset,900)" in plan.getvalue(),
          "the plan shows no pushed filter GreaterThanOrEqual(offset,900)")
    return "offset >= 900 pushed into the scan, 100 records"


CLASSIC_CASES = [
    ("discovery", case_discovery),
    ("batch_round_trip", case_batch_round_trip),
    ("sql_table", case_sql_table),
    ("streaming_restart", case_streaming_restart),
    ("idempotent_sink", case_idempotent_sink),
    ("filter_pushdown", case_filter_pushdown),
]


def classic(pd: str, work: Path) -> None:
    neighbour_source(work)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").appName("sbp-versions")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.sql.session.timeZone", "UTC")
             .config("spark.sql.warehouse.dir", str(work / "warehouse"))
             .config("spark.local.dir", str(work / "spark-local"))
             # Small Arrow batches, so the writer coalesces several into one SBP batch.
             .config("spark.sql.execution.arrow.maxRecordsPerBatch", "100")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    try:
        for name, case in CLASSIC_CASES:
            case_work = work / name
            case_work.mkdir(parents=True, exist_ok=True)
            run_case(name, case, spark, pd, case_work)
    finally:
        spark.stop()


# -- Spark Connect (a process of its own: a Connect session cannot start beside a classic one)


def case_connect(pd: str, work: Path) -> str:
    """A local Spark Connect server: register, write, read back."""
    from pyspark.sql import SparkSession

    import sbp_spark

    spark = (SparkSession.builder.remote("local[2]")
             .config("spark.connect.grpc.binding.address", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.driver.host", "127.0.0.1")
             .getOrCreate())
    try:
        check(type(spark).__module__ == "pyspark.sql.connect.session",
              f"got a {type(spark).__module__} session, not Spark Connect")
        sbp_spark.register(spark)
        [stream] = new_streams(pd, 1)
        (spark.range(500).selectExpr("CAST(id AS STRING) AS value").write.format("sbp")
         .option("pd", pd).option("stream", str(stream)).mode("append").save())
        values = {r.v for r in reader(spark, pd, stream)
                  .selectExpr("CAST(value AS STRING) AS v").collect()}
        check(values == {str(i) for i in range(500)},
              f"read {len(values)} distinct values back, wrote 500")
    finally:
        spark.stop()
    return "500 records written and read through Spark Connect"


def connect(pd: str, work: Path, extra_dir: str | None) -> None:
    if extra_dir:
        # pyspark[connect]'s own packages (grpcio, pandas, ...) live beside the platform: this
        # process and the Python workers the Connect server starts both see them.
        sys.path.insert(0, extra_dir)
        os.environ["PYTHONPATH"] = extra_dir
    # pyspark's switch for its own tests: the local Connect server takes a free port.
    os.environ["SPARK_TESTING"] = "1"
    run_case("connect", case_connect, pd, work)


def main(argv: list[str]) -> int:
    mode, pd, work = argv[0], argv[1], Path(argv[2])
    work.mkdir(parents=True, exist_ok=True)
    emit("PLATFORM", platform_info())
    if mode == "classic":
        classic(pd, work)
    elif mode == "connect":
        connect(pd, work, argv[3] if len(argv) > 3 else None)
    else:
        print(f"unknown mode {mode!r}: classic or connect", file=sys.stderr)
        return 2
    shutil.rmtree(work / "spark-local", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
