"""Head-partitioned history as a layer kind of phasekv's own models, so a model can be trained with it
(docs/notes/heads.md).  The training-free condition for transformers models is `phasekv.conditions.head_slices`.

A layer of kind "slices" is full causal attention in which each head group (a KV head with the query heads that
read it, or with `group: query` each query head) reads only its own slice of the past, defined by position, plus
a local tail and an attention sink that every head keeps.  Built from a one-sentence description of CoWindow-style
attention ("partitions history by position across heads, so each head covers a slice"); no public code or paper
text of it was available, so every choice here is ours.  With G groups a key at position s belongs to group

    owner(s) = floor((s + o) / L) mod G

  - kind: contiguous: slices of L = `size` consecutive positions dealt to the groups in turn (period G * L);
  - kind: interleaved: L = 1, owner(s) = (s + o) mod G;
  - shift: fixed: o = 0 in every layer; shift: layer: o = floor(l * G * L / layers) in layer l (the boundaries and
    the dealing order move from layer to layer; per head they cannot, a tiling by slices of one length keeps every
    boundary on one grid mod L).

A query at t reads key s <= t of its group when owner(s) is the group, s < sink or t - s < local.  The phase
stride this layer reports (`geometry`) is L for contiguous slices and G for interleaved ones: the position
relative to the slice boundaries.  `groups` must equal the model's number of groups (KV heads, or query heads
with group: query): a layer checks it, so a config states its phase period explicitly.

This is no compressor (the cache holds every key: it measures what the heads can read, not a smaller cache): its
options are registered as a layer kind's (`register_options`), not in the compressor registry, and
`phasekv.attention.Attention` runs the layer as a full layer under `HeadSlices.mask`.  `reference_attention` is
the slow oracle (one query and one head at a time, the allowed keys listed by hand).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from phasekv.config import CompressorOptions, ModelConfig, register_options, spec

NAME = "slices"  # the layer kind in `ModelConfig.layer_types`
KINDS = ("contiguous", "interleaved")
SHIFTS = ("fixed", "layer")
GROUPS = ("kv", "query")


@dataclass
class HeadSliceOptions(CompressorOptions):
    kind: str = spec("contiguous", choices=KINDS)
    size: int = spec(8, low=1, high=1 << 16)  # L, positions per slice (1 for interleaved)
    groups: int = spec(4, low=1, high=1024)  # G: the model's KV heads (group: kv) or query heads (group: query)
    group: str = spec("kv", choices=GROUPS)
    shift: str = spec("fixed", choices=SHIFTS)
    local: int = spec(16, low=1, high=1 << 20)  # the local tail every head reads (the query itself included)
    sink: int = spec(1, low=0, high=1 << 20)  # positions below `sink` every head reads

    def validate(self) -> None:
        if self.kind == "interleaved" and self.size != 1:
            raise ValueError(f"{self.section}.size: kind interleaved has slices of one position (size 1), "
                             f"got {self.size}")

    def geometry(self) -> tuple[int, int]:
        period = self.size if self.kind == "contiguous" else self.groups
        return period, period


register_options(NAME, HeadSliceOptions)


def layer_offset(layer_idx: int, layers: int, period: int) -> int:
    """shift: layer: layer i's slice boundaries moved by floor(i * period / layers)."""
    return (layer_idx * period) // layers


def slice_keep(key_pos: torch.Tensor, query_pos: torch.Tensor, *, size: int, groups: int,
               offset: int | torch.Tensor, sink: int, local: int) -> torch.Tensor:
    """(B | 1, G, Tq, Tk) bool, before the causal order: the keys of each group's slice (owner(s), with `offset`
    an int or one per row, (B,)) plus the sink and local tail every group reads.  Shared by this layer kind and the
    training-free condition (`phasekv.conditions.head_slices`)."""
    o = torch.as_tensor(offset, device=key_pos.device).reshape(-1, 1, 1, 1)
    owner = torch.div(key_pos + o, size, rounding_mode="floor") % groups  # (B | 1, 1, 1, Tk)
    mine = owner == torch.arange(groups, device=key_pos.device).view(1, groups, 1, 1)  # (B | 1, G, 1, Tk)
    shared = (key_pos[None, :] < sink) | (query_pos[:, None] - key_pos[None, :] < local)  # (Tq, Tk)
    return mine | shared[None, None]


class HeadSlices:
    """The slicing of one layer: which keys each head may read."""

    def __init__(self, options: HeadSliceOptions, config: ModelConfig, layer_idx: int):
        groups = config.num_key_value_heads if options.group == "kv" else config.num_attention_heads
        if options.groups != groups:
            raise ValueError(f"{options.section}.groups: {options.groups}, but the model has {groups} "
                             f"{'KV' if options.group == 'kv' else 'query'} heads (group: {options.group})")
        if config.attn_sink:
            raise ValueError(f"{options.section}: a slices layer is full attention, which has no learned sink "
                             "(model.attn_sink)")
        self.options, self.groups, self.heads = options, groups, config.num_attention_heads
        period = groups * options.size
        self.offset = layer_offset(layer_idx, config.num_hidden_layers, period) if options.shift == "layer" else 0

    def owner(self, positions: torch.Tensor) -> torch.Tensor:
        """The group owning each key position (any shape)."""
        return torch.div(positions + self.offset, self.options.size, rounding_mode="floor") % self.groups

    def keep(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """(G, Tq, Tk) bool: the keys each group's queries read, causal order included."""
        o = self.options
        keep = slice_keep(key_pos, query_pos, size=o.size, groups=self.groups, offset=self.offset, sink=o.sink,
                          local=o.local)[0]
        return keep & (key_pos[None, :] <= query_pos[:, None])[None]

    def mask(self, query_pos: torch.Tensor, key_pos: torch.Tensor) -> torch.Tensor:
        """(1, H, Tq, Tk) bool for scaled-dot-product attention: each group's keep given to its query heads."""
        return self.keep(query_pos, key_pos).repeat_interleave(self.heads // self.groups, dim=0)[None]


def reference_attention(slices: HeadSlices, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        query_pos: torch.Tensor) -> torch.Tensor:
    """The slow oracle of a slices layer's attention: q (B, H, Tq, D) at `query_pos` over k, v (B, KVH, Tk, D) at
    positions 0 .. Tk-1 -> (B, H, Tq, D); per row, head and query the allowed keys are listed one by one."""
    b, heads, tq, d = q.shape
    kv_heads, o = k.shape[1], slices.options
    out = torch.zeros_like(q)
    for row in range(b):
        for h in range(heads):
            g = h // (heads // slices.groups)
            kv = h // (heads // kv_heads)
            for i in range(tq):
                t = int(query_pos[i])
                keys = [s for s in range(t + 1)
                        if int(slices.owner(torch.tensor(s))) == g or s < o.sink or t - s < o.local]
                logits = torch.stack([q[row, h, i] @ k[row, kv, s] / d ** 0.5 for s in keys])
                w = torch.softmax(logits, 0)
                out[row, h, i] = sum(w[j] * v[row, kv, s] for j, s in enumerate(keys))
    return out
