"""Gate concentration of transformers' own DeepSeek-V4 heavily-compressed-attention (HCA) compressor.

`DeepseekV4HCACompressor` compresses each closed window of m' tokens into one entry (tied: the entry is key and
value) as sum_j softmax_j(gate_proj(h_j) + position_bias_j) * kv_proj(h_j), with the softmax over the window's
offsets j, per channel: a shared payload projection, a per-channel ("vector") gate and a learned per-offset bias.
`v4_gate_statistics` captures each compressor's input hidden states on real prompts (a forward pre-hook on the
real module), recomputes that softmax from the module's own `gate_proj` and `position_bias` for every closed
window, and pools the windows exactly as `phasekv.probes.gates.gate_statistics` does for phasekv's compressors
(same keys, kind "vector", branch "k", tied), so the report draws both alike.  The recomputation is checked
against the module's own compressed entries in tests/test_realarch.py.  CSA compressors (overlapping windows and
an indexer) are not covered yet.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from phasekv import families
from phasekv.probes.concentration import Accumulator


def v4_compressors(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer index, compressor) of every DeepSeek-V4 HCA compressor of `model` (found by class; [] otherwise)."""
    if "transformers" not in sys.modules:
        return []
    try:
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4
    except ImportError:
        return []
    return [(m.layer_idx, m.compressor) for m in model.modules()
            if isinstance(m, v4.DeepseekV4Attention) and isinstance(m.compressor, v4.DeepseekV4HCACompressor)]


def v4_gate_weights(compressor: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """hidden (B, T, hidden) from position 0 -> alpha (B, N, m', D): the softmax over each closed window's offsets of
    gate_proj(h) + position_bias, per channel (the compressor's own weights, float32 as it computes them)."""
    m = compressor.compress_rate
    n = hidden.shape[1] // m
    gate = compressor.gate_proj(hidden[:, :n * m]).view(hidden.shape[0], n, m, -1)
    return (gate + compressor.position_bias).softmax(dim=2, dtype=torch.float32)


@torch.no_grad()
def v4_gate_statistics(model: nn.Module, prompt_ids: torch.Tensor, batch_size: int = 16) -> list[dict[str, Any]]:
    """Per HCA layer: the gate record of `gate_statistics` (static, per-window, profile over the m' offsets)."""
    found = v4_compressors(model)
    if not found:
        raise ValueError("gates: no DeepSeek-V4 HCA compressor in the model")
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
        gates.append({"layer": i, "kv_head": 0, "branch": "k", "kind": "vector", "window": m, "stride": m,
                      "tied": True, "n_windows": stats[i].n, "first_window_start": 0, "offset_phases": list(range(m)),
                      "static": static, "per_window": per_window, "profile": stats[i].profile()})
    return gates
