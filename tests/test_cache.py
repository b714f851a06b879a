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


SHARED_CASES = {**CASES, "sliding-sink": dict(layer_types=["sliding", "full"], attn_sink=True),
                "gated-w8s4-sink-local3": dict(compressor="gated", window=8, stride=4, attn_sink=True, local_window=3)}


@pytest.mark.parametrize("name", sorted(SHARED_CASES))
@pytest.mark.parametrize("prefix, steps", [(20, 1), (21, 3), (17, 9)])
def test_shared_step_equals_a_repeated_copy_and_reads_the_cache_in_place(name, prefix, steps, monkeypatch):
    """Every layer kind and compressor option: query rows continuing a shared cache (the multi-query evaluation's
    step) give the logits of the same rows continued from a repeated copy, for continuations that do and do not
    complete windows; the in-place path (`Attention._shared_step`) runs exactly where `_reads_shared` allows it."""
    from phasekv.attention import Attention

    torch.manual_seed(0)
    model = build_model(tiny(**SHARED_CASES[name])).eval()
    ids = torch.randint(0, 64, (2, prefix + steps))
    calls = []
    original = Attention._shared_step
    monkeypatch.setattr(Attention, "_shared_step", lambda self, *a: calls.append(self.kind) or original(self, *a))
    with torch.no_grad():
        cache = KVCache()
        model(ids[:, :prefix], cache=cache)
        queries = torch.randint(0, 64, (6, steps))  # three different continuations per context
        fast = model(queries, cache=cache.shared(3))
        n_fast = len(calls)
        slow = model(queries, cache=cache.repeat_interleave(3))
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-5)
    layers = [layer.self_attn for layer in model.model.layers]
    shared = [a.kind == "full" or a.tail is None and (a.compressor is None or not (
        a.compressor.head_stagger or a.compressor.selects or a.compressor.kv_source is not None)) for a in layers]
    assert n_fast == sum(shared) and len(calls) == n_fast  # the repeated copy never takes the shared path


@pytest.mark.parametrize("name", sorted(SHARED_CASES))
def test_prefill_fills_the_cache_a_forward_fills(name):
    """`prefill` (no logits, the last layer's keys/values/entries only) leaves the cache a forward leaves,
    tensor for tensor, on a cold and on a warm cache."""
    torch.manual_seed(0)
    model = build_model(tiny(**SHARED_CASES[name])).eval()
    ids = torch.randint(0, 64, (2, 30))
    with torch.no_grad():
        by_forward, by_prefill = KVCache(), KVCache()
        for a, b in ((0, 19), (19, 30)):
            model(ids[:, a:b], cache=by_forward)
            assert model.prefill(ids[:, a:b], by_prefill) is None
            assert by_prefill.length == by_forward.length == b
            for lf, lp in zip(by_forward.layers, by_prefill.layers, strict=True):
                for f in lf.__dataclass_fields__:
                    x, y = getattr(lf, f), getattr(lp, f)
                    if isinstance(x, torch.Tensor):
                        torch.testing.assert_close(y, x, rtol=1e-6, atol=1e-6, msg=f"{name}: {f}")
                    else:
                        assert x == y, f
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.prefill(torch.zeros(1, 600, dtype=torch.long), KVCache())
