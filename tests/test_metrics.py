"""Statistics of the phase-sensitivity evaluation on oracles with known answers."""

import json

import numpy as np
import pytest
from scipy.stats import chi2_contingency, norm

from phasekv.evaluate.metrics import detect_period, summarize, wilson_interval

R = 24
Z = norm.ppf(0.975)


def shifted_records(residue_acc, n_clusters, seed, cluster_sd=0.0):
    """Prefix-padding-like oracle: every cluster is shown at R consecutive shifts (one per residue).

    residue_acc: accuracy per residue (length R).  cluster_sd: sd of a per-cluster logit offset,
    i.e. how much easier some logical examples are than others at every shift.
    """
    rng = np.random.default_rng(seed)
    base = rng.integers(300, 400, size=n_clusters)
    position = (base[:, None] + np.arange(R)).ravel()  # (C * R,)
    logit = np.log(residue_acc / (1 - residue_acc))[position % R]
    logit += np.repeat(rng.normal(0.0, cluster_sd, n_clusters), R)
    correct = rng.random(len(position)) < 1 / (1 + np.exp(-logit))
    return {"cluster": np.repeat(np.arange(n_clusters), R), "target_position": position, "correct": correct}


def phase_curve(period, fail=(), fail_acc=0.05, ok_acc=0.95):
    """Residue accuracies that fail at the given phases mod `period` and are high elsewhere."""
    return np.where(np.isin(np.arange(R) % period, fail), fail_acc, ok_acc)


def test_wilson_known_values():
    # Newcombe (1998), Stat. Med. 17:857, Table II, method 3 (score interval without correction)
    for k, n, lo, hi in [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611),
                         (1, 29, 0.0061, 0.1718)]:
        assert wilson_interval(k, n) == pytest.approx((lo, hi), abs=5e-5)
    n = np.full(11, 10)
    low, high = wilson_interval(np.arange(11), n)
    assert low[0] == 0.0 and high[-1] == 1.0
    assert high[0] == pytest.approx(Z**2 / (10 + Z**2)) and low[-1] == pytest.approx(10 / (10 + Z**2))
    np.testing.assert_allclose(low, 1 - high[::-1], atol=1e-12)  # symmetric in k <-> n - k
    # both bounds solve the score equation (k/n - p)^2 = z^2 p (1 - p) / n
    for bound in (low[1:-1], high[1:-1]):
        np.testing.assert_allclose((np.arange(1, 10) / 10 - bound) ** 2, Z**2 * bound * (1 - bound) / 10,
                                   atol=1e-12)
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


def test_oracle_failing_at_two_phases():
    m = summarize(shifted_records(phase_curve(8, fail=(2, 5)), n_clusters=400, seed=1), stride=8)
    phase_acc = [g["accuracy"] for g in m["per_phase"]]
    assert sorted(np.argsort(phase_acc)[:2].tolist()) == [2, 5]
    failing = [g["residue"] for g in m["per_residue"] if g["accuracy"] < 0.5]
    assert failing == [r for r in range(R) if r % 8 in (2, 5)]
    assert m["worst_phase"] in (2, 5) and m["worst_residue"] % 8 in (2, 5)
    assert m["max_gap_pp"] == pytest.approx(90, abs=6)
    assert m["phase_gap_pp"] == pytest.approx(90, abs=3)
    assert m["gap_ci_pp"][0] > 90  # the max-minus-min gap and its percentile interval are biased up
    assert m["gap_ci_basic_pp"][0] < m["gap_ci_pp"][0]
    assert m["gap_crossfit_pp"] == pytest.approx(90, abs=2)
    assert m["gap_crossfit_ci_pp"][0] <= 90 <= m["gap_crossfit_ci_pp"][1]
    assert m["mean_accuracy"] == pytest.approx(0.725, abs=0.01)
    assert m["mean_ci"][0] <= 0.725 <= m["mean_ci"][1]
    assert m["detected_period"] == 8
    assert m["flatness_p"] < 0.001
    assert all(g["n"] == 400 for g in m["per_residue"]) and m["n_prompts"] == 400 * R


