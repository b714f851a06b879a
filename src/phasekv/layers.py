"""Small building blocks shared by the model, the compressors and the cache: RMSNorm and RoPE.

RoPE follows Hugging Face's `rotate_half` convention so weights map to transformers' Qwen3.
Partial RoPE rotates `rope_dims` dims at the start ("first") or end ("last") of each head.
Layout: (B, H, T, D) for per-head tensors.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """cos/sin tables for positions, applied to a slice of each head's dims."""

    def __init__(self, head_dim: int, rope_dims: int, part: str, theta: float):
        super().__init__()
        self.rope_dims = rope_dims
        self.offset = 0 if part == "first" else head_dim - rope_dims
        inv_freq = 1.0 / theta ** (torch.arange(0, rope_dims, 2, dtype=torch.float32) / max(rope_dims, 1))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x (B, H, T, D) rotated at `positions` (T,) or (B, T)."""
        if self.rope_dims == 0:
            return x
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq  # (..., T, rope/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (..., T, rope)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        if positions.dim() == 2:  # (B, T, rope) -> (B, 1, T, rope)
            cos, sin = cos[:, None], sin[:, None]
        lo, hi = self.offset, self.offset + self.rope_dims
        part = x[..., lo:hi]
        half = self.rope_dims // 2
        rotated = torch.cat((-part[..., half:], part[..., :half]), dim=-1)
        part = part * cos + rotated * sin
        return torch.cat((x[..., :lo], part, x[..., hi:]), dim=-1)
