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

from phasekv.cli import flags
from phasekv.cli.audit_fleet import config_of, dry_run, long_spec, print_verdicts, run_merge, run_sharded
from phasekv.cli.flags import (
    add_endpoint_arguments,
    add_launch_arguments,
    check_reference_model,
    check_source_flags,
    endpoint_options,
)
from phasekv.config import AUDIT_DEFAULTS, DEFAULT_CONDITIONS, EVAL_PROTOCOLS, PROTOCOLS, AuditPlan
from phasekv.data.formats import FORMATS
from phasekv.data.longcontext import PRESETS

HF_CONDITIONS = DEFAULT_CONDITIONS
PLAN = AuditPlan()


def add_parser(sub) -> None:  # long: every flag of the command, in its --help groups
    from phasekv.conditions.grammar import compress_help

    p = sub.add_parser("audit", help="is a real model's retrieval phase sensitive under chunk compression?")
    model = p.add_argument_group("source and model (one of --hf, --endpoint, --launch)")
    source = model.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", help="transformers causal LM: local directory (or hub name)")
    source.add_argument("--checkpoint", help="a phasekv checkpoint: with --context, --family records")
    model.add_argument("--gguf-file", help="load this GGUF file inside --hf, or the --tokenizer from it (needs the "
                                           "gguf extra: make real-model)")
    model.add_argument("--device", help="auto (default), cpu, cuda, cuda:N")
    model.add_argument("--dtype", help="torch dtype of the --hf model (default float32)")
    model.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    model.add_argument("--prefill-chunk", type=int, default=0, metavar="TOKENS", help="--hf: prefill TOKENS at a "
                       "time (memory: the KV cache plus one chunk; 0: the whole context at once)")
    prompts = p.add_argument_group("prompt set")
    prompts.add_argument("--format", default=AUDIT_DEFAULTS["format"],
                         help=f"prompt format: {', '.join(FORMATS)}, or a YAML file")
    prompts.add_argument("--chat", action="store_true", help="wrap the prompts in the tokenizer's chat template")
    prompts.add_argument("--protocol", nargs="+", choices=EVAL_PROTOCOLS, default=list(PROTOCOLS), metavar="NAME",
                         help="prompt protocols: prefix, insequence (default: both), query (the target fixed, the "
                              "prompt length varied: the query phase and its source x query phase cells)")
    prompts.add_argument("--preset", choices=sorted(PRESETS), help="a named long-context design: paper-niah = the "
                         "paper's needle test (131,072 tokens, 16,000 records, target at the middle, mod 8, 256 per "
                         "group)")
    prompts.add_argument("--context", type=int, metavar="TOKENS", help="a long-context set of prompts of TOKENS "
                         "tokens, records spread over the whole depth (instead of --format)")
    prompts.add_argument("--family", choices=("records", "needle"), default="needle", help="--context: records "
                         "alone, or records in prose (default)")
    prompts.add_argument("--depths", type=float, nargs="+", metavar="D", help="--context: target depths in [0, 1] "
                         "(default 0.5), a verdict per depth and the depth x phase map")
    prompts.add_argument("--records", type=int, default=AUDIT_DEFAULTS["records"], help="records per prompt")
    prompts.add_argument("--demos", type=int, default=AUDIT_DEFAULTS["demos"], help="demonstrations per prompt")
    size = prompts.add_mutually_exclusive_group()
    size.add_argument("--prompts-per-phase", type=int, default=PLAN.prompts_per_phase)
    size.add_argument("--target-mde", type=float, metavar="PP", help="choose the prompts per phase that detect a "
                      "PP-point single-phase gap 80%% of the time (docs/power.md); prints the choice and its cost")
    prompts.add_argument("--batch-size", type=int, default=AUDIT_DEFAULTS["batch_size"])
    prompts.add_argument("--seed", type=int, default=0)
    conditions = p.add_argument_group("conditions (in-process models)")
    conditions.add_argument("--compress", nargs="+", default=None, metavar="COND",
                            help=compress_help(HF_CONDITIONS) + " (--endpoint, --launch: none)")
    conditions.add_argument("--press", action="append", default=[], metavar="NAME[:k=v,...]",
                            help="a kvpress press as one more condition (repeatable; needs make kvpress): knorm, "
                                 "snapkv, streaming, expected-attention, tova, keydiff, or chunkkv, chunk, block over "
                                 "one of them (press=NAME), e.g. chunkkv:press=knorm,ratio=0.5,chunk=8")
    conditions.add_argument("--window", type=int, default=PLAN.window, help="W: tokens per compressed entry")
    conditions.add_argument("--stride", type=int, default=AUDIT_DEFAULTS["stride"],
                            help="S: a window starts every S tokens (phase = position mod S)")
    conditions.add_argument("--local-window", type=int, default=AUDIT_DEFAULTS["local_window"],
                            help="the last tokens kept raw")
    endpoint = p.add_argument_group("endpoint (a served model: --endpoint URL)")
    add_endpoint_arguments(endpoint, source)
    endpoint.add_argument("--shard", metavar="I/N", help="--endpoint: answer shard I of N of the prompt set (every "
                                                         "N-th prompt) and publish its answers; `phasekv audit merge "
                                                         "DIR...` joins the N shards into the audit")
    endpoint.add_argument("--reference-hf", metavar="DIR", help="--endpoint, --launch: the same weights in "
                                                                "transformers (with --gguf-file: that GGUF inside "
                                                                "DIR): comparison.json, the engine vs reference "
                                                                "agreement per source and query phase")
    add_launch_arguments(p.add_argument_group("engine grid (phasekv starts the engine: --launch ENGINE)"), source)
    gate_flags = p.add_argument_group("regression gate (--endpoint, --launch)")
    gate_flags.add_argument("--expect", metavar="FILE", help="exit status 3, one line per violated expectation "
                                                             "(verdict classes, agreement lower bounds, per-phase "
                                                             "accuracy intervals)")
    gate_flags.add_argument("--write-expect", metavar="FILE", help="write the expectations of this (trusted) run, "
                                                                   "for --expect")
    output = p.add_argument_group("output")
    output.add_argument("--out", required=True, help="output directory (report.html, summary.json, per-condition "
                                                     "runs)")
    output.add_argument("--eval-results", metavar="DIR", help="also the Hub's .eval_results/*.yaml and a model card")
    output.add_argument("--force", action="store_true", help="replace an existing non-empty --out")
    output.add_argument("--no-progress", action="store_true")
    output.add_argument("--dry-run", action="store_true", help="print the run's requests, prompt tokens and time "
                                                               "estimate, write nothing (an endpoint: its metadata "
                                                               "only with --tokens-per-s, else one timed probe)")
    output.add_argument("--tokens-per-s", type=float, metavar="RATE", help="--dry-run: one server's prefill "
                                                                           "throughput, for the time estimate")
    p.set_defaults(func=run)
    merge = sub.add_parser("audit-merge", help="phasekv audit merge DIR... --out OUT: join the --shard runs of one "
                                               "endpoint audit into its audit (no server needed)")
    merge.add_argument("shards", nargs="+", metavar="DIR", help="the output directories of the shards")
    merge.add_argument("--out", required=True)
    merge.add_argument("--force", action="store_true", help="replace an existing non-empty --out")
    merge.add_argument("--no-progress", action="store_true")
    merge.set_defaults(func=run_merge)


