"""The training signal of transformers' sparse-attention indexers (DeepSeek-V4 CSA, DeepSeek-V3.2 DSA, GLM-5.3 DSA).

In all three the lightning indexer only *selects* (top-k indices), so the language-model loss gives its parameters
no gradient.  DeepSeek-V3.2 (arXiv 2512.02556, section 2.1) trains it by distillation from the main attention: for
query t, the main attention probabilities are summed over heads and L1-normalized over the candidates (target p_t);
the indexer's scores I_t are softmaxed over the same candidates; the loss is

    L_I = mean_t KL(p_t || softmax(I_t))          (the paper sums over t; the mean keeps the weight scale-free)

with the indexer's inputs detached and the target detached, so L_I reaches only indexer parameters and the
language-model gradients are unchanged.  The candidates are those the main attention used: the top-k selection,
restricted to causal ones (DeepSeek's sparse-training stage; when the top-k covers every causal candidate this is
its dense warm-up stage).

One `_Kind` per indexer class says how to get the scores and what a candidate is:

  DeepSeek-V4 (`DeepseekV4Indexer`)    candidates are compressed entries (one per m tokens); the scores are the
                                       output of the real `DeepseekV4IndexerScorer` (differentiable), with the
                                       indexer's inputs detached by a pre-hook
  DeepSeek-V3.2 (`DeepseekV32Indexer`) candidates are tokens; the real indexer runs under no_grad, so its scores
                                       are recomputed from its own submodules on its detached inputs
  GLM-5.3 (`Glm5NextTextIndexer`)      candidates are complete pools of `index_kpool` tokens (a pool's target mass
                                       is its tokens' attention mass; the raw tail the model always attends is no
                                       candidate); scores recomputed as for V3.2, pooling with the module's own
                                       `get_pooled_states`

The recomputations are checked against the real modules' selections in tests/test_realarch.py.
`distillation(model)` hooks the real modules (forward hooks that record, a pre-hook that detaches) and removes
every hook on exit, whatever happens.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn


class Record(NamedTuple):
    """One indexer call of a training forward."""

    scores: torch.Tensor  # (B, S, C) indexer scores, with grad into the indexer's parameters only
    candidates: torch.Tensor  # (B, S, C) bool: candidates the query may select (causal, complete)
    selected: torch.Tensor  # (B, S, C) bool: what the real indexer selected
    pools: torch.Tensor | None  # (B, C, kpool) token indices of each candidate pool; None: one key per candidate
    trailing: bool  # candidates are the attention's trailing key columns (V4: compressed entries after raw keys)

    @property
    def used(self) -> torch.Tensor:
        return self.candidates & self.selected


@dataclass
class _Kind:
    """How one transformers indexer class is hooked: the indexer, its attention module, and `record`, which turns
    one indexer call (module, args, kwargs, output, scorer output) into the first four fields of a Record."""

    indexer: type
    attention: type
    record: Any
    cache_index: int  # position of the indexer's `cache` argument (only cache-free training forwards are recorded)
    scorer: type | None = None  # a differentiable scoring submodule: its inputs are detached, its output recorded
    trailing: bool = False  # candidates are the attention's trailing key columns (V4: compressed entries after raw)


def _selected(indices: torch.Tensor, width: int) -> torch.Tensor:
    """Top-k indices (B, S, k), -1 for none -> (B, S, width) bool."""
    valid = (indices >= 0) & (indices < width)
    out = torch.zeros(*indices.shape[:2], width + 1, dtype=torch.bool, device=indices.device)
    out.scatter_(-1, torch.where(valid, indices.long(), width), True)
    return out[..., :width]


def _v4_record(indexer, args, kwargs, output, scores):
    position_ids = _arg(args, kwargs, 2, "position_ids")
    width = scores.shape[-1]
    causal = torch.arange(width, device=scores.device) < ((position_ids + 1) // indexer.compress_rate)[..., None]
    return scores, causal, _selected(output, width), None


def _v32_scores(indexer, hidden: torch.Tensor, q_resid: torch.Tensor, cos_sin) -> torch.Tensor:
    """DeepseekV32Indexer.forward's scores, with grad: sum_h w_{t,h} ReLU(q_{t,h} . k_s) / sqrt(D) (B, S, T)."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import apply_rotary_pos_emb

    b, s, _ = hidden.shape
    q = indexer.wq_b(q_resid).view(b, s, indexer.n_heads, indexer.head_dim)  # (B, S, H, D)
    rope = indexer.qk_rope_head_dim
    q_rot, q_pass = q.split([rope, indexer.head_dim - rope], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)  # (B, S, 1, D)
    k_rot, k_pass = k.split([rope, indexer.head_dim - rope], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb(q_rot, k_rot, *cos_sin, unsqueeze_dim=2)
    q, k = torch.cat([q_rot, q_pass], -1), torch.cat([k_rot, k_pass], -1).squeeze(2)  # (B, S, H, D), (B, S, D)
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * indexer.softmax_scale)
    weights = indexer.weights_proj(hidden).float() * indexer.n_heads ** -0.5  # (B, S, H)
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # (B, S, T)


