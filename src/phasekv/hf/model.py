"""phasekv models through transformers' Auto classes: `PhaseKVConfig` and `HFPhaseKVForCausalLM`.

After `import phasekv`, `AutoConfig` / `AutoModelForCausalLM.from_pretrained(DIR)` load a phasekv checkpoint
directory (`phasekv.hf.registration` registers these classes, without trust_remote_code).  The config is the
checkpoint's experiment as it is (`model`, `data`, `train`, `vocab`, `eval` sections), so the directories
`save_pretrained` writes are phasekv checkpoints too (`phasekv.load_checkpoint`, `phasekv eval --checkpoint`).
The model holds the same modules under the same names as `phasekv.model.PhaseKVForCausalLM`; weights load
through phasekv's own strict loader (`phasekv.checkpoint.load_weights`: names, shapes, finite values) and
compute in float32 unless `dtype` says otherwise, so logits equal `phasekv.load_checkpoint`'s.

Cache adapter: `generate()` runs with phasekv's compressed `KVCache` (raw window + pending window + compressed
entries), passed as `cache`; `prepare_inputs_for_generation` feeds only the tokens the cache has not seen.
phasekv models take no padding (a token's phase is its index in the input): an attention mask with a zero
is refused.  Layout: input_ids (B, T) -> logits (B, T, vocab).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from phasekv.cache import KVCache
from phasekv.checkpoint import MODEL_FILE, load_tensors, load_weights, resolve
from phasekv.hf.config import PhaseKVConfig
from phasekv.model import Qwen3Model, check_input

log = logging.getLogger(__name__)

class HFPhaseKVForCausalLM(PreTrainedModel, GenerationMixin):
    """`phasekv.model.PhaseKVForCausalLM` as a transformers PreTrainedModel (same modules, same names)."""

    config_class = PhaseKVConfig
    base_model_prefix = "model"
    _no_split_modules = ["DecoderLayer"]

    def __init__(self, config: PhaseKVConfig):
        super().__init__(config)
        model_config = config.model_config
        self.model = Qwen3Model(model_config)
        self.lm_head = nn.Linear(model_config.hidden_size, model_config.vocab_size, bias=False)
        if model_config.tie_word_embeddings:
            self._tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        # as phasekv.model.PhaseKVForCausalLM: compressor parameters initialize themselves
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=self.config.model["initializer_range"])

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the compressed KVCache comes from prepare_inputs_for_generation

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                cache: KVCache | None = None, use_cache: bool | None = None, **_ignored: Any) -> CausalLMOutputWithPast:
        """input_ids (B, T) -> logits (B, T, vocab); with `use_cache`, continues and returns `cache`."""
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("attention_mask: phasekv models take no padding (phase is the absolute position); "
                             "batch prompts of equal length")
        if use_cache and cache is None:
            cache = KVCache()
        check_input(self.config.model_config, input_ids, cache.length if cache is not None else 0)
        logits = self.lm_head(self.model(input_ids, cache))
        return CausalLMOutputWithPast(logits=logits, cache=cache if use_cache else None)

    def prepare_inputs_for_generation(self, input_ids: torch.Tensor, cache: KVCache | None = None,
                                      attention_mask: torch.Tensor | None = None, use_cache: bool | None = None,
                                      **_ignored: Any) -> dict[str, Any]:
        """The tokens the cache has not seen yet (all of them at the first step)."""
        if use_cache is False:
            return {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": False}
        cache = cache if cache is not None else KVCache()
        return {"input_ids": input_ids[:, cache.length:], "attention_mask": attention_mask, "cache": cache,
                "use_cache": True}

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str | Path, *model_args: Any,
                        config: PhaseKVConfig | None = None, dtype: Any = None, device_map: Any = None,
                        **kwargs: Any) -> HFPhaseKVForCausalLM:
        """A local phasekv checkpoint directory (bundled, trained or save_pretrained) through phasekv's strict
        loader.  `dtype`: None or "auto" -> float32 (phasekv computes in float32); `device_map`: one device."""
        if model_args:
            raise ValueError("from_pretrained: phasekv models take no positional model arguments")
        path = resolve(pretrained_model_name_or_path)
        config = config if config is not None else PhaseKVConfig.from_pretrained(path)
        ignored = sorted(k for k in kwargs if not k.startswith("_"))
        if ignored:
            log.info("from_pretrained: ignoring %s (a local phasekv checkpoint needs none of them)", ignored)
        model = cls(config)
        load_weights(model, load_tensors(path / MODEL_FILE), path)
        dtype = torch.float32 if dtype in (None, "auto") else getattr(torch, dtype) if isinstance(dtype, str) else dtype
        device = device_map if isinstance(device_map, str | torch.device) and device_map != "auto" else "cpu"
        return model.to(device=device, dtype=dtype).eval()


def register() -> None:
    """Register the model with AutoModelForCausalLM (idempotent)."""
    from transformers.models.auto.modeling_auto import AutoModelForCausalLM

    AutoModelForCausalLM.register(PhaseKVConfig, HFPhaseKVForCausalLM, exist_ok=True)
