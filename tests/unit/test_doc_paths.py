"""Every repository path README.md, docs/*.md and results/README.md name in backticks exists (their links are
checked by tests/integration/test_doc_commands.py::test_docs_are_linked_and_every_link_resolves).

A path is a word of a code span that contains a "/" and ends in .py, .md, .yaml, .yml, .sh or .json (a file), or
ends in "/" and starts with a folder of the repository or of the package (a folder). The docs write package paths
both ways, `vericache_connector/engine/serving.py` and `engine/serving.py`: a path exists when it does from the
repository root or from vericache_connector/. Not paths: URLs (`redis://...`), absolute and home paths, shell
variables, placeholders (`<stamp>`, `...`), and .venv/ (what `make install` makes); a glob (`k8s/secrets/*.yaml`)
must match a file."""

from __future__ import annotations

import re
from pathlib import Path

from doc_commands import doc_files

from paths import ROOT

PACKAGE = ROOT / "vericache_connector"
FILE_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".sh", ".json")
# Paths of other projects the docs name (vLLM's, LMCache's): not ours to find in this tree.
ELSEWHERE: set[str] = set()
_FENCED = re.compile(r"^\s*```.*?^\s*```", re.M | re.S)


def code_spans(text: str) -> list[str]:
    """The inline code spans of a Markdown text, fenced blocks left out (a span may cross a line break)."""
    return re.findall(r"`([^`]+)`", _FENCED.sub("", text))


def path_words(span: str) -> list[str]:
    """The words of a code span that name a repository path, cleaned of what surrounds them."""
    out = []
    for word in span.split():
        word = word.rsplit("=", 1)[-1].lstrip("([{\"'@").rstrip(".,;:)]}\"'")
        word = re.sub(r"(::|#).*$", "", word)  # tests/x.py::test_name, docs/x.md#anchor
        word = re.sub(r":\d+(-\d+)?$", "", word)  # file.py:81
        if "/" not in word or "://" in word or word.startswith(("/", "~", "$", ".venv/")):
            continue
        if any(s in word for s in ("<", ">", "...", "{", "}")):
            continue
        if word.endswith(FILE_SUFFIXES) or (word.endswith("/") and _names_a_top_folder(word)):
            out.append(word)
    return out


def _names_a_top_folder(word: str) -> bool:
    first = word.split("/", 1)[0]
    return any((base / first).is_dir() for base in (ROOT, PACKAGE)) and not first.startswith(".")


def exists(word: str) -> bool:
    for base in (ROOT, PACKAGE):
        if "*" in word:
            if any(base.glob(word)):
                return True
        elif (base / word).exists():
            return True
    return False


def missing_paths(path: Path) -> list[str]:
    return [
        f"{path.relative_to(ROOT)}: `{w}`"
        for span in code_spans(path.read_text())
        for w in path_words(span)
        if w not in ELSEWHERE and not exists(w)
    ]


def test_every_backticked_repository_path_exists():
    missing = [m for path in [*doc_files(), ROOT / "results" / "README.md"] for m in missing_paths(path)]
    assert not missing, "paths the docs name that do not exist (moved? fix the doc):\n" + "\n".join(missing)


def test_what_counts_as_a_path():
    assert path_words("engine/serving.py") == ["engine/serving.py"]
    assert path_words(".venv/bin/python benchmarks/vllm_bench.py --gbits 0.1") == ["benchmarks/vllm_bench.py"]
    assert path_words("tests/unit/test_layout.py::test_x") == ["tests/unit/test_layout.py"]
    assert path_words("(integration/vllm/proposer/),") == ["integration/vllm/proposer/"]
    assert path_words("local:///tmp/x redis://h:6379/0 ~/.cache/a.json $HOME/a.py results/<name>/<stamp>/") == []
    assert path_words("logs/ 20261206-163542/ cli.py") == []  # not a folder of ours; no "/"
    assert path_words("--config=k8s/helm/values.yaml") == ["k8s/helm/values.yaml"]
    assert exists("engine/serving.py") and exists("vericache_connector/engine/serving.py")
    assert exists("k8s/secrets/*.example.yaml") and not exists("k8s/secrets/*.nothing.yaml")
    assert not exists("integration/vllm/proposer.py")
    text = "a `tests/x.py` b\n```bash\ncat `not/a/span.py`\n```\n`split\nacross.md`"
    assert code_spans(text) == ["tests/x.py", "split\nacross.md"]
