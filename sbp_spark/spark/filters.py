"""Filter pushdown: which of Spark's filters the source applies itself, and how.

Comparisons (=, <, <=, >, >=, IN) on the metadata columns ``stream_id``, ``range_index`` and
``offset`` are applied exactly by planning: they choose the streams, ranges and offset intervals
fetched, and reading cuts batches at the interval ends. Comparisons on ``timestamp`` are applied
row by row on the Arrow batches, which is exact; planning also narrows each stream's offsets to
where their interval's ends fall (``times.timestamp_bounds``). Anything else is returned to
Spark unhandled.

Spark's filter classes come with pushdown itself (pyspark 4.1); this module reaches for them
only when Spark pushes filters, so it also loads on a pyspark without them (the predicates and
intervals serve every read).
"""

from __future__ import annotations

import datetime as dt
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import pyarrow as pa
import pyarrow.compute as pc

from .schemas import ARROW_TIMESTAMP

if TYPE_CHECKING:
    from pyspark.sql.datasource import (
        EqualNullSafe,
        EqualTo,
        Filter,
        GreaterThan,
        GreaterThanOrEqual,
        In,
        LessThan,
        LessThanOrEqual,
    )

    # The filter classes the source applies: each has one column (``attribute``) and a
    # ``value``.
    _Comparison = (EqualTo | EqualNullSafe | LessThan | LessThanOrEqual | GreaterThan
                   | GreaterThanOrEqual | In)

INTEGER_COLUMNS = ("stream_id", "range_index", "offset")
PUSHABLE_COLUMNS = (*INTEGER_COLUMNS, "timestamp")
OPERATORS = ("=", "<", "<=", ">", ">=", "in")


@functools.cache
def _operators() -> dict[type, str]:
    """The operator of each of Spark's filter classes the source applies (imported when Spark
    first pushes filters: only a pyspark with pushdown has them)."""
    from pyspark.sql.datasource import (
        EqualNullSafe,
        EqualTo,
        GreaterThan,
        GreaterThanOrEqual,
        In,
        LessThan,
        LessThanOrEqual,
    )

    return {EqualTo: "=", EqualNullSafe: "=", LessThan: "<", LessThanOrEqual: "<=",
            GreaterThan: ">", GreaterThanOrEqual: ">=", In: "in"}

UNBOUNDED = (-(1 << 63), 1 << 63)

Interval = tuple[int, int]  # [lo, hi): hi exclusive


@dataclass(frozen=True)
class Predicate:
    """One pushed comparison. Timestamps are microseconds since the epoch (UTC)."""

    column: str
    op: str
    value: int | tuple[int, ...]  # the tuple for "in", one value for the other operators

    def __post_init__(self) -> None:
        if self.op not in OPERATORS:
            raise ValueError(f"predicate on {self.column}: operator {self.op!r} is not one of "
                             f"{sorted(OPERATORS)}")
        if (self.op == "in") != isinstance(self.value, tuple):
            raise ValueError(f"predicate {self.column} {self.op} {self.value!r}: IN takes a "
                             f"tuple of values, the other operators one value")

    def describe(self) -> str:
        if isinstance(self.value, tuple):
            return f"{self.column} IN ({', '.join(str(v) for v in self.value)})"
        return f"{self.column} {self.op} {self.value}"


def _timestamp_micros(value: object) -> int | None:
    if not isinstance(value, dt.datetime):
        return None
    if value.tzinfo is None:
        # pyspark 4.3 hands TIMESTAMP literals over with a UTC zone attached; a naive one is
        # read as UTC too (the instant Spark pushed, never a wall-clock time).
        value = value.replace(tzinfo=dt.timezone.utc)
    delta = value - dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _literal(column: str, value: object) -> int | None:
    if column == "timestamp":
        return _timestamp_micros(value)
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def to_predicate(flt: Filter, columns: Iterable[str]) -> Predicate | None:
    """The predicate for ``flt`` if the source can apply it exactly, else None."""
    op = _operators().get(type(flt))
    if op is None:
        return None
    comparison = cast("_Comparison", flt)
    attribute = comparison.attribute
    if len(attribute) != 1 or attribute[0] not in columns:
        return None
    column = attribute[0]
    if column not in PUSHABLE_COLUMNS:
        return None
    if op == "in":
        values = []
        for item in comparison.value:
            if item is None:  # x IN (.., NULL) never selects more rows than without the NULL
                continue
            literal = _literal(column, item)
            if literal is None:
                return None
            values.append(literal)
        return Predicate(column, "in", tuple(sorted(set(values))))
    literal = _literal(column, comparison.value)
    if literal is None:
        return None
    return Predicate(column, op, literal)


