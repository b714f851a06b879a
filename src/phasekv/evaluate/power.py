"""Error rates and power of the verdict, simulated on the real prompt designs (docs/power.md).

A simulated model answers the prompts of a real prompt set (`phasekv.data.protocols.build_eval_set`, so the
clusters, the (cluster, target) pairs, the shifts and the positions are exactly those an evaluation uses) with
probability

    P(correct) = sigmoid(mu(phase, x) + u_cluster + v_pair + w_context),
    u ~ N(0, example_sd^2), v ~ N(0, pair_sd^2), w ~ N(0, context_sd^2) (a context: one cluster at one shift),

a(phase, x) = base at every phase except the affected ones, where it is base - gap, minus a trend of `trend_pp` over
x, centred on the base (`TRENDS`: linear, U, step, each running from 0 to 1, minus 0.5; x is the shift for the
padding protocols and the added length, query position minus the shortest, for the query protocol, scaled to
[0, 1]): the accuracies averaged over the random effects (`conditional_logit` finds the logit that gives them), so
"60% with one phase 30 pp lower" is what a user would measure on endless prompts.  The phase is the target
position's mod S for the padding protocols and the query position's for the query protocol, the coordinate each
protocol tests.  Every replicate is judged by phasekv's own functions: `summarize` and `task_verdict` (the padding
protocols), `query_phase_statistics` (the query protocol; its query-phase verdict), so the rates are those of the
verdict users get, not of a model of it.  `within=False` skips the one statistic no
verdict reads (the within-example test).

Designs (`DESIGNS`): the audit's default (`phasekv audit`: 8 phases, R = S = 8, 24 records, 4 demonstrations, the
fewest clusters giving AUDIT_PROMPTS_PER_PHASE prompts per phase with 1-token keys and values, as the records format
has with most tokenizers) and the eval default (`phasekv eval`: R = 24, 64 records, 8 demonstrations, the exactly
matched cluster count).  Effects (`EFFECTS`): none, and gaps of 5, 10, 15 and 30 pp at one phase (S - 1, the
boundary phase of a compressed model) and at a periodic set (phases 3 and 7 of 8: period 4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
from scipy.special import expit

from phasekv.data.protocols import build_eval_set
from phasekv.data.vocab import Vocabulary
from phasekv.evaluate.metrics import summarize
from phasekv.evaluate.verdict import query_phase_statistics, task_verdict

AUDIT_PROMPTS_PER_PHASE = 192  # `phasekv audit --prompts-per-phase` default: 1,536 prompts per protocol and condition
BASE_ACCURACY = 0.6  # the reference model: 60% at every good phase
EXAMPLE_SD, PAIR_SD = 0.5, 1.0  # random effects on the logit: examples and (example, target) pairs differ
GAPS_PP = (5.0, 10.0, 15.0, 30.0)
SINGLE, PERIODIC = (7,), (3, 7)  # affected phases of S = 8: the boundary phase; a period-4 set
# verdict classes, by the verdict's opening words (phasekv.evaluate.verdict.task_verdict)
CLASSES = {"phase sensitive": "sensitive", "a small phase effect": "small", "a length effect": "length",
           "a phase effect, not shown material": "unresolved", "no phase effect detected": "none",
           "cannot do the task": "unable", "retrieval destroyed": "destroyed"}


@dataclass(frozen=True)
class Design:
    """One prompt design: a protocol and build_eval_set's size arguments (n_clusters None: its default)."""

    name: str
    protocol: str
    stride: int = 8
    residue_modulus: int = 24
    n_records: int = 64
    n_demos: int = 8
    n_clusters: int | None = None

    def __post_init__(self) -> None:
        if self.protocol not in ("prefix", "insequence", "query"):
            raise ValueError(f"Design.protocol: must be prefix, insequence or query, got {self.protocol!r}")


