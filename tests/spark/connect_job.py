"""Run by tests/spark/test_connect.py in a process of its own (a Spark Connect session cannot
start where a classic one runs): everything a user does with format("sbp"), through a local
Spark Connect server. Prints one JSON line of results.

Usage: python connect_job.py PD WORKDIR
"""

from __future__ import annotations

import contextlib
import io
import json
import sys

from pyspark.sql import SparkSession

import sbp_spark
from sbp_spark.client import SbpClient
from sbp_spark.spark.pyspark_api import found


def main(pd: str, workdir: str) -> dict:
    spark = (SparkSession.builder.remote("local[2]")
             .config("spark.connect.grpc.binding.address", "127.0.0.1")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.sql.warehouse.dir", f"{workdir}/warehouse")
             .config("spark.sql.session.timeZone", "UTC")
             .getOrCreate())
    out: dict = {"session": type(spark).__module__}
    try:
        # Sets a conf and registers the source: both work remotely (pushdown where this
        # pyspark has it, 4.1+).
        sbp_spark.register(spark, filter_pushdown=found().filter_pushdown)
        out["pushdown_conf"] = spark.conf.get("spark.sql.python.filterPushdown.enabled", None)
        client = SbpClient(pd)
        source, relay, tabled = (s.stream_id for s in client.create_streams(3))

        (spark.range(1000).selectExpr("CAST(id AS STRING) AS key", "CAST(id AS STRING) AS value")
         .write.format("sbp").option("pd", pd).option("stream", str(source))
         .mode("append").save())

        pushed = (spark.read.format("sbp").option("pd", pd).option("streams", str(source))
                  .load().where("offset >= 900"))
        plan = io.StringIO()
        with contextlib.redirect_stdout(plan):
            pushed.explain("formatted")
        out["pushed_in_plan"] = "GreaterThanOrEqual(offset,900)" in plan.getvalue()
        out["pushed_count"] = pushed.count()

        table = f"connect_{tabled}"
        spark.sql(f"CREATE TABLE {table} USING sbp OPTIONS (pd '{pd}', stream '{tabled}')")
        # Every column named: pyspark 4.0 fills none an INSERT leaves out.
        spark.sql(f"INSERT INTO {table} SELECT NULL, NULL, NULL, NULL, NULL, "
                  "BINARY(CONCAT('t', id)) FROM range(5)")
        out["table_rows"] = spark.sql(f"SELECT count(*) FROM {table}").first()[0]
        spark.sql(f"DROP TABLE {table}")

        query = (spark.readStream.format("sbp").option("pd", pd).option("streams", str(source))
                 .option("startingOffsets", "earliest").option("maxRecordsPerTrigger", "300")
                 .load().selectExpr("key", "value")
                 .writeStream.format("sbp").option("pd", pd).option("stream", str(relay))
                 .option("checkpointLocation", f"{workdir}/checkpoint")
                 .trigger(availableNow=True).start())
        query.awaitTermination(180)
        out["stream_exception"] = None if query.exception() is None else str(query.exception())
        out["relayed"] = (spark.read.format("sbp").option("pd", pd).option("streams", str(relay))
                          .load().count())

        try:
            spark.sparkContext  # noqa: B018 - the attribute access is what is tried
            out["spark_context"] = "available"
        except Exception as exc:  # what a user of Connect sees
            out["spark_context"] = str(exc)
    finally:
        spark.stop()
    return out


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
