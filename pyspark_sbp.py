"""Automatic discovery of ``format("sbp")``: pyspark registers the ``DefaultSource`` of every
importable top-level ``pyspark_*`` module when a session starts.

This source does not push filters down, so it works whatever the session's settings (as does
``sbp_spark.register(spark)``; ``register(spark, filter_pushdown=True)`` for pushdown).

pyspark imports every ``pyspark_*`` module it finds without a guard, and one that fails to
import hides every Python data source of the environment. So importing this module never
fails: where no pyspark with Python data sources can be imported (none at all, or one older
than 4.0), it defines no ``DefaultSource`` and discovery passes it by;
``sbp_spark.register(spark)`` then says what is missing.
"""

from sbp_spark.spark.pyspark_api import found

__all__: list[str] = []

if found().data_sources:
    from sbp_spark.spark.source import SbpDataSourceNoPushdown as DefaultSource

    __all__ = ["DefaultSource"]
