"""What a range server logs while its calls to the PD fail.

The PD link calls the PD about once a second (heartbeats, metrics, stream settings, trims).
While the PD is down, logging every failure floods the log; ``PdOutage`` logs one warning when
calls start failing (which call, since when, the error), then at most one reminder per
``remind_every_s`` (for how long, how many calls failed, the last error), and one info line
once every call that failed has succeeded again. It changes no timing: callers retry as
before.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

# Seconds between two reminders that the PD calls still fail.
REMIND_EVERY_S = 30.0


def _clock_time(wall: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(wall))


@dataclass
class _Failure:
    since: float  # monotonic time of the first failure of the outage
    count: int = 0
    last_error: str = ""


@dataclass
class PdOutage:
    """Failed and succeeded PD calls of one range server, logged as one outage."""

    who: Callable[[], str]  # names the server in each line ("range server 3")
    log: logging.Logger
    remind_every_s: float = REMIND_EVERY_S
    monotonic: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    # call name -> its failures, while it fails
    _failing: dict[str, _Failure] = field(default_factory=dict)
    _started: float = 0.0  # monotonic start of the outage
    _started_wall: float = 0.0
    _last_told: float = 0.0  # monotonic time of the last warning
    _total: int = 0  # calls failed in this outage

    @property
    def failing(self) -> bool:
        return bool(self._failing)

    def failed(self, what: str, error: BaseException) -> None:
        """``what`` (HEARTBEAT, REPORT_METRICS, ...) to the PD failed with ``error``."""
        now = self.monotonic()
        first = not self._failing
        failure = self._failing.setdefault(what, _Failure(now))
        failure.count += 1
        self._total += 1
        failure.last_error = str(error)
        if first:
            self._total = 1
            self._started, self._started_wall, self._last_told = now, self.wall(), now
            self.log.warning(
                "%s: %s to the PD failed: %s (PD calls failing since %s; they are retried as "
                "usual, and this is said again every %g s while they fail)", self.who(), what,
                error, _clock_time(self._started_wall), self.remind_every_s)
        elif now - self._last_told >= self.remind_every_s:
            self._last_told = now
            counts = ", ".join(f"{name} x{f.count}" for name, f in self._failing.items())
            self.log.warning("%s: calls to the PD have failed for %.0f s, since %s (%s); "
                             "last: %s failed: %s", self.who(), now - self._started,
                             _clock_time(self._started_wall), counts, what, error)

    def succeeded(self, what: str) -> None:
        """``what`` to the PD succeeded; the outage ends once nothing fails any more."""
        if what not in self._failing:
            return
        del self._failing[what]
        if self._failing:
            return
        self.log.info("%s: the PD answers again (%s succeeded), after %.0f s of failed calls "
                      "since %s (%d failed)", self.who(), what,
                      self.monotonic() - self._started, _clock_time(self._started_wall),
                      self._total)
