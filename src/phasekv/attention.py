"""The attention layer for full, sliding and compressed layers (docs/science.md section 1).

`Attention` projects, normalizes and rotates queries, keys and values (HF parameter names), extends the
layer's cache (`LayerCache`: the raw window slides on, complete windows become compressed entries) and
dispatches to a kernel: full layers use PyTorch SDPA, sliding and compressed layers the joint softmax over
the raw local window and the visible entries of `phasekv.kernels` (`windowed_attention`,
`attention_over_shared`; the kernels, their layouts and their oracle live there).
A long prefill runs through the layer's cache in chunks of PREFILL_CHUNK positions
(`Attention._chunked_prefill`): its peak memory is chunk-sized.
Multi-query evaluation adds two inference-only steps on the layer: `fill_cache` extends the cache without
computing the attention output (the model's last layer during a prefill, `PhaseKVForCausalLM.prefill`), and
query rows continuing a shared cache (`KVCache.shared`) read it in place (`Attention._shared_step`,
`attention_over_shared`), both tested against the plain forward.
The training forward is cached inference that starts from an empty cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phasekv.cache import LayerCache
from phasekv.compression import build as build_compressor
from phasekv.compression import num_windows
from phasekv.compression.head_slices import NAME as SLICES
from phasekv.compression.head_slices import HeadSlices
from phasekv.config import LAYER_KINDS_BUILTIN, ModelConfig
from phasekv.kernels import (
    Visible,
    attention_by_parts,
    attention_over_shared,
    has_flash_lse,
    raw_mask,
    regular_entries,
    tail_start,
    windowed_attention,
    windowed_attention_reference,
)
from phasekv.layers import RMSNorm, Rotary

# the layer, and the kernels' public names as phasekv.attention has always offered them
__all__ = ["Attention", "PREFILL_CHUNK", "PROJECT_CHUNK", "Visible", "attention_by_parts", "attention_over_shared",
           "regular_entries", "tail_start", "windowed_attention", "windowed_attention_reference"]

PROJECT_CHUNK = 2048  # positions per chunk of a layer's q/k projection without autograd (`Attention._heads`)
PREFILL_CHUNK = 4096  # positions per chunk of a sliding/compressed layer's forward without autograd


class Attention(nn.Module):
    """Qwen3 attention (HF parameter names) with a full, sliding or compressed cache."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.kind = config.layer_types[layer_idx]
        self.slices = None  # a head-sliced layer is a full layer under a per-head mask (compression.head_slices)
        if self.kind == SLICES:
            self.slices, self.kind = HeadSlices(config.options(SLICES), config, layer_idx), "full"
        H, KVH, D, hidden = (config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                             config.hidden_size)
        self.num_heads, self.num_kv_heads, self.head_dim = H, KVH, D
        self.q_proj = nn.Linear(hidden, H * D, bias=False)
        self.k_proj = nn.Linear(hidden, KVH * D, bias=False)
        self.v_proj = nn.Linear(hidden, KVH * D, bias=False)
        self.o_proj = nn.Linear(H * D, hidden, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(D, config.rms_norm_eps)
            self.k_norm = RMSNorm(D, config.rms_norm_eps)
        self.rotary = Rotary(D, config.rope_dims, config.rope_part, config.rope_theta)
        self.compressor = None if self.kind in LAYER_KINDS_BUILTIN else build_compressor(
            config, self.kind, config.window_offset(layer_idx), layer=layer_idx)
        self.tail = None
        self.local = config.local_window
        if self.compressor is not None and config.uncompressed_tail:
            self.tail = (self.compressor.window, self.compressor.stride)
            self.local = self.compressor.window  # the tail never holds more than W tokens
        if config.attn_sink and self.kind != "full":
            self.sink = nn.Parameter(torch.zeros(H))
        else:
            self.sink = None
        self.query_block = config.query_block

    def new_cache(self, batch: int, dtype: torch.dtype, device: torch.device) -> LayerCache:
        if self.kind == "full":
            return LayerCache()
        hidden = self.q_proj.in_features
        cache = LayerCache.empty_windowed(batch, self.num_kv_heads, self.local, self.head_dim, hidden, dtype=dtype,
                                          device=device)
        cache.pending_start = 0 if self.compressor is None else self.compressor.grid_offset
        return cache

    def _norm_rope(self, x: torch.Tensor, norm: str, positions: torch.Tensor) -> torch.Tensor:
        """x (B, T, heads, D) -> normalized, rotated (B, heads, T, D); the norm runs on the contiguous layout."""
        if hasattr(self, norm):
            x = getattr(self, norm)(x)
        return self.rotary(x.transpose(1, 2), positions)

    def _heads(self, x: torch.Tensor, proj: nn.Linear, norm: str, pos: torch.Tensor) -> torch.Tensor:
        """Projected, normalized, rotated heads (B, heads, T, D) of x (B, T, hidden), stored (B, T, heads, D).
        Without autograd a long input goes in chunks of PROJECT_CHUNK positions, so the projection's and the
        norm's outputs live one chunk at a time (otherwise they are the prefill's peak memory)."""
        B, T, _ = x.shape
        heads = proj.out_features // self.head_dim
        if torch.is_grad_enabled() or T <= PROJECT_CHUNK:
            return self._norm_rope(proj(x).view(B, T, heads, self.head_dim), norm, pos)
        out = x.new_empty(B, T, heads, self.head_dim)
        for a in range(0, T, PROJECT_CHUNK):
            b = min(a + PROJECT_CHUNK, T)
            part = proj(x[:, a:b]).view(B, b - a, heads, self.head_dim)
            out[:, a:b] = self._norm_rope(part, norm, pos[a:b]).transpose(1, 2)
        return out.transpose(1, 2)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None, start: int = 0,
                state: dict | None = None) -> torch.Tensor:
        """x (B, T, hidden) normalized layer input for positions start..start+T-1 -> (B, T, hidden); `state`:
        what earlier layers of this forward published (a CSA2 layer reads its source's entries there)."""
        B, T, _ = x.shape
        H, D = self.num_heads, self.head_dim
        if cache is not None and cache.repeats > 1:
            if self._reads_shared(cache, x, start):
                return self._shared_step(x, cache, start)
            cache = cache.expanded()  # a shared cache: extend a transient copy of this layer's part only
        shares = self.compressor is not None and self.compressor.kv_source is not None
        if self.kind != "full" and T > PREFILL_CHUNK and not torch.is_grad_enabled() and not shares:
            return self._chunked_prefill(x, cache, start)
        pos = torch.arange(start, start + T, device=x.device)
        q = self._heads(x, self.q_proj, "q_norm", pos)  # (B, H, T, D)
        if self.kind == "full":
            out = self._full(q, *self._keys_values(x, pos), cache, start)
        else:  # keys and values are made inside: the layer holds them only until they are concatenated
            out = self._windowed(x, q, pos, cache, start, {} if state is None else state)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * D))

    def _reads_shared(self, cache: LayerCache, x: torch.Tensor, start: int) -> bool:
        """A shared cache (`KVCache.shared`) is read in place by `_shared_step` (no per-row copy) without autograd,
        on the CPU (torch's flash kernel with log-sum-exp) and when every cached key's visibility depends on the
        query position only; an indexer's selection, head-staggered owners and the uncompressed tail take the
        expanded copy."""
        if torch.is_grad_enabled() or start == 0 or not has_flash_lse(x):
            return False
        if self.kind == "full":
            return cache.k is not None and self.slices is None
        c = self.compressor
        return self.tail is None and (c is None or not (c.head_stagger or c.selects or c.kv_source is not None))

    def _shared_step(self, x: torch.Tensor, cache: LayerCache, start: int) -> torch.Tensor:
        """Rows x (C * n, T, hidden) continuing the C contexts of a shared cache (n rows each, context-major):
        `attention_over_shared` over the cache read in place plus each row's own tokens and the entries of the
        windows they complete.  The cache is not written (the next forward starts from the same contexts)."""
        R, T, _ = x.shape
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        pos = torch.arange(start, start + T, device=x.device)
        q = self._heads(x, self.q_proj, "q_norm", pos).reshape(R, KVH, H // KVH, T, D)
        k, v = self._keys_values(x, pos)  # (R, KVH, T, D)
        if self.kind == "full":
            shared_k, shared_v = cache.k, cache.v
            shared_ok = pos.new_ones(T, shared_k.shape[2], dtype=torch.bool)
            own_ok = pos[None, :] <= pos[:, None]  # (T, T) causal
        else:  # the raw window as `windowed_attention` reads it: the cached raw tokens, then the rows' own
            window = raw_mask(torch.cat([cache.raw_pos, pos]), pos, self.local, None)  # (T, L-1+T)
            shared_k, shared_v = cache.raw_k, cache.raw_v
            shared_ok, own_ok = window[:, :self.local - 1], window[:, self.local - 1:]
            if cache.entries_k is not None:  # complete windows of the context: every query reads them
                shared_k = torch.cat([shared_k, cache.entries_k], dim=2)
                shared_v = torch.cat([shared_v, cache.values()], dim=2)
                shared_ok = torch.cat([shared_ok, shared_ok.new_ones(T, cache.entries_k.shape[2])], dim=1)
            if self.compressor is not None:
                k, v, own_ok = self._own_entries(x, cache, start, k, v, own_ok)
        out = attention_over_shared(q, shared_k, shared_v, shared_ok, own_k=k, own_v=v, own_ok=own_ok, sink=self.sink)
        return self.o_proj(out.reshape(R, H, T, D).transpose(1, 2).reshape(R, T, H * D))

    def _own_entries(self, x, cache, start, k, v, own_ok):
        """`_shared_step`'s own keys extended by the entries of the windows the rows' tokens complete (per row:
        the cached partial window, shared, followed by the row's tokens), visible from their window's end on."""
        c, n, P = self.compressor, cache.repeats, cache.pending_h.shape[1]
        first = cache.window_start(start)
        if num_windows(P - first + x.shape[1], c.window, c.grid_stride) == 0:
            return k, v, own_ok
        h = torch.cat([cache.pending_h[:, first:].repeat_interleave(n, dim=0), x[:, max(0, first - P):]], dim=1)
        ek, ev, ends = self.compressed_entries(h, cache.pending_start)
        q_pos = torch.arange(start, start + x.shape[1], device=ends.device)
        seen = (ends.to(own_ok.device)[None, :] <= q_pos.to(own_ok.device)[:, None])
        return torch.cat([k, ek], dim=2), torch.cat([v, ev], dim=2), torch.cat([own_ok, seen], dim=1)

    def _chunked_prefill(self, x: torch.Tensor, cache: LayerCache | None, start: int) -> torch.Tensor:
        """A sliding or compressed layer's long forward without autograd, PREFILL_CHUNK positions at a time
        through its cache (a fresh one when none is given): what a query reads (the local window and the
        complete windows' entries) is all in the cache, so nothing of size T is held but the output and the
        entries: the prefill's peak memory is chunk-sized.  Equal to one forward (the prefill + continuation
        tests)."""
        B, T, _ = x.shape
        cache = self.new_cache(B, x.dtype, x.device) if cache is None else cache
        out = x.new_empty(B, T, self.o_proj.out_features)
        for a in range(0, T, PREFILL_CHUNK):
            b = min(a + PREFILL_CHUNK, T)
            out[:, a:b] = self.forward(x[:, a:b], cache, start + a)
        return out

    def _keys_values(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalized, rotated keys and values (B, KVH, T, D) of x (B, T, hidden) at positions pos."""
        B, T, _ = x.shape
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return self._heads(x, self.k_proj, "k_norm", pos), v

    def _full(self, q, k, v, cache, start):
        if cache is not None:
            k, v = cache.append_full(k, v)
        T, P = q.shape[2], k.shape[2]
        if self.slices is not None:
            keys = torch.arange(P, device=q.device)
            mask = self.slices.mask(keys[P - T:], keys)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        if P == T:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        mask = torch.arange(P, device=q.device)[None, :] <= torch.arange(P - T, P, device=q.device)[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def compressed_entries(self, h: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Entries of the complete windows of h (B, P, hidden), whose first token is at position `first`
        (a window start): normalized, rotated keys and values (B, KVH, N, D) and end positions (N,) on the CPU;
        with head stagger, keys and values (B, 1, N, D) of each window's owning KV head (`entry_owners`)."""
        c = self.compressor
        ek, ev = c.compress(h)  # (B, N, KVH, D)
        n = ek.shape[1]
        if n != num_windows(h.shape[1], c.window, c.grid_stride):
            raise ValueError(f"compressor {c.name}: compress returned {n} windows, expected one every "
                             f"grid_stride={c.grid_stride} tokens")
        starts = first + torch.arange(n) * c.grid_stride  # on the CPU, like every entry position
        if c.head_stagger:  # keep the owner's entry only: (B, N, 1, D)
            pick = c.owners(starts).to(h.device).view(1, n, 1, 1).expand(ek.shape[0], n, 1, ek.shape[3])
            ek, ev = ek.gather(2, pick), None if ev is None else ev.gather(2, pick)
        ek = self._norm_rope(ek, "k_norm", starts.to(h.device))  # (B, KVH or 1, N, D)
        ev = ek if ev is None else ev.transpose(1, 2)  # tied: values are the normalized, rotated keys
        return ek, ev, starts + c.window - 1

    def entry_owners(self, ends: torch.Tensor | None) -> torch.Tensor | None:
        """The KV head owning each cached entry (window ends `ends` (N,)) with head stagger, else None: a function
        of the window's start, so the cache need not store it."""
        c = self.compressor
        return c.owners(ends - c.window + 1) if c.head_stagger and ends is not None else None

    def fill_cache(self, x: torch.Tensor, cache: LayerCache, start: int, state: dict | None = None) -> None:
        """Extend `cache` with x (B, T, hidden) at positions start.. exactly as `forward` would, computing only
        what the cache holds (keys, values, entries): no queries, attention, output projection or selection."""
        pos = torch.arange(start, start + x.shape[1], device=x.device)
        if self.kind == "full":
            cache.append_full(*self._keys_values(x, pos))
        else:
            self._extend(x, pos, cache, start, {} if state is None else state, select=False)
            cache.compact()

    def _extend(self, x, pos, cache, start, state, *, select=True):
        """Append x's tokens to a windowed cache: the raw window slides on, complete windows become entries.
        Returns the raw keys and values the queries read (B, KVH, L-1+T, D), their positions and the visible
        entries (with the compressor's selection when `select`)."""
        k, v = self._keys_values(x, pos)
        T = k.shape[2]
        k_all = torch.cat([cache.raw_k, k], dim=2)  # (B, KVH, L-1+T, D)
        v_all = torch.cat([cache.raw_v, v], dim=2)
        del k, v  # the concatenated copies hold them
        k_pos = torch.cat([cache.raw_pos, pos])  # (L-1+T,)
        vis = Visible(None, None, None)
        c = self.compressor
        if c is not None and c.kv_source is not None:
            vis = self._shared_entries(x, cache, start, state, select)
        elif c is not None:
            self._compress_into(x, cache, start)
            vis = Visible(cache.entries_k, cache.values(), cache.entries_end,
                          entries_owner=self.entry_owners(cache.entries_end))
            if select and vis.entries_k is not None:
                vis.selection = c.select(x, vis.entries_k.transpose(1, 2))  # entries (B, N, KVH, D)
        cache.slide_raw(k_all, v_all, k_pos, T)
        return k_all, v_all, k_pos, vis

    def _compress_into(self, x, cache, start):
        """The entries of the windows x's tokens complete (with the cached partial window) into the cache."""
        # (B, P+T, hidden); no copy of x when nothing is pending (the whole training forward)
        h = torch.cat([cache.pending_h, x], dim=1) if cache.pending_h.shape[1] else x
        h = h[:, cache.window_start(start):]
        nk, nv, nend = self.compressed_entries(h, cache.pending_start)
        cache.add_entries(nk, nv if not self.compressor.tied else None, nend)
        cache.keep_pending(h, nk.shape[2] * self.compressor.grid_stride)

    def _shared_entries(self, x, cache, start, state, select):
        """A CSA2 layer (compression.csa2): its kv source compresses into its own cache and publishes the entries
        in `state`; the layers reusing it read them there (their caches hold the raw window only); the selection
        is the compressor's (an index source scores anew, the layers after it reuse its choice)."""
        c = self.compressor
        if c.owner:
            self._compress_into(x, cache, start)
            state[("kv", c.layer)] = (cache.entries_k, cache.values(), cache.entries_end)
        if ("kv", c.kv_source) not in state:
            raise ValueError(f"layer {c.layer}: reads layer {c.kv_source}'s compressed cache, which did not run in "
                             "this forward (run the whole model)")
        ek, ev, ends = state[("kv", c.kv_source)]
        vis = Visible(ek, ev, ends)
        if select and ek is not None:
            vis.selection = c.choose(x, ek.transpose(1, 2), ends, start, state)  # entries (B, N, KVH, D)
        return vis

    def _windowed(self, x, q, pos, cache, start, state):
        B, _, T, D = q.shape
        keep = cache is not None
        if not keep:
            cache = self.new_cache(B, x.dtype, x.device)
        k_all, v_all, k_pos, vis = self._extend(x, pos, cache, start, state)
        if keep:
            cache.compact()
        KVH = self.num_kv_heads
        qg = q.view(B, KVH, self.num_heads // KVH, T, D)  # (B, KVH, G, T, D)
        q_pos = torch.arange(start, start + T)  # the host copy of pos
        out = windowed_attention(qg, q_pos, k_all, v_all, k_pos, local=self.local, vis=vis, sink=self.sink,
                                 tail=self.tail, block=self.query_block)
        return out.reshape(B, self.num_heads, T, D)
