"""Which layout factor carries a model's residue pattern under prefix padding?

    python research/layout_factors.py CHECKPOINT [--variants prefix,no-post,...] [--out DIR] [--n-boot 1000]

Prefix padding (`phasekv.data.protocols`) shows every (example, target) pair at 24 shifts s: f + s fillers before
the records (the leading fillers L), E - L after them (the post fillers, before the demonstrations), so the query
position is fixed.  Target depth is balanced across residue groups, but within one record the residue, L, the post
fillers, the target's distance to the query and the filler words next to the records all move together.  This
script keeps the prefix set's logical examples (records, target records, filler words, demonstrations) and lays
each context out again with one factor changed (the others held):

    prefix     the protocol's own layout (L before, E - L after the records): must reproduce `phasekv eval`
    no-post    L before the records, none after: the records are followed by the demonstrations as in training,
               the prompt ends E - L tokens earlier (target positions as in prefix, distance to the query fixed
               per record)
    mid        L before the records, none after, E - L between the demonstrations and the target key: target
               and query positions as in prefix, but the records are followed directly by the demonstrations
    post-only  f before the records, s after: every target at its shift-0 position, the post fillers vary
    lead-fixed f + 12 before (fixed), s after the records: like post-only, behind a longer fixed lead (so the
               first tokens differ) - tests whether the sink region matters
    random     prefix layout, filler words drawn afresh for every (example, shift)
    one-filler prefix layout, every filler the same word

For each variant it prints the accuracy, the residue gap (max - min, pp), the selection-free cross-fitted gap with
its cluster-bootstrap 95% interval, the flatness p-value and the accuracy of the last `--tail` records against the
others (and the residue gap of the others), and with `--out` writes DIR/VARIANT.jsonl (one record per prompt: the
runner's fields plus lead, post and mid).  `--by-post` adds, for the last records, accuracy by post-filler count
(bins of 4).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import torch

from phasekv.data.lookup import assemble, filler_tokens
from phasekv.data.protocols import Context, EvalSet
from phasekv.evaluate.metrics import summarize
from phasekv.evaluate.runner import predict
from phasekv.evaluate.sources import Source, eval_config, open_source

VARIANTS = ("prefix", "no-post", "mid", "post-only", "lead-fixed", "random", "one-filler")


def _pieces(context: Context, n_demos: int) -> tuple[list[int], list[int], list[int]]:
    """(record keys, record values, filler words in order) of a prefix context with 1-token keys and values:
    the fillers are every token between <bos> and the demonstrations that is not a record's."""
    record_tokens = {p for r in context.record_positions for p in (r, r + 1)}
    end = len(context.ids) - 2 * n_demos
    fillers = [t for p, t in enumerate(context.ids[1:end], start=1) if p not in record_tokens]
    return ([context.ids[p] for p in context.record_positions], [context.ids[p + 1] for p in context.record_positions],
            fillers)


def _layout(variant: str, f: int, s: int, total: int) -> tuple[int, int, int]:
    """(fillers before the records, after them, between the demonstrations and the target key)."""
    lead = f + s
    return {"prefix": (lead, total - lead, 0), "no-post": (lead, 0, 0), "mid": (lead, 0, total - lead),
            "post-only": (f, s, 0), "lead-fixed": (f + 12, s, 0), "random": (lead, total - lead, 0),
            "one-filler": (lead, total - lead, 0)}[variant]


