"""The adapter of a phasekv model (`PhaseKVForCausalLM`), and `adapter_for`, the adapter of a model of either family.

A phasekv model's queries read the prefilled `KVCache` in place (`KVCache.shared`), so one call continues many
contexts' queries at once without a copy of the cache per query.  `prefill_chunk` = C > 0 prefills a context C tokens
at a time into the same cache (the cache carries partial windows across calls, as in decoding), so the activations
of a prefill are one chunk's; the one-shot prefill is its reference (tests/test_chunked_prefill.py).
"""

from __future__ import annotations

import torch
from torch import nn

from phasekv.adapters.base import Adapter, ModelInfo
from phasekv.adapters.hf import HFAdapter
from phasekv.cache import KVCache
from phasekv.families import compression_geometry
from phasekv.model import PhaseKVForCausalLM


class PhaseKVAdapter(Adapter):
    # continue_from reads the cache in place (KVCache.shared), so one call may continue many contexts'
    # queries at once without a copy of the cache per query
    shares_cache = True

    def __init__(self, model: nn.Module, name: str = "phasekv", *, prefill_chunk: int = 0):
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 0:
            raise ValueError(f"prefill_chunk: must be an integer >= 0 (0: one forward), got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        cfg = model.config
        self.module, self.device = model.eval(), next(model.parameters()).device
        windowed = any(kind != "full" for kind in cfg.layer_types)
        self.info = ModelInfo(name=name, vocab_size=cfg.vocab_size, num_layers=cfg.num_hidden_layers,
                              num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                              head_dim=cfg.head_dim, max_length=cfg.max_position_embeddings,
                              stride=cfg.phase_stride, local_window=cfg.local_window if windowed else None)

    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.module.model.layers]

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.module(ids.to(self.device))

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> KVCache:
        cache, ids = KVCache(), ids.to(self.device)
        step = self.prefill_chunk or ids.shape[1]
        for lo in range(0, ids.shape[1], step):
            self.module.prefill(ids[:, lo:lo + step], cache)  # the cache only: no logits of the context
        return cache

    @torch.no_grad()
    def continue_from(self, cache: KVCache, ids: torch.Tensor, repeats: int) -> torch.Tensor:
        return self.module(ids.to(self.device), cache=cache.shared(repeats))


def adapter_for(model: nn.Module, name: str) -> Adapter:
    """The adapter of a model of either family (`phasekv.families`)."""
    if isinstance(model, PhaseKVForCausalLM):
        return PhaseKVAdapter(model, name)
    geometry = compression_geometry(model)  # transformers' own chunked compression: its stride is the phase stride
    return HFAdapter(model, name, stride=geometry["stride"] if geometry else None)
