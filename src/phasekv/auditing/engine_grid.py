"""The engine's own settings as an axis: `phasekv audit --launch llama-server --engine-grid ubatch=16,64 ...`.

For every point of the grid (every combination of the settings' values) phasekv starts the engine itself
(`phasekv.engines.launchers`: a free loopback port, the server stopped after the point and on any exit, Ctrl-C
included), sends it the audit's prompt sets, and compares every answer with the reference (the same weights in
transformers, computed once for the whole grid: `phasekv.evaluate.served.reference_logprobs`).  Per point and per
protocol: the engine's accuracy per phase and its verdict (query protocol: the query-phase verdict too), the
engine-vs-reference agreement overall, per source phase and per query phase, the prompt tokens the engine said it
took from its prefix cache, and what the server reports about its settings (llama.cpp's /props and /slots, vLLM's
/metrics and /server_info).  A point whose server keeps a prefix cache requests cannot switch off (vLLM with
prefix_cache=on: `Launcher.caches_prefix`) is audited with --reuse-prefix, so that a context's queries hit it; the
other points refuse any cached token unless the grid reuses prefixes everywhere.  The per-point checks (`checks`:
decode steps, prefix-cache and batch paths, `phasekv.auditing.engine_paths`) add their own results.

Resuming: the grid works inside OUT, in its resumable work OUT/.partial/ (`phasekv.outputs.partial_dir`, never
beside OUT), and publishes each finished point there atomically as OUT/.partial/POINT/ (`phasekv.outputs.output_dir`);
a point's answers are journaled as they arrive (in OUT/.partial/POINT/.partial/).  A killed grid run again with
`resume` skips the finished points and sends only the unanswered prompts of the point it was killed in.  When every
point is done OUT is published (points/, grid.json, grid.md, figures/, summary.json) in place of its work.  A point
whose server does not come up, or dies while serving, is a row of the table with the one-line reason (and is tried
again on resume).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from phasekv.adapters.base import Adapter
from phasekv.config import EvalConfig
from phasekv.data.protocols import EvalSet, build_eval_set
from phasekv.engines.base import Launcher, point_name
from phasekv.engines.client import EndpointAdapter
from phasekv.engines.journal import Journal, journal_path, prompt_key, published
from phasekv.engines.process import EngineDied
from phasekv.engines.registry import started
from phasekv.engines.wire import EndpointError
from phasekv.evaluate.runner import predict, write_run
from phasekv.evaluate.served import compare, reference_logprobs
from phasekv.evaluate.sources import audit_clusters, prompt_settings, tokenizer_vocabulary
from phasekv.figures.engines import plot_setting_residue
from phasekv.outputs import check_output_dir, output_dir, partial_dir, write_json

log = logging.getLogger(__name__)

NO_FORMAT = "none"  # --format none: the tokenizer's own single-token words (a closed word-level vocabulary)
CHECKS = ("decode", "prefix", "batch")  # the per-point checks, by name (their residue coordinate below)
CHECK_RESIDUES = {"decode": ("per_phase", "phase", "decode steps: agreement [%] by position mod S of the step"),
                  "prefix": ("per_residue", "residue", "prefix cache vs cold: agreement [%] by cached length mod S"),
                  "batch": ("per_query_phase", "query_phase", "batched vs alone: agreement [%] by query phase")}
POINT_KEYS = ("mean_accuracy", "mean_ci", "max_gap_pp", "detected_period", "flatness_p", "per_phase", "chance",
              "in_context_chance", "can_do_task", "phase_sensitive", "verdict_parts", "verdict", "prompt_length",
              "n_prompts")

# a per-point check: (the point's adapter, the prompt sets, the reference's log-probabilities per protocol, the
# reference adapter) -> its JSON-ready result, stored under its name in the point's summary
Check = Callable[[EndpointAdapter, dict[str, EvalSet], dict[str, Any], Adapter | None], dict[str, Any]]


@dataclass(frozen=True)
class EngineGrid:
    """What to start at every point: `engine` (a launcher) running `binary` on `model`, one server per point of
    `points` (setting -> value), with `context` tokens and `slots` parallel sequences; `startup_s` None: the
    engine's own; `reuse_prefix`: every point audited with --reuse-prefix."""

    engine: Launcher
    binary: Path
    model: Path
    points: tuple[dict[str, str], ...]
    context: int = 4096
    slots: int = 1
    startup_s: float | None = None
    timeout: float = 600.0
    reuse_prefix: bool = False


