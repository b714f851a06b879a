"""`phasekv audit`: is a real model's retrieval phase sensitive under the chunk compression you ship?

One command for a person who ships a compressed model: load a transformers causal LM (optionally from
a GGUF file), render the lookup task in a prompt format the model can do (`phasekv.data.formats`),
and evaluate it under each condition:

    none            the full cache (the capability gate: if the model cannot do the task with this
                    format, the audit stops and says so; no phase verdict is given for a model at chance)
    select:r, mean, max-norm[+keep-first:n]
                    post-hoc chunk compression of the prefilled cache (`phasekv.evaluate.posthoc`):
                    one entry per window of W tokens every S tokens, older than the local window
    press:NAME[:k=v,...]
                    a kvpress 0.5.5 press applied during prefill, the queries continued on the cache it
                    left (`phasekv.evaluate.presses`; `make kvpress` installs it), e.g.
                    press:chunkkv:press=knorm,ratio=0.5,chunk=8

Both padding protocols (exact position matching), per-phase accuracy with intervals, the chance
level, the detected period and a one-line verdict per condition go into OUT/summary.json (the one
source of truth) and OUT/report.html (drawn from it).  `protocols` may add the query protocol (the target
fixed, the prompt length varied): its query-phase curve gets the same verdict, and its source x query phase
cells a heatmap.  With a `reference` (the engine's weights in process, for an endpoint audit) the same prompts
go through it as well: OUT/comparison.json, the engine-vs-reference agreement per source and query phase
(`phasekv.evaluate.compare`), also in summary.json and the report.
"""

from __future__ import annotations

import html
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from phasekv.adapters.selection import SelectionAdapter, is_selection, parse_selection
from phasekv.config import PROTOCOLS
from phasekv.data.formats import FormatVocabulary, load_format
from phasekv.data.protocols import build_eval_set
from phasekv.evaluate.adapter import Adapter
from phasekv.evaluate.runner import predict, write_run
from phasekv.evaluate.selection import selection_mechanism
from phasekv.evaluate.verdict import task_verdict
from phasekv.figures.evaluation import plot_cross_phase_heatmap, plot_residue_curves
from phasekv.outputs import output_dir
from phasekv.report.html import STYLE, _img, _pct, comparison_table, query_phase_table
from phasekv.report.reproduce import METRIC_KEYS, check_finite

log = logging.getLogger(__name__)

AUDIT_KEYS = (*METRIC_KEYS, "query_phase", "cross", "query_position_matching")  # the last three: query protocol


def check_conditions(conditions: tuple[str, ...], window: int, stride: int, local_window: int) -> None:
    """One-line ValueError for any condition that cannot be evaluated, before a model is loaded."""
    from phasekv.evaluate.posthoc import check_geometry, parse_policy

    check_geometry(window, stride, local_window)
    for condition in conditions:
        if is_selection(condition):
            parse_selection(condition)
        elif condition.startswith("press:"):
            from phasekv.evaluate.presses import check_press

            check_press(condition[len("press:"):])
        elif condition != "none":
            parse_policy(condition, window)


def condition_adapter(base: Adapter, condition: str, window: int, stride: int, local_window: int) -> Adapter:
    """The adapter that evaluates `base` under one condition (see the module docstring)."""
    if condition == "none":
        return base
    if is_selection(condition):
        return SelectionAdapter(base, parse_selection(condition))
    if condition.startswith("press:"):
        from phasekv.evaluate.presses import PressAdapter

        return PressAdapter(base, condition[len("press:"):], stride=stride)
    from phasekv.evaluate.posthoc import PosthocAdapter

    return PosthocAdapter(base, condition, window=window, stride=stride, local_window=local_window)


def compressed_verdict(m: dict[str, Any], chance: float, in_context_chance: float) -> dict[str, Any]:
    """`task_verdict` for a compressed condition of a model that passed the capability gate uncompressed: a collapse
    to chance at most phases is the finding, not an inability to do the task."""
    return task_verdict(m, chance, in_context_chance, capable=True)


def _evaluate(adapter: Adapter, eval_set, out: Path, batch_size: int, seed: int, progress: bool,
              gated: bool) -> dict[str, Any]:
    """Metrics of one condition and protocol; `gated`: the uncompressed model passed the capability gate."""
    records = predict(adapter, eval_set, batch_size, True, progress, desc=f"{out.parent.name} {eval_set.protocol}")
    metrics = write_run(adapter, eval_set, records, out, seed, judge=compressed_verdict if gated else task_verdict)
    return {k: metrics[k] for k in AUDIT_KEYS if k in metrics}


