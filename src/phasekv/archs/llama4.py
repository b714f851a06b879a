"""transformers' Llama 4 text model (`model_type: llama4_text`, `Llama4ForCausalLM`; `llama4` for the multimodal
config's text part): chunked local attention as a fixed grid.

Llama 4's chunked layers (`attention_chunk_size` C, the RoPE layers; `no_rope_layers` marks them) let a token at
position t attend only the tokens of its own chunk, positions floor(t / C) * C .. t: chunks are aligned at multiples
of C from position 0, like the windows of a chunked compressor with W = S = C, except that nothing of an earlier
chunk is kept at all.  The global layers (NoPE, every fourth in the real model) attend everything.  So phase =
position mod C, relative to the chunk grid: a record whose key and value fall in different chunks is cut in every
chunked layer, and only the global layers can carry it (docs/science.md section 1).

`geometry` is that grid: window = stride = C over the chunked layers (no gates, no indexer: nothing is learned
about the grid).  Its attention has an `o_proj` (the dense default's knockout target).
"""

from __future__ import annotations

from typing import Any

from phasekv.archs.base import Architecture, CompressionGeometry, register, text_config


@register
class Llama4(Architecture):
    name = "llama4"
    model_types = ("llama4_text", "llama4")

    def geometry(self, config: Any) -> CompressionGeometry | None:
        text = text_config(config)
        chunk = getattr(text, "attention_chunk_size", None)
        layers = tuple(i for i, t in enumerate(getattr(text, "layer_types", None) or []) if t == "chunked_attention")
        if not chunk or not layers:
            return None
        return CompressionGeometry("llama4_chunked_attention", chunk, chunk, layers)
