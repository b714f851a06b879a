"""The paper's claims as findings, on synthetic model summaries with known answers: every claim is tested where it
must hold, where it must fail and where its interval spans the threshold (inconclusive)."""

import pytest

from phasekv.report.claims import count, count_line, difference_interval, judge
from phasekv.report.findings import covered_phases, findings, fixes

IN_CONTEXT = 0.04  # in-context chance: the gate is 8%


def rows(phases, n=600):
    """Per-phase rows with Wilson-like intervals of half-width ~2 points (n prompts per phase)."""
    half = 0.02 if n >= 600 else 0.08
    return [{"phase": i, "accuracy": a, "ci_low": max(0.0, a - half), "ci_high": min(1.0, a + half), "n": n}
            for i, a in enumerate(phases)]


def model(compressor="gated", window=8, stride=8, kv=1, mean=0.5, gap=50.0, phases=None, uniform=False,
          shared=False, bytes_per_token=320.0, period=None, gap_ci=None, mean_ci=None, flatness_p=0.001, n=600,
          null_p95=5.0):
    phases = phases if phases is not None else [mean] * (stride or 8)
    period = period or stride or 1
    scores = {str(d): 0.0 if d == period else 20.0 for d in range(1, (stride or 8) + 1) if (stride or 8) % d == 0}
    can = (mean_ci or [mean - 0.01])[0] > 2 * IN_CONTEXT
    prefix = {"mean_accuracy": mean, "mean_ci": mean_ci or [mean - 0.01, mean + 0.01], "max_gap_pp": gap,
              "gap_crossfit_pp": gap, "gap_crossfit_ci_pp": gap_ci or [gap - 2, gap + 2], "gap_ci_pp": [gap, gap + 2],
              "contrast_crossfit_pp": gap, "contrast_crossfit_bounds_pp": gap_ci or [gap - 2, gap + 2],
              "detected_period": period, "period_scores": scores, "flatness_p": flatness_p, "null_gap_p95_pp": null_p95,
              "within_flatness_p": 0.001, "chance": 1 / 64, "in_context_chance": IN_CONTEXT, "can_do_task": can,
              "per_phase": rows(phases, n)}
    return {"compressor": compressor, "window": window if compressor != "none" else None,
            "stride": stride if compressor != "none" else None, "uniform": uniform, "shared_payload": shared,
            "staggered": False, "kv_heads": kv, "layers": 2, "hidden": 128, "prefix": prefix,
            "cache_bytes_per_token": bytes_per_token}


def full(kv=1, mean=0.2, gap=2.0, **kw):
    return model(compressor="none", kv=kv, mean=mean, gap=gap, **kw)


def status(found, text):
    hits = [f for f in found if f["claim"].startswith(text)]
    assert len(hits) == 1, [f["claim"] for f in found]
    return hits[0]["status"]


def test_the_one_rule():
    assert judge([12, 20], 10) == "holds" and judge([2, 8], 10) == "fails" and judge([8, 12], 10) == "inconclusive"
    assert judge([2, 5], 6.1, above=False) == "holds" and judge([7, 9], 6.1, above=False) == "fails"
    assert judge([5, 7], 6.1, above=False) == "inconclusive" and judge(None, 1) == "inconclusive"
    low, high = difference_interval(10.0, [8.0, 12.0], 20.0, [17.0, 23.0])
    assert low == pytest.approx(10 - 5 ** 0.5 * 1) or low == pytest.approx(10 - (4 + 9) ** 0.5)
    assert high - low == pytest.approx(2 * (2 ** 2 + 3 ** 2) ** 0.5)


def test_full_attention_learns_and_is_flat_only_when_it_can_do_the_task():
    found = findings({"good": full(mean=0.3), "copier": full(mean=0.05, mean_ci=[0.04, 0.06]),
                      "edge": full(mean=0.085, mean_ci=[0.07, 0.10]), "bumpy": full(mean=0.3, gap=12.0),
                      "vague": full(mean=0.3, gap=5.0, gap_ci=[1.0, 9.0])})
    assert status(found, "good: learns") == "holds" and status(found, "good: full attention is flat") == "holds"
    assert status(found, "copier: learns") == "fails"
    assert status(found, "copier: full attention is flat") == "inconclusive"  # flat near a copier means nothing
    assert status(found, "edge: learns") == "inconclusive"  # its interval spans the gate
    assert status(found, "bumpy: full attention is flat") == "fails"
    assert status(found, "vague: full attention is flat") == "inconclusive"
    copier = next(f for f in found if f["claim"].startswith("copier: full attention is flat"))
    assert copier["why"].startswith("inconclusive: cannot do the task") and copier["paper"] and copier["rule"]


