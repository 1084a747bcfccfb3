"""What ``pip install sbp-spark`` brings and what a packager gets.

The declared dependencies are what the runtime imports, with floors and no exact pin; the
command line, client and servers run without pyspark, and the commands that need Spark say
what to install; the sdist and wheel built from this checkout hold the runtime, its licence
and complete metadata, and pass ``twine check`` (marked slow: the build takes a few seconds;
``python -m pytest -m slow tests/test_packaging.py``). integration/versions installs the wheel
for real, next to every pyspark 4.x and on a host without one.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import re
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import pytest

import sbp_spark
from tests.dists import distributions
from tests.processes import spawn, stop

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "sbp_spark"
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
EXTRAS = PROJECT["optional-dependencies"]
# The Apache License 2.0 as the Apache Software Foundation publishes it (LICENSE-2.0.txt).
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
URL = "https://github.com/sbp-spark/sbp-spark"
CLI_TIMEOUT_S = 120
SERVER_START_TIMEOUT_S = 60.0


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower()


# -- the dependencies are what the runtime imports ---------------------------------------------

# Import name -> the distribution that provides it.
DISTRIBUTION = {"pyarrow": "pyarrow", "isal": "isal", "pyspark": "pyspark", "py4j": "pyspark",
                "matplotlib": "matplotlib", "prometheus_client": "prometheus_client",
                "jwt": "pyjwt", "cryptography": "cryptography"}


def _runtime_imports(path: Path) -> set[str]:
    """Top-level names of the modules ``path`` imports when it runs (anywhere in the file,
    but not under ``if TYPE_CHECKING:``), without the standard library and the package."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            return
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names.add(node.module.split(".")[0])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return names - set(sys.stdlib_module_names) - {"__future__", "sbp_spark", "pyspark_sbp"}


def _may_use(path: Path) -> set[str]:
    """The extras' distributions ``path`` may import: pyspark in the parts that run Spark (the
    connector, the benchmark, the demo, the environment checks), matplotlib for the chart."""
    relative = path.relative_to(REPO).as_posix()
    allowed = set()
    if relative.startswith(("sbp_spark/spark/", "sbp_spark/bench/")) or relative in (
            "sbp_spark/commands/demo.py", "sbp_spark/environment.py", "pyspark_sbp.py"):
        allowed.add("pyspark")
    if relative == "sbp_spark/bench/plot.py":
        allowed.add("matplotlib")
    return allowed


def test_runtime_dependencies_are_what_the_runtime_imports():
    runtime = {_name(r) for r in PROJECT["dependencies"]}
    extras = {_name(r) for extra in ("spark", "bench") for r in EXTRAS[extra]}
    used: set[str] = set()
    for path in [*sorted(PACKAGE.rglob("*.py")), REPO / "pyspark_sbp.py"]:
        imported = _runtime_imports(path)
        unknown = imported - set(DISTRIBUTION)
        assert not unknown, f"{path.relative_to(REPO)} imports {unknown}, which no dependency " \
                            "or extra provides"
        dists = {DISTRIBUTION[name] for name in imported}
        assert dists <= runtime | _may_use(path), \
            f"{path.relative_to(REPO)} imports {dists - runtime}, not a runtime dependency"
        used |= dists
    assert runtime <= used, f"declared but never imported: {runtime - used}"
    assert used - runtime == extras == {"pyspark", "matplotlib"}


