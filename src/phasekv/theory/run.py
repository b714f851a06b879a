"""`run_theory`: every check of docs/science.md section 5 in one pass, written to a JSON summary and figures.

Sections of the summary:
  loss_check   the population loss computed exactly (closed form at eps = 0; enumeration of every
               context for a tiny vocabulary at eps > 0) against Monte Carlo, with z-scores;
  theorem1     the oracle optimum on a small instance (`phasekv.theory.optimum`), at eps = 0 and eps > 0,
               and a scan over beta showing where the one-hot optimum stops being global;
  theorem2     gradient descent on log-linear gates over many seeds (`phasekv.theory.flow`): final
               loss, each head's position r_h with its worst-case p^K(r_h), p^V(r_h + 1), collisions
               (also against the initialization radius rho), and the speed of concentration against kappa;
  retrieval    the probability of the correct successor and top-1 accuracy by query position r at the
               trained solution, and at the Theorem 1 optimum as m, S, N, kappa, eps vary.
Positions are 0-based (phase r = t mod S); query positions are 0..S-2.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from phasekv.outputs import write_json
from phasekv.theory.flow import (
    FlowConfig,
    FlowResult,
    chance_collision_rate,
    collision_rate,
    final_positions,
    gate_assignment,
    single_run_assignment,
    train_gates,
)
from phasekv.theory.model import (
    DTYPE,
    TheoryConfig,
    closed_form_losses,
    enumerated_loss,
    gram_error,
    make_embeddings,
    monte_carlo_loss,
    one_hot_assignment,
    reference_monte_carlo_loss,
    retrieval_by_position,
    sample_contexts,
    static_assignment,
)
from phasekv.theory.optimum import enumerate_one_hot, oracle_descent, random_simplex, theorem1_check

log = logging.getLogger(__name__)

BASE = TheoryConfig(chunks=4, stride=4, vocab=32, heads=2, kappa=1.0, eps=0.0, gamma=4.0, beta=2.0)


def _settings(quick: bool) -> dict:
    """Sizes of every part; quick shrinks the sample sizes and the enumeration instance."""
    small = dataclasses.replace(BASE, chunks=2, stride=3 if quick else 4, vocab=12 if quick else 24)
    return {
        "base": BASE,
        "flow": FlowConfig(runs=8 if quick else 40, steps=150 if quick else 300, lr=8.0, rho=0.01,
                           batch=16 if quick else 32, record_every=3,
                           eval_contexts=128 if quick else 256),
        "enumeration": small,
        "descent": {"restarts": 8 if quick else 16, "steps": 200 if quick else 400, "lr": 1.0 / BASE.beta},
        "beta_scan": (1.0, 2.0, 4.0, 8.0),
        "beta_scan_descent": {"restarts": 4 if quick else 8, "steps": 150 if quick else 300},
        "tiny": TheoryConfig(chunks=2, stride=3, vocab=6, heads=2, eps=0.05, gamma=BASE.gamma, beta=BASE.beta),
        "reference_samples": 600 if quick else 3000,
        "mc_contexts": 1000 if quick else 4000,
        "retrieval_contexts": 256 if quick else 512,
        "kappa_flow": {"kappas": (0.25, 1.0, 4.0), "seeds": 2 if quick else 4, "steps": 100 if quick else 250},
        "rho_sweep": {"rhos": (0.1, 1.0), "runs": 8 if quick else 24, "steps": 80 if quick else 150},
    }


# ---------------------------------------------------------------- exact against Monte Carlo


def _agreement(exact: float, mean: float, stderr: float) -> dict:
    return {"exact": exact, "monte_carlo": mean, "stderr": stderr,
            "z": (mean - exact) / stderr if stderr > 0 else None}


def loss_check(settings: dict, gen: torch.Generator) -> dict:
    """Closed form vs reference MC at eps = 0 (random static p); enumeration vs both MCs at eps > 0 (gates)."""
    cfg = settings["base"]
    emb = make_embeddings(cfg)
    pk, pv = random_simplex((cfg.heads,), cfg.stride, gen), random_simplex((cfg.heads,), cfg.stride, gen)
    static = static_assignment(pk, pv)
    exact = closed_form_losses(pk, pv, cfg).mean().item()
    seed = int(torch.randint(2**31, (1,), generator=gen))
    ref = reference_monte_carlo_loss(cfg, emb, static, settings["reference_samples"], seed)

    tiny = settings["tiny"]
    emb_t = make_embeddings(tiny, gen)
    c = torch.randn((2, tiny.heads, tiny.stride, tiny.dim), generator=gen, dtype=DTYPE)  # content-dependent
    gates = single_run_assignment(c)
    exact_t = enumerated_loss(tiny, emb_t, gates).mean().item()
    ref_t = reference_monte_carlo_loss(tiny, emb_t, gates, settings["reference_samples"], seed + 1)
    fast_t = monte_carlo_loss(tiny, emb_t, gates, settings["mc_contexts"], gen)
    return {
        "static_eps0": {"config": dataclasses.asdict(cfg), **_agreement(exact, *ref)},
        "gates_eps": {"config": dataclasses.asdict(tiny), "gram_error": gram_error(emb_t, tiny.kappa),
                      "n_contexts_enumerated": math.perm(tiny.vocab, tiny.chunks * tiny.stride),
                      "reference": _agreement(exact_t, *ref_t),
                      "fast": _agreement(exact_t, fast_t.mean, fast_t.stderr)},
    }


# ---------------------------------------------------------------- Theorem 1


def beta_scan(settings: dict, gen: torch.Generator) -> list[dict]:
    """Enumerated one-hot optimum minus the best descent point of the oracle class, by beta."""
    rows = []
    for beta in settings["beta_scan"]:
        cfg = dataclasses.replace(settings["enumeration"], beta=beta)
        emb = make_embeddings(cfg)
        tokens = sample_contexts(cfg, 1, gen)[0]
        one_hot = enumerate_one_hot(cfg, emb, tokens).losses.min().item()
        d = settings["beta_scan_descent"]
        losses, pk, pv = oracle_descent(cfg, emb, tokens, restarts=d["restarts"], steps=d["steps"], lr=1.0 / beta,
                                        generator=gen)
        i = int(losses.argmin())
        rows.append({"beta": beta, "one_hot_optimum": one_hot, "descent_best": losses[i].item(),
                     "one_hot_is_global": bool(losses[i].item() >= one_hot - 1e-6),
                     "descent_max_coefficient": min(pk[i].max(-1).values.min().item(),
                                                    pv[i].max(-1).values.min().item())})
    return rows


# ---------------------------------------------------------------- Theorem 2


def _first_step(result: FlowResult, run: int, threshold: float) -> int | None:
    """First recorded step at which every head's largest static p^K and p^V exceed threshold."""
    for step, p in zip(result.steps, result.static_p):
        if min(max(row) for branch in p[run] for row in branch) > threshold:
            return step
    return None


