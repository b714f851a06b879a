"""report.html of `phasekv decide`, drawn from summary.json alone: the verdict table, the figure (decision rate by
phase per condition, Wilson 95% intervals, the uncompressed model's padding-only curve as the dashed baseline) and
the comparison of each compressed condition with the padding alone."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from phasekv.figures.common import new_figure, save
from phasekv.report.html import figure, page, pct


def plot_decision_rates(summary: dict[str, Any], path: Path) -> Path:
    """Decision rate (% deciding the answer) by phase, one line per condition, `none` dashed."""
    fig = new_figure(7.5, 4.0)
    ax = fig.add_subplot()
    for name, result in summary["conditions"].items():
        rows = result["effect"]["per_phase"]
        x = [r["phase"] for r in rows]
        y = [100 * r["rate"] for r in rows]
        err = [[100 * (r["rate"] - r["ci"][0]) for r in rows], [100 * (r["ci"][1] - r["rate"]) for r in rows]]
        ax.errorbar(x, y, yerr=err, capsize=3, marker="o", label=name, linestyle="--" if name == "none" else "-",
                    color="black" if name == "none" else None)
    ax.axhline(100 * summary["chance"], color="grey", linewidth=0.8, linestyle=":", label="chance")
    ax.set_xlabel(f"decision-point phase (position mod {summary['settings']['stride']})")
    ax.set_ylabel("decision rate [% answer]")
    ax.set_ylim(-3, 103)
    ax.set_title(f"{summary['model']}: {summary['set']}, {summary['items']} items x {summary['shifts']} shifts")
    ax.legend(fontsize=8)
    return save(fig, path)


def write_report(summary: dict[str, Any], out: Path) -> Path:
    """OUT/report.html and OUT/figures/decision_rates.png."""
    s = summary["settings"]
    parts = [f"<h1>Decision audit of {html.escape(summary['model'])}</h1>",
             f"<p class='note'>Set {html.escape(str(summary['set']))}: {summary['items']} items, each at "
             f"{summary['shifts']} shifts of meaning-preserving padding (every item at every phase of S = "
             f"{s['stride']} equally often; windows of {s.get('window')} tokens, the last {s.get('local_window')} "
             "raw). Decision = the continuation with the largest summed log-probability; rate = the share of "
             "prompts deciding the item's answer. Statistics cluster by item (within-item permutation, item "
             "bootstrap); flips = shifts off the item's most frequent decision.</p>",
             "<table><tr><th>condition</th><th>rate %</th><th>worst phase %</th><th>contrast pp</th>"
             "<th>cross-fitted pp</th><th>phase p</th><th>flips / item</th><th>verdict</th></tr>"]
    for name, result in summary["conditions"].items():
        e = result["effect"]
        worst = min(r["rate"] for r in e["per_phase"])
        flips = result.get("against_padding", {}).get("flips_mean")
        parts.append(f"<tr><td>{html.escape(name)}</td><td>{pct(e['mean'])}</td><td>{pct(worst)}</td>"
                     f"<td>{e['contrast_pp']:.1f}</td><td>{e['contrast_crossfit_pp']:.1f}</td>"
                     f"<td>{e['phase_p']:.3g}</td><td>{'' if flips is None else f'{flips:.2f}'}</td>"
                     f"<td>{html.escape(result['verdict'])}</td></tr>")
    parts.append("</table>")
    if "scoring" in s:
        parts.append(f"<p class='note'>Served model; continuation scoring: {html.escape(s['scoring'])}.</p>")
    if "comparison" in summary:
        parts.append("<table><tr><th>phase</th><th>decisions alike</th><th>agreement % [95% CI]</th>"
                     "<th>mean |log p difference|</th><th>max</th></tr>")
        for g in [*summary["comparison"]["per_phase"], {**summary["comparison"]["overall"], "phase": "all"}]:
            parts.append(f"<tr><td>{g['phase']}</td><td>{g['agree']}/{g['n']}</td><td>{pct(g['agreement'])} "
                         f"[{pct(g['ci_low'])}, {pct(g['ci_high'])}]</td><td>{g['mean_abs_logp_diff']:.4f}</td>"
                         f"<td>{g['max_abs_logp_diff']:.4f}</td></tr>")
        parts.append("</table><p class='note'>The engine against --reference-hf (the same weights in process), per "
                     "phase of the decision point.</p>")
    path = plot_decision_rates(summary, out / "figures" / "decision_rates.png")
    parts.append(figure(path, "Decision rate by phase per condition (Wilson 95% intervals); dashed: the "
                              "uncompressed model under the same padding shifts (the baseline); dotted: chance."))
    footer = f"<p class='note'>phasekv decide, {summary['elapsed_s']:.0f} s; settings: {html.escape(str(s))}.</p>"
    report = out / "report.html"
    report.write_text(page(f"phasekv decide: {summary['model']}", parts, footer))
    return report
