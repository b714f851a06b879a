"""Why in-sequence padding keeps a period-S gap on a windowed checkpoint (docs/notes/fixes.md): one eval run's accuracy
split by where the target record lies on the model's window grid (split across two windows or whole in one) and by
its spacing to the neighbouring records (fillers before and after it and their parity, fillers inside its window).

    phasekv eval --checkpoint checkpoints/w9s8-4kv --threads 1 --protocol insequence --out runs/w9-inseq
    python research/insequence_spacing.py checkpoints/w9s8-4kv runs/w9-inseq OUT.json

The prompts are rebuilt with the settings `phasekv eval` uses without options (the checkpoint's own) and joined to
the run's predictions.jsonl by (cluster, shift, record); a run made with other settings fails the join.  Window W and
stride S are the first compressed layer's (windows [j S, j S + W)).  Prints markdown tables, writes OUT.json.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from phasekv.evaluate.metrics import wilson_interval
from phasekv.evaluate.sources import Source, eval_config, open_source
from phasekv.outputs import write_json


def window_grid(model: dict) -> tuple[int, int]:
    """(W, S) of the first layer that has a window (a gated or DeepSeek-style compressor)."""
    for kind in model.get("layer_types", []):
        options = model.get("compressors", {}).get(kind, {})
        if "window" in options and "stride" in options:
            return int(options["window"]), int(options["stride"])
    raise ValueError("checkpoint: no layer with a window and a stride (model.compressors)")


def record_features(starts: list[int], i: int, length: int, window: int, stride: int) -> dict:
    """Where record i (first token at starts[i], `length` tokens) lies on the window grid and how far its
    neighbours are: split (no window holds it whole), its window's index and fillers (tokens of no record)."""
    p, end = starts[i], starts[i] + length - 1
    covering = [j for j in range(max(0, (p - window) // stride), p // stride + 1)
                if j * stride <= p and end < j * stride + window]
    j = covering[-1] if covering else p // stride  # split: the window of its first token
    lo, hi = j * stride, j * stride + window
    record_tokens = sum(max(0, min(hi, s + length) - max(lo, s)) for s in starts)
    return {"split": not covering, "offset": p - j * stride,
            "gap_before": p - (starts[i - 1] + length) if i > 0 else None,
            "gap_after": starts[i + 1] - (end + 1) if i + 1 < len(starts) else None,
            "fillers_in_window": window - record_tokens}


def joined(eval_set, records: list[dict], window: int, stride: int) -> list[dict]:
    """Each prediction with its target record's features; ValueError if the run's prompts are not these."""
    contexts = {(c.cluster, c.shift): c for c in eval_set.contexts}
    length = len(eval_set.contexts[0].queries[0].key) + int(eval_set.settings.get("value_tokens", 1))
    out = []
    for r in records:
        c = contexts.get((r["cluster"], r["shift"]))
        if c is None or c.record_positions[r["record"]] != r["target_position"]:
            raise ValueError(f"prediction (cluster {r['cluster']}, shift {r['shift']}, record {r['record']}) is not "
                             "in the rebuilt prompt set: the run was made with other settings")
        out.append({**r, **record_features(c.record_positions, r["record"], length, window, stride)})
    return out


def bucket(value, top: int) -> str:
    return "first/last" if value is None else (f">={top}" if value >= top else str(value))


def split_by(rows: list[dict], key) -> list[dict]:
    """Accuracy with a Wilson 95% interval per value of key(row), in sorted order of the values."""
    groups: dict = defaultdict(list)
    for r in rows:
        groups[key(r)].append(r["correct"])
    out = []
    for value in sorted(groups, key=str):
        hits = groups[value]
        low, high = wilson_interval(sum(hits), len(hits))
        out.append({"value": value, "n": len(hits), "accuracy": sum(hits) / len(hits),
                    "ci": [float(low), float(high)]})
    return out


def parity(value) -> str:
    """A gap's parity: with 2-token records packed as in training, every record of a window starts at one
    parity; an odd gap moves the neighbours to the other."""
    return "first/last" if value is None else ("even" if value % 2 == 0 else "odd")


def tables(rows: list[dict], stride: int) -> dict:
    packed = [r for r in rows if r["gap_before"] == 0 and r["gap_after"] == 0]
    spaced = [r for r in rows if not (r["gap_before"] == 0 and r["gap_after"] == 0)]
    return {
        "all": split_by(rows, lambda r: "all"),
        "split": split_by(rows, lambda r: "split" if r["split"] else "whole"),
        "gap_before": split_by(rows, lambda r: bucket(r["gap_before"], 3)),
        "gap_after": split_by(rows, lambda r: bucket(r["gap_after"], 3)),
        "fillers_in_window": split_by(rows, lambda r: bucket(r["fillers_in_window"], 4)),
        "gap_parity": split_by(rows, lambda r: f"{parity(r['gap_before'])} / {parity(r['gap_after'])}"),
        "phase_by_gap_parity": split_by(rows, lambda r: (r["target_position"] % stride, parity(r["gap_before"]),
                                                         parity(r["gap_after"]))),
        "packed_by_phase": split_by(packed, lambda r: r["target_position"] % stride),
        "spaced_by_phase": split_by(spaced, lambda r: r["target_position"] % stride),
        "phase_by_fillers_in_window": split_by(rows, lambda r: (r["target_position"] % stride,
                                                                bucket(r["fillers_in_window"], 4))),
    }


def markdown(data: dict) -> list[str]:
    lines = []
    for name, groups in data["tables"].items():
        lines += ["", f"{name}:", "| value | n | accuracy % [95%] |", "|---|---|---|"]
        lines += [f"| {g['value']} | {g['n']} | {100 * g['accuracy']:.1f} [{100 * g['ci'][0]:.1f}, "
                  f"{100 * g['ci'][1]:.1f}] |" for g in groups]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("run", type=Path, help="a `phasekv eval` output directory (predictions.jsonl, metrics.json)")
    parser.add_argument("out", type=Path)
    args = parser.parse_args()
    metrics = json.loads((args.run / "metrics.json").read_text())
    source = Source(checkpoint=args.checkpoint)
    window, stride = window_grid(source.experiment[1]["model"])
    _, eval_set = open_source(source, eval_config(source, {"protocol": metrics["protocol"], "threads": 1}))
    records = [json.loads(line) for line in (args.run / "predictions.jsonl").read_text().splitlines()]
    rows = joined(eval_set, records, window, stride)
    data = {"checkpoint": args.checkpoint, "run": str(args.run), "protocol": metrics["protocol"], "window": window,
            "stride": stride, "n_prompts": len(rows), "tables": tables(rows, stride)}
    write_json(args.out, data)
    print(f"{args.checkpoint} {metrics['protocol']} W{window}/S{stride}, {len(rows)} prompts")
    print("\n".join(markdown(data)))


if __name__ == "__main__":
    main()
