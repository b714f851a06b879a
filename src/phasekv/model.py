"""The Qwen3-style decoder (docs/science.md section 2), with Hugging Face parameter names.

RMSNorm pre-norm, per-head RMSNorm on q and k, RoPE (all, part or none of the dims), GQA, SwiGLU,
optional tied embeddings.  Each layer's attention is full, sliding or compressed
(`ModelConfig.layer_types`); with every layer "full" the state dict loads into transformers'
`Qwen3ForCausalLM` unchanged and gives the same logits (tested).

Layout: hidden states (B, T, hidden).  `model(ids)` returns logits (B, T, vocab); with
`cache=KVCache()` it continues from, and extends, the cached context.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from phasekv.attention import Attention
from phasekv.cache import KVCache
from phasekv.config import ModelConfig
from phasekv.layers import RMSNorm


class MLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cache, start: int, state: dict | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cache, start, state)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None, fill_only: bool = False) -> torch.Tensor:
        """`fill_only`: extend the cache and return nothing: the last layer computes its keys, values and entries
        only (its attention output and MLP feed nothing but the logits)."""
        B, T = input_ids.shape
        start = cache.length if cache is not None else 0
        x = self.embed_tokens(input_ids)  # (B, T, hidden)
        n = len(self.layers)
        state = {}  # what layers publish for later layers in this forward (CSA2's shared caches and top-k)
        for i, layer in enumerate(self.layers):
            lc = None
            if cache is not None:
                lc = cache.layer(i, n, lambda a=layer.self_attn, d=x.dtype, dev=x.device: a.new_cache(B, d, dev))
            if fill_only and i == n - 1:
                layer.self_attn.fill_cache(layer.input_layernorm(x), lc, start, state)
            else:
                x = layer(x, lc, start, state)
        if cache is not None:
            cache.length = start + T
        return None if fill_only else self.norm(x)


class PhaseKVForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=self.config.initializer_range)

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """input_ids (B, T) -> logits (B, T, vocab)."""
        check_input(self.config, input_ids, cache.length if cache is not None else 0)
        return self.lm_head(self.model(input_ids, cache))

    def new_cache(self) -> KVCache:
        return KVCache()

    def prefill(self, input_ids: torch.Tensor, cache: KVCache) -> None:
        """Extend `cache` with input_ids (B, T) as `forward` would, without computing what only the logits
        need (the last layer's attention output and MLP, the final norm, the LM head)."""
        check_input(self.config, input_ids, cache.length)
        self.model(input_ids, cache, fill_only=True)


def check_input(config: ModelConfig, input_ids: torch.Tensor, start: int) -> None:
    """Refuse ids that are not (B, T) or that would run past max_position_embeddings after `start` cached tokens."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected shape (B, T), got {tuple(input_ids.shape)}")
    if start + input_ids.shape[1] > config.max_position_embeddings:
        raise ValueError(f"input_ids: {start + input_ids.shape[1]} positions exceed "
                         f"max_position_embeddings={config.max_position_embeddings}")


def build_model(config: ModelConfig) -> PhaseKVForCausalLM:
    """A freshly initialized model for `config`."""
    return PhaseKVForCausalLM(config)