def test_what_users_install_has_floors_and_no_exact_pin():
    for requirement in PROJECT["dependencies"] + EXTRAS["spark"] + EXTRAS["bench"]:
        assert ">=" in requirement, f"{requirement}: no floor"
        assert not re.search(r"===?|~=", requirement), f"{requirement}: an exact pin"
    assert "pyspark" not in {_name(r) for r in PROJECT["dependencies"]}
    # The test extra brings everything the tests use, pyspark and Spark Connect included.
    test = {_name(r) for r in EXTRAS["test"]}
    assert {"sbp-spark", "pyspark", "pandas", "flatbuffers", "build", "twine"} <= test
    assert "sbp-spark[spark]" in EXTRAS["test"]


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(f"sbp_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_python_floor_is_the_same_everywhere():
    floor = PROJECT["requires-python"].removeprefix(">=")
    major, minor = floor.split(".")
    pyproject = (REPO / "pyproject.toml").read_text()
    assert f'target-version = "py{major}{minor}"' in pyproject
    assert f'python_version = "{floor}"' in pyproject
    ci = (REPO / ".ci" / "run").read_text()
    assert f"sys.version_info < ({major}, {minor})" in ci and f"Python {floor}+" in ci
    assert f"**Python {floor}+**" in (REPO / "README.md").read_text()
    versions = [c.rsplit(" ", 1)[1] for c in PROJECT["classifiers"]
                if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    assert versions[0] == floor
    # The version matrix runs a platform on the floor, and one on each classifier's Python.
    platforms = _load(REPO / "integration" / "versions" / "platforms.py")
    floors = [p for p in platforms.PLATFORMS if p.floors]
    assert [p.python for p in floors] == [floor]
    assert {p.python for p in platforms.PLATFORMS} == set(versions)


def test_the_version_has_one_source_and_a_changelog_entry():
    assert PROJECT["dynamic"] == ["version"] and "version" not in PROJECT
    changelog = (REPO / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## (\S+)", changelog, flags=re.M)
    assert releases and releases[0] == sbp_spark.__version__


# -- without pyspark ---------------------------------------------------------------------------

# Runs ``sbp`` with pyspark, py4j and flatbuffers unimportable, as in an environment without
# them: what a host that only runs the servers has.
_WITHOUT = """
import sys
class _Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("pyspark", "py4j", "flatbuffers"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Missing())
from sbp_spark.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _sbp_without_pyspark(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _WITHOUT, *args], input=stdin,
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S)


def test_the_servers_and_the_cli_run_without_pyspark(tmp_path):
    ready = tmp_path / "ready.json"
    with open(tmp_path / "server.log", "wb") as log:
        server = spawn([sys.executable, "-c", _WITHOUT, "server", "--data-dir",
                        str(tmp_path / "data"), "--port", "0", "--ready-file", str(ready)],
                       stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not ready.exists():
            assert server.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "server.log").read_text()
            time.sleep(0.1)
        pd = json.loads(ready.read_text())["pd"]
        created = _sbp_without_pyspark("streams", "create", "--pd", pd)
        assert created.returncode == 0, created.stderr
        stream = created.stdout.split()[0]
        produced = _sbp_without_pyspark("produce", "--pd", pd, stream, stdin="one\ntwo\n")
        assert produced.returncode == 0, produced.stderr
        tailed = _sbp_without_pyspark("tail", "--pd", pd, stream)
        assert (tailed.returncode, tailed.stdout) == (0, "one\ntwo\n"), tailed.stderr
    finally:
        stop(server)


def test_sbp_demo_without_pyspark_says_what_to_install():
    done = _sbp_without_pyspark("demo", "--rows", "10")
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.startswith("sbp demo: error: sbp demo needs pyspark, which this Python")
    assert "pip install 'sbp-spark[spark]' adds it" in done.stderr
    assert "Traceback" not in done.stderr and "Starting" not in done.stdout  # nothing started


def test_the_spark_part_of_sbp_bench_without_pyspark_says_what_to_install():
    done = _sbp_without_pyspark("bench", "--quick", "--sections", "codec,scaling,planning")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "the Spark part of sbp bench (sections scaling, planning) needs pyspark" in done.stderr
    assert "pip install 'sbp-spark[spark]' adds it" in done.stderr
    assert "--sections codec,client,latency,memory runs without it" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""  # before measuring anything


# -- the sdist and the wheel -------------------------------------------------------------------


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    return distributions(tmp_path_factory)


# Building takes 5 to 10 s (an isolated build environment, the sdist, then the wheel from it).
slow_build = pytest.mark.slow


def _tracked_runtime_files() -> set[str]:
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "sbp_spark", "pyspark_sbp.py"],
                            capture_output=True, text=True, check=True).stdout.split()
    return {name for name in listed if (REPO / name).is_file()}


@slow_build
def test_the_wheel_holds_the_runtime_its_licence_and_nothing_else(dists):
    with zipfile.ZipFile(dists.wheel) as wheel:
        names = set(wheel.namelist())
        [info] = {n.split("/")[0] for n in names if ".dist-info/" in n}
        licence = wheel.read(f"{info}/licenses/LICENSE")
    package = {n for n in names if not n.startswith(info)}
    assert package == _tracked_runtime_files()
    assert {"sbp_spark/py.typed", "pyspark_sbp.py", "sbp_spark/cli.py",
            "sbp_spark/protocol/_generated/wire_tables.py"} <= package
    # flatc's classes (and the flatbuffers runtime they need) stay with the tests.
    assert not [n for n in package if n.startswith("sbp_spark/protocol/_generated/")
                and n.rsplit("/", 1)[1] not in ("__init__.py", "wire_tables.py")]
    assert licence == (REPO / "LICENSE").read_bytes()
    assert hashlib.sha256(licence).hexdigest() == APACHE_2_SHA256


@slow_build
def test_the_wheel_metadata_says_what_a_package_index_shows(dists):
    meta = dists.wheel_metadata()
    assert meta["Name"] == "sbp-spark" and meta["Version"] == sbp_spark.__version__
    assert meta["Requires-Python"] == PROJECT["requires-python"]
    assert meta["License-Expression"] == "Apache-2.0" and meta["License-File"] == "LICENSE"
    assert meta["Description-Content-Type"] == "text/markdown"
    assert meta.get_payload().strip() == (REPO / "README.md").read_text().strip()
    urls = dict(u.split(", ", 1) for u in meta.get_all("Project-URL"))
    assert urls["Source"] == URL and urls["Issues"] == f"{URL}/issues"
    assert urls["Changelog"].startswith(URL) and urls["Changelog"].endswith("/CHANGELOG.md")
    classifiers = meta.get_all("Classifier")
    assert classifiers == PROJECT["classifiers"] and "Typing :: Typed" in classifiers
    assert dists.runtime_requirements() == PROJECT["dependencies"]
    requires = meta.get_all("Requires-Dist")
    assert 'pyspark<5,>=4.0.0; extra == "spark"' in requires
    assert not [r for r in dists.runtime_requirements() if _name(r) == "pyspark"]
    with zipfile.ZipFile(dists.wheel) as wheel:
        [entry_points] = [n for n in wheel.namelist() if n.endswith("/entry_points.txt")]
        assert "sbp = sbp_spark.cli:main" in wheel.read(entry_points).decode()


@slow_build
def test_twine_check_passes(dists):
    done = subprocess.run([sys.executable, "-m", "twine", "check", "--strict",
                           str(dists.sdist), str(dists.wheel)],
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("PASSED") == 2, done.stdout


@slow_build
def test_the_sdist_holds_the_sources_the_licence_and_the_changelog(dists):
    with tarfile.open(dists.sdist) as sdist:
        root = sdist.getnames()[0].split("/")[0]
        names = {n.removeprefix(root + "/") for n in sdist.getnames()}
    assert {"LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml"} <= names
    assert _tracked_runtime_files() <= names
    assert not [n for n in names if n.startswith(("tests/", "integration/"))]
