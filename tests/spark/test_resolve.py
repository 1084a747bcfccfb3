"""The schema resolution rules of payload=arrow reads, type by type (no cluster, no Spark)."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal

import pyarrow as pa
import pytest

from sbp_spark.spark.resolve import (
    Conversion,
    conversion,
    merge_fields,
    merge_types,
    plan_schema,
    type_problems,
    widens,
)

WIDENINGS = [
    (pa.int8(), pa.int16()), (pa.int8(), pa.int64()), (pa.int16(), pa.int32()),
    (pa.int32(), pa.int64()),
    (pa.float16(), pa.float32()), (pa.float32(), pa.float64()),
    (pa.decimal128(5, 2), pa.decimal128(7, 3)), (pa.decimal128(5, 2), pa.decimal128(5, 2)),
    (pa.decimal128(10, 0), pa.decimal128(38, 10)),
    (pa.date32(), pa.timestamp("us", tz="UTC")), (pa.date32(), pa.timestamp("us")),
    (pa.timestamp("ms", tz="UTC"), pa.timestamp("us", tz="UTC")),
    (pa.timestamp("us", tz="Europe/Paris"), pa.timestamp("us", tz="UTC")),
    (pa.timestamp("s"), pa.timestamp("us")),
    (pa.string(), pa.large_string()), (pa.large_string(), pa.string()),
    (pa.binary(), pa.large_binary()), (pa.large_binary(), pa.binary()),
    (pa.null(), pa.int32()), (pa.null(), pa.struct([("a", pa.string())])),
    # other Arrow writers' encodings of Spark's values
    (pa.time32("s"), pa.time64("ns")), (pa.time64("us"), pa.time64("ns")),
    (pa.binary(2), pa.binary()), (pa.binary(2), pa.large_binary()),
    (pa.dictionary(pa.int8(), pa.string()), pa.string()),
    (pa.dictionary(pa.int32(), pa.int16()), pa.int64()),
]

REFUSED = [
    # narrowings
    (pa.int64(), pa.int32(), "a narrowing"), (pa.int16(), pa.int8(), "a narrowing"),
    (pa.float64(), pa.float32(), "a narrowing"),
    (pa.decimal128(10, 2), pa.decimal128(10, 3),
     "a narrowing, which could lose 1 integer digit (decimal(11,3) holds the values of both)"),
    (pa.decimal128(10, 2), pa.decimal128(12, 1),
     "a narrowing, which could lose 1 fraction digit (decimal(13,2) holds the values of both)"),
    (pa.decimal128(10, 4), pa.decimal128(8, 3),
     "could lose 1 integer digit and 1 fraction digit (decimal(10,4) holds"),
    (pa.decimal128(38, 2), pa.decimal128(38, 4),
     "a narrowing, which could lose 2 integer digits"),
    (pa.decimal128(12, 2), pa.decimal128(10, 2), "a narrowing"),
    (pa.timestamp("us", tz="UTC"), pa.date32(), "a narrowing"),
    (pa.timestamp("ns", tz="UTC"), pa.timestamp("us", tz="UTC"), "a narrowing"),
    # unrelated
    (pa.string(), pa.int64(), "unrelated"), (pa.int64(), pa.string(), "unrelated"),
    (pa.int32(), pa.float64(), "unrelated"), (pa.binary(), pa.string(), "unrelated"),
    (pa.timestamp("us", tz="UTC"), pa.timestamp("us"), "unrelated"),
    (pa.uint8(), pa.int16(), "unrelated"),
    (pa.time64("ns"), pa.time64("us"), "a narrowing"), (pa.binary(3), pa.string(), "unrelated"),
    (pa.dictionary(pa.int8(), pa.int64()), pa.int32(), "unrelated"),
    (pa.list_(pa.int32()), pa.int32(), "unrelated"),
    (pa.struct([("a", pa.int32())]), pa.list_(pa.int32()), "unrelated"),
]


def sample(dtype: pa.DataType) -> pa.Array | None:
    """Extreme and ordinary values of ``dtype``, and a null (None: no Python values)."""
    if pa.types.is_integer(dtype):
        return pa.array([-(2 ** (dtype.bit_width - 1)), 2 ** (dtype.bit_width - 1) - 1, None],
                        dtype)
    if pa.types.is_float16(dtype):
        return None
    if pa.types.is_floating(dtype):
        return pa.array([1.5, -3.4e38, None], dtype)
    if pa.types.is_decimal(dtype):
        digits = "9" * (dtype.precision - dtype.scale) + "." + "9" * dtype.scale
        return pa.array([Decimal("-" + digits.rstrip(".")), None], dtype)
    if pa.types.is_date(dtype):
        return pa.array([dt.date(2024, 2, 29), None], dtype)
    if pa.types.is_timestamp(dtype):
        return pa.array([1_700_000_000, None], pa.int64()).cast(dtype)
    if pa.types.is_string(dtype) or pa.types.is_large_string(dtype):
        return pa.array(["é", None], dtype)
    if (pa.types.is_binary(dtype) or pa.types.is_large_binary(dtype)
            or pa.types.is_fixed_size_binary(dtype)):
        return pa.array([b"\x00\xff", None], dtype)
    if pa.types.is_time(dtype):
        return pa.array([dt.time(23, 59, 59), None], dtype)
    if pa.types.is_dictionary(dtype):
        values = sample(dtype.value_type)
        return None if values is None else values.dictionary_encode().cast(dtype)
    return pa.nulls(2)


@pytest.mark.parametrize(("source", "target"), WIDENINGS)
def test_safe_widenings_are_accepted_and_keep_every_value(source, target):
    assert widens(source, target)
    assert type_problems(source, target, "c") == []
    array = sample(source)
    if array is not None and not pa.types.is_null(source):
        # every value survives the widening (and comes back unchanged)
        if pa.types.is_dictionary(source):
            array = array.dictionary_decode()
        assert array.cast(target).cast(array.type).equals(array)


@pytest.mark.parametrize(("source", "target", "why"), REFUSED)
def test_narrowing_and_unrelated_types_are_refused_with_both_types(source, target, why):
    [problem] = type_problems(source, target, "col")
    assert problem.startswith(f"column 'col' is {source} in the stored batch but {target} in "
                              "the read schema")
    assert why in problem


def test_rules_apply_inside_structs_lists_and_maps_with_paths():
    stored = pa.struct([
        ("a", pa.int32()),
        ("gone", pa.string()),  # dropped: the read type lacks it
        ("items", pa.list_(pa.struct([("n", pa.int16())]))),
        ("tags", pa.map_(pa.string(), pa.float32())),
    ])
    wider = pa.struct([
        ("items", pa.large_list(pa.struct([("n", pa.int64()), ("new", pa.string())]))),
        ("a", pa.int64()),
        ("added", pa.float64()),
        ("tags", pa.map_(pa.large_string(), pa.float64())),
    ])
    assert type_problems(stored, wider, "s") == []
    narrower = pa.struct([
        ("a", pa.int16()),
        ("items", pa.list_(pa.struct([("n", pa.int8())]))),
        ("tags", pa.map_(pa.int32(), pa.float16())),
        pa.field("required", pa.int32(), nullable=False),
    ])
    problems = type_problems(stored, narrower, "s")
    assert [p.split(" is ")[0] for p in problems] == [
        "column 's.a'", "column 's.items[].n'", "column 's.tags[key]'",
        "column 's.tags[value]'", "column 's.required'"]
    assert problems[-1].endswith("is missing from the stored batch and the read schema says "
                                 "it cannot be null")
    # a nested field may loosen its nullability, never tighten it (nulls inside nested values
    # are not checked one by one)
    strict = pa.struct([pa.field("a", pa.int32(), nullable=False)])
    loose = pa.struct([pa.field("a", pa.int32())])
    assert type_problems(strict, loose, "s") == []
    assert type_problems(loose, strict, "s") == [
        "column 's.a' may hold nulls in the stored batch but the read schema says it cannot "
        "be null"]


def test_conversion_is_none_a_zero_copy_relabel_or_a_cast():
    assert conversion(pa.int64(), pa.int64()) is Conversion.NONE
    element = pa.list_(pa.field("element", pa.int64(), nullable=False))
    assert conversion(element, pa.list_(pa.int64())) is Conversion.RELABEL
    strict = pa.struct([pa.field("a", pa.int32(), nullable=False)])
    assert conversion(strict, pa.struct([("a", pa.int32())])) is Conversion.RELABEL
    assert conversion(pa.int32(), pa.int64()) is Conversion.CAST
    assert conversion(pa.struct([("a", pa.int32()), ("b", pa.int32())]),
                      pa.struct([("b", pa.int32()), ("a", pa.int32())])) is Conversion.CAST
    array = pa.array([{"a": 1}], strict)
    assert array.view(pa.struct([("a", pa.int32())])).to_pylist() == [{"a": 1}]


def test_plan_schema_fills_nulls_skips_filled_names_and_lists_every_problem():
    stored = pa.schema([("id", pa.int32()), ("name", pa.string()), ("old", pa.int8())])
    read = [pa.field("id", pa.int64(), nullable=False), pa.field("name", pa.string()),
            pa.field("score", pa.float64()), pa.field("offset", pa.int64())]
    plan = plan_schema(stored, read, filled={"offset"})
    assert plan.problems == []
    assert [(c.name, c.index, c.conversion, c.refuse_nulls) for c in plan.columns] == [
        ("id", 0, Conversion.CAST, True), ("name", 1, Conversion.NONE, False)]
    assert plan.null_columns == [("score", pa.float64())]
    bad = plan_schema(stored, [pa.field("id", pa.int16()), pa.field("req", pa.int8(), False)])
    assert len(bad.problems) == 2 and "'id' is int32" in bad.problems[0]


def test_merge_types_unions_by_name_and_widens():
    assert merge_types(pa.int32(), pa.int64(), "c") == pa.int64()
    assert merge_types(pa.float64(), pa.float32(), "c") == pa.float64()
    assert merge_types(pa.decimal128(5, 2), pa.decimal128(6, 0), "c") == pa.decimal128(8, 2)
    assert merge_types(pa.null(), pa.string(), "c") == pa.string()
    merged = merge_types(pa.struct([("a", pa.int32()), ("b", pa.string())]),
                         pa.struct([pa.field("c", pa.int8(), False), ("a", pa.int64())]), "s")
    assert merged == pa.struct([("a", pa.int64()), ("b", pa.string()), ("c", pa.int8())])
    assert merge_types(pa.list_(pa.int8()), pa.large_list(pa.int16()), "l") == pa.large_list(
        pa.int16())
    with pytest.raises(ValueError, match=r"column 's.a' is int32 in one batch and string in "
                                         "another"):
        merge_types(pa.struct([("a", pa.int32())]), pa.struct([("a", pa.string())]), "s")
    with pytest.raises(ValueError, match="neither widens"):
        merge_types(pa.decimal128(38, 0), pa.decimal128(38, 10), "d")
    fields = merge_fields([pa.field("id", pa.int32(), False), pa.field("name", pa.string())],
                          [pa.field("id", pa.int64(), False), pa.field("score", pa.float64())])
    assert fields == [pa.field("id", pa.int64(), False), pa.field("name", pa.string()),
                      pa.field("score", pa.float64())]


def test_names_match_ignoring_case_at_every_level_unless_case_sensitive():
    stored = pa.schema([("Amount", pa.int32()),
                        ("Info", pa.map_(pa.string(), pa.struct([("Code", pa.int32()),
                                                                 ("x", pa.int8())])))])
    read = [pa.field("amount", pa.int64()),
            pa.field("info", pa.map_(pa.string(), pa.struct([("code", pa.int64())])))]
    plan = plan_schema(stored, read, case_sensitive=False)
    assert plan.problems == [] and [c.name for c in plan.columns] == ["amount", "info"]
    info = plan.columns[1]
    stored_info = pa.array([[("k", {"Code": 7, "x": 1})]], stored.field("Info").type)
    assert stored_info.view(info.view_as).cast(info.type).to_pylist() == [[("k", {"code": 7})]]
    exact = plan_schema(stored, read, case_sensitive=True)
    assert exact.columns == [] and [n for n, _ in exact.null_columns] == ["amount", "info"]
    # one read name, two stored spellings: ambiguous, whichever level
    twice = pa.schema([("st", pa.struct([("ID", pa.int64()), ("id", pa.int64())]))])
    [problem] = plan_schema(twice, [pa.field("st", pa.struct([("id", pa.int64())]))],
                            case_sensitive=False).problems
    assert problem.startswith("column 'st.id' of the read schema matches columns 'ID', 'id'")


def test_merge_schema_takes_nested_names_differing_by_case_for_one_field():
    folded: list[str] = []
    a = [pa.field("st", pa.struct([("Code", pa.int32())]))]
    b = [pa.field("ST", pa.struct([("code", pa.int64()), ("more", pa.string())]))]
    assert merge_fields(a, b, folded=folded) == [
        pa.field("st", pa.struct([("Code", pa.int64()), ("more", pa.string())]))]
    assert folded == ["'st' and 'ST'", "'st.Code' and 'st.code'"]
    # a batch that itself has both spellings keeps them apart
    both = [pa.field("ID", pa.int64()), pa.field("id", pa.int64())]
    assert [f.name for f in merge_fields(both, [pa.field("Id", pa.int64())])] == [
        "ID", "id", "Id"]
