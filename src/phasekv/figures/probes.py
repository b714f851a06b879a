"""Figures of the mechanistic probes (docs/science.md section 4): knockout map, concentration plane, gate
profiles, gate trajectory and gate cycling.

Each function reads the JSON-ready dict (or list) its probe in `phasekv.probes` returns, writes a PNG
and returns its path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.colors import TwoSlopeNorm
from matplotlib.lines import Line2D
from matplotlib.ticker import PercentFormatter

from phasekv.figures.common import new_figure, save

VECTOR_NOTE = "vector gates: effective numbers computed per channel, then averaged over channels"


def _gate_name(g: dict[str, Any]) -> str:
    return f"L{g['layer']} KV{g['kv_head']}"


def _branch_name(g: dict[str, Any]) -> str:
    return "key = value (tied)" if g["tied"] else {"k": "key", "v": "value"}[g["branch"]]


def plot_knockout_map(result: dict[str, Any], path: str | Path) -> Path:
    """Heatmap of 100 (knockout - clean) / clean accuracy: rows (layer, KV head), columns phase."""
    rows, S = result["rows"], result["stride"]
    data = np.array([[np.nan if v is None else v for v in r["per_phase_rel_change_pct"]] for r in rows], dtype=float)
    labels = [f"L{r['layer']}" + (" all heads" if r["kv_head"] is None else f" KV{r['kv_head']}") for r in rows]
    fig = new_figure(max(5.0, 0.8 * S + 3), max(3.0, 0.32 * len(rows) + 2))
    ax = fig.add_subplot()
    finite = data[np.isfinite(data)]
    low, high = -100.0, max(100.0, float(finite.max()) if finite.size else 0.0)  # a loss is at most -100%
    cmap = colormaps["RdBu"].with_extremes(bad="0.85")
    image = ax.imshow(data, cmap=cmap, norm=TwoSlopeNorm(0.0, low, high), aspect="auto", interpolation="nearest")
    if data.size <= 600:
        for (i, j), v in np.ndenumerate(data):
            text = "n/a" if np.isnan(v) else str(round(v))  # an int: no "-0"
            ax.text(j, i, text, ha="center", va="center", fontsize=7,
                    color="white" if v < 0.6 * low or v > 0.6 * high else "black")
    clean = result["clean"]["per_phase"]
    ax.set_xticks(range(S), [f"{r}\n{'n/a' if c is None else f'{100 * c:.0f}%'}" for r, c in enumerate(clean)])
    ax.set_yticks(range(len(rows)), labels, fontsize=8 if len(rows) < 40 else 6)
    ax.set_xlabel(f"phase = target position mod {S} (second line: clean accuracy)")
    ax.set_ylabel("knocked-out heads")
    fig.colorbar(image, ax=ax, label="100 (knockout - clean) / clean  [%]")
    ax.set_title(f"{result['model']}: mean-replacement knockout, {result['protocol']} padding\n"
                 f"{result['n_prompts']} prompts, mean over {result['n_calibration']} calibration prompts; "
                 "grey: clean accuracy 0", fontsize=10)
    return save(fig, path)


def plot_concentration_plane(gates: list[dict[str, Any]], path: str | Path) -> Path:
    """Static vs per-window effective number of offsets, one point per gate, with the diagonal."""
    fig = new_figure(6.4, 6.0)
    ax = fig.add_subplot()
    top = max(g["window"] for g in gates)
    ax.plot([1, top], [1, top], color="0.5", ls="--", lw=1)
    layers = sorted({g["layer"] for g in gates})
    cmap = colormaps["viridis"]
    color = {layer: cmap(k / max(1, len(layers) - 1)) for k, layer in enumerate(layers)}
    marker = {"k": "o", "v": "^"}
    for g in gates:
        ax.scatter(g["static"], g["per_window"], color=color[g["layer"]], marker=marker[g["branch"]], s=40,
                   edgecolor="black", linewidth=0.4, alpha=0.85)
    ax.set_xlim(0.9, top + 0.1)
    ax.set_ylim(0.9, top + 0.1)
    ax.set_aspect("equal")
    ax.set_xlabel("static  exp(H(E[alpha]))  (1 = one offset, W = uniform)")
    ax.set_ylabel("per-window  E[exp(H(alpha))]")
    handles = [Line2D([], [], ls="", marker=marker[b], color="0.4", label=name)
               for b, name in (("k", "key gate"), ("v", "value gate")) if any(g["branch"] == b for g in gates)]
    shown = layers if len(layers) <= 8 else layers[:: max(1, len(layers) // 8)]
    handles += [Line2D([], [], ls="", marker="s", color=color[layer], label=f"layer {layer}") for layer in shown]
    handles.append(Line2D([], [], color="0.5", ls="--", label="diagonal (input-independent gate)"))
    ax.legend(handles=handles, fontsize=7, loc="upper left")
    note = f"\n({VECTOR_NOTE})" if any(g["kind"] == "vector" for g in gates) else ""
    ax.set_title(f"Gate concentration plane: {len(gates)} gates{note}", fontsize=10)
    return save(fig, path)


def plot_gate_profiles(gates: list[dict[str, Any]], path: str | Path, top: int = 4) -> Path:
    """Mean gate weight per offset of the `top` heads whose key gates are most concentrated (lowest
    static number), the value profile beside the key profile."""
    by_head: dict[tuple[int, int], dict[str, dict]] = {}
    for g in gates:
        by_head.setdefault((g["layer"], g["kv_head"]), {})[g["branch"]] = g
    heads = sorted(by_head.values(), key=lambda b: b["k"]["static"])[:max(1, top)]
    cols = max(len(b) for b in heads)
    fig = new_figure(4.2 * cols, 2.3 * len(heads) + 0.6)
    axes = fig.subplots(len(heads), cols, squeeze=False, sharey=True)
    for row, branches in zip(axes, heads):
        for ax, branch in zip(row, ("k", "v")):
            if branch not in branches:
                ax.set_axis_off()
                continue
            g = branches[branch]
            W = len(g["profile"])
            ax.bar(range(W), g["profile"], color="C0" if branch == "k" else "C1")
            ax.axhline(1 / W, color="0.5", ls=":", lw=1)
            ax.set_xticks(range(W))
            ax.set_ylim(0, 1)
            ax.set_title(f"{_gate_name(g)} {_branch_name(g)}: static {g['static']:.2f}, "
                         f"per-window {g['per_window']:.2f}", fontsize=9)
            ax.set_xlabel("offset in window", fontsize=8)
        row[0].set_ylabel("mean gate weight", fontsize=8)
    fig.suptitle(f"Gate profiles of the {len(heads)} most concentrated heads (dotted: uniform 1/W)", fontsize=10)
    return save(fig, path)


def plot_gate_trajectory(result: dict[str, Any], path: str | Path) -> Path:
    """Static and per-window concentration of every gate across the saved steps of a run."""
    fig = new_figure(11, 4.6)
    axes = fig.subplots(1, 2, sharey=True)
    heads = sorted({(g["layer"], g["kv_head"]) for g in result["gates"]})
    cmap = colormaps["tab20" if len(heads) > 10 else "tab10"]
    titles = ("static exp(H(E[alpha]))", "per-window E[exp(H(alpha))]")
    for ax, key, name in zip(axes, ("static", "per_window"), titles):
        for g in result["gates"]:
            k = heads.index((g["layer"], g["kv_head"]))
            ax.plot(result["steps"], g[key], color=cmap(k % cmap.N), ls="-" if g["branch"] == "k" else "--",
                    marker="o", ms=3, lw=1.2, label=f"{_gate_name(g)} {g['branch'].upper()}")
        ax.set_xlabel("training step")
        ax.set_title(name, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("effective number of offsets")
    if len(result["gates"]) <= 24:
        fig.legend(*axes[0].get_legend_handles_labels(), loc="outside right center", fontsize=7,
                   title="solid K, dashed V", title_fontsize=7)
    fig.suptitle(f"Gate concentration across training: {result['run']}", fontsize=10)
    return save(fig, path)


def plot_cycling(result: dict[str, Any], path: str | Path) -> Path:
    """Per delta: observed per-phase accuracy after cycling vs the prediction A_0((r - delta) mod S);
    the last panel shows R^2 (excluding the boundary phase and all phases) against delta.

    The boundary phases `result["boundary_phases"]` (default [S - 1]) are shaded in every panel."""
    rows, S = result["deltas"], result["stride"]
    boundaries = [int(b) for b in result.get("boundary_phases", [S - 1])]
    cols = 4
    n_rows = (len(rows) + 1 + cols - 1) // cols
    fig = new_figure(3.4 * cols, 2.9 * n_rows + 0.6)
    axes = fig.subplots(n_rows, cols, squeeze=False).ravel()
    for ax, row in zip(axes, rows):
        _cycling_panel(ax, row, S, boundaries)
    axes[0].legend(fontsize=7, loc="lower left")
    _cycling_summary(axes[len(rows)], rows)
    for ax in axes[len(rows) + 1:]:
        ax.set_axis_off()
    shaded = f"boundary phase{'' if len(boundaries) == 1 else 's'} {', '.join(map(str, boundaries)) or 'none'}"
    fig.suptitle(f"{result['model']}: gate cycling (S = {S}, shaded: {shaded}), "
                 f"{result['protocol']} padding, {result['n_prompts']} prompts", fontsize=10)
    return save(fig, path)


def _cycling_panel(ax, row: dict[str, Any], S: int, boundaries: list[int]) -> None:
    """One delta: predicted and observed accuracy per phase, the boundary phases shaded."""
    phases = np.arange(S)
    ax.plot(phases, 100 * np.array(row["predicted"]), "s--", color="0.5", ms=4, label="predicted A0((r-d) mod S)")
    ax.plot(phases, 100 * np.array(row["observed"]), "o-", color="C0", ms=4, label="observed")
    for b in boundaries:
        ax.axvspan(b - 0.5, b + 0.5, color="C3", alpha=0.1)
    r2 = row["r2_excl_boundary"]
    outcome = f"{row['status']}, " if row.get("status") else ""
    ax.set_title(f"delta {row['delta']:+d}: {outcome}R2 {'n/a' if r2 is None else f'{r2:.2f}'} excl. boundary, "
                 f"MAE {100 * row['mae']:.1f} pp", fontsize=8)
    ax.set_xticks(phases)
    ax.set_ylim(0, 105)
    ax.yaxis.set_major_formatter(PercentFormatter(100))
    ax.set_xlabel("phase r", fontsize=8)


def _cycling_summary(ax, rows: list[dict[str, Any]]) -> None:
    """R^2 of the prediction, excluding the boundary and over all phases, against delta."""
    deltas = [r["delta"] for r in rows]
    for key, style, label in (("r2_excl_boundary", "o-", "R2 excl. boundary"), ("r2_all", "s--", "R2 all phases")):
        ax.plot(deltas, [np.nan if r[key] is None else r[key] for r in rows], style, label=label)
    ax.set_xlabel("delta")
    ax.set_title("fit of the prediction", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
