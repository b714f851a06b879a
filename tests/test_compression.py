"""Every compressor: fast path == slow reference; no future leakage; entries invisible until complete."""

import pytest
import torch

from phasekv import build_model
from phasekv.compression import available, build, num_windows
from tests.helpers import COMPRESSOR_MATRIX, tiny


def test_every_registered_compressor_is_in_the_matrix():
    covered = {cfg["compressor"] for cfg in COMPRESSOR_MATRIX.values()}
    assert covered == set(available())


@pytest.mark.parametrize("name", sorted(COMPRESSOR_MATRIX))
def test_fast_equals_reference(name):
    torch.manual_seed(0)
    config = tiny(**COMPRESSOR_MATRIX[name])
    comp = build(config, config.compressor)
    with torch.no_grad():
        for p in comp.parameters():  # non-trivial gates and norms
            p.normal_(0, 0.5)
        h = torch.randn(2, 3 * comp.window + comp.stride + 1, config.hidden_size)
        fast_k, fast_v = comp.compress(h)
        ref_k, ref_v = comp.compress_reference(h)
    assert fast_k.shape == (2, num_windows(h.shape[1], comp.window, comp.grid_stride), 2, 16)
    torch.testing.assert_close(fast_k, ref_k, rtol=1e-5, atol=1e-5)
    if comp.tied:
        assert fast_v is None and ref_v is None
    else:
        torch.testing.assert_close(fast_v, ref_v, rtol=1e-5, atol=1e-5)


def test_gate_weights_are_distributions_and_uniform_is_flat():
    torch.manual_seed(0)
    for overrides, flat in ((dict(compressor="gated", gate="vector"), False),
                            (dict(compressor="gated", uniform=True), True)):
        comp = build(tiny(**overrides), "gated")
        alpha = comp.gate_weights(torch.randn(1, 24, 32))
        for a in alpha.values():
            torch.testing.assert_close(a.sum(dim=2), torch.ones_like(a.sum(dim=2)))
            if flat:
                torch.testing.assert_close(a, torch.full_like(a, 1 / 8))


def test_stride_larger_than_window_is_rejected():
    with pytest.raises(ValueError, match="stride"):
        tiny(compressor="gated", window=4, stride=8)
    with pytest.raises(ValueError, match="stride"):
        tiny(compressor="gated", window=4, stride=0)


@pytest.mark.parametrize("name", sorted(COMPRESSOR_MATRIX))
def test_no_future_leakage(name):
    """Changing the token at position p leaves every logit at positions < p unchanged."""
    torch.manual_seed(0)
    config = tiny(**COMPRESSOR_MATRIX[name])
    model = build_model(config).eval()
    W = max(build(config, k).window for k in config.layer_types if k not in ("full", "sliding")) \
        if config.compressed_layers else 8
    T = 3 * W + 3
    ids = torch.randint(0, config.vocab_size, (1, T))
    with torch.no_grad():
        base = model(ids)
        changed = ids.clone().repeat(T, 1)
        for p in range(T):  # row p changes only token p
            changed[p, p] = (ids[0, p] + 1 + p) % config.vocab_size
        out = model(changed)
    for p in range(T):
        torch.testing.assert_close(out[p, :p], base[0, :p], rtol=0, atol=1e-5)
        assert not torch.allclose(out[p, p:], base[0, p:], atol=1e-6)  # the change is seen at p


@pytest.mark.parametrize("stride", [4, 8])
def test_entry_invisible_until_window_complete(stride):
    """With a local window of 1, a query only sees itself and complete entries: the first token
    can influence position t only once the first window (ending at W-1) is complete."""
    torch.manual_seed(0)
    config = tiny(compressor="gated", window=8, stride=stride, local_window=1, num_hidden_layers=1)
    model = build_model(config).eval()
    ids = torch.randint(0, 64, (1, 20))
    other = ids.clone()
    other[0, 0] = (ids[0, 0] + 5) % 64
    with torch.no_grad():
        diff = (model(ids) - model(other)).abs().amax(-1)[0]
    assert torch.all(diff[1:7] == 0)  # window 0 = positions 0..7 not complete before t = 7
    assert torch.all(diff[7:] > 0)


