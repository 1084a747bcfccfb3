"""A condition variable that knows whether anyone waits on it.

Some conditions are notified on every request (a request ending, bytes released, data
appended) and waited on only now and then (a reader at its in-flight limit, a long poll).
``threading.Condition.notify_all`` is Python code that runs even when nobody waits: a few
calls per request on the path of every small append. This one skips it then.
"""

from __future__ import annotations

import threading


class WaitedCondition(threading.Condition):
    """``threading.Condition`` whose ``notify_all`` does nothing while no thread waits.

    The count changes only with the lock held (``wait`` is called holding it, and takes it
    back before returning), so a notifier holding the lock sees every waiter that could miss
    the notification."""

    def __init__(self) -> None:
        super().__init__()
        self._waiting = 0

    def wait(self, timeout: float | None = None) -> bool:
        self._waiting += 1
        try:
            return super().wait(timeout)
        finally:
            self._waiting -= 1

    def notify_all(self) -> None:
        if self._waiting:
            super().notify_all()
