"""Batched evaluation of a prompt set: full-vocabulary top-1 of the answer at the query position.

Two equivalent strategies (tested to agree):
  - multi-query: contexts are prefilled once, in batches, and each context's queries continue from
    its cache (one short forward per query instead of one long one), read in place (phasekv models
    and full-attention transformers models, `phasekv.adapters`); the leading tokens every
    context shares are handed to adapters that declare `shares_prefix`, which prefill them once;
  - one-by-one: every full prompt is its own forward pass (the reference, and the fallback).
`evaluate` writes the run's files: metrics.json (schema in docs/results.md), predictions.jsonl and
accuracy_by_residue.png (under the query protocol also the query-phase statistics and
accuracy_by_source_and_query_phase.png).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from phasekv import distributed
from phasekv.adapters.base import Adapter
from phasekv.config import EvalConfig
from phasekv.data.protocols import EvalSet
from phasekv.evaluate.metrics import summarize
from phasekv.evaluate.sources import Source, batch_size, open_source
from phasekv.evaluate.verdict import pair_period, query_phase_statistics, target_pairs, task_verdict
from phasekv.figures.evaluation import plot_accuracy_by_residue, plot_cross_phase_heatmap
from phasekv.outputs import METRICS_SCHEMA_VERSION, check_output_dir, output_dir, write_json, write_jsonl

log = logging.getLogger(__name__)


def _batches(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


def _contexts_per_batch(adapter: Adapter, batch_size: int, n_q: int) -> int:
    """Contexts per prefill: an adapter that continues many contexts' queries at once (`shares_cache`) takes
    batch_size contexts, as many prompts as a one-by-one forward; others about batch_size query rows."""
    return batch_size if adapter.shares_cache else max(1, batch_size // n_q)


def _common_prefix(rows: list[list[int]]) -> int:
    """The number of leading tokens all rows share."""
    first, n = rows[0], min(len(r) for r in rows)
    for row in rows[1:]:
        n = next((i for i, (a, b) in enumerate(zip(first[:n], row[:n])) if a != b), n)
    return n


def _top1(logits: torch.Tensor) -> list[int]:
    """Argmax of the final position's logits (B, t, V); a non-finite logit stops the evaluation."""
    last = logits[:, -1]
    if not torch.isfinite(last).all():
        raise ValueError("model produced non-finite logits (NaN or inf): its weights or config are broken "
                         "(e.g. NaN weights, rope_theta or rms_norm_eps); refusing to report accuracies")
    return last.argmax(-1).tolist()


def predict(adapter: Adapter, eval_set: EvalSet, batch_size: int = 32, multi_query: bool = True,
            progress: bool = True, desc: str = "eval") -> list[dict[str, Any]]:
    """One record per query, in `eval_set.queries()` order: position metadata, prediction, correct."""
    adapter.check_length(eval_set.prompt_length)
    # the bars are closed (and, with leave=False, erased) even when an error stops the loop, so the
    # error is the only line left on the terminal
    if multi_query:
        contexts = eval_set.contexts
        # contexts of one batch must share their number of queries, key length and length (the query protocol's
        # contexts differ in length)
        groups: dict[tuple[int, int, int], list[int]] = {}
        for i, c in enumerate(contexts):
            groups.setdefault((len(c.queries), len(c.queries[0].key), len(c.ids)), []).append(i)
        by_context: dict[int, list[int]] = {}
        # adapters of the original interface (duck-typed ones too) have no shares_prefix
        prefix = _common_prefix([c.ids for c in contexts]) if getattr(adapter, "shares_prefix", False) else 0
        with tqdm(total=len(eval_set.queries()), desc=desc, unit="prompt", disable=not progress,
                  leave=False) as bar:
            for (n_q, _, _), members in groups.items():
                for chunk in _batches(members, _contexts_per_batch(adapter, batch_size, n_q)):
                    ids = torch.tensor([contexts[i].ids for i in chunk])
                    cache = adapter.prefill(ids, prefix=prefix) if prefix else adapter.prefill(ids)
                    qids = torch.tensor([list(q.key) for i in chunk for q in contexts[i].queries])
                    top = _top1(adapter.continue_from(cache, qids, n_q))
                    del cache  # freed before the next prefill: one batch of caches in memory at a time
                    for j, i in enumerate(chunk):
                        by_context[i] = top[j * n_q:(j + 1) * n_q]
                    bar.update(len(qids))
        preds = [p for i in range(len(contexts)) for p in by_context[i]]
    else:
        prompts = eval_set.prompts()
        by_length: dict[int, list[int]] = {}  # a batch holds prompts of one length
        for i, p in enumerate(prompts):
            by_length.setdefault(len(p.ids), []).append(i)
        chunks = [chunk for members in by_length.values() for chunk in _batches(members, batch_size)]
        preds = [0] * len(prompts)
        # the last position's logits only; an adapter of the original interface gives all of them
        last_logits = getattr(adapter, "next_logits", adapter.logits)
        with tqdm(total=len(chunks), desc=desc, unit="batch", disable=not progress, leave=False) as bar:
            for chunk in chunks:
                for i, pred in zip(chunk, _top1(last_logits(torch.tensor([prompts[i].ids for i in chunk]))),
                                   strict=True):
                    preds[i] = pred
                bar.update()
    records = []
    for q, pred in zip(eval_set.queries(), preds, strict=True):
        answer_position = q.target_position + len(q.key)  # the record's first value token
        records.append({"target_position": q.target_position, "residue": q.residue, "phase": q.phase,
                        "answer_position": answer_position, "answer_phase": answer_position % eval_set.stride,
                        "protocol": q.protocol, "shift": q.shift, "cluster": q.cluster, "record": q.record,
                        "query_position": q.query_position, "query_phase": q.query_position % eval_set.stride,
                        "answer": q.answer, "prediction": int(pred), "correct": int(pred) == q.answer})
    return records


