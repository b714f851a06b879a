"""`phasekv audit`: is a real model's retrieval phase sensitive under the chunk compression you ship?

One command for a person who ships a compressed model: load a transformers causal LM (optionally from
a GGUF file), render the lookup task in a prompt format the model can do (`phasekv.data.formats`),
and evaluate it under each condition:

    none            the full cache (the capability gate: if the model cannot do the task with this
                    format, the audit stops and says so; no phase verdict is given for a model at chance)
    select:r, mean, max-norm[+keep-first:n]
                    post-hoc chunk compression of the prefilled cache (`phasekv.conditions.posthoc`):
                    one entry per window of W tokens every S tokens, older than the local window
    press:NAME[:k=v,...]
                    a kvpress 0.5.5 press applied during prefill, the queries continued on the cache it
                    left (`phasekv.conditions.presses`; `make kvpress` installs it), e.g.
                    press:chunkkv:press=knorm,ratio=0.5,chunk=8

(the grammar of the conditions and their checks: `phasekv.conditions.grammar`).  The prompt set is described by
an `EvalConfig`, as for `phasekv eval` (`phasekv.config.audit_config` holds the audit's defaults and
`phasekv.evaluate.sources.audit_sets` builds its prompt sets); `AuditPlan` says what is evaluated on it.

Both padding protocols (exact position matching), per-phase accuracy with intervals, the chance
level, the detected period and a one-line verdict per condition go into OUT/summary.json (the one
source of truth) and OUT/report.html (drawn from it).  `protocols` may add the query protocol (the target
fixed, the prompt length varied): its query-phase curve gets the same verdict, and its source x query phase
cells a heatmap.  With a `reference` (the engine's weights in process, for an endpoint audit) the same prompts
go through it as well: OUT/comparison.json, the engine-vs-reference agreement per source and query phase
(`phasekv.evaluate.served`), also in summary.json and the report; a served model's own account of its
settings (llama.cpp's /props and /slots) is summary.json's `engine_report`.  An endpoint's journal is published
inside OUT (`phasekv.engines.journal.published`).
"""

from __future__ import annotations

import html
import logging
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from phasekv.adapters.base import Adapter
from phasekv.conditions.grammar import Geometry, check_conditions, condition_adapter
from phasekv.conditions.hybrid import touched
from phasekv.config import AuditPlan, EvalConfig
from phasekv.data.formats import FormatVocabulary, load_format
from phasekv.engines.client import EndpointAdapter, check_reference
from phasekv.engines.journal import published
from phasekv.engines.registry import running_settings
from phasekv.evaluate.runner import predict, write_run
from phasekv.evaluate.sources import audit_sets
from phasekv.evaluate.verdict import task_verdict
from phasekv.figures.evaluation import plot_cross_phase_heatmap, plot_residue_curves
from phasekv.outputs import write_json
from phasekv.report.html import comparison_table, figure, page, pct, query_phase_table
from phasekv.report.reproduce import METRIC_KEYS, check_finite

log = logging.getLogger(__name__)

PLAN = AuditPlan()  # the default plan

AUDIT_KEYS = (*METRIC_KEYS, "query_phase", "cross", "query_position_matching")  # the last three: query protocol


def compressed_verdict(m: dict[str, Any], chance: float, in_context_chance: float) -> dict[str, Any]:
    """`task_verdict` for a compressed condition of a model that passed the capability gate uncompressed: a collapse
    to chance at most phases is the finding, not an inability to do the task."""
    return task_verdict(m, chance, in_context_chance, capable=True)


def _evaluate(adapter: Adapter, eval_set, out: Path, cfg: EvalConfig, progress: bool, gated: bool) -> dict[str, Any]:
    """Metrics of one condition and protocol; `gated`: the uncompressed model passed the capability gate."""
    records = predict(adapter, eval_set, cfg.batch_size, True, progress, desc=f"{out.parent.name} {eval_set.protocol}")
    metrics = write_run(adapter, eval_set, records, out, cfg.seed, judge=compressed_verdict if gated else task_verdict)
    return {k: metrics[k] for k in AUDIT_KEYS if k in metrics}


