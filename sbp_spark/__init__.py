"""sbp-spark: a PySpark connector for the Streaming Batch Protocol (SBP)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__version__ = "0.1.0"


def register(spark: SparkSession) -> None:
    """Register ``format("sbp")`` in ``spark`` with filter pushdown turned on.

    Sets ``spark.sql.python.filterPushdown.enabled=true`` (pyspark's switch for Python data
    sources) and registers the source, replacing the automatically discovered one.
    """
    from sbp_spark.spark.source import SbpDataSource

    spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    spark.dataSource.register(SbpDataSource)


__all__ = ["__version__", "register"]
