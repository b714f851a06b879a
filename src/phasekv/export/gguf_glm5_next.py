"""transformers' GLM-5.3 text model (`glm5_next_text`, phasekv's `TextCausalLM` around it) in the layout of llama.cpp's
`glm5-next` (b11434).

llama.cpp's src/models/glm5-next.cpp runs GLM-5.3-Flash: Kimi delta attention (KDA) layers and nope-only MLA layers
whose DSA indexer scores pools of `index_kpool` keys (a learned softmax-weighted mean per channel) and keeps the top
index_topk / index_kpool pools plus the incomplete tail, DeepSeek-V4-style hyper-connections (4 streams, an
unweighted mean at the head) and SwiGLU MLPs clamped at swiglu_limit.  The mapping follows llama.cpp's converter
(conversion/glm.py, Glm5NextModel): a layer is linear when its KV head count is 0, the KDA's packed q|k|v
convolution is split per stream, A_log is stored as -exp(A_log), kv_b_proj is split per head into k_b (transposed)
and v_b as for DeepSeek-V3.2.

One llama.cpp limit is met by widening the model exactly (`widen`): llama.cpp asserts 4 hyper-connection streams
(`GGML_ASSERT(hparams.dsv4_hc_mult == 4)` in load_arch_hparams); phasekv's small models have 1.  The 4 streams are
identical copies, as for DeepSeek-V4 (`phasekv.export.gguf.widen_streams`, whose docstring says why that is exact);
GLM-5.3's head averages the streams, and the mean of 4 copies is the copy.

Refused in one line (`check_exportable`): RoPE in the MLA (llama.cpp's glm5-next is nope-only), KDA heads other than
the attention heads (llama.cpp sizes KDA by n_head), a k-pool of 1 or a top-k that is not a whole number of pools
(asserted at load), MoE layers (not exported yet: phasekv's GLM-5.3 models are dense), attention biases.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

ARCH = "glm5-next"
HC_STREAMS = 4
INDEXER_NORM_EPS = 1e-6  # transformers' Glm5NextTextIndexer: nn.LayerNorm(head_dim, eps=1e-6)
WIDENED = ("hc_mult",)
NO_HF_OUT = ("transformers has no causal-LM class for glm5_next_text to save (phasekv wraps its text model in "
             "TextCausalLM); export without --hf-out")
KEEP_F32 = ("_hc.", "index_kpool_compress_", "conv1d.")  # f32 as llama.cpp converts them (ggml_ssm_conv: f32 only)


def check_exportable(config: Any) -> None:
    """Refuse, in one line naming the field, a GLM-5.3 config that llama.cpp's glm5-next cannot run exactly."""
    if getattr(config, "model_type", None) != "glm5_next_text":
        raise ValueError(f"model.model_type: the glm5-next export covers glm5_next_text, got {config.model_type!r}")
    if config.qk_rope_head_dim != 0:
        raise ValueError(f"model.qk_rope_head_dim: llama.cpp's glm5-next MLA is nope-only (asserts n_rot == 0), got "
                         f"{config.qk_rope_head_dim}")
    if "linear_attention" in config.layer_types and config.linear_num_heads != config.num_attention_heads:
        raise ValueError(f"model.linear_num_heads: llama.cpp's glm5-next runs KDA with num_attention_heads "
                         f"({config.num_attention_heads}) heads, got {config.linear_num_heads}")
    if config.index_kpool < 2 or config.index_topk % config.index_kpool:
        raise ValueError(f"model.index_kpool: llama.cpp asserts a pool of 2 or more that divides index_topk; got "
                         f"pool {config.index_kpool}, top-k {config.index_topk}")
    if any(t != "dense" for t in config.mlp_layer_types):
        raise ValueError("model.mlp_layer_types: the glm5-next export covers dense MLP layers (MoE is not exported)")
    if config.hc_mult not in (1, HC_STREAMS):
        raise ValueError(f"model.hc_mult: llama.cpp runs {HC_STREAMS} hyper-connection streams (1 is widened "
                         f"exactly), got {config.hc_mult}")
    if config.attention_bias:
        raise ValueError("model.attention_bias: llama.cpp's glm5-next has no attention biases")


def widen(model: nn.Module) -> nn.Module:
    """The same function with HC_STREAMS identical hyper-connection streams (a new float32 model in eval mode;
    `model` itself when it already has them)."""
    from phasekv import families
    from phasekv.export.gguf import widen_streams

    config = model.config
    check_exportable(config)
    if config.hc_mult == HC_STREAMS:
        return model
    wide_config = copy.deepcopy(config)
    wide_config.hc_mult = HC_STREAMS
    state = {name: t.detach().float() if t.is_floating_point() else t for name, t in model.state_dict().items()}
    wide = families.build(wide_config)
    wide.load_state_dict(widen_streams(state), strict=True)
    return wide.float().eval()


