"""MiniMax-M3 (`phasekv.archs.minimax_m3`) on tiny models of transformers' own MiniMaxM3VLForCausalLM: the
recomputed block scores select what the real indexer selects, the selection and the logits never read the future,
the dense warm-up makes the main attention dense (equal to full attention) and restores the top-k, the
distillation's rows are (batch, KV group) pairs with each group's own attention mass, and a config transformers
would accept but run wrong is refused in one line."""

import pytest
import torch

from phasekv import families
from phasekv.archs import architecture_of, geometry_of
from phasekv.archs.indexer_kl import dense_selection, distillation, indexers_of, kl_to_attention
from phasekv.archs.minimax_m3 import block_scores, candidate_blocks
from phasekv.config import TransformersModelConfig
from tests.test_archs import M3


def build(**over) -> torch.nn.Module:
    torch.manual_seed(0)
    fields = {**M3, "layer_types": ["minimax_m3_sparse"] * 2, "index_topk_blocks": 3, **over}
    return families.build(TransformersModelConfig("minimax_m3_vl_text", fields)).eval()


def ids_for(seed: int, batch: int = 2, length: int = 30) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def calls(model, ids) -> list[tuple]:
    """(indexer, its positional arguments, its output (B, H, S, k)) for every indexer call of one forward."""
    out = []
    handles = [ix.register_forward_hook(lambda m, a, o: out.append((m, a, o))) for _, ix, _ in indexers_of(model)]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return out


def selections(model, ids) -> list[torch.Tensor]:
    return [o for *_, o in calls(model, ids)]


def test_geometry_and_indexer_come_from_the_config():
    model = build(index_block_size=8, layer_types=["full_attention", "minimax_m3_sparse"])
    geometry = geometry_of(model)
    assert architecture_of(model).name == "minimax_m3"
    assert (geometry.name, geometry.window, geometry.stride, geometry.compressed_layers) == \
        ("minimax_m3_block_indexer", 8, 8, (1,))
    (_, indexer, kind), = indexers_of(model)
    assert (indexer.block_size, indexer.topk_blocks, indexer.local_blocks) == (8, 3, 1)
    assert kind.pool(indexer) == 8 and kind.groups(indexer) == 2
    assert geometry_of(build(index_block_size=1)) is None  # token-level selection: no grid
    assert geometry_of(build(layer_types=["full_attention"] * 2)) is None
    with torch.no_grad():
        assert torch.isfinite(model(ids_for(0)).logits).all()


