"""The cluster bootstrap and the cross-fitted (selection-free) contrasts of `phasekv.evaluate.metrics.summarize`.

Split from metrics.py by concept: this module resamples clusters (docs/science.md section 3: the prompts of one
logical example are correlated, so the cluster is the resampling unit) and computes the curve statistics of every
replicate; the permutation tests live in `phasekv.evaluate.permutation`.  The estimators are described in the
metrics module's docstring (`gap_crossfit_pp`, `contrast_crossfit_pp` and their bounds).
"""

from __future__ import annotations

from typing import Any

import numpy as np

CONTRAST_BOUND_PERCENTILES = (5.0, 95.0)  # the phase contrast's bounds: one-sided 95% each (the material rule)
CI_PERCENTILES = (2.5, 97.5)  # the two-sided 95% percentile intervals (mean_ci, gap_ci_pp, ...)
CROSSFIT_SPLITS = 20  # random half-splits of the clusters averaged by the cross-fitted point estimates
CHUNK_ELEMENTS = 2_000_000  # bounds the memory of one vectorized block of bootstrap/permutation draws


def group_counts(group: np.ndarray, correct: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Correct and total prompts per group id in 0..n_groups-1 (float arrays of exact integers)."""
    k = np.bincount(group, weights=correct, minlength=n_groups)
    n = np.bincount(group, minlength=n_groups).astype(float)
    return k, n


def curve_stats(k: np.ndarray, n: np.ndarray, stride: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean of the residue curve, residue gap and phase gap (pp) from counts of shape (..., R).

    Groups with n = 0 (possible only in a bootstrap replicate) are left out of mean and gaps.
    """
    acc = np.divide(k, n, out=np.full(k.shape, np.nan), where=n > 0)
    phase_shape = (*k.shape[:-1], k.shape[-1] // stride, stride)
    k_phase, n_phase = k.reshape(phase_shape).sum(-2), n.reshape(phase_shape).sum(-2)
    acc_phase = np.divide(k_phase, n_phase, out=np.full(k_phase.shape, np.nan), where=n_phase > 0)
    gap = 100 * (np.nanmax(acc, -1) - np.nanmin(acc, -1))
    phase_gap = 100 * (np.nanmax(acc_phase, -1) - np.nanmin(acc_phase, -1))
    return np.nanmean(acc, -1), gap, phase_gap


def _crossfit_gaps(k_a: np.ndarray, n_a: np.ndarray, k_b: np.ndarray, n_b: np.ndarray) -> np.ndarray:
    """Selection-free contrasts (pp) of groups chosen on half a and measured on half b, and vice versa, averaged:
    [..., 0] best minus worst group; [..., 1] the phase contrast: the dip (the mean of the upper half of the groups
    minus the worst) or, when the best group stands further above the median than the worst falls below it (a lone
    strong phase), the peak (the best minus the mean of the lower half); chosen on one half, measured on the other.

    Counts of shape (..., R); result (..., 2).  Groups empty in the choosing half are skipped; a contrast whose
    chosen groups are empty in the measuring half is nan.
    """
    def one_way(k_sel, n_sel, k_eval, n_eval):
        acc_sel = np.divide(k_sel, n_sel, out=np.full(k_sel.shape, np.nan), where=n_sel > 0)
        acc_eval = np.divide(k_eval, n_eval, out=np.full(k_eval.shape, np.nan), where=n_eval > 0)
        order = np.argsort(np.where(np.isnan(acc_sel), np.inf, -acc_sel), -1)  # best first, empty groups last
        seen = np.count_nonzero(~np.isnan(acc_sel), -1)[..., None]
        rank = np.arange(acc_sel.shape[-1])
        half = (seen + 1) // 2
        upper, lower = rank < half, (rank >= seen - half) & (rank < seen)  # (..., R) masks over the order
        first, last = rank == 0, rank == seen - 1

        def contrast(acc, high, low):
            ordered = np.take_along_axis(acc, order, -1)
            return _masked_mean(ordered, high) - _masked_mean(ordered, low)

        # a lone strong group stands further above the median than the weakest falls below it (the median, not
        # the halves' means: a half holding the weak groups would otherwise make a weak phase look like a peak)
        ordered = np.take_along_axis(acc_sel, order, -1)
        median = np.nanmedian(np.where(rank < seen, ordered, np.nan), -1)
        peak = ordered[..., 0] - median > median - np.take_along_axis(ordered, seen - 1, -1)[..., 0]
        phase = np.where(peak, contrast(acc_eval, first, lower), contrast(acc_eval, upper, last))
        return np.stack([contrast(acc_eval, first, last), phase], -1)

    return 50 * (one_way(k_a, n_a, k_b, n_b) + one_way(k_b, n_b, k_a, n_a))


def _masked_mean(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Mean over the last axis of the finite values where `mask` is set; nan where there are none."""
    keep = mask & ~np.isnan(values)
    count = np.count_nonzero(keep, -1)
    return np.divide(np.where(keep, values, 0.0).sum(-1), count, out=np.full(count.shape, np.nan), where=count > 0)


def crossfit_estimate(kc: np.ndarray, nc: np.ndarray, rng: np.random.Generator,
                       n_splits: int = CROSSFIT_SPLITS) -> list[float | None]:
    """Both cross-fitted contrasts of `_crossfit_gaps` (pp) averaged over random half-splits of the clusters;
    None where there are < 2 clusters or no split measured it."""
    C = kc.shape[0]
    if C < 2:
        return [None, None]
    gaps = []
    for _ in range(n_splits):
        perm = rng.permutation(C)
        a, b = perm[: C // 2], perm[C // 2 :]
        gaps.append(_crossfit_gaps(kc[a].sum(0), nc[a].sum(0), kc[b].sum(0), nc[b].sum(0)))
    gaps = np.asarray(gaps)  # (splits, 2)
    return [None if np.all(np.isnan(g)) else float(np.nanmean(g)) for g in gaps.T]


def cluster_bootstrap(kc: np.ndarray, nc: np.ndarray, stride: int, n_boot: int,
                       rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """Replicates of (mean, gap, phase gap, cross-fitted gap) with clusters resampled with replacement.

    kc, nc: (C, R) correct / total counts per cluster and residue.  A replicate draws C clusters
    with replacement; its counts are the multiplicity-weighted sums of the clusters' counts.  The
    first C // 2 draws and the rest are the two halves of the cross-fitted gap (nan replicates,
    where a chosen group is empty in the other half, are dropped).
    """
    C = kc.shape[0]
    chunk = max(1, CHUNK_ELEMENTS // C)
    parts = []
    for start in range(0, n_boot, chunk):
        b = min(chunk, n_boot - start)
        draws = rng.integers(0, C, size=(b, C))
        offset = C * np.arange(b)[:, None]
        halves = [np.bincount((d + offset).ravel(), minlength=b * C).reshape(b, C).astype(float)
                  for d in (draws[:, : C // 2], draws[:, C // 2 :])]  # (b, C) multiplicity of each cluster
        weights = halves[0] + halves[1]
        stats = curve_stats(weights @ kc, weights @ nc, stride)
        crossfit = (_crossfit_gaps(halves[0] @ kc, halves[0] @ nc, halves[1] @ kc, halves[1] @ nc)[:, 0] if C > 1
                    else np.full(b, np.nan))
        parts.append((*stats, crossfit))
    reps = [np.concatenate(p) for p in zip(*parts)]
    reps[3] = reps[3][~np.isnan(reps[3])]
    return tuple(reps)


def split_bootstrap(kc: np.ndarray, nc: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """Replicates of the cross-fitted phase contrast (pp, nan dropped; empty for < 2 clusters): each replicate
    splits the clusters into halves and resamples each half with replacement from its own clusters.  Drawing both
    halves from all clusters (as the gap's bootstrap does) puts ~15% of the clusters in both halves, so the
    choosing half's noise leaks into the measuring half: in simulation a flat curve's lower bound sat above 0."""
    C = kc.shape[0]
    if C < 2:
        return np.empty(0)
    chunk = max(1, CHUNK_ELEMENTS // C)
    parts = []
    for start in range(0, n_boot, chunk):
        b = min(chunk, n_boot - start)
        perm = rng.permuted(np.tile(np.arange(C), (b, 1)), axis=1)  # (b, C): a random split per replicate
        offset = C * np.arange(b)[:, None]
        halves = []
        for part in (perm[:, : C // 2], perm[:, C // 2 :]):
            draws = np.take_along_axis(part, rng.integers(0, part.shape[1], part.shape), 1)  # within the half
            halves.append(np.bincount((draws + offset).ravel(), minlength=b * C).reshape(b, C).astype(float))
        parts.append(_crossfit_gaps(halves[0] @ kc, halves[0] @ nc, halves[1] @ kc, halves[1] @ nc)[:, 1])
    reps = np.concatenate(parts)
    return reps[~np.isnan(reps)]


def percentile_ci(samples: np.ndarray) -> list[float]:
    low, high = np.percentile(samples, CI_PERCENTILES)
    return [float(low), float(high)]


def contrast_bounds(dip: float | None, samples: np.ndarray) -> dict[str, Any]:
    """`contrast_crossfit_bounds_pp` (the CONTRAST_BOUND_PERCENTILES of the bootstrap: each a one-sided 95% bound)
    and `contrast_crossfit_se_pp` (the bootstrap's sd); None without a contrast or with < 20 finite replicates."""
    if dip is None or samples.size < 20:
        return {"contrast_crossfit_bounds_pp": None, "contrast_crossfit_se_pp": None}
    return {"contrast_crossfit_bounds_pp": [float(x) for x in np.percentile(samples, CONTRAST_BOUND_PERCENTILES)],
            "contrast_crossfit_se_pp": float(samples.std(ddof=1))}


def basic_gap_ci(observed: float, samples: np.ndarray) -> list[float]:
    """Basic bootstrap interval of a gap in pp: reflects the percentiles around the estimate."""
    low, high = np.percentile(samples, CI_PERCENTILES)
    return [float(max(0.0, 2 * observed - high)), float(min(100.0, 2 * observed - low))]


