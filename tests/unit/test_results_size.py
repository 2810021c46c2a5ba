"""results/ keeps what a reader needs to re-check a figure (results.json, table.md, command.txt, plots), not a
run's raw material: every results/<name>/<stamp>/ folder's tracked files stay under 2 MB together, and none lies
under a logs/ folder (.gitignore keeps them out; `git add -f` would not)."""

from __future__ import annotations

import shutil
import subprocess
from collections import defaultdict

import pytest

from paths import ROOT

LIMIT = 2 * 1024 * 1024


def tracked() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    out = subprocess.run(["git", "ls-files", "-z", "results"], cwd=ROOT, capture_output=True, check=True)
    return [p for p in out.stdout.decode().split("\0") if p]


def test_every_results_folder_is_under_2_mb():
    sizes: dict[str, int] = defaultdict(int)
    for path in tracked():
        parts = path.split("/")
        if len(parts) >= 4 and (ROOT / path).is_file():  # results/<name>/<stamp>/...
            sizes["/".join(parts[:3])] += (ROOT / path).stat().st_size
    big = {folder: size for folder, size in sizes.items() if size > LIMIT}
    assert sizes and not big, f"tracked results folders over {LIMIT} bytes: {big}"


def test_no_raw_logs_are_tracked():
    logs = [p for p in tracked() if "/logs/" in p]
    assert not logs, f"raw logs tracked under results/ (they stay out of git): {logs[:5]}"
