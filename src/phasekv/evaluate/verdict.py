"""The verdict on a phase curve (docs/science.md section 3, "Chance levels and the verdict"), and the query phase.

`task_verdict` turns the statistics of `phasekv.evaluate.metrics.summarize` into one line.  Three parts, each with
its number (the module constants; tests/test_verdict.py pins every one just inside and just outside its boundary):

1. can do the task: the mean's 95% lower bound exceeds CHANCE_FACTOR x the in-context chance (the accuracy of a
   model that copies a random value present in the prompt);
2. phase-dependent: the cluster permutation test rejects flatness at FLATNESS_ALPHA;
3. material: the phase contrast (`contrast_crossfit_pp`: a weak group's dip below the mean of the upper half of the
   residue groups, or a lone strong group's peak above the lower half, the groups chosen on one half of the clusters
   and measured on the other) has a one-sided 95% lower bound >= MATERIAL_GAP_PP, and the observed gap exceeds the
   null's 95th percentile.  The cross-fitted (selection-free) bound is the only source: with too few clusters to
   split there is no bound and no material effect.

"phase sensitive: period P" needs all three; P divides the stride S (`verdict_period`): S, unless the cluster-aware
nested test does not reject "the curve is its fold mod d" at PERIOD_ALPHA for a proper divisor d (the smallest such
d).  Variation over the design's own cycle R that the phases mod S do not show is a layout or length trend, never a
period.

Why the contrast and a one-sided bound, not the best-minus-worst gap's two-sided interval: the paper's effect is a
weak phase; the upper half of the groups is measured four to twelve times as precisely as the best group, so the
contrast's error is mostly the weak group's own, and "material" is a one-sided question (is the weak phase at
least 10 pp down?).  The contrast is never above the best-minus-worst gap.  Simulated with phasekv's own functions
at the audit's design (docs/power.md, benchmarks/verdict_power.py), the verdict finds a 30 pp single-phase gap at
60% base in 21% of runs at the old 64 prompts per phase and in >= 97% at AUDIT_PROMPTS_PER_PHASE = 192
(`phasekv.evaluate.power`), with no false positive in 200 flat runs of any design.

Absence of evidence is not flatness: every "no phase effect detected" and "not material" verdict carries
`minimum_detectable_gap_pp`, the contrast this run's design finds with DETECTION_POWER (`minimum_detectable_gap`),
and says "small" only where the gap's upper bound (the percentile bootstrap of best minus worst, biased upward, so a
conservative upper bound) is below MATERIAL_GAP_PP.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from scipy.stats import norm

from phasekv.evaluate.metrics import detect_period, rounded_floats, wilson_interval
from phasekv.evaluate.query_stats import length_verdict, query_phase_summary
from phasekv.evaluate.resampling import CONTRAST_BOUND_PERCENTILES, group_counts
from phasekv.evaluate.sizing import BOUND_SD, detectable_gap_pp

CHANCE_FACTOR = 2.0  # 1. can do the task: the mean's 95% lower bound exceeds 2 x the in-context chance
FLATNESS_ALPHA = 0.05  # 2. phase-dependent: the cluster permutation test rejects flatness at 5%
MATERIAL_GAP_PP = 10.0  # 3. material: the contrast's one-sided 95% lower bound >= 10 pp AND the gap above null p95
DETECTION_POWER = 0.80  # the minimum detectable gap is the contrast found this often
MIN_CLUSTERS = 8  # fewer clusters: no bounds and no detectable gap of the run's own (`too_small`)
# the nested test's level: a proper divisor d of S is named where "the curve is its fold mod d" is not rejected at
# 1%.  At 5% a true period-4 curve was named 8 in 5% of its detections by construction (the test's own level: 10 of
# 300 at the audit's prefix default); at 1% 1 of 300, while one weak phase of 8 (30 pp) still rejects every fold in
# 292 of 292 detections (benchmarks/verdict_power.py's period4@ and period8@, docs/power.md)
PERIOD_ALPHA = 0.01


def material_gap_bound(metrics: dict) -> tuple[float | None, list[float] | None, str]:
    """(lower bound, [lower, upper] one-sided 95% bounds, name) of the contrast the material rule trusts: the
    selection-free cross-fitted phase contrast, the only source (None, None with too few clusters to split)."""
    bounds = metrics.get("contrast_crossfit_bounds_pp")
    return (None if bounds is None else bounds[0]), bounds, "selection-free phase contrast"


def too_small(metrics: dict) -> bool:
    """True where the run cannot resolve its own bootstrap: fewer than MIN_CLUSTERS clusters (the cross-fit's halves
    hold a few clusters each, and resampling them gives a few distinct values: 2 clusters printed bounds [3.1, 3.1]
    and a 10 pp detectable gap).  Such a run prints no bounds and no detectable gap of its own, and no material
    effect."""
    return metrics.get("n_clusters", MIN_CLUSTERS) < MIN_CLUSTERS


def minimum_detectable_gap(metrics: dict) -> float | None:
    """The contrast (pp) this run's design would call material with probability DETECTION_POWER, from its own
    bootstrap: MATERIAL_GAP_PP + (estimate - one-sided 95% lower bound) + z_0.80 x sd of the cross-fitted contrast.
    The bound's distance from the estimate is the bootstrap's own, but at least `sizing.BOUND_SD` sd: under an
    effect the bootstrap is left-skewed (a split that picks a wrong phase measures ~0), the bound ~2 sd below the
    estimate, not the normal 1.645, and a flat run cannot see that skew in its own bootstrap; with it a true gap of
    this size clears MATERIAL_GAP_PP about DETECTION_POWER of the time (simulated: docs/power.md).  None without a
    bootstrap of the contrast or where `too_small`."""
    if too_small(metrics) or metrics.get("contrast_crossfit_se_pp") is None:
        return None
    se, bounds, dip = (metrics["contrast_crossfit_se_pp"], metrics["contrast_crossfit_bounds_pp"],
                       metrics.get("contrast_crossfit_pp"))
    z_bound = norm.ppf(1 - CONTRAST_BOUND_PERCENTILES[0] / 100)
    spread = max(z_bound * se if dip is None else dip - bounds[0], BOUND_SD * se)
    return float(MATERIAL_GAP_PP + spread + norm.ppf(DETECTION_POWER) * se)


def small_run_note(metrics: dict) -> str:
    """The line a `too_small` run prints instead of bounds: its prompts per phase and the gap that size detects on
    the simulated models (`sizing.detectable_gap_pp`)."""
    per_phase = max(1, int(metrics["n_prompts"]) // int(metrics["stride"]))
    return (f"this run is too small: {per_phase} prompts per phase in {metrics.get('n_clusters', '?')} clusters "
            f"detect about {detectable_gap_pp(per_phase):.0f} pp")


def holm_line(pvalues: Mapping[str, float | None], alpha: float = FLATNESS_ALPHA) -> str:
    """One line of the family-wise view of several flatness p-values on the same prompts (an audit's conditions and
    protocols): Holm's step-down adjustment, the smallest adjusted p and how many tests reject at `alpha` family-wise.
    None entries are left out."""
    named = {k: float(v) for k, v in pvalues.items() if v is not None}
    if not named:
        return "family-wise (Holm): no flatness tests"
    adjusted = holm_adjusted(list(named.values()))
    best = int(np.argmin(adjusted))
    rejected = sum(a < alpha for a in adjusted)
    return (f"family-wise (Holm) over {len(named)} flatness tests: {rejected} reject at {100 * alpha:g}%, smallest "
            f"adjusted p = {adjusted[best]:.3g} ({list(named)[best]})")


def holm_adjusted(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order: the i-th smallest p times (m - i), made monotone and
    capped at 1."""
    p = np.asarray(pvalues, dtype=float)
    order = np.argsort(p, kind="stable")
    scaled = np.minimum(1.0, np.maximum.accumulate(p[order] * (len(p) - np.arange(len(p)))))
    out = np.empty_like(p)
    out[order] = scaled
    return [float(x) for x in out]


