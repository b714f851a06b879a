"""Attention for full, sliding and compressed layers (PAPER.md section 1).

A compressed layer's query at position t uses ONE softmax over
  (a) the exact keys/values of the last `local_window` raw tokens (t itself included), or, with
      `uncompressed_tail`, only the raw tokens not yet inside a complete window, and
  (b) every compressed entry whose window is complete (last token <= t),
plus an optional learned per-head sink logit in the denominator.  A sliding layer is (a) alone.
Full layers use PyTorch SDPA.

Layout: per-head tensors are (B, KVH, G, T, D) with query head h = kvh * G + g (as HF's
`repeat_kv`), keys and values (B, KVH, T, D), compressed entries (B, KVH, N, D).  A layer with head
stagger (`model.head_stagger`, beyond the paper) holds entries (B, 1, N, D) with an owner per entry: only
the query heads of the owning KV head read it (the others see it masked), so its entries cost the same
cache bytes and the attention reads KVH times as many entry columns, most of them masked.

The fast path tiles queries in blocks, one fused SDPA call per block over the block's raw tokens and
the entries it may see, so time and memory grow like T * (block + local_window + T / S);
`windowed_attention_reference` is the per-query loop it is tested against.  Both the training
forward and cached inference run the same code: the training forward is cached inference that
starts from an empty cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from phasekv.cache import LayerCache
from phasekv.compression import Selection, num_windows
from phasekv.compression import build as build_compressor
from phasekv.config import LAYER_KINDS_BUILTIN, ModelConfig
from phasekv.layers import RMSNorm, Rotary


@dataclass
class Visible:
    """What one block of queries may read, besides the raw local window."""

    entries_k: torch.Tensor | None  # (B, KVH, N, D)
    entries_v: torch.Tensor | None  # (B, KVH, N, D)
    entries_end: torch.Tensor | None  # (N,) last token position of each entry's window, on the CPU
    selection: Selection | None = None  # the compressor's choice of entries per query (None: all visible)
    entries_owner: torch.Tensor | None = None  # (N,) on the CPU, head stagger: entries are (B, 1, N, D), read by
    # the query heads of KV head entries_owner[j] only


def tail_start(t: torch.Tensor, window: int, stride: int) -> torch.Tensor:
    """First raw position NOT inside a complete window, for queries at positions t."""
    done = torch.div(t - window + 1, stride, rounding_mode="floor")  # index of last complete window
    return torch.where(t >= window - 1, done * stride + window, torch.zeros_like(t))


def _entry_mask(ends: torch.Tensor, selection: Selection | None, q_pos: torch.Tensor,
                owned: torch.Tensor | None = None) -> torch.Tensor:
    """(B or 1, H or 1, Tq, n) True where entry j (window end ends[j]) is usable by the query at q_pos (all on
    the compute device); `selection` holds these queries' rows; `owned` (H, n): query head h may read entry j."""
    ok = (ends[None, :] <= q_pos[:, None])[None]  # (1, Tq, n)
    n = ends.shape[0]
    if selection is not None and n > selection.k:
        scores = selection.scores[..., :n].masked_fill(~ok, float("-inf"))  # (B, Tq, n)
        keep = scores.topk(selection.k, dim=-1).indices
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, keep, True)
        ok = ok & chosen
    return ok[:, None] if owned is None else ok[:, None] & owned[None, :, None]


def _owned(owner: torch.Tensor | None, H: int, G: int, device: torch.device) -> torch.Tensor | None:
    """(H, N) True where query head h reads entry j: its KV head h // G owns it (None: every head reads all)."""
    if owner is None:
        return None
    return owner.to(device)[None, :] == torch.arange(H, device=device)[:, None] // G


