"""The PNG chart (matplotlib, optional): each throughput figure as a bar next to its ceiling,
then, when those sections ran, the latency per fsync policy next to its floor, and the scaling
curves (APPEND against active streams, Spark read against ranges) next to their baselines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .report import Figure

INSTALL_HINT = ("--plot needs matplotlib, which is not installed: "
                "pip install 'sbp-spark[bench]' (or pip install matplotlib)")
_COLORS = {True: "tab:green", False: "tab:red", None: "tab:blue"}


def require_matplotlib() -> None:
    """Exit with a one-line message when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(INSTALL_HINT) from None


def _throughput(ax: Any, rows: list[Figure]) -> None:
    height = 0.38
    labels = []
    for i, f in enumerate(reversed(rows)):
        labels.append(f"{f.section}: {f.name}")
        ax.barh(i + height / 2, f.value, height, color=_COLORS[f.passed])
        text = f" {f.value:,.0f}"
        if f.ceiling:
            ax.barh(i - height / 2, f.ceiling, height, color="lightgray")
            ax.text(f.ceiling, i - height / 2, f" {f.ceiling:,.0f} ({f.ceiling_name})",
                    va="center", fontsize=7, color="dimgray")
            text += f" ({f.ratio:.2f}x)"
        ax.text(f.value, i + height / 2, text, va="center", fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("MB/s (log scale); gray: ceiling; green/red: target met/missed")
    ax.margins(x=0.35)


def _latency(ax: Any, rows: list[Figure]) -> None:
    """p50 and p99 of one writer per fsync policy, each next to its floor."""
    width = 0.2
    policies = list(dict.fromkeys(f.extra["policy"] for f in rows))
    for stat, shift in (("p50", -1), ("p99", 1)):
        for i, policy in enumerate(policies):
            f = next(r for r in rows if r.extra["policy"] == policy and r.extra["stat"] == stat)
            x = i + shift * width
            ax.bar(x - width / 2, f.value, width, color=_COLORS[f.passed])
            ax.bar(x + width / 2, f.ceiling or 0, width, color="lightgray")
            ax.text(x - width / 2, f.value, f"{stat}\n{f.value:.2f}", ha="center",
                    va="bottom", fontsize=6)
    ax.set_xticks(range(len(policies)))
    ax.set_xticklabels([f"fsync {p}" for p in policies], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms (log)")
    ax.set_title("one writer, 1 KiB batches: p50 and p99 (gray: floor beside it)", fontsize=9)


def _curve(ax: Any, rows: list[Figure], key: str, title: str, ylabel: str, label: str,
           ceiling_label: str) -> None:
    """Value and ceiling against ``extra[key]``."""
    rows = sorted(rows, key=lambda f: f.extra[key])
    xs = [f.extra[key] for f in rows]
    ax.plot(xs, [f.value for f in rows], "o-", color="tab:blue", label=label)
    if any(f.ceiling for f in rows):
        ax.plot(xs, [f.ceiling for f in rows], "s--", color="gray", label=ceiling_label)
    for f in rows:
        if f.passed is not None:
            ax.plot([f.extra[key]], [f.value], "o", color=_COLORS[f.passed], markersize=9)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs], fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)


def _panels(figures: list[Figure]) -> list[tuple[str, list[Figure]]]:
    throughput = [f for f in figures if f.unit == "MB/s" and f.value is not None
                  and "ranges" not in f.extra]
    latency = [f for f in figures if f.section == "latency" and f.value is not None
               and f.extra.get("stat") in ("p50", "p99")]
    rate = [f for f in figures if f.unit == "batches/s" and "streams" in f.extra
            and f.value is not None]
    cpu = [f for f in figures if f.unit == "us" and "streams" in f.extra and f.value is not None]
    reads = [f for f in figures if "ranges" in f.extra and f.value is not None]
    panels = [("throughput", throughput), ("latency", latency), ("rate", rate), ("cpu", cpu),
              ("reads", reads)]
    return [(kind, rows) for kind, rows in panels if rows]


def plot(figures: list[Figure], path: Path, title: str = "sbp bench") -> None:
    """Write the chart of every MB/s figure and its ceiling, and the latency and scaling
    panels of the sections that ran, to ``path``."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(figures)
    if not panels:
        raise ValueError("no throughput figure was measured: nothing to plot")
    heights = [0.55 * len(rows) + 1.4 if kind == "throughput" else 3.2 for kind, rows in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, sum(heights)), dpi=80,
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (kind, rows) in zip(axes[:, 0], panels, strict=True):
        if kind == "throughput":
            _throughput(ax, rows)
            ax.set_title(title, fontsize=10)
        elif kind == "latency":
            _latency(ax, rows)
        elif kind in ("rate", "cpu"):
            policy = rows[0].name.rsplit(", ", 1)[-1]
            title, unit = (("APPEND of 1 KiB batches, one in flight per stream", "batches/s")
                           if kind == "rate" else ("server CPU per batch", "us per batch"))
            _curve(ax, rows, "streams", title, unit, policy, rows[0].ceiling_name)
            ax.set_xlabel("active streams", fontsize=8)
        else:
            _curve(ax, rows, "ranges", "Spark read + agg of the same rows", "MB/s", "sbp",
                   "Arrow ceiling, as many partitions")
            ax.set_xlabel("ranges read at once", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
