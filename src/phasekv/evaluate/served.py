"""A served model measured: `phasekv eval --endpoint` (`evaluate_endpoint`), and engine vs reference.

Engine vs reference: the same prompts through a served model and through transformers on the same weights.

For every prompt the engine's greedy next token is compared with the reference's argmax (and each with the
answer: both accuracies per group), and the two log-probabilities of the engine's token are differenced (engine
minus reference; the engine's own log-probability comes from its top-k answer).  Agreement is reported overall,
per source phase (the target record's position mod S) and per query phase (the last prompt position mod S; it
varies under the query protocol), each with a Wilson 95% interval, with the mean signed and absolute
log-probability differences: an engine whose disagreements concentrate on some phases is a finding about the
engine, not about the model.  `phasekv eval --endpoint` and `phasekv audit --endpoint` take `--reference-hf DIR`
for it (`evaluate_endpoint` here, `auditing.pipeline.run_audit`).

The reference runs through `predict` (contexts prefilled once, each query continued from the cache); `_Recorder`
keeps, per prompt, the reference's next-token log-probabilities (`reference_logprobs`), so an engine grid compares
every point with one reference pass.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from phasekv.adapters.base import Adapter, Wrapped
from phasekv.data.protocols import EvalSet
from phasekv.engines.client import EndpointAdapter
from phasekv.engines.journal import prompt_key, prompt_set_key, published
from phasekv.evaluate.metrics import wilson_interval
from phasekv.evaluate.runner import predict
from phasekv.outputs import write_json


class _Recorder(Wrapped):
    """`base`, recording for each prompt it scores (by `prompt_key`) its next-token log-probabilities (float32)."""

    def __init__(self, base: Adapter):
        super().__init__(base)
        self.seen: dict[str, torch.Tensor] = {}

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.inner.logits(ids)
        self._record(ids.tolist(), out)
        return out

    def prefill(self, ids: torch.Tensor):
        return self.inner.prefill(ids), ids.tolist()

    def continue_from(self, cache, ids: torch.Tensor, repeats: int) -> torch.Tensor:
        inner, contexts = cache
        out = self.inner.continue_from(inner, ids, repeats)
        self._record([contexts[row // repeats] + q for row, q in enumerate(ids.tolist())], out)
        return out

    def _record(self, prompts: list[list[int]], logits: torch.Tensor) -> None:
        logp = torch.log_softmax(logits[:, -1].double(), -1).float()  # (B, V)
        for prompt, lp in zip(prompts, logp, strict=True):
            self.seen[prompt_key(prompt)] = lp.clone()


def reference_logprobs(reference: Adapter, eval_set: EvalSet, batch_size: int = 16) -> dict[str, torch.Tensor]:
    """The reference's next-token log-probabilities (V,) of every prompt of `eval_set`, by `prompt_key`: computed
    once and compared with any number of engine runs (`compare(..., logprobs=...)`, the engine grid)."""
    recorder = _Recorder(reference)
    predict(recorder, eval_set, batch_size, progress=False)
    return recorder.seen


def compare(engine: EndpointAdapter, reference: Adapter, eval_set: EvalSet, batch_size: int = 16, *,
            logprobs: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """comparison.json's content for one prompt set (the engine's answers already journaled are not asked again);
    `logprobs`: the reference's, computed before (`reference_logprobs`)."""
    prompts = eval_set.prompts()
    keys = [prompt_key(p.ids) for p in prompts]
    answers = [group[0] for group in engine.answer([[p.ids] for p in prompts])]
    seen = logprobs if logprobs is not None else reference_logprobs(reference, eval_set, batch_size)
    rows = []
    for p, key, answer in zip(prompts, keys, answers, strict=True):
        ref_top, ref_logp = int(seen[key].argmax()), float(seen[key][answer.token])
        own = dict(answer.top).get(answer.token)
        rows.append({"phase": p.query.phase, "query_phase": p.query.query_position % eval_set.stride,
                     "agree": ref_top == answer.token, "dlogp": None if own is None else own - ref_logp,
                     "engine_correct": answer.token == p.query.answer, "reference_correct": ref_top == p.query.answer})
    return {"protocol": eval_set.protocol, "stride": eval_set.stride, "engine": engine.info.name,
            "reference": reference.info.name, "overall": _group(rows),
            "per_phase": _per(rows, "phase"), "per_query_phase": _per(rows, "query_phase")}


def _per(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    groups: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[r[key]].append(r)
    return [{key: g, **_group(groups[g])} for g in sorted(groups)]


def _group(rows: list[dict[str, Any]]) -> dict[str, Any]:
    k, n = sum(r["agree"] for r in rows), len(rows)
    low, high = wilson_interval(k, n)
    diffs = np.array([r["dlogp"] for r in rows if r["dlogp"] is not None])
    return {"n": n, "agree": k, "agreement": k / n, "ci_low": low, "ci_high": high,
            "engine_accuracy": sum(r["engine_correct"] for r in rows) / n,
            "reference_accuracy": sum(r["reference_correct"] for r in rows) / n,
            "mean_dlogp": float(diffs.mean()) if diffs.size else None,
            "mean_abs_dlogp": float(np.abs(diffs).mean()) if diffs.size else None,
            "max_abs_dlogp": float(np.abs(diffs).max()) if diffs.size else None}


def evaluate_endpoint(adapter: EndpointAdapter, tokenizer, cfg, out: str | Path, *, force: bool = False,
                      progress: bool = True, reference: Adapter | None = None) -> dict[str, Any]:
    """`phasekv eval --endpoint`: the prompt set `cfg` (an EvalConfig) describes for the served model, evaluated
    and published as OUT (the files of `phasekv eval`, plus endpoint.json and the journal); with `reference` (the
    same weights in process), OUT/comparison.json too."""
    from phasekv.evaluate.runner import write_run
    from phasekv.evaluate.sources import make_eval_set, prompt_settings, tokenizer_vocabulary
    vocab, defaults = tokenizer_vocabulary(tokenizer, cfg)
    eval_set = make_eval_set(adapter, vocab, cfg.protocol, cfg.stride, **prompt_settings(cfg, defaults))
    if adapter.journal is not None:  # a resumed journal must hold answers to these prompts
        adapter.journal.bind("prompt_set", prompt_set_key(p.ids for p in eval_set.prompts()))
    records = predict(adapter, eval_set, cfg.batch_size or 32, not cfg.one_by_one, progress)
    comparison = compare(adapter, reference, eval_set) if reference is not None else None
    with published(out, force, adapter) as tmp:
        metrics = write_run(adapter, eval_set, records, tmp, cfg.seed)
        if comparison is not None:
            write_json(tmp / "comparison.json", comparison)
    return metrics
