"""Figures of the theory run (docs/science.md section 5): training, concentration, retrieval, the optimum.

`write_theory_figures` draws all four into one directory:

  theory_training.png       loss over training, each head's static p^K(r), p^V(r) (the trajectory of
                            concentration) for the first run, and how often heads collide against rho;
  theory_concentration.png  effective number of offsets (static exp(H(E[p])), per-window E[exp(H(p))])
                            over training, the path in the concentration plane of docs/science.md section 4
                            ending in the lower-left corner (1, 1), and concentration speed against kappa;
  theory_retrieval.png      probability of the correct successor by query position at the trained
                            solution, and at the Theorem 1 optimum against m, S, N and eps;
  theory_optimum.png        every enumerated one-hot assignment, random assignments, smoothing, and the
                            beta scan of Theorem 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from matplotlib.figure import Figure

from phasekv.figures.common import new_figure, save

if TYPE_CHECKING:
    from phasekv.theory.flow import FlowResult

BRANCH = ("K", "V")


def _training(summary: dict, result: FlowResult) -> Figure:
    heads = len(result.static_p[0][0][0])
    stride = len(result.static_p[0][0][0][0])
    fig = new_figure(4.2 * (heads + 2), 3.4)
    axes = fig.subplots(1, heads + 2)
    ax = axes[0]
    runs = list(zip(*result.loss))
    for run in runs[1:]:
        ax.plot(result.steps, run, color="0.8", lw=0.8)
    ax.plot(result.steps, runs[0], color="C0", lw=2, label="run 0")
    ax.axhline(summary["theorem2"]["theorem1_optimum_loss"], color="k", ls="--", lw=1, label="Theorem 1 optimum")
    ax.set(xlabel="step", ylabel="population loss (MC)", title="loss (grey: other seeds)")
    ax.set_xscale("symlog", linthresh=10)
    ax.set_xlim(0, result.steps[-1])
    ax.legend(fontsize=8)
    for h in range(heads):
        ax = axes[h + 1]
        for b, style in zip(range(2), ("-", "--")):
            for r in range(stride):
                ax.plot(result.steps, [p[0][b][h][r] for p in result.static_p], style, color=f"C{r}",
                        label=f"p^{BRANCH[b]}({r})")
        ax.set(xlabel="step", ylabel="E[p] over contexts", ylim=(-0.02, 1.02),
               title=f"run 0, head {h}: r_h = {summary['theorem2']['r_h'][h]}")
        ax.set_xscale("symlog", linthresh=10)
        ax.set_xlim(0, result.steps[-1])
        ax.legend(fontsize=7, ncol=2)
    t2 = summary["theorem2"]
    rows = [{"rho": t2["flow_config"]["rho"], "collision_rate": t2["collision_rate"], "runs": t2["runs"]},
            *t2["rho_sweep"]]
    ax = axes[-1]
    ax.plot([r["rho"] for r in rows], [r["collision_rate"] for r in rows], "o-", label="trained")
    ax.axhline(t2["chance_collision_rate"], color="k", ls=":", label="heads pick uniformly")
    for r in rows:
        ax.annotate(f"n={r['runs']}", (r["rho"], r["collision_rate"]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    ax.set(xscale="log", xlabel="initialization radius rho", ylabel="fraction of runs",
           title="two heads on the same r_h", ylim=(-0.02, max(0.5, t2["chance_collision_rate"] + 0.1)))
    ax.legend(fontsize=8)
    return fig


def _concentration(summary: dict, result: FlowResult) -> Figure:
    heads = len(result.eff_static[0][0][0])
    fig = new_figure(14, 3.8)
    ax1, ax2, ax3 = fig.subplots(1, 3)
    for h in range(heads):
        for b, style in zip(range(2), ("-", "--")):
            static = [e[0][b][h] for e in result.eff_static]
            window = [e[0][b][h] for e in result.eff_window]
            label = f"head {h} {BRANCH[b]}"
            ax1.plot(result.steps, static, style, color=f"C{h}", label=f"{label} static")
            ax1.plot(result.steps, window, style, color=f"C{h}", alpha=0.45, label=f"{label} per-window")
            ax2.plot(static, window, style, color=f"C{h}", marker=".", ms=3, label=label)
            ax2.plot(static[-1], window[-1], "o", color=f"C{h}")
    top = max(max(e[0][b][h] for b in range(2) for h in range(heads)) for e in result.eff_static)
    ax1.set(xlabel="step", ylabel="effective number of offsets", title="concentration over training (run 0)")
    ax1.set_xscale("symlog", linthresh=10)
    ax1.set_xlim(0, result.steps[-1])
    ax1.axhline(1, color="k", lw=0.8)
    ax1.legend(fontsize=6, ncol=2)
    ax2.plot([1, top], [1, top], color="0.6", lw=0.8, ls=":")
    ax2.set(xlabel="static  exp(H(E[p]))", ylabel="per-window  E[exp(H(p))]",
            title="concentration plane (run 0; dot = end)", xlim=(0.9, top + 0.1), ylim=(0.9, top + 0.1))
    ax2.legend(fontsize=7)
    kappa_rows = summary["theorem2"]["kappa_flow"]
    for row in kappa_rows:
        steps = [s for s in row["steps_to_p09"] if s is not None]
        ax3.plot([row["kappa"]] * len(steps), steps, "o", color="C0", alpha=0.6)
    ax3.set(xscale="log", xlabel="kappa (common component)", ylabel="steps until every max E[p] > 0.9",
            title="speed of static concentration")
    ax3.set_xticks([r["kappa"] for r in kappa_rows], [f"{r['kappa']:g}" for r in kappa_rows])
    ax3.minorticks_off()
    return fig


def _retrieval(summary: dict) -> Figure:
    ret = summary["retrieval"]
    fig = new_figure(16, 3.5)
    axes = fig.subplots(1, 4)
    ax = axes[0]
    prob = ret["trained_prob_by_position"]
    covered = set(ret["trained_covered_positions"])
    colors = ["C2" if r in covered else "C3" for r in range(len(prob))]
    ax.bar(range(len(prob)), prob, yerr=[1.96 * s for s in ret["trained_stderr_by_position"]], color=colors)
    ax.plot(range(len(prob)), ret["trained_top1_by_position"], "ko", label="top-1 accuracy")
    ax.axhline(ret["chance"], color="k", ls=":", lw=1, label="1/N")
    ax.set(xlabel="query position r (green: a head covers it)", ylabel="P(correct successor)",
           title="trained gates, run 0", xticks=range(len(prob)), ylim=(0, 1.05))
    ax.legend(fontsize=8)
    for ax, key, label in zip(axes[1:], ("heads", "vocab", "eps"), ("heads m (S = 4)", "vocabulary N", "eps")):
        rows = ret["sweeps"][key]
        xs = [row[key] for row in rows]
        for field, color in (("covered_prob", "C2"), ("uncovered_prob", "C3"), ("mean_prob", "k")):
            pairs = [(x, row[field]) for x, row in zip(xs, rows) if row[field] is not None]
            ax.plot(*zip(*pairs), "o-", color=color, label=field.replace("_prob", ""))
        ax.plot(xs, [row["chance"] for row in rows], ":", color="0.5", label="1/N")
        ax.set(xlabel=label, ylabel="P(correct successor)", title="at the Theorem 1 optimum")
        if key == "vocab":
            ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    return fig


def _optimum(summary: dict, plot: dict) -> Figure:
    t1 = summary["theorem1"]
    fig = new_figure(14, 3.6)
    axes = fig.subplots(1, 3)
    ax = axes[0]
    enumerated = plot["enumerated"].tolist()
    ax.plot(enumerated, color="C0", label="one-hot assignments, sorted")
    ax.axhline(t1["optimal_loss"], color="C2", ls="--", lw=1, label="optimum (adjacent, distinct)")
    ax.axhline(t1["best_nonadjacent_loss"], color="C3", ls=":", lw=1, label="best non-adjacent")
    if t1["best_collided_loss"] is not None:
        ax.axhline(t1["best_collided_loss"], color="C1", ls=":", lw=1, label="best collided")
    ax.set(xlabel="assignment rank", ylabel="context loss", title=f"{t1['n_assignments']} one-hot assignments")
    ax.legend(fontsize=7)
    ax = axes[1]
    ax.hist(plot["random"].tolist(), bins=40, color="0.6", label="random (Dirichlet) p")
    ax.axvline(t1["optimal_loss"], color="C2", ls="--", label="one-hot optimum")
    ax.set(xlabel="context loss", ylabel="count", title="random and smoothed assignments")
    inset = ax.inset_axes([0.55, 0.5, 0.4, 0.4])
    inset.plot(t1["smoothing"], t1["smoothed_loss"], "o-", color="C1", ms=3)
    inset.set_xlabel("mix with uniform t", fontsize=7)
    inset.tick_params(labelsize=6)
    ax.legend(fontsize=7, loc="upper left")
    ax = axes[2]
    scan = t1["beta_scan"]
    ax.plot([r["beta"] for r in scan], [r["one_hot_optimum"] - r["descent_best"] for r in scan], "o-")
    ax.axhline(0, color="k", lw=0.8)
    ax.set(xscale="log", xlabel="beta (unembedding scale)", ylabel="one-hot optimum - best descent",
           title="> 0: a spread assignment beats one-hot")
    ax.set_xticks([r["beta"] for r in scan], [f"{r['beta']:g}" for r in scan])
    ax.minorticks_off()
    return fig


def write_theory_figures(out: str | Path, summary: dict, result: FlowResult, theorem1_plot: dict) -> list[str]:
    """Draw every figure of the theory run into `out` (the module docstring); return their file names.

    `summary` is run_theory's summary, `result` the FlowResult of its first batch of runs (read:
    steps, loss, static_p, eff_static, eff_window) and `theorem1_plot` theorem1_check's plot data
    ("enumerated" and "random" context losses, anything with `.tolist()`)."""
    figures = {"theory_training.png": _training(summary, result),
               "theory_concentration.png": _concentration(summary, result),
               "theory_retrieval.png": _retrieval(summary),
               "theory_optimum.png": _optimum(summary, theorem1_plot)}
    for name, fig in figures.items():
        save(fig, Path(out) / name)
    return list(figures)
