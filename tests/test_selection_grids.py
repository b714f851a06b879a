"""Moved selection grids (`grid=stagger|jitter` of
phasekv.conditions.selection.pooled, the kernel's `Geometry.origins`, the
indexers' moved pools, the distilled indexer's lead slots in phasekv.archs.glm5_next), on tiny transformers models."""

import pytest
import torch

from phasekv.adapters.hf import HFAdapter
from phasekv.conditions.selection import kernel as sel_kernel
from phasekv.conditions.selection import pooled as sel
from phasekv.conditions.selection import scorers as ix
from tests.helpers import tiny_causal_lm
from tests.test_selection import _call, _distilled_dir, _fast, _Layer

GRID_SPECS = ["kpool:pool=4,top=2,local=4,sink=1", "kpool:pool=4,budget=0.3,local=6,sink=0",
              "kpool:pool=3,top=3,local=3,sink=2"]
OFFSETS = torch.tensor([3, 1])  # jitter: the two rows' origins


def _offsets(spec):
    return OFFSETS % spec.pool if spec.grid == "jitter" else None


@pytest.mark.parametrize("text", GRID_SPECS)
@pytest.mark.parametrize("indexer", ["oracle", "mean", "max"])
@pytest.mark.parametrize("grid, heads", [("fixed", "kv"), ("stagger", "kv"), ("jitter", "shared"), ("jitter", "kv")])
def test_every_grid_matches_the_per_query_reference(text, indexer, grid, heads):
    """The fast path (block-wise, scatter pooling on a moved grid) against the reference's hand-listed moved pools;
    3 KV groups at pool 3 or 4: stagger origins 0, 1, 3 (pool 4) and 0, 1, 2 (pool 3)."""
    spec = sel.parse_selection(f"{text},heads={heads},indexer={indexer},grid={grid}")
    q, k, v = _call(heads=6, kv=3)
    offsets = _offsets(spec)
    fast = _fast(spec, ix.make_indexer(indexer), q, k, v, offsets=offsets)
    origins = sel_kernel.grid_origins(spec, offsets, 3)
    ref = sel_kernel.reference_attention(spec, ix.make_indexer(indexer), _Layer(), q, k, v, origins=origins)
    assert torch.allclose(fast, ref, atol=1e-5)


def test_the_distilled_indexer_on_a_jittered_grid_matches_the_reference(tmp_path):
    directory = _distilled_dir(tmp_path, hidden=16, layers=1, pool=4)
    spec = sel.parse_selection(f"kpool:pool=4,top=2,local=4,indexer=distilled:{directory},grid=jitter")
    q, k, v = _call(t=41)
    hidden = torch.randn(2, 41, 16)
    fast = _fast(spec, ix.make_indexer(spec.indexer), q, k, v, hidden, OFFSETS)
    ref = sel_kernel.reference_attention(spec, ix.make_indexer(spec.indexer), _Layer(), q, k, v, hidden=hidden,
                                  origins=OFFSETS[:, None])
    assert torch.allclose(fast, ref, atol=1e-5)
    assert not torch.allclose(fast, _fast(spec, ix.make_indexer(spec.indexer), q, k, v, hidden,
                                          torch.zeros(2).long()), atol=1e-3)


@pytest.mark.parametrize("origin", [1, 2, 3])
def test_the_distilled_indexer_pools_exactly_the_moved_pools(tmp_path, origin):
    """The real module's pools behind the lead slots: on a grid moved by o, pool j + 1 starts at position 4 - o +
    4j, so its score is pool j's on the fixed grid of the sequence that starts at position 4 - o (the same queries,
    the same hidden states); the partial pool 0 depends on positions 0 .. 3 - o only."""
    module = ix.load_distilled(_distilled_dir(tmp_path, hidden=16, layers=1, pool=4))[1][0]
    hidden = torch.randn(2, 30, 16)
    moved = ix.glm_pool_scores(module, hidden, 5, torch.full((2,), origin))  # (B, 5, pools)
    fixed = ix.glm_pool_scores(module, hidden[:, 4 - origin:], 5)
    complete = (30 - (4 - origin)) // 4
    assert torch.allclose(moved[..., 1:1 + complete], fixed[..., :complete], atol=1e-5)
    assert moved.shape[-1] == (30 + 3 - 1) // 4 + 1 and torch.isfinite(moved[..., 0]).all()
    changed = hidden.clone()
    changed[:, 3 - origin] += 1.0
    other = ix.glm_pool_scores(module, changed, 5, torch.full((2,), origin))
    assert torch.allclose(other[..., 1:], moved[..., 1:], atol=1e-6)  # position 3 - o is pool 0's alone
    assert not torch.allclose(other[..., 0], moved[..., 0], atol=1e-4)


