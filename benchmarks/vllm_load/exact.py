"""Exactness: every generated text against the reference run's (plain vLLM at the same concurrency and round,
request by request in the dataset's order; plain vLLM's own runs against plain vLLM at the lowest concurrency)."""

from __future__ import annotations


def compare(client: dict | None, reference: dict | None, requests: int, new: int) -> dict:
    """Request by request against the reference run (same order): identical is True only when both runs
    answered every request with `new` tokens, in the same order (same prompt lengths), with equal texts."""
    if client is None or reference is None:
        return {"identical": None if client is not None else False, "differing": None, "complete": client is not None}
    texts, ref = client.get("generated_texts") or [], reference.get("generated_texts") or []

    def complete(c):
        lens = c.get("output_lens") or []
        return c.get("completed") == requests and not c.get("failed") and len(lens) == requests and set(lens) == {new}

    ok = complete(client) and complete(reference) and len(texts) == len(ref) == requests
    same_order = client.get("input_lens") == reference.get("input_lens")
    differing = [i for i, (a, b) in enumerate(zip(texts, ref)) if a != b]
    return {
        "identical": bool(ok and same_order and not differing),
        "differing": differing,
        "complete": complete(client),
        "same_order": same_order,
    }


def check_runs(runs: list[dict], reference: str, configs: list[str], concurrency: list[int], requests: int, new: int):
    """Each run's exactness fields (compare) against its reference run; None where the reference is not run."""
    plain = {
        (r["round"], r["concurrency"]): r["client"] for r in runs if r["configuration"] == reference and r.get("client")
    }
    first_c = min(concurrency)
    for r in runs:
        c = first_c if r["configuration"] == reference else r["concurrency"]
        r.update(compare(r.get("client"), plain.get((r["round"], c)), requests, new))
        if reference not in configs and r.get("client") is not None:
            r["identical"] = None  # no reference run
