"""The measured reason of every finding that fails or is inconclusive (`phasekv.report.reasons`): each rule is given
where its measurement says so and refused where it does not (the finding then falls to the next rule)."""

from phasekv.report.findings import findings
from phasekv.report.reasons import BINARY_GAP_PP, CATEGORIES, CEILING_PCT, explained, reason_text
from tests.test_findings import full, model


def why(models, text):
    found = explained(findings(models), models)
    hits = [f for f in found if f["claim"].startswith(text)]
    assert len(hits) == 1, [f["claim"] for f in found]
    return hits[0].get("reason")


def category(models, text):
    r = why(models, text)
    return None if r is None else r["category"]


def test_a_finding_that_holds_has_no_reason_and_every_other_one_has_a_category_and_evidence():
    models = {"w8s8": model(phases=[0.9] * 7 + [0.05], gap=85), "copier": full(mean=0.05, mean_ci=[0.04, 0.06])}
    found = explained(findings(models), models)
    assert why(models, "w8s8: phase sensitive") is None
    for f in found:
        if f["status"] in ("fails", "inconclusive"):
            assert f["reason"]["category"] in CATEGORIES and f["reason"]["evidence"] and f["reason"]["because"]
            assert reason_text(f).startswith(f["reason"]["category"] + ": ")
        else:
            assert "reason" not in f and reason_text(f) == ""


def test_a_model_that_cannot_do_the_task_is_a_matter_of_scale():
    r = why({"copier": full(mean=0.05, mean_ci=[0.04, 0.06])}, "copier: full attention is flat")
    assert r["category"] == "scale" and r["because"].startswith("cannot do the task")
    assert r["evidence"].startswith("checkpoints/README.md")


def test_full_attention_whose_pattern_is_the_prefix_layouts_is_the_recipe():
    bumpy = full(mean=0.9, gap=12.0)
    inseq = {**bumpy["prefix"], "flatness_p": 0.4}
    r = why({"f": {**bumpy, "insequence": inseq}}, "f: full attention is flat")
    assert r["category"] == "recipe" and r["evidence"].startswith("docs/notes/full1kv.md") and "0.4" in r["because"]
    also = {**bumpy["prefix"], "flatness_p": 0.01}  # in-sequence padding shows it too: not the layout
    assert category({"f": {**bumpy, "insequence": also}}, "f: full attention is flat") == "not diagnosed"
    assert category({"f": bumpy}, "f: full attention is flat") == "not diagnosed"  # in-sequence not measured


def test_a_curve_retrieved_at_every_phase_is_a_matter_of_scale():
    ceiling = model(stride=4, window=8, kv=4, phases=[1.0] * 4, gap=0.5, gap_ci=[-0.2, 1.2], flatness_p=0.01)
    r = why({"w8s4-4kv": ceiling}, "w8s4-4kv: phase sensitive")
    assert r["category"] == "scale" and "8 compressor heads for S = 4" in r["because"]
    weak = model(stride=4, window=8, kv=4, phases=[0.9, 0.9, 0.9, 0.3], gap=3, gap_ci=[0, 6], flatness_p=0.3)
    assert category({"w8s4-4kv": weak}, "w8s4-4kv: phase sensitive") == "not diagnosed"
    # the within-window spread looks at phases 0..6 only
    spread = model(kv=4, phases=[1.0] * 6 + [0.84, 0.09])
    assert category({"w8s8-4kv": spread}, "w8s8-4kv: W8/S8 within-window") == "scale"
    low = model(kv=4, phases=[0.6] * 6 + [0.38, 0.05])  # spread 22 pp, phase 6's Wilson bound (36%) below 40%
    assert category({"w8s8-4kv": low}, "w8s8-4kv: W8/S8 within-window") == "not diagnosed"


def test_fewer_compressor_heads_than_the_phases_a_claim_needs_is_a_matter_of_scale():
    two = [1.0, 1.0] + [0.02] * 6
    r = why({"w8s8": model(phases=two)}, "w8s8: W8/S8 at least 3")
    assert r["category"] == "scale" and r["because"].startswith("2 compressor heads (2 layers x 1 KV)")
    assert category({"w8s8": model(kv=4, phases=two)}, "w8s8: W8/S8 at least 3") == "not diagnosed"


