"""The training signal of transformers' sparse-attention indexers (DeepSeek-V4 CSA, DeepSeek-V3.2 DSA, GLM-5.3 DSA,
MiniMax-M3 block-sparse attention).

In all of them the lightning indexer only *selects* (top-k indices), so the language-model loss gives its parameters
no gradient.  DeepSeek-V3.2 (arXiv 2512.02556, section 2.1) trains it by distillation from the main attention: for
query t, the main attention probabilities are summed over heads and L1-normalized over the candidates (target p_t);
the indexer's scores I_t are softmaxed over the same candidates; the loss is

    L_I = mean_t KL(p_t || softmax(I_t))          (the paper sums over t; the mean keeps the weight scale-free)

with the indexer's inputs detached and the target detached, so L_I reaches only indexer parameters and the
language-model gradients are unchanged.  The candidates are those the main attention used: the top-k selection,
restricted to causal ones (DeepSeek's sparse-training stage; when the top-k covers every causal candidate this is
its dense warm-up stage).

Each architecture says, in its own file of `phasekv.archs` (`indexer_kinds`, one `IndexerKind` per indexer class),
how to read its scores and what a candidate is:

  DeepSeek-V4     candidates are compressed entries (one per m tokens); the scores are the output of the real
                  scoring submodule (differentiable), with the indexer's inputs detached by a pre-hook
  DeepSeek-V3.2   candidates are tokens; the real indexer runs under no_grad, so its scores are recomputed from its
                  own submodules on its detached inputs
  GLM-5.3         candidates are complete pools of tokens (a pool's target mass is its tokens' attention mass; the
                  raw tail the model always attends is no candidate); scores recomputed as for V3.2
  MiniMax-M3      candidates are blocks of keys, one selection per KV group: the rows are (batch, group) pairs and
                  a group's target is its own query heads' mass (`Record.groups`); the always-kept local blocks
                  are no candidates; scores (a block's max) recomputed as for V3.2

The recomputations are checked against the real modules' selections in tests/test_realarch.py.
`distillation(model)` hooks the real modules (forward hooks that record, a pre-hook that detaches) and removes
every hook on exit, whatever happens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from phasekv.archs import IndexerKind, architecture_of


class Record(NamedTuple):
    """One indexer call of a training forward."""

    scores: torch.Tensor  # (B, S, C) indexer scores, with grad into the indexer's parameters only
    candidates: torch.Tensor  # (B, S, C) bool: candidates the query may select (causal, complete)
    selected: torch.Tensor  # (B, S, C) bool: what the real indexer selected
    pools: torch.Tensor | None  # (B, C, kpool) token indices of each candidate pool; None: one key per candidate
    trailing: bool  # candidates are the attention's trailing key columns (V4: compressed entries after raw keys)
    groups: int = 1  # rows are (batch, group) pairs: a group's target is its query heads' mass (MiniMax-M3)

    @property
    def used(self) -> torch.Tensor:
        return self.candidates & self.selected


def indexers_of(model: nn.Module) -> list[tuple[nn.Module, nn.Module, IndexerKind]]:
    """(attention module, its indexer, kind) for every indexer of a transformers sparse-attention model, found by
    type among its architecture's indexer kinds; [] for any other model (phasekv models included)."""
    kinds = architecture_of(model).indexer_kinds()
    found = []
    for module in model.modules():
        kind = next((k for k in kinds if isinstance(module, k.attention)), None)
        if kind is None:
            continue
        indexer = next((m for m in module.modules() if isinstance(m, kind.indexer)), None)
        if indexer is not None:
            found.append((module, indexer, kind))
    return found


