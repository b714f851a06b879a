"""transformers' MiniMax-M3 text model (`model_type: minimax_m3_vl_text`, `MiniMaxM3VLForCausalLM`): GQA softmax
attention with per-head QK-norm and RoPE (an `o_proj`, the dense default's knockout target) whose
`minimax_m3_sparse` layers carry a lightning indexer that selects *blocks* of keys.

Geometry: the indexer max-pools its per-key scores into blocks of `index_block_size` keys anchored at absolute
slots (block j holds keys j*b .. j*b+b-1) and keeps, per query and per KV group, its `topk_blocks` best blocks,
of which the `index_local_blocks` ending at the query's own block always win (their score is +inf).  The
main attention sees only the kept blocks: selection over a grid of W = S = index_block_size from position 0 (a
block of 1 is token-level selection: no grid).

Indexer (`MiniMaxM3VLIndexer`): one selection per indexer head, one indexer head per KV group (the attention
repeats head g's blocks over group g's query heads).  phasekv's distillation sees each group as its own row: the
record's rows are (batch, group) pairs (`IndexerKind.groups`), the target mass of a group is its query heads'
attention mass.  Candidates are the causal blocks other than the local ones (those are kept whatever they score,
like GLM-5.3's raw tail); a block's score is the max of its keys' scores, recomputed with grad from the indexer's
own submodules on its detached inputs (`block_scores`, checked against the real selection in
tests/test_minimax_m3.py).  The dense warm-up raises the top-k (counted in blocks) to every block.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from phasekv.archs.base import Architecture, CompressionGeometry, IndexerKind, argument, register, text_config

SPARSE = "minimax_m3_sparse"  # the layer type whose attention has an indexer


def block_scores(indexer, hidden: torch.Tensor, position_embeddings, position_ids: torch.Tensor,
                 queries: int | None = None) -> torch.Tensor:
    """MiniMaxM3VLIndexer.forward's block scores before the local boost, with grad (no cache): (B, H, Sq, blocks)
    for the last Sq = `queries` of the S positions (default all), -inf for blocks with no causal key.  Only those
    queries are projected and scored: an audit continuing 8 queries after a 2K-token context scores 8 rows."""
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import apply_rotary_pos_emb

    b, s, _ = hidden.shape
    first = s - (queries or s)
    q = indexer.q_norm(indexer.q_proj(hidden[:, first:]).view(b, s - first, -1, indexer.head_dim)).transpose(1, 2)
    k = indexer.k_norm(indexer.k_proj(hidden).view(b, s, 1, indexer.head_dim)).transpose(1, 2)  # (B, 1, S, D)
    cos, sin = (e[..., :indexer.head_dim] for e in position_embeddings)
    q = apply_rotary_pos_emb(q, q, cos[:, first:], sin[:, first:])[0]  # (B, H, Sq, D)
    k = apply_rotary_pos_emb(k, k, cos, sin)[0]
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2))  # (B, H, Sq, S)
    future = torch.arange(s, device=hidden.device)[None, None, None, :] > position_ids[:, None, first:, None]
    scores = scores.masked_fill(future, float("-inf"))
    blocks = -(-s // indexer.block_size)
    scores = F.pad(scores, (0, blocks * indexer.block_size - s), value=float("-inf"))
    return scores.view(b, indexer.num_heads, s - first, blocks, indexer.block_size).amax(-1)


def candidate_blocks(position_ids: torch.Tensor, blocks: int, block_size: int, local: int) -> torch.Tensor:
    """(B, S, blocks) bool: the blocks query t may select by score: those starting at or before t, minus the
    `local` blocks ending at t's own block (always kept)."""
    j = torch.arange(blocks, device=position_ids.device)[None, None, :]
    q_block = (position_ids // block_size)[..., None]
    return (j <= q_block) & (j <= q_block - local)


def _record(indexer, args, kwargs, output, _scores):
    hidden = argument(args, kwargs, 0, "hidden_states")
    cos_sin = argument(args, kwargs, 1, "position_embeddings")
    position_ids = argument(args, kwargs, 3, "position_ids")
    b, s, _ = hidden.shape
    position_ids = (position_ids if position_ids.ndim > 1 else position_ids.unsqueeze(0)).expand(b, -1)
    scores = block_scores(indexer, hidden.detach(), tuple(c.detach() for c in cos_sin), position_ids)
    h, blocks = scores.shape[1], scores.shape[-1]
    candidates = candidate_blocks(position_ids, blocks, indexer.block_size, indexer.local_blocks)
    candidates = candidates[:, None].expand(b, h, s, blocks) & torch.isfinite(scores)
    valid = (output >= 0) & (output < blocks)  # (B, H, S, k), -1 for none
    selected = torch.zeros(b, h, s, blocks + 1, dtype=torch.bool, device=output.device)
    selected.scatter_(-1, torch.where(valid, output.long(), blocks), True)
    tokens = torch.arange(blocks * indexer.block_size, device=hidden.device).view(blocks, indexer.block_size)
    pools = torch.where(tokens < s, tokens, -1)[None].expand(b * h, -1, -1)  # (B*H, blocks, block_size)
    # rows are (batch, group) pairs; a finite floor keeps the KL's softmax finite on the used candidates
    return (torch.where(torch.isfinite(scores), scores, -1e30).flatten(0, 1), candidates.flatten(0, 1),
            selected[..., :blocks].flatten(0, 1), pools)


def _block(indexer: nn.Module) -> int:
    return int(indexer.block_size)


def _groups(indexer: nn.Module) -> int:
    return int(indexer.num_heads)


@register
class MiniMaxM3(Architecture):
    name = "minimax_m3"
    model_types = ("minimax_m3_vl_text", "minimax_m3_vl")

    def check_config(self, config: Any) -> None:
        # the attention repeats each indexer head's selection over num_attention_heads // index_n_heads heads; an
        # indexer head must serve whole KV groups (one head for every group, as the exporter's tests build, runs
        # right; more heads than groups splits a group; transformers does not check)
        text = text_config(config)
        if SPARSE in (text.layer_types or []) and text.num_key_value_heads % text.index_n_heads:
            raise ValueError(f"model.index_n_heads: must divide num_key_value_heads={text.num_key_value_heads} (each "
                             f"indexer head selects for whole KV groups), got {text.index_n_heads}")

    def geometry(self, config: Any) -> CompressionGeometry | None:
        text = text_config(config)
        layers = tuple(i for i, t in enumerate(text.layer_types or []) if t == SPARSE)
        block = int(text.index_block_size)
        return CompressionGeometry("minimax_m3_block_indexer", block, block, layers) if layers and block > 1 else None

    def indexer_kinds(self) -> list[IndexerKind]:
        from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m3

        return [IndexerKind(m3.MiniMaxM3VLIndexer, m3.MiniMaxM3VLAttention, _record, 2, pool=_block,
                            groups=_groups, topk_attribute="topk_blocks", topk_in_candidates=True)]
