"""The paper's gated chunk compressor (docs/science.md section 1) and the per-offset machinery it shares.

For window j and offset i (hidden state h[j,i], separately for the K and V branches):

    s[j,i]     = Z_i h[j,i] + b_i                  gate logits (1 per KV head, or D: vector gates)
    alpha[j,i] = softmax_i s[j,i]                   over the window's W slots
    Khat[j]    = sum_i alpha[j,i] * (C_i h[j,i])    per-offset payload map C_i

`OffsetGatedCompressor` evaluates this for any per-offset parameter tensors C (W, hidden, KVH*D),
Z (W, hidden, KVH*G) and b (W, KVH*G); subclasses only say how those tensors are parameterized
(one map per offset here, shared maps in the DeepSeek kernels).  Parameters keep the offset on
their first dimension so that gate cycling (probes) is a roll along dim 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from phasekv.compression.base import Compressor, num_windows, register, windows
from phasekv.config import CompressorOptions, ModelConfig, spec
from phasekv.layers import RMSNorm

BRANCHES = ("k", "v")
# windows compressed per pass: bounds the (B, N, W, width) payload/gate intermediates of a long prefill (each
# window is independent, so the entries are identical to one pass over all windows)
COMPRESS_CHUNK = 256


class OffsetGatedCompressor(Compressor):
    """Softmax-gated sum of per-offset payloads over each window."""

    def __init__(self, options: CompressorOptions, config: ModelConfig, offset: int, vector_gate: bool,
                 tied: bool, post_norm: bool):
        super().__init__(options, config, offset)
        self.tied = tied
        self.gate_dim = self.head_dim if vector_gate else 1
        self.branches = BRANCHES[:1] if tied else BRANCHES
        self.post_norms = nn.ModuleDict(
            {b: RMSNorm(self.head_dim, config.rms_norm_eps) for b in self.branches} if post_norm else {})

    # subclasses: per-offset parameter views for one branch
    def maps(self, branch: str) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(C (W, hidden, KVH*D), Z (W, hidden, KVH*G) or None, b (W, KVH*G) or None); Z None = uniform."""
        raise NotImplementedError

    def _alpha(self, hw: torch.Tensor, z: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
        B, N, W, _ = hw.shape
        if z is None:  # uniform averaging
            return hw.new_full((B, N, W, self.num_kv_heads, self.gate_dim), 1.0 / W)
        logits = torch.einsum("bnwc,wcg->bnwg", hw, z)  # (B, N, W, KVH*G)
        if b is not None:
            logits = logits + b
        logits = logits.view(B, N, W, self.num_kv_heads, self.gate_dim)  # (B, N, W, KVH, G)
        return torch.softmax(logits.float(), dim=2).to(hw.dtype)

    def gate_weights(self, h: torch.Tensor) -> dict[str, torch.Tensor]:
        hw = windows(h, self.window, self.stride)  # (B, N, W, hidden)
        out = {}
        for branch in self.branches:
            _, z, b = self.maps(branch)
            out[branch] = self._alpha(hw, z, b)  # (B, N, W, KVH, G)
        return out

    def compress(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        hw = windows(h, self.window, self.grid_stride)  # (B, N, W, hidden): a strided view, no copy
        if hw.shape[1] <= COMPRESS_CHUNK:
            return self._compress_windows(hw, h.dtype)
        parts = [self._compress_windows(hw[:, a:a + COMPRESS_CHUNK], h.dtype)
                 for a in range(0, hw.shape[1], COMPRESS_CHUNK)]
        k = torch.cat([p[0] for p in parts], dim=1)
        return k, None if parts[0][1] is None else torch.cat([p[1] for p in parts], dim=1)

    def _compress_windows(self, hw: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Entries of the windows hw (B, N, W, hidden): (B, N, KVH, D) keys and values (None when tied)."""
        B, N, W, _ = hw.shape
        KVH, D, G = self.num_kv_heads, self.head_dim, self.gate_dim
        maps = {branch: self.maps(branch) for branch in self.branches}
        # every branch's payload map and gate map side by side: one batched matmul over the windows
        mats = [m for c, z, _ in maps.values() for m in (c, z) if m is not None]  # (W, hidden, width) each
        fused = torch.einsum("bnwc,wcf->bnwf", hw, torch.cat(mats, dim=-1))  # (B, N, W, sum of widths)
        parts = iter(fused.split([m.shape[-1] for m in mats], dim=-1))
        out = {}
        for branch, (_, z, b) in maps.items():
            payload = next(parts).view(B, N, W, KVH, D)  # (B, N, W, KVH, D)
            if z is None:  # uniform averaging
                entry = payload.mean(dim=2)
            else:
                logits = next(parts) if b is None else next(parts) + b  # (B, N, W, KVH*G)
                alpha = torch.softmax(logits.view(B, N, W, KVH, G).float(), dim=2).to(dtype)  # (B, N, W, KVH, G)
                entry = (alpha * payload).sum(dim=2)  # (B, N, KVH, D)
            out[branch] = self._post_norm(branch, entry)
        return out["k"], out.get("v")

    def compress_reference(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T, _ = h.shape
        W, S, KVH, D, G = self.window, self.grid_stride, self.num_kv_heads, self.head_dim, self.gate_dim
        n = num_windows(T, W, S)
        out = {}
        for branch in self.branches:
            c, z, b = self.maps(branch)
            entries = torch.zeros(B, n, KVH, D, dtype=h.dtype)
            for bi in range(B):
                for j in range(n):
                    scores = torch.zeros(W, KVH, G, dtype=h.dtype)
                    payloads = torch.zeros(W, KVH, D, dtype=h.dtype)
                    for i in range(W):
                        x = h[bi, j * S + i]
                        payloads[i] = (x @ c[i]).view(KVH, D)
                        if z is not None:
                            s = x @ z[i] + (b[i] if b is not None else 0.0)
                            scores[i] = s.view(KVH, G)
                    alpha = torch.softmax(scores, dim=0)  # all-zero scores give uniform 1/W
                    entries[bi, j] = (alpha * payloads).sum(dim=0)
            out[branch] = self._post_norm(branch, entries)
        return out["k"], out.get("v")

    def _post_norm(self, branch: str, entry: torch.Tensor) -> torch.Tensor:
        return self.post_norms[branch](entry) if branch in self.post_norms else entry


@dataclass
class GatedOptions(CompressorOptions):
    """Options of the paper's gated kernel."""

    window: int = spec(8, low=1, high=4096)  # W: tokens per compressed entry
    stride: int = spec(8, low=1, high=4096)  # S: a new window starts every S tokens
    gate: str = spec("scalar", choices=("scalar", "vector"))  # one gate per KV head, or per channel
    tied_kv: bool = False  # values reuse the normalized, rotated compressed keys
    gate_bias: bool = True
    post_norm: bool = False  # RMSNorm on each compressed entry after the payload sum
    uniform: bool = False  # alpha = 1/W, no gate parameters
    # per_offset: own payload map C_i per offset (the paper); shared: one map C for every offset (gates and
    # biases stay per offset), so an offset is chosen by its gate alone and gate cycling is a pure roll
    payload: str = spec("per_offset", choices=("per_offset", "shared"))

    def validate(self) -> None:
        if self.stride > self.window:
            raise ValueError(f"{self.section}.stride: stride S={self.stride} must be <= window W={self.window} "
                             "(S > W would skip tokens)")

    def geometry(self) -> tuple[int, int]:
        return self.window, self.stride


@register("gated", GatedOptions)
class GatedCompressor(OffsetGatedCompressor):
    """The paper's kernel: own Z_i, b_i, C_i per offset i, separate K and V branches by default."""

    def __init__(self, options: GatedOptions, config: ModelConfig, offset: int = 0):
        super().__init__(options, config, offset, options.gate == "vector", options.tied_kv, options.post_norm)
        W, hidden, F = self.window, config.hidden_size, self.num_kv_heads * self.head_dim
        G = self.num_kv_heads * self.gate_dim
        std = config.initializer_range
        self.shared_payload = options.payload == "shared"
        for branch in self.branches:
            n_maps = 1 if self.shared_payload else W
            setattr(self, f"{branch}_payload", nn.Parameter(torch.randn(n_maps, hidden, F) * std))
            if not options.uniform:
                setattr(self, f"{branch}_gate", nn.Parameter(torch.randn(W, hidden, G) * std))
                if options.gate_bias:
                    setattr(self, f"{branch}_gate_bias", nn.Parameter(torch.zeros(W, G)))

    def maps(self, branch: str):
        payload = getattr(self, f"{branch}_payload")  # (W or 1, hidden, F): a shared map serves every offset
        return (payload.expand(self.window, -1, -1), getattr(self, f"{branch}_gate", None),
                getattr(self, f"{branch}_gate_bias", None))

    def gate_parameters(self) -> dict[str, nn.Parameter]:
        return {name: p for name, p in self.named_parameters(recurse=False) if "_gate" in name}

    def offset_gate_parameters(self) -> dict[str, nn.Parameter]:
        return self.gate_parameters()  # every gate map and bias has one slice per offset

    def offset_payload_maps(self) -> dict[str, nn.Parameter]:
        if self.shared_payload:
            return {}
        return {branch: getattr(self, f"{branch}_payload") for branch in self.branches}

    def payload_parameters(self) -> dict[str, nn.Parameter]:
        return {name: p for name, p in self.named_parameters(recurse=False) if name.endswith("_payload")}
