"""The attention kernels of sliding and compressed layers and the oracle they are tested against (docs/science.md
section 1); the layer that calls them is `phasekv.attention.Attention`.

A compressed layer's query at position t uses ONE softmax over
  (a) the exact keys/values of the last `local_window` raw tokens (t itself included), or, with
      `uncompressed_tail`, only the raw tokens not yet inside a complete window, and
  (b) every compressed entry whose window is complete (last token <= t),
plus an optional learned per-head sink logit in the denominator.  A sliding layer is (a) alone.

Layout: per-head tensors are (B, KVH, G, T, D) with query head h = kvh * G + g (as HF's
`repeat_kv`), keys and values (B, KVH, T, D), compressed entries (B, KVH, N, D).  A layer with head
stagger (`model.head_stagger`, beyond the paper) holds entries (B, 1, N, D) with an owner per entry: only
the query heads of the owning KV head read it (the others see it masked), so its entries cost the same
cache bytes and the attention reads KVH times as many entry columns, most of them masked.

Two fast paths, both tested against `windowed_attention_reference` (the per-query loop):
  - with autograd (training) or an indexer's selection: queries in blocks, one fused SDPA call per block
    over the block's raw tokens and the entries it may see (`windowed_attention`);
  - without autograd, entries on one grid (inference, evaluation, prefill): `attention_by_parts`, flash-
    attention parts merged by their log-sum-exps, the entry part per block of 128 entry rows as one unmasked
    call and one small masked diagonal, so its cost is close to the full-attention kernel's per score times
    the work ratio.
Query rows continuing a shared cache (`KVCache.shared`) read it in place (`attention_over_shared`), tested
against the plain forward.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from phasekv.compression import Selection


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
    if selection is not None and selection.allowed is not None:
        ok = ok & selection.allowed[..., :n].to(ok.device)  # (B, Tq, n): a two-level top-k's candidates
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


def raw_mask(kp: torch.Tensor, q_pos: torch.Tensor, local: int, tail: tuple[int, int] | None) -> torch.Tensor:
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


def has_flash_lse(t: torch.Tensor) -> bool:
    """`_flash` runs on t's device: torch's flash kernel with log-sum-exp is CPU-only (meta shapes it too)."""
    return t.device.type in ("cpu", "meta")


def _parts_pay(q: torch.Tensor, vis: Visible) -> bool:
    """`attention_by_parts` applies (`regular_entries`, `has_flash_lse`) and is the faster path (PARTS_MIN_PAIRS)."""
    return q.shape[3] * (0 if vis.entries_k is None else vis.entries_k.shape[2]) >= PARTS_MIN_PAIRS and \
        has_flash_lse(q) and regular_entries(vis)


def windowed_attention(q: torch.Tensor, q_pos: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                       k_pos: torch.Tensor, *, local: int, vis: Visible, sink: torch.Tensor | None,
                       tail: tuple[int, int] | None, block: int) -> torch.Tensor:
    """Joint softmax over the raw local window and visible compressed entries.
    q (B, KVH, G, Tq, D) at positions q_pos (Tq,), a CPU tensor: how many entries a block of queries sees is
    decided on the host (no device sync; the meta device works).  k_all, v_all (B, KVH, local-1+Tq, D) hold the
    `local - 1` raw tokens before the queries (position -1 = empty slot) then the queries' own.  `tail` = (W, S)
    restricts raw tokens to the uncompressed tail.  Returns (B, KVH, G, Tq, D).  Without autograd, entries on one
    grid and many query-entry pairs, `attention_by_parts` computes it; otherwise (training, short calls, an indexer,
    head stagger): one fused `scaled_dot_product_attention` call per block of queries a..b-1 over the keys
    [raw tokens a-local+1 .. b-1 | sink | entries visible to the block's last query], under an additive
    float mask (the CPU kernel takes a float mask at no extra cost, a boolean one at twice the time).  Keys, values
    and mask live in buffers filled once: per block only the raw keys and the changing mask columns are rewritten
    (entries visible to every query of the block stay at 0).  Head-staggered entries (B, 1, N, D) fill every KV
    head's slots, masked for all but their owner.  The sink: a zero key and value whose per-head mask is its logit.
    """
    if _parts_pay(q, vis) and not _records_grad(q, k_all, v_all, vis.entries_k, vis.entries_v, sink):
        return attention_by_parts(q, q_pos, k_all, v_all, k_pos, local=local, vis=vis, sink=sink, tail=tail,
                                  block=block)
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
            ok = raw_mask(k_pos[a:b + local - 1], q_dev[a:b], local, tail)  # (nb, nb+L-1)
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


# torch's CPU flash-attention kernel that also returns each row's log-sum-exp (the public SDPA does not)
_FLASH_LSE = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
# `attention_by_parts` from this many (query, entry) pairs on: below it the per-block path is faster (measured, one
# thread, W8/S8, 8 heads: parts/blocks 1.5x at T = 152 x 32 rows, 1.2x at T = 4096, 1.06x at 8192; 0.9x at 16384)
PARTS_MIN_PAIRS = 1 << 24
# `attention_over_shared`: up to this many (query token, own key) pairs per row the own part is computed by
# products (measured 0.45 ms against 1.0 ms for batched matmuls at 384 rows of one token, 8 heads, one thread)
OWN_ELEMENTWISE = 32
# `_entries_by_rows`: entry rows per block of queries (measured at T = 16384, W8/S8: 64 rows 467 ms, 128 rows 445 ms,
# against 478 ms for one causal call per window-stride residue, best of 8 interleaved runs)
ENTRY_ROWS = 128
# `attention_by_parts`: queries per raw-window call (each reads BAND_BLOCK + local - 1 keys, local of them its own;
# measured at T = 16384, local 16: blocks of 32 67-79 ms, 64 75-83 ms, 128 90-93 ms)
BAND_BLOCK = 32


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
           mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention and its log-sum-exp per query: q (B, KVH, G, Tq, D) against k, v (B, KVH, M, D)
    -> (B, KVH, G, Tq, D), (B, KVH, G, Tq).  The KV heads go into the kernel's batch dimension and are
    broadcast over the G query heads of their group (no copy); `causal`: query i reads keys 0..i."""
    B, KVH, G, Tq, D = q.shape
    M = k.shape[2]
    kk, vv = (t.reshape(B * KVH, 1, M, D).expand(B * KVH, G, M, D) for t in (k, v))
    out, lse = _FLASH_LSE(q.reshape(B * KVH, G, Tq, D), kk, vv, 0.0, causal, attn_mask=mask)
    return out.view(B, KVH, G, Tq, D), lse.view(B, KVH, G, Tq)


def regular_entries(vis: Visible) -> bool:
    """Every query head may read every entry whose window is complete (no selection, no head stagger) and the
    entries lie on one grid: end of entry j = end of entry 0 + j * stride."""
    ends = vis.entries_end
    if vis.selection is not None or vis.entries_owner is not None:  # head stagger: owners mask the entries
        return False
    if ends is None or ends.shape[0] < 2:
        return True
    step = ends[1] - ends[0]
    return bool(step > 0) and torch.equal(ends, ends[0] + step * torch.arange(ends.shape[0]))


def _band(q: torch.Tensor, q_pos: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, k_pos: torch.Tensor, *,
          local: int, tail: tuple[int, int] | None, block: int, out: torch.Tensor) -> torch.Tensor:
    """The raw local window part of `attention_by_parts`: queries q (B, KVH, G, Tq, D) at q_pos, whose raw
    keys are k_all[:, :, i .. i+local-1] for query i; per block of queries one masked flash call (the mask
    of a full block whose slots are all filled is built once).  Writes the output into out (B, KVH, G, Tq, D)
    and returns the log-sum-exp (B, KVH, G, Tq)."""
    lses, regular = [], None
    zero, minus_inf = q.new_zeros(()), q.new_full((), float("-inf"))
    for a in range(0, q.shape[3], block):
        b = min(a + block, q.shape[3])
        steady = tail is None and b - a == block and a >= local - 1
        if steady and regular is not None:
            ok, mask = regular
        else:
            ok = raw_mask(k_pos[a:b + local - 1], q_pos[a:b], local, tail)  # (nb, nb+L-1)
            mask = torch.where(ok, zero, minus_inf)[None, None]
            regular = (ok, mask) if steady else None
        o, lse = _flash(q[:, :, :, a:b], k_all[:, :, a:b + local - 1], v_all[:, :, a:b + local - 1], mask=mask)
        if tail is not None:  # a query whose token was just compressed reads no raw key
            empty = ~ok.any(-1)
            o, lse = o.masked_fill(empty[:, None], 0.0), lse.masked_fill(empty, float("-inf"))
        out[:, :, :, a:b] = o
        lses.append(lse)
    return torch.cat(lses, dim=3)


@dataclass
class Part:
    """One flash-attention part of `attention_by_parts` for the call's queries lo..hi-1: output o
    (B, KVH, G, hi-lo, D) and log-sum-exp lse (B, KVH, G, hi-lo)."""

    lo: int
    hi: int
    o: torch.Tensor
    lse: torch.Tensor


def _entries_by_rows(q: torch.Tensor, ek: torch.Tensor, ev: torch.Tensor, *, lo: int, t0: int, e0: int,
                     stride: int) -> Iterator[Part]:
    """Attention of the call's queries q (B, KVH, G, n, D) at positions t0 - lo .. over the entries they may
    read (queries before lo read none; t0 >= e0), entry j ending at e0 + j * stride: the query at t reads
    entries 0..m with m = (t - e0) // stride, its ROW.  Per block of ENTRY_ROWS rows (ENTRY_ROWS * stride
    consecutive queries) two flash calls: the entries of earlier rows, read by every query of the block, in one
    unmasked call; the block's own rows' entries under a mask that is the same for every block (the blocks are
    whole multiples of the stride), so the only masked (wasted) work is this small diagonal."""
    B, KVH, G, n, D = q.shape
    span = min(ENTRY_ROWS, -(-(n - lo) // stride)) * stride  # no larger than the call's queries need
    off = (t0 - e0) % stride  # position of query lo within its row
    row = torch.arange(span) + off  # (span,) the block's queries' rows, relative to the block's first row
    cols = (span + off - 1) // stride + 1  # rows a block touches
    diagonal = torch.where(row[:, None] // stride >= torch.arange(cols)[None, :], 0.0, float("-inf"))
    diagonal = diagonal.to(q.dtype).to(q.device)
    for a in range(lo, n, span):
        b = min(a + span, n)
        m_a = (t0 + a - lo - e0) // stride  # the block's first row
        m_b = (t0 + b - 1 - lo - e0) // stride + 1  # one past its last
        mask = diagonal if b - a == span else diagonal[:b - a, :m_b - m_a].contiguous()
        yield Part(a, b, *_flash(q[:, :, :, a:b], ek[:, :, m_a:m_b], ev[:, :, m_a:m_b], mask=mask[None, None]))
        if m_a:
            yield Part(a, b, *_flash(q[:, :, :, a:b], ek[:, :, :m_a], ev[:, :, :m_a]))


def _merge_into(out: torch.Tensor, lse: torch.Tensor, part: Part) -> None:
    """Online softmax: out (B, KVH, G, n, D) and its log-sum-exp lse (B, KVH, G, n) become, in place, the
    attention over their keys and the part's together (each side weighted by exp(its lse - the joint one))."""
    lo, hi = part.lo, part.hi
    joint = torch.logaddexp(lse[..., lo:hi], part.lse)
    keep, w = (lse[..., lo:hi] - joint).exp(), (part.lse - joint).exp()
    out[:, :, :, lo:hi].mul_(keep[..., None]).addcmul_(part.o, w[..., None])
    lse[..., lo:hi] = joint


def attention_by_parts(q: torch.Tensor, q_pos: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                       k_pos: torch.Tensor, *, local: int, vis: Visible, sink: torch.Tensor | None,
                       tail: tuple[int, int] | None, block: int) -> torch.Tensor:
    """`windowed_attention` without autograd for entries on a regular grid and no selection (`regular_entries`):
    the softmax over (raw local window | entries | sink) computed as separate flash-attention parts merged by
    their log-sum-exps (`_merge_into`, an online softmax): the raw window per block of queries (`_band`), the
    entries per block of rows (`_entries_by_rows`: earlier rows unmasked, the block's own rows under one
    shared mask), so entry attention runs in torch's flash kernel at nearly its full-attention speed per
    score; the sink rescales the result.  q_pos must be consecutive positions.  A long prefill comes in
    chunks (`Attention.forward`), so the temporaries (one part's output at a time) stay chunk-sized."""
    B, KVH, G, Tq, D = q.shape
    out = torch.empty(B, Tq, KVH * G, D, dtype=q.dtype, device=q.device).transpose(1, 2).view(B, KVH, G, Tq, D)
    n_total = 0 if vis.entries_k is None else vis.entries_k.shape[2]
    e0 = int(vis.entries_end[0]) if n_total else 0
    # one entry: every query of this call is in row 0 (reads entry 0 only)
    stride = int(vis.entries_end[1] - vis.entries_end[0]) if n_total > 1 else int(q_pos[-1]) + 1
    band_lse = _band(q, q_pos.to(k_pos.device), k_all, v_all, k_pos, local=local, tail=tail,
                     block=min(block, BAND_BLOCK), out=out)
    t0 = max(int(q_pos[0]), e0)  # the first query that reads an entry
    if n_total and t0 <= int(q_pos[-1]):
        for part in _entries_by_rows(q, vis.entries_k, vis.entries_v, lo=t0 - int(q_pos[0]), t0=t0, e0=e0,
                                     stride=stride):
            _merge_into(out, band_lse, part)
            del part  # one part's output alive at a time
    _rescale_by_sink(out, band_lse, sink)
    return out


def _rescale_by_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor | None) -> None:
    """The sink, a key of logit sink[h] and value zero, added to attention out (B, KVH, G, T, D) with log-sum-exp
    lse (B, KVH, G, T): it only rescales the output, in place."""
    if sink is not None:
        KVH, G = out.shape[1:3]
        joint = torch.logaddexp(lse, sink.to(out.dtype).view(1, KVH, G, 1))
        out.mul_((lse - joint).exp()[..., None])


def attention_over_shared(q: torch.Tensor, shared_k: torch.Tensor, shared_v: torch.Tensor, shared_ok: torch.Tensor,
                          *, own_k: torch.Tensor, own_v: torch.Tensor, own_ok: torch.Tensor,
                          sink: torch.Tensor | None) -> torch.Tensor:
    """Attention of query rows that continue a shared, read-only cache (`KVCache.shared`): the R = C * n rows
    b*n .. b*n+n-1 continue cached context b.  q (R, KVH, G, T, D); shared_k, shared_v (C, KVH, M, D) what the
    contexts hold (raw window and entries, or a full layer's keys), shared_ok (T, M): query token i may read
    cached key j; own_k, own_v (R, KVH, M2, D) each row's own keys (its tokens, then the entries of windows its
    tokens complete), own_ok (T, M2).  Two parts merged by their log-sum-exps: the cached keys in ONE flash call
    per context with its n rows' queries folded into the query dimension (the cache is read in place, never
    repeated per row), the rows' own keys by a small batched matmul; the sink (logit sink[h], value zero)
    rescales the result.  Returns (R, KVH, G, T, D)."""
    R, KVH, G, T, D = q.shape
    C = shared_k.shape[0]
    n = R // C
    minus_inf = q.new_full((), float("-inf"))
    folded = q.view(C, n, KVH, G, T, D).permute(0, 2, 3, 1, 4, 5).reshape(C, KVH, G, n * T, D)
    mask = torch.where(shared_ok, q.new_zeros(()), minus_inf).repeat(n, 1)  # (n*T, M)
    o_s, lse_s = _flash(folded, shared_k, shared_v, mask=mask[None, None])
    lse_s = lse_s.masked_fill(~shared_ok.any(-1).repeat(n), float("-inf"))  # a row reading no cached key
    o_s = o_s.view(C, KVH, G, n, T, D).permute(0, 3, 1, 2, 4, 5).reshape(R, KVH, G, T, D)
    lse_s = lse_s.view(C, KVH, G, n, T).permute(0, 3, 1, 2, 4).reshape(R, KVH, G, T)
    M2 = own_k.shape[2]
    few = T * M2 <= OWN_ELEMENTWISE  # a query step of one token: products, not R * KVH tiny matmuls
    scores = (q[..., None, :] * own_k[:, :, None, None]).sum(-1) if few else torch.matmul(
        q.reshape(R, KVH, G * T, D), own_k.transpose(-1, -2)).view(R, KVH, G, T, M2)
    scores = scores.mul_(D ** -0.5).masked_fill_(~own_ok, float("-inf"))
    lse_o = scores.logsumexp(-1)  # every row reads at least its own token
    p = scores.sub_(lse_o[..., None]).exp_()
    o_o = (p[..., None] * own_v[:, :, None, None]).sum(-2) if few else torch.matmul(
        p.view(R, KVH, G * T, M2), own_v).view(R, KVH, G, T, D)
    _merge_into(o_s, lse_s, Part(0, T, o_o, lse_o))
    _rescale_by_sink(o_s, lse_s, sink)
    return o_s


def windowed_attention_reference(q, q_pos, k_all, v_all, k_pos, *, local, vis, sink, tail, block=None):
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
        if vis.selection is not None and vis.selection.allowed is not None:
            chosen = [j for j in chosen if bool(vis.selection.allowed[0, i, j])]
        if vis.selection is not None and n > vis.selection.k:
            chosen = sorted(sorted(chosen, key=lambda j: -float(vis.selection.scores[0, i, j]))[:vis.selection.k])
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

