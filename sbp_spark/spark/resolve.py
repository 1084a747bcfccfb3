"""Schema resolution for payload=arrow: which stored Arrow types may be read as which.

A payload=arrow stream keeps each batch's own Arrow schema, so a stream that outlives its
producer's first schema holds batches of several schemas. A read resolves every stored batch
against the read schema by column name, recursively inside structs, lists and maps:

- names match ignoring case unless the session sets ``spark.sql.caseSensitive=true``, as in
  Spark's file sources; a read name that matches several stored names differing only by case
  is ambiguous, an error;
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
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field

import pyarrow as pa

_TIME_UNITS = ("s", "ms", "us", "ns")  # coarsest first
# A fixed-size list (another writer's) is read as a list: Spark has no fixed-size arrays.
_LISTS = (pa.types.is_list, pa.types.is_large_list, pa.types.is_fixed_size_list)
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
    zone: the same instants), a time of day to a finer unit, string <-> large_string, binary
    <-> large_binary, fixed-size binary to binary, a dictionary-encoded column (another
    writer's encoding) to what its values widen to, and null (no values) to anything.
    """
    if source.equals(target) or pa.types.is_null(source):
        return True
    if pa.types.is_dictionary(source):
        return widens(source.value_type, target)
    if pa.types.is_time(source) and pa.types.is_time(target):
        return _TIME_UNITS.index(source.unit) <= _TIME_UNITS.index(target.unit)
    if pa.types.is_fixed_size_binary(source) and any(test(target) for test in _BINARIES):
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
    if pa.types.is_decimal(source) and pa.types.is_decimal(target):
        why = _decimal_narrowing(source, target)
    elif not _is_nested(source) and not _is_nested(target) and widens(target, source):
        why = "a narrowing, which could lose values"
    else:
        why = "unrelated types"
    return (f"column '{path}' is {source} in the stored batch but {target} in the read "
            f"schema: {why}")


def _decimal_narrowing(source: pa.DataType, target: pa.DataType) -> str:
    """Why a stored decimal cannot be read as ``target`` (a decimal that does not widen it):
    the digits it could lose on each side of the point, and the type that would hold both."""
    source_whole, target_whole = source.precision - source.scale, target.precision - target.scale
    lost = []
    if target_whole < source_whole:
        lost.append(f"{source_whole - target_whole} integer digit"
                    f"{'s' if source_whole - target_whole > 1 else ''}")
    if target.scale < source.scale:
        lost.append(f"{source.scale - target.scale} fraction digit"
                    f"{'s' if source.scale - target.scale > 1 else ''}")
    why = f"a narrowing, which could lose {' and '.join(lost)}"
    scale, whole = max(source.scale, target.scale), max(source_whole, target_whole)
    if scale + whole <= MAX_DECIMAL_PRECISION:
        why += f" (decimal({scale + whole},{scale}) holds the values of both)"
    return why


def matching_names(names: Sequence[str], wanted: str, case_sensitive: bool) -> list[int]:
    """The indices of ``names`` that ``wanted`` names: the equal one, or (not
    ``case_sensitive``) every one equal ignoring case."""
    if case_sensitive:
        return [i for i, name in enumerate(names) if name == wanted]
    folded = wanted.lower()
    return [i for i, name in enumerate(names) if name.lower() == folded]


def ambiguous_problem(path: str, matches: Iterable[str]) -> str:
    found = ", ".join(f"'{name}'" for name in matches)
    return (f"column '{path}' of the read schema matches columns {found} of the stored batch, "
            "which differ only by case: ambiguous while spark.sql.caseSensitive is false (the "
            "default); set spark.sql.caseSensitive=true to match names exactly")


