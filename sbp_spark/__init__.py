"""sbp-spark: a PySpark connector for the Streaming Batch Protocol (SBP)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__version__ = "0.2.0"


def register(spark: SparkSession, filter_pushdown: bool = False) -> None:
    """Register ``format("sbp")`` in ``spark``, replacing the automatically discovered source.

    ``filter_pushdown=True`` also sets ``spark.sql.python.filterPushdown.enabled=true``
    (pyspark's switch for Python data sources) and registers the variant that pushes filters
    on the metadata columns down to planning. It is off by default because pyspark (4.3.0
    checked) keeps the partitions a Python source planned with pushed filters on the source's
    relation and reuses them for other scans of it: a DataFrame or view queried again, or
    scanned twice in one query with different filters, silently returns the first scan's
    rows. Turn it on only where each query loads its DataFrame anew and scans it once (the
    README's "Filter pushdown" says more).
    """
    from sbp_spark.spark.source import SbpDataSource, SbpDataSourceNoPushdown

    if filter_pushdown:
        spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
        spark.dataSource.register(SbpDataSource)
    else:
        spark.dataSource.register(SbpDataSourceNoPushdown)


__all__ = ["__version__", "register"]
