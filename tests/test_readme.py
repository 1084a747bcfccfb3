"""The README stays true: its Quick start is what CI runs, and it documents every option."""

from __future__ import annotations

import re

from sbp_spark.spark.options import OPTIONS
from tests.conftest import REPO

README = (REPO / "README.md").read_text()


def _quick_start_blocks() -> list[str]:
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)```", section, flags=re.S)


def test_quick_start_has_setup_then_tests():
    setup, tests = _quick_start_blocks()[:2]
    assert 'pip install -e ".[test]"' in setup and "sbp demo" in setup
    assert "python -m pytest" in tests


def test_ci_runs_the_readme_test_command():
    ci = (REPO / ".ci" / "run").read_text()
    tests_block = _quick_start_blocks()[1]
    command = [line for line in tests_block.splitlines() if "pytest" in line][0].strip()
    assert command in ci
    assert 'pip install -q -e ".[test]" --config-settings editable_mode=compat' in ci


def test_every_option_is_in_the_readme_table():
    missing = [o.name for o in OPTIONS if f"| `{o.name}` | {o.default} |" not in README]
    assert not missing, f"README option table lacks: {missing}"
