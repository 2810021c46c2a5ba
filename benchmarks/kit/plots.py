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
    """tight_layout, write the PNG (shrunk: shrink_png), close the figure; the file's name."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    shrink_png(Path(path))
    return Path(path).name


def shrink_png(path: Path) -> int:
    """Re-encode a plot as a 256-colour palette PNG, no dithering (lines, text and fills of a few colours
    read the same; the file is a third to a quarter of matplotlib's RGBA one, and results/ stays small).
    Returns the bytes saved (0: left as it was, where the palette would not be smaller)."""
    from PIL import Image

    before = path.stat().st_size
    with Image.open(path) as img:
        small = img.convert("RGB").quantize(colors=256, dither=Image.Dither.NONE)
    tmp = path.with_suffix(".tmp.png")
    small.save(tmp, optimize=True)
    if tmp.stat().st_size >= before:
        tmp.unlink()
        return 0
    tmp.replace(path)
    return before - path.stat().st_size
