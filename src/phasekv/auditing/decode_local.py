"""Decode steps of an in-process phasekv model against a reference model: the decode-step audit without an engine.

`phasekv.auditing.decode` compares an engine's greedy continuation with a reference, step by step and by the phase
of the predicting position.  This module runs the same comparison for a model in this process: the model decodes
greedily through its own KV cache (one prefill, then one token per step: the path a serving engine takes), and
the reference reads the prompt plus the model's own tokens in ONE forward (teacher forcing), so a disagreement at
step j is the model's error at step j.  A cached decode path that differs from the full forward only on some
decode steps (a parity bug: DeepSeek's V4.1 reference scores the steps where no 2-token group completes against
another layer's indexer keys) shows up as disagreements concentrated on those phases.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import torch

from phasekv.auditing.decode import share


@torch.no_grad()
def greedy_cached(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> list[int]:
    """The model's `steps` greedy tokens after prompt (T,), decoding one token per step through its cache."""
    cache = model.new_cache()
    logits = model(prompt[None], cache=cache)
    tokens = [int(logits[0, -1].argmax())]
    for _ in range(steps - 1):
        logits = model(torch.tensor([[tokens[-1]]]), cache=cache)
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
