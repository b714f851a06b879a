"""Theorem 2 of docs/science.md section 5, simulated: gradient flow of log-linear gates concentrates statically.

Each head h has gates p^B_h(r | chunk) = softmax_r <c^B_{h,r}, x_{l,r}> for B in {K, V}, with
parameters c shared across contexts and chunks.  With the exact embeddings x_t = sqrt(kappa) u + e_t a
gate logit is sqrt(kappa) <c, u> (static: the same in every chunk) plus c[t] (content: depends on which
token sits there), so concentration can be static or input-dependent, and the run measures which.

Gradient flow is approximated by plain gradient descent with a small constant step on the population
loss, estimated each step on fresh contexts (exact over queries and vocabulary inside each context;
see `phasekv.theory.model`).  Initialization: Gaussian c scaled so that every run's whole parameter
tensor has norm rho.  Many independent runs (seeds) train at once as one batched computation; their
losses are summed, so their gradients do not interact.

Recorded over training: the loss, the static gate E[p^B_h] (mean over contexts and chunks), the two
gate-concentration coordinates of docs/science.md section 4 (static exp(H(E[p])), per-window E[exp(H(p))]),
and the largest content part of any gate logit.  At the end each head's position r_h = argmax E[p^K_h]
and the worst case over fresh contexts and chunks of p^K_h(r_h) and p^V_h(r_h + 1).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from phasekv.theory.config import FlowConfig, TheoryConfig
from phasekv.theory.model import (
    DTYPE,
    Assignment,
    embed,
    fixed_assignment,
    query_losses,
    sample_contexts,
)

log = logging.getLogger(__name__)


def gate_probabilities(c: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-linear gates: c (R, 2, m, S, d) (K then V), x (R, B, L, S, d) -> pK, pV (R, B, m, L, S)."""
    logits = torch.einsum("rkhsd,rblsd->krbhls", c, x)  # (2, R, B, m, L, S)
    p = torch.softmax(logits, dim=-1)
    return p[0], p[1]


def gate_assignment(c: torch.Tensor) -> Assignment:
    """The gates of every run as an assignment for contexts x (R, B, L, S, d)."""
    return lambda x: gate_probabilities(c, x)