def test_compressed_models_must_be_periodic_with_period_s():
    curve = [0.9] * 7 + [0.05]
    found = findings({"w8s8": model(phases=curve, gap=85), "w8s8-p4": model(phases=curve, gap=85, period=4),
                      "w8s8-flat": model(gap=3, flatness_p=0.4), "w8s8-small": model(gap=6, gap_ci=[2, 9]),
                      "w8s8-spans": model(gap=15, gap_ci=[7, 20]), "w8s8-noisy": model(gap=30, flatness_p=0.3),
                      "w8s8-dead": model(mean=0.03, mean_ci=[0.02, 0.04], gap=3)})
    assert status(found, "w8s8: phase sensitive with period S = 8") == "holds"
    assert status(found, "w8s8-p4: phase sensitive") == "fails"
    assert status(found, "w8s8-flat: phase sensitive") == "fails"
    assert status(found, "w8s8-small: phase sensitive") == "fails"
    assert status(found, "w8s8-spans: phase sensitive") == "inconclusive"
    assert status(found, "w8s8-noisy: phase sensitive") == "fails"  # a large gap that flatness does not confirm
    assert status(found, "w8s8-dead: phase sensitive") == "inconclusive"


def test_uniform_averaging_must_stay_phase_sensitive():
    found = findings({"u": model(uniform=True, gap=20), "u-flat": model(uniform=True, gap=3, gap_ci=[0, 6]),
                      "u-spans": model(uniform=True, gap=12, gap_ci=[6, 16])})
    assert status(found, "u: uniform averaging") == "holds"
    assert status(found, "u-flat: uniform averaging") == "fails"
    assert status(found, "u-spans: uniform averaging") == "inconclusive"


def test_w8s8_shape_worst_phase_and_within_window_spread():
    graded = [0.95, 0.9, 0.7, 0.5, 0.3, 0.2, 0.1, 0.05]  # the paper's kind: phases 0..6 spread widely
    boundary = [1, 1, 1, 1, 1, 1, 0.84, 0.09]  # only the boundary fails: spread within the window 16 pp
    weak_everywhere = [0.5, 0.45, 0.4, 0.5, 0.45, 0.4, 0.5, 0.35]  # no weak phase
    found = findings({"g": model(phases=graded), "b": model(phases=boundary), "w": model(phases=weak_everywhere),
                      "edge": model(phases=[0.9] * 7 + [0.19], n=60)})
    assert status(found, "g: W8/S8 worst phase") == "holds" and status(found, "g: W8/S8 within-window") == "holds"
    assert status(found, "b: W8/S8 worst phase") == "holds" and status(found, "b: W8/S8 within-window") == "fails"
    assert status(found, "w: W8/S8 worst phase") == "fails"
    assert status(found, "g: W8/S8 at least 3 phases") == "holds" and status(found, "b: W8/S8 at least 3") == "holds"
    two_good = findings({"o": model(phases=[0.9, 0.8, 0.41, 0.2, 0.1, 0.05, 0.05, 0.05]),  # the third straddles
                         "t": model(phases=[0.9, 0.8, 0.3, 0.2, 0.1, 0.05, 0.05, 0.05])})
    assert status(two_good, "o: W8/S8 at least 3") == "inconclusive"
    assert status(two_good, "t: W8/S8 at least 3") == "fails"
    assert status(found, "edge: W8/S8 worst phase") == "inconclusive"  # 19% with a wide interval
    spread = next(f for f in found if f["claim"].startswith("b: W8/S8 within-window"))
    assert "16.0 pp" in spread["measured"] and spread["paper"].startswith("phases 0..6")


