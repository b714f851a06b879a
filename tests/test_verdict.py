"""The verdict of `verdict.task_verdict`: every rule has a case where it must say no, and every threshold is pinned
just inside and just outside its boundary (changing a constant breaks a test).

Three parts: can the model do the task (against the in-context chance), is accuracy phase-dependent (flatness),
is the effect material (the selection-free dip's one-sided lower bound >= MATERIAL_GAP_PP and the gap above the
null's 95th percentile); "phase sensitive" needs all three and names the best period > 1."""

import numpy as np
import pytest

from phasekv.auditing.pipeline import compressed_verdict
from phasekv.data.protocols import build_eval_set
from phasekv.data.vocab import Vocabulary
from phasekv.evaluate.metrics import summarize
from phasekv.evaluate.verdict import (
    CHANCE_FACTOR,
    DETECTION_POWER,
    FLATNESS_ALPHA,
    MATERIAL_GAP_PP,
    minimum_detectable_gap,
    task_verdict,
    verdict_period,
)
from tests.test_metrics import phase_curve, shifted_records

CHANCE, IN_CONTEXT = 1 / 64, 0.04
SCORES = {"1": 30.0, "2": 25.0, "4": 12.0, "8": 0.0}  # BIC differences: period 8
NULL = {"stride": 8, "residue_modulus": 8, "n_prompts": 1536, "n_clusters": 48, "period_scores": SCORES,
        "gap_ci_pp": [15.0, 30.0], "contrast_crossfit_se_pp": 4.0, "null_gap_p95_pp": 8.0,
        "contrast_crossfit_pp": 20.0}
# a material effect, every part just inside its boundary; the tests move one number across it
EDGE = {**NULL, "mean_accuracy": 0.5, "mean_ci": [0.45, 0.55], "flatness_p": 0.001, "max_gap_pp": 25.0,
        "contrast_crossfit_bounds_pp": [MATERIAL_GAP_PP, 30.0]}


def judged(**changes):
    return task_verdict({**EDGE, **changes}, CHANCE, IN_CONTEXT)


def verdict(residue_acc, n_clusters=60, seed=0, **kw):
    m = summarize(shifted_records(np.asarray(residue_acc, float), n_clusters, seed), stride=8, n_boot=200,
                  n_perm=200)
    return m, task_verdict(m, CHANCE, IN_CONTEXT, **kw)


def copier_records(eval_set, seed):
    """A model that copies a uniformly random value present in its prompt, on every prompt of `eval_set`."""
    rng = np.random.default_rng(seed)
    start = eval_set.settings["key_tokens"]
    rows = []
    for c in eval_set.contexts:
        candidates = sorted({c.ids[p + start] for p in c.record_positions})
        for q in c.queries:
            rows.append({"cluster": q.cluster, "target_position": q.target_position,
                         "correct": candidates[rng.integers(len(candidates))] == q.answer})
    return rows


@pytest.mark.parametrize("protocol", ["prefix", "insequence"])
def test_a_random_in_context_copier_cannot_do_the_task(protocol):
    eval_set = build_eval_set(Vocabulary(), protocol, stride=8, n_records=32, n_demos=4, seed=0)
    records = copier_records(eval_set, seed=1)
    m = summarize(records, stride=8, n_boot=200, n_perm=200)
    icc = eval_set.in_context_chance
    # the exact in-context chance is what the simulated copier scores, well above the format's 1/64
    assert m["mean_ci"][0] <= icc <= m["mean_ci"][1]
    assert 2 * eval_set.chance < icc < 0.06
    v = task_verdict(m, eval_set.chance, icc)
    assert not v["can_do_task"] and v["verdict"].startswith("cannot do the task") and not v["phase_sensitive"]
    # the old gate (2 x the format's chance) would have let the copier through: the baseline matters
    assert m["mean_ci"][0] > CHANCE_FACTOR * eval_set.chance


def test_capability_gate_is_twice_the_in_context_chance():
    below = {"mean_accuracy": 0.075, "mean_ci": [0.07, 0.08]}  # 1.75 x the in-context chance
    above = {"mean_accuracy": 0.095, "mean_ci": [0.09, 0.10]}  # 2.25 x
    base = {**NULL, "flatness_p": 0.5, "max_gap_pp": 2.0, "contrast_crossfit_bounds_pp": [-1.0, 3.0]}
    assert not task_verdict({**base, **below}, CHANCE, IN_CONTEXT)["can_do_task"]
    assert task_verdict({**base, **above}, CHANCE, IN_CONTEXT)["can_do_task"]
    assert task_verdict({**base, **above}, CHANCE, IN_CONTEXT)["verdict"].startswith("no phase effect detected")


