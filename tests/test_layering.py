"""Layers import only downward: protocol <- client <- server, spark (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "sbp_spark"

# For each layer, the sbp_spark layers it may import (besides itself).
ALLOWED = {
    "protocol": set(),
    "client": {"protocol"},
    "server": {"protocol", "client"},
    "spark": {"protocol", "client"},
}
FORBIDDEN_THIRD_PARTY = {
    "protocol": {"socket", "threading", "pyspark", "selectors", "asyncio"},
    "client": {"pyspark"},
    "server": {"pyspark"},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    names: set[str] = set()
    layer_pkg = "sbp_spark." + path.relative_to(PACKAGE).parts[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against the file's package
                base = ".".join(("sbp_spark",) + path.relative_to(PACKAGE).parts[:-1])
                parts = base.split(".")
                parts = parts[: len(parts) - node.level + 1]
                module = ".".join(parts + ([node.module] if node.module else []))
                names.add(module or layer_pkg)
            elif node.module:
                names.add(node.module)
    return names


def _layer_files(layer: str) -> list[Path]:
    return [p for p in (PACKAGE / layer).rglob("*.py") if "_generated" not in p.parts]


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_only_downward(layer):
    offenders = []
    for path in _layer_files(layer):
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "sbp_spark" and len(parts) > 1 and parts[1] in ALLOWED:
                if parts[1] != layer and parts[1] not in ALLOWED[layer]:
                    offenders.append(f"{path.relative_to(PACKAGE)} imports {name}")
            if parts[0] in FORBIDDEN_THIRD_PARTY.get(layer, set()):
                offenders.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not offenders, "layering broken:\n" + "\n".join(offenders)
