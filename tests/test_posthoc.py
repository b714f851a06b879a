"""Post-hoc cache compression on tiny random Llama and Qwen3 models: W = S = 1 is full attention,
select:r is full attention with the dropped positions masked, mean and max-norm against plain
references, the attention sink, batch rows kept apart, the input cache left unchanged."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.cache_utils import DynamicCache  # noqa: E402

from phasekv.adapters.hf import HFAdapter  # noqa: E402
from phasekv.conditions.posthoc import PosthocAdapter, compress_cache, parse_policy  # noqa: E402
from tests.helpers import tiny_causal_lm  # noqa: E402

VOCAB, T, Q = 61, 37, 3  # context length, query length


def _tiny(family: str, attention: str = "eager") -> HFAdapter:
    return HFAdapter(tiny_causal_lm(family, VOCAB, 256, attention), f"{family}-{attention}")


@pytest.fixture(scope="module", params=[("llama", "eager"), ("qwen3", "eager"), ("qwen3", "sdpa")], ids="-".join)
def hf(request) -> HFAdapter:
    return _tiny(*request.param)


def _ids(rows: int = 2, length: int = T, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


def _random_cache(rows=2, heads=2, length=T, dim=4, layers=2, seed=0) -> DynamicCache:
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(rows, heads, length, dim, generator=g), torch.randn(rows, heads, length, dim, generator=g))
            for _ in range(layers)]
    return DynamicCache(data)


def _kept_by_select(length, offset, window, stride, local, keep_first) -> list[int]:
    """Plain reference: the raw positions a select:offset cache holds."""
    old, kept = length - local, set(range(min(keep_first, length)))
    j, covered = 0, 0
    while j * stride + window <= old:
        kept.add(j * stride + offset)
        covered = j * stride + window
        j += 1
    kept.update(range(covered, length))
    return sorted(kept)


@pytest.mark.parametrize("policy", ["select:0", "mean", "max-norm", "mean+keep-first:2"])
def test_window_of_one_is_full_attention(hf, policy):
    ids, queries = _ids(), _ids(4, Q, seed=2)
    full = hf.continue_from(hf.prefill(ids), queries, 2)
    post = PosthocAdapter(hf, policy, window=1, stride=1, local_window=4)
    assert torch.allclose(post.continue_from(post.prefill(ids), queries, 2), full, atol=1e-5)


@pytest.mark.parametrize(("offset", "window", "stride", "keep_first"), [(3, 8, 8, 0), (0, 4, 4, 1), (5, 8, 4, 1)])
def test_select_equals_full_attention_with_dropped_positions_masked(hf, offset, window, stride, keep_first):
    ids, queries, local = _ids(), _ids(2, Q, seed=2), 5
    post = PosthocAdapter(hf, f"select:{offset}+keep-first:{keep_first}", window=window, stride=stride,
                          local_window=local)
    got = post.continue_from(post.prefill(ids), queries, 1)

    kept = _kept_by_select(T, offset, window, stride, local, keep_first)
    assert len(kept) < T and post.bytes["compressed"] * T == post.bytes["full"] * len(kept)
    mask = torch.zeros(2, T + Q, dtype=torch.long)
    mask[:, kept] = 1
    mask[:, T:] = 1
    past, _ = hf.prefill(ids)
    positions = torch.arange(T, T + Q).expand(2, -1)
    want = hf.module(input_ids=queries, cache=past, attention_mask=mask, position_ids=positions).logits
    assert torch.allclose(got, want, atol=1e-5)


def test_mean_of_windows_of_two_by_hand():
    cache = _random_cache(length=7)
    out = compress_cache(cache, "mean", window=2, stride=2, local_window=2)
    for src, dst in zip(cache.layers, out.layers, strict=True):
        for a, b in ((src.keys, dst.keys), (src.values, dst.values)):
            # old region [0, 5): windows [0, 2) and [2, 4); position 4 stays raw, 5 and 6 are local
            want = torch.stack([(a[:, :, 0] + a[:, :, 1]) / 2, (a[:, :, 2] + a[:, :, 3]) / 2,
                                a[:, :, 4], a[:, :, 5], a[:, :, 6]], dim=2)
            assert torch.allclose(b, want)


def test_keep_first_keeps_position_zero_and_takes_it_out_of_its_window():
    cache = _random_cache(length=12)
    k = cache.layers[0].keys
    out = compress_cache(cache, "mean+keep-first:1", window=4, stride=4, local_window=4).layers[0].keys
    # sink 0; windows [0, 4) without 0 and [4, 8); local 8..11
    want = torch.stack([k[:, :, 0], k[:, :, 1:4].mean(2), k[:, :, 4:8].mean(2), *k[:, :, 8:].unbind(2)], dim=2)
    assert torch.allclose(out, want)
    sel = compress_cache(cache, "select:1+keep-first:1", window=4, stride=4, local_window=4).layers[0].keys
    assert torch.equal(sel[:, :, :3], k[:, :, [0, 1, 5]])


def test_max_norm_equals_a_loop_and_keeps_batch_rows_apart():
    cache = _random_cache(rows=2, length=20, seed=3)
    out = compress_cache(cache, "max-norm", window=4, stride=2, local_window=3)
    k, v = cache.layers[0].keys, cache.layers[0].values
    got_k, got_v = out.layers[0].keys, out.layers[0].values
    starts = range(0, 17 - 4 + 1, 2)
    for b in range(2):
        for h in range(2):
            for n, s in enumerate(starts):
                best = s + int(k[b, h, s:s + 4].norm(dim=-1).argmax())
                assert torch.equal(got_k[b, h, n], k[b, h, best]) and torch.equal(got_v[b, h, n], v[b, h, best])
    picks = [[int(k[b, 0, s:s + 4].norm(dim=-1).argmax()) for s in starts] for b in range(2)]
    assert picks[0] != picks[1]  # the two rows really chose differently
    assert torch.equal(got_k[:, :, len(starts):], k[:, :, 16:])  # uncovered old position 16 and the local window


@pytest.mark.parametrize("policy", ["max-norm", "mean+keep-first:1"])
def test_batch_rows_are_compressed_independently(hf, policy):
    ids, queries = _ids(2), _ids(2, Q, seed=2)
    post = PosthocAdapter(hf, policy, window=8, stride=8, local_window=4)
    both = post.continue_from(post.prefill(ids), queries, 1)
    for b in range(2):
        one = post.continue_from(post.prefill(ids[b:b + 1]), queries[b:b + 1], 1)
        assert torch.allclose(both[b:b + 1], one, atol=1e-5)


def test_input_cache_is_not_mutated(hf):
    past, _ = hf.prefill(_ids())
    before = [(layer.keys.clone(), layer.values.clone()) for layer in past.layers]
    twin = copy.deepcopy(past)
    out = compress_cache(past, "max-norm+keep-first:1", window=4, stride=4, local_window=4)
    assert out.get_seq_length() < past.get_seq_length() == T
    for (k, v), layer, other in zip(before, past.layers, twin.layers, strict=True):
        assert torch.equal(layer.keys, k) and torch.equal(layer.values, v) and torch.equal(other.keys, k)


def test_adapter_info_and_bytes(hf):
    post = PosthocAdapter(hf, "select:7", window=8, stride=8, local_window=16)
    assert (post.info.stride, post.info.local_window) == (8, 16)
    post.prefill(_ids(1, 64))
    # 64 tokens: old region [0, 48) -> 6 entries, plus 16 raw
    assert post.bytes["compressed"] * 64 == post.bytes["full"] * 22


@pytest.mark.parametrize("bad", ["", "select", "select:8", "select:-1", "median", "mean:2", "mean+keep-first",
                                 "mean+keep-first:x", "mean+sink:1", "mean+keep-first:1+keep-first:2"])
def test_bad_policy_is_a_one_line_error(bad):
    with pytest.raises(ValueError) as err:
        parse_policy(bad, window=8)
    assert "\n" not in str(err.value) and repr(bad) in str(err.value)


@pytest.mark.parametrize(("window", "stride", "local"), [(4, 8, 16), (4, 0, 16), (4, 4, -1)])
def test_bad_geometry_is_a_one_line_error(window, stride, local):
    with pytest.raises(ValueError, match="^[^\n]+$"):
        compress_cache(_random_cache(), "mean", window, stride, local)
