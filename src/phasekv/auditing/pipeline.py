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

import dataclasses
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
from phasekv.data.longcontext import LongContextSet, LongContextSpec
from phasekv.engines.client import EndpointAdapter, check_reference
from phasekv.engines.journal import prompt_key, prompt_set_key, published
from phasekv.evaluate.longrun import LongSetView, depth_statistics, predict_long
from phasekv.evaluate.runner import predict, write_run, write_run_files
from phasekv.evaluate.sources import audit_sets
from phasekv.evaluate.verdict import holm_line, task_verdict
from phasekv.figures.evaluation import plot_cross_phase_heatmap, plot_phase_heatmap, plot_residue_curves
from phasekv.outputs import SUMMARY_SCHEMA_VERSION, write_json
from phasekv.report.html import comparison_table, figure, page, pct, query_phase_table
from phasekv.report.reproduce import METRIC_KEYS, check_finite

log = logging.getLogger(__name__)

PLAN = AuditPlan()  # the default plan

AUDIT_KEYS = (*METRIC_KEYS, "query_phase", "cross", "query_position_matching",  # these three: the query protocol
              "by_depth")  # a long-context set


def compressed_verdict(m: dict[str, Any], chance: float, in_context_chance: float) -> dict[str, Any]:
    """`task_verdict` for a compressed condition of a model that passed the capability gate uncompressed: a collapse
    to chance at most phases is the finding, not an inability to do the task."""
    return task_verdict(m, chance, in_context_chance, capable=True)


def _evaluate(adapter: Adapter, eval_set, cfg: EvalConfig, condition: str, progress: bool) -> dict[str, Any]:
    """Full metrics and prediction records of one condition and protocol (the uncompressed model passed the
    capability gate for every condition but `none`).  A long-context set is streamed and also judged per target
    depth (`by_depth`)."""
    judge = task_verdict if condition == "none" else compressed_verdict
    if isinstance(eval_set, LongContextSet):
        view = LongSetView(eval_set)
        records = predict_long(adapter, eval_set, progress=progress, desc=f"{_safe(condition)} {view.protocol}")
        metrics = write_run(adapter, view, records, None, cfg.seed, judge=judge)
        metrics["by_depth"] = depth_statistics(records, view, seed=cfg.seed, judge=judge)
        return {"metrics": metrics, "records": records}
    records = predict(adapter, eval_set, cfg.batch_size, True, progress, desc=f"{_safe(condition)} {eval_set.protocol}")
    metrics = write_run(adapter, eval_set, records, None, cfg.seed, judge=judge)
    return {"metrics": metrics, "records": records}


def long_sets(spec: LongContextSpec, tokenizer: Any, protocols: tuple[str, ...]) -> dict[str, LongContextSet]:
    """The long-context prompt set of each protocol (prompts built on demand)."""
    return {p: LongContextSet(dataclasses.replace(spec, protocol=p), tokenizer) for p in protocols}


def checkpoint_subject(path: str | Path, spec: LongContextSpec, prefill_chunk: int = 0
                       ) -> tuple[Adapter, Any, LongContextSpec]:
    """A phasekv checkpoint as the subject of a long-context audit: (its adapter, its word vocabulary, which the
    prompt set takes as its tokenizer (`phasekv.data.keyspace.vocabulary_key_space`), `spec` with the records, key
    length and local window of its training data: the layout it learned)."""
    from phasekv.adapters.phasekv import PhaseKVAdapter
    from phasekv.checkpoint import load_checkpoint, read_experiment, resolve
    from phasekv.data.vocab import Vocabulary
    from phasekv.model import PhaseKVForCausalLM

    tree = read_experiment(resolve(path))
    model, _ = load_checkpoint(path, tree=tree)
    if not isinstance(model, PhaseKVForCausalLM) or "vocab" not in tree:
        raise ValueError(f"--checkpoint {path}: not a phasekv-family checkpoint with its word vocabulary (a "
                         "transformers-family one: export it and audit it with --hf)")
    data = tree["data"]
    spec = dataclasses.replace(spec, n_records=data["n_records"], key_tokens=data["key_tokens"],
                               local_window=data["local_window"])
    adapter = PhaseKVAdapter(model, Path(path).name, prefill_chunk=prefill_chunk)
    return adapter, Vocabulary.from_dict(tree["vocab"]), spec


