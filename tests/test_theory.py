"""Tests of phasekv.theory: the idealized induction model, Theorems 1 and 2, the retrieval prediction."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time

import numpy as np
import pytest
import torch

from phasekv.cli.theory import add_parser
from phasekv.theory.flow import (
    FlowConfig,
    chance_collision_rate,
    collision_rate,
    content_spread,
    effective_offsets,
    final_positions,
    gate_probabilities,
    train_gates,
)
from phasekv.theory.model import (
    DTYPE,
    TheoryConfig,
    closed_form_losses,
    enumerated_loss,
    fixed_assignment,
    gram_error,
    make_embeddings,
    monte_carlo_loss,
    one_hot_assignment,
    query_losses,
    reference_monte_carlo_loss,
    reference_query_loss,
    retrieval_by_position,
    sample_contexts,
    static_assignment,
)
from phasekv.theory.optimum import (
    project_to_simplex,
    random_simplex,
    reference_project_to_simplex,
    theorem1_check,
)
from phasekv.theory.run import run_theory, single_thread

BASE = TheoryConfig(chunks=4, stride=4, vocab=32, heads=2, gamma=4.0, beta=2.0)
TINY = TheoryConfig(chunks=2, stride=3, vocab=6, heads=2, gamma=4.0, beta=2.0)


@pytest.fixture(autouse=True)
def _one_thread():
    with single_thread():  # tiny tensors: threads only add contention on a shared machine
        yield


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- the model


@pytest.mark.parametrize("kwargs", [dict(heads=4), dict(heads=0), dict(vocab=15), dict(stride=1, heads=1),
                                    dict(kappa=0.0), dict(eps=-0.1), dict(beta=0.0)])
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        dataclasses.replace(BASE, **kwargs)


@pytest.mark.parametrize("eps", [0.0, 0.03, 0.2])
def test_embeddings_have_the_requested_gram_error(eps):
    cfg = dataclasses.replace(BASE, eps=eps)
    emb = make_embeddings(cfg, _gen())
    assert emb.shape == (cfg.vocab, cfg.vocab + 1)
    assert gram_error(emb, cfg.kappa) == pytest.approx(eps, abs=1e-9)


def test_contexts_hold_distinct_tokens():
    tokens = sample_contexts(BASE, 200, _gen())
    flat = tokens.flatten(1)
    assert tokens.shape == (200, BASE.chunks, BASE.stride)
    assert all(len(set(row.tolist())) == flat.shape[1] for row in flat)
    assert flat.min() >= 0 and flat.max() < BASE.vocab
    # uniform over tokens: each of the 32 tokens appears in about LS/N = half of the contexts
    counts = torch.bincount(flat.flatten(), minlength=BASE.vocab).double() / 200
    assert (counts - 0.5).abs().max() < 0.15


def test_fast_losses_match_the_loop_reference_for_every_query():
    cfg = dataclasses.replace(BASE, eps=0.05)
    gen = _gen(1)
    emb = make_embeddings(cfg, gen)
    tokens = sample_contexts(cfg, 1, gen)[0]
    shape = (cfg.heads, cfg.chunks)
    pk, pv = random_simplex(shape, cfg.stride, gen), random_simplex(shape, cfg.stride, gen)  # per chunk
    fast = query_losses(tokens[None], emb, fixed_assignment(pk[None], pv[None]), cfg)[0]  # (L, S-1)
    for l_star in range(cfg.chunks):
        for r_star in range(cfg.stride - 1):
            ref = reference_query_loss(emb.numpy(), tokens.numpy(), l_star, r_star, pk.numpy(), pv.numpy(),
                                       gamma=cfg.gamma, beta=cfg.beta)
            assert fast[l_star, r_star].item() == pytest.approx(ref, abs=1e-10)


@pytest.mark.parametrize("vocab", [6, 7])  # N = LS, and N > LS (one token outside every context)
def test_closed_form_equals_enumeration_over_all_contexts(vocab):
    gen = _gen(2)
    cfg = dataclasses.replace(TINY, vocab=vocab)
    pk, pv = random_simplex((cfg.heads,), cfg.stride, gen), random_simplex((cfg.heads,), cfg.stride, gen)
    closed = closed_form_losses(pk, pv, cfg)
    enumerated = enumerated_loss(cfg, make_embeddings(cfg), static_assignment(pk, pv))
    assert torch.allclose(closed, enumerated, atol=1e-12)


def test_closed_form_agrees_with_reference_monte_carlo():
    gen = _gen(3)
    pk, pv = random_simplex((BASE.heads,), BASE.stride, gen), random_simplex((BASE.heads,), BASE.stride, gen)
    exact = closed_form_losses(pk, pv, BASE).mean().item()
    mean, stderr = reference_monte_carlo_loss(BASE, make_embeddings(BASE), static_assignment(pk, pv), 1500)
    assert 0 < stderr < 0.05
    assert abs(mean - exact) < 3 * stderr


def test_enumeration_agrees_with_both_monte_carlos_for_gates_at_positive_eps():
    from phasekv.theory.flow import single_run_assignment

    cfg = dataclasses.replace(TINY, eps=0.05)
    gen = _gen(4)
    emb = make_embeddings(cfg, gen)
    c = torch.randn((2, cfg.heads, cfg.stride, cfg.dim), generator=gen, dtype=DTYPE)  # content-dependent gates
    gates = single_run_assignment(c)
    exact = enumerated_loss(cfg, emb, gates).mean().item()
    mean, stderr = reference_monte_carlo_loss(cfg, emb, gates, 1500, seed=5)
    assert abs(mean - exact) < 3 * stderr
    fast = monte_carlo_loss(cfg, emb, gates, 4000, gen)
    assert 0 < fast.stderr < 0.02
    assert abs(fast.mean - exact) < 3 * fast.stderr


def test_kappa_cancels_for_a_fixed_assignment():
    tokens = sample_contexts(BASE, 8, _gen())
    assign = one_hot_assignment(BASE, [0, 2])
    losses = [query_losses(tokens, make_embeddings(dataclasses.replace(BASE, kappa=k)), assign, BASE)
              for k in (0.3, 1.0, 5.0)]
    assert torch.allclose(losses[0], losses[1], atol=1e-9) and torch.allclose(losses[0], losses[2], atol=1e-9)


# ---------------------------------------------------------------- Theorem 1


def test_simplex_projection_matches_bisection_reference():
    v = torch.randn(50, 5, generator=_gen(), dtype=DTYPE) * 2
    fast = project_to_simplex(v)
    assert torch.allclose(fast, reference_project_to_simplex(v), atol=1e-9)
    assert (fast >= 0).all() and torch.allclose(fast.sum(-1), torch.ones(50, dtype=DTYPE))


@pytest.mark.parametrize("eps", [0.0, 0.05])
def test_theorem1_enumerated_optimum_is_one_hot_adjacent_and_distinct(eps):
    # N = 24: well inside the small-beta regime (near its edge, N = 16, descent stalls at split points)
    cfg = TheoryConfig(chunks=2, stride=4, vocab=24, heads=2, gamma=4.0, beta=2.0, eps=eps)
    s, _ = theorem1_check(cfg, seed=0, restarts=16, steps=300, lr=0.5, n_random=500)
    assert s["n_assignments"] == 16**4
    assert s["optimal_all_adjacent"]
    if eps == 0:
        assert s["optimal_all_distinct"]
        assert s["n_optimal"] == math.perm(cfg.stride - 1, cfg.heads) ** cfg.chunks  # ordered distinct per chunk
        assert s["best_collided_loss"] > s["optimal_loss"] + 0.05
    assert s["best_nonadjacent_loss"] > s["optimal_loss"] + 0.05
    # continuous descent over the oracle class cannot beat it and ends on a one-hot adjacent point: the
    # optimum itself at eps = 0; at eps > 0 the tie between the distinct assignments breaks by O(eps), and
    # descent may settle on one of the others
    assert s["descent_gap"] >= -1e-9 and s["descent_gap"] < (1e-6 if eps == 0 else 0.01)
    assert s["descent_min_max_coefficient"] > 0.999 and s["descent_adjacent"]
    assert s["random_min_loss"] > s["optimal_loss"]
    assert s["smoothed_increasing"]


def test_theorem1_needs_small_beta_when_heads_cannot_cover_every_position():
    """With m < S - 1 and a large unembedding scale a spread assignment beats every one-hot one."""
    cfg = TheoryConfig(chunks=2, stride=4, vocab=16, heads=2, gamma=4.0, beta=8.0)
    s, _ = theorem1_check(cfg, seed=0, restarts=8, steps=300, lr=1 / 8, n_random=200)
    assert s["descent_best_loss"] < s["optimal_loss"] - 0.1
    assert s["descent_min_max_coefficient"] < 0.9


# ---------------------------------------------------------------- Theorem 2


def test_log_linear_gates_match_a_loop_reference():
    gen = _gen(6)
    c = torch.randn((1, 2, BASE.heads, BASE.stride, BASE.dim), generator=gen, dtype=DTYPE)
    x = make_embeddings(BASE)[sample_contexts(BASE, 3, gen)][None]  # (1, B, L, S, d)
    pk, pv = gate_probabilities(c, x)
    for b in range(3):
        for h in range(BASE.heads):
            for l in range(BASE.chunks):
                for branch, p in enumerate((pk, pv)):
                    logits = [float(c[0, branch, h, r] @ x[0, b, l, r]) for r in range(BASE.stride)]
                    z = sum(math.exp(v) for v in logits)
                    for r in range(BASE.stride):
                        assert p[0, b, h, l, r].item() == pytest.approx(math.exp(logits[r]) / z, abs=1e-12)


def test_effective_offsets_separate_static_from_per_window_concentration():
    eye = torch.eye(BASE.stride, dtype=DTYPE)
    uniform = torch.full((1, 4, 1, 1, BASE.stride), 1 / BASE.stride, dtype=DTYPE)  # (R, B, m, L, S)
    fixed = eye[2].expand(1, 4, 1, 1, -1)
    moving = torch.stack([eye[0], eye[1], eye[0], eye[1]]).view(1, 4, 1, 1, -1)  # one-hot, two offsets
    for p, static, window in ((uniform, 4.0, 4.0), (fixed, 1.0, 1.0), (moving, 2.0, 1.0)):
        s, w = effective_offsets(p)
        assert s.item() == pytest.approx(static) and w.item() == pytest.approx(window)


def test_theorem2_every_head_concentrates_on_one_adjacent_pair():
    flow = FlowConfig(runs=4, steps=300, lr=8.0, rho=0.01, batch=16, record_every=50)
    gen = _gen(7)
    emb = make_embeddings(BASE)
    result = train_gates(BASE, flow, emb, gen, progress=False)
    final = final_positions(BASE, result.params, emb, 128, gen)
    for run in range(flow.runs):
        assert min(final["min_pk"][run]) > 0.99, final  # worst case over contexts and chunks
        assert min(final["min_pv"][run]) > 0.99, final
        assert all(final["value_after_key"][run])
        assert all(0 <= r < BASE.stride - 1 for r in final["r_h"][run])
    # static, not content-driven: the token part of any gate logit stays far below the static gap
    assert content_spread(result.params).max() < 0.2
    assert max(v for run in result.eff_static[-1] for b in run for v in b) < 1.05
    assert result.eff_static[0][0][0][0] == pytest.approx(BASE.stride, abs=0.01)  # uniform at the start
    assert result.loss[-1][0] < result.loss[0][0] - 0.5


def test_theorem2_outcome_does_not_depend_on_the_step_size():
    """Small enough steps follow the same flow: the positions chosen agree for lr and lr / 4."""
    emb = make_embeddings(BASE)
    picks = []
    for lr, steps in ((8.0, 60), (2.0, 240)):
        flow = FlowConfig(runs=6, steps=steps, lr=lr, batch=16, record_every=steps)
        result = train_gates(BASE, flow, emb, _gen(11), progress=False)
        picks.append(final_positions(BASE, result.params, emb, 32, _gen(0))["r_h"])
    assert picks[0] == picks[1]


def test_collision_rates():
    assert collision_rate([[0, 0], [0, 1], [2, 1], [1, 1]]) == 0.5
    assert chance_collision_rate(BASE) == pytest.approx(1 / 3)
    assert chance_collision_rate(dataclasses.replace(BASE, stride=5, heads=3)) == pytest.approx(1 - 24 / 64)


# ---------------------------------------------------------------- retrieval by position


def test_uncovered_positions_get_no_evidence():
    assign = one_hot_assignment(BASE, [0, 2])
    stats = retrieval_by_position(BASE, make_embeddings(BASE), assign, sample_contexts(BASE, 64, _gen()))
    eye = torch.eye(BASE.stride, dtype=DTYPE)
    closed = torch.exp(-closed_form_losses(eye[[0, 2]], eye[[1, 3]], BASE))
    assert torch.allclose(stats["prob"], closed, atol=1e-12)  # eps = 0: every context is the same
    prob, top1 = stats["prob"].tolist(), stats["top1"].tolist()
    assert top1 == [1.0, 0.0, 1.0]
    assert prob[1] < 1 / BASE.vocab < 5 * prob[1] < prob[0]
    assert prob[0] == pytest.approx(prob[2], abs=1e-12)


def test_bad_positions_raise():
    with pytest.raises(ValueError, match="positions"):
        one_hot_assignment(BASE, [0, 3])


# ---------------------------------------------------------------- the run and the CLI


@pytest.mark.slow
def test_run_theory_quick_writes_summary_and_figures(tmp_path):
    start = time.perf_counter()
    summary = run_theory(tmp_path, seed=0, quick=True)
    assert time.perf_counter() - start < 30
    on_disk = json.loads((tmp_path / "theory_summary.json").read_text())
    assert on_disk["figures"] == summary["figures"] and len(summary["figures"]) == 4
    for name in summary["figures"]:
        assert (tmp_path / name).stat().st_size > 10_000
    assert abs(summary["loss_check"]["static_eps0"]["z"]) < 3
    assert abs(summary["loss_check"]["gates_eps"]["fast"]["z"]) < 3
    assert summary["theorem1"]["optimal_all_adjacent"] and summary["theorem1"]["optimal_all_distinct"]
    assert summary["theorem2"]["min_pk_all_runs"] > 0.98
    prob = summary["retrieval"]["trained_prob_by_position"]
    assert max(prob) > 4 * min(prob)  # phase dependence at the trained solution
    assert np.isfinite(summary["theorem2"]["final_loss"])


def test_run_theory_rejects_a_file_as_out_dir(tmp_path):
    target = tmp_path / "file"
    target.write_text("")
    with pytest.raises(ValueError, match="--out"):
        run_theory(target, quick=True)


def test_cli_parser_sets_func():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["theory", "--out", "somewhere", "--seed", "3", "--quick"])
    assert (args.out, args.seed, args.quick) == ("somewhere", 3, True) and callable(args.func)
