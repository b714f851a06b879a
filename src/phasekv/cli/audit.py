"""`phasekv audit --hf DIR [--gguf-file NAME] --format records --compress none select:3 mean --out OUT`, or the
model as an inference engine serves it: `phasekv audit --endpoint URL --api llamacpp|openai|sglang --tokenizer DIR
[--gguf-file NAME] [--concurrency N] [--reuse-prefix] [--resume] [--reference-hf DIR] --out OUT` (the engine's own
compression is what is audited, so only the condition `none` applies; answers are journaled as they arrive and the
journal is published inside OUT; --reference-hf compares them with the same weights in transformers).  `--protocol
prefix insequence query` chooses the prompt protocols (query: the query phase).  Every flag, the format file and the
prompt set's size are checked before anything is loaded (`check_flags`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from phasekv.cli.flags import add_endpoint_arguments, add_launch_arguments, check_source_flags, endpoint_options
from phasekv.config import AUDIT_DEFAULTS, DEFAULT_CONDITIONS, EVAL_PROTOCOLS, PROTOCOLS, AuditPlan
from phasekv.data.formats import FORMATS

HF_CONDITIONS = DEFAULT_CONDITIONS
PLAN = AuditPlan()


def add_parser(sub) -> None:
    p = sub.add_parser("audit", help="is a real model's retrieval phase sensitive under chunk compression?")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", help="transformers causal LM: local directory (or hub name)")
    add_endpoint_arguments(p, source)
    add_launch_arguments(p, source)
    p.add_argument("--gguf-file", help="load this GGUF file inside --hf, or the --tokenizer from it (needs the gguf "
                                       "extra: make real-model)")
    p.add_argument("--format", default=AUDIT_DEFAULTS["format"],
                   help=f"prompt format: {', '.join(FORMATS)}, or a YAML file")
    p.add_argument("--chat", action="store_true", help="wrap the prompts in the tokenizer's chat template")
    p.add_argument("--protocol", nargs="+", choices=EVAL_PROTOCOLS, default=list(PROTOCOLS), metavar="NAME",
                   help="prompt protocols: prefix, insequence (default: both), query (the target fixed, the prompt "
                        "length varied: the query phase and its source x query phase cells)")
    p.add_argument("--reference-hf", metavar="DIR", help="--endpoint: the same weights in transformers (with "
                                                         "--gguf-file: that GGUF inside DIR): comparison.json, the "
                                                         "engine vs reference agreement per source and query phase")
    p.add_argument("--compress", nargs="+", default=None, metavar="COND",
                   help="conditions: none, select:r, mean, max-norm, each optionally +keep-first:n (the attention "
                        "sink); kpool:pool=P,top=K|budget=F[,local=L,sink=N,heads=shared|kv,indexer=oracle|mean|max|"
                        "distilled:DIR,grid=fixed|stagger|jitter,seed=S] (query-dependent pooled selection); "
                        "slices:kind=contiguous|interleaved[,size=L,"
                        "shift=fixed|layer|random,group=kv|query,local=N,sink=N] (head-partitioned history); "
                        "stagger:select:r, jitter:select:r (post-hoc grid per KV head / per request); "
                        "default: " + " ".join(HF_CONDITIONS) +
                        "; none only with --endpoint")
    p.add_argument("--press", action="append", default=[], metavar="NAME[:k=v,...]",
                   help="a kvpress press as one more condition (repeatable; needs make kvpress): knorm, snapkv, "
                        "streaming, expected-attention, tova, keydiff, or chunkkv, chunk, block over one of them "
                        "(press=NAME), e.g. chunkkv:press=knorm,ratio=0.5,chunk=8")
    p.add_argument("--window", type=int, default=PLAN.window, help="W: tokens per compressed entry")
    p.add_argument("--stride", type=int, default=AUDIT_DEFAULTS["stride"],
                   help="S: a window starts every S tokens (phase = position mod S)")
    p.add_argument("--local-window", type=int, default=AUDIT_DEFAULTS["local_window"], help="the last tokens kept raw")
    p.add_argument("--records", type=int, default=AUDIT_DEFAULTS["records"], help="records per prompt")
    p.add_argument("--demos", type=int, default=AUDIT_DEFAULTS["demos"], help="demonstrations per prompt")
    p.add_argument("--prompts-per-phase", type=int, default=PLAN.prompts_per_phase)
    p.add_argument("--batch-size", type=int, default=AUDIT_DEFAULTS["batch_size"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--dtype", help="torch dtype of the --hf model (default float32)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--expect", metavar="FILE", help="--endpoint/--launch: a regression gate: exit status 3, one line "
                                                    "per violated expectation (verdict classes, agreement lower "
                                                    "bounds, per-phase accuracy intervals)")
    p.add_argument("--write-expect", metavar="FILE", help="--endpoint/--launch: write the expectations of this "
                                                          "(trusted) run, for --expect")
    p.add_argument("--out", required=True, help="output directory (report.html, summary.json, per-condition runs)")
    p.add_argument("--force", action="store_true", help="replace an existing non-empty --out")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def check_flags(args, conditions: tuple[str, ...]) -> None:
    """Every flag, checked before anything is loaded (a GGUF model takes most of a minute): counts, the device, the
    format file, the conditions, and the prompt set's size against the memory available now."""
    from phasekv.cli import check_positive
    from phasekv.cli.flags import check_prompt_count
    from phasekv.conditions.grammar import Geometry, check_conditions, check_served
    from phasekv.data.formats import load_format
    from phasekv.distributed import resolve_device

    check_positive(args, "window", "stride", "records", "prompts_per_phase", "batch_size", "local_window")
    for name in ("demos", "seed", "threads"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name}: must be >= 0, got {getattr(args, name)}")
    if args.records < args.demos + 1:
        raise ValueError(f"--records: {args.records} records cannot hold a target and {args.demos} demonstrations "
                         "of other records (--demos)")
    check_source_flags(args)
    if args.endpoint is None:
        resolve_device(args.device or "auto")
    if not (args.launch and args.format == "none"):  # --launch: `none` is the tokenizer's own words
        load_format(args.format, args.chat)
    check_conditions(conditions, Geometry(args.window, args.stride, args.local_window))
    if args.endpoint is not None or args.launch:
        check_served(conditions)
    padding = sum(p in PROTOCOLS for p in set(getattr(args, "protocol", PROTOCOLS))) or 1  # query: its own count
    check_prompt_count(args.prompts_per_phase * args.stride * padding, "--prompts-per-phase")


