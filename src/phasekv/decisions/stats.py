"""Item-clustered statistics of decisions by phase, and the three-part verdict (docs/science.md section 3).

Unit: the item.  Its R shifts are R prompts sharing one context, so they are never treated as independent: every
resampling and permutation below moves whole items, or shuffles within one item.

  - per phase: the decision rate (the share of prompts deciding the item's `answer`), with a Wilson 95% interval
    (a description of the prompts; the tests below carry the item clustering);
  - phase-dependent: a within-item permutation test.  Under "the decision does not depend on the phase", an
    item's R decisions are exchangeable over its shifts; each permutation shuffles every item's decisions over its
    own shifts and recomputes the phase contrast (best minus worst phase rate).  p = (1 + #{perm >= observed}) /
    (1 + n_perm).  Random flips and flips spread evenly over the phases are exchangeable: the test says no;
  - material: the phase contrast cross-fitted (best and worst phase chosen on a random half of the items and
    measured on the other half, both ways, averaged over splits: no selection bias), its one-sided 95% lower bound
    from an item bootstrap >= `minimum_pp`.  The minimum detectable gap is the contrast the same rule would call
    material with 80% power at this design's spread: minimum + (z_0.95 + z_0.80) x the bootstrap SD;
  - can decide (the uncompressed model): its decisions are stable under padding (an item keeps its most frequent
    decision at >= STABLE_MIN of its shifts, on average over items) and above chance (the item-bootstrap one-sided
    95% lower bound of the rate > the mean of 1 / continuations);
  - against padding alone (a compressed condition, paired by item): `flips` = the shifts whose decision is not the
    item's most frequent one under that condition; d = flips(condition) - flips(none) per item, a one-sided
    sign-flip permutation test of mean d > 0 ("flips more than the padding alone does"), and the within-item
    permutation test of the disagreement with the uncompressed decision at the same shift by phase ("the extra
    flips are periodic in S");
  - a served model against its weights in process (`compare`, --reference-hf): per phase, the share of prompts
    deciding alike (Wilson interval) and the largest and mean absolute difference of continuation log-probabilities.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from phasekv.evaluate.metrics import wilson_interval

ALPHA = 0.05
STABLE_MIN = 0.8  # mean share of an item's shifts at its most frequent decision, for "can decide"
MINIMUM_PP = 10.0  # the smallest phase contrast of the decision rate called material
Z_SUM = 1.6449 + 0.8416  # one-sided 95% bound, 80% power
SPLITS = 40  # random half-splits averaged for the cross-fitted contrast


def _matrix(rows: Sequence[Mapping], key: str) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(items, values (n, R), phases (n, R)) from rows {item, shift, phase, key}, items in first-seen order."""
    items = list(dict.fromkeys(r["item"] for r in rows))
    where = {item: i for i, item in enumerate(items)}
    shifts = sorted({r["shift"] for r in rows})
    values = np.full((len(items), len(shifts)), np.nan)
    phases = np.zeros((len(items), len(shifts)), dtype=np.int64)
    col = {s: j for j, s in enumerate(shifts)}
    for r in rows:
        values[where[r["item"]], col[r["shift"]]] = float(r[key])
        phases[where[r["item"]], col[r["shift"]]] = r["phase"]
    if np.isnan(values).any():
        raise ValueError("decisions: every item needs a decision at every shift")
    return items, values, phases


def _phase_means(values: np.ndarray, onehot: np.ndarray) -> np.ndarray:
    """Phase rates of values (..., n, R) with one-hot phases (n, R, S): (..., S)."""
    return np.einsum("...ir,irs->...s", values, onehot) / onehot.sum((0, 1))


def _item_phase(values: np.ndarray, onehot: np.ndarray) -> np.ndarray:
    """Each item's rate at each phase, (n, S)."""
    return np.einsum("ir,irs->is", values, onehot) / onehot.sum(1)


