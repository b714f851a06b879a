"""DeepSeek-V4.1's CSA2 schedule (phasekv.compression.csa2): pooling, sharing, the two-level top-k, the schedule's
rules, and (once transformers ships it) parity with transformers' own model."""

import importlib

import pytest
import torch

from phasekv import build_model
from phasekv.cache import KVCache
from phasekv.compression import build
from phasekv.compression.csa2 import allowed_entries, candidate_blocks, candidate_blocks_reference
from phasekv.kernels import Visible, windowed_attention, windowed_attention_reference
from tests.helpers import COMPRESSOR_MATRIX, tiny

V41 = COMPRESSOR_MATRIX["deepseek_csa2-v41-schedule"]  # [sliding, 2 (source), 2 (reuses 1), 1 (source)]
SIX = dict(compressor="deepseek_csa2", num_hidden_layers=6, compress_ratios=[0, 2, 2, 1, 1, 1],
           layer_types=["sliding"] + ["deepseek_csa2"] * 5, kv_source_layer_ids=[1, 3], index_topk=3,
           index_heads=16, index_source_layer_ids=[1, 3, 5], candidate_source_layer_id=1, candidate_block_size=2,
           candidate_topk_blocks=2)


def _model(overrides, seed=0):
    torch.manual_seed(seed)
    model = build_model(tiny(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "compressor" in name:
                p.normal_(0, 0.5)  # non-trivial gates, biases and index scores
    return model


def _states(model, ids):
    """The per-forward state the layers shared (what the source layers published): a hook on each attention keeps
    a reference to the dict it was given."""
    seen = {}
    hooks = [layer.self_attn.register_forward_hook(lambda m, args, out: (seen.setdefault("state", args[3]), None)[1])
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return seen["state"]


@pytest.mark.parametrize("ratio", [1, 2])
def test_pooling_fast_equals_reference_and_ratio_one_is_a_projection(ratio):
    torch.manual_seed(0)
    config = tiny(compressor="deepseek_csa2", compress_ratios=[ratio, ratio])
    comp = build(config, "deepseek_csa2", layer=0)
    with torch.no_grad():
        for p in comp.parameters():
            p.normal_(0, 0.5)
        h = torch.randn(2, 11, config.hidden_size)
        fast, _ = comp.compress(h)
        ref, _ = comp.compress_reference(h)
    assert fast.shape[1] == 11 // ratio  # non-overlapping groups; a trailing partial group waits
    torch.testing.assert_close(fast, ref, rtol=1e-5, atol=1e-5)
    if ratio == 1:
        torch.testing.assert_close(fast.flatten(2), h @ comp.k_payload[0], rtol=1e-5, atol=1e-5)
    alpha = comp.gate_weights(h)["k"]  # (B, N, W, KVH, D): a softmax per channel over the group's tokens
    torch.testing.assert_close(alpha.sum(dim=2), torch.ones_like(alpha.sum(dim=2)))


def test_candidate_blocks_fast_equals_per_query_reference():
    torch.manual_seed(0)
    for N, block, keep in ((9, 2, 2), (16, 4, 1), (7, 8, 3), (12, 3, 10)):
        scores = torch.randn(2, 20, N)
        ends = torch.arange(N) * 2 + 1  # ratio-2 groups
        q_pos = torch.arange(5, 25)
        fast = candidate_blocks(scores, ends, q_pos, block, keep)
        assert torch.equal(fast, candidate_blocks_reference(scores, ends, q_pos, block, keep))


def test_candidate_blocks_come_from_complete_groups_only():
    scores = torch.zeros(1, 3, 6)
    scores[..., 4:] = 100.0  # the best entries are groups 4 and 5 (tokens 8..11), complete at 9 and 11
    ends = torch.arange(6) * 2 + 1
    blocks = candidate_blocks(scores, ends, torch.tensor([8, 9, 11]), block=2, keep=1)
    assert blocks[0].tolist() == [[True, False, False], [False, False, True], [False, False, True]]
    # query 8: group 4 (tokens 8, 9) is partial, so block 2 cannot be a candidate however high it scores


def test_attention_with_candidates_fast_equals_per_query_reference():
    torch.manual_seed(0)
    B, KVH, G, T, D, N, local = 1, 2, 2, 12, 8, 10, 3
    q, q_pos = torch.randn(B, KVH, G, T, D), torch.arange(8, 8 + T)
    k_all, v_all = torch.randn(B, KVH, local - 1 + T, D), torch.randn(B, KVH, local - 1 + T, D)
    k_pos = torch.arange(8 - local + 1, 8 + T)
    ends = torch.arange(N) * 2 + 1
    scores = torch.randn(B, T, N)
    allowed = allowed_entries(candidate_blocks(scores, ends, q_pos, 2, 2), ends - 1, 4)
    from phasekv.compression import Selection

    vis = Visible(torch.randn(B, KVH, N, D), torch.randn(B, KVH, N, D), ends, Selection(scores, 3, allowed))
    args = dict(local=local, vis=vis, sink=torch.randn(KVH * G), tail=None)
    fast = windowed_attention(q, q_pos, k_all, v_all, k_pos, block=5, **args)
    torch.testing.assert_close(fast, windowed_attention_reference(q, q_pos, k_all, v_all, k_pos, **args),
                               rtol=1e-5, atol=1e-5)


def test_partial_groups_wait_in_the_cache_and_reusing_layers_hold_no_entries():
    model = _model(V41)
    cache = KVCache()
    with torch.no_grad():
        model(torch.randint(0, 64, (1, 13)), cache=cache)
    src2, reuse, src1 = cache.layers[1], cache.layers[2], cache.layers[3]
    assert src2.entries_end.tolist() == [1, 3, 5, 7, 9, 11] and src2.pending_h.shape[1] == 1  # token 12 waits
    assert src1.entries_end.tolist() == list(range(13))  # ratio 1: every token is its own group
    assert reuse.entries_k is None and reuse.pending_h.shape[1] == 0  # layer 2 reads layer 1's cache
    assert not list(model.model.layers[2].self_attn.compressor.parameters())


def test_shared_layer_reads_its_source_cache_and_nothing_else():
    """Layer 2 reuses layer 1's compressed cache: replacing what layer 1 published changes layer 2's attention
    output for the same input; replacing layer 3's (a later source) or the sliding layer's changes nothing."""
    model = _model({**V41, "index_topk": 0})
    ids = torch.randint(0, 64, (1, 24))
    state = _states(model, ids)
    attn = model.model.layers[2].self_attn
    x = torch.randn(1, 24, 32)

    def out(st):
        with torch.no_grad():
            return attn(x, None, 0, st)

    base = out(dict(state))
    k, v, ends = state[("kv", 1)]
    knocked = {**state, ("kv", 1): (torch.zeros_like(k), torch.zeros_like(v), ends)}
    assert (out(knocked) - base).abs().amax() > 1e-3
    k3, v3, e3 = state[("kv", 3)]
    other = {**state, ("kv", 3): (torch.zeros_like(k3), torch.zeros_like(v3), e3), "unrelated": 1}
    torch.testing.assert_close(out(other), base, rtol=0, atol=0)


def test_two_level_topk_selects_only_inside_the_candidate_blocks():
    """Layers 3 and 5 (ratio-1 index sources after the candidate source, layer 1) pick their top-k only among
    visible entries inside the candidate blocks (2 blocks of 2 ratio-2 groups = 4 tokens); the per-query
    reference picks the same entries; layer 4 reuses layer 3's choice."""
    model = _model(SIX)
    T = 30
    ids = torch.randint(0, 64, (1, T))
    picks = {}
    for i in (1, 3, 4, 5):
        comp = model.model.layers[i].self_attn.compressor
        orig = comp.choose
        comp.choose = lambda *a, orig=orig, i=i, **kw: picks.setdefault(i, orig(*a, **kw))
    with torch.no_grad():
        model(ids)
    assert picks[4] is picks[3]
    q_pos = torch.arange(T)
    for i in (3, 5):
        sel = picks[i]
        blocks = _reference_blocks(picks[1].scores, q_pos, group=2, block=2, keep=2)
        for t in range(T):
            allowed = [j for j in range(t + 1) if j // 4 in blocks[t]]  # ratio-1 entries 0..t, 4-token blocks
            assert sel.allowed[0, t, :t + 1].nonzero().flatten().tolist() == allowed
            top = sorted(sorted(allowed, key=lambda j: -float(sel.scores[0, t, j]))[:3])
            from phasekv.kernels import _entry_mask

            got = _entry_mask(torch.arange(T), sel.rows(t, t + 1), q_pos[t:t + 1])[0, 0, 0]
            assert got.nonzero().flatten().tolist() == top
            assert all(j // 4 in blocks[t] for j in top)


def _reference_blocks(scores, q_pos, group, block, keep):
    """Per query: the candidate source's `keep` best blocks by their best complete group."""
    out = []
    for i, t in enumerate(q_pos.tolist()):
        best = {}
        for j in range(scores.shape[-1]):
            if j * group + group - 1 <= t:
                best[j // block] = max(best.get(j // block, float("-inf")), float(scores[0, i, j]))
        out.append(set(sorted(best, key=lambda b: -best[b])[:keep]))
    return out


def test_no_future_leakage_through_candidates_and_reused_topk():
    model = _model(SIX)
    T = 21
    ids = torch.randint(0, 64, (1, T))
    with torch.no_grad():
        base = model(ids)
        changed = ids.repeat(T, 1)
        for p in range(T):
            changed[p, p] = (ids[0, p] + 7) % 64
        out = model(changed)
    for p in range(T):
        torch.testing.assert_close(out[p, :p], base[0, :p], rtol=0, atol=1e-5)


def test_prefill_and_decode_equal_one_forward_when_chunks_cut_groups():
    model = _model(SIX)
    ids = torch.randint(0, 64, (2, 27))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache()
        pieces = [model(ids[:, :7], cache=cache)]  # 7: cuts the group (6, 7)
        pieces += [model(ids[:, t:t + 1], cache=cache) for t in range(7, 20)]
        pieces.append(model(ids[:, 20:], cache=cache))
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("overrides, field", [
    (dict(kv_source_layer_ids=[2, 3]), "kv_source_layer_ids"),  # layer 1 would reuse a source before any
    (dict(index_source_layer_ids=[3]), "index_source_layer_ids"),  # layer 1 would reuse a top-k before any
    (dict(candidate_block_size=3, compress_ratios=[0, 2, 2, 2]), "candidate_block_size"),  # fine: 2 | 6
    (dict(candidate_block_size=1, compress_ratios=[0, 1, 1, 2], kv_source_layer_ids=[1, 3]),
     "candidate_block_size"),  # ratio 2 of layer 3 does not divide the 1-token block of layer 1
    (dict(compress_ratios=[2, 2, 2, 1]), "compress_ratios"),  # layer 0 is sliding, not deepseek_csa2
    (dict(compress_ratios=[0, 2, 2]), "compress_ratios"),
    (dict(compress_ratios=[0, 2, 1, 1]), "compress_ratios"),  # layer 2 reuses layer 1's ratio-2 cache
    (dict(candidate_source_layer_id=2), "candidate_source_layer_id"),
])
def test_bad_schedules_are_refused_in_one_line_naming_the_field(overrides, field):
    if overrides.get("compress_ratios") == [0, 2, 2, 2]:
        tiny(**{**V41, **overrides})  # the valid neighbour of the case below
        return
    with pytest.raises(ValueError, match=rf"^model\.compressors\.deepseek_csa2\.{field}: [^\n]+$"):
        tiny(**{**V41, **overrides})


def test_training_with_the_indexer_is_refused_and_without_it_is_not():
    assert "index_topk" in build(tiny(**V41), "deepseek_csa2", layer=1).training_problem()
    assert build(tiny(**{**V41, "index_topk": 0}), "deepseek_csa2", layer=1).training_problem() is None


def test_parity_with_transformers_deepseek_v41():
    transformers = importlib.import_module("transformers")
    if not hasattr(transformers, "DeepseekV41ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no DeepseekV41ForCausalLM (deepseek_v41 is on "
                    "its main branch only): parity is tested once a release ships it")
    pytest.fail("transformers now ships DeepseekV41ForCausalLM: write the weight mapping and compare logits")


# layer 3 (ratio 2) re-scores layer 1's cache after index source 1: the injected bug borrows layer 1's index keys
DECODE = dict(compressor="deepseek_csa2", num_hidden_layers=5, compress_ratios=[0, 2, 2, 2, 1],
              layer_types=["sliding"] + ["deepseek_csa2"] * 4, kv_source_layer_ids=[1, 4], index_topk=2,
              index_heads=16, index_source_layer_ids=[1, 3, 4])


def test_decode_step_audit_flags_the_injected_parity_bug_and_passes_the_correct_model():
    """The reference-code deviation (incomplete-group decode steps scored with another layer's indexer keys) makes
    the cached greedy decode disagree with the full forward on phase-0 steps only; the correct model agrees on all."""
    import copy

    from phasekv.auditing.decode_local import decode_agreement

    model = _model(DECODE)
    buggy = copy.deepcopy(model)
    buggy.model.layers[3].self_attn.compressor.parity_bug = True
    prompts = [torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(n)) for n in range(9, 15)]
    ok = decode_agreement(model, model, prompts, steps=8, stride=2)
    bad = decode_agreement(buggy, model, prompts, steps=8, stride=2)
    assert ok["overall"]["agreement"] == 1.0
    by_phase = {r["phase"]: r["agreement"] for r in bad["per_phase"]}
    assert by_phase[0] < by_phase[1]  # no group completes at even positions: the borrowed keys change answers
    first = {r["phase"]: r["prompts"] for r in bad["first_disagreement_per_phase"]}
    assert first.get(0, 0) >= 2 and first.get(1, 0) == 0  # every first disagreement is on an even step
    with torch.no_grad():  # the full forward (prefill) never takes the buggy path
        ids = prompts[0][None]
        torch.testing.assert_close(buggy(ids), model(ids), rtol=0, atol=0)


def _decode_checkpoint(tmp_path):
    """A small DECODE-schedule checkpoint on the lookup vocabulary (random weights: the check needs no skill)."""
    from phasekv.checkpoint import save_checkpoint
    from phasekv.data import Vocabulary

    vocab = Vocabulary()
    model = _model({**DECODE, "vocab_size": vocab.size, "max_position_embeddings": 1024, "local_window": 8})
    tree = {"model": model.config.to_dict(), "data": {"n_records": 24, "local_window": 8}, "vocab": vocab.to_dict()}
    return save_checkpoint(tmp_path / "ckpt", model, tree)


@pytest.mark.parametrize("bug", [False, True])
def test_eval_engine_checks_decode_flags_the_parity_bug_and_passes_the_correct_model(tmp_path, monkeypatch, capsys,
                                                                                    bug):
    """`phasekv eval --checkpoint DIR --engine-checks decode`: the correct model's cached decode agrees with its full
    forward at every phase; the same checkpoint with the injected parity bug is flagged at phase 0 mod 2 only."""
    import json

    from phasekv.adapters import phasekv as native
    from phasekv.cli import main

    ckpt = _decode_checkpoint(tmp_path)
    if bug:
        made = native.PhaseKVAdapter.__init__

        def buggy(self, model, *args, **kwargs):
            model.model.layers[3].self_attn.compressor.parity_bug = True
            made(self, model, *args, **kwargs)

        monkeypatch.setattr(native.PhaseKVAdapter, "__init__", buggy)
    assert main(["eval", "--checkpoint", str(ckpt), "--residue-modulus", "4", "--clusters", "4", "--engine-checks",
                 "decode", "--decode-steps", "8", "--check-prompts", "12", "--no-progress", "--out",
                 str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "decode.json").read_text())
    assert result["stride"] == 2 and result["n_prompts"] == 12 and result["overall"]["n"] == 12 * 8
    printed = capsys.readouterr().out
    if bug:
        assert 0 in result["flagged_phases"] and "disagrees" in result["verdict"] and "disagrees" in printed
        assert result["first_phases"] == [0]  # every run of errors starts on a step where no group completes
        by_phase = {r["phase"]: r["agreement"] for r in result["per_phase"]}
        assert by_phase[0] < by_phase[1]
    else:
        assert result["flagged_phases"] == result["first_phases"] == [] and "agrees" in printed
        assert result["overall"]["agreement"] == 1.0
        # decode.json joined the published output as phasekv's own: --force replaces it
        assert main(["eval", "--checkpoint", str(ckpt), "--residue-modulus", "4", "--clusters", "4", "--engine-checks",
                     "decode", "--decode-steps", "1", "--check-prompts", "2", "--no-progress", "--force", "--out",
                     str(tmp_path / "out")]) == 0


def test_decode_verdict_flags_only_a_phase_wholly_below_the_floor():
    from phasekv.auditing.decode import share
    from phasekv.auditing.decode_local import decode_verdict

    def result(*phases):
        hits = [h for p in phases for h in p]
        return {"stride": 2, "overall": share(hits), "per_phase": [{"phase": i, **share(p)} for i, p in
                                                                   enumerate(phases)],
                "first_disagreement": {"per_phase": [{"phase": i, "prompts": 1} for i, p in enumerate(phases)
                                                     if not all(p)]}}

    one_slip = [True] * 199 + [False]  # a float near-tie: 99.5%, interval reaching above the floor
    assert decode_verdict(result([True] * 200, one_slip))["flagged_phases"] == []
    assert decode_verdict(result([True] * 180 + [False] * 20, [True] * 200))["flagged_phases"] == [0]
    assert decode_verdict(result([], []))["verdict"] == "no decode steps compared"


def test_eval_engine_checks_needs_a_checkpoint(tmp_path, capsys):
    from phasekv.cli import main

    (tmp_path / "m").mkdir()
    assert main(["eval", "--hf", str(tmp_path / "m"), "--engine-checks", "decode", "--out", str(tmp_path / "x")]) == 2
    assert "--engine-checks: applies to --checkpoint" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(tmp_path / "m"), "--engine-checks", "decode", "--decode-steps", "0",
                 "--out", str(tmp_path / "x")]) == 2
    assert "--decode-steps: must be >= 1" in capsys.readouterr().err


def test_audit_refuses_engine_checks_without_an_engine_and_names_the_checkpoint_check(tmp_path, capsys):
    from phasekv.cli import main

    (tmp_path / "m").mkdir()
    assert main(["audit", "--hf", str(tmp_path / "m"), "--engine-checks", "decode", "--out", str(tmp_path / "x")]) == 2
    assert "phasekv eval --checkpoint DIR --engine-checks decode" in capsys.readouterr().err