def verdict_period(metrics: dict) -> int:
    """The period the verdict names, always a divisor of the stride S (a period of the design's own cycle R, the
    shift, is a layout or length trend, never a phase): S, unless the nested test `period_nested_p` does not reject
    "the phase curve is its fold mod d" at PERIOD_ALPHA for a proper divisor d > 1 (the smallest such d).  Without
    the nested tests (older metrics), the divisor d > 1 of S with the lowest BIC in `period_scores`; 1 when S = 1."""
    S = int(metrics.get("stride") or max(int(d) for d in metrics["period_scores"]))
    nested = metrics.get("period_nested_p")
    if nested is not None:
        fits = [int(d) for d, p in nested.items() if p is not None and p >= PERIOD_ALPHA and S % int(d) == 0]
        return min(fits, default=S)
    scores = {int(d): s for d, s in metrics["period_scores"].items() if int(d) > 1 and S % int(d) == 0}
    if not scores:
        return S if S > 1 else 1
    best = min(scores.values())
    return min(d for d, s in scores.items() if s <= best + 1e-9)


def task_verdict(metrics: dict, chance: float, in_context_chance: float, capable: bool | None = None) -> dict:
    """`chance`, `in_context_chance`, `can_do_task`, `phase_sensitive`, `verdict_parts`, `minimum_detectable_gap_pp`
    and a one-line `verdict` for a summary of `summarize`.

    chance: the format's 1 / |answer tokens|; in_context_chance: the accuracy of a model that copies a uniformly
    random value present in the prompt (`EvalSet.in_context_chance`), the baseline the capability gate uses.
    "phase sensitive: period P" needs all three parts (module doc); otherwise the verdict says which part is
    missing.  A model that cannot do the task says nothing about phase: no flatness or period claim.
    `capable`: the model passed the gate in another condition (a compressed cache of a model that does the task
    uncompressed): a collapse to chance at most phases is then the finding, so the phase parts are judged even when
    this condition's mean is below the gate, and a condition below it at every phase says "retrieval destroyed".
    """
    mean, low = metrics["mean_accuracy"], metrics["mean_ci"][0]
    able = low > CHANCE_FACTOR * in_context_chance
    judged = able if capable is None else capable
    phase_p = metrics.get("phase_flatness_p")
    layout_only = metrics["flatness_p"] < FLATNESS_ALPHA and phase_p is not None and phase_p >= FLATNESS_ALPHA
    dependent = judged and metrics["flatness_p"] < FLATNESS_ALPHA and not layout_only
    small = too_small(metrics)
    bound, bounds, dip_name = material_gap_bound(metrics)
    bounds = None if small else bounds
    material = (dependent and not small and bound is not None and bound >= MATERIAL_GAP_PP
                and metrics["max_gap_pp"] > metrics["null_gap_p95_pp"])
    period = verdict_period(metrics)
    mde = minimum_detectable_gap(metrics)
    upper = metrics["gap_ci_pp"][1]
    tail = (f"accuracy {100 * mean:.1f}%, in-context chance {100 * in_context_chance:.1f}%, format chance "
            f"{100 * chance:.1f}%")
    dip = metrics.get("contrast_crossfit_pp")
    gap = (f"gap {metrics['max_gap_pp']:.1f} pp (upper bound {upper:.1f}), {dip_name} "
           f"{'-' if dip is None else f'{dip:.1f}'} pp, one-sided 95% bounds {_interval(bounds)} pp (minimum "
           f"{MATERIAL_GAP_PP:.0f}), null 95th percentile {metrics['null_gap_p95_pp']:.1f} pp, flatness p = "
           f"{metrics['flatness_p']:.3g}")
    detectable = (f"; {small_run_note(metrics)}" if small else
                  "; this run could not bound the phase contrast (too few clusters)" if mde is None else
                  f"; the smallest gap this run finds {100 * DETECTION_POWER:.0f}% of the time: {mde:.0f} pp")
    if layout_only and judged:
        detectable += (f"; the residues mod {metrics['residue_modulus']} vary (flatness p = "
                       f"{metrics['flatness_p']:.3g}) but the phases mod {metrics['stride']} do not (p = "
                       f"{phase_p:.3g}): a layout or length trend over the shifts, not a phase")
    if material:
        verdict = f"phase sensitive: period {period}, {gap} ({tail})"
    elif not judged:
        verdict = f"cannot do the task ({tail}): no phase verdict"
    elif not able and not dependent:  # a phase-dependent curve (one good phase) is not destroyed "at every phase"
        verdict = f"retrieval destroyed at every phase ({tail}): no phase effect can be seen"
    elif not dependent:
        verdict = f"no phase effect detected: {gap}{detectable} ({tail})"
    elif upper < MATERIAL_GAP_PP:
        verdict = f"a small phase effect, not material: {gap}{detectable} ({tail})"
    else:
        verdict = (f"a phase effect, not shown material (it may be as large as {upper:.0f} pp): {gap}{detectable} "
                   f"({tail})")
    parts = {"can_do_task": bool(able), "phase_dependent": bool(dependent), "material": bool(material),
             "period": int(period) if judged else None, "layout_trend": bool(layout_only), "too_small": bool(small)}
    return {"chance": round(float(chance), 10), "in_context_chance": round(float(in_context_chance), 10),
            "can_do_task": bool(able), "phase_sensitive": bool(material), "verdict_parts": parts,
            "minimum_detectable_gap_pp": None if mde is None else round(mde, 10), "verdict": verdict}


