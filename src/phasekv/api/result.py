"""The result objects of the Python API: `AuditResult` (an audit: per condition and protocol, per-phase accuracies
with Wilson 95% intervals, the gap with its interval, the verdict and its three parts) and `EvalResult` (one
evaluation).  Each holds exactly what the command writes (the summary or metrics, and the prediction records), so
`write(dir)` gives the command's files, `to_dict()` its JSON, and `repr` the per-phase table."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def phase_rows(metrics: dict[str, Any]) -> list[dict[str, Any]]:
    """One metrics dict's per-phase rows: phase, accuracy, ci_low, ci_high (Wilson 95%), n, n_correct."""
    return [dict(row) for row in metrics["per_phase"]]


def headline(metrics: dict[str, Any]) -> dict[str, Any]:
    """What a reader wants of one run: mean and worst-phase accuracy, the best-minus-worst gap with its bootstrap
    interval, the selection-free contrast's one-sided bounds, the verdict and its parts."""
    phases = metrics["per_phase"]
    worst = min(phases, key=lambda r: r["accuracy"])
    return {"mean_accuracy": metrics["mean_accuracy"], "mean_ci": metrics["mean_ci"],
            "worst_phase": worst["phase"], "worst_phase_accuracy": worst["accuracy"],
            "worst_phase_ci": [worst["ci_low"], worst["ci_high"]],
            "gap_pp": metrics["max_gap_pp"], "gap_ci_pp": metrics["gap_ci_pp"],
            "contrast_bounds_pp": metrics.get("contrast_crossfit_bounds_pp"),
            "flatness_p": metrics["flatness_p"], "period": metrics["detected_period"],
            "verdict": metrics["verdict"], "verdict_parts": dict(metrics["verdict_parts"])}


def table(rows: dict[str, dict[str, Any]]) -> str:
    """A text table: one line per labelled run (label -> metrics), its per-phase accuracies in %, mean, gap, the
    verdict's first clause."""
    if not rows:
        return "(no run)"
    width = max(len(label) for label in rows)
    phases = len(next(iter(rows.values()))["per_phase"])
    head = f"{'':<{width}}  " + " ".join(f"{p:>4}" for p in range(phases)) + "   mean    gap  verdict"
    lines = [head]
    for label, m in rows.items():
        cells = " ".join(f"{100 * r['accuracy']:4.0f}" for r in m["per_phase"])
        verdict = m["verdict"].split(":")[0]
        lines.append(f"{label:<{width}}  {cells}  {100 * m['mean_accuracy']:5.1f}  {m['max_gap_pp']:5.1f}  {verdict}")
    return "\n".join(lines)


@dataclass(repr=False)
class AuditResult:
    """An audit as `phasekv audit` reports it: `summary` is summary.json's content, `runs[condition][protocol]`
    each run's full metrics (metrics.json) and prediction records (predictions.jsonl)."""

    summary: dict[str, Any]
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def conditions(self) -> list[str]:
        return list(self.summary["conditions"])

    @property
    def protocols(self) -> list[str]:
        return list(self.summary["settings"]["protocols"])

    @property
    def can_do_task(self) -> bool:
        return bool(self.summary["can_do_task"])

    def metrics(self, condition: str = "none", protocol: str | None = None) -> dict[str, Any]:
        """The run's full metrics (metrics.json); `protocol` None: the first."""
        if condition not in self.summary["conditions"]:
            raise ValueError(f"condition {condition!r}: not in this audit (conditions: {', '.join(self.conditions)})")
        protocol = protocol or self.protocols[0]
        if protocol not in self.protocols:
            raise ValueError(f"protocol {protocol!r}: not in this audit (protocols: {', '.join(self.protocols)})")
        run = self.runs.get(condition, {}).get(protocol)
        return run["metrics"] if run else self.summary["conditions"][condition][protocol]

    def per_phase(self, condition: str = "none", protocol: str | None = None) -> list[dict[str, Any]]:
        """Per-phase accuracy rows: phase, accuracy, ci_low, ci_high (Wilson 95%), n, n_correct."""
        return phase_rows(self.metrics(condition, protocol))

    def headline(self, condition: str = "none", protocol: str | None = None) -> dict[str, Any]:
        """Mean, worst phase, gap with its interval, the verdict and its parts (`headline`)."""
        return headline(self.metrics(condition, protocol))

    def verdict(self, condition: str = "none", protocol: str | None = None) -> str:
        return self.metrics(condition, protocol)["verdict"]

    def verdict_parts(self, condition: str = "none", protocol: str | None = None) -> dict[str, Any]:
        """can_do_task, phase_dependent, material, period."""
        return dict(self.metrics(condition, protocol)["verdict_parts"])

    def predictions(self, condition: str = "none", protocol: str | None = None) -> list[dict[str, Any]]:
        self.metrics(condition, protocol)
        return [dict(r) for r in self.runs[condition][protocol or self.protocols[0]]["records"]]

    def to_dict(self) -> dict[str, Any]:
        """summary.json's content (a copy)."""
        return copy.deepcopy(self.summary)

    def write(self, out: str | Path, force: bool = False) -> Path:
        """The command's OUT (summary.json, report.html, each condition's runs), published atomically."""
        from phasekv.auditing.pipeline import write_audit
        from phasekv.outputs import output_dir

        with output_dir(out, force) as tmp:
            write_audit(self.summary, self.runs, tmp)
        return Path(out)

    def write_eval_results(self, out: str | Path, force: bool = False, **options: Any) -> Path:
        """The Hub's .eval_results/*.yaml entries and a model-card section (`phasekv.api.publish`)."""
        from phasekv.api.publish import write_eval_results

        return write_eval_results(self.summary, out, force=force, **options)

    def __repr__(self) -> str:
        rows = {f"{c} {p}": self.metrics(c, p) for c in self.conditions for p in self.protocols}
        return (f"AuditResult({self.summary['model']}: accuracy % by phase (position mod "
                f"{self.summary['settings']['stride']}), gap pp)\n{table(rows)}")


@dataclass(repr=False)
class EvalResult:
    """One evaluation as `phasekv eval` reports it: `metrics` (metrics.json) and the prediction records."""

    metrics: dict[str, Any]
    records: list[dict[str, Any]] = field(default_factory=list)
    prompt_format: str | None = None  # the prompts' format (None: bare words), named in the Hub's entries

    def per_phase(self) -> list[dict[str, Any]]:
        return phase_rows(self.metrics)

    def headline(self) -> dict[str, Any]:
        return headline(self.metrics)

    @property
    def verdict(self) -> str:
        return self.metrics["verdict"]

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.metrics)

    def write_into(self, directory: Path) -> None:
        from phasekv.evaluate.runner import write_run_files

        write_run_files(self.metrics, self.records, directory)

    def write(self, out: str | Path, force: bool = False) -> Path:
        """metrics.json, predictions.jsonl and the figures, published atomically."""
        from phasekv.outputs import output_dir

        with output_dir(out, force) as tmp:
            self.write_into(tmp)
        return Path(out)

    def write_eval_results(self, out: str | Path, force: bool = False, **options: Any) -> Path:
        """The Hub's .eval_results/*.yaml entries and a model-card section (`phasekv.api.publish`)."""
        from phasekv.api.publish import write_eval_results

        return write_eval_results(self.metrics, out, force=force, fmt=self.prompt_format, **options)

    def __repr__(self) -> str:
        return f"EvalResult({self.metrics['model']}, {self.metrics['protocol']})\n" + table(
            {self.metrics["protocol"]: self.metrics})
