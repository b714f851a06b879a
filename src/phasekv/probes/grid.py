"""A randomized window grid at inference (issue 15's "fixed or randomized at inference").

Compressed attention gives every token a phase because the window grid is fixed: windows start at
offset + j*S.  Drawing the grid's shift uniformly from 0..S-1 per prompt at inference moves the window
boundaries with it.  `run_grid_shifts` evaluates the eval set once per shift r (every compressor's grid
shifted by r, `phasekv.compression.shifted_windows`) and averages the per-phase curves over the S shifts:
the expected accuracy per phase of a prompt whose grid shift is uniform, computed exactly instead of by
sampling.  The expectation flattens any periodic curve that only moves with the grid, so read it beside
`per_shift`: a record that fails at one shift still fails there; the shift only decides which prompts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from phasekv.adapters.base import Adapter
from phasekv.compression import compressors_of, shifted_windows
from phasekv.config import EvalConfig
from phasekv.data.protocols import EvalSet
from phasekv.evaluate.profiles import accuracies
from phasekv.evaluate.runner import predict
from phasekv.evaluate.sources import Source, batch_size, open_source
from phasekv.probes.output import write_result


def run_grid_shifts(adapter: Adapter, eval_set: EvalSet, out_dir: str | Path | None = None, batch_size: int = 32,
                    progress: bool = True) -> dict[str, Any]:
    """Per shift r in 0..S-1: accuracy and per-phase accuracy with every grid shifted by r; then the
    shift-averaged (randomized-grid) per-phase curve, its mean and gap (max - min phase, points)."""
    compressors = [c for _, c in compressors_of(adapter.module)]
    if not compressors:
        raise ValueError(f"{adapter.info.name}: no phasekv compressor: nothing to shift")
    S, R = eval_set.stride, eval_set.residue_modulus
    rows = []
    for shift in range(S):
        with shifted_windows(adapter.module, shift):
            records = predict(adapter, eval_set, batch_size, True, progress, desc=f"shift {shift}")
        acc = accuracies(records, S, R)
        rows.append({"shift": shift, "accuracy": acc["accuracy"], "per_phase": acc["per_phase"]})
    curves = np.array([row["per_phase"] for row in rows], dtype=float)  # (shifts, S)
    expected = curves.mean(0)
    result = {"model": adapter.info.name, "protocol": eval_set.protocol, "stride": S,
              "n_prompts": len(eval_set.queries()), "per_shift": rows,
              "randomized": {"per_phase": expected.tolist(), "mean_accuracy": float(expected.mean()),
                             "gap_pp": float(100 * (expected.max() - expected.min()))},
              "fixed": {"per_phase": rows[0]["per_phase"], "mean_accuracy": rows[0]["accuracy"],
                        "gap_pp": float(100 * (curves[0].max() - curves[0].min()))}}
    if out_dir is not None:
        write_result(out_dir, "grid_shifts", result, None)
    return result


def grid_on(source: Source, cfg: EvalConfig, out_dir: str | Path, progress: bool = True) -> dict[str, Any]:
    """`phasekv grid`: the grid-shift evaluation of a checkpoint on the prompt set `cfg` describes."""
    adapter, eval_set = open_source(source, cfg)
    return run_grid_shifts(adapter, eval_set, out_dir, batch_size(source, cfg), progress)
