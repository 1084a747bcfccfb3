"""Shared test configuration: where the team's shared material lives."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _shared_dir() -> Path:
    env = os.environ.get("SBP_SHARED_DIR")
    if env:
        return Path(env)
    return REPO.parent / "shared"


VECTORS_DIR = _shared_dir() / "vectors"


def load_vectors(name: str) -> list[dict]:
    """The shared test vectors; tests/vectors/ keeps a copy so a lone checkout still has them."""
    for folder in (VECTORS_DIR, REPO / "tests" / "vectors"):
        path = folder / name
        if path.exists():
            return json.loads(path.read_text())
    pytest.fail(f"test vectors {name} not found in {VECTORS_DIR} or tests/vectors")


def pytest_configure(config):
    """Fail the run at once, with install instructions, when Spark cannot start here."""
    from sbp_spark.environment import JavaNotFoundError, check_java, use_this_python_for_workers

    try:
        check_java()
    except JavaNotFoundError as exc:
        raise pytest.UsageError(f"the Spark tests need Java: {exc}") from None
    use_this_python_for_workers()
