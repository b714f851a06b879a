"""`phasekv reproduce`: the paper's findings (docs/science.md section 6) measured on bundled checkpoints.

For every model: both padding protocols, then knockout maps, gate concentration and profiles
(compressed models), gate cycling (W = S gated models), and once the theory model.  Everything
lands in OUT/summary.json (the one source of truth) and OUT/report.html, whose figures are drawn
from summary.json's numbers (`phasekv.report.html`; OUT/models/NAME/ holds each analysis's JSON and
predictions, without the per-analysis figures that the report draws anyway).  `--train` first retrains every model from
its preset in configs/cpu/ with `phasekv train` (the command that made the bundled checkpoints);
`--bundle DIR` then stores compact copies (float16 weights, config, metrics, gate snapshots).

The findings are checked, not asserted: each claim of the paper gets a measured value and a
verdict, and the report says plainly when a claim does not hold at this scale.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import multiprocessing
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from phasekv.archs import architecture_of, geometry_of
from phasekv.archs.base import text_config
from phasekv.archs.indexer_kl import indexers_of
from phasekv.checkpoint import resolve
from phasekv.compression import compressors_of
from phasekv.config import PROTOCOLS, Experiment
from phasekv.evaluate.runner import evaluate
from phasekv.evaluate.sources import CHECKPOINT_BATCH, make_eval_set, open_checkpoint
from phasekv.families import family_name
from phasekv.outputs import output_dir, partial_dir, write_json
from phasekv.probes.archgates import arch_gate_statistics
from phasekv.probes.cycle import cycle_stride, offset_gate_parameters, run_cycling
from phasekv.probes.gates import gate_report, gate_trajectory
from phasekv.probes.knockout import calibration_set, run_knockout
from phasekv.report.findings import findings, fixes
from phasekv.report.html import model_figures, write_report
from phasekv.report.parity import parity_findings
from phasekv.report.reasons import explained
from phasekv.theory import run_theory
from phasekv.training.loop import train
from phasekv.training.rundir import read_metrics

log = logging.getLogger(__name__)

PROBE_CLUSTERS = 8
GRADED_CYCLING_CLUSTERS = 24  # gate cycling of a transformers architecture's compressors: 6,912 prompts
BUNDLED = ["full-1kv", "w8s8", "w8s4", "w8s6", "w4s4", "w12s12", "w8s8-uniform", "w8s8-stagger", "full-4kv",
           "full-8kv", "w8s8-4kv", "w8s4-4kv", "w12s12-4kv", "w8s8-uniform-4kv", "w8s8-shared-4kv", "w9s8-4kv",
           "dsv41-csa2",  # phasekv's own DeepSeek-V4.1 CSA2 schedule (ratio-2 and ratio-1 pooling)
           "dsv4-hca", "dsv4-csa", "qwen3-full", "dsv32-dsa", "minimax-m3"]  # the last five: transformers' own
# DeepSeek-V4 (HCA layers, CSA layers with the lightning indexer), Qwen3, DeepSeek-V3.2 (token-level top-k DSA) and
# MiniMax-M3 (top-k blocks of 4 keys)
# the per-protocol metrics a summary keeps (period_scores: the findings name the verdict's period from them)
METRIC_KEYS = ("mean_accuracy", "mean_ci", "max_gap_pp", "gap_ci_pp", "gap_crossfit_pp", "gap_crossfit_ci_pp",
               "phase_gap_pp", "detected_period", "flatness_p", "null_gap_p95_pp", "best_residue", "worst_residue",
               "per_residue", "per_phase", "n_prompts", "stride", "residue_modulus", "position_matching", "chance",
               "in_context_chance", "can_do_task", "phase_sensitive", "verdict_parts", "verdict", "gap_ci_basic_pp",
               "within_flatness_p", "cochran_p", "n_clusters", "contrast_crossfit_pp", "contrast_crossfit_bounds_pp",
               "contrast_crossfit_se_pp", "minimum_detectable_gap_pp", "period_scores")


def discover(checkpoints: Path, names: list[str] | None = None) -> dict[str, Path]:
    """Bundled model directories by name (sorted: full attention first)."""
    if not checkpoints.is_dir():
        raise FileNotFoundError(f"--checkpoints {checkpoints}: no such directory")
    found = {p.name: p for p in sorted(checkpoints.iterdir()) if (p / "model.safetensors").is_file()}
    if names:
        missing = sorted(set(names) - set(found))
        if missing:
            raise ValueError(f"--models: no checkpoint for {missing} in {checkpoints}; found {sorted(found)}")
        found = {n: found[n] for n in names}
    if not found:
        raise ValueError(f"--checkpoints {checkpoints}: holds no checkpoint (config.json + model.safetensors)")
    return dict(sorted(found.items(), key=lambda kv: (not kv[0].startswith("full"), kv[0])))


def bundle(run: Path, dest: Path) -> Path:
    """Compact copy of a training run: float16 weights, config, metrics, float16 gate snapshots, published as `dest`
    (`output_dir`: an old `dest` is replaced only when phasekv wrote all of it)."""
    final = run / "final" if (run / "final").is_dir() else resolve(run)
    with output_dir(dest, force=True) as tmp:
        _bundle_into(run, final, tmp)
    return dest


def _bundle_into(run: Path, final: Path, tmp: Path) -> None:
    (tmp / "gates").mkdir(parents=True)
    weights = load_file(str(final / "model.safetensors"))
    state = {k: v.half() if v.is_floating_point() else v for k, v in weights.items()}
    save_file(state, str(tmp / "model.safetensors"))
    shutil.copy(final / "config.json", tmp / "config.json")
    shutil.copy(run / "metrics.jsonl", tmp / "metrics.jsonl")
    for snap in sorted((run / "gates").glob("step_*.safetensors")):
        save_file({k: v.half() for k, v in load_file(str(snap)).items()}, str(tmp / "gates" / snap.name))


@torch.no_grad()
def cache_bytes_per_token(model: torch.nn.Module, tokens: int = 504) -> float | None:
    """Bytes the inference cache holds per token after prefilling `tokens` random ids (`KVCache.nbytes`,
    every tensor of every layer); None for a model without phasekv's cache."""
    if not hasattr(model, "new_cache"):
        return None
    tokens = min(tokens, model.config.max_position_embeddings)
    cache = model.new_cache()
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0))
    model(ids.to(next(model.parameters()).device), cache)
    return round(cache.nbytes() / tokens, 3)