def indexer_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter of every indexer (trained only by the distillation loss)."""
    return [p for _, indexer, _ in indexers_of(model) for p in indexer.parameters()]


def kl_to_attention(scores: torch.Tensor, used: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """mean over queries with a used candidate of KL(p || softmax(scores)) over the used candidates, where p is
    `target` (B, S, C) (attention mass, summed over heads) L1-normalized over them; scores, used: (B, S, C)."""
    p = torch.where(used, target.detach().float(), 0.0)
    total = p.sum(-1, keepdim=True)
    rows = used.any(-1) & (total.squeeze(-1) > 0)
    p = p / total.clamp_min(1e-30)
    log_q = torch.where(used, scores.float(), float("-inf")).log_softmax(-1)
    terms = torch.where(used & (p > 0), p * (p.clamp_min(1e-30).log() - log_q), 0.0)
    kl = terms.sum(-1)
    return kl[rows].mean() if rows.any() else scores.sum() * 0.0


def _pool_mass(mass: torch.Tensor, pools: torch.Tensor | None) -> torch.Tensor:
    """Attention mass per token (B, S, T) -> per candidate: tokens (pools None) or pools (B, P, kpool)."""
    if pools is None:
        return mass
    b, s, _ = mass.shape
    flat = pools.clamp(min=0).flatten(1)  # (B, P * kpool)
    per_token = mass.gather(-1, flat[:, None, :].expand(b, s, -1)) * (pools >= 0).flatten(1)[:, None, :]
    return per_token.view(b, s, *pools.shape[1:]).sum(-1)  # (B, S, P)


@dataclass
class Distillation:
    """What the hooks recorded during one forward: per attention module, its indexer's Record and the main
    attention's probabilities."""

    records: dict[int, Record] = field(default_factory=dict)
    attention: dict[int, torch.Tensor] = field(default_factory=dict)

    def loss(self, keep: bool = False) -> torch.Tensor | None:
        """Sum over indexed layers of the KL distillation loss of the last forward (None: nothing recorded); the
        records are dropped unless `keep`."""
        terms = []
        for key, record in self.records.items():
            probs = self.attention.get(key)
            if probs is None:
                continue
            b, heads = probs.shape[:2]
            mass = probs.detach().float().view(b, record.groups, heads // record.groups, *probs.shape[2:])
            mass = mass.sum(2).flatten(0, 1)  # (B * groups, S, keys): each group's heads summed
            if record.trailing:
                mass = mass[..., mass.shape[-1] - record.scores.shape[-1]:]
            terms.append(kl_to_attention(record.scores, record.used, _pool_mass(mass, record.pools)))
        if not keep:
            self.records.clear()
            self.attention.clear()
        return torch.stack(terms).sum() if terms else None


@contextlib.contextmanager
def distillation(model: nn.Module) -> Iterator[Distillation]:
    """Hook every indexer of `model` for the KL objective; yields a Distillation whose `loss()` is None for a model
    without indexers.  The hooks are removed on exit, whatever happens."""
    state, handles = Distillation(), []
    try:
        for attention, indexer, kind in indexers_of(model):
            key = id(attention)
            handles.append(attention.register_forward_hook(_keep_probs(state, key)))
            scorer_out: dict[str, torch.Tensor] = {}
            if kind.scorer is not None:
                handles.append(indexer.register_forward_pre_hook(_detach_inputs, with_kwargs=True))
                scorer = next(m for m in indexer.modules() if isinstance(m, kind.scorer))
                handles.append(scorer.register_forward_hook(lambda m, a, o, box=scorer_out: box.update(scores=o)))
            handles.append(indexer.register_forward_hook(_record(state, key, kind, scorer_out), with_kwargs=True))
        yield state
    finally:
        for handle in handles:
            handle.remove()


def _keep_probs(state: Distillation, key: int):
    def hook(module, args, output):
        if torch.is_grad_enabled() and isinstance(output, tuple) and output[1] is not None:
            state.attention[key] = output[1]
    return hook


def _record(state: Distillation, key: int, kind: IndexerKind, scorer_out: dict):
    def hook(module, args, kwargs, output):
        cache = kwargs.get("cache", args[kind.cache_index] if len(args) > kind.cache_index else None)
        if torch.is_grad_enabled() and cache is None:
            state.records[key] = Record(*kind.record(module, args, kwargs, output, scorer_out.pop("scores", None)),
                                        kind.trailing, kind.groups(module))
    return hook


def _detach_inputs(module, args, kwargs):
    return (tuple(a.detach() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args),
            {k: v.detach() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kwargs.items()})


@contextlib.contextmanager
def dense_selection(model: nn.Module, tokens: int, on: bool = True) -> Iterator[int]:
    """While active (and `on`), every transformers indexer of `model` keeps every candidate of a `tokens`-long
    sequence: its top-k is raised to `tokens` (rounded up to whole pools), so the main attention is dense and the
    KL distillation above trains the indexer on all causal candidates: DeepSeek-V3.2's dense warm-up stage
    (there the main model is frozen during warm-up; phasekv trains both).  Yields the number of indexers
    changed; the original top-k values are restored on exit, whatever happens."""
    changed: list[tuple[nn.Module, int]] = []
    try:
        if on:
            for _, module, kind in indexers_of(model):
                pool, name = kind.pool(module), kind.topk_attribute or "index_topk"
                changed.append((module, name, getattr(module, name)))
                setattr(module, name, -(-int(tokens) // pool) * (1 if kind.topk_in_candidates else pool))
        yield len(changed)
    finally:
        for module, name, topk in changed:
            setattr(module, name, topk)
