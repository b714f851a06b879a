"""Gate concentration (PAPER.md section 4): how many offsets a compressor's gate really uses.

For one gate (layer, KV head, branch) and its weights alpha over the W offsets of many windows:
    static     = exp(H(E[alpha]))     entropy of the mean profile: which offsets the gate uses overall
    per-window = E[exp(H(alpha))]     mean over windows of each window's own effective number
Both are 1 for a one-hot gate and W for a uniform one; an input-dependent one-hot gate has static W
and per-window 1.  Statically concentrated gates sit low-left on the diagonal of the plane.
Vector gates have one distribution per channel: both numbers are computed per channel, then
averaged over channels.
"""

from __future__ import annotations

import torch


def entropy(p: torch.Tensor, dim: int) -> torch.Tensor:
    p = p.clamp_min(0)
    return -(p * torch.log(p.clamp_min(1e-30))).sum(dim)


def concentration(alpha: torch.Tensor) -> tuple[float, float]:
    """alpha (N windows, W offsets, G channels) -> (static, per-window) effective numbers of offsets."""
    if alpha.dim() == 2:
        alpha = alpha[..., None]
    alpha = alpha.double()
    static = torch.exp(entropy(alpha.mean(0), dim=0)).mean()  # (G,) -> mean over channels
    per_window = torch.exp(entropy(alpha, dim=1)).mean(0).mean()
    return float(static), float(per_window)


def concentration_reference(alpha: torch.Tensor) -> tuple[float, float]:
    """Loops over channels and windows: the oracle for `concentration`."""
    import math

    if alpha.dim() == 2:
        alpha = alpha[..., None]
    N, W, G = alpha.shape
    statics, windows = [], []
    for g in range(G):
        mean = [sum(float(alpha[n, i, g]) for n in range(N)) / N for i in range(W)]
        statics.append(math.exp(-sum(m * math.log(m) for m in mean if m > 0)))
        per = [math.exp(-sum(float(a) * math.log(float(a)) for a in alpha[n, :, g] if a > 0)) for n in range(N)]
        windows.append(sum(per) / N)
    return sum(statics) / G, sum(windows) / G


def profile(alpha: torch.Tensor) -> list[float]:
    """Mean gate weight per offset (averaged over windows and channels)."""
    if alpha.dim() == 2:
        alpha = alpha[..., None]
    return [float(x) for x in alpha.double().mean(dim=(0, 2))]
