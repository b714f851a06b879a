"""Hybrid models under the audit conditions: which layers a condition acts on, which it leaves as the model runs
them, and what each cache layer holds (docs/science.md section 1).

Most served models mix layer kinds: sliding-window layers (Gemma 3, Cohere2, GPT-OSS), chunked local layers (Llama
4's `attention_chunk_size`: a token sees its own chunk of C tokens, chunks aligned at multiples of C), linear or
recurrent layers (Qwen3-Next's gated delta rule) and full-attention layers, the only ones that keep the whole past.
A compression condition is a statement about a cache that keeps the whole past, so every condition acts on the
full-attention layers only (`TARGET`) and leaves the others exactly as the model runs them: their cache entries,
their masks and their attention function are the model's own.

  - `layer_kinds(model)`: each decoder layer's kind, read from the config as transformers' own cache reads it
    (`get_layer_types_and_kwargs`): full, sliding, chunked, linear, and the kinds no condition supports.
  - `cache_plan(cache, kinds)`: per cache layer, whether post-hoc compression compresses it ("full") or leaves it
    (its kind); a one-line ValueError for a layer kind no condition can act on, with the reason.
  - `OffsetLayer`: a compressed full-attention layer inside a hybrid cache.  It holds fewer entries than positions
    seen, so it reports the positions seen as its length (what the other layers report, and what Llama 4's NoPE
    temperature reads) and offsets its mask so that the queries' own keys stay causal among themselves.
  - `layer_bytes(layer)`: the bytes a cache layer holds, for every layer type (keys and values, a sliding window,
    conv and recurrent states, indexer keys).
  - attention-function conditions (selection, head masks) install one attention implementation for the whole model;
    `split_modules` registers the model's own implementation for the layers they leave, and `attend_left` runs it.

Layout: cache tensors are (B, H_kv, T, D), as in transformers' DynamicLayer.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

TARGET = "full"
_KINDS = {"full_attention": "full", "sliding_attention": "sliding", "chunked_attention": "chunked",
          "linear_attention": "linear", "conv": "linear", "dummy": "shared", "indexed_attention": "indexed",
          "hybrid": "linear+full", "hybrid_sliding": "linear+sliding"}
# why no condition acts on a layer of this kind (the cache types the audit's dynamic prefill never builds are below)
_REFUSED = {
    "indexed": "its indexer keys cover the same positions as its keys: compressing the keys alone desynchronises "
               "the model's own token selection",
    "linear+full": "it holds a recurrent state and full-attention keys in one layer; phasekv compresses full-"
                   "attention layers kept apart from the recurrent ones",
}
_STATE_FIELDS = ("keys", "values", "conv_states", "recurrent_states", "indexer_keys")


def layer_kinds(model: nn.Module) -> list[str]:
    """Each decoder layer's kind (full, sliding, chunked, linear, shared, ...), from the model's text config as
    transformers' DynamicCache reads it."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    from phasekv.archs.base import text_config

    config = text_config(model.config)
    try:
        types, _ = get_layer_types_and_kwargs(config)
    except AttributeError:  # not a transformers config with per-layer configs: a plain full-attention decoder
        return [TARGET] * int(getattr(config, "num_hidden_layers", 0) or 0)
    return [_KINDS.get(t, t) for t in types]


def target_layers(model: nn.Module) -> list[int]:
    """The layers every condition acts on: those that keep the whole past."""
    return [i for i, kind in enumerate(layer_kinds(model)) if kind == TARGET]


def touched(model: nn.Module, acts: bool) -> dict[str, Any]:
    """What a condition did to the model's layers (summary.json's `layers`): `compressed` the layer indices it acts
    on (none for the full cache), `left` the others with their kind, as the model runs them."""
    kinds = layer_kinds(model)
    compressed = [i for i, k in enumerate(kinds) if k == TARGET] if acts else []
    return {"compressed": compressed, "left": {str(i): k for i, k in enumerate(kinds) if i not in compressed},
            "kinds": kinds}


def _cache_kind(layer: Any, kind: str) -> str:
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    name = type(layer).__name__
    if type(layer) is DynamicLayer or isinstance(layer, offset_layer_class()):
        return TARGET
    if type(layer) is DynamicSlidingWindowLayer:
        return kind if kind in ("sliding", "chunked") else "sliding"
    if name in ("LinearAttentionLayer", "DummyLayer"):
        return "linear" if name == "LinearAttentionLayer" else "shared"
    if name in ("DynamicIndexedLayer", "LinearAttentionAndFullAttentionLayer"):
        return {"DynamicIndexedLayer": "indexed"}.get(name, "linear+full")
    return name