def _v32_record(indexer, args, kwargs, output, _scores):
    hidden, q_resid = _arg(args, kwargs, 0, "hidden_states"), _arg(args, kwargs, 1, "q_resid")
    mask = _arg(args, kwargs, 3, "attention_mask")  # (B, S, T): additive (0 = visible) or bool (True = visible)
    scores = _v32_scores(indexer, hidden.detach(), q_resid.detach(), _arg(args, kwargs, 2, "position_embeddings"))
    causal = mask if mask.dtype == torch.bool else mask == 0
    return scores, causal, _selected(output, scores.shape[-1]), None


def glm5_pool_scores(indexer, hidden: torch.Tensor, q_resid: torch.Tensor, mask: torch.Tensor):
    """Glm5NextTextIndexer.forward's pool scores, with grad (no cache): (scores (B, S, P), candidates (B, S, P)
    bool: complete pools whose last token the query sees, pool token indices (B, P, kpool))."""
    b, s, _ = hidden.shape
    q = indexer.wq_b(q_resid).view(b, s, -1, indexer.head_dim)  # (B, S, H, D)
    k = indexer.k_norm(indexer.wk(hidden))  # (B, S, D)
    gate = F.linear(hidden, indexer.index_kpool_compress_gate)  # (B, S, D)
    packed = torch.cat([k, gate, mask.to(k.dtype)[..., None]], dim=-1)
    pool_keys, pool_indices, pool_valid = indexer.get_pooled_states(packed_states=packed)
    scores = F.relu(torch.matmul(q.float(), pool_keys.transpose(-1, -2).float().unsqueeze(1)) * indexer.softmax_scale)
    weights = indexer.weights_proj(hidden).float() * indexer.n_heads ** -0.5  # (B, S, H)
    scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # (B, S, P)
    visible = indexer.get_visible_tokens(valid_keys=mask.bool(), q_length=s, current_length=s)  # (B, S, T)
    ends = pool_indices[..., -1].clamp(0, s - 1)  # (B, P)
    candidates = visible.gather(-1, ends[:, None, :].expand(b, s, -1)) & pool_valid[:, None]
    return scores, candidates, pool_indices


def _glm5_record(indexer, args, kwargs, output, _scores):
    hidden, q_resid = _arg(args, kwargs, 0, "hidden_states"), _arg(args, kwargs, 1, "q_resid")
    mask = _arg(args, kwargs, 2, "attention_mask")  # (B, S) bool padding mask
    scores, candidates, pools = glm5_pool_scores(indexer, hidden.detach(), q_resid.detach(), mask)
    tokens = _selected(output, hidden.shape[1])  # (B, S, T)
    first = pools[..., 0].clamp(min=0)  # (B, P): a complete pool is selected whole, so its first token says it
    return scores, candidates, tokens.gather(-1, first[:, None, :].expand(-1, tokens.shape[1], -1)), pools


def _arg(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    return kwargs[name] if name in kwargs else args[index]


def _kinds() -> list[_Kind]:
    """The indexer classes of the installed transformers (imported only when a model is inspected)."""
    kinds = []
    with contextlib.suppress(ImportError):
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

        kinds.append(_Kind(v4.DeepseekV4Indexer, v4.DeepseekV4Attention, _v4_record, 3, v4.DeepseekV4IndexerScorer,
                           trailing=True))
    with contextlib.suppress(ImportError):
        from transformers.models.deepseek_v32 import modeling_deepseek_v32 as v32

        kinds.append(_Kind(v32.DeepseekV32Indexer, v32.DeepseekV32Attention, _v32_record, 5))
    with contextlib.suppress(ImportError):
        from transformers.models.glm5_next import modeling_glm5_next as glm

        kinds.append(_Kind(glm.Glm5NextTextIndexer, glm.Glm5NextTextAttention, _glm5_record, 3))
    return kinds


def indexers_of(model: nn.Module) -> list[tuple[nn.Module, nn.Module, _Kind]]:
    """(attention module, its indexer, kind) for every indexer of a transformers sparse-attention model, found by
    type; [] for any other model (phasekv models included)."""
    if "transformers" not in sys.modules:  # a model of transformers' classes has imported it
        return []
    kinds = _kinds()
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
            mass = probs.detach().float().sum(1)  # (B, S, keys): heads summed
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


def _record(state: Distillation, key: int, kind: _Kind, scorer_out: dict):
    def hook(module, args, kwargs, output):
        cache = kwargs.get("cache", args[kind.cache_index] if len(args) > kind.cache_index else None)
        if torch.is_grad_enabled() and cache is None:
            state.records[key] = Record(*kind.record(module, args, kwargs, output, scorer_out.pop("scores", None)),
                                        kind.trailing)
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
            for _, module, _ in indexers_of(model):
                pool = int(getattr(module, "index_kpool", 1) or 1)
                changed.append((module, module.index_topk))
                module.index_topk = -(-int(tokens) // pool) * pool
        yield len(changed)
    finally:
        for module, topk in changed:
            module.index_topk = topk
