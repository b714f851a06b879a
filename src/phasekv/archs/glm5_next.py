"""transformers' GLM-5.3 text model (`model_type: glm5_next_text`, the language model of `glm5_next`): linear
attention layers and MLA layers (both with an `o_proj`, the dense default's knockout target) whose k-pool DSA
indexer scores pools of `index_kpool` consecutive keys.

Geometry: selection, not compression, is pooled: the `indexed_attention` layers choose among pools of
index_kpool tokens starting every index_kpool tokens from position 0, a window grid of W = S = index_kpool (a
pool of 1 is token-level selection: no grid).

Indexer (`Glm5NextTextIndexer`): candidates are complete pools (a pool's target mass is its tokens' attention mass;
the raw tail the model always attends is no candidate); the real indexer runs under no_grad, so its pool scores
are recomputed from its own submodules on its detached inputs, pooling with the module's own `get_pooled_states`
(`pool_scores`, checked against the real selection in tests/test_realarch.py).  The dense warm-up raises its top-k
to whole pools.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phasekv.archs.base import Architecture, CompressionGeometry, IndexerKind, argument, register, selected_mask


def pool_scores(indexer, hidden: torch.Tensor, q_resid: torch.Tensor, mask: torch.Tensor,
                origins: torch.Tensor | None = None):
    """Glm5NextTextIndexer.forward's pool scores, with grad (no cache): (scores (B, Sq, P), candidates (B, Sq, P)
    bool: complete pools whose last token the query sees, pool token indices (B, P, kpool)).  The queries are the
    last Sq = q_resid.shape[1] of the S positions of `hidden` (all of them in a whole forward).  `origins` (B,):
    each row's pools moved by o (`lead_slots`); candidates and indices then count the kpool - 1 lead slots."""
    b, s, _ = hidden.shape
    sq = q_resid.shape[1]
    q = indexer.wq_b(q_resid).view(b, sq, -1, indexer.head_dim)  # (B, Sq, H, D)
    k = indexer.k_norm(indexer.wk(hidden))  # (B, S, D)
    gate = F.linear(hidden, indexer.index_kpool_compress_gate)  # (B, S, D)
    packed = torch.cat([k, gate, mask.to(k.dtype)[..., None]], dim=-1)
    if origins is not None:
        packed = lead_slots(packed, origins, indexer.index_kpool)
        mask, s = packed[..., -1].bool(), packed.shape[1]
    pool_keys, pool_indices, pool_valid = indexer.get_pooled_states(packed_states=packed)
    scores = F.relu(torch.matmul(q.float(), pool_keys.transpose(-1, -2).float().unsqueeze(1)) * indexer.softmax_scale)
    weights = indexer.weights_proj(hidden[:, hidden.shape[1] - sq:]).float() * indexer.n_heads ** -0.5  # (B, Sq, H)
    scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # (B, Sq, P)
    visible = indexer.get_visible_tokens(valid_keys=mask.bool(), q_length=sq, current_length=s)  # (B, Sq, S)
    ends = pool_indices[..., -1].clamp(0, s - 1)  # (B, P)
    candidates = visible.gather(-1, ends[:, None, :].expand(b, sq, -1)) & pool_valid[:, None]
    return scores, candidates, pool_indices


def lead_slots(packed: torch.Tensor, origins: torch.Tensor, pool: int) -> torch.Tensor:
    """Packed indexer states (B, S, 2D + 1: keys, gate scores, valid) -> (B, pool - 1 + S, 2D + 1): ahead of
    position 0, pool - 1 - o invalid slots then o weightless valid ones (key 0, gate -inf) for each row's origin o
    (0 <= o < pool).  `get_pooled_states` starts its pools at the first valid slot, so its pool j holds positions
    jP - o .. jP - o + P - 1 (pool 0 the partial 0 .. P - 1 - o, pooled over its real positions only: the
    weightless slots get softmax weight 0)."""
    b, _, width = packed.shape
    lead = packed.new_zeros(b, pool - 1, width)
    lead[..., (width - 1) // 2:-1] = float("-inf")
    lead[..., -1] = (torch.arange(pool - 1, device=packed.device)[None] >= pool - 1 - origins[:, None]).to(lead.dtype)
    return torch.cat([lead, packed], dim=1)


def _record(indexer, args, kwargs, output, _scores):
    hidden, q_resid = argument(args, kwargs, 0, "hidden_states"), argument(args, kwargs, 1, "q_resid")
    mask = argument(args, kwargs, 2, "attention_mask")  # (B, S) bool padding mask
    scores, candidates, pools = pool_scores(indexer, hidden.detach(), q_resid.detach(), mask)
    tokens = selected_mask(output, hidden.shape[1])  # (B, S, T)
    first = pools[..., 0].clamp(min=0)  # (B, P): a complete pool is selected whole, so its first token says it
    return scores, candidates, tokens.gather(-1, first[:, None, :].expand(-1, tokens.shape[1], -1)), pools


def _pool(indexer: nn.Module) -> int:
    return int(getattr(indexer, "index_kpool", 1) or 1)


@register
class Glm5Next(Architecture):
    name = "glm5_next"
    model_types = ("glm5_next_text", "glm5_next")

    def geometry(self, config) -> CompressionGeometry | None:
        types = getattr(config, "layer_types", None) or []
        k = getattr(config, "index_kpool", None) or 1
        layers = tuple(i for i, t in enumerate(types) if t == "indexed_attention")
        return CompressionGeometry("glm5_kpool_indexer", int(k), int(k), layers) if layers and k > 1 else None

    def indexer_kinds(self) -> list[IndexerKind]:
        from transformers.models.glm5_next import modeling_glm5_next as glm

        return [IndexerKind(glm.Glm5NextTextIndexer, glm.Glm5NextTextAttention, _record, 3, pool=_pool)]
