"""Decode steps of an in-process phasekv model against a reference model: the decode-step audit without an engine.

`phasekv.auditing.decode` compares an engine's greedy continuation with a reference, step by step and by the phase
of the predicting position.  This module runs the same comparison for a model in this process: the model decodes
greedily through its own KV cache (one prefill, then one token per step: the path a serving engine takes), and
the reference reads the prompt plus the model's own tokens in ONE forward (teacher forcing), so a disagreement at
step j is the model's error at step j.  A cached decode path that differs from the full forward only on some
decode steps (a parity bug: DeepSeek's V4.1 reference scores the steps where no 2-token group completes against
another layer's indexer keys) shows up as disagreements concentrated on those phases.

`local_decode_check` is the engine grid's decode check (`phasekv.auditing.decode.decode_check`) for such a model:
the same comparison and result (`compare_steps`), the model's own full forward as the reference, and a verdict
(`decode_verdict`); `phasekv eval --checkpoint DIR --engine-checks decode` runs it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import torch

from phasekv.auditing.decode import compare_steps, share, teacher_forced
from phasekv.data.protocols import EvalSet


@torch.no_grad()
def greedy_cached(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> list[int]:
    """The model's `steps` greedy tokens after prompt (T,), decoding one token per step through its cache."""
    cache = model.new_cache()
    logits = model(prompt[None], cache=cache)
    tokens = [int(logits[0, -1].argmax())]
    for _ in range(steps - 1):
        logits = model(prompt.new_tensor([[tokens[-1]]]), cache=cache)
        tokens.append(int(logits[0, -1].argmax()))
    return tokens


@torch.no_grad()
def decode_agreement(model: torch.nn.Module, reference: torch.nn.Module, prompts: list[torch.Tensor], steps: int,
                     stride: int) -> dict[str, Any]:
    """Agreement of the model's cached greedy decode with the reference's teacher-forced argmax, overall and per
    phase of the predicting position (position mod `stride`), with Wilson 95% intervals (`decode.share`), and the
    phase of each prompt's first disagreement (an error changes the cache the later steps read: they may echo it)."""
    per_phase: dict[int, list[bool]] = defaultdict(list)
    first: Counter = Counter()  # phase of each prompt's first disagreement (later ones may be its echoes)
    for prompt in prompts:
        tokens = greedy_cached(model, prompt, steps)
        ids = torch.cat([prompt, torch.tensor(tokens[:-1], dtype=prompt.dtype)])
        ref = reference(ids[None])[0, len(prompt) - 1:].argmax(-1).tolist()
        phases = [(len(prompt) - 1 + j) % stride for j in range(len(tokens))]
        for phase, mine, theirs in zip(phases, tokens, ref, strict=True):
            per_phase[phase].append(mine == theirs)
        wrong = [phase for phase, mine, theirs in zip(phases, tokens, ref, strict=True) if mine != theirs]
        if wrong:
            first[wrong[0]] += 1
    return {"overall": share([h for hits in per_phase.values() for h in hits]),
            "per_phase": [{"phase": ph, **share(per_phase[ph])} for ph in sorted(per_phase)],
            "first_disagreement_per_phase": [{"phase": ph, "prompts": first[ph]} for ph in sorted(first)]}


# a phase is flagged when even the upper end of its agreement's Wilson 95% interval is below this: the cached
# decode and the full forward of one model in float32 differ only by rounding, which can flip a near-tie's argmax
# now and then but not a share of the steps (measured: 100% agreement on the correct models of tests/test_csa2.py)
AGREEMENT_FLOOR = 0.99


def local_decode_steps(adapter, eval_set: EvalSet, steps: int, limit: int | None = None) -> dict[str, Any]:
    """The decode-step comparison of an in-process phasekv model (`PhaseKVAdapter`) with its own full forward, on
    the first `limit` prompts of `eval_set` (all: None); phases are positions mod eval_set.stride."""
    model = adapter.module
    device = adapter.device

    def continuation(ids: list[int]) -> list[int]:
        return greedy_cached(model, torch.tensor(ids, device=device), steps)

    result = compare_steps(eval_set, steps, limit, continuation,
                           lambda ids, tokens: teacher_forced(adapter, ids, tokens))
    return {**result, **decode_verdict(result)}


def decode_verdict(result: dict[str, Any], floor: float = AGREEMENT_FLOOR) -> dict[str, Any]:
    """The check's verdict on a `compare_steps` result: the phases whose agreement lies wholly below `floor`, and
    where the disagreements begin (each prompt's first one: a wrong step changes the hidden states the cache keeps,
    so the steps after it may disagree at any phase; a bug of one phase starts every run of errors on that phase)."""
    if not result["overall"]["n"]:
        return {"verdict": "no decode steps compared", "flagged_phases": [], "first_phases": []}
    flagged = [r["phase"] for r in result["per_phase"] if r["n"] and r["ci_high"] < floor]
    first = [r["phase"] for r in result["first_disagreement"]["per_phase"] if r["prompts"]]
    if not flagged:
        return {"verdict": "the cached decode agrees with the full forward", "flagged_phases": [],
                "first_phases": first}
    shares = ", ".join(f"{r['phase']}: {100 * r['agreement']:.1f}%" for r in result["per_phase"])
    starts = ", ".join(f"{r['phase']}: {r['prompts']}" for r in result["first_disagreement"]["per_phase"])
    return {"verdict": f"the cached decode disagrees with the full forward at phase(s) "
                       f"{', '.join(map(str, flagged))} mod {result['stride']} (agreement by phase {shares}; "
                       f"first disagreements by phase {starts})",
            "flagged_phases": flagged, "first_phases": first}


def local_decode_check(steps: int, limit: int | None = None):
    """`decode.decode_check` for an in-process phasekv model: check(adapter, sets) on the query protocol's prompts
    (its lengths move the decode positions across every phase), else the first protocol's."""

    def check(adapter, sets: dict[str, EvalSet]) -> dict[str, Any]:
        eval_set = sets.get("query") or next(iter(sets.values()))
        return local_decode_steps(adapter, eval_set, steps, limit)

    return check