def kappa_flow(settings: dict, gen: torch.Generator) -> list[dict]:
    """Speed of static concentration against kappa: runs with one vocabulary each, trained together."""
    kf = settings["kappa_flow"]
    cfg = settings["base"]
    embs = torch.stack([make_embeddings(dataclasses.replace(cfg, kappa=k))
                        for k in kf["kappas"] for _ in range(kf["seeds"])])
    flow = dataclasses.replace(settings["flow"], runs=len(embs), steps=kf["steps"], record_every=5)
    result = train_gates(cfg, flow, embs, gen, settings["progress"])
    rows = []
    for i, kappa in enumerate(kf["kappas"]):
        runs = range(i * kf["seeds"], (i + 1) * kf["seeds"])
        firsts = [_first_step(result, r, 0.9) for r in runs]
        rows.append({"kappa": kappa, "steps_to_p09": firsts, "final_loss": [result.loss[-1][r] for r in runs],
                     "final_content_spread": [result.spread[-1][r] for r in runs]})
    return rows


def rho_sweep(settings: dict, gen: torch.Generator) -> list[dict]:
    """How often heads collide, by the radius of the initialization (the main run gives rho = 0.01)."""
    cfg, rs = settings["base"], settings["rho_sweep"]
    emb = make_embeddings(cfg)
    rows = []
    for rho in rs["rhos"]:
        flow = dataclasses.replace(settings["flow"], runs=rs["runs"], steps=rs["steps"], rho=rho,
                                   record_every=rs["steps"])
        result = train_gates(cfg, flow, emb, gen, settings["progress"])
        final = final_positions(cfg, result.params, emb, settings["flow"].eval_contexts, gen)
        rows.append({"rho": rho, "runs": rs["runs"], "steps": rs["steps"],
                     "collision_rate": collision_rate(final["r_h"]),
                     "min_pk_all_runs": min(min(row) for row in final["min_pk"])})
    return rows


