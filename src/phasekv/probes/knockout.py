"""Mean-replacement knockout of KV heads, by phase (docs/science.md section 4).

For layer l and KV head h, the outputs (before o_proj) of the query heads that read h are replaced,
at the final position of each prompt only, by their mean over the N_cal prompts of a calibration set;
every other head, every earlier position and every other layer is left as it is.  The effect is
reported as 100 * (knockout - clean) / clean accuracy per phase (target position mod S) and per
residue (mod R); a phase whose clean accuracy is 0 has no relative change (None in the JSON).
`whole_layer=True` replaces all heads of a layer at once (what the paper did for DeepSeek-V4).

Only query forwards are touched: the runner's multi-query mode prefills contexts and continues
queries from the cache, and the hooks are disarmed during the prefill (`hooks.QueryOnly`), so the
cached context is the clean one and the knockout acts at the query position, as with full prompts.

Calibration set: built from the eval set's own settings (same protocol, lengths and vocabulary, so
the mean is taken over the same kind of prompt) with a different seed, which draws different
records, fillers and demonstrations; `check_disjoint` then verifies that no calibration prompt is
token-for-token identical to an evaluation prompt, and `run_knockout` refuses overlapping sets.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from phasekv.adapters.base import Adapter
from phasekv.config import EvalConfig
from phasekv.data.protocols import EvalSet, build_eval_set
from phasekv.evaluate.profiles import accuracies, nan_interval, phase_bootstrap
from phasekv.evaluate.runner import predict
from phasekv.evaluate.sources import Source, batch_size, open_source
from phasekv.figures.probes import plot_knockout_map
from phasekv.probes.hooks import QueryOnly, capture_final_head_outputs, mean_knockout
from phasekv.probes.output import write_result

log = logging.getLogger(__name__)

_DERIVED_SETTINGS = ("protocol", "families", "exact_matching")  # in EvalSet.settings, not build_eval_set arguments


def calibration_set(eval_set: EvalSet, n_prompts: int = 256, seed: int | None = None) -> EvalSet:
    """A calibration set of about `n_prompts` prompts disjoint from `eval_set`.

    Same settings as `eval_set` but seed (default: the eval seed + 1) and the smallest valid number of
    clusters; whole contexts are kept, spread evenly over clusters and shifts, until at least
    `n_prompts` queries are in (all of them if there are fewer).
    """
    if n_prompts < 1:
        raise ValueError(f"n_prompts: must be >= 1, got {n_prompts}")
    settings = {k: v for k, v in eval_set.settings.items() if k not in _DERIVED_SETTINGS}
    seed = settings["seed"] + 1 if seed is None else seed
    if seed == settings["seed"]:
        raise ValueError(f"seed: the calibration seed must differ from the eval set's seed {seed}")
    settings.update(seed=seed, n_clusters=eval_set.settings["families"])
    calib = build_eval_set(eval_set.vocab, eval_set.protocol, **settings)
    per_context = len(calib.contexts[0].queries)
    n_contexts = min(len(calib.contexts), math.ceil(n_prompts / per_context))
    keep = np.linspace(0, len(calib.contexts) - 1, n_contexts).round().astype(int)
    calib = dataclasses.replace(calib, contexts=[calib.contexts[i] for i in keep])
    check_disjoint(eval_set, calib)
    return calib


def check_disjoint(eval_set: EvalSet, calib_set: EvalSet) -> None:
    """ValueError if any calibration prompt equals an evaluation prompt token for token."""
    seen = {tuple(p.ids) for p in eval_set.prompts()}
    shared = sum(tuple(p.ids) in seen for p in calib_set.prompts())
    if shared:
        raise ValueError(f"calibration set: {shared} of its prompts also occur in the eval set; "
                         "build it with another seed")


def calibration_means(adapter: Adapter, calib_set: EvalSet, batch_size: int = 32, multi_query: bool = True,
                      progress: bool = True) -> list[torch.Tensor]:
    """Per layer, the mean o_proj input at the query position over the calibration prompts: (H*D,)."""
    probe = QueryOnly(adapter)
    with capture_final_head_outputs(probe) as captured:
        predict(probe, calib_set, batch_size, multi_query, progress, desc="calibration")
    n = len(calib_set.queries())
    means = []
    for rows in captured:
        x = torch.cat(rows)  # (N_cal, H*D)
        if x.shape[0] != n:
            raise AssertionError(f"internal: captured {x.shape[0]} query positions for {n} prompts")
        means.append(x.double().mean(0).float())
    return means


def relative_change(knockout: list[float | None], clean: list[float | None]) -> list[float | None]:
    """100 * (knockout - clean) / clean per group; None where clean is 0 or missing."""
    return [100 * (k - c) / c if k is not None and c else None for k, c in zip(knockout, clean, strict=True)]


def knockout_intervals(clean: list[dict], knocked: list[dict], stride: int, n_boot: int = 1000) -> dict[str, Any]:
    """95% cluster-bootstrap intervals of a knockout: the knocked-out accuracy per phase and the relative
    change of the mean over phases (pct), from one paired resampling of the logical examples."""
    reps = phase_bootstrap([clean, knocked], stride, n_boot)  # (b, 2, S)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = np.nanmean(reps, axis=2)  # (b, 2)
        rel = 100 * (means[:, 1] - means[:, 0]) / means[:, 0]
    return {"per_phase_ci": [nan_interval(reps[:, 1, p]) for p in range(stride)],
            "mean_rel_change_ci_pct": nan_interval(rel), "n_boot": n_boot}


def run_knockout(adapter: Adapter, eval_set: EvalSet, calib_set: EvalSet, out_dir: str | Path | None = None, *,
                 whole_layer: bool = False, batch_size: int = 32, progress: bool = True,
                 multi_query: bool = True, figures: bool = True) -> dict[str, Any]:
    """Knock out every (layer, KV head) (or every layer) in turn; JSON-ready results.

    Returns {clean: accuracies, rows: [{layer, kv_head (None: whole layer), accuracy, per_phase,
    per_residue, per_phase_rel_change_pct, per_residue_rel_change_pct, mean_rel_change_pct}], ...};
    mean_rel_change_pct is the relative change of the accuracy over all prompts.  With `out_dir`,
    writes knockout.json and (with `figures`) the map knockout.png (rows layer x KV head, columns phase).
    """
    check_disjoint(eval_set, calib_set)
    S, R = eval_set.stride, eval_set.residue_modulus
    probe = QueryOnly(adapter)
    means = calibration_means(adapter, calib_set, batch_size, multi_query, progress)
    clean_records = predict(probe, eval_set, batch_size, multi_query, progress, desc="clean")
    clean = accuracies(clean_records, S, R)
    heads = [None] if whole_layer else list(range(adapter.info.num_kv_heads))
    # a layer whose output projection is not the model's H x D heads (GLM-5.3's linear-attention layer with its
    # own head count) is knocked out whole
    width = adapter.info.num_heads * adapter.info.head_dim
    targets = [(layer, h) for layer in range(adapter.info.num_layers)
               for h in (heads if means[layer].numel() == width else [None])]
    rows = []
    for layer, kv_head in tqdm(targets, desc="knockout", unit="head", disable=not progress):
        name = f"L{layer}" + ("" if kv_head is None else f" KV{kv_head}")
        with mean_knockout(probe, layer, kv_head, means[layer]):
            records = predict(probe, eval_set, batch_size, multi_query, progress, desc=name)
        acc = accuracies(records, S, R)
        rows.append({"layer": layer, "kv_head": kv_head, **acc, **knockout_intervals(clean_records, records, S),
                     "per_phase_rel_change_pct": relative_change(acc["per_phase"], clean["per_phase"]),
                     "per_residue_rel_change_pct": relative_change(acc["per_residue"], clean["per_residue"]),
                     "mean_rel_change_pct": relative_change([acc["accuracy"]], [clean["accuracy"]])[0]})
    result = {"model": adapter.info.name, "protocol": eval_set.protocol, "stride": S, "residue_modulus": R,
              "whole_layer": whole_layer, "n_prompts": len(eval_set.queries()),
              "n_calibration": len(calib_set.queries()), "eval_seed": eval_set.settings.get("seed"),
              "calibration_seed": calib_set.settings.get("seed"), "clean": clean, "rows": rows, "heatmap": None}
    if out_dir is not None:
        write_result(out_dir, "knockout", result, plot_knockout_map if figures else None, key="heatmap")
    return result


def run_knockout_on(source: Source, cfg: EvalConfig, out_dir: str | Path, *, whole_layer: bool = False,
                    calib_prompts: int = 256, calib_seed: int | None = None, progress: bool = True) -> dict[str, Any]:
    """`phasekv knockout`: knockouts of a checkpoint or HF model on the prompt set `cfg` describes."""
    adapter, eval_set = open_source(source, cfg)
    calib = calibration_set(eval_set, calib_prompts, calib_seed)
    return run_knockout(adapter, eval_set, calib, out_dir, whole_layer=whole_layer, batch_size=batch_size(source, cfg),
                        progress=progress, multi_query=not cfg.one_by_one)
