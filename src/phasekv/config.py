"""Typed configuration: the model config, experiment YAML files and `a.b=value` overrides.

An experiment file has top-level sections `model`, `data`, `train` (and `eval`); each section is a
plain mapping.  `ModelConfig(**yaml["model"])` is always a valid call.  Validation happens in
`__post_init__` and every error is a `ValueError` that names the offending field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

LAYER_KINDS_BUILTIN = ("full", "sliding")
ROPE_PARTS = ("first", "last")
GATE_KINDS = ("scalar", "vector")


def _check(cond: bool, name: str, message: str) -> None:
    if not cond:
        raise ValueError(f"{name}: {message}")


@dataclass
class ModelConfig:
    """A Qwen3-style decoder with optional chunked KV compression.

    `compressor` names the compressor of compressed layers (see `phasekv.compression.available()`);
    "none" gives full attention everywhere.  `layer_types` sets the attention kind per layer:
    "full" (causal SDPA), "sliding" (the raw local window only) or a compressor name; by default
    every layer uses `compressor` (or "full" when it is "none").
    """

    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 1
    head_dim: int = 32
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    qk_norm: bool = True
    rope_dims: int | None = None  # None: every dim; 0: no RoPE; n: n dims (even)
    rope_part: str = "first"  # which n dims carry RoPE when rope_dims < head_dim
    layer_types: list[str] | None = None

    # compression (used by compressed layers only)
    compressor: str = "none"
    window: int = 8  # W: tokens per compressed entry ("gated")
    stride: int = 8  # S: a new window starts every S tokens
    gate: str = "scalar"  # "scalar" or "vector" gates
    tied_kv: bool = False  # values reuse the normalized, rotated compressed keys
    gate_bias: bool = True
    post_norm: bool = False  # RMSNorm on each compressed entry after the payload sum
    uniform: bool = False  # alpha = 1/W, no gate parameters
    csa_block: int = 4  # DeepSeek CSA block m (windows of 2m, stride m)
    hca_block: int = 128  # DeepSeek HCA block m (windows of m, stride m)
    index_topk: int = 0  # DeepSeek CSA indexer: keep top-k compressed entries per query (0: off)
    index_heads: int = 4
    index_dim: int = 32
    local_window: int = 16  # raw tokens each query sees exactly (itself included)
    uncompressed_tail: bool = False  # raw tokens = only those not yet in a complete window
    attn_sink: bool = False  # learned per-head logit in the softmax denominator
    stagger: bool = False  # beyond the paper: compressed layer c starts its windows at c * S // n_compressed
    query_block: int = 128  # queries per block in the block-wise compressed attention

    def __post_init__(self) -> None:
        from phasekv.compression import available

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                     "local_window", "query_block", "csa_block", "hca_block", "index_heads", "index_dim"):
            value = getattr(self, name)
            _check(isinstance(value, int) and not isinstance(value, bool) and value >= 1, name,
                   f"must be a positive integer, got {value!r}")
        _check(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
               f"num_attention_heads={self.num_attention_heads} is not divisible by "
               f"num_key_value_heads={self.num_key_value_heads}")
        if self.rope_dims is None:
            self.rope_dims = self.head_dim
        _check(isinstance(self.rope_dims, int) and 0 <= self.rope_dims <= self.head_dim, "rope_dims",
               f"must be in [0, head_dim={self.head_dim}], got {self.rope_dims!r}")
        _check(self.rope_dims % 2 == 0, "rope_dims", f"must be even, got {self.rope_dims}")
        _check(self.rope_part in ROPE_PARTS, "rope_part", f"must be one of {ROPE_PARTS}, got {self.rope_part!r}")
        known = ["none", *available()]
        _check(self.compressor in known, "compressor", f"unknown {self.compressor!r}; known: {known}")
        _check(self.gate in GATE_KINDS, "gate", f"must be one of {GATE_KINDS}, got {self.gate!r}")
        _check(isinstance(self.stride, int) and self.stride >= 1, "stride", f"must be >= 1, got {self.stride!r}")
        _check(isinstance(self.window, int) and self.stride <= self.window, "stride",
               f"stride S={self.stride} must be <= window W={self.window} (S > W would skip tokens)")
        _check(self.index_topk >= 0, "index_topk", f"must be >= 0, got {self.index_topk}")
        default_kind = "full" if self.compressor == "none" else self.compressor
        if self.layer_types is None:
            self.layer_types = [default_kind] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        _check(len(self.layer_types) == self.num_hidden_layers, "layer_types",
               f"has {len(self.layer_types)} entries for num_hidden_layers={self.num_hidden_layers}")
        for kind in self.layer_types:
            _check(kind in (*LAYER_KINDS_BUILTIN, *available()), "layer_types",
                   f"unknown kind {kind!r}; known: {[*LAYER_KINDS_BUILTIN, *available()]}")
        if self.stagger and self.uncompressed_tail:
            raise ValueError("stagger: cannot be combined with uncompressed_tail (tokens before a layer's first "
                             "window would never be compressed nor kept raw)")
        if self.attn_sink:
            _check(any(k != "full" for k in self.layer_types), "attn_sink",
                   "needs at least one sliding or compressed layer (full layers use SDPA without sinks)")

    @property
    def compressed_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind not in LAYER_KINDS_BUILTIN]

    def window_offset(self, layer: int) -> int:
        """Position of the first window start of compressed layer `layer` (0 unless `stagger`)."""
        from phasekv.compression import stride_of

        if not self.stagger or layer not in self.compressed_layers:
            return 0
        c = self.compressed_layers.index(layer)
        return c * stride_of(self, self.layer_types[layer]) // len(self.compressed_layers)

    @property
    def phase_stride(self) -> int | None:
        """The smallest stride among compressed layers: the period phase effects should have."""
        from phasekv.compression import stride_of

        strides = [stride_of(self, self.layer_types[i]) for i in self.compressed_layers]
        return min(strides) if strides else None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        return cls(**_only_known(cls, data, "model"))


def _only_known(cls: type, data: dict[str, Any], section: str) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{section}.{unknown[0]}: unknown key; known keys: {sorted(names)}")
    return dict(data)


# ----------------------------------------------------------------------------- experiment files


def parse_override(text: str) -> tuple[list[str], Any]:
    """'train.lr=3e-3' -> (['train', 'lr'], 0.003); the value is parsed as YAML."""
    if "=" not in text:
        raise ValueError(f"override {text!r}: expected KEY.PATH=VALUE")
    key, value = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ValueError(f"override {text!r}: empty key component")
    return path, yaml.safe_load(value)


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `tree` with each `a.b=value` override set; unknown sections are errors."""
    tree = json.loads(json.dumps(tree))
    for text in overrides:
        path, value = parse_override(text)
        node = tree
        for part in path[:-1]:
            if not isinstance(node.get(part), dict):
                raise ValueError(f"override {text!r}: no section {part!r}")
            node = node[part]
        node[path[-1]] = value
    return tree


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config {path}: no such file")
    try:
        tree = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValueError(f"config {path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(tree, dict) or "model" not in tree:
        raise ValueError(f"config {path}: expected a mapping with a 'model' section")
    return tree
