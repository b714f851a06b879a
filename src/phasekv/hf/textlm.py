"""A causal LM around a transformers text model that transformers ships only inside a multimodal class.

GLM-5.3's text decoder (`Glm5NextTextModel`, model type `glm5_next_text`) exists in transformers only as the
language model of the vision-language `Glm5NextForConditionalGeneration`; there is no `...ForCausalLM`.  This
class adds what that model adds on top of its language model, a bias-free linear LM head on the last hidden
state, and nothing else: the decoder is transformers' own module, unchanged.  Parameter names are `model.*`
(the text model) and `lm_head.weight`, as in transformers' `...ForCausalLM` classes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class TextCausalLM(nn.Module):
    """`AutoModel.from_config(config)` plus an LM head; forward(input_ids (B, T)) -> output with .logits (B, T, V)
    and .cache (the text model's cache when use_cache is set)."""

    def __init__(self, config: Any, **kwargs: Any):
        super().__init__()
        from transformers import AutoModel
        from transformers.modeling_outputs import CausalLMOutputWithPast

        self._output = CausalLMOutputWithPast
        self.model = AutoModel.from_config(config, **kwargs)
        self.config = self.model.config
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        nn.init.normal_(self.lm_head.weight, std=config.initializer_range)  # transformers' init of an LM head

    def set_attn_implementation(self, name: str) -> None:
        self.model.set_attn_implementation(name)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, cache: Any = None,
                use_cache: bool | None = None, **kwargs: Any) -> Any:
        out = self.model(input_ids=input_ids, position_ids=position_ids, cache=cache, use_cache=use_cache, **kwargs)
        return self._output(logits=self.lm_head(out.last_hidden_state), cache=out.cache)
