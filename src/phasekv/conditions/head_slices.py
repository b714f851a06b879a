"""Head-partitioned history as a training-free audit condition for transformers models (docs/notes/heads.md).

Each attention head group (a KV head and the query heads that read it, or each query head) attends to its own
slice of the past, defined by position, plus a local tail and an attention sink that every head keeps.  This is
built from a one-line description of CoWindow-style attention ("partitions history by position across heads, so
each head covers a slice"); no public code or paper text of it was available, so every choice below is ours.

Condition grammar (one string): `slices:kind=contiguous|interleaved[,size=L][,shift=fixed|layer|random]
[,group=kv|query][,local=N][,sink=N][,seed=N]`.  With G groups, a key at position s belongs to group

    owner(s) = floor((s + o) / L) mod G

  - kind=contiguous: slices of L consecutive positions (default 8) dealt to the groups in turn (period G * L);
  - kind=interleaved: L = 1, owner(s) = (s + o) mod G (the position mod G picks the group);
  - shift=fixed: o = 0, the same boundaries in every layer and request (phase = position mod L, or mod G);
  - shift=layer: o = floor(l * G * L / layers) in layer l: the boundaries and the dealing order move from layer to
    layer.  The slices cannot be staggered per head and still cover every position once: a tiling of the line by
    slices of one length L puts every boundary on one grid mod L, so a per-head shift leaves positions that no head
    sees (or two heads see); staggering by layer keeps a partition in every layer;
  - shift=random: o drawn per request (a context) from 0 .. G * L - 1 by a generator seeded with `seed`, in the
    order the requests arrive (the same seed and prompt order give the same offsets).  The draw depends on no
    token: keying it on the request's ids would let a position's attention depend on the tokens after it.

A query at position t attends key s (s <= t) of its group when owner(s) is the group, s < sink, or t - s < local
(the local tail holds the query itself, so no row is empty).  Each group sees about 1 / G of the older history.

Implementation: an attention function registered in transformers' `AttentionInterface` (`masking` installs it
and restores the model's own implementation on exit) runs scaled-dot-product attention under the boolean mask
(`call_geometry`'s causal order and the call's own mask, narrowed by the rule's `keep`).  The rule is any object
with `keep(layer=, layers=, geometry=, groups=, offsets=) -> (B | 1, G, Tq, Tk) bool`; `adapters.grid_fixes` uses
the same machinery for post-hoc per-head grids.  `reference_attention` is the slow oracle: one query and one head
at a time, the allowed keys listed by hand.  tests/test_head_slices.py compares them and checks that no query reads
its future.

Layout: attention tensors are (B, H, T, D) as in transformers; masks (B | 1, G, Tq, Tk).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from phasekv.adapters.base import Wrapped, spec_fields, whole_number
from phasekv.compression.head_slices import layer_offset, slice_keep
from phasekv.conditions.hybrid import (
    attend_left,
    is_left,
    release,
    sink_logits,
    softmax_with_sinks,
    split_modules,
)
from phasekv.conditions.selection.kernel import call_geometry
from phasekv.conditions.selection.pooled import attention_configs, attention_modules

ATTENTION_NAME = "phasekv_head_masks"
KINDS = ("contiguous", "interleaved")
SHIFTS = ("fixed", "layer", "random")
GROUPS = ("kv", "query")


@dataclass(frozen=True)
class SliceSpec:
    """One head-slicing condition (the module docstring's grammar)."""

    kind: str = "contiguous"
    size: int = 8
    shift: str = "fixed"
    group: str = "kv"
    local: int = 16
    sink: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"slices: kind={self.kind!r}: allowed {', '.join(KINDS)}")
        if self.kind == "interleaved" and self.size != 1:
            raise ValueError(f"slices: kind=interleaved has slices of one position (size=1), got size={self.size}")
        if self.size < 1:
            raise ValueError(f"slices: size={self.size}: must be >= 1")
        if self.shift not in SHIFTS:
            raise ValueError(f"slices: shift={self.shift!r}: allowed {', '.join(SHIFTS)}")
        if self.group not in GROUPS:
            raise ValueError(f"slices: group={self.group!r}: allowed {', '.join(GROUPS)}")
        if self.local < 1:
            raise ValueError(f"slices: local={self.local}: must be >= 1 (the local tail holds the query itself)")
        if self.sink < 0 or self.seed < 0:
            raise ValueError(f"slices: sink={self.sink}, seed={self.seed}: must be >= 0")

    @property
    def name(self) -> str:
        return (f"slices:kind={self.kind},size={self.size},shift={self.shift},group={self.group},local={self.local},"
                f"sink={self.sink}")

    def offsets(self, rows: int, groups: int, generator: torch.Generator) -> torch.Tensor | None:
        """The per-request offsets o (rows,) of shift=random, the next draws of `generator`; None otherwise."""
        return torch.randint(groups * self.size, (rows,), generator=generator) if self.shift == "random" else None

    def keep(self, *, layer: int, layers: int, geometry, groups: int, offsets: torch.Tensor | None) -> torch.Tensor:
        """(B | 1, G, Tq, Tk) bool: the keys each group's queries may read (before the causal order)."""
        if offsets is None:
            offsets = layer_offset(layer, layers, groups * self.size) if self.shift == "layer" else 0
        return slice_keep(geometry.key_pos, geometry.query_pos, size=self.size, groups=groups, offset=offsets,
                          sink=self.sink, local=self.local)