def grid_sets(tokenizer: Any, cfg: EvalConfig, protocols: Sequence[str], per_phase: int) -> dict[str, EvalSet]:
    """The prompt set of each protocol, at least `per_phase` prompts per phase: `cfg.format`'s records, or with
    format `none` the tokenizer's single-token words (`TokenizerVocabulary`, as `phasekv eval --endpoint`)."""
    vocab, defaults = tokenizer_vocabulary(tokenizer, dataclasses.replace(cfg, format=None)
                                           if cfg.format == NO_FORMAT else cfg)
    base = prompt_settings(cfg, defaults)
    record = base["key_tokens"] + base["value_tokens"] + getattr(vocab, "haystack_tokens", 0)
    return {p: build_eval_set(vocab, p, stride=cfg.stride, **{
        **base, "n_clusters": audit_clusters(per_phase, record, p, cfg.stride)}) for p in protocols}


def run_grid(grid: EngineGrid, tokenizer: Any, cfg: EvalConfig, out: str | Path, *, protocols: Sequence[str],
             per_phase: int, reference: Adapter | None = None, checks: dict[str, Check] | None = None,
             force: bool = False, resume: bool = False, progress: bool = True) -> dict[str, Any]:
    """Run every point of `grid` (module docstring) and publish OUT; returns OUT/summary.json's content."""
    check_output_dir(out, force, resume)
    started_at = time.perf_counter()
    sets = grid_sets(tokenizer, cfg, protocols, per_phase)
    logprobs = ({p: reference_logprobs(reference, s, cfg.batch_size or 16) for p, s in sets.items()}
                if reference is not None else {})
    work = partial_dir(out, force=force, resume=resume)
    points = []
    for settings in tqdm(grid.points, desc="engine grid", unit="point", disable=not progress):
        points.append(_point(grid, settings, sets, work, cfg=cfg, vocab_size=len(tokenizer), logprobs=logprobs,
                             reference=reference, checks=checks or {}, progress=progress))
    rows = grid_rows(points, protocols)
    summary = {"engine": grid.engine.name, "binary": str(grid.binary), "model": str(grid.model),
               "reference": None if reference is None else reference.info.name, "protocols": list(protocols),
               "stride": cfg.stride, "format": cfg.format, "prompts_per_phase": per_phase,
               "grid": [p["settings"] for p in points], "points": points, "rows": rows,
               "elapsed_s": round(time.perf_counter() - started_at, 1)}
    with output_dir(out, force, resume=True) as tmp:  # in place of the grid's work
        for p in points:
            if "failed" not in p:
                shutil.copytree(work / p["name"], tmp / "points" / p["name"])
        write_json(tmp / "grid.json", rows)
        (tmp / "grid.md").write_text(grid_markdown(rows, protocols))
        write_figures(points, protocols, cfg.stride, tmp / "figures")
        write_json(tmp / "summary.json", summary)
    return summary


def _point(grid: EngineGrid, settings: dict[str, str], sets: dict[str, EvalSet], work: Path, *, cfg: EvalConfig,
           vocab_size: int, logprobs: dict[str, Any], reference: Adapter | None, checks: dict[str, Check],
           progress: bool) -> dict[str, Any]:
    """One grid point's summary: read back when an earlier run finished it, else measured and published."""
    name = point_name(settings)
    done = work / name / "point.json"
    if done.is_file():
        log.info("grid point %s: finished by an earlier run", name)
        return json.loads(done.read_text())
    began = time.perf_counter()
    try:
        with started(grid.engine, grid.binary, grid.model, settings, context=grid.context, slots=grid.slots,
                     startup_s=grid.startup_s) as url:
            startup = time.perf_counter() - began
            adapter = EndpointAdapter(url, grid.engine.api, vocab_size, timeout=grid.timeout,
                                      reuse_prefix=grid.reuse_prefix or grid.engine.caches_prefix(settings))
            try:
                adapter.attach(Journal(journal_path(work / name), adapter.settings(), resume=True))
                with published(work / name, False, adapter) as tmp:
                    point = measure(adapter, sets, tmp, cfg=cfg, logprobs=logprobs, reference=reference,
                                     checks=checks, progress=progress)
                    point.update({"name": name, "settings": settings, "engine_report": grid.engine.report(adapter.conn),
                                  "startup_s": round(startup, 1), "elapsed_s": round(time.perf_counter() - began, 1)})
                    write_json(tmp / "point.json", point)
            finally:
                adapter.close()
    except (EngineDied, EndpointError) as exc:
        log.warning("grid point %s: %s", name, exc)
        return {"name": name, "settings": settings, "failed": str(exc)}
    return point


