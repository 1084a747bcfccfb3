"""Records every fault case's outcome and figures; writes the README table at session end.

A case declares what it does with ``@pytest.mark.fault_case(title, fault, checks)`` and reports
measured figures through the ``figures`` fixture (a dict: name -> value as shown).
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from . import report

_FIGURES = pytest.StashKey[dict]()
_collected: dict[str, dict[str, Any]] = {}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "fault_case(title, fault, checks): a row of integration/faults/README.md")


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
    if _collected:
        report.save(_collected)