@pytest.mark.parametrize("indexer", ["oracle", "mean", "max"])
def test_origin_zero_through_the_moved_path_is_the_fixed_grid(indexer):
    """Origins of 0 send the call through the moved grid's gathers and scatters: the same selection and output
    as the fixed grid's slices (grid=fixed runs today's path: its name and output are the unmoved ones)."""
    spec = sel.parse_selection(f"kpool:pool=4,top=2,local=4,heads=kv,indexer={indexer}")
    assert sel.parse_selection(f"kpool:pool=4,top=2,local=4,heads=kv,indexer={indexer},grid=fixed") == spec
    q, k, v = _call(t=40)
    query_pos = torch.arange(40)
    fixed, moved = [], []
    a = sel_kernel.chunked_attention(spec, ix.make_indexer(indexer), _Layer(), q, k, v, attention_mask=None,
                                     query_pos=query_pos, scaling=0.3, record=fixed)
    b = sel_kernel.chunked_attention(spec, ix.make_indexer(indexer), _Layer(), q, k, v, attention_mask=None,
                                     query_pos=query_pos, scaling=0.3, record=moved,
                                     origins=torch.zeros(1, 2, dtype=torch.long))
    assert torch.allclose(a, b, atol=1e-6) and torch.equal(fixed[0]["selected"], moved[0]["selected"])


def test_staggered_groups_select_pools_on_their_own_boundaries():
    """pool 4, 2 KV groups: origins 0 and 2.  Every selected (non-sink, non-tail) key run of group 0 starts at a
    multiple of 4, of group 1 at 2 mod 4, and each query selects K pools in each group (the budget)."""
    spec = sel.parse_selection("kpool:pool=4,top=3,local=4,sink=0,heads=kv,indexer=max,grid=stagger")
    assert sel_kernel.grid_origins(spec, None, 2).tolist() == [[0, 2]]
    q, k, _ = _call(t=48)
    geometry = sel_kernel.call_geometry(q, k, None, None)
    geometry.origins = sel_kernel.grid_origins(spec, None, 2)
    logits = torch.matmul(q, k.repeat_interleave(2, 1).transpose(-1, -2))
    pools = sel_kernel.pool_count(spec, 47, geometry.origins)
    scores = ix.MaxKey().pool_scores(module=None, logits=logits, geometry=geometry, spec=spec, pools=pools,
                                     kv_heads=2, hidden=None)
    chosen = sel_kernel.select_pools(spec, scores, sel.candidate_pools(spec, geometry, pools), geometry.query_pos)
    mask = sel_kernel.selection_mask(spec, geometry, chosen)  # (B, 2, Tq, Tk)
    for t in range(24, 48):
        for group, origin in enumerate((0, 2)):
            keys = mask[0, group, t, :t - 3].nonzero().flatten().tolist()  # before the tail t-3 .. t
            starts = [s for s in keys if s - 1 not in keys and s > 0]  # 0: the partial pool 0 starts there
            assert int(chosen[0, group, t].sum()) == 3 and all((s + origin) % 4 == 0 for s in starts), (t, keys)


def test_jitter_is_the_same_for_a_prompt_and_differs_across_prompts():
    spec = sel.parse_selection("kpool:pool=4,top=2,local=4,grid=jitter")
    ids = torch.randint(0, 50, (64, 30), generator=torch.Generator().manual_seed(0))
    drawn = spec.offsets(ids)
    assert torch.equal(drawn, spec.offsets(ids.clone())) and set(drawn.tolist()) == {0, 1, 2, 3}
    assert not torch.equal(drawn, sel.parse_selection("kpool:pool=4,top=2,local=4,grid=jitter,seed=1").offsets(ids))
    assert sel.parse_selection("kpool:pool=4,top=2,local=4,heads=kv,grid=stagger").offsets(ids) is None


