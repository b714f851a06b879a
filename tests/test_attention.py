"""Block-wise joint softmax == per-query reference loop; block size does not change results."""

import pytest
import torch

from phasekv import attention, build_model, kernels
from phasekv.compression import Selection
from phasekv.kernels import Visible, tail_start, windowed_attention, windowed_attention_reference
from phasekv.kernels import attention_by_parts as by_parts
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
    _assert_matches_reference(q, k_all, v_all, k_pos, L, vis, torch.randn(KVH * G) * 3 if sink else None, tail, block,
                              path, monkeypatch)


def _assert_matches_reference(q, k_all, v_all, k_pos, L, vis, sink, tail, block, path="blocks", monkeypatch=None):
    """The fast path `path` ("parts": `attention_by_parts`, taken without autograd; "blocks": the per-block
    SDPA path, taken while autograd records) equals the reference, and is the path taken."""
    T = q.shape[3]
    ref = windowed_attention_reference(q, torch.arange(T), k_all, v_all, k_pos, local=L, vis=vis, sink=sink, tail=tail)
    calls = []
    if monkeypatch is not None:
        monkeypatch.setattr(kernels, "attention_by_parts", lambda *a, **kw: calls.append(1) or by_parts(*a, **kw))
        monkeypatch.setattr(kernels, "PARTS_MIN_PAIRS", 0)  # the parts path at any size
    q = q.clone().requires_grad_(path == "blocks")
    fast = windowed_attention(q, torch.arange(T), k_all, v_all, k_pos, local=L, vis=vis, sink=sink, tail=tail,
                              block=block).detach()
    if monkeypatch is not None:
        assert bool(calls) == (path != "blocks")
    # every query reads at least one key (its own token, or the entry that just compressed it): no NaN rows
    assert torch.isfinite(fast).all()
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


def test_sink_is_an_extra_softmax_term():
    """A sink logit s adds exp(s) to the denominator only: one raw key gives v * e^l / (e^l + e^s)."""
    q, k, v = torch.randn(1, 1, 1, 1, 4), torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4)
    sink = torch.tensor([0.7])
    out = windowed_attention(q, torch.tensor([0]), k, v, torch.tensor([0]), local=1, vis=Visible(None, None, None),
                             sink=sink, tail=None, block=8)
    logit = (q[0, 0, 0, 0] @ k[0, 0, 0]) / 2
    expected = v[0, 0, 0] * torch.exp(logit) / (torch.exp(logit) + torch.exp(sink))
    torch.testing.assert_close(out[0, 0, 0, 0], expected, rtol=1e-5, atol=1e-6)


def test_tail_start():
    t = torch.arange(20)
    # W=8, S=8: before t=7 nothing is compressed; at t=7 window 0 is complete, tail starts at 8
    assert tail_start(t, 8, 8).tolist() == [0] * 7 + [8] * 8 + [16] * 5
    # W=8, S=4: windows end at 7, 11, 15, 19
    assert tail_start(t, 8, 4)[[6, 7, 10, 11, 19]].tolist() == [0, 8, 8, 12, 20]


@pytest.mark.parametrize("start, T", [(0, 11), (5, 4), (9, 1), (9, 11), (13, 11), (30, 11), (2, 37)])
@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("entry_rows", [1, 2, 128])
def test_attention_by_parts_for_queries_after_a_prefix(start, T, sink, entry_rows, monkeypatch):
    """Cached continuation: queries start..start+T-1 (rows cut anywhere), with every complete window's entry in
    the cache as the layer keeps it (one entry in the first two cases); entry rows in blocks of 1, 2 (several
    blocks, a partial last one) or 128."""
    monkeypatch.setattr(kernels, "ENTRY_ROWS", entry_rows)
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
    assert kernels.regular_entries(vis)
    fast = kernels.attention_by_parts(q, q_pos, k_all, v_all, k_pos, local=L, vis=vis, sink=s, tail=None, block=4)
    ref = windowed_attention_reference(q, q_pos, k_all, v_all, k_pos, local=L, vis=vis, sink=s, tail=None)
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)


def test_entries_off_one_grid_take_the_block_path():
    ends = torch.tensor([7, 11, 19])
    assert not kernels.regular_entries(Visible(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4), ends))
    assert kernels.regular_entries(Visible(torch.zeros(1, 1, 3, 4), torch.zeros(1, 1, 3, 4), ends[:2]))


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
    monkeypatch.setattr(kernels, "PARTS_MIN_PAIRS", 0)  # the parts path at any size
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


