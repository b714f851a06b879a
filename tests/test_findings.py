"""The paper's orderings and the fixes table, on synthetic model summaries with known answers."""

from phasekv.report.findings import covered_phases, findings, fixes, is_graded


def model(compressor="gated", window=8, stride=8, kv=1, mean=0.5, gap=50.0, phases=None, uniform=False,
          shared=False, bytes_per_token=320.0, period=None):
    phases = phases if phases is not None else [mean] * stride
    prefix = {"mean_accuracy": mean, "mean_ci": [mean - 0.01, mean + 0.01], "max_gap_pp": gap,
              "gap_ci_pp": [gap - 1, gap + 1], "detected_period": period or stride, "flatness_p": 0.001,
              "within_flatness_p": 0.001, "chance": 1 / 64, "per_phase": [{"accuracy": a} for a in phases]}
    return {"compressor": compressor, "window": window if compressor != "none" else None,
            "stride": stride if compressor != "none" else None, "uniform": uniform, "shared_payload": shared,
            "staggered": False, "kv_heads": kv, "layers": 2, "hidden": 128, "prefix": prefix,
            "cache_bytes_per_token": bytes_per_token}


def by_claim(found, text):
    return [f for f in found if f["claim"].startswith(text)]


def test_orderings_compare_same_family_models_only_and_say_when_unmeasured():
    models = {"w8s8": model(gap=98), "w8s4": model(stride=4, gap=40), "w8s8-4kv": model(kv=4, gap=70),
              "full-1kv": model(compressor="none", mean=0.2, gap=2), "full-8kv": model(compressor="none", kv=8,
                                                                                       mean=0.6, gap=3)}
    found = findings(models)
    gaps = by_claim(found, "gap(W8/S4) < gap(W8/S8)")
    assert [f["models"] for f in gaps] == [["w8s4", "w8s8"]] and gaps[0]["holds"] and gaps[0]["clear"]
    assert by_claim(found, "mean(full, 8 KV) > mean(full, 1 KV)")[0]["holds"]
    unmeasured = by_claim(found, "mean(W8/S8 uniform)")
    assert unmeasured[0]["holds"] is None and unmeasured[0]["measured"].startswith("not measured")


def test_graded_shape_and_covered_phases():
    graded = model(phases=[1, 1, 1, 1, 0.9, 0.5, 0.3, 0.05])["prefix"]
    binary = model(phases=[1, 1, 0.02, 0.02, 0.01, 0.01, 0.01, 0.02])["prefix"]
    assert covered_phases(graded) == 8 and is_graded(graded, 8)
    assert covered_phases(binary) == 2 and not is_graded(binary, 8)
    assert not is_graded({**graded, "detected_period": 4}, 8)


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


def test_transformers_model_gets_no_verdict_when_its_compressed_layers_are_unused():
    """A transformers model's phase claim is judged only when knockouts show its compressed layers do the lookup;
    a flat curve from a model whose compressed layer is unused is 'no verdict', not 'not reproduced'."""
    def arch(drops, flat):
        m = model(stride=4, window=4, gap=1 if flat else 40, period=1 if flat else 4)
        m["prefix"]["flatness_p"] = 1.0 if flat else 0.001
        rows = [{"layer": layer, "kv_head": head, "mean_rel_change_pct": d} for (layer, head), d in drops.items()]
        return {**m, "family": "transformers", "architecture": "X", "compressed_layers": [1],
                "knockout": {"rows": rows}}

    found = findings({"unused": arch({(0, 0): -40.0, (1, 0): -0.4, (1, 1): 8.0}, flat=True),
                      "used-flat": arch({(0, 0): -1.0, (1, 0): -35.0}, flat=True),
                      "used-periodic": arch({(1, 0): -90.0}, flat=False),
                      "no-knockout": {**arch({}, flat=False), "knockout": None}})
    verdict = {f["claim"].split(":")[0]: f for f in found}
    assert verdict["unused"]["holds"] is None and verdict["unused"]["why"].startswith("no verdict")
    assert "NO VERDICT" in verdict["unused"]["measured"]
    assert verdict["used-flat"]["holds"] is False and "why" not in verdict["used-flat"]
    assert verdict["used-periodic"]["holds"] is True and verdict["no-knockout"]["holds"] is True


def test_gate_cycling_verdict_is_inconclusive_when_intervals_span_the_bar():
    def cycled(rows):
        m = model(shared=True)
        m["cycling"] = {"deltas": [{"delta": 0, "r2_excl_boundary": 1.0, "r2_excl_boundary_ci": [1.0, 1.0]}] + [
            {"delta": d, "r2_excl_boundary": r2, "r2_excl_boundary_ci": ci} for d, (r2, ci) in rows.items()]}
        return m

    wide = {d: (0.5, [-0.3, 0.9]) for d in (-2, -1, 1, 2)}
    found = findings({"good": cycled({d: (0.95, [0.8, 0.98]) for d in (-2, -1, 1, 2)}), "wide": cycled(wide),
                      "bad": cycled({d: (0.1, [-0.2, 0.4]) for d in (-2, -1, 1, 2)})})
    verdict = {f["claim"].split(":")[0]: f for f in found if "gate cycling" in f["claim"]}
    assert verdict["good"]["holds"] is True and verdict["bad"]["holds"] is False
    assert verdict["wide"]["holds"] is None and verdict["wide"]["why"].startswith("inconclusive")
    assert "[-0.30, 0.90]" in verdict["wide"]["measured"] and "4 of 4 deltas" in verdict["wide"]["claim"]
