"""transformers' DeepSeek-V3.2 (`model_type: deepseek_v32`): MLA attention (an `o_proj` over heads of v_head_dim,
the dense default's knockout target) with token-level DeepSeek Sparse Attention.

No geometry: the lightning indexer scores every past token and keeps the top k, so there is no window grid and no
phase stride.  Indexer (`DeepseekV32Indexer`): candidates are tokens; the real indexer runs under no_grad, so its
scores are recomputed from its own submodules on its detached inputs (`scores`, checked against the real module's
selection in tests/test_realarch.py) for the KL distillation of `phasekv.archs.indexer_kl`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from phasekv.archs.base import Architecture, IndexerKind, argument, register, selected_mask, text_config


def scores(indexer, hidden: torch.Tensor, q_resid: torch.Tensor, cos_sin) -> torch.Tensor:
    """DeepseekV32Indexer.forward's scores, with grad: sum_h w_{t,h} ReLU(q_{t,h} . k_s) / sqrt(D) (B, S, T)."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

    b, s, _ = hidden.shape
    q = indexer.wq_b(q_resid).view(b, s, indexer.n_heads, indexer.head_dim)  # (B, S, H, D)
    rope = indexer.qk_rope_head_dim
    q_rot, q_pass = q.split([rope, indexer.head_dim - rope], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)  # (B, S, 1, D)
    k_rot, k_pass = k.split([rope, indexer.head_dim - rope], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, *cos_sin, unsqueeze_dim=2)
    q, k = torch.cat([q_rot, q_pass], -1), torch.cat([k_rot, k_pass], -1).squeeze(2)  # (B, S, H, D), (B, S, D)
    out = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * indexer.softmax_scale)
    weights = indexer.weights_proj(hidden).float() * indexer.n_heads ** -0.5  # (B, S, H)
    return torch.matmul(weights.unsqueeze(-2), out).squeeze(-2)  # (B, S, T)


def _record(indexer, args, kwargs, output, _scores):
    hidden, q_resid = argument(args, kwargs, 0, "hidden_states"), argument(args, kwargs, 1, "q_resid")
    mask = argument(args, kwargs, 3, "attention_mask")  # (B, S, T): additive (0 = visible) or bool (True = visible)
    recomputed = scores(indexer, hidden.detach(), q_resid.detach(), argument(args, kwargs, 2, "position_embeddings"))
    causal = mask if mask.dtype == torch.bool else mask == 0
    return recomputed, causal, selected_mask(output, recomputed.shape[-1]), None


@register
class DeepseekV32(Architecture):
    name = "deepseek_v32"
    model_types = ("deepseek_v32",)

    def check_config(self, config: Any) -> None:
        # the indexer splits each of its heads into qk_rope_head_dim rotary and the remaining plain dims
        text = text_config(config)
        if text.index_head_dim < text.qk_rope_head_dim:
            raise ValueError(f"model.index_head_dim: must be >= qk_rope_head_dim={text.qk_rope_head_dim} (the indexer "
                             f"rotates that many of its dims), got {text.index_head_dim}")

    def indexer_kinds(self) -> list[IndexerKind]:
        from transformers.models.deepseek_v32 import modeling_deepseek_v32 as v32

        return [IndexerKind(v32.DeepseekV32Indexer, v32.DeepseekV32Attention, _record, 5)]