def run_audit(adapter: Adapter, tokenizer: Any, cfg: EvalConfig, out: str | Path | None, *, plan: AuditPlan = PLAN,
              force: bool = False, progress: bool = True, reference: Adapter | None = None,
              long_context: LongContextSpec | None = None) -> dict[str, Any]:
    """`measure_audit`, published as OUT atomically (with an endpoint's journal: `write_audit`); the summary."""
    with published(out, force, adapter if isinstance(adapter, EndpointAdapter) else None) as tmp:
        summary, runs = measure_audit(adapter, tokenizer, cfg, plan=plan, progress=progress, reference=reference,
                                      long_context=long_context)
        write_audit(summary, runs, tmp)
    return summary


def measure_audit(adapter: Adapter, tokenizer: Any, cfg: EvalConfig, *, plan: AuditPlan = PLAN, progress: bool = True,
                  reference: Adapter | None = None,
                  long_context: LongContextSpec | None = None) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Audit `adapter` (a transformers model, or an `EndpointAdapter`) under each of `plan`'s conditions, on the
    prompt sets `cfg` describes (`audit_config`: its format, records, demos, stride, local window, seed, batch size,
    chat template), writing nothing.  `reference`: the served model's weights in process (needs an endpoint
    `adapter`), compared prompt by prompt.  (summary, runs): runs[condition][protocol] holds that run's full
    metrics and prediction records (what `write_audit` writes).  `long_context`: the prompt sets are that
    long-context design's (its stride and protocols from `cfg` and `plan`), streamed, with a verdict per depth."""
    served = isinstance(adapter, EndpointAdapter)
    check_reference(served, reference)
    conditions = ("none", *[c for c in plan.conditions if c != "none"])  # the capability gate always runs first
    geometry, protocols = Geometry(plan.window, cfg.stride, cfg.local_window), plan.protocols
    check_conditions(conditions, geometry)
    vocab = None if long_context else FormatVocabulary(load_format(cfg.format, cfg.chat), tokenizer)
    started = time.perf_counter()
    sets = long_sets(long_context, tokenizer, protocols) if long_context else audit_sets(
        vocab, cfg, protocols, plan.prompts_per_phase)
    adapter.check_length(max(s.prompt_length for s in sets.values()))
    if served and adapter.journal is not None:  # a resumed journal must hold answers to these prompts
        adapter.journal.bind("prompt_set", prompt_set_key(_ids(p) for s in sets.values() for p in s.prompts()))
    results: dict[str, Any] = {}
    runs: dict[str, dict[str, Any]] = {}
    for condition in tqdm(conditions, desc="audit", unit="condition", disable=not progress):
        cond_adapter = condition_adapter(adapter, condition, geometry)
        try:
            runs[condition] = {p: _evaluate(cond_adapter, s, cfg, condition, progress) for p, s in sets.items()}
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: what was answered so far, beside the journal
            if served and adapter.journal is not None:
                write_partial(adapter, sets)
            raise
        results[condition] = {p: {k: run["metrics"][k] for k in AUDIT_KEYS if k in run["metrics"]}
                              for p, run in runs[condition].items()}
        results[condition]["cache_bytes"] = getattr(cond_adapter, "bytes", None)  # full vs compressed prefill
        if hasattr(cond_adapter, "kept"):  # a press: the share of each phase's positions it kept (both protocols)
            results[condition]["kept"] = cond_adapter.kept()
        if hasattr(cond_adapter, "extras"):  # what a condition records beside its metrics (adapters.conditions)
            results[condition].update(cond_adapter.extras(sets, progress))
        if _transformers_model(adapter):  # the layers it acted on (full attention), those left as the model has them
            results[condition]["layers"] = touched(adapter.module, condition != "none")
        if condition == "none" and not all(results["none"][p]["can_do_task"] for p in protocols):
            log.warning("the model cannot do the task with format %s; no compressed condition evaluated",
                        f"long-context {long_context.family}" if long_context else cfg.format)
            break
    summary = {"schema_version": SUMMARY_SCHEMA_VERSION, "model": adapter.info.name, "conditions": results,
               "can_do_task": all(results["none"][p]["can_do_task"] for p in protocols),
               "family_wise": family_wise(results, protocols), **_described(vocab, sets, cfg, plan, long_context)}
    if reference is not None:
        from phasekv.evaluate.served import compare

        summary["comparison"] = {p: compare(adapter, reference, s, cfg.batch_size) for p, s in sets.items()}
    if served:  # what the server says about its own settings (llama.cpp: /props, /slots), beside the verdict
        summary["engine_report"] = adapter.report()
    summary["elapsed_s"] = round(time.perf_counter() - started, 1)
    check_finite(summary)
    return summary, runs


