"""`phasekv knockout | gates | cycle`: the mechanistic probes (PAPER.md section 4) from the command line.

    phasekv knockout --checkpoint DIR --protocol prefix --out OUT [--whole-layer] [--calib-prompts 256]
    phasekv knockout --hf PATH --stride 4 --protocol prefix --out OUT --whole-layer
    phasekv gates --checkpoint RUN_DIR --out OUT [--prompts 64] [--top 4] [--trajectory]
    phasekv cycle --checkpoint DIR --protocol prefix --out OUT [--deltas -3 -2 -1 0 1 2 3]

Prompt sets are those of `phasekv eval` (same flags and defaults; --clusters makes them smaller).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from phasekv.data.protocols import EvalSet
from phasekv.evaluate.adapter import Adapter
from phasekv.evaluate.cli import add_prompt_arguments, add_source_arguments, open_source


def add_parser(sub) -> None:
    k = sub.add_parser("knockout", help="mean-replacement knockout of each KV head (or layer), by phase")
    add_source_arguments(k, "transformers Qwen3/Llama-style causal LM: local directory or hub name")
    add_prompt_arguments(k)
    k.add_argument("--whole-layer", action="store_true", help="knock out all heads of a layer at once")
    k.add_argument("--calib-prompts", type=int, default=256, help="calibration prompts N_cal")
    k.add_argument("--calib-seed", type=int, help="seed of the calibration set (default: --seed + 1)")
    k.set_defaults(func=knockout_command)

    g = sub.add_parser("gates", help="gate concentration and profiles of the compressed layers")
    g.add_argument("--checkpoint", required=True, help="phasekv checkpoint or run directory")
    add_prompt_arguments(g)
    g.add_argument("--prompts", type=int, default=64, help="lookup prompts whose windows are pooled")
    g.add_argument("--top", type=int, default=4, help="heads shown in gate_profiles.png")
    g.add_argument("--trajectory", action="store_true",
                   help="also the trajectory over the run's gate snapshots (--checkpoint must be the run directory)")
    g.set_defaults(func=gates_command)

    c = sub.add_parser("cycle", help="cycle the gates by delta (W = S models) and compare to the prediction")
    c.add_argument("--checkpoint", required=True, help="phasekv checkpoint or run directory")
    add_prompt_arguments(c)
    c.add_argument("--deltas", type=int, nargs="+", default=list(range(-3, 4)), help="offsets delta to cycle by")
    c.set_defaults(func=cycle_command)


def _open(args) -> tuple[Adapter, EvalSet]:
    for name in ("prompts", "calib_prompts", "top"):
        value = getattr(args, name, 1)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {value}")
    return open_source(args)


def knockout_command(args) -> dict[str, Any]:
    from phasekv.probes.knockout import calibration_set, run_knockout

    adapter, eval_set = _open(args)
    calib = calibration_set(eval_set, args.calib_prompts, args.calib_seed)
    return run_knockout(adapter, eval_set, calib, args.out, args.whole_layer, args.batch_size,
                        not args.no_progress, not args.one_by_one)


def gates_command(args) -> dict[str, Any]:
    from phasekv.probes.gates import gate_report, gate_trajectory

    adapter, eval_set = _open(args)
    prompts = eval_set.prompts()
    keep = np.linspace(0, len(prompts) - 1, min(args.prompts, len(prompts))).round().astype(int)
    ids = torch.tensor([prompts[i].ids for i in keep])  # (B, T), spread over clusters and shifts
    result = gate_report(adapter, ids, args.out, args.top, args.batch_size, not args.no_progress)
    if args.trajectory:
        result["trajectory"] = gate_trajectory(args.checkpoint, ids, args.out, args.batch_size, not args.no_progress)
    return result


def cycle_command(args) -> dict[str, Any]:
    from phasekv.probes.cycle import run_cycling

    adapter, eval_set = _open(args)
    return run_cycling(adapter, eval_set, args.deltas, args.out, args.batch_size, not args.no_progress,
                       not args.one_by_one)
