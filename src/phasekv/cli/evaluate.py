"""`phasekv eval`: the phase-sensitivity evaluation of a phasekv checkpoint or any HF causal LM.

    phasekv eval --checkpoint DIR --protocol prefix --out OUT
    phasekv eval --checkpoint DIR --engine-checks decode --out OUT   (also its cached decode vs its full forward)
    phasekv eval --hf PATH --protocol insequence --stride 4 --out OUT
    phasekv eval --endpoint URL --api llamacpp --tokenizer DIR --format records --out OUT   (a served model)
    phasekv eval --hf PATH --format records --out OUT --eval-results DIR   (also the Hub's .eval_results/*.yaml)
    torchrun --nproc_per_node=8 -m phasekv.cli eval --hf PATH ...   (contexts sharded over ranks)

Settings come from the checkpoint's `eval` section; every flag given overrides it.  The flags it shares with the
probes, the audit and the export are defined and checked in `phasekv.cli.flags`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from phasekv.cli.flags import (
    add_endpoint_arguments,
    add_prompt_arguments,
    add_source_arguments,
    check_eval_results,
    check_prompt_count,
    check_source_flags,
    endpoint_options,
    given_flags,
    prompts_at_least,
    source_and_config,
)


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="accuracy by phase/residue of the lookup task, with intervals")
    add_endpoint_arguments(p, add_source_arguments(p))
    p.add_argument("--reference-hf", metavar="DIR", help="--endpoint: the same weights in transformers (with "
                                                         "--gguf-file: that GGUF inside DIR): writes comparison.json, "
                                                         "engine vs reference agreement per phase")
    p.add_argument("--eval-results", metavar="DIR", help="also the Hub's .eval_results/*.yaml and a model card")
    add_prompt_arguments(p)
    p.add_argument("--engine-checks", nargs="+", default=[], choices=("decode",), metavar="CHECK",
                   help="--checkpoint: also decode (the model's greedy tokens decoded through its own KV cache, one "
                        "per step, against its own full forward, by phase of the step: decode.json)")
    p.add_argument("--decode-steps", type=int, default=6, help="--engine-checks decode: tokens generated per prompt")
    p.add_argument("--check-prompts", type=int, default=0, help="--engine-checks: prompts checked (0: all)")
    p.set_defaults(func=run)


def run(args) -> dict[str, Any]:
    from phasekv.engines.client import check_reference
    from phasekv.evaluate.runner import run_eval

    check_source_flags(args)
    check_reference(args.endpoint is not None, args.reference_hf)
    check_eval_results(args)  # before anything is loaded or asked
    if args.endpoint is not None:
        metrics = run_endpoint(args)
    else:
        check_engine_checks(args)
        source, cfg = source_and_config(args)
        metrics = run_eval(source, cfg, args.out, force=args.force, progress=not args.no_progress)
        if args.engine_checks:
            metrics["decode"] = run_decode_check(source, cfg, args)
    if args.eval_results and metrics:  # under torchrun, rank 0 holds the metrics
        from phasekv.api.publish import write_eval_results

        write_eval_results(metrics, args.eval_results, force=args.force, fmt=getattr(args, "format", None),
                           figures_from=args.out)
    return metrics


def check_engine_checks(args) -> None:
    if not args.engine_checks:
        return
    if args.checkpoint is None:
        raise ValueError("--engine-checks: applies to --checkpoint (a phasekv model in process); an engine's decode "
                         "steps: phasekv audit --launch ENGINE --engine-checks decode")
    for name in ("decode_steps", "check_prompts"):
        if getattr(args, name) < (1 if name == "decode_steps" else 0):
            raise ValueError(f"--{name.replace('_', '-')}: must be >= {1 if name == 'decode_steps' else 0}, got "
                             f"{getattr(args, name)}")


def run_decode_check(source, cfg, args) -> dict[str, Any]:
    """--engine-checks decode: the checkpoint's cached greedy decode against its own full forward on the evaluated
    prompts (`phasekv.auditing.decode_local`), written to OUT/decode.json and its verdict printed."""
    from phasekv.auditing.decode_local import local_decode_check
    from phasekv.evaluate.sources import open_source
    from phasekv.outputs import add_written, write_json

    adapter, eval_set = open_source(source, cfg)
    result = local_decode_check(args.decode_steps, args.check_prompts or None)(adapter, {cfg.protocol: eval_set})
    write_json(Path(args.out) / "decode.json", result, atomic=True)  # OUT is published: this file joins it whole
    add_written(Path(args.out), "decode.json")
    overall = result["overall"]
    print(f"decode steps: {overall['agree']}/{overall['n']} cached greedy tokens agree with the full forward; "
          f"{result['verdict']}")
    return result


def run_endpoint(args) -> dict[str, Any]:
    """`phasekv eval --endpoint`: the flags' prompt set through the served model (and through --reference-hf)."""
    from phasekv.cli.flags import check_reference_model
    from phasekv.config import EvalConfig, from_section
    from phasekv.engines.client import open_endpoint
    from phasekv.evaluate.served import evaluate_endpoint
    from phasekv.outputs import check_output_dir

    cfg = from_section(EvalConfig, given_flags(args), "eval")
    check_prompt_count(prompts_at_least(cfg))
    check_output_dir(Path(args.out), args.force, args.resume)  # before anything is loaded or asked
    reference = None
    if args.reference_hf is not None:
        import torch

        from phasekv.adapters.hf import load_hf

        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        reference, reference_tokenizer = load_hf(args.reference_hf, cfg.device, cfg.dtype, gguf_file=cfg.gguf_file)
    adapter, tokenizer = open_endpoint(endpoint_options(args), args.out, args.force)
    with contextlib.closing(adapter):
        if reference is not None:
            check_reference_model(args, reference_tokenizer, tokenizer)
        return evaluate_endpoint(adapter, tokenizer, cfg, args.out, force=args.force, progress=not args.no_progress,
                                 reference=reference)