def test_orderings_use_the_difference_interval():
    models = {"w8s8": model(gap=80), "w8s4": model(stride=4, window=8, gap=40),
              "w12s12": model(window=12, stride=12, gap=79), "w8s8-uniform": model(uniform=True, mean=0.2, gap=20),
              "full-1kv": full(mean=0.2), "full-8kv": full(kv=8, mean=0.6)}
    found = findings(models)
    assert status(found, "gap(W8/S4) < gap(W8/S8) (w8s4 vs w8s8)") == "holds"
    assert status(found, "gap(W12/S12) < gap(W8/S8) (w12s12 vs w8s8)") == "inconclusive"  # 79 vs 80, +-2 each
    assert status(found, "mean(W8/S8 uniform) < mean(W8/S8 learned gates)") == "holds"
    assert status(found, "mean(full, 8 KV) > mean(full, 1 KV)") == "holds"
    reversed_ = findings({**models, "w8s4": model(stride=4, window=8, gap=95), "full-8kv": full(kv=8, mean=0.1)})
    assert status(reversed_, "gap(W8/S4) < gap(W8/S8) (w8s4 vs w8s8)") == "fails"
    assert status(reversed_, "mean(full, 8 KV) > mean(full, 1 KV)") == "fails"
    lonely = findings({"w8s8": model(gap=80)})
    assert status(lonely, "mean(W8/S8 uniform)") == "not measured"
    other_size = findings({"w8s8": model(gap=80), "w8s4-4kv": model(stride=4, window=8, kv=4, gap=40)})
    assert status(other_size, "gap(W8/S4) < gap(W8/S8)") == "not measured"  # different KV heads: not compared


def test_token_level_selection_is_judged_flat_under_its_own_name_and_never_paired_across_architectures():
    def hf(arch, kv, mean, gap=1.0, token_selection=False):
        return {**full(kv=kv, mean=mean, gap=gap), "family": "transformers", "architecture": arch,
                "token_selection": token_selection}

    found = findings({"qwen3": hf("Qwen3ForCausalLM", 1, 0.9), "v32": hf("DeepseekV32ForCausalLM", 8, 0.99, 2.0, True),
                      "v32-bumpy": hf("DeepseekV32ForCausalLM", 8, 0.9, 15.0, True),
                      "qwen3-8kv": hf("Qwen3ForCausalLM", 8, 0.5)})
    assert status(found, "v32: token-level top-k attention is flat") == "holds"
    assert status(found, "v32-bumpy: token-level top-k attention is flat") == "fails"
    assert status(found, "qwen3: full attention is flat") == "holds"
    pairs = [f["claim"] for f in found if f["claim"].startswith("mean(full")]
    assert pairs == ["mean(full, 8 KV) > mean(full, 1 KV) (qwen3-8kv vs qwen3)"]  # same architecture only
    assert status(found, "mean(full, 8 KV) > mean(full, 1 KV)") == "fails"  # 50% < 90%: it must say no


def test_coverage_grows_with_heads():
    def covering(k, kv):
        return model(kv=kv, phases=[0.9] * k + [0.05] * (8 - k))

    assert covered_phases(covering(3, 1)["prefix"]) == (3, 3)
    grows = findings({"a": covering(3, 1), "b": covering(6, 4)})
    same = findings({"a": covering(5, 1), "b": covering(5, 4)})
    edge = findings({"a": covering(3, 1), "b": model(kv=4, phases=[0.9] * 3 + [0.41] + [0.05] * 4)})
    assert status(grows, "covered phases") == "holds" and status(same, "covered phases") == "fails"
    assert status(edge, "covered phases") == "inconclusive"  # the 4th phase's interval straddles 40%


def test_gate_cycling_on_every_payload_kind():
    def cycled(ci_rows, shared):
        m = model(shared=shared)
        m["cycling"] = {"deltas": [{"delta": 0, "r2_excl_boundary": 1.0, "r2_excl_boundary_ci": [1.0, 1.0]}] + [
            {"delta": d, "r2_excl_boundary": sum(ci) / 2, "r2_excl_boundary_ci": ci} for d, ci in ci_rows.items()]}
        return m

    deltas = (-3, -2, -1, 1, 2, 3)
    found = findings({"good": cycled({d: [0.8, 0.98] for d in deltas}, shared=True),
                      "offset": cycled({d: [-0.9, 0.1] for d in deltas}, shared=False),
                      "wide": cycled({d: [0.29, 0.87] for d in deltas}, shared=True),
                      "point": cycled({d: [0.7, 0.9] for d in deltas[:3]} | {d: [0.2, 0.5] for d in deltas[3:]},
                                      shared=True)})
    assert status(found, "good: gate cycling") == "holds"
    assert status(found, "offset: gate cycling") == "fails"  # the paper's per-offset kernel counts too
    assert "per-offset payload maps" in next(f["claim"] for f in found if f["claim"].startswith("offset: gate"))
    assert status(found, "wide: gate cycling") == "inconclusive"  # a point above 0.66 with [0.29, 0.87] is not "holds"
    assert status(found, "point: gate cycling") == "fails"  # only 3 of 6 can reach the bar