def test_recomputed_block_scores_select_what_the_real_indexer_selects():
    model, ids = build(), ids_for(1)
    for indexer, args, picked in calls(model, ids):
        hidden, cos_sin, _, positions = args
        positions = positions.expand(hidden.shape[0], -1)
        with torch.no_grad():
            scores = block_scores(indexer, hidden, cos_sin, positions)
        assert scores.requires_grad is False and scores.shape[-1] == -(-ids.shape[1] // indexer.block_size)
        local = candidate_blocks(positions, scores.shape[-1], indexer.block_size, 0) & \
            ~candidate_blocks(positions, scores.shape[-1], indexer.block_size, indexer.local_blocks)
        boosted = scores.masked_fill(local[:, None], float("inf"))
        top, index = boosted.topk(picked.shape[-1], dim=-1)
        mine = index.masked_fill(top == float("-inf"), -1)
        assert torch.equal(mine.sort(-1).values, picked.sort(-1).values)
        with torch.no_grad():  # the last queries alone (an audit's continuation) score as the same rows of the whole
            last = block_scores(indexer, hidden, cos_sin, positions, queries=5)
        assert torch.allclose(last, scores[:, :, -5:], atol=1e-6) and last.shape[-2] == 5


def test_candidates_are_causal_blocks_without_the_local_ones():
    positions = torch.arange(12)[None]
    got = candidate_blocks(positions, 3, 4, 1)[0]  # blocks of 4: the own block is local
    assert not got[:4].any()  # block 0's queries: only their own (local) block exists
    assert got[4:8].tolist() == [[True, False, False]] * 4
    assert got[8:].tolist() == [[True, True, False]] * 4
    assert candidate_blocks(positions, 3, 4, 2)[0, 8:].tolist() == [[True, False, False]] * 4
    assert not candidate_blocks(positions, 3, 4, 1)[0, 4:8, 1].any()  # a query never selects its own block's future


def test_selection_and_logits_never_read_the_future():
    model, ids = build(), ids_for(2)
    cut = 17  # inside a block: the keys after it share the query's block
    changed = ids.clone()
    changed[:, cut:] = (changed[:, cut:] + 1) % 256
    for a, b in zip(selections(model, ids), selections(model, changed), strict=True):
        assert torch.equal(a[:, :, :cut], b[:, :, :cut])
        assert (a[:, :, :cut] <= torch.arange(cut)[None, None, :, None] // 4).all()  # no block after the query's
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits[:, :cut], model(changed).logits[:, :cut], rtol=0, atol=1e-5)


def test_selection_matters_and_the_dense_warmup_is_full_attention():
    sparse, ids = build(index_topk_blocks=2), ids_for(3)
    full = build(layer_types=["full_attention"] * 2)
    full.load_state_dict(sparse.state_dict(), strict=False)  # the same weights, no indexers
    with torch.no_grad():
        reference, narrow = full(ids).logits, sparse(ids).logits
        assert (narrow - reference).abs().max() > 1e-3  # 2 of 8 blocks: selection drops keys
        with dense_selection(sparse, ids.shape[1]) as changed:
            assert changed == 2 and [ix.topk_blocks for _, ix, _ in indexers_of(sparse)] == [8, 8]
            dense = sparse(ids).logits
    torch.testing.assert_close(dense, reference, rtol=0, atol=1e-5)
    assert [ix.topk_blocks for _, ix, _ in indexers_of(sparse)] == [2, 2]


def test_distillation_rows_are_batch_and_group_with_each_groups_attention_mass():
    model, ids = build(), ids_for(4, batch=3)
    try:
        with distillation(model.train()) as state:
            families.logits(model, ids)
            records = list(state.records.values())
            probs = list(state.attention.values())
            loss = state.loss(keep=True)
    finally:
        model.eval()
    assert len(records) == 2 and torch.isfinite(loss) and loss.item() >= 0
    expected = 0.0
    for record, p in zip(records, probs, strict=True):
        assert record.groups == 2 and record.scores.shape == (3 * 2, 30, 8) and record.scores.requires_grad
        assert record.pools.shape == (6, 8, 4) and (record.pools[:, -1, 2:] == -1).all()  # 30 keys: 2 slots past
        assert record.used.any() and not (record.used & ~record.candidates).any()
        # group 1 of row 0 is record row 1; its mass over block 0 is heads 2-3's attention on keys 0-3
        grouped = torch.stack([p.detach()[b, 2 * g:2 * g + 2].sum(0) for b in range(3) for g in range(2)])
        pooled = torch.nn.functional.pad(grouped.float(), (0, 2)).view(6, 30, 8, 4).sum(-1)
        expected = expected + kl_to_attention(record.scores, record.used, pooled)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    grads = [p.grad for _, ix, _ in indexers_of(model) for p in ix.parameters()]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    others = [p for n, p in model.named_parameters() if ".indexer." not in n]
    assert all(p.grad is None for p in others)  # the objective reaches the indexers only


def test_an_indexer_with_other_heads_than_kv_groups_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^model.index_n_heads: must divide num_key_value_heads=2 .*got 4\)?$"):
        build(index_n_heads=4)
    assert build(index_n_heads=1) is not None  # one indexer head for both KV groups: whole groups
    assert build(index_n_heads=4, layer_types=["full_attention"] * 2) is not None  # no indexer: nothing to check
