"""kvpress presses on tiny random Llama and Qwen3 models (sdpa attention).

For every press offered, the positions it keeps (read from the compressed cache) are checked against the
press's documented rule, reimplemented here from the prefilled queries, keys and values; the next-token
logits after the press equal attention over exactly the kept positions (the full cache with every other
position masked, per layer and KV head); batched contexts give the results of one context at a time;
without the compatibility layer the presses fail on transformers 5.24; the model is restored after a press,
also after a press that raised.  Spec parsing needs no kvpress and is tested without it.
"""

import importlib.util
import math
from contextlib import contextmanager

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from phasekv.adapters.hf import HFAdapter  # noqa: E402
from phasekv.conditions import presses  # noqa: E402
from phasekv.conditions.presses import PressAdapter, parse_press  # noqa: E402
from tests.helpers import SMOL, SMOL_FILE, needs_real, needs_real_model, tiny_causal_lm  # noqa: E402

needs_kvpress = needs_real(importlib.util.find_spec("kvpress") is not None, "kvpress not installed (make kvpress)")

VOCAB, T, Q = 61, 48, 3  # context length (a multiple of the chunks below), query length
RATIO = 0.5
SPECS = [
    "knorm", "knorm:ratio=0.75", "snapkv:window=8,kernel=3", "snapkv:window=8", "streaming:sinks=4",
    "expected-attention", "tova", "keydiff", "chunkkv:press=knorm,ratio=0.5,chunk=8",
    "chunkkv:press=snapkv,window=8,kernel=3,chunk=8", "chunk:press=knorm,chunk=8", "chunk:press=keydiff,chunk=16",
    "block:press=knorm,block=8", "block:press=keydiff,block=8",
]


def _tiny(family: str) -> HFAdapter:
    return HFAdapter(tiny_causal_lm(family, VOCAB, 1024, "sdpa").eval(), family)