_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_LAYER = {
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
    "attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn", "ffn_hc.base": "hc_ffn_base", "ffn_hc.scale": "hc_ffn_scale",
    "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up", "mlp.down_proj.weight": "ffn_down",
    # KDA
    "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k", "self_attn.v_proj.weight": "attn_v",
    "self_attn.forget_gate.f_a_proj.weight": "ssm_f_a", "self_attn.forget_gate.f_b_proj.weight": "ssm_f_b",
    "self_attn.b_proj.weight": "ssm_beta", "self_attn.g_a_proj.weight": "ssm_g_a",
    "self_attn.g_b_proj.weight": "ssm_g_b", "self_attn.o_norm.weight": "ssm_norm",
    "self_attn.o_proj.weight": "attn_output",
    # MLA and its indexer
    "self_attn.q_a_proj.weight": "attn_q_a", "self_attn.q_a_layernorm.weight": "attn_q_a_norm",
    "self_attn.q_b_proj.weight": "attn_q_b", "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm",
    "self_attn.indexer.wq_b.weight": "indexer.attn_q_b", "self_attn.indexer.wk.weight": "indexer.attn_k",
    "self_attn.indexer.k_norm.weight": "indexer.k_norm", "self_attn.indexer.weights_proj.weight": "indexer.proj",
    "self_attn.indexer.index_kpool_compress_gate": "indexer_compressor_gate",
    "self_attn.indexer.index_kpool_compress_ape": "indexer_compressor_ape",
}


def gguf_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor, str]]:
    """(llama.cpp's tensor name, tensor, transformers' name), torch shapes, of a model `widen` returned; every
    parameter and persistent buffer is placed or the export refuses."""
    from phasekv.export.gguf import place_tensors

    config = model.config
    heads, nope, v_dim = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim

    def layer(block: str, rest: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if rest == "self_attn.conv1d.weight":  # (3 d_inner, 1, K): q | k | v channels
            return [(block + f"ssm_conv1d_{s}.weight", part.contiguous()) for s, part in zip("qkv", t.chunk(3))]
        if rest == "self_attn.forget_gate.A_log":
            return [(block + "ssm_a", -torch.exp(t.float()))]
        if rest == "self_attn.forget_gate.dt_bias":
            return [(block + "ssm_dt.bias", t)]
        if rest == "self_attn.indexer.k_norm.bias":
            return [(block + "indexer.k_norm.bias", t)]
        if rest == "self_attn.kv_b_proj.weight":  # (heads*(nope+v), kv_lora): per head [k nope | v]
            k_b, v_b = t.view(heads, nope + v_dim, -1).split([nope, v_dim], dim=1)
            return [(block + "attn_k_b.weight", k_b.transpose(1, 2).contiguous()),  # (heads, kv_lora, nope)
                    (block + "attn_v_b.weight", v_b.contiguous())]  # (heads, v, kv_lora)
        return [(block + _LAYER[rest] + ".weight", t)] if rest in _LAYER else []

    return place_tensors(model, _TOP, layer)


def gguf_metadata(config: Any) -> dict[str, Any]:
    """The `glm5-next.*` hyper-parameters llama.cpp's loader reads (as its converter writes them)."""
    key = f"{ARCH}.".__add__
    n = config.num_hidden_layers
    meta = {
        key("context_length"): config.max_position_embeddings, key("embedding_length"): config.hidden_size,
        key("block_count"): n, key("vocab_size"): config.vocab_size,
        key("feed_forward_length"): config.intermediate_size, key("leading_dense_block_count"): n,
        key("attention.head_count"): config.num_attention_heads,
        key("attention.head_count_kv"): [0 if t == "linear_attention" else 1 for t in config.layer_types],
        key("attention.layer_norm_rms_epsilon"): float(config.rms_norm_eps),
        key("attention.layer_norm_epsilon"): INDEXER_NORM_EPS,
        key("ssm.conv_kernel"): config.linear_conv_kernel_dim, key("kda.head_dim"): config.linear_head_dim,
        key("attention.q_lora_rank"): config.q_lora_rank, key("attention.kv_lora_rank"): config.kv_lora_rank,
        key("rope.dimension_count"): 0, key("attention.key_length"): config.kv_lora_rank,
        key("attention.value_length"): config.kv_lora_rank, key("attention.key_length_mla"): config.qk_nope_head_dim,
        key("attention.value_length_mla"): config.v_head_dim,
        key("attention.indexer.head_count"): config.index_n_heads,
        key("attention.indexer.key_length"): config.index_head_dim,
        key("attention.indexer.top_k"): config.index_topk, key("attention.indexer.kpool"): config.index_kpool,
        key("attention.indexer.kpool_select_tail"): bool(config.index_kpool_always_select_tail),
        key("attention.indexer.types"): [int(t == "full") for t in config.indexer_types],
        key("hyper_connection.count"): config.hc_mult,
        key("hyper_connection.sinkhorn_iterations"): config.hc_sinkhorn_iters,
        key("hyper_connection.epsilon"): float(config.hc_eps),
        key("expert_feed_forward_length"): config.moe_intermediate_size,
        key("expert_shared_count"): config.n_shared_experts,
        key("expert_count"): config.n_routed_experts, key("expert_used_count"): config.num_experts_per_tok,
    }
    if config.swiglu_limit is not None:
        meta[key("swiglu_clamp_exp")] = [float(config.swiglu_limit)] * n
        meta[key("swiglu_clamp_shexp")] = [float(config.swiglu_limit)] * n
    if config.linear_lower_bound is not None:
        meta[key("kda.gate_lower_bound")] = float(config.linear_lower_bound)
    return meta
