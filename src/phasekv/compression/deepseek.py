"""DeepSeek-V4-style compressors (PAPER.md section 2), written from the paper's description.

`deepseek_csa` (compressed sparse attention): blocks of m tokens (config.csa_block, default 4).
Entry j is built from a window of 2m tokens: the previous block's m tokens go through one payload
map and one gate map, the current block's m tokens through another pair.  Gates are per channel
(vector) with a learned per-offset per-channel bias over the 2m offsets (DeepSeek's "ape").
K = V: the layer reuses the normalized, rotated key as value.  The RMSNorm and partial RoPE are the
layer's own k_norm / rope settings (use rope_dims=64, rope_part="last" for DeepSeek's choice).
Windows start at multiples of m; the first entry exists once 2m tokens have been seen, so window
geometry is W = 2m, S = m and the visibility rule is the same as every other compressor's.

Optional top-k indexer (config.index_topk > 0): a light scorer in the spirit of DeepSeek's
"lightning indexer": score(t, j) = sum_h w_h(x_t) * relu(q_h(x_t) . k_h(entry_j)) with `index_heads`
heads of `index_dim` dims; each query keeps its top-k visible entries (the raw local window is
always kept).  Selection is discrete, so the indexer receives no gradient from the language-model
loss; DeepSeek trains it with a separate distillation loss, which phasekv does not implement.

`deepseek_hca` (heavily compressed attention): windows of m = config.hca_block (default 128)
tokens, no overlap, one payload and gate map shared by all offsets plus the per-offset bias.
"""

from __future__ import annotations

import torch
from torch import nn

from phasekv.compression.base import register
from phasekv.compression.gated import OffsetGatedCompressor
from phasekv.config import ModelConfig


class _SharedMapCompressor(OffsetGatedCompressor):
    """Vector-gated, K = V compressor whose maps are shared by groups of consecutive offsets."""

    groups: int  # 2 for CSA (previous block, current block), 1 for HCA

    def __init__(self, config: ModelConfig):
        W, S = self.geometry(config)
        super().__init__(config, W, S, vector_gate=True, tied=True, post_norm=config.post_norm)
        hidden, F = config.hidden_size, self.num_kv_heads * self.head_dim
        std = config.initializer_range
        self.k_payload = nn.Parameter(torch.randn(self.groups, hidden, F) * std)
        self.k_gate = nn.Parameter(torch.randn(self.groups, hidden, F) * std)
        self.k_gate_bias = nn.Parameter(torch.zeros(W, F))  # per offset, per channel

    def maps(self, branch: str):
        per_group = self.window // self.groups  # offsets served by one map

        def expand(p: torch.Tensor) -> torch.Tensor:  # (groups, hidden, F) -> (W, hidden, F)
            return p.repeat_interleave(per_group, dim=0)

        return expand(self.k_payload), expand(self.k_gate), self.k_gate_bias


@register("deepseek_csa")
class DeepSeekCSA(_SharedMapCompressor):
    groups = 2

    def __init__(self, config: ModelConfig):
        super().__init__(config)
        self.index_topk = config.index_topk
        if self.index_topk:
            F = self.num_kv_heads * self.head_dim
            self.index_heads, self.index_dim = config.index_heads, config.index_dim
            self.index_q = nn.Linear(config.hidden_size, self.index_heads * self.index_dim, bias=False)
            self.index_w = nn.Linear(config.hidden_size, self.index_heads, bias=False)
            self.index_k = nn.Linear(F, self.index_heads * self.index_dim, bias=False)

    @staticmethod
    def geometry(config: ModelConfig) -> tuple[int, int]:
        return 2 * config.csa_block, config.csa_block

    def index_scores(self, x: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """x (B, Tq, hidden) queries' hidden states, entries (B, N, KVH, D) -> scores (B, Tq, N)."""
        B, Tq, _ = x.shape
        N = entries.shape[1]
        q = self.index_q(x).view(B, Tq, self.index_heads, self.index_dim)  # (B, Tq, Hi, Di)
        k = self.index_k(entries.reshape(B, N, -1)).view(B, N, self.index_heads, self.index_dim)
        w = self.index_w(x)  # (B, Tq, Hi)
        per_head = torch.relu(torch.einsum("bthd,bnhd->bthn", q, k))  # (B, Tq, Hi, N)
        return (w[..., None] * per_head).sum(dim=2)  # (B, Tq, N)


@register("deepseek_hca")
class DeepSeekHCA(_SharedMapCompressor):
    groups = 1

    @staticmethod
    def geometry(config: ModelConfig) -> tuple[int, int]:
        return config.hca_block, config.hca_block
