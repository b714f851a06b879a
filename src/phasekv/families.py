"""Model families: the seam between the models and phasekv's trainer, checkpoints, evaluation and probes.

Everything above this module sees "a causal LM": `build(config)` makes one, `logits(model, ids)`
runs it on token ids (B, T) -> (B, T, V); attention modules with an `o_proj` serve the knockouts
(`phasekv.evaluate.adapter`), and compressors, if any, are found by type
(`phasekv.compression.compressors_of`).  Two families exist:

  phasekv       `PhaseKVForCausalLM` from a `ModelConfig` (full, sliding or compressed layers)
  transformers  any transformers causal LM from a `TransformersModelConfig` (`model_type` plus that
                config class's fields, e.g. Qwen3ForCausalLM); transformers' classes are used as
                they are, never re-implemented
"""

from __future__ import annotations

import torch
from torch import nn

from phasekv.config import ModelConfig, TransformersModelConfig
from phasekv.model import PhaseKVForCausalLM, build_model

ModelConfigLike = ModelConfig | TransformersModelConfig


def build(config: ModelConfigLike) -> nn.Module:
    """A freshly initialized causal LM of either family (seed torch first for reproducible weights)."""
    if isinstance(config, ModelConfig):
        return build_model(config)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config.to_hf())


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