@pytest.mark.parametrize("sink, topk, head_stagger", [(False, 0, False), (True, 2, False), (True, 0, True)])
def test_gradients_over_several_blocks_match_reference(sink, topk, head_stagger):
    """Training runs many query blocks through shared buffers: every input's gradient equals the reference's
    (a buffer rewritten after SDPA saved it would raise or corrupt the backward pass)."""
    torch.manual_seed(1)
    B, KVH, G, T, D, L, N, W, S = 1, 2, 2, 23, 8, 5, 6, 8, 4
    E = 1 if head_stagger else KVH  # head-staggered entries hold one head each, owned in turn
    leaves = {"q": torch.randn(B, KVH, G, T, D), "k": torch.randn(B, KVH, L - 1 + T, D),
              "v": torch.randn(B, KVH, L - 1 + T, D), "ek": torch.randn(B, E, N, D),
              "ev": torch.randn(B, E, N, D), "sink": torch.randn(KVH * G)}
    k_pos = torch.cat([torch.full((L - 1,), -1), torch.arange(T)])
    ends = torch.arange(N) * S + W - 1
    select = Selection(torch.randn(B, T, N), topk) if topk else None
    owner = torch.arange(N) % KVH if head_stagger else None
    grads = []
    for fn, kw in ((windowed_attention, {"block": 4}), (windowed_attention_reference, {})):
        x = {name: t.clone().requires_grad_() for name, t in leaves.items()}
        vis = Visible(x["ek"], x["ev"], ends, select, owner)
        out = fn(x["q"], torch.arange(T), x["k"], x["v"], k_pos, local=L, vis=vis, sink=x["sink"] if sink else None,
                 tail=None, **kw)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads.append({name: t.grad for name, t in x.items() if t.grad is not None})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) == (6 if sink else 5)
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-5)


def _head_staggered_inputs(B, KVH, G, T, D, L, N, step, W):
    """Random queries, raw keys and N one-head entries (B, 1, N, D) every `step` tokens, owned in turn by the
    KV heads (as a head-staggered layer stores them)."""
    q = torch.randn(B, KVH, G, T, D)
    k_all, v_all = torch.randn(B, KVH, L - 1 + T, D), torch.randn(B, KVH, L - 1 + T, D)
    k_pos = torch.cat([torch.full((L - 1,), -1), torch.arange(T)])
    owner = (torch.arange(N) % KVH).to(torch.int16)
    vis = Visible(torch.randn(B, 1, N, D), torch.randn(B, 1, N, D), torch.arange(N) * step + W - 1,
                  entries_owner=owner)
    return q, k_all, v_all, k_pos, vis


@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("batch, kv_heads, groups, block", [(1, 2, 2, 5), (2, 4, 1, 3), (2, 2, 3, 128)])
def test_head_staggered_entries_match_reference(sink, batch, kv_heads, groups, block):
    torch.manual_seed(0)
    B, KVH, G, T, D, L, N, W = batch, kv_heads, groups, 23, 8, 5, 8, 8
    q, k_all, v_all, k_pos, vis = _head_staggered_inputs(B, KVH, G, T, D, L, N, 8 // KVH, W)
    _assert_matches_reference(q, k_all, v_all, k_pos, L, vis, torch.randn(KVH * G) * 3 if sink else None, None, block)


def test_head_staggered_entry_is_read_by_its_owner_only():
    """Changing the entries of KV head 0 changes the outputs of its query heads after the first entry is
    complete, and never the outputs of KV head 1's query heads."""
    torch.manual_seed(0)
    B, KVH, G, T, D, L, N, W = 1, 2, 2, 23, 8, 5, 8, 8
    q, k_all, v_all, k_pos, vis = _head_staggered_inputs(B, KVH, G, T, D, L, N, 4, W)
    base = windowed_attention(q, torch.arange(T), k_all, v_all, k_pos, local=L, vis=vis, sink=None, tail=None, block=4)
    mine = vis.entries_owner == 0
    changed = Visible(vis.entries_k + 3 * mine.view(1, 1, N, 1), vis.entries_v - 2 * mine.view(1, 1, N, 1),
                      vis.entries_end, entries_owner=vis.entries_owner)
    out = windowed_attention(q, torch.arange(T), k_all, v_all, k_pos, local=L, vis=changed, sink=None, tail=None,
                             block=4)
    torch.testing.assert_close(out[:, 1], base[:, 1], rtol=0, atol=0)
    first = int(vis.entries_end[0])
    assert torch.equal(out[:, 0, :, :first], base[:, 0, :, :first])
    assert (out[:, 0, :, first:] - base[:, 0, :, first:]).abs().amax(dim=-1).min() > 1e-4
