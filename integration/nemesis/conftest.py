"""Every run of these tests is guarded: what it starts dies with it, even when it is killed
(``integration/netlab/reaper.py``)."""

from __future__ import annotations

import pytest

from integration.netlab.reaper import guard


@pytest.fixture(scope="session", autouse=True)
def _leave_nothing_behind() -> None:
    guard()