def _interval(ci: list[float] | None) -> str:
    return "[-]" if ci is None else f"[{ci[0]:.1f}, {ci[1]:.1f}]"


# The query phase (the query protocol of `phasekv.data.protocols`): the targets are held fixed and the prompt length
# varies, so the coordinate under test is the query position (the last prompt token) mod S.

def query_phase_statistics(records: Sequence[Mapping], stride: int, residue_modulus: int, chance: float,
                           in_context_chance: float, *, judge=task_verdict, n_boot: int = 2000,
                           seed: int = 0, n_perm: int = 2000, within: bool = True) -> dict[str, Any]:
    """`query_phase`: the query-phase statistics (`query_stats.query_phase_summary`: the prompts grouped by the
    query phase, query position mod S; clusters resampled, whole contexts permuted within their cluster; the length
    trend and the length step beside them) and `judge`'s verdict (period, gap, material effect, the capability gate
    against the in-context chance), read by `query_stats.length_verdict` so that a length effect is not called a
    phase; and `cross`, `cross_phase_table`.  records: `summarize`'s fields plus `record` and `query_position`.
    residue_modulus and within are accepted for the callers' sake: the query phase is grouped mod S, and its unit,
    the context, is already within a cluster."""
    if any("query_position" not in r or "record" not in r for r in records):
        raise ValueError("records lack the field 'query_position' or 'record' (predictions of "
                         "phasekv.evaluate.runner.predict)")
    del residue_modulus, within
    query = query_phase_summary(records, stride, n_boot=n_boot, seed=seed, n_perm=n_perm)
    query.update(judge(query, chance, in_context_chance))
    query.update(length_verdict(query))
    return {"query_phase": query, "cross": cross_phase_table(records, stride)}