@pytest.mark.parametrize("indexer", ["max", "distilled"])
def test_a_jittered_request_is_one_grid_for_its_queries_and_never_sees_the_future(indexer, tmp_path):
    """The adapter's split path (contexts prefilled, queries continued on the context's drawn grid) is one selected
    forward per whole prompt on that grid, differs from the fixed grid's, and with the origins held, changing
    the tokens after t changes no logit up to t."""
    model = tiny_causal_lm("llama", 50, 256, "eager")
    name = f"distilled:{_distilled_dir(tmp_path, hidden=32, layers=2, pool=4)}" if indexer == "distilled" else indexer
    text = f"kpool:pool=4,top=2,local=4,indexer={name}"
    adapter = sel.SelectionAdapter(HFAdapter(model, "tiny"), sel.parse_selection(f"{text},grid=jitter"))
    contexts = torch.randint(0, 50, (4, 30), generator=torch.Generator().manual_seed(3))
    queries = torch.randint(0, 50, (8, 3))
    offsets = adapter.spec.offsets(contexts)
    assert len(set(offsets.tolist())) > 1
    split = adapter.continue_from(adapter.prefill(contexts), queries, 2)
    whole_ids = torch.cat([contexts.repeat_interleave(2, 0), queries], 1)
    whole = adapter._forward(whole_ids, 0, offsets=offsets.repeat_interleave(2))[:, -3:]
    assert torch.allclose(split, whole, atol=1e-5)
    fixed = sel.SelectionAdapter(HFAdapter(model, "tiny"), sel.parse_selection(text))
    assert not torch.allclose(fixed.logits(whole_ids)[:, -3:], whole, atol=1e-3)
    other = whole_ids.clone()
    other[:, 20:] = torch.randint(0, 50, (8, 13))
    held = offsets.repeat_interleave(2)
    a, b = adapter._forward(whole_ids, 0, offsets=held), adapter._forward(other, 0, offsets=held)
    assert torch.allclose(a[:, :20], b[:, :20], atol=1e-5) and not torch.allclose(a[:, 20:], b[:, 20:], atol=1e-3)


def test_staggered_selection_never_sees_the_future():
    model = tiny_causal_lm("llama", 50, 256, "eager")
    spec = sel.parse_selection("kpool:pool=4,top=2,local=4,heads=kv,indexer=oracle,grid=stagger")
    ids = torch.randint(0, 50, (2, 48))
    other = ids.clone()
    other[:, 30:] = torch.randint(0, 50, (2, 18))
    with torch.no_grad(), sel.selecting(model, spec, ix.Oracle()):
        a, b = model(ids).logits, model(other).logits
        fixed = sel.SelectionAdapter(HFAdapter(model, "tiny"), sel.parse_selection(
            "kpool:pool=4,top=2,local=4,heads=kv,indexer=oracle")).logits(ids)
    assert torch.allclose(a[:, :30], b[:, :30], atol=1e-5)
    assert not torch.allclose(a[:, 30:], b[:, 30:], atol=1e-3)
    assert not torch.allclose(a[:, 20:], fixed[:, 20:], atol=1e-3)  # the offset is not ignored


def test_the_mechanism_takes_the_targets_pool_on_each_groups_grid():
    """A record of 2 groups with origins 0 and 2, group 0 holding pool 2 (keys 8..11), group 1 pool 3 (keys
    10..13): position 9 is held by group 0 only, position 11 by both; the mass is each head's own pool's."""
    selected = torch.zeros(1, 2, 6, dtype=torch.bool)
    selected[0, 0, 2] = selected[0, 1, 3] = True
    probs = torch.zeros(1, 2, 24)
    probs[0, 0, 8:12] = 0.25  # head 0 (group 0): all its mass on its pool 2
    probs[0, 1, 10:14] = 0.25  # head 1 (group 1): all its mass on its pool 3
    record = {"selected": selected, "probs": probs, "key_pos": torch.arange(24), "query_pos": torch.tensor(23),
              "origins": torch.tensor([[0, 2]])}
    spec = sel.parse_selection("kpool:pool=4,top=1,local=4,sink=0,heads=kv,indexer=max,grid=stagger")
    assert sel._pool_attended(record, 0, 9, spec) == (0.5, 0.5)  # head 1: the pool of 9 is keys 6..9, mass 0
    assert sel._pool_attended(record, 0, 11, spec) == (1.0, 1.0)


def test_bad_grids_are_one_line_errors(tmp_path):
    """An unknown grid, a stagger without per-group selections (heads=shared, or the distilled indexer's one
    selection for all heads), and a jittered call that was given no offsets."""
    directory = _distilled_dir(tmp_path, hidden=16, layers=1, pool=4)
    for text, message in [("grid=diagonal", "grid='diagonal'"), ("grid=stagger", "needs heads=kv"),
                          (f"heads=kv,grid=stagger,indexer=distilled:{directory}", "an indexer that scores per group"),
                          ("grid=jitter,seed=x", "is not a whole number")]:
        with pytest.raises(ValueError, match=message) as caught:
            sel.parse_selection(f"kpool:pool=4,top=2,{text}")
        assert "\n" not in str(caught.value)
    q, k, v = _call()
    with pytest.raises(ValueError, match="no per-request offsets"):
        _fast(sel.parse_selection("kpool:pool=4,top=2,grid=jitter"), ix.Oracle(), q, k, v)
