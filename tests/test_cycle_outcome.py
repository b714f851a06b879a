"""The three outcomes of gate cycling (`phasekv.probes.cycle_outcome`), on synthetic predictions with known curves:
each status is given where it must be and refused where it must not, and every constant is pinned at its edge."""

import numpy as np
import pytest

from phasekv.evaluate.verdict import CHANCE_FACTOR
from phasekv.probes.cycle_outcome import (
    R2_FLOOR,
    SHIFT_SET_MASS,
    best_shifts,
    judge,
    outcome,
    shift_set,
    varies,
    wrap,
)

S, ICC = 8, 0.04  # in-context chance 4%: the gate is 8%
INNER = np.arange(S - 1)  # phase 7 is the boundary
CLEAN = np.array([0.9, 0.9, 0.1, 0.9, 0.9, 0.6, 0.9, 0.05])  # a weak phase 2, a middling phase 5


def records(curve, n_clusters=60, per_phase=2, seed=0):
    """Every cluster shows `per_phase` prompts at every phase; each is right with its phase's probability."""
    rng = np.random.default_rng(seed)
    return [{"cluster": c, "phase": p, "correct": bool(rng.random() < curve[p])}
            for c in range(n_clusters) for p in range(S) for _ in range(per_phase)]


def cycled(curve, delta, **kw):
    return outcome(records(CLEAN), records(curve, seed=1, **kw), delta, stride=S, inner=INNER,
                   in_context_chance=ICC, n_boot=300)


def rolled(delta):
    """The clean curve moved by delta on the inner phases, the boundary phase kept weak."""
    curve = CLEAN[(np.arange(S) - delta) % S].copy()
    curve[7] = CLEAN[7]
    return curve


def test_a_curve_that_moves_with_the_gates_is_moved():
    row = cycled(CLEAN[(np.arange(S) - 2) % S], 2)
    assert row["status"] == "moved" and row["shift"] == 2 and row["shift_set"] == [2]
    assert row["corr_shifted"] > 0.9 and row["corr_shifted_ci"][0] > 0.5 and row["corr_unshifted"] < 0.5
    assert row["observed_varies"] and row["r2_excl_boundary"] > 0.66
    assert row["mean_after_ci"][0] > CHANCE_FACTOR * ICC


def test_a_curve_that_stays_did_not_move():
    row = cycled(CLEAN, 3)
    assert row["status"] == "did not move" and row["shift"] == 0 and row["shift_set"] == [0]
    assert row["corr_unshifted"] > 0.9 > row["corr_shifted"] and row["r2_excl_boundary"] < 0.66
    assert cycled(CLEAN, -1)["status"] == "did not move"


def test_a_curve_at_the_copiers_level_is_destroyed_and_its_r2_is_not_kept():
    row = cycled(np.full(S, 0.02), 1)
    assert row["status"] == "destroyed" and "copier" in row["why"]
    assert not row["observed_varies"] and row["r2_excl_boundary"] is None and row["r2_all"] is None
    assert row["mean_before"] > 0.6 and row["mean_after"] < 0.05
    # a flat curve well above the gate is not destroyed (and its R^2 is not kept either)
    alive = cycled(np.full(S, 0.5), 1)
    assert alive["status"] != "destroyed" and alive["r2_excl_boundary"] is None


def test_a_curve_that_changes_shape_or_is_too_noisy_is_inconclusive():
    elsewhere = cycled(rolled(3), 1)  # it moved, but by 3, not by the delta
    assert elsewhere["status"] == "inconclusive" and "changed shape" in elsewhere["why"]
    assert elsewhere["shift"] == 3
    noisy = outcome(records(CLEAN, n_clusters=2, per_phase=1), records(rolled(1), n_clusters=2, per_phase=1, seed=1),
                    1, stride=S, inner=INNER, in_context_chance=ICC, n_boot=300)
    assert noisy["status"] != "moved" or 0 not in noisy["shift_set"]  # never "moved" with 0 in the set
    unable = outcome(records(np.full(S, 0.03)), records(np.full(S, 0.03), seed=1), 1, stride=S, inner=INNER,
                     in_context_chance=ICC, n_boot=300)
    assert unable["status"] == "inconclusive" and "cannot do the task" in unable["why"]
    flat = outcome(records(np.full(S, 0.7)), records(np.full(S, 0.7), seed=1), 1, stride=S, inner=INNER,
                   in_context_chance=ICC, n_boot=300)
    assert flat["status"] == "inconclusive" and "nothing to move" in flat["why"]
    assert cycled(CLEAN, 0)["status"] is None


