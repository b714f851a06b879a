"""Prompts per second of an endpoint audit through vLLM's real server (`make vllm`): 4 requests in flight against
one at a time, as a ratio measured in one run.

One vLLM server (as `phasekv.engines.process.vllm_server` starts it: eager, float32, one OpenMP thread, no prefix
cache, cached prompt tokens reported) with `--max-num-seqs 4`, so continuous batching can put the 4 requests in one
batch.  The prompt set is the audit's prefix-padding set of SmolLM2-135M-Instruct in the records format, as
`benchmarks/engine_throughput.py` builds it for llama-server.  Modes, each a fresh EndpointAdapter (no journal):

    c1   one request per prompt, one at a time (the audit's default; the baseline)
    c4   4 requests in flight (--concurrency 4)

Each mode is timed around `predict`, best of --repeats, the modes alternating (the machine's speed drifts), after
one warm-up run.  With the prefix cache off nothing is kept from one run to the next (every answer reports 0 cached
prompt tokens, or the adapter refuses it).  The predictions of c4 are compared with c1's.  Last line:
`prompts_per_s_c1=X ratio_c4=Y`.

    .venv/bin/python benchmarks/vllm_throughput.py [--repeats 3] [--clusters 2]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.engine starts the server

from engine_throughput import alternate, prompt_set, timed_predict  # noqa: E402  (its prompt set and timing)
from tests.engine import VLLM_MODEL, vllm_present, vllm_server  # noqa: E402

from phasekv.adapters.hf import load_tokenizer  # noqa: E402
from phasekv.engines.client import EndpointAdapter  # noqa: E402

MODES = {"c1": 1, "c4": 4}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clusters", type=int, default=2, help="prefix-set clusters (even; 32 prompts each)")
    args = parser.parse_args()
    if not vllm_present:
        sys.exit(f"vllm_throughput: needs vLLM's environment and {VLLM_MODEL} (make vllm)")
    tokenizer = load_tokenizer(str(VLLM_MODEL))
    eval_set = prompt_set(tokenizer, args.clusters)
    n = len(eval_set.queries())
    times: dict[str, list[float]] = {m: [] for m in MODES}
    predictions: dict[str, list[int]] = {}
    loads = [os.getloadavg()[0]]
    with vllm_server(extra=("--max-num-seqs", "4")) as url:
        def run(mode: str) -> float:
            adapter = EndpointAdapter(url, "openai", len(tokenizer), concurrency=MODES[mode])
            return timed_predict(adapter, eval_set, predictions, mode)

        alternate(run, MODES, times, args.repeats, after=lambda: loads.append(os.getloadavg()[0]))
    best = {m: min(t) for m, t in times.items()}
    rate = {m: n / best[m] for m in MODES}
    print(f"vLLM 0.32.0 (CPU, eager, float32, 1 thread, --max-num-seqs 4, no prefix cache), {VLLM_MODEL.name}; "
          f"{len(eval_set.contexts)} contexts, {n} prompts of {eval_set.prompt_length} tokens; best of "
          f"{args.repeats}; load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores")
    print(f"{'mode':>6} {'best s':>8} {'prompts/s':>10} {'ratio':>6} {'agree':>6}  all runs (s)")
    for m in MODES:
        agree = sum(a == b for a, b in zip(predictions[m], predictions["c1"], strict=True)) / n
        print(f"{m:>6} {best[m]:8.2f} {rate[m]:10.2f} {rate[m] / rate['c1']:6.2f} {100 * agree:5.1f}%  "
              + " ".join(f"{t:.2f}" for t in times[m]))
    print(f"prompts_per_s_c1={rate['c1']:.2f} ratio_c4={rate['c4'] / rate['c1']:.2f}")


if __name__ == "__main__":
    main()
