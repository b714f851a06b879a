"""Pooled selection as an audit condition (phasekv.conditions.selection.pooled, .indexers), its mechanism statistics
(in phasekv.conditions.selection.pooled) and the distilled indexer (phasekv.training.distill_indexer),
on tiny transformers models."""

import json
from pathlib import Path

import pytest
import torch

from phasekv.adapters.hf import HFAdapter
from phasekv.conditions.selection import kernel as sel_kernel
from phasekv.conditions.selection import pooled as sel
from phasekv.conditions.selection import scorers as ix
from tests.helpers import SMOL, SMOL_FILE, needs_real_model, tiny_causal_lm

SPECS = ["kpool:pool=4,top=2,local=4,sink=1", "kpool:pool=2,budget=0.3,local=4,sink=0",
         "kpool:pool=1,top=5,local=2,sink=2", "kpool:pool=8,top=1,local=8,sink=1"]


def _call(seed=0, b=2, heads=4, kv=2, t=40, d=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, heads, t, d, generator=g), torch.randn(b, kv, t, d, generator=g),
            torch.randn(b, kv, t, d, generator=g))


class _Layer(torch.nn.Module):
    layer_idx = 0


def _fast(spec, indexer, q, k, v, hidden=None, offsets=None):
    module = _Layer()
    state = sel.SelectionState(spec, indexer, offsets=offsets)
    if hidden is not None:
        state.hidden[id(module)] = hidden
    sel._ACTIVE[id(module)] = state
    try:
        return sel.selection_attention(module, q, k, v, None, scaling=q.shape[-1] ** -0.5)[0]
    finally:
        sel._ACTIVE.pop(id(module))


@pytest.mark.parametrize("text", SPECS)
@pytest.mark.parametrize("indexer", ["oracle", "mean", "max"])
@pytest.mark.parametrize("heads", ["shared", "kv"])
def test_fast_selection_matches_the_per_query_reference(text, indexer, heads):
    spec = sel.parse_selection(f"{text},heads={heads},indexer={indexer}")
    q, k, v = _call()
    fast = _fast(spec, ix.make_indexer(indexer), q, k, v)
    ref = sel_kernel.reference_attention(spec, ix.make_indexer(indexer), _Layer(), q, k, v)
    assert torch.allclose(fast, ref, atol=1e-5)


@pytest.mark.parametrize("indexer", ["oracle", "mean", "max"])
@pytest.mark.parametrize("heads", ["shared", "kv"])
@pytest.mark.parametrize("tq", [40, 7])
def test_the_blockwise_attention_equals_the_whole_call(monkeypatch, indexer, heads, tq):
    """chunked_attention in blocks of 3 query rows (each over the keys up to its last query) against
    whole_attention at once: a whole call (tq = 40) and 7 queries following a 33-key cache, under a boolean mask
    that hides some keys of one row; the outputs and the recorded last-query selection agree."""
    monkeypatch.setattr(sel_kernel, "BLOCK_ELEMENTS", 2 * 4 * 40 * 3)  # B * H * Tk * 3 rows
    spec = sel.parse_selection(f"kpool:pool=4,top=2,local=4,sink=1,heads={heads},indexer={indexer}")
    q, k, v = _call(t=40)
    q = q[:, :, -tq:]
    mask = torch.ones(2, 1, tq, 40, dtype=torch.bool)
    mask[1, :, :, 9:14] = False
    position_ids = torch.arange(40 - tq, 40)[None].expand(2, -1)
    query_pos, key_pos = sel_kernel.positions(q, k, position_ids)
    assert sel_kernel.in_order(key_pos)
    blocks, whole = [], []
    fast = sel_kernel.chunked_attention(spec, ix.make_indexer(indexer), _Layer(), q, k, v, attention_mask=mask,
                                        query_pos=query_pos, scaling=0.3, record=blocks)
    geometry = sel_kernel.call_geometry(q, k, mask, position_ids)
    slow = sel_kernel.whole_attention(spec, ix.make_indexer(indexer), _Layer(), q, k, v, geometry=geometry,
                                      scaling=0.3, record=whole)
    assert torch.allclose(fast, slow, atol=1e-5)
    assert torch.equal(blocks[0]["selected"], whole[0]["selected"])
    assert torch.allclose(blocks[0]["probs"], whole[0]["probs"], atol=1e-6)
    assert blocks[0]["probs"][1, :, 9:14].abs().max() == 0  # the masked keys get nothing


