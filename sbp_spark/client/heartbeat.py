"""A background thread that runs one small action at a fixed interval (HEARTBEAT frames)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from sbp_spark.protocol.errors import SbpError

log = logging.getLogger(__name__)


class Heartbeat:
    """Calls ``beat()`` every ``interval_s`` seconds on a daemon thread until ``stop()``.

    A failing beat is logged and kept in ``last_error``; the next beat still runs, so a
    heartbeat survives a PD restart. ``stop_when()`` returning True ends the thread (for
    example when the connection it beats on has closed).
    """

    def __init__(
        self,
        beat: Callable[[], None],
        interval_s: float,
        name: str = "sbp-heartbeat",
        stop_when: Callable[[], bool] | None = None,
        beat_now: bool = True,
    ) -> None:
        if not interval_s > 0:
            raise ValueError(f"heartbeat interval_s={interval_s!r}: must be > 0")
        self.interval_s = interval_s
        self.beats = 0
        self.failures = 0
        self.last_error: SbpError | None = None
        self._beat = beat
        self._stop_when = stop_when
        self._beat_now = beat_now
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop beating and wait (up to ``timeout`` seconds) for the thread to end."""
        self._stopped.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __enter__(self) -> Heartbeat:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        wait = 0.0 if self._beat_now else self.interval_s
        while not self._stopped.wait(wait):
            wait = self.interval_s
            if self._stop_when is not None and self._stop_when():
                return
            try:
                self._beat()
            except SbpError as exc:
                self.failures += 1
                self.last_error = exc
                log.warning("heartbeat failed: %s", exc)
            else:
                self.beats += 1
                self.last_error = None
