"""Automatic discovery of ``format("sbp")``: pyspark registers the ``DefaultSource`` of every
importable top-level ``pyspark_*`` module when a session starts.

This source does not push filters down, so it works whatever the session's settings (as does
``sbp_spark.register(spark)``; ``register(spark, filter_pushdown=True)`` for pushdown).
"""

from sbp_spark.spark.source import SbpDataSourceNoPushdown as DefaultSource

__all__ = ["DefaultSource"]
