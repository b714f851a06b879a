"""Statistics of the phase-sensitivity evaluation (docs/science.md sections 3 and 6).

Input: one record per prompt with `cluster` (id of the logical example that is shown at several
shifts), `target_position` (absolute token position of the target key, counting every filler and
special token) and `correct` (full-vocabulary top-1 hit, computed elsewhere).  Prompts are grouped
by residue = position mod R and by phase = position mod S; R must be a multiple of S, so the phase
curve is the residue curve folded mod S.

What `summarize` computes, and why:

* Per group: accuracy and a Wilson 95% interval.  Weak phases of compressed models sit near 0%,
  where the Wald interval collapses to a point; Wilson keeps its coverage there.
* `mean_accuracy`: the mean of the per-residue accuracies, i.e. the height of the residue curve
  (equal to the prompt-level mean when the groups have equal size, as both protocols make them).
* `max_gap_pp`: best minus worst residue group in percentage points (the paper's phase gap);
  `phase_gap_pp`: the same over the phases mod S.
* Cluster bootstrap (docs/science.md section 3): the prompts of one logical example are correlated (an
  easy example is right at every shift), so the resampling unit is the cluster.  95% percentile
  intervals for the mean and both gaps.  The max-minus-min gap is biased upward by noise (the range
  of R noisy estimates is positive even for a flat truth), so `gap_ci_pp` says how precisely the
  observed gap is measured; it is not a test of "no phase effect".  The same bias shifts the
  percentile interval itself upward (bootstrap replicates add their own noise to the range): in
  simulation it can miss both the true gap and the observed one.  `gap_ci_basic_pp` is therefore
  given beside it: the basic bootstrap interval [2 g - q97.5, 2 g - q2.5] (clipped to [0, 100]),
  which subtracts the bootstrap estimate of that bias.  Neither covers well: the bootstrap is not
  consistent for a max/min over groups with tied true accuracies (the many good phases).  In
  simulations of prefix-padding oracles (n = 150-400 per group, true gaps 30-90 pp) the percentile
  interval covered the true gap in 0-13% of runs, the basic one in 40-77%.
* `gap_crossfit_pp`: a selection-free gap.  Clusters are split into halves; the best and worst
  residue groups are chosen on one half and their accuracies measured on the other (both ways,
  averaged; the point estimate averages 20 random splits).  Noise in the measuring half is
  independent of the choice, so the estimate is unbiased for the gap between the chosen groups:
  never above the true gap on average, about 0 for a flat curve (it can be negative).
  `gap_crossfit_ci_pp`: percentile interval of the same estimator over the cluster bootstrap
  (each replicate's resampled clusters split into halves).  It is conservative: in the simulations
  above it covered the true gap in 98-100% of runs, and 0 in 100% of flat runs.  The test of "no
  phase effect" is (the verdict's material rule reads the next statistic instead):
* `contrast_crossfit_pp`: the selection-free phase contrast: the dip of the weakest residue group below the mean of
  the upper half (or, when the best group stands further above the median than the worst falls below it, the peak of
  the best above the lower half), chosen on one half of the clusters and measured on the other, averaged as above.
  `contrast_crossfit_bounds_pp`: its 5th and 95th bootstrap percentiles (each a one-sided 95% bound),
  `contrast_crossfit_se_pp` the bootstrap sd; each replicate splits the clusters and resamples each half from its
  own clusters (a cluster in both halves would leak the choosing half's noise into the measurement).
* `flatness_p`: a cluster-aware permutation test of H0 "accuracy is the same in every residue
  group".  Statistic: Pearson's chi-square of the R x 2 table.  Reference distribution: residue
  labels shuffled within each cluster, and label sets swapped between clusters of equal size.  Under
  H0 (and positions assigned independently of the example's content, as the protocols do) every
  such relabelling is equally likely, whatever the correlation inside a cluster, so the p-value is
  exact up to Monte Carlo error.  The textbook chi-square test assumes independent prompts: it is
  conservative when every cluster covers all residues (cluster effects cancel between groups) and
  anti-conservative when a cluster's prompts share a residue.  With singleton clusters the test
  reduces to the plain permutation chi-square test.  `null_gap_p95_pp` is the 95th percentile of
  the gap under the same relabellings: the gap that noise alone exceeds 5% of the time.
* `within_flatness_p`: the same statistic with residue labels shuffled only inside each cluster
  (no swap between clusters): a test conditional on each example, so an easy or hard example cannot
  move it whatever the clusters' sizes.  `cochran_q`, `cochran_p`: Cochran's Q with clusters as
  blocks, given when every cluster has exactly one prompt per residue (each example at every shift),
  else None.  tests/test_metrics.py checks by simulation that both reject about 5% of flat nulls
  with strong example effects, and have power against a phase effect.
* `detected_period`: for every divisor d of R, the model "accuracy depends on residue mod d only"
  (d free accuracies, the residue groups pooled mod d) is fit by binomial maximum likelihood and
  scored with BIC = -2 log L + d log N (N prompts).  The divisor with the lowest BIC wins; ties go
  to the smaller d.  A period-4 curve is also fit exactly by d = 8, 12, 24, but those pay for their
  extra parameters, so the smallest period that explains the curve wins; d = 1 (flat) wins for
  noise; a curve that fails at one phase of S = 8 gives 8, because folding mod 4 would merge the
  failing phase with a good one.  BIC's log N penalty makes a false period on a flat curve rare
  (P(chi2_1 > log 4800) < 0.4% for the nearest alternative).  `period_scores` reports BIC(d) minus
  the best BIC (0 for the winner; > 10 is strong evidence against d).  The likelihood treats
  prompts as independent; the cluster-aware statement of "any phase effect at all" is `flatness_p`.
* `position_matching`: per residue group the mean and variance (ddof 0) of the target position,
  the largest absolute difference of group means and the largest relative difference of group
  variances, (max - min) / mean of the group variances.  The protocols match both so that depth
  effects cannot masquerade as phase effects; these numbers check that they did.
* The verdict on these statistics and the query phase's statistics live in `phasekv.evaluate.verdict`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike
from scipy.special import xlogy
from scipy.stats import chi2, norm

FIELDS = ("cluster", "target_position", "correct")
CONTRAST_BOUND_PERCENTILES = (5.0, 95.0)  # the phase contrast's bounds: one-sided 95% each (the material rule)
_CHUNK_ELEMENTS = 2_000_000  # bounds the memory of one vectorized block of bootstrap/permutation draws

Records = Sequence[Mapping] | Mapping[str, ArrayLike]


def wilson_interval(k: ArrayLike, n: ArrayLike, confidence: float = 0.95):
    """Wilson score interval for a binomial proportion k / n.

    The bounds are the two proportions p at which the score test |k/n - p| / sqrt(p(1-p)/n) equals
    the normal quantile z; exactly 0 for k = 0 and exactly 1 for k = n.  Accepts scalars (returns
    two floats) or arrays of equal shape (returns two arrays).
    """
    k_arr, n_arr = np.asarray(k, dtype=float), np.asarray(n, dtype=float)
    if np.any(n_arr <= 0) or np.any(k_arr < 0) or np.any(k_arr > n_arr):
        raise ValueError("wilson_interval needs 0 <= k <= n and n > 0")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    z2 = norm.ppf(0.5 + confidence / 2) ** 2
    p = k_arr / n_arr
    denom = 1 + z2 / n_arr
    center = (p + z2 / (2 * n_arr)) / denom
    half = np.sqrt(z2 * p * (1 - p) / n_arr + z2 * z2 / (4 * n_arr**2)) / denom
    low = np.where(k_arr == 0, 0.0, np.clip(center - half, 0.0, 1.0))
    high = np.where(k_arr == n_arr, 1.0, np.clip(center + half, 0.0, 1.0))
    if low.ndim == 0:
        return float(low), float(high)
    return low, high


def detect_period(k: ArrayLike, n: ArrayLike) -> tuple[int, dict[int, float]]:
    """The divisor d of R = len(k) that best explains the residue curve k / n (BIC, see module doc).

    k[r], n[r]: correct and total prompts of residue group r (all n[r] > 0).  Returns the chosen
    period and, per divisor, BIC(d) - min BIC (0 for the chosen one; larger is worse).
    """
    k_arr, n_arr = np.asarray(k, dtype=float), np.asarray(n, dtype=float)
    if k_arr.ndim != 1 or k_arr.shape != n_arr.shape or np.any(n_arr <= 0):
        raise ValueError("detect_period needs 1-D k and n of equal length with every n > 0")
    R = len(k_arr)
    log_n = np.log(n_arr.sum())
    bic = {}
    for d in _divisors(R):
        kd, nd = k_arr.reshape(R // d, d).sum(0), n_arr.reshape(R // d, d).sum(0)  # pooled mod d
        theta = kd / nd
        log_lik = np.sum(xlogy(kd, theta) + xlogy(nd - kd, 1 - theta))
        bic[d] = float(-2 * log_lik + d * log_n)
    best = min(bic.values())
    period = min(d for d, b in bic.items() if b <= best + 1e-9 * max(1.0, abs(best)))
    return period, {d: b - best for d, b in bic.items()}


def summarize(records: Records, stride: int, residue_modulus: int = 24, n_boot: int = 2000,  # long: the
              seed: int = 0, n_perm: int = 2000, *, within: bool = True) -> dict:  # metrics.json schema is one flat
    # literal, read at a glance
    """All statistics of one evaluation as a JSON-ready dict of plain Python values (floats to 10 decimals).

    records: a sequence of mappings, or a mapping of parallel arrays, with at least the fields
    `cluster`, `target_position`, `correct`.  The bootstrap and the permutation test draw from
    independent streams spawned from `seed`, so the same input and seed give identical output.
    within=False leaves out the within-example test (None), which no verdict reads: half the permutation cost, for
    the simulations of `phasekv.evaluate.power`.
    Raises ValueError for bad fields, a modulus that is not a multiple of the stride, or empty
    residue groups.
    """
    if not isinstance(stride, int | np.integer) or stride < 1:
        raise ValueError(f"stride must be a positive integer, got {stride!r}")
    if not isinstance(residue_modulus, int | np.integer) or residue_modulus < 1 or residue_modulus % stride:
        raise ValueError(f"residue_modulus must be a positive multiple of stride={stride}, "
                         f"got {residue_modulus!r}")
    for name, value in (("n_boot", n_boot), ("n_perm", n_perm)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    R, S = int(residue_modulus), int(stride)
    cluster, position, correct = _columns(records)
    residue = position % R
    k, n = _group_counts(residue, correct, R)
    empty = np.flatnonzero(n == 0)
    if len(empty):
        raise ValueError(f"residue groups (target_position mod {R}) with no prompts: {empty.tolist()}")
    cluster_ids, cluster_idx = np.unique(cluster, return_inverse=True)
    boot_rng, perm_rng, split_rng, within_rng, contrast_rng = (np.random.default_rng(s)
                                                               for s in np.random.SeedSequence(seed).spawn(5))

    mean, gap, phase_gap = (float(x) for x in _curve_stats(k, n, S))
    kc, nc = (c.reshape(-1, R) for c in _group_counts(cluster_idx * R + residue, correct, len(cluster_ids) * R))
    boot = _cluster_bootstrap(kc, nc, S, n_boot, boot_rng)
    contrast_reps = _split_bootstrap(kc, nc, n_boot, contrast_rng)
    crossfit, contrast = _crossfit_estimate(kc, nc, split_rng)  # kc, nc: (C, R) per cluster and residue
    flat_p, null_gap95 = _flatness_test(cluster_idx, residue, correct, R=R, stride=S, n_perm=n_perm, rng=perm_rng)
    within_p = (_flatness_test(cluster_idx, residue, correct, R=R, stride=S, n_perm=n_perm, rng=within_rng,
                               swap=False)[0] if within else None)
    period, scores = detect_period(k, n)
    k_phase, n_phase = k.reshape(R // S, S).sum(0), n.reshape(R // S, S).sum(0)
    acc, acc_phase = k / n, k_phase / n_phase
    return _rounded({
        "stride": S,
        "residue_modulus": R,
        "n_prompts": len(correct),
        "n_clusters": len(cluster_ids),
        "mean_accuracy": mean,
        "mean_ci": _percentile_ci(boot[0]),
        "max_gap_pp": gap,
        "gap_ci_pp": _percentile_ci(boot[1]),
        "phase_gap_pp": phase_gap,
        "phase_gap_ci_pp": _percentile_ci(boot[2]),
        "gap_ci_basic_pp": _basic_gap_ci(gap, boot[1]),
        "phase_gap_ci_basic_pp": _basic_gap_ci(phase_gap, boot[2]),
        "gap_crossfit_pp": crossfit,
        "gap_crossfit_ci_pp": _percentile_ci(boot[3]) if crossfit is not None and boot[3].size else None,
        "contrast_crossfit_pp": contrast,
        **_contrast_bounds(contrast, contrast_reps),
        "best_residue": int(np.argmax(acc)),
        "worst_residue": int(np.argmin(acc)),
        "best_phase": int(np.argmax(acc_phase)),
        "worst_phase": int(np.argmin(acc_phase)),
        "detected_period": period,
        "period_criterion": "BIC of binomial model with accuracy depending on residue mod d",
        "period_scores": {str(d): s for d, s in scores.items()},
        "flatness_p": flat_p,
        "flatness_test": "cluster permutation test, Pearson chi-square statistic of the residue x correct table",
        "null_gap_p95_pp": null_gap95,
        "within_flatness_p": within_p,
        "within_flatness_test": "within-example permutation test: residue labels shuffled inside each cluster only",
        **cochran_q(kc, nc),
        "n_boot": int(n_boot),
        "n_perm": int(n_perm),
        "seed": int(seed),
        "per_residue": _group_rows("residue", k, n),
        "per_phase": _group_rows("phase", k_phase, n_phase),
        "position_matching": _position_matching(position, residue, R),
    })


def _rounded(obj):
    """Floats rounded to 10 decimals (drops float noise such as 9.999999999999998 or -0.0)."""
    if isinstance(obj, float):
        return round(obj, 10) + 0.0
    if isinstance(obj, dict):
        return {key: _rounded(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [_rounded(value) for value in obj]
    return obj


def _columns(records: Records) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(cluster, target_position as int64, correct as float 0/1) from either record layout."""
    if isinstance(records, Mapping):
        missing = [f for f in FIELDS if f not in records]
        cols = {} if missing else {f: np.asarray(records[f]) for f in FIELDS}
    else:
        missing = sorted({f for r in records for f in FIELDS if f not in r}, key=FIELDS.index)
        cols = {} if missing else {f: np.asarray([r[f] for r in records]) for f in FIELDS}
    if missing:
        raise ValueError(f"records lack the field(s) {missing}; each needs {list(FIELDS)}")
    lengths = {len(c) for c in cols.values()}
    if lengths != {len(cols["correct"])} or cols["correct"].ndim != 1:
        raise ValueError(f"fields {list(FIELDS)} must be 1-D and of equal length")
    if len(cols["correct"]) == 0:
        raise ValueError("records is empty")
    position = cols["target_position"]
    if not np.issubdtype(position.dtype, np.number) or np.any(position < 0) or np.any(position % 1):
        raise ValueError("target_position must hold non-negative integers")
    correct = cols["correct"]
    if not np.all((correct == 0) | (correct == 1)):
        raise ValueError("correct must hold booleans (or 0/1)")
    return cols["cluster"], position.astype(np.int64), correct.astype(float)