def run_audit(adapter: Adapter, tokenizer: Any, out: str | Path, fmt: str = "records",
              conditions: tuple[str, ...] = ("none", "select:3+keep-first:1", "mean+keep-first:1"),
              window: int = 8, stride: int = 8, local_window: int = 16, n_records: int = 24, n_demos: int = 4,
              prompts_per_phase: int = 192, seed: int = 0, batch_size: int = 16, force: bool = False,
              progress: bool = True, protocols: tuple[str, ...] = PROTOCOLS, chat: bool = False,
              reference: Adapter | None = None) -> dict[str, Any]:
    """Audit `adapter` (a transformers model, or an `EndpointAdapter`) under each condition; publish OUT atomically.
    `chat`: wrap the prompts in the tokenizer's chat template (`phasekv.data.formats`); `reference`: the served
    model's weights in process (needs an endpoint `adapter`), compared prompt by prompt."""
    from phasekv.evaluate.endpoint import EndpointAdapter

    if reference is not None and not isinstance(adapter, EndpointAdapter):
        raise ValueError("--reference-hf: compares a served model with its weights in process: needs --endpoint")
    if "none" not in conditions:
        conditions = ("none", *conditions)  # the capability gate always runs first
    conditions = ("none", *[c for c in conditions if c != "none"])
    check_conditions(conditions, window, stride, local_window)
    vocab = FormatVocabulary(load_format(fmt, chat), tokenizer)
    kt, vt = vocab.record_shape
    started = time.perf_counter()
    with output_dir(out, force) as tmp:
        record = kt + vt + vocab.haystack_tokens
        sets = {p: build_eval_set(vocab, p, n_records=n_records, n_demos=n_demos, stride=stride, residue_modulus=stride,
                                  n_clusters=_clusters(prompts_per_phase, record, p, stride), key_tokens=kt,
                                  value_tokens=vt, local_window=local_window, seed=seed)
                for p in protocols}
        adapter.check_length(max(s.prompt_length for s in sets.values()))
        results: dict[str, Any] = {}
        for condition in tqdm(conditions, desc="audit", unit="condition", disable=not progress):
            cond_adapter = condition_adapter(adapter, condition, window, stride, local_window)
            results[condition] = {p: _evaluate(cond_adapter, s, tmp / "conditions" / _safe(condition) / p,
                                               batch_size, seed, progress, condition != "none")
                                  for p, s in sets.items()}
            results[condition].update(_condition_extras(cond_adapter, sets, progress))
            if condition == "none" and not all(results["none"][p]["can_do_task"] for p in protocols):
                log.warning("the model cannot do the task with format %s; no compressed condition evaluated", fmt)
                break
        if reference is not None:
            from phasekv.evaluate.compare import compare

            comparison = {p: compare(adapter, reference, s, batch_size) for p, s in sets.items()}
            (tmp / "comparison.json").write_text(json.dumps(comparison, indent=2, sort_keys=True) + "\n")
        summary = {
            "model": adapter.info.name, "format": vocab.to_dict(), "conditions": results,
            "can_do_task": all(results["none"][p]["can_do_task"] for p in protocols),
            "settings": {"window": window, "stride": stride, "local_window": local_window, "n_records": n_records,
                         "n_demos": n_demos, "prompts_per_phase": prompts_per_phase, "seed": seed,
                         "protocols": list(protocols), "retokenization_agreement":
                             vocab.retokenization_agreement(sets[protocols[0]].prompts()[0].ids)},
            "elapsed_s": round(time.perf_counter() - started, 1),
        }
        if reference is not None:
            summary["comparison"] = comparison
        check_finite(summary)
        (tmp / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
        write_audit_report(summary, tmp)
    return summary


def _condition_extras(cond_adapter: Adapter, sets: dict[str, Any], progress: bool) -> dict[str, Any]:
    """What a condition records beside its metrics: cache bytes (full vs compressed prefill), a press's share of
    each phase's positions kept, a selection's attended share and which pools its answering query selected."""
    extras: dict[str, Any] = {"cache_bytes": getattr(cond_adapter, "bytes", None)}
    if hasattr(cond_adapter, "kept"):
        extras["kept"] = cond_adapter.kept()
    if isinstance(cond_adapter, SelectionAdapter):
        extras["attended"] = cond_adapter.attended
        extras["mechanism"] = {p: selection_mechanism(cond_adapter, s, progress=progress)
                               for p, s in sets.items() if p != "query"}
    return extras


def _clusters(per_phase: int, record: int, protocol: str, stride: int) -> int:
    """The fewest clusters (a multiple of g = gcd(record pitch, S)) that give at least `per_phase` prompts
    per phase: a cluster is shown at S shifts with S / g targets, i.e. S / g prompts per phase.  `record`:
    the tokens of a record and its haystack prose (the pitch without in-sequence fillers)."""
    g = math.gcd(record + (1 if protocol == "insequence" else 0), stride)
    clusters = math.ceil(per_phase / (stride // g))
    return math.ceil(clusters / g) * g


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
        parts.append(_img(path, f"{name}: top-1 accuracy by source phase (rows) and query phase (columns), with the "
                                "margins; cell text: accuracy and prompts."))
    return parts


def _safe(condition: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in condition)


def write_audit_report(summary: dict[str, Any], out: Path) -> Path:
    """report.html of an audit, drawn from `summary` alone."""
    conditions = summary["conditions"]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>phasekv audit: "
             f"{html.escape(summary['model'])}</title><style>{STYLE}</style></head><body>",
             f"<h1>Phase audit of {html.escape(summary['model'])}</h1>",
             f"<p class='note'>Format {html.escape(summary['format']['format']['name'])}; windows of "
             f"{summary['settings']['window']} tokens every {summary['settings']['stride']} (phase = position mod "
             f"{summary['settings']['stride']}); the last {summary['settings']['local_window']} tokens stay raw. "
             "Accuracy = top-1 of the answer's first token; in-context chance = the accuracy of copying a random value "
             "present in the prompt (the capability gate's baseline); format chance = 1 / possible answer tokens.</p>"]
    if not summary["can_do_task"]:
        first = summary["settings"]["protocols"][0]
        parts.append(f"<p class='no'>{html.escape(conditions['none'][first]['verdict'])} with this format: "
                     "no compressed condition was evaluated.</p>")
    for protocol in summary["settings"]["protocols"]:
        if protocol == "query":
            parts += _query_section(conditions, out)
        parts.append(f"<h2>{_TITLES.get(protocol, protocol + ' padding')}</h2><table><tr><th>condition</th>"
                     "<th>mean %</th><th>in-context chance %</th><th>format chance %</th>"
                     "<th>worst phase %</th><th>gap pp</th><th>period</th><th>flatness p</th><th>verdict</th></tr>")
        for name, result in conditions.items():
            m = result[protocol]
            worst = min(r["accuracy"] for r in m["per_phase"])
            parts.append(f"<tr><td>{html.escape(name)}</td><td>{_pct(m['mean_accuracy'])}</td>"
                         f"<td>{_pct(m['in_context_chance'])}</td><td>{_pct(m['chance'])}</td><td>{_pct(worst)}</td><td>{m['max_gap_pp']:.1f}</td>"
                         f"<td>{m['detected_period']}</td><td>{m['flatness_p']:.3g}</td>"
                         f"<td>{html.escape(m['verdict'])}</td></tr>")
        parts.append("</table>")
        path = plot_residue_curves({n: r[protocol] for n, r in conditions.items()},
                                   out / "figures" / f"phases_{protocol}.png",
                                   title=f"Accuracy by target position mod S, {protocol} padding")
        parts.append(_img(path, f"Accuracy by phase per condition, {protocol} padding (Wilson 95% intervals)."))
    if summary.get("comparison"):
        parts += ["<h2>Engine vs reference</h2><p class='note'>The same prompts through the served model and through "
                  "transformers on the same weights: agreement of the greedy next tokens (Wilson 95% intervals) and "
                  "the engine's minus the reference's log-probability of the engine's token.</p>",
                  comparison_table(summary["comparison"])]
    parts.append(f"<p class='note'>phasekv audit, {summary['elapsed_s']:.0f} s; settings: "
                 f"{html.escape(str(summary['settings']))}.</p></body></html>")
    path = out / "report.html"
    path.write_text("\n".join(parts))
    return path
