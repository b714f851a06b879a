"""Gate concentration of compressed layers over windows of real prompts (docs/science.md section 4).

For every compressed layer, KV head and branch (K, V; one "k" branch when K = V are tied, as in the
DeepSeek kernels) the prompts' hidden states are captured at the attention input, the compressor's
gate weights alpha (B, N windows, W, KVH, G) are recomputed from them, and all complete windows
(from the layer's first window start, every S tokens: staggered layers are read on their own windows) are pooled:
    static     = exp(H(E[alpha]))      per-window = E[exp(H(alpha))]      profile = E[alpha] per offset
Vector gates (G = head_dim channels) give one distribution per channel: both numbers are computed per
channel and then averaged over channels, and the profile is averaged over channels.  Uniform
averaging (no gate parameters) is reported too: it sits at (W, W).

`gate_trajectory` repeats this for the compressor snapshots a training run saved (gates/step_*.
safetensors).  Every other weight is the run's final checkpoint, so a trajectory shows how the gates
themselves evolve as read by the final network, not the concentration the model had at that step.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from phasekv.adapters.base import Adapter
from phasekv.checkpoint import load_checkpoint, load_tensors
from phasekv.compression import compressor_parameters
from phasekv.config import EvalConfig, ModelConfig
from phasekv.evaluate.sources import Source, batch_size, open_source
from phasekv.figures.probes import (
    VECTOR_NOTE,
    plot_concentration_plane,
    plot_gate_profiles,
    plot_gate_trajectory,
)
from phasekv.outputs import write_json
from phasekv.probes.concentration import Accumulator
from phasekv.probes.hooks import attention_inputs, compressed_layers
from phasekv.probes.output import write_result

log = logging.getLogger(__name__)


def _batches(prompt_ids: torch.Tensor | list[torch.Tensor], batch_size: int) -> list[torch.Tensor]:
    """(B, T) LongTensor or a list of them (lengths may differ between tensors) -> (b, T) batches."""
    tensors = [prompt_ids] if isinstance(prompt_ids, torch.Tensor) else list(prompt_ids)
    out = []
    for ids in tensors:
        if not isinstance(ids, torch.Tensor) or ids.dim() not in (1, 2) or ids.dtype != torch.long:
            raise ValueError("prompt_ids: expected a LongTensor (B, T) or a list of them")
        out.extend((ids[None] if ids.dim() == 1 else ids).split(batch_size))
    if not out or not sum(len(b) for b in out):
        raise ValueError("prompt_ids: no prompts given")
    return out


def _head_gates(c: nn.Module, x: torch.Tensor):
    """(kv_head, branch, alpha (B, N, W, G)) of every gate on the head's real windows of the layer input x
    (B, T, hidden): from the head's first window start (staggered layers and heads start later)."""
    by_start = {}
    for h in range(c.num_kv_heads):
        start = c.head_offset(h)
        if start not in by_start:
            by_start[start] = c.gate_weights(c.from_first_window(x, h))  # (B, N, W, KVH, G) per branch
        for branch, alpha in by_start[start].items():
            yield h, branch, alpha[:, :, :, h]


def _gate_kind(compressor: nn.Module, alpha: torch.Tensor) -> str:
    """alpha (B, N, W, [KVH,] G): uniform (no gate parameters), vector (G > 1) or scalar gates."""
    if not compressor.gate_parameters():
        return "uniform"
    return "vector" if alpha.shape[-1] > 1 else "scalar"


@torch.no_grad()
def gate_statistics(model: nn.Module | Adapter, prompt_ids: torch.Tensor | list[torch.Tensor],
                    batch_size: int = 16, progress: bool = True) -> list[dict[str, Any]]:
    """Per gate: layer, kv_head, branch, kind, window, tied, n_windows, static, per_window, profile."""
    model = model.module if isinstance(model, Adapter) else model
    layers = compressed_layers(model)
    if not layers:
        raise ValueError("gates: the model has no compressed layer (gate statistics need a KV compressor)")
    device = next(model.parameters()).device
    stats: dict[tuple[int, int, str], Accumulator] = {}
    kinds: dict[tuple[int, str], str] = {}
    was_training = model.training
    model.eval()
    try:
        for ids in tqdm(_batches(prompt_ids, batch_size), desc="gates", unit="batch", disable=not progress,
                        leave=False):
            with attention_inputs(model) as inputs:
                model(ids.to(device))
            for i, attn in layers:
                for h, branch, alpha in _head_gates(attn.compressor, inputs[i][0]):  # alpha (B, N, W, G)
                    kinds[(i, branch)] = _gate_kind(attn.compressor, alpha)
                    stats.setdefault((i, h, branch), Accumulator()).add(alpha.flatten(0, 1))  # (B*N, W, G)
    finally:
        model.train(was_training)
    compressors = dict(layers)
    gates = []
    for (i, h, branch), acc in sorted(stats.items()):
        c = compressors[i].compressor
        if not acc.n:
            raise ValueError(f"gates: the prompts hold no complete window of layer {i} (W={c.window} tokens)")
        static, per_window = acc.concentration()
        gates.append({"layer": i, "kv_head": h, "branch": branch, "kind": kinds[(i, branch)],
                      "window": c.window, "stride": c.stride, "tied": bool(c.tied), "n_windows": acc.n,
                      "first_window_start": c.head_offset(h),
                      "offset_phases": [c.offset_phase(j, h) for j in range(c.window)],
                      "static": static, "per_window": per_window, "profile": acc.profile()})
    return gates