def _crossfit(m: np.ndarray, rng: np.random.Generator, splits: int) -> np.ndarray:
    """Cross-fitted phase contrasts of item-by-phase rates m (B, n, S), averaged over `splits` half-splits: (B,)."""
    n = m.shape[1]
    total = np.zeros(m.shape[0])
    for _ in range(splits):
        half = rng.permuted(np.arange(n) < n // 2, axis=0)
        for a, b in ((half, ~half), (~half, half)):
            ra, rb = m[:, a].mean(1), m[:, b].mean(1)  # (B, S)
            best, worst = ra.argmax(1), ra.argmin(1)
            rows = np.arange(len(rb))
            total += rb[rows, best] - rb[rows, worst]
    return 100 * total / (2 * splits)


def within_item_permutation(values: np.ndarray, phases: np.ndarray, stride: int, *, n_perm: int,
                            rng: np.random.Generator) -> float:
    """p of the phase contrast under within-item exchangeability of the shifts (module docstring)."""
    onehot = np.eye(stride)[phases]  # (n, R, S)
    rates = _phase_means(values, onehot)
    observed = rates.max() - rates.min()
    perms = np.stack([rng.permuted(values, axis=1) for _ in range(n_perm)])  # (P, n, R)
    null = _phase_means(perms, onehot)
    contrast = null.max(1) - null.min(1)
    return float((1 + np.sum(contrast >= observed - 1e-12)) / (1 + n_perm))


def phase_table(values: np.ndarray, phases: np.ndarray, stride: int) -> list[dict[str, Any]]:
    """Per phase: prompts, count, rate and Wilson 95% interval of 0/1 values."""
    out = []
    for ph in range(stride):
        k, n = float(values[phases == ph].sum()), int((phases == ph).sum())
        low, high = wilson_interval(k, n)
        out.append({"phase": ph, "n": n, "k": int(k), "rate": k / n if n else None,
                    "ci": [float(low), float(high)] if n else None})
    return out


def phase_effect(values: np.ndarray, phases: np.ndarray, stride: int, *, minimum_pp: float = MINIMUM_PP,
                 n_perm: int = 2000, n_boot: int = 1000, seed: int = 0) -> dict[str, Any]:
    """Phase dependence and materiality of 0/1 `values` (n items, R shifts) at `phases` (module docstring)."""
    rng = np.random.default_rng(seed)
    onehot = np.eye(stride)[phases]
    m = _item_phase(values, onehot)  # (n, S)
    rates = m.mean(0)
    estimate = float(_crossfit(m[None], rng, SPLITS)[0])
    boot = _crossfit(m[rng.integers(0, len(m), (n_boot, len(m)))], rng, 4)
    lower, sd = float(np.percentile(boot, 5)), float(boot.std())
    p = within_item_permutation(values, phases, stride, n_perm=n_perm, rng=rng)
    return {"per_phase": phase_table(values, phases, stride), "mean": float(values.mean()),
            "contrast_pp": float(100 * (rates.max() - rates.min())), "contrast_crossfit_pp": estimate,
            "contrast_lower_pp": lower, "minimum_pp": minimum_pp,
            "minimum_detectable_gap_pp": float(minimum_pp + Z_SUM * sd), "phase_p": p,
            "phase_dependent": p < ALPHA, "material": lower >= minimum_pp}


def flips(decisions: np.ndarray) -> np.ndarray:
    """Per item (row of labels over shifts): the shifts whose decision is not the item's most frequent one."""
    out = []
    for row in decisions:
        _, counts = np.unique(row, return_counts=True)
        out.append(len(row) - counts.max())
    return np.array(out)


def can_decide(correct: np.ndarray, decisions: np.ndarray, chance: float, *, n_boot: int = 1000,
               seed: int = 0) -> dict[str, Any]:
    """The capability gate of the uncompressed model (module docstring)."""
    rng = np.random.default_rng(seed)
    per_item = correct.mean(1)
    boot = per_item[rng.integers(0, len(per_item), (n_boot, len(per_item)))].mean(1)
    stability = float(1 - flips(decisions).mean() / decisions.shape[1])
    lower = float(np.percentile(boot, 5))
    return {"rate": float(per_item.mean()), "rate_lower": lower, "chance": chance, "stability": stability,
            "stable_min": STABLE_MIN, "above_chance": lower > chance, "stable": stability >= STABLE_MIN,
            "can_decide": lower > chance and stability >= STABLE_MIN}


def against_padding(decisions: np.ndarray, baseline: np.ndarray, phases: np.ndarray, stride: int, *,
                    n_perm: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Paired by item: does the condition flip more than the padding alone (`baseline`: the uncompressed decisions
    at the same shifts), and are its departures from the baseline periodic in S (module docstring)."""
    rng = np.random.default_rng(seed)
    d = flips(decisions) - flips(baseline)
    signs = rng.choice([-1.0, 1.0], size=(n_perm, len(d)))
    null = (signs * d).mean(1)
    p_more = float((1 + np.sum(null >= d.mean() - 1e-12)) / (1 + n_perm)) if d.any() else 1.0
    differ = (decisions != baseline).astype(float)
    p_periodic = within_item_permutation(differ, phases, stride, n_perm=n_perm, rng=rng)
    return {"flips_mean": float(flips(decisions).mean()), "padding_flips_mean": float(flips(baseline).mean()),
            "extra_flips_mean": float(d.mean()), "more_flips_p": p_more, "flips_more": p_more < ALPHA,
            "disagreement": float(differ.mean()), "disagreement_by_phase": phase_table(differ, phases, stride),
            "periodic_p": p_periodic, "periodic": p_periodic < ALPHA}


def condition_matrices(rows: Sequence[Mapping]) -> dict[str, Any]:
    """items, correct (n, R), decisions (n, R, labels as text), phases (n, R) of one condition's rows."""
    items, correct, phases = _matrix(rows, "correct")
    where = {item: i for i, item in enumerate(items)}
    shifts = sorted({r["shift"] for r in rows})
    col = {s: j for j, s in enumerate(shifts)}
    decisions = np.empty(correct.shape, dtype=object)
    for r in rows:
        decisions[where[r["item"]], col[r["shift"]]] = r["decision"]
    return {"items": items, "correct": correct, "decisions": decisions.astype(str), "phases": phases}


def verdict_line(effect: Mapping[str, Any]) -> str:
    """The three-part verdict of a phase effect, in one line."""
    numbers = (f"contrast {effect['contrast_pp']:.1f} pp, cross-fitted {effect['contrast_crossfit_pp']:.1f} pp "
               f"(lower bound {effect['contrast_lower_pp']:.1f}, minimum {effect['minimum_pp']:g}), "
               f"p = {effect['phase_p']:.3g}")
    if effect["phase_dependent"] and effect["material"]:
        return f"decisions phase sensitive: {numbers}"
    if effect["phase_dependent"]:
        return f"a phase effect, not shown material: {numbers}"
    return (f"no phase effect detected: {numbers}; contrasts below {effect['minimum_detectable_gap_pp']:.1f} pp "
            "would often go unseen")


def _agreement(agree: int, n: int) -> dict[str, Any]:
    low, high = wilson_interval(agree, n)
    return {"n": n, "agree": agree, "agreement": agree / n if n else float("nan"), "ci_low": float(low),
            "ci_high": float(high)}


def compare(served: Sequence[dict[str, Any]], reference: Sequence[dict[str, Any]], stride: int) -> dict[str, Any]:
    """The engine's decisions and continuation log-probabilities against the reference's, per phase and overall
    (`served` and `reference`: decision rows of the same prompts, `phasekv.decisions.pipeline.decision_row`;
    `phasekv decide --reference-hf`)."""
    ref = {(r["item"], r["shift"]): r for r in reference}
    if set(ref) != {(r["item"], r["shift"]) for r in served}:
        raise ValueError("the reference scored other prompts than the engine")
    by_phase: dict[int, list[tuple[bool, list[float]]]] = {}
    for r in served:
        other = ref[(r["item"], r["shift"])]
        diffs = [abs(r["logp"][label] - other["logp"][label]) for label in r["logp"]]
        by_phase.setdefault(r["phase"], []).append((r["decision"] == other["decision"], diffs))

    def summary(rows: list[tuple[bool, list[float]]]) -> dict[str, Any]:
        diffs = np.array([d for _, ds in rows for d in ds])
        return {**_agreement(sum(same for same, _ in rows), len(rows)),
                "max_abs_logp_diff": float(diffs.max()), "mean_abs_logp_diff": float(diffs.mean())}

    per_phase = [{"phase": phase, **summary(by_phase[phase])} for phase in range(stride) if phase in by_phase]
    return {"per_phase": per_phase, "overall": summary([row for rows in by_phase.values() for row in rows])}
