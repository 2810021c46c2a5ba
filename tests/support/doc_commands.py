"""The fenced blocks of README.md and docs/*.md, and a runner for their shell blocks, as a reader runs them.

A block is what a fence opens (```bash, ```python, ```text, ...; every fence names its language). An HTML
comment on the line(s) right above a fence says what the block is (docs/tests.md has the table):

    <!-- not run: REASON -->                   not run here (a cluster, a GPU, a long run): REASON required
    <!-- server: tcp://127.0.0.1:PORT -->      a server a reader starts in a terminal of its own: ready when
    <!-- server: http://127.0.0.1:PORT/health -->   the port accepts / the URL answers 200 / its output
    <!-- server: log TEXT -->                        shows TEXT; stopped when the file's blocks are done
    <!-- expect: REGEX -->                     its output must match REGEX (re.M)
    <!-- expect within N s: REGEX -->          run again each second until its output matches, N s at most
    <!-- run by: tests/PATH.py::test_name -->  a python block that test runs

Shell blocks (bash, sh, shell) without `not run` are run by DocRun: each in a fresh `bash -e -o pipefail`
from the repository root (as a new terminal: nothing carries over from one block to the next), with the
environment of a fresh shell (the tests' own VERICACHE_*, VLLM_*, LMCACHE_* and AWS_* variables removed),
one after another in the file's order. A block that exits non-zero, a server that exits or is not ready
in time, and an expectation that does not match each raise AssertionError with the block's place and
output.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.kit.vllm_server import stop_group, wait_healthy

from paths import ROOT

SHELL = ("bash", "sh", "shell")
MARKS = ("not run", "server", "expect", "expect within", "run by")
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
_MARK = re.compile(r"^<!--\s*(not run|server|expect within (\d+) s|expect|run by):\s*(.*?)\s*-->$", re.S)
FRESH_SHELL_DROPS = ("VERICACHE_", "VLLM_", "LMCACHE_", "AWS_")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass
class Block:
    path: Path
    line: int  # the opening fence's line, 1-based
    lang: str
    text: str
    marks: dict[str, str] = field(default_factory=dict)  # kind -> value ("expect within" -> "N REGEX")
    comments: list[str] = field(default_factory=list)  # every comment right above, marker or not

    @property
    def where(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"

    @property
    def runs_here(self) -> bool:
        """A shell block the runner executes (everything else is run elsewhere, not run, or not a command)."""
        return self.lang in SHELL and "not run" not in self.marks


def _comments_above(lines: list[str], i: int) -> list[str]:
    """The HTML comments on the lines right above line i (no blank line between), top to bottom."""
    out, j = [], i - 1
    while j >= 0 and lines[j].strip().endswith("-->"):
        k = j
        while k >= 0 and "<!--" not in lines[k]:
            k -= 1
        if k < 0:
            break
        out.insert(0, " ".join(s.strip() for s in lines[k : j + 1]))
        j = k - 1
    return out


def blocks(path: Path) -> list[Block]:
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.groups()
        j = i + 1
        while j < len(lines) and not re.match(r"^\s*```\s*$", lines[j]):
            j += 1
        assert j < len(lines), f"{path}:{i + 1}: the fence opened here is never closed"
        body = "\n".join(s[len(indent) :] if s.startswith(indent) else s for s in lines[i + 1 : j]) + "\n"
        block = Block(path, i + 1, lang, body, comments=_comments_above(lines, i))
        for c in block.comments:
            mm = _MARK.match(c)
            if mm:
                kind, secs, value = mm.groups()
                block.marks["expect within" if secs else kind] = f"{secs} {value}" if secs else value
        out.append(block)
        i = j + 1
    return out


def fresh_shell_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment as a new terminal would have it: none of the tests' own settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(FRESH_SHELL_DROPS)}
    if os.environ.get("VERICACHE_CACHE_DIR"):  # where the model is: the docs' commands must find it too
        env["VERICACHE_CACHE_DIR"] = os.environ["VERICACHE_CACHE_DIR"]
    return {**env, **(extra or {})}


def _port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 0.5).close()
        return True
    except OSError:
        return False


def server_port(block: Block) -> int | None:
    """The port a server block listens on, from its marker (None for `log TEXT`)."""
    m = re.match(r"^(?:tcp|http)://127\.0\.0\.1:(\d+)(/health)?$", block.marks["server"])
    return int(m.group(1)) if m else None


def check_server_mark(value: str) -> str | None:
    """What is wrong with a `server:` marker's value (None: nothing)."""
    if re.match(r"^tcp://127\.0\.0\.1:\d+$", value) or re.match(r"^http://127\.0\.0\.1:\d+/health$", value):
        return None
    if re.match(r"^log \S", value):
        return None
    return f"server marker {value!r} is none of tcp://127.0.0.1:PORT, http://127.0.0.1:PORT/health, log TEXT"


