"""Gate concentration of the compressors of transformers architectures (docs/science.md section 4).

An architecture with compressor gates (`phasekv.archs`, `gate_layers`) names, per compressed layer, the module whose
input is the hidden states its gates read and how to recompute the gate softmax alpha from the module's own
weights.  `arch_gate_statistics` captures those inputs on real prompts (a forward pre-hook on the real module),
recomputes alpha for every closed window and pools the windows exactly as `phasekv.probes.gates.gate_statistics`
does for phasekv's compressors (same keys), so the report draws both alike.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phasekv import families
from phasekv.archs import architecture_of
from phasekv.probes.concentration import Accumulator


@torch.no_grad()
def arch_gate_statistics(model: nn.Module, prompt_ids: torch.Tensor, batch_size: int = 16) -> list[dict[str, Any]]:
    """Per gated compressor layer of a transformers model: the gate record of `gate_statistics` (static, per-window,
    profile over the window's W offsets, windows every S tokens from position 0)."""
    found = architecture_of(model).gate_layers(model)
    if not found:
        raise ValueError("gates: the model's architecture has no compressor gates to read (phasekv.archs)")
    captured: dict[int, torch.Tensor] = {}
    handles = [g.module.register_forward_pre_hook(
        lambda mod, args, kwargs, i=g.layer: captured.__setitem__(i, args[0] if args else kwargs["hidden_states"]),
        with_kwargs=True) for g in found]
    stats = {g.layer: Accumulator() for g in found}
    try:
        for ids in prompt_ids.split(batch_size):
            families.logits(model, ids.to(next(model.parameters()).device))
            for g in found:
                stats[g.layer].add(g.weights(captured.pop(g.layer)).flatten(0, 1).float())  # (B*N, W, D)
    finally:
        for handle in handles:
            handle.remove()
    gates = []
    for g in found:
        acc = stats[g.layer]
        if not acc.n:
            raise ValueError(f"gates: the prompts hold no closed window of layer {g.layer} (S = {g.stride})")
        static, per_window = acc.concentration()
        gates.append({"layer": g.layer, "kv_head": 0, "branch": g.branch, "kind": g.kind, "window": g.window,
                      "stride": g.stride, "tied": g.tied, "n_windows": acc.n, "first_window_start": 0,
                      "offset_phases": [j % g.stride for j in range(g.window)],
                      "static": static, "per_window": per_window, "profile": acc.profile()})
    return gates
