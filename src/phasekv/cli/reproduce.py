"""`phasekv reproduce --out DIR`: every analysis on the bundled checkpoints, summary.json and report.html."""

from __future__ import annotations

import sys
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("reproduce", help="run every analysis on the bundled checkpoints and write report.html")
    p.add_argument("--out", required=True, help="output directory (summary.json, report.html, figures)")
    p.add_argument("--force", action="store_true", help="replace an existing non-empty --out")
    p.add_argument("--checkpoints", default="checkpoints", help="directory of bundled checkpoints")
    p.add_argument("--models", nargs="+", help="only these models (directory names)")
    p.add_argument("--train", action="store_true", help="first retrain every model from configs/cpu presets "
                                                        "(runs kept in OUT/train/, resumed if interrupted)")
    p.add_argument("--configs", default="configs/cpu", help="preset directory used by --train")
    p.add_argument("--bundle", help="with --train: store compact copies of the trained models here")
    p.add_argument("--quick", action="store_true", help="smaller prompt sets (for tests; intervals get wider)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2, help="models analysed in parallel processes (1 thread each)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args) -> None:
    from phasekv.report.claims import count_line
    from phasekv.report.reasons import reason_text
    from phasekv.report.reproduce import reproduce

    if args.jobs < 1:
        raise ValueError(f"--jobs: must be >= 1, got {args.jobs}")
    summary = reproduce(args.out, args.checkpoints, args.models, args.train, args.configs, args.bundle,
                        quick=args.quick, seed=args.seed, progress=not args.no_progress, jobs=args.jobs,
                        force=args.force)
    sys.stdout.write(f"{count_line(summary['findings'])}; report: {Path(args.out) / 'report.html'}\n")
    for f in summary["findings"]:
        if f["status"] in ("fails", "inconclusive"):
            sys.stdout.write(f"  {f['status']}: {f['claim']}: {f['measured']}\n")
            if f.get("reason"):
                sys.stdout.write(f"    why: {reason_text(f)}\n")
