"""The tensor side of pooled selection (`phasekv.adapters.selection`): where one attention call's queries and
keys sit, which pools each query may choose and chooses, the keys it then attends, and the attention itself, fast
and as a slow per-query reference.

Two attention paths compute the same thing.  `chunked_attention` serves every call whose keys sit at positions
0 .. Tk - 1 in order (a whole forward, and a continuation whose queries follow its cache): it walks the queries
in blocks, gives each block only the keys up to its last query (the causal bound, which halves the work of a
prefill), scores the pools, selects, and attends with one masked softmax, so no (B, H, Tq, Tk) tensor and no copy
of the keys per query head is ever made (the query heads of a KV group are stacked along the query axis).
`whole_attention` serves any other call (keys over a cache with packed queries) at once.
`reference_attention` loops over queries, lists the candidates by hand, selects pools by sorting and attends to
the gathered keys only; tests/test_selection.py compares all three.

Layout: attention tensors are (B, H, T, D) as in transformers; pool scores are (B, G, Tq, pools) with G = 1
(shared) or H_kv (kv).  `spec` is a `phasekv.adapters.selection.SelectionSpec`; `indexer` a
`phasekv.adapters.indexers.Indexer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

# query rows per block of `chunked_attention`: about this many logits (B * H * rows * keys) at a time
BLOCK_ELEMENTS = 1 << 22


@dataclass
class Geometry:
    """Where the queries and keys of one attention call sit: positions and the allowed (visible) pairs."""

    query_pos: torch.Tensor  # (Tq,)
    key_pos: torch.Tensor  # (Tk,)
    visible: torch.Tensor  # (B or 1, 1, Tq, Tk) bool: causal and allowed by the call's mask

    def key_pool(self, pool: int) -> torch.Tensor:
        return self.key_pos // pool  # (Tk,)

    @property
    def contiguous(self) -> bool:
        """Whether the keys sit at positions 0 .. Tk - 1 in order (a whole forward): pools are then slices."""
        return in_order(self.key_pos)


def call_geometry(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
                  position_ids: torch.Tensor | None) -> Geometry:
    """Positions of one attention call's queries (B, H, Tq, D) and keys (B, H_kv, Tk, D), and what each query may
    see: the causal order of positions, narrowed by the call's mask (additive or boolean) when it has one."""
    query_pos, key_pos = positions(query, key, position_ids)
    visible = (key_pos[None, :] <= query_pos[:, None])[None, None]  # (1, 1, Tq, Tk)
    allowed = _allowed_by_mask(attention_mask, len(key_pos))
    return Geometry(query_pos, key_pos, visible if allowed is None else visible & allowed)


def candidate_pools(spec: Any, geometry: Geometry, pools: int) -> torch.Tensor:
    """(Tq, pools) bool: pool j is a candidate for the query at t when it is complete (jP + P - 1 <= t), not wholly
    in the local tail (jP <= t - L) and not wholly in the sink ((j + 1) P > N)."""
    start = torch.arange(pools, device=geometry.query_pos.device) * spec.pool  # (pools,)
    t = geometry.query_pos[:, None]
    return (start + spec.pool - 1 <= t) & (start <= t - spec.local) & (start + spec.pool > spec.sink)


def select_pools(spec: Any, scores: torch.Tensor, candidates: torch.Tensor,
                 query_pos: torch.Tensor) -> torch.Tensor:
    """The selected pools (B, G, Tq, pools) bool: per query, the K(t) highest-scoring candidates (ties: the lower
    pool index), fewer when fewer are candidates.  scores: (B, G, Tq, pools)."""
    k = spec.pools_per_query(query_pos)  # (Tq,)
    kmax = int(min(int(k.max()), scores.shape[-1]))
    masked = scores.float().masked_fill(~candidates, float("-inf"))
    values, order = masked.sort(dim=-1, descending=True, stable=True)  # stable: ties go to the lower pool
    values, order = values[..., :kmax], order[..., :kmax]
    keep = (torch.arange(kmax, device=scores.device) < k[:, None]) & torch.isfinite(values)  # (B, G, Tq, kmax)
    chosen = torch.zeros_like(masked, dtype=torch.bool)
    return chosen.scatter(-1, order, keep)


