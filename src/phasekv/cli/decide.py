"""`phasekv decide --hf DIR [--gguf-file NAME] --set borderline|questions|code|FILE --compress none select:3 mean
--out OUT`: do meaning-preserving padding shifts change the model's decisions, periodically in S, under
compression?  Or the model as an engine serves it: `--endpoint URL --api llamacpp|openai --tokenizer DIR`, or
`--launch llama-server|vllm` (phasekv starts the engine on --engine-model, or on --tokenizer's --gguf-file / folder),
each with `--reference-hf DIR` (the same weights in process: the agreement per phase).  Every flag is checked
before the model is loaded (`phasekv.decisions.pipeline`, `phasekv.decisions.served`)."""

from __future__ import annotations

import contextlib
from typing import Any

from phasekv.config import AUDIT_DEFAULTS, AuditPlan
from phasekv.decisions.sets import SHIPPED

PLAN = AuditPlan()
COMPRESS_DEFAULT = ["none", "select:3+keep-first:1", "mean+keep-first:1"]
# the flags only a served model (--endpoint, --launch) reads
SERVED_ONLY = ("api", "tokenizer", "model", "concurrency", "timeout", "reference_hf", "engine_bin", "engine_model",
               "engine_context")


def add_parser(sub) -> None:
    from phasekv.conditions.grammar import compress_help

    p = sub.add_parser("decide", help="do meaning-preserving padding shifts change a compressed model's decisions?")
    from phasekv.engines.registry import apis, launchers

    source = p.add_mutually_exclusive_group()
    source.add_argument("--hf", help="transformers causal LM: local directory (or hub name)")
    source.add_argument("--endpoint", metavar="URL", nargs="+", help="an engine serving the model (replicas: "
                                                                     "several URLs); only the condition none")
    source.add_argument("--launch", metavar="ENGINE", help=f"start this engine ({', '.join(launchers())}) on "
                                                           "--engine-model and audit it as --endpoint")
    p.add_argument("--gguf-file", help="load this GGUF file inside --hf (or --reference-hf, or the --tokenizer from "
                                       "it; needs the gguf extra: make real-model)")
    p.add_argument("--api", help=f"--endpoint: {', '.join(apis())} (default llamacpp; continuation scoring: "
                                 "llamacpp and openai/vLLM)")
    p.add_argument("--tokenizer", metavar="DIR", help="--endpoint, --launch: the served model's tokenizer")
    p.add_argument("--model", help="--endpoint: the served model's name (default: the one it serves)")
    p.add_argument("--concurrency", type=int, help="--endpoint: requests in flight per server (default 1)")
    p.add_argument("--timeout", type=float, help="--endpoint: seconds one request may take (default 600)")
    p.add_argument("--reference-hf", metavar="DIR", help="--endpoint, --launch: the same weights in transformers "
                                                         "(with --gguf-file): summary.json's comparison")
    p.add_argument("--engine-bin", metavar="PATH", help="--launch: the engine's binary (default: its install's)")
    p.add_argument("--engine-model", metavar="PATH", help="--launch: what the engine serves (default: --tokenizer's "
                                                          "--gguf-file, or the --tokenizer folder for vLLM)")
    p.add_argument("--engine-context", type=int, help="--launch: the engine's context in tokens (default 4096)")
    p.add_argument("--set", default="borderline", help=f"decision set: {', '.join(SHIPPED)}, or a YAML file")
    p.add_argument("--items", type=int, help="N items, a seeded sample stratified by the set's kinds (--seed)")
    p.add_argument("--shifts", type=int, help="R padding shifts per item, a multiple of --stride (default S)")
    p.add_argument("--compress", nargs="+", default=COMPRESS_DEFAULT, metavar="COND",
                   help=compress_help(tuple(COMPRESS_DEFAULT)) + " (--endpoint, --launch: none)")
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

    served = args.endpoint is not None or args.launch is not None
    if not served and args.hf is None:
        raise ValueError("--hf, --endpoint or --launch: give the model to audit")
    if not served:
        for name in SERVED_ONLY:
            if getattr(args, name) is not None:
                raise ValueError(f"--{name.replace('_', '-')}: applies to --endpoint or --launch only: drop it")
    check_positive(args, "window", "stride", "local_window", "batch_size", "permutations")
    for name in ("items", "shifts", "concurrency", "engine_context"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.minimum_pp <= 0 or args.minimum_pp > 100:
        raise ValueError(f"--minimum-pp: must be in (0, 100], got {args.minimum_pp}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    conditions = (*args.compress, *(f"press:{name}" for name in args.press))
    geometry = Geometry(args.window, args.stride, args.local_window)
    options = {"gguf_file": args.gguf_file, "device": args.device, "dtype": args.dtype, "items": args.items,
               "batch_size": args.batch_size, "minimum_pp": args.minimum_pp, "n_perm": args.permutations,
               "seed": args.seed, "force": args.force, "resume": args.resume, "progress": not args.no_progress}
    if served:
        summary = run_served(args, conditions, geometry, options)
    else:
        summary = decide_hf(args.hf, args.set, args.out, conditions=conditions, geometry=geometry,
                            shifts=args.shifts, options=options)
    for name, result in summary["conditions"].items():
        print(f"{name:>24}  {result['verdict']}")
    return summary


def run_served(args, conditions: tuple[str, ...], geometry, options: dict[str, Any]) -> dict[str, Any]:
    """--endpoint / --launch: every flag checked, then (--launch) the engine started for the run's length."""
    from pathlib import Path

    from phasekv.conditions.grammar import check_conditions, check_served
    from phasekv.decisions.prompts import check_shifts
    from phasekv.decisions.served import comparison_line, decide_endpoint, launched_endpoint
    from phasekv.decisions.sets import load_set
    from phasekv.engines.client import EndpointOptions, check_endpoint_options
    from phasekv.outputs import check_output_dir

    if args.compress == COMPRESS_DEFAULT and not args.press:
        conditions = ("none",)  # the default conditions are the in-process ones: a served model runs as it serves
    check_conditions(conditions, geometry)
    check_served(conditions)
    if args.tokenizer is None:
        raise ValueError("--endpoint, --launch: need --tokenizer DIR (the served model's tokenizer)")
    load_set(args.set)
    check_shifts(args.shifts or args.stride, args.stride)
    check_output_dir(Path(args.out), args.force)
    given = {k: getattr(args, k) for k in ("api", "concurrency", "timeout") if getattr(args, k) is not None}
    run = {**options, "reference_hf": args.reference_hf, "device": args.device, "dtype": args.dtype}
    with contextlib.ExitStack() as stack:
        if args.launch is not None:
            from phasekv.cli.audit import served_model
            from phasekv.engines.registry import launcher

            if "api" in given:
                raise ValueError("--api: --launch talks to the engine it starts in that engine's API: drop it")
            model = served_model(launcher(args.launch), args)
            url, api = stack.enter_context(launched_endpoint(args.launch, args.engine_bin, model,
                                                             args.engine_context or 4096))
            given["api"], endpoints = api, [url]
        else:
            endpoints = args.endpoint
        endpoint = EndpointOptions(endpoints[0], replicas=tuple(endpoints[1:]), tokenizer=args.tokenizer,
                                   gguf_file=args.gguf_file, model=args.model, **given)
        check_endpoint_options(endpoint)
        summary = decide_endpoint(endpoint, args.set, args.out, geometry=geometry, shifts=args.shifts, run=run)
    print(f"scoring: {summary['settings']['scoring']}")
    if "comparison" in summary:
        print(comparison_line(summary["comparison"]))
    return summary