def _ids(rows: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


@contextmanager
def _sdpa_replaced(function):
    """Every sdpa attention call goes to `function(original, module, query, key, value, ...)` inside the block."""
    original = ALL_ATTENTION_FUNCTIONS["sdpa"]
    ALL_ATTENTION_FUNCTIONS["sdpa"] = lambda *args, **kwargs: function(original, *args, **kwargs)
    try:
        yield
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = original


def _prefill_recorded(hf: HFAdapter, ids: torch.Tensor):
    """The full cache of `ids` and each layer's queries after RoPE, (B, H, T, D), as attention received them."""
    queries = {}

    def record(original, module, query, *args, **kwargs):
        queries[module.layer_idx] = query.detach().clone()
        return original(module, query, *args, **kwargs)

    with _sdpa_replaced(record):
        past, _ = hf.prefill(ids)
    return past, queries


class Case:
    """One family's model, contexts, their full cache and recorded queries."""

    def __init__(self, family: str, rows: int = 2, length: int = T, seed: int = 1):
        self.hf = _tiny(family)
        self.ids = _ids(rows, length, seed)
        self.full, self.queries = _prefill_recorded(self.hf, self.ids)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def case(request) -> Case:
    return Case(request.param)


def _kept(caches, full, layer: int) -> list[torch.Tensor]:
    """Per context row: the position of every entry of the compressed cache, (H, T'), found by comparing it
    with the full cache entry by entry; each entry's key and value must be a copy of exactly one position's."""
    out = []
    for past in caches:
        small_k, small_v = past.layers[layer].keys, past.layers[layer].values
        for r in range(small_k.shape[0]):
            k, v = full.layers[layer].keys[len(out)], full.layers[layer].values[len(out)]  # (H, T, D)
            same = (small_k[r][:, :, None] == k[:, None]).all(-1)  # (H, T', T)
            assert (same.sum(-1) == 1).all(), "an entry is not a copy of exactly one prefilled key"
            index = same.float().argmax(-1)  # (H, T')
            assert torch.equal(v.gather(1, index[..., None].expand_as(small_v[r])), small_v[r])
            out.append(index)
    return out


# --- the presses' documented rules, from the prefilled queries q (Hq, T, D), keys k and values v (Hkv, T, D) of
# one context row; a score (Hkv, T) ranks the positions (higher is kept), forced positions score max + 1


def _forced(scores: torch.Tensor, positions) -> torch.Tensor:
    scores = scores.clone()
    scores[:, positions] = scores.max() + 1
    return scores


def _knorm(q, k, v, values):
    return -k.norm(dim=-1)  # KnormPress: the lowest key norms are kept


def _keydiff(q, k, v, values):
    anchor = (k / k.norm(dim=-1, keepdim=True)).mean(1, keepdim=True)  # KeyDiff: the mean unit key
    return -(k * anchor).sum(-1) / (k.norm(dim=-1) * anchor.norm(dim=-1))  # least similar kept


def _streaming(q, k, v, values):
    sinks = values["sinks"]  # StreamingLLM: the sinks and the most recent tokens
    return _forced(torch.arange(k.shape[1], dtype=torch.float).expand(k.shape[0], -1), list(range(sinks)))


def _window_attention(q, k, window):
    """Attention probabilities (Hq, window, T) of the last `window` queries over all keys, causal."""
    length, group = k.shape[1], q.shape[0] // k.shape[0]
    keys = k.repeat_interleave(group, 0)  # (Hq, T, D)
    logits = q[:, -window:] @ keys.transpose(1, 2) / math.sqrt(q.shape[-1])
    query_position = torch.arange(length - window, length)[:, None]
    logits = logits.masked_fill(torch.arange(length)[None] > query_position, float("-inf"))
    return logits.softmax(-1)


def _snapkv(q, k, v, values):
    """SnapKV: the observation window's (last `window` queries') mean attention to each older position,
    averaged over a `kernel`-wide neighbourhood (zero beyond the ends) and over a KV head's query heads; the
    window itself is always kept."""
    window, kernel, length = values["window"], values["kernel"], k.shape[1]
    attention = _window_attention(q, k, window)[:, :, :length - window].mean(1)  # (Hq, T - w)
    pooled = torch.zeros_like(attention)
    for j in range(length - window):
        for o in range(-(kernel // 2), kernel // 2 + 1):
            if 0 <= j + o < length - window:
                pooled[:, j] += attention[:, j + o] / kernel
    group = q.shape[0] // k.shape[0]
    scores = torch.cat([pooled.view(k.shape[0], group, -1).mean(1), torch.zeros(k.shape[0], window)], 1)
    return _forced(scores, list(range(length - window, length)))


def _tova(q, k, v, values):
    """TOVA: the last token's attention, averaged over all query heads; the last token is kept."""
    length = k.shape[1]
    attention = _window_attention(q, k, 1)[:, 0, :length - 1].mean(0)  # (T - 1,)
    scores = torch.cat([attention, torch.zeros(1)]).expand(k.shape[0], -1)
    return _forced(scores, [length - 1])


def _rotation(inv_freq: torch.Tensor, position: int) -> torch.Tensor:
    """RoPE at `position` as a (D, D) matrix, transformers' half-split layout: dimension i pairs with i + D/2."""
    half = inv_freq.shape[0]
    cos, sin = torch.cos(position * inv_freq.double()), torch.sin(position * inv_freq.double())
    rotation = torch.zeros(2 * half, 2 * half, dtype=torch.float64)
    i = torch.arange(half)
    rotation[i, i], rotation[i, i + half], rotation[i + half, i], rotation[i + half, i + half] = cos, -sin, sin, cos
    return rotation


def _expected_attention(q, k, v, values, inv_freq):
    """ExpectedAttention: the mean and covariance of the queries before RoPE (sinks left out), rotated by RoPE
    averaged over the next `future` positions, give an expected attention logit per key, mean . k / sqrt(d)
    + k^T cov k / (2 d); its softmax over the non-sink keys, averaged over a KV head's query heads, times
    the value norm.  The sinks are kept."""
    sinks, future, (heads, length, dim) = values["sinks"], values["future"], q.shape
    unrotated = torch.stack([_rotation(inv_freq, p).T @ q[:, p].double().T for p in range(length)], 1)  # (D, T, H)
    unrotated = unrotated.permute(2, 1, 0)[:, sinks:]  # (Hq, T - s, D)
    mean = unrotated.mean(1)  # (Hq, D)
    centred = unrotated - mean[:, None]
    cov = centred.transpose(1, 2) @ centred / centred.shape[1]  # (Hq, D, D)
    rotation = torch.stack([_rotation(inv_freq, p) for p in range(length, length + future)]).mean(0)
    mean, cov = mean @ rotation.T, rotation @ cov @ rotation.T
    keys = k.double().repeat_interleave(heads // k.shape[0], 0)[:, sinks:]  # (Hq, T - s, D)
    logits = (keys @ mean[:, :, None])[..., 0] / math.sqrt(dim) + ((keys @ cov) * keys).sum(-1) / dim / 2
    scores = logits.softmax(-1).view(k.shape[0], heads // k.shape[0], -1).mean(1) * v[:, sinks:].norm(dim=-1)
    return _forced(torch.cat([torch.zeros(k.shape[0], sinks), scores.float()], 1), list(range(sinks)))


SCORERS = {"knorm": _knorm, "keydiff": _keydiff, "streaming": _streaming, "snapkv": _snapkv, "tova": _tova,
           "expected-attention": _expected_attention}


def _assert_top(kept: torch.Tensor, scores: torch.Tensor, n: int) -> None:
    """`kept` (n,) are n positions of highest `scores` (T,), up to float ties at the cut."""
    assert kept.shape[0] == n == len(set(kept.tolist()))
    mask = torch.zeros(scores.shape[0], dtype=torch.bool)
    mask[kept] = True
    if (~mask).any():
        tolerance = 1e-5 * scores.abs().max()
        assert scores[mask].min() >= scores[~mask].max() - tolerance


def _check_rule(spec: str, q, k, v, kept: torch.Tensor, inv_freq) -> None:
    """The kept positions (Hkv, T') of one row and layer obey the press's rule."""
    parsed = parse_press(spec)
    values, length, ratio = parsed.values, k.shape[1], parsed.values["ratio"]
    score = SCORERS[parsed.scorer]
    if parsed.scorer == "expected-attention":
        score = lambda q_, k_, v_, values_: _expected_attention(q_, k_, v_, values_, inv_freq)  # noqa: E731
    n_kept = max(1, int(length * (1 - ratio)))
    if parsed.name == "chunkkv":
        # whole chunks of the grid j * L, the same for every head, ranked by the inner score summed over
        # heads and averaged over the chunk (kvpress 0.5.5 scores a partial last chunk by its mean too)
        size = values["chunk"]
        summed = score(q, k, v, values).sum(0)  # (T,)
        chunks = [list(range(s, min(s + size, length))) for s in range(0, length, size)]
        kept_set = set(kept[0].tolist())
        assert all(set(h.tolist()) == kept_set for h in kept), "ChunkKV keeps the same positions in every head"
        picked = [c for c in chunks if c[0] in kept_set]
        assert all(set(c) <= kept_set for c in picked) and sum(map(len, picked)) == len(kept_set)
        chunk_scores = torch.stack([summed[c].mean() for c in chunks])
        _assert_top(torch.tensor([chunks.index(c) for c in picked]), chunk_scores,
                    max(1, int(len(chunks) * (1 - ratio))))
    elif parsed.name == "chunk":
        # FINCH-style: each chunk of the grid j * L keeps its own top share, scored on the chunk alone
        size = values["chunk"]
        for start in range(0, length, size):
            end = min(start + size, length)
            scores = score(q[:, start:end], k[:, start:end], v[:, start:end], values)
            for h in range(k.shape[0]):
                inside = kept[h][(kept[h] >= start) & (kept[h] < end)] - start
                _assert_top(inside, scores[h], max(1, int((end - start) * (1 - ratio))))
    elif parsed.name == "block":
        # KeyDiff's block-wise eviction: start from the first n_kept positions, then for each next block of
        # positions keep the n_kept best of (kept so far + block), scored on that candidate set alone
        size = values["block"]
        for h in range(k.shape[0]):
            current = list(range(n_kept))
            for start in range(n_kept, length, size):
                candidates = current + list(range(start, min(start + size, length)))
                scores = score(q, k[h:h + 1, candidates], v[h:h + 1, candidates], values)[0]
                current = [candidates[i] for i in scores.topk(n_kept).indices.tolist()]
            assert set(kept[h].tolist()) == set(current)
    else:
        scores = score(q, k, v, values)
        n = int(length * (1 - ratio)) if parsed.name == "streaming" else n_kept
        for h in range(k.shape[0]):
            _assert_top(kept[h], scores[h], n)


def _check_all_rules(case: Case, spec: str, caches) -> None:
    inv_freq = case.hf.module.model.rotary_emb.inv_freq
    assert case.hf.module.model.rotary_emb.attention_scaling == 1.0  # _rotation is plain RoPE
    for layer in range(len(case.full.layers)):
        for row, kept in enumerate(_kept(caches, case.full, layer)):
            q = case.queries[layer][row]
            k, v = case.full.layers[layer].keys[row], case.full.layers[layer].values[row]
            assert kept.shape[1] < k.shape[1]  # the press compressed
            _check_rule(spec, q, k, v, kept, inv_freq)


@needs_kvpress
@pytest.mark.parametrize("spec", SPECS)
def test_kept_positions_follow_the_documented_rule(case, spec):
    press = PressAdapter(case.hf, spec, stride=8)
    caches, length = press.prefill(case.ids)
    assert length == T and press.rows_separately == spec.startswith("chunkkv")
    _check_all_rules(case, spec, caches)


@needs_kvpress
@pytest.mark.parametrize("spec", ["chunkkv:press=knorm,ratio=0.5,chunk=8", "chunkkv:press=knorm,ratio=0.75,chunk=10"])
def test_chunkkv_on_a_length_that_is_not_a_multiple_of_the_chunk(spec):
    # 45 = 5 * 8 + 5 = 4 * 10 + 5: a partial last chunk, scored by its mean; no padding happens
    case = Case("llama", rows=3, length=45, seed=4)
    press = PressAdapter(case.hf, spec, stride=8)
    caches, length = press.prefill(case.ids)
    assert length == 45
    _check_all_rules(case, spec, caches)


def _masked_attention(masks: dict[int, torch.Tensor]):
    """Attention of the query tokens over the full cache with only `masks[layer]` (B, Hkv, T) of the context
    positions visible (the query tokens see each other causally), written out plainly."""
    def attention(original, module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        rows, heads, t, dim = query.shape
        group, total = heads // key.shape[1], key.shape[2]
        visible = torch.ones(rows, key.shape[1], t, total, dtype=torch.bool)
        visible[..., :total - t] = masks[module.layer_idx][:, :, None]
        visible[..., total - t:] = torch.tril(torch.ones(t, t, dtype=torch.bool))
        visible = visible.repeat_interleave(group, 1)  # (B, Hq, t, T + t): query head h reads KV head h // group
        logits = query @ key.repeat_interleave(group, 1).transpose(2, 3) * (scaling or dim ** -0.5)
        out = logits.masked_fill(~visible, float("-inf")).softmax(-1) @ value.repeat_interleave(group, 1)
        return out.transpose(1, 2).contiguous(), None
    return attention


def _masks(caches, full) -> dict[int, torch.Tensor]:
    masks = {}
    for layer in range(len(full.layers)):
        kept = _kept(caches, full, layer)
        mask = torch.zeros(full.layers[layer].keys.shape[:3], dtype=torch.bool)  # (B, Hkv, T)
        for row, index in enumerate(kept):
            mask[row].scatter_(1, index, True)
        masks[layer] = mask
    return masks


@needs_kvpress
@pytest.mark.parametrize("spec", SPECS)
def test_logits_after_a_press_are_attention_over_exactly_the_kept_positions(case, spec):
    press = PressAdapter(case.hf, spec, stride=8)
    cache = press.prefill(case.ids)
    queries = _ids(case.ids.shape[0], Q, seed=2)
    got = press.continue_from(cache, queries, 1)
    with _sdpa_replaced(_masked_attention(_masks(cache[0], case.full))):
        want = case.hf.continue_by_copies((case.full, T), queries, 1)  # one query per row, as the mask is written
    full = case.hf.continue_from((case.full, T), queries, 1)
    assert (got - full).abs().max() > 1e-4  # the press changed the logits
    assert torch.allclose(got, want, atol=2e-5), (got - want).abs().max()


@needs_kvpress
def test_a_cache_whose_layers_kept_different_lengths_is_continued_token_by_token():
    case = Case("llama", rows=3, length=45, seed=4)
    press = PressAdapter(case.hf, "chunkkv:press=knorm,ratio=0.5,chunk=8", stride=8)
    caches, _ = press.prefill(case.ids)
    lengths = [{layer.get_seq_length() for layer in past.layers} for past in caches]
    assert any(len(s) > 1 for s in lengths)  # this case exercises the token-by-token path
    queries = _ids(6, Q, seed=2)
    with pytest.raises(RuntimeError):  # the one-mask path cannot continue such a cache
        case.hf.continue_from((caches[lengths.index(max(lengths, key=len))], 45), queries[:2], 2)
    got = press.continue_from((caches, 45), queries, 2)
    with _sdpa_replaced(_masked_attention({layer: m.repeat_interleave(2, 0) for layer, m in
                                           _masks(caches, case.full).items()})):
        want = case.hf.continue_by_copies((case.full, 45), queries, 2)
    assert torch.allclose(got, want, atol=2e-5)
    # and on a cache whose layers agree, token by token equals the one-mask continuation
    knorm = PressAdapter(case.hf, "knorm", stride=8)
    (past,), _ = knorm.prefill(case.ids)
    assert torch.allclose(knorm.stepwise(past, 45, queries, 2), case.hf.continue_from((past, 45), queries, 2),
                          atol=2e-5)


@needs_kvpress
@pytest.mark.parametrize("spec", SPECS)
def test_batched_contexts_give_the_results_of_one_context_at_a_time(spec):
    case = Case("qwen3", rows=3, seed=5)
    press = PressAdapter(case.hf, spec, stride=8)
    queries = _ids(6, Q, seed=6)
    batched = press.prefill(case.ids)
    together = press.continue_from(batched, queries, 2)
    for row in range(3):
        alone = press.prefill(case.ids[row:row + 1])
        assert torch.allclose(press.continue_from(alone, queries[2 * row:2 * row + 2], 2),
                              together[2 * row:2 * row + 2], atol=2e-5)
        single = Case.__new__(Case)
        single.full = case.hf.prefill(case.ids[row:row + 1])[0]
        for layer in range(2):
            got = _kept(batched[0], case.full, layer)[row]
            assert torch.equal(got.sort(-1).values, _kept(alone[0], single.full, layer)[0].sort(-1).values)


@needs_kvpress
def test_kvpress_chunkkv_applies_row_zeros_chunks_to_every_row():
    """Why chunkkv prefills row by row: kvpress 0.5.5 itself, on a batch, gives every row row 0's chunks."""
    case = Case("llama", rows=2, seed=7)
    spec = parse_press("chunkkv:press=knorm,ratio=0.5,chunk=8")
    with presses.pressed(spec.build(), case.hf.module, case.hf.attention_layers()):
        raw, _ = case.hf.prefill(case.ids)
    own = PressAdapter(case.hf, spec).prefill(case.ids)[0]
    row0, row1 = (_kept(own, case.full, 0)[r][0].sort().values for r in (0, 1))
    assert not torch.equal(row0, row1)  # the rows' own chunks differ
    leaked = _kept([raw], case.full, 0)[1][0].sort().values
    assert torch.equal(leaked, row0)


@needs_kvpress
def test_kept_positions_reads_the_cache_like_entry_by_entry_comparison(case):
    press = PressAdapter(case.hf, "knorm", stride=8)
    (past,), _ = press.prefill(case.ids)
    for layer in range(2):
        got = presses.kept_positions(case.full.layers[layer].keys, past.layers[layer].keys)
        assert torch.equal(got, torch.stack(_kept([past], case.full, layer)))
    with pytest.raises(ValueError, match="not a copy"):
        presses.kept_positions(case.full.layers[0].keys, past.layers[0].keys + 1e-3)


@needs_kvpress
def test_kept_statistics_and_cache_bytes():
    case = Case("llama", rows=2, seed=8)
    press = PressAdapter(case.hf, "streaming:sinks=4", stride=8)
    press.prefill(case.ids)
    # 24 of 48 kept: positions 0-3 and 28-47; positions of phase r: r, r + 8, ..., six of them
    want = [(int(r < 4) + sum(p >= 28 for p in range(r, 48, 8))) / 6 for r in range(8)]
    kept = press.kept()
    assert kept["period"] == 8 and kept["fraction"] == 0.5 and kept["fraction_by_phase"] == pytest.approx(want)
    assert press.bytes["compressed"] * 2 == press.bytes["full"] > 0


@needs_kvpress
def test_the_presses_fail_without_the_compatibility_layer(monkeypatch):
    hf = _tiny("llama")
    ids = _ids(1, T, seed=1)
    # kvpress's own way of applying a press, on transformers 5.24: its hook reads the renamed keywords
    press = parse_press("knorm").build()
    with pytest.raises(KeyError, match="past_key_values"), press(hf.module):
        hf.prefill(ids)
    for layer in hf.attention_layers():
        del layer.rotary_emb  # kvpress leaves it attached
    # phasekv's context manager with its keyword translation taken out
    monkeypatch.setattr(presses, "_kvpress_kwargs", lambda module, kwargs, cache: kwargs)
    with pytest.raises(KeyError, match="past_key_values"):
        PressAdapter(hf, "knorm").prefill(ids)
    monkeypatch.setattr(presses, "_kvpress_kwargs", lambda module, kwargs, cache: {**kwargs, "past_key_values":
                                                                                   cache})
    with pytest.raises(KeyError, match="cache_position"):
        PressAdapter(hf, "knorm").prefill(ids)


def _model_state(hf: HFAdapter):
    module = hf.module
    return ([name for name, _ in module.named_modules()],
            sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules()),
            {k: v.clone() for k, v in module.state_dict().items()})


@needs_kvpress
@pytest.mark.parametrize("spec, message", [
    ("snapkv:window=64", "Query length 48 should be greater than the window size 64"),
    ("expected-attention:sinks=60", "more tokens than n_sink=60"),
    ("knorm", None),
])
def test_the_model_is_restored_after_a_press_also_one_that_raises(spec, message):
    hf = _tiny("qwen3")
    ids = _ids(2, T, seed=1)
    before, (cache, _) = _model_state(hf), hf.prefill(ids)
    press = PressAdapter(hf, spec)
    if message:
        with pytest.raises(ValueError, match=message) as error:
            press.prefill(ids)
        assert len(str(error.value).splitlines()) == 1
    else:
        press.prefill(ids)
    after = _model_state(hf)
    assert after[:2] == before[:2] and before[1] == 0
    assert all(torch.equal(after[2][k], v) for k, v in before[2].items())
    assert not any(hasattr(layer, "rotary_emb") for layer in hf.attention_layers())
    again, _ = hf.prefill(ids)  # an ordinary prefill afterwards is the uncompressed one
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(again.layers, cache.layers))


@needs_kvpress
def test_eager_attention_for_a_chunk_press_and_unverified_models_are_refused():
    hf = _tiny("llama")
    hf.module.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="eager attention"):
        PressAdapter(hf, "chunkkv:chunk=8")
    with pytest.raises(ValueError, match="multi-query"):
        PressAdapter(_tiny("llama"), "knorm").logits(_ids(1, 4, seed=0))
    def mistral(window):
        return HFAdapter(transformers.MistralForCausalLM(transformers.MistralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, sliding_window=window)), "mistral")
    with pytest.raises(ValueError, match="MistralForCausalLM is not a model presses are verified on"):
        PressAdapter(mistral(None), "knorm")
    # with its sliding window on, every layer bounds its own window: nothing for a press to compress
    with pytest.raises(ValueError, match="MistralForCausalLM has no full-attention layer"):
        PressAdapter(mistral(16), "knorm")


# --- parsing and the install step: no kvpress needed


def test_specs_parse_with_defaults_filled_in():
    spec = parse_press("chunkkv:press=snapkv,ratio=0.75,chunk=8")
    assert (spec.name, spec.scorer) == ("chunkkv", "snapkv")
    assert spec.values == {"chunk": 8, "ratio": 0.75, "window": 64, "kernel": 5}
    assert parse_press("block").values == {"block": 128, "ratio": 0.5} and parse_press("block").scorer == "knorm"
    assert parse_press("streaming:sinks=0").values == {"ratio": 0.5, "sinks": 0}
    assert parse_press("expected-attention:future=16").values == {"ratio": 0.5, "sinks": 4, "future": 16}


@pytest.mark.parametrize("text, message", [
    ("squash", "unknown press 'squash' (allowed: knorm, snapkv"),
    ("knorm:rate=0.5", "unknown key 'rate' for knorm (allowed: ratio)"),
    ("knorm:press=snapkv", "unknown key 'press'"),
    ("chunkkv:press=block", "press=block is not a scoring press"),
    ("chunkkv:window=8", "unknown key 'window' for chunkkv (allowed: press, chunk, ratio)"),
    ("knorm:ratio=1", "ratio=1 must be a number in [0.0, 1.0)"),
    ("knorm:ratio=half", "ratio=half must be a number"),
    ("knorm:ratio=nan", "ratio=nan must be a number in [0.0, 1.0)"),
    ("chunkkv:chunk=0", "chunk=0 must be an integer >= 1"),
    ("chunkkv:chunk=2.5", "chunk=2.5 must be an integer >= 1"),
    ("snapkv:kernel=4", "kernel=4 must be an odd integer >= 1"),
    ("streaming:sinks=-1", "sinks=-1 must be an integer >= 0"),
    ("knorm:ratio", "'ratio' is not key=value"),
    ("knorm:ratio=0.5,ratio=0.6", "ratio given twice"),
])
def test_bad_specs_are_refused_in_one_line(text, message):
    with pytest.raises(ValueError) as error:
        parse_press(text)
    assert message in str(error.value) and len(str(error.value).splitlines()) == 1


def test_a_missing_kvpress_names_the_install_step(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "kvpress", None)  # import kvpress now fails
    presses.load_kvpress.cache_clear()
    try:
        with pytest.raises(ValueError, match="kvpress cannot be imported .*: run make kvpress"):
            presses.check_press("knorm")
    finally:
        presses.load_kvpress.cache_clear()


@needs_kvpress
def test_another_kvpress_version_is_refused(monkeypatch):
    presses.load_kvpress.cache_clear()
    monkeypatch.setattr(presses.importlib.metadata, "version", lambda name: "0.6.0")
    try:
        with pytest.raises(ValueError, match="kvpress 0.6.0 is installed; .* verified with 0.5.5 only"):
            presses.load_kvpress()
    finally:
        presses.load_kvpress.cache_clear()


@needs_kvpress
def test_importing_kvpress_leaves_transformers_attention_functions_alone():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    presses.load_kvpress()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa_attention_forward


# --- the audit


def test_the_audit_refuses_a_bad_press_before_loading_a_model(tmp_path, capsys):
    from phasekv.cli import main

    code = main(["audit", "--hf", str(tmp_path / "no-such-model"), "--out", str(tmp_path / "o"),
                 "--press", "chunkkv:chunk=0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "chunk=0 must be an integer >= 1" in err[0]


@needs_kvpress
def test_the_audit_evaluates_a_press_condition_through_press_adapter():
    from phasekv.conditions.grammar import Geometry, check_conditions, condition_adapter

    check_conditions(("none", "press:chunkkv:press=knorm,ratio=0.5,chunk=8"), Geometry(8, 8, 16))
    hf = _tiny("llama")
    adapter = condition_adapter(hf, "press:chunkkv:press=knorm,ratio=0.5,chunk=8", Geometry(8, 8, 16))
    assert isinstance(adapter, PressAdapter) and adapter.info.stride == 8 and adapter.spec.values["chunk"] == 8


@pytest.mark.slow
@needs_real_model
@needs_kvpress
def test_the_real_model_audit_runs_a_press(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from phasekv.auditing.pipeline import run_audit
    from phasekv.config import AuditPlan, audit_config

    tokenizer = AutoTokenizer.from_pretrained(SMOL, gguf_file=SMOL_FILE)
    model = AutoModelForCausalLM.from_pretrained(SMOL, gguf_file=SMOL_FILE, dtype=torch.float32)
    condition = "press:chunkkv:press=knorm,ratio=0.5,chunk=8"
    summary = run_audit(HFAdapter(model, "SmolLM2-135M"), tokenizer, audit_config(), tmp_path / "a",
                        plan=AuditPlan(conditions=(condition,), prompts_per_phase=8, protocols=("prefix",)),
                        progress=False)
    result = summary["conditions"][condition]
    assert summary["can_do_task"] and result["prefix"]["verdict"]
    assert result["prefix"]["mean_accuracy"] < summary["conditions"]["none"]["prefix"]["mean_accuracy"]
    assert 0.45 < result["cache_bytes"]["compressed"] / result["cache_bytes"]["full"] < 0.56