def gate_report(model: nn.Module | Adapter, prompt_ids: torch.Tensor | list[torch.Tensor],
                out_dir: str | Path | None = None, *, top: int = 4, batch_size: int = 16,
                progress: bool = True, figures: bool = True) -> dict[str, Any]:
    """Gate statistics of every gate, and (with `out_dir`) gates.json and (with `figures`) concentration_plane.png
    and gate_profiles.png (the `top` heads with the most concentrated key gates, value profile beside)."""
    gates = gate_statistics(model, prompt_ids, batch_size, progress)
    result: dict[str, Any] = {"gates": gates, "figures": {}}
    if any(g["kind"] == "vector" for g in gates):
        result["note"] = VECTOR_NOTE
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        if figures:
            plane = plot_concentration_plane(gates, out / "concentration_plane.png")
            result["figures"] = {"concentration_plane": str(plane),
                                 "gate_profiles": str(plot_gate_profiles(gates, out / "gate_profiles.png", top))}
        write_json(out / "gates.json", result, sort_keys=False)
        log.info("wrote %s", out)
    return result


def _step(path: Path) -> int:
    match = re.fullmatch(r"step_(\d+)\.safetensors", path.name)
    return int(match.group(1)) if match else -1


def gate_trajectory(run_dir: str | Path, prompt_ids: torch.Tensor | list[torch.Tensor], out_dir: str | Path,
                    batch_size: int = 16, progress: bool = True) -> dict[str, Any]:
    """Static and per-window concentration of every gate at every saved step of a training run.

    Reads run_dir/gates/step_*.safetensors and run_dir/config.json; writes gate_trajectory.json and
    gate_trajectory.png to `out_dir`.  ValueError if the run saved no snapshot.
    """
    run = Path(run_dir)
    snapshots = sorted((p for p in (run / "gates").glob("step_*.safetensors") if _step(p) >= 0), key=_step)
    if not snapshots:
        raise ValueError(f"gate trajectory: no snapshots in {run / 'gates'} (phasekv train writes "
                         "gates/step_NNNNNN.safetensors for compressed models at every checkpoint)")
    if not (run / "config.json").is_file():
        raise ValueError(f"gate trajectory: {run} has no config.json (expected a phasekv training run directory)")
    config = ModelConfig.from_dict(json.loads((run / "config.json").read_text())["model"])
    model, final_config = load_checkpoint(run)
    if final_config != config:
        raise ValueError(f"gate trajectory: {run}/config.json and its final checkpoint describe different models")
    names = set(compressor_parameters(model))
    steps, per_step = [], []
    for path in tqdm(snapshots, desc="gate snapshots", unit="step", disable=not progress):
        tensors = load_tensors(path)
        if set(tensors) != names:
            missing, unexpected = sorted(names - set(tensors))[:3], sorted(set(tensors) - names)[:3]
            raise ValueError(f"gate trajectory: {path} does not hold this model's compressor parameters "
                             f"(missing {missing}, unexpected {unexpected})")
        model.load_state_dict(tensors, strict=False)
        steps.append(_step(path))
        per_step.append(gate_statistics(model, prompt_ids, batch_size, progress))
    gates = [{key: g[key] for key in ("layer", "kv_head", "branch", "kind")} for g in per_step[0]]
    for j, g in enumerate(gates):
        g["static"] = [stats[j]["static"] for stats in per_step]
        g["per_window"] = [stats[j]["per_window"] for stats in per_step]
    result: dict[str, Any] = {"run": str(run), "steps": steps, "gates": gates}
    return write_result(out_dir, "gate_trajectory", result, plot_gate_trajectory)


def gates_on(source: Source, cfg: EvalConfig, out_dir: str | Path, *, n_prompts: int = 64, top: int = 4,
             trajectory: bool = False, progress: bool = True) -> dict[str, Any]:
    """`phasekv gates`: gate statistics of a checkpoint on `n_prompts` lookup prompts spread over the
    eval set's clusters and shifts (and, with `trajectory`, over the run's gate snapshots)."""
    adapter, eval_set = open_source(source, cfg)
    prompts = eval_set.prompts()
    keep = np.linspace(0, len(prompts) - 1, min(n_prompts, len(prompts))).round().astype(int)
    ids = torch.tensor([prompts[i].ids for i in keep])  # (B, T)
    bs = batch_size(source, cfg)
    result = gate_report(adapter, ids, out_dir, top=top, batch_size=bs, progress=progress)
    if trajectory:
        result["trajectory"] = gate_trajectory(source.checkpoint, ids, out_dir, bs, progress)
    return result
