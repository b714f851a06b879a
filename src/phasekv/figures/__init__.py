"""Every figure of phasekv, drawn from the JSON-ready results of evaluation, probes and theory.

A leaf layer: it imports nothing else of phasekv.  `common` holds the one constructor (`new_figure`)
and the one writer (`save`); evaluation.py, probes.py and theory.py hold the figures themselves.
"""

from phasekv.figures.common import new_figure, save
from phasekv.figures.evaluation import (
    plot_accuracy_by_residue,
    plot_cross_phase_heatmap,
    plot_phase_heatmap,
    plot_residue_curves,
    plot_residue_grid,
    plot_sweep,
)
from phasekv.figures.probes import (
    plot_concentration_plane,
    plot_cycling,
    plot_gate_profiles,
    plot_gate_trajectory,
    plot_knockout_map,
)
from phasekv.figures.theory import write_theory_figures

__all__ = [
    "new_figure", "plot_accuracy_by_residue", "plot_concentration_plane", "plot_cross_phase_heatmap", "plot_cycling",
    "plot_gate_profiles", "plot_gate_trajectory", "plot_knockout_map", "plot_phase_heatmap", "plot_residue_curves",
    "plot_residue_grid", "plot_sweep", "save", "write_theory_figures",
]
