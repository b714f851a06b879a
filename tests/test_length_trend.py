"""Engine bugs keyed to the prompt length, through the query phase's statistics and verdict on the real query
layout (phasekv.evaluate.query_stats, phasekv.evaluate.verdict.query_phase_statistics): a length-mod-4 bug is a
phase of period 4; a linear length trend and a length threshold are length effects, never a phase."""

import numpy as np
import pytest

from phasekv.evaluate.power import DESIGNS, layout
from phasekv.evaluate.query_stats import length_step, length_trend
from phasekv.evaluate.verdict import query_phase_statistics

LAY = layout(DESIGNS["query24"])
Q = LAY["query_position"]
LOW, HIGH = int(Q.min()), int(Q.max())


def judged(p_correct, seed=0):
    rng = np.random.default_rng(seed)
    correct = rng.random(len(Q)) < p_correct
    records = [{"cluster": int(c), "record": int(r), "target_position": int(t), "query_position": int(q),
                "correct": bool(k)} for c, r, t, q, k in zip(LAY["cluster"], LAY["record"], LAY["target_position"], Q,
                                                             correct)]
    return query_phase_statistics(records, 8, 24, LAY["chance"], LAY["in_context_chance"], n_boot=300,
                                  n_perm=300)["query_phase"]


def no_phase(query):
    return not query["verdict"].startswith(("phase sensitive", "a phase effect", "a small phase effect"))


@pytest.mark.parametrize("seed", [0, 1])
def test_a_length_mod_4_bug_is_phase_sensitive_with_period_4(seed):
    query = judged(np.where(Q % 4 == 1, 0.1, 0.9), seed)
    assert query["verdict"].startswith("phase sensitive: period 4"), query["verdict"]
    assert abs(query["length_trend"]["pp_per_stride"]) < 3 and "length: accuracy changes by" in query["verdict"]


@pytest.mark.parametrize("seed", [0, 1])
def test_errors_growing_linearly_with_the_length_are_a_trend_not_a_phase(seed):
    query = judged(0.95 - 0.6 * (Q - LOW) / (HIGH - LOW), seed)
    trend = query["length_trend"]
    assert no_phase(query), query["verdict"]
    expected = -60.0 * 8 / (HIGH - LOW)  # pp per 8 tokens
    assert trend["ci_pp"][0] < expected < trend["ci_pp"][1] and trend["ci_pp"][1] < 0 and trend["p"] < 1e-6
    assert f"accuracy changes by {trend['pp_per_stride']:+.1f} pp per 8 tokens" in query["verdict"]


@pytest.mark.parametrize("threshold", [LOW + 13, LOW + 16, LOW + 21])
def test_everything_past_a_length_wrong_is_a_length_effect_not_a_phase(threshold):
    query = judged(np.where(threshold <= Q, 0.05, 0.9))
    assert no_phase(query), query["verdict"]
    if query["verdict"].startswith("a length effect"):
        assert query["length_step"]["step_at"] == threshold and not query["phase_sensitive"]
        assert query["verdict_parts"]["length_step"] and query["verdict_parts"]["period"] is not None


def test_a_flat_model_has_no_length_trend_and_no_step():
    query = judged(np.full(len(Q), 0.7))
    assert no_phase(query) and query["length_trend"]["ci_pp"][0] < 0 < query["length_trend"]["ci_pp"][1]


def test_the_trend_is_the_within_cluster_slope_and_the_step_is_found_by_hand():
    cluster = np.repeat([0, 1], 4)
    length = np.array([10, 11, 12, 13, 20, 21, 22, 23])
    correct = np.array([1, 1, 0, 0, 0, 0, 0, 0], dtype=float)  # cluster 0 falls, cluster 1 is flat at 0
    # within cluster 0: dx = -1.5..1.5, dy = .5,.5,-.5,-.5: Sxy = -2, Sxx = 5; cluster 1: Sxy = 0, Sxx = 5
    trend = length_trend(cluster, length, correct, 4, 50, np.random.default_rng(0))
    assert trend["pp_per_stride"] == pytest.approx(100 * 4 * -2 / 10)
    assert [r["query_position"] for r in trend["per_length"]] == length.tolist()
    step = length_step(np.arange(40), (np.arange(40) < 23).astype(float), 8)
    assert step["step_at"] == 23 and step["step_pp"] == pytest.approx(-100) and step["step_explains"]
    periodic = length_step(np.arange(40), (np.arange(40) % 8 != 3).astype(float), 8)
    assert not periodic["step_explains"] and periodic["rss_phase"] == pytest.approx(0, abs=1e-12)
    assert length_step(np.arange(6), np.ones(6), 8)["step_explains"] is None  # too few lengths to fit
