"""Which KV head of a transformers model carries the answer: each KV head knocked out in EVERY layer at once (its query
heads' outputs replaced at the final position by their calibration means), under a condition, on the audit's prefix
prompt set; accuracy overall, by the value token's position mod S and by the owning group of a fixed slicing.

    python research/head_knockout_hf.py DIR --gguf-file NAME OUT.json [--condition none] [--prompts-per-phase 16]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import torch

from phasekv.adapters.hf import load_hf
from phasekv.conditions.grammar import Geometry, condition_adapter
from phasekv.config import audit_config
from phasekv.evaluate.runner import predict
from phasekv.evaluate.sources import audit_sets, tokenizer_vocabulary
from phasekv.outputs import write_json
from phasekv.probes.hooks import QueryOnly, mean_knockout
from phasekv.probes.knockout import calibration_means, calibration_set


def grouped(records, key) -> list[float | None]:
    groups: dict[int, list[bool]] = {}
    for r in records:
        groups.setdefault(key(r), []).append(r["correct"])
    return [round(sum(v) / len(v), 4) if v else None for _, v in sorted(groups.items())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("hf")
    parser.add_argument("out", type=Path)
    parser.add_argument("--gguf-file")
    parser.add_argument("--condition", default="none")
    parser.add_argument("--prompts-per-phase", type=int, default=16)
    parser.add_argument("--calib-prompts", type=int, default=128)
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    adapter, tokenizer = load_hf(args.hf, "cpu", "float32", gguf_file=args.gguf_file)
    cfg = audit_config(format="records", threads=1, gguf_file=args.gguf_file)
    eval_set = audit_sets(tokenizer_vocabulary(tokenizer, cfg)[0], cfg, ("prefix",), args.prompts_per_phase)["prefix"]
    probe = QueryOnly(condition_adapter(adapter, args.condition, Geometry(8, cfg.stride, cfg.local_window)))
    means = calibration_means(probe, calibration_set(eval_set, args.calib_prompts), cfg.batch_size, True, False)
    stride = cfg.stride

    def measure(records):
        return {"accuracy": round(sum(r["correct"] for r in records) / len(records), 4),
                "by_answer_phase": grouped(records, lambda r: r["answer_position"] % stride),
                "by_slice_owner": grouped(records, lambda r: (r["answer_position"] // 8) % adapter.info.num_kv_heads)}

    result = {"model": adapter.info.name, "condition": args.condition, "n_prompts": len(eval_set.queries()),
              "clean": measure(predict(probe, eval_set, cfg.batch_size, True, False)), "knocked_out": []}
    for head in range(adapter.info.num_kv_heads):
        with contextlib.ExitStack() as stack:
            for layer in range(adapter.info.num_layers):
                stack.enter_context(mean_knockout(probe, layer, head, means[layer]))
            records = predict(probe, eval_set, cfg.batch_size, True, False)
        result["knocked_out"].append({"kv_head": head, **measure(records)})
        print(head, result["knocked_out"][-1], flush=True)
    result["elapsed_s"] = round(time.perf_counter() - started, 1)
    write_json(args.out, result)
    print(result["clean"])


if __name__ == "__main__":
    main()
