"""Permutation tests of the phase statistics: the cluster permutation test of flatness (`summarize`'s
`flatness_p`), and unit-level tests that shuffle labels only within strata (`stratified_test`): whole contexts within
a cluster (the query phase, whose contexts share a query position) and labels congruent mod d (the nested test of a
period d against the stride, `nested_period_p`).

Split from metrics.py by concept; the tests are exact under their null hypotheses because every relabelling they
draw is equally likely under it, whatever the correlation inside a cluster (metrics module docstring, `flatness_p`).
"""

from __future__ import annotations

import numpy as np

from phasekv.evaluate.resampling import CHUNK_ELEMENTS, curve_stats, group_counts


def _chi_square(k: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Pearson chi-square of the groups x {correct, wrong} table, counts of shape (..., G)."""
    p = k.sum(-1, keepdims=True) / n.sum(-1, keepdims=True)
    var = n * p * (1 - p)
    terms = np.divide((k - n * p) ** 2, var, out=np.zeros(np.broadcast_shapes(k.shape, var.shape)),
                      where=var > 0)
    return terms.sum(-1)


def cluster_flatness_test(cluster_idx: np.ndarray, residue: np.ndarray, correct: np.ndarray, *, R: int, stride: int,
                   n_perm: int, rng: np.random.Generator, swap: bool = True) -> tuple[float, float, float]:
    """Cluster permutation p-value of "accuracy equal in all residue groups", the null gap p95, and the p-value
    of the same relabellings for the phase groups (residues folded mod `stride`: the table of S groups).

    Each relabelling gives every cluster the residue labels of a random cluster of the same size
    (between-cluster swap; `swap=False`: every cluster keeps its own labels, the within-example test)
    in random order (within-cluster shuffle).  Group sizes stay fixed, so only the correct counts
    change.  p = (1 + #{X2_perm >= X2_obs}) / (1 + n_perm).
    """
    k, n = group_counts(residue, correct, R)
    observed = _chi_square(k, n)
    fold = (R // stride, stride)
    observed_phase = _chi_square(k.reshape(fold).sum(0), n.reshape(fold).sum(0))
    order = np.argsort(cluster_idx, kind="stable")
    sizes = np.bincount(cluster_idx)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    labels, hits = residue[order], correct[order]
    classes = []  # per cluster size s: (m, s) residue labels and correctness of its m clusters
    for s in np.unique(sizes[sizes > 0]):
        rows = starts[sizes == s][:, None] + np.arange(s)
        classes.append((labels[rows], hits[rows]))
    chunk = max(1, CHUNK_ELEMENTS // len(correct))
    stats, gaps, phase_stats = [], [], []
    for start in range(0, n_perm, chunk):
        b = min(chunk, n_perm - start)
        k_perm = np.zeros((b, R))
        for lab, hit in classes:
            m = lab.shape[0]
            swapped = (lab[rng.permuted(np.tile(np.arange(m), (b, 1)), axis=1)] if swap
                       else np.broadcast_to(lab, (b, *lab.shape)))  # (b, m, s)
            shuffled = rng.permuted(swapped, axis=2)
            flat = (shuffled + R * np.arange(b)[:, None, None]).ravel()
            k_perm += np.bincount(flat, weights=np.broadcast_to(hit, shuffled.shape).ravel(),
                                  minlength=b * R).reshape(b, R)
        stats.append(_chi_square(k_perm, n))
        phase_stats.append(_chi_square(k_perm.reshape(b, *fold).sum(1), n.reshape(fold).sum(0)))
        gaps.append(curve_stats(k_perm, np.broadcast_to(n, k_perm.shape), stride)[1])
    return (_p_value(np.concatenate(stats), observed), float(np.percentile(np.concatenate(gaps), 95)),
            _p_value(np.concatenate(phase_stats), observed_phase))


def _p_value(stats: np.ndarray, observed: float) -> float:
    """(1 + #{relabelled >= observed}) / (1 + relabellings), with a relative tolerance for float ties."""
    exceed = np.count_nonzero(stats >= observed - 1e-9 * max(1.0, observed))
    return float((1 + exceed) / (1 + len(stats)))


def stratified_test(strata: np.ndarray, label: np.ndarray, k: np.ndarray, n: np.ndarray, *, groups: int,
                    n_perm: int, rng: np.random.Generator) -> tuple[float, float]:
    """Permutation p-value of "accuracy equal in all `groups` label groups" (Pearson chi-square of the groups x
    correct table) with units' labels shuffled only among the units of one stratum, and the 95th percentile of
    the relabelled best-minus-worst gap (pp).

    One unit per entry: strata (any ids), label in 0..groups-1, k correct of n prompts.  A unit's prompts move
    together: under the query protocol the unit is a context (its prompts share a query position and whatever the
    context does to them), the stratum its cluster, so a context effect moves whole units and cannot pass for a
    phase effect.  Units of unequal size are allowed: group sizes are recounted in every relabelling.
    """
    strata, label = np.asarray(strata), np.asarray(label, dtype=np.int64)
    k, n = np.asarray(k, dtype=float), np.asarray(n, dtype=float)
    _, stratum = np.unique(strata, return_inverse=True)
    order = np.argsort(stratum, kind="stable")
    stratum, label, k, n = stratum[order], label[order], k[order], n[order]
    U = len(label)
    observed = _chi_square(*_unit_counts(label[None], k, n, groups))[0]
    chunk = max(1, CHUNK_ELEMENTS // max(U, 1))
    stats, gaps = [], []
    for start in range(0, n_perm, chunk):
        b = min(chunk, n_perm - start)
        shuffled = np.argsort(stratum + rng.random((b, U)), axis=1)  # a permutation within every stratum block
        kp, np_ = _unit_counts(label[shuffled], k, n, groups)
        stats.append(_chi_square(kp, np_))
        acc = np.divide(kp, np_, out=np.full(kp.shape, np.nan), where=np_ > 0)
        gaps.append(100 * (np.nanmax(acc, 1) - np.nanmin(acc, 1)))
    return _p_value(np.concatenate(stats), observed), float(np.percentile(np.concatenate(gaps), 95))


def _unit_counts(labels: np.ndarray, k: np.ndarray, n: np.ndarray, groups: int) -> tuple[np.ndarray, np.ndarray]:
    """(b, groups) correct and total counts of units whose labels are the rows of `labels` (b, U)."""
    b = labels.shape[0]
    flat = (labels + groups * np.arange(b)[:, None]).ravel()
    kp = np.bincount(flat, weights=np.broadcast_to(k, labels.shape).ravel(), minlength=b * groups)
    np_ = np.bincount(flat, weights=np.broadcast_to(n, labels.shape).ravel(), minlength=b * groups)
    return kp.reshape(b, groups), np_.reshape(b, groups)


def nested_period_p(cluster: np.ndarray, phase: np.ndarray, k: np.ndarray, n: np.ndarray, *, stride: int,
                    n_perm: int, rng: np.random.Generator) -> dict[str, float]:
    """Per proper divisor d > 1 of the stride, the p-value of "the phase curve is its fold mod d" (accuracy at
    phase p equals that at p + d, p + 2 d, ...) against the full curve over the S phases: units' phase labels are
    shuffled only within (cluster, phase mod d), which leaves the mod-d curve unchanged, and the statistic is the
    chi-square of the S phase groups (where every cluster sits at one phase, whole clusters are shuffled within
    their class mod d instead, as the flatness test swaps label sets between clusters).  A large p means the
    period d explains the curve as well as S does."""
    cluster, phase = np.asarray(cluster), np.asarray(phase, dtype=np.int64)
    k, n = np.asarray(k, dtype=float), np.asarray(n, dtype=float)
    _, cluster_idx = np.unique(cluster, return_inverse=True)
    single = len(np.unique(cluster_idx * stride + phase)) == cluster_idx.max() + 1
    if single:  # every cluster at one phase (e.g. the query protocol's pairs): whole clusters are the units
        C = cluster_idx.max() + 1
        phase = phase[np.unique(cluster_idx, return_index=True)[1]]
        k, n = np.bincount(cluster_idx, k, C), np.bincount(cluster_idx, n, C)
    out = {}
    for d in range(2, stride):
        if stride % d == 0:
            strata = phase % d if single else cluster_idx * d + phase % d
            out[str(d)] = stratified_test(strata, phase, k, n, groups=stride, n_perm=n_perm, rng=rng)[0]
    return out


