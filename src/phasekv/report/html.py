"""report.html: one self-contained page drawn from summary.json alone.

Every figure is redrawn here from the numbers in the summary (the theory figures, which plot
training trajectories that the summary does not hold, are embedded from the theory run), so the
page and summary.json cannot disagree.  Images are embedded as base64 PNG, each with alt text that
states what it shows.  The page reads top-down: the findings table, one line per model, the
phase-by-model heatmap, then per protocol a table and one small residue panel per model, then the
probes.  Every section is an <h2> with an id (`SECTIONS`), which the browser test checks.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path
from typing import Any

from phasekv.figures.evaluation import plot_phase_heatmap, plot_residue_grid
from phasekv.figures.probes import plot_concentration_plane, plot_cycling, plot_gate_profiles, plot_knockout_map
from phasekv.report.claims import count_line
from phasekv.report.reasons import reason_text

STYLE = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222;line-height:1.45}
table{border-collapse:collapse;margin:1em 0;font-size:14px}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%;border:1px solid #eee}
.ok{color:#1a7f37;font-weight:600}.no{color:#c62828;font-weight:600}.note{color:#555;font-size:14px}
figure{margin:1.2em 0}figcaption{font-size:13px;color:#555}ul.models{font-size:14px;padding-left:1.2em}
table.findings td,table.findings th{text-align:left}
figure.headline img{max-height:calc(100vh - 240px);width:auto}
"""
# the sections every report has, in page order (id -> heading); the probes' sections follow when measured
SECTIONS = {"phase-heatmap": "Accuracy by phase, every model and its verdict (prefix padding)", "findings": "Findings",
            "models": "Models at a glance (prefix padding)", "prefix": "prefix padding",
            "insequence": "insequence padding"}
THEORY_ALT = {
    "theory_training.png": "Theory model training: population loss over steps for every seed, the key and value "
                           "gate positions r_h each head settles on, and how often two heads collide.",
    "theory_concentration.png": "Theory model: effective number of offsets falling to one over training, the "
                                "concentration plane and the speed of static concentration.",
    "theory_retrieval.png": "Theory model: probability of the correct successor per position for trained gates "
                            "and at the Theorem 1 optimum, against chance.",
    "theory_optimum.png": "Theory model: context loss of every one-hot gate assignment by rank, random and "
                          "smoothed assignments, and where a spread assignment would beat one-hot.",
}



def _h2(key: str, text: str) -> str:
    return f"<h2 id='{key}'>{html.escape(text)}</h2>"


def figure(path: Path, caption: str, alt: str | None = None, headline: bool = False) -> str:
    """A figure with the PNG embedded; `alt` (default: the caption) is what a reader without it gets.  `headline`:
    the page's first figure, scaled down (never up) to fit the first screen below the title (a heatmap of many
    models is taller than a screen)."""
    data = base64.b64encode(path.read_bytes()).decode()
    return (f'<figure{" class=headline" if headline else ""}><img alt="{html.escape(alt or caption)}" '
            f'src="data:image/png;base64,{data}"><figcaption>{html.escape(caption)}</figcaption></figure>')


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}"


