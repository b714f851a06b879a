"""`phasekv decide`: every item of a decision set at R shifts of its padding, under each compression condition;
decisions, margins and flips per item, decision rates by phase, the item-clustered verdict (`stats.py`) and the
uncompressed model's padding-only flips as the baseline every compressed condition is compared with.

Per (condition, item, shift) the decision is the continuation with the largest summed log-probability
(`scoring.py`); `margin` is log P(answer) minus the best other continuation's, `p_margin` the same difference of
probabilities renormalized over the item's continuations (P(a) - P(b) for two).  `none` always runs first: it is
the capability gate (`stats.can_decide`: without it no compressed condition gets a phase verdict) and the
padding-only baseline.

Resume: each (condition, item) is appended, fsync'd, to a journal in OUT's resumable work (OUT/.partial,
`phasekv.outputs.partial_dir`) as soon as it is scored; a killed run continues with `resume` (only the
missing pairs are scored; the journal must have been written for the same model, prompts and settings), and OUT
is published atomically (`phasekv.outputs.output_dir`) with decisions.jsonl (every prompt's row), items.jsonl (per
item and condition: the decision at each shift, the margins, the flips), summary.json (the one source of truth)
and report.html with the figure (decision rate by phase per condition, the uncompressed baseline beside them).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from phasekv.decisions import stats
from phasekv.decisions.prompts import Prompt
from phasekv.decisions.report import write_report
from phasekv.decisions.scoring import Scorer, score_prompts
from phasekv.outputs import append_jsonl, check_output_dir, output_dir, partial_dir, write_json, write_jsonl

log = logging.getLogger(__name__)

JOURNAL = "decide_journal.jsonl"
REFERENCE = "reference"  # the journal's and decisions.jsonl's name of the in-process reference's rows
ITEMS_PER_CALL = 8  # items scored together (their prompts of equal length batched), then journaled


def decision_row(prompt: Prompt, scores: dict[str, list[float]]) -> dict[str, Any]:
    """One prompt's decision, margins and summed log-probabilities."""
    logp = {label: float(sum(values)) for label, values in scores.items()}
    decision = max(logp, key=lambda label: (logp[label], label == prompt.answer))  # a tie goes to the answer
    other = max(v for label, v in logp.items() if label != prompt.answer)
    top = max(logp.values())
    norm = sum(math.exp(v - top) for v in logp.values())
    return {"item": prompt.item, "shift": prompt.shift, "phase": prompt.phase, "position": len(prompt.ids) - 1,
            "decision": decision, "answer": prompt.answer, "correct": decision == prompt.answer,
            "margin": logp[prompt.answer] - other,
            "p_margin": (math.exp(logp[prompt.answer] - top) - math.exp(other - top)) / norm, "logp": logp}


class _Journal:
    """(condition, item) -> its rows, appended as they are scored (module docstring)."""

    def __init__(self, out: Path, key: str, *, force: bool, resume: bool):
        self.path = partial_dir(out, force=force, resume=resume) / JOURNAL
        self.done: dict[tuple[str, str], list[dict[str, Any]]] = {}
        if self.path.exists():
            self._load(key)
        else:
            append_jsonl(self.path, {"journal": 1, "key": key}, durable=True)
        self.resumed = len(self.done)

    def _load(self, key: str) -> None:
        """The pairs an interrupted run scored; a journal of other settings, or not a journal, is refused and left
        as it is.  A torn last line (a pair never finished) is cut off."""
        data = self.path.read_bytes()
        complete = data[:data.rfind(b"\n") + 1]
        try:
            lines = complete.decode().splitlines()
            header = json.loads(lines[0]) if lines else None
            entries = [json.loads(line) for line in lines[1:]]
            done = {(e["condition"], e["item"]): e["rows"] for e in entries}
        except (ValueError, RecursionError, TypeError, KeyError):
            raise ValueError(f"{self.path}: not a phasekv decide journal; --force to start over") from None
        if not isinstance(header, dict) or header.get("key") != key:
            raise ValueError(f"{self.path}: written for another model, prompt set or settings; --force to start over")
        self.done = done
        if len(complete) < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(len(complete))

    def add(self, condition: str, item: str, rows: list[dict[str, Any]]) -> None:
        append_jsonl(self.path, {"condition": condition, "item": item, "rows": rows}, compact=True, durable=True)
        self.done[(condition, item)] = rows