def case_duplicates(names: Iterable[str]) -> list[list[str]]:
    """Groups of ``names`` that differ only by case (each group in order)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(name.lower(), []).append(name)
    return [group for group in groups.values() if len(group) > 1]


def groups_text(groups: list[list[str]], where: str = "") -> str:
    """``groups`` of column names (under ``where``) as a message names them."""
    return "; ".join(" and ".join(f"'{where}{name}'" for name in group) for group in groups)


def duplicates_problem(groups: list[list[str]], where: str = "") -> str:
    return (f"columns {groups_text(groups, where)} of the read schema differ only by case, "
            "so while spark.sql.caseSensitive is false (the default) they name one column (Spark "
            "refuses such a schema); keep one of each in the schema, or set "
            "spark.sql.caseSensitive=true")


def missing_problem(path: str) -> str:
    return (f"column '{path}' is missing from the stored batch and the read schema says it "
            "cannot be null")


def type_problems(source: pa.DataType, target: pa.DataType, path: str,
                  case_sensitive: bool = True) -> list[str]:
    """Why a stored column of type ``source`` (at ``path``) cannot be read as ``target``
    (struct fields matched by name, ignoring case unless ``case_sensitive``); empty when it
    can."""
    if (source.equals(target) and (case_sensitive or not _is_nested(target))) or (
            pa.types.is_null(source)):
        return []
    if pa.types.is_struct(source) and pa.types.is_struct(target):
        problems: list[str] = []
        if not case_sensitive and (groups := case_duplicates(f.name for f in target)):
            return [duplicates_problem(groups, f"{path}.")]
        names = [f.name for f in source]
        for field in target:
            found = matching_names(names, field.name, case_sensitive)
            inner = f"{path}.{field.name}"
            if not found:
                if not field.nullable:
                    problems.append(missing_problem(inner))
            elif len(found) > 1:
                problems.append(ambiguous_problem(inner, (names[i] for i in found)))
            else:
                problems += _field_problems(source.field(found[0]), field, inner,
                                            case_sensitive)
        return problems
    if _same_family(source, target, _LISTS):
        return _field_problems(source.value_field, target.value_field, f"{path}[]",
                               case_sensitive)
    if pa.types.is_map(source) and pa.types.is_map(target):
        return (type_problems(source.key_type, target.key_type, f"{path}[key]", case_sensitive)
                + _field_problems(source.item_field, target.item_field, f"{path}[value]",
                                  case_sensitive))
    if _is_nested(source) or _is_nested(target) or not widens(source, target):
        return [_mismatch(path, source, target)]
    return []


def _field_problems(source: pa.Field, target: pa.Field, path: str,
                    case_sensitive: bool = True) -> list[str]:
    """``type_problems`` of a nested field, which must also not tighten nullability: nulls
    inside nested values are not checked value by value (only top-level columns are)."""
    if not _loosens(source, target):
        return [f"column '{path}' may hold nulls in the stored batch but the read schema says "
                "it cannot be null"]
    return type_problems(source.type, target.type, path, case_sensitive)


def with_read_names(source: pa.DataType, target: pa.DataType) -> pa.DataType:
    """``source`` with each struct field that matches one of ``target`` ignoring case (and
    ``type_problems`` accepted) spelled as ``target`` spells it, at every level: the same data,
    whose fields Arrow's casts then find by name."""
    if pa.types.is_struct(source) and pa.types.is_struct(target):
        spelled = {f.name.lower(): f for f in target}
        fields = []
        for field in source:
            wanted = spelled.get(field.name.lower())
            if wanted is None:
                fields.append(field)
            else:
                fields.append(pa.field(wanted.name, with_read_names(field.type, wanted.type),
                                       field.nullable, field.metadata))
        return pa.struct(fields)
    if _same_family(source, target, _LISTS):
        item = source.value_field
        item = item.with_type(with_read_names(item.type, target.value_type))
        if pa.types.is_fixed_size_list(source):
            return pa.list_(item, source.list_size)
        return pa.large_list(item) if pa.types.is_large_list(source) else pa.list_(item)
    if pa.types.is_map(source) and pa.types.is_map(target):
        key, item = source.key_field, source.item_field
        return pa.map_(key.with_type(with_read_names(key.type, target.key_type)),
                       item.with_type(with_read_names(item.type, target.item_type)),
                       source.keys_sorted)
    return source


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
    # CAST only: the type to view the stored column as first (struct fields spelled as the
    # read schema spells them, when they matched ignoring case)
    view_as: pa.DataType | None = None


@dataclass
class SchemaPlan:
    """How batches of one stored schema become the read columns (see ``plan_schema``)."""

    columns: list[ColumnPlan] = dataclass_field(default_factory=list)
    null_columns: list[tuple[str, pa.DataType]] = dataclass_field(default_factory=list)
    problems: list[str] = dataclass_field(default_factory=list)


