"""phasekv: chunked KV-cache compression, its phase sensitivity, and the tools to measure it."""

from phasekv.api.audit import audit
from phasekv.checkpoint import load_checkpoint
from phasekv.config import ModelConfig
from phasekv.hf import registration as hf_registration
from phasekv.model import PhaseKVForCausalLM, build_model

hf_registration.install()  # AutoConfig / AutoModelForCausalLM learn model_type "phasekv" once transformers loads them

# `evaluate` stays `phasekv.api.evaluate`: `phasekv.evaluate` is the measurement package (docs/architecture.md)
__all__ = ["ModelConfig", "PhaseKVForCausalLM", "audit", "build_model", "load_checkpoint"]
