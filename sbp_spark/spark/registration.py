"""Registering ``format("sbp")`` in a session (``sbp_spark.register``), on every pyspark 4.x."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from .pyspark_api import found

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def register(spark: SparkSession, filter_pushdown: bool = False) -> None:
    """``sbp_spark.register``: register the source (with filter pushdown when asked) after
    checking that the pyspark found can host it (``PysparkUnsupportedError`` otherwise)."""
    api = found()
    api.require_data_sources()
    if filter_pushdown:
        api.require("filter_pushdown", "sbp_spark.register(spark, filter_pushdown=True)")
    from pyspark.errors import AnalysisException

    from .source import SbpDataSource, SbpDataSourceNoPushdown

    if filter_pushdown:
        spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
        spark.dataSource.register(SbpDataSource)
        return
    try:
        spark.dataSource.register(SbpDataSourceNoPushdown)
    except AnalysisException as exc:
        # pyspark 4.0 lets no session replace a discovered source. The one discovered as
        # 'sbp' is pyspark_sbp's DefaultSource, which is the very class registered here.
        if exc.getCondition() != "DATA_SOURCE_ALREADY_EXISTS" or not _discoverable():
            raise


def _discoverable() -> bool:
    """Whether pyspark's discovery finds ``pyspark_sbp``'s source (it is importable and
    defines ``DefaultSource``)."""
    if importlib.util.find_spec("pyspark_sbp") is None:
        return False
    import pyspark_sbp

    return hasattr(pyspark_sbp, "DefaultSource")


__all__ = ["register"]
