"""Small building blocks shared by the model, the compressors and the cache: RMSNorm and RoPE.

RoPE follows Hugging Face's `rotate_half` convention so weights map to transformers' Qwen3.
Partial RoPE rotates `rope_dims` dims at the start ("first") or end ("last") of each head.
Layout: (B, H, T, D) for per-head tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused pass, one output tensor (the unfused form below holds three x-sized temporaries)
            return F.rms_norm(x, self.weight.shape, self.weight, self.variance_epsilon)
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
        """x (B, H, T, D) rotated at `positions` (T,) or (B, T).

        out = x * cos + rotate_half(x) * sin on the rotated dims, x elsewhere, written as ONE x-sized output
        (cos is 1 and sin 0 outside the rotated dims) plus two in-place multiply-adds on its halves: the
        query of a long prefill is the largest activation of a layer, and every temporary of its size
        raises the layer's peak memory."""
        if self.rope_dims == 0:
            return x
        cos, sin = self.tables(positions, x.shape[-1], x.dtype)  # (..., T, D)
        lo, half = self.offset, self.rope_dims // 2
        first, second = slice(lo, lo + half), slice(lo + half, lo + 2 * half)
        out = x * cos
        out[..., first].addcmul_(x[..., second], sin[..., first], value=-1)
        out[..., second].addcmul_(x[..., first], sin[..., second])
        return out

    def tables(self, positions: torch.Tensor, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin over all `head_dim` dims at `positions` (T,) -> (T, D), (B, T) -> (B, 1, T, D); cos = 1 and
        sin = 0 on the dims that are not rotated."""
        freqs = positions.to(torch.float32)[..., None] * self.inv_freq  # (..., T, rope/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (..., T, rope)
        pad = (self.offset, head_dim - self.offset - self.rope_dims)
        cos, sin = F.pad(emb.cos(), pad, value=1.0).to(dtype), F.pad(emb.sin(), pad).to(dtype)
        if positions.dim() == 2:
            cos, sin = cos[:, None], sin[:, None]
        return cos, sin

    def forward_reference(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The textbook form (Hugging Face's rotate_half), the oracle `forward` is tested against."""
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