def test_a_strong_periodic_curve_is_phase_sensitive_with_its_period():
    m, v = verdict(phase_curve(8, fail=(7,), fail_acc=0.05, ok_acc=0.9))
    assert v["phase_sensitive"] and v["verdict"].startswith("phase sensitive: period 8")
    assert v["verdict_parts"] == {"can_do_task": True, "phase_dependent": True, "material": True, "period": 8,
                                  "layout_trend": False, "too_small": False}
    assert m["contrast_crossfit_bounds_pp"][0] >= MATERIAL_GAP_PP
    assert f"minimum {MATERIAL_GAP_PP:.0f}" in v["verdict"]


def test_a_near_flat_model_at_high_accuracy_has_no_material_effect():
    """W8/S4 4 KV at 99.9%: thousands of prompts reject flatness for a 1-2 pp dip, which does not matter."""
    acc = np.full(24, 0.995)
    acc[np.arange(24) % 8 == 3] = 0.975
    m, v = verdict(acc, n_clusters=600, seed=3)
    assert m["flatness_p"] < 0.05  # the dip is real ...
    assert not v["phase_sensitive"] and v["verdict"].startswith("a small phase effect, not material")
    assert v["verdict_parts"]["phase_dependent"] and not v["verdict_parts"]["material"]


def test_a_flat_model_is_not_phase_sensitive():
    m, v = verdict(np.full(24, 0.6), seed=5)
    assert not v["phase_sensitive"] and not v["verdict"].startswith("phase sensitive")


def test_compressed_condition_verdicts():
    """A compressed cache of a capable model: a collapse at most phases is the finding; below the gate at every
    phase it is 'retrieval destroyed'; an immaterial or absent effect is never 'phase sensitive'."""
    collapsed = phase_curve(8, fail=(1, 2, 3, 4, 5, 6, 7), fail_acc=0.01, ok_acc=0.6)  # mean ~8%: below the gate
    m = summarize(shifted_records(collapsed, 60, 0), stride=8, n_boot=200, n_perm=200)
    assert not task_verdict(m, CHANCE, IN_CONTEXT)["can_do_task"]
    v = compressed_verdict(m, CHANCE, IN_CONTEXT)
    assert v["phase_sensitive"] and v["verdict"].startswith("phase sensitive: period 8")
    dead = summarize(shifted_records(np.full(24, 0.02), 60, 1), stride=8, n_boot=200, n_perm=200)
    assert compressed_verdict(dead, CHANCE, IN_CONTEXT)["verdict"].startswith("retrieval destroyed")
    flat = summarize(shifted_records(np.full(24, 0.7), 60, 2), stride=8, n_boot=200, n_perm=200)
    assert not compressed_verdict(flat, CHANCE, IN_CONTEXT)["phase_sensitive"]


def test_one_good_phase_in_a_run_too_small_to_bound_it_is_not_destroyed_retrieval():
    """A compressed condition that keeps one phase of 8 (mean near chance) in a run of 3 clusters: its curve is phase
    dependent, so 'retrieval destroyed at every phase' would be false; too few clusters to bound the contrast, the
    verdict is an effect not shown material and says the run is too small."""
    one = phase_curve(8, fail=(0, 1, 2, 3, 4, 6, 7), fail_acc=0.0, ok_acc=1.0)
    m = summarize(shifted_records(one, 3, 3), stride=8, n_boot=200, n_perm=200)
    v = compressed_verdict(m, CHANCE, 0.1)  # mean 12.5% below the gate (2 x 10%), as SmolLM2's select:3 at 8/phase
    assert v["verdict_parts"]["phase_dependent"] and not v["verdict_parts"]["can_do_task"]
    assert v["verdict"].startswith("a phase effect, not shown material") and "too small" in v["verdict"], v["verdict"]


