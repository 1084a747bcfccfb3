"""Small timing helpers shared by the bench sections, and the progress line printer."""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import TextIO

MIB = 1024 * 1024
MB = 1_000_000


def rate(fn: Callable[[], object], units_per_call: float, min_time_s: float = 0.2,
         repeats: int = 5) -> tuple[float, list[float]]:
    """Median units/s of ``fn`` over ``repeats`` timed loops of at least ``min_time_s`` each."""
    fn()  # warm caches and lazy imports outside the timed loops
    samples = []
    for _ in range(repeats):
        calls = 0
        start = time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time_s:
                break
        samples.append(calls * units_per_call / elapsed)
    return statistics.median(samples), samples


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) by nearest rank on the sorted values."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = min(len(ordered), max(1, math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


class Progress:
    """One line per step on stderr, stamped with the seconds since the run started."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._start = time.monotonic()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self._start

    def __call__(self, section: str, message: str) -> None:
        print(f"[{self.elapsed:6.1f}s] {section}: {message}", file=self._stream, flush=True)
