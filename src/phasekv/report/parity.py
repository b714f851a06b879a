"""The period-2 finding of DeepSeek-V4.1-style pooling (docs/science.md section 6): ratio-2 pooling puts every even
residue group on one side of every odd one.

The paper reports, for DeepSeek-V4.1-Flash (CSA2: every 2 tokens pooled into one entry), "all even residue groups
above all odd ones".  phasekv's own CSA2 model (`compression.csa2`, preset configs/cpu/dsv41-csa2.yaml) is judged on
the same statement, for every reproduced model whose phase stride is 2, with the one rule of
`findings.judge`:

    value     the parity contrast |acc(even phase) - acc(odd phase)| (pp), on the side the data show, and its 95%
              interval (`findings.difference_interval` of the two phases' Wilson intervals)
    holds     the contrast's interval lies above MATERIAL_GAP_PP (the verdict's material minimum) AND every even
              residue (mod 24) lies on that side of every odd residue
    fails     the interval lies below the minimum (no period-2 pattern at this scale), or it lies above but some
              residues cross (a period-2 contrast without the clean split)
    inconclusive  the interval spans the minimum, or the model cannot do the task

Its measured text also lists the knockouts by layer: how much each compressed layer carries the lookup and the
phase (a shared CSA2 layer reads its source's cache: does it carry phase the way its source does?).
A finding that does not hold carries its own measured reason (`diagnosis`, read by `reasons`).
"""

from __future__ import annotations

from typing import Any

from phasekv.evaluate.verdict import MATERIAL_GAP_PP
from phasekv.report.claims import difference_interval, finding, judge

PAPER = "DeepSeek-V4.1-Flash: all even residue groups above all odd ones (needle gap 6.1 pp at S = 2)"


def parity_split(p: dict[str, Any]) -> dict[str, Any]:
    """Measured numbers of one protocol result (per_phase of stride 2, per_residue): the contrast (pp, even minus
    odd) and its interval, the side (+1 even above, -1 below), and how many residues cross to the other side."""
    even, odd = p["per_phase"][0], p["per_phase"][1]
    ci = lambda r: [100 * r["ci_low"], 100 * r["ci_high"]]  # noqa: E731
    contrast = 100 * (even["accuracy"] - odd["accuracy"])
    interval = difference_interval(100 * odd["accuracy"], ci(odd), 100 * even["accuracy"], ci(even))
    side = 1 if contrast >= 0 else -1
    residues = [r for r in p["per_residue"] if r.get("n")]
    evens = [side * r["accuracy"] for r in residues if r["residue"] % 2 == 0]
    odds = [side * r["accuracy"] for r in residues if r["residue"] % 2 == 1]
    crossing = sum(e <= max(odds) for e in evens) + sum(o >= min(evens) for o in odds) if evens and odds else 0
    return {"contrast_pp": contrast, "interval": interval, "side": side, "crossing": crossing,
            "n_residues": len(residues)}


def _knockouts(m: dict[str, Any]) -> str:
    """'; knockouts by layer: L1 -40% (even -50, odd -30), ...' (worst head of each layer), or ''."""
    rows = (m.get("knockout") or {}).get("rows") or []
    by_layer: dict[int, dict] = {}
    for r in rows:
        if r["layer"] not in by_layer or r["mean_rel_change_pct"] < by_layer[r["layer"]]["mean_rel_change_pct"]:
            by_layer[r["layer"]] = r
    parts = []
    for layer, r in sorted(by_layer.items()):
        phases = r.get("per_phase_rel_change_pct") or []
        split = f" (even {phases[0]:.0f}, odd {phases[1]:.0f})" if len(phases) == 2 and None not in phases else ""
        parts.append(f"L{layer} {r['mean_rel_change_pct']:.0f}%{split}")
    return "; knockouts by layer: " + ", ".join(parts) if parts else ""


def parity_status(p: dict[str, Any]) -> tuple[str, dict[str, Any], tuple[str, str] | None]:
    """(status, measured numbers, diagnosis (category, because) when it does not hold)."""
    split = parity_split(p)
    if not p["can_do_task"]:
        return "inconclusive", split, ("scale", f"cannot do the task (mean {100 * p['mean_accuracy']:.1f}%)")
    lo_hi = split["interval"]
    magnitude = None if lo_hi is None else sorted(split["side"] * v for v in lo_hi)
    status = judge(magnitude, MATERIAL_GAP_PP)
    if status == "fails":
        return status, split, ("scale", f"the even-odd contrast {abs(split['contrast_pp']):.1f} pp is below the "
                                        f"{MATERIAL_GAP_PP:g} pp minimum: no period-2 pattern at this scale")
    if status == "inconclusive":
        return status, split, ("protocol", f"this run's prompts cannot decide: the contrast's interval spans "
                                           f"{MATERIAL_GAP_PP:g} pp")
    if split["crossing"]:
        return "fails", split, ("recipe", f"a period-2 contrast without the clean split: {split['crossing']} of "
                                          f"{split['n_residues']} residues cross to the other parity's side")
    return "holds", split, None


def parity_findings(models: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The period-2 claim for every model with phase stride 2 (prefix padding, residues mod 24)."""
    out = []
    for name, m in models.items():
        if m.get("stride") != 2 or m.get("compressor") in (None, "none"):
            continue
        p = m["prefix"]
        status, split, diagnosis = parity_status(p)
        side = "above" if split["side"] > 0 else "below"
        residues = " ".join(f"{100 * r['accuracy']:.0f}" for r in p["per_residue"] if r.get("n"))
        even, odd = (100 * r["accuracy"] for r in p["per_phase"][:2])
        measured = (f"even phase {even:.1f}%, odd {odd:.1f}%: even {side} odd by {abs(split['contrast_pp']):.1f} pp, "
                    f"{split['crossing']} of {split['n_residues']} residues cross; residues mod 24: "
                    f"{residues}{_knockouts(m)}")
        interval = None if split["interval"] is None else sorted(split["side"] * v for v in split["interval"])
        out.append(finding(f"{name}: ratio-2 pooling gives a period-2 pattern (even residue groups on one side of "
                            "odd ones)", PAPER, f"|even - odd| phase contrast's 95% interval above "
                            f"{MATERIAL_GAP_PP:g} pp and every even residue (mod 24) on one side of every odd one",
                            measured, status, abs(split["contrast_pp"]), interval=interval,
                            threshold=MATERIAL_GAP_PP, kind="parity", model=name,
                            **({"diagnosis": list(diagnosis)} if diagnosis else {})))
    return out


def diagnosed(f: dict[str, Any], models: dict[str, Any]) -> tuple[str, str, str] | None:
    """`reasons` rule: a parity finding's own measured reason."""
    if f.get("kind") != "parity" or not f.get("diagnosis"):
        return None
    category, because = f["diagnosis"]
    return category, because, "this run's summary.json (findings, kind parity) and its per-residue curve"