def single_run_assignment(c: torch.Tensor) -> Assignment:
    """The gates c (2, m, S, d) of one run as an assignment for contexts x (..., L, S, d)."""

    def assign(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch = x.shape[:-3]
        pk, pv = gate_probabilities(c[None], x.reshape(1, -1, *x.shape[-3:]))  # (1, B, m, L, S)
        return pk.reshape(*batch, *pk.shape[2:]), pv.reshape(*batch, *pv.shape[2:])

    return assign


def effective_offsets(p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(static exp(H(E[p])), per-window E[exp(H(p))]) for p (R, B, m, L, S): each (R, m)."""

    def exp_entropy(q: torch.Tensor) -> torch.Tensor:
        return torch.exp(-(q * torch.log(q.clamp_min(1e-300))).sum(-1))

    return exp_entropy(p.mean(dim=(1, 3))), exp_entropy(p).mean(dim=(1, 3))


def content_spread(c: torch.Tensor) -> torch.Tensor:
    """(R,) the largest range over tokens of a gate logit's content part c[t] (coordinates 1..N)."""
    tok = c[..., 1:]
    return (tok.max(-1).values - tok.min(-1).values).flatten(1).max(1).values


@dataclass
class FlowResult:
    """Trajectories (lists over record points) and final statistics of a batch of runs."""

    steps: list[int] = field(default_factory=list)
    loss: list[list[float]] = field(default_factory=list)  # [point][run]
    static_p: list[list] = field(default_factory=list)  # [point][run][K/V][head][r]
    eff_static: list[list] = field(default_factory=list)  # [point][run][K/V][head]
    eff_window: list[list] = field(default_factory=list)  # [point][run][K/V][head]
    spread: list[list[float]] = field(default_factory=list)  # [point][run]
    params: torch.Tensor | None = None  # final c (R, 2, m, S, d)


def _record(result: FlowResult, step: int, loss: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor,
            c: torch.Tensor) -> None:
    result.steps.append(step)
    result.loss.append(loss.tolist())
    result.static_p.append(torch.stack([pk.mean(dim=(1, 3)), pv.mean(dim=(1, 3))], 1).tolist())
    (sk, wk), (sv, wv) = effective_offsets(pk), effective_offsets(pv)
    result.eff_static.append(torch.stack([sk, sv], 1).tolist())
    result.eff_window.append(torch.stack([wk, wv], 1).tolist())
    result.spread.append(content_spread(c).tolist())


def train_gates(cfg: TheoryConfig, flow: FlowConfig, emb: torch.Tensor, generator: torch.Generator,
                progress: bool = True) -> FlowResult:
    """Gradient descent on the gates of flow.runs independent runs.

    emb is one vocabulary (N, d) shared by the runs or one per run (R, N, d).
    """
    runs = flow.runs
    c = torch.randn((runs, 2, cfg.heads, cfg.stride, cfg.dim), generator=generator, dtype=DTYPE)
    c *= flow.rho / c.flatten(1).norm(dim=1).view(-1, 1, 1, 1, 1)
    result = FlowResult()
    for step in tqdm(range(flow.steps + 1), desc="theory: gradient flow", disable=not progress,
                     mininterval=1.0):
        tokens = sample_contexts(cfg, flow.batch, generator, runs=(runs,))  # (R, B, L, S)
        c.requires_grad_(True)
        pk, pv = gate_probabilities(c, embed(tokens, emb)[0])
        loss = query_losses(tokens, emb, fixed_assignment(pk, pv), cfg).mean(dim=(1, 2, 3))
        if step % flow.record_every == 0 or step == flow.steps:
            with torch.no_grad():
                _record(result, step, loss, pk, pv, c)
        if step == flow.steps:
            break
        (grad,) = torch.autograd.grad(loss.sum(), c)
        with torch.no_grad():
            c = c - flow.lr * grad
    result.params = c.detach()
    return result


def final_positions(cfg: TheoryConfig, c: torch.Tensor, emb: torch.Tensor, n_contexts: int,
                    generator: torch.Generator) -> dict:
    """Each head's r_h and the worst case over fresh contexts and chunks of p^K(r_h), p^V(r_h + 1).

    Returns plain lists indexed [run][head], plus whether argmax E[p^V_h] = r_h + 1.
    """
    runs = c.shape[0]
    tokens = sample_contexts(cfg, n_contexts, generator, runs=(runs,))
    with torch.no_grad():
        pk, pv = gate_probabilities(c, embed(tokens, emb)[0])  # (R, B, m, L, S)
    r_h = pk.mean(dim=(1, 3)).argmax(-1)  # (R, m)
    v_h = pv.mean(dim=(1, 3)).argmax(-1)
    idx = r_h[:, None, :, None, None].expand(-1, n_contexts, -1, cfg.chunks, 1)
    min_k = pk.gather(-1, idx).squeeze(-1).amin(dim=(1, 3))  # (R, m)
    min_v = pv.gather(-1, (idx + 1).clamp_max(cfg.stride - 1)).squeeze(-1).amin(dim=(1, 3))
    return {"r_h": r_h.tolist(), "value_after_key": (v_h == r_h + 1).tolist(),
            "min_pk": min_k.tolist(), "min_pv": min_v.tolist()}


def collision_rate(r_h: list[list[int]]) -> float:
    """Fraction of runs in which two heads settled on the same key position."""
    return sum(len(set(row)) < len(row) for row in r_h) / len(r_h)


def chance_collision_rate(cfg: TheoryConfig) -> float:
    """Collision probability if each head picked one of the S-1 key positions uniformly at random."""
    k = cfg.stride - 1
    return 1 - math.perm(k, cfg.heads) / k**cfg.heads
