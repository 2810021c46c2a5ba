"""Two checkpoints whose folders share a name (runA/checkpoint, runB/checkpoint) never share cache
entries: keys and manifests name a model by 'folder.fingerprint' (config, weights, tokenizer, dtype),
the same way in the engine and in the vLLM connector. B writes a prefix; A, asking for the same
prompt, misses and gives its own full-KV output (before, it read B's KV as a hit). Tiny random-weight
checkpoints with the bundled model's tokenizer files; an in-memory store."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from storage_backends import DualCopyStore, Manifest
from vericache_connector.engine import DecodeConfig, VeriCacheEngine
from vericache_connector.model.causal_lm import CausalLM
from vericache_connector.remote import RemoteCacheConfig, RemotePrefixCache

from stores import has_module, run
from tiny_model import TINY_HF_CONFIG, tiny_config

HF_CONFIG = {**TINY_HF_CONFIG, "torch_dtype": "float32"}
CFG = DecodeConfig(max_new_tokens=12, draft_k=4, stop_at_eos=False)
PROMPT = [int(x) for x in torch.randint(3, 256, (70,), generator=torch.Generator().manual_seed(3))]


def write_checkpoint(path, seed: int, tokenizer_from: str) -> str:
    torch.manual_seed(seed)
    model = CausalLM(tiny_config())
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.08)
    path.mkdir(parents=True)
    save_file({f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(HF_CONFIG))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tokenizer_from}/{name}", path / name)
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("runs")
    a = write_checkpoint(root / "runA" / "checkpoint", 0, model_dir)
    b = write_checkpoint(root / "runB" / "checkpoint", 1, model_dir)
    same_as_a = root / "runC" / "checkpoint"  # another folder, the same files
    shutil.copytree(a, same_as_a, ignore=shutil.ignore_patterns(".vericache-*"))
    return a, b, str(same_as_a)


def test_same_folder_name_different_weights_never_share_entries(checkpoints, memory_url):
    a_dir, b_dir, same_dir = checkpoints
    a, b = VeriCacheEngine.from_pretrained(a_dir), VeriCacheEngine.from_pretrained(b_dir)
    assert a.model_name != b.model_name
    assert a.model_name.startswith("checkpoint.") and b.model_name.startswith("checkpoint.")
    assert VeriCacheEngine.from_pretrained(same_dir).model_name == a.model_name  # named by content
    ref_a = a.generate_full([a.prefill(PROMPT)], CFG)[0]
    ref_b = b.generate_full([b.prefill(PROMPT)], CFG)[0]
    assert ref_a != ref_b  # the test can tell the two models apart

    cfg = RemoteCacheConfig(url=memory_url, chunk_size=16)
    with RemotePrefixCache(b, cfg) as cache:
        assert [cache.generate(PROMPT, CFG).path for _ in range(2)] == ["miss", "hit"]
        key = cache.store.keys.chunks(PROMPT[:64])[0].copy("full")
        manifest = Manifest.from_bytes(run(cache.store.backend.get(key)), key)
        assert manifest.model == b.model_name and key.startswith(b.model_name + "@")
    with RemotePrefixCache(a, cfg) as cache:
        first, second = cache.generate(PROMPT, CFG), cache.generate(PROMPT, CFG)
    assert (first.path, first.tokens) == ("miss", ref_a)  # B's entries are not A's
    assert (second.path, second.tokens) == ("hit", ref_a)


def test_explicit_model_name_overrides_the_identity(checkpoints, memory_url):
    """RemoteCacheConfig.model_name is taken as is: it must then identify the weights itself."""
    a = VeriCacheEngine.from_pretrained(checkpoints[0])
    with RemotePrefixCache(a, RemoteCacheConfig(url=memory_url, chunk_size=16, model_name="my-model-v3")) as cache:
        assert cache.store.keys.model_name == "my-model-v3"


def test_another_models_manifest_under_our_key_is_a_logged_miss(checkpoints, memory_url, caplog):
    """A manifest naming another model, found under this model's key, is not trusted: warning, and the
    output is still this model's full-KV output."""
    a = VeriCacheEngine.from_pretrained(checkpoints[0])
    ref = a.generate_full([a.prefill(PROMPT)], CFG)[0]
    layers = [{"k": k, "v": v} for k, v in zip(*(lambda p: (p.keys, p.values))(a.prefill(PROMPT[:64]).prefix))]

    async def plant():
        async with DualCopyStore(memory_url, "other.0123456789abcdef", torch.float32, 16) as other:
            await other.put_prefix(PROMPT[:64], layers)
            ours = DualCopyStore(memory_url, a.model_name, torch.float32, 16)
            for c_other, c_ours in zip(other.keys.chunks(PROMPT[:64]), ours.keys.chunks(PROMPT[:64])):
                m = Manifest.from_bytes(await other.backend.get(c_other.copy("full")))
                m.key = c_ours.copy("full")  # a well-formed manifest at our key, naming the other model
                await other.backend.put(m.key, m.to_bytes())

    run(plant())
    with RemotePrefixCache(a, RemoteCacheConfig(url=memory_url, chunk_size=16)) as cache:
        res = cache.generate(PROMPT, CFG)
    assert (res.path, res.tokens) == ("miss", ref)  # the lookup reads the manifest: a miss, not a fetch
    assert "other.0123456789abcdef" in caplog.text  # the warning names the model the manifest is for


@pytest.mark.skipif(not has_module("vllm"), reason="vllm is not installed")
def test_vllm_connector_names_models_as_the_engine_does(checkpoints):
    from vericache_connector.integration.vllm.connector.facade import model_name_of

    def vllm_config(model, revision=None, hf_config=None):
        mc = SimpleNamespace(model=model, dtype=torch.float32, revision=revision, hf_config=hf_config)
        return SimpleNamespace(model_config=mc)

    a_dir, b_dir, _ = checkpoints
    a, b = VeriCacheEngine.from_pretrained(a_dir), VeriCacheEngine.from_pretrained(b_dir)
    assert model_name_of(vllm_config(a_dir), None) == a.model_name
    assert model_name_of(vllm_config(b_dir + "/"), None) == b.model_name
    assert model_name_of(vllm_config(a_dir), "explicit-name") == "explicit-name"
    # a hub name with no local snapshot: the full name (organisation too), its config and revision
    hub = {
        (org, rev): model_name_of(vllm_config(f"{org}/checkpoint", rev, HF_CONFIG), None)
        for org in ("orgA", "orgB")
        for rev in ("main", "v2")
    }
    assert len(set(hub.values())) == 4
    assert hub["orgA", "main"] == model_name_of(vllm_config("orgA/checkpoint", "main", dict(HF_CONFIG)), None)
