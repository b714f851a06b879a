"""`phasekv theory --out DIR`: run the checks of PAPER.md section 5 and write figures and a JSON summary."""

from __future__ import annotations

import argparse


def _run(args: argparse.Namespace) -> None:
    from phasekv.theory.run import run_theory

    run_theory(args.out, seed=args.seed, quick=args.quick)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("theory", help="the idealized induction model: optimum, gradient flow, phase "
                                             "dependence (PAPER.md section 5)")
    p.add_argument("--out", required=True, help="directory for theory_summary.json and the figures")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="smaller samples (under 30 s)")
    p.set_defaults(func=_run)
    return p
