"""Figures, targets and the two outputs of a benchmark run: a text table and a JSON document."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

# Comparison kinds a target can express.
AT_LEAST_RATIO = "ratio>="
AT_MOST_RATIO = "ratio<="
AT_LEAST = ">="
AT_MOST = "<="
_TARGET_KINDS = (AT_LEAST_RATIO, AT_MOST_RATIO, AT_LEAST, AT_MOST)
_RATIO_KINDS = (AT_LEAST_RATIO, AT_MOST_RATIO)


@dataclass(frozen=True)
class Target:
    """What a figure must reach: ``ratio>= 0.7`` (of its ceiling), ``ratio<= 1.0``,
    ``>= 10000`` or ``<= 1.0``."""

    kind: str
    threshold: float

    def __post_init__(self) -> None:
        if self.kind not in _TARGET_KINDS:
            raise ValueError(f"target kind {self.kind!r} is not one of {', '.join(_TARGET_KINDS)}")

    def describe(self, unit: str) -> str:
        if self.kind in _RATIO_KINDS:
            return f"{self.kind[len('ratio'):]} {self.threshold:g}x"
        return f"{self.kind} {_number(self.threshold)} {unit}".rstrip()

    def check(self, value: float | None, ratio: float | None) -> bool | None:
        """True/False, or None when the figure needed for the comparison is missing."""
        measured = ratio if self.kind in _RATIO_KINDS else value
        if measured is None:
            return None
        if self.kind in (AT_MOST, AT_MOST_RATIO):
            return measured <= self.threshold
        return measured >= self.threshold


@dataclass
class Figure:
    """One measured number, the ceiling it is compared with, and its target.

    ``value`` is None when the figure could not be measured; ``note`` then says why
    (``error: ...``).
    """

    section: str
    name: str
    unit: str
    value: float | None = None
    ceiling: float | None = None
    ceiling_name: str = ""
    target: Target | None = None
    note: str = ""
    # Supporting numbers (per-run times, records/s, sizes) kept in the JSON only.
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float | None:
        if self.value is None or not self.ceiling:
            return None
        return self.value / self.ceiling

    @property
    def passed(self) -> bool | None:
        return None if self.target is None else self.target.check(self.value, self.ratio)

    def status(self) -> str:
        if self.value is None:
            return self.note or "not measured"
        verdict = self.passed
        return "-" if verdict is None else ("pass" if verdict else "FAIL")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["target"] = None if self.target is None else asdict(self.target)
        out["ratio"] = self.ratio
        out["passed"] = self.passed
        out["status"] = self.status()
        return out


def _number(x: float | None) -> str:
    if x is None:
        return ""
    ax = abs(x)
    if ax >= 100:
        return f"{x:,.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    if ax >= 0.01 or ax == 0:
        return f"{x:.2f}"
    return f"{x:.2g}"


def _cell(value: float | None, unit: str) -> str:
    return f"{_number(value)} {unit}".strip() if value is not None else "-"


def format_table(figures: list[Figure]) -> str:
    """The run as an aligned text table (also valid GitHub Markdown)."""
    header = ["figure", "value", "ceiling", "ratio", "target", "pass/fail"]
    rows = [header]
    for f in figures:
        ceiling = _cell(f.ceiling, f.unit)
        if f.ceiling is not None and f.ceiling_name:
            ceiling = f"{ceiling} ({f.ceiling_name})"
        rows.append([
            f"{f.section}: {f.name}",
            _cell(f.value, f.unit),
            ceiling if f.ceiling is not None else "-",
            f"{f.ratio:.2f}x" if f.ratio is not None else "-",
            f.target.describe(f.unit) if f.target else "-",
            f.status(),
        ])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for n, row in enumerate(rows):
        lines.append("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")
        if n == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _command_version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc.__class__.__name__})"
    text = (out.stderr or out.stdout).strip().splitlines()
    return text[0] if text else "unknown"


def _mem_total_mib() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        return None
    return None


def machine_info() -> dict[str, Any]:
    """Where the run happened: cores, memory and the versions that decide the figures."""
    import pyarrow
    import pyspark

    java = os.path.join(os.environ["JAVA_HOME"], "bin", "java") if os.environ.get(
        "JAVA_HOME") else "java"
    return {
        "nproc": os.cpu_count(),
        "mem_total_mib": _mem_total_mib(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "java": _command_version([java, "-version"]),
        "pyspark": pyspark.__version__,
        "pyarrow": pyarrow.__version__,
    }


def to_json(figures: list[Figure], meta: dict[str, Any]) -> str:
    """The run as JSON: ``meta`` (machine, settings, times) and every figure."""
    doc = dict(meta)
    doc["figures"] = [f.to_dict() for f in figures]
    return json.dumps(doc, indent=2, sort_keys=False)
