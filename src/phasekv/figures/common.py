"""The one way figures are made and written: `new_figure` and `save`.

Figures are drawn on matplotlib's Agg canvas directly (no pyplot: no global backend switch and no
figures left open) with constrained layout, and written at 120 dpi.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def new_figure(width: float, height: float) -> Figure:
    """An empty `width` x `height` inch figure on its own Agg canvas, with constrained layout."""
    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def save(fig: Figure, path: str | Path) -> Path:
    """Write `fig` to `path` (PNG, or any format its suffix names), creating parent directories."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
