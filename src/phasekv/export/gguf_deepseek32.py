"""transformers' DeepSeek-V3.2 (`DeepseekV32ForCausalLM`) in the layout of llama.cpp's `deepseek32` (b11434).

llama.cpp's src/models/deepseek32.cpp runs MLA with the absorption trick (the cache holds the latent [kv_lora |
rope] per token: one "KV head" of kv_lora_rank + qk_rope_head_dim channels) and the lightning indexer of DeepSeek
Sparse Attention: per query, ReLU(q_h . k) weighted per head, summed, the top `index_topk` tokens kept.  The
mapping follows llama.cpp's own converter (conversion/deepseek.py, DeepseekV2Model.modify_tensors): kv_b_proj is
split per head into k_b (transposed) and v_b; dense layers must lead (`leading_dense_block_count`).

One llama.cpp limit is met by widening the model exactly (`widen`):

  index_head_dim    llama.cpp always Hadamard-rotates the indexer's queries and keys in blocks of at least 64
                    channels (llama_kv_cache creates the rotation for every DSA model, and no matrix smaller than
                    64); with a head of 16 channels there is no rotation matrix to multiply by.  The head is widened
                    to d' (a multiple of 64 and of d): the key projection's d rows repeat d'/d times, so the
                    LayerNorm over the d' channels sees the same mean and variance; its gain and bias are the
                    original on the first d channels and 0 on the copies, so the normalized key is the original
                    followed by zeros; the query projection's new rows are 0.  q . k is unchanged; the scorer's
                    1/sqrt(d') instead of 1/sqrt(d) is undone by scaling the head weights by sqrt(d'/d) (ReLU is
                    positively homogeneous).  RoPE stays on the first qk_rope_head_dim channels in both codes
                    (llama.cpp's layout is [rope | nope], transformers' split is the same).

Refused in one line (`check_exportable`): norms whose epsilon is not 1e-6 (transformers builds q_a_layernorm and
kv_a_layernorm with the default 1e-6, llama.cpp uses the one rms epsilon for every norm), non-default RoPE, MoE
layers before dense ones, expert groups (n_group > 1), attention biases.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

ARCH = "deepseek32"
ROTATION_BLOCK = 64  # llama.cpp's smallest Hadamard block (llama_kv_cache: n_rot_k starts at 64)
SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
NORM_EPS = 1e-6  # transformers' DeepseekV32RMSNorm default, used by q_a_layernorm and kv_a_layernorm


def check_exportable(config: Any) -> None:
    """Refuse, in one line naming the field, a DeepSeek-V3.2 config that this export cannot run exactly."""
    if getattr(config, "model_type", None) != "deepseek_v32":
        raise ValueError(f"model.model_type: the deepseek32 export covers deepseek_v32, got {config.model_type!r}")
    if not math.isclose(config.rms_norm_eps, NORM_EPS):
        raise ValueError(f"model.rms_norm_eps: llama.cpp uses one epsilon for every norm and transformers' latent "
                         f"norms use {NORM_EPS}; got {config.rms_norm_eps}")
    if (config.rope_parameters or {}).get("rope_type", "default") != "default":
        raise ValueError(f"model.rope_parameters: only default RoPE is exported, got "
                         f"{config.rope_parameters.get('rope_type')!r}")
    sparse = [t == "sparse" for t in config.mlp_layer_types]
    if sparse != sorted(sparse):
        raise ValueError("model.mlp_layer_types: llama.cpp runs the first leading_dense_block_count layers dense: "
                         "dense layers must come first")
    if any(sparse) and (config.n_group or 1) > 1:
        raise ValueError(f"model.n_group: llama.cpp's deepseek32 routes without expert groups, got {config.n_group}")
    if config.attention_bias:
        raise ValueError("model.attention_bias: llama.cpp's deepseek32 has no attention biases")


def indexer_dim(config: Any) -> int:
    """d': the smallest multiple of both ROTATION_BLOCK and index_head_dim (its rows repeat whole: see the module
    docstring) that is not the latent cache's head size (llama.cpp would rotate that cache as well)."""
    step = math.lcm(config.index_head_dim, ROTATION_BLOCK)
    d = step
    while d == config.kv_lora_rank + config.qk_rope_head_dim:
        d += step
    return d


