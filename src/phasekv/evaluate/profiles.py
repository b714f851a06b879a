"""Per-phase accuracy profiles of probe runs (knockout, gate cycling, the grid): plain accuracies, and one cluster
bootstrap over several evaluations of the same prompts, so that differences between them get paired intervals."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def accuracies(records: list[dict[str, Any]], stride: int, residue_modulus: int) -> dict[str, Any]:
    """Overall, per-phase and per-residue accuracy (fractions; None for an empty group)."""
    def grouped(key: str, size: int) -> list[float | None]:
        k, n = np.zeros(size), np.zeros(size)
        for r in records:
            k[r[key]] += r["correct"]
            n[r[key]] += 1
        return [float(a / b) if b else None for a, b in zip(k, n)]

    return {"accuracy": float(np.mean([r["correct"] for r in records])),
            "per_phase": grouped("phase", stride), "per_residue": grouped("residue", residue_modulus)}


def phase_bootstrap(record_sets: Sequence[Sequence[Mapping]], stride: int, n_boot: int = 1000,
                    seed: int = 0) -> np.ndarray:
    """Per-phase accuracies of several evaluations of the SAME prompts (clean, knocked out, cycled...)
    under one cluster bootstrap: (n_boot, len(record_sets), stride), NaN for a phase a replicate misses.

    Every replicate draws the clusters (logical examples) with replacement once and applies the draw
    to every record set, so differences between the sets (relative changes, R^2 of one against
    another) get intervals that respect both the pairing and the correlation inside an example.
    """
    if not record_sets or not record_sets[0]:
        raise ValueError("phase_bootstrap: no records to resample (an evaluation with no prompts)")
    clusters = [np.asarray([r["cluster"] for r in records]) for records in record_sets]
    if any(len(c) != len(clusters[0]) or np.any(c != clusters[0]) for c in clusters):
        raise ValueError("phase_bootstrap: the record sets must cover the same prompts in the same order")
    ids, idx = np.unique(clusters[0], return_inverse=True)
    phase = np.asarray([r["phase"] for r in record_sets[0]])
    C = len(ids)
    nc = np.bincount(idx * stride + phase, minlength=C * stride).reshape(C, stride).astype(float)
    kc = np.stack([np.bincount(idx * stride + phase, weights=[float(r["correct"]) for r in records],
                               minlength=C * stride).reshape(C, stride) for records in record_sets])  # (sets, C, S)
    draws = np.random.default_rng(seed).multinomial(C, np.full(C, 1.0 / C), size=n_boot).astype(float)  # (b, C)
    n = draws @ nc  # (b, S)
    k = np.einsum("bc,xcs->bxs", draws, kc)
    with np.errstate(invalid="ignore", divide="ignore"):
        return k / n[:, None, :]


def nan_interval(samples: np.ndarray) -> list[float] | None:
    """95% percentile interval of the finite samples; None when fewer than 20 are finite."""
    samples = np.asarray(samples, dtype=float)
    samples = samples[np.isfinite(samples)]
    return None if samples.size < 20 else [float(x) for x in np.percentile(samples, [2.5, 97.5])]
