"""Theorem 1 of docs/science.md section 5, checked numerically: the oracle optimum is one-hot and adjacent.

In the oracle class the coefficient vectors p^K_{h,l}, p^V_{h,l} may depend on the context, the chunk
and the head (never on the query), so the population loss is minimized context by context: for one
context X we minimize the mean successor loss over its L(S-1) queries.  At eps = 0 every context is a
relabelling of every other, so one context stands for all.

Three views of that minimization:
  * exhaustive enumeration of every one-hot assignment (a key position and a value position for each
    head and chunk: S^(2mL) of them), whose minimizers should all be p^K = e_r, p^V = e_(r+1) with,
    at eps = 0, distinct r across the heads of a chunk;
  * projected gradient descent over the full product of simplices from random starts, which should
    not beat the enumerated optimum and should end at a one-hot point;
  * random (Dirichlet) and smoothed assignments (the optimum mixed with the uniform vector), which
    should all be worse, the more so the more they are smoothed.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch

from phasekv.theory.model import (
    DTYPE,
    TheoryConfig,
    fixed_assignment,
    make_embeddings,
    query_losses,
    sample_contexts,
)

log = logging.getLogger(__name__)


def context_loss(cfg: TheoryConfig, emb: torch.Tensor, tokens: torch.Tensor, pk: torch.Tensor,
                 pv: torch.Tensor) -> torch.Tensor:
    """Mean successor loss over the queries of one context tokens (L, S), for a batch pk, pv (A, m, L, S)."""
    return query_losses(tokens[None], emb, fixed_assignment(pk, pv), cfg).mean(dim=(-2, -1))  # (A,)


@dataclass
class Enumeration:
    losses: torch.Tensor  # (A,)
    key_pos: torch.Tensor  # (A, m, L) position of p^K's one
    value_pos: torch.Tensor  # (A, m, L) position of p^V's one


def enumerate_one_hot(cfg: TheoryConfig, emb: torch.Tensor, tokens: torch.Tensor, batch: int = 4096
                      ) -> Enumeration:
    """Loss of every one-hot assignment (free per head and chunk) on one context tokens (L, S)."""
    m, big_l, s = cfg.heads, cfg.chunks, cfg.stride
    n = (s * s) ** (m * big_l)
    if n > 2_000_000:
        raise ValueError(f"enumeration: S^(2mL) = {n} assignments is too many; use smaller S, m or L")
    codes = torch.tensor(list(itertools.product(range(s * s), repeat=m * big_l))).view(-1, m, big_l)
    key_pos, value_pos = codes // s, codes % s  # (A, m, L)
    eye = torch.eye(s, dtype=DTYPE)
    losses = torch.cat([context_loss(cfg, emb, tokens, eye[k], eye[v])
                        for k, v in zip(key_pos.split(batch), value_pos.split(batch))])
    return Enumeration(losses, key_pos, value_pos)


def is_adjacent(key_pos: torch.Tensor, value_pos: torch.Tensor) -> torch.Tensor:
    """(A,) bool: every head and chunk has p^V one position after p^K."""
    return (value_pos == key_pos + 1).flatten(1).all(dim=1)


def is_distinct(key_pos: torch.Tensor) -> torch.Tensor:
    """(A,) bool: within every chunk the heads' key positions differ."""
    m = key_pos.shape[1]
    pairs = [(key_pos[:, a] != key_pos[:, b]).all(dim=1) for a in range(m) for b in range(a + 1, m)]
    return torch.stack(pairs).all(dim=0) if pairs else torch.ones(len(key_pos), dtype=torch.bool)


def project_to_simplex(v: torch.Tensor) -> torch.Tensor:
    """Euclidean projection of each row of v (..., S) onto the probability simplex (sort-based)."""
    u = v.sort(dim=-1, descending=True).values
    css = u.cumsum(-1) - 1
    ks = torch.arange(1, v.shape[-1] + 1, dtype=v.dtype)
    rho = (u - css / ks > 0).sum(-1, keepdim=True)  # number of positive entries in the projection
    tau = css.gather(-1, rho - 1) / rho
    return (v - tau).clamp_min(0)


def reference_project_to_simplex(v: torch.Tensor, iters: int = 200) -> torch.Tensor:
    """Slow reference: bisect for the threshold tau with sum(max(v - tau, 0)) = 1, row by row."""
    out = torch.empty_like(v)
    for i, row in enumerate(v.reshape(-1, v.shape[-1])):
        lo, hi = row.min().item() - 1, row.max().item()
        for _ in range(iters):
            tau = (lo + hi) / 2
            lo, hi = (tau, hi) if (row - tau).clamp_min(0).sum() > 1 else (lo, tau)
        out.view(-1, v.shape[-1])[i] = (row - (lo + hi) / 2).clamp_min(0)
    return out


