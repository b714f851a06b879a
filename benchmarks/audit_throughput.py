"""Speed-up of the real-model path's multi-query evaluation over one forward per full prompt, on the same prompts, at
context lengths 512, 2K and 8K, for a tiny random transformers Llama (tests/helpers.py's tiny_causal_lm, with the
byte-level BPE tokenizer of the tests) and, when `make real-model` has fetched it, SmolLM2-135M (loaded as
`phasekv audit --hf` loads it: the GGUF file dequantized to float32).

Multi-query (`phasekv.evaluate.runner.predict`): contexts are prefilled once and each context's queries, packed in
one row, read the prefilled cache in place (`phasekv.adapters`); one-by-one: one forward per full prompt,
`--batch-size` prompts at a time, the LM head at the last position only.  Two workloads, both with prefix padding:

  needle    the needle format, its prose between needles sized to the length: contexts share nothing but
            <bos> and the header, so the speed-up is the multi-query one alone;
  preamble  the records format behind a prose preamble sized to the length (the layout of the records-4k /
            records-8k formats): every context begins with the same preamble, prefilled once per run.

Each prompt set holds the fewest clusters the layout allows, g = gcd(record pitch, 8), at all 8 shifts (8 g
contexts), with `--queries` records queried per context; SmolLM2 runs the first `--smol-contexts` contexts.  Both
modes must give identical predictions (asserted).  Each mode is timed with time.perf_counter, best of --repeats
(SmolLM2: --smol-repeats), the modes alternating, one thread, after one multi-query warm-up; every run starts from a
fresh adapter, so each multi-query run pays for its own preamble.  Prints a table and, last,
`speedup_<model>_<workload>_<length>=X ...`.

    .venv/bin/python benchmarks/audit_throughput.py [--models tiny smollm2] [--lengths 512 2048 8192] \
        [--smol-lengths 512 2048] [--workloads needle preamble] [--queries 16] [--batch-size 16] [--repeats 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.helpers: the tiny model and tokenizer builders the tests use

from tests.helpers import REAL_MODEL_PRESENT, SMOL, SMOL_FILE, bpe_tokenizer, tiny_causal_lm  # noqa: E402

from phasekv.adapters.hf import HFAdapter  # noqa: E402
from phasekv.data.formats import FORMATS, FormatVocabulary  # noqa: E402
from phasekv.data.protocols import EvalSet, build_eval_set  # noqa: E402
from phasekv.evaluate.runner import predict  # noqa: E402

STRIDE, N_RECORDS, N_DEMOS = 8, 24, 4


def _eval_set(vocab: FormatVocabulary, queries: int) -> EvalSet:
    kt, vt = vocab.record_shape
    pitch = kt + vt + vocab.haystack_tokens
    return build_eval_set(vocab, "prefix", n_records=N_RECORDS, n_demos=N_DEMOS, stride=STRIDE, residue_modulus=STRIDE,
                          n_clusters=math.gcd(pitch, STRIDE), targets_per_context=queries, key_tokens=kt,
                          value_tokens=vt, local_window=16)


def _vocabulary(fmt, tokenizer, **changes) -> FormatVocabulary | None:
    """`fmt` with `changes` for this tokenizer; None when no set of sentences fills its prose exactly."""
    try:
        return FormatVocabulary(dataclasses.replace(fmt, **changes), tokenizer)
    except ValueError:
        return None


def prompt_set(tokenizer, workload: str, length: int, queries: int) -> EvalSet:
    """The longest prompt set of `workload` whose prompts fit in `length` tokens (module docstring)."""
    if workload == "needle":  # the prose between needles, from the most that could fit down to none
        for h in range(min(4096, length // (N_RECORDS + 1)), -1, -1):
            vocab = _vocabulary(FORMATS["needle"], tokenizer, haystack_tokens=h)
            if vocab is not None:
                eval_set = _eval_set(vocab, queries)
                if eval_set.prompt_length <= length:
                    return eval_set
        raise ValueError(f"length: no needle prompt set fits in {length} tokens")
    fmt = FORMATS["records-8k"]  # its preamble resized; the rest of the prompt does not depend on the preamble
    rest = next(_eval_set(vocab, queries).prompt_length - n for n in range(64, length)
                if (vocab := _vocabulary(fmt, tokenizer, preamble_tokens=n)) is not None)
    for n in range(length - rest, 0, -1):
        vocab = _vocabulary(fmt, tokenizer, preamble_tokens=n)
        if vocab is not None:
            return _eval_set(vocab, queries)
    raise ValueError(f"length: no preamble prompt set fits in {length} tokens")


def measure(model, eval_set: EvalSet, batch_size: int, repeats: int) -> dict[str, float]:
    """Best seconds of each mode (alternating, after one multi-query warm-up); predictions asserted identical."""
    times, predictions = {"multi_query": [], "single": []}, {}
    predict(HFAdapter(model, "bench"), eval_set, batch_size, progress=False)  # warm-up
    for _ in range(repeats):
        for mode in times:
            adapter = HFAdapter(model, "bench")  # a fresh adapter: no preamble kept from an earlier run
            t0 = time.perf_counter()
            records = predict(adapter, eval_set, batch_size, multi_query=mode == "multi_query", progress=False)
            times[mode].append(time.perf_counter() - t0)
            predictions[mode] = [r["prediction"] for r in records]
        assert predictions["multi_query"] == predictions["single"], "multi-query and one-by-one predictions differ"
    return {mode: min(t) for mode, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["tiny", "smollm2"], choices=["tiny", "smollm2"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--smol-lengths", type=int, nargs="*", default=[512, 2048])
    parser.add_argument("--workloads", nargs="+", default=["needle", "preamble"], choices=["needle", "preamble"])
    parser.add_argument("--queries", type=int, default=16, help="records queried per context (a multiple of 8)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smol-contexts", type=int, default=1)
    parser.add_argument("--smol-repeats", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    models = []
    if "tiny" in args.models:
        tokenizer = bpe_tokenizer(prose=True)
        models.append(("tiny", tiny_causal_lm("llama", len(tokenizer), max(args.lengths), "sdpa").eval(), tokenizer,
                       args.lengths, None, args.repeats))
    if "smollm2" in args.models and REAL_MODEL_PRESENT and args.smol_lengths:
        from phasekv.adapters.hf import load_hf

        smol, smol_tokenizer = load_hf(str(SMOL), "cpu", "float32", gguf_file=SMOL_FILE)
        models.append(("smollm2", smol.module, smol_tokenizer, args.smol_lengths, args.smol_contexts,
                       args.smol_repeats))
    print(f"one thread; batch size {args.batch_size}; {args.queries} queries per context; prefix padding; "
          "predictions identical in every row")
    print(f"{'model':>8} {'workload':>9} {'tokens':>7} {'contexts':>8} {'prompts':>7} {'multi s':>8} {'single s':>9} "
          f"{'multi p/s':>10} {'single p/s':>10} {'speed-up':>8}")
    ratios = {}
    for name, model, tok, lengths, n_contexts, repeats in models:
        for workload in args.workloads:
            for length in lengths:
                eval_set = prompt_set(tok, workload, length, args.queries)
                if n_contexts:
                    eval_set = dataclasses.replace(eval_set, contexts=eval_set.contexts[:n_contexts])
                n = len(eval_set.queries())
                best = measure(model, eval_set, args.batch_size, repeats)
                ratio = best["single"] / best["multi_query"]
                ratios[f"speedup_{name}_{workload}_{length}"] = ratio
                print(f"{name:>8} {workload:>9} {eval_set.prompt_length:>7} {len(eval_set.contexts):>8} {n:>7} "
                      f"{best['multi_query']:8.2f} {best['single']:9.2f} {n / best['multi_query']:10.1f} "
                      f"{n / best['single']:10.1f} {ratio:8.2f}", flush=True)
    print(" ".join(f"{k}={v:.2f}" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
