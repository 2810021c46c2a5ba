"""Issue 28, case 1: a checkpoint copied with its fingerprint cache (`cp -a` keeps mtimes) and then edited,
its config.json or same-size weight bytes with the mtime set back, kept the model id of the original, so a
store written by the original served the edited model a hit. Now config.json is hashed on every call and
each file's cached digest is keyed by its identity (device, inode, size, mtime, ctime): the edited copy
gets its own id, misses, and gives its own full-KV output. Tiny random-weight checkpoints with the
bundled model's tokenizer files; an in-memory store."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch
from safetensors.torch import save_file

from storage_backends.identity import SIDECAR
from vericache_connector.engine import DecodeConfig, VeriCacheEngine
from vericache_connector.model.causal_lm import CausalLM
from vericache_connector.remote import RemoteCacheConfig, RemotePrefixCache

from tiny_model import TINY_HF_CONFIG, tiny_config

CFG = DecodeConfig(max_new_tokens=10, draft_k=4, stop_at_eos=False)
PROMPT = [int(x) for x in torch.randint(3, 256, (70,), generator=torch.Generator().manual_seed(5))]


@pytest.fixture(scope="module")
def original(tmp_path_factory, model_dir):
    path = tmp_path_factory.mktemp("edits") / "orig" / "checkpoint"
    path.mkdir(parents=True)
    torch.manual_seed(7)
    model = CausalLM(tiny_config())
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.08)
    save_file({f"model.{k}": v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**TINY_HF_CONFIG, "torch_dtype": "float32", "rope_theta": 10000.0}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{model_dir}/{name}", path / name)
    engine = VeriCacheEngine.from_pretrained(str(path))
    assert (path / SIDECAR).is_file()  # the fingerprint cache the copies inherit
    return path, engine


def copy_of(src, name: str):
    dst = src.parent.parent / name / "checkpoint"
    dst.parent.mkdir()
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    assert (dst / SIDECAR).is_file()
    return dst


def edit_keeping_mtime(path, change) -> None:
    """change(bytes) -> bytes of the same length, written in place with the old atime/mtime put back."""
    st = os.stat(path)
    data = path.read_bytes()
    new = change(data)
    assert len(new) == len(data) and new != data
    with open(path, "r+b") as f:
        f.write(new)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_mtime_ns == st.st_mtime_ns and os.stat(path).st_size == st.st_size


def flip_a_weight(data: bytes) -> bytes:
    """One byte near the end of the tensor data of a .safetensors file (past its JSON header)."""
    out = bytearray(data)
    out[-7] ^= 0x40
    return bytes(out)


def other_rope(data: bytes) -> bytes:
    return data.replace(b'"rope_theta": 10000.0', b'"rope_theta": 50000.0')  # the same size


def served(writer: VeriCacheEngine, reader: VeriCacheEngine, url: str):
    """The writer stores PROMPT's prefix; what the reader then gets for the same prompt."""
    cfg = RemoteCacheConfig(url=url, chunk_size=16)
    with RemotePrefixCache(writer, cfg) as cache:
        assert [cache.generate(PROMPT, CFG).path for _ in range(2)] == ["miss", "hit"]
    with RemotePrefixCache(reader, cfg) as cache:
        return cache.generate(PROMPT, CFG)


@pytest.mark.parametrize("what", ["config", "weights"])
def test_an_edited_copy_gets_its_own_id_and_misses(original, what, memory_url):
    src, a = original
    dst = copy_of(src, f"copy-{what}")
    assert VeriCacheEngine.from_pretrained(str(dst)).model_name == a.model_name  # an unedited copy: same model
    if what == "config":
        edit_keeping_mtime(dst / "config.json", other_rope)
    else:
        edit_keeping_mtime(dst / "model.safetensors", flip_a_weight)
    b = VeriCacheEngine.from_pretrained(str(dst))
    assert b.model_name != a.model_name
    ref_b = b.generate_full([b.prefill(PROMPT)], CFG)[0]
    res = served(a, b, memory_url)
    assert (res.path, res.tokens) == ("miss", ref_b)


def test_an_in_place_weight_edit_with_the_mtime_restored_changes_the_id(original):
    src, a = original
    dst = copy_of(src, "in-place")
    before = VeriCacheEngine.from_pretrained(str(dst)).model_name  # cached for dst's own inodes now
    edit_keeping_mtime(dst / "model.safetensors", flip_a_weight)  # same inode, same size and mtime
    assert before == a.model_name != VeriCacheEngine.from_pretrained(str(dst)).model_name