def run_audit(adapter: Adapter, tokenizer: Any, cfg: EvalConfig, out: str | Path, *, plan: AuditPlan = PLAN,
              force: bool = False, progress: bool = True, reference: Adapter | None = None) -> dict[str, Any]:
    """Audit `adapter` (a transformers model, or an `EndpointAdapter`) under each of `plan`'s conditions, on the
    prompt sets `cfg` describes (`audit_config`: its format, records, demos, stride, local window, seed, batch size,
    chat template); publish OUT atomically (with an endpoint's journal).  `reference`: the served model's weights
    in process (needs an endpoint `adapter`), compared prompt by prompt."""
    served = isinstance(adapter, EndpointAdapter)
    check_reference(served, reference)
    conditions = ("none", *[c for c in plan.conditions if c != "none"])  # the capability gate always runs first
    geometry, protocols = Geometry(plan.window, cfg.stride, cfg.local_window), plan.protocols
    check_conditions(conditions, geometry)
    vocab = FormatVocabulary(load_format(cfg.format, cfg.chat), tokenizer)
    started = time.perf_counter()
    with published(out, force, adapter if served else None) as tmp:
        sets = audit_sets(vocab, cfg, protocols, plan.prompts_per_phase)
        adapter.check_length(max(s.prompt_length for s in sets.values()))
        results: dict[str, Any] = {}
        for condition in tqdm(conditions, desc="audit", unit="condition", disable=not progress):
            cond_adapter = condition_adapter(adapter, condition, geometry)
            results[condition] = {p: _evaluate(cond_adapter, s, tmp / "conditions" / _safe(condition) / p, cfg,
                                               progress, condition != "none")
                                  for p, s in sets.items()}
            results[condition]["cache_bytes"] = getattr(cond_adapter, "bytes", None)  # full vs compressed prefill
            if hasattr(cond_adapter, "kept"):  # a press: the share of each phase's positions it kept (both protocols)
                results[condition]["kept"] = cond_adapter.kept()
            if hasattr(cond_adapter, "extras"):  # what a condition records beside its metrics (adapters.conditions)
                results[condition].update(cond_adapter.extras(sets, progress))
            if not served:  # the layers it acted on (full attention) and those left as the model runs them
                results[condition]["layers"] = touched(adapter.module, condition != "none")
            if condition == "none" and not all(results["none"][p]["can_do_task"] for p in protocols):
                log.warning("the model cannot do the task with format %s; no compressed condition evaluated",
                            cfg.format)
                break
        if reference is not None:
            from phasekv.evaluate.served import compare

            comparison = {p: compare(adapter, reference, s, cfg.batch_size) for p, s in sets.items()}
            write_json(tmp / "comparison.json", comparison)
        summary = {
            "model": adapter.info.name, "format": vocab.to_dict(), "conditions": results,
            "can_do_task": all(results["none"][p]["can_do_task"] for p in protocols),
            "settings": {"window": plan.window, "stride": cfg.stride, "local_window": cfg.local_window,
                         "n_records": cfg.records, "n_demos": cfg.demos, "prompts_per_phase": plan.prompts_per_phase,
                         "seed": cfg.seed, "protocols": list(protocols), "retokenization_agreement":
                             vocab.retokenization_agreement(sets[protocols[0]].prompts()[0].ids)},
            "elapsed_s": round(time.perf_counter() - started, 1),
        }
        if reference is not None:
            summary["comparison"] = comparison
        if served:  # what the server says about its own settings (llama.cpp: /props, /slots), beside the verdict
            summary["engine_report"] = running_settings(adapter.api.name, adapter.conn)
        check_finite(summary)
        write_json(tmp / "summary.json", summary)
        write_audit_report(summary, tmp)
    return summary


_TITLES = {"query": "query protocol, by source phase (target position mod S)"}


def _query_section(conditions: dict[str, Any], out: Path) -> list[str]:
    """The query protocol's query-phase table and one source x query phase heatmap per condition."""
    parts = ["<h2>query protocol: the query phase (prompt length mod S)</h2><p class='note'>The target records keep "
             "their positions and fillers after them make the prompt one token longer per shift, so every query "
             "phase (query position mod S) holds the same examples at the same target positions: the query-phase "
             "curve gets the same three-part verdict as the source phase. The distance from target to query grows "
             "with the shift (a trend, not a period). Its source-phase groups hold different (example, target) "
             "pairs, each at every shift, so the pair is their unit of resampling and permutation; the padding "
             "protocols, which show every example at every source phase, remain the test of the source phase.</p>",
             query_phase_table({n: r["query"] for n, r in conditions.items()})]
    for name, result in conditions.items():
        path = plot_cross_phase_heatmap(result["query"]["cross"], out / "figures" / f"cross_{_safe(name)}.png",
                                        title=f"{name}: accuracy [%] by source x query phase")
        parts.append(figure(path, f"{name}: top-1 accuracy by source phase (rows) and query phase (columns), with the "
                                "margins; cell text: accuracy and prompts."))
    return parts