def run_decide(scorer: Scorer, prompts: Sequence[Prompt], out: str | Path, *, conditions: Sequence[str],
               settings: dict[str, Any], reference: Scorer | None = None, force: bool = False, resume: bool = False,
               progress: bool = True) -> dict[str, Any]:
    """Score `prompts` under each condition (`none` first), publish OUT; returns the summary.

    `settings` must hold `stride` and `model` (and whatever else defines the run: it keys the journal) and may hold
    `minimum_pp`, `n_perm`, `n_boot`, `seed`.  `reference` (a served model's weights in process) scores the prompts
    uncompressed too, journaled as the condition `reference`; summary.json's `comparison` holds the agreement
    (`stats.compare`)."""
    out = Path(out)
    check_output_dir(out, force, resume)
    conditions = ["none", *[c for c in conditions if c != "none"]]
    scored = [*conditions, *([REFERENCE] if reference is not None else [])]
    ids_key = hashlib.sha256(json.dumps([[p.item, p.ids, sorted(p.continuations.items())] for p in prompts])
                             .encode()).hexdigest()[:32]
    key = hashlib.sha256(json.dumps({**settings, "prompts": ids_key}, sort_keys=True, default=str).encode()
                         ).hexdigest()[:32]
    journal = _Journal(out, key, force=force, resume=resume)
    by_item: dict[str, list[Prompt]] = {}
    for p in prompts:
        by_item.setdefault(p.item, []).append(p)
    started = time.perf_counter()
    for condition in tqdm(scored, desc="decide", unit="condition", disable=not progress):
        score, named = (reference, "none") if condition == REFERENCE and reference else (scorer, condition)
        todo = [item for item in by_item if (condition, item) not in journal.done]
        for start in range(0, len(todo), ITEMS_PER_CALL):  # items share batches; each is journaled when scored
            chunk = todo[start:start + ITEMS_PER_CALL]
            scores = iter(score(named, [p for item in chunk for p in by_item[item]]))
            for item in chunk:
                journal.add(condition, item, [decision_row(p, next(scores)) for p in by_item[item]])
    rows = {c: [r for item in by_item for r in journal.done[(c, item)]] for c in scored}
    reference_rows = rows.pop(REFERENCE, None)
    summary = summarize(rows, settings, chance=float(np.mean([1 / len(g[0].continuations) for g in by_item.values()])))
    if reference_rows is not None:
        summary["comparison"] = stats.compare(rows["none"], reference_rows, settings["stride"])
    summary.update({"elapsed_s": time.perf_counter() - started, "resumed_pairs": journal.resumed,
                    "prompt_set_key": ids_key})
    with output_dir(out, force, resume=True) as tmp:  # in place of the run's work and journal
        write_jsonl(tmp / "decisions.jsonl", [{"condition": c, **r} for c in scored
                                              for r in (rows[c] if c != REFERENCE else reference_rows)])
        write_jsonl(tmp / "items.jsonl", item_rows(rows))
        write_json(tmp / "summary.json", summary)
        write_report(summary, tmp)
    return summary


