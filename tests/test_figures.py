"""phasekv.figures: a leaf layer with one writer, and every public figure drawn once from small inputs."""

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from matplotlib.image import imread

import phasekv
from phasekv import figures
from phasekv.evaluate.metrics import summarize
from phasekv.figures import (
    plot_accuracy_by_residue,
    plot_concentration_plane,
    plot_cycling,
    plot_gate_profiles,
    plot_gate_trajectory,
    plot_knockout_map,
    plot_phase_heatmap,
    plot_residue_curves,
    plot_residue_grid,
    plot_sweep,
    write_theory_figures,
)
from tests.test_metrics import phase_curve, shifted_records

SRC = Path(phasekv.__file__).parent
PNG = b"\x89PNG\r\n\x1a\n"


def is_png(path: Path) -> bool:
    data = Path(path).read_bytes()
    return data[:8] == PNG and len(data) > 5_000


# ----------------------------------------------------------------------------- structure


def _runtime_imports(tree: ast.Module) -> list[tuple[str, int]]:
    """(module, relative level) of every import outside `if TYPE_CHECKING:` blocks."""
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((alias.name, 0) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module or "", node.level))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_figures_import_nothing_else_of_phasekv():
    files = sorted((SRC / "figures").glob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "common.py", "evaluation.py", "probes.py", "theory.py"}
    bad = []
    for file in files:
        for module, level in _runtime_imports(ast.parse(file.read_text())):
            outside = level > 1 or (level == 0 and module.split(".")[0] == "phasekv"
                                    and not (module + ".").startswith("phasekv.figures."))
            if outside:
                bad.append(f"{file.name}: {'.' * level}{module}")
    assert not bad, f"phasekv.figures must not import the rest of phasekv: {bad}"


def test_one_save_helper_in_the_package():
    pattern = re.compile(r"\bdef save\(|\.savefig\(")
    hits = [(path.relative_to(SRC).as_posix(), match.group())
            for path in sorted(SRC.rglob("*.py")) for match in pattern.finditer(path.read_text())]
    assert hits == [("figures/common.py", "def save("), ("figures/common.py", ".savefig(")]


# ----------------------------------------------------------------------------- evaluation


def test_residue_plots_write_png(tmp_path):
    a = summarize(shifted_records(phase_curve(8, fail=(7,)), 40, seed=0), stride=8, n_boot=100, n_perm=100)
    b = summarize(shifted_records(phase_curve(4, fail=(1,)), 40, seed=1), stride=4, n_boot=100, n_perm=100)
    for path in (plot_accuracy_by_residue(a, tmp_path / "one.png"),
                 plot_residue_curves({"W8/S8": a, "W4/S4": b}, tmp_path / "sub" / "many.png")):
        assert is_png(path)
    with pytest.raises(ValueError, match="residue_modulus"):
        plot_residue_curves({"a": a, "b": {**b, "residue_modulus": 12}}, tmp_path / "bad.png")


def _grey_pixels(path: Path) -> int:
    """Pixels of the heatmap's 'no such phase' grey (0.85)."""
    rgb = imread(path)[..., :3]  # (H, W, 3)
    return int((np.abs(rgb - 0.85) < 0.01).all(axis=-1).sum())


def test_small_multiples_and_phase_heatmap(tmp_path):
    """One panel per model; in the heatmap a model with a smaller stride leaves its extra phases grey."""
    a = summarize(shifted_records(phase_curve(8, fail=(7,)), 20, seed=0), stride=8, n_boot=50, n_perm=50)
    b = summarize(shifted_records(phase_curve(4, fail=(1,)), 20, seed=1), stride=4, n_boot=50, n_perm=50)
    curves = {f"m{i}": m for i, m in enumerate([a, b, a, b, a])}  # 5 panels: a 4 x 2 grid, 3 hidden
    assert is_png(plot_residue_grid(curves, tmp_path / "grid.png"))
    assert _grey_pixels(plot_phase_heatmap({"a": a, "b": b}, tmp_path / "mixed.png")) > 2_000
    assert _grey_pixels(plot_phase_heatmap({"a": a, "a2": a}, tmp_path / "same.png")) < 200
    for plot in (plot_residue_grid, plot_phase_heatmap):
        with pytest.raises(ValueError, match="empty"):
            plot({}, tmp_path / "none.png")


def test_sweep_plot_writes_png(tmp_path):
    choices = ["a", "a", "b", "b"] * 4
    choices[5] = "a"  # one length off the pattern
    rows = [{"filler": n, "diff": 0.3 if c == "a" else -0.3, "choice": c} for n, c in enumerate(choices)]
    result = {"per_length": rows, "detected_period": 4, "pattern": ["a", "a", "b", "b"],
              "period_fit": [0.3, 0.3, -0.3, -0.15], "a": "8", "b": "32", "model": "synthetic",
              "agreement": 15, "n_rankings": 16}
    assert is_png(plot_sweep(result, tmp_path / "sweep.png"))


# ----------------------------------------------------------------------------- probes


def _gates(window: int = 4) -> list[dict]:
    """Two layers x one KV head x (K, V) gates in the gate_statistics format."""
    rng = np.random.default_rng(0)
    gates = []
    for layer in range(2):
        for branch in ("k", "v"):
            profile = rng.dirichlet(np.ones(window))
            gates.append({"layer": layer, "kv_head": 0, "branch": branch, "kind": "vector" if layer else "scalar",
                          "window": window, "tied": False, "n_windows": 40, "static": 1 + 2.5 * rng.random(),
                          "per_window": 1 + rng.random(), "profile": profile.tolist()})
    return gates


