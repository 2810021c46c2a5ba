"""The kvpress presets' kept masks on the session's shortest bundled prompt (graphlib_py, prefills[0]), computed
once per test run: one shared prefill for the hook presses and one KVzip run (press.press_masks), kept in this
process and shared with the other pytest-xdist workers (run_shared.shared). The press exactness tests build their
copies from them (PressCompressor.from_masks) and the serving tests hand them to the serving engine."""

from __future__ import annotations

PRESS = ["kvzip-5x", "expected-attention-4x", "adakv-ea-4x", "pyramidkv-4x"]
_MEMO: dict = {}


def graphlib_press_masks(prefills, tmp_path_factory) -> dict:
    """{preset: per layer the kept mask [H_kv, T] (bool)} for prefills[0]."""
    if "masks" not in _MEMO:
        from run_shared import shared

        from vericache_connector.compressors import get_compressor
        from vericache_connector.compressors.press import press_masks

        def compute():
            ids = list(prefills[0].prompt_ids)
            return dict(zip(PRESS, press_masks([get_compressor(s) for s in PRESS], ids)))

        _MEMO["masks"] = shared(tmp_path_factory, "press-masks-graphlib", compute)
    return _MEMO["masks"]
