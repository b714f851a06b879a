"""Speed-up of multi-query evaluation (contexts prefilled once, each query continued from a copy of
the cache) over one forward per full prompt, at the same batch size, on a randomly initialized model
of the cpu preset geometry (configs/cpu/w8s8.yaml) and a small prefix-padding eval set.

Both modes must give identical predictions (asserted).  Each mode is timed with time.perf_counter,
best of --repeats, in one process on one thread.  Prints a table and, last,
`speedup_multi_query=X prompts_per_s_multi=Y prompts_per_s_single=Z`.

    .venv/bin/python benchmarks/eval_throughput.py [--batch-size 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from phasekv import build_model
from phasekv.config import Experiment
from phasekv.data import Vocabulary, build_eval_set
from phasekv.evaluate.adapter import PhaseKVAdapter
from phasekv.evaluate.runner import predict

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "cpu" / "w8s8.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = Experiment.from_file(CONFIG).model
    adapter = PhaseKVAdapter(build_model(config))
    eval_set = build_eval_set(Vocabulary(), "prefix", n_records=24, n_demos=8, stride=8, n_clusters=4)
    n_prompts = len(eval_set.queries())

    best, predictions = {}, {}
    for mode, multi in (("multi_query", True), ("single", False)):
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            records = predict(adapter, eval_set, args.batch_size, multi_query=multi, progress=False)
            times.append(time.perf_counter() - t0)
        best[mode], predictions[mode] = min(times), [r["prediction"] for r in records]
    assert predictions["multi_query"] == predictions["single"], "multi-query and one-by-one predictions differ"

    W, S = config.options(config.compressor).geometry()
    print(f"model {CONFIG.name} (random init): {config.num_hidden_layers} layers, width {config.hidden_size}, "
          f"{config.compressor} W{W}/S{S}; {len(eval_set.contexts)} contexts, "
          f"{n_prompts} prompts of {eval_set.prompt_length} tokens; batch size {args.batch_size}; "
          f"best of {args.repeats}; 1 thread; predictions identical")
    print(f"{'mode':>12} {'best s':>8} {'prompts/s':>10}")
    rate = {mode: n_prompts / t for mode, t in best.items()}
    for mode, t in best.items():
        print(f"{mode:>12} {t:8.3f} {rate[mode]:10.1f}")
    print(f"speedup_multi_query={best['single'] / best['multi_query']:.2f} "
          f"prompts_per_s_multi={rate['multi_query']:.1f} prompts_per_s_single={rate['single']:.1f}")


if __name__ == "__main__":
    main()
