"""Schema resolution for payload=arrow: which stored Arrow types may be read as which.

A payload=arrow stream keeps each batch's own Arrow schema, so a stream that outlives its
producer's first schema holds batches of several schemas. A read resolves every stored batch
against the read schema by column name, recursively inside structs, lists and maps:

- a column (or struct field) the batch lacks is read as nulls when the read schema lets it be
  null, and is an error otherwise; one the read schema lacks is dropped;
- a type is read as a wider type of its family when every value survives unchanged
  (``widens``); anything narrowing or unrelated is an error, never a silent coercion.

Everything here is about types (no data, no I/O): ``type_problems`` says why a stored type
cannot be read as a read type (nothing: it can), ``conversion`` says what a column needs
(nothing, a zero-copy relabel, or an Arrow cast), and ``merge_types`` unions the types of two
stored batches for ``mergeSchema`` inference. The casts themselves run as Arrow kernels on
whole columns (``decode``), once per distinct stored schema planned.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from dataclasses import field as dataclass_field

import pyarrow as pa

_TIME_UNITS = ("s", "ms", "us", "ns")  # coarsest first
_LISTS = (pa.types.is_list, pa.types.is_large_list)
_STRINGS = (pa.types.is_string, pa.types.is_large_string)
_BINARIES = (pa.types.is_binary, pa.types.is_large_binary)
# Decimal128 holds at most 38 digits (Spark's DecimalType too); wider unions fail.
MAX_DECIMAL_PRECISION = 38


class SchemaMismatchError(ValueError):
    """A stored batch whose columns do not fit the read schema."""


class Conversion(enum.Enum):
    """What a stored column needs to have its read type."""

    NONE = "none"  # the same type
    RELABEL = "relabel"  # the same data, other field names or looser nullability: a view
    CAST = "cast"  # values change representation (an Arrow cast)


def _same_family(source: pa.DataType, target: pa.DataType, family) -> bool:
    return any(test(source) for test in family) and any(test(target) for test in family)


def widens(source: pa.DataType, target: pa.DataType) -> bool:
    """Whether every value of the (non-nested) ``source`` type is kept exactly as ``target``.

    int8 -> int16 -> int32 -> int64, float16 -> float32 -> float64, a decimal to one with at
    least as many digits on both sides of the point, date -> timestamp (midnight; UTC for a
    time zone aware timestamp), a timestamp to a finer unit (or, both zone aware, another
    zone: the same instants), string <-> large_string, binary <-> large_binary, and null (no
    values) to anything.
    """
    if source.equals(target) or pa.types.is_null(source):
        return True
    if pa.types.is_signed_integer(source) and pa.types.is_signed_integer(target):
        return source.bit_width <= target.bit_width
    if pa.types.is_floating(source) and pa.types.is_floating(target):
        return source.bit_width <= target.bit_width
    if pa.types.is_decimal(source) and pa.types.is_decimal(target):
        return (target.scale >= source.scale
                and target.precision - target.scale >= source.precision - source.scale)
    if pa.types.is_date(source) and pa.types.is_timestamp(target):
        return True
    if pa.types.is_timestamp(source) and pa.types.is_timestamp(target):
        return (_TIME_UNITS.index(source.unit) <= _TIME_UNITS.index(target.unit)
                and (source.tz is None) == (target.tz is None))
    return _same_family(source, target, _STRINGS) or _same_family(source, target, _BINARIES)


def _is_nested(dtype: pa.DataType) -> bool:
    return pa.types.is_struct(dtype) or pa.types.is_map(dtype) or any(
        test(dtype) for test in _LISTS)


def _mismatch(path: str, source: pa.DataType, target: pa.DataType) -> str:
    if not _is_nested(source) and not _is_nested(target) and widens(target, source):
        why = "a narrowing, which could lose values"
    else:
        why = "unrelated types"
    return (f"column '{path}' is {source} in the stored batch but {target} in the read "
            f"schema: {why}")


def missing_problem(path: str) -> str:
    return (f"column '{path}' is missing from the stored batch and the read schema says it "
            "cannot be null")


def type_problems(source: pa.DataType, target: pa.DataType, path: str) -> list[str]:
    """Why a stored column of type ``source`` (at ``path``) cannot be read as ``target``;
    empty when it can."""
    if source.equals(target) or pa.types.is_null(source):
        return []
    if pa.types.is_struct(source) and pa.types.is_struct(target):
        problems: list[str] = []
        for field in target:
            index = source.get_field_index(field.name)
            inner = f"{path}.{field.name}"
            if index < 0:
                if not field.nullable:
                    problems.append(missing_problem(inner))
            else:
                problems += _field_problems(source.field(index), field, inner)
        return problems
    if _same_family(source, target, _LISTS):
        return _field_problems(source.value_field, target.value_field, f"{path}[]")
    if pa.types.is_map(source) and pa.types.is_map(target):
        return (type_problems(source.key_type, target.key_type, f"{path}[key]")
                + _field_problems(source.item_field, target.item_field, f"{path}[value]"))
    if _is_nested(source) or _is_nested(target) or not widens(source, target):
        return [_mismatch(path, source, target)]
    return []


def _field_problems(source: pa.Field, target: pa.Field, path: str) -> list[str]:
    """``type_problems`` of a nested field, which must also not tighten nullability: nulls
    inside nested values are not checked value by value (only top-level columns are)."""
    if not _loosens(source, target):
        return [f"column '{path}' may hold nulls in the stored batch but the read schema says "
                "it cannot be null"]
    return type_problems(source.type, target.type, path)


def conversion(source: pa.DataType, target: pa.DataType) -> Conversion:
    """What a column of ``source`` (which ``type_problems`` accepts) needs to be ``target``."""
    if source.equals(target):
        return Conversion.NONE
    return Conversion.RELABEL if _relabels(source, target) else Conversion.CAST


def _relabels(source: pa.DataType, target: pa.DataType) -> bool:
    """Whether ``source`` data already is ``target`` data: the same physical types and struct
    fields in order, differing only in names of list/map fields and in nullability that the
    target loosens (so a zero-copy view serves, with nothing to check)."""
    if source.id != target.id or source.num_fields != target.num_fields:
        return False
    if pa.types.is_struct(source):
        return all(s.name == t.name and _loosens(s, t) and _relabels(s.type, t.type)
                   for s, t in zip(source, target, strict=True))
    if source.num_fields:  # list, large_list, map: one child field each
        child_s, child_t = source.field(0), target.field(0)
        return _loosens(child_s, child_t) and _relabels(child_s.type, child_t.type)
    return source.equals(target)


def _loosens(source: pa.Field, target: pa.Field) -> bool:
    """Whether ``target``'s nullability admits everything ``source``'s does."""
    return target.nullable or not source.nullable


@dataclass(frozen=True)
class ColumnPlan:
    """How one read column comes from a stored batch's column."""

    name: str
    index: int  # in the stored batch
    conversion: Conversion
    type: pa.DataType  # the read type
    refuse_nulls: bool  # the stored column may hold nulls, the read column may not


