"""Run by tests/spark/test_auth.py in a process of its own (the test session's Spark runs
without its UI): a write and a read with option token, then every page of the Spark UI and its
REST API that shows queries, jobs, stages or settings, searched for the token. Prints one JSON
line of results.

Usage: python ui_job.py PD
"""

from __future__ import annotations

import json
import secrets
import sys
import urllib.request

from pyspark.sql import SparkSession

import sbp_spark
from sbp_spark.client import SbpClient
from sbp_spark.server.auth.tokens import create_token

PAGES = ("/jobs/", "/stages/", "/SQL/", "/environment/", "/executors/")
API = ("sql?details=true&planDescription=true", "jobs", "stages?details=true", "environment")


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as answer:  # noqa: S310 - loopback only
        return answer.read().decode("utf-8", "replace")


def main(pd: str) -> dict:
    spark = (SparkSession.builder.master("local[2]")
             .config("spark.ui.enabled", "true").config("spark.ui.port", "0")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.ui.showConsoleProgress", "false").getOrCreate())
    try:
        sbp_spark.register(spark)
        token = create_token("ui-check", secret=secrets.token_bytes(32))
        [stream] = SbpClient(pd).create_streams(1)
        (spark.range(100).selectExpr("CAST(id AS STRING) AS key", "CAST(id AS STRING) AS value")
         .write.format("sbp").option("pd", pd).option("stream", str(stream.stream_id))
         .option("token", token).mode("append").save())
        df = (spark.read.format("sbp").option("pd", pd).option("streams", str(stream.stream_id))
              .option("token", token).load())
        rows = df.count()
        base = spark.sparkContext.uiWebUrl
        app = spark.sparkContext.applicationId
        texts = [_get(base + page) for page in PAGES]
        texts += [_get(f"{base}/api/v1/applications/{app}/{path}") for path in API]
        found_in = [name for name, text in zip(PAGES + API, texts, strict=True)
                    if token in text]
        sql = texts[len(PAGES) + API.index(API[0])]  # the REST API's queries with their plans
        return {"rows": rows, "pages": len(texts), "token_in": found_in,
                "sql_api_shows_the_plans": "BatchScan sbp" in sql,
                "environment_shows_settings": "spark.master" in texts[-1]}
    finally:
        spark.stop()


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1])), flush=True)