def test_phase_blind_oracle_is_flat():
    flat = np.full(R, 0.6)
    runs = [summarize(shifted_records(flat, 150, seed, cluster_sd=1.5), stride=8, n_boot=400, n_perm=400,
                      seed=seed) for seed in range(10)]
    assert sum(m["flatness_p"] > 0.05 for m in runs) >= 9
    assert sum(m["max_gap_pp"] <= m["null_gap_p95_pp"] for m in runs) >= 9
    assert sum(m["detected_period"] == 1 for m in runs) >= 9
    assert sum(m["gap_crossfit_ci_pp"][0] <= 0 <= m["gap_crossfit_ci_pp"][1] for m in runs) >= 9
    # noise alone: a gap no larger than a few binomial standard errors of one group
    assert all(m["max_gap_pp"] < 100 * 5 * np.sqrt(0.25 / 150) for m in runs)


@pytest.mark.parametrize("period, fail", [(4, (3,)), (6, (1, 5)), (8, (7,)), (8, (2, 5)), (12, (11, 4))])
def test_detect_period_on_synthetic_curves(period, fail):
    curve = phase_curve(period, fail=fail, fail_acc=0.35, ok_acc=0.75)
    curve[1::period] = 0.55  # a second, milder dip: the curve is not just one failing phase
    for seed in range(5):
        rng = np.random.default_rng(seed)
        n = rng.integers(100, 301, size=R)
        found, scores = detect_period(rng.binomial(n, curve), n)
        assert found == period, (seed, scores)
        assert scores[period] == 0.0 and all(scores[d] > 0 for d in scores if d != period)


def test_one_failing_phase_of_stride_8_is_period_8_not_24():
    rng = np.random.default_rng(0)
    n = np.full(R, 200)
    found, scores = detect_period(rng.binomial(n, phase_curve(8, fail=(7,))), n)
    assert found == 8 and scores[24] > 50 and scores[4] > 50


def test_detect_period_flat_noise_gives_1():
    found = []
    for seed in range(10):
        rng = np.random.default_rng(seed)
        n = rng.integers(100, 301, size=R)
        found.append(detect_period(rng.binomial(n, 0.6), n)[0])
    assert found.count(1) >= 9


def test_flatness_permutation_matches_chi_square_for_independent_prompts():
    rng = np.random.default_rng(3)
    position = rng.integers(0, 10_000, size=4000)
    correct = rng.random(4000) < 0.4 + 0.04 * (position % 8 == 3)
    m = summarize({"cluster": np.arange(4000), "target_position": position, "correct": correct}, stride=8)
    table = np.stack([np.bincount(position % R, weights=correct, minlength=R),
                      np.bincount(position % R, weights=~correct, minlength=R)])
    assert m["flatness_p"] == pytest.approx(chi2_contingency(table)[1], abs=0.03)


def test_flatness_accounts_for_clusters():
    """Clusters whose prompts share one residue: the plain chi-square test is fooled, the permutation is not."""
    naive_rejects, perm_rejects = 0, 0
    for seed in range(5):
        rng = np.random.default_rng(seed)
        cluster = np.repeat(np.arange(240), 20)  # 240 clusters of 20 prompts, 10 clusters per residue
        position = np.repeat(rng.permutation(np.arange(1000, 1240)), 20)
        correct = rng.random(len(cluster)) < np.repeat(rng.uniform(0.1, 0.9, 240), 20)
        m = summarize({"cluster": cluster, "target_position": position, "correct": correct}, stride=8,
                      n_boot=200, n_perm=500)
        table = np.stack([np.bincount(position % R, weights=correct), np.bincount(position % R, weights=~correct)])
        naive_rejects += chi2_contingency(table)[1] < 0.05
        perm_rejects += m["flatness_p"] < 0.05
    assert naive_rejects == 5 and perm_rejects <= 1


def test_cluster_bootstrap_width():
    """Independent prompts: the binomial width; correlated clusters: wider, as it must be."""
    widths = {}
    for sd in (0.0, 2.0):
        m = summarize(shifted_records(np.full(R, 0.5), 100, seed=4, cluster_sd=sd), stride=8)
        widths[sd] = m["mean_ci"][1] - m["mean_ci"][0]
    assert widths[0.0] == pytest.approx(2 * Z * np.sqrt(0.25 / (100 * R)), rel=0.15)
    assert widths[2.0] > 2 * widths[0.0]


