"""The compressor interface and its name registry (PAPER.md section 1).

A compressor reads a layer's normalized hidden states in windows of `W` tokens that start every
`S` tokens and writes ONE key (and one value) per window per KV head.  Window `j` covers positions
`j*S .. j*S + W - 1`; it is usable by a query at position `t` only once it is complete
(`j*S + W - 1 <= t`).  Layout in this package: hidden states are `(B, T, hidden)`, compressed
entries are `(B, N, KVH, D)` with N the number of complete windows.

A new compressor is one file: subclass `Compressor`, implement `compress` (fast, all windows at
once) and `compress_reference` (slow loops, the oracle in the tests), decorate with `@register`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from phasekv.config import ModelConfig

_REGISTRY: dict[str, type[Compressor]] = {}


def register(name: str):
    def wrap(cls: type[Compressor]) -> type[Compressor]:
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return wrap


def available() -> list[str]:
    """Names of the registered compressors."""
    return sorted(_REGISTRY)


def get(name: str) -> type[Compressor]:
    if name not in _REGISTRY:
        raise ValueError(f"compressor: unknown {name!r}; known: {available()}")
    return _REGISTRY[name]


def build(config: ModelConfig, name: str) -> Compressor:
    return get(name)(config)


def stride_of(config: ModelConfig, name: str) -> int:
    return get(name).geometry(config)[1]


def num_windows(length: int, window: int, stride: int) -> int:
    """How many complete windows `length` tokens hold."""
    return 0 if length < window else (length - window) // stride + 1


def windows(x: torch.Tensor, window: int, stride: int) -> torch.Tensor:
    """All complete windows of `x` (B, T, C) as a strided view (B, N, W, C); no copy."""
    if x.shape[1] < window:
        return x.new_zeros(x.shape[0], 0, window, x.shape[2])
    return x.unfold(1, window, stride).transpose(-1, -2)  # (B, N, W, C)


class Compressor(nn.Module):
    """Maps hidden states to one compressed key and value per complete window.

    Subclasses set `self.window`, `self.stride`, `self.num_kv_heads`, `self.head_dim` and
    `self.tied` (True: the layer reuses the normalized, rotated keys as values and `compress`
    returns `None` for them).
    """

    name = "base"
    window: int
    stride: int
    tied: bool

    @staticmethod
    def geometry(config: ModelConfig) -> tuple[int, int]:
        """(W, S) this compressor uses under `config`."""
        raise NotImplementedError

    def compress(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h (B, T, hidden), T a window start -> keys, values (B, N, KVH, D) for complete windows."""
        raise NotImplementedError

    def compress_reference(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Same as `compress`, written as plain loops over windows and offsets."""
        raise NotImplementedError

    def gate_weights(self, h: torch.Tensor) -> dict[str, torch.Tensor]:
        """alpha per branch ("k", "v"): (B, N, W, KVH, G) with G = 1 (scalar) or D (vector)."""
        raise NotImplementedError
