"""What the running pyspark offers the connector, found by probing for each feature.

pyspark's Python Data Source API grew over the 4.x releases: 4.0 has batch and streaming
sources and sinks, 4.1 added filter pushdown and an Arrow stream writer, 4.2 admission control
for streaming reads (read limits, availableNow, a reported latest offset). The connector asks
this module what it may use (``found()``) instead of comparing version strings: a probe looks
for the class, module or keyword itself, so a backport or a patched build gets what it really
has. The version string is only read for messages.

``FEATURES`` lists what depends on the pyspark found, with the first pyspark that has it and
what the connector does without it; the README's table of features by pyspark version is
checked against it (``tests/spark/test_pyspark_api.py``).

Importing this module never imports Spark's JVM side and never fails, with or without pyspark.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass
from types import ModuleType

# What to tell someone whose environment cannot host the connector.
INSTALL_HINT = 'pip install "sbp-spark[spark]" (or any pyspark 4.x)'


class PysparkUnsupportedError(RuntimeError):
    """The pyspark found (or its absence) cannot do what was asked of the connector; the
    message names the pyspark found and what to install."""


@dataclass(frozen=True)
class Feature:
    """One thing the connector does only where pyspark allows it."""

    name: str  # the attribute of ``PysparkApi`` that says whether the pyspark found has it
    title: str  # what it is, as the README's table names it
    since: str  # the first pyspark minor version that has it (for the docs; probes decide)
    without: str  # what the connector does on a pyspark without it


FEATURES: tuple[Feature, ...] = (
    Feature("data_sources", "batch reads and writes, SQL tables, Spark Connect, payload=arrow "
            "and schema evolution, streaming reads and writes", "4.0",
            "none: `sbp_spark.register` says which pyspark to install"),
    Feature("filter_pushdown", "filter pushdown (`register(spark, filter_pushdown=True)`)",
            "4.1", "refused, naming the pyspark found; Spark applies every filter itself"),
    Feature("stream_arrow_writer", "streaming writes handed over as Arrow batches", "4.1",
            "row writer: the same records, slower; a TIMESTAMP in the hour a worker's clock "
            "goes back is refused unless the workers run in UTC"),
    Feature("admission_control", "admission control: read limits passed by Spark, "
            "`availableNow` in as many micro-batches as the limits need", "4.2",
            "the source applies the limits itself; a one-time trigger runs one micro-batch "
            "([docs/streaming.md](docs/streaming.md#triggers-on-each-pyspark))"),
    Feature("progress_lag", "lag figures in the query progress (`latestOffset`)", "4.2",
            "logged at INFO for each micro-batch"),
)


@dataclass(frozen=True)
class PysparkApi:
    """What one pyspark offers (all False, ``version`` None, when none can be imported)."""

    version: str | None
    # Why pyspark could not be imported (None: it was).
    import_problem: str | None
    # pyspark.sql.datasource: DataSource, batch readers and Arrow writers, stream readers and
    # writers (4.0).
    data_sources: bool
    # DataSourceReader.pushFilters and the Filter classes (4.1).
    filter_pushdown: bool
    # DataSourceStreamArrowWriter (4.1).
    stream_arrow_writer: bool
    # pyspark.sql.streaming.datasource: ReadLimit and its kinds, SupportsTriggerAvailableNow,
    # latestOffset(start, limit) (4.2).
    admission_control: bool
    # DataSourceStreamReader.reportLatestOffset (4.2).
    progress_lag: bool
    # pyspark.sql.pandas.types.to_arrow_type(..., timezone=) (4.2); before, timestamp_utc=.
    arrow_timezone_keyword: bool

    def describe(self) -> str:
        """``pyspark 4.0.5``, or what was found instead, for messages."""
        if self.version is None:
            return f"no pyspark ({self.import_problem})"
        return f"pyspark {self.version}"

    def has(self, feature: str) -> bool:
        """Whether this pyspark has ``feature`` (a name from ``FEATURES``)."""
        if feature not in {f.name for f in FEATURES}:
            raise ValueError(f"unknown pyspark feature {feature!r}; known: "
                             f"{', '.join(f.name for f in FEATURES)}")
        return bool(getattr(self, feature))

    def require_data_sources(self) -> None:
        """Raise ``PysparkUnsupportedError`` unless this pyspark can host the connector."""
        if self.version is None:
            raise PysparkUnsupportedError(
                f"format sbp needs pyspark 4.x, and this Python has none "
                f"({self.import_problem}): {INSTALL_HINT}")
        if not self.data_sources:
            raise PysparkUnsupportedError(
                f"format sbp needs pyspark 4.x (its Python Data Source API), but this is "
                f"{self.describe()}, which has none: {INSTALL_HINT}")

    def require(self, feature: str, asked: str) -> None:
        """Raise ``PysparkUnsupportedError`` naming ``asked`` (what the user asked for) when
        this pyspark lacks ``feature``."""
        self.require_data_sources()
        if self.has(feature):
            return
        spec = next(f for f in FEATURES if f.name == feature)
        raise PysparkUnsupportedError(
            f"{asked} needs pyspark {spec.since} or newer ({spec.title}), but this is "
            f"{self.describe()}; pip install \"pyspark>={spec.since},<5\"")


def _module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _has(module: ModuleType | None, *names: str) -> bool:
    return module is not None and all(hasattr(module, name) for name in names)


def probe() -> PysparkApi:
    """Probe the pyspark importable now (``found()`` keeps the answer)."""
    try:
        pyspark = importlib.import_module("pyspark")
    except ImportError as exc:
        return PysparkApi(None, str(exc), *([False] * 6))
    version = str(getattr(pyspark, "__version__", "(version unknown)"))
    datasource = _module("pyspark.sql.datasource")
    data_sources = _has(datasource, "DataSource", "DataSourceReader", "DataSourceArrowWriter",
                        "DataSourceStreamReader", "DataSourceStreamWriter", "InputPartition",
                        "WriterCommitMessage")
    reader = getattr(datasource, "DataSourceReader", None)
    filter_pushdown = data_sources and hasattr(reader, "pushFilters") and _has(
        datasource, "Filter", "EqualTo", "EqualNullSafe", "GreaterThan", "GreaterThanOrEqual",
        "LessThan", "LessThanOrEqual", "In")
    stream_reader = getattr(datasource, "DataSourceStreamReader", None)
    admission = _module("pyspark.sql.streaming.datasource") if data_sources else None
    admission_control = _has(admission, "ReadLimit", "ReadAllAvailable", "ReadMaxRows",
                             "ReadMinRows", "ReadMaxBytes", "SupportsTriggerAvailableNow")
    types = _module("pyspark.sql.pandas.types")
    to_arrow_type = getattr(types, "to_arrow_type", None)
    return PysparkApi(
        version=version,
        import_problem=None,
        data_sources=data_sources,
        filter_pushdown=filter_pushdown,
        stream_arrow_writer=data_sources and _has(datasource, "DataSourceStreamArrowWriter"),
        admission_control=admission_control,
        progress_lag=data_sources and hasattr(stream_reader, "reportLatestOffset"),
        arrow_timezone_keyword=to_arrow_type is not None
        and "timezone" in inspect.signature(to_arrow_type).parameters,
    )


@functools.cache
def found() -> PysparkApi:
    """What the pyspark of this Python process offers (probed once)."""
    return probe()


__all__ = ["FEATURES", "INSTALL_HINT", "Feature", "PysparkApi", "PysparkUnsupportedError",
           "found", "probe"]