def _model_facts(path: Path, model: torch.nn.Module) -> dict[str, Any]:
    """Geometry read from the model's own compressors (any family) and the run's last validation."""
    compressors = [c for _, c in compressors_of(model)]
    info = text_config(model.config)
    rows = read_metrics(path)
    vals = [r for r in rows if "val_loss" in r]
    geometry = geometry_of(model)  # a transformers model's own compression, read from its config by its architecture
    shape = compressors[0] if compressors else geometry  # either is a phasekv.archs.Geometry: name, window, stride
    return {
        "family": family_name(model), "architecture": type(model).__name__,
        "compressor": shape.name if shape is not None else "none",
        "window": shape.window if shape is not None else None,
        "stride": shape.stride if shape is not None else None,
        "compressed_layers": list(geometry.compressed_layers) if geometry else None,  # transformers models only
        "uniform": bool(compressors) and not any(c.gate_parameters() for c in compressors),
        "shared_payload": (bool(compressors) and not any(c.offset_payload_maps() for c in compressors)
                           or any(g.shared_payload for g in architecture_of(model).gate_layers(model))),
        "staggered": any(c.offset for c in compressors),
        "token_selection": geometry is None and not compressors and bool(indexers_of(model)),  # top-k single tokens
        "kv_heads": info.num_key_value_heads, "layers": info.num_hidden_layers, "hidden": info.hidden_size,
        "val_loss": vals[-1]["val_loss"] if vals else None,
        "val_lookup_acc": vals[-1]["val_lookup_acc"] if vals else None,
        "train_steps": rows[-1]["step"] if rows else None,
    }


def can_cycle(model: torch.nn.Module) -> bool:
    """Gate cycling is defined: compressed layers with W = S and offset-specific gate parameters."""
    try:
        cycle_stride(model)
        return bool(offset_gate_parameters(model))
    except ValueError:
        return False


def _settings(defaults: dict[str, Any], seed: int, n_clusters: int | None) -> dict[str, Any]:
    return {"n_records": defaults["n_records"], "n_demos": 8, "key_tokens": defaults["key_tokens"],
            "value_tokens": defaults["value_tokens"], "local_window": defaults["local_window"], "seed": seed,
            "n_clusters": n_clusters}


class _NoBar:
    """Stands in for a progress bar inside worker processes (the parent shows progress per model)."""

    def set_description(self, text: str) -> None:
        pass

    def update(self, n: int = 1) -> None:
        pass


