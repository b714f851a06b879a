"""The distilled MiniMax-M3 indexer (`phasekv train-indexer --kind minimax`, `indexer=distilled:DIR` of kind
minimax_m3_block): the audit scores pools with transformers' own MiniMaxM3VLIndexer block scores, a trained one
saves and loads whole, and it refuses one selection shared by all heads."""

import pytest
import torch

from phasekv.conditions.selection import pooled as sel
from phasekv.conditions.selection import scorers as ix
from tests.helpers import tiny_causal_lm
from tests.test_selection import _distilled_dir, _Layer, _plain


def test_the_audit_scores_pools_with_minimax_m3s_own_block_scores(tmp_path, monkeypatch):
    """The distilled minimax indexer's pool scores in the audit path (`Distilled.pool_scores`, one group per KV
    head) are the block scores MiniMaxM3VLIndexer.forward computes itself (read where it ranks them), with its
    RoPE from its own rotary embedding at positions 0 .. T-1 and no local boost."""
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLRotaryEmbedding

    t, pool = 37, 4
    directory = _distilled_dir(tmp_path, hidden=16, layers=1, pool=pool, kind="minimax")
    spec = sel.parse_selection(f"kpool:pool={pool},top=2,local={pool},heads=kv,indexer=distilled:{directory}")
    indexer = ix.make_indexer(spec.indexer)
    hidden = torch.randn(1, t, 16)
    pools = -(-t // pool)
    logits = torch.zeros(1, 4, t, t)  # 4 query heads in 2 KV groups; the distilled indexer does not read them
    mine = indexer.pool_scores(module=_Layer(), logits=logits, geometry=_plain(t), spec=spec, pools=pools,
                               kv_heads=2, hidden=hidden)
    module = indexer.modules[0]
    module.topk_blocks = pools  # rank every block
    ranked = {}
    topk = torch.Tensor.topk
    monkeypatch.setattr(torch.Tensor, "topk", lambda self, *a, **k: (ranked.setdefault("scores", self.clone()),
                                                                     topk(self, *a, **k))[1])
    position_ids = torch.arange(t)[None]
    with torch.no_grad():
        module(hidden, MiniMaxM3VLRotaryEmbedding(module.config)(hidden, position_ids), None, position_ids)
    theirs = ranked["scores"]  # (1, H, T, blocks)
    assert mine.shape == theirs.shape == (1, 2, t, pools)
    assert torch.equal(mine.isinf(), theirs.isinf()) and int(mine.isfinite().sum()) > 300
    assert torch.allclose(mine.nan_to_num(0, 0, 0), theirs.nan_to_num(0, 0, 0), atol=1e-5)


def test_a_trained_minimax_indexer_saves_loads_and_needs_heads_kv(tmp_path):
    """train-indexer --kind minimax end to end on a tiny Llama (a character tokenizer over the prose corpus): the
    config records the kind, one head per KV group and the RoPE theta; the loaded modules give the held-out numbers
    the trained ones had; heads=shared is refused in one line, heads=kv accepted."""
    from phasekv.training.distill_indexer import IndexerTraining, corpus, features, held_out, train_indexer

    class Characters:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) % 50 for c in text]}

    model = tiny_causal_lm("llama", 50, 256, "sdpa")
    cfg = IndexerTraining(kind="minimax", pool=4, heads=2, head_dim=8, sequences=4, held_out=2, length=48, steps=20,
                          batch=2, lr=3e-3, local=4)
    config = train_indexer(model, Characters(), tmp_path, cfg, model_name="tiny", progress=False)
    assert (config["kind"], config["heads"], config["rope_theta"]) == (ix.MINIMAX_KIND, 2, 10000.0)
    assert config["held_out_after"]["kl_per_layer"] < config["held_out_before"]["kl_per_layer"]
    loaded = ix.make_indexer(f"distilled:{tmp_path}")
    assert loaded.config["kind"] == ix.MINIMAX_KIND
    sequences = corpus(Characters(), cfg.sequences + cfg.held_out, cfg.length, cfg.seed)[cfg.sequences:]
    again = held_out(loaded.modules, features(model, sequences, 4, progress=False, groups=2), cfg)
    assert again == pytest.approx(config["held_out_after"], rel=1e-5)
    with pytest.raises(ValueError, match="MiniMax-M3 indexer .* needs heads=kv, not heads=shared") as caught:
        sel.parse_selection(f"kpool:pool=4,top=2,local=4,indexer=distilled:{tmp_path}")
    assert "\n" not in str(caught.value)
    assert sel.parse_selection(f"kpool:pool=4,top=2,local=4,heads=kv,indexer=distilled:{tmp_path}").heads == "kv"
    with pytest.raises(ValueError, match="blocks start at position 0: grid=jitter is not supported"):
        sel.parse_selection(f"kpool:pool=4,top=2,local=4,heads=kv,grid=jitter,indexer=distilled:{tmp_path}")
    with pytest.raises(ValueError, match="no moved grid"):  # the scorer refuses too, should a spec slip through
        ix.indexer_pool_scores(loaded.modules[0], torch.zeros(1, 8, 256), origins=torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="one indexer head per KV group: heads must be 2, got 3"):
        train_indexer(model, Characters(), tmp_path / "other", IndexerTraining(kind="minimax", heads=3, length=48),
                      model_name="tiny", progress=False)
