"""`phasekv knockout`: mean-replacement knockout of each KV head (or layer), by phase (docs/science.md section 4).

    phasekv knockout --checkpoint DIR --protocol prefix --out OUT [--whole-layer] [--calib-prompts 256]
    phasekv knockout --hf PATH --stride 4 --protocol prefix --out OUT --whole-layer

The prompt set is that of `phasekv eval` (same flags and defaults; --clusters makes it smaller).
The --out directory is built aside and published when complete.
"""

from __future__ import annotations

from typing import Any

from phasekv.cli import check_positive
from phasekv.cli.flags import add_prompt_arguments, add_source_arguments, source_and_config


def add_parser(sub) -> None:
    k = sub.add_parser("knockout", help="mean-replacement knockout of each KV head (or layer), by phase")
    add_source_arguments(k, "transformers Qwen3/Llama-style causal LM: local directory or hub name")
    add_prompt_arguments(k)
    k.add_argument("--whole-layer", action="store_true", help="knock out all heads of a layer at once")
    k.add_argument("--calib-prompts", type=int, default=256, help="calibration prompts N_cal")
    k.add_argument("--calib-seed", type=int, help="seed of the calibration set (default: --seed + 1)")
    k.set_defaults(func=run)


def run(args) -> dict[str, Any]:
    from phasekv.outputs import output_dir
    from phasekv.probes.knockout import run_knockout_on

    check_positive(args, "calib_prompts")
    source, cfg = source_and_config(args)
    with output_dir(args.out, args.force) as tmp:
        return run_knockout_on(source, cfg, tmp, whole_layer=args.whole_layer, calib_prompts=args.calib_prompts,
                               calib_seed=args.calib_seed, progress=not args.no_progress)
