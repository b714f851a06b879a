"""phasekv: chunked KV-cache compression, its phase sensitivity, and the tools to measure it."""

from phasekv.checkpoint import load_checkpoint
from phasekv.config import ModelConfig
from phasekv.model import PhaseKVForCausalLM, build_model

__all__ = ["ModelConfig", "PhaseKVForCausalLM", "build_model", "load_checkpoint"]
