"""`phasekv export gguf`: a transformers DeepSeek-V4 checkpoint as a GGUF file that llama.cpp's `deepseek4` serves.

(DeepSeek-V3.2 checkpoints go to llama.cpp's `deepseek32` and MiniMax-M3 ones to `minimax-m3` through the same writer
and tokenizer; their layouts and widenings are in gguf_deepseek32.py and gguf_minimax_m3.py, chosen by `layout`.)

llama.cpp has its own DeepSeek-V4 kernels (src/models/deepseek4.cpp of b11434: the overlapping ratio-4 compressor and
lightning indexer of CSA, the ratio-128 compressor of HCA, hyper-connections, grouped output projection);
auditing them on phasekv-trained weights (docs/notes/gguf.md) needs the weights in llama.cpp's layout.  llama.cpp's
converter reads DeepSeek's release checkpoints, not transformers' names, so the GGUF is written here directly:
llama.cpp's tensor names (`blk.N.attn_compressor_kv`, `blk.N.indexer.attn_q_b`, ...) and `deepseek4.*`
hyper-parameters, float32 or float16 (no quantization: a difference from transformers is the kernel's), and a
tokenizer with one token per phasekv vocabulary entry.

What llama.cpp b11434 accepts, and how phasekv's small models are brought there without changing their function
(what llama-server does with the unchanged shapes is tested in tests/test_export_gguf.py):

  compress ratios   only 0 (sliding), 4 (CSA) and 128 (HCA): anything else is refused (`check_exportable`), and
                    so is a model without a CSA layer (llama-server dies of SIGFPE creating its context: the
                    indexer's key cache gets no layer, and the loop sizing its Hadamard rotation doubles the block
                    while 0 % (2 * block) == 0, until the block overflows to 0)
  hc_mult           its hyper-connection code asserts 4 streams (`GGML_ASSERT(hc == 4)`: the server aborts).  A
                    1-stream model is widened exactly: the 4 streams start as copies of the embedding (both codes)
                    and stay copies, because every stream gets the same post weight and the residual mix is
                    uniform (comb logits all equal: Sinkhorn keeps a uniform matrix uniform, and 4 copies times
                    1/4 is the 1-stream residual); the RMS norm of 4 equal copies is that of one; the collapse
                    weight of stream 0 is the 1-stream one, streams 1..3 get sigmoid(-1e4) = 0.  Left over: each
                    collapse adds hc_eps for each of the 3 extra streams (3e-6 absolute, and an RMS norm follows
                    every collapse), and the Sinkhorn iterations start from 1 + 4 eps instead of 1 + eps (their
                    contraction leaves ~1e-12).
  index_head_dim    the indexer's key cache is always Hadamard-rotated in blocks of 64 (or more) channels: a head
                    of 16 aborts the server (ggml_reshape_2d of 16-channel keys into rows of 64).  A narrower
                    indexer is padded exactly: the head's channels are laid out [nope | zeros | rope] (RoPE stays
                    on the trailing qk_rope_head_dim channels, as both codes apply it), the zero channels come
                    from zero rows of the projections, so scores are unchanged but for the RMS norm of the
                    compressed key, which now averages over d' channels: the key grows by sqrt(d'/d), which the
                    scorer's softmax scale 1/sqrt(d') undoes exactly; only the norm's eps acts d'/d times larger.
                    d' is the smallest multiple of 64 that differs from head_dim: llama.cpp rotates every cache
                    whose head size equals the indexer's, so a different size keeps the main attention
                    unrotated, as for the released model (512 vs 128).
  MoE scoring       sqrtsoftplus only (llama.cpp refuses others for deepseek4)

`widen(model)` returns the transformers model llama.cpp's config describes (the reference for the comparisons);
tests/test_export_gguf.py checks it against the original and the served GGUF against it.

The tokenizer is llama.cpp's `whitespace` model (whitespace-separated segments, each byte-pair merged): one token per
vocabulary word, the unused ids of the embedding as `[PADn]`, and merges that rebuild every word from its
characters (`word_merges`), so llama.cpp's own text tokenization equals `Vocabulary.encode` (prompts are sent as ids
anyway).  `word_tokenizer` is the same vocabulary as a transformers tokenizer (what `--tokenizer` reads).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phasekv.export.gguf_tokenizer import word_merges, word_tokenizer, word_tokens

log = logging.getLogger(__name__)

ARCH = "deepseek4"
HC_STREAMS = 4  # llama.cpp b11434 build_hc_pre: GGML_ASSERT(hc == 4)
ROTATION_BLOCK = 64  # the smallest Hadamard block llama.cpp rotates the indexer's key cache with
RATIOS = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
SQRT_SOFTPLUS = 4  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS
OFF = -1e4  # a hyper-connection base that switches a stream's collapse weight off: sigmoid(-1e4) = 0 in float32
DTYPES = ("f32", "f16")


# ---------------------------------------------------------------------------------------------- what exports


def check_exportable(config: Any) -> None:
    """Refuse, in one line naming the field, a DeepSeek-V4 config that llama.cpp b11434 cannot run."""
    if getattr(config, "model_type", None) != "deepseek_v4":
        raise ValueError(f"model.model_type: GGUF export covers deepseek_v4, got {config.model_type!r}")
    for i, kind in enumerate(config.layer_types):
        ratio = config.compress_rates.get(kind, 0) if kind != "sliding_attention" else 0
        if ratio != RATIOS[kind]:
            raise ValueError(f"model.compress_rates: llama.cpp's deepseek4 loader takes ratios 0, 4 and 128 only; "
                             f"layer {i} ({kind}) has {ratio}")
    if "compressed_sparse_attention" not in config.layer_types:
        raise ValueError("model.layer_types: llama.cpp b11434 needs a compressed_sparse_attention layer (without one "
                         "its indexer cache has no layer and its rotation-size loop divides by zero: SIGFPE)")
    if config.hc_mult not in (1, HC_STREAMS):
        raise ValueError(f"model.hc_mult: llama.cpp runs {HC_STREAMS} hyper-connection streams (1 is widened "
                         f"exactly), got {config.hc_mult}")
    if config.scoring_func != "sqrtsoftplus":
        raise ValueError(f"model.scoring_func: llama.cpp's deepseek4 loader takes sqrtsoftplus only, got "
                         f"{config.scoring_func!r}")
    for label, rope in config.rope_parameters.items():
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"model.rope_parameters: only default RoPE is exported, {label} has "
                             f"{rope.get('rope_type')!r}")
    hashed = [t == "hash_moe" for t in config.mlp_layer_types]
    if hashed != sorted(hashed, reverse=True):
        raise ValueError("model.mlp_layer_types: llama.cpp hash-routes the first hash_layer_count layers: hash_moe "
                         "layers must come first")


def indexer_dim(config: Any) -> int:
    """d': index_head_dim rounded up to a multiple of ROTATION_BLOCK, skipping head_dim (see the module docstring)."""
    d = -(-config.index_head_dim // ROTATION_BLOCK) * ROTATION_BLOCK
    return d + ROTATION_BLOCK if d == config.head_dim else d


# ---------------------------------------------------------------------------------------------- widening


def widen(model: nn.Module) -> nn.Module:
    """The same function as a DeepSeek-V4 model with HC_STREAMS streams and an indexer head of `indexer_dim` (a new
    float32 model in eval mode; `model` itself when it already has both)."""
    from phasekv import families

    config = model.config
    check_exportable(config)
    d_new = indexer_dim(config) if config.index_head_dim % ROTATION_BLOCK else config.index_head_dim
    if config.hc_mult == HC_STREAMS and d_new == config.index_head_dim:
        return model
    wide_config = copy.deepcopy(config)
    wide_config.hc_mult, wide_config.index_head_dim = HC_STREAMS, d_new
    state = {name: t.detach().float() if t.is_floating_point() else t for name, t in model.state_dict().items()}
    if config.hc_mult == 1:
        state = widen_streams(state)
    if d_new != config.index_head_dim:
        state = _pad_indexer(state, config, d_new)
    wide = families.build(wide_config)
    wide.load_state_dict(state, strict=True)
    return wide.float().eval()


def widen_streams(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """1-stream hyper-connections as HC_STREAMS identical streams (the module docstring says why this is exact)."""
    n = HC_STREAMS
    out = dict(state)
    for name, fn in state.items():
        if name.endswith(("attn_hc.fn", "ffn_hc.fn")):  # fn (3, D): pre, post, comb rows
            prefix = name[:-len("fn")]
            base = state[prefix + "base"]  # (3,)
            wide = fn.new_zeros((2 + n) * n, n * fn.shape[1])  # ((2+n)*n, n*D): [pre n | post n | comb n*n] rows
            wide[0, :fn.shape[1]] = fn[0]  # stream 0 collapses as the one stream did
            wide[n:2 * n, :fn.shape[1]] = fn[1]  # every stream takes the block output alike
            wide_base = base.new_zeros((2 + n) * n)  # comb logits all 0: a uniform mix
            wide_base[:n] = torch.tensor([float(base[0])] + [OFF] * (n - 1))
            wide_base[n:2 * n] = base[1]
            out[name], out[prefix + "base"] = wide, wide_base
        elif name.endswith("hc_head.hc_fn"):  # (1, D)
            prefix = name[:-len("hc_fn")]
            wide = fn.new_zeros(n, n * fn.shape[1])  # (n, n*D)
            wide[0, :fn.shape[1]] = fn[0]
            out[name] = wide
            out[prefix + "hc_base"] = torch.tensor([float(state[prefix + "hc_base"][0])] + [OFF] * (n - 1))
    return out


def _pad_indexer(state: dict[str, torch.Tensor], config: Any, d_new: int) -> dict[str, torch.Tensor]:
    """The indexer's head channels from d to d_new: [nope | zeros | rope] per head and per series (Ca, Cb)."""
    d, rope = config.index_head_dim, config.qk_rope_head_dim
    where = torch.cat([torch.arange(d - rope), torch.arange(d_new - rope, d_new)])  # (d,) old channel -> new

    def pad(t: torch.Tensor, dim: int) -> torch.Tensor:
        groups = t.shape[dim] // d  # series or heads stacked along `dim`
        moved = t.movedim(dim, 0).reshape(groups, d, *t.shape[:dim], *t.shape[dim + 1:])  # (G, d, ...)
        wide = moved.new_zeros(groups, d_new, *moved.shape[2:])  # (G, d', ...)
        wide[:, where] = moved
        return wide.reshape(groups * d_new, *moved.shape[2:]).movedim(0, dim)

    out = dict(state)
    for name, t in state.items():
        if ".indexer." not in name:
            continue
        if name.endswith(("indexer.kv_proj.weight", "indexer.gate_proj.weight", "indexer.q_b_proj.weight",
                          "indexer.kv_norm.weight")):
            out[name] = pad(t, 0)  # (2d or H*d or d, ...) rows
        elif name.endswith("indexer.position_bias"):
            out[name] = pad(t, 1)  # (m, 2d) columns
    return out


# ---------------------------------------------------------------------------------------------- GGUF layout


_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight", "model.hc_head.hc_fn": "output_hc_fn.weight",
        "model.hc_head.hc_base": "output_hc_base.weight", "model.hc_head.hc_scale": "output_hc_scale.weight"}
_LAYER = {
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.sinks": "attn_sinks", "self_attn.q_a_proj.weight": "attn_q_a",
    "self_attn.q_a_norm.weight": "attn_q_a_norm", "self_attn.q_b_proj.weight": "attn_q_b",
    "self_attn.kv_proj.weight": "attn_kv", "self_attn.kv_norm.weight": "attn_kv_a_norm",
    "self_attn.o_a_proj.weight": "attn_output_a", "self_attn.o_b_proj.weight": "attn_output_b",
    "self_attn.compressor.kv_proj.weight": "attn_compressor_kv",
    "self_attn.compressor.gate_proj.weight": "attn_compressor_gate",
    "self_attn.compressor.position_bias": "attn_compressor_ape",
    "self_attn.compressor.kv_norm.weight": "attn_compressor_norm",
    "self_attn.compressor.indexer.kv_proj.weight": "indexer_compressor_kv",
    "self_attn.compressor.indexer.gate_proj.weight": "indexer_compressor_gate",
    "self_attn.compressor.indexer.position_bias": "indexer_compressor_ape",
    "self_attn.compressor.indexer.kv_norm.weight": "indexer_compressor_norm",
    "self_attn.compressor.indexer.q_b_proj.weight": "indexer.attn_q_b",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "indexer.proj",
    "attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn", "ffn_hc.base": "hc_ffn_base", "ffn_hc.scale": "hc_ffn_scale",
    "mlp.gate.weight": "ffn_gate_inp", "mlp.gate.tid2eid": "ffn_gate_tid2eid",
    "mlp.experts.down_proj": "ffn_down_exps", "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp", "mlp.shared_experts.down_proj.weight": "ffn_down_shexp",
}


def gguf_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor, str]]:
    """(llama.cpp's tensor name, tensor, transformers' name) of a model llama.cpp accepts as it is (`widen` first);
    torch shapes (GGUF lists them reversed)."""
    def layer(block: str, rest: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if rest == "mlp.experts.gate_up_proj":
            return split_gate_up(block, t)
        if rest == "mlp.gate.e_score_correction_bias":
            return [(block + "exp_probs_b.bias", t)]
        if rest in _LAYER:
            return [(block + _LAYER[rest] + ".weight", t.to(torch.int32) if rest == "mlp.gate.tid2eid" else t)]
        return []

    return place_tensors(model, _TOP, layer)


def split_gate_up(block: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """transformers' packed experts (E, 2I, H: gate rows then up rows) as llama.cpp's two expert tensors."""
    gate, up = t.chunk(2, dim=1)
    return [(block + "ffn_gate_exps.weight", gate), (block + "ffn_up_exps.weight", up)]


def place_tensors(model: nn.Module, top: dict[str, str], layer) -> list[tuple[str, torch.Tensor, str]]:
    """(llama.cpp's name, tensor, transformers' name) for every parameter and persistent buffer of `model`: `top`
    maps whole names, `layer(block, rest, tensor)` the rest of `model.layers.N.rest` under `block` = "blk.N." (a
    list of (name, tensor), empty for none).  A tensor nothing places is refused, so nothing is dropped silently;
    RoPE's inverse frequencies are left out (llama.cpp recomputes them from the rope keys)."""
    out = []
    for name, t in model.state_dict().items():
        if ".rotary_emb." in name:
            continue
        if name in top:
            out.append((top[name], t, name))
            continue
        parts = name.split(".", 3)  # model, layers, i, rest
        placed = layer(f"blk.{parts[2]}.", parts[3], t) if len(parts) == 4 and parts[:2] == ["model", "layers"] else []
        if not placed:
            raise ValueError(f"gguf export: no llama.cpp tensor for {name}")
        out += [(gguf_name, tensor, name) for gguf_name, tensor in placed]
    return out


def gguf_metadata(config: Any) -> dict[str, Any]:
    """The `deepseek4.*` hyper-parameters llama.cpp's loader reads (lists: per layer)."""
    n = config.num_hidden_layers
    key = f"{ARCH}.".__add__
    return {
        key("context_length"): config.max_position_embeddings, key("embedding_length"): config.hidden_size,
        key("embedding_length_out"): config.hidden_size * config.hc_mult, key("block_count"): n,
        key("feed_forward_length"): config.moe_intermediate_size,
        key("attention.head_count"): config.num_attention_heads,
        key("attention.head_count_kv"): config.num_key_value_heads,
        key("attention.key_length"): config.head_dim, key("attention.value_length"): config.head_dim,
        key("attention.layer_norm_rms_epsilon"): float(config.rms_norm_eps),
        key("attention.q_lora_rank"): config.q_lora_rank, key("attention.sliding_window"): config.sliding_window,
        key("attention.output_group_count"): config.o_groups, key("attention.output_lora_rank"): config.o_lora_rank,
        key("attention.compress_ratios"): [RATIOS[t] for t in config.layer_types],
        key("attention.compress_rope_freq_base"): float(config.rope_parameters["compress"]["rope_theta"]),
        key("rope.freq_base"): float(config.rope_parameters["main"]["rope_theta"]),
        key("rope.dimension_count"): config.qk_rope_head_dim,
        key("attention.indexer.head_count"): config.index_n_heads,
        key("attention.indexer.key_length"): config.index_head_dim,
        key("attention.indexer.top_k"): config.index_topk,
        key("expert_count"): config.n_routed_experts, key("expert_used_count"): config.num_experts_per_tok,
        key("expert_shared_count"): config.n_shared_experts,
        key("expert_feed_forward_length"): config.moe_intermediate_size,
        key("expert_weights_scale"): float(config.routed_scaling_factor),
        key("expert_weights_norm"): bool(config.norm_topk_prob), key("expert_gating_func"): SQRT_SOFTPLUS,
        key("swiglu_clamp_exp"): [float(config.swiglu_limit)] * n,
        key("swiglu_clamp_shexp"): [float(config.swiglu_limit)] * n,
        key("hyper_connection.count"): config.hc_mult,
        key("hyper_connection.sinkhorn_iterations"): config.hc_sinkhorn_iters,
        key("hyper_connection.epsilon"): float(config.hc_eps),
        key("hash_layer_count"): sum(t == "hash_moe" for t in config.mlp_layer_types),
    }


# ---------------------------------------------------------------------------------------------- writing


def write_gguf(model: nn.Module, vocab: Any, out: str | Path, dtype: str = "f32", name: str = "phasekv") -> dict:
    """Write `model` (llama.cpp-shaped: `widen` first) and `vocab` as a GGUF file at `out`, atomically (a
    temporary sibling, flushed, read back and checked (`gguf_check`), renamed; a failed write, a full disk included,
    is one line and leaves no file).
    f16 stores the matrices as float16 except those transformers keeps in float32 (hyper-connections, sinks,
    compressor biases, norms) and those the layout's KEEP_F32 names (MiniMax-M3's indexer); 1-D tensors are always
    float32."""
    import gguf
    import numpy as np

    from phasekv.export.gguf_check import fingerprint, publish_gguf, tensor_bytes
    from phasekv.outputs import write_error

    if dtype not in DTYPES:
        raise ValueError(f"--dtype: must be one of {list(DTYPES)}, got {dtype!r}")
    config = model.config
    arch = layout(config)
    out = Path(out)
    keep_f32 = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ()) + getattr(arch, "KEEP_F32", ())
    tmp, written = out.with_name(f".{out.name}.tmp-{os.getpid()}"), {}
    writer = gguf.GGUFWriter(str(tmp), arch.ARCH)
    try:
        writer.add_name(name)
        writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else gguf.LlamaFileType.ALL_F32))
        for key, value in arch.gguf_metadata(config).items():
            _add_value(writer, gguf, key, value)
        tokens = word_tokens(vocab, config.vocab_size)
        writer.add_tokenizer_model("whitespace")
        writer.add_tokenizer_pre("whitespace")
        writer.add_token_list(tokens)
        specials = set(vocab.group("specials"))
        writer.add_token_types([gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL
                                if i < vocab.size else gguf.TokenType.UNUSED for i in range(len(tokens))])
        writer.add_token_merges(word_merges([w for i, w in enumerate(vocab.words) if i not in specials]))
        writer.add_bos_token_id(vocab.bos)
        writer.add_eos_token_id(tokens.index("<pad>"))
        writer.add_pad_token_id(tokens.index("<pad>"))
        writer.add_add_bos_token(False)  # phasekv prompts start with <bos> themselves
        writer.add_add_eos_token(False)
        tensors = arch.gguf_tensors(model)
        for gguf_name, t, source in tensors:
            array = t.detach().cpu().float().numpy() if t.is_floating_point() else t.cpu().numpy()
            if dtype == "f16" and array.ndim >= 2 and not any(k in source for k in keep_f32):
                array = array.astype(np.float16)
            writer.add_tensor(gguf_name, np.ascontiguousarray(array))
            written[gguf_name] = fingerprint(np.ascontiguousarray(array))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        publish_gguf(tmp, out, written)
    except OSError as exc:  # numpy's short write ("32768 requested and 19496 written") carries no errno
        raise write_error(exc, out, tensor_bytes(written)) from None
    finally:
        with contextlib.suppress(OSError):  # closing flushes: on a full disk that fails too
            writer.close()
        tmp.unlink(missing_ok=True)
    return {"file": str(out), "tensors": len(tensors), "dtype": dtype, "bytes": out.stat().st_size}


