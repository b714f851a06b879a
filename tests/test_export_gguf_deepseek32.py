"""GGUF export of DeepSeek-V3.2 (phasekv.export.gguf_deepseek32): the indexer widening keeps its scores, the file holds
llama.cpp's `deepseek32` names, unsupported configs are refused in one line, and the real llama-server (b11434, `make
engine`) serves the export with transformers' next-token log-probabilities on the same weights: the trained
checkpoints/dsv32-dsa and a random model with dense and MoE layers, on prompts past the indexer's top-k."""

import copy

import pytest
import torch

from phasekv.archs.deepseek_v32 import scores
from phasekv.engines import process as launch
from phasekv.export import gguf as eg
from phasekv.export import gguf_deepseek32 as e32
from tests.engine import llama_server
from tests.test_export_gguf import (
    STRICT,
    assert_refused,
    export_twin,
    grown_prompts,
    logprobs,
    needs_gguf,
    needs_server,
    random_prompts,
    served_gap,
    tiny_vocab,
)

CHECKPOINT = "checkpoints/dsv32-dsa"


def tiny_v32(seed: int = 0, **overrides):
    """A small random DeepSeek-V3.2 (a dense layer, then a MoE layer; indexer heads of 16 channels, top-8) with every
    parameter drawn, so that each tensor the export moves changes the logits."""
    from transformers import DeepseekV32Config

    from phasekv import families

    fields = dict(vocab_size=32, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8,
                  qk_rope_head_dim=8, v_head_dim=8, index_n_heads=16, index_head_dim=16, index_topk=8,
                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                  first_k_dense_replace=1, max_position_embeddings=512, tie_word_embeddings=False)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = families.build(DeepseekV32Config(**fields))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.3 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model.eval()


def indexer_scores(model, ids: list[int]) -> list[torch.Tensor]:
    """Each layer's lightning-indexer scores (B, S, T) for `ids`, recomputed from the inputs its forward received."""
    seen, hooks = [], []
    for layer in model.model.layers:
        def keep(module, args, kwargs):
            hidden, q_resid, cos_sin = (list(args) + [None] * 3)[:3]
            seen.append(scores(module, hidden, q_resid, cos_sin if cos_sin is not None
                               else kwargs["position_embeddings"]))
        hooks.append(layer.self_attn.indexer.register_forward_pre_hook(keep, with_kwargs=True))
    try:
        logprobs(model, ids)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


# ---------------------------------------------------------------------------------------------- widening


def test_widening_keeps_the_indexer_scores_and_a_zero_padding_does_not():
    model = tiny_v32()
    wide = e32.widen(model)
    assert wide.config.index_head_dim == 64 and e32.widen(wide) is wide
    prompts = random_prompts(3, 32, 20, 60, seed=1)  # 20+ tokens: the indexer keeps 8 of 20+
    for ids in prompts:
        for a, b in zip(indexer_scores(model, ids), indexer_scores(wide, ids)):
            assert (a - b).abs().max() <= 1e-5 * a.abs().max()
        assert (logprobs(model, ids) - logprobs(wide, ids)).abs().max() < 1e-5
    zero = copy.deepcopy(wide)  # key rows padded with zeros: the LayerNorm's mean and variance move
    with torch.no_grad():
        for layer in zero.model.layers:
            layer.self_attn.indexer.wk.weight[16:] = 0
    a, b = indexer_scores(model, prompts[0])[0], indexer_scores(zero, prompts[0])[0]
    assert (a - b).abs().max() > 1e-2 * a.abs().max()


def test_indexer_dim_repeats_whole_heads_and_avoids_the_latent_width():
    config = tiny_v32().config
    assert e32.indexer_dim(config) == 64
    config.index_head_dim, config.kv_lora_rank, config.qk_rope_head_dim = 48, 184, 8  # lcm 192 = the latent's width
    assert e32.indexer_dim(config) == 384


