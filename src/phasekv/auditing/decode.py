"""Answers across decode steps: the engine's greedy continuation compared, token by token, with the reference.

The engine generates `steps` tokens greedily after each prompt (one request per prompt: `Api.generate_body`, end of
sequence ignored).  The reference (the same weights in transformers) reads the prompt followed by the engine's own
tokens in one forward, so its argmax at every step is its next token on the ENGINE's prefix (teacher forcing): a
disagreement at step j is the engine's error at step j, not an echo of an earlier one.  Step j is predicted at
position p = len(prompt) - 1 + j, whose phase p mod S says where the compression grid is while generating (a window
completes when p + 1 = 0 mod S: a boundary crossed during decode is its own coordinate).

Reported, each with Wilson 95% intervals: agreement per step, per phase of the predicting position, and per (step,
phase) cell; where the first disagreement of each prompt happens (its step and its position mod S); and the
engine's accuracy per step against the target's value (a multi-token answer: `needle-digits`), where the value has
that many tokens.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch

from phasekv.adapters.base import Adapter
from phasekv.data.protocols import EvalSet, Prompt
from phasekv.engines.client import EndpointAdapter
from phasekv.engines.wire import Answer
from phasekv.evaluate.metrics import wilson_interval


def generate(adapter: EndpointAdapter, ids: list[int], steps: int) -> list[Answer]:
    """The engine's `steps` greedy tokens after `ids` (fewer if it stopped), each with its top-k."""
    payload = adapter.conn.request("POST", adapter.api.path,
                                   adapter.api.generate_body(ids, steps, adapter.top_k, adapter.model))
    return adapter.api.parse_steps(payload)[:steps]


@torch.no_grad()
def teacher_forced(reference: Adapter, prompt: list[int], tokens: list[int]) -> list[int]:
    """The reference's argmax after `prompt` + tokens[:j] for every step j (one forward)."""
    logits = reference.logits(torch.tensor([prompt + tokens[:-1]]))  # (1, T + steps - 1, V)
    return logits[0, len(prompt) - 1:].argmax(-1).tolist()


def target_value(eval_set: EvalSet, prompt: Prompt) -> list[int]:
    """The tokens of the target record's value (the whole multi-token answer)."""
    context = eval_set.contexts[prompt.context]
    start = context.record_positions[prompt.query.record] + eval_set.settings["key_tokens"]
    return context.ids[start:start + eval_set.settings["value_tokens"]]


def decode_steps(adapter: EndpointAdapter, reference: Adapter, eval_set: EvalSet, steps: int,
                 limit: int | None = None) -> dict[str, Any]:
    """The decode-step comparison (module docstring) on the first `limit` prompts of `eval_set` (all: None)."""
    return compare_steps(eval_set, steps, limit, lambda ids: [a.token for a in generate(adapter, ids, steps)],
                         lambda ids, tokens: teacher_forced(reference, ids, tokens))


def compare_steps(eval_set: EvalSet, steps: int, limit: int | None, continuation: Callable[[list[int]], list[int]],
                  reference: Callable[[list[int], list[int]], list[int]]) -> dict[str, Any]:
    """The comparison itself, for any decoder: `continuation(ids)` is its greedy tokens after a prompt (at most
    `steps`), `reference(ids, tokens)` the teacher-forced argmax at each of them (`teacher_forced`)."""
    S = eval_set.stride
    cells: dict[tuple[int, int], list[bool]] = defaultdict(list)  # (step, phase of the predicting position)
    correct: dict[int, list[bool]] = defaultdict(list)
    first_step, first_phase, generated = Counter(), Counter(), []
    prompts = eval_set.prompts()[:limit]
    for p in prompts:
        tokens = continuation(p.ids)
        generated.append(len(tokens))
        if not tokens:
            continue
        ref = reference(p.ids, tokens)
        value = target_value(eval_set, p)
        first = None
        for j, (mine, theirs) in enumerate(zip(tokens, ref, strict=True)):
            phase = (len(p.ids) - 1 + j) % S
            cells[j, phase].append(mine == theirs)
            if j < len(value):
                correct[j].append(mine == value[j])
            if first is None and mine != theirs:
                first = (j, phase)
        if first is not None:
            first_step[first[0]] += 1
            first_phase[first[1]] += 1

    def pooled(key) -> list[dict[str, Any]]:
        groups: dict[int, list[bool]] = defaultdict(list)
        for (j, phase), hits in cells.items():
            groups[key(j, phase)].extend(hits)
        return [{"value": g, **share(groups[g])} for g in sorted(groups)]

    per_step = [{"step": r.pop("value"), **r} for r in pooled(lambda j, phase: j)]
    for r in per_step:
        hits = correct.get(r["step"], [])
        r["engine_accuracy"] = sum(hits) / len(hits) if hits else None
    return {"protocol": eval_set.protocol, "stride": S, "steps": steps, "n_prompts": len(prompts),
            "tokens_generated": sum(generated), "overall": share([h for v in cells.values() for h in v]),
            "per_step": per_step, "per_phase": [{"phase": r.pop("value"), **r} for r in pooled(lambda j, ph: ph)],
            "cells": [{"step": j, "phase": phase, **share(cells[j, phase])} for j, phase in sorted(cells)],
            "first_disagreement": {"prompts": sum(first_step.values()),
                                   "per_step": [{"step": j, "prompts": first_step[j]} for j in sorted(first_step)],
                                   "per_phase": [{"phase": ph, "prompts": first_phase[ph]}
                                                 for ph in sorted(first_phase)]}}


def share(hits: list[bool]) -> dict[str, Any]:
    """n, agree, agreement and its Wilson 95% interval."""
    n, k = len(hits), sum(hits)
    if n == 0:
        return {"n": 0, "agree": 0, "agreement": None, "ci_low": None, "ci_high": None}
    low, high = wilson_interval(k, n)
    return {"n": n, "agree": k, "agreement": k / n, "ci_low": low, "ci_high": high}


def decode_check(steps: int, limit: int | None = None):
    """The engine grid's per-point check (`phasekv.auditing.engine_grid.Check`): decode steps on the query
    protocol's prompts (its lengths move the decode positions across every phase), else the first protocol's."""

    def check(adapter, sets, logprobs, reference) -> dict[str, Any]:
        if reference is None:
            return {"skipped": "needs --reference-hf (the teacher-forced reference)"}
        eval_set = sets.get("query") or next(iter(sets.values()))
        return decode_steps(adapter, reference, eval_set, steps, limit)

    return check
