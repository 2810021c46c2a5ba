"""A press run shows its progress (kvpress_bridge.progress): one tick per decoder layer per model pass, the bar
full when the run ends, KVzip's reconstruction passes counted (a kvzip-5x run on a few thousand tokens takes
minutes on a CPU and printed nothing). A tiny random Llama with a byte-level tokenizer (KVzip tokenizes its
reconstruction prompt with the checkpoint's tokenizer). Skipped when kvpress is not installed."""

from __future__ import annotations

import pytest
import torch

from vericache_connector.compressors import get_compressor
from vericache_connector.compressors import kvpress_bridge as kb

pytestmark = pytest.mark.skipif(not kb.kvpress_available(), reason="kvpress not installed")
LAYERS = 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
    )
    path = tmp_path_factory.mktemp("tiny-hf-tok")
    LlamaForCausalLM(cfg).save_pretrained(path)
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}  # one token per byte
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return str(path)


class Bar:
    """Records what a tqdm bar is given."""

    made: list["Bar"] = []

    def __init__(self, total, desc, **kw):
        self.total, self.desc, self.n, self.kw, self.closed = total, desc, 0, kw, False
        Bar.made.append(self)

    def update(self, n):
        self.n += n
        return True  # as tqdm's does when it redraws: a hook passing it on would replace the layer's output

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.closed = True


@pytest.fixture
def bars(monkeypatch):
    Bar.made = []
    monkeypatch.setattr(kb, "tqdm", Bar)
    return Bar.made


def test_hook_presses_tick_once_per_layer_of_their_one_prefill(ckpt, bars):
    ids = torch.randint(0, 256, (100,), generator=torch.Generator().manual_seed(1)).tolist()
    comps = [get_compressor(f"{s},model={ckpt}") for s in ("press:knorm:ratio=4", "press:snapkv:ratio=2")]
    from vericache_connector.compressors.press import press_masks

    press_masks(comps, ids)
    (bar,) = bars
    assert bar.total == bar.n == LAYERS and bar.closed
    assert bar.desc == "kvpress Knorm, SnapKV on 100 tokens" and bar.kw["delay"] == kb.PROGRESS_DELAY_S
    assert not any(layer._forward_hooks for layer in kb.hf_model(ckpt).model.layers)  # hooks removed


@pytest.mark.parametrize("tokens, chunk", [(150, 64), (40, 64)])
def test_kvzip_counts_its_reconstruction_passes(ckpt, bars, tokens, chunk):
    ids = torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(2)).tolist()
    c = get_compressor(f"press:kvzip:ratio=4,options=chunk_size={chunk},model={ckpt}")
    masks = c.kept(ids)
    assert len(masks) == LAYERS and masks[0].shape == (2, tokens)
    (bar,) = bars
    passes = 1 + -(-tokens // chunk)  # the prefill, then one reconstruction per chunk
    assert kb.kvzip_passes(tokens, chunk) == passes
    assert bar.total == bar.n == LAYERS * passes and bar.closed, (bar.total, bar.n)
    assert f"on {tokens} tokens ({passes} passes)" in bar.desc
