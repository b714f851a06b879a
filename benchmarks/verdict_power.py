"""Error rates and power of phasekv's verdict on simulated models over the real prompt designs
(`phasekv.evaluate.power`; docs/power.md has the measured table).

For every design (`--designs`: audit-prefix, audit-insequence, audit-query, eval-prefix, eval-insequence,
eval-query, or audit-PROTOCOL:N for the audit's design at N prompts per phase) and effect (flat; 5, 10, 15, 30 pp at
one phase; the same at phases 3 and 7), `--replicates` simulated models are judged by `summarize` + `task_verdict`
(or `query_phase_statistics`) and the rate of each verdict class is printed, with the rate of rejected flatness and
the median minimum detectable gap the verdicts printed.  One thread; the last line is `name=value` pairs:
`fpr@D` (rate of "phase sensitive" on flat models), `powerG@D` (at a G pp single-phase gap) and `mde80@D` (the
smallest simulated single-phase gap found >= 80% of the time, `>30` when none is).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/verdict_power.py [--designs audit-prefix eval-prefix] \
        [--replicates 200] [--n-boot 2000] [--n-perm 2000] [--gaps 5 10 15 30]
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--designs", nargs="+", default=sorted(DESIGNS))
    p.add_argument("--replicates", type=int, default=200)
    p.add_argument("--n-boot", type=int, default=2000)
    p.add_argument("--n-perm", type=int, default=2000)
    p.add_argument("--gaps", type=float, nargs="+", default=list(GAPS_PP))
    p.add_argument("--no-periodic", action="store_true", help="single-phase effects only")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    effects = [Effect(), *(Effect(g, SINGLE) for g in args.gaps),
               *(() if args.no_periodic else (Effect(g, PERIODIC) for g in args.gaps))]
    classes = list(CLASSES.values())
    print(f"{'design':<22} {'effect':<12} {'prompts':>7} {'clusters':>8} " + " ".join(f"{c:>10}" for c in classes)
          + f" {'flat-rej':>8} {'mde':>5} {'s':>6}", flush=True)
    pairs = []
    for name in args.designs:
        d = design(name)
        found = {}
        for effect in effects:
            started = time.perf_counter()
            r = verdict_rates(d, effect, args.replicates, args.seed, args.n_boot, args.n_perm)
            mde = "-" if r["median_mde_pp"] is None else f"{r['median_mde_pp']:.0f}"
            print(f"{name:<22} {effect.name:<12} {r['n_prompts']:>7} {r['n_clusters']:>8} "
                  + " ".join(f"{r['rates'][c]:>10.3f}" for c in classes)
                  + f" {r['flatness_rejected']:>8.3f} {mde:>5} {time.perf_counter() - started:>6.0f}", flush=True)
            if not effect.gap_pp:
                pairs.append(f"fpr@{name}={r['rates']['sensitive']:.3f}")
            elif effect.phases == SINGLE:
                found[effect.gap_pp] = r["rates"]["sensitive"]
                pairs.append(f"power{effect.gap_pp:g}@{name}={r['rates']['sensitive']:.3f}")
        mde80 = min((g for g, rate in found.items() if rate >= 0.8), default=None)
        pairs.append(f"mde80@{name}=" + (f"{mde80:g}" if mde80 is not None else f">{max(found, default=0):g}"))
    print(f"replicates={args.replicates} n_boot={args.n_boot} n_perm={args.n_perm} " + " ".join(pairs))


if __name__ == "__main__":
    main()
