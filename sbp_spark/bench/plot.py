"""The PNG chart: each throughput figure as a bar next to its ceiling (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path

from .report import Figure

INSTALL_HINT = ("--plot needs matplotlib, which is not installed: "
                "pip install 'sbp-spark[bench]' (or pip install matplotlib)")


def require_matplotlib() -> None:
    """Exit with a one-line message when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(INSTALL_HINT) from None


def plot(figures: list[Figure], path: Path, title: str = "sbp bench") -> None:
    """Write a horizontal bar chart of every MB/s figure and its ceiling to ``path``."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(f, f.value) for f in figures if f.unit == "MB/s" and f.value is not None]
    if not rows:
        raise ValueError("no throughput figure was measured: nothing to plot")
    height = 0.38
    fig, ax = plt.subplots(figsize=(9, 0.55 * len(rows) + 1.4), dpi=80)
    labels = []
    for i, (f, value) in enumerate(reversed(rows)):
        labels.append(f"{f.section}: {f.name}")
        color = {True: "tab:green", False: "tab:red", None: "tab:blue"}[f.passed]
        ax.barh(i + height / 2, value, height, color=color)
        text = f" {value:,.0f}"
        if f.ceiling:
            ax.barh(i - height / 2, f.ceiling, height, color="lightgray")
            ax.text(f.ceiling, i - height / 2, f" {f.ceiling:,.0f} ({f.ceiling_name})",
                    va="center", fontsize=7, color="dimgray")
            text += f" ({f.ratio:.2f}x)"
        ax.text(value, i + height / 2, text, va="center", fontsize=7)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(labels, fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("MB/s (log scale); gray: ceiling; green/red: target met/missed")
    ax.set_title(title, fontsize=10)
    ax.margins(x=0.35)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
