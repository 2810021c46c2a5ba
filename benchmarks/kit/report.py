"""Summary and table helpers the benchmark scripts share: numbers that may be missing (None), and Markdown tables.

fmt(None) == "-"; fmt(1.234) == "1.23"; fmt(0.5, ".0%") == "50%"
mean([1, None, 3]) == 2.0; mean([]) is None
ratio(3, 2) == 1.5; ratio(3, None) is None
markdown(["link", "tok/s"], "lr", [["0.1", "12.5"]]) == "| link | tok/s |\n|---|---:|\n| 0.1 | 12.5 |"
"""

from __future__ import annotations

import statistics


def fmt(x, spec: str = ".2f", none: str = "-") -> str:
    """x formatted with spec; `none` where it is missing."""
    return none if x is None else format(x, spec)


def mean(xs):
    """The mean of the values that are there (None skipped); None when none is."""
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def ratio(a, b):
    """a / b, None where either is missing or b is 0."""
    return a / b if a is not None and b else None


def yes(flag, none: str = "-") -> str:
    """True -> yes, False -> NO (loud: a failed check), None -> `none`."""
    return none if flag is None else "yes" if flag else "NO"


def row(cells) -> str:
    """One Markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown(header, align: str, rows) -> str:
    """A Markdown table: header cells, one alignment letter per column (l: left, r: right), rows of cells."""
    if len(align) != len(header) or set(align) - {"l", "r"}:
        raise ValueError(f"align needs one of l / r per column ({len(header)}), got {align!r}")
    rule = "|" + "".join("---|" if a == "l" else "---:|" for a in align)
    return "\n".join([row(header), rule, *(row(r) for r in rows)])