def measure(adapter: EndpointAdapter, sets: dict[str, EvalSet], where: Path, *, cfg: EvalConfig,
             logprobs: dict[str, Any], reference: Adapter | None, checks: dict[str, Check],
             progress: bool) -> dict[str, Any]:
    """The point's evaluation of every prompt set (each protocol's files of `phasekv eval` in `where`/PROTOCOL), its
    comparison with the reference and its checks."""
    protocols, comparison = {}, {}
    for protocol, eval_set in sets.items():
        records = predict(adapter, eval_set, cfg.batch_size or 16, True, progress, desc=f"{where.name} {protocol}")
        metrics = write_run(adapter, eval_set, records, where / protocol, cfg.seed)
        protocols[protocol] = {k: metrics[k] for k in POINT_KEYS if k in metrics}
        if "query_phase" in metrics:
            protocols[protocol]["query_phase"] = {k: metrics["query_phase"][k] for k in POINT_KEYS
                                                  if k in metrics["query_phase"]}
        protocols[protocol]["prompt_cache"] = prompt_cache(adapter, eval_set)
        if protocol in logprobs:
            comparison[protocol] = compare(adapter, reference, eval_set, logprobs=logprobs[protocol])
    point: dict[str, Any] = {"protocols": protocols}
    if comparison:
        point["comparison"] = comparison
    for check_name, check in checks.items():
        point[check_name] = check(adapter, sets, logprobs, reference)
    return point


def prompt_cache(adapter: EndpointAdapter, eval_set: EvalSet) -> dict[str, Any]:
    """What the engine said about its prefix cache for this prompt set's answers: the mode asked, the prompt
    tokens it took from the cache, the answers with a hit, and how many answers said (`reported`)."""
    cached = [a.cached for p in eval_set.prompts() if (a := adapter.answers.get(prompt_key(p.ids))) is not None
              and a.cached is not None]
    return {"mode": "reuse-prefix" if adapter.reuse_prefix else "off", "cached_tokens": sum(cached),
            "hits": sum(c > 0 for c in cached), "reported": len(cached), "n": len(eval_set.prompts())}


def verdict_class(verdict: str) -> str:
    """The class of a one-line verdict, without its numbers: "phase sensitive", "no phase effect detected", ..."""
    return verdict.split(":")[0].split(" (")[0].strip()


def grid_rows(points: list[dict[str, Any]], protocols: Sequence[str]) -> list[dict[str, Any]]:
    """One row per point and protocol: settings, accuracy, verdict class (and the query phase's), agreement."""
    rows = []
    for p in points:
        for protocol in protocols:
            row: dict[str, Any] = {"point": p["name"], "settings": p["settings"], "protocol": protocol}
            if "failed" in p:
                rows.append({**row, "failed": p["failed"]})
                continue
            m = p["protocols"][protocol]
            row.update({"accuracy": m["mean_accuracy"], "accuracy_ci": m["mean_ci"], "gap_pp": m["max_gap_pp"],
                        "verdict": verdict_class(m["verdict"]), "period": m["verdict_parts"]["period"]})
            if "prompt_cache" in m:
                row["prompt_cache"] = m["prompt_cache"]
            if "query_phase" in m:
                q = m["query_phase"]
                row.update({"query_verdict": verdict_class(q["verdict"]), "query_period": q["verdict_parts"]["period"],
                            "query_gap_pp": q["max_gap_pp"]})
            comparison = p.get("comparison", {}).get(protocol)
            if comparison is not None:
                o = comparison["overall"]
                row.update({"agree": o["agree"], "n": o["n"], "agreement": o["agreement"],
                            "agreement_ci": [o["ci_low"], o["ci_high"]],
                            "min_phase_agreement": min(g["agreement"] for g in comparison["per_phase"]),
                            "min_query_phase_agreement": min(g["agreement"] for g in comparison["per_query_phase"])})
            for check in CHECKS:
                result = p.get(check)
                if isinstance(result, dict) and result.get("protocol") == protocol and "overall" in result:
                    row[f"{check}_agreement"] = result["overall"]["agreement"]
                    row[f"{check}_n"] = result["overall"]["n"]
            rows.append(row)
    return rows


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def _cached(c: dict[str, Any] | None) -> str:
    if not c or not c["reported"]:
        return "not reported"
    return f"{c['cached_tokens']:,} ({c['hits']}/{c['reported']}{', ' + c['mode'] if c['mode'] != 'off' else ''})"


