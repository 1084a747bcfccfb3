"""A one-line progress display on stderr for long commands, shown only on a terminal."""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 24
# Redraw at most this often, and only once the work has run this long: short runs stay quiet.
REDRAW_INTERVAL_S = 0.1
SHOW_AFTER_S = 0.5


class Progress:
    """Bytes and records done, with a bar when the total is known; a no-op off a terminal."""

    def __init__(self, total_bytes: int | None = None, out: TextIO | None = None,
                 enabled: bool | None = None) -> None:
        self.out = out or sys.stderr
        self.total = total_bytes if total_bytes else None
        self.enabled = self.out.isatty() if enabled is None else enabled
        self.started = time.monotonic()
        self._last_draw = 0.0
        self._drawn = False

    def update(self, done_bytes: int, records: int) -> None:
        """Report progress; redraws when enough time has passed."""
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.started < SHOW_AFTER_S or now - self._last_draw < REDRAW_INTERVAL_S:
            return
        self._last_draw = now
        self.out.write("\r" + self.render(done_bytes, records, now - self.started) + "\x1b[K")
        self.out.flush()
        self._drawn = True

    def render(self, done_bytes: int, records: int, elapsed: float) -> str:
        """The progress line for these figures."""
        rate = done_bytes / 1e6 / elapsed if elapsed > 0 else 0.0
        figures = f"{done_bytes / 1e6:,.1f} MB  {records:,} records  {rate:,.1f} MB/s"
        if self.total is None:
            return figures
        fraction = min(1.0, done_bytes / self.total)
        filled = int(fraction * BAR_WIDTH)
        bar = "#" * filled + "-" * (BAR_WIDTH - filled)
        return f"[{bar}] {fraction * 100:3.0f}%  {figures}"

    def close(self) -> None:
        """Erase the progress line, so what follows starts on a clean line."""
        if self._drawn:
            self.out.write("\r\x1b[K")
            self.out.flush()
            self._drawn = False