def test_json_is_deterministic_and_plain():
    records = shifted_records(phase_curve(6, fail=(5,)), 60, seed=2)
    as_list = [{"cluster": int(c), "target_position": int(t), "correct": bool(k)}
               for c, t, k in zip(*(records[f] for f in ("cluster", "target_position", "correct")))]
    a = json.dumps(summarize(records, stride=6, seed=7), sort_keys=True)
    assert a == json.dumps(summarize(as_list, stride=6, seed=7), sort_keys=True)
    assert a != json.dumps(summarize(records, stride=6, seed=8), sort_keys=True)
    m = json.loads(a)
    assert m["detected_period"] == 6 and m["stride"] == 6 and len(m["per_phase"]) == 6


def test_position_matching():
    base = np.array([96, 120, 144])
    position = (base[:, None] + np.arange(R)).ravel()  # residue r holds 96 + r, 120 + r, 144 + r
    records = {"cluster": np.repeat(np.arange(3), R), "target_position": position,
               "correct": np.arange(len(position)) % 3 == 0}
    pm = summarize(records, stride=4, n_boot=10, n_perm=10)["position_matching"]
    assert [g["mean"] for g in pm["per_residue"]] == [120.0 + r for r in range(R)]
    assert all(g["variance"] == pytest.approx(384.0) for g in pm["per_residue"])
    assert pm["max_abs_mean_diff"] == 23.0 and pm["max_rel_var_diff"] == pytest.approx(0.0)


def test_input_errors():
    records = shifted_records(np.full(R, 0.5), 5, seed=0)
    with pytest.raises(ValueError, match="residue_modulus"):
        summarize(records, stride=5)
    gappy = {k: v[records["target_position"] % R != 7] for k, v in records.items()}
    gappy = {k: v[gappy["target_position"] % R != 19] for k, v in gappy.items()}
    with pytest.raises(ValueError, match=r"no prompts: \[7, 19\]"):
        summarize(gappy, stride=8)
    with pytest.raises(ValueError, match="cluster"):
        summarize([{"target_position": 3, "correct": True}], stride=8)


def test_within_example_tests_size_and_power():
    """Flat nulls with strong example effects: the within-example permutation test and Cochran's Q reject
    about 5% (size); two phases of 8 at 10% instead of 50% over 16 examples are found almost always (power; measured
    with 40 simulations: 8 examples with two phases at 10% -> 75-78%, one phase at 20% -> 15-18%, the same
    as the cluster test)."""
    sims, rejects = 120, {"within": 0, "cochran": 0}
    for seed in range(sims):
        m = summarize(shifted_records(np.full(R, 0.5), 8, seed=100 + seed, cluster_sd=1.5), stride=8,
                      n_boot=1, n_perm=200)
        rejects["within"] += m["within_flatness_p"] < 0.05
        rejects["cochran"] += m["cochran_p"] < 0.05
    # binomial(120, 0.05): mean 6, P(X > 14) < 0.5%
    assert rejects["within"] <= 14 and rejects["cochran"] <= 14, rejects
    power = {"within": 0, "cochran": 0}
    for seed in range(30):
        curve = np.where(np.isin(np.arange(R) % 8, (5, 6)), 0.1, 0.5)
        m = summarize(shifted_records(curve, 16, seed=500 + seed, cluster_sd=1.5), stride=8, n_boot=1, n_perm=200)
        power["within"] += m["within_flatness_p"] < 0.05
        power["cochran"] += m["cochran_p"] < 0.05
    assert power["within"] >= 26 and power["cochran"] >= 26, power