def test_transformers_model_gets_no_verdict_when_its_compressed_layers_are_unused():
    def arch(drops, flat):
        m = model(stride=4, window=4, gap=1 if flat else 40, period=1 if flat else 4, flatness_p=1.0 if flat else 1e-3)
        knock = [{"layer": layer, "kv_head": head, "mean_rel_change_pct": d} for (layer, head), d in drops.items()]
        return {**m, "family": "transformers", "architecture": "X", "compressed_layers": [1],
                "knockout": {"rows": knock}}

    found = findings({"unused": arch({(0, 0): -40.0, (1, 0): -0.4, (1, 1): 8.0}, flat=True),
                      "used-flat": arch({(0, 0): -1.0, (1, 0): -35.0}, flat=True),
                      "used-periodic": arch({(1, 0): -90.0}, flat=False),
                      "no-knockout": {**arch({}, flat=False), "knockout": None}})
    verdict = {f["claim"].split(":")[0]: f for f in found}
    assert verdict["unused"]["status"] == "inconclusive" and verdict["unused"]["why"].startswith("no verdict")
    assert "NO VERDICT" in verdict["unused"]["measured"]
    assert verdict["used-flat"]["status"] == "fails" and "why" not in verdict["used-flat"]
    assert verdict["used-periodic"]["status"] == "holds" and verdict["no-knockout"]["status"] == "holds"


def test_llama4_chunked_attention_is_or_is_not_phase_sensitive_at_period_c():
    def chunked(flat):
        m = model(compressor="llama4_chunked_attention", window=16, stride=16, gap=1 if flat else 60,
                  period=1 if flat else 16, flatness_p=1.0 if flat else 1e-4)
        return {**m, "family": "transformers", "architecture": "llama4", "compressed_layers": [0],
                "knockout": {"rows": [{"layer": 0, "kv_head": 0, "mean_rel_change_pct": -80.0}]}}

    found = {f["claim"].split(":")[0]: f for f in findings({"yes": chunked(False), "no": chunked(True)})}
    assert found["yes"]["status"] == "holds"
    assert found["yes"]["claim"] == "yes: Llama 4's chunked attention is phase sensitive at period C = 16"
    assert found["no"]["status"] == "fails"
    assert found["no"]["claim"] == "no: Llama 4's chunked attention is not phase sensitive at period C = 16"


def test_counts_keep_every_status():
    found = findings({"w8s8": model(phases=[0.9] * 7 + [0.05], gap=85), "full-1kv": full(mean=0.05,
                                                                                         mean_ci=[0.04, 0.06])})
    c = count(found)
    assert sum(c.values()) == len(found) and c["fails"] >= 1 and c["inconclusive"] >= 1 and c["not measured"] >= 1
    line = count_line(found)
    assert line.startswith(f"{c['holds']} hold, {c['fails']} fail, {c['inconclusive']} inconclusive of "
                           f"{c['holds'] + c['fails'] + c['inconclusive']}")
    for f in found:  # every claim states the paper's number and its rule (unless it was not measured)
        assert f["status"] == "not measured" or (f["paper"] and f["rule"] and f["measured"])
        assert f["holds"] is {"holds": True, "fails": False}.get(f["status"])


def test_fixes_rows_and_goal():
    base = model(kv=4, mean=0.86, gap=92)
    good = model(kv=4, window=9, mean=0.95, gap=10, bytes_per_token=325.0)
    assert fixes({"w8s8-4kv": base}) == []  # the fix was not measured: no row
    row = fixes({"w8s8-4kv": base, "w9s8-4kv": good})[0]
    assert row["baseline"] == "w8s8-4kv" and row["goal_met"] and row["cache_bytes_per_token"] == 325.0
    costly = model(kv=4, window=9, mean=0.95, gap=10, bytes_per_token=640.0)  # twice the cache: not a fair fix
    assert not fixes({"w8s8-4kv": base, "w9s8-4kv": costly})[0]["goal_met"]
    weak = model(kv=4, window=9, mean=0.5, gap=10)  # flat but worse than the baseline's lower bound
    assert not fixes({"w8s8-4kv": base, "w9s8-4kv": weak})[0]["goal_met"]


