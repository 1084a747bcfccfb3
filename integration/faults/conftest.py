"""Records every fault case's outcome and figures; writes the README table only when asked.

A case declares what it does with ``@pytest.mark.fault_case(title, fault, checks)`` and reports
measured figures through the ``figures`` fixture (a dict: name -> value as shown).

The table (``README.md``) and ``results.json`` are rewritten at the end of a run only with
``--faults-report`` (``pytest integration/faults --faults-report``; the option exists when
pytest starts from this directory or one above it in the command line) or with the environment
variable ``SBP_FAULTS_REPORT=1`` (works however pytest is started). Without either, a run
leaves the working tree untouched.

The ``spark`` fixture is the Spark session of the Spark fault cases (one per test session).

Every run is guarded (``integration/netlab/reaper.py``): the processes and network namespaces
it starts die with it, even when the run is killed.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from integration.netlab.reaper import guard

from . import report

REPO = Path(__file__).resolve().parents[2]
# Spark cases run on local[2] with up to 4 attempts per task (Spark's default on a cluster), so
# a task that fails on a killed server is retried as it would be in production.
SPARK_MASTER = "local[2,4]"

_FIGURES = pytest.StashKey[dict]()
_collected: dict[str, dict[str, Any]] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--faults-report", action="store_true", default=False,
        help=f"rewrite integration/faults/README.md and results.json with the results of the "
             f"fault cases that ran (also: {report.REPORT_ENV}=1)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "fault_case(title, fault, checks): a row of integration/faults/README.md")
    _report_env()  # a bad value fails the run before any case starts


def _report_env() -> bool:
    try:
        return report.requested_by_env()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


def report_requested(config: pytest.Config) -> bool:
    """Whether this run should rewrite the fault table (option or environment variable)."""
    return bool(config.getoption("faults_report", default=False)) or _report_env()


@pytest.fixture(scope="session", autouse=True)
def _leave_nothing_behind() -> None:
    """Mark this run's processes and watch it (``reaper.guard``), before any case starts."""
    guard()


@pytest.fixture(scope="session")
def network_ready() -> None:
    """Skip, saying why, where the partition cases cannot build networks (no root, no
    namespaces, no nftables); else remove what killed runs left behind, once per session."""
    from integration.netlab.network import remove_leftovers, unavailable

    reason = unavailable()
    if reason is not None:
        pytest.skip(f"network partition cases: {reason}")
    removed = remove_leftovers()
    if removed:
        print(f"removed network namespaces and links of earlier runs: {', '.join(removed)}")


@pytest.fixture(scope="session")
def spark():
    """A local Spark session (the sbp source registered) for the Spark fault cases.

    When a Spark session is already running in this process (a run that includes tests/spark),
    Spark hands that one out instead, with its own master (local[2]: a failed task fails its
    job at once); the cases work either way.
    """
    # Workers find pyspark_sbp on the checkout (see tests/spark/conftest.py).
    paths = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from sbp_spark.environment import local_spark_session

    session = local_spark_session("sbp-faults", master=SPARK_MASTER, **{
        "spark.driver.memory": "1g",
        "spark.ui.showConsoleProgress": "false",
    })
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Figures of this case for the README (insertion order is kept)."""
    return request.node.stash.setdefault(_FIGURES, {})


def _case_id(item: pytest.Item) -> str:
    return item.name


def _message(report_: pytest.TestReport, call: pytest.CallInfo) -> str:
    if report_.skipped:
        longrepr = report_.longrepr
        if isinstance(longrepr, tuple) and len(longrepr) == 3:
            return str(longrepr[2]).removeprefix("Skipped: ")
        return str(longrepr)
    if call.excinfo is not None:
        first = call.excinfo.exconly().strip().splitlines()[0]
        return first[:300]
    return ""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    rep: pytest.TestReport = outcome.get_result()
    marker = item.get_closest_marker("fault_case")
    if marker is None:
        return
    case_id = _case_id(item)
    entry = _collected.get(case_id)
    if rep.when == "setup" or entry is None:
        title, fault, checks = (list(marker.args) + ["", "", ""])[:3]
        entry = _collected[case_id] = {
            "title": marker.kwargs.get("title", title),
            "fault": marker.kwargs.get("fault", fault),
            "checks": marker.kwargs.get("checks", checks),
            # Rows follow the suite's files and the cases' place in them.
            "order": f"{item.location[0]}:{(item.location[1] or 0):05d}:{case_id}",
            "outcome": "passed", "message": "", "duration_s": 0.0,
            "when": time.strftime("%Y-%m-%d"),
        }
    entry["duration_s"] += rep.duration
    if hasattr(rep, "wasxfail"):  # a known gap: failed (xfail) or unexpectedly passed
        if rep.skipped:
            entry["outcome"] = "xfailed"
            seen = call.excinfo.exconly().strip().splitlines()[0][:200] if call.excinfo else ""
            entry["message"] = f"{rep.wasxfail.removeprefix('reason: ')} (seen: {seen})"
        else:
            entry["outcome"] = "xpassed"
    elif rep.failed or rep.skipped:
        if entry["outcome"] == "passed":  # keep the first failure
            entry["outcome"] = "skipped" if rep.skipped else "failed"
            entry["message"] = _message(rep, call)
            if rep.failed and rep.when != "call":
                entry["message"] = f"({rep.when}) {entry['message']}"
    entry["figures"] = {k: v for k, v in item.stash.get(_FIGURES, {}).items()}


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _collected and report_requested(session.config):
        report.save(_collected)
