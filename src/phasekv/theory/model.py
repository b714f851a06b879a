"""The idealized induction model of docs/science.md section 5, and its population loss three ways.

A context holds L chunks of S distinct tokens drawn without replacement from N embeddings with
x.x' = kappa + 1{x = x'} up to error eps.  Each of m < S heads compresses chunk l into
k = sum_r p^K(r) x_{l,r} and v = sum_r p^V(r) x_{l,r}.  A query q = x_{l*,r*} (r* < S-1, uniform
over chunks and non-final positions) attends over the L chunk keys of every head with
softmax(gamma * q.k); the head outputs are summed and unembedded against all N embeddings at scale
beta; the loss is the cross-entropy of the successor x_{l*,r*+1}.

Layout: a context is token ids (..., L, S); its embeddings X are (..., L, S, d); coefficient
vectors pK, pV are (..., m, L, S) (one probability vector per head and chunk, so the oracle class of
Theorem 1, static assignments and content-dependent gates all fit); queries are flattened to
Q = L * (S - 1) in chunk-major order.  An *assignment* is any callable X -> (pK, pV).

The population loss is computed
  * in closed form (`closed_form_losses`) for a static assignment at eps = 0, where every context is
    a relabelling of every other and the N - LS tokens outside the context share one logit;
  * exactly by enumerating every ordered context (`enumerated_loss`) for tiny N, any eps and any
    assignment;
  * by Monte Carlo over contexts with exact sums over all queries and the whole vocabulary inside
    each context (`monte_carlo_loss`), the workhorse for content-dependent gates;
and a loop-based `reference_monte_carlo_loss` that samples single (context, query) pairs is the slow
obviously-correct oracle the tests compare against.

Choices the paper leaves open (written down here): the query is uniform over the L(S-1) non-final
slots; eps > 0 embeddings are the exact ones plus a random perturbation scaled so that the largest
Gram error is exactly eps; computations are in float64.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from phasekv.theory.config import TheoryConfig

Assignment = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
DTYPE = torch.float64


# ---------------------------------------------------------------- embeddings and contexts


def make_embeddings(cfg: TheoryConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """Vocabulary embeddings E (N, N+1) with |E E^T - kappa - I| <= eps, equality of the max at eps > 0.

    At eps = 0, x_t = sqrt(kappa) u + e_t with u orthogonal to every e_t, so the Gram matrix is exactly
    kappa 11^T + I.  At eps > 0 a Gaussian perturbation D is added as E0 + t D with t chosen by bisection
    so that the largest Gram error equals eps.
    """
    n = cfg.vocab
    e0 = torch.cat([torch.full((n, 1), math.sqrt(cfg.kappa), dtype=DTYPE), torch.eye(n, dtype=DTYPE)], 1)
    if cfg.eps == 0:
        return e0
    d = torch.randn(e0.shape, generator=generator, dtype=DTYPE)
    target = torch.full((n, n), cfg.kappa, dtype=DTYPE) + torch.eye(n, dtype=DTYPE)

    def error(t: float) -> float:
        e = e0 + t * d
        return (e @ e.T - target).abs().max().item()

    lo, hi = 0.0, 1.0
    while error(hi) < cfg.eps:
        hi *= 2
    for _ in range(100):  # error(lo) < eps <= error(hi), continuous: bisect to the crossing
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if error(mid) < cfg.eps else (lo, mid)
    return e0 + hi * d


def gram_error(emb: torch.Tensor, kappa: float) -> float:
    """max |x.x' - kappa - 1{x = x'}| over the vocabulary (equation 4 of the paper)."""
    n = emb.shape[0]
    return (emb @ emb.T - kappa - torch.eye(n, dtype=emb.dtype)).abs().max().item()


def sample_contexts(cfg: TheoryConfig, n: int, generator: torch.Generator | None = None,
                    runs: tuple[int, ...] = ()) -> torch.Tensor:
    """Token ids (*runs, n, L, S): LS distinct tokens per context, uniform without replacement."""
    keys = torch.rand((*runs, n, cfg.vocab), generator=generator)
    ids = keys.argsort(dim=-1)[..., : cfg.chunks * cfg.stride]  # a uniform random injection
    return ids.reshape(*runs, n, cfg.chunks, cfg.stride)


def all_contexts(cfg: TheoryConfig) -> torch.Tensor:
    """Every ordered context (N!/(N-LS)!, L, S); only for tiny N."""
    count = math.perm(cfg.vocab, cfg.chunks * cfg.stride)
    if count > 2_000_000:
        raise ValueError(f"vocab: enumerating {count} ordered contexts is too many; use N, L, S with "
                         "N!/(N-LS)! <= 2e6")
    ids = torch.tensor(list(itertools.permutations(range(cfg.vocab), cfg.chunks * cfg.stride)))
    return ids.reshape(-1, cfg.chunks, cfg.stride)


# ---------------------------------------------------------------- assignments


def static_assignment(pk: torch.Tensor, pv: torch.Tensor) -> Assignment:
    """The same coefficient vectors pK, pV (m, S) for every context and chunk."""

    def assign(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (*x.shape[:-3], pk.shape[0], x.shape[-3], pk.shape[1])  # (..., m, L, S)
        return pk[:, None, :].expand(shape), pv[:, None, :].expand(shape)

    return assign


def fixed_assignment(pk: torch.Tensor, pv: torch.Tensor) -> Assignment:
    """Coefficients already computed, pk, pv (..., m, L, S), whatever the contexts (broadcast)."""
    return lambda x: (pk, pv)


def one_hot_assignment(cfg: TheoryConfig, positions: list[int]) -> Assignment:
    """Head h keeps its key at positions[h] and its value at positions[h] + 1 (Theorem 1's form)."""
    if len(positions) != cfg.heads or not all(0 <= r < cfg.stride - 1 for r in positions):
        raise ValueError(f"positions: need {cfg.heads} key positions in 0..{cfg.stride - 2}, got {positions}")
    eye = torch.eye(cfg.stride, dtype=DTYPE)
    idx = torch.tensor(positions)
    return static_assignment(eye[idx], eye[idx + 1])


# ---------------------------------------------------------------- the forward pass (fast path)


def successor_logits(x: torch.Tensor, emb: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor,
                     gamma: float, beta: float) -> torch.Tensor:
    """Logits over the vocabulary for every query of every context.

    x: (..., L, S, d) context embeddings; emb: (..., N, d) vocabulary (broadcast against x's batch);
    pk, pv: (..., m, L, S).  Returns (..., Q, N) with Q = L(S-1), query (l, r) at index l(S-1) + r.
    """
    s = x.shape[-2]
    q = x[..., :, : s - 1, :].flatten(-3, -2)  # (..., Q, d)
    k = torch.einsum("...hls,...lsd->...hld", pk, x)  # (..., m, L, d)
    v = torch.einsum("...hls,...lsd->...hld", pv, x)  # (..., m, L, d)
    attn = torch.softmax(gamma * torch.einsum("...qd,...hld->...hql", q, k), dim=-1)  # (..., m, Q, L)
    out = torch.einsum("...hql,...hld->...qd", attn, v)  # summed over heads: (..., Q, d)
    return beta * torch.einsum("...qd,...nd->...qn", out, emb)


def successor_targets(tokens: torch.Tensor) -> torch.Tensor:
    """Token id of each query's successor, (..., Q) for tokens (..., L, S)."""
    return tokens[..., :, 1:].flatten(-2)


def embed(tokens: torch.Tensor, emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Context embeddings x (..., L, S, d) and the vocabulary shaped to broadcast against x's batch.

    emb is one vocabulary (N, d), or one per run (R, N, d) with tokens (R, B, L, S).
    """
    if emb.dim() == 3:
        runs = torch.arange(emb.shape[0]).view(-1, 1, 1, 1)
        return emb[runs, tokens], emb[:, None]  # (R, B, L, S, d), (R, 1, N, d)
    return emb[tokens], emb


def query_logits(tokens: torch.Tensor, emb: torch.Tensor, assign: Assignment, cfg: TheoryConfig
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits (..., Q, N) of every query of contexts tokens (..., L, S) and their successors (..., Q)."""
    x, vocab = embed(tokens, emb)
    pk, pv = assign(x)
    logits = successor_logits(x, vocab, pk, pv, cfg.gamma, cfg.beta)
    return logits, successor_targets(tokens).expand(logits.shape[:-1])  # the assignment may add batch dims


def query_losses(tokens: torch.Tensor, emb: torch.Tensor, assign: Assignment, cfg: TheoryConfig
                 ) -> torch.Tensor:
    """Cross-entropy of the successor for every query: (..., L, S-1) for tokens (..., L, S)."""
    logits, target = query_logits(tokens, emb, assign, cfg)
    nll = torch.logsumexp(logits, -1) - logits.gather(-1, target[..., None]).squeeze(-1)
    return nll.unflatten(-1, (cfg.chunks, cfg.stride - 1))


def top1_accuracy(logits: torch.Tensor, target: torch.Tensor, tol: float = 1e-9) -> torch.Tensor:
    """Expected top-1 accuracy per query with ties broken uniformly at random: (..., Q)."""
    top = logits.max(-1, keepdim=True).values
    tied = logits >= top - tol
    return tied.gather(-1, target[..., None]).squeeze(-1) / tied.sum(-1)


# ---------------------------------------------------------------- the population loss, three ways


def closed_form_losses(pk: torch.Tensor, pv: torch.Tensor, cfg: TheoryConfig) -> torch.Tensor:
    """Exact loss per query position r* (S-1,) for a static assignment pK, pV (m, S) at eps = 0.

    With Gram kappa 11^T + I and rows of p summing to one, kappa shifts every score and every logit by
    the same amount and cancels.  For a query at (l*, r*) head h puts weight
    A_h = e^{gamma pK_h(r*)} / (e^{gamma pK_h(r*)} + L - 1) on its chunk and B_h = (1 - A_h)/(L - 1) on
    each other chunk, so the logit of the token at position r of chunk l* is beta sum_h A_h pV_h(r), of
    position r of any other chunk beta sum_h B_h pV_h(r) (L - 1 copies), and 0 for the N - LS tokens
    outside the context.  Differentiable in pk, pv.
    """
    big_l, s, n = cfg.chunks, cfg.stride, cfg.vocab
    e = torch.exp(cfg.gamma * pk[:, : s - 1])  # (m, S-1): per head and query position
    a = e / (e + big_l - 1)
    b = (1 - a) / max(big_l - 1, 1)
    own = cfg.beta * torch.einsum("hq,hr->qr", a, pv)  # (S-1, S) logits in the query's chunk
    parts = [own]
    if big_l > 1:
        parts.append(cfg.beta * torch.einsum("hq,hr->qr", b, pv) + math.log(big_l - 1))
    if n > big_l * s:
        parts.append(torch.full((s - 1, 1), math.log(n - big_l * s), dtype=own.dtype))
    lse = torch.logsumexp(torch.cat(parts, dim=1), dim=1)
    return lse - own[torch.arange(s - 1), torch.arange(1, s)]


def enumerated_loss(cfg: TheoryConfig, emb: torch.Tensor, assign: Assignment, batch: int = 8192
                    ) -> torch.Tensor:
    """Exact population loss per query position (S-1,) by averaging over every ordered context."""
    contexts = all_contexts(cfg)
    total = torch.zeros(cfg.stride - 1, dtype=DTYPE)
    for chunk in contexts.split(batch):
        total += query_losses(chunk, emb, assign, cfg).sum(dim=(0, 1))
    return total / (len(contexts) * cfg.chunks)


@dataclass
class MonteCarloEstimate:
    mean: float
    stderr: float
    per_position: list[float]  # mean loss by query position r*


def monte_carlo_loss(cfg: TheoryConfig, emb: torch.Tensor, assign: Assignment, n_contexts: int,
                     generator: torch.Generator | None = None, batch: int = 1024) -> MonteCarloEstimate:
    """Population loss by Monte Carlo over contexts, exact over queries and vocabulary within each one."""
    per_context, per_position = [], torch.zeros(cfg.stride - 1, dtype=DTYPE)
    for start in range(0, n_contexts, batch):
        tokens = sample_contexts(cfg, min(batch, n_contexts - start), generator)
        with torch.no_grad():
            losses = query_losses(tokens, emb, assign, cfg)  # (B, L, S-1)
        per_context.append(losses.mean(dim=(1, 2)))
        per_position += losses.sum(dim=(0, 1))
    values = torch.cat(per_context)
    stderr = values.std().item() / math.sqrt(n_contexts) if n_contexts > 1 else float("nan")
    return MonteCarloEstimate(values.mean().item(), stderr,
                              (per_position / (n_contexts * cfg.chunks)).tolist())


def retrieval_by_position(cfg: TheoryConfig, emb: torch.Tensor, assign: Assignment, tokens: torch.Tensor
                          ) -> dict[str, torch.Tensor]:
    """Probability of the correct successor and top-1 accuracy by query position r* over contexts tokens.

    tokens (..., B, L, S) with the assignment's batch dims in front; returns mean and standard error of
    the probability over the B contexts, and the mean accuracy, each (..., S-1).
    """
    with torch.no_grad():
        logits, target = query_logits(tokens, emb, assign, cfg)
    prob = torch.softmax(logits, -1).gather(-1, target[..., None]).squeeze(-1)  # (..., B, Q)
    acc = top1_accuracy(logits, target)
    per_context = prob.unflatten(-1, (cfg.chunks, cfg.stride - 1)).mean(-2)  # (..., B, S-1)
    n = per_context.shape[-2]
    return {"prob": per_context.mean(-2), "stderr": per_context.std(-2) / math.sqrt(n),
            "top1": acc.unflatten(-1, (cfg.chunks, cfg.stride - 1)).mean(dim=(-3, -2))}


# ---------------------------------------------------------------- the slow, obviously-correct reference


def reference_query_loss(emb: np.ndarray, tokens: np.ndarray, l_star: int, r_star: int, pk: np.ndarray,
                         pv: np.ndarray, *, gamma: float, beta: float) -> float:
    """Loss of one query by explicit loops: emb (N, d), tokens (L, S), pk, pv (m, L, S)."""
    heads, chunks, s = pk.shape
    q = emb[tokens[l_star, r_star]]
    out = np.zeros(emb.shape[1])
    for h in range(heads):
        keys = [sum(pk[h, l, r] * emb[tokens[l, r]] for r in range(s)) for l in range(chunks)]
        values = [sum(pv[h, l, r] * emb[tokens[l, r]] for r in range(s)) for l in range(chunks)]
        scores = np.array([gamma * float(q @ keys[l]) for l in range(chunks)])
        weights = np.exp(scores - scores.max())
        weights /= weights.sum()
        for l in range(chunks):
            out += weights[l] * values[l]
    logits = np.array([beta * float(emb[t] @ out) for t in range(emb.shape[0])])
    top = logits.max()
    return float(top + math.log(np.exp(logits - top).sum()) - logits[tokens[l_star, r_star + 1]])


def reference_monte_carlo_loss(cfg: TheoryConfig, emb: torch.Tensor, assign: Assignment, n_samples: int,
                               seed: int = 0) -> tuple[float, float]:
    """(mean, standard error) of the loss over n_samples independent (context, query) draws."""
    rng = np.random.default_rng(seed)
    e = emb.numpy()
    losses = []
    for _ in range(n_samples):
        tokens = rng.permutation(cfg.vocab)[: cfg.chunks * cfg.stride].reshape(cfg.chunks, cfg.stride)
        with torch.no_grad():
            pk, pv = assign(emb[torch.from_numpy(tokens)])
        l_star, r_star = int(rng.integers(cfg.chunks)), int(rng.integers(cfg.stride - 1))
        losses.append(reference_query_loss(e, tokens, l_star, r_star, pk.numpy(), pv.numpy(),
                                           gamma=cfg.gamma, beta=cfg.beta))
    values = np.array(losses)
    return float(values.mean()), float(values.std(ddof=1) / math.sqrt(n_samples))
