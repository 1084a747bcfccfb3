"""Run by tests/spark/test_discovery.py in a fresh Python process (pyspark discovers the
``pyspark_*`` sources when a session first looks a Python source up, once per process): read
a source of another package next to format("sbp"), both found by discovery alone. Prints one
JSON line of results.

Usage: python discovery_job.py PD STREAM
"""

from __future__ import annotations

import json
import sys

from pyspark.sql import SparkSession


def main(pd: str, stream: str) -> dict:
    spark = (SparkSession.builder.master("local[1]")
             .config("spark.driver.bindAddress", "127.0.0.1")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.ui.enabled", "false")
             .getOrCreate())
    try:
        spark.sparkContext.setLogLevel("ERROR")
        return {
            "xyz": sorted(r.n for r in spark.read.format("xyz").load().collect()),
            "sbp": spark.read.format("sbp").option("pd", pd).option("streams", stream)
            .option("startingOffsets", "earliest").load().count(),
        }
    finally:
        spark.stop()


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
