"""Batched evaluation of a prompt set: full-vocabulary top-1 of the answer at the query position.

Two equivalent strategies (tested to agree):
  - multi-query: contexts are prefilled once, in batches, and each context's queries continue from
    its cache (one short forward per query instead of one long one): read through a shared view for
    adapters that declare `shares_cache` (phasekv models), from copies otherwise;
  - one-by-one: every full prompt is its own forward pass (the reference, and the fallback).
`evaluate` writes the run's files: metrics.json (schema in the README), predictions.jsonl and
accuracy_by_residue.png.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from phasekv import distributed
from phasekv.config import EvalConfig
from phasekv.data.protocols import EvalSet
from phasekv.evaluate.adapter import Adapter
from phasekv.evaluate.metrics import summarize, task_verdict
from phasekv.evaluate.sources import Source, batch_size, open_source
from phasekv.figures.evaluation import plot_accuracy_by_residue
from phasekv.outputs import check_output_dir, output_dir

log = logging.getLogger(__name__)


def _batches(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


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
    preds: list[int] = []
    # the bars are closed (and, with leave=False, erased) even when an error stops the loop, so the
    # error is the only line left on the terminal
    if multi_query:
        contexts = eval_set.contexts
        # contexts of one batch must share their number of queries and key length
        groups: dict[tuple[int, int], list[int]] = {}
        for i, c in enumerate(contexts):
            groups.setdefault((len(c.queries), len(c.queries[0].key)), []).append(i)
        by_context: dict[int, list[int]] = {}
        with tqdm(total=len(eval_set.queries()), desc=desc, unit="prompt", disable=not progress,
                  leave=False) as bar:
            for (n_q, _), members in groups.items():
                # an adapter that continues from a shared cache (no copy per query) prefills batch_size
                # contexts per forward, as many prompts as a one-by-one forward; others keep about
                # batch_size query rows (and cache copies) per continuation
                shared = adapter.shares_cache
                per_batch = batch_size if shared else max(1, batch_size // n_q)
                for chunk in _batches(members, per_batch):
                    ids = torch.tensor([contexts[i].ids for i in chunk])
                    cache = adapter.prefill(ids)
                    qids = torch.tensor([list(q.key) for i in chunk for q in contexts[i].queries])
                    top = _top1(adapter.continue_from(cache, qids, n_q))
                    for j, i in enumerate(chunk):
                        by_context[i] = top[j * n_q:(j + 1) * n_q]
                    bar.update(len(qids))
        preds = [p for i in range(len(contexts)) for p in by_context[i]]
    else:
        chunks = list(_batches(eval_set.prompts(), batch_size))
        with tqdm(total=len(chunks), desc=desc, unit="batch", disable=not progress, leave=False) as bar:
            for chunk in chunks:
                preds.extend(_top1(adapter.logits(torch.tensor([p.ids for p in chunk]))))
                bar.update()
    records = []
    for q, pred in zip(eval_set.queries(), preds, strict=True):
        answer_position = q.target_position + len(q.key)  # the record's first value token
        records.append({"target_position": q.target_position, "residue": q.residue, "phase": q.phase,
                        "answer_position": answer_position, "answer_phase": answer_position % eval_set.stride,
                        "protocol": q.protocol, "shift": q.shift, "cluster": q.cluster, "record": q.record,
                        "answer": q.answer, "prediction": int(pred), "correct": int(pred) == q.answer})
    return records


def evaluate(adapter: Adapter, eval_set: EvalSet, out: str | Path | None = None, batch_size: int = 32,
             multi_query: bool = True, seed: int = 0, n_boot: int = 2000, progress: bool = True,
             extra: dict[str, Any] | None = None, figures: bool = True) -> dict[str, Any]:
    """Predict, summarize and (with `out`) write metrics.json, predictions.jsonl and (with `figures`)
    accuracy_by_residue.png."""
    records = predict(adapter, eval_set, batch_size, multi_query, progress, desc=f"eval {eval_set.protocol}")
    return write_run(adapter, eval_set, records, out, seed, n_boot, extra, figures=figures)


def write_run(adapter: Adapter, eval_set: EvalSet, records: list[dict[str, Any]], out: str | Path | None,
              seed: int = 0, n_boot: int = 2000, extra: dict[str, Any] | None = None,
              judge: Callable[[dict, float, float], dict] = task_verdict, figures: bool = True) -> dict[str, Any]:
    """metrics.json (statistics + position matching + settings + `judge`'s chance and verdict),
    predictions.jsonl and (with `figures`) the figure."""
    metrics = summarize(records, stride=eval_set.stride, residue_modulus=eval_set.residue_modulus,
                        n_boot=n_boot, seed=seed)
    metrics.update(judge(metrics, eval_set.chance, eval_set.in_context_chance))
    metrics.update({
        "protocol": eval_set.protocol,
        "model": adapter.info.name,
        "model_stride": adapter.info.stride,
        "query_position": eval_set.query_position,
        "prompt_length": eval_set.prompt_length,
        "settings": {k: v for k, v in eval_set.settings.items() if k != "vocab"},
        "target_position_matching": eval_set.matching_stats(),
        **(extra or {}),
    })
    if out is not None:
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
        with open(out / "predictions.jsonl", "w") as f:
            for r in records:
                f.write(json.dumps(r, sort_keys=True) + "\n")
        if figures:
            plot_accuracy_by_residue(metrics, out / "accuracy_by_residue.png",
                                     title=f"{adapter.info.name}: {eval_set.protocol} padding")
        log.info("wrote %s", out)
    return metrics


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