def target_pairs(records: Sequence[Mapping]) -> list[dict[str, Any]]:
    """`records` with `cluster` replaced by an id of its (cluster, record) pair: the unit of the query protocol's
    source-phase statistics.  There a target keeps its source phase at every shift, so a source-phase group holds
    its own pairs, each at every shift; resampling and permuting whole examples would count a pair's repeats as
    independent evidence (an easy pair in one group looks like a phase effect), while pairs are exchangeable
    between groups under "accuracy does not depend on the source phase"."""
    ids: dict[tuple[Any, Any], int] = {}
    return [{**r, "cluster": ids.setdefault((r["cluster"], r["record"]), len(ids))} for r in records]


def pair_period(records: Sequence[Mapping], residue_modulus: int) -> dict[str, Any]:
    """`detected_period` and `period_scores` of the source-phase curve when every (cluster, record) pair is shown
    at several shifts with its source phase fixed (the query protocol): `detect_period` on the residue counts
    divided by the shows per pair, one unit of evidence per pair.  BIC's likelihood treats prompts as independent
    and a pair's repeats are not: counted as prompts, a period-8 curve of a few pairs per residue reads as period
    24.  Conservative where a pair's answers vary with the shift."""
    R = int(residue_modulus)
    residue = np.asarray([r["target_position"] for r in records], dtype=np.int64) % R
    correct = np.asarray([float(r["correct"]) for r in records])
    shows = len(records) / len({(r["cluster"], r["record"]) for r in records})
    k, n = group_counts(residue, correct, R)
    period, scores = detect_period(k / shows, n / shows)
    return rounded_floats({"detected_period": period, "period_scores": {str(d): v for d, v in scores.items()},
                     "period_criterion": "BIC of binomial model with accuracy depending on residue mod d, one unit "
                                         "of evidence per (cluster, target) pair"})


