"""`phasekv knockout | gates | cycle`: the mechanistic probes (PAPER.md section 4) from the command line.

    phasekv knockout --checkpoint DIR --protocol prefix --out OUT [--whole-layer] [--calib-prompts 256]
    phasekv knockout --hf PATH --stride 4 --protocol prefix --out OUT --whole-layer
    phasekv gates --checkpoint RUN_DIR --out OUT [--prompts 64] [--top 4] [--trajectory]
    phasekv cycle --checkpoint DIR --protocol prefix --out OUT [--deltas -3 -2 -1 0 1 2 3]

Prompt sets are those of `phasekv eval` (same flags and defaults; --clusters makes them smaller).
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch

from phasekv.data.protocols import PROTOCOLS, EvalSet
from phasekv.evaluate.adapter import Adapter
from phasekv.evaluate.cli import make_eval_set, open_checkpoint


def _prompt_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--protocol", choices=PROTOCOLS, default="prefix")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--stride", type=int, help="phase stride S (default: the model's; 8 without compression)")
    p.add_argument("--residue-modulus", type=int, default=24)
    p.add_argument("--records", type=int, help="records per prompt (checkpoint: its training value; HF: 64)")
    p.add_argument("--demos", type=int, default=8)
    p.add_argument("--clusters", type=int, help="logical examples (default: exact position matching)")
    p.add_argument("--targets-per-context", type=int)
    p.add_argument("--local-window", type=int, help="targets lie outside this many final tokens (HF default 16)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--no-progress", action="store_true")


def add_parser(sub) -> None:
    k = sub.add_parser("knockout", help="mean-replacement knockout of each KV head (or layer), by phase")
    src = k.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="phasekv checkpoint or run directory")
    src.add_argument("--hf", help="transformers Qwen3/Llama-style causal LM: local directory or hub name")
    _prompt_arguments(k)
    k.add_argument("--whole-layer", action="store_true", help="knock out all heads of a layer at once")
    k.add_argument("--calib-prompts", type=int, default=256, help="calibration prompts N_cal")
    k.add_argument("--calib-seed", type=int, help="seed of the calibration set (default: --seed + 1)")
    k.add_argument("--one-by-one", action="store_true", help="one forward per prompt (no shared prefill)")
    k.add_argument("--dtype", default="float32", help="HF models: torch dtype, e.g. bfloat16")
    k.set_defaults(func=knockout_command)

    g = sub.add_parser("gates", help="gate concentration and profiles of the compressed layers")
    g.add_argument("--checkpoint", required=True, help="phasekv checkpoint or run directory")
    _prompt_arguments(g)
    g.add_argument("--prompts", type=int, default=64, help="lookup prompts whose windows are pooled")
    g.add_argument("--top", type=int, default=4, help="heads shown in gate_profiles.png")
    g.add_argument("--trajectory", action="store_true",
                   help="also the trajectory over the run's gate snapshots (--checkpoint must be the run directory)")
    g.set_defaults(func=gates_command)

    c = sub.add_parser("cycle", help="cycle the gates by delta (W = S models) and compare to the prediction")
    c.add_argument("--checkpoint", required=True, help="phasekv checkpoint or run directory")
    _prompt_arguments(c)
    c.add_argument("--deltas", type=int, nargs="+", default=list(range(-3, 4)), help="offsets delta to cycle by")
    c.add_argument("--one-by-one", action="store_true", help="one forward per prompt (no shared prefill)")
    c.set_defaults(func=cycle_command)


def _open(args) -> tuple[Adapter, EvalSet]:
    """The adapter and the lookup prompt set the flags describe (as `phasekv eval` builds them)."""
    for name in ("batch_size", "prompts", "calib_prompts", "top"):
        value = getattr(args, name, 1)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {value}")
    if getattr(args, "hf", None):
        from phasekv.evaluate.hf import TokenizerVocabulary, load_hf

        adapter, tokenizer = load_hf(args.hf, args.device, args.dtype, stride=args.stride,
                                     local_window=args.local_window)
        defaults: dict[str, Any] = {"n_records": 64, "key_tokens": 1, "value_tokens": 1, "local_window": 16}
        vocab = TokenizerVocabulary(tokenizer, {"keys": args.records or 64, "values": 16, "fillers": 8})
    else:
        adapter, defaults = open_checkpoint(args.checkpoint, args.device)
        vocab = defaults.pop("vocab")
    settings = {"n_records": args.records or defaults["n_records"], "n_demos": args.demos,
                "residue_modulus": args.residue_modulus, "n_clusters": args.clusters,
                "targets_per_context": args.targets_per_context, "key_tokens": defaults["key_tokens"],
                "value_tokens": defaults["value_tokens"], "local_window": args.local_window or defaults["local_window"],
                "seed": args.seed}
    return adapter, make_eval_set(adapter, vocab, args.protocol, args.stride, **settings)


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
