"""GGUF export of GLM-5.3 (phasekv.export.gguf_glm5_next): the hyper-connection widening keeps the function to the
order of hc_eps, the file holds llama.cpp's `glm5-next` names, unsupported configs are refused in one line, and the
real llama-server (b11434, `make engine`) serves the export with transformers' next-token log-probabilities and
greedy continuations on the same weights: the trained checkpoints/extra/glm5-kpool-induction (a KDA layer, then an
MLA layer with a k-pool indexer) and a random model with a shared-indexer layer, on prompts below and past the
indexer's budget (index_topk tokens in whole pools, plus the incomplete tail)."""

import copy

import pytest
import torch

from phasekv.checkpoint import read_experiment
from phasekv.data.vocab import Vocabulary
from phasekv.export import gguf as eg
from phasekv.export import gguf_glm5_next as eglm
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
from tests.test_export_gguf_minimax_m3 import greedy, served_greedy

CHECKPOINT = "checkpoints/extra/glm5-kpool-induction"
# the trained checkpoint's indexer keeps the top 32 tokens (8 pools of 4) and the tail: the 36th query is the first
# that can drop a token
BUCKETS = {"below the budget (10-35)": (10, 20, 35), "just past it (36-64)": (36, 40, 48, 64),
           "far past it (100-448)": (100, 200, 300, 448)}