def _group_counts(group: np.ndarray, correct: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Correct and total prompts per group id in 0..n_groups-1 (float arrays of exact integers)."""
    k = np.bincount(group, weights=correct, minlength=n_groups)
    n = np.bincount(group, minlength=n_groups).astype(float)
    return k, n


def _curve_stats(k: np.ndarray, n: np.ndarray, stride: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def _crossfit_estimate(kc: np.ndarray, nc: np.ndarray, rng: np.random.Generator,
                       n_splits: int = 20) -> list[float | None]:
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


def _cluster_bootstrap(kc: np.ndarray, nc: np.ndarray, stride: int, n_boot: int,
                       rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """Replicates of (mean, gap, phase gap, cross-fitted gap) with clusters resampled with replacement.

    kc, nc: (C, R) correct / total counts per cluster and residue.  A replicate draws C clusters
    with replacement; its counts are the multiplicity-weighted sums of the clusters' counts.  The
    first C // 2 draws and the rest are the two halves of the cross-fitted gap (nan replicates,
    where a chosen group is empty in the other half, are dropped).
    """
    C = kc.shape[0]
    chunk = max(1, _CHUNK_ELEMENTS // C)
    parts = []
    for start in range(0, n_boot, chunk):
        b = min(chunk, n_boot - start)
        draws = rng.integers(0, C, size=(b, C))
        offset = C * np.arange(b)[:, None]
        halves = [np.bincount((d + offset).ravel(), minlength=b * C).reshape(b, C).astype(float)
                  for d in (draws[:, : C // 2], draws[:, C // 2 :])]  # (b, C) multiplicity of each cluster
        weights = halves[0] + halves[1]
        stats = _curve_stats(weights @ kc, weights @ nc, stride)
        crossfit = (_crossfit_gaps(halves[0] @ kc, halves[0] @ nc, halves[1] @ kc, halves[1] @ nc)[:, 0] if C > 1
                    else np.full(b, np.nan))
        parts.append((*stats, crossfit))
    reps = [np.concatenate(p) for p in zip(*parts)]
    reps[3] = reps[3][~np.isnan(reps[3])]
    return tuple(reps)


def _split_bootstrap(kc: np.ndarray, nc: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """Replicates of the cross-fitted phase contrast (pp, nan dropped; empty for < 2 clusters): each replicate
    splits the clusters into halves and resamples each half with replacement from its own clusters.  Drawing both
    halves from all clusters (as the gap's bootstrap does) puts ~15% of the clusters in both halves, so the
    choosing half's noise leaks into the measuring half: in simulation a flat curve's lower bound sat above 0."""
    C = kc.shape[0]
    if C < 2:
        return np.empty(0)
    chunk = max(1, _CHUNK_ELEMENTS // C)
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


def _chi_square(k: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Pearson chi-square of the groups x {correct, wrong} table, counts of shape (..., G)."""
    p = k.sum(-1, keepdims=True) / n.sum(-1, keepdims=True)
    var = n * p * (1 - p)
    terms = np.divide((k - n * p) ** 2, var, out=np.zeros(np.broadcast_shapes(k.shape, var.shape)),
                      where=var > 0)
    return terms.sum(-1)


def _flatness_test(cluster_idx: np.ndarray, residue: np.ndarray, correct: np.ndarray, *, R: int, stride: int,
                   n_perm: int, rng: np.random.Generator, swap: bool = True) -> tuple[float, float]:
    """Cluster permutation p-value of "accuracy equal in all residue groups", and the null gap p95.

    Each relabelling gives every cluster the residue labels of a random cluster of the same size
    (between-cluster swap; `swap=False`: every cluster keeps its own labels, the within-example test)
    in random order (within-cluster shuffle).  Group sizes stay fixed, so only the correct counts
    change.  p = (1 + #{X2_perm >= X2_obs}) / (1 + n_perm).
    """
    k, n = _group_counts(residue, correct, R)
    observed = _chi_square(k, n)
    order = np.argsort(cluster_idx, kind="stable")
    sizes = np.bincount(cluster_idx)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    labels, hits = residue[order], correct[order]
    classes = []  # per cluster size s: (m, s) residue labels and correctness of its m clusters
    for s in np.unique(sizes[sizes > 0]):
        rows = starts[sizes == s][:, None] + np.arange(s)
        classes.append((labels[rows], hits[rows]))
    chunk = max(1, _CHUNK_ELEMENTS // len(correct))
    stats, gaps = [], []
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
        gaps.append(_curve_stats(k_perm, np.broadcast_to(n, k_perm.shape), stride)[1])
    stats = np.concatenate(stats)
    exceed = np.count_nonzero(stats >= observed - 1e-9 * max(1.0, observed))
    return float((1 + exceed) / (1 + n_perm)), float(np.percentile(np.concatenate(gaps), 95))


def cochran_q(kc: np.ndarray, nc: np.ndarray) -> dict[str, float | None]:
    """Cochran's Q test of "accuracy equal in all residue groups" with clusters as blocks.

    kc, nc: (C, R) correct / total counts per cluster and residue.  Defined when every cluster has
    exactly one prompt per residue (a complete block design: each example at every shift); then
    Q = (R - 1) (R sum_j T_j^2 - N^2) / (R N - sum_i B_i^2) with T_j the residue totals, B_i the
    cluster totals and N the grand total, and p from chi-square with R - 1 degrees of freedom.
    Otherwise (and when no cluster varies across residues, Q = 0/0) both are None.
    """
    if kc.shape[1] < 2 or not np.all(nc == 1):
        return {"cochran_q": None, "cochran_p": None}
    R = kc.shape[1]
    col, row = kc.sum(0), kc.sum(1)
    total = col.sum()
    denominator = R * total - (row ** 2).sum()
    if denominator <= 0:
        return {"cochran_q": None, "cochran_p": None}
    q = (R - 1) * (R * (col ** 2).sum() - total ** 2) / denominator
    return {"cochran_q": float(q), "cochran_p": float(chi2.sf(q, R - 1))}


def _percentile_ci(samples: np.ndarray) -> list[float]:
    low, high = np.percentile(samples, [2.5, 97.5])
    return [float(low), float(high)]


def _contrast_bounds(dip: float | None, samples: np.ndarray) -> dict[str, Any]:
    """`contrast_crossfit_bounds_pp` (the CONTRAST_BOUND_PERCENTILES of the bootstrap: each a one-sided 95% bound)
    and `contrast_crossfit_se_pp` (the bootstrap's sd); None without a contrast or with < 20 finite replicates."""
    if dip is None or samples.size < 20:
        return {"contrast_crossfit_bounds_pp": None, "contrast_crossfit_se_pp": None}
    return {"contrast_crossfit_bounds_pp": [float(x) for x in np.percentile(samples, CONTRAST_BOUND_PERCENTILES)],
            "contrast_crossfit_se_pp": float(samples.std(ddof=1))}


def _basic_gap_ci(observed: float, samples: np.ndarray) -> list[float]:
    """Basic bootstrap interval of a gap in pp: reflects the percentiles around the estimate."""
    low, high = np.percentile(samples, [2.5, 97.5])
    return [float(max(0.0, 2 * observed - high)), float(min(100.0, 2 * observed - low))]


def _group_rows(key: str, k: np.ndarray, n: np.ndarray) -> list[dict]:
    low, high = wilson_interval(k, n)
    return [{key: g, "accuracy": float(k[g] / n[g]), "ci_low": float(low[g]), "ci_high": float(high[g]),
             "n": int(n[g]), "n_correct": int(k[g])} for g in range(len(k))]


def _position_matching(position: np.ndarray, residue: np.ndarray, R: int) -> dict:
    pos = position.astype(float)
    means = np.array([pos[residue == r].mean() for r in range(R)])
    variances = np.array([pos[residue == r].var() for r in range(R)])
    mean_var = variances.mean()
    return {
        "per_residue": [{"residue": r, "mean": float(means[r]), "variance": float(variances[r])}
                        for r in range(R)],
        "max_abs_mean_diff": float(means.max() - means.min()),
        "max_rel_var_diff": float((variances.max() - variances.min()) / mean_var) if mean_var > 0 else 0.0,
    }


def _divisors(R: int) -> list[int]:
    return [d for d in range(1, R + 1) if R % d == 0]
