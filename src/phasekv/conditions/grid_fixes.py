"""Training-free phase fixes for post-hoc chunk compression: the window grid moved per KV head or per request, at
the same cache budget (docs/notes/fixes.md).

`conditions.posthoc` puts every window of every KV head on one grid, j * S, so a record at a bad offset of its
window is lost in every head, layer and request alike.  The two fixes move the grid's origin o (0 <= o < S):

    stagger:POLICY   KV head h of H_kv uses o_h = floor(h * S / H_kv): each head loses other offsets
    jitter:POLICY    every request (a context) draws one o from a seeded generator, in arrival order: the weak
                     offset moves from request to request (it is hidden in the average, not removed)

POLICY is `select:r[+keep-first:n]` with W = S (windows tile the line, so a moved grid keeps the same number of
entries to within one per head).  With origin o the windows are the cells [o + kS, o + (k + 1)S) that end inside the
old region (positions before the last `local_window` of the context; the first cell is the partial [0, o) when o >
0), each keeping its position o + kS + r when that is >= 0; positions past the last complete cell, the sink and the
local window stay raw, exactly as in `conditions.posthoc` (which is o = 0; tested equal).

A select policy's compressed cache is full attention with the dropped positions masked out, so the fix runs the
prefill with full attention (as post-hoc compression does) and the queries under a per-head key mask
(`adapters.head_slices.masking`); `bytes` counts the positions each head keeps, as a compressed cache would hold
them.  `reference_kept` is the plain list of kept positions the tests compare the mask with.  In a hybrid model only
the full-attention layers are masked (`conditions.hybrid`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from phasekv.adapters.base import Wrapped
from phasekv.conditions.head_slices import MaskState, masking
from phasekv.conditions.hybrid import TARGET, cache_plan, layer_bytes, layer_kinds
from phasekv.conditions.posthoc import Policy, cache_bytes, check_geometry, parse_policy

MODES = ("stagger", "jitter")


@dataclass(frozen=True)
class GridFix:
    """One fixed condition: the mode, the select policy it moves, the geometry and the jitter seed."""

    mode: str
    policy: Policy
    stride: int
    local_window: int
    seed: int = 0

    @property
    def name(self) -> str:
        sink = f"+keep-first:{self.policy.keep_first}" if self.policy.keep_first else ""
        return f"{self.mode}:select:{self.policy.offset}{sink}"

    def origins(self, kv_heads: int, offsets: torch.Tensor | None) -> torch.Tensor:
        """(B | 1, H_kv) grid origins: per head (stagger) or per request (jitter, `offsets` (B,))."""
        if self.mode == "stagger":
            return (torch.arange(kv_heads) * self.stride // kv_heads)[None]
        return offsets[:, None].expand(-1, kv_heads)

    def keep(self, *, layer: int, layers: int, geometry, groups: int, offsets: torch.Tensor | None) -> torch.Tensor:
        """(B | 1, H_kv, Tq, Tk) bool: the keys a compressed cache would hold, and every key of the queries."""
        s = geometry.key_pos  # (Tk,)
        context = int(geometry.key_pos.shape[0] - geometry.query_pos.shape[0])  # the cached keys: 0 .. context-1
        o = self.origins(groups, offsets).to(s.device)[..., None]  # (B | 1, G, 1)
        old = context - self.local_window
        covered = torch.where(old >= o, o + torch.div(old - o, self.stride, rounding_mode="floor") * self.stride, 0)
        kept = ((s < self.policy.keep_first) | (s >= covered) | ((s - o) % self.stride == self.policy.offset))
        return kept[:, :, None, :] | (s >= context)  # (B | 1, G, 1, Tk): every query sees the same cache


def parse_fix(text: str, window: int, stride: int, local_window: int) -> GridFix:
    """'stagger:select:3+keep-first:1' | 'jitter:select:3' -> GridFix; one-line ValueError for anything else."""
    mode, _, rest = text.partition(":")
    if mode not in MODES:
        raise ValueError(f"fix {text!r}: allowed {', '.join(m + ':select:r[+keep-first:n]' for m in MODES)}")
    check_geometry(window, stride, local_window)
    policy = parse_policy(rest, window)
    if policy.kind != "select" or window != stride:
        raise ValueError(f"fix {text!r}: moved grids need select:r and W = S (got {policy.kind}, W={window}, "
                         f"S={stride}): windows that tile the line keep the budget when the grid moves")
    return GridFix(mode, policy, stride, local_window)


def reference_kept(fix: GridFix, length: int, origin: int) -> list[int]:
    """Plain reference: the positions a cache of `length` tokens keeps with grid origin `origin`."""
    old, kept = length - fix.local_window, set(range(min(fix.policy.keep_first, length)))
    start = origin - fix.stride if origin > 0 else 0  # the partial first cell [0, origin)
    covered = 0
    while start + fix.stride <= old:
        if start + fix.policy.offset >= 0:
            kept.add(start + fix.policy.offset)
        covered = start + fix.stride
        start += fix.stride
    kept.update(range(covered, length))
    return sorted(kept)


class GridFixAdapter(Wrapped):
    """An HFAdapter whose prefilled caches keep, per KV head, the positions a moved-grid select policy keeps; the
    prefill is full attention, the queries read the kept positions only.  `bytes`: (full, compressed) bytes of the
    last prefill's cache, counted per head."""

    def __init__(self, inner, fix: GridFix):
        i = inner.info
        super().__init__(inner, replace(i, name=f"{i.name} posthoc {fix.name} W{fix.stride}/S{fix.stride}",
                                        stride=fix.stride, local_window=fix.local_window))
        self.fix = fix
        self.state = MaskState(fix, "kv")
        self.bytes = {"full": 0, "compressed": 0}
        self.generator = torch.Generator().manual_seed(fix.seed)  # jitter: one draw per request
        self.kinds = layer_kinds(inner.module)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        raise ValueError("post-hoc compression happens between prefill and the queries: evaluate with "
                         "prefill + continue_from (multi-query), not one forward pass per prompt")

    def _draw(self, rows: int) -> torch.Tensor | None:
        return torch.randint(self.fix.stride, (rows,), generator=self.generator) if self.fix.mode == "jitter" else None

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, prefix: int = 0):
        """(cache, offsets): the full prefill and, for jitter, each context's drawn origin."""
        cache, offsets = self.inner.prefill(ids), self._draw(ids.shape[0])
        self.bytes = self._bytes(cache[0], ids.shape[1], offsets)
        return cache, offsets

    def _bytes(self, past, length: int, offsets: torch.Tensor | None) -> dict[str, int]:
        """The prefilled cache's bytes, and those it holds once each full-attention layer keeps, per head, only the
        positions of its grid (sliding-window, chunked and linear layers are left as they are)."""
        targets = [layer for layer, kind in zip(past.layers, cache_plan(past, self.kinds), strict=True)
                   if kind == TARGET and layer.get_seq_length() > 0]
        size = targets[0].keys.element_size() if targets else 4
        per_position = 2 * self.info.head_dim * size * len(targets)  # keys and values of one head, every target
        rows = targets[0].keys.shape[0] if targets else 0
        origins = self.fix.origins(self.info.num_kv_heads, offsets).expand(rows, -1)
        kept = sum(len(reference_kept(self.fix, length, int(o))) for o in origins.flatten())
        full = cache_bytes(past)
        return {"full": full, "compressed": full - sum(layer_bytes(t) for t in targets) + kept * per_position}

    def continue_from(self, cache, ids: torch.Tensor, repeats: int) -> torch.Tensor:
        inner_cache, offsets = cache
        self.state.offsets = None if offsets is None else offsets.repeat_interleave(repeats)
        with torch.no_grad(), masking(self.module, self.state):
            return self.inner.continue_from(inner_cache, ids, repeats)
