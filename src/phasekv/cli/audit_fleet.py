"""The audit's runs that span machines and money: `--dry-run` (what a run will cost, from the servers' metadata
alone), `--shard I/N` (one machine's part of an endpoint audit) and `phasekv audit merge` (the shards joined), with
the prompt-set and config flags they share with `phasekv audit` (cli/audit.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from phasekv.cli.flags import endpoint_options
from phasekv.config import AuditPlan
from phasekv.data.longcontext import PRESETS


def run_merge(args) -> dict[str, Any]:
    from phasekv.auditing.shards import merge_shards
    from phasekv.outputs import check_output_dir

    for shard in args.shards:
        out, given = Path(args.out).resolve(), Path(shard).resolve()
        if out == given or given in out.parents or out in given.parents:
            raise ValueError(f"--out {args.out}: is, holds or lies inside the shard {shard}; choose another --out")
    check_output_dir(Path(args.out), args.force)
    summary = merge_shards(args.shards, args.out, force=args.force, progress=not args.no_progress)
    print_verdicts(summary)
    return summary


def print_verdicts(summary: dict[str, Any]) -> None:
    for name, result in summary["conditions"].items():
        for protocol in summary["settings"]["protocols"]:
            print(f"{name:>24}  {protocol}: {result[protocol]['verdict']}")
            if protocol == "query":
                print(f"{name:>24}  query phase: {result[protocol]['query_phase']['verdict']}")
    if summary.get("family_wise"):
        print(f"{'all verdicts':>24}  {summary['family_wise']}")


def long_spec(args):
    """The long-context design --preset or --context describe (None for a --format prompt set)."""
    import dataclasses

    from phasekv.data.longcontext import LongContextSpec

    if args.preset and args.context:
        raise ValueError("--preset and --context: give one (the preset fixes the context)")
    if args.preset:
        return dataclasses.replace(PRESETS[args.preset], seed=args.seed)
    if args.context is None:
        if args.depths:
            raise ValueError("--depths: applies to a long-context set: give --context TOKENS or --preset")
        return None
    R = args.stride  # every residue group holds a multiple of R prompts per depth and cluster offset
    per_group = -(-args.prompts_per_phase // (R * R)) * R * R
    return LongContextSpec(family=args.family, context=args.context, stride=args.stride,
                           depths=tuple(args.depths or (0.5,)), per_group=per_group,
                           local_window=args.local_window, seed=args.seed)


def config_of(args):
    """The EvalConfig of the audit's prompt-set and run flags."""
    from phasekv.config import audit_config

    return audit_config(format=args.format, chat=args.chat, records=args.records, demos=args.demos,
                        stride=args.stride, local_window=args.local_window, batch_size=args.batch_size, seed=args.seed,
                        device=args.device or "auto", dtype=args.dtype or "float32", threads=args.threads,
                        gguf_file=args.gguf_file)


def dry_run(args, conditions: tuple[str, ...]) -> dict[str, Any]:
    """--dry-run: the prompt sets built (never a model), the served model's context checked from its metadata, the
    cost printed; nothing written.  Without --tokens-per-s an endpoint's rate comes from one timed probe request."""
    from phasekv.adapters.hf import load_tokenizer
    from phasekv.auditing.cost import cost_lines, probe_rate, run_cost
    from phasekv.auditing.pipeline import checkpoint_subject, long_sets
    from phasekv.data.formats import FormatVocabulary, load_format
    from phasekv.engines.client import open_endpoint
    from phasekv.evaluate.sources import audit_sets

    if args.tokens_per_s is not None and not (0 < args.tokens_per_s < float("inf")):
        raise ValueError(f"--tokens-per-s: must be a finite rate > 0, got {args.tokens_per_s}")
    adapter = None
    if args.endpoint is not None:
        adapter, tokenizer = open_endpoint(endpoint_options(args))  # the server's metadata; no journal
    elif args.checkpoint is None:
        tokenizer = load_tokenizer(args.hf or args.tokenizer, args.gguf_file, flag="--hf" if args.hf else "--tokenizer")
    try:
        cfg, spec, protocols = config_of(args), long_spec(args), tuple(dict.fromkeys(args.protocol))
        if args.checkpoint is not None:
            _, tokenizer, spec = checkpoint_subject(args.checkpoint, spec)
        sets = long_sets(spec, tokenizer, protocols) if spec else audit_sets(
            FormatVocabulary(load_format(cfg.format, cfg.chat), tokenizer), cfg, protocols, args.prompts_per_phase)
        rate, source = args.tokens_per_s, "--tokens-per-s"
        if adapter is not None:
            adapter.check_length(max(s.prompt_length for s in sets.values()))
            if rate is None:
                rate, source = probe_rate(adapter, next(iter(sets.values()))), "one timed probe request"
        served = adapter is not None or args.launch
        cost = run_cost(sets, conditions=1 if served else len(conditions),
                        endpoints=len(args.endpoint) if args.endpoint else 1, tokens_per_s=rate)
    finally:
        if adapter is not None:
            adapter.close()
    print("\n".join(cost_lines(cost, source)))
    return cost


def run_sharded(args) -> dict[str, Any]:
    """--shard I/N: this shard's answers, published with what `audit merge` needs (auditing.shards)."""
    from phasekv.auditing.shards import audit_record, parse_shard, run_shard
    from phasekv.data.formats import FormatVocabulary, load_format
    from phasekv.engines.client import open_endpoint
    from phasekv.evaluate.sources import audit_sets
    from phasekv.outputs import check_output_dir

    shard = parse_shard(args.shard)
    if args.endpoint is None or args.reference_hf is not None or args.expect or args.write_expect:
        raise ValueError("--shard: splits an --endpoint audit over machines: needs --endpoint, without "
                         "--reference-hf, --expect or --write-expect (run those on the merged audit's server)")
    if long_spec(args) is not None:  # a shard's journal and the merge hold a --format set's prompts
        raise ValueError("--shard: splits a --format prompt set; a long-context set (--context, --preset) is not "
                         "sharded: spread it over replicas with --endpoint URL1 URL2 ...")
    check_output_dir(Path(args.out), args.force, args.resume)
    cfg = config_of(args)
    plan = AuditPlan(("none",), args.window, tuple(dict.fromkeys(args.protocol)), args.prompts_per_phase)
    adapter, tokenizer = open_endpoint(endpoint_options(args), args.out, args.force)
    try:
        sets = audit_sets(FormatVocabulary(load_format(cfg.format, cfg.chat), tokenizer), cfg, plan.protocols,
                          plan.prompts_per_phase)
        record = run_shard(adapter, sets, args.out, shard=shard, force=args.force, progress=not args.no_progress,
                           audit=audit_record(cfg, plan, tokenizer=str(Path(args.tokenizer).resolve()),
                                              gguf_file=args.gguf_file))
    finally:
        adapter.close()
    print(f"shard {shard[0]}/{shard[1]}: {record['prompts']} prompts answered; join all {shard[1]} with "
          f"phasekv audit merge DIR... --out OUT")
    return record