def family_wise(conditions: dict[str, Any], protocols: tuple[str, ...]) -> str:
    """One line of Holm's family-wise view of every flatness p-value behind the audit's verdicts (each condition and
    protocol, and the query protocol's query phase): an audit prints several verdicts on the same prompts, and an
    outside audit found "a phase effect" somewhere in about 17% of flat audits at 5% per test (`verdict.holm_line`)."""
    pvalues = {}
    for name, result in conditions.items():
        for protocol in (p for p in protocols if p in result):
            pvalues[f"{name}/{protocol}"] = result[protocol].get("flatness_p")
            if "query_phase" in result[protocol]:
                pvalues[f"{name}/query phase"] = result[protocol]["query_phase"].get("flatness_p")
    return holm_line(pvalues)


def _transformers_model(adapter: Adapter) -> bool:
    """Whether the audited model is a transformers model in process (whose layer kinds its config names)."""
    from transformers import PretrainedConfig

    return isinstance(getattr(getattr(adapter, "module", None), "config", None), PretrainedConfig)


def _described(vocab, sets: dict[str, Any], cfg: EvalConfig, plan: AuditPlan,
               long_context: LongContextSpec | None) -> dict[str, Any]:
    """The summary's description of the prompt sets: format, settings, whether the model can do the task."""
    protocols, first = plan.protocols, plan.protocols[0]
    return {"format": vocab.to_dict() if vocab else {"format": {"name": f"long-context {long_context.family}"},
                                                     "long_context": sets[first].settings},
            "settings": {"window": plan.window, "stride": cfg.stride, "local_window": cfg.local_window,
                         "n_records": cfg.records, "n_demos": cfg.demos, "prompts_per_phase": plan.prompts_per_phase,
                         "seed": cfg.seed, "protocols": list(protocols), "retokenization_agreement":
                             vocab.retokenization_agreement(sets[first].prompts()[0].ids) if vocab else None}}


def write_audit(summary: dict[str, Any], runs: dict[str, dict[str, Any]], out: str | Path | None) -> None:
    """An audit's files in the directory `out` (nothing when None): each condition's and protocol's run
    (conditions/COND/PROTOCOL/: metrics.json, predictions.jsonl, figures), comparison.json with a reference,
    summary.json and report.html."""
    if out is None:
        return
    out = Path(out)
    for condition, protocols in runs.items():
        for protocol, run in protocols.items():
            write_run_files(run["metrics"], run["records"], out / "conditions" / _safe(condition) / protocol)
    if "comparison" in summary:
        write_json(out / "comparison.json", summary["comparison"])
    write_json(out / "summary.json", summary)
    write_audit_report(summary, out)


def _ids(prompt) -> list[int]:
    return prompt.ids.tolist() if hasattr(prompt.ids, "tolist") else prompt.ids