def run(args) -> dict[str, Any]:
    from phasekv.adapters.hf import load_hf
    from phasekv.audit.pipeline import run_audit
    from phasekv.config import audit_config
    from phasekv.engines.client import check_reference, open_endpoint
    from phasekv.outputs import check_output_dir

    conditions = (*(args.compress or (("none",) if args.endpoint or args.launch else HF_CONDITIONS)),
                  *(f"press:{name}" for name in args.press))
    check_flags(args, conditions)
    expected = check_gate_flags(args)
    if args.launch:
        from phasekv.cli.engine_grid import run_launched

        return gate(args, expected, run_launched(args))
    check_output_dir(Path(args.out), args.force)  # before loading anything
    device, dtype = args.device or "auto", args.dtype or "float32"
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    check_reference(args.endpoint is not None, args.reference_hf)
    cfg = audit_config(format=args.format, chat=args.chat, records=args.records, demos=args.demos, stride=args.stride,
                       local_window=args.local_window, batch_size=args.batch_size, seed=args.seed, device=device,
                       dtype=dtype, threads=args.threads, gguf_file=args.gguf_file)
    plan = AuditPlan(conditions, args.window, tuple(dict.fromkeys(args.protocol)), args.prompts_per_phase)
    reference = None
    if args.reference_hf is not None:
        reference, _ = load_hf(args.reference_hf, device, dtype, gguf_file=args.gguf_file)
    if args.endpoint is not None:
        adapter, tokenizer = open_endpoint(endpoint_options(args), args.out, args.force)
    else:
        adapter, tokenizer = load_hf(args.hf, device, dtype, gguf_file=args.gguf_file)
    try:
        summary = run_audit(adapter, tokenizer, cfg, args.out, plan=plan, force=args.force,
                            progress=not args.no_progress, reference=reference)
    finally:
        if args.endpoint is not None:
            adapter.close()
    for name, result in summary["conditions"].items():
        for protocol in summary["settings"]["protocols"]:
            print(f"{name:>24}  {protocol}: {result[protocol]['verdict']}")
            if protocol == "query":
                print(f"{name:>24}  query phase: {result[protocol]['query_phase']['verdict']}")
    for protocol, comparison in summary.get("comparison", {}).items():
        overall = comparison["overall"]
        print(f"{'engine vs reference':>24}  {protocol}: {overall['agree']}/{overall['n']} greedy tokens agree "
              f"({100 * overall['agreement']:.1f}% [{100 * overall['ci_low']:.1f}, {100 * overall['ci_high']:.1f}])")
    return gate(args, expected, summary)


def check_gate_flags(args) -> dict[str, Any] | None:
    """--expect's file, read and checked before anything runs (None without it); --write-expect's directory."""
    from phasekv.audit.expect import load_expectations

    if (args.expect or args.write_expect) and not (args.endpoint or args.launch):
        raise ValueError("--expect/--write-expect: gate a served model: need --endpoint or --launch")
    if args.write_expect:
        target = Path(args.write_expect)
        if target.is_dir() or not target.absolute().parent.is_dir():
            raise ValueError(f"--write-expect {target}: must be a file in an existing directory")
    return load_expectations(args.expect) if args.expect else None


def gate(args, expected: dict[str, Any] | None, summary: dict[str, Any]) -> dict[str, Any]:
    """Write this run's expectations (--write-expect), then hold it to the given ones (--expect: GateFailed)."""
    from phasekv.audit.expect import check_expectations, write_expectations
    from phasekv.cli import GateFailed
    from phasekv.outputs import write_json

    if args.write_expect:
        write_json(Path(args.write_expect), write_expectations(summary), atomic=True)
    if expected is not None:
        lines = check_expectations(expected, summary)
        if lines:
            raise GateFailed(lines)
        print(f"expectations of {args.expect}: all hold")
    return summary
