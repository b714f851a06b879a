"""The query phase's statistics: the query position mod S tested with the context as the unit, and the length
effect estimated beside it, so that an engine bug keyed to the prompt length is not called a phase.

Under the query protocol (`phasekv.data.protocols`, crossed design) a context is one cluster at one shift, shown
after its cluster's length offset e: all its T targets share one query position Q0 + e + s, hence one query phase.
So:

* The unit of the permutation test is the context: `summarize(..., units=contexts)` shuffles whole contexts' query
  phases within their cluster (the shift labels of each cluster), so a context random effect (a shared easy or hard
  context moves T answers together) cannot pass for a phase effect; the bootstrap and the cross-fit resample and
  split clusters, as everywhere.  Permuting prompts instead treated a context's T answers as independent evidence.
* The phase groups are the S phases (residue_modulus = S): every period the verdict can name divides the stride
  (`verdict.verdict_period`, with the nested test at the context level).  Variation over the design's own cycle,
  the shift, is no phase: the crossed design puts every shift in every phase group equally often.
* `length_trend`: the within-cluster least-squares slope of correctness on the query position, reported as "pp per
  S tokens" with a cluster-bootstrap 95% interval and a two-sided p from its bootstrap sd.  Within a cluster the
  prompts differ only in the shift, so the slope is free of cluster effects; the design balances a linear trend
  exactly across the phase groups (equal mean length), so a linear trend never moves the phase statistics.
* `length_step`: what the design cannot balance is a sharp change with the length: "everything from length L on is
  wrong" lowers, in the one stride cycle holding L, the phases past L mod S.  The per-length curve is fit (weighted
  least squares, a linear trend in both) by S phase means and by one step at the best length; where the step
  explains the curve at least as well as the S phases, the verdict reads a length effect, not a phase
  (`length_verdict`).  A periodic effect repeats in every cycle, which one step cannot follow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from scipy.stats import norm

from phasekv.evaluate.metrics import rounded_floats, summarize
from phasekv.evaluate.resampling import CI_PERCENTILES, group_counts


def query_phase_summary(records: Sequence[Mapping], stride: int, *, n_boot: int = 2000, seed: int = 0,
                        n_perm: int = 2000) -> dict[str, Any]:
    """`summarize` of the prompts grouped by query phase (query position mod S), clusters as the resampling unit and
    contexts (cluster, query position) as the permutation unit, plus `length_trend` and `length_step`.
    records: `cluster`, `query_position`, `correct` per prompt."""
    cluster = np.asarray([r["cluster"] for r in records])
    length = np.asarray([r["query_position"] for r in records], dtype=np.int64)
    correct = np.asarray([float(r["correct"]) for r in records])
    _, contexts = np.unique(np.stack([np.unique(cluster, return_inverse=True)[1], length]), axis=1,
                            return_inverse=True)
    metrics = summarize({"cluster": cluster, "target_position": length, "correct": correct}, stride, stride,
                        n_boot=n_boot, seed=seed, n_perm=n_perm, within=False, units=contexts.ravel())
    metrics["flatness_test"] = ("context permutation test: the query phases of each cluster's contexts shuffled "
                                "within the cluster, Pearson chi-square of the phase x correct table")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 50]))
    metrics["length_trend"] = length_trend(cluster, length, correct, stride, n_boot, rng)
    metrics["length_step"] = length_step(length, correct, stride)
    return metrics


def length_trend(cluster: np.ndarray, length: np.ndarray, correct: np.ndarray, stride: int, n_boot: int,
                 rng: np.random.Generator) -> dict[str, Any]:
    """The within-cluster slope of correctness on the query position in pp per `stride` tokens, its cluster
    bootstrap 95% percentile interval, sd and two-sided p (normal, from the sd); `per_length`: accuracy per query
    position.  Slope 0 (sd None) where no cluster varies in length."""
    _, ci = np.unique(cluster, return_inverse=True)
    C = ci.max() + 1
    n_c = np.bincount(ci, minlength=C).astype(float)
    x = length.astype(float)
    dx = x - (np.bincount(ci, x, C) / n_c)[ci]
    dy = correct - (np.bincount(ci, correct, C) / n_c)[ci]
    sxy, sxx = np.bincount(ci, dx * dy, C), np.bincount(ci, dx * dx, C)
    scale = 100.0 * stride
    k, n = group_counts(length - length.min(), correct, int(length.max() - length.min()) + 1)
    per_length = [{"query_position": int(length.min() + i), "n": int(n[i]), "accuracy": float(k[i] / n[i])}
                  for i in np.flatnonzero(n)]
    if sxx.sum() <= 0:
        return {"pp_per_stride": 0.0, "ci_pp": None, "se_pp": None, "p": None, "per_length": per_length}
    slope = scale * sxy.sum() / sxx.sum()
    weights = rng.multinomial(C, np.full(C, 1 / C), size=n_boot).astype(float)  # (n_boot, C) cluster multiplicities
    denominators = weights @ sxx
    reps = scale * np.divide(weights @ sxy, denominators, out=np.full(n_boot, np.nan), where=denominators > 0)
    reps = reps[np.isfinite(reps)]
    se = float(reps.std(ddof=1)) if reps.size > 1 else 0.0
    p = (1.0 if slope == 0 else 0.0) if se == 0 else float(2 * norm.sf(abs(slope) / se))
    ci = [float(v) for v in np.percentile(reps, CI_PERCENTILES)]
    return rounded_floats({"pp_per_stride": float(slope), "ci_pp": ci, "se_pp": se, "p": p, "per_length": per_length})


def length_step(length: np.ndarray, correct: np.ndarray, stride: int) -> dict[str, Any]:
    """Per-length curve fit by (a) S phase means + a linear trend and (b) one step at the best query position + a
    linear trend (weighted least squares, weights = prompts per length); `step_explains` is True where (b)'s
    residual sum of squares is at most (a)'s.  With fewer distinct lengths than S + 2 nothing is fit (None)."""
    k, n = group_counts(length - length.min(), correct, int(length.max() - length.min()) + 1)
    keep = n > 0
    positions = length.min() + np.flatnonzero(keep)
    y, w = k[keep] / n[keep], n[keep]
    if len(positions) < stride + 2:
        return {"step_at": None, "step_pp": None, "rss_step": None, "rss_phase": None, "step_explains": None}
    centred = (positions - positions.mean()) / max(1.0, positions.std())
    phase_design = np.column_stack([np.eye(stride)[positions % stride], centred])
    rss_phase = _wls_rss(phase_design, y, w)[0]
    best = None
    for t in positions[1:]:
        rss, beta = _wls_rss(np.column_stack([np.ones_like(centred), positions >= t, centred]), y, w)
        if best is None or rss < best[0] - 1e-12:
            best = (rss, int(t), float(beta[1]))
    return rounded_floats({"step_at": best[1], "step_pp": 100 * best[2], "rss_step": float(best[0]),
                     "rss_phase": float(rss_phase), "step_explains": bool(best[0] <= rss_phase + 1e-12)})


