"""An audit's or an evaluation's results where a model's readers look: the Hugging Face Hub's `.eval_results/*.yaml`
entries (the Hub shows them on the model page and aggregates them into the benchmark dataset's leaderboard) and a
short model-card section in markdown (the per-phase table and the figures).

The entry fields are the Hub's documented ones (its eval-results page, `huggingface_hub.EvalResultEntry`): a list
of entries, each with `dataset` (`id`, required, a Hub dataset id that the Hub must know as a benchmark for a
leaderboard; `task_id`; `revision`), `value` (required), `date` (ISO-8601), `source` (`url`, required when a source
is given; `name`, `user`, `org`) and `notes`.  One file per run (an audit: each condition and protocol; an
evaluation: its protocol), three entries each (three task ids): the mean accuracy, the worst phase's accuracy and
the best-minus-worst phase gap, in percent and points; the gap's bootstrap interval and the verdict go into
`notes`."""

from __future__ import annotations

import datetime
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

DATASET_ID = "phasekv/lookup"  # the phase-matched lookup prompt sets: pass your own registered benchmark's id
ENTRY_FIELDS = {"dataset": {"id", "task_id", "revision"}, "value": None, "date": None, "verifyToken": None,
                "source": {"url", "name", "user", "org"}, "notes": None}  # the Hub's documented fields
CARD_NAME = "phasekv_model_card.md"


@dataclass(frozen=True)
class Published:
    """What is published of one audit or evaluation: `runs` (condition, protocol, metrics), the condition None for
    an evaluation (the model as it is); the card's scope sentence and figures (alt text, path in the run's OUT)."""

    command: str  # "audit" or "eval"
    fmt: str  # the prompt format's name
    stride: int
    scope: str
    runs: list[tuple[str | None, str, dict[str, Any]]]
    figures: list[tuple[str, str]]
    label: str = "condition"  # the card table's first column


def of_audit(summary: dict[str, Any]) -> Published:
    settings = summary["settings"]
    scope = (f"under chunked KV-cache compression (windows of {settings['window']} tokens every {settings['stride']}; "
             f"the last {settings['local_window']} raw), {settings['prompts_per_phase']} prompts per phase")
    runs = [(c, p, result[p]) for c, result in summary["conditions"].items() for p in settings["protocols"]]
    figures = [(f"per-phase accuracy, {p} protocol", f"figures/phases_{p}.png") for p in settings["protocols"]
               if p != "query"]
    return Published("audit", summary["format"]["format"]["name"], settings["stride"], scope, runs, figures)


def of_eval(metrics: dict[str, Any], fmt: str) -> Published:
    scope = (f"of the model as it is (its own attention; every target ends at least "
             f"{metrics['settings']['local_window']} tokens before the query), {metrics['n_prompts']} prompts in "
             f"{metrics['n_clusters']} clusters")
    return Published("eval", fmt, metrics["stride"], scope, [(None, metrics["protocol"], metrics)],
                     [(f"accuracy by residue, {metrics['protocol']} protocol", "accuracy_by_residue.png")],
                     label="model")


def published(doc: dict[str, Any], fmt: str | None = None) -> Published:
    """An audit's summary (summary.json) or an evaluation's metrics (metrics.json, its prompt format `fmt`: the
    format's name, None for the bare word prompts)."""
    return of_audit(doc) if "conditions" in doc else of_eval(doc, Path(fmt).stem if fmt else "bare")


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)


def eval_result_files(doc: dict[str, Any], *, fmt: str | None = None, dataset_id: str = DATASET_ID,
                      source_url: str | None = None, date: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """file name -> its entries, for each run of an audit's summary or an evaluation's metrics (`published`)."""
    pub = published(doc, fmt)
    date = date or datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat()
    files = {}
    for condition, protocol, m in pub.runs:
        worst = min(r["accuracy"] for r in m["per_phase"])
        low, high = m["gap_ci_pp"] or (None, None)
        gap = f"{m['max_gap_pp']:.1f} pp" + ("" if low is None else f" [{low:.1f}, {high:.1f}] (bootstrap 95%)")
        what = "" if condition is None else f", condition {condition}"
        notes = (f"phasekv {pub.command}{what}, {protocol} protocol, format {pub.fmt}, stride {pub.stride}: "
                 f"phase gap {gap}; verdict: {m['verdict']}")
        values = {"mean_accuracy": 100 * m["mean_accuracy"], "worst_phase_accuracy": 100 * worst,
                  "phase_gap_pp": m["max_gap_pp"]}
        run = protocol if condition is None else f"{protocol}_{_slug(condition)}"
        entries = []
        for metric, value in values.items():
            entry = {"dataset": {"id": dataset_id, "task_id": f"{pub.fmt}_{run}_{metric}"},
                     "value": round(float(value), 2), "date": date, "notes": notes}
            if source_url:
                entry["source"] = {"url": source_url, "name": f"phasekv {pub.command}"}
            entries.append(entry)
        name = f"eval_{protocol}" if condition is None else f"{_slug(condition)}_{protocol}"
        files[f"phasekv_{name}.yaml"] = entries
    return files


def model_card_section(doc: dict[str, Any], fmt: str | None = None) -> str:
    """Markdown: per run, the per-phase accuracies, the mean, the gap and the verdict; the figures."""
    pub = published(doc, fmt)
    lines = [f"## Phase sensitivity (phasekv {pub.command})", "",
             f"Retrieval accuracy (%) by phase (target position mod {pub.stride}) {pub.scope}, format {pub.fmt}; "
             "gap = best minus worst phase.", "",
             f"| {pub.label} | protocol | " + " | ".join(str(p) for p in range(pub.stride)) +
             " | mean | gap pp | verdict |",
             "|---|---|" + "---|" * pub.stride + "---|---|---|"]
    for condition, protocol, m in pub.runs:
        cells = " | ".join(f"{100 * r['accuracy']:.0f}" for r in m["per_phase"])
        lines.append(f"| {m['model'] if condition is None else condition} | {protocol} | {cells} | "
                     f"{100 * m['mean_accuracy']:.1f} | {m['max_gap_pp']:.1f} | {m['verdict'].split(':')[0]} |")
    lines.append("")
    lines += [f"![{alt}]({path})" for alt, path in pub.figures]
    return "\n".join(lines) + "\n"


def write_eval_results(doc: dict[str, Any], out: str | Path, *, force: bool = False, fmt: str | None = None,
                       figures_from: str | Path | None = None, **options: Any) -> Path:
    """OUT/.eval_results/*.yaml (`eval_result_files`, its `options`) and OUT/phasekv_model_card.md, published
    atomically; `figures_from`: the run's OUT, whose figures the card shows are copied beside it."""
    from phasekv.outputs import output_dir

    with output_dir(out, force) as tmp:
        folder = tmp / ".eval_results"
        folder.mkdir()
        for name, entries in eval_result_files(doc, fmt=fmt, **options).items():
            (folder / name).write_text(yaml.safe_dump(entries, sort_keys=False, allow_unicode=True))
        (tmp / CARD_NAME).write_text(model_card_section(doc, fmt))
        for _, path in published(doc, fmt).figures if figures_from is not None else ():
            if (Path(figures_from) / path).is_file():
                (tmp / path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(Path(figures_from) / path, tmp / path)
    return Path(out)
