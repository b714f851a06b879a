"""Post-hoc chunk compression of a pretrained transformers model's KV cache (docs/science.md section 1).

A model is prefilled with full attention; then, in every layer, the keys and values of the "old"
positions (all but the last `local_window` of the T context tokens) are replaced by ONE entry per
complete window of W tokens.  Windows start on the absolute grid j * S (so phase = position mod S,
as in the paper) and are complete when they end inside the old region.  Old positions covered by
no complete window (the tail just before the local window) stay raw, as do the local window and
the optional attention sink.  Queries then continue from the shorter cache at their true
positions: `HFAdapter.continue_from` passes explicit position_ids, which set RoPE, while the
mask only needs the cache length (every cached entry precedes every query).  A context is compressed
once, at prefill; its queries all read that one compressed cache in place (`phasekv.adapters.hf`).

Policies (one entry per window, per batch row and KV head):
  - `select:r`  the token at offset r of the window (a subset of the raw cache: equal to full
                attention with the other old positions masked out);
  - `mean`      the mean of the window's keys and of its values.  Keys in a transformers cache are
                stored AFTER RoPE, so this averages keys rotated at W different positions (not the
                paper's "RoPE at the window start");
  - `max-norm`  per KV head, the token with the largest key norm (its key and its value);
  - `+keep-first:n` (modifier, e.g. "select:3+keep-first:1") keeps positions 0..n-1 raw, the
                attention sink.  Sink positions are taken out of the windows: a window pools only
                its non-sink tokens, and a window whose selected token (or all of whose tokens)
                lies in the sink adds no entry, so no token is ever cached twice.

Hybrid models (sliding-window, chunked or linear layers beside full ones, `conditions.hybrid`): only the full-
attention layers, the ones that keep the whole past, are compressed; the others keep what the model keeps.

Layout: cache tensors are (B, H_kv, T, D), as in transformers' DynamicLayer.  Entries keep the
order of their window starts; order is irrelevant to attention once RoPE has been applied.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import torch
from transformers.cache_utils import Cache

from phasekv.adapters.base import Wrapped, whole_number
from phasekv.adapters.hf import HFAdapter, read_only
from phasekv.conditions.hybrid import TARGET, cache_plan, layer_bytes, layer_kinds, offset_layer

POLICIES = ("select:r", "mean", "max-norm")


@dataclass(frozen=True)
class Policy:
    kind: str  # "select", "mean" or "max-norm"
    offset: int = 0  # the kept offset of "select"
    keep_first: int = 0  # attention-sink positions kept raw


def parse_policy(text: str, window: int) -> Policy:
    """'select:r' | 'mean' | 'max-norm', optionally followed by '+keep-first:n'."""
    base, *mods = text.strip().split("+")
    keep_first = 0
    for mod in mods:
        name, _, arg = mod.partition(":")
        if name != "keep-first" or not arg:
            raise ValueError(f"policy {text!r}: unknown modifier {mod!r} (allowed: keep-first:n with n >= 0)")
        if len(mods) > 1:
            raise ValueError(f"policy {text!r}: at most one keep-first modifier")
        keep_first = whole_number(arg, f"policy {text!r}: keep-first")
    name, _, arg = base.partition(":")
    if name == "select":
        if not (arg.isascii() and arg.isdigit()) or len(arg) > 9 or int(arg) >= window:
            raise ValueError(f"policy {text!r}: select needs an offset 0..{window - 1} (the window length W={window})")
        return Policy("select", int(arg), keep_first)
    if name in ("mean", "max-norm") and not arg:
        return Policy(name, 0, keep_first)
    raise ValueError(f"policy {text!r}: unknown policy {base!r} (allowed: {', '.join(POLICIES)}, "
                     "optionally +keep-first:n)")


def check_geometry(window: int, stride: int, local_window: int) -> None:
    if not 1 <= stride <= window:
        raise ValueError(f"stride S={stride} and window W={window}: need 1 <= S <= W")
    if local_window < 0:
        raise ValueError(f"local_window={local_window}: must be >= 0")


def window_starts(length: int, window: int, stride: int, local_window: int) -> list[int]:
    """Starts j * S of the complete windows of the old region [0, length - local_window)."""
    old = length - local_window
    return list(range(0, old - window + 1, stride)) if old >= window else []


def compress_layer(keys: torch.Tensor, values: torch.Tensor, policy: Policy, window: int, stride: int,
                   local_window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys, values (B, H, T, D) -> compressed (B, H, T', D): sink, window entries, uncovered old
    positions and the local window, in position order."""
    length = keys.shape[2]
    starts = window_starts(length, window, stride, local_window)
    covered_end = starts[-1] + window if starts else 0
    sink = min(policy.keep_first, length)
    pieces: list[tuple[int, torch.Tensor, torch.Tensor]] = [(0, keys[:, :, :sink], values[:, :, :sink])]
    if starts:
        idx = torch.tensor(starts, device=keys.device)[:, None] + torch.arange(window, device=keys.device)  # (N, W)
        in_sink = idx < sink  # (N, W)
        if policy.kind == "select":  # only the kept offset is gathered: no copy of every window
            pick = idx[~in_sink[:, policy.offset], policy.offset]  # (N',)
            ent_k, ent_v = keys[:, :, pick], values[:, :, pick]  # (B, H, N', D)
        else:
            live = ~in_sink.all(1)
            keep = (~in_sink[live]).to(keys.dtype)[:, :, None]  # (N', W, 1)
            win_k, win_v = keys[:, :, idx[live]], values[:, :, idx[live]]  # (B, H, N', W, D)
            if policy.kind == "mean":
                ent_k = (win_k * keep).sum(3) / keep.sum(1)
                ent_v = (win_v * keep).sum(3) / keep.sum(1)
            else:  # max-norm, per batch row and KV head
                norm = win_k.norm(dim=-1).masked_fill(keep[..., 0] == 0, float("-inf"))  # (B, H, N', W)
                pick = norm.argmax(-1)[..., None, None].expand(*norm.shape[:3], 1, keys.shape[-1])
                ent_k, ent_v = win_k.gather(3, pick)[:, :, :, 0], win_v.gather(3, pick)[:, :, :, 0]
        pieces.append((1, ent_k, ent_v))
    rest = max(covered_end, sink)
    pieces.append((2, keys[:, :, rest:], values[:, :, rest:]))
    return torch.cat([k for _, k, _ in pieces], 2), torch.cat([v for _, _, v in pieces], 2)


