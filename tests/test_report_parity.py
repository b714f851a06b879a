"""The period-2 finding (phasekv.report.parity) on synthetic summaries with known answers: it must hold for a clean
even/odd split, fail without a contrast or with crossing residues, and be inconclusive where it cannot decide."""

from phasekv.report.parity import parity_findings
from phasekv.report.reasons import explained


def _rows(key, accs, half):
    return [{key: i, "accuracy": a, "ci_low": max(0.0, a - half), "ci_high": min(1.0, a + half), "n": 100}
            for i, a in enumerate(accs)]


def summary(even, odd, jitter=0.0, half=0.02, can=True, stride=2, knockout=None):
    """A model whose residues mod 24 alternate even/odd accuracies (+- jitter on every fourth residue)."""
    residues = [(even if r % 2 == 0 else odd) + (jitter if r % 4 < 2 else -jitter) for r in range(24)]
    prefix = {"per_phase": _rows("phase", [even, odd], half), "per_residue": _rows("residue", residues, half),
              "can_do_task": can, "mean_accuracy": (even + odd) / 2}
    return {"compressor": "deepseek_csa2", "stride": stride, "prefix": prefix,
            **({"knockout": {"rows": knockout}} if knockout else {})}


def one(m, name="m"):
    found = explained(parity_findings({name: m}), {name: m})
    assert len(found) == 1
    return found[0]


def test_clean_split_holds_either_way_round():
    f = one(summary(0.8, 0.4))
    assert f["status"] == "holds" and f["value"] == 40.0 and "even above odd by 40.0 pp" in f["measured"]
    assert one(summary(0.3, 0.7))["status"] == "holds"  # all even below all odd: still one side


def test_no_contrast_fails_with_a_measured_reason():
    f = one(summary(0.61, 0.60))
    assert f["status"] == "fails" and f["reason"]["category"] == "scale" and "below" in f["reason"]["because"]


def test_crossing_residues_fail_even_with_a_large_contrast():
    f = one(summary(0.7, 0.5, jitter=0.15))  # residue 2: 0.55 < residue 1: 0.65
    assert f["status"] == "fails" and f["reason"]["category"] == "recipe" and "cross" in f["reason"]["because"]


def test_undecided_and_unable_models_are_inconclusive():
    assert one(summary(0.62, 0.50, half=0.06))["status"] == "inconclusive"  # [3.5, 20.5] spans 10
    f = one(summary(0.02, 0.01, can=False))
    assert f["status"] == "inconclusive" and f["reason"]["category"] == "scale"


def test_only_stride_two_models_are_judged_and_knockouts_are_listed_by_layer():
    assert parity_findings({"v4": summary(0.8, 0.4, stride=4), "full": {**summary(0.8, 0.4), "compressor": "none"}}) \
        == []
    rows = [{"layer": 1, "kv_head": 0, "mean_rel_change_pct": -40.0, "per_phase_rel_change_pct": [-50.0, -20.0]},
            {"layer": 2, "kv_head": 0, "mean_rel_change_pct": -5.0, "per_phase_rel_change_pct": [-6.0, -4.0]}]
    assert "knockouts by layer: L1 -40% (even -50, odd -20), L2 -5% (even -6, odd -4)" in \
        one(summary(0.8, 0.4, knockout=rows))["measured"]
