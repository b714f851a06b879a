"""The fixes of phasekv's own models outside `make demo` (checkpoints/extra/), kept as one summary for the README's
fixes table (`phasekv.report.readme_doc`) and docs/notes/fixes.md: per model its cache bytes per token (the
measure `phasekv reproduce` uses, `cache_bytes_per_token`) and, per padding protocol, the fields of a
`phasekv eval` run's metrics.json that the table reads.

    for n in w9s8-4kv-gaps w8s8-4kv-gaps w8s8-4kv-headstagger w8s8-4kv-headstagger-layer w8s8-4kv-jitter; do
      for p in prefix insequence; do
        phasekv eval --checkpoint checkpoints/extra/$n --protocol $p --threads 1 --out runs/fixes-extra/$n-$p
      done
    done
    python research/fixes_extra.py runs/fixes-extra docs/summaries/fixes-extra.json \
        w9s8-4kv-gaps w8s8-4kv-gaps w8s8-4kv-headstagger w8s8-4kv-headstagger-layer w8s8-4kv-jitter

A model's runs are RUNS/NAME-prefix and RUNS/NAME-insequence; its checkpoint is checkpoints/extra/NAME (or
--checkpoints DIR).  A missing run or one of another checkpoint is one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from phasekv import load_checkpoint
from phasekv.outputs import write_json
from phasekv.report.reproduce import cache_bytes_per_token

PROTOCOLS = ("prefix", "insequence")
# the fields of a protocol's metrics kept (those the README's table and a reader of the numbers need)
FIELDS = ("mean_accuracy", "mean_ci", "max_gap_pp", "gap_ci_pp", "detected_period", "flatness_p", "n_prompts",
          "verdict")


def metrics(run: Path, protocol: str) -> dict:
    """The kept fields of one eval run; ValueError when it is missing or of another protocol."""
    try:
        m = json.loads((run / "metrics.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{run}: no readable metrics.json ({e})") from e
    if m.get("protocol") != protocol:
        raise ValueError(f"{run}: a {m.get('protocol')} run, expected {protocol}")
    kept = {k: m[k] for k in FIELDS if k in m}
    kept["per_phase"] = [{"accuracy": r["accuracy"]} for r in m["per_phase"]]
    return kept


def model_entry(name: str, runs: Path, checkpoints: Path) -> dict:
    """One model: its checkpoint, cache bytes per token and both protocols' metrics."""
    checkpoint = checkpoints / name
    try:
        model = load_checkpoint(checkpoint)[0].eval()
    except (OSError, ValueError) as e:
        raise ValueError(f"{checkpoint}: cannot load ({e})") from e
    with torch.no_grad():
        cache = cache_bytes_per_token(model)
    return {"checkpoint": str(checkpoint), "cache_bytes_per_token": cache,
            **{p: metrics(runs / f"{name}-{p}", p) for p in PROTOCOLS}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", type=Path, help="the folder holding NAME-prefix and NAME-insequence eval runs")
    parser.add_argument("out", type=Path, help="the summary to write (docs/summaries/fixes-extra.json)")
    parser.add_argument("names", nargs="+", help="checkpoint names, in the table's order")
    parser.add_argument("--checkpoints", type=Path, default=Path("checkpoints/extra"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    try:
        models = {name: model_entry(name, args.runs, args.checkpoints) for name in args.names}
    except ValueError as e:
        print(f"fixes_extra: error: {e}", file=sys.stderr)
        return 2
    write_json(args.out, {"baseline": "w8s8-4kv", "models": models}, indent=1, sort_keys=False, atomic=True)
    for name, m in models.items():
        print(f"{name}: {m['cache_bytes_per_token']} B/token, " + ", ".join(
            f"{p} gap {m[p]['max_gap_pp']:.1f} mean {100 * m[p]['mean_accuracy']:.1f}" for p in PROTOCOLS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