def split_filters(filters: Sequence[Filter], columns: Iterable[str]
                  ) -> tuple[list[Predicate], list[Filter]]:
    """(predicates the source applies, filters left for Spark)."""
    columns = set(columns)
    handled: list[Predicate] = []
    unhandled: list[Filter] = []
    for flt in filters:
        predicate = to_predicate(flt, columns)
        if predicate is None:
            unhandled.append(flt)
        else:
            handled.append(predicate)
    return handled, unhandled


# -- integer columns: interval sets ------------------------------------------------------------


def _predicate_intervals(pred: Predicate) -> list[Interval]:
    v = pred.value
    if isinstance(v, tuple):  # "in" (a Predicate holds a tuple for that operator alone)
        return merge_intervals((x, x + 1) for x in v)
    lo, hi = UNBOUNDED
    bounds = {"=": (v, v + 1), "<": (lo, v), "<=": (lo, v + 1), ">": (v + 1, hi),
              ">=": (v, hi)}
    return [bounds[pred.op]]


def merge_intervals(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint, non-adjacent intervals covering the same values."""
    merged: list[Interval] = []
    for lo, hi in sorted(i for i in intervals if i[0] < i[1]):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def intersect_intervals(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The values in both interval lists (each sorted and disjoint)."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo = max(a[i][0], b[j][0])
        hi = min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


@dataclass(frozen=True)
class PushedFilters:
    """What pushdown asks of planning (intervals per column; timestamps in microseconds)
    and of reading (row predicates)."""

    predicates: tuple[Predicate, ...] = ()
    intervals: dict[str, tuple[Interval, ...]] = field(default_factory=dict)

    @classmethod
    def from_predicates(cls, predicates: Iterable[Predicate]) -> PushedFilters:
        predicates = tuple(predicates)
        intervals: dict[str, tuple[Interval, ...]] = {}
        for column in PUSHABLE_COLUMNS:
            current: list[Interval] = [UNBOUNDED]
            for pred in predicates:
                if pred.column == column:
                    current = intersect_intervals(current, _predicate_intervals(pred))
            intervals[column] = tuple(current)
        return cls(predicates, intervals)

    def allows(self, column: str, value: int) -> bool:
        """Whether an integer column value passes the pushed predicates."""
        return any(lo <= value < hi for lo, hi in self.intervals.get(column, (UNBOUNDED,)))

    def offset_intervals(self) -> tuple[Interval, ...]:
        return self.intervals.get("offset", (UNBOUNDED,))

    def hull(self, column: str) -> Interval:
        """The smallest interval holding every value of ``column`` the predicates allow
        (empty when they allow none; unbounded when none is on the column)."""
        spans = self.intervals.get(column, (UNBOUNDED,))
        return (spans[0][0], spans[-1][1]) if spans else (0, 0)

    @property
    def row_predicates(self) -> tuple[Predicate, ...]:
        """Predicates reading must evaluate on rows (planning cannot prune by them)."""
        return tuple(p for p in self.predicates if p.column == "timestamp")

    def describe(self) -> str:
        return " AND ".join(p.describe() for p in self.predicates) or "none"


# -- row evaluation --------------------------------------------------------------------------


def row_mask(predicates: Sequence[Predicate], columns: dict[str, pa.Array]) -> pa.Array | None:
    """A boolean mask of the rows that pass every predicate (None when there are none).

    ``columns`` maps column names to arrays; timestamps must be ``timestamp[us, UTC]``.
    """
    mask = None
    for pred in predicates:
        array = columns[pred.column]
        if pred.column == "timestamp":
            scalar_type = ARROW_TIMESTAMP
        else:
            scalar_type = pa.int64()
        if pred.op == "in":
            this = pc.is_in(array, value_set=pa.array(pred.value, scalar_type))
        else:
            scalar = pa.scalar(pred.value, scalar_type)
            this = _COMPARE[pred.op](array, scalar)
        mask = this if mask is None else pc.and_kleene(mask, this)
    return mask


_COMPARE = {
    "=": pc.equal, "<": pc.less, "<=": pc.less_equal, ">": pc.greater, ">=": pc.greater_equal,
}