def grid_markdown(rows: list[dict[str, Any]], protocols: Sequence[str]) -> str:
    """grid.md: the table of `grid_rows`, one line per point and protocol."""
    checks = [c for c in CHECKS if any(f"{c}_agreement" in r for r in rows)]
    cache = any(r.get("prompt_cache", {}).get("reported") for r in rows)  # the engine says what it cached
    lines = ["| point | protocol | accuracy % [95%] | verdict | query-phase verdict | agreement [95%] | "
             "worst source / query phase agreement % |" + " cached prompt tokens (answers with a hit) |" * cache
             + "".join(f" {c} agreement % |" for c in checks),
             "|---|---|---|---|---|---|---|" + "---|" * (len(checks) + cache)]
    for r in rows:
        if "failed" in r:
            cause = r["failed"].split(" | ")[0]  # the first error line (grid.json has the whole reason)
            lines.append(f"| {r['point']} | {r['protocol']} | failed: {cause} | | | | |" + " |" * (len(checks) + cache))
            continue
        verdict = r["verdict"] + (f", period {r['period']}" if r["verdict"] == "phase sensitive" else "")
        query = "-" if "query_verdict" not in r else r["query_verdict"] + (
            f", period {r['query_period']}" if r["query_verdict"] == "phase sensitive" else "")
        agreement = "-" if "agree" not in r else (f"{r['agree']}/{r['n']} = {_pct(r['agreement'])} "
                                                  f"[{_pct(r['agreement_ci'][0])}, {_pct(r['agreement_ci'][1])}]")
        worst = "-" if "agree" not in r else (f"{_pct(r['min_phase_agreement'])} / "
                                              f"{_pct(r['min_query_phase_agreement'])}")
        lines.append(f"| {r['point']} | {r['protocol']} | {_pct(r['accuracy'])} [{_pct(r['accuracy_ci'][0])}, "
                     f"{_pct(r['accuracy_ci'][1])}] | {verdict} | {query} | {agreement} | {worst} |"
                     + (f" {_cached(r.get('prompt_cache'))} |" if cache else "")
                     + "".join(f" {_pct(r[f'{c}_agreement'])} of {r[f'{c}_n']} |" if f"{c}_n" in r else " - |"
                               for c in checks))
    return "\n".join(lines) + "\n"


def write_figures(points: list[dict[str, Any]], protocols: Sequence[str], stride: int, where: Path) -> list[Path]:
    """Setting x residue heat maps per protocol: engine accuracy per source phase, agreement with the reference
    per source phase and per query phase (points that failed are left out)."""
    done = [p for p in points if "failed" not in p]
    paths = []
    for protocol in protocols:
        accuracy = [{"setting": p["name"], "cells": [{"residue": c["phase"], "value": c["accuracy"], "n": c["n"]}
                                                     for c in p["protocols"][protocol]["per_phase"]]} for p in done]
        if accuracy:
            paths.append(plot_setting_residue(accuracy, where / f"accuracy_{protocol}.png", stride=stride,
                                              value="value", title=f"engine accuracy [%] by source phase, {protocol}"))
        compared = [p for p in done if protocol in p.get("comparison", {})]
        for key, label in (("phase", "source phase"), ("query_phase", "query phase")):
            rows = [{"setting": p["name"], "cells": [{"residue": g[key], "value": g["agreement"], "n": g["n"]}
                                                     for g in p["comparison"][protocol][f"per_{key}"]]}
                    for p in compared]
            if rows:
                paths.append(plot_setting_residue(rows, where / f"agreement_{key}_{protocol}.png", stride=stride,
                                                  value="value", title=f"engine vs reference agreement [%] by "
                                                                       f"{label}, {protocol}"))
    for check, (group, key, title) in CHECK_RESIDUES.items():
        rows = [{"setting": p["name"], "cells": [{"residue": g[key], "value": g["agreement"], "n": g["n"]}
                                                 for g in p[check][group]]}
                for p in done if group in p.get(check, {})]
        if rows:
            paths.append(plot_setting_residue(rows, where / f"{check}.png", stride=stride, value="value", title=title))
    return paths
