"""Model families: the seam between the models and phasekv's trainer, checkpoints, evaluation and probes.

Everything above this module sees "a causal LM": `build(config)` makes one, `logits(model, ids)`
runs it on token ids (B, T) -> (B, T, V); attention modules with an `o_proj` serve the knockouts
(`phasekv.adapters`), and compressors, if any, are found by type
(`phasekv.compression.compressors_of`).  Two families exist:

  phasekv       `PhaseKVForCausalLM` from a `ModelConfig` (full, sliding or compressed layers)
  transformers  any transformers causal LM from a `TransformersModelConfig` (`model_type` plus that
                config class's fields, e.g. Qwen3ForCausalLM); transformers' classes are used as
                they are, never re-implemented.  A text model transformers ships only inside a
                multimodal class (GLM-5.3's) gets a linear LM head (`phasekv.hf.textlm.TextCausalLM`).
                Models with a sparse-attention indexer (`phasekv.archs.indexer_kl`) run eager attention: their
                indexer objective reads the main attention's probabilities, which only the eager path
                returns.  What phasekv knows of each transformers architecture lives in `phasekv.archs`.

`build` first checks that the weights fit in memory (`check_fits`, through `phasekv.memory`): the model is
built once on the `meta` device (no storage) and its parameters counted, so an absurd config is refused in one
line instead of being allocated until the machine swaps or the kernel kills the process.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from phasekv.archs import architecture_of, geometry_of
from phasekv.archs.indexer_kl import indexers_of
from phasekv.config import ModelConfig, TransformersModelConfig
from phasekv.hf.textlm import TextCausalLM
from phasekv.memory import check_budget
from phasekv.model import PhaseKVForCausalLM, build_model

ModelConfigLike = ModelConfig | TransformersModelConfig


def _build(config: Any) -> nn.Module:
    """A model from a ModelConfig, a TransformersModelConfig or a transformers config object."""
    if isinstance(config, ModelConfig):
        return build_model(config)
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    hf = config.to_hf() if isinstance(config, TransformersModelConfig) else config
    architecture_of(hf).check_config(hf)
    model = AutoModelForCausalLM.from_config(hf) if type(hf) in MODEL_FOR_CAUSAL_LM_MAPPING else TextCausalLM(hf)
    if indexers_of(model):
        model.set_attn_implementation("eager")
    return model


def build(config: ModelConfigLike, copies: float = 1.0) -> nn.Module:
    """A freshly initialized causal LM of either family (seed torch first for reproducible weights), refused
    beforehand when `copies` times its weights would not fit in memory (4 for training with AdamW)."""
    check_fits(config, copies=copies)
    return _build(config)


def weight_bytes(config: Any, bytes_per_value: int = 4) -> int:
    """Bytes of the model's parameters and buffers (float32 by default), counted without allocating:
    the model is built on the meta device, so every family and compressor is counted exactly.
    `config`: a ModelConfig, a TransformersModelConfig or a transformers config object."""
    with torch.device("meta"):
        model = _build(config)
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() for t in tensors) * bytes_per_value


def check_fits(config: Any, copies: float = 1.0, available: int | None = None, bytes_per_value: int = 4) -> None:
    """Refuse, before anything is allocated, a model whose weights (times `copies`, e.g. 4 for weights,
    gradients and two AdamW moments) would not fit in the available memory (or in `available` bytes)."""
    check_budget(weight_bytes(config, bytes_per_value) * copies,
                 f"model (its weights{f' x {copies:g}' if copies != 1 else ''})", have=available,
                 advice="use smaller sizes (hidden_size, intermediate_size, num_hidden_layers, vocab_size)")


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel wrapper (or the model itself)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """ids (B, T) -> next-token logits (B, T, V), one forward without a cache (DDP-wrapped or not)."""
    if isinstance(unwrap(model), PhaseKVForCausalLM):
        return model(ids)
    return model(input_ids=ids, use_cache=False).logits


def family_name(model: nn.Module) -> str:
    return "phasekv" if isinstance(unwrap(model), PhaseKVForCausalLM) else "transformers"


def compression_geometry(model: nn.Module) -> dict[str, Any] | None:
    """Chunked compression inside a transformers model, read from its config by its architecture
    (`phasekv.archs`; its classes are not phasekv compressors): {"compressor", "window", "stride",
    "compressed_layers"} of the first compressed layer's kind (compressed_layers: the indices of the layers of that
    kind), or None (dense models, token-level indexers, phasekv's own models)."""
    geometry = geometry_of(unwrap(model))
    return None if geometry is None else geometry.as_dict()