LAYOUTS = {"deepseek_v4": __name__, "deepseek_v32": "phasekv.export.gguf_deepseek32",
           "minimax_m3_vl_text": "phasekv.export.gguf_minimax_m3", "glm5_next_text": "phasekv.export.gguf_glm5_next"}


def layout(config: Any):
    """The module that holds llama.cpp's layout for `config.model_type` (ARCH, check_exportable, widen,
    gguf_tensors, gguf_metadata): this one for DeepSeek-V4, one module per other architecture."""
    import importlib

    if config.model_type not in LAYOUTS:
        raise ValueError(f"model.model_type: GGUF export covers {covered()}, got {config.model_type!r}")
    return importlib.import_module(LAYOUTS[config.model_type])


def covered() -> str:
    """The model types `layout` knows, as a phrase ("a, b and c")."""
    names = list(LAYOUTS)
    return f"{', '.join(names[:-1])} and {names[-1]}"


def _add_value(writer, gguf, key: str, value: Any) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, list):
        sub = gguf.GGUFValueType.FLOAT32 if isinstance(value[0], float) else gguf.GGUFValueType.UINT32
        writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=sub)
    else:
        writer.add_string(key, str(value))


def export_gguf(checkpoint: str | Path, out: str | Path, dtype: str = "f32", hf_out: str | Path | None = None,
                force: bool = False) -> dict[str, Any]:
    """`phasekv export gguf`: the checkpoint's model, widened for llama.cpp (`widen`), as a GGUF file at `out`;
    with `hf_out`, the same widened weights as a transformers directory with `word_tokenizer` (what
    `phasekv eval --endpoint --tokenizer DIR --reference-hf DIR` reads).  Returns what was written."""
    from phasekv.checkpoint import load_checkpoint, read_experiment, resolve
    from phasekv.config import TransformersModelConfig, model_config_from_dict
    from phasekv.data.vocab import Vocabulary
    from phasekv.outputs import output_dir

    if dtype not in DTYPES:  # before the (slow) model
        raise ValueError(f"--dtype: must be one of {list(DTYPES)}, got {dtype!r}")
    out = Path(out)
    if out.suffix != ".gguf":
        raise ValueError(f"--out {out}: must name a .gguf file")
    if out.is_dir() or out.is_symlink() or (out.exists() and not force):
        raise ValueError(f"--out {out}: exists; pass --force to replace it or choose a new file name")
    if not out.parent.is_dir():
        raise ValueError(f"--out {out}: its directory {out.parent} does not exist")
    experiment = read_experiment(checkpoint)
    config = model_config_from_dict(experiment["model"])
    if not isinstance(config, TransformersModelConfig) or config.model_type not in LAYOUTS:
        raise ValueError(f"checkpoint {checkpoint}: model.model_type: GGUF export covers transformers' "
                         f"{covered()}, got {experiment['model'].get('model_type', 'phasekv')!r}")
    arch = layout(config)
    arch.check_exportable(config.to_hf())  # before the weights are read
    if "vocab" not in experiment:
        raise ValueError(f"checkpoint {checkpoint}: config.json has no 'vocab' (not written by phasekv train)")
    vocab = Vocabulary.from_dict(experiment["vocab"])
    if hf_out is not None and getattr(arch, "NO_HF_OUT", None):
        raise ValueError(f"--hf-out: {arch.NO_HF_OUT}")
    model, _ = load_checkpoint(checkpoint)
    wide = arch.widen(model)
    name = resolve(checkpoint).name
    if hf_out is None:
        summary = write_gguf(wide, vocab, out, dtype, name)
    else:  # the GGUF is written before --hf-out is published: a failed one leaves neither behind
        with output_dir(hf_out, force) as tmp:
            wide.save_pretrained(tmp)
            word_tokenizer(vocab, wide.config.vocab_size).save_pretrained(tmp)
            summary = write_gguf(wide, vocab, out, dtype, name)
    widened = {field: [getattr(model.config, field), getattr(wide.config, field)]
               for field in getattr(arch, "WIDENED", ("hc_mult", "index_head_dim")) if hasattr(model.config, field)}
    return {**summary, "checkpoint": str(checkpoint), "widened": widened,
            "hf_out": None if hf_out is None else str(hf_out)}
