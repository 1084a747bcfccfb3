"""Waiting for a condition in tests: poll with a deadline, never a bare sleep."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(condition: Callable[[], object], what: str = "the condition",
               timeout: float = 10.0, interval: float = 0.01) -> None:
    """Return once ``condition()`` is true; fail the test naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


def stays_true(condition: Callable[[], object], what: str, duration: float,
               interval: float = 0.01) -> None:
    """Check ``condition()`` over ``duration`` seconds; fail the test naming ``what`` as soon
    as it is false. For what must *not* happen (a limit that holds while nothing more
    arrives): the window is the only way to look, and a violation ends it at once."""
    deadline = time.monotonic() + duration
    while True:
        if not condition():
            raise AssertionError(f"{what} stopped holding")
        if time.monotonic() > deadline:
            return
        time.sleep(interval)
