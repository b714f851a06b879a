"""The dense default: every transformers architecture no other file of this package claims (Qwen3, Llama, ...).

Nothing special: decoder layers at `model.layers` (or `model.model.layers`, `transformer.h`,
`model.decoder.layers`), each `self_attn.o_proj` reading the heads' outputs (B, T, H * D) (the knockout target),
no chunked compression (no phase stride), no compressor gates to read or cycle, no indexer to train, and a cache
repeated per query row through `reorder_cache`.  phasekv's own models take this default too: their compressors
carry their own geometry and gates (`phasekv.compression`).
"""

from __future__ import annotations

from phasekv.archs.base import DEFAULT, Architecture, register


@register
class Dense(Architecture):
    name = DEFAULT
