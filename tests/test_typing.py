"""mypy passes on the package, with the settings in pyproject.toml ([tool.mypy]).

Part of the default run; ``python -m pytest -m typing`` runs it alone.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.typing


def test_mypy_passes_on_the_package():
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (it comes with the test and dev extras)")
    # No arguments: [tool.mypy] names the files, the excluded generated code and the
    # per-module settings, so this is exactly what a developer runs.
    result = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                            text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success" in result.stdout, result.stdout