def relayout(eval_set: EvalSet, variant: str, seed: int = 0) -> tuple[EvalSet, list[tuple[int, int, int]]]:
    """`eval_set` (prefix, 1-token keys and values, no prompt format) laid out as `variant` says; also the
    (lead, post, mid) filler counts of every query, in `queries()` order."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: unknown {variant!r}; choose from {VARIANTS}")
    settings = eval_set.settings
    if (eval_set.protocol != "prefix" or settings["key_tokens"] != 1 or settings["value_tokens"] != 1
            or eval_set.vocab.header or eval_set.vocab.tail or eval_set.vocab.haystack_tokens):
        raise ValueError("relayout: needs a prefix set of 1-token keys and values without a prompt format")
    vocab, n_demos, g = eval_set.vocab, settings["n_demos"], settings["families"]
    total = (g - 1) + (eval_set.residue_modulus - 1)
    contexts, counts = [], []
    for context in eval_set.contexts:
        keys, values, fillers = _pieces(context, n_demos)
        f, s = context.cluster % g, context.shift
        if variant == "random":
            fillers = filler_tokens(np.random.default_rng([seed, context.cluster, s]), vocab, total).tolist()
        elif variant == "one-filler":
            fillers = [vocab.group("fillers")[0]] * total
        lead, post, mid = _layout(variant, f, s, total)
        words = np.asarray((fillers * 2)[:lead + post + mid])  # lead-fixed needs up to f + 12 + s words
        gaps = [lead] + [0] * (len(keys) - 1) + [post]
        layout = assemble(vocab.bos, np.asarray(keys)[:, None], np.asarray(values)[:, None], gaps, words,
                          context.demo_records)
        ids = layout.ids + words[lead + post:].tolist()  # the mid fillers, right before the target key
        queries = []
        for q in context.queries:
            pos = layout.record_positions[q.record]
            queries.append(dataclasses.replace(q, target_position=pos, residue=pos % eval_set.residue_modulus,
                                               phase=pos % eval_set.stride, query_position=len(ids)))
            counts.append((lead, post, mid))
        contexts.append(Context(ids, queries, context.cluster, s, layout.record_positions, context.demo_records))
    return dataclasses.replace(eval_set, contexts=contexts), counts


def _interval(ci) -> str:
    return "[-]" if ci is None else f"[{ci[0]:.1f}, {ci[1]:.1f}]"


def report(name: str, records: list[dict], eval_set: EvalSet, tail: int, n_boot: int) -> str:
    """One line: accuracy, gap, cross-fitted gap [95%], flatness p, worst / best residue, last records vs others
    (and the others' residue gap, pp)."""
    m = summarize(records, eval_set.stride, eval_set.residue_modulus, n_boot=n_boot, n_perm=n_boot)
    first_tail = eval_set.settings["n_records"] - tail
    last = [r["correct"] for r in records if r["record"] >= first_tail]
    rest = [r["correct"] for r in records if r["record"] < first_tail]
    by_residue = [[r["correct"] for r in records if r["record"] < first_tail and r["residue"] == g]
                  for g in range(eval_set.residue_modulus)]
    rest_gap = 100 * (max(map(np.mean, by_residue)) - min(map(np.mean, by_residue)))
    return (f"{name:11s} acc {100 * m['mean_accuracy']:5.1f}  gap {m['max_gap_pp']:5.1f}  crossfit "
            f"{m['gap_crossfit_pp']:5.1f} {_interval(m['gap_crossfit_ci_pp']):14s} flat p {m['flatness_p']:.4f}  "
            f"worst r{m['worst_residue']:<2d} best r{m['best_residue']:<2d}  last {tail} records "
            f"{100 * np.mean(last):5.1f}  others {100 * np.mean(rest):5.1f} (their gap {rest_gap:4.1f})")


def by_post(records: list[dict], first_tail: int, n_records: int) -> list[str]:
    """Accuracy (%) of each of the last records by post-filler count, bins of 4 (0-3, 4-7, ..., 20-24)."""
    lines = []
    for i in range(first_tail, n_records):
        cells = []
        for b in range(6):
            hits = [r["correct"] for r in records if r["record"] == i and min(r["post"] // 4, 5) == b]
            cells.append(f"{100 * np.mean(hits):4.0f}" if hits else "   -")
        lines.append(f"  record {i}: " + " ".join(cells))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tail", type=int, default=6, help="how many of the last records to report apart")
    parser.add_argument("--n-boot", type=int, default=1000)
    parser.add_argument("--by-post", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    source = Source(checkpoint=args.checkpoint)
    adapter, base = open_source(source, eval_config(source, {"protocol": "prefix", "device": "cpu"}))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    n_records = base.settings["n_records"]
    for name in args.variants.split(","):
        eval_set, counts = relayout(base, name)
        records = predict(adapter, eval_set, progress=False)
        for r, (lead, post, mid) in zip(records, counts, strict=True):
            r.update(lead=lead, post=post, mid=mid)
        print(report(name, records, eval_set, args.tail, args.n_boot), flush=True)
        if args.by_post:
            print("\n".join(by_post(records, n_records - args.tail, n_records)), flush=True)
        if args.out:
            with open(args.out / f"{name}.jsonl", "w") as out:
                out.writelines(json.dumps(r, sort_keys=True) + "\n" for r in records)


if __name__ == "__main__":
    main()
