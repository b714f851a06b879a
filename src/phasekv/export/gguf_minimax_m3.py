"""transformers' MiniMax-M3 text model (`MiniMaxM3VLForCausalLM`) in the layout of llama.cpp's `minimax-m3` (b11434).

llama.cpp's src/models/minimax-m3.cpp runs GQA softmax attention (per-head QK RMS norm, partial NeoX RoPE) with
MiniMax Sparse Attention: per KV group one indexer query head scores every key against a single shared indexer key
(RMS-normed, RoPE'd), the scores are max-pooled into blocks of `index_block_size` positions (anchored at position
0), the `index_local_blocks` blocks ending at the query are forced in, the top `index_topk_blocks` blocks are kept,
and the main attention sees only the keys of its group's kept blocks.  The layer plan is fixed: the first
`leading_dense_block_count` layers run full attention and a dense SwiGLU-OAI MLP, every later layer sparse
attention and a MoE (sigmoid routing with correction bias, normalized weights, routed scaling, shared experts).
transformers' RMS norms scale by (1 + w): the file holds w + 1 (as llama.cpp's converter writes it).

Two llama.cpp limits are met by widening the model exactly (`widen`):

  groups            llama.cpp asserts one indexer head per KV group (`GGML_ASSERT(HKV == Hd)`); transformers only
                    needs both to divide the query heads.  Both are raised to g = lcm(kv heads, indexer heads) by
                    repeating whole heads: KV head j of g is the original KV head j // (g / kv) (the same query
                    heads read it), indexer query head j the original j // (g / idx) (the same query heads use
                    its selection); the shared indexer key and the per-head norms are unchanged.
  the layer plan    a sparse-attention layer with a dense MLP (transformers allows any mix) becomes a MoE layer
                    whose shared expert is that MLP and whose routed experts are zero (their output is exactly 0
                    whatever the router picks).  The shared expert's width is raised to a multiple of the routed
                    experts' (llama.cpp sizes it n_expert_shared x expert_feed_forward_length) with zero channels:
                    SwiGLU-OAI of a zero gate is 0, so they add exactly 0.  A model without MoE layers gets one
                    routed expert as wide as its dense MLP.

Refused in one line (`check_exportable`): a full-attention layer after a sparse one or with a MoE, no sparse layer,
an indexer head narrower than the RoPE channels (transformers would rotate a truncated table), SwiGLU-OAI
constants other than llama.cpp's fixed alpha 1.702 and limit 7, non-default RoPE.  llama.cpp runs the selection
only with flash attention (without it: dense attention, a warning; docs/notes/gguf.md).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
from torch import nn

ARCH = "minimax-m3"
SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID
SWIGLU = (1.702, 7.0)  # llama.cpp's build_ffn / build_moe_ffn: LLM_FFN_SWIGLU_OAI_MOE's constant alpha and limit
SPARSE, FULL = "minimax_m3_sparse", "full_attention"
KEEP_F32 = (".indexer.",)  # llama.cpp's converter keeps the indexer in float32 (tensor_force_quant)
WIDENED = ("num_key_value_heads", "index_n_heads", "shared_intermediate_size")


def rotary_dim(config: Any) -> int:
    """The RoPE channels of a head: head_dim x partial_rotary_factor (transformers ignores `config.rotary_dim`)."""
    return int(config.head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0))


def leading_dense(config: Any) -> int:
    """How many layers lead with full attention (llama.cpp's leading_dense_block_count)."""
    return next((i for i, t in enumerate(config.layer_types) if t != FULL), len(config.layer_types))


def check_exportable(config: Any) -> None:
    """Refuse, in one line naming the field, a MiniMax-M3 config that llama.cpp's minimax-m3 cannot run exactly."""
    if getattr(config, "model_type", None) != "minimax_m3_vl_text":
        raise ValueError(f"model.model_type: the minimax-m3 export covers minimax_m3_vl_text, got "
                         f"{config.model_type!r}")
    n_dense = leading_dense(config)
    for i, (attn, mlp) in enumerate(zip(config.layer_types, config.mlp_layer_types)):
        if i >= n_dense and attn != SPARSE:
            raise ValueError(f"model.layer_types: llama.cpp's minimax-m3 runs sparse attention in every layer after "
                             f"the leading full-attention ones; layer {i} is {attn!r}")
        if i < n_dense and mlp != "dense":
            raise ValueError(f"model.mlp_layer_types: llama.cpp's minimax-m3 gives its leading full-attention layers "
                             f"a dense MLP; layer {i} is {mlp!r}")
    if n_dense == len(config.layer_types):
        raise ValueError(f"model.layer_types: no {SPARSE} layer (the minimax-m3 export is for sparse attention)")
    if config.index_head_dim < rotary_dim(config):
        raise ValueError(f"model.index_head_dim: llama.cpp ropes the indexer's first {rotary_dim(config)} channels "
                         f"as the heads'; an indexer head of {config.index_head_dim} is narrower")
    if (config.swiglu_alpha, config.swiglu_limit) != SWIGLU:
        raise ValueError(f"model.swiglu_alpha/swiglu_limit: llama.cpp fixes SwiGLU-OAI at alpha {SWIGLU[0]} and "
                         f"limit {SWIGLU[1]}; got {config.swiglu_alpha} and {config.swiglu_limit}")
    if (config.rope_parameters or {}).get("rope_type", "default") != "default":
        raise ValueError(f"model.rope_parameters: only default RoPE is exported, got "
                         f"{config.rope_parameters.get('rope_type')!r}")


def wide_config(config: Any) -> Any:
    """The config `widen` returns: groups at lcm(kv, indexer heads), every sparse layer a MoE, the shared expert a
    whole number of routed experts wide."""
    check_exportable(config)
    wide = copy.deepcopy(config)
    wide.num_key_value_heads = wide.index_n_heads = math.lcm(config.num_key_value_heads, config.index_n_heads)
    n_dense = leading_dense(config)
    moe = [m == "sparse" for m in config.mlp_layer_types[n_dense:]]
    dense_in_sparse = not all(moe)
    if not any(moe):  # no routed experts to keep: one zero expert as wide as the dense MLP
        wide.num_local_experts, wide.num_experts_per_tok = 1, 1
        wide.intermediate_size = config.dense_intermediate_size
    need = max([config.shared_intermediate_size] * any(moe) + [config.dense_intermediate_size] * dense_in_sparse)
    wide.shared_intermediate_size = -(-need // wide.intermediate_size) * wide.intermediate_size
    wide.mlp_layer_types = ["dense"] * n_dense + ["sparse"] * (config.num_hidden_layers - n_dense)
    return wide


def _repeat_heads(t: torch.Tensor, heads: int, times: int) -> torch.Tensor:
    """Rows of `heads` stacked heads, each head repeated `times` times in place (dim 0)."""
    return t.view(heads, -1, *t.shape[1:]).repeat_interleave(times, dim=0).reshape(-1, *t.shape[1:])


def _pad_rows(t: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
    """`t` with zeros appended along `dim` up to `rows`."""
    shape = list(t.shape)
    shape[dim] = rows - t.shape[dim]
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def widen(model: nn.Module) -> nn.Module:
    """The same function in llama.cpp's minimax-m3 shapes (the module docstring; a new float32 model in eval mode,
    or `model` itself when nothing changes)."""
    from phasekv import families

    config = model.config
    wide = wide_config(config)
    fields = ("num_key_value_heads", "index_n_heads", "shared_intermediate_size", "mlp_layer_types",
              "intermediate_size", "num_local_experts")
    if all(getattr(wide, f) == getattr(config, f) for f in fields):
        return model
    kv_times = wide.num_key_value_heads // config.num_key_value_heads
    idx_times = wide.index_n_heads // config.index_n_heads
    state = {name: t.detach().float() if t.is_floating_point() else t for name, t in model.state_dict().items()}
    out = {}
    for name, t in state.items():
        if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
            t = _repeat_heads(t, config.num_key_value_heads, kv_times)
        elif name.endswith("indexer.q_proj.weight"):
            t = _repeat_heads(t, config.index_n_heads, idx_times)
        elif ".mlp.shared_experts." in name:
            t = _pad_shared(t, name, wide.shared_intermediate_size)
        out[name] = t
    for i, kind in enumerate(config.mlp_layer_types):
        if wide.mlp_layer_types[i] == "sparse" and kind == "dense":
            out.update(_dense_as_moe(out, f"model.layers.{i}.mlp.", wide))
    reference = families.build(wide)
    reference.load_state_dict(out, strict=True)
    return reference.float().eval()


def _pad_shared(t: torch.Tensor, name: str, width: int) -> torch.Tensor:
    """A shared expert's matrix widened to `width` channels with zeros (gate and up halves padded apart)."""
    if name.endswith("gate_up_proj.weight"):  # (2I, H): gate rows then up rows
        return torch.cat([_pad_rows(half, width, 0) for half in t.chunk(2, dim=0)])
    return _pad_rows(t, width, 1)  # down_proj (H, I)


def _dense_as_moe(state: dict[str, torch.Tensor], prefix: str, wide: Any) -> dict[str, torch.Tensor]:
    """A dense MLP's weights (removed from `state`) as a MoE block: the MLP as the shared expert, zero routed
    experts and router."""
    gate_up, down = state.pop(prefix + "gate_up_proj.weight"), state.pop(prefix + "down_proj.weight")
    e, inter, hidden = wide.num_local_experts, wide.intermediate_size, wide.hidden_size
    return {prefix + "shared_experts.gate_up_proj.weight": _pad_shared(gate_up, "gate_up_proj.weight",
                                                                       wide.shared_intermediate_size),
            prefix + "shared_experts.down_proj.weight": _pad_shared(down, "down_proj.weight",
                                                                    wide.shared_intermediate_size),
            prefix + "experts.gate_up_proj": gate_up.new_zeros(e, 2 * inter, hidden),
            prefix + "experts.down_proj": gate_up.new_zeros(e, hidden, inter),
            prefix + "gate.weight": gate_up.new_zeros(e, hidden), prefix + "gate.e_score_correction_bias":
                gate_up.new_zeros(e)}


_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "self_attn.indexer.q_proj.weight": "indexer.q_proj.weight", "self_attn.indexer.k_proj.weight":
        "indexer.k_proj.weight", "self_attn.indexer.q_norm.weight": "indexer.q_norm.weight",
    "self_attn.indexer.k_norm.weight": "indexer.k_norm.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.experts.down_proj": "ffn_down_exps.weight", "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
_GATE_UP = {"mlp.gate_up_proj.weight": ("ffn_gate.weight", "ffn_up.weight"),
            "mlp.shared_experts.gate_up_proj.weight": ("ffn_gate_shexp.weight", "ffn_up_shexp.weight")}


def gguf_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor, str]]:
    """(llama.cpp's tensor name, tensor, transformers' name), torch shapes, of a model `widen` returned; RMS norm
    gains as 1 + w; every parameter and persistent buffer is placed or the export refuses."""
    from phasekv.export.gguf import place_tensors, split_gate_up

    def norm(name: str, t: torch.Tensor) -> torch.Tensor:
        return t.float() + 1.0 if name.endswith("norm.weight") else t

    def layer(block: str, rest: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if rest == "mlp.experts.gate_up_proj":
            return split_gate_up(block, t)
        if rest in _GATE_UP:  # (2I, H): gate rows then up rows
            return [(block + name, half) for name, half in zip(_GATE_UP[rest], t.chunk(2, dim=0))]
        return [(block + _LAYER[rest], norm(rest, t))] if rest in _LAYER else []

    return [(gguf_name, norm(source, t) if source in _TOP else t, source)
            for gguf_name, t, source in place_tensors(model, _TOP, layer)]


def gguf_metadata(config: Any) -> dict[str, Any]:
    """The `minimax-m3.*` hyper-parameters llama.cpp's loader reads, for a config `wide_config` returned."""
    key = f"{ARCH}.".__add__
    return {
        key("context_length"): config.max_position_embeddings, key("embedding_length"): config.hidden_size,
        key("block_count"): config.num_hidden_layers, key("vocab_size"): config.vocab_size,
        key("feed_forward_length"): config.dense_intermediate_size,
        key("leading_dense_block_count"): leading_dense(config),
        key("attention.head_count"): config.num_attention_heads,
        key("attention.head_count_kv"): config.num_key_value_heads,
        key("attention.key_length"): config.head_dim, key("attention.value_length"): config.head_dim,
        key("attention.layer_norm_rms_epsilon"): float(config.rms_norm_eps),
        key("rope.freq_base"): float(config.rope_parameters["rope_theta"]),
        key("rope.dimension_count"): rotary_dim(config),
        key("attention.indexer.head_count"): config.index_n_heads,
        key("attention.indexer.key_length"): config.index_head_dim,
        key("attention.indexer.top_k"): config.index_topk_blocks,
        key("attention.indexer.block_size"): config.index_block_size,
        key("attention.indexer.local_blocks"): config.index_local_blocks,
        key("expert_count"): config.num_local_experts, key("expert_used_count"): config.num_experts_per_tok,
        key("expert_shared_count"): config.shared_intermediate_size // config.intermediate_size,
        key("expert_feed_forward_length"): config.intermediate_size,
        key("expert_weights_scale"): float(config.routed_scaling_factor),
        key("expert_weights_norm"): True, key("expert_gating_func"): SIGMOID,
    }
