"""`phasekv export lm-eval`: the phase-sensitivity prompts as an lm-evaluation-harness task;
`phasekv export gguf`: a DeepSeek-V4, DeepSeek-V3.2, MiniMax-M3 or GLM-5.3 checkpoint as a GGUF file llama.cpp serves
(`phasekv.export.gguf`).

    phasekv export lm-eval --hf PATH --out DIR        (the format records-lmeval unless --format says otherwise)
    lm_eval --model hf --model_args pretrained=PATH --include_path DIR --tasks phasekv_records_lmeval_prefix
    phasekv export lm-eval --tokenizer PATH --format records --protocol prefix --out DIR
    phasekv export gguf --checkpoint checkpoints/dsv4-csa --out dsv4.gguf [--dtype f16] [--hf-out DIR]

The prompt-set flags are those of `phasekv eval --hf` (same defaults), so the task's documents are the
prompts `phasekv eval --hf PATH` evaluates with the same flags.  `--hf PATH` names the model lm_eval will load (its
tokenizer builds the prompts) and defaults the format to `records-lmeval`, a shipped format whose text tokenizes
back to its own ids under real tokenizers; it prints (and export.json records) the matching `lm_eval` and
`phasekv eval` command lines.  `--tokenizer PATH` keeps eval's defaults (bare words without --format).
"""

from __future__ import annotations

import argparse
from typing import Any

from phasekv.cli.flags import add_prompt_set_arguments, given_flags

LMEVAL_FORMAT = "records-lmeval"  # export lm-eval --hf's default: a shipped format that round-trips real tokenizers


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="export the phase-sensitivity prompts for other tools")
    targets = p.add_subparsers(dest="target", required=True)
    lm = targets.add_parser("lm-eval", help="an lm-evaluation-harness task (YAML, local jsonl, utils.py)")
    model = lm.add_mutually_exclusive_group(required=True)
    model.add_argument("--hf", help="the transformers model lm_eval will evaluate (directory or hub name, its "
                                    "pretrained=): its tokenizer builds the prompts; default --format "
                                    f"{LMEVAL_FORMAT}")
    model.add_argument("--tokenizer", help="the evaluated model's tokenizer: the directory or hub name you pass to "
                                           "lm_eval as pretrained= (prompts are built token by token with it)")
    lm.add_argument("--gguf-file", default=argparse.SUPPRESS, help="the tokenizer of a GGUF file inside the "
                                                                   "--hf / --tokenizer directory")
    add_prompt_set_arguments(lm)
    lm.add_argument("--out", required=True, help="output directory (the task's --include_path)")
    lm.add_argument("--force", action="store_true", help="replace an existing non-empty --out")
    lm.set_defaults(func=run)
    gg = targets.add_parser("gguf", help="a DeepSeek-V4, DeepSeek-V3.2, MiniMax-M3 or GLM-5.3 checkpoint as a GGUF "
                                         "file for llama.cpp (docs/notes/gguf.md)")
    gg.add_argument("--checkpoint", required=True, help="phasekv checkpoint or run directory (transformers "
                                                        "DeepSeek-V4, DeepSeek-V3.2, MiniMax-M3 or GLM-5.3 text model)")
    gg.add_argument("--out", required=True, help="the .gguf file to write")
    gg.add_argument("--dtype", default="f32", help="f32 (default) or f16 (matrices only; no quantization)")
    gg.add_argument("--hf-out", metavar="DIR", help="also write the exported weights as a transformers directory "
                                                    "with the vocabulary's tokenizer (eval --endpoint's --tokenizer "
                                                    "and --reference-hf; not for GLM-5.3)")
    gg.add_argument("--force", action="store_true", help="replace an existing --out (and phasekv's --hf-out)")
    gg.set_defaults(func=run_gguf)


def run_gguf(args) -> dict[str, Any]:
    from phasekv.export.gguf import export_gguf

    summary = export_gguf(args.checkpoint, args.out, args.dtype, args.hf_out, args.force)
    widened = ", ".join(f"{field} {old} -> {new}" for field, (old, new) in summary["widened"].items())
    print(f"wrote {summary['file']} ({summary['tensors']} tensors, {summary['dtype']}, "
          f"{summary['bytes'] / 1e6:.1f} MB; {widened})")
    return summary


def run(args) -> dict[str, Any]:
    from phasekv.cli.flags import check_prompt_count, prompts_at_least
    from phasekv.config import EvalConfig, from_section
    from phasekv.export.lmeval import export_lmeval

    given = given_flags(args)
    if args.hf is not None:
        given.setdefault("format", LMEVAL_FORMAT)
    cfg = from_section(EvalConfig, given, "eval")
    check_prompt_count(prompts_at_least(cfg))  # before the tokenizer loads
    summary = export_lmeval(args.hf or args.tokenizer, cfg, args.out, args.force,
                            flag="--tokenizer" if args.hf is None else "--hf", given=given)
    print(f"wrote task {summary['task']} ({summary['n_prompts']} prompts, stride {summary['stride']}, "
          f"residue modulus {summary['residue_modulus']}) to {args.out}")
    print(f"run it:     {summary['lm_eval_command']}\nthe same prompts in phasekv: {summary['eval_command']}")
    return summary