def theorem2(settings: dict, gen: torch.Generator) -> tuple[dict, FlowResult, dict]:
    cfg, flow = settings["base"], settings["flow"]
    emb = make_embeddings(cfg)
    result = train_gates(cfg, flow, emb, gen, settings["progress"])
    final = final_positions(cfg, result.params, emb, flow.eval_contexts, gen)
    eye = torch.eye(cfg.stride, dtype=DTYPE)
    optimum = closed_form_losses(eye[: cfg.heads], eye[1 : cfg.heads + 1], cfg).mean().item()
    counts = [0] * cfg.stride
    for row in final["r_h"]:
        for r in row:
            counts[r] += 1
    summary = {
        "runs": flow.runs,
        "flow_config": dataclasses.asdict(flow),
        "final_loss": result.loss[-1][0],
        "final_loss_all_runs": result.loss[-1],
        "theorem1_optimum_loss": optimum,
        "r_h": final["r_h"][0],
        "min_pk": final["min_pk"][0],
        "min_pv": final["min_pv"][0],
        "min_pk_all_runs": min(min(row) for row in final["min_pk"]),
        "min_pv_all_runs": min(min(row) for row in final["min_pv"]),
        "value_after_key_all_runs": all(all(row) for row in final["value_after_key"]),
        "r_h_all_runs": final["r_h"],
        "position_counts": counts,
        "collision_rate": collision_rate(final["r_h"]),
        "chance_collision_rate": chance_collision_rate(cfg),
        "final_eff_static_max": max(v for run in result.eff_static[-1] for b in run for v in b),
        "final_eff_window_max": max(v for run in result.eff_window[-1] for b in run for v in b),
        "final_content_spread_max": max(result.spread[-1]),
        "steps_to_p09": _first_step(result, 0, 0.9),
    }
    return summary, result, final


# ---------------------------------------------------------------- retrieval by position


def _coverage_stats(prob: list[float], covered: set[int]) -> dict:
    cov = [p for r, p in enumerate(prob) if r in covered]
    unc = [p for r, p in enumerate(prob) if r not in covered]
    return {"covered_prob": sum(cov) / len(cov) if cov else None,
            "uncovered_prob": sum(unc) / len(unc) if unc else None,
            "mean_prob": sum(prob) / len(prob)}


def _optimum_prediction(cfg: TheoryConfig, gen: torch.Generator, n_contexts: int) -> dict:
    """Probability by position at the distinct one-hot optimum (closed form at eps = 0, else MC)."""
    positions = list(range(cfg.heads))
    if cfg.eps == 0:
        eye = torch.eye(cfg.stride, dtype=DTYPE)
        prob = torch.exp(-closed_form_losses(eye[positions], eye[[r + 1 for r in positions]], cfg)).tolist()
    else:
        emb = make_embeddings(cfg, gen)
        stats = retrieval_by_position(cfg, emb, one_hot_assignment(cfg, positions),
                                      sample_contexts(cfg, n_contexts, gen))
        prob = stats["prob"].tolist()
    return {"vocab": cfg.vocab, "prob_by_position": prob, **_coverage_stats(prob, set(positions)),
            "chance": 1 / cfg.vocab}