def audit_design(protocol: str, prompts_per_phase: int = AUDIT_PROMPTS_PER_PHASE) -> Design:
    """`phasekv audit`'s design with 1-token keys and values: the fewest clusters, a multiple of g = gcd(record pitch,
    8), giving `prompts_per_phase` per phase (8 / g each).  The same count as `evaluate.sources.audit_clusters`, which a
    lower layer cannot import (tests/test_power.py checks that they agree)."""
    g = math.gcd(2 + (protocol == "insequence"), 8)
    clusters = math.ceil(math.ceil(prompts_per_phase / (8 // g)) / g) * g
    return Design(f"audit{prompts_per_phase}", protocol, stride=8, residue_modulus=8, n_records=24, n_demos=4,
                  n_clusters=clusters)


DESIGNS = {**{f"audit-{p}": audit_design(p) for p in ("prefix", "insequence", "query")},
           **{f"eval-{p}": Design("eval", p) for p in ("prefix", "insequence", "query")},
           # the query protocol where a trend must be told from a period: R = 3 S, 16 clusters (every length offset
           # twice per family), 32 records: 4,608 prompts, 576 per phase
           "query24": Design("query24", "query", stride=8, residue_modulus=24, n_records=32, n_demos=4, n_clusters=16)}


TRENDS = {"linear": lambda t: t, "U": lambda t: 1 - 4 * (t - 0.5) ** 2, "step": lambda t: (t >= 0.5).astype(float)}


@dataclass(frozen=True)
class Effect:
    """A phase effect: `gap_pp` lower accuracy at `phases` (mod the design's stride); gap 0 is a flat model."""

    gap_pp: float = 0.0
    phases: tuple[int, ...] = ()
    trend: str | None = None  # one of TRENDS: accuracy falls by trend_pp over the shifts (query: the lengths)
    trend_pp: float = 0.0

    def __post_init__(self) -> None:
        if self.trend is not None and self.trend not in TRENDS:
            raise ValueError(f"Effect.trend: must be one of {sorted(TRENDS)} or None, got {self.trend!r}")

    @property
    def name(self) -> str:
        phase = f"{self.gap_pp:g}pp@{'+'.join(map(str, self.phases))}" if self.gap_pp else ""
        trend = f"{self.trend}{self.trend_pp:g}" if self.trend and self.trend_pp else ""
        return "+".join(x for x in (phase, trend) if x) or "flat"


EFFECTS = (Effect(), *(Effect(g, SINGLE) for g in GAPS_PP), *(Effect(g, PERIODIC) for g in GAPS_PP))


@lru_cache(maxsize=16)
def layout(design: Design) -> dict[str, Any]:
    """The design's prompts as arrays: cluster, record, target_position, query_position, pair (an id per (cluster,
    record)), and the in-context chance and format chance of its prompt set."""
    eval_set = build_eval_set(Vocabulary(), design.protocol, n_records=design.n_records, n_demos=design.n_demos,
                              stride=design.stride, residue_modulus=design.residue_modulus,
                              n_clusters=design.n_clusters)
    queries = eval_set.queries()
    cluster = np.array([q.cluster for q in queries])
    record = np.array([q.record for q in queries])
    _, pair = np.unique(cluster * (design.n_records + 1) + record, return_inverse=True)
    shift = np.array([q.shift for q in queries])
    _, context = np.unique(cluster * (design.residue_modulus + 1) + shift, return_inverse=True)
    return {"cluster": cluster, "record": record, "pair": pair, "shift": shift, "context": context,
            "target_position": np.array([q.target_position for q in queries]),
            "query_position": np.array([q.query_position for q in queries]),
            "chance": eval_set.chance, "in_context_chance": eval_set.in_context_chance}


def simulate(design: Design, effect: Effect, replicates: int, rng: np.random.Generator, *, base: float = BASE_ACCURACY,
             example_sd: float = EXAMPLE_SD, pair_sd: float = PAIR_SD, context_sd: float = 0.0) -> np.ndarray:
    """Correct (bool) of every prompt of `design` in each replicate: (replicates, prompts), the module doc's model."""
    lay = layout(design)
    query = design.protocol == "query"
    coordinate = lay["query_position" if query else "target_position"]
    acc = np.full(design.stride, base)[coordinate % design.stride]
    acc[np.isin(coordinate % design.stride, effect.phases)] -= effect.gap_pp / 100
    if effect.trend and effect.trend_pp:
        x = (lay["query_position"] - lay["query_position"].min()) if query else lay["shift"]
        acc = acc - effect.trend_pp / 100 * (TRENDS[effect.trend](x / max(1, x.max())) - 0.5)  # centred on base
    if np.any(acc <= 0):
        raise ValueError(f"effect: {effect.name} leaves no positive accuracy at base {base}")
    values, index = np.unique(acc, return_inverse=True)
    mu = conditional_logit(values, math.sqrt(example_sd ** 2 + pair_sd ** 2 + context_sd ** 2))[index]
    u = rng.normal(0.0, example_sd, (replicates, lay["cluster"].max() + 1))
    v = rng.normal(0.0, pair_sd, (replicates, lay["pair"].max() + 1))
    w = rng.normal(0.0, context_sd, (replicates, lay["context"].max() + 1))
    eta = mu + u[:, lay["cluster"]] + v[:, lay["pair"]] + w[:, lay["context"]]  # (replicates, prompts)
    return rng.random(eta.shape) < expit(eta)


def conditional_logit(accuracy: np.ndarray, sd: float) -> np.ndarray:
    """The logit mu whose logit-normal mean E[sigmoid(mu + sd Z)] is `accuracy` (Gauss-Hermite quadrature of the
    mean, bisection on mu: the mean is increasing in mu)."""
    x, w = np.polynomial.hermite_e.hermegauss(64)
    w = w / w.sum()
    low, high = np.full(np.shape(accuracy), -30.0), np.full(np.shape(accuracy), 30.0)
    for _ in range(60):
        mid = (low + high) / 2
        above = (expit(mid[..., None] + sd * x) * w).sum(-1) > accuracy
        high, low = np.where(above, mid, high), np.where(above, low, mid)
    return (low + high) / 2


def judge_replicate(design: Design, correct: np.ndarray, seed: int, n_boot: int, n_perm: int) -> dict[str, Any]:
    """phasekv's verdict (and the statistics it read) on one simulated replicate."""
    lay = layout(design)
    if design.protocol == "query":
        records = [{"cluster": int(c), "record": int(r), "target_position": int(t), "query_position": int(q),
                    "correct": bool(k)} for c, r, t, q, k in zip(lay["cluster"], lay["record"], lay["target_position"],
                                                                 lay["query_position"], correct)]
        return query_phase_statistics(records, design.stride, design.residue_modulus, lay["chance"],
                                      lay["in_context_chance"], n_boot=n_boot, seed=seed, n_perm=n_perm,
                                      within=False)["query_phase"]
    metrics = summarize({"cluster": lay["cluster"], "target_position": lay["target_position"], "correct": correct},
                        design.stride, design.residue_modulus, n_boot=n_boot, seed=seed, n_perm=n_perm, within=False)
    return {**metrics, **task_verdict(metrics, lay["chance"], lay["in_context_chance"])}


def verdict_class(verdict: str) -> str:
    """The class of a verdict line (CLASSES); ValueError for a line no class opens."""
    for opening, name in CLASSES.items():
        if verdict.startswith(opening):
            return name
    raise ValueError(f"verdict: no class opens {verdict[:60]!r}")


def verdict_rates(design: Design, effect: Effect, replicates: int = 200, seed: int = 0, n_boot: int = 2000,
                  n_perm: int = 2000, **model: float) -> dict[str, Any]:
    """Rates of every verdict class over `replicates` simulated models (`model`: simulate's base, example_sd,
    pair_sd), the rate of rejected flatness and the median minimum detectable gap the verdicts printed."""
    if replicates < 1:
        raise ValueError(f"replicates: must be >= 1, got {replicates}")
    rng = np.random.default_rng([seed, int(10 * effect.gap_pp), *effect.phases, int(10 * effect.trend_pp),
                                 sorted(TRENDS).index(effect.trend) if effect.trend else len(TRENDS)])
    correct = simulate(design, effect, replicates, rng, **model)
    counts = dict.fromkeys(CLASSES.values(), 0)
    rejected, mde, periods = 0, [], {}
    for i, row in enumerate(correct):
        m = judge_replicate(design, row, seed * 100_003 + i, n_boot, n_perm)
        counts[verdict_class(m["verdict"])] += 1
        rejected += m["verdict_parts"]["phase_dependent"]
        if m["phase_sensitive"]:
            periods[m["verdict_parts"]["period"]] = periods.get(m["verdict_parts"]["period"], 0) + 1
        if m.get("minimum_detectable_gap_pp") is not None:
            mde.append(m["minimum_detectable_gap_pp"])
    return {"design": design.name, "protocol": design.protocol, "effect": effect.name, "replicates": replicates,
            "n_prompts": correct.shape[1], "n_clusters": int(layout(design)["cluster"].max() + 1),
            "rates": {k: v / replicates for k, v in counts.items()}, "counts": counts, "periods": periods,
            "flatness_rejected": rejected / replicates,
            "phase_effect": (counts["sensitive"] + counts["small"] + counts["unresolved"]) / replicates,
            "median_mde_pp": float(np.median(mde)) if mde else None}