def test_blocks_leave_out_the_keys_after_their_last_query(monkeypatch):
    """The causal bound is what the blocks save: with one row per block, query t's scores see t + 1 keys."""
    monkeypatch.setattr(sel_kernel, "BLOCK_ELEMENTS", 1)
    seen = []

    class Spy(ix.Oracle):
        def pool_scores(self, *, logits, **kw):
            seen.append(logits.shape[-1])
            return super().pool_scores(logits=logits, **kw)

    spec = sel.parse_selection("kpool:pool=4,top=2,local=4,sink=1")
    q, k, v = _call(t=12)
    sel_kernel.chunked_attention(spec, Spy(), _Layer(), q, k, v, attention_mask=None, query_pos=torch.arange(12),
                                 scaling=0.3)
    assert seen == list(range(1, 13))


@pytest.mark.parametrize("how", ["sum", "mean", "max"])
@pytest.mark.parametrize("t, pool", [(40, 4), (41, 4), (23, 8), (9, 1)])
def test_the_reshaped_pool_reduction_matches_the_scatter(how, t, pool):
    """pool_reduce_fast (keys at 0 .. T-1) against the scatter `pool_reduce`, causal visibility and a random
    padding mask, a trailing partial pool and one more pool than the keys fill."""
    g = torch.Generator().manual_seed(t)
    values = torch.randn(2, 3, t, t, generator=g)
    visible = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & (torch.rand(2, 1, 1, t, generator=g) > 0.2)
    pools = -(-t // pool) + 1
    key_pool = torch.arange(t) // pool
    fast = ix.pool_reduce_fast(values, visible, pool, pools, how)
    slow = ix.pool_reduce(values, key_pool, pools, visible, how)
    assert fast.shape == slow.shape == (2, 3, t, pools)
    assert torch.equal(fast.isinf(), slow.isinf())
    assert torch.allclose(fast.nan_to_num(0, 0, 0), slow.nan_to_num(0, 0, 0), atol=1e-5)
    if how != "mean":  # values already neutral where unseen: the same without the mask
        neutral = values.masked_fill(~visible, float("-inf") if how == "max" else 0.0)
        assert torch.equal(ix.pool_reduce_fast(neutral, None, pool, pools, how), fast)


@pytest.mark.parametrize("kind, heads", [("glm5", "shared"), ("minimax", "kv")])
def test_the_distilled_indexer_matches_the_reference_too(tmp_path, kind, heads):
    directory = _distilled_dir(tmp_path, hidden=16, layers=1, pool=4, kind=kind)
    spec = sel.parse_selection(f"kpool:pool=4,top=2,local=4,heads={heads},indexer=distilled:{directory}")
    q, k, v = _call(t=41)  # a trailing incomplete pool, which the real module leaves out of its pools
    hidden = torch.randn(2, 41, 16)
    fast = _fast(spec, ix.make_indexer(spec.indexer), q, k, v, hidden)
    ref = sel_kernel.reference_attention(spec, ix.make_indexer(spec.indexer), _Layer(), q, k, v, hidden=hidden)
    assert torch.allclose(fast, ref, atol=1e-5)


def test_each_query_attends_exactly_sink_local_and_its_pools():
    """Read off the mask: with pool 4, top 2, local 4, sink 1 the query at t = 39 sees the sink, its tail and the
    keys of exactly 2 pools; a query with fewer candidates than K sees every candidate."""
    spec = sel.parse_selection("kpool:pool=4,top=2,local=4,sink=1")
    q, k, _ = _call(t=40)
    geometry = sel.call_geometry(q, k, None, None)
    logits = torch.matmul(q, k.repeat_interleave(2, 1).transpose(-1, -2))
    scores = ix.Oracle().pool_scores(module=None, logits=logits, geometry=geometry, spec=spec, pools=10, kv_heads=2,
                                     hidden=None)
    candidates = sel.candidate_pools(spec, geometry, 10)
    chosen = sel_kernel.select_pools(spec, scores, candidates, geometry.query_pos)
    mask = sel_kernel.selection_mask(spec, geometry, chosen)
    pools = chosen[0, 0, 39].nonzero().flatten().tolist()
    expected = {0} | set(range(36, 40)) | {s for j in pools for s in range(4 * j, 4 * j + 4)}
    assert len(pools) == 2 and mask[0, 0, 39].nonzero().flatten().tolist() == sorted(expected)
    assert int(candidates[8].sum()) == 2 and int(mask[0, 0, 8].sum()) == 9  # t = 8: pools 0, 1 and the tail 5..8
    assert not mask[..., :, :].triu(1).any()  # nothing after the query, ever


def test_the_oracle_selects_the_pools_with_the_most_attention_mass():
    """One query whose key-5 logit is huge: pool 1 (keys 4..7) holds nearly all the mass and must be selected."""
    spec = sel.parse_selection("kpool:pool=4,top=1,local=4,sink=0")
    q = torch.zeros(1, 1, 24, 2)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 24, 2)
    k[0, 0, 5, 0] = 30.0
    geometry = sel.call_geometry(q, k, None, None)
    scores = ix.Oracle().pool_scores(module=None, logits=torch.matmul(q, k.transpose(-1, -2)), geometry=geometry,
                                     spec=spec, pools=6, kv_heads=1, hidden=None)
    chosen = sel_kernel.select_pools(spec, scores, sel.candidate_pools(spec, geometry, 6), geometry.query_pos)
    assert chosen[0, 0, 23].nonzero().flatten().tolist() == [1]
    assert chosen[0, 0, 6].nonzero().flatten().tolist() == [0]  # at t = 6 pool 1 is incomplete: not a candidate