def _safe(condition: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in condition)


def _layers_section(conditions: dict[str, Any]) -> list[str]:
    """Which layers each condition acted on and which it left as the model runs them (hybrid models)."""
    rows = [(name, r["layers"]) for name, r in conditions.items() if r.get("layers")]
    if not rows or all(set(layers["kinds"]) == {"full"} for _, layers in rows):
        return []
    out = ["<h2>Layers</h2><p class='note'>A condition acts on the full-attention layers, the ones that keep the whole "
           "past; sliding-window, chunked and linear layers run as the model runs them.</p><table><tr><th>condition"
           "</th><th>compressed layers</th><th>left as the model has them</th></tr>"]
    for name, layers in rows:
        left = ", ".join(f"{i} ({kind})" for i, kind in layers["left"].items()) or "none"
        out.append(f"<tr><td>{html.escape(name)}</td><td>{', '.join(map(str, layers['compressed'])) or 'none'}</td>"
                   f"<td>{html.escape(left)}</td></tr>")
    return [*out, "</table>"]


def write_audit_report(summary: dict[str, Any], out: Path) -> Path:
    """report.html of an audit, drawn from `summary` alone."""
    conditions = summary["conditions"]
    parts = [f"<h1>Phase audit of {html.escape(summary['model'])}</h1>",
             f"<p class='note'>Format {html.escape(summary['format']['format']['name'])}; windows of "
             f"{summary['settings']['window']} tokens every {summary['settings']['stride']} (phase = position mod "
             f"{summary['settings']['stride']}); the last {summary['settings']['local_window']} tokens stay raw. "
             "Accuracy = top-1 of the answer's first token; in-context chance = the accuracy of copying a random value "
             "present in the prompt (the capability gate's baseline); format chance = 1 / possible answer tokens.</p>"]
    if not summary["can_do_task"]:
        first = summary["settings"]["protocols"][0]
        parts.append(f"<p class='no'>{html.escape(conditions['none'][first]['verdict'])} with this format: "
                     "no compressed condition was evaluated.</p>")
    parts += _layers_section(conditions)
    for protocol in summary["settings"]["protocols"]:
        if protocol == "query":
            parts += _query_section(conditions, out)
        parts.append(f"<h2>{_TITLES.get(protocol, protocol + ' padding')}</h2><table><tr><th>condition</th>"
                     "<th>mean %</th><th>in-context chance %</th><th>format chance %</th>"
                     "<th>worst phase %</th><th>gap pp</th><th>period</th><th>flatness p</th><th>verdict</th></tr>")
        for name, result in conditions.items():
            m = result[protocol]
            worst = min(r["accuracy"] for r in m["per_phase"])
            parts.append(f"<tr><td>{html.escape(name)}</td><td>{pct(m['mean_accuracy'])}</td>"
                         f"<td>{pct(m['in_context_chance'])}</td><td>{pct(m['chance'])}</td><td>{pct(worst)}</td><td>{m['max_gap_pp']:.1f}</td>"
                         f"<td>{m['detected_period']}</td><td>{m['flatness_p']:.3g}</td>"
                         f"<td>{html.escape(m['verdict'])}</td></tr>")
        parts.append("</table>")
        path = plot_residue_curves({n: r[protocol] for n, r in conditions.items()},
                                   out / "figures" / f"phases_{protocol}.png",
                                   title=f"Accuracy by target position mod S, {protocol} padding")
        parts.append(figure(path, f"Accuracy by phase per condition, {protocol} padding (Wilson 95% intervals)."))
    if summary.get("comparison"):
        parts += ["<h2>Engine vs reference</h2><p class='note'>The same prompts through the served model and through "
                  "transformers on the same weights: agreement of the greedy next tokens (Wilson 95% intervals) and "
                  "the engine's minus the reference's log-probability of the engine's token.</p>",
                  comparison_table(summary["comparison"])]
    footer = (f"<p class='note'>phasekv audit, {summary['elapsed_s']:.0f} s; settings: "
              f"{html.escape(str(summary['settings']))}.</p>")
    path = out / "report.html"
    path.write_text(page(f"phasekv audit: {summary['model']}", parts, footer))
    return path
