"""The vocabulary of reproduce's findings: the verdict constants the claims are judged by, the one status rule
(`judge`: an interval on the claimed side of a threshold holds, on the other side fails, across it is inconclusive),
the finding record (`finding`), the counts, and how a measured model's numbers are read and written into a finding
(`phasekv.report.findings` states the claims themselves).
"""

from __future__ import annotations

import math
from typing import Any

from phasekv.evaluate.verdict import CHANCE_FACTOR, material_gap_bound

FULL_FLAT_PP = 6.1  # the paper's largest full-attention phase gap
W8S8_WORST_PCT = 20.0  # the paper's W8/S8 worst phases: 5.7% (1 KV), 9.9% (8 KV)
WITHIN_WINDOW_PP = 50.0  # the paper: phases 0..6 of W8/S8 spread by more than 50 points
COVERED_PCT = 40.0  # a phase is covered when its accuracy is above 40% (Wilson interval)
W8S8_COVERED = 3  # phases above 40% that the paper's W8/S8 numbers force
CYCLING_R2 = 0.66  # the paper's lowest R^2 excluding the boundary phase
CYCLING_DELTAS_NEEDED = 4  # of the 6 non-zero deltas
STATUSES = ("holds", "fails", "inconclusive", "not measured")


def judge(interval: list[float] | None, threshold: float, above: bool = True) -> str:
    """The one rule: 'holds' when the interval lies on the claimed side of the threshold (above it, or below it
    with above=False), 'fails' when it lies on the other side, 'inconclusive' when it spans it."""
    if interval is None:
        return "inconclusive"
    low, high = interval
    if above:
        return "holds" if low >= threshold else "fails" if high < threshold else "inconclusive"
    return "holds" if high < threshold else "fails" if low >= threshold else "inconclusive"


def difference_interval(a: float, ci_a: list[float] | None, b: float, ci_b: list[float] | None) -> list[float] | None:
    """95% interval of b - a from the two models' own intervals (normal approximation, independent models)."""
    if ci_a is None or ci_b is None:
        return None
    half = math.hypot((ci_a[1] - ci_a[0]) / 2, (ci_b[1] - ci_b[0]) / 2)
    return [b - a - half, b - a + half]


def count(found: list[dict[str, Any]]) -> dict[str, int]:
    """Findings per status (every status present, zeros included)."""
    return {status: sum(f["status"] == status for f in found) for status in STATUSES}


def count_line(found: list[dict[str, Any]]) -> str:
    """'27 hold, 3 fail, 5 inconclusive of 35 (2 not measured)'."""
    c = count(found)
    judged = c["holds"] + c["fails"] + c["inconclusive"]
    line = f"{c['holds']} hold, {c['fails']} fail, {c['inconclusive']} inconclusive of {judged}"
    return line + (f" ({c['not measured']} not measured: models missing)" if c["not measured"] else "")


def finding(claim: str, paper: str, rule: str, measured: str, status: str, value: float | None = None, *,
             interval: list[float] | None = None, threshold: float | None = None, why: str | None = None,
             **extra: Any) -> dict[str, Any]:
    assert status in STATUSES, status
    return {"claim": claim, "paper": paper, "rule": rule, "measured": measured, "status": status,
            "holds": {"holds": True, "fails": False}.get(status), "value": value, "interval": interval,
            "threshold": threshold, **({"why": why} if why else {}), **extra}


def family(m: dict[str, Any]) -> tuple:
    """What two models must share to be compared: model family (phasekv or transformers; a transformers model also
    its architecture: Qwen3 and DeepSeek-V3.2 are different networks), KV heads, layers, width."""
    fam = m.get("family", "phasekv")
    return fam, m.get("architecture") if fam == "transformers" else None, m["kv_heads"], m["layers"], m["hidden"]


def without_kv(m: dict[str, Any]) -> tuple:
    """`family` except the KV heads (full-attention models compared across KV heads)."""
    fam, arch, _, layers, hidden = family(m)
    return fam, arch, layers, hidden


def kind(m: dict[str, Any]) -> str:
    """Short variant name: full, W8/S8, W8/S8 uniform, W8/S8 shared, W8/S8 stagger, csa..."""
    if m["compressor"] == "none":
        return "full"
    base = f"W{m['window']}/S{m['stride']}" if m["compressor"] == "gated" else m["compressor"]
    extras = [flag for flag, on in (("uniform", m["uniform"]), ("stagger", m.get("staggered")),
                                    ("shared", m.get("shared_payload") and not m["uniform"])) if on]
    return " ".join([base, *extras])


def ci_text(ci: list[float] | None, digits: int = 1) -> str:
    return "" if ci is None else f"[{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]"


def curve_text(p: dict[str, Any]) -> str:
    return "per phase " + " ".join(f"{100 * r['accuracy']:.0f}" for r in p["per_phase"])


def gap_of(p: dict[str, Any]) -> tuple[float, list[float] | None]:
    """The selection-free (cross-fitted) best-minus-worst gap and its 95% interval (pp): flatness and orderings."""
    value = p.get("gap_crossfit_pp")
    return (p["max_gap_pp"] if value is None else value), p.get("gap_crossfit_ci_pp")


def dip_of(p: dict[str, Any]) -> tuple[float | None, list[float] | None]:
    """The dip the verdict's material rule trusts and its one-sided 95% bounds (pp): `verdict.material_gap_bound`."""
    _, bounds, _ = material_gap_bound(p)
    return p.get("contrast_crossfit_pp"), bounds


def mean_of(p: dict[str, Any]) -> tuple[float, list[float] | None]:
    return 100 * p["mean_accuracy"], [100 * x for x in p["mean_ci"]] if p.get("mean_ci") else None


def gate_of(p: dict[str, Any]) -> float:
    """The capability gate in %: 2 x the in-context chance."""
    return 100 * CHANCE_FACTOR * p["in_context_chance"]


def unable_reason(p: dict[str, Any]) -> str | None:
    """Why a phase claim about this protocol result is empty (the model cannot do the task), else None."""
    if p["can_do_task"]:
        return None
    return f"inconclusive: cannot do the task (mean {100 * p['mean_accuracy']:.1f}% vs gate {gate_of(p):.1f}%)"