@dataclass
class SchemaPlan:
    """How batches of one stored schema become the read columns (see ``plan_schema``)."""

    columns: list[ColumnPlan] = dataclass_field(default_factory=list)
    null_columns: list[tuple[str, pa.DataType]] = dataclass_field(default_factory=list)
    problems: list[str] = dataclass_field(default_factory=list)


def plan_schema(stored: pa.Schema, read: Iterable[pa.Field],
                filled: Collection[str] = ()) -> SchemaPlan:
    """Resolve the ``stored`` schema of a batch against the ``read`` fields, by name.

    Read fields the batch lacks become null columns (``filled`` names are left out: the
    caller fills them otherwise); ``problems`` lists every column that cannot be read.
    """
    plan = SchemaPlan()
    names = set(stored.names)
    for wanted in read:
        index = stored.get_field_index(wanted.name) if wanted.name in names else -1
        if index < 0:
            if wanted.name in filled:
                continue
            if wanted.nullable:
                plan.null_columns.append((wanted.name, wanted.type))
            else:
                plan.problems.append(missing_problem(wanted.name))
            continue
        source = stored.field(index)
        found = type_problems(source.type, wanted.type, wanted.name)
        if found:
            plan.problems += found
            continue
        plan.columns.append(ColumnPlan(wanted.name, index, conversion(source.type, wanted.type),
                                       wanted.type, source.nullable and not wanted.nullable))
    return plan


def schema_text(schema: pa.Schema) -> str:
    """``name type, ...`` of a schema, for messages."""
    return ", ".join(f"{f.name} {f.type}" for f in schema)


def merge_types(a: pa.DataType, b: pa.DataType, path: str) -> pa.DataType:
    """The type both ``a`` and ``b`` are read as when a schema unions them (``mergeSchema``):
    the wider of the two, struct fields unioned by name; ``ValueError`` when neither widens to
    a common type."""
    if a.equals(b) or pa.types.is_null(b):
        return a
    if pa.types.is_null(a):
        return b
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        return pa.struct(merge_fields(list(a), list(b), path))
    if _same_family(a, b, _LISTS):
        item = _merge_field(a.value_field, b.value_field, f"{path}[]")
        return (pa.large_list(item) if pa.types.is_large_list(a) or pa.types.is_large_list(b)
                else pa.list_(item))
    if pa.types.is_map(a) and pa.types.is_map(b):
        key = merge_types(a.key_type, b.key_type, f"{path}[key]")
        item = _merge_field(a.item_field, b.item_field, f"{path}[value]")
        return pa.map_(pa.field(a.key_field.name, key, nullable=False), item)
    if pa.types.is_decimal(a) and pa.types.is_decimal(b):
        scale = max(a.scale, b.scale)
        precision = scale + max(a.precision - a.scale, b.precision - b.scale)
        if precision <= MAX_DECIMAL_PRECISION:
            return pa.decimal128(precision, scale)
    elif not _is_nested(a) and not _is_nested(b):
        if widens(a, b):
            return b
        if widens(b, a):
            return a
    raise ValueError(f"column '{path}' is {a} in one batch and {b} in another, and neither "
                     "widens to a type that holds both")


def _merge_field(a: pa.Field, b: pa.Field, path: str) -> pa.Field:
    return pa.field(a.name, merge_types(a.type, b.type, path), nullable=a.nullable or b.nullable)


def merge_fields(a: list[pa.Field], b: list[pa.Field], path: str = "") -> list[pa.Field]:
    """``a``'s fields then ``b``'s new ones, by name; a field only one side has may be null."""
    by_name = {f.name: f for f in b}
    out = []
    for field in a:
        other = by_name.get(field.name)
        name = f"{path}.{field.name}" if path else field.name
        out.append(field.with_nullable(True) if other is None
                   else _merge_field(field, other, name))
    names = {f.name for f in a}
    out += [f.with_nullable(True) for f in b if f.name not in names]
    return out


__all__ = ["ColumnPlan", "Conversion", "SchemaMismatchError", "SchemaPlan", "conversion",
           "merge_fields", "merge_types", "missing_problem", "plan_schema", "schema_text",
           "type_problems", "widens"]
