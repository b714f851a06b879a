"""Configurations of the theory: the idealized model's sizes and scales, and its gradient flow's settings."""

from __future__ import annotations

from dataclasses import dataclass

from phasekv.config.fields import check_fields, spec


@dataclass
class TheoryConfig:
    """Sizes and scales of the idealized model (names follow docs/science.md section 5)."""

    chunks: int = spec(4, low=1, high=1 << 12)  # L
    stride: int = spec(4, low=2, high=1 << 12)  # S: tokens per chunk (>= 2 so a query has a successor)
    vocab: int = spec(32, low=1, high=1 << 16)  # N: embeddings in the vocabulary
    heads: int = spec(2, low=1)  # m < S
    kappa: float = spec(1.0, positive=True)  # common component of every inner product
    eps: float = spec(0.0, low=0.0)  # largest deviation of the Gram matrix from kappa + identity
    gamma: float = spec(6.0, positive=True)  # attention scale
    beta: float = spec(8.0, positive=True)  # unembedding scale

    def __post_init__(self) -> None:
        check_fields(self, "theory")
        if not self.heads < self.stride:
            raise ValueError(f"theory.heads: need 1 <= m < S = {self.stride}, got m = {self.heads}")
        if self.vocab < self.chunks * self.stride:
            raise ValueError(f"theory.vocab: need N >= L*S = {self.chunks * self.stride} distinct tokens, "
                             f"got {self.vocab}")

    @property
    def dim(self) -> int:
        return self.vocab + 1


@dataclass
class FlowConfig:
    """Gradient-descent settings for the theory model's log-linear gates."""

    runs: int = spec(16, low=1, high=1 << 16)  # independent seeds trained together
    steps: int = spec(1500, low=1, high=1 << 24)
    lr: float = spec(2.0, positive=True)
    rho: float = spec(0.01, positive=True)  # norm of each run's initial parameter tensor
    batch: int = spec(32, low=1, high=1 << 16)  # fresh contexts per run per step
    record_every: int = spec(25, low=1)
    eval_contexts: int = spec(256, low=1, high=1 << 20)

    def __post_init__(self) -> None:
        check_fields(self, "flow")
