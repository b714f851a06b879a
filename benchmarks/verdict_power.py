"""Error rates and power of phasekv's verdict on simulated models over the real prompt designs
(`phasekv.evaluate.power`; docs/power.md has the measured table).

For every design (`--designs`: audit-prefix, audit-insequence, audit-query, eval-prefix, eval-insequence,
eval-query, query24, or audit-PROTOCOL:N for the audit's design at N prompts per phase) and scenario, `--replicates`
simulated models are judged by `summarize` + `task_verdict` (or `query_phase_statistics`) and the rate of each
verdict class is printed, with the rate of rejected flatness, the rate of any phase effect ("phase sensitive", "a
small phase effect" or "a phase effect, not shown material") and the median minimum detectable gap printed.

Scenarios (`--scenarios`, default all): `flat`; `ctx0.5` (flat, context random effects of sd 0.5 logit); `linear`,
`U`, `step` (a `--trend-pp` trend over the shifts, over the added length for the query protocol, no phase effect);
the single-phase gaps `--gaps` at phase 7; `p4-30` (30 pp at phases 3 and 7: period 4); `30+linear` (30 pp at phase 7
plus the trend).  One thread; the last line is `name=value` pairs: `fpr@D` (rate of any phase effect on flat
models), `fprctx@D`, `fprTREND@D` (the same under context effects and each trend), `powerG@D` (rate of "phase
sensitive" at a G pp single-phase gap), `power30trend@D`, `period4@D` (the rate of "period 4" among the correct
detections of the period-4 effect), `period8@D` (the rate of "period 8", the stride, among the correct detections
of the 30 pp single-phase gap) and `mde80@D` (the smallest simulated single-phase gap found >= 80% of the
time, `>G` when none is).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/verdict_power.py [--designs audit-prefix query24] \
        [--replicates 200] [--n-boot 2000] [--n-perm 2000] [--gaps 5 10 15 30] [--trend-pp 30]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

from phasekv.evaluate.power import (  # noqa: E402
    CLASSES,
    DESIGNS,
    GAPS_PP,
    PERIODIC,
    SINGLE,
    Effect,
    audit_design,
    verdict_rates,
)


def design(name: str):
    if name in DESIGNS:
        return DESIGNS[name]
    head, _, per_phase = name.partition(":")
    if not head.startswith("audit-") or not per_phase.isdigit():
        raise SystemExit(f"--designs: unknown {name!r}; choose from {sorted(DESIGNS)} or audit-PROTOCOL:N")
    return audit_design(head[len("audit-"):], int(per_phase))


def scenarios(gaps: list[float], trend_pp: float) -> dict[str, tuple[Effect, dict[str, float]]]:
    """Name -> (effect, extra random effects of `simulate`)."""
    out = {"flat": (Effect(), {}), "ctx0.5": (Effect(), {"context_sd": 0.5})}
    out.update({t: (Effect(trend=t, trend_pp=trend_pp), {}) for t in ("linear", "U", "step")})
    out.update({f"g{g:g}": (Effect(g, SINGLE), {}) for g in gaps})
    out["p4-30"] = (Effect(30.0, PERIODIC), {})
    out["30+linear"] = (Effect(30.0, SINGLE, "linear", trend_pp), {})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--designs", nargs="+", default=sorted(DESIGNS))
    p.add_argument("--replicates", type=int, default=200)
    p.add_argument("--n-boot", type=int, default=2000)
    p.add_argument("--n-perm", type=int, default=2000)
    p.add_argument("--gaps", type=float, nargs="+", default=list(GAPS_PP))
    p.add_argument("--trend-pp", type=float, default=30.0)
    p.add_argument("--scenarios", nargs="+", default=None, help="names of scenarios(); default all")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    chosen = scenarios(args.gaps, args.trend_pp)
    if args.scenarios:
        unknown = sorted(set(args.scenarios) - set(chosen))
        if unknown:
            raise SystemExit(f"--scenarios: unknown {unknown}; choose from {sorted(chosen)}")
        chosen = {k: v for k, v in chosen.items() if k in args.scenarios}
    classes = list(CLASSES.values())
    print(f"{'design':<22} {'scenario':<10} {'prompts':>7} {'clusters':>8} " + " ".join(f"{c:>10}" for c in classes)
          + f" {'flat-rej':>8} {'effect':>6} {'mde':>5} {'s':>6}", flush=True)
    pairs = []
    for name in args.designs:
        d = design(name)
        found = {}
        for label, (effect, model) in chosen.items():
            started = time.perf_counter()
            r = verdict_rates(d, effect, args.replicates, args.seed, args.n_boot, args.n_perm, **model)
            mde = "-" if r["median_mde_pp"] is None else f"{r['median_mde_pp']:.0f}"
            print(f"{name:<22} {label:<10} {r['n_prompts']:>7} {r['n_clusters']:>8} "
                  + " ".join(f"{r['rates'][c]:>10.3f}" for c in classes)
                  + f" {r['flatness_rejected']:>8.3f} {r['phase_effect']:>6.3f} {mde:>5} "
                    f"{time.perf_counter() - started:>6.0f}", flush=True)
            if label == "flat":
                pairs.append(f"fpr@{name}={r['phase_effect']:.3f}")
            elif label == "ctx0.5":
                pairs.append(f"fprctx@{name}={r['phase_effect']:.3f}")
            elif label in ("linear", "U", "step"):
                pairs.append(f"fpr{label}@{name}={r['phase_effect']:.3f}")
            elif label.startswith("g"):
                found[effect.gap_pp] = r["rates"]["sensitive"]
                pairs.append(f"power{effect.gap_pp:g}@{name}={r['rates']['sensitive']:.3f}")
                if effect.gap_pp == 30:  # one weak phase of S: the period is the stride
                    named = r["periods"].get(d.stride, 0) / max(1, r["counts"]["sensitive"])
                    pairs.append(f"period{d.stride}@{name}={named:.3f}")
            elif label == "30+linear":
                pairs.append(f"power30trend@{name}={r['rates']['sensitive']:.3f}")
            elif label == "p4-30":
                named = r["periods"].get(4, 0) / max(1, r["counts"]["sensitive"])
                pairs.append(f"period4@{name}={named:.3f}")
        if found:
            mde80 = min((g for g, rate in found.items() if rate >= 0.8), default=None)
            pairs.append(f"mde80@{name}=" + (f"{mde80:g}" if mde80 is not None else f">{max(found):g}"))
    print(f"replicates={args.replicates} n_boot={args.n_boot} n_perm={args.n_perm} " + " ".join(pairs))


if __name__ == "__main__":
    main()
