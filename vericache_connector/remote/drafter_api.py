"""The drafter's HTTP request (`vericache drafter`, drafter_server.py), described where both its parser and its
`--help` read it (this module imports nothing heavy: cli_args.py builds the parser without torch)."""

from __future__ import annotations

import textwrap

# "mode" picks what runs, so that one node can measure its options side by side on the same link
# (benchmarks/disaggregated.py does).
MODES = {
    "vericache": "the default: fetch only the compressed copy and draft on it; the verifier beside the store "
    "checks the drafts (without --verifier: as local)",
    "local": "the same cache without the verifier: compressed copy first, the full copy streamed to this node",
    "full-kv": "fetch the full copy, then plain full-KV decoding (the baseline)",
    "recompute": "prefill the whole prompt here, then plain decoding (the store is not read)",
}

REQUEST_HELP = """\
POST /v1/generate takes a JSON object:
  prompt          text, tokenized with the model's tokenizer (or prompt_ids: token ids; one of the two)
  max_new_tokens  64         draft_k  8         temperature  0 (greedy)
  seed            0          stop_at_eos  true
  mode            what runs: one of the modes below (default vericache)
It answers: mode, path (how it was served: verified, hit, fetch, miss, recompute, ...), prompt_tokens,
tokens, text (the tokens decoded), timings (total_s, first_token_s, ...), bytes_compressed, bytes_full,
verify_calls, mean_accepted. A bad body is a 400 naming the field; GET /health answers once warmed up.

  curl -s 127.0.0.1:8000/v1/generate -d '{"prompt": "def fib(n):", "max_new_tokens": 32}'

modes:
""" + "\n".join(
    textwrap.fill(what, 110, initial_indent=f"  {name:<10}  ", subsequent_indent=" " * 14)
    for name, what in MODES.items()
)


def mode_error(mode: object) -> str:
    return f"mode must be one of {', '.join(MODES)} (vericache drafter --help says what each runs), got {mode!r}"