_KEYS = ("kind", "size", "shift", "group", "local", "sink", "seed")


def parse_slices(text: str) -> SliceSpec:
    """'slices:kind=contiguous,size=8,shift=layer' -> SliceSpec; one-line ValueError for anything else."""
    head, _, body = text.partition(":")
    if head != "slices":
        raise ValueError(f"slices {text!r}: expected slices:kind=contiguous|interleaved[,size=L][,shift=fixed|layer|"
                         "random][,group=kv|query][,local=N][,sink=N][,seed=N]")
    fields: dict[str, Any] = {}
    for key, value in spec_fields(text, list(filter(None, body.split(","))), what="slices", keys=_KEYS).items():
        fields[key] = value if key in ("kind", "shift", "group") else whole_number(value, f"slices {text!r}: {key}")
    if fields.get("kind") == "interleaved":
        fields.setdefault("size", 1)
    return SliceSpec(**fields)


# ----------------------------------------------------------------------------- the masked attention function


@dataclass
class MaskState:
    """What the installed attention function reads per call: the rule and the current rows' offsets."""

    rule: Any  # an object with keep(layer=, layers=, geometry=, groups=, offsets=)
    group: str = "kv"  # "kv": one mask per KV head group; "query": one per query head
    offsets: torch.Tensor | None = None  # (rows,) per-request offsets of the forward in progress


_ACTIVE: dict[int, MaskState] = {}  # id(attention module) -> the state it runs under


def _layers(module: nn.Module) -> int:
    config = getattr(module, "config", None)
    return int(getattr(config, "num_hidden_layers", 1) or 1)