def random_simplex(shape: tuple[int, ...], size: int, generator: torch.Generator | None = None
                   ) -> torch.Tensor:
    """Uniform (Dirichlet(1)) probability vectors (*shape, size): normalized exponential variables."""
    e = -torch.log1p(-torch.rand((*shape, size), generator=generator, dtype=DTYPE))
    return e / e.sum(-1, keepdim=True)


def oracle_descent(cfg: TheoryConfig, emb: torch.Tensor, tokens: torch.Tensor, *, restarts: int, steps: int,
                   lr: float, generator: torch.Generator | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Projected gradient descent over the oracle class of one context from Dirichlet(1) starts.

    Returns final losses (R,) and pk, pv (R, m, L, S).
    """
    shape = (restarts, cfg.heads, cfg.chunks, cfg.stride)
    pk, pv = (random_simplex(shape[:-1], cfg.stride, generator) for _ in range(2))
    for _ in range(steps):
        pk.requires_grad_(True)
        pv.requires_grad_(True)
        loss = context_loss(cfg, emb, tokens, pk, pv)
        gk, gv = torch.autograd.grad(loss.sum(), (pk, pv))
        with torch.no_grad():
            pk, pv = project_to_simplex(pk - lr * gk), project_to_simplex(pv - lr * gv)
    with torch.no_grad():
        return context_loss(cfg, emb, tokens, pk, pv), pk, pv


def theorem1_check(cfg: TheoryConfig, seed: int = 0, restarts: int = 16, steps: int = 300, lr: float = 1.0, *,
                   n_random: int = 2000, smoothing: tuple[float, ...] = (0.0, 0.05, 0.1, 0.2, 0.4, 0.7, 1.0)
                   ) -> tuple[dict, dict]:
    """Enumeration, descent, random and smoothed assignments on one context.

    Returns a plain-JSON summary and the loss arrays the figure draws (sorted enumerated losses,
    random losses).
    """
    gen = torch.Generator().manual_seed(seed)
    emb = make_embeddings(cfg, gen)
    tokens = sample_contexts(cfg, 1, gen)[0]
    enum = enumerate_one_hot(cfg, emb, tokens)
    best = enum.losses.min().item()
    optimal = enum.losses <= best + 1e-9
    adjacent, distinct = is_adjacent(enum.key_pos, enum.value_pos), is_distinct(enum.key_pos)
    log.info("theorem 1: %d one-hot assignments, optimum %.6f", len(enum.losses), best)

    desc_loss, pk, pv = oracle_descent(cfg, emb, tokens, restarts=restarts, steps=steps, lr=lr, generator=gen)
    i = int(desc_loss.argmin())
    dk, dv = pk[i].argmax(-1), pv[i].argmax(-1)  # (m, L)
    shape = (n_random, cfg.heads, cfg.chunks)
    with torch.no_grad():
        random_loss = context_loss(cfg, emb, tokens, random_simplex(shape, cfg.stride, gen),
                                   random_simplex(shape, cfg.stride, gen))
    eye = torch.eye(cfg.stride, dtype=DTYPE)
    j = int(enum.losses.argmin())
    opt_k, opt_v = eye[enum.key_pos[j]], eye[enum.value_pos[j]]  # (m, L, S)
    t = torch.tensor(smoothing, dtype=DTYPE).view(-1, 1, 1, 1)
    with torch.no_grad():
        smooth_loss = context_loss(cfg, emb, tokens, (1 - t) * opt_k + t / cfg.stride,
                                   (1 - t) * opt_v + t / cfg.stride)
    summary = {
        "config": {"chunks": cfg.chunks, "stride": cfg.stride, "vocab": cfg.vocab, "heads": cfg.heads,
                   "eps": cfg.eps},
        "n_assignments": len(enum.losses),
        "optimal_loss": best,
        "n_optimal": int(optimal.sum()),
        "optimal_all_adjacent": bool(adjacent[optimal].all()),
        "optimal_all_distinct": bool(distinct[optimal].all()),
        "best_nonadjacent_loss": enum.losses[~adjacent].min().item(),
        "best_collided_loss": enum.losses[adjacent & ~distinct].min().item()
        if (adjacent & ~distinct).any() else None,
        "optimal_key_positions": enum.key_pos[j].tolist(),  # [head][chunk]
        "descent_best_loss": desc_loss[i].item(),
        "descent_gap": desc_loss[i].item() - best,
        "descent_fraction_at_optimum": (desc_loss <= best + 1e-6).double().mean().item(),
        "descent_min_max_coefficient": min(pk[i].max(-1).values.min().item(), pv[i].max(-1).values.min().item()),
        "descent_adjacent": bool((dv == dk + 1).all()),
        "random_min_loss": random_loss.min().item(),
        "random_mean_loss": random_loss.mean().item(),
        "smoothing": list(smoothing),
        "smoothed_loss": smooth_loss.tolist(),
        "smoothed_increasing": bool((smooth_loss.diff() > 0).all()),
    }
    return summary, {"enumerated": enum.losses.sort().values, "random": random_loss,
                     "adjacent_distinct": enum.losses[adjacent & distinct]}
