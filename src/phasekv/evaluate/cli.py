"""`phasekv eval`: the phase-sensitivity evaluation of a phasekv checkpoint or any HF causal LM.

    phasekv eval --checkpoint DIR --protocol prefix --out OUT
    phasekv eval --hf PATH --protocol insequence --stride 4 --out OUT
    torchrun --nproc_per_node=8 -m phasekv.cli eval --hf PATH ...   (contexts sharded over ranks)

For a checkpoint, the number of records, the vocabulary and the local window default to those of
its training data (tested in distribution); the paper's 64 records + 8 demonstrations is the
default for HF models and is always available with --records 64 --demos 8.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from phasekv.checkpoint import load_checkpoint, read_experiment
from phasekv.data.protocols import PROTOCOLS, EvalSet, build_eval_set
from phasekv.data.vocab import Vocabulary
from phasekv.evaluate.adapter import Adapter, PhaseKVAdapter
from phasekv.evaluate.runner import evaluate

DEFAULT_STRIDE = 8  # phase stride assumed for models without compression (override with --stride)


def checkpoint_eval_defaults(path: str | Path) -> dict[str, Any]:
    """Eval-set settings that test a checkpoint in distribution (from its training data)."""
    tree = read_experiment(path)
    data = tree.get("data", {})
    if "vocab" not in tree:
        raise ValueError(f"checkpoint {path}: config.json has no 'vocab' (not written by phasekv train)")
    return {"vocab": Vocabulary.from_dict(tree["vocab"]), "n_records": data.get("n_records", 64),
            "key_tokens": data.get("key_tokens", 1), "value_tokens": data.get("value_tokens", 1),
            "local_window": tree["model"].get("local_window", 16)}


def open_checkpoint(path: str | Path, device: str = "cpu") -> tuple[PhaseKVAdapter, dict[str, Any]]:
    model, config = load_checkpoint(path, device=device)
    return PhaseKVAdapter(model, name=Path(path).resolve().name), checkpoint_eval_defaults(path)


def make_eval_set(adapter: Adapter, vocab, protocol: str, stride: int | None = None, **settings) -> EvalSet:
    """The prompt set for `adapter`; stride defaults to the model's compression stride."""
    stride = stride or adapter.info.stride or DEFAULT_STRIDE
    eval_set = build_eval_set(vocab, protocol, stride=stride, **settings)
    adapter.check_length(eval_set.prompt_length)
    return eval_set


def _shard(eval_set: EvalSet) -> tuple[EvalSet, int, int]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return eval_set, 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank = dist.get_rank()
    return dataclasses.replace(eval_set, contexts=eval_set.contexts[rank::world]), rank, world


def add_source_arguments(p, hf_help: str = "transformers causal LM: local directory or hub name") -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="phasekv checkpoint or run directory")
    src.add_argument("--hf", help=hf_help)


def add_prompt_arguments(p) -> None:
    """The flags that choose a model and build its prompt set (shared by eval and the probes)."""
    p.add_argument("--protocol", choices=PROTOCOLS, default="prefix")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--stride", type=int, help="phase stride S (default: the model's; 8 without compression)")
    p.add_argument("--residue-modulus", type=int, default=24)
    p.add_argument("--records", type=int, help="records per prompt (checkpoint: its training value; HF: 64)")
    p.add_argument("--demos", type=int, default=8)
    p.add_argument("--clusters", type=int, help="logical examples (default: exact position matching)")
    p.add_argument("--targets-per-context", type=int)
    p.add_argument("--key-tokens", type=int, help="tokens per key (needle test: 2 keys + 2 values = 4)")
    p.add_argument("--value-tokens", type=int)
    p.add_argument("--local-window", type=int, help="targets lie outside this many final tokens (HF default 16)")
    p.add_argument("--batch-size", type=int, help="query rows per forward (default: 256 checkpoints, 32 HF)")
    p.add_argument("--one-by-one", action="store_true", help="one forward per prompt (no shared prefill)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", help="HF models: torch dtype, e.g. bfloat16")
    p.add_argument("--device-map", help="HF models: e.g. 'auto' to spread a large model over GPUs")
    p.add_argument("--no-progress", action="store_true")


def open_source(args) -> tuple[Adapter, EvalSet]:
    """The adapter (--checkpoint or --hf) and the prompt set the flags describe."""
    if args.batch_size is None:
        args.batch_size = 32 if getattr(args, "hf", None) else 256
    if args.batch_size < 1:
        raise ValueError(f"--batch-size: must be >= 1, got {args.batch_size}")
    if getattr(args, "hf", None):
        from phasekv.evaluate.hf import TokenizerVocabulary, load_hf

        adapter, tokenizer = load_hf(args.hf, args.device, args.dtype, args.device_map, stride=args.stride,
                                     local_window=args.local_window)
        defaults: dict[str, Any] = {"n_records": 64, "key_tokens": 1, "value_tokens": 1, "local_window": 16}
        n = args.records or defaults["n_records"]
        vocab = TokenizerVocabulary(tokenizer, {"keys": _words_needed(n, args.key_tokens or 1), "values": 16,
                                                "fillers": 8})
    else:
        adapter, defaults = open_checkpoint(args.checkpoint, args.device)
        vocab = defaults.pop("vocab")
    settings = {
        "n_records": args.records or defaults["n_records"], "n_demos": args.demos,
        "residue_modulus": args.residue_modulus, "n_clusters": args.clusters,
        "targets_per_context": args.targets_per_context,
        "key_tokens": args.key_tokens or defaults["key_tokens"],
        "value_tokens": args.value_tokens or defaults["value_tokens"],
        "local_window": args.local_window or defaults["local_window"], "seed": args.seed,
    }
    return adapter, make_eval_set(adapter, vocab, args.protocol, args.stride, **settings)


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="accuracy by phase/residue of the lookup task, with intervals")
    add_source_arguments(p)
    add_prompt_arguments(p)
    p.set_defaults(func=run_eval_command)


def run_eval_command(args) -> dict[str, Any]:
    adapter, eval_set = open_source(args)
    shard, rank, world = _shard(eval_set)
    if world == 1:
        return evaluate(adapter, eval_set, args.out, args.batch_size, not args.one_by_one, args.seed,
                        progress=not args.no_progress)
    import torch.distributed as dist

    from phasekv.evaluate.runner import predict, write_run

    records = predict(adapter, shard, args.batch_size, not args.one_by_one, progress=rank == 0 and not args.no_progress)
    gathered = [None] * world
    dist.all_gather_object(gathered, records)
    metrics = {}
    if rank == 0:
        # rank r holds contexts r, r + world, ...: restore the original query order
        ordered, cursors = [], [0] * world
        for i, context in enumerate(eval_set.contexts):
            r, n_q = i % world, len(context.queries)
            ordered.extend(gathered[r][cursors[r]:cursors[r] + n_q])
            cursors[r] += n_q
        metrics = write_run(adapter, eval_set, ordered, args.out, args.seed)
    dist.barrier()
    dist.destroy_process_group()
    return metrics


def _words_needed(n_records: int, key_tokens: int) -> int:
    """Single-token key words needed for n_records distinct keys of key_tokens tokens."""
    k = 1
    while k ** key_tokens < n_records:
        k += 1
    return max(k, 2)
