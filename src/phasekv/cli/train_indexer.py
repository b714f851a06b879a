"""`phasekv train-indexer --hf DIR [--gguf-file NAME] [--kind glm5|minimax] --pool 4 --out OUT`: transformers'
GLM-5.3 k-pool indexer (`Glm5NextTextIndexer`) or MiniMax-M3 block indexer (`MiniMaxM3VLIndexer`, one head per KV
group), one per layer, distilled onto a frozen dense LM (`phasekv.training.distill_indexer`); OUT then serves
`phasekv audit --compress none kpool:pool=4,...,indexer=distilled:OUT` (heads=kv for minimax).  The work is kept in
OUT/.partial (`phasekv.outputs.partial_dir`) until it is complete (a killed run, run again with the same flags,
resumes from the features it had computed; --force starts over) and then published as OUT in its place."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def add_parser(sub) -> None:
    p = sub.add_parser("train-indexer", help="distil a GLM-5.3 k-pool or MiniMax-M3 block indexer onto a frozen "
                                             "transformers LM")
    p.add_argument("--kind", choices=("glm5", "minimax"), default="glm5",
                   help="glm5: Glm5NextTextIndexer, one selection for all heads; minimax: MiniMaxM3VLIndexer, one "
                        "head and one selection per KV group")
    p.add_argument("--hf", required=True, help="transformers causal LM: local directory")
    p.add_argument("--gguf-file", help="load this GGUF file inside --hf (needs the gguf extra: make real-model)")
    p.add_argument("--pool", type=int, default=4, help="tokens per pool (GLM-5.3: 4)")
    p.add_argument("--heads", type=int, help="indexer heads (default: glm5 4, minimax the model's KV heads)")
    p.add_argument("--head-dim", type=int, help="indexer head dimension (default: glm5 32, minimax the model's)")
    p.add_argument("--sequences", type=int, default=64, help="training sequences of the corpus")
    p.add_argument("--held-out", type=int, default=16, help="held-out sequences (KL and recall before and after)")
    p.add_argument("--length", type=int, default=384, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--batch", type=int, default=2, help="sequences per step")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--out", required=True, help="output directory (indexer.safetensors, indexer.json)")
    p.add_argument("--force", action="store_true", help="replace an existing non-empty --out")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args) -> dict[str, Any]:
    from dataclasses import replace

    import torch

    from phasekv.adapters.hf import load_hf
    from phasekv.archs.base import text_config
    from phasekv.conditions.selection.scorers import CONFIG_FILE, WEIGHTS_FILE
    from phasekv.outputs import check_output_dir, output_dir, partial_dir
    from phasekv.training.distill_indexer import IndexerTraining, train_indexer

    if not 0 < args.lr < float("inf"):
        raise ValueError(f"--lr: must be a finite number > 0, got {args.lr}")
    cfg = IndexerTraining(kind=args.kind, pool=args.pool, heads=args.heads or 4, head_dim=args.head_dim or 32,
                          sequences=args.sequences, held_out=args.held_out, length=args.length, steps=args.steps,
                          batch=args.batch, lr=args.lr, seed=args.seed)  # checked before loading anything
    out = Path(args.out)
    check_output_dir(out, args.force, resume=True)  # before loading anything; an interrupted run's work continues
    if args.threads:
        torch.set_num_threads(args.threads)
    adapter, tokenizer = load_hf(args.hf, gguf_file=args.gguf_file)
    if args.kind == "minimax":  # one indexer head per KV group, the model's head dimension (its RoPE)
        text = text_config(adapter.module.config)
        cfg = replace(cfg, heads=args.heads or text.num_key_value_heads,
                      head_dim=args.head_dim or getattr(text, "head_dim", None)
                      or text.hidden_size // text.num_attention_heads)
    work = partial_dir(out, force=args.force, resume=not args.force)
    config = train_indexer(adapter.module, tokenizer, work, cfg, model_name=adapter.info.name,
                           progress=not args.no_progress)
    with output_dir(out, args.force, resume=True) as tmp:  # in place of the work (the features: a resume cache)
        for name in (WEIGHTS_FILE, CONFIG_FILE):
            (work / name).replace(tmp / name)
    return config
