"""What gate cycling did to the phase curve, as one of three outcomes with its own statistics (`phasekv.probes.cycle`).

R^2 of the cycled curve against the clean one shifted by delta cannot tell the outcomes apart: it is computed about
the cycled curve's own mean, so when cycling destroys retrieval at every phase the cycled curve is nearly flat, its
sum of squares is near zero and R^2 runs to -10^4 or -10^5 (measured on the bundled per-offset models) while saying
nothing a reader can use.  Per delta, on the clean and the cycled records of the same prompts under one cluster
bootstrap (`phase_bootstrap`), this module measures instead:

* `shift`: the roll s of the clean curve A_0 that best matches the cycled curve A_d (least squares over the phases
  other than the boundary phases, which cycling does not move), wrapped into (-S/2, S/2].  It is the shift of the
  curve's argmax and argmin when the curve moves as a whole, and stays defined when the extreme is tied (two good
  phases, a block of good phases that wraps round).  `shift_set`: the 95% bootstrap set, the most frequent shifts
  of the replicates taken in turn until they hold SHIFT_SET_MASS of them (a set, not an interval: the shift lives on
  a circle); a replicate whose best roll is tied draws one of the tied rolls at random, so an uninformative
  replicate widens the set instead of favouring one shift;
* `corr_shifted`, `corr_unshifted`: the Pearson correlation of A_d with A_0((r - delta) mod S) and with A_0(r), with
  95% bootstrap intervals (None where a curve has no spread);
* `mean_before`, `mean_after`: the mean of the clean and the cycled curve with 95% bootstrap intervals;
* `observed_varies`: the cycled curve's phases differ by more than noise (Pearson's chi-square of the phases x
  correct table, phases other than the boundary, p < FLATNESS_ALPHA; conservative when every example covers every
  phase, as the probe sets do).  R^2 is kept only then; otherwise it is None.  A kept R^2 is floored at R2_FLOOR:
  below -1 the prediction misses by more than twice the cycled curve's own spread, and a larger miss says nothing
  more, so no output ever shows an R^2 below -1.

`status`, one rule per outcome, judged in this order:

    destroyed      the cycled mean's 95% lower bound is at or below the capability gate (CHANCE_FACTOR x the
                   in-context chance: the accuracy of a model that copies a random value from its context), while
                   the clean model is above it
    moved          the shift set holds delta and not 0
    did not move   the shift set holds 0 and not delta
    inconclusive   the set holds both (too noisy) or neither (the curve changed shape), the clean model cannot do
                   the task, or the clean curve is flat (nothing to move); `why` says which

delta = 0 (mod S) is the clean model itself and gets no status (None).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from scipy.stats import chi2

from phasekv.evaluate.profiles import nan_interval, phase_bootstrap
from phasekv.evaluate.verdict import CHANCE_FACTOR, FLATNESS_ALPHA

SHIFT_SET_MASS = 0.95  # the shift set holds this share of the bootstrap replicates
R2_FLOOR = -1.0  # the lowest R^2 reported
OUTCOMES = ("moved", "did not move", "destroyed", "inconclusive")


def wrap(shift: int, stride: int) -> int:
    """A roll of a curve of `stride` phases as the shift in (-S/2, S/2] (S = 8: -3 .. 4)."""
    s = int(shift) % stride
    return s - stride if s > stride // 2 else s


def r_squared(observed: np.ndarray, predicted: np.ndarray) -> float | None:
    """1 - SS_res / SS_tot about the observed mean; None when the observed values are all equal."""
    total = float(((observed - observed.mean()) ** 2).sum())
    return None if total == 0 else 1 - float(((observed - predicted) ** 2).sum()) / total


def floored(r2: float | None) -> float | None:
    return None if r2 is None else max(R2_FLOOR, r2)


def best_shifts(clean: np.ndarray, observed: np.ndarray, inner: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Per row, the roll s in 0..S-1 minimising sum over the `inner` phases of (observed[r] - clean[(r - s) mod S])^2;
    ties drawn at random.  clean, observed: (b, S) curves; returns (b,) rolls, -1 for a row without a finite cost."""
    S = clean.shape[-1]
    r = np.arange(S)
    rolled = np.stack([clean[:, (r - s) % S] for s in range(S)], 1)  # (b, s, S)
    cost = np.nansum((observed[:, None, inner] - rolled[:, :, inner]) ** 2, -1)  # (b, s)
    cost[np.isnan(rolled[:, :, inner]).all(-1) | np.isnan(observed[:, None, inner]).all(-1)] = np.inf
    best = cost.min(1, keepdims=True)
    tied = np.isfinite(cost) & (cost <= best + 1e-12)
    pick = np.argmax(rng.random(cost.shape) * tied, 1)
    return np.where(tied.any(1), pick, -1)