def selection_mask(spec: Any, geometry: Geometry, selected: torch.Tensor) -> torch.Tensor:
    """(B, G, Tq, Tk) bool: the keys each query attends: visible and (sink, local or in a selected pool)."""
    t, s = geometry.query_pos[:, None], geometry.key_pos[None, :]
    fixed = (s < spec.sink) | (t - s < spec.local)  # (Tq, Tk)
    tk = len(geometry.key_pos)
    if geometry.contiguous:  # pool j is keys jP .. jP + P - 1: repeat each pool's flag P times
        pooled = selected.repeat_interleave(spec.pool, dim=-1)[..., :tk]  # (B, G, Tq, Tk)
    else:
        pooled = selected.gather(-1, geometry.key_pool(spec.pool).expand(*selected.shape[:-1], -1))
    return geometry.visible & (fixed | pooled)



def expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x  # (B, H_kv, T, D) -> (B, H, T, D)


def positions(query: torch.Tensor, key: torch.Tensor,
              position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(query positions (Tq,), key positions (Tk,)) of a call: the cached keys occupy 0 .. Tk - Tq - 1 and the new
    keys sit at the queries' positions (every row of a phasekv call shares its positions)."""
    tq, tk = query.shape[2], key.shape[2]
    device = query.device
    query_pos = torch.arange(tk - tq, tk, device=device) if position_ids is None else position_ids[0].to(device)
    return query_pos, torch.cat([torch.arange(tk - tq, device=device), query_pos])


def in_order(key_pos: torch.Tensor) -> bool:
    """Whether the keys sit at positions 0 .. Tk - 1 in order (`chunked_attention` serves the call, and pools are
    slices of the key axis)."""
    return torch.equal(key_pos, torch.arange(len(key_pos), device=key_pos.device))


def _allowed_by_mask(attention_mask: torch.Tensor | None, tk: int) -> torch.Tensor | None:
    if attention_mask is None:
        return None
    allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    return allowed[..., -tk:]


def whole_attention(spec: Any, indexer: Any, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, *, geometry: Geometry, scaling: float, hidden: torch.Tensor | None = None,
                    record: list | None = None) -> torch.Tensor:
    """Selection over any call geometry at once: dense scores, the indexer's pool scores, then torch's fused
    attention with the selection as a boolean mask -> (B, H, Tq, D).  `record` gets the last query's selection."""
    heads, kv_heads = query.shape[1], key.shape[1]
    k, v = expand_kv(key, heads // kv_heads), expand_kv(value, heads // kv_heads)
    logits = torch.matmul(query * scaling, k.transpose(-1, -2))  # (B, H, Tq, Tk); scaled on the smaller side
    pools = int(geometry.key_pos.max()) // spec.pool + 1
    scores = indexer.pool_scores(module=module, logits=logits, geometry=geometry, spec=spec, pools=pools,
                                 kv_heads=kv_heads, hidden=hidden)  # (B, G, Tq, P)
    selected = select_pools(spec, scores, candidate_pools(spec, geometry, pools), geometry.query_pos)
    allowed = selection_mask(spec, geometry, selected)  # (B, G, Tq, Tk)
    if allowed.shape[1] not in (1, heads):
        allowed = allowed.repeat_interleave(heads // allowed.shape[1], dim=1)
    if record is not None:  # the last query's selection (B, G, pools) and attention (B, H, Tk)
        last = logits[:, :, -1].masked_fill(~allowed[:, :, -1], float("-inf")).softmax(-1)
        record.append({"selected": selected[:, :, -1], "probs": last, "key_pos": geometry.key_pos,
                       "query_pos": geometry.query_pos[-1]})
    del logits  # the fused attention recomputes the scores; the (B, H, Tq, Tk) logits go now
    # the local tail keeps every row non-empty
    return F.scaled_dot_product_attention(query, k, v, attn_mask=allowed, scale=scaling)


def chunked_attention(spec: Any, indexer: Any, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, *, attention_mask: torch.Tensor | None, query_pos: torch.Tensor,
                      scaling: float, hidden: torch.Tensor | None = None, record: list | None = None) -> torch.Tensor:
    """Selection for a call whose keys sit at 0 .. Tk - 1 (`in_order`), block by block of queries, each block over
    the keys up to its last query only -> (B, H, Tq, D).  A block's geometry is the whole call's restricted to its
    rows, so every pool score, candidate and selection is the one `whole_attention` computes."""
    # long: one pass over the blocks, each step commented, reads best in one piece
    b, heads, tq, d = query.shape
    kv_heads, tk = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    allowed_by_mask = _allowed_by_mask(attention_mask, tk)
    key_pos = torch.arange(tk, device=query.device)
    called = indexer.call_scores(module=module, hidden=hidden, query_pos=query_pos, tk=tk, pool=spec.pool)
    out = query.new_empty(b, heads, tq, d)
    rows = max(1, BLOCK_ELEMENTS // max(1, b * heads * tk))
    for start in range(0, tq, rows):
        stop = min(start + rows, tq)
        n, qpos = stop - start, query_pos[start:stop]
        end = int(qpos.max()) + 1  # keys after the block's last query are nobody's in it
        visible = (key_pos[None, :end] <= qpos[:, None])[None, None]  # (1, 1, n, end)
        if allowed_by_mask is not None:
            mask_rows = allowed_by_mask[..., start:stop, :] if allowed_by_mask.shape[-2] > 1 else allowed_by_mask
            visible = visible & mask_rows[..., :end]
        geometry = Geometry(qpos, key_pos[:end], visible)
        # the query heads of a KV group stacked along the rows: (B, H_kv, groups * n, D) against (B, H_kv, end, D)
        stacked = (query[:, :, start:stop] * scaling).reshape(b, kv_heads, groups * n, d)
        logits = torch.matmul(stacked, key[:, :, :end].transpose(-1, -2)).view(b, heads, n, end)
        pools = (end - 1) // spec.pool + 1
        if called is not None:
            scores = called[:, :, start:stop, :pools]
        else:
            scores = indexer.pool_scores(module=module, logits=logits, geometry=geometry, spec=spec, pools=pools,
                                         kv_heads=kv_heads, hidden=None)  # (B, G, n, pools)
        selected = select_pools(spec, scores, candidate_pools(spec, geometry, pools), qpos)
        allowed = selection_mask(spec, geometry, selected)  # (B or 1, G, n, end), G = 1 or H_kv
        grouped = logits.view(b, kv_heads, groups, n, end)  # a view: the masking below writes into `logits`
        grouped.masked_fill_(~allowed.unsqueeze(2), float("-inf"))
        probs = logits.softmax(-1, dtype=torch.float32).to(value.dtype)  # the local tail keeps rows non-empty
        if record is not None and stop == tq:  # the call's last query: its selection and attention
            record.append({"selected": selected[:, :, -1], "probs": probs[:, :, -1], "key_pos": geometry.key_pos,
                           "query_pos": qpos[-1]})
        mixed = torch.matmul(probs.view(b, kv_heads, groups * n, end), value[:, :, :end])  # (B, H_kv, groups n, D)
        out[:, :, start:stop] = mixed.view(b, heads, n, d)
    return out


def reference_attention(spec: Any, indexer: Any, module: nn.Module, query: torch.Tensor,
                        key: torch.Tensor, value: torch.Tensor, *, hidden: torch.Tensor | None = None) -> torch.Tensor:
    """The slow oracle of `selection_attention` for a plain causal call (keys at 0 .. T-1): one query at a time,
    candidates listed by hand, pools ranked by sorting, softmax over the gathered keys only.  -> (B, Tq, H, D)."""
    b, heads, tq, d = query.shape
    kv_heads, groups = key.shape[1], query.shape[1] // key.shape[1]
    out = torch.zeros(b, tq, heads, d, dtype=query.dtype)
    geometry = call_geometry(query, key, None, None)
    logits = torch.matmul(query, expand_kv(key, groups).transpose(-1, -2)) * d ** -0.5
    pools = (key.shape[2] - 1) // spec.pool + 1
    scores = indexer.pool_scores(module=module, logits=logits, geometry=geometry, spec=spec, pools=pools,
                                 kv_heads=kv_heads, hidden=hidden)  # (B, G, Tq, P)
    for row in range(b):
        for t in range(tq):
            budget = int(spec.pools_per_query(torch.tensor([t]))[0])
            for h in range(heads):
                g = 0 if scores.shape[1] == 1 else h // groups
                cands = [j for j in range(pools) if j * spec.pool + spec.pool - 1 <= t
                         and j * spec.pool <= t - spec.local and (j + 1) * spec.pool > spec.sink]
                ranked = sorted(cands, key=lambda j: (-float(scores[row, g, t, j]), j))[:budget]
                keys = sorted({s for s in range(t + 1) if s < spec.sink or t - s < spec.local}
                              | {s for j in ranked for s in range(j * spec.pool, j * spec.pool + spec.pool)})
                w = torch.softmax(torch.stack([logits[row, h, t, s] for s in keys]), 0)
                out[row, t, h] = sum(w[i] * value[row, h // groups, s] for i, s in enumerate(keys))
    return out
