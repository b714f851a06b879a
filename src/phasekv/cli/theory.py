"""`phasekv theory --out DIR`: run the checks of docs/science.md section 5 and write figures and a JSON summary."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("theory", help="the idealized induction model: optimum, gradient flow, phase "
                                      "dependence (docs/science.md section 5)")
    p.add_argument("--out", required=True, help="directory for theory_summary.json and the figures")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smaller samples (under 30 s)")
    p.add_argument("--force", action="store_true", help="replace an existing non-empty --out")
    p.set_defaults(func=run)


def run(args) -> None:
    from phasekv.outputs import output_dir
    from phasekv.theory.run import run_theory

    with output_dir(args.out, args.force) as tmp:
        run_theory(tmp, seed=args.seed, quick=args.quick)
