"""docs/layout.md, the code map, against the tree: one line per module of the mapped folders, under its folder's
heading, each line and each folder with a note. A module that exists and is not listed fails, and so does a listed
one that no longer exists: the failure names the lines to add or remove."""

from __future__ import annotations

import re

from paths import ROOT

LAYOUT = ROOT / "docs" / "layout.md"
MAPPED = ("vericache_connector", "storage_backends", "kernels", "benchmarks", "tests/support")
_FOLDER = re.compile(r"^## (\S+/)$")  # a folder's heading: "## vericache_connector/engine/"
_ENTRY = re.compile(r"^- `([^`]+)` — (\S.*)$")  # a module's line: "- `path` — what it holds"


def modules_on_disk() -> set[str]:
    """Every .py file under the mapped folders (caches and hidden folders left out), relative to the root."""
    found = set()
    for top in MAPPED:
        for p in (ROOT / top).rglob("*.py"):
            rel = p.relative_to(ROOT)
            if not any(part == "__pycache__" or part.startswith(".") for part in rel.parts):
                found.add(rel.as_posix())
    return found


def parse_map(text: str) -> tuple[list[tuple[str, str, str]], dict[str, str], list[str]]:
    """(entries as (folder, path, note), the note under each folder's heading, lines that look like entries
    but are not written as one)."""
    entries, notes, malformed = [], {}, []
    folder = None
    for n, line in enumerate(text.splitlines(), 1):
        heading = _FOLDER.match(line)
        if heading:
            folder = heading.group(1)
            notes[folder] = ""
            continue
        if line.startswith("- `"):
            m = _ENTRY.match(line)
            if not m:
                malformed.append(f"docs/layout.md:{n}: not `- \\`path\\` — what it holds`: {line}")
            elif folder is None:
                malformed.append(f"docs/layout.md:{n}: a module line before any folder heading")
            else:
                entries.append((folder, m.group(1), m.group(2)))
            continue
        if folder is not None and line.strip() and not line.startswith("#") and not entries_under(entries, folder):
            notes[folder] += " " + line.strip()
    return entries, notes, malformed


def entries_under(entries, folder: str) -> bool:
    return any(f == folder for f, _, _ in entries)


def test_the_map_lists_every_module_and_only_those():
    entries, _, malformed = parse_map(LAYOUT.read_text())
    assert not malformed, "\n".join(malformed)
    listed = [path for _, path, _ in entries]
    twice = sorted({p for p in listed if listed.count(p) > 1})
    assert not twice, f"listed more than once in docs/layout.md: {twice}"
    on_disk = modules_on_disk()
    missing = sorted(on_disk - set(listed))
    gone = sorted(set(listed) - on_disk)
    assert not missing and not gone, (
        "docs/layout.md and the tree disagree:\n"
        + "".join(f"  not listed (add its line under ## {p.rsplit('/', 1)[0]}/): {p}\n" for p in missing)
        + "".join(f"  listed but no longer exists (remove its line): {p}\n" for p in gone)
    )


def test_each_module_sits_under_its_folder_and_every_folder_says_its_role():
    entries, notes, _ = parse_map(LAYOUT.read_text())
    misplaced = [f"{path} under ## {folder}" for folder, path, _ in entries if path.rsplit("/", 1)[0] + "/" != folder]
    assert not misplaced, "a module's line goes under its own folder's heading:\n" + "\n".join(misplaced)
    folders = {folder for folder, _, _ in entries}
    silent = sorted(f for f in folders if len(notes.get(f, "").split()) < 3)
    assert not silent, f"these folders' headings need a line on the room's role: {silent}"
    assert all(len(note.split()) >= 2 for _, _, note in entries)


def test_the_parser_sees_what_a_reader_sees():
    text = (
        "# Code map\n\nintro\n\n## a/\n\nThe a room: what it holds.\n\n- `a/x.py` — the x\n- `a/y.py` - wrong dash\n"
        "- `b/z.py` — under the wrong folder\n"
    )
    entries, notes, malformed = parse_map(text)
    assert entries == [("a/", "a/x.py", "the x"), ("a/", "b/z.py", "under the wrong folder")]
    assert notes == {"a/": " The a room: what it holds."}
    assert len(malformed) == 1 and "a/y.py" in malformed[0]
