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
* `phase_flatness_p`: the same relabellings scored on the S phase groups (residues folded mod S): "accuracy is the
  same at every phase".  With R > S a residue pattern of period R that does not fold onto the phases (a layout or
  length trend over the design's own cycle, the shift) rejects `flatness_p` but not this; the verdict needs both.
* `period_nested_p`: per proper divisor d > 1 of S, the p-value of "the phase curve is its fold mod d"
  (`permutation.nested_period_p`: labels shuffled within (cluster, phase mod d), which keeps the mod-d curve); the
  verdict's period (`verdict.verdict_period`) is the smallest d it does not reject, else S.  None where neither
  flatness test rejects at NESTED_WHEN_P (no period to name).
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

import numpy as np
from numpy.typing import ArrayLike
from scipy.special import xlogy
from scipy.stats import chi2, norm

from phasekv.evaluate.permutation import cluster_flatness_test, nested_period_p, stratified_test
from phasekv.evaluate.resampling import (
    basic_gap_ci,
    cluster_bootstrap,
    contrast_bounds,
    crossfit_estimate,
    curve_stats,
    group_counts,
    percentile_ci,
    split_bootstrap,
)

FIELDS = ("cluster", "target_position", "correct")

NESTED_WHEN_P = 0.05  # `period_nested_p` is computed where a flatness test rejects at this level (else None)

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
              seed: int = 0, n_perm: int = 2000, *, within: bool = True,  # metrics.json schema is one flat
              units: ArrayLike | None = None) -> dict:
    # literal, read at a glance
    """All statistics of one evaluation as a JSON-ready dict of plain Python values (floats to 10 decimals).

    records: a sequence of mappings, or a mapping of parallel arrays, with at least the fields
    `cluster`, `target_position`, `correct`.  The bootstrap and the permutation test draw from
    independent streams spawned from `seed`, so the same input and seed give identical output.
    within=False leaves out the within-example test (None), which no verdict reads: half the permutation cost, for
    the simulations of `phasekv.evaluate.power`.  units: an id per prompt of the unit the permutation tests move
    as a whole (the query phase's contexts, `phasekv.evaluate.query_stats`): then `flatness_p`, `phase_flatness_p`
    and `null_gap_p95_pp` shuffle whole units' labels within each cluster (`permutation.stratified_test`).
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
    k, n = group_counts(residue, correct, R)
    empty = np.flatnonzero(n == 0)
    if len(empty):
        raise ValueError(f"residue groups (target_position mod {R}) with no prompts: {empty.tolist()}")
    cluster_ids, cluster_idx = np.unique(cluster, return_inverse=True)
    boot_rng, perm_rng, split_rng, within_rng, contrast_rng, nested_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(6))

    mean, gap, phase_gap = (float(x) for x in curve_stats(k, n, S))
    kc, nc = (c.reshape(-1, R) for c in group_counts(cluster_idx * R + residue, correct, len(cluster_ids) * R))
    boot = cluster_bootstrap(kc, nc, S, n_boot, boot_rng)
    contrast_reps = split_bootstrap(kc, nc, n_boot, contrast_rng)
    crossfit, contrast = crossfit_estimate(kc, nc, split_rng)  # kc, nc: (C, R) per cluster and residue
    if units is None:
        flat_p, null_gap95, phase_p = cluster_flatness_test(cluster_idx, residue, correct, R=R, stride=S, n_perm=n_perm,
                                                     rng=perm_rng)
        unit_cluster, unit_residue, unit_k, unit_n = cluster_idx, residue, correct, np.ones_like(correct)
    else:
        unit_cluster, unit_residue, unit_k, unit_n = _units(units, cluster_idx, residue, correct)
        flat_p, null_gap95 = stratified_test(unit_cluster, unit_residue, unit_k, unit_n, groups=R, n_perm=n_perm,
                                             rng=perm_rng)
        phase_p = (flat_p if R == S else stratified_test(unit_cluster, unit_residue % S, unit_k, unit_n, groups=S,
                                                         n_perm=n_perm, rng=perm_rng)[0])
    nested = (nested_period_p(unit_cluster, unit_residue % S, unit_k, unit_n, stride=S, n_perm=n_perm, rng=nested_rng)
              if min(flat_p, phase_p) < NESTED_WHEN_P else None)
    within_p = (cluster_flatness_test(cluster_idx, residue, correct, R=R, stride=S, n_perm=n_perm, rng=within_rng,
                               swap=False)[0] if within else None)
    period, scores = detect_period(k, n)
    k_phase, n_phase = k.reshape(R // S, S).sum(0), n.reshape(R // S, S).sum(0)
    acc, acc_phase = k / n, k_phase / n_phase
    return rounded_floats({
        "stride": S,
        "residue_modulus": R,
        "n_prompts": len(correct),
        "n_clusters": len(cluster_ids),
        "mean_accuracy": mean,
        "mean_ci": percentile_ci(boot[0]),
        "max_gap_pp": gap,
        "gap_ci_pp": percentile_ci(boot[1]),
        "phase_gap_pp": phase_gap,
        "phase_gap_ci_pp": percentile_ci(boot[2]),
        "gap_ci_basic_pp": basic_gap_ci(gap, boot[1]),
        "phase_gap_ci_basic_pp": basic_gap_ci(phase_gap, boot[2]),
        "gap_crossfit_pp": crossfit,
        "gap_crossfit_ci_pp": percentile_ci(boot[3]) if crossfit is not None and boot[3].size else None,
        "contrast_crossfit_pp": contrast,
        **contrast_bounds(contrast, contrast_reps),
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
        "phase_flatness_p": phase_p,
        "period_nested_p": nested,
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


def _units(units: ArrayLike, cluster_idx: np.ndarray, residue: np.ndarray,
           correct: np.ndarray) -> tuple[np.ndarray, ...]:
    """(cluster, residue, correct, prompts) per permutation unit; ValueError where a unit's prompts differ in cluster
    or residue (a unit moves as a whole, so it must have one label)."""
    units = np.asarray(units)
    if units.shape != residue.shape:
        raise ValueError(f"units: one id per prompt needed, got shape {units.shape} for {len(residue)} prompts")
    _, first, unit_idx = np.unique(units, return_index=True, return_inverse=True)
    if np.any(cluster_idx[first][unit_idx] != cluster_idx) or np.any(residue[first][unit_idx] != residue):
        raise ValueError("units: every prompt of a unit needs the same cluster and residue")
    k, n = group_counts(unit_idx, correct, len(first))
    return cluster_idx[first], residue[first], k, n


def rounded_floats(obj):
    """Floats rounded to 10 decimals (drops float noise such as 9.999999999999998 or -0.0)."""
    if isinstance(obj, float):
        return round(obj, 10) + 0.0
    if isinstance(obj, dict):
        return {key: rounded_floats(value) for key, value in obj.items()}
    if isinstance(obj, list):
        return [rounded_floats(value) for value in obj]
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
