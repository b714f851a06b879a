"""The paper's claims (PAPER.md section 6) checked on `reproduce`'s measured models.

Per model: full attention learns and is flat, compressed models have period S, uniform averaging is
still phase sensitive.  Then the paper's ORDERINGS, each between models that differ in one thing only
(same KV heads, layers and width; `family`):

* gap(W8/S4) < gap(W8/S8)                 overlapping windows cover more phases;
* gap(W12/S12) < gap(W8/S8)               the paper's 63 < 75 (more offsets per entry, fewer entries);
* mean(uniform) < mean(learned gates)     W8/S8 with and without gates;
* mean(full, more KV heads) > mean(full, 1 KV head);
* covered phases grow with compressor heads (W8/S8, layers x KV heads);
* a graded W8/S8 curve: >= S/2 phases above 3 x chance, worst below half the best, period S;
* gate cycling R^2 >= 0.66 excluding the boundary phase for >= 4 of 6 deltas (shared payload maps).

Each finding carries the measured numbers with their 95% cluster-bootstrap intervals and `holds`
(the point estimates are in the claimed order); `clear` says whether the intervals are disjoint too.
An ordering whose models were not measured is reported with holds = None ("not measured"), never
silently dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

COVERED_FACTOR = 3.0  # a phase is "covered" when its accuracy exceeds 3 x chance
CYCLING_R2 = 0.66  # the paper's lowest R^2 excluding the boundary phase
CYCLING_DELTAS_NEEDED = 4  # of the 6 non-zero deltas


def covered_phases(result: dict[str, Any]) -> int:
    """Phases of a protocol result whose accuracy exceeds COVERED_FACTOR x chance."""
    return sum(row["accuracy"] > COVERED_FACTOR * result["chance"] for row in result["per_phase"])


def is_graded(result: dict[str, Any], stride: int) -> bool:
    """The paper's shape: at least half the phases covered, the worst below half the best, period S."""
    acc = [row["accuracy"] for row in result["per_phase"]]
    return (covered_phases(result) >= stride / 2 and min(acc) < max(acc) / 2
            and result["detected_period"] == stride)


def family(m: dict[str, Any]) -> tuple:
    """What two models must share to be compared: model family (phasekv or transformers), KV heads, layers, width."""
    return m.get("family", "phasekv"), m["kv_heads"], m["layers"], m["hidden"]


def _without_kv(m: dict[str, Any]) -> tuple:
    """`family` except the KV heads (full-attention models compared across KV heads)."""
    fam, _, layers, hidden = family(m)
    return fam, layers, hidden


def kind(m: dict[str, Any]) -> str:
    """Short variant name: full, W8/S8, W8/S8 uniform, W8/S8 shared, W8/S8 stagger, csa..."""
    if m["compressor"] == "none":
        return "full"
    base = f"W{m['window']}/S{m['stride']}" if m["compressor"] == "gated" else m["compressor"]
    extras = [flag for flag, on in (("uniform", m["uniform"]), ("stagger", m.get("staggered")),
                                    ("shared", m.get("shared_payload") and not m["uniform"])) if on]
    return " ".join([base, *extras])


def _value(m: dict[str, Any], metric: str) -> tuple[float, list[float] | None]:
    p = m["prefix"]
    if metric == "gap":
        return p["max_gap_pp"], p.get("gap_ci_pp")
    return 100 * p["mean_accuracy"], [100 * x for x in p["mean_ci"]] if p.get("mean_ci") else None


def _pairs(models: dict[str, dict], first: Callable[[dict], bool], second: Callable[[dict], bool]):
    """(name_a, name_b) for every model a matching `first` and b matching `second` of the same family."""
    return [(a, b) for a, ma in models.items() for b, mb in models.items()
            if a != b and first(ma) and second(mb) and family(ma) == family(mb)]


def _ordering(models, text: str, metric: str, less: Callable[[dict], bool], more: Callable[[dict], bool],
              claim: Callable[..., None]) -> None:
    """Claim metric(less-model) < metric(more-model) for every same-family pair."""
    pairs = _pairs(models, less, more)
    if not pairs:
        claim(text, "not measured: no pair of bundled models of the same size", None)
    for a, b in pairs:
        (va, ca), (vb, cb) = _value(models[a], metric), _value(models[b], metric)
        unit = "pp" if metric == "gap" else "%"
        clear = ca is not None and cb is not None and ca[1] < cb[0]
        claim(f"{text} ({a} vs {b})", f"{metric} {va:.1f} {unit} {_ci(ca)} vs {vb:.1f} {unit} {_ci(cb)}", va < vb,
              models=[a, b], values=[va, vb], intervals=[ca, cb], clear=clear)


