"""Block-wise joint softmax == per-query reference loop; block size does not change results."""

import pytest
import torch

from phasekv import attention, build_model
from phasekv.attention import Visible, tail_start, windowed_attention, windowed_attention_reference
from phasekv.attention import attention_by_parts as by_parts
from phasekv.compression import Selection
from tests.helpers import tiny


@pytest.mark.parametrize("tail", [None, (8, 4), (6, 6)])
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("topk", [0, 2])
@pytest.mark.parametrize("batch, groups, block", [(1, 2, 5), (2, 4, 3), (2, 1, 128)])
@pytest.mark.parametrize("path", ["parts", "blocks"])
def test_windowed_attention_matches_reference(tail, sink, topk, batch, groups, block, path, monkeypatch):
    """Both fast paths: `attention_by_parts` (no autograd, entries on a grid) and the per-block SDPA path
    (autograd recording, or an indexer selection)."""
    if topk and batch > 1:
        pytest.skip("the reference's indexer selection is written for batch 1")
    if topk and path != "blocks":
        pytest.skip("a selection always takes the block path")
    torch.manual_seed(0)
    B, KVH, G, T, D, L, N = batch, 2, groups, 23, 8, 5 if tail is None else 8, 6
    q = torch.randn(B, KVH, G, T, D)
    k_all, v_all = torch.randn(B, KVH, L - 1 + T, D), torch.randn(B, KVH, L - 1 + T, D)
    k_pos = torch.cat([torch.full((L - 1,), -1), torch.arange(T)])
    W, S = tail or (8, 4)
    ends = torch.arange(N) * S + W - 1  # windows consistent with the tail's geometry
    vis = Visible(torch.randn(B, KVH, N, D), torch.randn(B, KVH, N, D), ends,
                  Selection(torch.randn(B, T, N), topk) if topk else None)
    s = torch.randn(KVH * G) * 3 if sink else None
    ref = windowed_attention_reference(q, torch.arange(T), k_all, v_all, k_pos, L, vis, s, tail)
    if path == "blocks":
        q.requires_grad_()
    calls = []
    monkeypatch.setattr(attention, "attention_by_parts", lambda *a: calls.append(1) or by_parts(*a))
    fast = windowed_attention(q, torch.arange(T), k_all, v_all, k_pos, L, vis, s, tail, block=block).detach()
    assert bool(calls) == (path != "blocks")
    # every query reads at least one key (its own token, or the entry that just compressed it): no NaN rows
    assert torch.isfinite(fast).all()
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


def test_sink_is_an_extra_softmax_term():
    """A sink logit s adds exp(s) to the denominator only: one raw key gives v * e^l / (e^l + e^s)."""
    q, k, v = torch.randn(1, 1, 1, 1, 4), torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4)
    sink = torch.tensor([0.7])
    out = windowed_attention(q, torch.tensor([0]), k, v, torch.tensor([0]), 1, Visible(None, None, None), sink,
                             None, block=8)
    logit = (q[0, 0, 0, 0] @ k[0, 0, 0]) / 2
    expected = v[0, 0, 0] * torch.exp(logit) / (torch.exp(logit) + torch.exp(sink))
    torch.testing.assert_close(out[0, 0, 0, 0], expected, rtol=1e-5, atol=1e-6)


def test_tail_start():
    t = torch.arange(20)
    # W=8, S=8: before t=7 nothing is compressed; at t=7 window 0 is complete, tail starts at 8
    assert tail_start(t, 8, 8).tolist() == [0] * 7 + [8] * 8 + [16] * 5
    # W=8, S=4: windows end at 7, 11, 15, 19
    assert tail_start(t, 8, 4)[[6, 7, 10, 11, 19]].tolist() == [0, 8, 8, 12, 20]


