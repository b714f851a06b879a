"""A toy compressor written the way CONTRIBUTING.md says: one file, its own options, one registry line.

`toy_mean`: windows of `span` tokens every `span` tokens; the entry is `scale` times the mean of one
shared linear map of the window's hidden states (no gates).  It exists to prove that a compressor
with a hyperparameter phasekv has never heard of (`scale`) needs no edit outside its own file: the
test matrix (tests/helpers.py) runs it through fast == reference, no leakage and prefill + decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from phasekv.compression.base import Compressor, num_windows, register, windows
from phasekv.config import CompressorOptions, ModelConfig, spec


@dataclass
class ToyMeanOptions(CompressorOptions):
    span: int = spec(3, low=1, high=64)  # W = S
    scale: float = spec(1.0, positive=True)  # the new knob

    def geometry(self) -> tuple[int, int]:
        return self.span, self.span


@register("toy_mean", ToyMeanOptions)
class ToyMean(Compressor):
    tied = False

    def __init__(self, options: ToyMeanOptions, config: ModelConfig, offset: int = 0):
        super().__init__(options, config, offset)
        self.scale = options.scale
        F = self.num_kv_heads * self.head_dim
        self.k_map = nn.Parameter(torch.randn(config.hidden_size, F) * config.initializer_range)
        self.v_map = nn.Parameter(torch.randn(config.hidden_size, F) * config.initializer_range)

    def compress(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hw = windows(h, self.window, self.grid_stride)  # (B, N, W, hidden)
        mean = hw.mean(dim=2)  # (B, N, hidden)
        B, N, _ = mean.shape
        shape = (B, N, self.num_kv_heads, self.head_dim)
        return self.scale * (mean @ self.k_map).view(shape), self.scale * (mean @ self.v_map).view(shape)

    def compress_reference(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T, _ = h.shape
        n = num_windows(T, self.window, self.grid_stride)
        k = torch.zeros(B, n, self.num_kv_heads, self.head_dim, dtype=h.dtype)
        v = torch.zeros_like(k)
        for b in range(B):
            for j in range(n):
                total = sum(h[b, j * self.grid_stride + i] for i in range(self.window)) / self.window
                k[b, j] = self.scale * (total @ self.k_map).view(self.num_kv_heads, self.head_dim)
                v[b, j] = self.scale * (total @ self.v_map).view(self.num_kv_heads, self.head_dim)
        return k, v

    def payload_parameters(self) -> dict[str, nn.Parameter]:
        return {"k_map": self.k_map, "v_map": self.v_map}
