"""The mechanism figure of pooled selection: per phase of the target record (target position mod the pool), the
audit's accuracy (left, with its 95% interval) beside how often the answering query's selection holds the pool of
the record's first answer token, averaged over layers (right), for every `kpool:` condition of the given
`phasekv audit` summaries and each padding protocol.

    python research/selection_figure.py docs/summaries/kpool-smollm2.json [...] --out docs/notes/selection-mechanism.png
"""

import argparse
import json
import sys
from pathlib import Path


def series(summaries: list[dict]):
    """(label, protocol, phases, accuracy, ci_low, ci_high, answer_held) of every selection condition."""
    for summary in summaries:
        for name, cond in summary["conditions"].items():
            if not name.startswith("kpool:") or not cond.get("mechanism"):
                continue
            fields = dict(part.split("=", 1) for part in name[len("kpool:"):].split(","))
            indexer = fields.get("indexer", "oracle").split("/")[-1]
            label = f"pool {fields['pool']}, {fields.get('budget', fields.get('top'))}, {indexer}"
            for protocol, mech in cond["mechanism"].items():
                per_phase = {p["phase"]: p for p in cond[protocol]["per_phase"]}
                held = {p["phase"]: p["answer_selected"] for p in mech["per_phase"]}
                phases = sorted(held)
                yield (label, protocol, phases, [per_phase[p]["accuracy"] for p in phases],
                       [per_phase[p]["ci_low"] for p in phases], [per_phase[p]["ci_high"] for p in phases],
                       [held[p] for p in phases])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("summaries", nargs="+")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    try:
        summaries = [json.loads(Path(s).read_text()) for s in args.summaries]
    except (OSError, ValueError) as e:
        sys.exit(f"selection_figure.py: cannot read a summary: {e}")
    rows = list(series(summaries))
    if not rows:
        sys.exit("selection_figure.py: no kpool condition with a selection mechanism in these summaries")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    protocols = sorted({r[1] for r in rows}, reverse=True)
    fig, axes = plt.subplots(len(protocols), 2, figsize=(11, 3.6 * len(protocols)), squeeze=False)
    for i, protocol in enumerate(protocols):
        left, right = axes[i]
        for label, proto, phases, acc, lo, hi, held in rows:
            if proto != protocol:
                continue
            line = left.errorbar(phases, [100 * a for a in acc], yerr=[[100 * (a - x) for a, x in zip(acc, lo)],
                                 [100 * (x - a) for a, x in zip(acc, hi)]], marker="o", capsize=3, label=label)
            right.plot(phases, [100 * h for h in held], marker="o", color=line[0].get_color(), label=label)
        left.set(title=f"{protocol}: accuracy by target phase", xlabel="target position mod pool",
                 ylabel="accuracy (%)", ylim=(0, 100))
        right.set(title=f"{protocol}: answer's pool held by the answering query", xlabel="target position mod pool",
                  ylabel="share of layers (%)", ylim=(0, 100))
        for ax in (left, right):
            ax.xaxis.get_major_locator().set_params(integer=True)
        left.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
