"""Gate cycling (docs/science.md section 4): move each gate's preferred offsets by delta and re-evaluate.

For W = S compressors, window j covers positions o + jS .. o + jS + S - 1 (o: the layer's first
window start), so offset i IS phase (o + i) mod S of its
token.  Cycling the offset-specific gate parameters by delta,
    Z~_i = Z_((i - delta) mod W),   b~_i = b_((i - delta) mod W)       (torch.roll(x, delta, 0)),
with the payload maps C_i fixed, makes the gate favour offset i + delta where it favoured i.  If the
phase profile of accuracy is set by the gates alone, it moves with them:
    A_delta(r) ~ A_0((r - delta) mod S).
The boundary phase of each layer (the phase of its windows' last offset: S - 1 for windows that
start at 0, earlier for staggered layers) is excluded from the headline R^2 and the shift: its weakness comes
from the window boundary (the successor sits in the next entry), which cycling does not move.  Each delta's
outcome, "moved", "did not move" or "destroyed", with its statistics: `phasekv.probes.cycle_outcome`.

Offset-specific gate parameters are those each compressor declares (`offset_gate_parameters`: one
slice per offset on dim 0); maps shared by several offsets are left alone, payload maps are never
touched.  The compressors of a transformers architecture are cycled through the offset-specific gate parameters
its file in `phasekv.archs` declares (`cycled_layers`); a W != S compressor is not cyclable.
`cycled_gates` restores the saved parameters bit for bit on exit, exception or not.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from phasekv.adapters.base import Adapter
from phasekv.archs import CycledLayer, architecture_of
from phasekv.config import EvalConfig
from phasekv.data.protocols import EvalSet
from phasekv.evaluate.profiles import accuracies
from phasekv.evaluate.runner import predict
from phasekv.evaluate.sources import Source, batch_size, open_source
from phasekv.figures.probes import plot_cycling
from phasekv.probes.cycle_outcome import outcome
from phasekv.probes.gates import gate_statistics
from phasekv.probes.hooks import compressed_layers
from phasekv.probes.output import write_result

log = logging.getLogger(__name__)


def cycled_layers(model: nn.Module | Adapter) -> list[CycledLayer]:
    """Every compressed layer: phasekv's compressors, and those of a transformers architecture that declares its
    offset-specific gate parameters (`phasekv.archs`, `cycled_layers`)."""
    out = []
    for i, attn in compressed_layers(model):
        c = attn.compressor
        if c.head_stagger:
            raise ValueError(f"gate cycling: layer {i} staggers its KV heads (each head has its own boundary phase)")
        out.append(CycledLayer(i, c.window, c.stride, c.offset_phase(c.window - 1), c.offset_gate_parameters()))
    module = model.module if isinstance(model, Adapter) else model
    return out + architecture_of(module).cycled_layers(module)


def cycle_stride(model: nn.Module | Adapter) -> int:
    """The common S = W of the model's compressed layers; ValueError when cycling is undefined."""
    layers = cycled_layers(model)
    if not layers:
        raise ValueError("gate cycling: the model has no compressed layer")
    strides = set()
    for cl in layers:
        if cl.window != cl.stride:
            raise ValueError(f"gate cycling: needs W = S, but layer {cl.layer} has W={cl.window}, S={cl.stride}")
        strides.add(cl.stride)
    if len(strides) > 1:
        raise ValueError(f"gate cycling: compressed layers have different strides {sorted(strides)}")
    return strides.pop()