def cross_phase_table(records: Sequence[Mapping], stride: int) -> dict[str, Any]:
    """The cross design: accuracy per (source phase, query phase) cell, source phase = target_position mod S and
    query phase = query_position mod S, with Wilson 95% intervals; both margins (`per_phase`, `per_query_phase`);
    and `per_relative_phase`, (query - target position) mod S, the coordinate of a kernel that chunks the cache
    from the end of the prompt.  A cell without prompts has n = 0 and accuracy None."""
    if not isinstance(stride, int | np.integer) or stride < 1:
        raise ValueError(f"stride must be a positive integer, got {stride!r}")
    if len(records) == 0:
        raise ValueError("records is empty")
    S = int(stride)
    target = np.asarray([r["target_position"] for r in records], dtype=np.int64)
    query = np.asarray([r["query_position"] for r in records], dtype=np.int64)
    correct = np.asarray([float(r["correct"]) for r in records])
    k, n = group_counts((target % S) * S + query % S, correct, S * S)
    cells = [{"phase": p, "query_phase": q, **_cell(k[p * S + q], n[p * S + q])} for p in range(S) for q in range(S)]
    k, n = k.reshape(S, S), n.reshape(S, S)  # (source phase, query phase)
    relative = group_counts((query - target) % S, correct, S)
    return rounded_floats({
        "stride": S, "n_prompts": len(correct), "cells": cells,
        "per_phase": [{"phase": p, **_cell(k[p].sum(), n[p].sum())} for p in range(S)],
        "per_query_phase": [{"query_phase": q, **_cell(k[:, q].sum(), n[:, q].sum())} for q in range(S)],
        "per_relative_phase": [{"relative_phase": d, **_cell(relative[0][d], relative[1][d])} for d in range(S)],
    })


def _cell(k: float, n: float) -> dict[str, Any]:
    """n, n_correct, accuracy and Wilson 95% interval of one group (None for an empty group)."""
    if n == 0:
        return {"n": 0, "n_correct": 0, "accuracy": None, "ci_low": None, "ci_high": None}
    low, high = wilson_interval(k, n)
    return {"n": int(n), "n_correct": int(k), "accuracy": float(k / n), "ci_low": low, "ci_high": high}
