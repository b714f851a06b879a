"""The engine grid's figure: one row per engine setting, one column per residue (position mod S), the cell a
percentage (engine-vs-reference agreement or engine accuracy) with its count (`phasekv.auditing.engine_grid`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib import colormaps

from phasekv.figures.common import new_figure, save


def plot_setting_residue(rows: list[dict], path: str | Path, *, stride: int, value: str, title: str) -> Path:
    """`rows`: [{"setting": label, "cells": [{"residue": r, value: fraction or None, "n": n}, ...]}, ...] ->
    a setting x residue heat map of 100 * `value` (cell text: the percentage and n; an empty cell grey)."""
    grid = np.full((len(rows), stride), np.nan)  # (setting, residue), percent
    counts = np.zeros((len(rows), stride), dtype=int)
    for i, row in enumerate(rows):
        for cell in row["cells"]:
            counts[i, cell["residue"]] = cell["n"]
            if cell.get(value) is not None:
                grid[i, cell["residue"]] = 100 * cell[value]
    fig = new_figure(max(6.5, 3.0 + 0.7 * stride), 1.3 + 0.42 * len(rows))
    ax = fig.add_subplot()
    image = ax.imshow(np.ma.masked_invalid(grid), cmap=colormaps["viridis"].with_extremes(bad="0.85"), vmin=0,
                      vmax=100, aspect="auto", interpolation="nearest")
    for (i, j), v in np.ndenumerate(grid):
        if np.isfinite(v):
            ax.text(j, i, f"{v:.0f}\n{counts[i, j]}", ha="center", va="center", fontsize=6.5,
                    color="white" if v < 60 else "black")
    ax.set_xticks(range(stride), [str(r) for r in range(stride)])
    ax.set_yticks(range(len(rows)), [r["setting"] for r in rows], fontsize=7)
    ax.set_xlabel(f"position mod {stride}")
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, label="%")
    return save(fig, path)