def offset_gate_parameters(model: nn.Module | Adapter) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every offset-specific gate parameter of the compressed layers."""
    params = []
    for cl in cycled_layers(model):
        for name, p in cl.gates.items():
            if p.shape[0] != cl.window:
                raise ValueError(f"gate cycling: layer {cl.layer} {name} has {p.shape[0]} slices on dim 0, not "
                                 f"W={cl.window}")
            params.append((f"layer {cl.layer} {name}", p))
    return params


@contextlib.contextmanager
def _restored(params: list[nn.Parameter]) -> Iterator[None]:
    """Save the parameters and restore them bit for bit on exit, exception or not."""
    saved = [p.detach().clone() for p in params]
    try:
        yield
    finally:
        with torch.no_grad():
            for p, original in zip(params, saved):
                p.copy_(original)


@contextlib.contextmanager
def cycled_gates(model: nn.Module | Adapter, delta: int) -> Iterator[None]:
    """Roll every offset-specific gate parameter by `delta` along the offset dim; restore on exit."""
    cycle_stride(model)
    params = [p for _, p in offset_gate_parameters(model)]
    if not params:
        raise ValueError("gate cycling: the compressors have no offset-specific gate parameters "
                         "(uniform averaging has nothing to cycle)")
    with _restored(params):
        with torch.no_grad():
            for p in params:
                p.copy_(torch.roll(p, int(delta), 0))
        yield


def boundary_phases(model: nn.Module | Adapter) -> list[int]:
    """Phases of the last offset of every compressed layer's windows (S - 1 unless staggered)."""
    return sorted({cl.boundary for cl in cycled_layers(model)})


def offset_payload_maps(model: nn.Module | Adapter) -> list[tuple[int, str, int, nn.Parameter]]:
    """(layer, branch, KV heads, map) of every per-offset payload map (W, hidden, KVH*D)."""
    return [(i, branch, attn.compressor.num_kv_heads, p) for i, attn in compressed_layers(model)
            for branch, p in attn.compressor.offset_payload_maps().items()]


@contextlib.contextmanager
def rolled_payloads(model: nn.Module | Adapter, delta: int) -> Iterator[None]:
    """Control 1: roll the per-offset payload maps together with the gates (the whole offset-specific
    compressor moves, so the prediction A_0((r - delta) mod S) should hold whatever the maps hold)."""
    maps = [p for *_, p in offset_payload_maps(model)]
    with _restored(maps), cycled_gates(model, delta):
        with torch.no_grad():
            for p in maps:
                p.copy_(torch.roll(p, int(delta), 0))
        yield


