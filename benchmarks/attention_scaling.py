"""Time and peak memory of one compressed attention layer (W8/S8, local window 16) against one
full-attention layer of the same width, and whole-model cache bytes per token.

Each (kind, T) runs in a fresh subprocess so peak RSS is its own.  Prints a table and, last,
`time_ratio@16384=X memory_ratio@16384=Y cache_ratio@16384=Z` (compressed / full).

    .venv/bin/python benchmarks/attention_scaling.py [--lengths 1024 4096 16384] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

WIDTH = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             vocab_size=256, num_hidden_layers=2)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure(kind: str, T: int, repeats: int) -> dict:
    import torch

    from phasekv.attention import Attention
    from phasekv.config import ModelConfig
    from phasekv.model import build_model

    torch.manual_seed(0)
    comp = dict(compressor="gated", window=8, stride=8, local_window=16) if kind == "compressed" else {}
    config = ModelConfig(**WIDTH, **comp, max_position_embeddings=T)
    layer = Attention(config, 0).eval()
    x = torch.randn(1, T, config.hidden_size)
    with torch.no_grad():
        layer(x[:, :64])  # warm up kernels
        times = []
        base = _rss_bytes()
        for _ in range(repeats):
            t0 = time.perf_counter()
            layer(x)
            times.append(time.perf_counter() - t0)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
        model = build_model(config).eval()
        cache = model.new_cache()
        model(torch.randint(0, 256, (1, T)), cache=cache)
    return {"time_s": min(times), "peak_bytes": max(peak, 0), "cache_bytes_per_token": cache.nbytes() / T}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child[0], int(args.child[1]), args.repeats)))
        return
    rows = {}
    for T in args.lengths:
        for kind in ("full", "compressed"):
            out = subprocess.run([sys.executable, __file__, "--child", kind, str(T), "--repeats", str(args.repeats)],
                                 check=True, capture_output=True, text=True).stdout
            rows[kind, T] = json.loads(out.strip().splitlines()[-1])
    print(f"{'T':>6} {'kind':>10} {'time ms':>9} {'peak MiB':>9} {'cache B/tok':>11}")
    for (kind, T), r in rows.items():
        print(f"{T:>6} {kind:>10} {r['time_s'] * 1e3:9.1f} {r['peak_bytes'] / 2**20:9.1f} "
              f"{r['cache_bytes_per_token']:11.1f}")
    print(f"{'T':>6} {'time':>9} {'memory':>9} {'cache':>9} {'work (16+T/8)/T':>16}  (ratios compressed/full)")
    ratios = {}
    for T in args.lengths:
        c, f = rows["compressed", T], rows["full", T]
        ratios[T] = (c["time_s"] / f["time_s"], c["peak_bytes"] / max(f["peak_bytes"], 1),
                     c["cache_bytes_per_token"] / f["cache_bytes_per_token"])
        print(f"{T:>6} {ratios[T][0]:9.3f} {ratios[T][1]:9.3f} {ratios[T][2]:9.3f} {(16 + T / 8) / T:16.3f}")
    T = args.lengths[-1]
    print(f"time_ratio@{T}={ratios[T][0]:.3f} memory_ratio@{T}={ratios[T][1]:.3f} cache_ratio@{T}={ratios[T][2]:.3f}")


if __name__ == "__main__":
    main()