@pytest.mark.parametrize("start, T", [(0, 11), (5, 4), (9, 1), (9, 11), (13, 11), (30, 11)])
@pytest.mark.parametrize("sink", [False, True])
def test_attention_by_parts_for_queries_after_a_prefix(start, T, sink):
    """Cached continuation: queries start..start+T-1 (rows cut anywhere), with every complete window's entry in
    the cache as the layer keeps it (one entry in the first two cases)."""
    torch.manual_seed(0)
    B, KVH, G, D, L, W, S = 2, 2, 3, 8, 4, 8, 4
    n_entries = (start + T - 1 - (W - 1)) // S + 1
    q = torch.randn(B, KVH, G, T, D)
    k_all, v_all = torch.randn(B, KVH, L - 1 + T, D), torch.randn(B, KVH, L - 1 + T, D)
    k_pos = torch.arange(start - L + 1, start + T).clamp(min=-1)
    ends = torch.arange(n_entries) * S + W - 1
    vis = Visible(torch.randn(B, KVH, n_entries, D), torch.randn(B, KVH, n_entries, D), ends)
    s = torch.randn(KVH * G) * 3 if sink else None
    q_pos = torch.arange(start, start + T)
    assert attention.regular_entries(vis)
    fast = attention.attention_by_parts(q, q_pos, k_all, v_all, k_pos, L, vis, s, None, 4)
    ref = windowed_attention_reference(q, q_pos, k_all, v_all, k_pos, L, vis, s, None)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


def test_entries_off_one_grid_take_the_block_path():
    ends = torch.tensor([7, 11, 19])
    assert not attention.regular_entries(Visible(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4), ends))
    assert attention.regular_entries(Visible(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4), ends[:2]))


@pytest.mark.parametrize("kwargs", [dict(compressor="gated", window=8, stride=4, attn_sink=True),
                                    dict(compressor="gated", window=6, stride=6, uncompressed_tail=True),
                                    dict(compressor="gated", window=8, stride=8, layer_types=["sliding", "gated"])])
def test_chunked_prefill_equals_one_forward_and_continues_the_cache(kwargs, monkeypatch):
    """Without autograd a long input goes through each sliding/compressed layer in chunks of PREFILL_CHUNK
    positions (cut mid-window here); logits equal the autograd forward's (the block path, one call), and the
    cache it leaves decodes the next tokens like a one-call prefill's."""
    from phasekv.cache import KVCache

    torch.manual_seed(0)
    model = build_model(tiny(**kwargs)).eval()
    ids = torch.randint(0, 64, (2, 45))
    expect = model(ids).detach()  # autograd on: one call per layer
    monkeypatch.setattr(attention, "PREFILL_CHUNK", 7)
    calls = []
    chunked = attention.Attention._chunked_prefill
    monkeypatch.setattr(attention.Attention, "_chunked_prefill", lambda *a: calls.append(1) or chunked(*a))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), expect, rtol=1e-5, atol=1e-5)
        assert calls
        cache = KVCache()
        model(ids[:, :40], cache=cache)
        step = model(ids[:, 40:], cache=cache)
    torch.testing.assert_close(step, expect[:, 40:], rtol=1e-5, atol=1e-5)


def test_query_block_size_does_not_change_logits():
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (2, 50))
    outs = []
    for block in (7, 1024):
        torch.manual_seed(3)
        model = build_model(tiny(compressor="gated", window=8, stride=4, query_block=block)).eval()
        with torch.no_grad():
            outs.append(model(ids))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sink, topk", [(False, 0), (True, 2)])
def test_gradients_over_several_blocks_match_reference(sink, topk):
    """Training runs many query blocks through shared buffers: every input's gradient equals the reference's
    (a buffer rewritten after SDPA saved it would raise or corrupt the backward pass)."""
    torch.manual_seed(1)
    B, KVH, G, T, D, L, N, W, S = 1, 2, 2, 23, 8, 5, 6, 8, 4
    leaves = {"q": torch.randn(B, KVH, G, T, D), "k": torch.randn(B, KVH, L - 1 + T, D),
              "v": torch.randn(B, KVH, L - 1 + T, D), "ek": torch.randn(B, KVH, N, D),
              "ev": torch.randn(B, KVH, N, D), "sink": torch.randn(KVH * G)}
    k_pos = torch.cat([torch.full((L - 1,), -1), torch.arange(T)])
    ends = torch.arange(N) * S + W - 1
    select = Selection(torch.randn(B, T, N), topk) if topk else None
    grads = []
    for fn, kw in ((windowed_attention, {"block": 4}), (windowed_attention_reference, {})):
        x = {name: t.clone().requires_grad_() for name, t in leaves.items()}
        vis = Visible(x["ek"], x["ev"], ends, select)
        out = fn(x["q"], torch.arange(T), x["k"], x["v"], k_pos, L, vis, x["sink"] if sink else None, None, **kw)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append({name: t.grad for name, t in x.items() if t.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == (6 if sink else 5)
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-5)
