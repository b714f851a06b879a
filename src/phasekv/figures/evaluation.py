"""Figures of the evaluation (docs/science.md sections 3 and 6): accuracy by residue and the shift sweep.

`plot_accuracy_by_residue`, `plot_residue_curves`, `plot_residue_grid` and `plot_phase_heatmap` read
the dict that `phasekv.evaluate.metrics.summarize` returns (the metrics.json contract);
`plot_cross_phase_heatmap` reads its `cross_phase_table` (the query protocol's source x query phase); `plot_sweep`
reads the sweep.json dict of `phasekv.evaluate.sweep.run_sweep`.  Each writes a PNG (or any format the file
suffix names) and returns its path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.ticker import PercentFormatter

from phasekv.figures.common import new_figure, save

_REQUIRED = ("stride", "residue_modulus", "mean_accuracy", "max_gap_pp", "per_residue")


def plot_accuracy_by_residue(metrics: dict, path: str | Path, title: str | None = None) -> Path:
    """One model's accuracy by residue with Wilson 95% error bars; returns the written path.

    Marks the phase boundaries (multiples of S), the mean, the best and the worst residue group and
    the gap between them with its bootstrap interval (and the cross-fitted gap when present); the
    top axis shows the phase (residue mod S).  The legend sits below the axes so it hides no data.
    """
    x, acc, err, S, R = _curve(metrics)
    fig, ax = _new_axes(R, S)
    ax.errorbar(x, acc, yerr=err, fmt="o-", color="C0", ms=4, lw=1.2, capsize=3, label="accuracy (Wilson 95%)")
    mean = 100 * metrics["mean_accuracy"]
    ax.axhline(mean, color="0.3", ls="--", lw=1, label=f"mean {mean:.1f}%")
    best, worst = int(np.argmax(acc)), int(np.argmin(acc))
    ax.plot(best, acc[best], "^", color="C2", ms=10, label=f"best: residue {best} ({acc[best]:.1f}%)")
    ax.plot(worst, acc[worst], "v", color="C3", ms=10, label=f"worst: residue {worst} ({acc[worst]:.1f}%)")
    ax.hlines(acc[best], best, worst, color="C2", ls=":", lw=1)
    gap_text = f"gap (best - worst) {metrics['max_gap_pp']:.1f} pp"
    if "gap_ci_pp" in metrics:
        gap_text += " [{:.1f}, {:.1f}]".format(*metrics["gap_ci_pp"])
    if metrics.get("gap_crossfit_pp") is not None:
        gap_text += f"; cross-fitted {metrics['gap_crossfit_pp']:.1f} pp"
    ax.vlines(worst, acc[worst], acc[best], color="C3", lw=1.2, label=gap_text)
    ax.annotate("", xy=(worst, acc[best]), xytext=(worst, acc[worst]),
                arrowprops=dict(arrowstyle="<->", color="C3", lw=1.2))
    facts = [f"n = {metrics['n_prompts']} prompts"] if "n_prompts" in metrics else []
    if "detected_period" in metrics:
        facts.append(f"detected period {metrics['detected_period']}")
    if "flatness_p" in metrics:
        facts.append(f"flatness p = {metrics['flatness_p']:.3g}")
    fig.legend(loc="outside lower center", ncols=2, fontsize=8, title=", ".join(facts) or None,
               title_fontsize=8)
    ax.set_title(title or f"Top-1 accuracy by target position mod {R} (stride S = {S})")
    return save(fig, path)


def plot_residue_curves(curves: dict[str, dict], path: str | Path, title: str | None = None) -> Path:
    """Several models' residue curves on one figure (name -> metrics dict); returns the written path.

    All curves must share the residue modulus.  Phase boundaries are drawn when all share the
    stride; the legend gives each model's mean and gap.  Curves are offset slightly along x so
    that their error bars stay apart.
    """
    if not curves:
        raise ValueError("curves is empty: give at least one name -> metrics entry")
    parsed = {name: _curve(m) for name, m in curves.items()}
    moduli = {p[4] for p in parsed.values()}
    if len(moduli) != 1:
        raise ValueError(f"all curves need the same residue_modulus, got {sorted(moduli)}")
    strides = {p[3] for p in parsed.values()}
    R = moduli.pop()
    fig, ax = _new_axes(R, strides.pop() if len(strides) == 1 else None)
    width = 0.3
    for i, (name, (x, acc, err, S, _)) in enumerate(parsed.items()):
        dx = width * (i / max(1, len(parsed) - 1) - 0.5) if len(parsed) > 1 else 0.0
        m = curves[name]
        label = f"{name} (S={S}): mean {100 * m['mean_accuracy']:.1f}%, gap {m['max_gap_pp']:.1f} pp"
        ax.errorbar(x + dx, acc, yerr=err, fmt="o-", color=f"C{i % 10}", ms=3, lw=1.1, capsize=2,
                    label=label)
    fig.legend(loc="outside lower center", ncols=1 if len(parsed) < 4 else 2, fontsize=8)
    ax.set_title(title or f"Top-1 accuracy by target position mod {R}")
    return save(fig, path)


def plot_residue_grid(curves: dict[str, dict], path: str | Path, title: str | None = None,
                      ncols: int = 4) -> Path:
    """Small multiples: one panel per model (name -> metrics dict) of accuracy by residue with Wilson
    95% bars, its mean dashed and its own phase boundaries dotted; returns the written path.

    Panels share both axes, so heights compare across models without a legend to decode.
    """
    if not curves:
        raise ValueError("curves is empty: give at least one name -> metrics entry")
    ncols = min(ncols, len(curves))
    nrows = -(-len(curves) // ncols)
    fig = new_figure(2.6 * ncols + 0.4, 2.1 * nrows + 0.6)
    axes = fig.subplots(nrows, ncols, sharex=True, sharey=True, squeeze=False).ravel()
    for ax, (name, m) in zip(axes, curves.items(), strict=False):
        x, acc, err, S, R = _curve(m)
        ax.errorbar(x, acc, yerr=err, fmt="o-", color="C0", ms=2.5, lw=1, capsize=1.5, elinewidth=0.8)
        ax.axhline(100 * m["mean_accuracy"], color="0.3", ls="--", lw=0.8)
        for boundary in range(S, R, S):
            ax.axvline(boundary - 0.5, color="0.5", ls=":", lw=0.8)
        ax.set_title(f"{name} (S={S}): gap {m['max_gap_pp']:.1f} pp", fontsize=8)
        ax.set(xlim=(-0.7, R - 0.3), ylim=(0, 105))
        ax.set_xticks(range(0, R, max(1, R // 4)))
        ax.tick_params(labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    for ax in axes[len(curves):]:
        ax.set_visible(False)
    axes[0].yaxis.set_major_formatter(PercentFormatter(100))
    fig.supxlabel(f"residue = target key position mod {R} (dotted: window boundaries; dashed: mean)", fontsize=8)
    fig.supylabel("top-1 accuracy", fontsize=8)
    fig.suptitle(title or f"Top-1 accuracy by target position mod {R}, one panel per model", fontsize=10)
    return save(fig, path)


def plot_phase_heatmap(curves: dict[str, dict], path: str | Path, title: str | None = None) -> Path:
    """Accuracy by phase as a models x phases heatmap (name -> metrics dict with `per_phase`); models
    with a smaller stride than the widest leave their extra phases grey; returns the written path."""
    if not curves:
        raise ValueError("curves is empty: give at least one name -> metrics entry")
    width = max(int(m["stride"]) for m in curves.values())
    grid = np.full((len(curves), width), np.nan)  # (models, phases); NaN = the model has no such phase
    for i, m in enumerate(curves.values()):
        for row in m["per_phase"]:
            grid[i, row["phase"]] = 100 * row["accuracy"]
    # at least the axis and colour bar labels' length: a small depth x phase map is otherwise cut at its sides
    fig = new_figure(max(6.5, 1.2 + 0.55 * width + 1.2), max(2.4, 0.9 + 0.32 * len(curves)))
    ax = fig.add_subplot()
    cmap = colormaps["viridis"].with_extremes(bad="0.85")
    image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=100, aspect="auto",
                      interpolation="nearest")
    for (i, j), value in np.ndenumerate(grid):
        if np.isfinite(value):
            ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=7,
                    color="white" if value < 60 else "black")
    ax.set_xticks(range(width))
    ax.set_yticks(range(len(curves)), list(curves), fontsize=8)
    ax.set_xlabel("phase = target key position mod S (grey: beyond the model's S)")
    ax.set_title(title or "Top-1 accuracy by phase [%]", fontsize=10)
    fig.colorbar(image, ax=ax, label="top-1 accuracy [%]")
    return save(fig, path)


def plot_cross_phase_heatmap(cross: dict, path: str | Path, title: str | None = None) -> Path:
    """The cross design (the `cross` dict of `phasekv.evaluate.verdict.cross_phase_table`): accuracy per source
    phase (rows) x query phase (columns) cell, each with its n, and the margins in an extra row and column (the
    corner: all prompts); an empty cell stays grey; returns the written path."""
    if "cells" not in cross or "stride" not in cross:
        raise ValueError("cross dict lacks 'cells' or 'stride'; pass the output of verdict.cross_phase_table")
    S = int(cross["stride"])
    grid = np.full((S + 1, S + 1), np.nan)  # (source phase + margin, query phase + margin), accuracy %
    counts = np.zeros((S + 1, S + 1), dtype=int)
    rows = [(c["phase"], c["query_phase"], c) for c in cross["cells"]]
    rows += [(r["phase"], S, r) for r in cross["per_phase"]]
    rows += [(S, r["query_phase"], r) for r in cross["per_query_phase"]]
    for i, j, c in rows:
        counts[i, j] = c["n"]
        if c["accuracy"] is not None:
            grid[i, j] = 100 * c["accuracy"]
    total = counts[:S, S].sum()
    counts[S, S] = total
    if total:
        grid[S, S] = 100 * sum(r["n_correct"] for r in cross["per_phase"]) / total
    fig = new_figure(max(7.5, 1.6 + 0.62 * (S + 1) + 1.2), 1.2 + 0.5 * (S + 1))  # wide enough for the title
    ax = fig.add_subplot()
    cmap = colormaps["viridis"].with_extremes(bad="0.85")
    image = ax.imshow(np.ma.masked_invalid(grid), cmap=cmap, vmin=0, vmax=100, aspect="auto", interpolation="nearest")
    for (i, j), value in np.ndenumerate(grid):
        if np.isfinite(value):
            ax.text(j, i, f"{value:.0f}\n{counts[i, j]}", ha="center", va="center", fontsize=6.5,
                    color="white" if value < 60 else "black")
    ax.axhline(S - 0.5, color="white", lw=2)
    ax.axvline(S - 0.5, color="white", lw=2)
    ax.set_xticks(range(S + 1), [*map(str, range(S)), "all"])
    ax.set_yticks(range(S + 1), [*map(str, range(S)), "all"])
    ax.set_xlabel(f"query phase = query position (last prompt token) mod {S}")
    ax.set_ylabel(f"source phase = target key position mod {S}")
    ax.set_title(title or "Top-1 accuracy [%] by source and query phase (cell text: accuracy, n)", fontsize=10)
    fig.colorbar(image, ax=ax, label="top-1 accuracy [%]")
    return save(fig, path)


def plot_sweep(result: dict[str, Any], path: str | Path) -> Path:
    """P(a) - P(b) against filler length: rankings coloured, those off the periodic pattern crossed,
    the class means mod the detected period dashed, dotted lines every period; returns the path."""
    rows, p = result["per_length"], result["detected_period"]
    n = np.array([r["filler"] for r in rows])
    diff = np.array([r["diff"] for r in rows])
    fig = new_figure(9, 4.8)
    ax = fig.add_subplot()
    ax.plot(n, diff, "-", color="0.6", lw=1)
    for choice, color in (("a", "C0"), ("b", "C3")):
        mask = np.array([r["choice"] == choice for r in rows])
        if mask.any():
            ax.plot(n[mask], diff[mask], "o", color=color, ms=4, label=f"ranks {result[choice]!r} first")
    off = np.array([r["choice"] != result["pattern"][r["filler"] % p] for r in rows])
    if off.any():
        ax.plot(n[off], diff[off], "x", color="k", ms=9, label=f"disagrees with the period-{p} pattern")
    fit = np.array(result["period_fit"])
    ax.step(n, fit[n % p], where="mid", color="k", ls="--", lw=1, label=f"class means mod {p}")
    for boundary in range(p, int(n[-1]) + 1, p) if p > 1 else ():
        ax.axvline(boundary - 0.5, color="0.5", ls=":", lw=0.8)
    ax.axhline(0, color="0.3", lw=0.8)
    ax.set_xlabel("filler tokens n (dotted lines: every detected period)")
    ax.set_ylabel(f"P({result['a']!r}) - P({result['b']!r})")
    ax.set_title(f"{result['model']}: shift sweep, detected period {p}, "
                 f"{result['agreement']} of {result['n_rankings']} rankings agree with it", fontsize=10)
    fig.legend(loc="outside lower center", ncols=4, fontsize=8)
    return save(fig, path)


def _curve(metrics: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """(residues, accuracy %, Wilson error bars % of shape (2, R), stride, modulus) from a metrics dict."""
    missing = [k for k in _REQUIRED if k not in metrics]
    if missing:
        raise ValueError(f"metrics dict lacks {missing}; pass the output of metrics.summarize")
    rows = sorted(metrics["per_residue"], key=lambda r: r["residue"])
    x = np.array([r["residue"] for r in rows])
    acc = 100 * np.array([r["accuracy"] for r in rows])
    low, high = 100 * np.array([r["ci_low"] for r in rows]), 100 * np.array([r["ci_high"] for r in rows])
    err = np.stack([acc - low, high - acc]).clip(min=0)  # (2, R) below / above
    return x, acc, err, int(metrics["stride"]), int(metrics["residue_modulus"])


def _new_axes(R: int, stride: int | None):
    """Figure with residue x axis, percent y axis, phase boundaries and a phase axis on top."""
    fig = new_figure(9, 5.4)
    ax = fig.add_subplot()
    ax.set_xlim(-0.7, R - 0.3)
    ax.set_ylim(0, 105)
    ax.yaxis.set_major_formatter(PercentFormatter(100))
    ax.set_xticks(range(R))
    ax.set_xlabel(f"residue = target key position mod {R}")
    ax.set_ylabel("top-1 accuracy")
    ax.grid(axis="y", alpha=0.3)
    if stride is not None:
        for boundary in range(stride, R, stride):
            ax.axvline(boundary - 0.5, color="0.5", ls=":", lw=1)
        top = ax.twiny()
        top.set_xlim(ax.get_xlim())
        top.set_xticks(range(R), [str(r % stride) for r in range(R)], fontsize=7)
        top.set_xlabel(f"phase = position mod {stride} (dotted lines: window boundaries)", fontsize=8)
    return fig, ax