@pytest.mark.parametrize("indexer", ["oracle", "mean", "max", "distilled", "distilled-minimax"])
def test_selection_never_looks_at_the_future(indexer, tmp_path):
    """Changing the tokens after position t changes no logit at or before t, whatever the indexer."""
    model = tiny_causal_lm("llama", 50, 256, "eager")
    name, heads = _indexer_name(indexer, tmp_path)
    spec = sel.parse_selection(f"kpool:pool=4,top=2,local=4,sink=1,heads={heads},indexer={name}")
    ids = torch.randint(0, 50, (2, 48))
    other = ids.clone()
    other[:, 30:] = torch.randint(0, 50, (2, 18))
    with torch.no_grad(), sel.selecting(model, spec, ix.make_indexer(name)):
        a, b = model(ids).logits, model(other).logits
    assert torch.allclose(a[:, :30], b[:, :30], atol=1e-5)
    assert not torch.allclose(a[:, 30:], b[:, 30:], atol=1e-3)


def test_selection_changes_the_model_and_is_removed_on_exit_even_after_an_error():
    model = tiny_causal_lm("llama", 50, 256, "sdpa")
    ids = torch.randint(0, 50, (1, 64))
    with torch.no_grad():
        dense = model(ids).logits
        spec = sel.parse_selection("kpool:pool=4,top=1,local=4,sink=0")
        with sel.selecting(model, spec, ix.Oracle()):
            selected = model(ids).logits
        with pytest.raises(RuntimeError, match="boom"), sel.selecting(model, spec, ix.Oracle()):
            raise RuntimeError("boom")
        assert model.config._attn_implementation == "sdpa" and not sel._ACTIVE
        assert torch.allclose(model(ids).logits, dense, atol=1e-6)
    assert (selected - dense)[:, 20:].abs().max() > 1e-3  # later queries lost keys


def test_a_budget_attends_everything_matches_dense_attention():
    """top larger than every candidate count: the selection is the whole causal past, i.e. dense attention."""
    model = tiny_causal_lm("llama", 50, 256, "eager")
    ids = torch.randint(0, 50, (2, 40))
    with torch.no_grad():
        dense = model(ids).logits
        with sel.selecting(model, sel.parse_selection("kpool:pool=4,top=99,local=4,sink=0"), ix.MeanKey()):
            assert torch.allclose(model(ids).logits, dense, atol=1e-5)


