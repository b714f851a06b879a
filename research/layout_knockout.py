"""Which layer carries a lookup model's retrieval in its own training layout?

    python research/layout_knockout.py CHECKPOINT [--sequences 64] [--seed 123]

`phasekv knockout` asks this on evaluation prompts, where a model that cannot do the task gives no answer (every
knockout of a model at chance costs nothing).  Some models retrieve in the layout they were trained on (records
directly followed by 32 queries) but not in the evaluation prompts (fillers between the records and the
demonstrations): this script measures them there.  It draws `--sequences` lookup sequences from the checkpoint's
own training stream (example indices past any training step), splits the supervised queries into first-time queries
(the value must come from the record) and repeated ones (an earlier query of the same key is closer), and prints
top-1 accuracy for each with nothing knocked out, with each whole attention layer knocked out and with each head of
it knocked out: the head's slice of the input of the layer's output projection is set to zero at every position.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from phasekv import families, load_checkpoint
from phasekv.adapters.phasekv import adapter_for
from phasekv.archs.base import text_config
from phasekv.checkpoint import read_experiment
from phasekv.config import Experiment
from phasekv.data.lookup import TrainingStream
from phasekv.data.vocab import Vocabulary
from phasekv.probes.hooks import output_projection

FIRST_HELD_OUT = 10_000_000  # stream index of the first sequence drawn: past every training example of the presets


def sequences(exp: Experiment, count: int, seed: int):
    """(ids, labels, first-time query mask, repeated query mask) of `count` lookup sequences."""
    stream = TrainingStream(Vocabulary.from_data_config(exp.data), exp.data, seed=seed)
    examples, index = [], FIRST_HELD_OUT
    while len(examples) < count:
        example = stream.example(index)
        index += 1
        if example.kind == "lookup":
            examples.append(example)
    ids = torch.tensor(np.stack([e.ids for e in examples]))
    labels = torch.tensor(np.stack([e.labels for e in examples]))
    first, repeated = torch.zeros_like(ids, dtype=torch.bool), torch.zeros_like(ids, dtype=torch.bool)
    last_key = exp.data.key_tokens - 1  # the query's logits at its last key token predict the first value token
    for row, example in enumerate(examples):
        seen: set[int] = set()
        for position, record, supervised in zip(example.query_positions, example.query_records, example.supervised):
            if supervised:
                (repeated if record in seen else first)[row, position + last_key] = True
            seen.add(record)
    return ids, labels, first, repeated


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
        parser.exit(2, f"layout_knockout: {error}\n")
    ids, labels, first, repeated = sequences(exp, args.sequences, args.seed)
    adapter = adapter_for(model, args.checkpoint)
    layers = adapter.attention_layers()
    config = text_config(model.config)
    heads = [getattr(attn, "num_heads", None) or config.num_attention_heads for attn in layers]

    def measure(tag: str, layer: int | None = None, knocked: list[int] = ()) -> None:
        handle = None
        if layer is not None:
            projection = output_projection(adapter, layers[layer])
            width = projection.in_features // heads[layer]

            def zero(module, inputs):
                x = inputs[0].clone()
                for head in knocked:
                    x[..., head * width:(head + 1) * width] = 0
                return (x, *inputs[1:])

            handle = projection.register_forward_pre_hook(zero)
        try:
            with torch.no_grad():
                hit = families.logits(model, ids).argmax(-1) == labels
        finally:
            if handle is not None:
                handle.remove()
        print(f"{tag:20s} first-time queries {100 * hit[first].float().mean():5.1f}%   repeated "
              f"{100 * hit[repeated].float().mean():5.1f}%", flush=True)

    print(f"{args.checkpoint}: {int(first.sum())} first-time and {int(repeated.sum())} repeated queries in "
          f"{args.sequences} training-layout sequences")
    measure("nothing knocked out")
    for layer in range(len(layers)):
        measure(f"layer {layer} whole", layer, list(range(heads[layer])))
        for head in range(heads[layer]):
            measure(f"layer {layer} head {head}", layer, [head])


if __name__ == "__main__":
    main()
