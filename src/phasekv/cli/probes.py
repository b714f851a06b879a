"""`phasekv knockout | gates | cycle`: the mechanistic probes (PAPER.md section 4) from the command line.

    phasekv knockout --checkpoint DIR --protocol prefix --out OUT [--whole-layer] [--calib-prompts 256]
    phasekv knockout --hf PATH --stride 4 --protocol prefix --out OUT --whole-layer
    phasekv gates --checkpoint RUN_DIR --out OUT [--prompts 64] [--top 4] [--trajectory]
    phasekv cycle --checkpoint DIR --protocol prefix --out OUT [--deltas -3 -2 -1 0 1 2 3]
    phasekv grid --checkpoint DIR --protocol prefix --out OUT      (every window-grid shift r = 0..S-1)

Prompt sets are those of `phasekv eval` (same flags and defaults; --clusters makes them smaller).
Each command builds its --out directory aside and publishes it when complete.
"""

from __future__ import annotations

from typing import Any

from phasekv.cli.evaluate import add_prompt_arguments, add_source_arguments, source_and_config


def add_parser(sub) -> None:
    k = sub.add_parser("knockout", help="mean-replacement knockout of each KV head (or layer), by phase")
    add_source_arguments(k, "transformers Qwen3/Llama-style causal LM: local directory or hub name")
    add_prompt_arguments(k)
    k.add_argument("--whole-layer", action="store_true", help="knock out all heads of a layer at once")
    k.add_argument("--calib-prompts", type=int, default=256, help="calibration prompts N_cal")
    k.add_argument("--calib-seed", type=int, help="seed of the calibration set (default: --seed + 1)")
    k.set_defaults(func=knockout)

    g = sub.add_parser("gates", help="gate concentration and profiles of the compressed layers")
    g.add_argument("--checkpoint", required=True, help="phasekv checkpoint or run directory")
    add_prompt_arguments(g)
    g.add_argument("--prompts", type=int, default=64, help="lookup prompts whose windows are pooled")
    g.add_argument("--top", type=int, default=4, help="heads shown in gate_profiles.png")
    g.add_argument("--trajectory", action="store_true",
                   help="also the trajectory over the run's gate snapshots (--checkpoint must be the run directory)")
    g.set_defaults(func=gates)

    c = sub.add_parser("cycle", help="cycle the gates by delta (W = S models) and compare to the prediction")
    c.add_argument("--checkpoint", required=True, help="phasekv checkpoint or run directory")
    add_prompt_arguments(c)
    c.add_argument("--deltas", type=int, nargs="+", default=list(range(-3, 4)), help="offsets delta to cycle by")
    c.set_defaults(func=cycle)

    r = sub.add_parser("grid", help="evaluate with the window grid shifted by each r = 0..S-1 (a randomized grid)")
    r.add_argument("--checkpoint", required=True, help="phasekv checkpoint or run directory")
    add_prompt_arguments(r)
    r.set_defaults(func=grid)


def _positive(args, *names: str) -> None:
    for name in names:
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {value}")


def knockout(args) -> dict[str, Any]:
    from phasekv.outputs import output_dir
    from phasekv.probes.knockout import run_knockout_on

    _positive(args, "calib_prompts")
    source, cfg = source_and_config(args)
    with output_dir(args.out, args.force) as tmp:
        return run_knockout_on(source, cfg, tmp, args.whole_layer, args.calib_prompts, args.calib_seed,
                               not args.no_progress)


def gates(args) -> dict[str, Any]:
    from phasekv.outputs import output_dir
    from phasekv.probes.gates import gates_on

    _positive(args, "prompts", "top")
    source, cfg = source_and_config(args)
    with output_dir(args.out, args.force) as tmp:
        return gates_on(source, cfg, tmp, args.prompts, args.top, args.trajectory, not args.no_progress)


def cycle(args) -> dict[str, Any]:
    from phasekv.outputs import output_dir
    from phasekv.probes.cycle import cycling_on

    source, cfg = source_and_config(args)
    with output_dir(args.out, args.force) as tmp:
        return cycling_on(source, cfg, tmp, args.deltas, not args.no_progress)



def grid(args) -> dict[str, Any]:
    from phasekv.outputs import output_dir
    from phasekv.probes.grid import grid_on

    source, cfg = source_and_config(args)
    with output_dir(args.out, args.force) as tmp:
        return grid_on(source, cfg, tmp, not args.no_progress)
