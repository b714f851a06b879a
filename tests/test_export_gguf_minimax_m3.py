"""GGUF export of MiniMax-M3 (phasekv.export.gguf_minimax_m3): the widening to llama.cpp's layer plan and groups keeps
the function, the file holds llama.cpp's `minimax-m3` names with the (1 + w) norms baked, unsupported configs are
refused in one line, and the real llama-server (b11434, `make engine`) serves the export with transformers'
next-token log-probabilities and greedy continuations on the same weights, on prompts below and past the indexer's
top-k budget (index_topk_blocks x index_block_size tokens)."""

import copy

import httpx
import pytest
import torch

from phasekv.engines import process as launch
from phasekv.export import gguf as eg
from phasekv.export import gguf_minimax_m3 as em
from tests.engine import llama_server
from tests.test_export_gguf import (
    STRICT,
    assert_refused,
    grown_prompts,
    logprobs,
    needs_gguf,
    needs_server,
    random_prompts,
    served_gap,
    tiny_vocab,
)

SPARSE, FULL = em.SPARSE, em.FULL
# llama.cpp runs MiniMax Sparse Attention only with flash attention: the strict setting keeps it on, f32 cache
STRICT_FA = ("-fa", "on", "-ctk", "f32", "-ctv", "f32")
BLOCK, TOPK = 8, 3  # the tiny models' indexer: the budget is 24 tokens, the 25th query is the first to drop a block
BUCKETS = {"below the budget (8-24)": (8, 16, 24), "just past it (25-40)": (25, 26, 32, 40),
           "far past it (64-400)": (64, 128, 200, 400)}


def tiny_m3(seed: int = 0, **overrides):
    """A small random MiniMax-M3 (2 KV groups, 1 indexer head, blocks of 8, top-3 blocks, 1 local block; layers:
    sparse + MoE, sparse + dense MLP) with every parameter drawn, so that each tensor the export moves changes the
    logits."""
    from transformers.models.minimax_m3_vl import MiniMaxM3VLTextConfig

    from phasekv import families

    fields = dict(vocab_size=32, hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, dense_intermediate_size=24, shared_intermediate_size=16,
                  num_local_experts=4, num_experts_per_tok=2, index_n_heads=1, index_head_dim=16,
                  index_block_size=BLOCK, index_topk_blocks=TOPK, index_local_blocks=1, layer_types=[SPARSE, SPARSE],
                  mlp_layer_types=["sparse", "dense"], max_position_embeddings=512, bos_token_id=0, eos_token_id=1,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                  tie_word_embeddings=False)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = families.build(MiniMaxM3VLTextConfig(**fields))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model.eval()


def dense_lead(seed: int = 3):
    """tiny_m3 with a leading full-attention layer (dense MLP) before two sparse MoE layers."""
    return tiny_m3(seed, num_hidden_layers=3, layer_types=[FULL, SPARSE, SPARSE],
                   mlp_layer_types=["dense", "sparse", "sparse"])


def unselective(model):
    """`model` with a top-k larger than any prompt's blocks: the dense attention the same weights compute."""
    dense = copy.deepcopy(model)
    for layer in dense.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.topk_blocks = 10_000
    return dense


def length_prompts(lengths, vocab_size: int = 32) -> list[list[int]]:
    return [random_prompts(1, vocab_size, n - 1, n, seed=n)[0] for n in lengths]


def greedy(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(logprobs(model, out).argmax()))
    return out[len(ids):]


def served_greedy(url: str, ids: list[int], n: int) -> list[int]:
    answer = httpx.post(f"{url}/completion", timeout=120, json={
        "prompt": ids, "n_predict": n, "temperature": -1, "ignore_eos": True, "return_tokens": True,
        "cache_prompt": False}).json()
    return answer["tokens"]


# ---------------------------------------------------------------------------------------------- widening


