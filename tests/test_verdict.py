"""The verdict of `metrics.task_verdict`: every rule has a case where it must say no.

Three parts: can the model do the task (against the in-context chance), is accuracy phase-dependent (flatness),
is the effect material (gap lower bound >= MATERIAL_GAP_PP and above the null's 95th percentile); "phase
sensitive" needs all three and a period > 1."""

import numpy as np
import pytest

from phasekv.data.protocols import build_eval_set
from phasekv.data.vocab import Vocabulary
from phasekv.evaluate.metrics import CHANCE_FACTOR, MATERIAL_GAP_PP, summarize, task_verdict
from phasekv.report.audit import compressed_verdict
from tests.test_metrics import phase_curve, shifted_records

CHANCE, IN_CONTEXT = 1 / 64, 0.04


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
    base = {"flatness_p": 0.5, "detected_period": 1, "max_gap_pp": 2.0, "null_gap_p95_pp": 5.0,
            "gap_crossfit_ci_pp": [-1.0, 3.0]}
    assert not task_verdict({**base, **below}, CHANCE, IN_CONTEXT)["can_do_task"]
    assert task_verdict({**base, **above}, CHANCE, IN_CONTEXT)["can_do_task"]
    assert task_verdict({**base, **above}, CHANCE, IN_CONTEXT)["verdict"].startswith("no phase effect detected")


def test_a_strong_periodic_curve_is_phase_sensitive_with_its_period():
    m, v = verdict(phase_curve(8, fail=(7,), fail_acc=0.05, ok_acc=0.9))
    assert v["phase_sensitive"] and v["verdict"].startswith("phase sensitive: period 8")
    assert v["verdict_parts"] == {"can_do_task": True, "phase_dependent": True, "material": True, "period": 8}
    assert f"minimum {MATERIAL_GAP_PP:.0f}" in v["verdict"]


def test_a_near_flat_model_at_high_accuracy_has_no_material_effect():
    """W8/S4 4 KV at 99.9%: thousands of prompts reject flatness for a 1-2 pp dip, which does not matter."""
    acc = np.full(24, 0.995)
    acc[np.arange(24) % 8 == 3] = 0.975
    m, v = verdict(acc, n_clusters=600, seed=3)
    assert m["flatness_p"] < 0.05  # the dip is real ...
    assert not v["phase_sensitive"] and v["verdict"].startswith("a small phase effect, not material")
    assert v["verdict_parts"]["phase_dependent"] and not v["verdict_parts"]["material"]


def test_a_gap_interval_reaching_below_the_minimum_is_not_material():
    base = {"mean_accuracy": 0.5, "mean_ci": [0.45, 0.55], "flatness_p": 0.001, "detected_period": 8,
            "max_gap_pp": 25.0, "null_gap_p95_pp": 8.0}
    spans = task_verdict({**base, "gap_crossfit_ci_pp": [6.0, 30.0]}, CHANCE, IN_CONTEXT)
    clear = task_verdict({**base, "gap_crossfit_ci_pp": [12.0, 30.0]}, CHANCE, IN_CONTEXT)
    assert not spans["phase_sensitive"] and spans["verdict"].startswith("a small phase effect")
    assert clear["phase_sensitive"]
    # the gap must also beat the noise's 95th percentile
    noisy = task_verdict({**base, "gap_crossfit_ci_pp": [12.0, 30.0], "null_gap_p95_pp": 26.0}, CHANCE, IN_CONTEXT)
    assert not noisy["phase_sensitive"]
    # the basic bootstrap interval decides when the cross-fit one is missing (too few clusters)
    basic = task_verdict({**base, "gap_crossfit_ci_pp": None, "gap_ci_basic_pp": [4.0, 30.0]}, CHANCE, IN_CONTEXT)
    assert not basic["phase_sensitive"]


def test_period_one_is_never_phase_sensitive():
    m = {"mean_accuracy": 0.5, "mean_ci": [0.45, 0.55], "flatness_p": 0.001, "detected_period": 1,
         "max_gap_pp": 40.0, "null_gap_p95_pp": 8.0, "gap_crossfit_ci_pp": [20.0, 40.0]}
    v = task_verdict(m, CHANCE, IN_CONTEXT)
    assert not v["phase_sensitive"] and "without a period" in v["verdict"] and "period 1" not in v["verdict"][:20]


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