def retrieval(settings: dict, final: dict, result: FlowResult, gen: torch.Generator) -> dict:
    cfg = settings["base"]
    emb = make_embeddings(cfg)
    tokens = sample_contexts(cfg, settings["retrieval_contexts"], gen, runs=(result.params.shape[0],))
    stats = retrieval_by_position(cfg, emb, gate_assignment(result.params), tokens)  # (R, S-1)
    per_run = [_coverage_stats(p, set(r)) for p, r in zip(stats["prob"].tolist(), final["r_h"])]
    top1 = stats["top1"].tolist()  # [run][position]
    collided = [len(set(r)) < len(r) for r in final["r_h"]]
    n = settings["retrieval_contexts"] // 4
    sweeps = {
        "heads": [{"heads": m, **_optimum_prediction(dataclasses.replace(cfg, heads=m), gen, n)}
                  for m in range(1, cfg.stride)],
        "stride": [{"stride": s, **_optimum_prediction(dataclasses.replace(cfg, stride=s, vocab=8 * s), gen, n)}
                   for s in (3, 4, 6, 8)],
        "vocab": [_optimum_prediction(dataclasses.replace(cfg, vocab=v), gen, n) for v in (16, 32, 64, 128, 256)],
        "eps": [{"eps": e, **_optimum_prediction(dataclasses.replace(cfg, eps=e), gen, n)}
                for e in (0.0, 0.02, 0.05, 0.1, 0.2)],
        "kappa": [{"kappa": k, **_optimum_prediction(dataclasses.replace(cfg, kappa=k, eps=0.05), gen, n)}
                  for k in (0.25, 1.0, 4.0)],
    }
    return {
        "trained_prob_by_position": stats["prob"][0].tolist(),
        "trained_stderr_by_position": stats["stderr"][0].tolist(),
        "trained_top1_by_position": stats["top1"][0].tolist(),
        "trained_covered_positions": sorted(set(final["r_h"][0])),
        "chance": 1 / cfg.vocab,
        "all_runs_covered_prob": _mean([s["covered_prob"] for s in per_run]),
        "all_runs_uncovered_prob": _mean([s["uncovered_prob"] for s in per_run]),
        "all_runs_top1_covered": _mean([t for ts, r in zip(top1, final["r_h"]) for i, t in enumerate(ts) if i in r]),
        "all_runs_top1_uncovered": _mean([t for ts, r in zip(top1, final["r_h"])
                                          for i, t in enumerate(ts) if i not in r]),
        # a collided run covers fewer positions: lower mean accuracy (and higher loss, though its doubly
        # covered position can give it a higher mean probability)
        "collided_runs_mean_top1": _mean([sum(t) / len(t) for t, c in zip(top1, collided) if c]),
        "distinct_runs_mean_top1": _mean([sum(t) / len(t) for t, c in zip(top1, collided) if not c]),
        "collided_runs_mean_loss": _mean([loss for loss, c in zip(result.loss[-1], collided) if c]),
        "distinct_runs_mean_loss": _mean([loss for loss, c in zip(result.loss[-1], collided) if not c]),
        "optimum": _optimum_prediction(cfg, gen, n),
        "sweeps": sweeps,
    }


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


# ---------------------------------------------------------------- everything


@contextmanager
def single_thread():
    """One intra-op thread for the duration: these tensors are tiny, and extra threads on a shared
    machine cost far more in synchronization than they save (10x slower measured on 2 busy cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_theory(out_dir: str | Path, seed: int = 0, quick: bool = False, progress: bool = True) -> dict:
    """Run every check of docs/science.md section 5; write theory_summary.json and PNG figures into out_dir.

    Returns the summary (plain JSON values); its "figures" lists the PNG file names written.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out: {out} exists and is not a directory")
    with single_thread():
        return _run_theory(out, seed, quick, progress)


def _run_theory(out: Path, seed: int, quick: bool, progress: bool = True) -> dict:
    from phasekv.figures.theory import write_theory_figures  # matplotlib only when figures are drawn

    out.mkdir(parents=True, exist_ok=True)
    settings = {**_settings(quick), "progress": progress}
    gen = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    timings = {}

    def timed(name, fn, *args):
        t0 = time.perf_counter()
        value = fn(*args)
        timings[name] = round(time.perf_counter() - t0, 2)
        log.info("theory: %s done in %.1fs", name, timings[name])
        return value

    checks = timed("loss_check", loss_check, settings, gen)
    d = settings["descent"]
    t1, t1_plot = timed("theorem1", lambda: theorem1_check(settings["enumeration"], seed, d["restarts"],
                                                           d["steps"], d["lr"]))
    t1_eps, _ = timed("theorem1_eps", lambda: theorem1_check(dataclasses.replace(settings["enumeration"],
                                                                                 eps=0.05),
                                                             seed, d["restarts"], d["steps"], d["lr"]))
    t1["eps_positive"] = {k: t1_eps[k] for k in ("config", "optimal_loss", "n_optimal", "optimal_all_adjacent",
                                                 "optimal_all_distinct", "descent_gap", "smoothed_increasing")}
    t1["beta_scan"] = timed("beta_scan", beta_scan, settings, gen)
    t2, result, final = timed("theorem2", theorem2, settings, gen)
    t2["kappa_flow"] = timed("kappa_flow", kappa_flow, settings, gen)
    t2["rho_sweep"] = timed("rho_sweep", rho_sweep, settings, gen)
    ret = timed("retrieval", retrieval, settings, final, result, gen)
    summary = {"seed": seed, "quick": quick, "config": dataclasses.asdict(settings["base"]),
               "loss_check": checks, "theorem1": t1, "theorem2": t2, "retrieval": ret}
    summary["figures"] = timed("figures", write_theory_figures, out, summary, result, t1_plot)
    timings["total"] = round(time.perf_counter() - start, 2)
    summary["timings_s"] = timings
    write_json(out / "theory_summary.json", summary, indent=1, sort_keys=False, end="")
    return summary