def _wls_rss(design: np.ndarray, y: np.ndarray, w: np.ndarray) -> tuple[float, np.ndarray]:
    """Weighted least squares: (residual sum of squares sum w (y - X b)^2, b)."""
    root = np.sqrt(w)
    beta = np.linalg.lstsq(design * root[:, None], y * root, rcond=None)[0]
    return float(np.sum(w * (y - design @ beta) ** 2)), beta


def length_verdict(query: dict[str, Any]) -> dict[str, Any]:
    """The query phase's verdict with the length effect beside it: a phase-dependent curve that one step in the
    length explains at least as well as the S phases becomes "a length effect, not a phase" (no phase effect, no
    period), and every verdict ends with the length trend, "accuracy changes by X pp per S tokens [low, high]"."""
    trend, step, S = query["length_trend"], query["length_step"], query["stride"]
    interval = "[-]" if trend["ci_pp"] is None else f"[{trend['ci_pp'][0]:.1f}, {trend['ci_pp'][1]:.1f}]"
    p = "" if trend["p"] is None else f", p = {trend['p']:.3g}"
    length_text = f"length: accuracy changes by {trend['pp_per_stride']:+.1f} pp per {S} tokens {interval}{p}"
    parts = dict(query["verdict_parts"])
    verdict = query["verdict"]
    if parts.get("phase_dependent") and step.get("step_explains"):
        parts.update(phase_dependent=False, material=False, length_step=True)
        verdict = (f"a length effect, not a phase: one step of {step['step_pp']:+.1f} pp from query position "
                   f"{step['step_at']} on explains the per-length curve at least as well as the {S} phases; "
                   f"{length_text}; the phase statistics: {verdict}")
        return {"phase_sensitive": False, "verdict_parts": parts, "verdict": verdict}
    return {"verdict_parts": {**parts, "length_step": False}, "verdict": f"{verdict}; {length_text}"}