def tiny_glm(seed: int = 0, **overrides):
    """A small random GLM-5.3 (KDA, MLA with a full indexer, MLA sharing it; k-pool 4, top-8) with every parameter
    drawn; 16 indexer heads (few heads leave ReLU ties at the top-k boundary)."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig

    from phasekv import families

    fields = dict(vocab_size=32, hidden_size=32, num_attention_heads=2, num_key_value_heads=2, intermediate_size=48,
                  kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=0, v_head_dim=8,
                  index_topk=8, index_n_heads=16, index_head_dim=8, index_kpool=4, linear_head_dim=8,
                  linear_num_heads=2, num_hidden_layers=3, hc_mult=1, max_position_embeddings=512,
                  layer_types=["linear_attention", "indexed_attention", "indexed_attention"],
                  indexer_types=["full", "full", "shared"], mlp_layer_types=["dense"] * 3, tie_word_embeddings=False,
                  pad_token_id=None)
    fields.update(overrides)
    torch.manual_seed(seed)
    model = families.build(Glm5NextTextConfig(**fields))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith(("norm.weight", "layernorm.weight"))
                    else 0.3 * torch.randn_like(p))
    return model.eval()


def length_prompts(lengths, vocab_size: int) -> list[list[int]]:
    return [random_prompts(1, vocab_size, n - 1, n, seed=n)[0] for n in lengths]


def bucket_gaps(url: str, reference, vocab_size: int) -> dict[str, tuple[float, int]]:
    return {name: served_gap(url, reference, length_prompts(lengths, vocab_size))[:2]
            for name, lengths in BUCKETS.items()}


def trained():
    from phasekv.checkpoint import load_checkpoint

    model, _ = load_checkpoint(CHECKPOINT)
    return model, Vocabulary.from_dict(read_experiment(CHECKPOINT)["vocab"])


def without_hc_eps(model):
    quiet = copy.deepcopy(model).double()
    for layer in quiet.model.layers:
        layer.attn_hc.hc_eps = layer.ffn_hc.hc_eps = 0.0
    return quiet


# ---------------------------------------------------------------------------------------------- widening


def test_the_widening_is_exact_but_for_hc_eps_and_a_wrong_one_is_not():
    """4 copies of one stream: without hc_eps (float64) the same function to rounding; with it, each collapse weighs
    the copies by 4 eps more than the one stream, which the RMS norm after it cancels unless the collapsed stream is
    as small as its epsilon (the trained checkpoint's is: mean square 4e-7 against 1e-5; docs/notes/gguf.md)."""
    model, _ = trained()
    wide = eglm.widen(model)
    assert wide.config.hc_mult == 4 and eglm.widen(wide) is wide
    prompts = length_prompts((14, 42, 56, 173), 256)
    exact = max((logprobs(without_hc_eps(model), p) - logprobs(without_hc_eps(wide), p)).abs().max().item()
                for p in prompts)
    assert exact < 2e-5  # measured 5.2e-6: the hyper-connection mixes run in float32 even in a float64 model
    gap = max((logprobs(model, p) - logprobs(wide, p)).abs().max().item() for p in prompts)
    assert gap < 5e-3  # measured 4.1e-4
    broken = copy.deepcopy(wide)  # streams 1..3 no longer take layer 0's attention output: the copies part
    with torch.no_grad():
        broken.model.layers[0].attn_hc.base[5:8] = eg.OFF
    assert max((logprobs(model, p) - logprobs(broken, p)).abs().max().item() for p in prompts) > 1e-2


def test_check_exportable_refuses_what_llama_cpp_cannot_run_in_one_line():
    config = tiny_glm().config
    eglm.check_exportable(config)
    cases = [(dict(qk_rope_head_dim=8), "model.qk_rope_head_dim: .* nope-only"),
             (dict(linear_num_heads=4), "model.linear_num_heads"), (dict(index_kpool=3), "model.index_kpool"),
             (dict(mlp_layer_types=["dense", "sparse", "sparse"]), "model.mlp_layer_types"),
             (dict(hc_mult=2), "model.hc_mult"), (dict(attention_bias=True), "model.attention_bias"),
             (dict(model_type="deepseek_v32"), "model.model_type")]
    assert_refused(eglm.check_exportable, config, cases)


@needs_gguf
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_the_file_holds_llama_cpp_names(dtype, tmp_path):
    """(In f16 the KDA convolution stays f32: ggml_ssm_conv asserts an f32 kernel, llama-server aborts otherwise.)"""
    import gguf
    import numpy as np

    wide = eglm.widen(tiny_glm())
    eg.write_gguf(wide, tiny_vocab(), tmp_path / "tiny.gguf", dtype)
    reader = gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    types = {t.name: t.tensor_type for t in reader.tensors}
    assert types["blk.0.ssm_conv1d_q.weight"] == gguf.GGMLQuantizationType.F32
    assert (types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.F16) == (dtype == "f16")
    if dtype == "f16":
        return
    stored = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert sorted(stored) == sorted(name for name, _, _ in eglm.gguf_tensors(wide))
    assert {"blk.0.ssm_conv1d_v.weight", "blk.1.indexer_compressor_ape.weight", "blk.1.attn_k_b.weight"} <= set(stored)
    assert "blk.2.indexer.attn_k.weight" not in stored  # the shared layer has no indexer of its own
    a_log = wide.model.layers[0].self_attn.forget_gate.A_log.detach()
    np.testing.assert_array_equal(stored["blk.0.ssm_a"], -torch.exp(a_log).numpy())
    conv = wide.model.layers[0].self_attn.conv1d.weight.detach()  # (3 x 16, 1, 4): q | k | v channels
    np.testing.assert_array_equal(stored["blk.0.ssm_conv1d_k.weight"].reshape(16, 1, 4), conv[16:32].numpy())

    def field(key):
        return reader.fields[key].parts[-1].tolist()

    assert field("glm5-next.hyper_connection.count") == [4]
    assert [reader.fields["glm5-next.attention.head_count_kv"].parts[i].tolist()[0]
            for i in reader.fields["glm5-next.attention.head_count_kv"].data] == [0, 1, 1]


@needs_gguf
def test_the_command_exports_the_trained_checkpoint_and_refuses_hf_out(tmp_path):
    summary = eg.export_gguf(CHECKPOINT, tmp_path / "glm.gguf")
    assert summary["widened"] == {"hc_mult": [1, 4]} and (tmp_path / "glm.gguf").is_file()
    with pytest.raises(ValueError, match="--hf-out: transformers has no causal-LM class for glm5_next_text"):
        eg.export_gguf(CHECKPOINT, tmp_path / "other.gguf", hf_out=tmp_path / "hf")
    assert not (tmp_path / "other.gguf").exists() and not (tmp_path / "hf").exists()


# ---------------------------------------------------------------------------------------------- the real server


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The trained checkpoint widened and written (f32), with its vocabulary."""
    model, vocab = trained()
    wide = eglm.widen(model)
    root = tmp_path_factory.mktemp("glm")
    eg.write_gguf(wide, vocab, root / "glm.gguf")
    return root / "glm.gguf", wide


@needs_server
@pytest.mark.slow
def test_llama_server_agrees_with_transformers_on_the_trained_checkpoint(exported):
    """Every length bucket, ubatches of 30 tokens (pools of 4 and KDA chunks straddle them), continued from the
    server's cache (the KDA state and the k-pool cache carried over; 1-token decode steps too), greedy continuations."""
    path, wide = exported
    with llama_server(path, slots=1, context=512, extra=(*STRICT, "-ub", "30", "-b", "30")) as url:
        for name, (gap, differ) in bucket_gaps(url, wide, 256).items():
            assert gap < 1e-4 and differ == 0, name  # measured 1e-6 to 7e-6
        prompts = random_prompts(2, 256, 60, 80, seed=5)
        grown = grown_prompts(prompts[0][:30], prompts[1], (1, 5, 13, 40))
        gap, differ, cached = served_gap(url, wide, grown, cache=True)
        assert gap < 1e-4 and differ == 0 and cached >= sum(map(len, grown[:-1]))
        for p in length_prompts((20, 60), 256):
            assert served_greedy(url, p, 16) == greedy(wide, p, 16)
    with llama_server(path, slots=1, context=512) as url:  # server defaults: f16 cache, flash attention auto
        for name, (gap, differ) in bucket_gaps(url, wide, 256).items():
            assert gap < 0.05 and differ <= 1, name  # measured up to 2.8e-3, none differ


@needs_server
def test_the_indexer_is_live_in_llama_cpp(exported, tmp_path):
    """Negative control: the indexer's queries negated in the file change nothing below the budget and the answer past
    it, so agreement above is llama.cpp following the k-pool selection."""
    path, wide = exported
    broken = copy.deepcopy(wide)
    with torch.no_grad():
        broken.model.layers[1].self_attn.indexer.wq_b.weight.neg_()
    _, vocab = trained()
    eg.write_gguf(broken, vocab, tmp_path / "broken.gguf")
    with llama_server(tmp_path / "broken.gguf", slots=1, context=512, extra=STRICT) as url:
        gaps = bucket_gaps(url, wide, 256)
    below, *past = gaps.values()
    assert below[0] < 1e-4 and all(gap > 1e-2 for gap, _ in past), gaps  # measured 5.3e-6; 2.2 and 2.8


@needs_server
def test_a_shared_indexer_layer_agrees_on_a_random_model(tmp_path):
    wide = eglm.widen(tiny_glm(seed=3))
    eg.write_gguf(wide, tiny_vocab(), tmp_path / "tiny.gguf")
    with llama_server(tmp_path / "tiny.gguf", slots=1, context=512, extra=STRICT) as url:
        gap, differ, _ = served_gap(url, wide, random_prompts(6, 32, 10, 300, seed=4))
    assert gap < 1e-4 and differ == 0  # measured 3.9e-5 (5.1e-3 at the server defaults)
