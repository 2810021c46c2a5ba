"""docs/benchmarks.md is the one index of benchmarks/: its table ("## The scripts") names every script, module and
sub-package of the folder, and every name it lists exists; benchmarks/README.md only points there."""

from __future__ import annotations

import re

from paths import BENCH, ROOT

INDEX = ROOT / "docs" / "benchmarks.md"


def listed() -> list[str]:
    """The first column of the index table: `benchmarks/<name>` (a file, or a folder ending in /)."""
    text = INDEX.read_text()
    table = text[text.index("## The scripts") :].split("\n## ", 1)[0]
    return re.findall(r"^\| `benchmarks/([^`]+)` \|", table, re.M)


def in_folder() -> set[str]:
    files = {p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh") and p.name != "__init__.py"}
    packages = {f"{p.name}/" for p in BENCH.iterdir() if (p / "__init__.py").is_file()}
    return files | packages


def test_every_script_is_listed_and_every_listed_script_exists():
    names = listed()
    assert len(names) == len(set(names)), f"listed twice: {sorted(n for n in names if names.count(n) > 1)}"
    assert not in_folder() - set(names), f"not in docs/benchmarks.md's index: {sorted(in_folder() - set(names))}"
    assert not set(names) - in_folder(), f"listed but not in benchmarks/: {sorted(set(names) - in_folder())}"


def test_one_index():
    readme = (BENCH / "README.md").read_text()
    assert "docs/benchmarks.md" in readme and readme.count("\n") <= 2, "benchmarks/README.md is a pointer only"