def test_widening_keeps_the_function_and_a_wrong_widening_does_not():
    model = tiny_m3()
    wide = em.widen(model)
    c = wide.config
    assert (c.num_key_value_heads, c.index_n_heads, c.mlp_layer_types) == (2, 2, ["sparse", "sparse"])
    assert c.shared_intermediate_size == 32  # the dense MLP (24) as the shared expert, in whole experts of 16
    assert em.widen(wide) is wide
    prompts = length_prompts((20, 40, 100, 200))  # past the 24-token budget but the first
    for p in prompts:
        assert (logprobs(model, p) - logprobs(wide, p)).abs().max() < 1e-5  # measured 0 (the same sums)
    broken = copy.deepcopy(wide)  # the two KV heads of layer 0 swapped: each group reads the other's keys
    with torch.no_grad():
        k = broken.model.layers[0].self_attn.k_proj.weight
        k.copy_(k.roll(16, dims=0))
    assert max((logprobs(model, p) - logprobs(broken, p)).abs().max().item() for p in prompts) > 1e-2


def test_a_model_without_moe_layers_gets_one_zero_expert():
    model = tiny_m3(mlp_layer_types=["dense", "dense"])
    wide = em.widen(model)
    assert (wide.config.num_local_experts, wide.config.intermediate_size, wide.config.shared_intermediate_size) == (
        1, 24, 24)
    for p in length_prompts((30, 90)):
        assert (logprobs(model, p) - logprobs(wide, p)).abs().max() < 1e-5


def test_check_exportable_refuses_what_llama_cpp_cannot_run_in_one_line():
    config = dense_lead().config
    em.check_exportable(config)
    cases = [(dict(layer_types=[SPARSE, FULL, SPARSE]), "model.layer_types: .* layer 1 is 'full_attention'"),
             (dict(mlp_layer_types=["sparse", "sparse", "sparse"]), "model.mlp_layer_types: .* layer 0 is 'sparse'"),
             (dict(layer_types=[FULL] * 3, mlp_layer_types=["dense"] * 3),
              "model.layer_types: no minimax_m3_sparse layer"),
             (dict(index_head_dim=4), "model.index_head_dim: .* first 8 channels"),
             (dict(swiglu_limit=10.0), "model.swiglu_alpha/swiglu_limit"),
             (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}), "model.rope_parameters"),
             (dict(model_type="deepseek_v32"), "model.model_type")]
    assert_refused(em.check_exportable, config, cases)


# ---------------------------------------------------------------------------------------------- the file


@needs_gguf
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_the_file_holds_llama_cpp_names_and_the_baked_norms(dtype, tmp_path):
    import gguf
    import numpy as np

    wide = em.widen(dense_lead())
    eg.write_gguf(wide, tiny_vocab(), tmp_path / "tiny.gguf", dtype)
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    stored = {t.name: t for t in reader.tensors}
    assert sorted(stored) == sorted(name for name, _, _ in em.gguf_tensors(wide))
    assert {"blk.0.ffn_gate.weight", "blk.1.indexer.q_proj.weight", "blk.2.ffn_up_shexp.weight"} <= set(stored)
    assert "blk.0.indexer.k_proj.weight" not in stored  # the leading full-attention layer has no indexer
    norm = wide.model.layers[1].self_attn.indexer.q_norm.weight.detach()
    np.testing.assert_array_equal(np.asarray(stored["blk.1.indexer.q_norm.weight"].data), (norm + 1).numpy())
    gate_up = wide.model.layers[0].mlp.gate_up_proj.weight.detach()  # (2 x 24, 32): gate rows, then up rows
    up = gate_up[24:].half() if dtype == "f16" else gate_up[24:]
    np.testing.assert_array_equal(np.asarray(stored["blk.0.ffn_up.weight"].data).reshape(24, 32), up.numpy())
    f32 = {n for n, t in stored.items() if t.tensor_type == gguf.GGMLQuantizationType.F32 and len(t.shape) >= 2}
    assert "blk.1.indexer.q_proj.weight" in f32 and (dtype == "f32") == ("blk.1.attn_q.weight" in f32)

    def field(key):
        return reader.fields[key].parts[-1].tolist()

    assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "minimax-m3"
    for key, value in [("leading_dense_block_count", 1), ("attention.indexer.block_size", BLOCK),
                       ("attention.indexer.top_k", TOPK), ("attention.indexer.head_count", 2),
                       ("rope.dimension_count", 8), ("expert_shared_count", 1), ("expert_feed_forward_length", 16)]:
        assert field(f"minimax-m3.{key}") == [value], key