def test_every_threshold_of_the_findings_is_pinned_at_its_boundary():
    """Each constant just inside and just outside its boundary: changing one breaks a line here."""
    from phasekv.report import claims as F

    assert (F.FULL_FLAT_PP, F.W8S8_WORST_PCT, F.WITHIN_WINDOW_PP, F.COVERED_PCT, F.W8S8_COVERED) == (
        6.1, 20.0, 50.0, 40.0, 3)
    # full attention is flat: the selection-free gap's interval strictly below 6.1 pp
    assert status(findings({"f": full(mean=0.3, gap=3.0, gap_ci=[1.0, 6.09])}), "f: full attention is flat") == "holds"
    assert status(findings({"f": full(mean=0.3, gap=3.0, gap_ci=[1.0, 6.1])}), "f: full attention") == "inconclusive"
    assert status(findings({"f": full(mean=0.3, gap=8.0, gap_ci=[6.1, 9.0])}), "f: full attention is flat") == "fails"
    # learns: the mean's lower bound at least 2 x the in-context chance (8%)
    assert status(findings({"f": full(mean=0.09, mean_ci=[0.08, 0.1])}), "f: learns") == "holds"
    assert status(findings({"f": full(mean=0.09, mean_ci=[0.0799, 0.1])}), "f: learns") == "inconclusive"
    # phase sensitive: flatness p strictly below 0.05, the contrast's lower bound >= 10, the gap above the null p95
    curve = [0.9] * 7 + [0.05]
    edge = {"phases": curve, "gap": 50.0, "gap_ci": [10.0, 60.0], "flatness_p": 0.0499, "null_p95": 49.99}
    assert status(findings({"m": model(**edge)}), "m: phase sensitive") == "holds"
    assert status(findings({"m": model(**{**edge, "flatness_p": 0.05})}), "m: phase sensitive") == "fails"
    assert status(findings({"m": model(**{**edge, "gap_ci": [9.99, 60.0]})}), "m: phase sensitive") == "inconclusive"
    assert status(findings({"m": model(**{**edge, "gap_ci": [2.0, 9.99]})}), "m: phase sensitive") == "fails"
    assert status(findings({"m": model(**{**edge, "null_p95": 50.0})}), "m: phase sensitive") == "fails"
    # uniform averaging: the same material bound
    assert status(findings({"u": model(uniform=True, gap=20, gap_ci=[10.0, 30.0])}), "u: uniform") == "holds"
    assert status(findings({"u": model(uniform=True, gap=20, gap_ci=[9.99, 30.0])}), "u: uniform") == "inconclusive"


def shaped(worst=(0.1, 0.15), third=(0.5, 0.6), spread=(0.8, 0.3)):
    """A W8/S8 curve with hand-set Wilson intervals: the worst phase (7), the third-best phase (2), and the best
    (phase 0, lower bound spread[0]) and weakest (phase 6, upper bound spread[1]) of phases 0..6."""
    m = model()
    rows = [{"phase": i, "accuracy": 0.9, "ci_low": 0.85, "ci_high": 0.95, "n": 600} for i in range(8)]
    rows[0].update(accuracy=0.95, ci_low=spread[0], ci_high=0.99)
    rows[2].update(accuracy=sum(third) / 2, ci_low=third[0], ci_high=third[1])
    rows[6].update(accuracy=0.28, ci_low=0.26, ci_high=spread[1])
    rows[3:6] = [{**r, "accuracy": 0.3, "ci_low": 0.26, "ci_high": 0.34} for r in rows[3:6]]
    rows[7].update(accuracy=sum(worst) / 2, ci_low=worst[0], ci_high=worst[1])
    m["prefix"]["per_phase"] = rows
    return findings({"w": m})


