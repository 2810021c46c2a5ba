"""Run a kvpress press (NVIDIA kvpress, PyPI `kvpress`) and read which positions each head keeps.

kvpress presses hook a Hugging Face model's attention modules during prefill. Our engine runs its own
Llama forward, so the bridge loads the same checkpoint directory as a transformers model (float32,
SDPA), prefills the prompt's token ids and calls the presses on what their hooks would see, then reads
back per layer which positions each KV head keeps:

  * presses that drop by gathering (ScorerPress.compress and its overrides, e.g. PyramidKV): every key
    row the press's own `compress` returns is matched exactly to its position in the keys it was
    given (an integer hash of the float bits, then a row-by-row equality check), so no selection rule
    is re-implemented here;
  * presses that mask instead (AdaKV's per-head budgets, KVzip): the `masked_key_indices`
    (batch, head, position) they leave on each attention module are dropped from the kept set.

All hook presses share one prefill (hook_masks); KVzip runs its own reconstruction passes once and
scores every requested ratio from them (kvzip_masks). The keys and values stored are then OUR
prefill's, at those positions (compressors/press.py).

Importing: `import kvpress` runs the package __init__, which imports every press (DuoAttention needs
`datasets`, the stats press `fire`) and patches transformers' attention functions globally. Neither is
needed to score, so the bridge registers the installed package directory without running its
__init__ and imports only the press modules it is asked for (`kvpress.presses.<name>_press`).

transformers >= 5.x no longer passes `cache_position` to attention modules, and kvpress 0.5.5's
BasePress.forward_hook reads kwargs["cache_position"] (KeyError otherwise); the bridge passes
cache_position=arange(T) to the model call, which forwards it to every attention module.

Progress: a press run is a float32 transformers prefill of the whole prompt, and KVzip adds one
reconstruction pass per chunk_size tokens (minutes for a few thousand tokens on a CPU), so each run shows a
bar on stderr (one tick per decoder layer per pass) once it has taken PROGRESS_DELAY_S.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import math
import sys
import threading
from pathlib import Path

import torch
from tqdm.auto import tqdm

Tensor = torch.Tensor
INSTALL = "pip install --no-deps kvpress==0.5.5"
_LOCK = threading.Lock()  # one press run at a time on a shared HF model
PROGRESS_DELAY_S = 2.0  # shorter runs show no bar


def _package():
    """The kvpress package object, registered without running its __init__ (see the module doc)."""
    if "kvpress" in sys.modules:
        return sys.modules["kvpress"]
    spec = importlib.util.find_spec("kvpress")
    if spec is None or spec.submodule_search_locations is None:
        raise ValueError(f"press compressors need kvpress, which is not installed ({INSTALL})")
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["kvpress"] = pkg
    return pkg


def kvpress_available() -> bool:
    return "kvpress" in sys.modules or importlib.util.find_spec("kvpress") is not None


def kvpress_module(name: str):
    """kvpress.<name> (e.g. "presses.kvzip_press", "utils"), imported without the package __init__."""
    _package()
    try:
        return importlib.import_module(f"kvpress.{name}")
    except ModuleNotFoundError as e:
        if e.name and e.name.startswith("kvpress"):
            raise ValueError(f"kvpress has no module {name!r}") from None
        raise ValueError(f"kvpress.{name} needs {e.name!r}, which is not installed") from None


def press_names() -> list[str]:
    """Names of the installed kvpress press modules (<name>_press.py), e.g. 'kvzip', 'snapkv'."""
    root = Path(_package().__path__[0]) / "presses"
    return sorted(p.name.removesuffix("_press.py") for p in root.glob("*_press.py"))


@functools.lru_cache(maxsize=None)
def press_class(name: str) -> type:
    """The press class of kvpress/presses/<name>_press.py ('expected_attention' -> ExpectedAttentionPress)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"press name must be a module name like 'kvzip', got {name!r}")
    if name not in press_names():
        raise ValueError(f"unknown kvpress press {name!r}; installed: {', '.join(press_names())}")
    base = kvpress_module("presses.base_press").BasePress
    module = kvpress_module(f"presses.{name}_press")
    found = [
        c
        for c in vars(module).values()
        if isinstance(c, type) and issubclass(c, base) and c.__module__ == module.__name__
    ]
    want = name.replace("_", "") + "press"
    exact = [c for c in found if c.__name__.lower() == want]
    if exact or len(found) == 1:
        return (exact or found)[0]
    raise ValueError(f"kvpress module {name}_press defines {[c.__name__ for c in found]}; none is {name!r}")


