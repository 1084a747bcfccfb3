"""Writes from a Python thread other than the one that built the session (issue 41 item 6).

pyspark (4.0 to 4.3) looks a Python data source up for a write in the active session of the
JVM thread behind the calling Python thread, and a new thread's has none: the write fails with
DATA_SOURCE_NOT_FOUND, whether the source was registered or discovered, while reads work.
``sbp_spark.session_in_thread`` is the fix a user applies (docs/upstream/pyspark-thread-write.md).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import sbp_spark

from .streaming.helpers import append_values, new_stream, stored_values


def in_thread(work: Callable[[], Any]) -> Any:
    """What ``work`` returns (or raises) when run in a new Python thread."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = work()
        except Exception as exc:  # handed to the test thread
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(300)
    assert not thread.is_alive(), "the thread did not finish within 300 s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def failure(work: Callable[[], Any]) -> str:
    """The error ``work`` raises in a new thread."""
    try:
        in_thread(work)
    except Exception as exc:
        return str(exc)
    raise AssertionError("the write from a new thread did not fail (has pyspark fixed it?)")


def test_a_write_from_another_thread_needs_the_session_made_active(spark, plain_spark, pd,
                                                                   sbp_client):
    sid = new_stream(sbp_client)
    # Built in this thread: pyspark's createDataFrame makes its session active in the thread
    # that calls it, which would hide the bug.
    frames = {session: session.range(5).selectExpr("CAST(id AS STRING) AS value")
              for session in (spark, plain_spark)}

    def write(session=spark) -> None:
        (frames[session].write.format("sbp").option("pd", pd).option("stream", str(sid))
         .mode("append").save())

    # The pyspark bug, for the registered source and for the discovered one.
    assert "DATA_SOURCE_NOT_FOUND" in failure(write)
    assert "DATA_SOURCE_NOT_FOUND" in failure(lambda: write(plain_spark))
    assert stored_values(sbp_client, sid) == []

    def fixed(session=spark) -> None:
        with sbp_spark.session_in_thread(session):
            write(session)
        # The thread's JVM thread has no active session again afterwards.
        jvm_sessions = session._jvm.org.apache.spark.sql.SparkSession
        assert not jvm_sessions.getActiveSession().isDefined()

    in_thread(fixed)
    in_thread(lambda: fixed(plain_spark))
    assert sorted(stored_values(sbp_client, sid)) == sorted(["0", "1", "2", "3", "4"] * 2)


def test_a_read_from_another_thread_works_as_it_is(spark, pd, sbp_client):
    sid = new_stream(sbp_client)
    append_values(sbp_client, sid, ["a", "b"])

    def read() -> list[str]:
        df = (spark.read.format("sbp").option("pd", pd).option("streams", str(sid))
              .load().selectExpr("CAST(value AS STRING) AS v"))
        return sorted(r.v for r in df.collect())

    assert in_thread(read) == ["a", "b"]
