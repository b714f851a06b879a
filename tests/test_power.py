"""Error rates and power of the default verdict, simulated on the real prompt designs (phasekv.evaluate.power)."""

import argparse

import numpy as np
import pytest
from scipy.stats import beta

from phasekv.evaluate.power import (
    AUDIT_PROMPTS_PER_PHASE,
    DESIGNS,
    SINGLE,
    Effect,
    audit_design,
    conditional_logit,
    layout,
    simulate,
    verdict_class,
    verdict_rates,
)

REPLICATES = 60  # reduced; the Monte Carlo error is taken into account by one-sided 95% Clopper-Pearson bounds


def upper_bound(k, n):
    return 1.0 if k == n else float(beta.ppf(0.95, k + 1, n - k))


def lower_bound(k, n):
    return 0.0 if k == 0 else float(beta.ppf(0.05, k, n - k + 1))


def test_the_audit_default_has_at_most_5_percent_false_positives_and_80_percent_power_at_30_pp():
    """At `phasekv audit`'s default design (prefix padding) a flat 60% model is called phase sensitive at most 5% of
    the time and a model with one phase 30 pp lower at least 80% of the time, both at 95% confidence."""
    design = DESIGNS["audit-prefix"]
    flat = verdict_rates(design, Effect(), REPLICATES, seed=1, n_boot=200, n_perm=200)
    weak = verdict_rates(design, Effect(30.0, SINGLE), REPLICATES, seed=1, n_boot=200, n_perm=200)
    assert upper_bound(flat["counts"]["sensitive"], REPLICATES) <= 0.05, flat
    assert lower_bound(weak["counts"]["sensitive"], REPLICATES) >= 0.80, weak
    # the absence verdicts printed the smallest gap they could have found, and it is below the 30 pp found here
    assert flat["median_mde_pp"] is not None and 10 < flat["median_mde_pp"] < 30


def test_the_cli_and_the_library_default_to_the_simulated_design():
    from phasekv.cli import audit as cli_audit
    from phasekv.config import AuditPlan

    assert AuditPlan().prompts_per_phase == AUDIT_PROMPTS_PER_PHASE  # run_audit's default plan
    parser = argparse.ArgumentParser()
    cli_audit.add_parser(parser.add_subparsers())
    action = next(a for a in parser._subparsers._group_actions[0].choices["audit"]._actions
                  if a.dest == "prompts_per_phase")
    assert action.default == AUDIT_PROMPTS_PER_PHASE
    lay = layout(DESIGNS["audit-prefix"])
    assert len(lay["cluster"]) == 8 * AUDIT_PROMPTS_PER_PHASE
    assert np.all(np.bincount(lay["target_position"] % 8) == AUDIT_PROMPTS_PER_PHASE)
    from phasekv.evaluate.sources import audit_clusters

    for protocol in ("prefix", "insequence", "query"):
        for per_phase in (64, AUDIT_PROMPTS_PER_PHASE):
            assert audit_design(protocol, per_phase).n_clusters == audit_clusters(per_phase, 2, protocol, 8)


def test_the_simulated_accuracies_are_the_stated_ones_averaged_over_the_random_effects():
    mu = conditional_logit(np.array([0.6, 0.3]), 1.2)
    z = np.random.default_rng(0).normal(0, 1.2, 400_000)
    np.testing.assert_allclose([np.mean(1 / (1 + np.exp(-(m + z)))) for m in mu], [0.6, 0.3], atol=3e-3)
    design = DESIGNS["audit-query"]
    correct = simulate(design, Effect(30.0, SINGLE), 200, np.random.default_rng(1))  # (replicates, prompts)
    phase = layout(design)["query_position"] % 8  # the query protocol's effect sits on the query phase
    assert correct[:, phase == 7].mean() == pytest.approx(0.3, abs=0.02)
    assert correct[:, phase != 7].mean() == pytest.approx(0.6, abs=0.02)


def test_every_verdict_opening_has_a_class():
    assert verdict_class("phase sensitive: period 8, gap ...") == "sensitive"
    assert verdict_class("a phase effect, not shown material (it may be as large as 20 pp): ...") == "unresolved"
    with pytest.raises(ValueError, match="no class"):
        verdict_class("a material phase effect without a period")


# ------------------------------------------------------------------ trends, context effects and the query phase

TREND_REPLICATES = 40
PERIOD_REPLICATES = 60


@pytest.mark.parametrize("design_name", ["query24", "audit-prefix", "audit-insequence"])
@pytest.mark.parametrize("trend", ["linear", "U", "step"])
def test_a_30_pp_trend_over_the_shifts_is_no_phase_effect(design_name, trend):
    """A trend over the shifts (for the query protocol: over the added length) with no phase effect gets neither
    "phase sensitive" nor "a phase effect" (nor "a small phase effect") in more than 5% of the runs."""
    design = DESIGNS[design_name] if design_name == "query24" else audit_design(design_name[len("audit-"):], 64)
    r = verdict_rates(design, Effect(trend=trend, trend_pp=30.0), TREND_REPLICATES, seed=2, n_boot=150, n_perm=150)
    effects = r["counts"]["sensitive"] + r["counts"]["small"] + r["counts"]["unresolved"]
    assert effects <= 0.05 * TREND_REPLICATES and r["counts"]["sensitive"] == 0, r  # the point estimate <= 5%