def test_cochran_q_matches_the_textbook_formula_and_needs_a_complete_design():
    records = shifted_records(phase_curve(8, fail=(7,), fail_acc=0.3, ok_acc=0.7), 6, seed=9)
    m = summarize(records, stride=8, n_boot=10, n_perm=50)
    x = np.zeros((6, R))  # cluster x residue
    x[records["cluster"], np.asarray(records["target_position"]) % R] = records["correct"]
    col, row, n = x.sum(0), x.sum(1), x.sum()
    q = (R - 1) * (R * (col ** 2).sum() - n ** 2) / (R * n - (row ** 2).sum())
    assert m["cochran_q"] == pytest.approx(q)
    incomplete = {k: np.asarray(v)[:-1] for k, v in records.items()}  # one cluster misses a residue
    assert summarize(incomplete, stride=8, n_boot=10, n_perm=50)["cochran_p"] is None


def test_the_permutation_p_value_counts_the_observed_table():
    """p = (1 + #{X2_perm >= X2_obs}) / (1 + n_perm): a curve no relabelling reaches gets 1 / (1 + n_perm), not 0."""
    records = {"cluster": np.arange(400), "target_position": np.arange(400) % 2,
               "correct": np.arange(400) % 2 == 0}  # right at every even position, wrong at every odd one
    m = summarize(records, stride=2, residue_modulus=2, n_boot=50, n_perm=99)
    assert m["flatness_p"] == pytest.approx(1 / 100, abs=1e-12)


def test_the_null_gap_is_the_95th_percentile_of_the_relabelled_gaps():
    """Singleton clusters, two groups of 200 and K correct: the relabelled gap |k1 - (K - k1)| / 200 is
    hypergeometric, so its exact 95th percentile is known (the 90th lies ~1.6 pp lower)."""
    from scipy.stats import hypergeom

    rng = np.random.default_rng(3)
    correct = rng.random(400) < 0.5
    K = int(correct.sum())
    records = {"cluster": np.arange(400), "target_position": np.arange(400) % 2, "correct": correct}
    m = summarize(records, stride=2, residue_modulus=2, n_boot=50, n_perm=8000)
    k1 = np.arange(0, 201)
    gaps = 100 * np.abs(2 * k1 - K) / 200
    pmf = hypergeom(400, K, 200).pmf(k1)
    order = np.argsort(gaps)
    cdf = np.cumsum(pmf[order])
    q95, q90 = (gaps[order][np.searchsorted(cdf, q)] for q in (0.95, 0.90))
    assert q95 - q90 >= 1.0
    assert abs(m["null_gap_p95_pp"] - q95) <= 0.6


def test_the_phase_contrast_bounds_are_one_sided_95_percent():
    """bounds = 5th and 95th bootstrap percentiles: (upper - lower) / (2 sd) is z_0.95 = 1.64 (z_0.975 = 1.96 would
    be the two-sided interval's); the contrast is the dip for a weak phase and the peak for a lone strong one."""
    weak = summarize(shifted_records(phase_curve(8, fail=(7,), fail_acc=0.3, ok_acc=0.6), 300, 1), stride=8,
                     n_boot=4000, n_perm=50)
    low, high = weak["contrast_crossfit_bounds_pp"]
    assert 1.5 < (high - low) / (2 * weak["contrast_crossfit_se_pp"]) < 1.8
    assert weak["contrast_crossfit_pp"] == pytest.approx(30, abs=4)  # upper half (60%) minus the weak phase (30%)
    lone = summarize(shifted_records(phase_curve(8, fail=(1, 2, 3, 4, 5, 6, 7), fail_acc=0.02, ok_acc=0.6), 48, 2),
                     stride=8, n_boot=400, n_perm=50)
    assert lone["contrast_crossfit_pp"] == pytest.approx(58, abs=8)  # the peak: 60% minus the lower half (2%)
    flat = summarize(shifted_records(np.full(R, 0.6), 48, 3), stride=8, n_boot=400, n_perm=50)
    assert flat["contrast_crossfit_bounds_pp"][0] < 0 < flat["contrast_crossfit_bounds_pp"][1]


# --------------------------------------------------- pinned by hand: the contrast, the percentiles, the cross-fit

