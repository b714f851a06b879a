"""`phasekv audit --hf DIR --context N --prefill-chunk C` at 16K-32K tokens on this machine: wall time and the peak
RSS of the audit process, against the adapter's own memory estimate (`adapters.hf.forward_bytes`).

DIR is a tiny random Llama built from its config (no download) with a byte-level BPE trained here
(`data.keyspace.train_bpe`), saved as safetensors: the model cannot do the task, so the audit stops at its
capability gate after the uncompressed condition, which is the whole long-context path (prompts streamed, each
prefilled in chunks, the key continued, per-depth statistics, the report).  Each context runs in its own process;
its peak RSS comes from the kernel (`os.wait4`, as /usr/bin/time -v reports it).  The first line is a short context
(1,024 tokens): its peak is the process's baseline (interpreter, torch, the model), and `growth` is the peak over it,
to compare with the estimate for the longer context minus the estimate for the short one.

    python benchmarks/longcontext_hf.py [--contexts 16384 32768] [--chunk 2048] [--hidden 64 --layers 2]

One line per context: context=... chunk=... wall_s=... peak_mib=... growth_mib=... estimate_growth_mib=...
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASELINE = 1024


def build(where: Path, hidden: int, layers: int, longest: int):
    """A tiny random Llama and its tokenizer saved in `where`; its config."""
    import torch
    import transformers

    from phasekv.data.keyspace import train_bpe

    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=train_bpe("byte-level"), bos_token="<s>",
                                                     eos_token="<s>")
    tokenizer.save_pretrained(where)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=hidden // 4, max_position_embeddings=longest + 64)
    transformers.LlamaForCausalLM(config).float().save_pretrained(where)
    return config


def audit(model: Path, context: int, chunk: int, out: Path) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one `phasekv audit --hf` process: one prompt of `context` tokens."""
    command = [sys.executable, "-m", "phasekv", "audit", "--hf", str(model), "--context", str(context),
               "--prefill-chunk", str(chunk), "--family", "records", "--stride", "1", "--depths", "0.5",
               "--prompts-per-phase", "1", "--protocol", "prefix", "--compress", "none", "--threads", "1",
               "--no-progress", "--out", str(out), "--force"]
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - start
    if status:
        raise SystemExit(f"audit at {context} tokens failed: {process.stderr.read().decode()[-2000:]}")
    return seconds, usage.ru_maxrss / 1024  # KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    from phasekv.adapters.hf import forward_bytes

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        config = build(model, args.hidden, args.layers, max(args.contexts))
        base_s, base = audit(model, BASELINE, args.chunk, Path(tmp) / "base")
        print(f"context={BASELINE} chunk={args.chunk} wall_s={base_s:.1f} peak_mib={base:.0f} (baseline)")
        for context in args.contexts:
            seconds, peak = audit(model, context, args.chunk, Path(tmp) / str(context))
            estimate = (forward_bytes(config, context, 1, 4, False, chunk=args.chunk)
                        - forward_bytes(config, BASELINE, 1, 4, False, chunk=args.chunk)) / 2**20
            print(f"context={context} chunk={args.chunk} wall_s={seconds:.1f} peak_mib={peak:.0f} "
                  f"growth_mib={peak - base:.0f} estimate_growth_mib={estimate:.0f}")


if __name__ == "__main__":
    main()