def _table(models: dict[str, dict[str, Any]], protocol: str) -> str:
    head = ("<tr><th>model</th><th>val loss</th><th>mean %</th><th>worst residue %</th><th>gap pp</th>"
            "<th>gap 95% CI (cross-fit)</th><th>phase gap pp</th><th>period</th><th>flatness p</th>"
            "<th>prompts</th><th>verdict</th></tr>")
    rows = []
    for name, m in models.items():
        p = m[protocol]
        worst = min(r["accuracy"] for r in p["per_residue"])
        lo, hi = p.get("gap_crossfit_ci_pp", [None, None])
        ci = "n/a" if lo is None else f"[{lo:.1f}, {hi:.1f}]"
        val = "n/a" if m.get("val_loss") is None else f"{m['val_loss']:.3f}"
        rows.append(f"<tr><td>{html.escape(name)}</td><td>{val}</td><td>{pct(p['mean_accuracy'])}</td>"
                    f"<td>{pct(worst)}</td><td>{p['max_gap_pp']:.1f}</td><td>{ci}</td>"
                    f"<td>{p['phase_gap_pp']:.1f}</td><td>{p['detected_period']}</td>"
                    f"<td>{p['flatness_p']:.3g}</td><td>{p['n_prompts']}</td>"
                    f"<td>{html.escape(p.get('verdict', 'n/a'))}</td></tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def model_figures(name: str, m: dict[str, Any], figs: Path) -> dict[str, str]:
    """Draw the figures of one model's probes into `figs` (knockout map, gate profiles, cycling; those it has):
    {kind: path}.  They need nothing but the model's own summary entry, so `reproduce` draws them in a worker
    as soon as the model is analysed."""
    drawn = {}
    if m.get("knockout", {}).get("rows"):
        drawn["knockout"] = str(plot_knockout_map(m["knockout"], figs / f"knockout_{name}.png"))
    if any(g["kind"] != "uniform" for g in m.get("gates") or []):
        drawn["gate_profiles"] = str(plot_gate_profiles(m["gates"], figs / f"gate_profiles_{name}.png"))
    if m.get("cycling"):
        drawn["cycling"] = str(plot_cycling(m["cycling"], figs / f"cycling_{name}.png"))
    return drawn


def write_report(summary: dict[str, Any], out: str | Path, drawn: dict[str, dict[str, str]] | None = None) -> Path:
    """Redraw every figure from `summary` into out/figures and write out/report.html.  `drawn`: the per-model
    figures already drawn into out/figures by `model_figures` (model name -> {kind: path}); the others are drawn
    here."""
    out = Path(out)
    figs = out / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    models = summary["models"]
    drawn = {name: (drawn or {}).get(name) or model_figures(name, m, figs) for name, m in models.items()}
    glance, heatmap = _glance(models, figs)
    # the headline picture first (every model's accuracy by phase, each with its verdict), then the findings
    parts = ["<h1>Phase sensitivity from chunked KV-cache compression: reproduction report</h1>", *heatmap]
    parts += _findings(summary["findings"])
    parts.append("<p class='note'>Every number on this page is read from summary.json in the same directory, and "
                 "every figure is redrawn from it. Accuracy is full-vocabulary top-1 of the answer; residue = target "
                 "key position mod 24; phase = position mod S. Gaps are best minus worst residue group (the paper's "
                 "definition, biased upward by noise); the cross-fitted gap chooses the groups on half of the "
                 "clusters and measures them on the other half.</p>")
    parts += _fixes(summary.get("fixes") or [])
    parts += glance
    parts += _protocols(models, figs)
    parts += _knockouts(models, drawn)
    parts += _gates(models, figs, drawn)
    parts += _cycling(models, drawn)
    parts += _theory(summary.get("theory") or {}, out)
    footer = (f"<p class='note'>Generated by phasekv reproduce in {summary.get('elapsed_s', 0):.0f} s; "
              f"settings: {html.escape(str(summary.get('settings')))}.</p>")
    path = out / "report.html"
    path.write_text(page("phasekv report", parts, footer))
    return path


def page(title: str, body: list[str], footer: str) -> str:
    """The HTML page of a report (`phasekv reproduce`'s and `phasekv audit`'s): `title` (escaped here), the `body`
    parts and a closing `footer` paragraph, one part per line."""
    head = (f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>")
    return "\n".join([head, *body, f"{footer}</body></html>"])


def _findings(findings: list[dict[str, Any]]) -> list[str]:
    parts = [_h2("findings", SECTIONS["findings"]), f"<p>{html.escape(count_line(findings))}.</p>",
             "<table class='findings'><tr><th>claim (docs/science.md section 6)</th><th>paper</th><th>measured</th>"
             "<th>rule</th><th>verdict</th></tr>"]
    style = {"holds": "ok", "fails": "no", "inconclusive": "note", "not measured": "note"}
    for f in findings:
        status = f["status"]
        text = f.get("why", status) if status == "inconclusive" else status
        parts.append(f"<tr><td>{html.escape(f['claim'])}</td><td>{html.escape(f.get('paper', ''))}</td>"
                     f"<td>{html.escape(f['measured'])}</td><td>{html.escape(f.get('rule', ''))}</td>"
                     f"<td><span class='{style[status]}'>{html.escape(text)}</span>"
                     + (f"<br>why: {html.escape(reason_text(f))}" if f.get("reason") else "") + "</td></tr>")
    return [*parts, "</table>"]


def _short_verdict(p: dict[str, Any]) -> str:
    """'phase sensitive', 'no phase effect detected' or 'cannot do the task': the verdict before its numbers."""
    return re.split(r"[:(]", p.get("verdict", "n/a"))[0].strip()


def _glance(models: dict[str, Any], figs: Path) -> tuple[list[str], list[str]]:
    """One line per model (prefix padding: mean, chance, gap, period, verdict), and the phase heatmap (each row
    labelled with the model's verdict): the report's headline."""
    lines = []
    for name, m in models.items():
        p = m["prefix"]
        lines.append(f"<li><b>{html.escape(name)}</b>: mean {pct(p['mean_accuracy'])}% (in-context chance "
                     f"{pct(p.get('in_context_chance'))}%), gap {p['max_gap_pp']:.1f} pp, period "
                     f"{p['detected_period']} (S = {p['stride']}): {html.escape(_short_verdict(p))}</li>")
    curves = {f"{n}: {_short_verdict(m['prefix'])}": m["prefix"] for n, m in models.items()}
    strong = {n: [str(r["phase"]) for r in p["per_phase"] if r["accuracy"] >= 0.5] for n, p in curves.items()}
    cells = "; ".join(f"{n}: {', '.join(v) or 'none'}" for n, v in strong.items())
    heatmap = figure(plot_phase_heatmap(curves, figs / "phase_heatmap.png"),
                   "Top-1 accuracy by phase (position mod S), one row per model, prefix padding; grey cells lie "
                   "beyond a model's stride S.",
                   alt=f"Heatmap of accuracy by phase, rows models, columns phases. Phases at 50% or more: {cells}.",
                   headline=True)
    return ([_h2("models", SECTIONS["models"]), f"<ul class='models'>{''.join(lines)}</ul>"],
            [_h2("phase-heatmap", SECTIONS["phase-heatmap"]), heatmap])


def _protocols(models: dict[str, Any], figs: Path) -> list[str]:
    parts = []
    for protocol in ("prefix", "insequence"):
        curves = {n: m[protocol] for n, m in models.items()}
        path = plot_residue_grid(curves, figs / f"residue_{protocol}.png",
                                 title=f"Accuracy by residue, {protocol} padding (Wilson 95% intervals)")
        alt = "; ".join(f"{n}: mean {pct(p['mean_accuracy'])}%, gap {p['max_gap_pp']:.1f} pp, worst residue "
                        f"{p.get('worst_residue', 'n/a')}" for n, p in curves.items())
        parts += [_h2(protocol, SECTIONS[protocol]), _table(models, protocol),
                  figure(path, f"Accuracy by target position mod 24, one panel per model, {protocol} padding "
                             "(dotted: window boundaries; dashed: the model's mean).",
                       alt=f"Small multiples of accuracy by residue, {protocol} padding. {alt}.")]
    return parts


def _knockouts(models: dict[str, Any], drawn: dict[str, dict[str, str]]) -> list[str]:
    knocked = {n: m["knockout"] for n, m in models.items() if m.get("knockout", {}).get("rows")}
    if not knocked:
        return []
    parts = [_h2("knockouts", "Knockouts (mean replacement, prefix padding)")]
    for name, knockout in knocked.items():
        path = Path(drawn[name]["knockout"])
        heads = "; ".join(f"layer {r['layer']} KV head {r['kv_head']}: "
                          + ("n/a" if r["mean_rel_change_pct"] is None else f"{r['mean_rel_change_pct']:.0f}%")
                          for r in knockout["rows"])  # None: clean accuracy 0, no relative change
        parts.append(figure(path, f"{name}: relative accuracy change per phase when a KV head's query heads "
                                "are replaced by their calibration mean at the final position.",
                          alt=f"{name}: knockout heatmap, KV heads by phase. Mean accuracy change per head: "
                              f"{heads}."))
    return parts


def _gates(models: dict[str, Any], figs: Path, drawn: dict[str, dict[str, str]]) -> list[str]:
    gated = {n: m for n, m in models.items() if m.get("gates")}
    if not gated:
        return []
    parts = [_h2("gates", "Gate concentration"), "<p class='note'>Effective number of offsets: static = "
             "exp(H(E[alpha])), per-window = E[exp(H(alpha))]; 1 = one-hot, W = uniform. Vector gates: "
             "per channel, then averaged.</p>"]
    all_gates = [dict(g, layer=f"{n} L{g['layer']}") for n, m in gated.items() for g in m["gates"]]
    parts.append(figure(plot_concentration_plane(all_gates, figs / "concentration_plane.png"),
                      "Concentration plane: one point per gate (model, layer, KV head, branch)."))
    for name in gated:
        if "gate_profiles" in drawn[name]:
            parts.append(figure(Path(drawn[name]["gate_profiles"]),
                              f"{name}: mean gate profile over offsets of the most concentrated heads "
                              "(value gate beside key gate)."))
    return parts


def _cycling(models: dict[str, Any], drawn: dict[str, dict[str, str]]) -> list[str]:
    cycled = {n: m for n, m in models.items() if m.get("cycling")}
    if not cycled:
        return []
    parts = [_h2("cycling", "Gate cycling (W = S)"), "<table><tr><th>model</th><th>delta</th>"
             "<th>outcome</th><th>R&sup2; excl. boundary</th><th>R&sup2; all</th><th>MAE</th></tr>"]
    for name, m in cycled.items():
        for row in m["cycling"]["deltas"]:
            r2b, r2 = row.get("r2_excl_boundary"), row.get("r2_all")
            parts.append(f"<tr><td>{html.escape(name)}</td><td>{row['delta']}</td>"
                         f"<td>{html.escape(row.get('status') or '-')}</td>"
                         f"<td>{'n/a' if r2b is None else f'{r2b:.2f}'}</td>"
                         f"<td>{'n/a' if r2 is None else f'{r2:.2f}'}</td><td>{row['mae']:.3f}</td></tr>")
    parts.append("</table>")
    for name in cycled:
        parts.append(figure(Path(drawn[name]["cycling"]),
                          f"{name}: observed accuracy per phase after cycling the gates by delta, against "
                          "the prediction A_0((r - delta) mod S)."))
    return parts


def _theory(theory: dict[str, Any], out: Path) -> list[str]:
    if not theory:
        return []
    parts = [_h2("theory", "Theory: the idealized induction model")]
    for name in theory.get("figures", []):
        path = out / "theory" / name
        if path.is_file():
            parts.append(figure(path, f"Theory model: {name}", alt=THEORY_ALT.get(name)))
    return parts


def _fixes(rows: list[dict[str, Any]]) -> list[str]:
    """The fixes table (beyond the paper): each fix beside its baseline at (nearly) equal cache bytes."""
    if not rows:
        return []
    parts = [_h2("fixes", "Fixes (beyond the paper)") + "<table><tr><th>fix</th><th>baseline</th><th>cache bytes/token "
             "(fix / baseline)</th><th>mean % [95% CI]</th><th>worst phase %</th><th>gap pp [95% CI]</th>"
             "<th>period</th><th>flatness p</th><th>goal met</th><th>in-sequence gap pp (fix / baseline)</th></tr>"]
    for r in rows:
        ci, gci = r["mean_ci"], r["gap_ci_pp"]
        goal = "<span class='ok'>yes</span>" if r["goal_met"] else "<span class='no'>no</span>"
        parts.append(f"<tr><td>{html.escape(r['name'])}</td><td>{html.escape(r['baseline'])}</td>"
                     f"<td>{r['cache_bytes_per_token']} / {r['baseline_cache_bytes_per_token']}</td>"
                     f"<td>{100 * r['mean_accuracy']:.1f} [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}]</td>"
                     f"<td>{100 * r['worst_phase_accuracy']:.1f}</td>"
                     f"<td>{r['max_gap_pp']:.1f} [{gci[0]:.1f}, {gci[1]:.1f}]</td><td>{r['detected_period']}</td>"
                     f"<td>{r['flatness_p']:.3g}</td><td>{goal}</td><td>{_insequence_gaps(r)}</td></tr>")
    return [*parts, "</table><p class='note'>Goal: gap at most a third of the baseline's, mean no lower than the "
            "baseline's lower interval bound, cache bytes within 5%.</p>"]


def _insequence_gaps(row: dict[str, Any]) -> str:
    ins = row.get("insequence")
    return "-" if not ins else f"{ins['max_gap_pp']:.1f} / {ins['baseline_max_gap_pp']:.1f}"


def query_phase_table(conditions: dict[str, dict[str, Any]]) -> str:
    """The query protocol's query-phase statistics, one row per condition (name -> the query protocol's metrics,
    with `query_phase` and `cross`): mean, worst query phase, gap, its selection-free interval, period, flatness p,
    the worst relative phase and the verdict (the same three-part rule as the source phase's)."""
    head = ("<tr><th>condition</th><th>mean %</th><th>worst query phase %</th><th>query-phase gap pp</th>"
            "<th>gap 95% CI (cross-fit)</th><th>period</th><th>flatness p</th><th>worst relative phase %</th>"
            "<th>verdict (query phase)</th></tr>")
    rows = []
    for name, m in conditions.items():
        q = m["query_phase"]
        ci = q.get("gap_crossfit_ci_pp")
        worst_relative = min(r["accuracy"] for r in m["cross"]["per_relative_phase"] if r["accuracy"] is not None)
        rows.append(f"<tr><td>{html.escape(name)}</td><td>{pct(q['mean_accuracy'])}</td>"
                    f"<td>{pct(min(r['accuracy'] for r in q['per_phase']))}</td><td>{q['max_gap_pp']:.1f}</td>"
                    f"<td>{'n/a' if ci is None else f'[{ci[0]:.1f}, {ci[1]:.1f}]'}</td>"
                    f"<td>{q['detected_period']}</td><td>{q['flatness_p']:.3g}</td><td>{pct(worst_relative)}</td>"
                    f"<td>{html.escape(q['verdict'])}</td></tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def comparison_table(comparison: dict[str, dict[str, Any]]) -> str:
    """Engine vs reference (`phasekv.evaluate.served`, protocol -> comparison): per protocol the overall, per
    source phase and per query phase agreement of the greedy tokens with Wilson 95% intervals, both accuracies,
    and the mean and largest absolute log-probability difference of the engine's token."""
    head = ("<tr><th>protocol</th><th>group</th><th>prompts</th><th>agreement %</th><th>95% CI</th>"
            "<th>engine / reference accuracy %</th><th>mean |d log p|</th><th>max |d log p|</th></tr>")
    rows = []
    for protocol, c in comparison.items():
        groups = [("all", c["overall"])] + [(f"source phase {g['phase']}", g) for g in c["per_phase"]]
        groups += [(f"query phase {g['query_phase']}", g) for g in c["per_query_phase"]]
        for label, g in groups:
            dlogp = ["n/a" if g[k] is None else f"{g[k]:.3f}" for k in ("mean_abs_dlogp", "max_abs_dlogp")]
            rows.append(f"<tr><td>{html.escape(protocol)}</td><td>{label}</td><td>{g['n']}</td>"
                        f"<td>{pct(g['agreement'])}</td><td>[{pct(g['ci_low'])}, {pct(g['ci_high'])}]</td>"
                        f"<td>{pct(g['engine_accuracy'])} / {pct(g['reference_accuracy'])}</td>"
                        f"<td>{dlogp[0]}</td><td>{dlogp[1]}</td></tr>")
    return f"<table>{head}{''.join(rows)}</table>"
