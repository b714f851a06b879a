"""phasekv.archs.indexer_kl: the KL distillation objective of sparse-attention indexers, checked on its own against a
plain loop.  (The hooks on transformers' real DeepSeek-V4, DeepSeek-V3.2 and GLM-5.3 indexers, the dense warm-up
and the training effect: test_realarch.py.)"""

import math

import pytest
import torch

from phasekv import build_model
from phasekv.archs.base import selected_mask
from phasekv.archs.indexer_kl import _pool_mass, dense_selection, distillation, indexers_of, kl_to_attention
from tests.helpers import tiny


def kl_reference(scores: torch.Tensor, used: torch.Tensor, target: torch.Tensor) -> float:
    """mean over query rows with used candidates of KL(p || q), p = target normalized over the used candidates,
    q = softmax of the scores over them; one row at a time."""
    kls = []
    for b in range(scores.shape[0]):
        for s in range(scores.shape[1]):
            idx = [c for c in range(scores.shape[2]) if used[b, s, c]]
            total = sum(float(target[b, s, c]) for c in idx)
            if not idx or total <= 0:
                continue
            norm = math.log(sum(math.exp(float(scores[b, s, c])) for c in idx))
            kl = 0.0
            for c in idx:
                p = float(target[b, s, c]) / total
                if p > 0:
                    kl += p * (math.log(p) - (float(scores[b, s, c]) - norm))
            kls.append(kl)
    return sum(kls) / len(kls)


def test_kl_to_attention_equals_the_loop_on_random_inputs():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 5, 7, generator=gen)
    target = torch.rand(2, 5, 7, generator=gen)
    target[0, 0, 3] = 0.0  # a used candidate without attention mass
    used = torch.rand(2, 5, 7, generator=gen) > 0.4
    used[1, 2] = False  # a query with no used candidate is left out of the mean
    loss = kl_to_attention(scores, used, target)
    assert loss.item() == pytest.approx(kl_reference(scores, used, target), rel=1e-5)


def test_kl_is_zero_when_the_indexer_matches_the_attention_and_reaches_only_the_scores():
    target = torch.tensor([[[0.5, 0.3, 0.2, 7.0]]])
    used = torch.tensor([[[True, True, True, False]]])  # the unused candidate's mass is ignored
    scores = torch.log(torch.tensor([[[0.5, 0.3, 0.2, 1.0]]])).requires_grad_()
    loss = kl_to_attention(scores, used, target.requires_grad_())
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    (kl_to_attention(scores * 0, used, target)).backward()
    assert scores.grad is not None and target.grad is None  # the target is detached
    assert kl_to_attention(scores, torch.zeros_like(used), target).item() == 0.0  # nothing used: zero, finite


def test_selected_indices_become_a_mask_and_minus_one_selects_nothing():
    indices = torch.tensor([[[2, 0, -1], [5, -1, -1]]])  # 5 is out of range: no candidate
    assert selected_mask(indices, 4).tolist() == [[[True, False, True, False], [False, False, False, False]]]


def test_pool_mass_sums_the_attention_of_each_pools_tokens():
    mass = torch.tensor([[[0.1, 0.2, 0.3, 0.4, 0.5]]])  # (B, S, T)
    pools = torch.tensor([[[0, 1], [2, 3], [4, -1]]])  # (B, P, kpool), -1 pads the last pool
    torch.testing.assert_close(_pool_mass(mass, pools), torch.tensor([[[0.3, 0.7, 0.5]]]))
    assert _pool_mass(mass, None) is mass  # token-level candidates


def test_a_model_without_indexers_is_left_alone():
    model = build_model(tiny(compressor="deepseek_csa", csa_block=4, index_topk=2))  # phasekv's own top-k
    assert indexers_of(model) == []
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())
    with distillation(model) as state:
        model(torch.randint(0, 64, (1, 20)))
        assert state.loss() is None
    with dense_selection(model, 20) as changed:
        assert changed == 0
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()) == hooks