def test_every_part_is_pinned_at_its_boundary():
    assert judged()["phase_sensitive"] and judged()["verdict"].startswith("phase sensitive: period 8")
    # 1. the capability gate: the mean's lower bound strictly above CHANCE_FACTOR (2.0) x the in-context chance
    gate = 2.0 * IN_CONTEXT
    assert CHANCE_FACTOR == 2.0
    assert judged(mean_ci=[gate + 1e-4, 0.55])["can_do_task"]
    assert not judged(mean_ci=[gate, 0.55])["can_do_task"]
    # 2. flatness rejected strictly below alpha = 0.05
    assert FLATNESS_ALPHA == 0.05
    assert judged(flatness_p=0.0499)["phase_sensitive"]
    v = judged(flatness_p=0.05)
    assert not v["phase_sensitive"] and v["verdict"].startswith("no phase effect detected")
    # 3. material: the dip's lower bound at least 10 pp, and the gap strictly above the null's 95th percentile
    assert MATERIAL_GAP_PP == 10.0
    v = judged(contrast_crossfit_bounds_pp=[9.99, 30.0])
    assert not v["phase_sensitive"] and v["verdict"].startswith("a phase effect, not shown material")
    assert judged(max_gap_pp=8.01)["phase_sensitive"]
    assert not judged(max_gap_pp=8.0)["phase_sensitive"]
    # "small" only when the gap's upper bound is below the minimum
    assert judged(contrast_crossfit_bounds_pp=[2.0, 9.0], gap_ci_pp=[3.0, 9.99])["verdict"].startswith("a small phase")
    assert judged(contrast_crossfit_bounds_pp=[2.0, 9.0], gap_ci_pp=[3.0, 10.0])["verdict"].startswith(
        "a phase effect, not shown material (it may be as large as 10 pp)")


def test_the_selection_free_phase_contrast_is_the_only_source_of_the_material_bound():
    """No other interval can make an effect material: not the basic bootstrap (selection-biased), not the
    best-minus-worst cross-fit, and nothing when the dip could not be bounded (too few clusters)."""
    others = {"gap_ci_basic_pp": [20.0, 40.0], "gap_crossfit_ci_pp": [20.0, 40.0], "gap_ci_pp": [20.0, 40.0]}
    assert not judged(**others, contrast_crossfit_bounds_pp=[9.0, 30.0])["phase_sensitive"]
    v = judged(**others, contrast_crossfit_bounds_pp=None, contrast_crossfit_se_pp=None, contrast_crossfit_pp=None)
    assert not v["phase_sensitive"] and "could not bound the phase contrast" in v["verdict"]
    assert v["minimum_detectable_gap_pp"] is None


def test_the_period_is_the_best_divisor_above_one():
    assert verdict_period({"period_scores": {"1": 0.0, "2": 9.0, "4": 3.0, "8": 3.0}}) == 4  # ties: the smaller
    assert verdict_period({"period_scores": {"1": 0.0, "2": 9.0, "4": 3.0, "8": 2.9}}) == 8
    assert verdict_period({"period_scores": {"1": 0.0}}) == 1
    # BIC prefers "flat" (d = 1) for this curve, but the permutation test rejected flatness: the period is 4
    assert judged(period_scores={"1": 0.0, "2": 9.0, "4": 3.0, "8": 5.0})["verdict"].startswith(
        "phase sensitive: period 4")


def test_the_minimum_detectable_gap_is_printed_with_every_absence():
    # the bootstrap's own distance from the estimate to its 5% bound (20 - 2), then z_0.80 sd for the power
    mde = MATERIAL_GAP_PP + (20.0 - 2.0) + 0.8416212 * 4.0
    assert DETECTION_POWER == 0.80
    assert minimum_detectable_gap({**NULL, "contrast_crossfit_bounds_pp": [2.0, 30.0]}) == pytest.approx(mde, abs=1e-5)
    for changes in ({"flatness_p": 0.5}, {"contrast_crossfit_bounds_pp": [2.0, 9.0], "gap_ci_pp": [3.0, 9.0]},
                    {"contrast_crossfit_bounds_pp": [2.0, 19.0]}):
        changes = {"contrast_crossfit_bounds_pp": [2.0, 30.0], **changes}
        v = judged(**changes)
        assert not v["phase_sensitive"] and f"finds 80% of the time: {mde:.0f} pp" in v["verdict"]
        assert v["minimum_detectable_gap_pp"] == pytest.approx(mde, abs=1e-5)


# ------------------------------------------------------------- periods, small runs, layout trends, Holm (issue 50)

