"""Every fenced block of README.md and docs/*.md: the shell blocks run as written, the rest is marked.

- The static checks (fast, nothing started): every fence names its language; an HTML comment right above
  a fence is a marker this test knows (tests/support/doc_commands.py, docs/tests.md), a `not run` one
  with its reason; a python block is run by a named test that exists or marked `not run`; every docs/
  page and results/README.md is linked from the README, and every relative link and anchor resolves; the
  README stays short.
- The runs: each file's shell blocks, in order, from the repository root on 127.0.0.1, servers started
  as documented (their ports are the documented ones: all these runs are one xdist group, one after
  another), checked ready and stopped at the end. docs/vllm.md runs in
  tests/integration/vllm/test_readme_commands.py (it shares that vLLM server with more checks).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from doc_commands import (
    _MARK,
    SHELL,
    DocRun,
    blocks,
    check_server_mark,
    doc_files,
    model_subst,
    needs,
)

from paths import ROOT
from stores import need

RUN_ELSEWHERE = {"docs/vllm.md": "tests/integration/vllm/test_readme_commands.py"}
README_MAX_BYTES = 11_000  # issues 25, 51: about 10 kB; the details live in docs/ (the code map: docs/layout.md)


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def docs_to_run() -> list[str]:
    return [rel(p) for p in doc_files() if rel(p) not in RUN_ELSEWHERE and any(b.runs_here for b in blocks(p))]


# ---------------------------------------------------------------- static checks
def _problems(b) -> list[str]:
    out = []
    if not b.lang:
        out.append("a fence without a language (```text for output, ```bash for commands)")
    out += [f"unknown comment right above the fence: {c!r}" for c in b.comments if not _MARK.match(c)]
    if "not run" in b.marks and (not b.marks["not run"] or len(b.marks) > 1):
        out.append("`not run:` needs a reason and goes alone")
    for kind in ("expect", "expect within"):
        if kind in b.marks:
            try:
                re.compile(b.marks[kind].split(" ", 1)[1] if kind == "expect within" else b.marks[kind])
            except re.error as e:
                out.append(f"{kind} is not a regex: {e}")
    if "server" in b.marks:
        bad = check_server_mark(b.marks["server"])
        out += [bad] if bad else []
        if any(k in b.marks for k in ("expect", "expect within")):
            out.append("a server block's output is its log: no `expect` on it")
    if b.lang == "python":
        by = b.marks.get("run by")
        if by is None and "not run" not in b.marks:
            out.append("a python block needs `run by: tests/...py::test_name` or `not run: REASON`")
        if by is not None:
            path, _, name = by.partition("::")
            f = ROOT / path
            if not (f.is_file() and re.search(rf"^def {re.escape(name)}\(", f.read_text(), re.M)):
                out.append(f"`run by:` names {by!r}, which does not exist")
    elif b.lang not in SHELL and b.marks:
        out.append(f"markers on a {b.lang or 'plain'} block, which is not a command")
    if b.lang in SHELL and "run by" in b.marks:
        out.append("shell blocks are run here: `run by:` is for python blocks")
    return out


def test_every_block_is_runnable_or_marked():
    problems = [f"{b.where}: {p}" for path in doc_files() for b in blocks(path) for p in _problems(b)]
    assert not problems, "\n".join(problems)
    shell = [b for path in doc_files() for b in blocks(path) if b.lang in SHELL]
    assert sum(b.runs_here for b in shell) >= 10, "the docs' commands are (nearly) all marked `not run`"
    for doc, test in RUN_ELSEWHERE.items():  # the files run by another test are named by it
        assert doc in (ROOT / test).read_text(), f"{test} does not run {doc}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces -> hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^\s*```.*?^\s*```", "", path.read_text(), flags=re.M | re.S)
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_docs_are_linked_and_every_link_resolves():
    readme = (ROOT / "README.md").read_text()
    pages = [rel(p) for p in doc_files()[1:]] + ["results/README.md"]
    unlinked = [p for p in pages if f"]({p})" not in readme and f"]({p}#" not in readme]
    assert not unlinked, f"README.md does not link {unlinked}"
    broken = []
    for path in [*doc_files(), ROOT / "results" / "README.md"]:
        text = re.sub(r"^\s*```.*?^\s*```", "", path.read_text(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{rel(path)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{rel(path)}: {target} (no heading with that anchor)")
    assert not broken, "\n".join(broken)


def test_readme_stays_short():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes: move details to docs/"


# ---------------------------------------------------------------- the runs
def run_doc(path: Path, log_dir: Path, model_dir: str) -> DocRun:
    """Run one file's shell blocks (servers stopped at the end); the DocRun, for its timings."""
    missing = needs(path)
    need(not missing, f"{rel(path)}: {'; '.join(missing)}")
    busy = lambda port, where: need(  # noqa: E731
        False, f"{where}: 127.0.0.1:{port} is taken (the docs' servers use their documented ports)"
    )
    with DocRun(path, log_dir, subst=model_subst(model_dir), port_busy=busy) as run:
        run.run_all()
    return run


@pytest.mark.slow
@pytest.mark.xdist_group("doc_commands")  # documented ports: one file at a time, on one worker
@pytest.mark.parametrize("doc", docs_to_run())
def test_doc_commands_run_as_written(doc, model_dir, tmp_path):
    t0 = time.monotonic()
    run = run_doc(ROOT / doc, tmp_path, model_dir)
    lines = [f"{where}: {s:.1f} s" for where, s in run.timings]
    print(f"{doc}: {time.monotonic() - t0:.1f} s\n" + "\n".join(lines))