def compress_cache(cache: Cache, policy: str | Policy, window: int, stride: int, local_window: int,
                   kinds: list[str] | None = None) -> Cache:
    """A compressed copy of a prefilled cache (the input is left unchanged).  Its full-attention layers are
    compressed; in a hybrid cache (`kinds`: the model's layer kinds, `conditions.hybrid`) the sliding-window,
    chunked and linear layers are copied as the model left them and the compressed layers become `OffsetLayer`s,
    which count the positions seen, as the other layers do."""
    check_geometry(window, stride, local_window)
    policy = parse_policy(policy, window) if isinstance(policy, str) else policy
    plan = cache_plan(cache, kinds)
    if all(kind == TARGET for kind in plan):
        return read_only([compress_layer(layer.keys, layer.values, policy, window, stride, local_window)
                          if layer.get_seq_length() > 0 else (layer.keys, layer.values)
                          for layer in cache.layers], keep=True)
    out = copy.copy(cache)
    out.layers = [copy.deepcopy(layer) if kind != TARGET or layer.get_seq_length() == 0 else
                  offset_layer(*compress_layer(layer.keys, layer.values, policy, window, stride, local_window),
                               seen=layer.get_seq_length())
                  for layer, kind in zip(cache.layers, plan, strict=True)]
    return out


def cache_bytes(cache: Cache) -> int:
    """Bytes of the state a cache holds, every layer type counted (`conditions.hybrid.layer_bytes`)."""
    cache_plan(cache)
    return sum(layer_bytes(layer) for layer in cache.layers)


class PosthocAdapter(Wrapped):
    """An HFAdapter whose prefilled caches are compressed post hoc; `runner.predict` works unchanged.

    `bytes` records the (full, compressed) cache sizes of the last prefill."""

    shares_prefix = True  # the full prefill may share its prefix: compression starts from the whole cache

    def __init__(self, inner: HFAdapter, policy: str, *, window: int, stride: int, local_window: int = 16):
        check_geometry(window, stride, local_window)
        i = inner.info
        super().__init__(inner, replace(i, name=f"{i.name} posthoc {policy} W{window}/S{stride}", stride=stride,
                                        local_window=local_window))
        self.policy = parse_policy(policy, window)
        self.window, self.stride, self.local_window = window, stride, local_window
        self.bytes = {"full": 0, "compressed": 0}
        self.kinds = layer_kinds(inner.module)
        self.shares_prefix = inner.shares_prefix  # a hybrid model prefills whole (`HFAdapter`)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        raise ValueError("post-hoc compression happens between prefill and the queries: evaluate with "
                         "prefill + continue_from (multi-query), not one forward pass per prompt")

    def check_length(self, length: int) -> None:
        """Also refuse a condition that would compress nothing in a prompt of `length` tokens (no complete window
        in the old region, or one long sink covering every window): its numbers would be the full cache's."""
        super().check_length(length)
        starts = window_starts(length, self.window, self.stride, self.local_window)
        if not starts or starts[-1] + self.window <= self.policy.keep_first:
            covered = (f"keep-first:{self.policy.keep_first} keeps every window raw" if starts else
                       f"no window of {self.window} tokens ends before the last {self.local_window}")
            raise ValueError(f"--compress {self.policy.kind}+keep-first:{self.policy.keep_first}: prompts of {length} "
                             f"tokens would not be compressed at all ({covered}); lower keep-first or use longer "
                             "prompts")

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, prefix: int = 0):
        past, length = self.inner.prefill(ids, prefix)
        small = compress_cache(past, self.policy, self.window, self.stride, self.local_window, self.kinds)
        self.bytes = {"full": cache_bytes(past), "compressed": cache_bytes(small)}
        return small, length