def _ci(ci: list[float] | None) -> str:
    return "" if ci is None else f"[{ci[0]:.1f}, {ci[1]:.1f}]"


def ordering_findings(models: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The paper's orderings between same-family models (module doc)."""
    out: list[dict[str, Any]] = []

    def claim(text: str, measured: str, holds: bool | None, **numbers: Any) -> None:
        out.append({"claim": text, "measured": measured, "holds": holds, "ordering": True, **numbers})

    def is_kind(name: str) -> Callable[[dict], bool]:
        return lambda m: kind(m) == name

    _ordering(models, "gap(W8/S4) < gap(W8/S8)", "gap", is_kind("W8/S4"), is_kind("W8/S8"), claim)
    _ordering(models, "gap(W12/S12) < gap(W8/S8) (paper: 63 < 75)", "gap", is_kind("W12/S12"), is_kind("W8/S8"),
              claim)
    _ordering(models, "mean(W8/S8 uniform) < mean(W8/S8 learned gates)", "mean", is_kind("W8/S8 uniform"),
              is_kind("W8/S8"), claim)
    full = [(n, m) for n, m in models.items() if m["compressor"] == "none"]
    pairs = [(a, b) for a, ma in full for b, mb in full
             if ma["kv_heads"] < mb["kv_heads"] and _without_kv(ma) == _without_kv(mb)]
    if not pairs:
        claim("mean(full, more KV heads) > mean(full, 1 KV head)", "not measured: one full-attention model", None)
    for a, b in pairs:
        (va, ca), (vb, cb) = _value(models[a], "mean"), _value(models[b], "mean")
        claim(f"mean(full, {models[b]['kv_heads']} KV) > mean(full, {models[a]['kv_heads']} KV) ({b} vs {a})",
              f"mean {vb:.1f}% {_ci(cb)} vs {va:.1f}% {_ci(ca)}", vb > va, models=[b, a], values=[vb, va],
              intervals=[cb, ca], clear=ca is not None and cb is not None and ca[1] < cb[0])
    _coverage(models, claim)
    _graded(models, claim)
    _cycling(models, claim)
    return out


def _coverage(models: dict[str, dict], claim: Callable[..., None]) -> None:
    """Covered phases grow with the number of compressor heads (layers x KV heads), W8/S8 models."""
    rows = sorted((m["layers"] * m["kv_heads"], covered_phases(m["prefix"]), n)
                  for n, m in models.items() if kind(m) == "W8/S8")
    if len({heads for heads, _, _ in rows}) < 2:
        claim("covered phases (> 3 x chance) grow with compressor heads", "not measured: one W8/S8 size", None)
        return
    text = ", ".join(f"{n}: {heads} heads -> {covered} of 8" for heads, covered, n in rows)
    by_heads: dict[int, list[int]] = {}
    for heads, covered, _ in rows:
        by_heads.setdefault(heads, []).append(covered)
    means = [sum(v) / len(v) for _, v in sorted(by_heads.items())]
    claim("covered phases (> 3 x chance) grow with compressor heads (W8/S8)", text,
          all(a < b for a, b in zip(means, means[1:])), covered=[[h, c, n] for h, c, n in rows])


def _graded(models: dict[str, dict], claim: Callable[..., None]) -> None:
    """At least one W8/S8 model has the paper's graded shape."""
    rows = [(n, m) for n, m in models.items() if m.get("window") == 8 and m.get("stride") == 8
            and m["compressor"] == "gated"]
    graded = [n for n, m in rows if is_graded(m["prefix"], 8)]
    text = "; ".join(f"{n}: {covered_phases(m['prefix'])} of 8 covered, per phase "
                     + " ".join(f"{100 * r['accuracy']:.0f}" for r in m["prefix"]["per_phase"]) for n, m in rows)
    claim("a W8/S8 model has a graded curve (>= 4 of 8 phases above 3 x chance, worst < best / 2, period 8)",
          text or "not measured: no W8/S8 model", bool(graded) if rows else None, graded=graded)


def _cycling(models: dict[str, dict], claim: Callable[..., None]) -> None:
    """Gate cycling works on shared-payload models: R^2 >= 0.66 (boundary excluded) for >= 4 of 6 deltas."""
    rows = [(n, m["cycling"]) for n, m in models.items() if m.get("cycling") and m.get("shared_payload")]
    if not rows:
        claim(f"gate cycling R^2 >= {CYCLING_R2} (boundary excluded) on a shared-payload model",
              "not measured: no shared-payload W = S model", None)
    for n, cyc in rows:
        r2 = {row["delta"]: row["r2_excl_boundary"] for row in cyc["deltas"] if row["delta"] != 0}
        ci = {row["delta"]: row.get("r2_excl_boundary_ci") for row in cyc["deltas"] if row["delta"] != 0}
        good = sum(v is not None and v >= CYCLING_R2 for v in r2.values())
        # a delta clearly below the bar: its whole 95% interval is (a model that cannot be cycled)
        clearly_bad = sum(ci[d] is not None and ci[d][1] < CYCLING_R2 for d in r2)
        need = min(CYCLING_DELTAS_NEEDED, len(r2))
        holds = True if good >= need else False if len(r2) - clearly_bad < need else None
        measured = ", ".join(f"{d:+d}: {'-' if v is None else f'{v:.2f}'}"
                             + (f" [{ci[d][0]:.2f}, {ci[d][1]:.2f}]" if ci[d] else "") for d, v in sorted(r2.items()))
        claim(f"{n}: gate cycling R^2 >= {CYCLING_R2} excluding the boundary for >= {need} of "
              f"{len(r2)} deltas", measured, holds, r2=r2, deltas_ok=good,
              **({} if holds is not None else {"why": "inconclusive: intervals span the bar"}))


# a layer takes part in the lookup when knocking out one of its heads (or the whole layer) costs at least this
# much accuracy, relative (mean replacement, `phasekv.probes.knockout`)
USED_DROP_PCT = 10.0


def compressed_layer_drop(m: dict[str, Any]) -> float | None:
    """The largest relative accuracy loss (%, negative) of a knockout in one of the model's compressed layers
    (`compressed_layers`), or None when those layers or their knockouts were not measured."""
    layers, knockout = m.get("compressed_layers"), m.get("knockout")
    rows = [r for r in (knockout or {}).get("rows", []) if layers and r.get("layer") in layers]
    return min(r["mean_rel_change_pct"] for r in rows) if rows else None


def findings(models: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Every claim: per model (learns, flat, period S, uniform still phase sensitive), then the orderings."""
    out = []

    def claim(text: str, measured: str, holds: bool | None, why: str | None = None) -> None:
        # holds None: no verdict, for the reason `why` (the report's verdict column)
        out.append({"claim": text, "measured": measured, "holds": None if holds is None else bool(holds),
                    **({"why": why} if why else {})})

    for name, m in models.items():
        p = m["prefix"]
        if m["compressor"] == "none":
            claim(f"{name}: full attention learns the task (mean >= 10%, chance {100 * p['chance']:.1f}%)",
                  f"mean {100 * p['mean_accuracy']:.1f}%", p["mean_accuracy"] >= 0.10)
            claim(f"{name}: full attention is flat (gap <= 6 points and flatness not rejected at 5%)",
                  f"gap {p['max_gap_pp']:.1f} pp, flatness p = {p['flatness_p']:.3f}, within-example p = "
                  f"{p.get('within_flatness_p', float('nan')):.3f}",
                  p["max_gap_pp"] <= 6 and p["flatness_p"] > 0.05)
            continue
        if m.get("family") == "transformers":  # the code users ship: does it show the paper's effect?
            drop = compressed_layer_drop(m)
            unused = drop is not None and drop > -USED_DROP_PCT  # the lookup runs through other layers
            claim(f"{name}: transformers' {m['architecture']} with {m['compressor']} (W{m['window']}/S{m['stride']}) "
                  "is phase sensitive (flatness rejected at 5%, period S)",
                  f"mean {100 * p['mean_accuracy']:.1f}% (chance {100 * p['chance']:.1f}%), gap {p['max_gap_pp']:.1f} "
                  f"pp {_ci(p.get('gap_ci_pp'))}, period {p['detected_period']}, flatness p = {p['flatness_p']:.3g}, "
                  "per phase " + " ".join(f"{100 * r['accuracy']:.0f}" for r in p["per_phase"])
                  + (f"; NO VERDICT: knocking out any head of its compressed layers {m['compressed_layers']} "
                     f"costs at most {max(0.0, -drop):.0f}% (< {USED_DROP_PCT:.0f}%): the lookup does not go through "
                     "them" if unused else ""),
                  None if unused else p["flatness_p"] < 0.05 and p["detected_period"] == m["stride"],
                  "no verdict: compressed layers unused" if unused else None)
            continue
        if m["stride"] and name not in FIXES:  # a fix aims at NO period: it is judged in the fixes table
            claim(f"{name}: detected period equals the stride S = {m['stride']}",
                  f"period {p['detected_period']}", p["detected_period"] == m["stride"])
        if m["uniform"]:
            claim(f"{name}: uniform averaging is still phase sensitive (flatness rejected at 5%)",
                  f"gap {p['max_gap_pp']:.1f} pp, flatness p = {p['flatness_p']:.3g}", p["flatness_p"] < 0.05)
        elif m["window"] == 8 and m["stride"] == 8 and m["kv_heads"] == 1:
            claim(f"{name}: W8/S8 phase gap >= 30 points", f"gap {p['max_gap_pp']:.1f} pp", p["max_gap_pp"] >= 30)
    return out + ordering_findings(models)


# beyond the paper: phase-robust variants and the baseline each one fixes (same heads, layers, training budget)
FIXES = {"w9s8-4kv": "w8s8-4kv",  # windows overlapping by one token, one entry per 8 tokens as W8/S8
         "w8s8-4kv-jitter": "w8s8-4kv",  # the W8/S8 grid shifted by a random 0..7 per training step
         "w8s8-4kv-headstagger": "w8s8-4kv",  # KV head h starts its windows at 2h (model.head_stagger)
         "w8s8-4kv-headstagger-layer": "w8s8-4kv"}  # and layer 1's heads one token later (with model.stagger)
BYTES_TOLERANCE = 0.05  # "equal cache bytes": within 5%


def fixes(models: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per measured fix whose baseline was measured too (prefix padding): cache bytes per token,
    mean and gap with their intervals, period, and whether it meets the goal of the fixes issue: gap at
    most a third of the baseline's, mean no lower than the baseline's lower interval bound, and cache
    bytes within 5% of the baseline's."""
    rows = []
    for name, base in FIXES.items():
        if name not in models or base not in models:
            continue
        m, b = models[name], models[base]
        p, q = m["prefix"], b["prefix"]
        same_bytes = (m.get("cache_bytes_per_token") is not None and b.get("cache_bytes_per_token")
                      and abs(m["cache_bytes_per_token"] / b["cache_bytes_per_token"] - 1) <= BYTES_TOLERANCE)
        goal = bool(same_bytes and p["max_gap_pp"] <= q["max_gap_pp"] / 3 and p["mean_accuracy"] >= q["mean_ci"][0])
        rows.append({"name": name, "baseline": base, "cache_bytes_per_token": m.get("cache_bytes_per_token"),
                     "baseline_cache_bytes_per_token": b.get("cache_bytes_per_token"),
                     "mean_accuracy": p["mean_accuracy"], "mean_ci": p["mean_ci"], "max_gap_pp": p["max_gap_pp"],
                     "gap_ci_pp": p["gap_ci_pp"], "detected_period": p["detected_period"],
                     "flatness_p": p["flatness_p"], "worst_phase_accuracy": min(r["accuracy"] for r in p["per_phase"]),
                     "goal_met": goal, **_insequence(m, b)})
    return rows


def _insequence(fix: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """The in-sequence padding numbers of a fix and its baseline (the goal is judged on prefix padding)."""
    if "insequence" not in fix or "insequence" not in base:
        return {}
    f, b = fix["insequence"], base["insequence"]
    return {"insequence": {"mean_accuracy": f["mean_accuracy"], "max_gap_pp": f["max_gap_pp"],
                           "detected_period": f["detected_period"], "baseline_mean_accuracy": b["mean_accuracy"],
                           "baseline_max_gap_pp": b["max_gap_pp"]}}