def shift_set(shifts: np.ndarray, stride: int) -> list[int]:
    """The most frequent wrapped shifts, in turn, until they hold SHIFT_SET_MASS of the replicates (sorted)."""
    shifts = shifts[shifts >= 0]
    if shifts.size == 0:
        return []
    values, counts = np.unique([wrap(s, stride) for s in shifts], return_counts=True)
    order = np.argsort(-counts, kind="stable")
    mass = np.cumsum(counts[order]) / shifts.size
    keep = order[: int(np.searchsorted(mass, SHIFT_SET_MASS - 1e-12)) + 1]
    return sorted(int(v) for v in values[keep])


def varies(records: Sequence[Mapping], phases: np.ndarray, stride: int) -> tuple[bool, float | None]:
    """(the phases' accuracies differ beyond noise, the chi-square p) over `phases`: Pearson's chi-square of the
    phases x correct table, independent prompts (module doc)."""
    phase = np.asarray([r["phase"] for r in records])
    correct = np.asarray([float(r["correct"]) for r in records])
    k = np.bincount(phase, weights=correct, minlength=stride)[phases]
    n = np.bincount(phase, minlength=stride)[phases].astype(float)
    k, n = k[n > 0], n[n > 0]
    p = k.sum() / n.sum() if n.sum() else 0.0
    if len(n) < 2 or p in (0.0, 1.0):
        return False, None
    statistic = float(((k - n * p) ** 2 / (n * p * (1 - p))).sum())
    p_value = float(chi2.sf(statistic, len(n) - 1))
    return p_value < FLATNESS_ALPHA, p_value


def _per_phase(records: Sequence[Mapping], stride: int) -> np.ndarray:
    """Accuracy per phase (nan for a phase without prompts)."""
    phase = np.asarray([r["phase"] for r in records])
    k = np.bincount(phase, weights=[float(r["correct"]) for r in records], minlength=stride)
    n = np.bincount(phase, minlength=stride)
    return np.divide(k, n, out=np.full(stride, np.nan), where=n > 0)


