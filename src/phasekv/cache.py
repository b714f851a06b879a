"""Inference cache that really saves the memory (docs/science.md section 1).

Full layers keep every key and value.  Sliding and compressed layers keep
  - the raw window: keys/values of the last `local_window - 1` tokens (fixed size; the query's
    own token completes the window), slots not yet filled carry position -1;
  - the pending partial window: normalized hidden states from the next window's first token on,
    at most W + S - 2 tokens, from which the next entries will be compressed;
  - the compressed entries: one normalized, rotated key per complete window and KV head, and one
    value unless K/V are tied (tied layers store the value only once, as the key).
So a compressed layer holds about (local_window + T / S) tokens' worth of K/V at T tokens.
With head stagger (`model.head_stagger`) a layer stores one entry per window of its S / KVH grid, of the one
KV head that owns it: entries (B, 1, N, D), the same bytes as (B, KVH, N / KVH, D).  The owner is a function
of the window's start (`Compressor.owners`), so it is derived from `entries_end`, not stored.

Usage: `cache = KVCache()`, then `model(ids, cache=cache)` repeatedly; `cache.copy()` forks a
prefilled context, `cache.shared(n)` lets n query rows per context read it once without copying it
(multi-query evaluation), `cache.nbytes()` reports the memory.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass
class LayerCache:
    # full attention
    k: torch.Tensor | None = None  # (B, KVH, P, D)
    v: torch.Tensor | None = None
    # sliding / compressed
    raw_k: torch.Tensor | None = None  # (B, KVH, L-1, D)
    raw_v: torch.Tensor | None = None
    raw_pos: torch.Tensor | None = None  # (L-1,), -1 = empty slot
    pending_h: torch.Tensor | None = None  # (B, P, hidden)
    pending_start: int = 0
    entries_k: torch.Tensor | None = None  # (B, KVH, N, D), or (B, 1, N, D) with head stagger
    entries_v: torch.Tensor | None = None  # None when tied
    entries_end: torch.Tensor | None = None  # (N,), on the CPU: visibility is decided on the host
    # > 1: a read-only view in which each of the B cached contexts serves `repeats` consecutive rows
    repeats: int = 1

    @classmethod
    def empty_windowed(cls, B: int, KVH: int, L: int, D: int, hidden: int, *, dtype, device) -> LayerCache:
        return cls(raw_k=torch.zeros(B, KVH, L - 1, D, dtype=dtype, device=device),
                   raw_v=torch.zeros(B, KVH, L - 1, D, dtype=dtype, device=device),
                   raw_pos=torch.full((L - 1,), -1, dtype=torch.long, device=device),
                   pending_h=torch.zeros(B, 0, hidden, dtype=dtype, device=device))

    def append_full(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    def add_entries(self, k: torch.Tensor, v: torch.Tensor | None, end: torch.Tensor) -> None:
        if self.entries_k is None:
            self.entries_k, self.entries_v, self.entries_end = k, v, end
            return
        self.entries_k = torch.cat([self.entries_k, k], dim=2)
        self.entries_v = None if v is None else torch.cat([self.entries_v, v], dim=2)
        self.entries_end = torch.cat([self.entries_end, end])

    def window_start(self, start: int) -> int:
        """Index, in (the pending hidden states, then the input at position `start`), of the first window start
        (`pending_start`): where the compressor's input begins."""
        return max(0, self.pending_start - (start - self.pending_h.shape[1]))

    def keep_pending(self, h: torch.Tensor, consumed: int) -> None:
        """h (B, P, hidden), the compressor's input from `pending_start` on, of which the first `consumed` tokens'
        windows became entries: the rest is the next pending partial window."""
        self.pending_h, self.pending_start = h[:, consumed:], self.pending_start + consumed

    def slide_raw(self, k_all: torch.Tensor, v_all: torch.Tensor, k_pos: torch.Tensor, T: int) -> None:
        """The raw window after T new tokens: the last L-1 keys and values of k_all, v_all (B, KVH, L-1+T, D)
        (the window before them, then theirs) and their positions k_pos (L-1+T,)."""
        self.raw_k, self.raw_v, self.raw_pos = k_all[:, :, T:], v_all[:, :, T:], k_pos[T:]

    def expanded(self) -> LayerCache:
        """A fresh cache with each context repeated `repeats` times along the batch: the forward of one
        layer extends this transient copy and drops it, so the shared cache is read, never written."""
        def repeat(name: str, value):
            # positions carry no batch dimension; everything else gets fresh repeated storage
            if not isinstance(value, torch.Tensor) or name in ("raw_pos", "entries_end"):
                return value
            return value.repeat_interleave(self.repeats, dim=0)

        return LayerCache(**{f.name: repeat(f.name, getattr(self, f.name))
                             for f in fields(self) if f.name != "repeats"})

    def values(self) -> torch.Tensor:
        return self.entries_k if self.entries_v is None else self.entries_v

    def compact(self) -> None:
        """Own every tensor (no views into a larger activation), so nbytes is what is really held."""
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and (
                    value.untyped_storage().nbytes() > value.numel() * value.element_size()):
                setattr(self, f.name, value.clone())

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]


class KVCache:
    """Per-layer caches plus the number of tokens seen."""

    def __init__(self, layers: list[LayerCache] | None = None, length: int = 0):
        self.layers = layers
        self.length = length

    def layer(self, i: int, num_layers: int, make) -> LayerCache:
        """Layer i's cache, created by `make()` on first use."""
        if self.layers is None:
            self.layers = [None] * num_layers
        if self.layers[i] is None:
            self.layers[i] = make()
        return self.layers[i]

    def nbytes(self) -> int:
        """Bytes held by every tensor of the cache."""
        return sum(t.numel() * t.element_size() for lc in (self.layers or []) if lc for t in lc.tensors())

    def copy(self) -> KVCache:
        """An independent copy (tensors cloned): continue several queries from one prefilled context."""
        layers = None
        if self.layers is not None:
            layers = []
            for lc in self.layers:
                layers.append(LayerCache(**{f.name: _clone(getattr(lc, f.name)) for f in fields(lc)})
                              if lc else None)
        return KVCache(layers, self.length)

    def repeat_interleave(self, n: int) -> KVCache:
        """Each of the B cached contexts repeated n times along the batch (row b*n + i is context b),
        as an independent cache; the original is untouched."""
        shared = self.shared(n)
        layers = None if shared.layers is None else [lc.expanded() if lc else None for lc in shared.layers]
        return KVCache(layers, self.length)

    def shared(self, n: int) -> KVCache:
        """A read-only view for ONE forward of n rows per cached context (row b*n + i is context b): no
        tensor is copied up front; each layer repeats its own part only while it runs (`expanded`), so
        memory holds one layer's repeated copy at a time.  The view is spent after that forward."""
        layers = None if self.layers is None else [
            replace(lc, repeats=lc.repeats * n) if lc else None for lc in self.layers]
        return KVCache(layers, self.length)


def _clone(value):
    return value.clone() if isinstance(value, torch.Tensor) else value
