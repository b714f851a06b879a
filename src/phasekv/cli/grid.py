"""`phasekv grid`: evaluation with every compressor's window grid shifted by each r = 0..S-1.

    phasekv grid --checkpoint DIR --protocol prefix --out OUT

The prompt set is that of `phasekv eval` (same flags and defaults; --clusters makes it smaller); the
per-phase curves of the S shifts are averaged into the curve of a grid drawn at random per prompt
(`phasekv.probes.grid`).  The --out directory is built aside and published when complete.
"""

from __future__ import annotations

from typing import Any

from phasekv.cli.flags import add_prompt_arguments, source_and_config


def add_parser(sub) -> None:
    r = sub.add_parser("grid", help="evaluate with the window grid shifted by each r = 0..S-1 (a randomized grid)")
    r.add_argument("--checkpoint", required=True, help="phasekv checkpoint or run directory")
    add_prompt_arguments(r)
    r.set_defaults(func=run)


def run(args) -> dict[str, Any]:
    from phasekv.outputs import output_dir
    from phasekv.probes.grid import grid_on

    source, cfg = source_and_config(args)
    with output_dir(args.out, args.force) as tmp:
        return grid_on(source, cfg, tmp, not args.no_progress)