def test_check_exportable_refuses_what_the_export_cannot_run_exactly_in_one_line():
    config = tiny_v32().config
    e32.check_exportable(config)
    cases = [(dict(rms_norm_eps=1e-5), "model.rms_norm_eps"), (dict(n_group=2), "model.n_group"),
             (dict(mlp_layer_types=["sparse", "dense"]), "model.mlp_layer_types: .* dense layers must come first"),
             (dict(attention_bias=True), "model.attention_bias"),
             (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "model.rope_parameters")]
    assert_refused(e32.check_exportable, config, cases)


# ---------------------------------------------------------------------------------------------- the file


@needs_gguf
def test_the_file_holds_the_split_latent_projection_under_llama_cpp_names(tmp_path):
    import gguf
    import numpy as np

    wide = e32.widen(tiny_v32())
    eg.write_gguf(wide, tiny_vocab(), tmp_path / "tiny.gguf")
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    stored = {t.name: np.asarray(t.data) for t in reader.tensors}
    expected = e32.gguf_tensors(wide)
    assert sorted(stored) == sorted(name for name, _, _ in expected)
    assert {"blk.0.ffn_gate.weight", "blk.1.ffn_gate_exps.weight", "blk.1.exp_probs_b.bias"} <= set(stored)
    kv_b = wide.model.layers[0].self_attn.kv_b_proj.weight.detach().view(2, 16, 16)  # (heads, nope + v, kv_lora)
    k_b = stored["blk.0.attn_k_b.weight"].reshape(2, 16, 8)  # (heads, kv_lora, nope)
    np.testing.assert_array_equal(k_b, kv_b[:, :8].transpose(1, 2).numpy())
    np.testing.assert_array_equal(stored["blk.0.attn_v_b.weight"].reshape(2, 8, 16), kv_b[:, 8:].numpy())
    field = reader.fields["general.architecture"]
    assert bytes(field.parts[field.data[0]]).decode() == "deepseek32"
    for key, value in [("deepseek32.leading_dense_block_count", 1), ("deepseek32.attention.indexer.key_length", 64),
                       ("deepseek32.attention.key_length", 24), ("deepseek32.attention.head_count_kv", 1)]:
        assert reader.fields[key].parts[-1].tolist() == [value]


