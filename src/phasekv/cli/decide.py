"""`phasekv decide --hf DIR [--gguf-file NAME] --set borderline|questions|code|FILE --compress none select:3 mean
--out OUT`: do meaning-preserving padding shifts change the model's decisions, periodically in S, under
compression?  Every flag is checked before the model is loaded; `--endpoint` is refused in one line (module
docstring of `phasekv.decisions.pipeline`, and the reason below)."""

from __future__ import annotations

from typing import Any

from phasekv.config import AUDIT_DEFAULTS, AuditPlan
from phasekv.decisions.sets import SHIPPED

PLAN = AuditPlan()
ENDPOINT_REFUSAL = ("--endpoint: phasekv decide needs the log-probability of every token of each continuation by "
                    "teacher forcing, and phasekv's endpoint client reads the top-k log-probabilities of generated "
                    "tokens only; use --hf with the same weights")


def add_parser(sub) -> None:
    from phasekv.conditions.grammar import compress_help

    p = sub.add_parser("decide", help="do meaning-preserving padding shifts change a compressed model's decisions?")
    p.add_argument("--hf", help="transformers causal LM: local directory (or hub name)")
    p.add_argument("--endpoint", help="a served model: refused (continuation log-probabilities are not available)")
    p.add_argument("--gguf-file", help="load this GGUF file inside --hf (needs the gguf extra: make real-model)")
    p.add_argument("--set", default="borderline", help=f"decision set: {', '.join(SHIPPED)}, or a YAML file")
    p.add_argument("--items", type=int, help="only the set's first N items")
    p.add_argument("--shifts", type=int, help="R padding shifts per item, a multiple of --stride (default S)")
    p.add_argument("--compress", nargs="+", default=["none", "select:3+keep-first:1", "mean+keep-first:1"],
                   metavar="COND", help=compress_help(("none", "select:3+keep-first:1", "mean+keep-first:1")))
    p.add_argument("--press", action="append", default=[], metavar="NAME[:k=v,...]",
                   help="a kvpress press as one more condition (repeatable; needs make kvpress)")
    p.add_argument("--window", type=int, default=PLAN.window, help="W: tokens per compressed entry")
    p.add_argument("--stride", type=int, default=AUDIT_DEFAULTS["stride"], help="S (phase = position mod S)")
    p.add_argument("--local-window", type=int, default=AUDIT_DEFAULTS["local_window"], help="the last tokens kept raw")
    p.add_argument("--minimum-pp", type=float, default=10.0, help="the smallest phase contrast called material")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--permutations", type=int, default=2000, help="permutations of each test")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="float32", help="torch dtype of the --hf model")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--out", required=True, help="output directory (summary.json, report.html, decisions.jsonl)")
    p.add_argument("--force", action="store_true", help="replace an existing non-empty --out")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run's journal")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args) -> dict[str, Any]:
    from phasekv.cli import check_positive
    from phasekv.conditions.grammar import Geometry
    from phasekv.decisions.pipeline import decide_hf

    if args.endpoint is not None:
        raise ValueError(ENDPOINT_REFUSAL)
    if args.hf is None:
        raise ValueError("--hf: give the model to audit (a transformers directory, or one with --gguf-file)")
    check_positive(args, "window", "stride", "local_window", "batch_size", "permutations")
    for name in ("items", "shifts"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name}: must be >= 1, got {getattr(args, name)}")
    if args.minimum_pp <= 0 or args.minimum_pp > 100:
        raise ValueError(f"--minimum-pp: must be in (0, 100], got {args.minimum_pp}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    conditions = (*args.compress, *(f"press:{name}" for name in args.press))
    options = {"gguf_file": args.gguf_file, "device": args.device, "dtype": args.dtype, "items": args.items,
               "batch_size": args.batch_size, "minimum_pp": args.minimum_pp, "n_perm": args.permutations,
               "seed": args.seed, "force": args.force, "resume": args.resume, "progress": not args.no_progress}
    summary = decide_hf(args.hf, args.set, args.out, conditions=conditions,
                        geometry=Geometry(args.window, args.stride, args.local_window), shifts=args.shifts,
                        options=options)
    for name, result in summary["conditions"].items():
        print(f"{name:>24}  {result['verdict']}")
    return summary