@pytest.mark.parametrize("trend, n", [("linear", 300), ("U", 100), ("step", 100)])
def test_at_the_audits_default_query_design_a_30_pp_trend_is_no_phase_effect(trend, n):
    """The audit's own query design (R = S = 8, the lengths over 3 S offsets, 192 prompts per phase): runs with a 30 pp
    trend over the added length say "phase sensitive" never, and "a small phase effect" or "a phase effect" not
    significantly more often than 5% (the context permutation test's own level: flat models 4.6-4.9%; 8 of 100 linear
    runs once did, re-measured 36 of 1,000, docs/power.md).  300 linear runs: a true rate of 8% fails it ~70% of the
    time."""
    r = verdict_rates(DESIGNS["audit-query"], Effect(trend=trend, trend_pp=30.0), n, seed=6, n_boot=100, n_perm=200)
    effects = r["counts"]["sensitive"] + r["counts"]["small"] + r["counts"]["unresolved"]
    assert lower_bound(effects, n) <= 0.05 and r["counts"]["sensitive"] == 0, r


def test_context_random_effects_do_not_make_a_query_phase_effect():
    """Flat models whose contexts differ (sd 0.5 logit, shared by a context's T answers): the context permutation
    test holds its level (not significantly above 5%); the earlier pair-level test rejected in ~43% of such runs."""
    n = 100
    r = verdict_rates(DESIGNS["query24"], Effect(), n, seed=3, n_boot=100, n_perm=150, context_sd=0.5)
    effects = r["counts"]["sensitive"] + r["counts"]["small"] + r["counts"]["unresolved"]
    assert lower_bound(effects, n) <= 0.05 and r["counts"]["sensitive"] == 0, r


def test_the_query_phase_finds_30_pp_with_and_without_a_trend_and_names_the_period():
    design = DESIGNS["query24"]
    for effect in (Effect(30.0, SINGLE), Effect(30.0, SINGLE, "linear", 30.0)):
        r = verdict_rates(design, effect, TREND_REPLICATES, seed=4, n_boot=150, n_perm=150)
        assert lower_bound(r["counts"]["sensitive"], TREND_REPLICATES) >= 0.80, r
        assert set(r["periods"]) == {8}, r  # one phase of 8 is period 8, never 2, 4 or the design's 24
    r = verdict_rates(design, Effect(30.0, (3, 7)), TREND_REPLICATES, seed=4, n_boot=150, n_perm=150)
    assert r["counts"]["sensitive"] >= 0.8 * TREND_REPLICATES and set(r["periods"]) <= {4, 8}
    assert r["periods"].get(4, 0) >= 0.85 * r["counts"]["sensitive"], r


@pytest.mark.parametrize("protocol", ["prefix", "insequence", "query"])
def test_at_the_audit_default_the_named_period_is_right_in_95_percent_of_correct_detections(protocol):
    """A period-4 effect (30 pp at phases 3 and 7 of 8) is named period 4, and one weak phase of 8 period 8, in at
    least 95% of the runs that call it phase sensitive.  The nested test at 5% named the period-4 effect 8 in about
    5% of them by construction (its own level: 94% right measured at the audit's query default), hence its 1%."""
    design = audit_design(protocol)
    for effect, period in ((Effect(30.0, (3, 7)), 4), (Effect(30.0, SINGLE), 8)):
        r = verdict_rates(design, effect, PERIOD_REPLICATES, seed=5, n_boot=100, n_perm=300)
        assert r["counts"]["sensitive"] >= 0.8 * PERIOD_REPLICATES, r
        assert r["periods"].get(period, 0) >= 0.95 * r["counts"]["sensitive"], r


def test_the_query_design_is_crossed_and_its_phases_have_equal_mean_length():
    lay = layout(DESIGNS["query24"])
    phase = lay["query_position"] % 8
    cells = np.bincount(phase * 24 + lay["shift"], minlength=8 * 24)
    assert np.all(cells == cells[0])  # every shift equally often in every query phase
    means = [lay["query_position"][phase == p].mean() for p in range(8)]
    assert max(means) - min(means) == 0.0


def test_every_trend_shape_and_its_name():
    assert Effect(30.0, SINGLE, "linear", 30.0).name == "30pp@7+linear30" and Effect().name == "flat"
    assert verdict_class("a length effect, not a phase: one step ...") == "length"
    with pytest.raises(ValueError, match="Effect.trend"):
        Effect(trend="sine", trend_pp=5.0)
