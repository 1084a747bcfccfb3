"""Layers import only downward: protocol <- transport <- client <- server, spark <- bench <-
commands <- cli (docs/ARCHITECTURE.md), no module imports itself through others (an import
cycle, type-only imports counted), and the Spark layer never builds wire messages: it asks the
client."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "sbp_spark"

# For each layer, the sbp_spark layers it may import (besides itself).
ALLOWED = {
    "protocol": set(),
    "transport": {"protocol"},
    "client": {"protocol", "transport"},
    "server": {"protocol", "transport", "client"},
    "spark": {"protocol", "transport", "client"},
    "bench": {"protocol", "transport", "client", "server", "spark"},
    "commands": {"protocol", "transport", "client", "server", "spark", "bench"},
    "cli": {"protocol", "transport", "client", "server", "spark", "bench", "commands"},
}
# Layers that are single modules at the package's top (the command-line entry points).
MODULE_LAYERS = {"cli": ["cli.py"]}
FORBIDDEN_THIRD_PARTY = {
    "protocol": {"socket", "threading", "pyspark", "selectors", "asyncio"},
    "transport": {"pyspark"},
    "client": {"pyspark"},
    "server": {"pyspark"},
}
# What builds or parses frames and headers: the client's business. The Spark layer may name
# these types for a type checker (under TYPE_CHECKING), never use them at run time.
WIRE_MODULES = ("sbp_spark.protocol.messages", "sbp_spark.protocol.frame",
                "sbp_spark.protocol._flatbuf", "sbp_spark.protocol._fastpath",
                "sbp_spark.protocol._generated")

def _module_name(path: Path) -> str:
    return ".".join(("sbp_spark",) + path.relative_to(PACKAGE).with_suffix("").parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, runtime_only: bool = False) -> set[str]:
    """Every module ``path`` imports (relative imports resolved); with ``runtime_only``,
    leaving out the imports under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path).rsplit(".", 1)[0]
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if runtime_only and isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against the file's package
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
                names.add(base)
                if not node.module:  # "from . import x": x may be a module
                    names.update(f"{base}.{alias.name}" for alias in node.names)
            elif node.module:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return names


def _layer_files(layer: str) -> list[Path]:
    if layer in MODULE_LAYERS:
        return [PACKAGE / name for name in MODULE_LAYERS[layer]]
    return [p for p in (PACKAGE / layer).rglob("*.py") if "_generated" not in p.parts]


def _layer_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "sbp_spark" or len(parts) < 2:
        return None
    for layer, files in MODULE_LAYERS.items():
        if f"{parts[1]}.py" in files:
            return layer
    return parts[1] if parts[1] in ALLOWED else None


def test_every_layer_has_files():
    for layer in ALLOWED:
        files = _layer_files(layer)
        assert files and all(f.is_file() for f in files), layer


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_only_downward(layer):
    offenders = []
    for path in _layer_files(layer):
        for name in _imports(path):
            target = _layer_of(name)
            if target is not None and target != layer and target not in ALLOWED[layer]:
                offenders.append(f"{path.relative_to(PACKAGE)} imports {name}")
            if name.split(".")[0] in FORBIDDEN_THIRD_PARTY.get(layer, set()):
                offenders.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not offenders, "layering broken:\n" + "\n".join(sorted(set(offenders)))


def test_no_import_cycles():
    found = [sorted(c) for c in _cycles(_import_graph())]
    assert not found, "modules that import each other (give the part the narrow interface it " \
        "uses instead of its owner):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_spark_layer_does_not_build_wire_messages():
    offenders = sorted(
        f"{path.relative_to(PACKAGE)} imports {name}"
        for path in _layer_files("spark")
        for name in _imports(path, runtime_only=True)
        if name.startswith(WIRE_MODULES))
    assert not offenders, ("the Spark layer must ask the client (sbp_spark.client) instead of "
                           "building wire messages:\n" + "\n".join(offenders))


# -- the range server and its storage -----------------------------------------------------------

RANGE_SERVER = "sbp_spark.server.range_server"
STORAGE = "sbp_spark.server.storage"


def _package_modules() -> dict[str, Path]:
    """Every module of the package by name (a package by its own name, not ``__init__``)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        if "_generated" in path.parts:
            continue
        name = _module_name(path)
        out[name.removesuffix(".__init__")] = path
    return out


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, type-only imports included (an import of a
    name is one of the module that defines it)."""
    modules = _package_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for imported in _imports(path):
            parts = imported.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            if parts and ".".join(parts) != name:
                targets.add(".".join(parts))
        graph[name] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph``: its strongly connected components of two or more
    modules (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            step = next(targets, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_range_server_and_its_storage_import_in_no_cycle():
    cycles = [c for c in _cycles(_import_graph())
              if any(m.startswith((RANGE_SERVER, STORAGE)) for m in c)]
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_part_of_the_range_server_imports_its_owner():
    owner = f"{RANGE_SERVER}.server"
    graph = _import_graph()
    offenders = sorted(m for m, targets in graph.items()
                       if m.startswith(f"{RANGE_SERVER}.") and owner in targets)
    assert not offenders, f"{owner} builds the parts; they must not import it: {offenders}"


def test_the_storage_imports_nothing_of_the_range_server():
    graph = _import_graph()
    offenders = sorted(f"{m} imports {t}" for m, targets in graph.items()
                       if m.startswith(STORAGE) for t in targets if t.startswith(RANGE_SERVER))
    assert not offenders, offenders


def test_the_cycle_finder_finds_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": {"d"}, "f": set()}
    assert sorted(_cycles(graph)) == [["a", "b", "c"], ["d", "e"]]


def test_the_checks_see_what_they_look_for():
    # The rules above are only as good as the import finder: it must see relative imports,
    # "from x import module", and skip type-only imports when asked.
    spark = PACKAGE / "spark" / "cluster_access.py"
    assert "sbp_spark.protocol.messages" in _imports(spark)
    assert "sbp_spark.protocol.messages" not in _imports(spark, runtime_only=True)
    assert "sbp_spark.spark.planning" in _imports(spark)
    assert "sbp_spark.protocol._fastpath" in _imports(PACKAGE / "protocol" / "messages.py")
    assert _layer_of("sbp_spark.cli") == "cli" and _layer_of("sbp_spark.bench.codec") == "bench"
    # Type-only imports count for cycles: a module named only under TYPE_CHECKING is an edge.
    graph = _import_graph()
    assert "sbp_spark.server.storage.range_log" in graph["sbp_spark.server.range_server.metrics"]
    assert "sbp_spark.server.storage.store" in graph["sbp_spark.server.range_server.server"]
    assert "sbp_spark.protocol.messages" in graph["sbp_spark.spark.cluster_access"]