@dataclass
class Server:
    block: Block
    proc: subprocess.Popen
    log_path: Path
    port: int | None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class DocRun:
    """One file's shell blocks, in order; servers stay up until the end (or `with` exits).

    subst: literal replacements made in every block before it runs (e.g. the docs' model path, where
    $VERICACHE_CACHE_DIR moves the model); port_busy(port, where): called when a server's port is already
    taken before it starts (the tests skip or fail there)."""

    def __init__(
        self,
        path: Path,
        log_dir: Path,
        subst: dict[str, str] | None = None,
        port_busy=None,
        block_timeout_s: float = 600,
        ready_timeout_s: float = 600,
    ):
        self.path, self.log_dir = path, Path(log_dir)
        self.subst = subst or {}
        self.port_busy = port_busy
        self.block_timeout_s, self.ready_timeout_s = block_timeout_s, ready_timeout_s
        self.env = fresh_shell_env()
        self.servers: list[Server] = []
        self.timings: list[tuple[str, float]] = []  # (where, seconds) per block run

    def __enter__(self) -> "DocRun":
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self

    def __exit__(self, *exc) -> None:
        for s in reversed(self.servers):
            stop_group(s.proc)
        self.servers.clear()

    def blocks(self) -> list[Block]:
        return [b for b in blocks(self.path) if b.runs_here]

    def run_all(self) -> None:
        for b in self.blocks():
            self.run(b)

    def server(self, pattern: str) -> Server:
        """The running server whose block matches pattern (re.search)."""
        (s,) = [s for s in self.servers if re.search(pattern, s.block.text)]
        return s

    # ---------------------------------------------------------------- one block
    def _text(self, b: Block) -> str:
        text = b.text
        for old, new in self.subst.items():
            text = text.replace(old, new)
        return text

    def _context(self) -> str:
        """The servers' log tails, for a failure message."""
        return "".join(f"\n--- server {s.block.where} log (tail) ---\n{s.log()[-3000:]}" for s in self.servers)

    def run(self, b: Block) -> None:
        t0 = time.monotonic()
        if "server" in b.marks:
            self._start(b)
        else:
            self._command(b)
        self.timings.append((b.where, time.monotonic() - t0))

    def _command(self, b: Block) -> None:
        within = b.marks.get("expect within")
        limit, pattern = (
            (float(within.split(" ", 1)[0]), within.split(" ", 1)[1]) if within else (0, b.marks.get("expect"))
        )
        deadline = time.monotonic() + limit
        while True:
            try:
                r = subprocess.run(
                    ["bash", "-e", "-o", "pipefail", "-c", self._text(b)],
                    cwd=ROOT,
                    env=self.env,
                    capture_output=True,
                    text=True,
                    timeout=self.block_timeout_s,
                )
            except subprocess.TimeoutExpired as e:
                raise AssertionError(
                    f"{b.where}: still running after {self.block_timeout_s:g} s{self._context()}"
                ) from e
            matched = pattern is None or re.search(pattern, r.stdout, re.M) is not None
            if r.returncode == 0 and matched:
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(1)
        what = f"exited with {r.returncode}" if r.returncode else f"printed nothing matching {pattern!r}"
        raise AssertionError(
            f"{b.where}: the block {what}\n--- block ---\n{b.text}--- stdout ---\n{r.stdout[-4000:]}"
            f"\n--- stderr ---\n{r.stderr[-4000:]}{self._context()}"
        )

    def _start(self, b: Block) -> None:
        port = server_port(b)
        if port is not None and _port_open(port) and self.port_busy is not None:
            self.port_busy(port, b.where)
        log_path = self.log_dir / f"server-{b.line}.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                ["bash", "-e", "-o", "pipefail", "-c", self._text(b)],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop_group ends it and its children
            )
        server = Server(b, proc, log_path, port)
        self.servers.append(server)
        try:
            self._wait_ready(server)
        except (RuntimeError, TimeoutError) as e:
            raise AssertionError(f"{b.where}: the server did not start: {e}{self._context()}") from None

    def _wait_ready(self, s: Server) -> None:
        mark = s.block.marks["server"]
        if mark.startswith("http://"):
            wait_healthy(s.proc, s.port, self.ready_timeout_s, str(s.log_path))
            return
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if s.proc.poll() is not None:
                raise RuntimeError(f"it exited with {s.proc.returncode}")
            if _port_open(s.port) if s.port is not None else mark[4:] in s.log():
                return
            time.sleep(0.5)
        raise TimeoutError(f"not ready in {self.ready_timeout_s:g} s")


# ---------------------------------------------------------------- what the tests share
DOCS_MODEL = "~/.cache/vericache/smollm2-135m-instruct"  # the converted model's path as the docs write it


def model_subst(model_dir: str) -> dict[str, str]:
    """No change where the model is where the docs say; else the docs' path -> model_dir."""
    if os.path.realpath(os.path.expanduser(DOCS_MODEL)) == os.path.realpath(model_dir):
        return {}
    return {DOCS_MODEL: model_dir}


def needs(path: Path) -> list[str]:
    """Why this file's commands cannot run here ([] when they can): the venv they name, the programs
    their servers and commands start."""
    text = "".join(b.text for b in blocks(path) if b.runs_here)
    missing = []
    if ".venv/bin/" in text and not (ROOT / ".venv" / "bin" / "python").exists():
        missing.append(".venv is missing (make install creates it)")
    for prog in ("redis-server", "redis-cli", "curl"):
        if re.search(rf"(^|[\s;|&(]){prog}\b", text, re.M) and not shutil.which(prog):
            missing.append(f"{prog} is not installed")
    return missing
