"""Time and peak memory of one compressed attention layer (W8/S8, local window 16) against one
full-attention layer of the same width, the attention core alone, and whole-model cache bytes per token.

Each measurement runs in a fresh subprocess so peak RSS is its own.  Prints a table and, last,
`core_ratio@16384=A time_ratio@16384=B time_ratio@65536=C memory_ratio@16384=D cache_ratio@16384=E`
(compressed / full).  The core ratio times `windowed_attention` against causal SDPA on the same q, k, v
(B=1, H=8, KVH=2, D=64), the two alternating, best of max(5, --repeats) each; the long length is timed
(best of 2, the two kinds alternating), without memory or cache measurements, at a quarter of the width
(2 query heads, 1 KV head, hidden 128) so that the whole run takes about three minutes.

    .venv/bin/python benchmarks/attention_scaling.py [--lengths 1024 4096 16384] [--long 65536] [--repeats 3]
                                                     [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

WIDTH = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
             vocab_size=256, num_hidden_layers=2)
LONG_WIDTH = dict(WIDTH, hidden_size=128, intermediate_size=384, num_attention_heads=2, num_key_value_heads=1)
COMPRESSED = dict(compressor="gated", window=8, stride=8, local_window=16)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(kind: str, T: int, repeats: int, cache: bool, width: dict) -> dict:
    import torch

    from phasekv.attention import Attention
    from phasekv.config import ModelConfig
    from phasekv.model import build_model

    torch.manual_seed(0)
    config = ModelConfig(**width, **(COMPRESSED if kind == "compressed" else {}), max_position_embeddings=T)
    layer = Attention(config, 0).eval()
    x = torch.randn(1, T, config.hidden_size)
    with torch.no_grad():
        layer(x[:, :64])  # warm up kernels
        base = _rss_bytes()
        seconds = _best(lambda: layer(x), repeats)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
        result = {"time_s": seconds, "peak_bytes": max(peak, 0)}
        if cache:
            model = build_model(config).eval()
            kv = model.new_cache()
            model(torch.randint(0, 256, (1, T)), cache=kv)
            result["cache_bytes_per_token"] = kv.nbytes() / T
    return result


def measure_core(T: int, repeats: int) -> dict:
    """The attention core alone: `windowed_attention` over the entries of a W8/S8 compressor vs causal SDPA."""
    import torch
    import torch.nn.functional as F

    from phasekv.attention import Visible, windowed_attention

    torch.manual_seed(0)
    H, KVH, D, L, S = WIDTH["num_attention_heads"], WIDTH["num_key_value_heads"], WIDTH["head_dim"], 16, 8
    q = torch.randn(1, H, T, D)
    k, v = torch.randn(1, KVH, T, D), torch.randn(1, KVH, T, D)
    n = T // S
    vis = Visible(torch.randn(1, KVH, n, D), torch.randn(1, KVH, n, D), torch.arange(n) * S + S - 1)
    k_all = torch.cat([k.new_zeros(1, KVH, L - 1, D), k], dim=2)  # (1, KVH, L-1+T, D)
    v_all = torch.cat([v.new_zeros(1, KVH, L - 1, D), v], dim=2)
    k_pos = torch.cat([torch.full((L - 1,), -1), torch.arange(T)])
    qg = q.view(1, KVH, H // KVH, T, D)  # (1, KVH, G, T, D)
    full, core = [], []
    with torch.no_grad():  # alternating, so that a drift of the machine's speed hits both alike
        for _ in range(repeats):
            full.append(_best(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), 1))
            core.append(_best(lambda: windowed_attention(qg, torch.arange(T), k_all, v_all, k_pos, local=L, vis=vis,
                                                         sink=None, tail=None, block=128), 1))
    return {"full_s": min(full), "compressed_s": min(core)}


# glibc serves every allocation of 128 KiB or more by mmap and returns it on free, so peak RSS is the peak of
# live tensors: with its default dynamic threshold, freed blocks up to 32 MiB stay in the heap and the peak
# depends on the allocation history (measured: the same layer's peak varied by 20-40% between runs)
CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}


def _child(threads: int, *args: str, memory: bool = False) -> dict:
    """One measurement in a fresh process; `memory`: with CHILD_ENV (peak RSS = peak of live tensors; timed
    without it, since mmap-per-allocation page faults slow the many small allocations of a block loop)."""
    out = subprocess.run([sys.executable, __file__, "--threads", str(threads), "--child", *args], check=True,
                         capture_output=True, text=True, env={**os.environ, **(CHILD_ENV if memory else {})}).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--long", type=int, default=65536, help="timed (best of 2) per kind, whole layer (0: skip)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: PyTorch's default)")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        kind, T, repeats, mode = args.child[0], int(args.child[1]), int(args.child[2]), args.child[3]
        print(json.dumps(measure_core(T, repeats) if kind == "core" else
                         measure(kind, T, repeats, mode == "cache", LONG_WIDTH if mode == "long" else WIDTH)))
        return
    T = args.lengths[-1]
    rows = {(kind, n): _child(args.threads, kind, str(n), str(args.repeats), "cache" if n == T else "plain")
            for n in args.lengths for kind in ("full", "compressed")}
    for (kind, n), row in rows.items():
        row["peak_bytes"] = _child(args.threads, kind, str(n), "1", "plain", memory=True)["peak_bytes"]
    if args.long:  # best of 2 per kind, the kinds alternating (full, compressed, full, compressed): one child each
        runs = [(kind, _child(args.threads, kind, str(args.long), "1", "long")) for _ in range(2)
                for kind in ("full", "compressed")]
        rows.update({(kind, args.long): min((r for k, r in runs if k == kind), key=lambda r: r["time_s"])
                     for kind in ("full", "compressed")})
    core = _child(args.threads, "core", str(T), str(max(args.repeats, 5)), "plain")
    print(f"{'T':>6} {'kind':>10} {'time ms':>9} {'peak MiB':>9} {'cache B/tok':>11}")
    for (kind, n), r in rows.items():
        print(f"{n:>6} {kind:>10} {r['time_s'] * 1e3:9.1f} {r['peak_bytes'] / 2**20:9.1f} "
              f"{r.get('cache_bytes_per_token', float('nan')):11.1f}")
    print(f"core at T={T}: causal SDPA {core['full_s'] * 1e3:.1f} ms, compressed {core['compressed_s'] * 1e3:.1f} ms")
    print(f"{'T':>6} {'time':>9} {'memory':>9} {'work (16+T/8)/T':>16}  (ratios compressed/full; "
          f"T={args.long}: quarter width, time only)")
    ratio = {}
    for n in sorted({n for _, n in rows}):
        c, f = rows["compressed", n], rows["full", n]
        ratio[n] = (c["time_s"] / f["time_s"], c["peak_bytes"] / max(f["peak_bytes"], 1))
        print(f"{n:>6} {ratio[n][0]:9.3f} {ratio[n][1]:9.3f} {(16 + n / 8) / n:16.3f}")
    cache = rows["compressed", T]["cache_bytes_per_token"] / rows["full", T]["cache_bytes_per_token"]
    long = f" time_ratio@{args.long}={ratio[args.long][0]:.3f}" if args.long else ""
    print(f"core_ratio@{T}={core['compressed_s'] / core['full_s']:.3f} time_ratio@{T}={ratio[T][0]:.3f}{long} "
          f"memory_ratio@{T}={ratio[T][1]:.3f} cache_ratio@{T}={cache:.3f}")


if __name__ == "__main__":
    main()