def test_orderings_at_the_ceiling_or_between_binary_curves_are_not_testable_here():
    assert (CEILING_PCT, BINARY_GAP_PP) == (98.0, 95.0)
    tied = {"full-4kv": full(kv=4, mean=0.98), "full-8kv": full(kv=8, mean=0.98)}
    assert category(tied, "mean(full, 8 KV) > mean(full, 4 KV)") == "claim not testable here"
    below = {"full-4kv": full(kv=4, mean=0.9799), "full-8kv": full(kv=8, mean=0.9799)}
    assert category(below, "mean(full, 8 KV) > mean(full, 4 KV)") == "protocol"  # the interval spans 0
    binary = {"w8s4": model(stride=4, window=8, gap=95.0), "w8s8": model(gap=95.5)}
    assert category(binary, "gap(W8/S4) < gap(W8/S8)") == "claim not testable here"
    graded = {"w8s4": model(stride=4, window=8, gap=94.99), "w8s8": model(gap=95.0)}
    assert category(graded, "gap(W8/S4) < gap(W8/S8)") == "protocol"


def test_a_stride_with_more_phases_than_heads_against_one_with_fewer_is_a_matter_of_scale():
    pair = {"w12s12-4kv": model(window=12, stride=12, kv=4, gap=97.0), "w8s8-4kv": model(kv=4, gap=91.7)}
    r = why(pair, "gap(W12/S12) < gap(W8/S8)")
    assert r["category"] == "scale" and "S = 12" in r["because"]
    more = {"w12s12-8kv": model(window=12, stride=12, kv=8, gap=97.0), "w8s8-8kv": model(kv=8, gap=91.7)}
    assert category(more, "gap(W12/S12) < gap(W8/S8)") == "not diagnosed"  # 16 heads cover 12 phases


def test_uniform_gates_in_front_of_per_offset_payload_maps_are_the_recipe():
    pair = {"w8s8-uniform": model(uniform=True, mean=0.274, gap=20), "w8s8": model(mean=0.262, gap=90)}
    r = why(pair, "mean(W8/S8 uniform) < mean(W8/S8 learned gates)")
    assert r["category"] == "recipe" and "per-offset payload maps" in r["because"]
    pooled = {"w8s8-uniform": model(uniform=True, shared=True, mean=0.274, gap=20), "w8s8": model(mean=0.262, gap=90)}
    assert category(pooled, "mean(W8/S8 uniform) < mean(W8/S8 learned gates)") == "protocol"  # the next rule


def cycled(gate_status, control_status):
    m = model()
    rows = [{"delta": d, "r2_excl_boundary": None, "r2_excl_boundary_ci": None, "status": gate_status,
             "shift": None, "shift_set": [], "mean_before": 0.9, "mean_after": 0.01} for d in (-3, -2, -1, 1, 2, 3)]
    controls = [{"delta": d, "status": control_status} for d in (-2, -1, 1, 2)]
    m["cycling"] = {"deltas": [{"delta": 0, "r2_excl_boundary": 1.0, "status": None}, *rows],
                    "controls": {"rolled_payloads": {"deltas": controls}}}
    return m


def test_cycling_whose_payload_control_moves_the_curve_is_the_recipe():
    r = why({"w8s8": cycled("destroyed", "moved")}, "w8s8: gate cycling")
    assert r["category"] == "recipe" and "moved in 4 of 4" in r["because"] and "destroyed 6" in r["because"]
    assert category({"w8s8": cycled("destroyed", "destroyed")}, "w8s8: gate cycling") == "not diagnosed"
    no_controls = cycled("destroyed", "moved")
    del no_controls["cycling"]["controls"]
    assert category({"w8s8": no_controls}, "w8s8: gate cycling") == "not diagnosed"


def test_an_interval_that_spans_its_threshold_is_the_protocol():
    r = why({"w8s8-spans": model(gap=15, gap_ci=[7, 20], phases=[0.6] * 7 + [0.3])}, "w8s8-spans: phase sensitive")
    assert r["category"] == "protocol" and "spans 10" in r["because"] and r["evidence"] == "docs/power.md"


def test_the_scale_rules_are_pinned_at_their_boundaries():
    def lowest(bound):
        m = model(stride=4, window=8, kv=4, phases=[1.0] * 4, gap=3, gap_ci=[0, 6], flatness_p=0.3)
        m["prefix"]["per_phase"][2].update(accuracy=0.45, ci_low=bound, ci_high=0.5)
        return category({"m": m}, "m: phase sensitive")

    assert lowest(0.40) == "scale" and lowest(0.3999) == "not diagnosed"  # every phase's bound at least 40%
    three = {**model(phases=[1.0, 1.0] + [0.02] * 6), "layers": 3}  # 3 compressor heads: enough for the claim
    assert category({"w8s8": three}, "w8s8: W8/S8 at least 3") == "not diagnosed"