@pytest.mark.parametrize("indexer", ["oracle", "max", "distilled", "distilled-minimax"])
def test_the_adapter_scores_whole_prompts_as_the_runner_splits_them(indexer, tmp_path):
    """Prefill then continue over copies of the selected cache (and, for distilled, of the contexts' hidden states)
    gives the logits of one selected forward per whole prompt, and differs from the dense model's."""
    model = tiny_causal_lm("llama", 50, 256, "eager")
    name, heads = _indexer_name(indexer, tmp_path)
    adapter = sel.SelectionAdapter(HFAdapter(model, "tiny"), sel.parse_selection(f"kpool:pool=4,top=2,local=4,"
                                                                                f"heads={heads},indexer={name}"))
    contexts = torch.randint(0, 50, (2, 30))
    queries = torch.randint(0, 50, (6, 3))
    split = adapter.continue_from(adapter.prefill(contexts), queries, 3)
    whole_ids = torch.cat([contexts.repeat_interleave(3, 0), queries], 1)
    whole = adapter.logits(whole_ids)[:, -3:]
    assert torch.allclose(split, whole, atol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(model(whole_ids).logits[:, -3:], whole, atol=1e-3)
    assert adapter.info.stride == 4
    with pytest.raises(ValueError, match="would attend everything"):
        adapter.check_length(12)


@pytest.mark.parametrize("text, message", [
    ("kpool:top=2", "pool=P is required"),
    ("kpool:pool=0,top=2", "pool=0: must be >= 1"),
    ("kpool:pool=4", "exactly one of top=K"),
    ("kpool:pool=4,top=2,budget=0.5", "exactly one of top=K"),
    ("kpool:pool=4,budget=1.5", "0 < budget < 1"),
    ("kpool:pool=8,top=2,local=4", "local=4 < pool=8"),
    ("kpool:pool=4,top=2,heads=all", "heads='all'"),
    ("kpool:pool=4,top=2,indexer=best", "indexer='best'"),
    ("kpool:pool=4,top=two", "is not a whole number"),
    ("kpool:pool=4,top=2,top=3", "given twice"),
    ("kpool:pool=4,size=2", "cannot read"),
    ("kpool:pool=4,top=2,indexer=distilled:/nonexistent", "holds no indexer.json"),
    ("pool:4", "expected kpool:"),
])
def test_bad_selection_specs_are_one_line_errors(text, message):
    with pytest.raises(ValueError, match=message) as caught:
        sel.parse_selection(text)
    assert "\n" not in str(caught.value)


def test_a_distilled_indexer_for_another_pool_is_refused(tmp_path):
    directory = _distilled_dir(tmp_path, hidden=16, layers=1, pool=4)
    with pytest.raises(ValueError, match="trained for pool=4, not pool=8"):
        sel.parse_selection(f"kpool:pool=8,top=2,local=8,indexer=distilled:{directory}")


@pytest.mark.parametrize("kind", ["glm5", "minimax"])
def test_distillation_lowers_the_held_out_kl_and_raises_recall(kind):
    """The real Glm5NextTextIndexer (one selection) or MiniMaxM3VLIndexer (one per KV group: the target is the
    group's own heads' mass) modules on a tiny Llama's hidden states, trained on the KL to its dense attention over
    random sequences: the held-out KL falls and the top-K recall of the oracle's pools rises."""
    from phasekv.training.distill_indexer import IndexerTraining, features, fit, held_out

    torch.manual_seed(0)
    model = tiny_causal_lm("llama", 50, 256, "sdpa").requires_grad_(False)
    seqs = [torch.randint(0, 50, (64,)).tolist() for _ in range(10)]
    groups = 2 if kind == "minimax" else 1  # the tiny Llama's 4 heads in 2 KV groups
    feats = features(model, seqs, 4, progress=False, groups=groups)
    assert feats[0]["hidden"].shape == (2, 64, 32) and feats[0]["mass"].shape == (2, groups, 64, 16)
    heads_per_group = torch.full((2, groups, 64), 4.0 / groups)
    assert torch.allclose(feats[0]["mass"].float().sum(-1), heads_per_group, atol=0.02)  # each group's heads' mass
    cfg = IndexerTraining(kind=kind, pool=4, heads=2, head_dim=8, sequences=8, held_out=2, length=64, steps=150,
                          batch=4, lr=3e-3, local=4)
    indexers = ix.build_indexers(_shape(kind, hidden=32, layers=2, pool=4))
    before = held_out(indexers, feats[8:], cfg)
    fit(indexers, feats[:8], cfg, progress=False)
    after = held_out(indexers, feats[8:], cfg)
    assert after["kl_per_layer"] < 0.8 * before["kl_per_layer"]
    assert after["recall_at_budget"] > before["recall_at_budget"]


def test_distillation_ranks_only_the_pools_selection_chooses_among():
    """The loss is the KL over the selection's candidates: attention mass moved within the local tail leaves it
    unchanged, mass moved between two candidate pools changes it."""
    from phasekv.training.distill_indexer import IndexerTraining, distillation_loss

    torch.manual_seed(0)
    cfg = IndexerTraining(pool=4, heads=2, head_dim=8, sequences=1, held_out=1, length=48, local=8, sink=1)
    indexers = ix.build_glm_indexers(16, 1, 4, 2, 8)
    mass = torch.rand(1, 1, 48, 12)  # (L, G, T, pools)
    feature = {"hidden": torch.randn(1, 48, 16), "mass": mass}
    base = float(distillation_loss(indexers, [feature], cfg))
    tail, far = mass.clone(), mass.clone()
    tail[0, 0, 47, 10] += 5.0  # pool 10 (keys 40..43) is inside query 47's local tail (40..47)
    far[0, 0, 47, 3] += 5.0  # pool 3 (keys 12..15) is a candidate of query 47
    assert float(distillation_loss(indexers, [{**feature, "mass": tail}], cfg)) == pytest.approx(base, abs=1e-6)
    assert abs(float(distillation_loss(indexers, [{**feature, "mass": far}], cfg)) - base) > 1e-4


def test_the_mechanism_counts_the_target_pool_per_phase():
    """On a lookup prompt set the oracle's rate of selecting the target's pool is reported per phase, in [0, 1],
    with the tail share apart."""
    from phasekv.conditions.selection.pooled import selection_mechanism
    from phasekv.data.protocols import build_eval_set
    from phasekv.data.vocab import Vocabulary

    vocab = Vocabulary()
    model = tiny_causal_lm("llama", vocab.size, 512, "eager")
    eval_set = build_eval_set(vocab, "prefix", n_records=24, n_demos=1, stride=4, residue_modulus=4,
                              seed=0)
    adapter = sel.SelectionAdapter(HFAdapter(model, "tiny"), sel.parse_selection("kpool:pool=4,top=2,local=4"))
    result = selection_mechanism(adapter, eval_set, per_phase=2, progress=False)
    assert [p["phase"] for p in result["per_phase"]] == [0, 1, 2, 3]
    for p in result["per_phase"]:
        assert p["n"] == 2 and 0 <= p["target_selected"] <= 1 and 0 <= p["answer_mass"] <= 1


def _shape(kind: str, hidden: int, layers: int, pool: int) -> dict:
    """An indexer config: 2 heads of 8 dims (for minimax one per KV group of the tiny Llama and _call)."""
    shape = {"pool": pool, "hidden_size": hidden, "layers": layers, "heads": 2, "head_dim": 8}
    return {**shape, "kind": ix.MINIMAX_KIND, "rope_theta": 10000.0} if kind == "minimax" else shape


def _distilled_dir(tmp_path, hidden: int, layers: int, pool: int, kind: str = "glm5"):
    from safetensors.torch import save_file

    directory = tmp_path / f"indexer-{kind}-{hidden}-{layers}-{pool}"
    directory.mkdir()
    config = _shape(kind, hidden, layers, pool)  # glm5: no "kind", as the first indexers were written
    modules = ix.build_indexers(config, seed=1)
    for m in modules:  # non-trivial norms / pooling gate, so the real module's weighting is exercised
        for name, w in m.named_parameters():
            if name.endswith("norm.weight") or "compress_gate" in name:
                torch.nn.init.normal_(w, mean=1.0 if "norm" in name else 0.0, std=0.1)
    save_file({k: v.contiguous() for k, v in modules.state_dict().items()}, str(directory / ix.WEIGHTS_FILE))
    (directory / ix.CONFIG_FILE).write_text(json.dumps(config))
    return directory


def _indexer_name(indexer: str, tmp_path) -> tuple[str, str]:
    """(indexer=, heads=) of a test's indexer: distilled ones on the tiny Llama (the minimax kind needs heads=kv)."""
    if not indexer.startswith("distilled"):
        return indexer, "shared"
    kind = "minimax" if indexer.endswith("minimax") else "glm5"
    return f"distilled:{_distilled_dir(tmp_path, hidden=32, layers=2, pool=4, kind=kind)}", \
        "kv" if kind == "minimax" else "shared"


def _plain(t: int):
    pos = torch.arange(t)
    return sel.Geometry(pos, pos, (pos[None, :] <= pos[:, None])[None, None])


def test_the_max_indexer_selects_minimax_m3s_own_blocks():
    """transformers' MiniMaxM3VLIndexer on random hidden states (no rotation: cos 1, sin 0): its per-head block
    selection, less its local blocks, is the `max` indexer's selection (heads=kv, one head per group) on the same
    module's queries and keys, with the local tail at its local blocks and the budget at its other blocks."""
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLIndexer

    torch.manual_seed(0)
    block, topk, local_blocks, heads, t = 4, 3, 1, 2, 37
    config = MiniMaxM3VLTextConfig(hidden_size=16, index_n_heads=heads, index_head_dim=8, index_block_size=block,
                                   index_topk_blocks=topk, index_local_blocks=local_blocks)
    module = MiniMaxM3VLIndexer(config, 0).eval()
    kept = {}
    module.q_norm.register_forward_hook(lambda m, a, out: kept.__setitem__("q", out.transpose(1, 2)))
    module.k_norm.register_forward_hook(lambda m, a, out: kept.__setitem__("k", out.transpose(1, 2)))
    hidden = torch.randn(1, t, 16)
    position_ids = torch.arange(t)[None]
    with torch.no_grad():
        blocks = module(hidden, (torch.ones(1, t, 8), torch.zeros(1, t, 8)), None, position_ids)  # (1, H, S, topk)
    logits = kept["q"] @ kept["k"].transpose(-1, -2)  # (1, H, S, S)
    spec = sel.parse_selection(f"kpool:pool={block},top={topk - local_blocks},local={local_blocks * block},sink=0,"
                               "heads=kv,indexer=max")
    geometry = _plain(t)
    pools = -(-t // block)
    scores = ix.MaxKey().pool_scores(module=None, logits=logits, geometry=geometry, spec=spec, pools=pools,
                                     kv_heads=heads, hidden=None)
    mine = sel_kernel.select_pools(spec, scores, sel.candidate_pools(spec, geometry, pools), geometry.query_pos)
    compared = 0
    for h in range(heads):
        for q in range(block * local_blocks, t):  # from the first query with all its local blocks
            local = {q // block - i for i in range(local_blocks)}
            theirs = {int(j) for j in blocks[0, h, q] if j >= 0} - local
            assert set(mine[0, h, q].nonzero().flatten().tolist()) == theirs, (h, q)
            compared += len(theirs)
    assert compared > 50  # the comparison covered real choices, not only empty sets


def test_the_mean_indexer_scores_glm5s_own_pooled_keys():
    """transformers' Glm5NextTextIndexer, pooling gate and position offsets at their zero initialisation: its own
    pooled keys (`get_pooled_states`) scored by its own queries are the `mean` indexer's pool scores (q . mean k)
    on the same module's queries and keys; and the module's own top-k selection (one head with a positive weight,
    every q . k > 0 so that its ReLU is the identity) is the `mean` indexer's."""
    torch.manual_seed(0)
    pool, t, hidden_size, d = 4, 29, 16, 8
    module = ix.build_glm_indexers(hidden_size, 1, pool, 1, d)[0].eval()
    module.index_topk = 3 * pool  # three pools per query
    module.index_kpool_always_select_tail = False
    hidden = torch.randn(1, t, hidden_size)
    hidden[..., 0] = 1.0  # a constant channel: it sets the head weight and shifts every query
    with torch.no_grad():
        module.k_norm.bias.fill_(3.0)  # keys around +3 in every dimension ...
        module.wq_b.weight[:, 0] += 1.0  # ... and queries around +1: q . k > 0
        module.weights_proj.weight.zero_()
        module.weights_proj.weight[0, 0] = 1.0
        k = module.k_norm(module.wk(hidden))  # (1, T, D)
        q = module.wq_b(hidden).view(1, t, 1, d).transpose(1, 2)  # (1, 1, T, D)
        packed = torch.cat([k, torch.zeros_like(k), torch.ones(1, t, 1)], dim=-1)
        pool_keys, _, _ = module.get_pooled_states(packed_states=packed)  # (1, pools, D)
        theirs = q[:, 0] @ pool_keys.transpose(-1, -2)  # (1, T, pools)
        tokens = module(hidden, hidden, torch.ones(1, t, dtype=torch.bool), None)  # (1, T, 3 * pool) token ids
    pools = -(-t // pool)
    geometry = _plain(t)
    spec = sel.parse_selection(f"kpool:pool={pool},top=3,local={pool},sink=0,indexer=mean")
    mine = ix.MeanKey().pool_scores(module=None, logits=q @ k[:, None].transpose(-1, -2), geometry=geometry,
                                    spec=spec, pools=pools, kv_heads=1, hidden=None)[0, 0]  # (T, pools)
    complete = (torch.arange(pools)[None, :] + 1) * pool <= torch.arange(t)[:, None] + 1  # (T, pools)
    n = theirs.shape[-1]  # the module keeps complete pools only
    assert n == t // pool and (theirs > 0).all() and int(complete.sum()) > 90
    assert torch.allclose(mine[:, :n][complete[:, :n]], theirs[0][complete[:, :n]], atol=1e-5)
    chosen = sel_kernel.select_pools(spec, mine[None, None], complete, geometry.query_pos)[0, 0]  # (T, pools)
    for s in range(3 * pool, t):  # queries with at least the three complete pools they select
        assert set(chosen[s].nonzero().flatten().tolist()) == {int(x) // pool for x in tokens[0, s] if x >= 0}, s


@pytest.mark.slow
@needs_real_model
def test_the_bundled_indexers_rank_smollm2s_pools_as_they_did_when_trained():
    """The two distilled indexers shipped in checkpoints/indexers/, loaded from disk (float16) onto the real SmolLM2:
    on the held-out prose windows their training set aside (rebuilt from the recorded recipe), the top-K recall of
    the oracle's pools is the one indexer.json recorded (27% for an untrained indexer), and the KL is a fraction of
    a freshly initialised indexer's; the MiniMax-M3 one, trained on today's objective, reproduces its KL too."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from phasekv.training.distill_indexer import IndexerTraining, corpus, features, held_out

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(SMOL, gguf_file=SMOL_FILE)
    model = AutoModelForCausalLM.from_pretrained(SMOL, gguf_file=SMOL_FILE, dtype=torch.float32)
    for name in ("smollm2-kpool4", "smollm2-mm3-pool4"):
        loaded = ix.make_indexer(f"distilled:{Path(__file__).resolve().parents[1] / 'checkpoints' / 'indexers' / name}")
        recipe = {k: v for k, v in loaded.config["training"].items() if k != "kind"}
        minimax = loaded.config["kind"] == ix.MINIMAX_KIND
        cfg = IndexerTraining(**recipe, kind="minimax" if minimax else "glm5")
        windows = corpus(tokenizer, cfg.sequences + cfg.held_out, cfg.length, cfg.seed)[cfg.sequences:]
        feats = features(model, windows, cfg.pool, progress=False, groups=cfg.heads if minimax else 1)
        trained, fresh = held_out(loaded.modules, feats, cfg), held_out(ix.build_indexers(loaded.config), feats, cfg)
        recorded = loaded.config["held_out_after"]
        assert trained["recall_at_budget"] == pytest.approx(recorded["recall_at_budget"], abs=1e-3), name
        assert fresh["recall_at_budget"] < 0.3 < 0.5 < trained["recall_at_budget"], name
        assert trained["kl_per_layer"] < fresh["kl_per_layer"] / 3, name
        if minimax:
            assert trained["kl_per_layer"] == pytest.approx(recorded["kl_per_layer"], rel=1e-3)
