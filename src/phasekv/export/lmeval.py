"""Phase sensitivity as an lm-evaluation-harness task (`phasekv export lm-eval`).

The task's documents are the prompts `phasekv eval --hf` builds (same tokenizer, format, protocol and
settings; `phasekv.evaluate.sources`), each with its residue and phase.  lm-eval talks to models in text,
so every prompt is written as the text its token ids decode to, and the export refuses a prompt set whose
text would not tokenize back to exactly those ids the way lm-eval's `hf` model tokenizes it (a merged
filler would shift every later position and phase).  A document asks for ONE greedily generated token
(`generate_until`, `max_gen_toks: 1`) and is correct when that token's text is the answer token's text,
which the export checks no other token shares: so a document is correct exactly when the full-vocabulary
argmax at the query position is the answer, `phasekv eval`'s criterion.  The shipped `utils.py`
(`phasekv.export.lmeval_task`) aggregates accuracy per residue group and per phase and the gaps.

Written to OUT: `<task>.yaml`, `prompts.jsonl`, `utils.py` and `export.json` (the resolved settings).
"""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path
from typing import Any

from phasekv.adapters.hf import load_tokenizer
from phasekv.config import EvalConfig
from phasekv.data.protocols import EvalSet, build_eval_set
from phasekv.evaluate.sources import DEFAULT_STRIDE, prompt_settings, tokenizer_vocabulary
from phasekv.export import lmeval_task
from phasekv.outputs import check_output_dir, output_dir, write_json, write_jsonl


def lmeval_tokens(tokenizer: Any, text: str) -> list[int]:
    """The ids lm-eval's `hf` model gives `text` (HFLM.tok_batch_encode with add_bos_token unset: no special
    tokens added when the text already starts with the bos token, the tokenizer's default otherwise)."""
    bos = getattr(tokenizer, "bos_token", None)
    kwargs = {"add_special_tokens": False} if bos and text.startswith(bos) else {}
    return tokenizer(text, **kwargs)["input_ids"]