def item_rows(rows: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per condition and item: the decision and margin at each shift, and the flip count."""
    out = []
    for condition, condition_rows in rows.items():
        grouped: dict[str, list[dict[str, Any]]] = {}
        for r in condition_rows:
            grouped.setdefault(r["item"], []).append(r)
        for item, rs in grouped.items():
            rs = sorted(rs, key=lambda r: r["shift"])
            decisions = [r["decision"] for r in rs]
            out.append({"condition": condition, "item": item, "answer": rs[0]["answer"], "decisions": decisions,
                        "phases": [r["phase"] for r in rs], "margins": [round(r["margin"], 6) for r in rs],
                        "p_margins": [round(r["p_margin"], 6) for r in rs],
                        "flips": int(stats.flips(np.array([decisions]))[0]),
                        "changes": sum(a != b for a, b in zip(decisions, decisions[1:]))})
    return out


def summarize(rows: dict[str, list[dict[str, Any]]], settings: dict[str, Any], chance: float) -> dict[str, Any]:
    """summary.json: per condition the phase effect, (compressed) the comparison with padding alone, the verdict."""
    stride = settings["stride"]
    options = {"n_perm": settings.get("n_perm", 2000), "seed": settings.get("seed", 0)}
    base = stats.condition_matrices(rows["none"])
    gate = stats.can_decide(base["correct"], base["decisions"], chance, n_boot=settings.get("n_boot", 1000),
                            seed=options["seed"])
    conditions: dict[str, Any] = {}
    for condition, condition_rows in rows.items():
        m = stats.condition_matrices(condition_rows)
        if m["items"] != base["items"]:
            raise ValueError(f"condition {condition}: decided other items than the uncompressed model")
        effect = stats.phase_effect(m["correct"], m["phases"], stride, minimum_pp=settings.get("minimum_pp",
                                    stats.MINIMUM_PP), n_boot=settings.get("n_boot", 1000), **options)
        margin = float(np.mean([r["margin"] for r in condition_rows]))
        result: dict[str, Any] = {"effect": effect, "mean_margin": margin}
        if condition == "none":
            result["gate"] = gate
            result["verdict"] = (f"padding alone: {stats.verdict_line(effect)}" if gate["can_decide"] else
                                 f"cannot decide: rate {gate['rate']:.1%} (lower bound {gate['rate_lower']:.1%}, "
                                 f"chance {chance:.1%}), stability {gate['stability']:.1%} (minimum "
                                 f"{stats.STABLE_MIN:.0%})")
        else:
            paired = stats.against_padding(m["decisions"], base["decisions"], m["phases"], stride, **options)
            result["against_padding"] = paired
            padding = (f"{paired['flips_mean']:.2f} flips per item against {paired['padding_flips_mean']:.2f} for "
                       f"padding alone (p = {paired['more_flips_p']:.3g}); departures from the uncompressed "
                       f"decisions {'periodic' if paired['periodic'] else 'not shown periodic'} in S "
                       f"(p = {paired['periodic_p']:.3g})")
            result["verdict"] = (f"{stats.verdict_line(effect)}; {padding}" if gate["can_decide"] else
                                 f"no phase verdict: the uncompressed model cannot decide this set; {padding}")
        conditions[condition] = result
    return {"model": settings["model"], "set": settings.get("set"), "settings": settings, "chance": chance,
            "can_decide": gate["can_decide"], "items": len(base["items"]), "shifts": base["correct"].shape[1],
            "conditions": conditions}


def adapter_scorer(base, geometry, *, batch_size: int = 8, progress: bool = True) -> Scorer:
    """A `Scorer` that evaluates the adapter `base` under each condition through the audit's grammar."""
    from phasekv.conditions.grammar import condition_adapter

    adapters: dict[str, Any] = {}  # one adapter per condition, built on its first chunk

    def score(condition: str, prompts: Sequence) -> list[dict[str, list[float]]]:
        if condition not in adapters:
            adapters[condition] = condition_adapter(base, condition, geometry)
        return score_prompts(adapters[condition], prompts, batch_size=batch_size, progress=progress, desc=condition)

    return score


def prompt_set(tokenizer, set_name: str, geometry, shifts: int | None,
               options: dict[str, Any]) -> tuple[list[Prompt], dict[str, Any]]:
    """(the set's prompts, the run's settings without the model) for `decide_hf` and `decide_endpoint`; `options`
    may hold items, seed, minimum_pp, n_perm, n_boot."""
    from phasekv.decisions.prompts import build_prompts
    from phasekv.decisions.sets import load_set

    decision_set = load_set(set_name)
    shifts = shifts or geometry.stride
    prompts = build_prompts(tokenizer, decision_set, shifts=shifts, stride=geometry.stride, items=options.get("items"),
                            seed=options.get("seed", 0))
    settings = {"set": decision_set.name, "stride": geometry.stride, "window": geometry.window,
                "local_window": geometry.local_window, "shifts": shifts,
                "chat": bool(decision_set.chat and getattr(tokenizer, "chat_template", None)),
                **{k: options[k] for k in ("items", "minimum_pp", "n_perm", "n_boot", "seed") if k in options}}
    return prompts, settings


def decide_hf(hf: str, set_name: str, out: str | Path, *, conditions: Sequence[str], geometry, shifts: int | None,
              options: dict[str, Any]) -> dict[str, Any]:
    """`phasekv decide --hf`: load the model (`gguf_file`, `device`, `dtype` in `options`), build the set's prompts
    and run every condition.  `options` also holds items, batch_size, minimum_pp, n_perm, n_boot, seed, force,
    resume, progress."""
    from phasekv.adapters.hf import load_hf
    from phasekv.conditions.grammar import check_conditions
    from phasekv.decisions.prompts import check_shifts
    from phasekv.decisions.sets import load_set

    check_conditions(tuple(conditions), geometry)
    load_set(set_name)  # a broken set file is refused before the model loads
    check_output_dir(Path(out), options.get("force", False), options.get("resume", False))
    check_shifts(shifts or geometry.stride, geometry.stride)
    adapter, tokenizer = load_hf(hf, options.get("device", "auto"), options.get("dtype", "float32"),
                                 gguf_file=options.get("gguf_file"))
    prompts, settings = prompt_set(tokenizer, set_name, geometry, shifts, options)
    settings.update({"model": adapter.info.name, "conditions": ["none", *[c for c in conditions if c != "none"]]})
    scorer = adapter_scorer(adapter, geometry, batch_size=options.get("batch_size", 8),
                            progress=options.get("progress", True))
    return run_decide(scorer, prompts, out, conditions=conditions, settings=settings,
                      force=options.get("force", False), resume=options.get("resume", False),
                      progress=options.get("progress", True))