def test_the_phase_contrast_on_a_fixed_8_group_table_by_hand():
    from phasekv.evaluate.resampling import _crossfit_gaps

    n = np.full(8, 20.0)
    acc_a = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.1])
    acc_b = np.array([0.85, 0.8, 0.65, 0.6, 0.5, 0.45, 0.4, 0.2])
    # chosen on a (median 0.55: best 0.35 above, worst 0.45 below -> a dip): upper half = groups 0-3, worst = 7,
    # measured on b: (0.85 + 0.8 + 0.65 + 0.6) / 4 - 0.2 = 0.525; chosen on b (a dip as well), measured on a:
    # (0.9 + 0.8 + 0.7 + 0.6) / 4 - 0.1 = 0.65.  Average x 100: 58.75.  Best minus worst: (0.65 + 0.8) / 2 = 72.5.
    gaps = _crossfit_gaps(acc_a * n, n, acc_b * n, n)
    assert gaps.tolist() == pytest.approx([72.5, 58.75])
    # a lone strong group (best 0.5 above the median, worst 0.1 below it) is a peak: best minus the lower half
    peak = np.array([0.9, 0.45, 0.42, 0.41, 0.39, 0.38, 0.35, 0.3])
    assert _crossfit_gaps(peak * n, n, peak * n, n)[1] == pytest.approx(100 * (0.9 - (0.39 + 0.38 + 0.35 + 0.3) / 4))


def test_the_interval_percentiles_and_the_cross_fit_are_pinned():
    from phasekv.evaluate.resampling import (
        CI_PERCENTILES,
        CROSSFIT_SPLITS,
        _crossfit_gaps,
        crossfit_estimate,
        percentile_ci,
    )

    assert CI_PERCENTILES == (2.5, 97.5) and percentile_ci(np.arange(1001.0)) == [25.0, 975.0]
    assert CROSSFIT_SPLITS == 20

    class Identity:  # a generator whose splits are the clusters in order, counting the splits
        calls = 0

        def permutation(self, c):
            Identity.calls += 1
            return np.arange(c)

    kc = np.array([[1.0, 2.0], [2.0, 0.0], [0.0, 1.0], [2.0, 2.0], [1.0, 1.0]])
    nc = np.full(kc.shape, 2.0)
    got = crossfit_estimate(kc, nc, Identity())
    assert Identity.calls == 20  # the point estimate averages 20 splits
    halves = _crossfit_gaps(kc[:2].sum(0), nc[:2].sum(0), kc[2:].sum(0), nc[2:].sum(0))  # C // 2 and the rest
    assert got == pytest.approx(halves.tolist())
    m = summarize(shifted_records(np.full(R, 0.7), 30, 0), stride=8, n_boot=400, n_perm=50)
    assert m["mean_ci"][0] < m["mean_accuracy"] < m["mean_ci"][1]


def test_nested_period_tests_tell_period_4_from_one_phase_of_8():
    period4 = summarize(shifted_records(phase_curve(4, fail=(3,), fail_acc=0.3, ok_acc=0.8), 60, 0), stride=8,
                        n_boot=50, n_perm=300)
    single = summarize(shifted_records(phase_curve(8, fail=(7,), fail_acc=0.3, ok_acc=0.8), 60, 0), stride=8,
                       n_boot=50, n_perm=300)
    assert period4["period_nested_p"]["4"] > 0.05 and period4["period_nested_p"]["2"] < 0.01
    assert single["period_nested_p"]["4"] < 0.01 and single["period_nested_p"]["2"] < 0.01
    flat = summarize(shifted_records(np.full(R, 0.7), 60, 0), stride=8, n_boot=50, n_perm=300)
    assert flat["flatness_p"] > 0.05 and flat["period_nested_p"] is None


def test_the_phase_flatness_test_ignores_a_pattern_of_period_r():
    # residues 0-7 low, 8-23 high: every phase holds one low residue of three, so the phases are flat
    layout = np.where(np.arange(R) < 8, 0.4, 0.9)
    m = summarize(shifted_records(layout, 60, 0), stride=8, n_boot=50, n_perm=300)
    assert m["flatness_p"] < 0.01 and m["phase_flatness_p"] > 0.05


def test_unit_permutation_needs_one_label_per_unit():
    recs = shifted_records(np.full(R, 0.7), 4, 0)
    with pytest.raises(ValueError, match="units"):
        summarize(recs, stride=8, n_boot=10, n_perm=10, units=np.zeros(len(recs["cluster"]), dtype=int))
