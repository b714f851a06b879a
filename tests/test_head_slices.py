"""Head-partitioned history (phasekv.conditions.head_slices) and the moved post-hoc grids
(phasekv.conditions.grid_fixes) on tiny transformers models: the masked attention against its per-query reference,
the slicings by hand, no query reading its future, prefill + queries equal to one whole forward, and origin 0 equal to
plain post-hoc select."""

import pytest
import torch

pytest.importorskip("transformers")

from phasekv.adapters.hf import HFAdapter  # noqa: E402
from phasekv.conditions import grid_fixes as gf  # noqa: E402
from phasekv.conditions import head_slices as hs  # noqa: E402
from phasekv.conditions.grammar import Geometry, check_conditions, condition_adapter  # noqa: E402
from phasekv.conditions.posthoc import PosthocAdapter  # noqa: E402
from phasekv.conditions.selection.kernel import call_geometry  # noqa: E402
from tests.helpers import tiny_causal_lm  # noqa: E402

VOCAB, T, Q = 61, 45, 3
SLICES = ["slices:kind=contiguous,size=4,local=3,sink=1", "slices:kind=contiguous,size=3,shift=layer,local=2,sink=0",
          "slices:kind=contiguous,size=4,shift=random,local=3,seed=5", "slices:kind=interleaved,local=2",
          "slices:kind=interleaved,shift=random,group=query,local=1,sink=2"]


class _Layer(torch.nn.Module):
    def __init__(self, layer_idx=1, layers=3):
        super().__init__()
        self.layer_idx, self.config = layer_idx, type("C", (), {"num_hidden_layers": layers})()


def _call(seed=0, b=2, heads=4, kv=2, t=23, d=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, heads, t, d, generator=g), torch.randn(b, kv, t, d, generator=g),
            torch.randn(b, kv, t, d, generator=g))


def _state(spec, rows=2, groups=2):
    return hs.MaskState(spec, spec.group, spec.offsets(rows, groups, torch.Generator().manual_seed(3)))


def _hf(attention="eager") -> HFAdapter:
    return HFAdapter(tiny_causal_lm("llama", VOCAB, 256, attention), f"llama-{attention}")


def _ids(rows=2, length=T, seed=1):
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("text", SLICES)
def test_masked_attention_matches_the_per_query_reference(text):
    spec = hs.parse_slices(text)
    q, k, v = _call()
    state = _state(spec, groups=2 if spec.group == "kv" else 4)
    module = _Layer()
    hs._ACTIVE[id(module)] = state
    try:
        fast = hs.masked_attention(module, q, k, v, None, scaling=0.3)[0]
    finally:
        hs._ACTIVE.pop(id(module))
    assert torch.allclose(fast, hs.reference_attention(state, module, q, k, v, scaling=0.3), atol=1e-5)


def _owners(text, t=40, groups=3, layer=0, layers=1, offsets=None):
    """(rows, G, Tk) of the older keys (beyond the local tail and sink) the last query's groups read."""
    spec = hs.parse_slices(text)
    q, k, _ = _call(t=t, heads=groups, kv=groups)
    keep = spec.keep(layer=layer, layers=layers, geometry=call_geometry(q, k, None, None), groups=groups,
                     offsets=offsets)
    return keep[:, :, -1]


