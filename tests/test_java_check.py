"""Only tests that start Spark need Java: without it, the protocol tests run and pass, and a
run that selects Spark tests stops at once saying how to install Java."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _pytest_without_java(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("JAVA_HOME", "PYTEST_ADDOPTS")}
    env["PATH"] = str(Path(sys.executable).parent)  # this Python and its tools; no java
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=240)


def test_protocol_tests_run_without_java():
    done = _pytest_without_java("tests/protocol/test_frame_vectors.py",
                                "tests/protocol/test_errors.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Java" not in done.stdout + done.stderr


def test_selected_spark_tests_stop_the_run_with_the_install_message():
    done = _pytest_without_java("tests/spark/test_batch.py")
    assert done.returncode == 4, done.stdout + done.stderr  # a usage error: nothing ran
    assert "start Spark, which needs Java (leave them out with -m 'not spark')" in done.stderr
    assert "Install a Java 17+ runtime" in done.stderr and "Traceback" not in done.stderr
    assert _pytest_without_java("tests/spark/test_batch.py", "-m", "not spark").returncode == 5