@needs_gguf
def test_the_command_exports_a_minimax_checkpoint(tmp_path):
    from phasekv.checkpoint import save_checkpoint

    model, vocab = tiny_m3(), tiny_vocab()
    fields = {k: v for k, v in model.config.to_diff_dict().items() if k in type(model.config)().to_dict()}
    save_checkpoint(tmp_path / "ckpt", model, {"model": {**fields, "model_type": "minimax_m3_vl_text"},
                                               "vocab": vocab.to_dict()})
    summary = eg.export_gguf(tmp_path / "ckpt", tmp_path / "m3.gguf", hf_out=tmp_path / "hf")
    assert summary["widened"]["index_n_heads"] == [1, 2] and (tmp_path / "m3.gguf").is_file()
    from transformers import AutoModelForCausalLM

    twin = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    p = length_prompts((60,))[0]
    assert (logprobs(model, p) - logprobs(twin, p)).abs().max() < 1e-5


# ---------------------------------------------------------------------------------------------- the real server


def bucket_gaps(url: str, reference) -> dict[str, tuple[float, int]]:
    """(max log-prob gap, greedy tokens that differ) per length bucket of BUCKETS."""
    return {name: served_gap(url, reference, length_prompts(lengths))[:2] for name, lengths in BUCKETS.items()}


@needs_server
def test_llama_server_agrees_with_transformers_below_and_past_the_budget(tmp_path):
    """All layers sparse: with flash attention on and an f32 cache llama.cpp's block selection is transformers'
    to float32 precision in every length bucket, across ubatch boundaries (30 tokens: blocks of 8 straddle them),
    continuing from its cache (batch and one-token decode paths) and in greedy continuations."""
    wide = em.widen(tiny_m3())
    eg.write_gguf(wide, tiny_vocab(), tmp_path / "m3.gguf")
    with llama_server(tmp_path / "m3.gguf", slots=1, context=512, extra=(*STRICT_FA, "-ub", "30", "-b", "30")) as url:
        for name, (gap, differ) in bucket_gaps(url, wide).items():
            assert gap < 1e-4 and differ == 0, name  # measured 1e-6 to 3e-6 in each bucket
        prompts = random_prompts(2, 32, 40, 60, seed=5)
        grown = grown_prompts(prompts[0][:20], prompts[1], (1, 5, 13, 40))  # 20 -> 79 tokens, 1-token steps too
        gap, differ, cached = served_gap(url, wide, grown, cache=True)
        assert gap < 1e-4 and differ == 0 and cached >= sum(map(len, grown[:-1]))
        for p in length_prompts((20, 60)):  # 16 greedy tokens: the decode path, its blocks completing as it goes
            assert served_greedy(url, p, 16) == greedy(wide, p, 16)
    with llama_server(tmp_path / "m3.gguf", slots=1, context=512) as url:  # server defaults: f16 cache, fa auto
        for name, (gap, differ) in bucket_gaps(url, wide).items():
            assert gap < 0.05 and differ <= 1, name  # measured up to 4.7e-3, none differ


@needs_server
def test_a_leading_full_attention_layer_runs_flash_attention_in_f16(tmp_path):
    """A leading full-attention layer goes through llama.cpp's ordinary attention, which casts an f32 cache to f16
    for flash attention (llm_graph_context::build_attn_mha): 1e-3 where the sparse layers alone give 1e-6."""
    wide = em.widen(dense_lead())
    eg.write_gguf(wide, tiny_vocab(), tmp_path / "m3.gguf")
    with llama_server(tmp_path / "m3.gguf", slots=1, context=512, extra=STRICT_FA) as url:
        gaps = bucket_gaps(url, wide)
    assert all(gap < 0.05 and differ == 0 for gap, differ in gaps.values()), gaps  # measured up to 3.1e-3
    assert max(gap for gap, _ in gaps.values()) > 1e-4  # the f16 cast: fails once llama.cpp keeps f32 there