def write_partial(adapter: EndpointAdapter, sets: dict[str, Any]) -> Path:
    """An interrupted endpoint audit's summary so far, marked `"partial": true`, written atomically beside its
    journal (in OUT's resumable temporary directory): per protocol the prompts answered and their accuracy, overall
    and per source phase (no verdict: the groups are incomplete).  `--resume` completes the run."""
    protocols = {}
    for name, eval_set in sets.items():
        per_phase: dict[int, list[int]] = {}
        for prompt in eval_set.prompts():
            answer = adapter.answers.get(prompt_key(_ids(prompt)))
            query = getattr(prompt, "query", prompt)  # a long-context prompt is its own query
            if answer is not None:
                per_phase.setdefault(query.phase, []).append(int(answer.token == query.answer))
        answered = [c for hits in per_phase.values() for c in hits]
        total = getattr(eval_set, "n_prompts", None) or len(eval_set.prompts())
        protocols[name] = {"prompts": total, "answered": len(answered),
                           "accuracy": sum(answered) / len(answered) if answered else None,
                           "per_phase": [{"phase": ph, "n": len(h), "accuracy": sum(h) / len(h)}
                                         for ph, h in sorted(per_phase.items())]}
    path = adapter.journal.path.parent / "partial_summary.json"
    write_json(path, {"partial": True, "model": adapter.info.name, "protocols": protocols,
                      "answered": sum(p["answered"] for p in protocols.values()),
                      "prompts": sum(p["prompts"] for p in protocols.values()),
                      "resume": "the same command with --resume sends only the unanswered prompts"}, atomic=True)
    log.warning("interrupted: %s holds the answers so far (partial); --resume completes the run", path)
    return path


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
    parts = [f"<h1>Phase audit of {html.escape(summary['model'])}</h1>"]
    about = [f"<p class='note'>Format {html.escape(summary['format']['format']['name'])}; windows of "
             f"{summary['settings']['window']} tokens every {summary['settings']['stride']} (phase = position mod "
             f"{summary['settings']['stride']}); the last {summary['settings']['local_window']} tokens stay raw. "
             "Accuracy = top-1 of the answer's first token; in-context chance = the accuracy of copying a random value "
             "present in the prompt (the capability gate's baseline); format chance = 1 / possible answer tokens.</p>",
             *_layers_section(conditions)]  # after the first protocol's curves and table: the headline comes first
    if not summary["can_do_task"]:
        first = summary["settings"]["protocols"][0]
        parts.append(f"<p class='no'>{html.escape(conditions['none'][first]['verdict'])} with this format: "
                     "no compressed condition was evaluated.</p>")
    if summary.get("family_wise"):  # with the settings, after the first protocol's curves and table
        about.insert(0, f"<p class='note'>{html.escape(summary['family_wise'])}</p>")
    for protocol in summary["settings"]["protocols"]:
        if protocol == "query":
            parts += _query_section(conditions, out)
        # the conditions' per-phase curves first: the headline a reader wants on the first screen, then the table
        path = plot_residue_curves({n: r[protocol] for n, r in conditions.items()},
                                   out / "figures" / f"phases_{protocol}.png",
                                   title=f"Accuracy by target position mod S, {protocol} padding")
        parts.append(f"<h2>{_TITLES.get(protocol, protocol + ' padding')}</h2>")
        parts.append(figure(path, f"Accuracy by phase per condition, {protocol} padding (Wilson 95% intervals).",
                            headline=bool(about)))
        depths = {f"{n}, depth {d}": m for n, r in conditions.items()
                  for d, m in r[protocol].get("by_depth", {}).items()}
        if depths:  # a long-context set: the needle-in-a-haystack map with the phase axis
            path = plot_phase_heatmap(depths, out / "figures" / f"depth_phase_{protocol}.png",
                                      title=f"Accuracy [%] by target depth and phase, {protocol}")
            parts.append(figure(path, "Top-1 accuracy by target depth (rows, per condition) and phase (columns); the "
                                      "per-depth verdicts and Wilson intervals are in summary.json's by_depth."))
        parts.append("<table><tr><th>condition</th>"
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
        parts += about
        about = []
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