def test_the_period_divides_the_stride_and_s_is_kept_unless_a_divisor_fits():
    from phasekv.evaluate.verdict import PERIOD_ALPHA, verdict_period

    base = {"stride": 8, "period_scores": {"1": 9.0, "2": 9.0, "4": 9.0, "8": 3.0, "24": 0.0}}
    assert PERIOD_ALPHA == 0.01
    assert verdict_period({**base, "period_nested_p": {"2": 0.001, "4": 0.0099}}) == 8  # both folds rejected
    assert verdict_period({**base, "period_nested_p": {"2": 0.001, "4": 0.01}}) == 4  # mod 4 fits: p >= 1%
    assert verdict_period({**base, "period_nested_p": {"2": 0.001, "4": 0.03}}) == 4  # rejected at 5%, not at 1%
    assert verdict_period({**base, "period_nested_p": {"2": 0.2, "4": 0.3}}) == 2  # the smallest that fits
    assert verdict_period({**base, "period_nested_p": {"2": 0.0099, "4": 0.00999}}) == 8
    assert verdict_period(base) == 8  # without nested tests: BIC over the divisors of S only, never 24


def test_a_residue_pattern_that_does_not_fold_onto_the_phases_is_a_layout_trend():
    v = judged(residue_modulus=24, phase_flatness_p=0.2)
    assert not v["phase_sensitive"] and v["verdict"].startswith("no phase effect detected")
    assert "a layout or length trend over the shifts, not a phase" in v["verdict"]
    assert v["verdict_parts"]["layout_trend"]
    assert judged(residue_modulus=24, phase_flatness_p=0.049)["phase_sensitive"]


def test_too_few_clusters_say_the_run_is_too_small_instead_of_bounds():
    from phasekv.evaluate.sizing import detectable_gap_pp
    from phasekv.evaluate.verdict import MIN_CLUSTERS

    assert MIN_CLUSTERS == 8
    v = judged(n_clusters=7, n_prompts=64, contrast_crossfit_bounds_pp=[30.0, 30.0], contrast_crossfit_se_pp=0.0)
    assert not v["phase_sensitive"] and v["minimum_detectable_gap_pp"] is None and "bounds [-]" in v["verdict"]
    assert f"this run is too small: 8 prompts per phase in 7 clusters detect about {detectable_gap_pp(8):.0f} pp" in (
        v["verdict"])
    assert judged(n_clusters=8)["phase_sensitive"]


def test_holm_adjusts_an_audits_flatness_p_values():
    from phasekv.evaluate.verdict import holm_adjusted, holm_line

    # sorted 0.01, 0.03, 0.04 times 3, 2, 1 = 0.03, 0.06, 0.04 -> monotone 0.03, 0.06, 0.06
    assert holm_adjusted([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm_adjusted([0.5, 0.9]) == pytest.approx([1.0, 1.0])
    line = holm_line({"none/prefix": 0.01, "kv/prefix": 0.04, "kv/query": 0.03, "skipped": None})
    assert line == ("family-wise (Holm) over 3 flatness tests: 1 reject at 5%, smallest adjusted p = 0.03 "
                    "(none/prefix)")
    assert holm_line({}) == "family-wise (Holm): no flatness tests"


def test_the_detectable_gap_helper_and_its_inverse():
    from phasekv.evaluate.sizing import detectable_gap_pp, prompts_per_phase_for

    assert detectable_gap_pp(192) < detectable_gap_pp(64) < detectable_gap_pp(8)
    for target in (15.0, 25.0, 40.0):
        n = prompts_per_phase_for(target)
        assert detectable_gap_pp(n) <= target < detectable_gap_pp(n - 1)
    assert prompts_per_phase_for(25.0, multiple=32) % 32 == 0
    for bad in (10.0, 5, "20"):
        with pytest.raises(ValueError, match="target_mde_pp"):
            prompts_per_phase_for(bad)
    with pytest.raises(ValueError, match="prompts_per_phase"):
        detectable_gap_pp(0)


def test_the_detectable_gap_allows_for_the_skew_an_effect_gives_the_bootstrap():
    from phasekv.evaluate.sizing import BOUND_SD

    assert BOUND_SD == 2.1
    # a flat run's bootstrap: the bound only 1 sd below the estimate; the gap still allows 2.1 sd of skew
    got = minimum_detectable_gap({**NULL, "contrast_crossfit_pp": 4.0, "contrast_crossfit_bounds_pp": [0.0, 9.0]})
    assert got == pytest.approx(MATERIAL_GAP_PP + 2.1 * 4.0 + 0.8416212 * 4.0, abs=1e-5)