def allowed_keys(state: MaskState, module: nn.Module, geometry, heads: int, kv_heads: int, rows: int) -> torch.Tensor:
    """(B | 1, H, Tq, Tk) bool: visible under the call and kept by the rule, each group's mask given to its heads."""
    groups = kv_heads if state.group == "kv" else heads
    offsets = state.offsets
    if offsets is not None and offsets.shape[0] != rows:
        raise ValueError(f"head masks: {offsets.shape[0]} request offsets for a forward of {rows} rows")
    keep = state.rule.keep(layer=int(getattr(module, "layer_idx", 0)), layers=_layers(module), geometry=geometry,
                           groups=groups, offsets=offsets)  # (B | 1, G, Tq, Tk)
    if groups != heads:
        keep = keep.repeat_interleave(heads // groups, dim=1)  # (B | 1, H, Tq, Tk)
    return geometry.visible & keep


def masked_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, *, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (B, H, Tq, D) queries over (B, H_kv, Tk, D) keys and values
    -> ((B, Tq, H, D) output, None) under the module's head mask."""
    if is_left(module):  # a sliding-window or chunked layer of a hybrid model runs as the model runs it
        return attend_left(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    state = _ACTIVE[id(module)]
    heads, kv_heads = query.shape[1], key.shape[1]
    sinks = sink_logits(kwargs, heads)
    geometry = call_geometry(query, key, attention_mask, kwargs.get("position_ids"))
    allowed = allowed_keys(state, module, geometry, heads, kv_heads, query.shape[0])
    k = key.repeat_interleave(heads // kv_heads, dim=1)  # (B, H, Tk, D)
    v = value.repeat_interleave(heads // kv_heads, dim=1)
    if sinks is None:
        out = F.scaled_dot_product_attention(query, k, v, attn_mask=allowed, scale=scaling)  # (B, H, Tq, D)
    else:  # GPT-OSS: each head's sink logit takes its share of the softmax
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        logits = torch.matmul(query * scale, k.transpose(-1, -2)).masked_fill(~allowed, float("-inf"))
        out = torch.matmul(softmax_with_sinks(logits, sinks).to(v.dtype), v)
    return out.transpose(1, 2).contiguous(), None


def reference_attention(state: MaskState, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, *, scaling: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The slow oracle of `masked_attention` for a plain causal call (keys at 0 .. T-1): for each row, head and
    query, the keys the rule allows are listed one by one and softmax runs over them only (and the head's sink
    logit, `sinks` (H,), when given).  -> (B, Tq, H, D)."""
    b, heads, tq, d = query.shape
    kv_heads = key.shape[1]
    groups = kv_heads if state.group == "kv" else heads
    geometry = call_geometry(query, key, None, None)
    keep = state.rule.keep(layer=int(getattr(module, "layer_idx", 0)), layers=_layers(module), geometry=geometry,
                           groups=groups, offsets=state.offsets)
    out = torch.zeros(b, tq, heads, d, dtype=query.dtype)
    for row in range(b):
        for h in range(heads):
            g = h // (heads // groups)
            for i in range(tq):
                t = int(geometry.query_pos[i])
                keys = [s for s in range(t + 1) if keep[row % keep.shape[0], g, i, s]]
                kv = h // (heads // kv_heads)
                sink = [] if sinks is None else [sinks[h].to(query.dtype)]
                w = torch.softmax(torch.stack([query[row, h, i] @ key[row, kv, s] * scaling for s in keys] + sink), 0)
                out[row, i, h] = sum(w[j] * value[row, kv, s] for j, s in enumerate(keys))
    return out


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, masked_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, eager_mask)


@contextlib.contextmanager
def masking(model: nn.Module, state: MaskState) -> Iterator[MaskState]:
    """While active, every full-attention layer of `model` runs under `state`'s rule (the others run the model's own
    attention, `conditions.hybrid`); the model's attention
    implementation is restored on exit, whatever happens."""
    _register()
    configs = [(c, c._attn_implementation) for c in attention_configs(model)]
    every = attention_modules(model)
    modules = split_modules(model, every, configs[0][1])  # full-attention layers only
    try:
        for module in modules:
            _ACTIVE[id(module)] = state
        for config, _ in configs:
            config._attn_implementation = ATTENTION_NAME
        yield state
    finally:
        release(every)
        for module in modules:
            _ACTIVE.pop(id(module), None)
        for config, implementation in configs:
            config._attn_implementation = implementation


# ----------------------------------------------------------------------------- the audit condition


class HeadSliceAdapter(Wrapped):
    """An HFAdapter whose every forward (prefill and the queries continued from its cache) runs under head
    slicing; `runner.predict` works unchanged.  The cache holds every key (the slicing is a mask: this measures
    what the heads can read, not a smaller cache); phase is position mod the slice size L."""

    def __init__(self, inner, spec: SliceSpec):
        i = inner.info
        super().__init__(inner, replace(i, name=f"{i.name} {spec.name}", stride=spec.size, local_window=spec.local))
        self.spec = spec
        self.groups = i.num_kv_heads if spec.group == "kv" else i.num_heads
        self.state = MaskState(spec, spec.group)
        self.generator = torch.Generator().manual_seed(spec.seed)  # shift=random: one draw per request

    def _run(self, offsets: torch.Tensor | None, call, *args):
        self.state.offsets = offsets
        with torch.no_grad(), masking(self.module, self.state):
            return call(*args)

    def _draw(self, rows: int) -> torch.Tensor | None:
        return self.spec.offsets(rows, self.groups, self.generator)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self._run(self._draw(ids.shape[0]), self.inner.logits, ids)

    def next_logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self._run(self._draw(ids.shape[0]), self.inner.next_logits, ids)

    def prefill(self, ids: torch.Tensor, prefix: int = 0):
        """(cache, offsets): each context's offset is drawn once, and its queries continue under the same one."""
        offsets = self._draw(ids.shape[0])
        return self._run(offsets, self.inner.prefill, ids), offsets

    def continue_from(self, cache, ids: torch.Tensor, repeats: int) -> torch.Tensor:
        inner_cache, offsets = cache
        offsets = None if offsets is None else offsets.repeat_interleave(repeats)
        return self._run(offsets, self.inner.continue_from, inner_cache, ids, repeats)
