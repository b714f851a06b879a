"""A long-context prompt set (`phasekv.data.longcontext`) evaluated: prompts streamed one batch at a time, never all
held, each through the adapter as the runner would (a context prefilled, in chunks where the adapter chunks, and the
query's key continued from it; a served model answers whole prompts, `concurrency` at a time), then the same
statistics and verdicts as any prompt set, overall and per target depth.

`LongSetView` gives `runner.write_run` what it reads of a prompt set (protocol, stride, chance, matching
statistics, settings).  `depth_statistics` adds, per design depth, the per-phase accuracies with their Wilson
intervals and the three-part verdict: the depth x phase map (`figures.evaluation.plot_phase_heatmap` draws it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tqdm import tqdm

from phasekv.adapters.base import Adapter
from phasekv.data.longcontext import LongContextSet
from phasekv.evaluate.metrics import summarize
from phasekv.evaluate.verdict import task_verdict

# prompts of one batch sent to a served model (its concurrency spreads them) or prefilled in process one by one
SERVED_BATCH = 64


class LongSetView:
    """What `write_run` reads of a prompt set, for a long-context set."""

    def __init__(self, lset: LongContextSet):
        self.lset, self.protocol, self.stride = lset, lset.spec.protocol, lset.spec.stride
        self.residue_modulus, self.chance = lset.spec.modulus, lset.chance
        self.prompt_length, self.settings = lset.prompt_length, lset.settings
        self.query_position = lset.prompt_length - 1

    @property
    def in_context_chance(self) -> float:
        """A copier of a random value present in the prompt: every record's value is a candidate."""
        return 1.0 / min(self.lset.n, len(self.lset.keys.values))

    def matching_stats(self, modulus: int | None = None, coordinate: str = "target") -> dict[str, Any]:
        return self.lset.matching_stats(modulus, coordinate)


def _answer(adapter: Adapter, prompts: list, key_tokens: int) -> list[int]:
    if hasattr(adapter, "answer"):  # a served model: whole prompts, answered concurrently
        return [group[0].token for group in adapter.answer([[p.ids.tolist()] for p in prompts])]
    out = []
    for p in prompts:  # in process: the context prefilled (chunked where the adapter chunks), the key continued
        ids = torch.as_tensor(p.ids, dtype=torch.long)[None]
        cache = adapter.prefill(ids[:, :-key_tokens])
        logits = adapter.continue_from(cache, ids[:, -key_tokens:], 1)
        out.append(int(logits[0, -1].argmax()))
    return out


def predict_long(adapter: Adapter, lset: LongContextSet, *, progress: bool = True,
                 desc: str = "long") -> list[dict[str, Any]]:
    """One record per prompt, in the set's order, with the fields `runner.predict` writes and the target's depth."""
    adapter.check_length(lset.prompt_length)
    lset.check_memory(SERVED_BATCH)
    key_tokens, stride = lset.query_tokens, lset.spec.stride  # the query: the key code and ":" (if any)
    records, batch = [], []

    def flush() -> None:
        for p, pred in zip(batch, _answer(adapter, batch, key_tokens), strict=True):
            answer_position = p.target_position + key_tokens
            records.append({"target_position": p.target_position, "residue": p.residue, "phase": p.phase,
                            "answer_position": answer_position, "answer_phase": answer_position % stride,
                            "protocol": p.protocol, "shift": p.shift, "cluster": p.cluster, "record": p.record,
                            "query_position": p.query_position, "query_phase": p.query_position % stride,
                            "depth": p.depth, "answer": p.answer, "prediction": pred, "correct": pred == p.answer})
        batch.clear()

    for prompt in tqdm(lset.prompts(), total=lset.n_prompts, desc=desc, unit="prompt", disable=not progress,
                       leave=False):
        batch.append(prompt)
        if len(batch) == SERVED_BATCH:
            flush()
    if batch:
        flush()
    return records


def depth_statistics(records: list[dict[str, Any]], view: LongSetView, *, seed: int = 0,
                     judge: Callable[[dict, float, float], dict] = task_verdict) -> dict[str, Any]:
    """Per design depth: mean, per-phase accuracies with Wilson intervals and the verdict (`judge`)."""
    out = {}
    for depth in sorted({r["depth"] for r in records}):
        rows = [r for r in records if r["depth"] == depth]
        m = summarize(rows, stride=view.stride, residue_modulus=view.residue_modulus, seed=seed)
        m.update(judge(m, view.chance, view.in_context_chance))
        out[f"{depth:g}"] = {k: m[k] for k in ("n_prompts", "mean_accuracy", "per_phase", "max_gap_pp", "verdict",
                                               "stride") if k in m}
    return out
