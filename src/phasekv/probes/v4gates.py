"""Gate concentration of transformers' own DeepSeek-V4 compressors (HCA and CSA).

`DeepseekV4HCACompressor` compresses each closed window of m' tokens into one entry (tied: the entry is key and
value) as sum_j softmax_j(gate_proj(h_j) + position_bias_j) * kv_proj(h_j), with the softmax over the window's
offsets j, per channel: a shared payload projection, a per-channel ("vector") gate and a learned per-offset bias.
`v4_gate_statistics` captures each compressor's input hidden states on real prompts (a forward pre-hook on the
real module), recomputes that softmax from the module's own `gate_proj` and `position_bias` for every closed
window, and pools the windows exactly as `phasekv.probes.gates.gate_statistics` does for phasekv's compressors
(same keys, kind "vector", branch "k", tied), so the report draws both alike.  The recomputation is checked
against the module's own compressed entries in tests/test_realarch.py.

`DeepseekV4CSACompressor` (compressed sparse attention, m tokens per step) is covered too: its entry w mixes two
series over 2m slots, the Ca half of the gate and payload projections (`[..., :head_dim]`) for the m tokens of
window w-1 and the Cb half (`[..., head_dim:]`) for the m tokens of window w, under ONE softmax over the 2m slots
(overlapping windows W = 2m at stride S = m).  Entry 0 has no previous window (its Ca slots carry weight 0), so
the statistics pool entries 1.. : windows of 2m tokens starting at 0, m, 2m, ..., offset j at phase j mod m.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from phasekv import families
from phasekv.probes.concentration import Accumulator


def v4_compressors(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer index, compressor) of every DeepSeek-V4 HCA or CSA compressor of `model` (by class; [] otherwise)."""
    if "transformers" not in sys.modules:
        return []
    try:
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4
    except ImportError:
        return []
    kinds = (v4.DeepseekV4HCACompressor, v4.DeepseekV4CSACompressor)
    return [(m.layer_idx, m.compressor) for m in model.modules()
            if isinstance(m, v4.DeepseekV4Attention) and isinstance(m.compressor, kinds)]


def overlapping(compressor: nn.Module) -> bool:
    """A CSA compressor: windows of 2m tokens every m (two series per token), else HCA (m' tokens every m')."""
    return compressor.kv_proj.out_features == 2 * compressor.head_dim


def v4_windows(compressor: nn.Module, projected: torch.Tensor) -> torch.Tensor:
    """A projection (B, T, D or 2D) of the tokens from position 0 laid out per window's slots: HCA (B, N, m', D)
    over the closed windows; CSA (B, N-1, 2m, D) for entries 1..N-1, the Ca half of window w-1's tokens then the
    Cb half of window w's."""
    m = compressor.compress_rate
    n = projected.shape[1] // m
    per_window = projected[:, :n * m].view(projected.shape[0], n, m, -1)
    if not overlapping(compressor):
        return per_window
    D = compressor.head_dim
    return torch.cat([per_window[:, :-1, :, :D], per_window[:, 1:, :, D:]], dim=2)


def v4_gate_weights(compressor: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """hidden (B, T, hidden) from position 0 -> alpha (B, N, W, D): the softmax over each window's slots of
    gate_proj(h) + position_bias, per channel (the compressor's own weights, float32 as it computes them);
    W = m' for HCA, 2m for CSA (entries 1.., `v4_windows`)."""
    m = compressor.compress_rate
    n = hidden.shape[1] // m
    gate = compressor.gate_proj(hidden[:, :n * m]).view(hidden.shape[0], n, m, -1) + compressor.position_bias
    return v4_windows(compressor, gate.flatten(1, 2)).softmax(dim=2, dtype=torch.float32)


@torch.no_grad()
def v4_gate_statistics(model: nn.Module, prompt_ids: torch.Tensor, batch_size: int = 16) -> list[dict[str, Any]]:
    """Per HCA or CSA layer: the gate record of `gate_statistics` (static, per-window, profile over the window's
    W offsets: m' for HCA, 2m for CSA)."""
    found = v4_compressors(model)
    if not found:
        raise ValueError("gates: no DeepSeek-V4 HCA or CSA compressor in the model")
    captured: dict[int, torch.Tensor] = {}
    handles = [c.register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: captured.__setitem__(i, args[0] if args else kwargs["hidden_states"]),
        with_kwargs=True) for i, c in found]
    stats = {i: Accumulator() for i, _ in found}
    try:
        for ids in prompt_ids.split(batch_size):
            families.logits(model, ids.to(next(model.parameters()).device))
            for i, c in found:
                stats[i].add(v4_gate_weights(c, captured.pop(i)).flatten(0, 1).float())  # (B*N, m', D)
    finally:
        for handle in handles:
            handle.remove()
    gates = []
    for i, c in found:
        if not stats[i].n:
            raise ValueError(f"gates: the prompts hold no closed window of layer {i} (m' = {c.compress_rate})")
        static, per_window = stats[i].concentration()
        m = c.compress_rate
        W = 2 * m if overlapping(c) else m
        gates.append({"layer": i, "kv_head": 0, "branch": "k", "kind": "vector", "window": W, "stride": m,
                      "tied": True, "n_windows": stats[i].n, "first_window_start": 0,
                      "offset_phases": [j % m for j in range(W)],
                      "static": static, "per_window": per_window, "profile": stats[i].profile()})
    return gates