def test_no_r2_below_the_floor():
    """A cycled curve with a small real spread against a prediction that swings widely: R^2 far below -1, shown
    as -1 (the floor) with its interval."""
    small = np.array([0.5, 0.58, 0.5, 0.58, 0.5, 0.58, 0.5, 0.5])
    row = outcome(records(CLEAN, n_clusters=600), records(small, n_clusters=600, seed=1), 1, stride=S, inner=INNER,
                  in_context_chance=ICC, n_boot=200)
    assert row["observed_varies"] and row["r2_excl_boundary"] == R2_FLOOR == -1.0
    assert row["r2_excl_boundary_ci"][0] >= -1.0 and row["r2_all"] >= -1.0


def base_row(**changes):
    return {"delta": 1, "mean_before": 0.8, "mean_before_ci": [0.7, 0.9], "mean_after": 0.5,
            "mean_after_ci": [0.4, 0.6], "shift_set": [1], **changes}


def test_each_rule_at_its_edge():
    gate = CHANCE_FACTOR * ICC
    assert CHANCE_FACTOR == 2.0
    rule = {"stride": S, "gate": gate, "clean_varies": True}
    assert judge(base_row(), **rule)["status"] == "moved"
    # destroyed: the cycled mean's lower bound at or below the gate
    assert judge(base_row(mean_after_ci=[gate, 0.2]), **rule)["status"] == "destroyed"
    assert judge(base_row(mean_after_ci=[gate + 1e-4, 0.2]), **rule)["status"] == "moved"
    # the clean model must clear the gate itself
    assert judge(base_row(mean_before_ci=[gate, 0.9]), **rule)["status"] == "inconclusive"
    assert judge(base_row(mean_before_ci=[gate + 1e-4, 0.9]), **rule)["status"] == "moved"
    # moved / did not move / both / neither
    assert judge(base_row(shift_set=[0]), **rule)["status"] == "did not move"
    assert judge(base_row(shift_set=[0, 1]), **rule)["status"] == "inconclusive"
    assert judge(base_row(shift_set=[2]), **rule)["status"] == "inconclusive"
    assert judge(base_row(delta=-7, shift_set=[1]), **rule)["status"] == "moved"  # -7 = +1 mod 8
    assert judge(base_row(), stride=S, gate=gate, clean_varies=False)["status"] == "inconclusive"


def test_the_shift_set_holds_95_percent_of_the_replicates():
    assert SHIFT_SET_MASS == 0.95
    assert shift_set(np.array([1] * 95 + [0] * 5), S) == [1]
    assert shift_set(np.array([1] * 94 + [0] * 6), S) == [0, 1]
    assert shift_set(np.array([7] * 100), S) == [-1] and shift_set(np.array([-1, -1]), S) == []
    assert [wrap(s, 8) for s in range(8)] == [0, 1, 2, 3, 4, -3, -2, -1] and wrap(-3, 4) == 1


def test_tied_rolls_are_drawn_at_random_not_given_to_one_shift():
    """A flat cycled curve matches every roll equally well: the replicates spread over the rolls."""
    flat, curve = np.full((400, S), 0.5), np.tile(np.array([1.0, 0.0] * 4), (400, 1))
    picks = best_shifts(curve, flat, np.arange(S), np.random.default_rng(0))
    assert set(picks) == set(range(S))
    assert best_shifts(curve[:1], np.roll(curve[:1], 1, 1), np.arange(S), np.random.default_rng(0))[0] in (1, 3, 5, 7)


@pytest.mark.parametrize("delta", [-3, -1, 1, 3])
def test_moved_is_refused_when_the_gates_moved_the_curve_the_other_way(delta):
    assert cycled(rolled(-delta), delta)["status"] != "moved"


def test_the_cycled_curve_varies_when_its_chi_square_rejects_at_5_percent():
    def two_phases(k2):
        return [{"phase": p, "correct": i < k} for p, k in ((0, 50), (1, k2)) for i in range(100)]

    both = np.array([0, 1])
    flat_enough, p = varies(two_phases(63), both, 2)
    assert flat_enough is False and 0.05 < p < 0.1
    assert varies(two_phases(65), both, 2)[0] is True and varies(two_phases(50), both, 2)[0] is False
