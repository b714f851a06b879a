"""The tensor side of pooled selection (`phasekv.conditions.selection.pooled`): where one attention call's queries and
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

Moved grids (`grid=stagger|jitter`): `Geometry.origins` (B | 1, G | 1) moves the pools of each row (a request)
and selection group by o: pool j holds positions jP - o .. jP - o + P - 1 (the pool id of position s is
(s + o) // P; pool 0 is the partial 0 .. P - 1 - o when o > 0, a pool like any other).  Pools are then no slices
of the key axis: the masks gather each key's pool and the indexers pool by scatter (`Geometry.slices`);
tests/test_selection_grids.py compares them with the reference on every grid.

Layout: attention tensors are (B, H, T, D) as in transformers; pool scores are (B, G, Tq, pools) with G = 1
(shared) or H_kv (kv).  `spec` is a `phasekv.conditions.selection.pooled.SelectionSpec`; `indexer` a
`phasekv.conditions.selection.scorers.Indexer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from phasekv.conditions.hybrid import softmax_with_sinks

# query rows per block of `chunked_attention`: about this many logits (B * H * rows * keys) at a time
BLOCK_ELEMENTS = 1 << 22


@dataclass
class Geometry:
    """Where the queries and keys of one attention call sit: positions and the allowed (visible) pairs."""

    query_pos: torch.Tensor  # (Tq,)
    key_pos: torch.Tensor  # (Tk,)
    visible: torch.Tensor  # (B or 1, 1, Tq, Tk) bool: causal and allowed by the call's mask
    origins: torch.Tensor | None = None  # (B or 1, G or 1) grid origins of a moved grid; None: the grid at 0

    def key_pool(self, pool: int, heads: int = 1) -> torch.Tensor:
        """Each key's pool: (Tk,) on the grid at 0, else (B | 1, heads | 1, 1, Tk) with the origins of the `heads`
        rows of a (B, heads, Tq, Tk) tensor (a group's origin repeated over its query heads)."""
        if self.origins is None:
            return self.key_pos // pool  # (Tk,)
        o = self.origins
        if o.shape[1] > 1:
            o = o.repeat_interleave(heads // o.shape[1], dim=1)
        return torch.div(self.key_pos + o[..., None, None], pool, rounding_mode="floor")

    @property
    def slices(self) -> bool:
        """Whether pool j is the keys jP .. jP + P - 1 of the key axis (keys in order, grid at 0)."""
        return self.origins is None and self.contiguous

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
    """(Tq, pools) bool, (B | 1, G | 1, Tq, pools) on a moved grid: pool j, positions first .. last (jP .. jP + P - 1
    at origin 0; max(0, jP - o) .. jP - o + P - 1 at origin o), is a candidate for the query at t when it is
    complete (last <= t), not wholly in the local tail (first <= t - L) and not wholly in the sink (last >= N)."""
    start = torch.arange(pools, device=geometry.query_pos.device) * spec.pool  # (pools,)
    t = geometry.query_pos[:, None]
    if geometry.origins is not None:  # (B | 1, G | 1, 1, pools), then broadcast over the queries
        start = start - geometry.origins[..., None, None].to(start.device)
        t = t[None, None]
    first, last = start.clamp(min=0), start + spec.pool - 1
    return (last <= t) & (first <= t - spec.local) & (last >= spec.sink)


def pool_count(spec: Any, last: int, origins: torch.Tensor | None) -> int:
    """Pools spanning keys 0 .. `last` on the call's grid (the largest origin's)."""
    return (last + (0 if origins is None else int(origins.max()))) // spec.pool + 1


def grid_origins(spec: Any, offsets: torch.Tensor | None, kv_heads: int) -> torch.Tensor | None:
    """The call's grid origins (B | 1, G | 1): None for grid=fixed, o_g = round(g P / H_kv) per KV group for
    stagger, the request's drawn offset (`offsets` (B,)) per row for jitter."""
    if spec.grid == "fixed":
        return None
    if spec.grid == "stagger":
        g = torch.arange(kv_heads)
        return ((2 * g * spec.pool + kv_heads) // (2 * kv_heads) % spec.pool)[None]
    if offsets is None:
        raise ValueError("kpool: grid=jitter: the call has no per-request offsets (run it through SelectionAdapter)")
    return offsets[:, None]


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
    if geometry.slices:  # pool j is keys jP .. jP + P - 1: repeat each pool's flag P times
        pooled = selected.repeat_interleave(spec.pool, dim=-1)[..., :tk]  # (B, G, Tq, Tk)
    else:
        index = geometry.key_pool(spec.pool, selected.shape[1])  # (Tk,) or (B | 1, G | 1, 1, Tk)
        pooled = selected.gather(-1, index.expand(*selected.shape[:-1], -1))
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
                    record: list | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Selection over any call geometry at once: dense scores, the indexer's pool scores, then torch's fused
    attention with the selection as a boolean mask -> (B, H, Tq, D).  `record` gets the last query's selection;
    `sinks` (H,): GPT-OSS's per-head sink logits (the softmax is then written out)."""
    heads, kv_heads = query.shape[1], key.shape[1]
    k, v = expand_kv(key, heads // kv_heads), expand_kv(value, heads // kv_heads)
    logits = torch.matmul(query * scaling, k.transpose(-1, -2))  # (B, H, Tq, Tk); scaled on the smaller side
    pools = pool_count(spec, int(geometry.key_pos.max()), geometry.origins)
    scores = indexer.pool_scores(module=module, logits=logits, geometry=geometry, spec=spec, pools=pools,
                                 kv_heads=kv_heads, hidden=hidden)  # (B, G, Tq, P)
    selected = select_pools(spec, scores, candidate_pools(spec, geometry, pools), geometry.query_pos)
    allowed = selection_mask(spec, geometry, selected)  # (B, G, Tq, Tk)
    if allowed.shape[1] not in (1, heads):
        allowed = allowed.repeat_interleave(heads // allowed.shape[1], dim=1)
    if record is not None:  # the last query's selection (B, G, pools) and attention (B, H, Tk)
        last = logits[:, :, -1].masked_fill(~allowed[:, :, -1], float("-inf")).softmax(-1)
        record.append({"selected": selected[:, :, -1], "probs": last, "key_pos": geometry.key_pos,
                       "query_pos": geometry.query_pos[-1], "origins": geometry.origins})
    if sinks is not None:
        probs = softmax_with_sinks(logits.masked_fill(~allowed, float("-inf")), sinks)
        return torch.matmul(probs.to(v.dtype), v)
    del logits  # the fused attention recomputes the scores; the (B, H, Tq, Tk) logits go now
    # the local tail keeps every row non-empty
    return F.scaled_dot_product_attention(query, k, v, attn_mask=allowed, scale=scaling)


def chunked_attention(spec: Any, indexer: Any, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, *, attention_mask: torch.Tensor | None, query_pos: torch.Tensor,
                      scaling: float, hidden: torch.Tensor | None = None, record: list | None = None,
                      origins: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Selection for a call whose keys sit at 0 .. Tk - 1 (`in_order`), block by block of queries, each block over
    the keys up to its last query only -> (B, H, Tq, D); `origins`: a moved grid's (`Geometry.origins`); `sinks`
    (H,): GPT-OSS's per-head sink logits.  A
    block's geometry is the whole call's restricted to its rows, so every pool score, candidate and selection is the
    one `whole_attention` computes."""
    # long: one pass over the blocks, each step commented, reads best in one piece
    b, heads, tq, d = query.shape
    kv_heads, tk = key.shape[1], key.shape[2]
    groups = heads // kv_heads
    allowed_by_mask = _allowed_by_mask(attention_mask, tk)
    key_pos = torch.arange(tk, device=query.device)
    called = indexer.call_scores(module=module, hidden=hidden, query_pos=query_pos, tk=tk, pool=spec.pool,
                                 origins=origins)
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
        geometry = Geometry(qpos, key_pos[:end], visible, origins)
        # the query heads of a KV group stacked along the rows: (B, H_kv, groups * n, D) against (B, H_kv, end, D)
        stacked = (query[:, :, start:stop] * scaling).reshape(b, kv_heads, groups * n, d)
        logits = torch.matmul(stacked, key[:, :, :end].transpose(-1, -2)).view(b, heads, n, end)
        pools = pool_count(spec, end - 1, origins)
        if called is not None:
            scores = called[:, :, start:stop, :pools]
        else:
            scores = indexer.pool_scores(module=module, logits=logits, geometry=geometry, spec=spec, pools=pools,
                                         kv_heads=kv_heads, hidden=None)  # (B, G, n, pools)
        selected = select_pools(spec, scores, candidate_pools(spec, geometry, pools), qpos)
        allowed = selection_mask(spec, geometry, selected)  # (B or 1, G, n, end), G = 1 or H_kv
        grouped = logits.view(b, kv_heads, groups, n, end)  # a view: the masking below writes into `logits`
        grouped.masked_fill_(~allowed.unsqueeze(2), float("-inf"))
        probs = softmax_with_sinks(logits, sinks).to(value.dtype)  # the local tail keeps rows non-empty
        if record is not None and stop == tq:  # the call's last query: its selection and attention
            record.append({"selected": selected[:, :, -1], "probs": probs[:, :, -1], "key_pos": geometry.key_pos,
                           "query_pos": qpos[-1], "origins": origins})
        mixed = torch.matmul(probs.view(b, kv_heads, groups * n, end), value[:, :, :end])  # (B, H_kv, groups n, D)
        out[:, :, start:stop] = mixed.view(b, heads, n, d)
    return out


def reference_attention(spec: Any, indexer: Any, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, *, hidden: torch.Tensor | None = None,
                        origins: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The slow oracle of `selection_attention` for a plain causal call (keys at 0 .. T-1): one query at a time,
    candidates listed by hand (on the grid moved by `origins` (B | 1, G | 1) when given), pools ranked by sorting,
    softmax over the gathered keys only (and the head's sink logit, `sinks` (H,), when given).  -> (B, Tq, H, D)."""
    b, heads, tq, d = query.shape
    kv_heads, groups = key.shape[1], query.shape[1] // key.shape[1]
    out = torch.zeros(b, tq, heads, d, dtype=query.dtype)
    geometry = call_geometry(query, key, None, None)
    geometry.origins = origins
    logits = torch.matmul(query, expand_kv(key, groups).transpose(-1, -2)) * d ** -0.5
    pools = pool_count(spec, key.shape[2] - 1, origins)
    scores = indexer.pool_scores(module=module, logits=logits, geometry=geometry, spec=spec, pools=pools,
                                 kv_heads=kv_heads, hidden=hidden)  # (B, G, Tq, P)
    for row in range(b):
        for t in range(tq):
            budget = int(spec.pools_per_query(torch.tensor([t]))[0])
            for h in range(heads):
                g = 0 if scores.shape[1] == 1 else h // groups
                o = 0 if origins is None else int(origins[min(row, origins.shape[0] - 1), min(g, origins.shape[1] - 1)])
                span = {j: range(max(0, j * spec.pool - o), j * spec.pool - o + spec.pool) for j in range(pools)}
                cands = [j for j, s in span.items() if s[-1] <= t and s[0] <= t - spec.local and s[-1] >= spec.sink]
                ranked = sorted(cands, key=lambda j: (-float(scores[row, g, t, j]), j))[:budget]
                keys = sorted({s for s in range(t + 1) if s < spec.sink or t - s < spec.local}
                              | {s for j in ranked for s in span[j]})
                sink = [] if sinks is None else [sinks[h].to(logits.dtype)]
                w = torch.softmax(torch.stack([logits[row, h, t, s] for s in keys] + sink), 0)
                out[row, t, h] = sum(w[i] * value[row, h // groups, s] for i, s in enumerate(keys))
    return out
