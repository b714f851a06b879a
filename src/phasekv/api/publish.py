"""An audit's results where a model's readers look: the Hugging Face Hub's `.eval_results/*.yaml` entries (the Hub
shows them on the model page and aggregates them into the benchmark dataset's leaderboard) and a short model-card
section in markdown (the per-phase table and the audit's figure).

The entry fields are the Hub's documented ones (its eval-results page, `huggingface_hub.EvalResultEntry`): a list
of entries, each with `dataset` (`id`, required, a Hub dataset id that the Hub must know as a benchmark for a
leaderboard; `task_id`; `revision`), `value` (required), `date` (ISO-8601), `source` (`url`, required when a source
is given; `name`, `user`, `org`) and `notes`.  One file per condition and protocol, three entries each (three
task ids): the mean accuracy, the worst phase's accuracy and the best-minus-worst phase gap, in percent and points;
the gap's bootstrap interval and the verdict go into `notes`."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import yaml

DATASET_ID = "phasekv/lookup"  # the phase-matched lookup prompt sets: pass your own registered benchmark's id
ENTRY_FIELDS = {"dataset": {"id", "task_id", "revision"}, "value": None, "date": None, "verifyToken": None,
                "source": {"url", "name", "user", "org"}, "notes": None}  # the Hub's documented fields
CARD_NAME = "phasekv_model_card.md"


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)


def eval_result_files(summary: dict[str, Any], *, dataset_id: str = DATASET_ID, source_url: str | None = None,
                      date: str | None = None) -> dict[str, list[dict[str, Any]]]:
    """file name -> its entries, for each condition and protocol of an audit's summary."""
    date = date or datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat()
    fmt = summary["format"]["format"]["name"]
    files = {}
    for condition, result in summary["conditions"].items():
        for protocol in summary["settings"]["protocols"]:
            m = result[protocol]
            worst = min(r["accuracy"] for r in m["per_phase"])
            low, high = m["gap_ci_pp"] or (None, None)
            gap = f"{m['max_gap_pp']:.1f} pp" + ("" if low is None else f" [{low:.1f}, {high:.1f}] (bootstrap 95%)")
            notes = (f"phasekv audit, condition {condition}, {protocol} protocol, format {fmt}, stride "
                     f"{summary['settings']['stride']}: phase gap {gap}; verdict: {m['verdict']}")
            values = {"mean_accuracy": 100 * m["mean_accuracy"], "worst_phase_accuracy": 100 * worst,
                      "phase_gap_pp": m["max_gap_pp"]}
            entries = []
            for metric, value in values.items():
                entry = {"dataset": {"id": dataset_id, "task_id": f"{fmt}_{protocol}_{_slug(condition)}_{metric}"},
                         "value": round(float(value), 2), "date": date, "notes": notes}
                if source_url:
                    entry["source"] = {"url": source_url, "name": "phasekv audit"}
                entries.append(entry)
            files[f"phasekv_{_slug(condition)}_{protocol}.yaml"] = entries
    return files


def model_card_section(summary: dict[str, Any], figure_dir: str = "figures") -> str:
    """Markdown: per condition and protocol, the per-phase accuracies, the gap and the verdict; the figures."""
    settings = summary["settings"]
    stride = settings["stride"]
    lines = ["## Phase sensitivity (phasekv audit)", "",
             f"Retrieval accuracy (%) by phase (target position mod {stride}) under chunked KV-cache compression "
             f"(windows of {settings['window']} tokens every {stride}; the last {settings['local_window']} raw), "
             f"{settings['prompts_per_phase']} prompts per phase; gap = best minus worst phase.", "",
             "| condition | protocol | " + " | ".join(str(p) for p in range(stride)) + " | mean | gap pp | verdict |",
             "|---|---|" + "---|" * stride + "---|---|---|"]
    for condition, result in summary["conditions"].items():
        for protocol in settings["protocols"]:
            m = result[protocol]
            cells = " | ".join(f"{100 * r['accuracy']:.0f}" for r in m["per_phase"])
            lines.append(f"| {condition} | {protocol} | {cells} | {100 * m['mean_accuracy']:.1f} | "
                         f"{m['max_gap_pp']:.1f} | {m['verdict'].split(':')[0]} |")
    lines.append("")
    lines += [f"![per-phase accuracy, {p} protocol]({figure_dir}/phases_{p}.png)" for p in settings["protocols"]
              if p != "query"]
    return "\n".join(lines) + "\n"


def write_eval_results(summary: dict[str, Any], out: str | Path, *, force: bool = False, **options: Any) -> Path:
    """OUT/.eval_results/*.yaml (`eval_result_files`, its `options`) and OUT/phasekv_model_card.md, published
    atomically."""
    from phasekv.outputs import output_dir

    with output_dir(out, force) as tmp:
        folder = tmp / ".eval_results"
        folder.mkdir()
        for name, entries in eval_result_files(summary, **options).items():
            (folder / name).write_text(yaml.safe_dump(entries, sort_keys=False, allow_unicode=True))
        (tmp / CARD_NAME).write_text(model_card_section(summary))
    return Path(out)
