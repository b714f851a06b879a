"""Prompts per second of an endpoint audit through the real llama-server (`make engine`, `make real-model`):
requests in flight at once and the engine's prefix cache, each as a ratio to one request per prompt.

The prompt set is the audit's prefix-padding set of SmolLM2-135M-Instruct in the records format (contexts of
4 queries each, ~310 tokens).  Modes, each a fresh EndpointAdapter (no journal, nothing answered twice):

    c1          one request per prompt, one at a time, prompt cache off (the audit's default; the baseline)
    c4          4 requests in flight (the server runs 4 slots)
    reuse       a context's queries back to back with the prompt cache on (--reuse-prefix), one at a time
    reuse_c4    both

Each mode is timed with time.perf_counter around `predict`, best of --repeats, the modes alternating (this
VM's speed drifts within minutes), after one warm-up run.  The server keeps no prompt from one run to the next
(its host-memory prompt cache is off, --cache-ram 0, and every slot is erased before each run, which
llama-server allows only with a --slot-save-path), so a reused
prefix is one that the run itself computed.  The predictions of each mode are compared with the
baseline's (the share that agree is printed: a reused prefix is another code path of the engine).  Last line:
`prompts_per_s_c1=X ratio_c4=Y ratio_reuse=Z ratio_reuse_c4=W`.

    .venv/bin/python benchmarks/engine_throughput.py [--threads 1] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.engine starts the server

from tests.engine import LLAMA_SERVER, engine_present, llama_server  # noqa: E402
from tests.helpers import SMOL, SMOL_FILE  # noqa: E402

from phasekv.adapters.hf import load_tokenizer  # noqa: E402
from phasekv.data.formats import FormatVocabulary, load_format  # noqa: E402
from phasekv.data.protocols import build_eval_set  # noqa: E402
from phasekv.engines.client import EndpointAdapter  # noqa: E402
from phasekv.evaluate.runner import predict  # noqa: E402

MODES = {"c1": (1, False), "c4": (4, False), "reuse": (1, True), "reuse_c4": (4, True)}


def prompt_set(tokenizer, clusters: int):
    """The audit's prefix-padding set of the records format (contexts of 4 queries, ~310 tokens)."""
    vocab = FormatVocabulary(load_format("records", False), tokenizer)
    kt, vt = vocab.record_shape
    return build_eval_set(vocab, "prefix", n_records=24, n_demos=4, stride=8, residue_modulus=8,
                          n_clusters=clusters, key_tokens=kt, value_tokens=vt, local_window=16, seed=0)


def timed_predict(adapter, eval_set, predictions: dict[str, list[int]], mode: str) -> float:
    """Seconds `predict` takes on the whole set (the adapter closed after); its predictions kept under `mode`."""
    t0 = time.perf_counter()
    records = predict(adapter, eval_set, batch_size=16, progress=False)
    elapsed = time.perf_counter() - t0
    adapter.close()
    predictions[mode] = [r["prediction"] for r in records]
    return elapsed


def alternate(run, modes, times: dict[str, list[float]], repeats: int, after=None) -> None:
    """One warm-up run of the first mode, then `repeats` rounds of every mode in turn (`after()` after each)."""
    run(next(iter(modes)))
    for _ in range(repeats):
        for mode in modes:
            times[mode].append(run(mode))
            if after is not None:
                after()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="llama-server threads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clusters", type=int, default=2, help="prefix-set clusters (even; 32 prompts each)")
    args = parser.parse_args()
    if not engine_present:
        sys.exit(f"engine_throughput: needs {LLAMA_SERVER} (make engine) and {SMOL / SMOL_FILE} (make real-model)")
    tokenizer = load_tokenizer(str(SMOL), SMOL_FILE)
    eval_set = prompt_set(tokenizer, args.clusters)
    n = len(eval_set.queries())
    times: dict[str, list[float]] = {m: [] for m in MODES}
    predictions: dict[str, list[int]] = {}
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as slots, llama_server(
            slots=4, context=8192, threads=args.threads, extra=("--cache-ram", "0", "--slot-save-path", slots)) as url:
        def run(mode: str) -> float:
            concurrency, reuse = MODES[mode]
            for slot in range(4):
                httpx.post(f"{url}/slots/{slot}?action=erase", timeout=30).raise_for_status()
            adapter = EndpointAdapter(url, "llamacpp", len(tokenizer), concurrency=concurrency, reuse_prefix=reuse)
            return timed_predict(adapter, eval_set, predictions, mode)

        alternate(run, MODES, times, args.repeats)
    best = {m: min(t) for m, t in times.items()}
    rate = {m: n / best[m] for m in MODES}
    print(f"llama-server b11434, {SMOL_FILE}, {args.threads} thread(s), 4 slots, no prompt kept between runs; "
          f"{len(eval_set.contexts)} contexts, "
          f"{n} prompts of {eval_set.prompt_length} tokens; best of {args.repeats}; load average {load:.1f} on "
          f"{os.cpu_count()} cores")
    print(f"{'mode':>10} {'best s':>8} {'prompts/s':>10} {'ratio':>6} {'agree':>6}  all runs (s)")
    for m in MODES:
        agree = sum(a == b for a, b in zip(predictions[m], predictions["c1"])) / n
        print(f"{m:>10} {best[m]:8.2f} {rate[m]:10.2f} {rate[m] / rate['c1']:6.2f} {100 * agree:5.1f}%  "
              + " ".join(f"{t:.2f}" for t in times[m]))
    print(f"prompts_per_s_c1={rate['c1']:.2f} " + " ".join(f"ratio_{m}={rate[m] / rate['c1']:.2f}"
                                                          for m in MODES if m != "c1"))


if __name__ == "__main__":
    main()