def cache_plan(cache: Any, kinds: list[str] | None = None) -> list[str]:
    """Per layer of a prefilled transformers cache: "full" (a condition compresses it) or the kind it is left as;
    one-line ValueError for a layer no condition can act on or leave (static, quantized, indexed layers)."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ValueError(f"{type(cache).__name__}: not a transformers Cache with .layers (transformers >= 4.56)")
    plan = []
    for i, layer in enumerate(layers):
        kind = _cache_kind(layer, kinds[i] if kinds and i < len(kinds) else TARGET)
        if kind in _REFUSED:
            raise ValueError(f"cache layer {i} is a {type(layer).__name__}: post-hoc compression cannot act on it "
                             f"({_REFUSED[kind]})")
        if kind not in (TARGET, "sliding", "chunked", "linear", "shared"):
            raise ValueError(f"cache layer {i} is a {kind}: post-hoc compression acts on dynamic caches (full, "
                             "sliding-window, chunked, linear layers); a static or quantized cache holds its "
                             "entries in fixed slots or quantized blocks that a shorter cache cannot replace")
        plan.append(kind)
    return plan


def layer_bytes(layer: Any) -> int:
    """Bytes of the state a cache layer holds (keys, values, conv and recurrent states, indexer keys)."""
    total = 0
    for name in _STATE_FIELDS:
        value = getattr(layer, name, None)
        items = value.values() if isinstance(value, dict) else value if isinstance(value, list | tuple) else [value]
        total += sum(t.numel() * t.element_size() for t in items if isinstance(t, torch.Tensor))
    return total


_OFFSET_LAYER: type | None = None


def offset_layer_class() -> type:
    """`OffsetLayer`, the class of a compressed full-attention layer in a hybrid cache (the module docstring), built
    on first use (transformers is imported lazily)."""
    global _OFFSET_LAYER
    if _OFFSET_LAYER is None:
        from transformers.cache_utils import DynamicLayer

        class OffsetLayer(DynamicLayer):
            dropped = 0  # positions seen but not held (the compressed cache is this much shorter)

            def get_seq_length(self) -> int:
                return super().get_seq_length() + self.dropped

            def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
                # keys at mask indices dropped .. seen + q - 1: the queries at seen .. seen + q - 1 see every held
                # entry and their own keys causally
                return super().get_seq_length() + query_length, self.dropped

        _OFFSET_LAYER = OffsetLayer
    return _OFFSET_LAYER


def offset_layer(keys: torch.Tensor, values: torch.Tensor, seen: int):
    """A compressed full-attention layer holding `keys`, `values` (B, H, T', D) of `seen` positions."""
    layer = offset_layer_class()()
    layer.lazy_initialization(keys, values)
    layer.keys, layer.values, layer.dropped = keys, values, seen - keys.shape[-2]
    return layer


# ----------------------------------------------------------------------------- attention-function conditions

_LEFT: dict[int, Callable] = {}  # id(attention module) -> the model's own attention function, for layers left as is


def own_attention(module: nn.Module, implementation: str | None) -> Callable:
    """The attention function `module` runs under `implementation` (its modeling file's eager one by default)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as eager
    return ALL_ATTENTION_FUNCTIONS.get_interface(implementation or "eager", eager)


def split_modules(model: nn.Module, modules: list[nn.Module], implementation: str | None) -> list[nn.Module]:
    """The modules of `modules` a condition acts on (full-attention layers); the others are registered to run the
    model's own `implementation` (`attend_left`) until `release`."""
    kinds = layer_kinds(model)
    targets = []
    for module in modules:
        index = int(getattr(module, "layer_idx", 0))
        if index < len(kinds) and kinds[index] != TARGET:
            _LEFT[id(module)] = own_attention(module, implementation)
        else:
            targets.append(module)
    return targets


def release(modules: list[nn.Module]) -> None:
    for module in modules:
        _LEFT.pop(id(module), None)


def attend_left(module: nn.Module, *args, **kwargs):
    """Run a left layer's own attention function (the mask it gets is transformers' for its kind)."""
    return _LEFT[id(module)](module, *args, **kwargs)


def is_left(module: nn.Module) -> bool:
    return id(module) in _LEFT


def sink_logits(kwargs: dict[str, Any], heads: int) -> torch.Tensor | None:
    """GPT-OSS's learned per-head attention sinks (`s_aux`, (H,)) of an attention call, or None; a call with logit
    soft-capping is refused (the selection and mask kernels do not model it)."""
    if kwargs.get("softcap") is not None:
        raise ValueError("attention logit soft-capping (softcap) is not modeled by phasekv's selection and head-mask "
                         "kernels: use a post-hoc condition (select, mean, max-norm)")
    sinks = kwargs.get("s_aux")
    return None if sinks is None else sinks.reshape(heads)


def softmax_with_sinks(logits: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last axis of logits (B, H, Tq, Tk) with, per head, one more logit `sinks` (H,) that takes
    probability mass and gives no value (GPT-OSS's sinks); plain softmax without sinks.  Float32."""
    if sinks is None:
        return logits.softmax(-1, dtype=torch.float32)
    extra = sinks.float().reshape(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
    return torch.cat([logits.float(), extra], -1).softmax(-1)[..., :-1]
