"""`PhaseKVConfig`: a phasekv experiment as a transformers config (model_type "phasekv").

The config is the checkpoint's config.json as phasekv writes it: sections `model` (a `phasekv.ModelConfig`),
`data`, `train`, `vocab`, `eval`; the fields transformers' readers look for at the top level (vocab_size,
max_position_embeddings, ...) are copied from `model`.  phasekv's checkpoints predate transformers and carry
no top-level `model_type`, which transformers needs to pick a config class: `register` teaches
`PreTrainedConfig.get_config_dict` to add `model_type: phasekv` to exactly those configs (a top-level `model`
section of the phasekv family and no `model_type`), which transformers would otherwise refuse, so the bundled
checkpoint directories load as they are.  A checkpoint of the transformers family (a `model` section with a
transformers `model_type`, `phasekv.families`) is returned as that section, i.e. the transformers config of the
model it holds, so `AutoConfig.from_pretrained(DIR)` gives e.g. a `DeepseekV4Config` and
`AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.float32)` the model with its trained weights (where
transformers has a causal-LM class for the type: GLM-5.3's text model has none, `phasekv.load_checkpoint`
loads it).  Every other config is returned unchanged.
"""

from __future__ import annotations

from typing import Any

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig

from phasekv.config import ModelConfig

# what transformers' config readers need at the top level, from the `model` section
_TOP_LEVEL = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "max_position_embeddings", "tie_word_embeddings")


@strict(accept_kwargs=True)
class PhaseKVConfig(PreTrainedConfig):
    """A phasekv experiment as a transformers config; `model` is a `phasekv.ModelConfig` as a dict."""

    model_type = "phasekv"
    model: dict | None = None
    data: dict | None = None
    train: dict | None = None
    vocab: dict | None = None
    eval: dict | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        if self.model is not None and self.model.get("model_type", "phasekv") != "phasekv":
            raise ValueError(f"model.model_type: {self.model['model_type']!r} is a transformers family; load it "
                             "with AutoModelForCausalLM.from_pretrained(DIR) or phasekv.load_checkpoint")
        self.model = ModelConfig.from_dict(self.model or {}).to_dict()  # validated, every field explicit
        for name in _TOP_LEVEL:
            kwargs.pop(name, None)
            setattr(self, name, self.model[name])
        super().__post_init__(**kwargs)

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig.from_dict(self.model)



def is_phasekv_experiment(config_dict: dict[str, Any]) -> bool:
    """A phasekv config.json of the phasekv model family, without transformers' model_type."""
    model = config_dict.get("model")
    return "model_type" not in config_dict and isinstance(model, dict) and "model_type" not in model


def transformers_model(config_dict: dict[str, Any]) -> dict[str, Any] | None:
    """The transformers config (as a dict) of a phasekv config.json of the transformers family, else None."""
    model = config_dict.get("model")
    if "model_type" in config_dict or not isinstance(model, dict) or model.get("model_type") in (None, "phasekv"):
        return None
    return dict(model)


def _with_phasekv_model_type(get_config_dict):
    def wrapped(cls, *args: Any, **kwargs: Any):
        config_dict, rest = get_config_dict(cls, *args, **kwargs)
        if is_phasekv_experiment(config_dict):
            config_dict = {**config_dict, "model_type": PhaseKVConfig.model_type}
        elif (model := transformers_model(config_dict)) is not None:
            config_dict = model
        return config_dict, rest

    wrapped.phasekv = True
    return wrapped


def register() -> None:
    """Register PhaseKVConfig with AutoConfig and let phasekv's own config.json name it (idempotent)."""
    from transformers.models.auto.configuration_auto import AutoConfig

    AutoConfig.register(PhaseKVConfig.model_type, PhaseKVConfig, exist_ok=True)
    current = PreTrainedConfig.__dict__["get_config_dict"].__func__
    if not getattr(current, "phasekv", False):
        PreTrainedConfig.get_config_dict = classmethod(_with_phasekv_model_type(current))