def _raw_mask(kp: torch.Tensor, q_pos: torch.Tensor, local: int, tail: tuple[int, int] | None) -> torch.Tensor:
    """(nb, nb+local-1) True where a block's query i (position q_pos[i]) may read raw key j (position kp[j]):
    its own window is keys i..i+local-1, without empty slots and, with `tail`, without compressed tokens."""
    nb = q_pos.shape[0]
    rel = torch.arange(kp.shape[0], device=kp.device)[None, :] - torch.arange(nb, device=kp.device)[:, None]
    ok = (rel >= 0) & (rel < local) & (kp >= 0)[None, :]
    if tail is not None:
        ok = ok & (kp[None, :] >= tail_start(q_pos, *tail)[:, None])
    return ok


def _records_grad(*tensors: torch.Tensor | None) -> bool:
    """Autograd is recording and some input needs a gradient."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def windowed_attention(q: torch.Tensor, q_pos: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                       k_pos: torch.Tensor, local: int, vis: Visible, sink: torch.Tensor | None,
                       tail: tuple[int, int] | None, block: int) -> torch.Tensor:
    """Joint softmax over the raw local window and visible compressed entries.

    q (B, KVH, G, Tq, D) at positions q_pos (Tq,), a CPU tensor: how many entries a block of queries
    sees is decided on the host (no device sync; the meta device works).  k_all, v_all
    (B, KVH, local-1+Tq, D) hold the `local - 1` raw tokens before the queries (position -1 = empty
    slot) then the queries' own.
    `tail` = (W, S) restricts raw tokens to the uncompressed tail.  Returns (B, KVH, G, Tq, D).

    One fused `scaled_dot_product_attention` call per block of queries a..b-1 over the keys
    [raw tokens a-local+1 .. b-1 | sink | entries visible to the block's last query], under an additive
    float mask (PyTorch's CPU kernel takes a float mask at no extra cost, a boolean one at about twice
    the time).  Keys, values and mask live in buffers filled once: per block only the raw keys and the
    mask columns that change are rewritten (entries visible to every query of the block stay at 0).
    Head-staggered entries (B, 1, N, D) fill every KV head's slots; the mask hides each from all but its owner.
    The sink is a key of zeros (logit 0) whose per-head mask value is the sink logit, with a zero value.
    """
    B, KVH, G, Tq, D = q.shape
    H = KVH * G
    qh = q.reshape(B, H, Tq, D)  # (B, H, Tq, D): query head h = kvh * G + g
    # (B, H, Tq, D) view of (B, Tq, H, D) storage: the layer's o_proj input is then a view, not a copy
    out = torch.empty(B, Tq, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)
    nq, n_total = min(block, Tq), 0 if vis.entries_k is None else vis.entries_k.shape[2]
    R, E = nq + local - 1, int(sink is not None)  # raw key slots, sink slots; entries start at R + E
    keys, vals = (t.new_zeros(B, KVH, R + E + n_total, D) for t in (k_all, v_all))  # (B, KVH, R+E+N, D)
    if n_total:  # head-staggered entries (B, 1, N, D) are broadcast to every KV head, then masked by owner
        keys[:, :, R + E:], vals[:, :, R + E:] = vis.entries_k, vis.entries_v
    owned = _owned(vis.entries_owner, H, G, k_pos.device) if n_total else None  # (H, N) or None
    heads = H if E or owned is not None else 1  # masks depend on the head only through the sink and the owners
    mask = q.new_zeros(B if vis.selection is not None else 1, heads, nq, R + E + n_total)
    if E:
        mask[:, :, :, R] = sink.to(q.dtype).view(1, H, 1)
    zero, minus_inf = q.new_zeros(()), q.new_full((), float("-inf"))
    q_dev, ends = q_pos.to(k_pos.device), vis.entries_end.to(k_pos.device) if n_total else None
    grad = _records_grad(q, k_all, v_all, vis.entries_k, vis.entries_v, sink)
    band = False  # the mask's raw columns hold the band of a full block whose slots are all filled
    done = 0  # entries visible to every query of the previous block: their mask columns are already 0
    for a in range(0, Tq, block):
        b = min(a + block, Tq)
        nb, n = b - a, int((vis.entries_end <= q_pos[b - 1]).sum()) if n_total else 0  # host: no device sync
        keys[:, :, :nb + local - 1] = k_all[:, :, a:b + local - 1]
        vals[:, :, :nb + local - 1] = v_all[:, :, a:b + local - 1]
        m = mask[:, :, :nb]  # (B|1, H|1, nb, R+E+N)
        regular = tail is None and nb == nq and a >= local - 1  # slots before index local-1 may be empty
        if not (regular and band):
            ok = _raw_mask(k_pos[a:b + local - 1], q_dev[a:b], local, tail)  # (nb, nb+L-1)
            m[..., :R] = torch.where(F.pad(ok, (0, R - ok.shape[1])), zero, minus_inf)
            band = regular
        if n:
            first = 0 if vis.selection is not None else done  # a selection may change any column
            sel = None if vis.selection is None else vis.selection.rows(a, b)
            ok = _entry_mask(ends[first:n], sel, q_dev[a:b], None if owned is None else owned[:, first:n])
            m[..., R + E + first:R + E + n] = torch.where(ok, zero, minus_inf)  # (1|B, 1|H, nb, n-first)
            done = int((vis.entries_end <= q_pos[a]).sum())
        M = R + E + n  # autograd saves SDPA's inputs: then the next block must not overwrite them
        kb, vb, mb = (t.clone() if grad else t for t in (keys[:, :, :M], vals[:, :, :M], m[..., :M]))
        out[:, :, a:b] = F.scaled_dot_product_attention(qh[:, :, a:b], kb, vb, attn_mask=mb, enable_gqa=True)
    return out.view(B, KVH, G, Tq, D)


def windowed_attention_reference(q, q_pos, k_all, v_all, k_pos, local, vis, sink, tail, block=None):
    """Per-query loop over explicitly listed visible keys: the oracle for `windowed_attention`."""
    B, KVH, G, Tq, D = q.shape
    out = torch.zeros_like(q)
    for i in range(Tq):
        t = int(q_pos[i])
        first_raw = t - local + 1
        if tail is not None:
            first_raw = max(first_raw, int(tail_start(torch.tensor(t), *tail)))
        raw = [j for j in range(k_all.shape[2]) if int(k_pos[j]) >= max(first_raw, 0) and int(k_pos[j]) <= t]
        n = 0 if vis.entries_k is None else int((vis.entries_end <= t).sum())
        chosen = list(range(n))
        if vis.selection is not None and n > vis.selection.k:
            chosen = sorted(vis.selection.scores[0, i, :n].topk(vis.selection.k).indices.tolist())
            assert B == 1, "reference indexer selection is written for batch 1"
        for kv in range(KVH):
            owner = vis.entries_owner  # head stagger: entries (B, 1, N, D), each read by its owner's heads only
            mine = [j for j in chosen if owner is None or int(owner[j]) == kv]
            e = kv if owner is None else 0
            keys = torch.cat([k_all[:, kv, raw], vis.entries_k[:, e, mine] if mine else k_all[:, kv, :0]], dim=1)
            vals = torch.cat([v_all[:, kv, raw], vis.entries_v[:, e, mine] if mine else v_all[:, kv, :0]], dim=1)
            for g in range(G):
                s = (keys @ q[:, kv, g, i, :, None])[..., 0] / math.sqrt(D)  # (B, M)
                if sink is not None:
                    s = torch.cat([s, sink[kv * G + g].expand(B, 1)], dim=-1)
                p = torch.softmax(s, dim=-1)[:, : keys.shape[1]]
                out[:, kv, g, i] = (p[:, :, None] * vals).sum(1)
    return out


class Attention(nn.Module):
    """Qwen3 attention (HF parameter names) with a full, sliding or compressed cache."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.kind = config.layer_types[layer_idx]
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
            config, self.kind, config.window_offset(layer_idx))
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
        cache = LayerCache.empty_windowed(batch, self.num_kv_heads, self.local, self.head_dim, hidden, dtype, device)
        cache.pending_start = 0 if self.compressor is None else self.compressor.grid_offset
        return cache

    def _norm_rope(self, x: torch.Tensor, norm: str, positions: torch.Tensor) -> torch.Tensor:
        if hasattr(self, norm):
            x = getattr(self, norm)(x)
        return self.rotary(x, positions)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None, start: int = 0) -> torch.Tensor:
        """x (B, T, hidden) normalized layer input for positions start..start+T-1 -> (B, T, hidden)."""
        B, T, _ = x.shape
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        if cache is not None and cache.repeats > 1:
            cache = cache.expanded()  # a shared cache: extend a transient copy of this layer's part only
        pos = torch.arange(start, start + T, device=x.device)
        q = self._norm_rope(self.q_proj(x).view(B, T, H, D).transpose(1, 2), "q_norm", pos)  # (B, H, T, D)
        k = self._norm_rope(self.k_proj(x).view(B, T, KVH, D).transpose(1, 2), "k_norm", pos)  # (B, KVH, T, D)
        v = self.v_proj(x).view(B, T, KVH, D).transpose(1, 2)  # (B, KVH, T, D)
        if self.kind == "full":
            out = self._full(q, k, v, cache, start)
        else:
            out = self._windowed(x, q, k, v, pos, cache, start)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * D))

    def _full(self, q, k, v, cache, start):
        if cache is not None:
            k, v = cache.append_full(k, v)
        T, P = q.shape[2], k.shape[2]
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
        ek = self._norm_rope(ek.transpose(1, 2), "k_norm", starts.to(h.device))  # (B, KVH or 1, N, D)
        ev = ek if ev is None else ev.transpose(1, 2)  # tied: values are the normalized, rotated keys
        return ek, ev, starts + c.window - 1

    def entry_owners(self, ends: torch.Tensor | None) -> torch.Tensor | None:
        """The KV head owning each cached entry (window ends `ends` (N,)) with head stagger, else None: a function
        of the window's start, so the cache need not store it."""
        c = self.compressor
        return c.owners(ends - c.window + 1) if c.head_stagger and ends is not None else None

    def _windowed(self, x, q, k, v, pos, cache, start):
        B, KVH, T, D = k.shape
        L = self.local
        keep = cache is not None
        if not keep:
            cache = self.new_cache(B, x.dtype, x.device)
        k_all = torch.cat([cache.raw_k, k], dim=2)  # (B, KVH, L-1+T, D)
        v_all = torch.cat([cache.raw_v, v], dim=2)
        k_pos = torch.cat([cache.raw_pos, pos])  # (L-1+T,)
        vis = Visible(None, None, None)
        if self.compressor is not None:
            # (B, P+T, hidden); no copy of x when nothing is pending (the whole training forward)
            h = torch.cat([cache.pending_h, x], dim=1) if cache.pending_h.shape[1] else x
            h = h[:, max(0, cache.pending_start - (start - cache.pending_h.shape[1])):]  # from a window start
            nk, nv, nend = self.compressed_entries(h, cache.pending_start)
            cache.add_entries(nk, nv if not self.compressor.tied else None, nend)
            consumed = nk.shape[2] * self.compressor.grid_stride
            cache.pending_h, cache.pending_start = h[:, consumed:], cache.pending_start + consumed
            vis = Visible(cache.entries_k, cache.values(), cache.entries_end,
                          entries_owner=self.entry_owners(cache.entries_end))
            if vis.entries_k is not None:
                vis.selection = self.compressor.select(x, vis.entries_k.transpose(1, 2))  # entries (B, N, KVH, D)
        cache.raw_k, cache.raw_v, cache.raw_pos = k_all[:, :, T:], v_all[:, :, T:], k_pos[T:]
        if keep:
            cache.compact()
        G = self.num_heads // KVH
        qg = q.view(B, KVH, G, T, D)  # (B, KVH, G, T, D)
        q_pos = torch.arange(start, start + T)  # the host copy of pos
        out = windowed_attention(qg, q_pos, k_all, v_all, k_pos, L, vis, self.sink, self.tail, self.query_block)
        return out.reshape(B, self.num_heads, T, D)