def plan_schema(stored: pa.Schema, read: Iterable[pa.Field],
                filled: Collection[str] = (), case_sensitive: bool = True) -> SchemaPlan:
    """Resolve the ``stored`` schema of a batch against the ``read`` fields, by name (ignoring
    case unless ``case_sensitive``; the read schema's names have no duplicates then).

    Read fields the batch lacks become null columns (``filled`` names are left out: the
    caller fills them otherwise); ``problems`` lists every column that cannot be read.
    """
    plan = SchemaPlan()
    names = stored.names
    for wanted in read:
        found = matching_names(names, wanted.name, case_sensitive)
        if len(found) != 1:
            if len(found) > 1:
                plan.problems.append(ambiguous_problem(wanted.name, (names[i] for i in found)))
            elif wanted.name in filled:
                continue
            elif wanted.nullable:
                plan.null_columns.append((wanted.name, wanted.type))
            else:
                plan.problems.append(missing_problem(wanted.name))
            continue
        index = found[0]
        source = stored.field(index)
        problems = type_problems(source.type, wanted.type, wanted.name, case_sensitive)
        if problems:
            plan.problems += problems
            continue
        spelled = source.type if case_sensitive else with_read_names(source.type, wanted.type)
        how = conversion(spelled, wanted.type)
        view_as = None
        if not spelled.equals(source.type):
            if how is Conversion.CAST:
                view_as = spelled
            else:  # the stored data is the read data, under other names: a view serves
                how = Conversion.RELABEL
        plan.columns.append(ColumnPlan(wanted.name, index, how, wanted.type,
                                       source.nullable and not wanted.nullable, view_as))
    return plan


def schema_text(schema: pa.Schema) -> str:
    """``name type, ...`` of a schema, for messages."""
    return ", ".join(f"{f.name} {f.type}" for f in schema)


def merge_types(a: pa.DataType, b: pa.DataType, path: str,
                folded: list[str] | None = None) -> pa.DataType:
    """The type both ``a`` and ``b`` are read as when a schema unions them (``mergeSchema``):
    the wider of the two, struct fields unioned by name (see ``merge_fields``); ``ValueError``
    when neither widens to a common type."""
    if pa.types.is_dictionary(a):
        a = a.value_type
    if pa.types.is_dictionary(b):
        b = b.value_type
    if a.equals(b) or pa.types.is_null(b):
        return a
    if pa.types.is_null(a):
        return b
    if pa.types.is_struct(a) and pa.types.is_struct(b):
        return pa.struct(merge_fields(list(a), list(b), path, folded))
    if _same_family(a, b, _LISTS):
        item = _merge_field(a.value_field, b.value_field, f"{path}[]", folded)
        return (pa.large_list(item) if pa.types.is_large_list(a) or pa.types.is_large_list(b)
                else pa.list_(item))
    if pa.types.is_map(a) and pa.types.is_map(b):
        key = merge_types(a.key_type, b.key_type, f"{path}[key]", folded)
        item = _merge_field(a.item_field, b.item_field, f"{path}[value]", folded)
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


def _merge_field(a: pa.Field, b: pa.Field, path: str,
                 folded: list[str] | None = None) -> pa.Field:
    return pa.field(a.name, merge_types(a.type, b.type, path, folded),
                    nullable=a.nullable or b.nullable)


def merge_fields(a: list[pa.Field], b: list[pa.Field], path: str = "",
                 folded: list[str] | None = None) -> list[pa.Field]:
    """``a``'s fields then ``b``'s new ones, by name; a field only one side has may be null.

    Names that differ only by case are one field, spelled as ``a`` spells it (what Spark's
    file sources infer while ``spark.sql.caseSensitive`` is false, its default); each such
    pair is described in ``folded``. A side that itself has names differing only by case keeps
    those apart."""
    by_name = {f.name: f for f in b}
    by_folded = _unique_folded(b)
    a_counts = Counter(f.name.lower() for f in a)
    out = []
    taken = set()
    for field in a:
        other = by_name.get(field.name)
        name = f"{path}.{field.name}" if path else field.name
        if other is None and a_counts[field.name.lower()] == 1:
            other = by_folded.get(field.name.lower())
            if other is not None and folded is not None:
                folded.append(f"'{name}' and '{path + '.' if path else ''}{other.name}'")
        if other is None:
            out.append(field.with_nullable(True))
        else:
            taken.add(other.name)
            out.append(_merge_field(field, other, name, folded))
    out += [f.with_nullable(True) for f in b if f.name not in taken]
    return out


def _unique_folded(fields: list[pa.Field]) -> dict[str, pa.Field]:
    """``fields`` by lower-case name, leaving out names that several of them have."""
    counts = Counter(f.name.lower() for f in fields)
    return {f.name.lower(): f for f in fields if counts[f.name.lower()] == 1}


__all__ = ["ColumnPlan", "Conversion", "SchemaMismatchError", "SchemaPlan", "ambiguous_problem",
           "case_duplicates", "conversion", "duplicates_problem", "groups_text", "matching_names",
           "merge_fields", "merge_types", "missing_problem", "plan_schema", "schema_text",
           "type_problems", "widens", "with_read_names"]
