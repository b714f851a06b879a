"""`phasekv gates`: gate concentration and profiles of the compressed layers (docs/science.md section 4).

    phasekv gates --checkpoint RUN_DIR --out OUT [--prompts 64] [--top 4] [--trajectory]

The prompts are lookup prompts of `phasekv eval`'s prompt set (same flags and defaults).
The --out directory is built aside and published when complete.
"""

from __future__ import annotations

from typing import Any

from phasekv.cli import check_positive
from phasekv.cli.flags import add_prompt_arguments, source_and_config


def add_parser(sub) -> None:
    g = sub.add_parser("gates", help="gate concentration and profiles of the compressed layers")
    g.add_argument("--checkpoint", required=True, help="phasekv checkpoint or run directory")
    add_prompt_arguments(g)
    g.add_argument("--prompts", type=int, default=64, help="lookup prompts whose windows are pooled")
    g.add_argument("--top", type=int, default=4, help="heads shown in gate_profiles.png")
    g.add_argument("--trajectory", action="store_true",
                   help="also the trajectory over the run's gate snapshots (--checkpoint must be the run directory)")
    g.set_defaults(func=run)


def run(args) -> dict[str, Any]:
    from phasekv.outputs import output_dir
    from phasekv.probes.gates import gates_on

    check_positive(args, "prompts", "top")
    source, cfg = source_and_config(args)
    with output_dir(args.out, args.force) as tmp:
        return gates_on(source, cfg, tmp, n_prompts=args.prompts, top=args.top, trajectory=args.trajectory,
                        progress=not args.no_progress)
