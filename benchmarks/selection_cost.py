"""Cost of pooled selection in an audit: the same prompts at ~2K tokens evaluated as the audit evaluates them,
dense (the `none` condition) and under `kpool:` selection (`phasekv.conditions.selection.pooled`), in one run.

The prompts are the preamble workload of benchmarks/audit_throughput.py (the records format behind a prose
preamble sized to the length, the layout of the records-4k / records-8k formats), `--contexts` contexts with
`--queries` records queried each, prefix padding.  Each condition runs `phasekv.evaluate.runner.predict` (the
audit's path) from a fresh adapter, best of `--repeats`, the conditions alternating, one thread.  The model is
SmolLM2-135M (the GGUF dequantized to float32, as `phasekv audit --hf` loads it) when `make real-model` has
fetched it, else the tiny random Llama of the tests.  Prints a table and, last, `cost_ratio_<indexer>@<tokens>=X
...` (selection seconds / dense seconds; the target is <= 3).

    .venv/bin/python benchmarks/selection_cost.py [--length 2048] [--indexers oracle max distilled:DIR] \
        [--pool 4] [--budget 0.25] [--contexts 1] [--queries 8] [--repeats 1]

An indexer item may carry more `kpool` keys after a comma (`distilled:DIR,heads=kv` for a MiniMax-M3 indexer,
`max,grid=jitter`); a distilled indexer's ratio is labelled by its directory's name.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.helpers and the prompt sets of benchmarks/audit_throughput.py

from benchmarks.audit_throughput import prompt_set  # noqa: E402
from tests.helpers import REAL_MODEL_PRESENT, SMOL, SMOL_FILE, bpe_tokenizer, tiny_causal_lm  # noqa: E402

from phasekv.adapters.hf import HFAdapter  # noqa: E402
from phasekv.conditions.selection.pooled import SelectionAdapter, parse_selection  # noqa: E402
from phasekv.evaluate.runner import predict  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--indexers", nargs="+", default=["oracle"])
    parser.add_argument("--pool", type=int, default=4)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--contexts", type=int, default=1)
    parser.add_argument("--queries", type=int, default=8, help="records queried per context (a multiple of 8)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--tiny", action="store_true", help="the tiny random Llama even when SmolLM2 is present")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if REAL_MODEL_PRESENT and not args.tiny:
        from phasekv.adapters.hf import load_hf

        adapter, tokenizer = load_hf(str(SMOL), "cpu", "float32", gguf_file=SMOL_FILE)
        name, model = "smollm2", adapter.module
    else:
        tokenizer = bpe_tokenizer(prose=True)
        name, model = "tiny", tiny_causal_lm("llama", len(tokenizer), args.length + 64, "sdpa").eval()
    eval_set = prompt_set(tokenizer, "preamble", args.length, args.queries)
    eval_set = dataclasses.replace(eval_set, contexts=eval_set.contexts[:args.contexts])
    conditions = {"none": None, **{i: parse_selection(f"kpool:pool={args.pool},budget={args.budget},indexer={i}")
                                   for i in args.indexers}}
    times: dict[str, list[float]] = {c: [] for c in conditions}
    for _ in range(args.repeats):
        for condition, spec in conditions.items():
            base = HFAdapter(model, "bench")  # fresh: no preamble cache kept from an earlier run
            adapter = base if spec is None else SelectionAdapter(base, spec)
            t0 = time.perf_counter()
            predict(adapter, eval_set, args.batch_size, progress=False)
            times[condition].append(time.perf_counter() - t0)
    dense = min(times["none"])
    n = len(eval_set.queries())
    print(f"{name}; one thread; {eval_set.prompt_length} tokens per prompt; {len(eval_set.contexts)} contexts, "
          f"{n} prompts; pool {args.pool}, budget {args.budget}")
    print(f"{'condition':>28} {'seconds':>8} {'ratio':>6}")
    ratios = {}
    for condition in conditions:
        best = min(times[condition])
        print(f"{condition[:28]:>28} {best:>8.2f} {best / dense:>6.2f}")
        if condition != "none":
            label = f"distilled-{Path(condition[len('distilled:'):]).name}" if condition.startswith("distilled:") \
                else condition
            ratios[f"cost_ratio_{label}@{eval_set.prompt_length}"] = best / dense
    print(" ".join(f"{k}={v:.2f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
