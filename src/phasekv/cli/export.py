"""`phasekv export lm-eval`: the phase-sensitivity prompts as an lm-evaluation-harness task.

    phasekv export lm-eval --tokenizer PATH --format records --protocol prefix --out DIR
    lm_eval --model hf --model_args pretrained=PATH --include_path DIR --tasks phasekv_records_prefix

The prompt-set flags are those of `phasekv eval --hf` (same defaults), so the task's documents are the
prompts `phasekv eval --hf PATH` evaluates with the same flags.
"""

from __future__ import annotations

import argparse
from typing import Any

from phasekv.cli.evaluate import add_prompt_set_arguments, given_flags


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="export the phase-sensitivity prompts for other tools")
    targets = p.add_subparsers(dest="target", required=True)
    lm = targets.add_parser("lm-eval", help="an lm-evaluation-harness task (YAML, local jsonl, utils.py)")
    lm.add_argument("--tokenizer", required=True, help="the evaluated model's tokenizer: the directory or hub "
                                                       "name you pass to lm_eval as pretrained= (prompts are "
                                                       "built token by token with it)")
    lm.add_argument("--gguf-file", default=argparse.SUPPRESS, help="the tokenizer of a GGUF file inside the "
                                                                   "--tokenizer directory")
    add_prompt_set_arguments(lm)
    lm.add_argument("--out", required=True, help="output directory (the task's --include_path)")
    lm.add_argument("--force", action="store_true", help="replace an existing non-empty --out")
    lm.set_defaults(func=run)


def run(args) -> dict[str, Any]:
    from phasekv.config import EvalConfig, from_section
    from phasekv.evaluate.lmeval import export_lmeval

    summary = export_lmeval(args.tokenizer, from_section(EvalConfig, given_flags(args), "eval"), args.out,
                            args.force)
    print(f"wrote task {summary['task']} ({summary['n_prompts']} prompts, stride {summary['stride']}, "
          f"residue modulus {summary['residue_modulus']}) to {args.out}")
    return summary