def evaluate(adapter: Adapter, eval_set: EvalSet, out: str | Path | None = None, batch_size: int = 32, *,
             multi_query: bool = True, seed: int = 0, n_boot: int = 2000, progress: bool = True,
             extra: dict[str, Any] | None = None, figures: bool = True) -> dict[str, Any]:
    """Predict, summarize and (with `out`) write metrics.json, predictions.jsonl and (with `figures`)
    accuracy_by_residue.png."""
    records = predict(adapter, eval_set, batch_size, multi_query, progress, desc=f"eval {eval_set.protocol}")
    return write_run(adapter, eval_set, records, out, seed, n_boot=n_boot, extra=extra, figures=figures)


def write_run(adapter: Adapter, eval_set: EvalSet, records: list[dict[str, Any]], out: str | Path | None,
              seed: int = 0, *, n_boot: int = 2000, extra: dict[str, Any] | None = None,
              judge: Callable[[dict, float, float], dict] = task_verdict, figures: bool = True) -> dict[str, Any]:
    """metrics.json (statistics + position matching + settings + `judge`'s chance and verdict),
    predictions.jsonl and (with `figures`) the figure."""
    # the query protocol fixes each target's source phase: the (cluster, target) pair is the unit there
    source = target_pairs(records) if eval_set.protocol == "query" else records
    metrics = summarize(source, stride=eval_set.stride, residue_modulus=eval_set.residue_modulus,
                        n_boot=n_boot, seed=seed)
    if eval_set.protocol == "query":
        metrics.update(pair_period(records, eval_set.residue_modulus))
    metrics.update(judge(metrics, eval_set.chance, eval_set.in_context_chance))
    metrics.update({
        "schema_version": METRICS_SCHEMA_VERSION,
        "protocol": eval_set.protocol,
        "model": adapter.info.name,
        "model_stride": adapter.info.stride,
        "query_position": eval_set.query_position,
        "prompt_length": eval_set.prompt_length,
        "settings": {k: v for k, v in eval_set.settings.items() if k != "vocab"},
        "target_position_matching": eval_set.matching_stats(),
        **(extra or {}),
    })
    if eval_set.protocol == "query":  # the query-phase curve, its verdict and the source x query phase cells
        metrics.update(query_phase_statistics(records, eval_set.stride, eval_set.residue_modulus, eval_set.chance,
                                              eval_set.in_context_chance, judge=judge, n_boot=n_boot, seed=seed))
        metrics["query_position_matching"] = eval_set.matching_stats(coordinate="query")
    if out is not None:
        write_run_files(metrics, records, out, figures=figures)
    return metrics


def write_run_files(metrics: dict[str, Any], records: list[dict[str, Any]], out: str | Path, *,
                    figures: bool = True) -> Path:
    """One run's files in `out`: metrics.json, predictions.jsonl and (with `figures`) its figures."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "metrics.json", metrics)
    write_jsonl(out / "predictions.jsonl", records, sort_keys=True)
    if figures:
        plot_accuracy_by_residue(metrics, out / "accuracy_by_residue.png",
                                 title=f"{metrics['model']}: {metrics['protocol']} padding")
        if "cross" in metrics:
            plot_cross_phase_heatmap(metrics["cross"], out / "accuracy_by_source_and_query_phase.png",
                                     title=f"{metrics['model']}: accuracy [%] by source x query phase")
    log.info("wrote %s", out)
    return out


def run_eval(source: Source, cfg: EvalConfig, out: str | Path, force: bool = False,
             progress: bool = True) -> dict[str, Any]:
    """`phasekv eval`: evaluate `source` as `cfg` says and publish OUT atomically (metrics.json,
    predictions.jsonl, the figure).  Under torchrun the contexts are sharded over ranks and rank 0
    writes the union, in the original order."""
    dd = distributed.setup(cfg.device)
    try:
        # rank 0 checks --out before any compute; every rank stops on its verdict (no rank is left
        # waiting in a collective for a rank 0 that has given up)
        problem = None
        if dd.main:
            try:
                check_output_dir(Path(out), force)
            except ValueError as exc:
                problem = str(exc)
        problem = dd.broadcast_object(problem)
        if problem:
            raise ValueError(problem)
        adapter, eval_set = open_source(source, dataclasses.replace(cfg, device=str(dd.device)))
        shard = dataclasses.replace(eval_set, contexts=eval_set.contexts[dd.rank::dd.world])
        records = predict(adapter, shard, batch_size(source, cfg), not cfg.one_by_one,
                          progress=progress and dd.main)
        gathered = dd.gather_objects(records)
        metrics: dict[str, Any] = {}
        if dd.main:
            ordered = _in_context_order(eval_set, gathered)
            with output_dir(out, force) as tmp:
                metrics = write_run(adapter, eval_set, ordered, tmp, cfg.seed)
        dd.barrier()
        return metrics
    finally:
        dd.shutdown()


def _in_context_order(eval_set: EvalSet, gathered: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Rank r predicted contexts r, r + world, ...: restore the original query order."""
    world = len(gathered)
    ordered, cursors = [], [0] * world
    for i, context in enumerate(eval_set.contexts):
        r, n_q = i % world, len(context.queries)
        ordered.extend(gathered[r][cursors[r]:cursors[r] + n_q])
        cursors[r] += n_q
    return ordered