def test_stagger_shifts_each_compressed_layer_windows():
    torch.manual_seed(0)
    config = tiny(compressor="gated", window=4, stride=4, stagger=True, num_hidden_layers=2)
    assert [config.window_offset(i) for i in range(2)] == [0, 2]
    model = build_model(config).eval()
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 15)), cache=cache)
    assert cache.layers[0].entries_end.tolist() == [3, 7, 11]
    assert cache.layers[1].entries_end.tolist() == [5, 9, 13]
    with pytest.raises(ValueError, match="stagger"):
        tiny(compressor="gated", stagger=True, uncompressed_tail=True)


@pytest.mark.parametrize("name", sorted(n for n, o in COMPRESSOR_MATRIX.items() if o.get("compressor") == "gated"))
def test_gated_compression_in_chunks_of_windows_equals_one_pass(name, monkeypatch):
    import phasekv.compression.gated as gated

    torch.manual_seed(0)
    config = tiny(**COMPRESSOR_MATRIX[name])
    comp = build(config, config.compressor)
    with torch.no_grad():
        for p in comp.parameters():
            p.normal_(0, 0.5)
        h = torch.randn(2, 7 * comp.grid_stride + comp.window, config.hidden_size)  # 8 windows
        whole = comp.compress(h)
        monkeypatch.setattr(gated, "COMPRESS_CHUNK", 3)  # 3 + 3 + 2 windows
        chunked = comp.compress(h)
        ref_k, ref_v = comp.compress_reference(h)
    assert chunked[0].shape[1] == 8
    torch.testing.assert_close(chunked[0], whole[0], rtol=0, atol=0)
    torch.testing.assert_close(chunked[0], ref_k, rtol=1e-5, atol=1e-5)
    assert (chunked[1] is None) == (whole[1] is None) == comp.tied
    if not comp.tied:
        torch.testing.assert_close(chunked[1], whole[1], rtol=0, atol=0)
        torch.testing.assert_close(chunked[1], ref_v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("stagger", [False, True])
def test_head_stagger_keeps_each_heads_own_windows(stagger):
    """Each KV head's stored entries are exactly the windows starting at its offsets: the same as compressing
    the layer input on the S-grid shifted to the head's first window start and keeping that head's entries,
    also when the cache is filled in pieces (prefill, then one token at a time)."""
    from phasekv.cache import KVCache
    from phasekv.probes.hooks import attention_inputs

    torch.manual_seed(0)
    config = tiny(compressor="gated", window=8, stride=8, num_attention_heads=8, num_key_value_heads=4,
                  head_stagger=True, stagger=stagger)
    model = build_model(config).eval()
    plain = build(tiny(compressor="gated", window=8, stride=8, num_attention_heads=8, num_key_value_heads=4),
                  "gated")
    ids = torch.randint(0, 64, (2, 45))
    cache = KVCache()
    with torch.no_grad(), attention_inputs(model) as inputs:
        model(ids[:, :13], cache=cache)
        for t in range(13, 45):
            model(ids[:, t:t + 1], cache=cache)
    for i, layer in enumerate(model.model.layers):
        attn, lc = layer.self_attn, cache.layers[i]
        c, x = attn.compressor, torch.cat(inputs[i], dim=1)  # (B, 45, hidden) the layer's input
        plain.load_state_dict(c.state_dict())
        offsets = [c.head_offset(h) for h in range(4)]
        assert sorted(o % 8 for o in offsets) == [o + c.offset % 2 for o in (0, 2, 4, 6)]
        for h, first in enumerate(offsets):
            with torch.no_grad():
                k, v = plain.compress(x[:, first:])  # (B, N, KVH, D) on the head's own S-grid
                starts = first + torch.arange(k.shape[1]) * 8
                k = attn._norm_rope(k[:, :, h:h + 1], "k_norm", starts)  # (B, 1, N, D)
            mine = attn.entry_owners(lc.entries_end) == h
            assert lc.entries_end[mine].tolist() == (starts + 7).tolist()
            torch.testing.assert_close(lc.entries_k[:, :, mine], k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(lc.entries_v[:, :, mine], v[:, :, h:h + 1].transpose(1, 2), rtol=1e-5,
                                       atol=1e-5)
