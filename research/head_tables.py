"""Tables of a head-slicing or grid-fix `phasekv audit` run: per condition and protocol the mean, the gap with its
interval and the verdict, and, for the fixed slicings, accuracy by the group (KV head) that owns the answer token
and the record's key (read from each condition's predictions.jsonl).  Writes a small JSON for docs/summaries and
prints markdown.

    python research/head_tables.py AUDIT_DIR OUT.json [--groups 3] [--knockout KNOCKOUT.json --knockout-layer 1]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from phasekv.conditions.head_slices import parse_slices
from phasekv.evaluate.metrics import wilson_interval


def _safe(condition: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in condition)


def owner_of(condition: str, groups: int):
    """position -> owning group of a fixed slicing (None for other conditions: their owners move)."""
    if not condition.startswith("slices:"):
        return None
    spec = parse_slices(condition)
    if spec.shift != "fixed":
        return None
    return lambda s: (s // spec.size) % groups if s >= spec.sink else None


def by_owner(records: list[dict], owner, key: str, groups: int) -> list[dict]:
    """Accuracy (with a Wilson 95% interval) of the prompts whose `key` position each group owns."""
    out = []
    for g in range(groups):
        hits = [r["correct"] for r in records if owner(r[key]) == g]
        low, high = wilson_interval(sum(hits), len(hits)) if hits else (None, None)
        out.append({"group": g, "n": len(hits), "accuracy": sum(hits) / len(hits) if hits else None,
                    "ci_low": None if low is None else float(low), "ci_high": None if high is None else float(high)})
    return out


def summarize(audit: Path, groups: int) -> dict:
    summary = json.loads((audit / "summary.json").read_text())
    rows = {}
    stride = summary["settings"]["stride"]
    for name, cond in summary["conditions"].items():
        row = {"cache_bytes": cond.get("cache_bytes")}
        for protocol in summary["settings"]["protocols"]:
            m = cond[protocol]
            m = m.get("query_phase", m) if protocol == "query" else m
            row[protocol] = {k: m.get(k) for k in ("mean_accuracy", "mean_ci", "max_gap_pp", "gap_ci_pp",
                                                    "detected_period", "flatness_p", "verdict", "chance",
                                                    "in_context_chance")}
            row[protocol]["per_phase"] = [round(p["accuracy"], 4) for p in m["per_phase"]]
            if protocol == "query":
                continue
            path = audit / "conditions" / _safe(name) / protocol / "predictions.jsonl"
            records = [json.loads(line) for line in path.read_text().splitlines()]
            row[protocol]["by_answer_phase"] = by_owner(records, lambda s: s % stride, "answer_position", stride)
            owner = owner_of(name, groups)
            if owner is not None:
                row[protocol]["by_answer_owner"] = by_owner(records, owner, "answer_position", groups)
                row[protocol]["by_key_owner"] = by_owner(records, owner, "target_position", groups)
        rows[name] = row
    return {"model": summary["model"], "settings": summary["settings"], "elapsed_s": summary["elapsed_s"],
            "conditions": rows}


def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def markdown(data: dict) -> list[str]:
    lines = ["| condition | protocol | mean % [95%] | gap pp [95%] | period | per phase % | verdict |",
             "|---|---|---|---|---|---|---|"]
    for name, row in data["conditions"].items():
        for protocol in data["settings"]["protocols"]:
            m = row[protocol]
            ci, gap = m["mean_ci"] or [None, None], m["gap_ci_pp"] or [None, None]
            gap_ci = "" if gap[0] is None else f" [{gap[0]:.1f}, {gap[1]:.1f}]"
            lines.append(f"| `{name}` | {protocol} | {pct(m['mean_accuracy'])} [{pct(ci[0])}, {pct(ci[1])}] | "
                         f"{m['max_gap_pp']:.1f}{gap_ci} | {m['detected_period']} | "
                         f"{' / '.join(f'{100 * a:.0f}' for a in m['per_phase'])} | {m['verdict'].split(' (')[0]} |")
    owners = [(n, p, row[p]) for n, row in data["conditions"].items() for p in data["settings"]["protocols"]
              if "by_answer_owner" in row.get(p, {})]
    if owners:
        lines += ["", "| condition | protocol | owner of | " + " | ".join(
            f"group {g['group']} % [95%] (n)" for g in owners[0][2]["by_answer_owner"]) + " |",
            "|---|---|---|" + "---|" * len(owners[0][2]["by_answer_owner"])]
        for name, protocol, m in owners:
            for what in ("answer", "key"):
                cells = [f"{pct(g['accuracy'])} [{pct(g['ci_low'])}, {pct(g['ci_high'])}] ({g['n']})"
                         for g in m[f"by_{what}_owner"]]
                lines.append(f"| `{name}` | {protocol} | {what} | " + " | ".join(cells) + " |")
    return lines


def fixes_markdown(data: dict) -> list[str]:
    """The fixes table: per condition its cache share (bytes of the last prefilled batch), and per padding
    protocol the gap with its interval, the mean and the verdict."""
    lines = ["| condition | cache share % | prefix gap pp [95%] | in-seq. gap pp [95%] | prefix mean % | "
             "in-seq. mean % | prefix verdict | in-seq. verdict |", "|---|---|---|---|---|---|---|---|"]
    for name, row in data["conditions"].items():
        size = row.get("cache_bytes") or {}
        share = pct(size["compressed"] / size["full"]) if size.get("full") else "100"
        cells = []
        for key in ("gap", "mean", "verdict"):
            for protocol in ("prefix", "insequence"):
                m = row[protocol]
                if key == "gap":
                    ci = m["gap_ci_pp"] or [None, None]
                    cells.append(f"{m['max_gap_pp']:.1f}" + ("" if ci[0] is None else f" [{ci[0]:.1f}, {ci[1]:.1f}]"))
                elif key == "mean":
                    cells.append(pct(m["mean_accuracy"]))
                else:
                    cells.append(m["verdict"].split(": ")[0].split(" (")[0])
        lines.append(f"| `{name}` | {share} | " + " | ".join(cells) + " |")
    return lines


def knockout_markdown(runs: list[dict], layer: int) -> list[str]:
    """One row per knocked-out head of `layer`: accuracy by the group owning the answer token (knockout.json of
    research/head_slices_checkpoint.py)."""
    groups = len(runs[0]["clean_by_answer_owner"])
    lines = ["| condition | knocked out | all % | " + " | ".join(f"phase {g} %" for g in range(groups)) + " |",
             "|---|---|---|" + "---|" * groups]
    for run in runs:
        cells = " | ".join(pct(a) for a in run["clean_by_answer_owner"])
        lines.append(f"| `{run['condition']}` | nothing | {pct(run['clean'])} | {cells} |")
        for row in (r for r in run["rows"] if r["layer"] == layer):
            cells = " | ".join(pct(a) for a in row["by_answer_owner"])
            lines.append(f"| `{run['condition']}` | L{layer} H{row['head']} | {pct(row['accuracy'])} | {cells} |")
    return lines


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("audit", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--groups", type=int, default=3, help="head groups of the slicing (SmolLM2-135M: 3 KV heads)")
    parser.add_argument("--knockout", type=Path, help="also print this knockout.json's table (of --knockout-layer)")
    parser.add_argument("--knockout-layer", type=int, default=1)
    parser.add_argument("--fixes", action="store_true", help="print the fixes table instead of the phase table")
    args = parser.parse_args()
    if args.knockout is not None:
        print("\n".join(knockout_markdown(json.loads(args.knockout.read_text()), args.knockout_layer)) + "\n")
    data = summarize(args.audit, args.groups)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print("\n".join(fixes_markdown(data) if args.fixes else markdown(data)))