def answer_texts(tokenizer: Any, answers: set[int]) -> dict[int, str]:
    """Answer token id -> its text as lm-eval decodes a generated token; refused when another token has the
    same text (exact match of text would then not be exact match of the token)."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=True)
    owners: dict[str, list[int]] = {}
    for i, text in enumerate(texts):
        owners.setdefault(text, []).append(i)
    for answer in sorted(answers):
        if not texts[answer] or len(owners[texts[answer]]) > 1:
            raise ValueError(f"tokenizer: answer token {answer} ({texts[answer]!r}) decodes to the same text as "
                             f"tokens {owners[texts[answer]][:4]}; exact match of text cannot score it")
    return {a: texts[a] for a in answers}


def documents(tokenizer: Any, eval_set: EvalSet) -> list[dict[str, Any]]:
    """One lm-eval document per prompt: its text, answer, residue, phase and position metadata."""
    prompts = eval_set.prompts()
    texts = answer_texts(tokenizer, {q.answer for q in eval_set.queries()})
    docs, unstable = [], []
    for i, prompt in enumerate(prompts):
        text = tokenizer.decode(prompt.ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if lmeval_tokens(tokenizer, text) != prompt.ids:
            unstable.append(i)
        q = prompt.query
        docs.append({"text": text, "answer_text": texts[q.answer], "answer": q.answer, "residue": q.residue,
                     "phase": q.phase, "target_position": q.target_position, "protocol": q.protocol,
                     "shift": q.shift, "cluster": q.cluster, "record": q.record, "stride": eval_set.stride,
                     "residue_modulus": eval_set.residue_modulus})
    if unstable:
        raise ValueError(f"{len(unstable)} of {len(prompts)} prompts do not tokenize back to their own token ids "
                         f"(first: prompt {unstable[0]}), so lm-eval would see other positions and phases; use a "
                         "format whose filler and pieces tokenize the same in running text (--format FILE)")
    return docs


def task_name(cfg: EvalConfig, format_name: str) -> str:
    return re.sub(r"[^a-z0-9_]+", "_", f"phasekv_{format_name}_{cfg.protocol}".lower())


def task_yaml(name: str, stride: int, residue_modulus: int) -> str:
    """The task definition; metrics and aggregations live in the shipped utils.py."""
    metrics = [("acc", "mean", "true"), ("gap_pp", "!function utils.gap", "false"),
               ("phase_gap_pp", "!function utils.gap", "false")]
    metrics += [(lmeval_task.residue_metric(r, residue_modulus), "!function utils.group_accuracy", "true")
                for r in range(residue_modulus)]
    metrics += [(lmeval_task.phase_metric(p, stride), "!function utils.group_accuracy", "true")
                for p in range(stride)]
    lines = [f"task: {name}", "custom_dataset: !function utils.load_prompts", "test_split: test",
             "output_type: generate_until", "doc_to_text: text", "doc_to_target: answer_text",
             "generation_kwargs:", "  until: []", "  max_gen_toks: 1", "  do_sample: false",
             "process_results: !function utils.process_results", "metric_list:"]
    for metric, aggregation, higher in metrics:
        lines += [f"  - metric: {metric}", f"    aggregation: {aggregation}", f"    higher_is_better: {higher}"]
    lines += ["metadata:", "  version: 1.0"]
    return "\n".join(lines) + "\n"


def command_lines(model: str, given: dict[str, Any], out: str | Path, task: str) -> dict[str, str]:
    """The `lm_eval` command that runs the exported task on `model`, and the `phasekv eval --hf` command that
    evaluates the same prompts (`given`: the EvalConfig fields the export was given, as flags)."""
    flags = [f"--{name.replace('_', '-')}" + ("" if value is True else f" {shlex.quote(str(value))}")
             for name, value in given.items() if value is not None and value is not False and name != "gguf_file"]
    gguf = given.get("gguf_file")
    model_args = f"pretrained={model}" + (f",gguf_file={gguf}" if gguf else "")
    return {"lm_eval_command": f"lm_eval --model hf --model_args {shlex.quote(model_args)} --include_path "
                               f"{shlex.quote(str(out))} --tasks {task}",
            "eval_command": " ".join(["phasekv eval --hf", shlex.quote(model),
                                      *([f"--gguf-file {shlex.quote(gguf)}"] if gguf else []), *flags,
                                      "--out OUT"])}


def export_lmeval(tokenizer_path: str, cfg: EvalConfig, out: str | Path, force: bool = False, *,
                  flag: str = "--tokenizer", given: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the lm-eval task of `cfg`'s prompt set for the tokenizer at `tokenizer_path` into `out`;
    returns what export.json records (task name, sizes, settings, and with `given`, the flags `cfg` came from, the
    `command_lines`).  `flag`: the option that named the path, in errors."""
    check_output_dir(Path(out), force)  # before loading anything
    tokenizer = load_tokenizer(tokenizer_path, cfg.gguf_file, flag=flag)
    vocab, defaults = tokenizer_vocabulary(tokenizer, cfg)
    eval_set = build_eval_set(vocab, cfg.protocol, stride=cfg.stride or DEFAULT_STRIDE,
                              **prompt_settings(cfg, defaults))
    docs = documents(tokenizer, eval_set)
    format_name = getattr(getattr(vocab, "format", None), "name", "bare")
    name = task_name(cfg, format_name)
    summary = {"task": name, "tokenizer": tokenizer_path, "format": format_name, "protocol": cfg.protocol,
               "stride": eval_set.stride, "residue_modulus": eval_set.residue_modulus, "n_prompts": len(docs),
               "prompt_length": eval_set.prompt_length, "chance": eval_set.chance,
               "in_context_chance": eval_set.in_context_chance,
               "settings": {k: v for k, v in eval_set.settings.items() if k != "vocab"},
               **(command_lines(tokenizer_path, given, out, name) if given is not None else {})}
    with output_dir(out, force) as tmp:
        write_jsonl(tmp / "prompts.jsonl", docs)
        shutil.copyfile(lmeval_task.__file__, tmp / "utils.py")
        (tmp / f"{name}.yaml").write_text(task_yaml(name, eval_set.stride, eval_set.residue_modulus))
        write_json(tmp / "export.json", summary, default=str)
    return summary