def _die_with_parent() -> None:
    """Worker initializer: on Linux the kernel sends the worker SIGTERM when the parent process dies, so a killed
    `reproduce` (SIGTERM, SIGKILL) leaves no orphaned analyses running (the pool's own shutdown needs the parent
    alive)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before prctl took effect
            os._exit(1)


def _analyse_in_worker(args: tuple) -> dict[str, Any]:
    torch.set_num_threads(1)
    return analyse_model(*args, bar=_NoBar())


def _figures_in_worker(name: str, result: dict[str, Any], figs: Path) -> dict[str, str]:
    return model_figures(name, result, figs)


def _theory_in_worker(out: Path, seed: int, quick: bool) -> dict[str, Any]:
    sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the parent's bar is the one progress display
    return run_theory(out, seed=seed, quick=quick)


def analyse_model(name: str, path: Path, out: Path, quick: bool, seed: int, bar) -> dict[str, Any]:
    adapter, defaults = open_checkpoint(path)
    adapter.info.name = name
    vocab = defaults.pop("vocab")
    facts = _model_facts(path, adapter.module)
    result: dict[str, Any] = {"path": str(path), **facts, "phase_stride": adapter.info.stride, "seconds": {},
                              "cache_bytes_per_token": cache_bytes_per_token(adapter.module)}
    clock = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        result["seconds"][stage] = round(now - clock, 2)
        clock = now

    # contexts per forward where queries share one cache; query rows per forward where the adapter copies the
    # cache per query (transformers models)
    batch = CHECKPOINT_BATCH if adapter.shares_cache else 256
    main_clusters = 6 if quick else None  # None: the exactly matched default; 6 suits both protocols
    for protocol in PROTOCOLS:
        bar.set_description(f"{name}: {protocol}")
        eval_set = make_eval_set(adapter, vocab, protocol, **_settings(defaults, seed, main_clusters))
        metrics = evaluate(adapter, eval_set, out / protocol, batch_size=batch, seed=seed, progress=False,
                           n_boot=500 if quick else 2000, figures=False)
        result[protocol] = {k: metrics[k] for k in METRIC_KEYS if k in metrics}
        result[protocol]["target_position_matching"] = metrics["target_position_matching"]
        lap(protocol)
        bar.update()
    # probes: 8 clusters (96 logical examples at 24 shifts) so that one prompt cannot swing a cell
    probe_set = make_eval_set(adapter, vocab, "prefix", **_settings(defaults, seed, 2 if quick else PROBE_CLUSTERS))
    bar.set_description(f"{name}: knockout")
    calib = calibration_set(probe_set, n_prompts=64 if quick else 256, seed=seed + 1)
    ko = run_knockout(adapter, probe_set, calib, out / "knockout", batch_size=batch, progress=False, figures=False)
    result["knockout"] = _numbers_only(ko)
    lap("knockout")
    bar.update()
    prompts = torch.tensor([p.ids for p in probe_set.prompts()[:: max(1, len(probe_set.prompts()) // 64)]])
    if architecture_of(adapter.module).gate_layers(adapter.module):  # a transformers architecture's compressors
        result["gates"] = arch_gate_statistics(adapter.module, prompts)
        lap("gates")
    if compressors_of(adapter.module):  # phasekv's compressors
        bar.set_description(f"{name}: gates")
        gates = gate_report(adapter, prompts, out / "gates", progress=False, figures=False)
        result["gates"] = gates["gates"]
        lap("gates")
        if (path / "gates").is_dir() and any((path / "gates").glob("step_*.safetensors")):
            traj = gate_trajectory(path, prompts[:16], out / "gates", progress=False)
            result["gate_trajectory"] = _numbers_only(traj)
            lap("gate_trajectory")
    if can_cycle(adapter.module):  # W = S compressors with offset-specific gates, of either family
        bar.set_description(f"{name}: cycling")
        result["cycling"] = _cycling(adapter, probe_set, vocab, defaults, out, quick=quick, seed=seed, batch=batch)
        lap("cycling")
    bar.update()
    return result


def _cycling(adapter, probe_set, vocab, defaults, out: Path, *, quick: bool, seed: int, batch: int) -> dict[str, Any]:
    """Gate cycling on the probe set; a transformers architecture's compressors on a larger set with two shifts each
    way: their graded curve (phases at 17-30%, not 0 or 100) needs more prompts for a usable R^2 interval (measured on
    dsv4-hca: with the probe set's 2,304 prompts the intervals spanned [-0.3, 0.9])."""
    deltas, cycle_set = (-1, 0, 1) if quick else range(-3, 4), probe_set
    if architecture_of(adapter.module).gate_layers(adapter.module) and not quick:
        deltas = range(-2, 3)
        cycle_set = make_eval_set(adapter, vocab, "prefix", **_settings(defaults, seed, GRADED_CYCLING_CLUSTERS))
    cyc = run_cycling(adapter, cycle_set, deltas=deltas, out_dir=out / "cycling", batch_size=batch, progress=False,
                      figures=False)
    return _numbers_only(cyc)


def _numbers_only(result: dict[str, Any]) -> dict[str, Any]:
    """A probe's result without the paths of the figures it wrote (the report redraws them)."""
    return {k: v for k, v in result.items() if not (isinstance(v, str) and v.endswith((".png", ".json")))}


def check_finite(tree: Any, where: str = "summary") -> None:
    """Raise if any number in `tree` is NaN or infinite (the report shows only finite numbers)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            check_finite(v, f"{where}.{k}")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            check_finite(v, f"{where}[{i}]")
    elif isinstance(tree, float) and not math.isfinite(tree):
        raise ValueError(f"{where} is not finite ({tree})")


def retrain(runs: Path, names: list[str], configs: Path, bundle_to: Path | None, progress: bool
            ) -> tuple[dict[str, Path], dict[str, float]]:
    """Train every model from its preset into `runs`/NAME (resumed when a run exists there), and
    bundle compact copies into `bundle_to`; (model directories, training seconds)."""
    dirs, seconds = {}, {}
    for name in names:
        run = runs / name
        t0 = time.perf_counter()
        train(Experiment.from_file(configs / f"{name}.yaml"), run, resume=(run / "latest").exists(),
              progress=progress)
        seconds[name] = round(time.perf_counter() - t0, 1)
        dirs[name] = bundle(run, bundle_to / name) if bundle_to else run
    return dirs, seconds


def analyse_all(models_dirs: dict[str, Path], out: Path, quick: bool, seed: int, progress: bool, jobs: int
                ) -> tuple[dict[str, Any], dict[str, Any], dict[str, dict[str, str]]]:
    """Every model's analyses and the theory model, in parallel single-thread processes when jobs > 1; (models,
    theory, the per-model report figures drawn so far: with jobs > 1 a worker draws a model's figures into
    out/figures as soon as it is analysed, beside the other analyses)."""
    bar = tqdm(total=3 * len(models_dirs) + 1, desc="reproduce", unit="stage", disable=not progress,
               dynamic_ncols=True)
    models: dict[str, Any] = {}
    tasks = {name: (name, path, out / "models" / name, quick, seed) for name, path in models_dirs.items()}
    theory, drawn = None, {}
    if jobs > 1 and len(tasks) > 1:
        # one model per worker process with one thread each (small models use 2 cores better this
        # way); the theory model runs beside them
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(min(jobs, len(tasks)), mp_context=ctx,
                                                    initializer=_die_with_parent) as pool:
            # the theory first: submitted last, it ran alone at the end while the other worker idled
            futures = {pool.submit(_theory_in_worker, out / "theory", seed, quick): ("theory", "theory")}
            futures.update({pool.submit(_analyse_in_worker, args): ("model", name) for name, args in tasks.items()})
            pending = set(futures)
            while pending:
                done, pending = concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
                for future in done:
                    kind, name = futures[future]
                    if kind == "figures":
                        drawn[name] = future.result()
                        continue
                    if kind == "theory":
                        theory = future.result()
                        bar.update(1)
                    else:
                        models[name] = future.result()
                        bar.update(3)
                        figures = pool.submit(_figures_in_worker, name, models[name], out / "figures")
                        futures[figures] = ("figures", name)
                        pending.add(figures)
                    bar.set_description(f"{name}: done")
        models = {name: models[name] for name in tasks}
    else:
        for name, args in tasks.items():
            models[name] = analyse_model(*args, bar=bar)
        bar.set_description("theory")
        theory = run_theory(out / "theory", seed=seed, quick=quick, progress=progress)
        bar.update()
    bar.close()
    return models, theory, drawn


def reproduce(out: str | Path, checkpoints: str | Path = "checkpoints", names: list[str] | None = None,
              retrain_models: bool = False, configs: str | Path = "configs/cpu", bundle_to: str | Path | None = None,
              *, quick: bool = False, seed: int = 0, progress: bool = True, jobs: int = 2, force: bool = False
              ) -> dict[str, Any]:
    """Analyse the bundled (or retrained) models and the theory model; publish OUT (summary.json,
    report.html, every analysis's files) atomically when everything is done."""
    out = Path(out)
    started = time.perf_counter()
    with output_dir(out, force, resume=retrain_models) as tmp:
        train_times: dict[str, float] = {}
        runs = partial_dir(out, force=False, resume=True) / "train" if retrain_models else None  # resumable in OUT
        if runs is not None:
            models_dirs, train_times = retrain(runs, names or BUNDLED, Path(configs),
                                               Path(bundle_to) if bundle_to else None, progress)
        else:
            models_dirs = discover(Path(checkpoints), names)
        models, theory, drawn = analyse_all(models_dirs, tmp, quick, seed, progress, jobs)
        summary = {
            "models": models,
            "theory": theory,
            "findings": explained(findings(models) + parity_findings(models), models),
            "fixes": fixes(models),
            "settings": {"quick": quick, "seed": seed, "checkpoints": str(checkpoints), "retrained": retrain_models,
                         "train_seconds": train_times},
            "elapsed_s": round(time.perf_counter() - started, 1),
        }
        check_finite(summary)
        write_json(tmp / "summary.json", summary)
        write_report(summary, tmp, drawn)
        if runs is not None:
            runs.replace(tmp / "train")  # the training runs, kept in OUT/train
    return summary
