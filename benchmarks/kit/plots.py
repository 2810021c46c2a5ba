"""Plots without a display: matplotlib's Agg backend, a figure per file, closed once saved.

plt = pyplot()
fig, ax = plt.subplots(figsize=(6, 4))
lines(ax, summary, "configuration", "concurrency", "output_throughput")   # one line per configuration
save(fig, folder / "throughput.png")
"""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (imported on first use: scripts that plot nothing never load it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def points(rows, x: str, y: str, where=lambda r: True) -> list[tuple]:
    """(r[x], r[y]) of the rows `where` keeps, both present (not None), sorted by x."""
    return sorted((r[x], r[y]) for r in rows if where(r) and r.get(x) is not None and r.get(y) is not None)


def lines(ax, rows, by: str, x: str, y: str, labels=None, label=str, **style) -> list[str]:
    """One line per value of r[by] (in `labels`' order, else first seen), markers on; the labels drawn."""
    drawn = []
    for value in labels if labels is not None else dict.fromkeys(r[by] for r in rows):
        pts = points(rows, x, y, lambda r: r[by] == value)
        if pts:
            ax.plot(*zip(*pts), **{"marker": "o", **style}, label=label(value))
            drawn.append(value)
    return drawn


def save(fig, path: Path, dpi: int = 120) -> str:
    """tight_layout, write the PNG, close the figure; the file's name."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return Path(path).name
