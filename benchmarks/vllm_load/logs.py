"""What the servers' logs say about a run: the connector's loads and load-or-recompute decisions, vLLM's
speculative-decoding counts, the router's paths; and an excerpt of the connector's own lines for results.json
(the raw logs stay under the results folder's logs/, out of git).

A new per-row figure from the logs is a new key in log_stats() and its line in summary.entry().
"""

from __future__ import annotations

import re
import time
from pathlib import Path

# the connector's lines a reader re-checks a row's loads with (kept in results.json: "log_excerpt")
EXCERPT = re.compile(r"VeriCache load-or-recompute:|\bhit \S+: \d+ tokens loaded|load of \S+ failed")
# vLLM's prefix of a log line: "(EngineCore pid=31097) INFO 12-06 22:24:00 [scheduler.py:176] "
_PREFIX = re.compile(r"^(?:\(\S+ pid=\d+\) )?[A-Z]+ \d\d-\d\d (\d\d:\d\d:\d\d)(?:\.\d+)? \[[^\]]*\] ")


def summed(counts) -> dict[str, int]:
    """Per-key sums of {key: count} dicts (None: nothing)."""
    out: dict[str, int] = {}
    for c in counts:
        for k, v in (c or {}).items():
            out[k] = out.get(k, 0) + v
    return out


def _decisions(text: str) -> dict[str, int]:
    decisions: dict[str, int] = {}
    for line in text.splitlines():
        if "VeriCache load-or-recompute:" in line:
            tail = line.split("VeriCache load-or-recompute:", 1)[1]  # " <request>: <decision> ..."
            m = re.match(r"\s*\S+: (partial|recompute|load)\b", tail) or re.search(
                r"\b(partial|recompute|load)\b", tail
            )
            word = m.group(1) if m else "other"
            decisions[word] = decisions.get(word, 0) + 1
    return decisions


def _spec(text: str) -> list[int]:
    """[accepted, drafted] over vLLM's SpecDecoding metrics lines."""
    spec = [0, 0]
    for line in text.splitlines():
        if "SpecDecoding metrics" in line:
            for i, key in enumerate(("Accepted", "Drafted")):
                m = re.search(rf"{key}: (\d+) tokens", line)
                spec[i] += int(m.group(1)) if m else 0
    return spec


def _router(text: str) -> tuple[dict[str, int], int, int]:
    """The router's line per request: how it was served, its verify calls and accepted drafts."""
    paths: dict[str, int] = {}
    calls = accepted = 0
    for m in re.finditer(
        r"router: \S+: \d+ prompt \+ \d+ new tokens, (\w+).*?, (\d+) verify calls \([\d.]+s\), accepted \[([^\]]*)\]",
        text,
    ):
        paths[m.group(1)] = paths.get(m.group(1), 0) + 1
        calls += int(m.group(2))
        accepted += sum(int(x) for x in m.group(3).split(",") if x.strip())
    return paths, calls, accepted


# the proposer's periodic line: "... steps by batch (ms) {1: 53, 8: 73}, view draft steps by rows (ms) {8: 41.2}"
_STEPS = re.compile(r"steps by batch \(ms\) \{([^}]*)\}")
_VIEW_STEPS = re.compile(r"view draft steps by rows \(ms\) \{([^}]*)\}")
_CACHE_DRAFT = re.compile(r"VeriCache proposer: \{.*?\}, draft ([\d.]+) ms")
# the connector's counters on vLLM's /metrics: tokens vLLM accepted of the proposer's drafts, by source
_ACCEPTED = re.compile(r'^vericache_accepted_tokens(?:_total)?\{[^}]*source="(\w+)"[^}]*\} ([\d.e+]+)$', re.M)


def _by_size(text: str) -> dict[str, float]:
    """ "1: 53, 8: 73.5" -> {"1": 53.0, "8": 73.5}."""
    return {k.strip(): float(v) for k, v in (p.split(":") for p in text.split(",") if ":" in p)}


def step_times(text: str) -> dict:
    """The proposer's last word on step times: vLLM's steps without drafts by batch size (target_step_ms), one
    batched view draft step by rows (draft_step_ms), one draft step on a store copy's draft cache (ms)."""
    steps, views, cache = _STEPS.findall(text), _VIEW_STEPS.findall(text), _CACHE_DRAFT.findall(text)
    return {
        "target_step_ms": _by_size(steps[-1]) if steps else None,
        "draft_step_ms": _by_size(views[-1]) if views else None,
        "cache_draft_step_ms": float(cache[-1]) if cache else None,
    }


def accepted_by_source(metrics_text: str) -> dict[str, int] | None:
    """Tokens vLLM accepted of the proposer's drafts by source, from a server's /metrics (None: no proposer)."""
    got = _ACCEPTED.findall(metrics_text)
    return {source: int(float(n)) for source, n in got} if got else None


def scrape(base_url: str, timeout_s: float = 30) -> str:
    """A server's /metrics text ("" if it does not answer)."""
    import urllib.request

    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=timeout_s) as r:
            return r.read().decode(errors="replace")
    except OSError:
        return ""


def log_stats(text: str) -> dict:
    """The connector's and vLLM's counts in one run's server logs."""
    hits = re.findall(r"hit (\S+): (\d+) tokens loaded(.*)", text)
    loads = [float(m.group(1)) for _, _, rest in hits if (m := re.search(r"full after ([\d.]+)s", rest))]
    paths, calls, accepted = _router(text)
    return {
        "hits": len(hits),
        "hit_requests": len({req for req, _, _ in hits}),
        "loaded_tokens": [int(n) for _, n, _ in hits],
        "loads_s": loads,
        "load_failures": len(re.findall(r"load of \S+ failed", text)),
        "saves": len(re.findall(r"saved \S+: \d+ tokens", text)),
        "decisions": _decisions(text),
        "spec_log_accepted_drafted": _spec(text),
        "predrafted": [int(x) for x in re.findall(r"VeriCache pre-draft: (\d+) tokens", text)],
        "router_paths": paths,
        "router_verify_calls": calls,
        "router_accepted": accepted,
        **step_times(text),
    }


def excerpt(text: str) -> list[str]:
    """The connector's load lines (EXCERPT), each with its time of day and without vLLM's prefix."""
    return [_PREFIX.sub(r"\1 ", line.strip()) for line in text.splitlines() if EXCERPT.search(line)]


def read_logs(paths: list[Path]) -> str:
    return "".join(p.read_text(errors="replace") for p in paths if p.exists())


def wait_saves(log_path: Path, count: int, timeout_s: float = 300) -> None:
    """Saves run after a request is answered: wait until `count` are logged."""
    deadline = time.monotonic() + timeout_s
    while len(re.findall(r"saved \S+: \d+ tokens", log_path.read_text(errors="replace"))) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} saves not logged in {timeout_s:g} s ({log_path})")
        time.sleep(0.2)
