"""report.html: one self-contained page drawn from summary.json alone.

Every figure is redrawn here from the numbers in the summary (the theory figures, which plot
training trajectories that the summary does not hold, are embedded from the theory run), so the
page and summary.json cannot disagree.  Images are embedded as base64 PNG.
"""

from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Any

from phasekv.figures.evaluation import plot_residue_curves
from phasekv.figures.probes import plot_concentration_plane, plot_cycling, plot_gate_profiles, plot_knockout_map

STYLE = """
body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222;line-height:1.45}
table{border-collapse:collapse;margin:1em 0;font-size:14px}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}img{max-width:100%;border:1px solid #eee}
.ok{color:#1a7f37;font-weight:600}.no{color:#c62828;font-weight:600}.note{color:#555;font-size:14px}
figure{margin:1.2em 0}figcaption{font-size:13px;color:#555}
"""


def _img(path: Path, caption: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return (f'<figure><img alt="{html.escape(caption)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(caption)}</figcaption></figure>")


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}"


def _table(models: dict[str, dict[str, Any]], protocol: str) -> str:
    head = ("<tr><th>model</th><th>val loss</th><th>mean %</th><th>worst residue %</th><th>gap pp</th>"
            "<th>gap 95% CI (cross-fit)</th><th>phase gap pp</th><th>period</th><th>flatness p</th>"
            "<th>prompts</th></tr>")
    rows = []
    for name, m in models.items():
        p = m[protocol]
        worst = min(r["accuracy"] for r in p["per_residue"])
        lo, hi = p.get("gap_crossfit_ci_pp", [None, None])
        ci = "n/a" if lo is None else f"[{lo:.1f}, {hi:.1f}]"
        val = "n/a" if m.get("val_loss") is None else f"{m['val_loss']:.3f}"
        rows.append(f"<tr><td>{html.escape(name)}</td><td>{val}</td><td>{_pct(p['mean_accuracy'])}</td>"
                    f"<td>{_pct(worst)}</td><td>{p['max_gap_pp']:.1f}</td><td>{ci}</td>"
                    f"<td>{p['phase_gap_pp']:.1f}</td><td>{p['detected_period']}</td>"
                    f"<td>{p['flatness_p']:.3g}</td><td>{p['n_prompts']}</td></tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def write_report(summary: dict[str, Any], out: str | Path) -> Path:
    """Redraw every figure from `summary` into out/figures and write out/report.html."""
    out = Path(out)
    figs = out / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    models = summary["models"]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>phasekv report</title>"
             f"<style>{STYLE}</style></head><body>",
             "<h1>Phase sensitivity from chunked KV-cache compression: reproduction report</h1>",
             "<p class='note'>Every number on this page is read from summary.json in the same directory, and "
             "every figure is redrawn from it. Accuracy is full-vocabulary top-1 of the answer; residue = target "
             "key position mod 24; phase = position mod S. Gaps are best minus worst residue group (the paper's "
             "definition, biased upward by noise); the cross-fitted gap chooses the groups on half of the "
             "clusters and measures them on the other half.</p>"]

    parts.append("<h2>Findings</h2><table><tr><th>claim (PAPER.md section 6)</th><th>measured</th>"
                 "<th>verdict</th></tr>")
    for f in summary["findings"]:
        verdict = "<span class='ok'>reproduced</span>" if f["holds"] else "<span class='no'>NOT reproduced</span>"
        parts.append(f"<tr><td>{html.escape(f['claim'])}</td><td>{html.escape(f['measured'])}</td>"
                     f"<td>{verdict}</td></tr>")
    parts.append("</table>")

    for protocol in ("prefix", "insequence"):
        parts.append(f"<h2>{protocol} padding</h2>")
        parts.append(_table(models, protocol))
        path = plot_residue_curves({n: m[protocol] for n, m in models.items()}, figs / f"residue_{protocol}.png",
                                   title=f"Accuracy by residue, {protocol} padding (Wilson 95% intervals)")
        parts.append(_img(path, f"Accuracy by target position mod 24, all models, {protocol} padding."))

    parts.append("<h2>Knockouts (mean replacement, prefix padding)</h2>")
    for name, m in models.items():
        if m.get("knockout", {}).get("rows"):
            path = plot_knockout_map(m["knockout"], figs / f"knockout_{name}.png")
            parts.append(_img(path, f"{name}: relative accuracy change per phase when a KV head's query heads "
                                    "are replaced by their calibration mean at the final position."))

    gated = {n: m for n, m in models.items() if m.get("gates")}
    if gated:
        parts.append("<h2>Gate concentration</h2><p class='note'>Effective number of offsets: static = "
                     "exp(H(E[alpha])), per-window = E[exp(H(alpha))]; 1 = one-hot, W = uniform. Vector gates: "
                     "per channel, then averaged.</p>")
        all_gates = [dict(g, layer=f"{n} L{g['layer']}") for n, m in gated.items() for g in m["gates"]]
        parts.append(_img(plot_concentration_plane(all_gates, figs / "concentration_plane.png"),
                          "Concentration plane: one point per gate (model, layer, KV head, branch)."))
        for name, m in gated.items():
            if any(g["kind"] != "uniform" for g in m["gates"]):
                parts.append(_img(plot_gate_profiles(m["gates"], figs / f"gate_profiles_{name}.png"),
                                  f"{name}: mean gate profile over offsets of the most concentrated heads "
                                  "(value gate beside key gate)."))

    cycled = {n: m for n, m in models.items() if m.get("cycling")}
    if cycled:
        parts.append("<h2>Gate cycling (W = S)</h2><table><tr><th>model</th><th>delta</th>"
                     "<th>R&sup2; excl. boundary</th><th>R&sup2; all</th><th>MAE</th></tr>")
        for name, m in cycled.items():
            for row in m["cycling"]["deltas"]:
                r2b, r2 = row.get("r2_excl_boundary"), row.get("r2_all")
                parts.append(f"<tr><td>{html.escape(name)}</td><td>{row['delta']}</td>"
                             f"<td>{'n/a' if r2b is None else f'{r2b:.2f}'}</td>"
                             f"<td>{'n/a' if r2 is None else f'{r2:.2f}'}</td><td>{row['mae']:.3f}</td></tr>")
        parts.append("</table>")
        for name, m in cycled.items():
            parts.append(_img(plot_cycling(m["cycling"], figs / f"cycling_{name}.png"),
                              f"{name}: observed accuracy per phase after cycling the gates by delta, against "
                              "the prediction A_0((r - delta) mod S)."))

    theory = summary.get("theory") or {}
    if theory:
        parts.append("<h2>Theory: the idealized induction model</h2>")
        for name in theory.get("figures", []):
            path = out / "theory" / name
            if path.is_file():
                parts.append(_img(path, f"Theory model: {name}"))
    parts.append(f"<p class='note'>Generated by phasekv reproduce in {summary.get('elapsed_s', 0):.0f} s; "
                 f"settings: {html.escape(str(summary.get('settings')))}.</p></body></html>")
    path = out / "report.html"
    path.write_text("\n".join(parts))
    return path
