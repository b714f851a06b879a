"""Does a MiniMax-M3 checkpoint's block indexer select the block a lookup needs, in its own training layout?

    python research/minimax_m3_selection.py CHECKPOINT [--sequences 64] [--seed 123]

On `--sequences` held-out lookup sequences of the checkpoint's own training stream (research/layout_knockout.py's
sequences: first-time queries, whose value must come from the record), it prints top-1 accuracy on first-time
queries with the indexers as trained and with every block selected (`training.indexer_kl.dense_selection`: the main
attention dense, the same weights), then, per sparse layer, how often the query's selection keeps the target block
(the block holding the record's first value token), for any KV group and for each, overall and by the target's
phase (the value token's position mod the block size), with the chance a uniform pick of the non-local causal
blocks would have.  A model whose dense accuracy is far above its sparse accuracy is limited by its selection; one
at chance in both never formed the lookup.
"""

from __future__ import annotations

import argparse

import torch

from phasekv import families, load_checkpoint
from phasekv.archs.indexer_kl import dense_selection, indexers_of
from phasekv.checkpoint import read_experiment
from phasekv.config import Experiment
from phasekv.data.lookup import TrainingStream
from phasekv.data.vocab import Vocabulary

FIRST_HELD_OUT = 10_000_000  # as research/layout_knockout.py: past every training example of the presets


def targets(exp: Experiment, count: int, seed: int):
    """(ids (N, T), labels, [(row, query answer position, target value-token position)]) of first-time queries."""
    stream = TrainingStream(Vocabulary.from_data_config(exp.data), exp.data, seed=seed)
    examples, index = [], FIRST_HELD_OUT
    while len(examples) < count:
        example = stream.example(index)
        index += 1
        if example.kind == "lookup":
            examples.append(example)
    last_key, found = exp.data.key_tokens - 1, []
    for row, e in enumerate(examples):
        seen: set[int] = set()
        for position, record, supervised in zip(e.query_positions, e.query_records, e.supervised, strict=True):
            if supervised and record not in seen:
                found.append((row, position + last_key, e.record_positions[record] + exp.data.key_tokens))
            seen.add(record)
    ids = torch.tensor([e.ids.tolist() for e in examples])
    return ids, torch.tensor([e.labels.tolist() for e in examples]), found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--seed", type=int, default=123, help="training-stream seed (not the model's: held out)")
    args = parser.parse_args()
    if args.sequences < 1:
        parser.error(f"--sequences: must be >= 1, got {args.sequences}")
    torch.set_num_threads(1)
    try:
        model = load_checkpoint(args.checkpoint)[0].eval()
        exp = Experiment.from_tree(read_experiment(args.checkpoint))
    except (OSError, ValueError) as error:
        parser.exit(2, f"minimax_m3_selection: {error}\n")
    found = indexers_of(model)
    if not found or not hasattr(found[0][1], "topk_blocks"):
        parser.exit(2, f"minimax_m3_selection: {args.checkpoint} has no MiniMax-M3 block indexer\n")
    ids, labels, queries = targets(exp, args.sequences, args.seed)
    rows, answer, target = (torch.tensor(c) for c in zip(*queries, strict=True))
    picks: list[torch.Tensor] = []
    handles = [ix.register_forward_hook(lambda m, a, o: picks.append(o)) for _, ix, _ in found]
    try:
        with torch.no_grad():
            sparse = families.logits(model, ids).argmax(-1)
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad(), dense_selection(model, ids.shape[1]):
        dense = families.logits(model, ids).argmax(-1)
    hit = lambda pred: 100 * (pred[rows, answer] == labels[rows, answer]).float().mean()  # noqa: E731
    print(f"{args.checkpoint}: {len(queries)} first-time queries in {args.sequences} training-layout sequences")
    print(f"first-time accuracy: as trained {hit(sparse):5.1f}%   every block selected {hit(dense):5.1f}%")
    for (attn, ix, _), blocks in zip(found, picks, strict=True):
        b = ix.block_size
        chosen = blocks[rows, :, answer]  # (Q, groups, k)
        kept = (chosen == (target // b)[:, None, None]).any(-1)  # (Q, groups)
        free = answer // b - ix.local_blocks + 1  # non-local causal blocks
        chance = 100 * ((ix.topk_blocks - ix.local_blocks) / free.clamp(min=1).float()).clamp(max=1).mean()
        phase = target % b
        by_phase = " ".join(f"{100 * kept.any(-1)[phase == p].float().mean():.1f}" for p in range(b))
        groups = " ".join(f"{100 * kept[:, g].float().mean():.1f}" for g in range(kept.shape[1]))
        print(f"layer {attn.layer_idx}: target block kept {100 * kept.any(-1).float().mean():5.1f}% (any group; "
              f"per group {groups}; uniform pick {chance:.1f}%); by target phase 0..{b - 1}: {by_phase}")


if __name__ == "__main__":
    main()
