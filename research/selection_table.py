"""Print the pooled-selection results of a `phasekv audit` summary.json as markdown: per condition and padding
protocol, accuracy, per-phase accuracy, the verdict, and the selection mechanism's per-phase rates.

    python research/selection_table.py runs/kpool-smollm2/summary.json
"""

import json
import sys
from pathlib import Path


def pct(x):
    return "-" if x is None else f"{100 * x:.1f}"


def rows(summary):
    yield "| condition | protocol | attended | accuracy | per phase (%) | verdict |"
    yield "|---|---|---|---|---|---|"
    for name, cond in summary["conditions"].items():
        for protocol in summary["settings"]["protocols"]:
            m = cond.get(protocol)
            if not m:
                continue
            phases = " / ".join(f"{100 * p['accuracy']:.0f}" for p in m["per_phase"])
            yield (f"| `{name}` | {protocol} | {pct(cond.get('attended'))} | {pct(m['mean_accuracy'])} | {phases} | "
                   f"{m['verdict']} |")


def mechanism(summary):
    yield "| condition | protocol | phase | n | target pool held | answer pool held | mass on answer pool | in tail |"
    yield "|---|---|---|---|---|---|---|---|"
    for name, cond in summary["conditions"].items():
        for protocol, mech in (cond.get("mechanism") or {}).items():
            for p in mech["per_phase"]:
                yield (f"| `{name}` | {protocol} | {p['phase']} | {p['n']} | {pct(p['target_selected'])} | "
                       f"{pct(p['answer_selected'])} | {pct(p['answer_mass'])} | {pct(p['fixed_share'])} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: selection_table.py SUMMARY.json")
    try:
        data = json.loads(Path(sys.argv[1]).read_text())
    except (OSError, ValueError) as e:
        sys.exit(f"selection_table.py: cannot read {sys.argv[1]}: {e}")
    print("\n".join(rows(data)))
    print()
    print("\n".join(mechanism(data)))