def test_the_w8s8_shape_thresholds_are_pinned_at_their_boundaries():
    assert status(shaped(worst=(0.1, 0.1999)), "w: W8/S8 worst phase") == "holds"
    assert status(shaped(worst=(0.1, 0.2)), "w: W8/S8 worst phase") == "inconclusive"
    assert status(shaped(worst=(0.2, 0.3)), "w: W8/S8 worst phase") == "fails"
    assert status(shaped(third=(0.4, 0.5)), "w: W8/S8 at least 3") == "holds"  # phases 0, 1, 2 clearly above 40%
    assert status(shaped(third=(0.3999, 0.5)), "w: W8/S8 at least 3") == "inconclusive"
    assert status(shaped(third=(0.2, 0.3999)), "w: W8/S8 at least 3") == "fails"
    assert status(shaped(spread=(0.8, 0.3)), "w: W8/S8 within-window") == "holds"  # 80 - 30 = 50
    assert status(shaped(spread=(0.8, 0.3001)), "w: W8/S8 within-window") == "inconclusive"


def test_the_cycling_and_knockout_and_fix_thresholds_are_pinned_at_their_boundaries():
    from phasekv.report import claims as C
    from phasekv.report import findings as F

    assert (C.CYCLING_R2, C.CYCLING_DELTAS_NEEDED, F.USED_DROP_PCT, F.BYTES_TOLERANCE) == (0.66, 4, 10.0, 0.05)

    def cycled(lows):
        m = model(shared=True)
        m["cycling"] = {"deltas": [{"delta": d, "r2_excl_boundary": low, "r2_excl_boundary_ci": [low, 0.99]}
                                   for d, low in zip((-3, -2, -1, 1, 2, 3), lows)]}
        return findings({"c": m})

    assert status(cycled([0.66] * 4 + [0.1] * 2), "c: gate cycling") == "holds"  # 4 of 6 at the bar
    assert status(cycled([0.6599] + [0.66] * 3 + [0.1] * 2), "c: gate cycling") == "inconclusive"
    m = model(shared=True)
    highs = [0.9] * 3 + [0.6599] * 3  # 3 deltas wholly below the bar
    m["cycling"] = {"deltas": [{"delta": d, "r2_excl_boundary": 0.5,
                                "r2_excl_boundary_ci": [0.5 if h < 0.66 else 0.8, h]}
                               for d, h in zip((-3, -2, -1, 1, 2, 3), highs)]}
    assert status(findings({"c": m}), "c: gate cycling") == "fails"  # 3 above, 3 wholly below: 4 cannot be reached

    def arch(drop):
        m = model(stride=4, window=4, gap=1, period=1, flatness_p=1.0)
        return {**m, "family": "transformers", "architecture": "X", "compressed_layers": [1],
                "knockout": {"rows": [{"layer": 1, "kv_head": 0, "mean_rel_change_pct": drop}]}}

    verdicts = {f["claim"].split(":")[0]: f for f in findings({"used": arch(-10.0), "unused": arch(-9.99)})}
    assert verdicts["used"]["status"] == "fails" and verdicts["unused"]["status"] == "inconclusive"
    base = model(kv=4, mean=0.86, gap=90, bytes_per_token=320.0)  # mean_ci [0.85, 0.87]

    def goal(**kw):
        fix = model(kv=4, window=9, **{"mean": 0.9, "gap": 30.0, "bytes_per_token": 335.99, **kw})
        return fixes({"w8s8-4kv": base, "w9s8-4kv": fix})[0]["goal_met"]

    assert goal()  # just under 5% more bytes, a third of the gap
    assert not goal(bytes_per_token=336.1) and not goal(gap=30.01)
    assert goal(mean=0.85) and not goal(mean=0.8499)  # the baseline's lower bound


def test_the_material_bound_of_a_finding_is_the_selection_free_contrast_only():
    """Other intervals, however high, never make a compressed model phase sensitive or uniform averaging material."""
    m = model(phases=[0.9] * 7 + [0.05], gap=85, gap_ci=[5.0, 9.0])
    m["prefix"].update(gap_ci_basic_pp=[80.0, 90.0], gap_crossfit_ci_pp=[80.0, 90.0], gap_ci_pp=[80.0, 90.0])
    u = model(uniform=True, gap=20, gap_ci=[5.0, 9.0])
    u["prefix"].update(gap_ci_basic_pp=[15.0, 25.0], gap_crossfit_ci_pp=[15.0, 25.0])
    found = findings({"m": m, "u": u})
    assert status(found, "m: phase sensitive") == "fails" and status(found, "u: uniform") == "fails"
    m["prefix"].update(contrast_crossfit_bounds_pp=None, contrast_crossfit_pp=None)
    assert status(findings({"m": m}), "m: phase sensitive") == "inconclusive"  # not bounded: never material