def compute_n_kept(num_tokens: int, compression_ratio: float) -> int:
    """kvpress's own rule for how many positions a press keeps (kvpress.utils.compute_n_kept)."""
    return kvpress_module("utils").compute_n_kept(num_tokens, compression_ratio)


@functools.lru_cache(maxsize=2)
def hf_model(model_dir: str):
    """The checkpoint as a transformers causal LM (float32, SDPA attention, eval), loaded once."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


# ---- which rows a gathering press kept ------------------------------------------------------------
def _row_hash(x: Tensor) -> Tensor:
    """[..., D] float -> [...] int64: sum of the float bit patterns times fixed odd coefficients
    (integer arithmetic, wrapping: exact and independent of summation order)."""
    ints = {4: torch.int32, 2: torch.int16, 8: torch.int64}[x.element_size()]
    gen = torch.Generator().manual_seed(0x5EED)
    coef = torch.randint(1, 2**62, (x.shape[-1],), generator=gen, dtype=torch.int64) * 2 + 1
    return (x.contiguous().view(ints).long() * coef.to(x.device)).sum(-1)


def match_rows(full: Tensor, kept: Tensor) -> Tensor:
    """Positions [H, n] in full [H, T, D] of the rows of kept [H, n, D] (each must occur exactly)."""
    hf, hk = _row_hash(full), _row_hash(kept)
    order = hf.argsort(-1)
    sorted_hash = hf.gather(-1, order)
    at = torch.searchsorted(sorted_hash, hk).clamp_(max=full.shape[1] - 1)
    pos = order.gather(-1, at)
    found = full.gather(1, pos[..., None].expand(-1, -1, full.shape[-1]))
    if not bool((found == kept).all()):
        raise ValueError("the press returned key rows that are not rows of its input (a merging press?)")
    if any(p.unique().numel() != p.numel() for p in pos):
        raise ValueError("the press returned the same key row twice")
    return pos.sort(-1).values


# ---- running presses ----------------------------------------------------------------------------
@contextlib.contextmanager
def progress(model, passes: int, desc: str):
    """A bar over the decoder layers' forwards of `passes` model passes: one tick per layer per pass."""
    layers = model.model.layers
    with tqdm(total=passes * len(layers), desc=desc, unit="layer", leave=False, delay=PROGRESS_DELAY_S) as bar:

        def tick(*_) -> None:  # None: a forward hook's return value would replace the layer's output
            bar.update(1)

        handles = [layer.register_forward_hook(tick) for layer in layers]
        try:
            yield bar
        finally:
            for handle in handles:
                handle.remove()


def kvzip_passes(num_tokens: int, chunk_size: int) -> int:
    """Model passes of one KVzip run on the whole prompt as context: the prefill, then one context
    reconstruction per chunk of chunk_size tokens (KVzipPress._chunk_fn)."""
    return 1 + max(1, math.ceil(num_tokens / chunk_size))


def _prefill(model, token_ids: list[int]) -> None:
    from transformers import DynamicCache

    t = len(token_ids)
    model.model(
        input_ids=torch.tensor([token_ids], device=model.device),
        past_key_values=DynamicCache(config=model.config),
        use_cache=True,
        cache_position=torch.arange(t, device=model.device),
    )