@contextlib.contextmanager
def averaged_payloads(model: nn.Module | Adapter, gates: list[dict[str, Any]]) -> Iterator[None]:
    """Control 2: every offset's payload map becomes the average of the maps weighted by how much the
    gate uses each offset (per layer, branch and KV head: `profile` of `gate_statistics`).  The
    compressor then has one shared payload, as with `payload: shared`, and the gates alone choose."""
    profiles = {(g["layer"], g["branch"], g["kv_head"]): g["profile"] for g in gates}
    maps = offset_payload_maps(model)
    with _restored([p for *_, p in maps]):
        with torch.no_grad():
            for layer, branch, kv_heads, p in maps:
                W, hidden, F = p.shape
                heads = p.view(W, hidden, kv_heads, F // kv_heads)  # (W, hidden, KVH, D)
                weights = torch.tensor([profiles[(layer, branch, h)] for h in range(kv_heads)],
                                       dtype=p.dtype).T  # (W, KVH)
                mixed = torch.einsum("wh,wchd->chd", weights / weights.sum(0), heads)
                heads.copy_(mixed.expand_as(heads))
        yield


def _cycle_rows(adapter: Adapter, eval_set: EvalSet, deltas: list[int], clean_records: list[dict], context, *,
                inner: np.ndarray, run: dict[str, Any], desc: str) -> list[dict[str, Any]]:
    """Evaluate under `context(delta)` for each delta and compare with the clean profile A_0: the outcome of each
    delta with its statistics (`phasekv.probes.cycle_outcome.outcome`)."""
    rows = []
    for delta in tqdm(deltas, desc=desc, unit="delta", disable=not run["progress"]):
        with context(delta):
            records = predict(adapter, eval_set, run["batch_size"], run["multi_query"], run["progress"],
                              desc=f"delta {delta:+d}")
        row = outcome(clean_records, records, delta, stride=eval_set.stride, inner=inner,
                      in_context_chance=eval_set.in_context_chance, n_boot=run["n_boot"])
        if delta == 0:
            row["matches_clean"] = [r["prediction"] for r in records] == [r["prediction"] for r in clean_records]
        rows.append(row)
    return rows


def run_cycling(adapter: Adapter, eval_set: EvalSet, deltas: Iterable[int] = range(-3, 4),
                out_dir: str | Path | None = None, batch_size: int = 32, progress: bool = True, *,
                multi_query: bool = True, controls: bool = True, n_boot: int = 1000, figures: bool = True
                ) -> dict[str, Any]:
    """Evaluate the model with its gates cycled by each delta and compare to A_0((r - delta) mod S).

    Per delta: observed and predicted per-phase accuracy (fractions), the outcome ("moved", "did not move",
    "destroyed", "inconclusive") with its statistics (shift and its 95% set, correlations, mean before and after:
    `phasekv.probes.cycle_outcome`), r2_excl_boundary (phases other than the layers' boundary phases) with a 95%
    cluster-bootstrap interval and r2_all, each only where the cycled curve varies and never below -1, and mae
    (mean absolute error over all phases, as a fraction).  With `controls` and per-offset payload maps,
    `controls` holds the same rows for `rolled_payloads` (maps rolled with the gates) and for
    `averaged_payloads` (maps replaced by their gate-weighted average first; its own clean profile).
    With `out_dir`, writes cycling.json and (with `figures`) cycling.png.
    """
    S = cycle_stride(adapter)
    if eval_set.stride != S:
        raise ValueError(f"gate cycling: the eval set's phase stride {eval_set.stride} differs from the "
                         f"model's S = {S}")
    deltas = [int(d) for d in deltas]
    run = {"batch_size": batch_size, "multi_query": multi_query, "progress": progress, "n_boot": n_boot}
    clean_records = predict(adapter, eval_set, batch_size, multi_query, progress, desc="clean")
    boundary = boundary_phases(adapter)
    inner = np.array([r for r in range(S) if r not in boundary], dtype=int)
    rows = _cycle_rows(adapter, eval_set, deltas, clean_records, lambda d: cycled_gates(adapter, d), inner=inner,
                       run=run, desc="cycling")
    result = {"model": adapter.info.name, "protocol": eval_set.protocol, "stride": S, "boundary_phases": boundary,
              "n_prompts": len(clean_records), "clean": accuracies(clean_records, S, eval_set.residue_modulus),
              "deltas": rows, "figure": None, "n_boot": n_boot}
    if controls and offset_payload_maps(adapter):
        result["controls"] = _controls(adapter, eval_set, deltas, clean_records, inner, run)
    if out_dir is not None:
        write_result(out_dir, "cycling", result, plot_cycling if figures else None)
    return result


CONTROL_MAX_SHIFT = 2  # the controls run on the non-zero deltas up to this shift


def _controls(adapter: Adapter, eval_set: EvalSet, deltas: list[int], clean_records: list[dict],
              inner: np.ndarray, run: dict[str, Any]) -> dict[str, Any]:
    """The two zero-cost controls that say why per-offset payload maps break gate-only cycling (on the
    non-zero deltas with |delta| <= 2: delta 0 is the clean model, and two shifts each way suffice)."""
    deltas = [d for d in deltas if d != 0 and abs(d) <= CONTROL_MAX_SHIFT] or deltas
    rolled = _cycle_rows(adapter, eval_set, deltas, clean_records, lambda d: rolled_payloads(adapter, d),
                         inner=inner, run=run, desc="cycling, payloads rolled too")
    prompts = [torch.tensor(p.ids) for p in eval_set.prompts()]
    gates = gate_statistics(adapter, prompts[:: max(1, len(prompts) // 64)], progress=False)
    S, R = eval_set.stride, eval_set.residue_modulus
    with averaged_payloads(adapter, gates):
        avg_clean = predict(adapter, eval_set, run["batch_size"], run["multi_query"], run["progress"],
                            desc="averaged payloads")
        averaged = _cycle_rows(adapter, eval_set, deltas, avg_clean, lambda d: cycled_gates(adapter, d),
                               inner=inner, run=run, desc="cycling, averaged payloads")
    return {"rolled_payloads": {"deltas": rolled},
            "averaged_payloads": {"clean": accuracies(avg_clean, S, R), "deltas": averaged}}


def cycling_on(source: Source, cfg: EvalConfig, out_dir: str | Path, deltas: Iterable[int] = range(-3, 4),
               progress: bool = True) -> dict[str, Any]:
    """`phasekv cycle`: gate cycling of a checkpoint on the prompt set `cfg` describes."""
    adapter, eval_set = open_source(source, cfg)
    return run_cycling(adapter, eval_set, deltas, out_dir, batch_size(source, cfg), progress,
                       multi_query=not cfg.one_by_one)
