"""`phasekv demo`: a one-minute look at what chunked compression does to the cache.

Builds a tiny full-attention model and its W8/S8 compressed twin, prefills the same random
context into both caches, and prints which positions (and phases) each compressed entry covers
and how many bytes each cache holds (a command's body: its whole output is its printout).
"""

from __future__ import annotations

MAX_TOKENS = 1 << 16  # two tiny models' caches and activations stay well under 1 GiB


def run_demo(tokens: int = 4096, window: int = 8, stride: int = 8) -> dict[str, float]:
    if not 2 * window <= tokens <= MAX_TOKENS:
        raise ValueError(f"--tokens: must be in [{2 * window}, {MAX_TOKENS}], got {tokens}")
    import torch

    from phasekv.config import ModelConfig
    from phasekv.model import build_model

    torch.manual_seed(0)
    base = dict(max_position_embeddings=tokens + 1)
    full = build_model(ModelConfig(**base)).eval()
    comp = build_model(ModelConfig(compressor="gated", window=window, stride=stride, **base)).eval()
    ids = torch.randint(0, full.config.vocab_size, (1, tokens))
    sizes = {}
    with torch.no_grad():
        for name, model in (("full", full), ("compressed", comp)):
            cache = model.new_cache()
            model(ids, cache=cache)
            sizes[name] = cache.nbytes()
    ends = cache.layers[0].entries_end[:4].tolist()
    print(f"W{window}/S{stride}: entry j covers positions [j*S, j*S+W-1]; first entries end at {ends}")
    print("a token's phase = position mod S; tokens of one phase always sit at the same offset of an entry")
    print(f"cache after {tokens} tokens: full {sizes['full'] / 1024:.0f} KiB, "
          f"compressed {sizes['compressed'] / 1024:.0f} KiB, ratio {sizes['compressed'] / sizes['full']:.3f} "
          f"(work ratio (16 + T/S)/T = {(16 + tokens / stride) / tokens:.3f})")
    return {"cache_ratio": sizes["compressed"] / sizes["full"]}


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="show a compressed cache next to a full one")
    p.add_argument("--tokens", type=int, default=4096)
    p.set_defaults(func=run)


def run(args) -> None:
    run_demo(args.tokens)
