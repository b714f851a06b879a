"""Prefill + token-by-token decode == one full forward; cache bytes scale like (L + T/S) / T."""

import pytest
import torch

from phasekv import build_model
from phasekv.cache import KVCache
from tests.helpers import COMPRESSOR_MATRIX, tiny

CASES = {"full": dict(), "sliding": dict(layer_types=["sliding", "full"]), **COMPRESSOR_MATRIX}


@pytest.mark.parametrize("name", sorted(CASES))
def test_prefill_then_decode_equals_full_forward(name):
    torch.manual_seed(0)
    model = build_model(tiny(**CASES[name])).eval()
    ids = torch.randint(0, 64, (2, 41))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache()
        pieces = [model(ids[:, :13], cache=cache)]
        pieces += [model(ids[:, t:t + 1], cache=cache) for t in range(13, 30)]
        pieces.append(model(ids[:, 30:], cache=cache))  # a multi-token chunk on a warm cache
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 41


def test_cache_copy_is_independent():
    torch.manual_seed(0)
    model = build_model(tiny(compressor="gated", window=4, stride=4)).eval()
    ids = torch.randint(0, 64, (1, 21))
    with torch.no_grad():
        cache = KVCache()
        model(ids[:, :20], cache=cache)
        fork = cache.copy()
        a = model(ids[:, 20:], cache=fork)
        b = model(ids[:, 20:], cache=cache.copy())
        many = model(ids[:, 20:].repeat(3, 1), cache=cache.repeat_interleave(3))
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(many, a.repeat(3, 1, 1))
    assert cache.length == 20
    with torch.no_grad():  # two contexts, each continued twice, context-major order
        pair = KVCache()
        model(ids[:, :20].repeat(2, 1), cache=pair)
        rows = model(ids[:, 20:].repeat(4, 1), cache=pair.repeat_interleave(2))
    torch.testing.assert_close(rows, a.repeat(4, 1, 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layers", [dict(compressor="gated", window=4, stride=4),
                                    dict(layer_types=["full", "sliding"])])
def test_shared_cache_is_read_in_place_and_equals_a_repeated_copy(layers):
    torch.manual_seed(0)
    model = build_model(tiny(**layers)).eval()
    ids = torch.randint(0, 64, (2, 23))
    with torch.no_grad():
        cache = KVCache()
        model(ids[:, :20], cache=cache)
        before = [(t.data_ptr(), t.clone()) for lc in cache.layers for t in lc.tensors()]
        shared = cache.shared(3)
        assert [t.data_ptr() for lc in shared.layers for t in lc.tensors()] == [p for p, _ in before]
        queries = ids[:, 20:].repeat_interleave(3, dim=0)  # (6, 3): context-major rows
        fast = model(queries, cache=shared)
        slow = model(queries, cache=cache.repeat_interleave(3))
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    for (ptr, value), t in zip(before, [t for lc in cache.layers for t in lc.tensors()], strict=True):
        assert t.data_ptr() == ptr and torch.equal(t, value)  # the shared cache was never written


@pytest.mark.parametrize("window, stride", [(8, 8), (8, 4)])
def test_cache_bytes_follow_local_window_plus_entries(window, stride):
    torch.manual_seed(0)
    T, L = 1024, 16
    kw = dict(local_window=L, max_position_embeddings=T)
    sizes = {}
    for name, extra in (("full", dict()), ("comp", dict(compressor="gated", window=window, stride=stride))):
        model = build_model(tiny(**kw, **extra)).eval()
        cache = KVCache()
        with torch.no_grad():
            model(torch.randint(0, 64, (1, T)), cache=cache)
        sizes[name] = cache.nbytes()
    expected = (L + T / stride) / T
    assert sizes["comp"] / sizes["full"] == pytest.approx(expected, rel=0.15)


@pytest.mark.parametrize("stagger", [False, True])
def test_head_stagger_keeps_the_cache_bytes_per_token(stagger):
    """A head-staggered layer stores one KV head's entry every S / KVH tokens: after a long prefill its cache
    holds the baseline's bytes per token within the fixes' 5% (the 4-KV-head W8/S8 geometry of the presets)."""
    from phasekv.report.findings import BYTES_TOLERANCE

    torch.manual_seed(0)
    T, kw = 504, dict(hidden_size=128, num_attention_heads=8, num_key_value_heads=4, head_dim=32, local_window=16,
                      compressor="gated", window=8, stride=8)
    sizes, entries = {}, {}
    for name, extra in (("base", dict()), ("heads", dict(head_stagger=True, stagger=stagger))):
        model = build_model(tiny(**kw, **extra)).eval()
        cache = KVCache()
        with torch.no_grad():
            model(torch.randint(0, 64, (1, T)), cache=cache)
        sizes[name] = cache.nbytes() / T
        entries[name] = [lc.entries_k.shape for lc in cache.layers]
    assert all(shape[1] == 1 for shape in entries["heads"])  # one KV head per stored entry
    assert sizes["heads"] / sizes["base"] == pytest.approx(1, abs=BYTES_TOLERANCE)
