"""The one small interface evaluation and probes use to talk to a model (docs/architecture.md).

An adapter scores next-token logits for batches of token ids, either in one forward pass or by
prefilling shared contexts once and continuing several queries from copies of the cache.  Both
phasekv models and Hugging Face causal LMs implement it; probes attach PyTorch hooks to
`adapter.attention_layers()` (each layer's `self_attn` and its output projection, `o_proj` or the module the
model's architecture names in `phasekv.archs`, have the same roles in both families).

Every position is a real token: there is no padding and no attention mask, so a token's phase is
its index in the input ids.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass

import torch
from torch import nn

from phasekv.archs import architecture_of
from phasekv.cache import KVCache
from phasekv.families import compression_geometry
from phasekv.model import PhaseKVForCausalLM


@dataclass
class ModelInfo:
    name: str
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_length: int
    stride: int | None  # the compression stride that sets phase (None: no compression)
    local_window: int | None  # raw tokens a compressed layer sees exactly (None: full attention)


class Adapter:
    info: ModelInfo
    module: nn.Module
    device: torch.device
    shares_cache = False  # True: continue_from reads the prefilled cache without copying it per query row

    def attention_layers(self) -> list[nn.Module]:
        """The attention module of each layer (exposing its output projection: `o_proj`, or what its architecture
        names, `phasekv.archs`)."""
        raise NotImplementedError

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, T) -> logits (B, T, V), one forward pass without cache."""
        raise NotImplementedError

    def prefill(self, ids: torch.Tensor):
        """ids (B, T) -> an opaque cache of the B contexts."""
        raise NotImplementedError

    def continue_from(self, cache, ids: torch.Tensor, repeats: int) -> torch.Tensor:
        """Continue each of the cached contexts with `repeats` query rows each (context-major order):
        ids (B * repeats, t) -> logits (B * repeats, t, V).  The cache itself is left unchanged."""
        raise NotImplementedError

    def check_length(self, length: int) -> None:
        if length > self.info.max_length:
            raise ValueError(f"prompt length {length} exceeds the model's context ({self.info.max_length} tokens)")


class PhaseKVAdapter(Adapter):
    # continue_from reads the cache in place (KVCache.shared), so one call may continue many contexts'
    # queries at once without a copy of the cache per query
    shares_cache = True

    def __init__(self, model: nn.Module, name: str = "phasekv"):
        cfg = model.config
        self.module, self.device = model.eval(), next(model.parameters()).device
        windowed = any(kind != "full" for kind in cfg.layer_types)
        self.info = ModelInfo(name, cfg.vocab_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                              cfg.num_key_value_heads, cfg.head_dim, cfg.max_position_embeddings, cfg.phase_stride,
                              cfg.local_window if windowed else None)

    def attention_layers(self) -> list[nn.Module]:
        return [layer.self_attn for layer in self.module.model.layers]

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.module(ids.to(self.device))

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> KVCache:
        cache = KVCache()
        self.module.prefill(ids.to(self.device), cache)  # the cache only: no logits of the context
        return cache

    @torch.no_grad()
    def continue_from(self, cache: KVCache, ids: torch.Tensor, repeats: int) -> torch.Tensor:
        return self.module(ids.to(self.device), cache=cache.shared(repeats))


class HFAdapter(Adapter):
    """Any transformers causal LM.  The cache is its DynamicCache, deep-copied and repeated per query."""

    def __init__(self, model: nn.Module, name: str, stride: int | None = None, local_window: int | None = None):
        cfg = model.config
        text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        heads = text.num_attention_heads
        self.module, self.device = model.eval(), next(model.parameters()).device
        self.info = ModelInfo(name, text.vocab_size, text.num_hidden_layers, heads,
                              getattr(text, "num_key_value_heads", None) or heads,
                              getattr(text, "v_head_dim", None) or getattr(text, "head_dim", None)  # o_proj input
                              or text.hidden_size // heads,
                              getattr(text, "max_position_embeddings", 1 << 30), stride, local_window)

    def attention_layers(self) -> list[nn.Module]:
        layers = None
        for path in ("model.layers", "model.model.layers", "transformer.h", "model.decoder.layers"):
            obj = self.module
            try:
                for part in path.split("."):
                    obj = getattr(obj, part)
            except AttributeError:
                continue
            layers = obj
            break
        if layers is None:
            raise ValueError(f"{self.info.name}: cannot find decoder layers (looked for model.layers)")
        attn = [getattr(layer, "self_attn", None) for layer in layers]
        arch = architecture_of(self.module)
        if any(a is None or arch.output_projection(a) is None for a in attn):
            raise ValueError(f"{self.info.name}: layers have no self_attn.o_proj (or the output projection their "
                             f"architecture names in phasekv.archs; read as {arch.name!r})")
        return attn

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.module(input_ids=ids.to(self.device), use_cache=False).logits

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor):
        # the cache is what is wanted: the LM head runs on the last position only where the class allows it
        keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(self.module.forward).parameters else {}
        out = self.module(input_ids=ids.to(self.device), use_cache=True, **keep)
        past = getattr(out, "cache", None) or out.past_key_values  # renamed in transformers 5.x
        return (past, ids.shape[1])

    @torch.no_grad()
    def continue_from(self, cache, ids: torch.Tensor, repeats: int) -> torch.Tensor:
        past, length = cache
        past = copy.deepcopy(past)
        if repeats > 1:  # every cache layer repeats its whole state (compressor buffers too)
            architecture_of(self.module).repeat_cache(past, ids.shape[0] // repeats, repeats)
        ids = ids.to(self.device)
        positions = torch.arange(length, length + ids.shape[1], device=self.device).expand(ids.shape[0], -1)
        name = "cache" if "cache" in inspect.signature(self.module.forward).parameters else "past_key_values"
        return self.module(input_ids=ids, position_ids=positions, use_cache=True, **{name: past}).logits


def adapter_for(model: nn.Module, name: str) -> Adapter:
    """The adapter of a model of either family (`phasekv.families`)."""
    if isinstance(model, PhaseKVForCausalLM):
        return PhaseKVAdapter(model, name)
    geometry = compression_geometry(model)  # transformers' own chunked compression: its stride is the phase stride
    return HFAdapter(model, name, stride=geometry["stride"] if geometry else None)
