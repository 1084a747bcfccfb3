"""What the connector finds out about the running pyspark (``sbp_spark.spark.pyspark_api``),
the README's table of features by pyspark version, and imports without pyspark."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import sbp_spark
from sbp_spark.spark.pyspark_api import (
    FEATURES,
    INSTALL_HINT,
    PysparkApi,
    PysparkUnsupportedError,
    found,
)
from tests.conftest import REPO


def _minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()  # type: ignore[union-attr]
    return int(major), int(minor)


def test_each_probe_agrees_with_the_release_that_brought_the_feature():
    api = found()
    assert api.version is not None and api.data_sources
    for feature in FEATURES:
        assert api.has(feature.name) == (_minor(api.version) >= _minor(feature.since)), (
            f"{api.describe()}: probe of {feature.name} (pyspark {feature.since}+)")
    with pytest.raises(ValueError, match="unknown pyspark feature 'nope'"):
        api.has("nope")


def _readme_feature_table() -> tuple[list[str], list[list[str]]]:
    section = (REPO / "README.md").read_text().split("### pyspark versions", 1)[1]
    lines = [line for line in section.split("\n### ", 1)[0].splitlines()
             if line.startswith("| ")]
    header, *rows = ([cell.strip() for cell in line.strip("|").split(" | ")] for line in lines)
    return header, rows


def test_the_readme_table_is_the_connectors_feature_list():
    header, rows = _readme_feature_table()
    versions = header[1:-1]
    assert header[0] == "feature" and header[-1] == "on a pyspark without it"
    assert versions == ["4.0", "4.1", "4.2", "4.3"]
    expected = [[f.title, *("yes" if _minor(v) >= _minor(f.since) else "no" for v in versions),
                 f.without] for f in FEATURES]
    assert rows == expected


def api(**features: bool) -> PysparkApi:
    base = dict(version="4.0.5", import_problem=None, data_sources=True, filter_pushdown=False,
                stream_arrow_writer=False, admission_control=False, progress_lag=False,
                arrow_timezone_keyword=False)
    return PysparkApi(**{**base, **features})


def test_what_is_missing_is_said_with_the_pyspark_found():
    with pytest.raises(PysparkUnsupportedError, match=re.escape(
            "sbp_spark.register(spark, filter_pushdown=True) needs pyspark 4.1 or newer "
            "(filter pushdown (`register(spark, filter_pushdown=True)`)), but this is pyspark "
            '4.0.5; pip install "pyspark>=4.1,<5"')):
        api().require("filter_pushdown", "sbp_spark.register(spark, filter_pushdown=True)")
    api(filter_pushdown=True).require("filter_pushdown", "pushdown")
    with pytest.raises(PysparkUnsupportedError, match=re.escape(
            f"format sbp needs pyspark 4.x (its Python Data Source API), but this is pyspark "
            f"3.5.1, which has none: {INSTALL_HINT}")):
        api(version="3.5.1", data_sources=False).require_data_sources()


@pytest.mark.skipif(found().filter_pushdown, reason=f"{found().describe()} has pushdown")
def test_register_refuses_pushdown_on_a_pyspark_without_it():
    with pytest.raises(PysparkUnsupportedError, match=f"but this is {found().describe()}"):
        sbp_spark.register(None, filter_pushdown=True)  # type: ignore[arg-type]


# Run in a fresh interpreter where every import of pyspark fails.
WITHOUT_PYSPARK = '''
import importlib.abc
import sys


class NoPyspark(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "pyspark" or name.startswith("pyspark."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, NoPyspark())
import pyspark_sbp
import sbp_spark
import sbp_spark.cli

print("DefaultSource" in vars(pyspark_sbp))
try:
    sbp_spark.register(None)
except Exception as exc:
    print(type(exc).__name__, exc)
from sbp_spark.environment import local_spark_session

try:
    local_spark_session()  # what sbp demo and sbp bench start
except Exception as exc:
    print(type(exc).__name__)
'''


def test_imports_work_without_pyspark_and_using_it_says_what_to_install():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    done = subprocess.run([sys.executable, "-c", WITHOUT_PYSPARK], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "False",
        "PysparkUnsupportedError format sbp needs pyspark 4.x, and this Python has none (No "
        f"module named 'pyspark'): {INSTALL_HINT}",
        "PysparkNotFoundError"]


def test_pyspark_sbp_offers_the_source_on_this_pyspark():
    import pyspark_sbp
    from sbp_spark.spark.source import SbpDataSourceNoPushdown

    assert pyspark_sbp.DefaultSource is SbpDataSourceNoPushdown