def test_contiguous_slices_are_dealt_to_the_groups_in_turn():
    keep = _owners("slices:kind=contiguous,size=4,local=1,sink=0")[0]  # (G, Tk)
    for s in range(39):
        assert keep[:, s].tolist() == [g == (s // 4) % 3 for g in range(3)]
    assert keep[:, 39].all()  # the query itself, in every group's local tail


def test_interleaved_slices_follow_the_position_mod_groups():
    keep = _owners("slices:kind=interleaved,local=4,sink=2")[0]
    for s in range(2, 36):
        assert keep[:, s].tolist() == [g == s % 3 for g in range(3)]
    assert keep[:, :2].all() and keep[:, 36:].all()  # the sink and the local tail


def test_every_older_position_has_exactly_one_group_under_each_shift():
    for text, offsets, layer in [("slices:kind=contiguous,size=5,shift=layer,local=1,sink=0", None, 2),
                                 ("slices:kind=contiguous,size=5,shift=random,local=1,sink=0",
                                  torch.tensor([0, 7, 14]), 0)]:
        keep = _owners(text, offsets=offsets, layer=layer, layers=4)
        assert (keep[..., :39].sum(1) == 1).all()


def test_the_shifts_move_the_boundaries():
    fixed = _owners("slices:kind=contiguous,size=4,local=1,sink=0")
    layer = _owners("slices:kind=contiguous,size=4,shift=layer,local=1,sink=0", layer=1, layers=4)  # o = 3
    assert not torch.equal(fixed, layer)
    assert torch.equal(layer[0, :, :36], fixed[0, :, 3:39])  # group of s + 3 with o = 0 is the group of s with o = 3
    rows = _owners("slices:kind=contiguous,size=4,shift=random,local=1,sink=0", offsets=torch.tensor([0, 5]))
    assert torch.equal(rows[0], fixed[0]) and not torch.equal(rows[1], fixed[0])


def test_request_offsets_are_reproducible_and_differ_between_requests():
    spec = hs.parse_slices("slices:kind=contiguous,size=8,shift=random")
    a = spec.offsets(16, 3, torch.Generator().manual_seed(0))
    assert torch.equal(a, spec.offsets(16, 3, torch.Generator().manual_seed(0)))
    assert ((a >= 0) & (a < 24)).all() and len(set(a.tolist())) > 4
    assert not torch.equal(a, spec.offsets(16, 3, torch.Generator().manual_seed(1)))
    assert spec.offsets(4, 3, torch.Generator()).shape == (4,)
    assert hs.parse_slices("slices:shift=layer").offsets(4, 3, torch.Generator()) is None


@pytest.mark.parametrize("text", ["slices:kind=diagonal", "slices:kind=interleaved,size=4", "slices:size=0",
                                  "slices:shift=head", "slices:local=0", "slices:size=x", "slices:size=4,size=5",
                                  "slices:group=layer"])
def test_bad_slicings_are_refused_in_one_line(text):
    with pytest.raises(ValueError, match="slices"):
        check_conditions((text,), Geometry())


@pytest.mark.parametrize("text", SLICES)
def test_no_query_reads_its_future(text):
    base, spec = _hf(), hs.parse_slices(text)
    ids = _ids(1, T)
    changed = ids.clone()
    changed[0, 30:] = (changed[0, 30:] + 1) % VOCAB
    a, b = (hs.HeadSliceAdapter(base, spec).logits(x) for x in (ids, changed))  # the same draws for both
    assert torch.allclose(a[:, :30], b[:, :30], atol=1e-5)
    assert not torch.allclose(a[:, 30:], b[:, 30:], atol=1e-3)  # the changed tokens are read from 30 on


@pytest.mark.parametrize("text", SLICES[:4])
def test_prefill_and_queries_equal_one_whole_forward_and_differ_from_full_attention(text):
    base = _hf()
    hf = hs.HeadSliceAdapter(base, hs.parse_slices(text))
    ids, queries = _ids(), _ids(4, Q, seed=2)
    got = hf.continue_from(hf.prefill(ids), queries, 2)
    offsets = hf.spec.offsets(2, hf.groups, torch.Generator().manual_seed(hf.spec.seed))  # the prefill's draws
    whole = hf._run(None if offsets is None else offsets.repeat_interleave(2), base.logits,
                    torch.cat([ids.repeat_interleave(2, 0), queries], 1))[:, T:]
    assert torch.allclose(got, whole, atol=1e-4)
    assert not torch.allclose(got, base.continue_from(base.prefill(ids), queries, 2), atol=1e-3)
    assert base.module.config._attn_implementation == "eager"  # restored


def test_the_model_is_restored_when_a_forward_fails():
    base = _hf("sdpa")
    hf = hs.HeadSliceAdapter(base, hs.parse_slices("slices:kind=interleaved"))
    with pytest.raises(Exception):  # noqa: B017 - any failure inside the forward
        hf.logits(torch.full((1, 5), VOCAB + 100))
    assert base.module.config._attn_implementation == "sdpa" and not hs._ACTIVE


# ----------------------------------------------------------------------------- the moved post-hoc grids


@pytest.mark.parametrize("text", ["stagger:select:3", "jitter:select:5+keep-first:1", "stagger:select:0+keep-first:2"])
@pytest.mark.parametrize("origin", [0, 1, 3, 7])
def test_the_grid_mask_keeps_what_the_plain_reference_lists(text, origin):
    fix = gf.parse_fix(text, 8, 8, 5)
    q, k, _ = _call(t=T + Q, heads=2, kv=2)
    geometry = call_geometry(q[:, :, T:], k, None, torch.arange(T, T + Q)[None])
    keep = gf.GridFix("jitter", fix.policy, 8, 5).keep(layer=0, layers=1, geometry=geometry, groups=2,
                                                       offsets=torch.tensor([origin, origin]))
    want = set(gf.reference_kept(fix, T, origin)) | set(range(T, T + Q))
    assert keep[0, 0, 0].nonzero().flatten().tolist() == sorted(want)
    assert len(gf.reference_kept(fix, T, origin)) < T


def test_stagger_moves_each_kv_heads_grid():
    fix = gf.parse_fix("stagger:select:3", 8, 8, 16)
    assert fix.origins(4, None).tolist() == [[0, 2, 4, 6]]


def test_origin_zero_is_plain_posthoc_select():
    base = _hf()
    ids, queries = _ids(), _ids(4, Q, seed=2)
    fix = gf.GridFixAdapter(base, gf.parse_fix("jitter:select:3+keep-first:1", 8, 8, 5))
    fix._draw = lambda rows: torch.zeros(rows, dtype=torch.long)
    post = PosthocAdapter(base, "select:3+keep-first:1", window=8, stride=8, local_window=5)
    got = fix.continue_from(fix.prefill(ids), queries, 2)
    assert torch.allclose(got, post.continue_from(post.prefill(ids), queries, 2), atol=1e-5)
    assert fix.bytes == post.bytes


@pytest.mark.parametrize("text", ["stagger:select:3", "jitter:select:3+keep-first:1"])
def test_moved_grids_keep_the_budget_and_change_the_answer(text):
    base = _hf()
    ids, queries = _ids(), _ids(4, Q, seed=2)
    fix = condition_adapter(base, text, Geometry(8, 8, 5))
    post = PosthocAdapter(base, text.split(":", 1)[1], window=8, stride=8, local_window=5)
    got = fix.continue_from(fix.prefill(ids), queries, 2)
    post.prefill(ids)
    # per head and row: at most one entry fewer at the start and S - 1 more raw positions before the local window
    per_position = post.bytes["full"] // (2 * base.info.num_kv_heads * T)
    assert abs(fix.bytes["compressed"] - post.bytes["compressed"]) <= 2 * base.info.num_kv_heads * 8 * per_position
    assert not torch.allclose(got, post.continue_from(post.prefill(ids), queries, 2), atol=1e-3)


def test_moved_grids_read_no_future_query_token():
    base = _hf()
    fix = condition_adapter(base, "stagger:select:3", Geometry(8, 8, 5))
    ids, queries = _ids(), _ids(2, Q, seed=2)
    changed = queries.clone()
    changed[:, -1] = (changed[:, -1] + 1) % VOCAB
    a, b = (fix.continue_from(fix.prefill(ids), x, 1) for x in (queries, changed))
    assert torch.allclose(a[:, :-1], b[:, :-1], atol=1e-5) and not torch.allclose(a[:, -1], b[:, -1], atol=1e-3)


@pytest.mark.parametrize("text", ["stagger:mean", "jitter:select:9", "shuffle:select:3"])
def test_bad_fixes_are_refused_in_one_line(text):
    with pytest.raises(ValueError):
        check_conditions((text,), Geometry(8, 8, 16))
    with pytest.raises(ValueError, match="W = S"):
        check_conditions(("stagger:select:3",), Geometry(9, 8, 16))


def test_the_grammar_builds_each_condition_and_the_fix_refuses_one_forward_per_prompt():
    conditions = ("slices:kind=interleaved,group=query", "stagger:select:3+keep-first:1", "jitter:select:0")
    check_conditions(conditions, Geometry(8, 8, 16))
    base = _hf()
    built = [condition_adapter(base, c, Geometry(8, 8, 16)) for c in conditions]
    assert [type(a).__name__ for a in built] == ["HeadSliceAdapter", "GridFixAdapter", "GridFixAdapter"]
    assert built[0].groups == base.info.num_heads and built[1].fix.mode == "stagger"
    with pytest.raises(ValueError, match="prefill"):
        built[1].logits(_ids())


# ----------------------------------------------------------------------------- the layer kind of phasekv's models

LAYER = {"contiguous": dict(kind="contiguous", size=4, groups=2, local=3),
         "contiguous-layer": dict(kind="contiguous", size=3, groups=2, shift="layer", local=2, sink=0),
         "interleaved": dict(kind="interleaved", size=1, groups=2, local=2),
         "interleaved-query": dict(kind="interleaved", size=1, groups=4, group="query", local=1, sink=2)}


def _sliced(name, **overrides):
    from phasekv.model import build_model
    from tests.helpers import tiny

    torch.manual_seed(0)
    config = tiny(layer_types=["slices", "slices"], compressors={"slices": LAYER[name]}, **overrides)
    return build_model(config).eval()


@pytest.mark.parametrize("name", sorted(LAYER))
def test_the_sliced_layer_matches_its_per_query_reference_and_the_posthoc_rule(name):
    from phasekv.compression.head_slices import reference_attention

    attn = _sliced(name).model.layers[1].self_attn
    q, k, v = _call(seed=4, b=2, heads=4, kv=2, t=21, d=16)
    fast = attn._full(q, k, v, None, 0)
    assert torch.allclose(fast, reference_attention(attn.slices, q, k, v, torch.arange(21)), atol=1e-5)
    o = attn.slices.options  # the same rule as the training-free condition of transformers models
    spec = hs.SliceSpec(o.kind, o.size, "layer" if o.shift == "layer" else "fixed", o.group, o.local, o.sink)
    keep = spec.keep(layer=1, layers=2, geometry=call_geometry(q, k, None, None), groups=attn.slices.groups,
                     offsets=None)[0] & torch.ones(21, 21, dtype=torch.bool).tril()
    assert torch.equal(attn.slices.keep(torch.arange(21), torch.arange(21)), keep)


def test_the_sliced_layer_deals_contiguous_slices_and_interleaves_by_hand():
    contiguous = _sliced("contiguous").model.layers[0].self_attn.slices
    assert contiguous.owner(torch.arange(12)).tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]
    interleaved = _sliced("interleaved-query").model.layers[0].self_attn.slices
    assert interleaved.owner(torch.arange(6)).tolist() == [0, 1, 2, 3, 0, 1]
    shifted = [_sliced("contiguous-layer").model.layers[i].self_attn.slices for i in (0, 1)]
    assert shifted[0].offset == 0 and shifted[1].offset == 3  # floor(1 * G * L / layers) = floor(6 / 2)
    assert shifted[1].owner(torch.arange(6)).tolist() == [1, 1, 1, 0, 0, 0]
    keep = contiguous.keep(torch.arange(20), torch.arange(20))[:, 19]  # the last query: (G, Tk)
    assert keep[:, 17:].all() and keep[:, 0].all()  # the local tail (3) and the sink (1) in every group
    assert (keep[:, 1:17].sum(0) == 1).all()  # every older position in exactly one group


@pytest.mark.parametrize("name", sorted(LAYER))
def test_the_sliced_model_reads_no_future_token_and_differs_from_full_attention(name):
    from phasekv.model import build_model

    model = _sliced(name)
    ids = _ids(2, 40)
    changed = ids.clone()
    changed[:, 30:] = (changed[:, 30:] + 1) % VOCAB
    with torch.no_grad():
        a, b = model(ids), model(changed)
        full = build_model(model.config.__class__(**{**model.config.to_dict(), "layer_types": ["full", "full"],
                                                       "compressors": {}}))
        full.load_state_dict(model.state_dict())
        dense = full.eval()(ids)
    assert torch.allclose(a[:, :30], b[:, :30], atol=1e-6)
    assert not torch.allclose(a[:, 30:], b[:, 30:], atol=1e-3)
    assert not torch.allclose(a[:, 20:], dense[:, 20:], atol=1e-3)  # the slicing acts beyond the local tail


@pytest.mark.parametrize("name", sorted(LAYER))
def test_the_sliced_model_prefill_and_shared_queries_equal_one_forward(name):
    from phasekv.cache import KVCache

    model = _sliced(name)
    ids, queries = _ids(2, 30), _ids(6, 5, seed=2)
    with torch.no_grad():
        cache = KVCache()
        model.prefill(ids, cache)
        got = model(queries, cache=cache.shared(3))
        whole = model(torch.cat([ids.repeat_interleave(3, 0), queries], 1))[:, 30:]
    assert torch.allclose(got, whole, atol=1e-5)


def test_the_sliced_model_trains():
    model = _sliced("interleaved").train()
    ids = _ids(2, 24)
    logits = model(ids)[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters()
               if "layers.1" in n or "embed" in n)


@pytest.mark.parametrize("options, extra, match", [
    (dict(groups=3), {}, "groups: 3, but the model has 2 KV heads"),
    (dict(kind="interleaved", size=4, groups=2), {}, "size: kind interleaved"),
    (dict(kind="diagonal", groups=2), {}, "kind"),
    (dict(groups=2, shift="random"), {}, "shift"),
    (dict(groups=2), dict(attn_sink=True), "no learned sink"),
])
def test_bad_sliced_layers_are_refused_in_one_line(options, extra, match):
    from phasekv.model import build_model
    from tests.helpers import tiny

    with pytest.raises(ValueError, match=match) as err:
        build_model(tiny(layer_types=["slices", "full"], compressors={"slices": options}, **extra))
    assert "\n" not in str(err.value) and "model.compressors.slices" in str(err.value)
