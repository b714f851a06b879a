"""Gate concentration (docs/science.md section 4): how many offsets a compressor's gate really uses.

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


class Accumulator:
    """Streaming `concentration` and `profile` over batches of windows of one gate.

    Keeps the sum over windows of alpha (W, G) and of exp(H(alpha)) (G,), so windows from many
    prompts never have to be held at once; the result equals `concentration` on their concatenation.
    """

    def __init__(self) -> None:
        self.n = 0
        self.sum_alpha: torch.Tensor | None = None  # (W, G)
        self.sum_effective: torch.Tensor | None = None  # (G,)

    def add(self, alpha: torch.Tensor) -> Accumulator:
        """alpha (N windows, W offsets, G channels) or (N, W)."""
        if alpha.dim() == 2:
            alpha = alpha[..., None]
        alpha = alpha.detach().double().cpu()
        sums = (alpha.sum(0), torch.exp(entropy(alpha, dim=1)).sum(0))
        if self.sum_alpha is None:
            self.sum_alpha, self.sum_effective = sums
        else:
            self.sum_alpha, self.sum_effective = self.sum_alpha + sums[0], self.sum_effective + sums[1]
        self.n += alpha.shape[0]
        return self

    def concentration(self) -> tuple[float, float]:
        """(static, per-window) effective numbers of offsets, averaged over channels."""
        if not self.n:
            raise ValueError("concentration: no windows were added (prompts shorter than the window?)")
        static = torch.exp(entropy(self.sum_alpha / self.n, dim=0)).mean()  # (G,) -> mean over channels
        return float(static), float((self.sum_effective / self.n).mean())

    def profile(self) -> list[float]:
        """Mean gate weight per offset (averaged over windows and channels)."""
        if not self.n:
            raise ValueError("profile: no windows were added")
        return [float(x) for x in (self.sum_alpha / self.n).mean(1)]


def concentration(alpha: torch.Tensor) -> tuple[float, float]:
    """alpha (N windows, W offsets, G channels) -> (static, per-window) effective numbers of offsets."""
    return Accumulator().add(alpha).concentration()


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
    return Accumulator().add(alpha).profile()