def _corr(a: np.ndarray, b: np.ndarray) -> float:
    """Pearson correlation of the last axis (nan where either side has no spread)."""
    a, b = a - np.nanmean(a, -1, keepdims=True), b - np.nanmean(b, -1, keepdims=True)
    denominator = np.sqrt(np.nansum(a * a, -1) * np.nansum(b * b, -1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator > 0, np.nansum(a * b, -1) / denominator, np.nan)


def _value(x: float) -> float | None:
    return None if not np.isfinite(x) else float(x)


def outcome(clean_records: Sequence[Mapping], records: Sequence[Mapping], delta: int, *, stride: int,
            inner: np.ndarray, in_context_chance: float, n_boot: int = 1000, seed: int = 0) -> dict[str, Any]:
    """The statistics and status of one delta (module doc).  clean_records, records: predictions of the same
    prompts (`cluster`, `phase`, `correct`) before and after cycling; inner: the phases other than the boundary."""
    S, delta = int(stride), int(delta)
    reps = phase_bootstrap([clean_records, records], S, n_boot, seed)  # (b, 2, S)
    a0, ad = (_per_phase(rs, S) for rs in (clean_records, records))
    predicted = a0[(np.arange(S) - delta) % S]
    rng = np.random.default_rng(seed + 1)
    shifts = best_shifts(reps[:, 0], reps[:, 1], inner, rng)
    point_shift = best_shifts(a0[None], ad[None], inner, rng)[0]
    corr = {name: _corr(reps[:, 1, inner], (reps[:, 0] if d == 0 else reps[:, 0][:, (np.arange(S) - d) % S])[:, inner])
            for name, d in (("corr_shifted", delta), ("corr_unshifted", 0))}
    means = np.nanmean(reps, -1)  # (b, 2)
    observed_varies, varies_p = varies(records, inner, S)
    all_vary, _ = varies(records, np.arange(S), S)
    r2_reps = [floored(r_squared(o[inner], c[(np.arange(S) - delta) % S][inner])) for c, o in reps]
    row = {"delta": delta, "observed": ad.tolist(), "predicted": predicted.tolist(),
           "shift": None if point_shift < 0 else wrap(point_shift, S), "shift_set": shift_set(shifts, S),
           **{name: _value(_corr(ad[inner], (a0 if name == "corr_unshifted" else predicted)[inner]))
              for name in corr},
           **{f"{name}_ci": nan_interval(values) for name, values in corr.items()},
           "mean_before": float(a0.mean()), "mean_before_ci": nan_interval(means[:, 0]),
           "mean_after": float(ad.mean()), "mean_after_ci": nan_interval(means[:, 1]),
           "observed_varies": observed_varies, "observed_varies_p": varies_p,
           "r2_excl_boundary": floored(r_squared(ad[inner], predicted[inner])) if observed_varies else None,
           "r2_excl_boundary_ci": (nan_interval([np.nan if r is None else r for r in r2_reps]) if observed_varies
                                   else None),
           "r2_all": floored(r_squared(ad, predicted)) if all_vary else None,
           "mae": float(np.abs(ad - predicted).mean())}
    return {**row, **judge(row, stride=S, gate=CHANCE_FACTOR * in_context_chance,
                           clean_varies=varies(clean_records, inner, S)[0])}


def judge(row: Mapping[str, Any], *, stride: int, gate: float, clean_varies: bool) -> dict[str, Any]:
    """`status` and `why` of one delta's statistics (module doc); gate: the capability gate (CHANCE_FACTOR x the
    in-context chance) as a fraction."""
    delta = wrap(row["delta"], stride)
    before, after = row["mean_before_ci"], row["mean_after_ci"]
    if delta == 0:
        return {"status": None, "why": "delta 0 is the clean model"}
    if before is None or before[0] <= gate:
        return {"status": "inconclusive", "why": f"the clean model cannot do the task (mean's lower bound at or "
                                                 f"below the gate {100 * gate:.1f}%)"}
    if after is not None and after[0] <= gate:
        return {"status": "destroyed", "why": f"cycled mean {100 * row['mean_after']:.1f}% [{100 * after[0]:.1f}, "
                                              f"{100 * after[1]:.1f}]: down to the copier's level (gate "
                                              f"{100 * gate:.1f}%)"}
    if not clean_varies:
        return {"status": "inconclusive", "why": "the clean curve is flat: nothing to move"}
    found = row["shift_set"]
    if delta in found and 0 not in found:
        return {"status": "moved", "why": None}
    if 0 in found and delta not in found:
        return {"status": "did not move", "why": None}
    return {"status": "inconclusive", "why": f"shift set {found} holds both 0 and {delta:+d}" if found and 0 in found
            else f"the curve changed shape: shift set {found}, neither 0 nor {delta:+d}"}