def _masked(module, keep: Tensor) -> None:
    """Drop the (batch, head, position) triples a masking press left on `module` from keep [H, T]."""
    masked = getattr(module, "masked_key_indices", None)
    if masked is not None:
        _, head, pos = masked
        keep[head.cpu(), pos.cpu()] = False
        del module.masked_key_indices


def hook_masks(presses: list, model, token_ids: list[int]) -> list[list[Tensor]]:
    """Kept masks [H_kv, T] per press, per layer, for presses applied by BasePress.forward_hook (every
    scorer press, AdaKV, PyramidKV, ...), all from ONE prefill of `token_ids`.

    What each press's own `with press(model)` run does at every attention module during prefill is
    compress(module, hidden_states, full keys, full values, attentions, kwargs) and write the result
    back to the cache, which no later computation of the prefill reads (each layer attends over its own
    keys of this forward). So one forward with a hook calling every press's compress on the same
    inputs, leaving the cache alone, gives every press exactly the inputs of its own run."""
    layers = model.model.layers
    t, h = len(token_ids), model.config.num_key_value_heads
    masks = [[torch.ones(h, t, dtype=torch.bool) for _ in layers] for _ in presses]

    def hook(module, args, kwargs, output):
        i = int(module.layer_idx)
        cache = kwargs["past_key_values"].layers[i]
        for keep, press in zip(masks, presses):
            keys = cache.keys.clone()
            k, _ = press.compress(module, kwargs["hidden_states"], keys, cache.values.clone(), output[1], kwargs)
            if k.shape[2] != keys.shape[2]:
                keep[i].zero_().scatter_(1, match_rows(keys[0], k[0]).cpu(), True)
            _masked(module, keep[i])
        return output

    names = ", ".join(sorted({type(p).__name__.removesuffix("Press") for p in presses}))
    with _LOCK:
        for press in presses:
            press.post_init_from_model(model)
        hooks = []
        try:
            for layer in layers:  # as BasePress.__call__: the presses read module.rotary_emb
                layer.self_attn.rotary_emb = model.model.rotary_emb
                hooks.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
            with torch.inference_mode(), progress(model, 1, f"kvpress {names} on {t} tokens"):
                _prefill(model, token_ids)
        finally:
            for handle in hooks:
                handle.remove()
    return masks


def kvzip_masks(press, ratios: list[float], model, token_ids: list[int]) -> list[list[Tensor]]:
    """Kept masks per compression ratio, per layer, of a KVzipPress: one KVzip run (prefill and
    context-reconstruction passes); its compress_post, which turns the reconstruction scores into
    masked positions, is called once per ratio on the same scores.

    kvpress assumes its chat-template prefix precedes the context and does not score it; the prompts
    here are raw token ids (plain text or any template), so the whole prompt is the context
    (prefix_length = 0)."""
    attn = [layer.self_attn for layer in model.model.layers]
    t, h = len(token_ids), model.config.num_key_value_heads
    out: list[list[Tensor]] = []
    post = press.compress_post

    def every_ratio(m):
        for ratio in ratios:
            press.compression_ratio = ratio
            post(m)
            keep = [torch.ones(h, t, dtype=torch.bool) for _ in attn]
            for module, k in zip(attn, keep):
                _masked(module, k)
            out.append(keep)

    passes = kvzip_passes(t, press.chunk_size)
    with _LOCK:
        press.compress_post = every_ratio  # instance attribute over the method
        try:
            desc = f"kvpress KVzip on {t} tokens ({passes} passes)"
            with torch.inference_mode(), progress(model, passes, desc), press(model):
                press.prefix_length = 0
                _prefill(model, token_ids)
        finally:
            del press.compress_post
            for module in attn:
                if hasattr(module, "masked_key_indices"):
                    del module.masked_key_indices
    if len(out) != len(ratios):
        raise ValueError(f"KVzip scored nothing for {len(token_ids)} tokens (compression_ratio {ratios})")
    return out
