"""`phasekv cycle`: gate cycling of W = S compressors against its prediction (docs/science.md section 4).

    phasekv cycle --checkpoint DIR --protocol prefix --out OUT [--deltas -3 -2 -1 0 1 2 3]

The prompt set is that of `phasekv eval` (same flags and defaults; --clusters makes it smaller).
The --out directory is built aside and published when complete.
"""

from __future__ import annotations

from typing import Any

from phasekv.cli.flags import add_prompt_arguments, source_and_config


def add_parser(sub) -> None:
    c = sub.add_parser("cycle", help="cycle the gates by delta (W = S models) and compare to the prediction")
    c.add_argument("--checkpoint", required=True, help="phasekv checkpoint or run directory")
    add_prompt_arguments(c)
    c.add_argument("--deltas", type=int, nargs="+", default=list(range(-3, 4)), help="offsets delta to cycle by")
    c.set_defaults(func=run)


def run(args) -> dict[str, Any]:
    from phasekv.outputs import output_dir
    from phasekv.probes.cycle import cycling_on

    source, cfg = source_and_config(args)
    with output_dir(args.out, args.force) as tmp:
        return cycling_on(source, cfg, tmp, args.deltas, not args.no_progress)
