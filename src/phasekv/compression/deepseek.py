"""DeepSeek-V4-style compressors (docs/science.md section 2), written from the paper's description.

`deepseek_csa` (compressed sparse attention): blocks of m tokens (option csa_block, default 4).
Entry j is built from a window of 2m tokens: the previous block's m tokens go through one payload
map and one gate map, the current block's m tokens through another pair.  Gates are per channel
(vector) with a learned per-offset per-channel bias over the 2m offsets (DeepSeek's "ape").
K = V: the layer reuses the normalized, rotated key as value.  The RMSNorm and partial RoPE are the
layer's own k_norm / rope settings (use rope_dims=64, rope_part="last" for DeepSeek's choice).
Windows start at multiples of m; the first entry exists once 2m tokens have been seen, so window
geometry is W = 2m, S = m and the visibility rule is the same as every other compressor's.

Optional top-k indexer (option index_topk > 0): a light scorer in the spirit of DeepSeek's
"lightning indexer": score(t, j) = sum_h w_h(x_t) * relu(q_h(x_t) . k_h(entry_j)) with `index_heads`
heads of `index_dim` dims; each query keeps its top-k visible entries (the raw local window is
always kept).  Selection is discrete, so the indexer receives no gradient from the language-model
loss; DeepSeek trains it with a separate distillation loss, which phasekv does not implement.

`deepseek_hca` (heavily compressed attention): windows of m = hca_block (default 128)
tokens, no overlap, one payload and gate map shared by all offsets plus the per-offset bias.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from phasekv.compression.base import Selection, register
from phasekv.compression.gated import OffsetGatedCompressor
from phasekv.config import CompressorOptions, ModelConfig, spec


class _SharedMapCompressor(OffsetGatedCompressor):
    """Vector-gated, K = V compressor whose maps are shared by groups of consecutive offsets."""

    groups: int  # 2 for CSA (previous block, current block), 1 for HCA

    def __init__(self, options: CompressorOptions, config: ModelConfig, offset: int = 0):
        super().__init__(options, config, offset, vector_gate=True, tied=True, post_norm=options.post_norm)
        W, hidden, F = self.window, config.hidden_size, self.num_kv_heads * self.head_dim
        std = config.initializer_range
        self.k_payload = nn.Parameter(torch.randn(self.groups, hidden, F) * std)
        self.k_gate = nn.Parameter(torch.randn(self.groups, hidden, F) * std)
        self.k_gate_bias = nn.Parameter(torch.zeros(W, F))  # per offset, per channel

    def maps(self, branch: str):
        per_group = self.window // self.groups  # offsets served by one map

        def expand(p: torch.Tensor) -> torch.Tensor:  # (groups, hidden, F) -> (W, hidden, F)
            return p.repeat_interleave(per_group, dim=0)

        return expand(self.k_payload), expand(self.k_gate), self.k_gate_bias

    def gate_parameters(self) -> dict[str, nn.Parameter]:
        return {"k_gate": self.k_gate, "k_gate_bias": self.k_gate_bias}

    def offset_gate_parameters(self) -> dict[str, nn.Parameter]:
        return {"k_gate_bias": self.k_gate_bias}  # the gate maps are shared by groups of offsets

    def payload_parameters(self) -> dict[str, nn.Parameter]:
        return {"k_payload": self.k_payload}


@dataclass
class CSAOptions(CompressorOptions):
    csa_block: int = spec(4, low=1, high=2048)  # m: windows of 2m tokens every m tokens
    post_norm: bool = False
    index_topk: int = spec(0, low=0, high=1 << 20)  # indexer: keep top-k compressed entries per query (0: off)
    index_heads: int = spec(4, low=1, high=256)
    index_dim: int = spec(32, low=1, high=4096)

    def geometry(self) -> tuple[int, int]:
        return 2 * self.csa_block, self.csa_block

    def selects(self) -> bool:
        return self.index_topk > 0


@register("deepseek_csa", CSAOptions)
class DeepSeekCSA(_SharedMapCompressor):
    groups = 2

    def __init__(self, options: CSAOptions, config: ModelConfig, offset: int = 0):
        super().__init__(options, config, offset)
        self.index_topk = options.index_topk
        if self.index_topk:
            F = self.num_kv_heads * self.head_dim
            self.index_heads, self.index_dim = options.index_heads, options.index_dim
            self.index_q = nn.Linear(config.hidden_size, self.index_heads * self.index_dim, bias=False)
            self.index_w = nn.Linear(config.hidden_size, self.index_heads, bias=False)
            self.index_k = nn.Linear(F, self.index_heads * self.index_dim, bias=False)

    def index_scores(self, x: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """x (B, Tq, hidden) queries' hidden states, entries (B, N, KVH, D) -> scores (B, Tq, N)."""
        B, Tq, _ = x.shape
        N = entries.shape[1]
        q = self.index_q(x).view(B, Tq, self.index_heads, self.index_dim)  # (B, Tq, Hi, Di)
        k = self.index_k(entries.reshape(B, N, -1)).view(B, N, self.index_heads, self.index_dim)
        w = self.index_w(x)  # (B, Tq, Hi)
        per_head = torch.relu(torch.einsum("bthd,bnhd->bthn", q, k))  # (B, Tq, Hi, N)
        return (w[..., None] * per_head).sum(dim=2)  # (B, Tq, N)

    def select(self, x: torch.Tensor, entries: torch.Tensor) -> Selection | None:
        if not self.index_topk or not entries.shape[1]:
            return None
        return Selection(self.index_scores(x, entries), self.index_topk)

    def training_problem(self) -> str | None:
        if self.index_topk:
            return ("index_topk > 0: the indexer's top-k selection is discrete, so its parameters get no gradient "
                    "from the language-model loss (its separate training objective is not implemented yet); "
                    "train with index_topk: 0")
        return None


@dataclass
class HCAOptions(CompressorOptions):
    hca_block: int = spec(128, low=1, high=1 << 16)  # m: windows of m tokens every m tokens
    post_norm: bool = False

    def geometry(self) -> tuple[int, int]:
        return self.hca_block, self.hca_block


@register("deepseek_hca", HCAOptions)
class DeepSeekHCA(_SharedMapCompressor):
    groups = 1
