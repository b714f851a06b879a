"""Peak memory and time of a chunked prefill against the one-shot prefill it replaces (HFAdapter(prefill_chunk=C)).

Each side runs in its own process (a fresh peak RSS): a tiny random transformers Llama built from its config
prefills one context of `--length` tokens with `--attention` (eager materializes (heads, T, T) scores, sdpa
does not) and continues one query; the peak RSS the prefill adds, its time, and the largest difference of the
query logits between the two sides are reported.

    python benchmarks/chunked_prefill.py [--length 4096] [--chunk 512] [--attention eager|sdpa]

Last line: name=value pairs (`one_shot_peak_mib=... chunked_peak_mib=... max_abs_diff=...`).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(length: int, chunk: int, attention: str, out: str) -> None:
    import torch
    import transformers

    from phasekv.adapters.hf import HFAdapter

    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=length + 8)
    model = transformers.LlamaForCausalLM(config).float()
    model.config._attn_implementation = attention
    adapter = HFAdapter(model, "llama", prefill_chunk=chunk)
    ids = torch.randint(0, 256, (1, length), generator=torch.Generator().manual_seed(1))
    query = torch.randint(0, 256, (1, 3), generator=torch.Generator().manual_seed(2))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    cache = adapter.prefill(ids)
    seconds = time.perf_counter() - start
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    torch.save(adapter.continue_from(cache, query, 1)[0, -1], out)
    print(json.dumps({"peak_mib": peak, "seconds": seconds}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--attention", default="eager", choices=("eager", "sdpa"))
    parser.add_argument("--child", nargs=2, metavar=("CHUNK", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.length, int(args.child[0]), args.attention, args.child[1])
        return
    import torch

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, chunk in (("one_shot", 0), ("chunked", args.chunk)):
            out = str(Path(tmp) / f"{name}.pt")
            run = subprocess.run([sys.executable, __file__, "--length", str(args.length), "--attention",
                                  args.attention, "--child", str(chunk), out], capture_output=True, text=True,
                                 check=True)
            results[name] = json.loads(run.stdout.strip().splitlines()[-1])
            results[name]["logits"] = torch.load(out)
    diff = (results["one_shot"]["logits"] - results["chunked"]["logits"]).abs().max().item()
    one, chunked = results["one_shot"], results["chunked"]
    print(f"{args.length} tokens, {args.attention} attention, chunks of {args.chunk}")
    print(f"one_shot_peak_mib={one['peak_mib']:.0f} chunked_peak_mib={chunked['peak_mib']:.0f} "
          f"one_shot_s={one['seconds']:.2f} chunked_s={chunked['seconds']:.2f} max_abs_diff={diff:.2e}")


if __name__ == "__main__":
    main()
