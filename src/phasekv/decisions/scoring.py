"""Continuation scoring by teacher forcing: log P(continuation | prompt), summed over all its tokens.

The prompt minus its last token is prefilled (under a compression condition, the adapter compresses that cache:
`phasekv.conditions.grammar.condition_adapter`), and every continuation c is continued from the cache as the query
[last prompt token] + c[:-1], whose logits at step j score c[j].  So the decision point and the continuation are
the queries a condition's local window sees raw, and the whole context before them is what it compresses, as in
the audit's retrieval prompts.  A cache is read, never changed, so all continuations of a context share its one
prefill; contexts of one length and one set of continuation lengths share a batch (whatever their items), and
the continuations of one length one `continue_from` call (no padding anywhere: every position is real).  A prompt
of one token has no context to prefill and is scored by whole forward passes (`forward_logprobs`).

No judge model: the decision is the continuation with the largest summed log-probability.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from tqdm import tqdm

from phasekv.adapters.base import Adapter

Scores = dict[str, list[float]]  # label -> log-probability of each of its tokens


def _shape(continuations: dict[str, Sequence[int]]) -> tuple[int, ...]:
    """The sorted continuation lengths: prompts of one length and one shape share a batch."""
    return tuple(sorted(len(ids) for ids in continuations.values()))


def score_batch(adapter: Adapter, prompts: Sequence[Sequence[int]],
                continuations: Sequence[dict[str, Sequence[int]]]) -> list[Scores]:
    """Per prompt (all of one length, their continuations of one `_shape`), per label, the log-probabilities of the
    continuation's tokens."""
    rows = [list(p) for p in prompts]
    if len(rows[0]) == 1:
        return [_one_forward(adapter, row, conts) for row, conts in zip(rows, continuations)]
    cache = adapter.prefill(torch.tensor([r[:-1] for r in rows]))
    out: list[Scores] = [{} for _ in rows]
    for length in sorted(set(_shape(continuations[0]))):
        labels = [[label for label, ids in conts.items() if len(ids) == length] for conts in continuations]
        n = len(labels[0])  # the same for every row: one shape
        queries = [[row[-1], *conts[label][:-1]] for row, conts, own in zip(rows, continuations, labels)
                   for label in own]  # context-major, (B * n, t)
        targets = torch.tensor([list(conts[label]) for conts, own in zip(continuations, labels) for label in own])
        logp = _finite(adapter.continue_from(cache, torch.tensor(queries), n)).float().log_softmax(-1)
        picked = logp.gather(-1, targets.to(logp.device)[..., None])[..., 0].tolist()  # (B * n, t)
        for q, values in enumerate(picked):
            out[q // n][labels[q // n][q % n]] = values
    del cache
    return out


def _one_forward(adapter: Adapter, row: list[int], continuations: dict[str, Sequence[int]]) -> Scores:
    labels = list(continuations)
    return dict(zip(labels, forward_logprobs(adapter, row, [continuations[label] for label in labels])))


def forward_logprobs(adapter: Adapter, prompt: Sequence[int], candidates: Sequence[Sequence[int]]) -> list[list[float]]:
    """Per candidate, log P(token k | prompt + candidate[:k]) for each of its tokens, by whole forward passes
    (`adapter.logits`: any adapter, no cache; `phasekv sweep`'s path and the reference of the cached one).

    The input of candidate c is prompt + c[:-1]; equal inputs run once, inputs of equal length share one batch (no
    padding: nothing may shift a position)."""
    prompt = list(prompt)
    inputs = {tuple(prompt + list(c[:-1])) for c in candidates}
    by_length: dict[int, list[tuple[int, ...]]] = {}
    for row in sorted(inputs):
        by_length.setdefault(len(row), []).append(row)
    logp: dict[tuple[int, ...], torch.Tensor] = {}
    for rows in by_length.values():
        out = _finite(adapter.logits(torch.tensor(rows)))[:, len(prompt) - 1:].float().log_softmax(-1)  # (k, t, V)
        logp.update(zip(rows, out))
    return [logp[tuple(prompt + list(c[:-1]))][torch.arange(len(c)), torch.tensor(list(c))].tolist()
            for c in candidates]


def _finite(logits: torch.Tensor) -> torch.Tensor:
    if not torch.isfinite(logits).all():
        raise ValueError("model produced non-finite logits (NaN or inf): refusing to score continuations")
    return logits


def score_prompts(adapter: Adapter, prompts: Sequence, *, batch_size: int = 8, progress: bool = True,
                  desc: str = "score") -> list[Scores]:
    """`score_batch` over prompts with `.ids` and `.continuations` (`phasekv.decisions.prompts.Prompt`), batched by
    prompt length and continuations; results in the input order."""
    adapter.check_length(max(len(p.ids) + max(len(c) for c in p.continuations.values()) - 1 for p in prompts))
    adapter.check_length(min(len(p.ids) - 1 for p in prompts))  # a condition refuses a cache it would not compress
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault((len(p.ids), _shape(p.continuations)), []).append(i)
    out: list[Scores | None] = [None] * len(prompts)
    with tqdm(total=len(prompts), desc=desc, unit="prompt", disable=not progress, leave=False) as bar:
        for members in groups.values():
            for start in range(0, len(members), batch_size):
                chunk = members[start:start + batch_size]
                scores = score_batch(adapter, [prompts[i].ids for i in chunk],
                                     [prompts[i].continuations for i in chunk])
                for i, row in zip(chunk, scores, strict=True):
                    out[i] = row
                bar.update(len(chunk))
    return out  # type: ignore[return-value]


Scorer = Callable[[str, Sequence], list[Scores]]  # (condition, prompts) -> scores, in order