def check_flags(args, conditions: tuple[str, ...]) -> None:
    """Every flag, checked before anything is loaded (a GGUF model takes most of a minute): counts, the device, the
    format file, the conditions, and the prompt set's size against the memory available now."""
    from phasekv.cli import check_positive
    from phasekv.cli.flags import check_prompt_count
    from phasekv.conditions.grammar import Geometry, check_conditions, check_served
    from phasekv.data.formats import load_format
    from phasekv.distributed import resolve_device

    check_positive(args, "window", "stride", "records", "prompts_per_phase", "batch_size", "local_window")
    for name in ("demos", "seed", "threads", "prefill_chunk"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 0, got {getattr(args, name)}")
    if args.records < args.demos + 1:
        raise ValueError(f"--records: {args.records} records cannot hold a target and {args.demos} demonstrations "
                         "of other records (--demos)")
    check_source_flags(args)
    if args.checkpoint is not None and (args.context is None or conditions != ("none",)):
        raise ValueError("--checkpoint: a phasekv checkpoint compresses in its own layers and has its own vocabulary: "
                         "audit it on a long-context set (--context TOKENS --family records) under condition none")
    if args.engine_checks and not args.launch:
        raise ValueError("--engine-checks: applies to --launch (phasekv starts the engine); a phasekv checkpoint's "
                         "own decode path: phasekv eval --checkpoint DIR --engine-checks decode")
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
    from phasekv.auditing.pipeline import checkpoint_subject, run_audit
    from phasekv.cli.flags import apply_target_mde
    from phasekv.engines.client import check_reference, open_endpoint
    from phasekv.outputs import check_output_dir

    own = args.endpoint or args.launch or args.checkpoint  # compressed by the engine or the model itself
    conditions = (*(args.compress or (("none",) if own else HF_CONDITIONS)),
                  *(f"press:{name}" for name in args.press))
    apply_target_mde(args, len(conditions))
    check_flags(args, conditions)
    expected = check_gate_flags(args)
    if args.dry_run:
        return dry_run(args, conditions)
    if args.shard is not None:
        return run_sharded(args)
    if args.launch:
        return gate(args, expected, run_launched(args))
    check_output_dir(Path(args.out), args.force, args.resume)  # before loading anything
    flags.check_eval_results(args)
    device, dtype = args.device or "auto", args.dtype or "float32"
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    check_reference(args.endpoint is not None, args.reference_hf)
    cfg = config_of(args)
    plan = AuditPlan(conditions, args.window, tuple(dict.fromkeys(args.protocol)), args.prompts_per_phase)
    reference = reference_tokenizer = None
    if args.reference_hf is not None:
        reference, reference_tokenizer = load_hf(args.reference_hf, device, dtype, gguf_file=args.gguf_file)
    spec = long_spec(args)
    if args.endpoint is not None:
        adapter, tokenizer = open_endpoint(endpoint_options(args), args.out, args.force)
    elif args.checkpoint is not None:
        adapter, tokenizer, spec = checkpoint_subject(args.checkpoint, spec)
    else:
        adapter, tokenizer = load_hf(args.hf, device, dtype, gguf_file=args.gguf_file, prefill_chunk=args.prefill_chunk)
    try:
        if reference is not None:
            check_reference_model(args, reference_tokenizer, tokenizer)
        summary = run_audit(adapter, tokenizer, cfg, args.out, plan=plan, force=args.force,
                            progress=not args.no_progress, reference=reference, long_context=spec)
    finally:
        if args.endpoint is not None:
            adapter.close()
    print_verdicts(summary)
    if args.eval_results:
        from phasekv.api.publish import write_eval_results

        write_eval_results(summary, args.eval_results, force=args.force, figures_from=args.out)
    for protocol, comparison in summary.get("comparison", {}).items():
        overall = comparison["overall"]
        print(f"{'engine vs reference':>24}  {protocol}: {overall['agree']}/{overall['n']} greedy tokens agree "
              f"({100 * overall['agreement']:.1f}% [{100 * overall['ci_low']:.1f}, {100 * overall['ci_high']:.1f}])")
    return gate(args, expected, summary)


def check_gate_flags(args) -> dict[str, Any] | None:
    """--expect's file, read and checked before anything runs (None without it); --write-expect's directory."""
    from phasekv.auditing.expect import load_expectations

    if (args.expect or args.write_expect) and not (args.endpoint or args.launch):
        raise ValueError("--expect/--write-expect: gate a served model: need --endpoint or --launch")
    if args.write_expect:
        target = Path(args.write_expect)
        if target.is_dir() or not target.absolute().parent.is_dir():
            raise ValueError(f"--write-expect {target}: must be a file in an existing directory")
    return load_expectations(args.expect) if args.expect else None


def gate(args, expected: dict[str, Any] | None, summary: dict[str, Any]) -> dict[str, Any]:
    """Write this run's expectations (--write-expect), then hold it to the given ones (--expect: GateFailed)."""
    from phasekv.auditing.expect import check_expectations, write_expectations
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


# ---------------------------------------------------------------------------------------------- --launch


def grid_of(args):
    """The EngineGrid the flags describe (checked: the engine, its binary, the model file, every grid value)."""
    from phasekv.auditing.engine_grid import EngineGrid
    from phasekv.engines.base import parse_grid
    from phasekv.engines.registry import default_binary, launcher

    engine = launcher(args.launch)
    points = parse_grid(engine, args.engine_grid)
    binary = Path(args.engine_bin) if args.engine_bin else default_binary(engine)
    if not binary.is_file():
        raise ValueError(f"--engine-bin {binary}: no such file ({engine.install})")
    model = served_model(engine, args)
    if args.tokenizer is None:
        raise ValueError("--launch: needs --tokenizer DIR (the served model's tokenizer)")
    if args.timeout is not None and (isinstance(args.timeout, bool) or not args.timeout > 0
                                     or args.timeout == float("inf")):
        raise ValueError(f"--timeout: must be a finite number of seconds > 0, got {args.timeout}")
    for name in ("engine_context", "decode_steps", "batch_width"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.check_prompts < 0:
        raise ValueError(f"--check-prompts: must be >= 0, got {args.check_prompts}")
    if "decode" in args.engine_checks and args.reference_hf is None:
        raise ValueError("--engine-checks decode: compares with the reference: needs --reference-hf")
    slots = args.batch_width if "batch" in args.engine_checks else 1
    for point in points:
        engine.limits(point, context=args.engine_context * slots, slots=slots)
    return EngineGrid(engine, binary, model, tuple(points), context=args.engine_context * slots, slots=slots,
                      reuse_prefix=args.reuse_prefix, **({} if args.timeout is None else {"timeout": args.timeout}))


def served_model(engine, args) -> Path:
    """What the engine serves: --engine-model, else llama-server's --tokenizer/--gguf-file, vLLM's --tokenizer DIR
    (a safetensors folder is its own tokenizer); a file or a folder as the engine needs."""
    folder = engine.serves == "folder"
    if args.engine_model:
        model = Path(args.engine_model)
    elif folder and args.tokenizer and not args.gguf_file:
        model = Path(args.tokenizer)
    elif not folder and args.tokenizer and args.gguf_file:
        model = Path(args.tokenizer) / args.gguf_file
    elif folder:
        raise ValueError(f"--launch {engine.name}: serves a model folder (safetensors): needs --engine-model DIR or "
                         "--tokenizer DIR without --gguf-file")
    else:
        raise ValueError("--launch: needs --engine-model FILE (the file the engine serves) or --tokenizer DIR with "
                         "--gguf-file NAME")
    if folder and not (model / "config.json").is_file():
        raise ValueError(f"--engine-model {model}: not a model folder (no config.json); {engine.name} serves "
                         "safetensors folders")
    if not folder and not model.is_file():
        raise ValueError(f"--engine-model {model}: no such file")
    return model


def checks_of(args) -> dict:
    """The per-point checks --engine-checks names, in the order of the grid's table."""
    from phasekv.auditing.decode import decode_check
    from phasekv.auditing.engine_paths import paths_check

    limit = args.check_prompts or None
    made = {"decode": lambda: decode_check(args.decode_steps, limit),
            "prefix": lambda: paths_check("prefix", limit=limit),
            "batch": lambda: paths_check("batch", args.batch_width, limit)}
    return {name: made[name]() for name in ("decode", "prefix", "batch") if name in args.engine_checks}


def run_launched(args) -> dict[str, Any]:
    from phasekv.adapters.hf import load_hf, load_tokenizer
    from phasekv.auditing.engine_grid import run_grid
    from phasekv.outputs import check_output_dir

    grid = grid_of(args)
    check_output_dir(Path(args.out), args.force, args.resume)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    cfg = config_of(args)
    tokenizer = load_tokenizer(args.tokenizer, args.gguf_file, flag="--tokenizer")
    reference = None
    if args.reference_hf is not None:
        reference, reference_tokenizer = load_hf(args.reference_hf, args.device or "auto", args.dtype or "float32",
                                                 gguf_file=args.gguf_file)
        check_reference_model(args, reference_tokenizer, tokenizer, served=str(grid.model))
    summary = run_grid(grid, tokenizer, cfg, args.out, protocols=tuple(dict.fromkeys(args.protocol)),
                       per_phase=args.prompts_per_phase, reference=reference, checks=checks_of(args), force=args.force,
                       resume=args.resume, progress=not args.no_progress)
    for row in summary["rows"]:
        if "failed" in row:
            print(f"{row['point']:>40}  {row['protocol']}: failed: {row['failed']}")
            continue
        line = f"{row['point']:>40}  {row['protocol']}: {100 * row['accuracy']:.1f}%, {row['verdict']}"
        if "query_verdict" in row:
            line += f"; query phase: {row['query_verdict']}"
        if "agree" in row:
            line += f"; {row['agree']}/{row['n']} greedy tokens agree with the reference"
        for check in ("decode", "prefix", "batch"):
            if f"{check}_agreement" in row:
                line += f"; {check}: {100 * row[f'{check}_agreement']:.1f}% of {row[f'{check}_n']} agree"
        print(line)
    failed = [row for row in summary["rows"] if "failed" in row]
    if summary["rows"] and len(failed) == len(summary["rows"]):  # a dead engine is no passing gate
        raise ValueError(f"--launch: every grid point failed, nothing was audited ({args.out} records why); the "
                         f"first: {failed[0]['failed']}")
    return summary
