"""SQL settings of the session a task runs for.

The driver-side Python workers that build a source's schema, reader and writer get no SQL
settings and no SparkSession. Spark does hand every task of a query the settings its session
had explicitly set, as task properties (``TaskContext.getLocalProperty``), so settings that
change how data is read or written are looked up in the task; a setting the session never set
has Spark's default.
"""

from __future__ import annotations

CASE_SENSITIVE = "spark.sql.caseSensitive"


def task_property(name: str) -> str | None:
    """In a task: the session's explicit value of the setting ``name`` (None: not set, or not
    in a task)."""
    from pyspark import TaskContext

    context = TaskContext.get()
    return context.getLocalProperty(name) if context is not None else None


def case_sensitive() -> bool:
    """In a task: whether its session matches column names case-sensitively
    (``spark.sql.caseSensitive``, false unless set)."""
    return (task_property(CASE_SENSITIVE) or "false").strip().lower() == "true"


__all__ = ["CASE_SENSITIVE", "case_sensitive", "task_property"]