@needs_server
def test_the_indexer_is_live_in_llama_cpp(tmp_path):
    """Negative control: the indexer's queries negated in the file change nothing below the budget (every block is
    kept) and the answer past it, so agreement above is llama.cpp following the indexer."""
    wide = em.widen(tiny_m3())
    broken = copy.deepcopy(wide)
    with torch.no_grad():
        for layer in broken.model.layers:
            layer.self_attn.indexer.q_proj.weight.neg_()
    eg.write_gguf(broken, tiny_vocab(), tmp_path / "broken.gguf")
    with llama_server(tmp_path / "broken.gguf", slots=1, context=512, extra=STRICT_FA) as url:
        gaps = bucket_gaps(url, wide)
    below, *past = gaps.values()
    assert below[0] < 1e-4 and all(gap > 1e-2 for gap, _ in past), gaps  # measured 1.8e-6; 5.9 and 5.7


@needs_server
def test_llama_cpp_runs_dense_attention_without_flash_attention(tmp_path):
    """A divergence of llama.cpp b11434: with flash attention off (`-fa off`) minimax-m3 warns and runs every layer
    dense.  The served model then equals the same weights without selection (to float32) and departs from
    transformers' sparse model past the budget.  A llama.cpp that selects without flash attention fails this test."""
    wide = em.widen(tiny_m3())
    eg.write_gguf(wide, tiny_vocab(), tmp_path / "m3.gguf")
    with llama_server(tmp_path / "m3.gguf", slots=1, context=512, extra=STRICT) as url:
        sparse, dense = bucket_gaps(url, wide), bucket_gaps(url, unselective(wide))
    assert all(gap < 1e-4 for gap, _ in dense.values()), dense
    below, *past = sparse.values()
    assert below[0] < 1e-4 and all(gap > 1e-2 for gap, _ in past), sparse


@needs_server
def test_llama_cpp_dies_on_fewer_indexer_heads_than_kv_groups(tmp_path):
    """Why `widen` repeats heads: one indexer head for two KV groups, written as it is, kills llama-server b11434
    while it reserves its graph (GGML_ASSERT(HKV == Hd) in llama_model_minimax_m3::graph).  A llama.cpp that runs it
    fails this test: the group widening can go."""
    model = tiny_m3(mlp_layer_types=["sparse", "sparse"])  # nothing else to widen
    assert em.wide_config(model.config).index_n_heads == 2
    eg.write_gguf(model, tiny_vocab(), tmp_path / "as-is.gguf")
    with pytest.raises(launch.EngineDied, match="killed by SIGABRT"), llama_server(tmp_path / "as-is.gguf", slots=1,
                                                                                 context=512, startup_s=60):
        pass


@needs_server
def test_llama_cpp_runs_dense_attention_with_a_unified_cache_of_several_slots(tmp_path):
    """Another divergence of llama.cpp b11434: with several slots (-np 2) the default per-slot cache streams select
    as transformers does, but a unified cache (--kv-unified) makes minimax-m3 warn and run dense (block anchoring
    needs one slot space per sequence): the same weights without selection (to the f16 cast of its ordinary
    attention), not MiniMax-M3, past the budget.  A llama.cpp that selects in a unified cache fails this test."""
    wide = em.widen(tiny_m3())
    eg.write_gguf(wide, tiny_vocab(), tmp_path / "m3.gguf")
    with llama_server(tmp_path / "m3.gguf", slots=2, context=1024, extra=STRICT_FA) as url:
        streams = bucket_gaps(url, wide)
    assert all(gap < 1e-4 for gap, _ in streams.values()), streams  # measured 1.8e-6 to 3.2e-6
    with llama_server(tmp_path / "m3.gguf", slots=2, context=1024, extra=(*STRICT_FA, "--kv-unified")) as url:
        sparse, dense = bucket_gaps(url, wide), bucket_gaps(url, unselective(wide))
    assert all(gap < 2e-2 for gap, _ in dense.values()), dense  # measured 1.6e-3 to 4.7e-3
    below, *past = sparse.values()
    assert below[0] < 2e-2 and all(gap > 1e-1 for gap, _ in past), sparse  # measured 4.7e-3; 6.2 and 4.6
