"""The workloads vllm_bench.py sends: documents, questions about them, shuffled with a fixed seed.

WORKLOADS is the table of named workloads (`--workload NAME`); a workload's figures are the defaults of
--documents, --doc-tokens, --questions, --new, --concurrency and --gbits (a flag given wins), and its `texts`
the documents it cuts (and --kv-space-gib, the servers' KV cache). A new workload is one entry here (its own `texts` where the bundled prompts do not fit).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# Generic questions: a document's requests share its whole chunks and differ only in the tail.
QUESTIONS = (
    "\n\nQuestion: Summarize the text above in one sentence.\nAnswer:",
    "\n\nQuestion: What is the main purpose of the text above?\nAnswer:",
    "\n\nQuestion: Name three functions, classes or terms defined or used above.\nAnswer:",
    "\n\nQuestion: What would you change to make the text above clearer?\nAnswer:",
    "\n\nQuestion: Who is the intended reader of the text above?\nAnswer:",
    "\n\nQuestion: Which part of the text above is the most important, and why?\nAnswer:",
)


def bundled_prompts() -> dict[str, str]:
    """The bundled real prompts (vericache_connector/data/prompts), by name."""
    from vericache_connector.data import load_prompts

    return load_prompts()


def long_documents() -> dict[str, str]:
    """The bundled long documents (vericache_connector/data/prompts/long: 6.6-7.4k tokens each), by name."""
    from vericache_connector.data import load_long_documents

    return load_long_documents()


@dataclass(frozen=True)
class WorkloadSpec:
    """A named workload: the documents it cuts and the grid it runs by default."""

    name: str
    about: str  # one line for --help
    documents: int
    doc_tokens: int  # each document cut to this many tokens
    questions: int  # per document (at most len(QUESTIONS))
    new: int  # tokens generated per request
    concurrency: tuple[int, ...]
    gbits: tuple[float, ...]
    kv_space_gib: int = 1  # every server's KV cache: the documents and every request's tokens at once
    texts: Callable[[], dict[str, str]] = bundled_prompts  # name -> text: the documents, in order


WORKLOADS = {
    w.name: w
    for w in (
        WorkloadSpec(
            "short",
            "bundled prompts cut to 1,800 tokens, 4 questions each, 64 new tokens",
            documents=4,
            doc_tokens=1800,
            questions=4,
            new=64,
            concurrency=(1, 4, 8),
            gbits=(0.1, 0.4),
        ),
        # LMCache's long-document QA shape, where reading the KV dominates a decode step: documents near the
        # model's 8k context, long answers, many requests at once; beside the store (0: no link emulated, the
        # rows measure decoding) and across the design card's slow link
        WorkloadSpec(
            "long",
            "long documents (data/prompts/long) cut to 6,400 tokens, 4 questions each, 256 new tokens",
            documents=4,
            doc_tokens=6400,
            questions=4,
            new=256,
            kv_space_gib=4,  # 4 x 6,400 document tokens + 16 x 300 request tokens: ~1.4 GiB, and room to spare
            concurrency=(1, 8, 16),
            gbits=(0.0, 0.1),
            texts=long_documents,
        ),
    )
}
DEFAULT = "short"


@dataclass
class Workload:
    documents: list[dict]  # name, tokens, stored (tokens every question shares), text
    requests: list[dict]  # document, question, prompt, tokens (shuffled: the order every client sends)
    warnings: list[str]


def build_workload(args, texts: dict[str, str], encode, decode, chunk: int) -> Workload:
    """Documents cut to --doc-tokens tokens and decoded back to text, --questions per document, shuffled with
    --seed. Checks that every prompt of a document keeps the document's whole chunks (the stored prefix every
    question shares) token for token after the text round trip."""
    docs, warnings = [], []
    for name, text in texts.items():
        ids = encode(text)
        if len(ids) >= args.doc_tokens:
            docs.append((name, ids[: args.doc_tokens]))
        if len(docs) == args.documents:
            break
    if len(docs) < args.documents:
        raise SystemExit(f"only {len(docs)} documents have {args.doc_tokens} tokens; lower --documents/--doc-tokens")
    shared = args.doc_tokens // chunk * chunk
    if shared == 0:
        warnings.append(f"--doc-tokens {args.doc_tokens} < the store's chunk ({chunk}): nothing is stored")
    documents, requests = [], []
    for name, ids in docs:
        text = decode(ids)
        documents.append({"name": name, "tokens": args.doc_tokens, "stored": shared, "text": text})
        for q in range(args.questions):
            prompt = text + QUESTIONS[q]
            got = encode(prompt)
            if got[:shared] != ids[:shared]:
                first = next((i for i, (x, y) in enumerate(zip(got, ids[:shared])) if x != y), min(len(got), shared))
                warnings.append(
                    f"{name} + question {q}: the text round trip changes token {first} of the first {shared}: "
                    "this question does not share the whole stored prefix"
                )
            if len(got) // chunk * chunk > shared:
                warnings.append(f"{name} + question {q}: a stored chunk holds question tokens (not shared)")
            requests.append({"document": name, "question": q, "prompt": prompt, "tokens": len(got)})
    random.Random(args.seed).shuffle(requests)
    return Workload(documents, requests, warnings)


def dataset_bytes(workload: Workload, new: int) -> bytes:
    """vLLM's `custom` dataset: one {"prompt", "output_tokens"} per line, in the order the client sends them."""
    return "".join(json.dumps({"prompt": r["prompt"], "output_tokens": new}) + "\n" for r in workload.requests).encode()


def write_dataset(workload: Workload, path: Path, new: int) -> str:
    """The dataset file (dataset_bytes); its sha1 (results.json records it: a rebuilt dataset is checked with it)."""
    data = dataset_bytes(workload, new)
    path.write_bytes(data)
    return hashlib.sha1(data).hexdigest()


def kv_bytes_per_token(model: str) -> int | None:
    """Full-copy bytes per token (float32 K and V, every layer), from the model's config.json."""
    try:
        c = json.loads((Path(model) / "config.json").read_text())
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * 4
    except (OSError, KeyError, ValueError):
        return None


def describe(args, work: Workload, chunk: int, per_token: int | None, link_scale: float) -> dict:
    """The workload as results.json records it (the documents without their text, the order, the link time)."""
    shared = work.documents[0]["stored"]
    return {
        "name": args.workload,
        "documents": [{k: v for k, v in d.items() if k != "text"} for d in work.documents],
        "doc_tokens": args.doc_tokens,
        "questions": args.questions,
        "requests": len(work.requests),
        "order": [(r["document"], r["question"]) for r in work.requests],
        "prompt_tokens": [r["tokens"] for r in work.requests],
        "new_tokens": args.new,
        "chunk": chunk,
        "full_copy_bytes": None if per_token is None else per_token * shared,
        "link_s": {f"{g:g}": per_token * shared * 8 / (g * 1e9 * link_scale) for g in args.gbits if g > 0}
        if per_token
        else None,
        "link_scaled_to": args.scale_to,
        "warnings": work.warnings,
    }