def widen(model: nn.Module) -> nn.Module:
    """The same function as a DeepSeek-V3.2 model whose indexer head is `indexer_dim` channels (a new float32
    model in eval mode; `model` itself when its head is already a multiple of ROTATION_BLOCK)."""
    from phasekv import families

    config = model.config
    check_exportable(config)
    d = config.index_head_dim
    if d % ROTATION_BLOCK == 0:
        return model
    d_new = indexer_dim(config)
    wide_config = copy.deepcopy(config)
    wide_config.index_head_dim = d_new
    state = {name: t.detach().float() if t.is_floating_point() else t for name, t in model.state_dict().items()}
    repeats, heads = d_new // d, config.index_n_heads
    for name, t in list(state.items()):
        if name.endswith("indexer.wk.weight"):  # (d, H): the rows repeat
            state[name] = t.repeat(repeats, 1)  # (d', H)
        elif name.endswith(("indexer.k_norm.weight", "indexer.k_norm.bias")):  # (d,): the copies switched off
            state[name] = torch.cat([t, t.new_zeros(d_new - d)])  # (d',)
        elif name.endswith("indexer.wq_b.weight"):  # (heads*d, q_lora): new rows 0 per head
            per_head = t.view(heads, d, -1)  # (heads, d, q_lora)
            wide = per_head.new_zeros(heads, d_new, per_head.shape[-1])  # (heads, d', q_lora)
            wide[:, :d] = per_head
            state[name] = wide.reshape(heads * d_new, -1)
        elif name.endswith("indexer.weights_proj.weight"):  # undo 1/sqrt(d') vs 1/sqrt(d)
            state[name] = t * math.sqrt(d_new / d)
    wide = families.build(wide_config)
    wide.load_state_dict(state, strict=True)
    return wide.float().eval()


_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight", "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight", "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.indexer.wq_b.weight": "indexer.attn_q_b.weight", "self_attn.indexer.wk.weight": "indexer.attn_k.weight",
    "self_attn.indexer.k_norm.weight": "indexer.k_norm.weight", "self_attn.indexer.k_norm.bias": "indexer.k_norm.bias",
    "self_attn.indexer.weights_proj.weight": "indexer.proj.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias", "mlp.experts.down_proj": "ffn_down_exps.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}


def gguf_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor, str]]:
    """(llama.cpp's tensor name, tensor, transformers' name), torch shapes; every parameter and persistent buffer
    is placed or the export refuses (`phasekv.export.gguf.place_tensors`)."""
    from phasekv.export.gguf import place_tensors, split_gate_up

    config = model.config
    heads, nope, v_dim = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim

    def layer(block: str, rest: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if rest == "self_attn.kv_b_proj.weight":  # (heads*(nope+v), kv_lora): per head [k nope | v]
            k_b, v_b = t.view(heads, nope + v_dim, -1).split([nope, v_dim], dim=1)  # (heads, nope|v, kv_lora)
            return [(block + "attn_k_b.weight", k_b.transpose(1, 2).contiguous()),  # (heads, kv_lora, nope)
                    (block + "attn_v_b.weight", v_b.contiguous())]  # (heads, v, kv_lora)
        if rest == "mlp.experts.gate_up_proj":
            return split_gate_up(block, t)
        return [(block + _LAYER[rest], t)] if rest in _LAYER else []

    return place_tensors(model, _TOP, layer)


def gguf_metadata(config: Any) -> dict[str, Any]:
    """The `deepseek32.*` hyper-parameters llama.cpp's loader reads (MLA as one latent KV head, as its converter
    writes them)."""
    key = f"{ARCH}.".__add__
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    return {
        key("context_length"): config.max_position_embeddings, key("embedding_length"): config.hidden_size,
        key("block_count"): config.num_hidden_layers, key("vocab_size"): config.vocab_size,
        key("feed_forward_length"): config.intermediate_size,
        key("leading_dense_block_count"): sum(t != "sparse" for t in config.mlp_layer_types),
        key("attention.head_count"): config.num_attention_heads, key("attention.head_count_kv"): 1,
        key("attention.key_length"): latent, key("attention.value_length"): config.kv_lora_rank,
        key("attention.key_length_mla"): config.qk_nope_head_dim + config.qk_rope_head_dim,
        key("attention.value_length_mla"): config.v_head_dim,
        key("attention.q_lora_rank"): config.q_lora_rank, key("attention.kv_lora_rank"): config.kv_lora_rank,
        key("attention.layer_norm_rms_epsilon"): float(config.rms_norm_eps),
        key("rope.freq_base"): float(config.rope_parameters["rope_theta"]),
        key("rope.dimension_count"): config.qk_rope_head_dim,
        key("attention.indexer.head_count"): config.index_n_heads,
        key("attention.indexer.key_length"): config.index_head_dim,
        key("attention.indexer.top_k"): config.index_topk,
        key("expert_count"): config.n_routed_experts, key("expert_used_count"): config.num_experts_per_tok,
        key("expert_shared_count"): config.n_shared_experts,
        key("expert_feed_forward_length"): config.moe_intermediate_size,
        key("expert_weights_scale"): float(config.routed_scaling_factor),
        key("expert_weights_norm"): bool(config.norm_topk_prob), key("expert_gating_func"): SIGMOID,
    }