def test_probe_plots_write_png(tmp_path):
    S = 4
    knockout = {"model": "synthetic", "protocol": "prefix", "stride": S, "n_prompts": 64, "n_calibration": 16,
                "clean": {"per_phase": [0.5, 0.75, None, 0.25]},
                "rows": [{"layer": 0, "kv_head": 0, "per_phase_rel_change_pct": [-50.0, 10.0, None, 0.0]},
                         {"layer": 1, "kv_head": None, "per_phase_rel_change_pct": [-100.0, 150.0, None, -20.0]}]}
    assert is_png(plot_knockout_map(knockout, tmp_path / "knockout.png"))
    assert is_png(plot_concentration_plane(_gates(), tmp_path / "plane.png"))
    assert is_png(plot_gate_profiles(_gates(), tmp_path / "profiles.png", top=2))
    trajectory = {"run": "synthetic", "steps": [0, 10, 20],
                  "gates": [{**{k: g[k] for k in ("layer", "kv_head", "branch", "kind")},
                             "static": [4.0, 3.0, g["static"]], "per_window": [4.0, 2.0, g["per_window"]]}
                            for g in _gates()]}
    assert is_png(plot_gate_trajectory(trajectory, tmp_path / "trajectory.png"))


def _cycling(**extra) -> dict:
    S = 4
    clean = np.array([0.9, 0.8, 0.7, 0.1])
    rows = [{"delta": d, "observed": np.roll(clean, d).tolist(), "predicted": np.roll(clean, d).tolist(),
             "r2_excl_boundary": 1.0 if d else None, "r2_all": 1.0, "mae": 0.0} for d in (-1, 0, 1)]
    return {"model": "synthetic", "protocol": "prefix", "stride": S, "n_prompts": 64, "deltas": rows, **extra}


@pytest.mark.parametrize("extra, boundaries, title", [
    ({}, [3], "shaded: boundary phase 3)"),  # results written before boundary_phases existed
    ({"boundary_phases": [1, 3]}, [1, 3], "shaded: boundary phases 1, 3)"),
])
def test_cycling_plot_shades_every_boundary_phase(extra, boundaries, title, tmp_path, monkeypatch):
    drawn = []

    def keep(fig, path):
        drawn.append(fig)
        return figures.common.save(fig, path)

    monkeypatch.setattr(figures.probes, "save", keep)
    assert is_png(plot_cycling(_cycling(**extra), tmp_path / "cycling.png"))
    fig = drawn[0]
    assert title in fig._suptitle.get_text()
    for ax in fig.axes[:3]:  # one panel per delta; axvspan adds one patch per boundary phase
        spans = sorted(round(p.get_x() + p.get_width() / 2) for p in ax.patches)
        assert spans == boundaries


# ----------------------------------------------------------------------------- theory


def _theory_inputs():
    """Synthetic summary, FlowResult-like trajectories and Theorem 1 plot data: 2 heads, S = 4, 3 runs."""
    steps, heads, S, runs = [0, 10, 100], 2, 4, 3
    p = [[[[[(1 + t * (r == h + b)) / (S + t) for r in range(S)] for h in range(heads)] for b in range(2)]
          for _ in range(runs)] for t in (0, 5, 50)]
    eff = [[[[S / (1 + t)] * heads for _ in range(2)] for _ in range(runs)] for t in (0, 1, 3)]
    result = SimpleNamespace(steps=steps, loss=[[3.0 - 0.5 * i + 0.1 * r for r in range(runs)] for i in range(3)],
                             static_p=p, eff_static=eff, eff_window=[[[[x * 0.8 for x in h] for h in run]
                                                                      for run in point] for point in eff])
    sweep = {key: [{key: x, "covered_prob": 0.8, "uncovered_prob": None if i == 0 else 0.1, "mean_prob": 0.5,
                    "chance": 1 / 64} for i, x in enumerate((1, 2, 4))] for key in ("heads", "vocab", "eps")}
    summary = {
        "theorem2": {"theorem1_optimum_loss": 1.5, "r_h": [1, 2], "flow_config": {"rho": 0.1}, "collision_rate": 0.2,
                     "runs": runs, "rho_sweep": [{"rho": 1.0, "collision_rate": 0.4, "runs": runs}],
                     "chance_collision_rate": 0.25,
                     "kappa_flow": [{"kappa": k, "steps_to_p09": [50, None, 80]} for k in (0.1, 1.0)]},
        "retrieval": {"trained_prob_by_position": [0.9, 0.2, 0.8, 0.1], "trained_covered_positions": [0, 2],
                      "trained_stderr_by_position": [0.01] * S, "trained_top1_by_position": [1.0, 0.1, 0.9, 0.0],
                      "chance": 1 / 64, "sweeps": sweep},
        "theorem1": {"optimal_loss": 1.5, "best_nonadjacent_loss": 1.9, "best_collided_loss": 2.1,
                     "n_assignments": 16, "smoothing": [0.0, 0.5, 1.0], "smoothed_loss": [1.5, 1.8, 2.5],
                     "beta_scan": [{"beta": b, "one_hot_optimum": 1.5, "descent_best": 1.5 - 0.1 * i}
                                   for i, b in enumerate((0.5, 1.0, 2.0))]},
    }
    plot = {"enumerated": np.sort(np.random.default_rng(0).uniform(1.5, 3.0, 16)),
            "random": np.random.default_rng(1).uniform(1.8, 3.5, 200)}
    return summary, result, plot


def test_theory_figures_write_png(tmp_path):
    names = write_theory_figures(tmp_path / "theory", *_theory_inputs())
    assert names == ["theory_training.png", "theory_concentration.png", "theory_retrieval.png", "theory_optimum.png"]
    for name in names:
        assert is_png(tmp_path / "theory" / name)
