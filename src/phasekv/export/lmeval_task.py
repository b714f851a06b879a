"""The `utils.py` of an exported lm-evaluation-harness task (`phasekv export lm-eval` copies this file verbatim).

It runs inside lm-eval, where phasekv need not be installed, so it imports nothing of phasekv.  It loads the
task's `prompts.jsonl` from beside itself (no download), scores a document by exact match of the one greedily
generated token's text with the answer token's text, and aggregates the statistics `phasekv eval` reports:
`acc` (mean), `acc_residue_<r>` (per residue group, target position mod R), `acc_phase_<p>` (per phase, mod S),
`gap_pp` (best minus worst residue group, percentage points, docs/science.md's phase gap) and `phase_gap_pp`.

Every document yields every metric; a per-group metric is None for the documents outside its group, and
`group_accuracy` averages the others, so each group's accuracy is n_correct / n of exactly its documents.
"""

import json
from pathlib import Path

PROMPTS = Path(__file__).with_name("prompts.jsonl")


def load_prompts(**_metadata):
    """The task's documents as lm-eval's `custom_dataset`: {"test": datasets.Dataset}."""
    import datasets

    with open(PROMPTS) as f:
        rows = [json.loads(line) for line in f]
    return {"test": datasets.Dataset.from_list(rows)}


def residue_metric(residue: int, modulus: int) -> str:
    return f"acc_residue_{residue:0{len(str(modulus - 1))}d}"


def phase_metric(phase: int, stride: int) -> str:
    return f"acc_phase_{phase:0{len(str(stride - 1))}d}"


def process_results(doc: dict, results: list) -> dict:
    """One document's metrics from its generation (`results[0]`: the text of one greedy token)."""
    correct = float(results[0] == doc["answer_text"])
    out = {"acc": correct, "gap_pp": (doc["residue"], correct), "phase_gap_pp": (doc["phase"], correct)}
    for r in range(doc["residue_modulus"]):
        out[residue_metric(r, doc["residue_modulus"])] = correct if r == doc["residue"] else None
    for p in range(doc["stride"]):
        out[phase_metric(p, doc["stride"])] = correct if p == doc["phase"] else None
    return out


def group_accuracy(items: list) -> float:
    """Accuracy of one group: the mean over the documents in it (the others carry None)."""
    present = [x for x in items if x is not None]
    return sum(present) / len(present) if present else float("nan")


def gap(items: list) -> float:
    """Best minus worst group accuracy in percentage points; items: (group, correct) pairs."""
    groups: dict = {}
    for group, correct in items:
        groups.setdefault(group, []).append(correct)
    accuracies = [sum(v) / len(v) for v in groups.values()]
    return 100.0 * (max(accuracies) - min(accuracies))
