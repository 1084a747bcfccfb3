"""sbp-spark: a PySpark connector for the Streaming Batch Protocol (SBP).

Importing the package needs no pyspark: the embedded cluster, the client and the ``sbp``
command work without it. The connector's functions say which pyspark they need when called.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__version__ = "0.2.0"


def register(spark: SparkSession, filter_pushdown: bool = False) -> None:
    """Register ``format("sbp")`` in ``spark``, replacing the automatically discovered source
    (pyspark 4.0 lets no session replace a discovered source: there the discovered one, the
    same class, stays).

    ``filter_pushdown=True`` also sets ``spark.sql.python.filterPushdown.enabled=true``
    (pyspark's switch for Python data sources) and registers the variant that pushes filters
    on the metadata columns down to planning; pyspark has pushdown since 4.1, and on 4.0 this
    raises ``PysparkUnsupportedError`` naming the pyspark found. It is off by default because
    pyspark (4.3.0 checked) keeps the partitions a Python source planned with pushed filters
    on the source's relation and reuses them for other scans of it: a DataFrame or view
    queried again, or scanned twice in one query with different filters, silently returns the
    first scan's rows. Turn it on only where each query loads its DataFrame anew and scans it
    once (the README's "Filter pushdown" says more).

    Raises ``PysparkUnsupportedError`` when the pyspark found has no Python data sources
    (none before 4.0), naming it and what to install.
    """
    from sbp_spark.spark.registration import register as register_in

    register_in(spark, filter_pushdown)


@contextmanager
def session_in_thread(spark: SparkSession) -> Iterator[SparkSession]:
    """Make ``spark`` the active session of the calling thread's Spark calls, for the
    ``with`` block; the thread's previous active session (or none) comes back after it.

    pyspark (4.0 to 4.3 measured) runs each Python thread's calls on a JVM thread of its own,
    and looks a Python data source up for a write (``df.write.format("sbp").save()``,
    ``saveAsTable``, ``insertInto``) in that JVM thread's active session. A thread other than
    the one that built the session has none, so its writes fail with
    ``DATA_SOURCE_NOT_FOUND`` (reads work). Wrap such a write::

        with sbp_spark.session_in_thread(spark):
            df.write.format("sbp").option("pd", pd).option("stream", "7").save()

    A Spark Connect session has no JVM in this process; the block then changes nothing.
    docs/upstream/pyspark-thread-write.md describes the pyspark bug.
    """
    jvm = getattr(spark, "_jvm", None)  # None: Spark Connect (no JVM here)
    if jvm is None:
        yield spark
        return
    sessions = jvm.org.apache.spark.sql.SparkSession
    previous = sessions.getActiveSession()
    sessions.setActiveSession(spark._jsparkSession)
    try:
        yield spark
    finally:
        if previous.isDefined():
            sessions.setActiveSession(previous.get())
        else:
            sessions.clearActiveSession()


__all__ = ["__version__", "register", "session_in_thread"]
