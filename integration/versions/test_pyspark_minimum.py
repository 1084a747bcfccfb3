"""The Spark tests on the oldest pyspark the spark extra declares, in a virtualenv of their own.

pyspark's Python Data Source API changed a lot between minor releases, so the declared minimum
is only true while something runs the tests on it. test_matrix.py runs the users' cases from
the wheel on every minor release; this runs the whole of tests/spark on the oldest: it builds
a fresh virtualenv with the project's test extra and exactly that pyspark, and runs
``tests/spark`` in it. Downloading pyspark and running the suite takes 10-20 minutes, so it is
marked slow::

    python -m pytest -m slow integration/versions -v
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

INSTALL_TIMEOUT_S = 1800
TESTS_TIMEOUT_S = 3600

pytestmark = pytest.mark.slow
tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11+")


def declared_minimum() -> str:
    """The floor of pyspark in the package's spark extra."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    floors = [m.group(1) for r in extras["spark"]
              if (m := re.match(r"pyspark\s*>=\s*([0-9.]+)", r))]
    assert floors, "the spark extra of pyproject.toml declares no pyspark>= minimum"
    return floors[0]


@pytest.mark.timeout(INSTALL_TIMEOUT_S + TESTS_TIMEOUT_S + 60)
def test_spark_tests_pass_on_the_declared_minimum_pyspark(tmp_path):
    minimum = declared_minimum()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", "-e", f"{REPO}[test]", f"pyspark=={minimum}",
         "--config-settings", "editable_mode=compat"],
        capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-4000:]
    version = subprocess.run([python, "-c", "import pyspark; print(pyspark.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version == minimum
    run = subprocess.run(
        [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/spark"],
        cwd=REPO, capture_output=True, text=True, timeout=TESTS_TIMEOUT_S)
    assert run.returncode == 0, f"tests/spark on pyspark {minimum}:\n" + run.stdout[-6000:]