def test_export_refuses_a_v32_config_llama_cpp_would_run_differently(tmp_path, monkeypatch):
    from phasekv.config import TransformersModelConfig

    real = TransformersModelConfig.to_hf

    def looser(self):  # the checkpoint's config, with an epsilon the latent norms do not use
        config = real(self)
        config.rms_norm_eps = 1e-5
        return config

    monkeypatch.setattr(TransformersModelConfig, "to_hf", looser)
    with pytest.raises(ValueError, match="model.rms_norm_eps"):
        eg.export_gguf(CHECKPOINT, tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()


# ---------------------------------------------------------------------------------------------- the real server


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """checkpoints/dsv32-dsa exported (f32, with its transformers twin) and that twin loaded."""
    return export_twin(tmp_path_factory.mktemp("gguf32"), CHECKPOINT)


@needs_server
@pytest.mark.slow
def test_llama_server_agrees_with_transformers_on_the_trained_checkpoint(exported):
    """Prompts of 20-200 tokens, past the indexer's top-32; ubatches of 30 tokens split the prompts."""
    root, reference = exported
    prompts = random_prompts(8, 210, 20, 200, seed=1)
    # the length axis: one prompt per length, from below the top-32 budget to past the training length (106)
    lengths = [random_prompts(1, 210, n - 1, n, seed=n)[0] for n in (31, 32, 33, 34, 64, 128, 256, 448)]
    with llama_server(root / "dsv32-dsa.gguf", slots=1, context=512, extra=(*STRICT, "-ub", "30", "-b", "30")) as url:
        gap, differ, _ = served_gap(url, reference, prompts)
        # measured 1.6e-4: transformers' own float32 vs float64 on these prompts differs by 1.2e-4
        assert gap < 5e-4 and differ == 0
        gap, differ, _ = served_gap(url, reference, lengths)
        assert gap < 5e-4 and differ == 0
        grown = grown_prompts(prompts[0][:30], prompts[1], (1, 5, 13, 40))  # the indexer scores cached keys
        gap, differ, cached = served_gap(url, reference, grown, cache=True)
        # every prompt continues the last; the first also finds its 30 tokens, prompt 0's start, in the server's
        # RAM prompt cache (measured: 146 = 116 + 30)
        assert gap < 5e-4 and differ == 0 and cached == sum(map(len, grown[:-1])) + 30
    with llama_server(root / "dsv32-dsa.gguf", slots=1, context=512) as url:  # server defaults: f16 KV cache, fa auto
        gap, differ, _ = served_gap(url, reference, prompts + lengths)
        # measured 0.18 (the 33-token prompt, one token at log p -5.5; 2.3e-2 without it), no greedy token: flash
        # attention's arithmetic (-fa on with an f32 cache gives the same; 1e-3 to 3e-2 on other prompts below and
        # above the budget), not the selection
        assert gap < 0.3 and differ <= 1


@needs_server
def test_the_indexer_is_live_in_llama_cpp(exported, tmp_path):
    """Negative control: the indexer's key projection zeroed in the file changes what llama.cpp selects on prompts
    longer than the top-k (and only there), so agreement above is llama.cpp following the indexer."""
    from phasekv.checkpoint import read_experiment
    from phasekv.data.vocab import Vocabulary

    root, reference = exported
    broken = copy.deepcopy(reference)
    with torch.no_grad():
        for layer in broken.model.layers:
            layer.self_attn.indexer.wq_b.weight.neg_()  # ReLU(-q.k): the opposite tokens score
    eg.write_gguf(broken, Vocabulary.from_dict(read_experiment(CHECKPOINT)["vocab"]), tmp_path / "broken.gguf")
    with llama_server(tmp_path / "broken.gguf", slots=1, context=512, extra=STRICT) as url:
        short, _, _ = served_gap(url, reference, random_prompts(3, 210, 10, 30, seed=2))
        long, _, _ = served_gap(url, reference, random_prompts(3, 210, 100, 200, seed=2))
    assert short < 1e-4 < 1e-2 < long  # measured 2.0e-5 and 14.7 (every long prompt's greedy token differs)


@needs_server
def test_dense_and_moe_layers_agree_on_a_random_model(tmp_path):
    wide = e32.widen(tiny_v32(seed=3))
    eg.write_gguf(wide, tiny_vocab(), tmp_path / "tiny.gguf")
    with llama_server(tmp_path / "tiny.gguf", slots=1, context=512, extra=STRICT) as url:
        gap, differ, _ = served_gap(url, wide, random_prompts(6, 32, 20, 300, seed=4))
    assert gap < 1e-4 and differ == 0  # measured 5.2e-6 (5.4e-3 at the server defaults)


@needs_server
def test_llama_cpp_dies_on_an_indexer_head_narrower_than_its_rotation(tmp_path):
    """Why `widen` exists: the model as it is (indexer heads of 16 channels) kills llama-server b11434 while it
    reserves its graph (GGML_ASSERT(ggml_can_mul_mat(a, b)) in ggml_mul_mat from llama_model_deepseek32::graph: the
    indexer's 16-channel queries times its smallest Hadamard rotation, 64 x 64).  A llama.cpp that runs it fails
    this test: the widening can go."""
    eg.write_gguf(tiny_v32(), tiny_vocab(), tmp_path / "as-is.gguf")
    with pytest.raises(launch.EngineDied, match="killed by SIGABRT"), llama_server(tmp_path / "as-is.gguf", slots=1,
                                                                                 context=512, startup_s=60):
        pass
