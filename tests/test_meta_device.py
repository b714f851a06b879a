"""Every model path on the `meta` device: a tensor created without `device=` (a mask, positions, a
cache slot) lands on the CPU and mixing it with meta tensors raises, so a device bug that only a GPU
would show fails here on CPU.

Covered: the training forward and backward, cached prefill + one-token decode + repeated query
rows (the evaluation's multi-query path, through `PhaseKVAdapter`), for every compressor of the
test matrix (attention sink and top-k indexer included).  The evaluation runner and the probes are
not run on meta: they read numbers (argmax, isfinite, accuracies), which meta tensors do not have.
"""

import pytest
import torch
import torch.nn.functional as F

from phasekv.adapters.phasekv import PhaseKVAdapter
from phasekv.cache import KVCache
from phasekv.model import build_model
from tests.helpers import COMPRESSOR_MATRIX, tiny

META = torch.device("meta")


def meta_model(name: str):
    with META:
        return build_model(tiny(**COMPRESSOR_MATRIX[name]))


def test_a_cpu_tensor_mixed_with_meta_raises():
    """The premise of this module: a stray CPU tensor cannot pass silently."""
    with pytest.raises((RuntimeError, ValueError)):
        _ = torch.ones(3) + torch.ones(3, device=META)


@pytest.mark.parametrize("name", COMPRESSOR_MATRIX)
def test_training_step_on_meta(name):
    model = meta_model(name)
    ids = torch.zeros(2, 40, dtype=torch.long, device=META)
    logits = model(ids)
    assert logits.device == META and logits.shape == (2, 40, 64)
    F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    # the indexer gets no language-model gradient (its selection is discrete)
    grads = [p.grad for n, p in model.named_parameters() if ".index_" not in n]
    assert all(g is not None and g.device == META for g in grads)


@pytest.mark.parametrize("name", COMPRESSOR_MATRIX)
def test_cached_prefill_decode_and_query_rows_on_meta(name):
    model = meta_model(name).eval()
    cache = KVCache()
    with torch.no_grad():
        model(torch.zeros(2, 29, dtype=torch.long, device=META), cache=cache)
        for _ in range(3):
            out = model(torch.zeros(2, 1, dtype=torch.long, device=META), cache=cache)
    assert out.device == META and cache.length == 32
    adapter = PhaseKVAdapter(model)
    ctx = adapter.prefill(torch.zeros(2, 30, dtype=torch.long))  # ids come from the CPU, as in run_eval
    logits = adapter.continue_from(ctx, torch.zeros(6, 2, dtype=torch.long), repeats=3)
    assert logits.device == META and logits.shape == (6, 2, 64)
