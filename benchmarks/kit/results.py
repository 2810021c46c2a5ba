"""The results folder of a benchmark run: results/<name>/<stamp>/ (`--out` puts it elsewhere) with

  results.json  the summary and the figures behind it (per request / per row), for a reader to re-check
  table.md      the printed table
  command.txt   the command that ran, as a reader types it
  *.png         the plots (plots.py)

and, where a script keeps raw material (server and client logs), a `logs/` subfolder that .gitignore keeps out
of git. Every script writes through Results: one stamp format, one command line, one JSON layout.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.kit.paths import ROOT

LOGS = "logs"  # raw material under a results folder: ignored by git (.gitignore)


def to_json(obj, indent: int | None = 2, _level: int = 0) -> str:
    """JSON as json.dumps(obj, indent=indent) writes it, but a list of numbers (or of short strings: names,
    digests) on one line: per-request figures stay readable and small."""
    if indent is None:
        return json.dumps(obj)
    pad, end = " " * indent * (_level + 1), " " * indent * _level
    if isinstance(obj, dict) and obj:
        items = (f"{pad}{json.dumps(str(k))}: {to_json(v, indent, _level + 1)}" for k, v in obj.items())
        return "{\n" + ",\n".join(items) + "\n" + end + "}"
    if isinstance(obj, (list, tuple)) and obj and not _flat(obj):
        return "[\n" + ",\n".join(pad + to_json(x, indent, _level + 1) for x in obj) + "\n" + end + "]"
    return json.dumps(obj)


def _flat(items) -> bool:
    if all(x is None or isinstance(x, (bool, int, float)) for x in items):
        return True
    return all(isinstance(x, str) and len(x) <= 16 for x in items)


def stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def command_line(argv: list[str] | None = None) -> str:
    """`python <script> <arguments>`: the script as run (relative to the repository root when inside it) and
    the arguments main() got (None: this process's own)."""
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    return "python " + shlex.join([str(script), *(sys.argv[1:] if argv is None else argv)])


@dataclass
class Results:
    """One run's folder: created (with command.txt) by create(), filled by write() and plot paths."""

    path: Path
    command: str

    @classmethod
    def create(cls, out: str | Path, argv: list[str] | None = None, suffix: str = "", command: str | None = None):
        """<out>/<stamp><suffix>/ with command.txt written (command: given, else command_line(argv))."""
        path = Path(out) / (stamp() + suffix)
        path.mkdir(parents=True, exist_ok=True)
        folder = cls(path, command if command is not None else command_line(argv))
        (path / "command.txt").write_text(folder.command + "\n")
        return folder

    @property
    def logs(self) -> Path:
        """<folder>/logs/ (created): raw logs, kept out of git."""
        (self.path / LOGS).mkdir(exist_ok=True)
        return self.path / LOGS

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    def write(self, doc: dict | None = None, table: str | None = None, indent: int = 2, name: str = "results") -> None:
        """<name>.json (doc) and table.md (table, newline-terminated); either may be left out."""
        if doc is not None:
            self.write_json(f"{name}.json", doc, indent)
        if table is not None:
            (self.path / "table.md").write_text(table if table.endswith("\n") else table + "\n")

    def write_json(self, name: str, doc, indent: int | None = 2) -> Path:
        path = self.path / name
        path.write_text(to_json(doc, indent) + "\n")
        return path

    def __str__(self) -> str:
        return str(self.path)
