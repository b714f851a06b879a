"""The decoder against transformers' Qwen3 (an outside reference) and config validation."""

import pytest
import torch

from phasekv import ModelConfig, build_model
from phasekv.compression import available
from tests.helpers import tiny


@pytest.mark.parametrize("tie", [False, True])
def test_full_attention_matches_transformers_qwen3(tie):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = tiny(tie_word_embeddings=tie, num_hidden_layers=3)
    ours = build_model(config).eval()
    hf_config = transformers.Qwen3Config(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta, rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=tie,
        attention_bias=False, use_sliding_window=False)
    hf_config._attn_implementation = "eager"
    theirs = transformers.Qwen3ForCausalLM(hf_config).eval()
    missing, unexpected = theirs.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    ids = torch.randint(0, config.vocab_size, (2, 37))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids).logits, rtol=1e-5, atol=1e-5)


def test_partial_and_no_rope_change_logits_and_keep_shapes():
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (1, 20))
    outs = []
    for kw in (dict(), dict(rope_dims=8, rope_part="first"), dict(rope_dims=8, rope_part="last"), dict(rope_dims=0)):
        torch.manual_seed(1)
        outs.append(build_model(tiny(**kw))(ids))
    for a in outs[1:]:
        assert a.shape == outs[0].shape and not torch.allclose(a, outs[0])


@pytest.mark.parametrize("rope_dims, part", [(16, "first"), (8, "first"), (8, "last"), (0, "first")])
@pytest.mark.parametrize("batched_positions", [False, True])
def test_lean_rope_equals_rotate_half_form_with_gradients(rope_dims, part, batched_positions):
    from phasekv.layers import Rotary

    torch.manual_seed(0)
    rotary = Rotary(16, rope_dims, part, 1000.0)
    x = torch.randn(2, 3, 5, 16).transpose(1, 2).requires_grad_()  # (B, H, T, D) view, as the layer passes it
    positions = torch.tensor([[0, 3, 9], [7, 8, 40]]) if batched_positions else torch.tensor([2, 5, 11])
    out, ref = rotary(x, positions), rotary.forward_reference(x, positions)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    weight = torch.randn_like(ref)
    grad, = torch.autograd.grad((out * weight).sum(), x)
    grad_ref, = torch.autograd.grad((ref * weight).sum(), x)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-6, atol=1e-6)
    if rope_dims:
        assert not torch.allclose(out, x)


def test_fused_rms_norm_equals_the_unfused_form():
    from phasekv.layers import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(16, 1e-6)
    norm.weight.data = torch.randn(16)
    x = torch.randn(4, 7, 16)
    unfused = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(norm(x), unfused, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(norm(x.double()).float(), unfused, rtol=1e-6, atol=1e-6)  # the unfused branch


@pytest.mark.parametrize("kwargs, field", [
    (dict(compressor="gated", window=4, stride=8), "stride"),
    (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads"),
    (dict(rope_dims=48), "rope_dims"),
    (dict(rope_dims=7), "rope_dims"),
    (dict(compressor="nope"), "compressor"),
    (dict(layer_types=["full"]), "layer_types"),
    (dict(layer_types=["full", "bogus"]), "layer_types"),
    (dict(compressor="gated", gate="matrix"), "gate"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(head_stagger=True), "head_stagger"),  # no compressed layer
    (dict(compressor="gated", head_stagger=True, num_key_value_heads=1), "head_stagger"),
    (dict(compressor="gated", window=6, stride=6, head_stagger=True, num_key_value_heads=4), "head_stagger"),
    (dict(compressor="gated", window=6, stride=6, head_stagger=True, stagger=True), "head_stagger"),  # 6 % (2 * 2)
    (dict(compressor="gated", head_stagger=True, uncompressed_tail=True), "head_stagger"),
    (dict(compressor="deepseek_csa", csa_block=4, index_topk=2, head_stagger=True), "head_stagger"),
])
def test_bad_configs_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        tiny(**kwargs)


def test_unknown_compressor_lists_known_ones():
    with pytest.raises(ValueError) as info:
        ModelConfig(compressor="nope")
    for name in available():
        assert name in str(info.value)


def test_unknown_key_in_yaml_section_is_one_clear_error():
    with pytest.raises(ValueError, match="model.windw"):
        ModelConfig.from_dict({"windw": 8})


def test_phase_stride_is_the_smallest_compressed_stride():
    assert tiny().phase_stride is None
    assert tiny(compressor="gated", window=8, stride=6).phase_stride == 6
    cfg = tiny(num_hidden_layers=4, hca_block=8, csa_block=4,
               layer_types=["sliding", "sliding", "deepseek_csa", "deepseek_hca"])
    assert cfg.phase_stride == 4


def test_paper_geometry_parameter_count_on_meta():
    config = ModelConfig(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
                         max_position_embeddings=40960, rope_theta=1e6)
    with torch.device("meta"):
        model = build_model(config)
    n = sum(p.numel() for p in model.parameters())
    assert abs(n - 596_049_920) < 1e6  # Qwen3-0.6B
