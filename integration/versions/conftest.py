"""Fixtures of the version matrix: the wheel (built once per run), each platform's virtualenv
with it installed, an SBP cluster from that virtualenv, and the cases' results; the version x
case table at the end of the run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from matrix import (
    CLASSIC_TIMEOUT_S,
    CONNECT_TIMEOUT_S,
    PlatformRun,
    SbpServer,
    run_cases,
    runner_env,
)
from platforms import OUTCOMES, Platform, PlatformError, cache_dir, format_table, prepare

from tests.dists import Distributions, distributions
from tests.processes import reap_leftovers


@pytest.fixture(scope="session")
def running() -> Path:
    """Where helper processes are written down; kills what a killed run left behind."""
    path = cache_dir() / "running"
    reap_leftovers(path)
    return path


@pytest.fixture(scope="session")
def dists(tmp_path_factory) -> Distributions:
    return distributions(tmp_path_factory)


@pytest.fixture(scope="session")
def platform_run(request, dists, running, tmp_path_factory) -> PlatformRun:
    """One platform: its virtualenv with the wheel, a cluster, every case run once."""
    platform: Platform = request.param
    run = PlatformRun(platform, column=platform.label)
    work = tmp_path_factory.mktemp(f"platform-{platform.id}")
    server = None
    try:
        run.venv = prepare(platform, dists.runtime_requirements(), dists.wheel)
        install = run.venv.record["install"]
        run.column = platform.label.replace(f"pyspark {platform.id}",
                                            f"pyspark {install['pyspark']}")
        server = SbpServer(run.venv.bin / "sbp", work / "cluster", running,
                           runner_env(run.venv))
        run.logs.append(server.log)
        run_cases(run, "classic", server.pd, work, running, CLASSIC_TIMEOUT_S)
        if platform.connect and run.venv.connect_dir is not None:
            run_cases(run, "connect", server.pd, work, running, CONNECT_TIMEOUT_S,
                      str(run.venv.connect_dir))
    except (PlatformError, OSError, subprocess.SubprocessError) as exc:
        run.error = f"{type(exc).__name__}: {exc}"
    finally:
        if server is not None:
            server.stop()
    return run


def pytest_terminal_summary(terminalreporter):
    """The version x case table of this run (the lead copies it into the closing note)."""
    if not OUTCOMES:
        return
    terminalreporter.section("sbp-spark version matrix")
    for line in format_table().splitlines():
        terminalreporter.write_line(line)
