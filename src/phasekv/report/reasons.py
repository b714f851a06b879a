"""Why a finding fails or is inconclusive: a measured reason category and a pointer to its evidence.

Every finding of `phasekv.report.findings` that does not hold gets `reason` = {category, because, evidence}: the
category, the measured numbers of this run that put it there, and where the evidence is written up.  The rules are
tried in order and the first that applies wins; each reads only what this run measured (the finding and the
models' summaries), so a rule that does not apply to a run is not given:

    scale                    the model at this size does not have what the claim presupposes: it cannot do the
                             task; every phase the claim looks at is retrieved (as many compressor heads as phases);
                             fewer compressor heads than the phases the claim needs; or a stride with more phases
                             than the model's compressor heads against one with fewer
    recipe                   a training or architecture choice of the bundled model carries the result: full
                             attention whose prefix-padding pattern disappears under in-sequence padding (the layout
                             it was trained on); uniform gates in front of per-offset payload maps (which select
                             offsets by themselves); per-offset payload maps that move the curve when they are
                             cycled with the gates; compressed layers the trained model routes around
    claim not testable here  both models of an ordering at the ceiling (means) or with binary curves (gaps)
    protocol                 the interval spans the threshold: this run's prompts cannot decide
    not diagnosed            none of the above applies: no measured cause in this run
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phasekv.evaluate.verdict import FLATNESS_ALPHA
from phasekv.report.claims import COVERED_PCT, CYCLING_DELTAS_NEEDED, W8S8_COVERED
from phasekv.report.parity import diagnosed

CATEGORIES = ("scale", "recipe", "claim not testable here", "protocol", "not diagnosed")
CEILING_PCT = 98.0  # an ordering of means between two models both above this cannot be tested
BINARY_GAP_PP = 95.0  # a gap above this is a binary curve: phases at ~100% or at chance
READING = "docs/results.md, section 'Reading the demo's findings'"
EVIDENCE = {
    "unable": "checkpoints/README.md, section 'Token-level attention: the recipe that learns the lookup'",
    "unused": "docs/results.md, section 'The transformers architectures and the two model families'",
    "layout": "docs/notes/full1kv.md, section 'Answer'",
    "cycling": "this run's summary.json (models.NAME.cycling.controls) and docs/science.md, section 4 (Gate cycling)",
    "power": "docs/power.md",
}

Reason = tuple[str, str, str] | None  # (category, because, evidence)


def _heads(m: dict[str, Any]) -> int:
    """Compressor heads: layers x KV heads."""
    return m["layers"] * m["kv_heads"]


def _unable(f: dict, models: dict) -> Reason:
    why = f.get("why") or ""
    if why.startswith("inconclusive: cannot do the task"):
        return "scale", why.removeprefix("inconclusive: "), EVIDENCE["unable"]
    return None


def _unused(f: dict, models: dict) -> Reason:
    if (f.get("why") or "").startswith("no verdict: compressed layers unused"):
        return "recipe", "the trained model routes the lookup around its compressed layers (knockouts)", \
            EVIDENCE["unused"]
    return None


def _layout(f: dict, models: dict) -> Reason:
    """Full attention not flat under prefix padding, flat under in-sequence padding."""
    m = models.get(f.get("model"), {})
    if f.get("kind") != "flat" or f["status"] != "fails" or not m.get("insequence"):
        return None
    prefix, inseq = m["prefix"]["flatness_p"], m["insequence"]["flatness_p"]
    if prefix < FLATNESS_ALPHA <= inseq:
        return "recipe", (f"the pattern follows the prefix layout, not the position: flatness p = {prefix:.2g} "
                          f"under prefix padding, {inseq:.2g} under in-sequence padding"), EVIDENCE["layout"]
    return None


def _covered(f: dict, models: dict) -> Reason:
    """A periodicity or within-window claim on a curve whose every phase (of the claim) is retrieved."""
    m = models.get(f.get("model"), {})
    if f.get("kind") not in ("periodic", "spread") or not m.get("prefix"):
        return None
    rows = m["prefix"]["per_phase"]
    rows = rows[:-1] if f["kind"] == "spread" else rows
    worst = min(r["ci_low"] for r in rows)
    if 100 * worst >= COVERED_PCT:
        return "scale", (f"every phase it looks at is retrieved (lowest Wilson bound {100 * worst:.0f}% >= "
                         f"{COVERED_PCT:.0f}%): {_heads(m)} compressor heads for S = {m['stride']} phases"), READING
    return None


def _few_heads(f: dict, models: dict) -> Reason:
    m = models.get(f.get("model"), {})
    if f.get("kind") == "covered" and m and _heads(m) < W8S8_COVERED:
        return "scale", (f"{_heads(m)} compressor heads ({m['layers']} layers x {m['kv_heads']} KV), one phase each; "
                         f"the claim needs {W8S8_COVERED} phases"), READING
    return None


def _ordering(f: dict, models: dict) -> Reason:
    """Orderings at the ceiling or between binary curves, and strides against the head count."""
    if f.get("kind") != "ordering":
        return None
    (a, b), (va, vb) = f["models"], f["values"]
    if f["metric"] == "mean" and min(va, vb) >= CEILING_PCT:
        return "claim not testable here", f"both means at the ceiling ({va:.1f}% and {vb:.1f}%)", READING
    if f["metric"] == "gap" and min(va, vb) >= BINARY_GAP_PP:
        return "claim not testable here", (f"both curves binary (gaps {va:.1f} and {vb:.1f} pp >= "
                                           f"{BINARY_GAP_PP:.0f}: phases at ~100% or at chance)"), READING
    ma, mb = models[a], models[b]
    if f["metric"] == "gap" and ma["stride"] > _heads(ma) and mb["stride"] <= _heads(mb):
        return "scale", (f"{a} has more phases (S = {ma['stride']}) than compressor heads ({_heads(ma)}), {b} does "
                         f"not (S = {mb['stride']}, {_heads(mb)} heads): {a}'s extra phases stay uncovered"), READING
    if f["metric"] == "mean" and ma.get("uniform") and not ma.get("shared_payload"):
        return "recipe", (f"{a}'s uniform gates sit in front of per-offset payload maps, which select offsets by "
                          "themselves: it is not mean pooling"), READING
    return None


def _payload_maps(f: dict, models: dict) -> Reason:
    """Gate-only cycling fails while the payload-map control moves the curve."""
    m = models.get(f.get("model"), {})
    if f.get("kind") != "cycling" or not (m.get("cycling") or {}).get("controls"):
        return None
    rolled = [r.get("status") for r in m["cycling"]["controls"]["rolled_payloads"]["deltas"]]
    moved = rolled.count("moved")
    if moved >= min(CYCLING_DELTAS_NEEDED, len(rolled)) and moved > f["outcome_counts"]["moved"]:
        counts = ", ".join(f"{o} {n}" for o, n in f["outcome_counts"].items() if n)
        return "recipe", (f"the per-offset payload maps carry the phase: cycled with the gates the curve moved in "
                          f"{moved} of {len(rolled)} deltas; the gates alone: {counts}"), EVIDENCE["cycling"]
    return None


def _spans(f: dict, models: dict) -> Reason:
    if f["status"] != "inconclusive":
        return None
    interval, threshold = f.get("interval"), f.get("threshold")
    if interval is not None and threshold is not None:
        return "protocol", (f"this run's prompts cannot decide: the interval [{interval[0]:.1f}, {interval[1]:.1f}] "
                            f"spans {threshold:g}"), EVIDENCE["power"]
    if "span" in (f.get("why") or ""):
        return "protocol", f"this run's prompts cannot decide: {f['why'].removeprefix('inconclusive: ')}", \
            EVIDENCE["power"]
    return None


RULES: tuple[Callable[[dict, dict], Reason], ...] = (diagnosed, _unable, _unused, _layout, _covered, _few_heads,
                                                     _ordering, _payload_maps, _spans)


def reason(f: dict[str, Any], models: dict[str, dict[str, Any]]) -> dict[str, str] | None:
    """{category, because, evidence} of a finding that fails or is inconclusive (module doc); None otherwise."""
    if f["status"] not in ("fails", "inconclusive"):
        return None
    found = next((r for rule in RULES if (r := rule(f, models))), None)
    category, because, evidence = found or ("not diagnosed", "no measured cause in this run", READING)
    return {"category": category, "because": because, "evidence": evidence}


def explained(found: list[dict[str, Any]], models: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The findings, each that fails or is inconclusive with its `reason`."""
    return [{**f, "reason": r} if (r := reason(f, models)) else f for f in found]


def reason_text(f: dict[str, Any]) -> str:
    """'recipe: ... (docs/notes/full1kv.md, section ...)', or '' for a finding without a reason."""
    r = f.get("reason")
    return "" if not r else f"{r['category']}: {r['because']} ({r['evidence']})"
