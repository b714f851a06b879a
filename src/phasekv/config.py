"""One home for every configuration: model, compressor options, data, train, eval, experiment, theory.

An experiment file has top-level sections `model`, `data`, `train` and optionally `eval` and
`notes`; each section is a plain mapping.  The `model` section either describes a phasekv model
(`ModelConfig(**yaml["model"])` is always a valid call) or names a transformers model type
(`model_type: qwen3`, with that config class's fields; `TransformersModelConfig`).

Every config is a dataclass of plain values, validated in one place and one style: `check_fields`
checks each field's type from its annotation and its range, size or allowed values from the field's
`spec(...)` metadata before anything is allocated; every error is a `ValueError` naming the field as
`section.field`.  Cross-field rules live in each class's `__post_init__`.

Compressor options are declared beside each compressor (a `CompressorOptions` dataclass registered
under the compressor's name by `phasekv.compression.register`), so a compressor with new knobs is one
file and one registry line, with no edit here.  A phasekv model config keeps them per compressor kind
in `compressors`; for convenience and for old checkpoints, flat keys (`window=8, stride=8`) are routed
to the options of the compressor kinds the model uses.

This module imports nothing of phasekv (it is the bottom layer).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

LAYER_KINDS_BUILTIN = ("full", "sliding")
ROPE_PARTS = ("first", "last")
PROTOCOLS = ("prefix", "insequence")  # the padding protocols: the query position is fixed, the target moves
EVAL_PROTOCOLS = (*PROTOCOLS, "query")  # and the query-phase protocol: the target is fixed, the prompt length moves
MAX_NESTING = 32  # deepest mapping/list accepted in a config file


# ----------------------------------------------------------------------------- one validator


def spec(default: Any = dataclasses.MISSING, *, low: float | None = None, high: float | None = None,
         choices: tuple | None = None, positive: bool = False, factory: Any = None) -> Any:
    """A dataclass field with validation metadata: inclusive bounds, allowed values, > 0."""
    meta = {"low": low, "high": high, "choices": choices, "positive": positive}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string",
               list: "a list", dict: "a mapping"}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _coerce(value: Any, hint: Any) -> tuple[bool, Any]:
    """(ok, value) for `value` against a type hint; ints become floats for float fields."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            ok, out = _coerce(value, arg)
            if ok:
                return True, out
        return False, value
    if hint is type(None):
        return value is None, value
    if hint is Any:
        return True, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        return ok, float(value) if ok else value
    if hint is str:
        return isinstance(value, str), value
    if origin is list:
        if not isinstance(value, list | tuple):
            return False, value
        items = [_coerce(v, args[0]) if args else (True, v) for v in value]
        return all(ok for ok, _ in items), [v for _, v in items]
    if origin is dict or hint is dict:
        return isinstance(value, dict), value
    return isinstance(value, hint), value


def _describe(hint: Any) -> str:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args) + (" or null" if len(args) < len(typing.get_args(hint))
                                                        else "")
    if typing.get_origin(hint) is list:
        return f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}s" if args else "a list"
    return _KIND_NAMES.get(typing.get_origin(hint) or hint, str(hint))


def check_fields(obj: Any, section: str) -> None:
    """Check every field of dataclass `obj` for type (from its annotation) and spec metadata."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        name, value = f"{section}.{f.name}", getattr(obj, f.name)
        ok, value = _coerce(value, hints[f.name])
        if not ok:
            raise ValueError(f"{name}: must be {_describe(hints[f.name])}, got {_short(value)}")
        object.__setattr__(obj, f.name, value)
        if value is None:
            continue
        meta = f.metadata
        if meta.get("choices") is not None and value not in meta["choices"]:
            raise ValueError(f"{name}: must be one of {list(meta['choices'])}, got {_short(value)}")
        if meta.get("positive") and not value > 0:
            raise ValueError(f"{name}: must be > 0, got {value!r}")
        if meta.get("low") is not None and value < meta["low"]:
            raise ValueError(f"{name}: must be >= {meta['low']}, got {value!r}")
        if meta.get("high") is not None and value > meta["high"]:
            raise ValueError(f"{name}: must be <= {meta['high']}, got {value!r}")


def from_section(cls: type, data: Any, section: str) -> Any:
    """`cls(**data)` with unknown keys and non-mapping sections named in the error."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{section}: section must be a mapping, got {_short(data)}")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names, key=str)
    if unknown:
        raise ValueError(f"{section}.{unknown[0]}: unknown key; known keys: {sorted(names)}")
    return cls(**data)


# ----------------------------------------------------------------------------- compressor options


class CompressorOptions:
    """Base of every compressor's options dataclass (declared beside the compressor)."""

    section = "model.compressor"  # set per compressor at registration, for error messages

    def __post_init__(self) -> None:
        check_fields(self, self.section)
        self.validate()

    def validate(self) -> None:
        """Cross-field rules of one compressor's options (subclasses)."""

    def geometry(self) -> tuple[int, int]:
        """(W, S): tokens per window and the stride between window starts."""
        raise NotImplementedError

    def selects(self) -> bool:
        """Whether the compressor picks a subset of the entries per query (a top-k indexer)."""
        return False


_OPTIONS: dict[str, type[CompressorOptions]] = {}  # filled by phasekv.compression.register


def register_options(name: str, options: type[CompressorOptions]) -> None:
    options.section = f"model.compressors.{name}"  # the field's path in config.json
    _OPTIONS[name] = options


def compressor_names() -> list[str]:
    return sorted(_OPTIONS)


def _compressor_kinds(compressor: Any, layer_types: Any) -> list[str]:
    kinds = [compressor] if isinstance(compressor, str) and compressor != "none" else []
    for kind in layer_types or []:
        if kind in _OPTIONS and kind not in kinds:
            kinds.append(kind)
    return [k for k in kinds if k in _OPTIONS]


def route_compressor_keys(data: dict[str, Any]) -> dict[str, Any]:
    """Move flat compressor option keys (`window`, `stride`, ...) into `compressors[kind]` for every
    compressor kind the model uses.  Options of compressors no layer uses are dropped (old
    checkpoints stored every option; a full-attention model has no window); unknown keys are errors."""
    own = {f.name for f in dataclasses.fields(ModelConfig)}
    kinds = _compressor_kinds(data.get("compressor", "none"), data.get("layer_types"))
    out = {k: v for k, v in data.items() if k in own}
    raw = data.get("compressors") or {}
    if not isinstance(raw, dict):
        raise ValueError(f"model.compressors: must be a mapping of compressor name to options, got {_short(raw)}")
    nested = {kind: dict(opts) if isinstance(opts, dict) else opts for kind, opts in raw.items()}
    for key in sorted(set(data) - own, key=str):
        owners = [n for n, cls in _OPTIONS.items() if key in {f.name for f in dataclasses.fields(cls)}]
        used = [k for k in kinds if k in owners]
        if used:
            for kind in used:
                options = nested.setdefault(kind, {})
                if isinstance(options, dict) and options.setdefault(key, data[key]) != data[key]:
                    raise ValueError(f"model.{key}: {_short(data[key])} conflicts with model.compressors.{kind}."
                                     f"{key}={_short(options[key])}; give it in one place")
        elif not owners:
            raise ValueError(f"model.{key}: unknown key; known keys: {sorted(own)}")
    if nested:
        out["compressors"] = nested
    return out


# ----------------------------------------------------------------------------- the phasekv model


@dataclass
class ModelConfig:
    """A Qwen3-style decoder with optional chunked KV compression.

    `compressor` names the compressor of compressed layers (see `phasekv.compression.available()`);
    "none" gives full attention everywhere.  `layer_types` sets the attention kind per layer:
    "full" (causal SDPA), "sliding" (the raw local window only) or a compressor name; by default
    every layer uses `compressor` (or "full" when it is "none").  `compressors` holds each used
    compressor's options (flat keys such as `window=8` are routed there on construction).
    """

    vocab_size: int = spec(256, low=1, high=1 << 22)
    hidden_size: int = spec(128, low=1, high=1 << 16)
    intermediate_size: int = spec(384, low=1, high=1 << 18)
    num_hidden_layers: int = spec(2, low=1, high=512)
    num_attention_heads: int = spec(4, low=1, high=1024)
    num_key_value_heads: int = spec(1, low=1, high=1024)
    head_dim: int = spec(32, low=1, high=1024)
    max_position_embeddings: int = spec(4096, low=1, high=1 << 24)
    rope_theta: float = spec(10000.0, positive=True)
    rms_norm_eps: float = spec(1e-6, low=0.0, high=1.0)
    tie_word_embeddings: bool = False
    initializer_range: float = spec(0.02, low=0.0, high=10.0)
    qk_norm: bool = True
    rope_dims: int | None = spec(None, low=0)  # None: every dim; 0: no RoPE; n: n dims (even)
    rope_part: str = spec("first", choices=ROPE_PARTS)  # which n dims carry RoPE when rope_dims < head_dim
    layer_types: list[str] | None = None
    compressor: str = "none"
    compressors: dict[str, Any] = spec(factory=dict)  # compressor kind -> its options
    local_window: int = spec(16, low=1, high=1 << 20)  # raw tokens each query sees exactly (itself included)
    uncompressed_tail: bool = False  # raw tokens = only those not yet in a complete window
    attn_sink: bool = False  # learned per-head logit in the softmax denominator
    stagger: bool = False  # beyond the paper: compressed layer c starts its windows at c * S // n_compressed
    # beyond the paper: KV head h of a compressed layer starts its windows at h * S / KVH (with `stagger`, layer c's
    # heads are shifted by c * S / (KVH * n_compressed) more).  Same cache bytes: a layer compresses every S / KVH
    # tokens and keeps only the owning head's entry; the compressor's compute is KVH times the baseline's.
    head_stagger: bool = False
    query_block: int = spec(128, low=1, high=1 << 16)  # queries per block in the compressed attention

    def __post_init__(self) -> None:
        check_fields(self, "model")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"model.num_key_value_heads: num_attention_heads={self.num_attention_heads} is not "
                             f"divisible by num_key_value_heads={self.num_key_value_heads}")
        if self.rope_dims is None:
            self.rope_dims = self.head_dim
        if self.rope_dims > self.head_dim or self.rope_dims % 2:
            raise ValueError(f"model.rope_dims: must be even and in [0, head_dim={self.head_dim}], "
                             f"got {self.rope_dims}")
        known = ["none", *compressor_names()]
        if self.compressor not in known:
            raise ValueError(f"model.compressor: unknown {self.compressor!r}; known: {known}")
        kinds = (*LAYER_KINDS_BUILTIN, *compressor_names())
        if self.layer_types is None:
            self.layer_types = [self.compressor if self.compressor != "none" else "full"] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"model.layer_types: has {len(self.layer_types)} entries for num_hidden_layers="
                             f"{self.num_hidden_layers}")
        for kind in self.layer_types:
            if kind not in kinds:
                raise ValueError(f"model.layer_types: unknown kind {kind!r}; known: {list(kinds)}")
        self._build_compressor_options()
        if self.stagger and self.uncompressed_tail:
            raise ValueError("model.stagger: cannot be combined with uncompressed_tail (tokens before a layer's "
                             "first window would never be compressed nor kept raw)")
        if self.head_stagger:
            self._check_head_stagger()
        if self.attn_sink and all(k == "full" for k in self.layer_types):
            raise ValueError("model.attn_sink: needs at least one sliding or compressed layer (full layers use "
                             "SDPA without sinks)")

    def _check_head_stagger(self) -> None:
        layers, KVH = self.compressed_layers, self.num_key_value_heads
        if not layers or KVH < 2:
            raise ValueError(f"model.head_stagger: needs a compressed layer and num_key_value_heads > 1 (got "
                             f"{len(layers)} compressed layers, {KVH} KV heads)")
        if self.uncompressed_tail:
            raise ValueError("model.head_stagger: cannot be combined with uncompressed_tail (the heads' windows "
                             "complete at different positions)")
        for i in layers:
            opts = self.options(self.layer_types[i])
            stride, parts = opts.geometry()[1], KVH * (len(layers) if self.stagger else 1)
            if stride % parts:
                raise ValueError(f"model.head_stagger: stride S={stride} of layer {i} must be divisible by "
                                 f"{parts} (KV heads{' x compressed layers with stagger' if self.stagger else ''})")
            if opts.selects():
                raise ValueError(f"model.head_stagger: cannot be combined with an indexer (layer {i}'s "
                                 f"{self.layer_types[i]} selects entries per query)")

    def _build_compressor_options(self) -> None:
        kinds = _compressor_kinds(self.compressor, self.layer_types)
        unused = sorted(set(self.compressors) - set(kinds), key=str)
        if unused:
            raise ValueError(f"model.compressors.{unused[0]}: options for a compressor no layer uses "
                             f"(used: {kinds})")
        self.compressors = {kind: self.compressors.get(kind, {}) for kind in kinds}
        for kind, opts in self.compressors.items():
            if not isinstance(opts, _OPTIONS[kind]):
                self.compressors[kind] = from_section(_OPTIONS[kind], opts, f"model.compressors.{kind}")

    def options(self, kind: str) -> CompressorOptions:
        """The options of compressor `kind` (one the model uses)."""
        if kind not in self.compressors:
            raise ValueError(f"model.compressors: no compressor {kind!r} in this model (used: "
                             f"{sorted(self.compressors)})")
        return self.compressors[kind]

    @property
    def compressed_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layer_types) if kind not in LAYER_KINDS_BUILTIN]

    def window_offset(self, layer: int) -> int:
        """Position of the first window start of compressed layer `layer` (0 unless `stagger`; with
        `head_stagger`, of its KV head 0, the others following every S / KVH tokens)."""
        layers = self.compressed_layers
        if not self.stagger or layer not in layers:
            return 0
        stride = self.options(self.layer_types[layer]).geometry()[1]
        if self.head_stagger:
            stride //= self.num_key_value_heads  # the layers interleave within one head's S / KVH step
        return layers.index(layer) * stride // len(layers)

    @property
    def phase_stride(self) -> int | None:
        """The smallest stride among compressed layers: the period phase effects should have."""
        strides = [self.options(self.layer_types[i]).geometry()[1] for i in self.compressed_layers]
        return min(strides) if strides else None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """From a `model` section or a checkpoint's config; old flat configs (every compressor's options
        at the top level) are mapped onto the compressors the model uses."""
        if not isinstance(data, dict):
            raise ValueError(f"model: section must be a mapping, got {_short(data)}")
        return cls(**route_compressor_keys(data))


_dataclass_init = ModelConfig.__init__


def _model_config_init(self: ModelConfig, **kwargs: Any) -> None:
    """ModelConfig(compressor="gated", window=8, stride=8): flat option keys go to `compressors`."""
    _dataclass_init(self, **route_compressor_keys(kwargs))


ModelConfig.__init__ = _model_config_init  # keyword-only; the dataclass fields are the same


@dataclass
class TransformersModelConfig:
    """A model built from transformers' own classes: `model_type` and that config class's fields."""

    model_type: str
    fields: dict[str, Any] = spec(factory=dict)

    def __post_init__(self) -> None:
        check_fields(self, "model")
        cls = self.config_class()
        known = set(cls().to_dict())
        unknown = sorted(set(self.fields) - known, key=str)
        if unknown:
            raise ValueError(f"model.{unknown[0]}: not a field of transformers' {cls.__name__}")
        try:
            hf = cls(**self.fields)
        except Exception as exc:  # noqa: BLE001 - transformers and huggingface_hub raise their own types
            raise ValueError(f"model: transformers' {cls.__name__} rejects these fields "
                             f"({' '.join(str(exc).split())[:200]})") from None
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings"):
            value = getattr(hf.get_text_config() if hasattr(hf, "get_text_config") else hf, name, 1)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= (1 << 24):
                raise ValueError(f"model.{name}: must be an integer in [1, {1 << 24}], got {_short(value)}")

    def config_class(self) -> type:
        from transformers import CONFIG_MAPPING  # transformers is slow to import: only when used

        if self.model_type not in CONFIG_MAPPING:
            raise ValueError(f"model.model_type: transformers has no model type {self.model_type!r}")
        return CONFIG_MAPPING[self.model_type]

    def to_hf(self) -> Any:
        """The transformers config object (a fresh one per call)."""
        return self.config_class()(**self.fields)

    def text(self) -> Any:
        hf = self.to_hf()
        return hf.get_text_config() if hasattr(hf, "get_text_config") else hf

    @property
    def vocab_size(self) -> int:
        return self.text().vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.text().max_position_embeddings

    @property
    def local_window(self) -> None:
        return None  # full attention: no raw window

    def to_dict(self) -> dict[str, Any]:
        return {"model_type": self.model_type, **self.fields}


def model_config_from_dict(data: Any) -> ModelConfig | TransformersModelConfig:
    """The `model` section as a phasekv ModelConfig or, with `model_type`, a TransformersModelConfig."""
    if isinstance(data, dict) and data.get("model_type", "phasekv") != "phasekv":
        fields = {k: v for k, v in data.items() if k != "model_type"}
        return TransformersModelConfig(data["model_type"], fields)
    if isinstance(data, dict):
        data = {k: v for k, v in data.items() if k != "model_type"}
    return ModelConfig.from_dict(data)


# ----------------------------------------------------------------------------- data, train, eval


@dataclass
class DataConfig:
    """Lengths, mixture and vocabulary of the training data (the `data` section of an experiment)."""

    n_records: int = spec(32, low=1, high=1 << 16)
    n_queries: int = spec(32, low=1, high=1 << 16)
    key_tokens: int = spec(1, low=1, high=64)
    value_tokens: int = spec(1, low=1, high=64)
    prefix_max: int = spec(23, low=0, high=1 << 16)  # prefix fillers ~ U{0..prefix_max}
    outer_max: int = spec(23, low=0, high=1 << 16)  # fillers between records and queries ~ U{0..outer_max}
    gap_fillers: int = spec(0, low=0, high=1 << 20)  # fillers scattered at random between records
    local_window: int = spec(16, low=1, high=1 << 20)  # the model's raw window; supervised only outside it
    background_fraction: float = spec(0.25, low=0.0, high=1.0)
    # share of the other examples that are a random key/value word sequence shown twice, every token of the second
    # copy supervised: a dense signal for the two-layer induction circuit token-level attention needs (0: none)
    repeat_fraction: float = spec(0.0, low=0.0, high=1.0)
    background_successors: int = spec(4, low=1, high=1 << 16)
    chain_seed: int = spec(0, low=0)  # fixes the background Markov chain (the "language")
    n_keys: int = spec(64, low=1, high=1 << 16)
    n_values: int = spec(64, low=1, high=1 << 16)
    n_fillers: int = spec(16, low=1, high=1 << 16)
    n_background: int = spec(64, low=1, high=1 << 16)
    curriculum_start: int = spec(0, low=0)  # records per example at the start of training (0: none)
    curriculum_examples: int = spec(0, low=0)  # examples over which the count ramps to n_records

    def __post_init__(self) -> None:
        check_fields(self, "data")
        if self.background_successors > self.n_background:
            raise ValueError(f"data.background_successors: {self.background_successors} exceeds n_background="
                             f"{self.n_background}")
        if self.n_records > self.n_keys ** self.key_tokens:
            raise ValueError(f"data.n_records: {self.n_records} distinct keys needed, only "
                             f"{self.n_keys ** self.key_tokens} exist (n_keys ** key_tokens)")
        if self.curriculum_start and not (2 <= self.curriculum_start <= self.n_records and self.curriculum_examples):
            raise ValueError(f"data.curriculum_start: must be in [2, n_records={self.n_records}] with "
                             f"curriculum_examples >= 1, got {self.curriculum_start}, {self.curriculum_examples}")
        if self.gap_fillers and self.n_records < 2:
            raise ValueError("data.gap_fillers: needs n_records >= 2 (fillers go between records)")
        reach = (self.n_records - 1) * self.record_length + self.key_tokens
        if reach < self.local_window:
            raise ValueError(f"data.n_records: {self.n_records} records are too few: no query can lie outside the "
                             f"local_window={self.local_window} of its record")

    @property
    def record_length(self) -> int:
        return self.key_tokens + self.value_tokens

    @property
    def seq_len(self) -> int:
        """Length of every training sequence (lookup and background alike)."""
        return (1 + self.prefix_max + self.outer_max + self.gap_fillers
                + (self.n_records + self.n_queries) * self.record_length)


@dataclass
class TrainConfig:
    steps: int = spec(1000, low=1, high=1 << 30)
    batch_size: int = spec(64, low=1, high=1 << 20)  # global batch (sequences per step, all ranks)
    grad_accum: int = spec(1, low=1, high=1 << 16)
    lr: float = spec(3e-3, positive=True, high=10.0)
    min_lr_ratio: float = spec(0.1, low=0.0, high=1.0)
    warmup_steps: int = spec(50, low=0)
    # earlier cosine horizons, increasing: up to step h the cosine decays over h steps, then over the next
    # horizon, finally over `steps`: the schedule of a run resumed with a larger train.steps, in one run
    lr_horizons: list = spec(factory=list)
    weight_decay: float = spec(0.1, low=0.0)
    beta1: float = spec(0.9, low=0.0, high=1.0)
    beta2: float = spec(0.95, low=0.0, high=1.0)
    grad_clip: float = spec(1.0, positive=True)
    gate_lr_mult: float = spec(1.0, low=0.0)  # learning-rate multiplier of the compressor gates
    indexer_loss_weight: float = spec(1.0, low=0.0)  # weight of the indexer's KL objective (models with one)
    indexer_dense_steps: int = spec(0, low=0)  # first steps with every indexer candidate selected (dense warm-up)
    window_jitter: bool = False  # each step shifts every compressor's window grid by a random 0..S-1 (a phase fix)
    seed: int = spec(42, low=0)
    log_every: int = spec(10, low=1)
    eval_every: int = spec(100, low=1)
    eval_sequences: int = spec(256, low=1, high=1 << 20)
    checkpoint_every: int = spec(200, low=1)
    keep_checkpoints: int = spec(2, low=1, high=1000)
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N" (checked by phasekv.distributed)
    threads: int = spec(0, low=0, high=1024)  # torch CPU threads (0: torch's default)
    save_dtype: str = spec("float32", choices=("float32", "float16", "bfloat16"))  # final weights' dtype

    # fields that may change when a run is resumed (everything else must match the saved run)
    RESUMABLE = ("steps", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "threads", "device")

    def __post_init__(self) -> None:
        check_fields(self, "train")
        if self.warmup_steps > self.steps:
            raise ValueError(f"train.warmup_steps: must be in [0, steps={self.steps}], got {self.warmup_steps}")
        bounds = [self.warmup_steps, *self.lr_horizons, self.steps]
        if any(isinstance(h, bool) or not isinstance(h, int) for h in self.lr_horizons) or any(
                a >= b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"train.lr_horizons: must be increasing integers between warmup_steps="
                             f"{self.warmup_steps} and steps={self.steps} (exclusive), got {_short(self.lr_horizons)}")

    def lr_at(self, step: int) -> float:
        """Linear warmup to lr, then cosine to lr * min_lr_ratio at the horizon: the first of `lr_horizons`
        above the step, else the last step."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        horizon = next((h for h in self.lr_horizons if step < h), self.steps)
        progress = (step - self.warmup_steps) / max(1, horizon - self.warmup_steps)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class EvalConfig:
    """Settings of `phasekv eval` and the probes (the `eval` section; command-line flags override it).

    None means "the model's own value": a checkpoint's training data for records, key/value tokens
    and local window; the model's compression stride (8 without compression)."""

    protocol: str = spec("prefix", choices=EVAL_PROTOCOLS)
    stride: int | None = spec(None, low=1, high=4096)
    residue_modulus: int = spec(24, low=1, high=4096)
    records: int | None = spec(None, low=1, high=1 << 16)
    demos: int = spec(8, low=0, high=1 << 12)
    clusters: int | None = spec(None, low=1, high=1 << 16)
    targets_per_context: int | None = spec(None, low=1, high=1 << 16)
    key_tokens: int | None = spec(None, low=1, high=64)
    value_tokens: int | None = spec(None, low=1, high=64)
    local_window: int | None = spec(None, low=1, high=1 << 20)
    batch_size: int | None = spec(None, low=1, high=1 << 16)
    one_by_one: bool = False
    seed: int = spec(0, low=0)
    device: str = "auto"
    dtype: str = spec("float32", choices=("float32", "float16", "bfloat16", "float64"))
    device_map: str | None = None
    format: str | None = None  # HF models: a prompt format (phasekv.data.formats) or YAML file; None: bare words
    chat: bool = False  # HF models: wrap the format's prompts in the tokenizer's chat template
    gguf_file: str | None = None  # HF models: a GGUF file inside the model directory
    threads: int = spec(0, low=0, high=1024)  # torch CPU threads (0: torch's default); 1 when runs share cores

    def __post_init__(self) -> None:
        check_fields(self, "eval")
        if self.chat and self.format is None:
            raise ValueError("eval.chat: needs a prompt format (--format): the bare word prompts have no chat form")


# `phasekv audit`'s settings where `phasekv eval` has others (its residue modulus is the stride: R = S)
AUDIT_DEFAULTS = {"format": "records", "records": 24, "demos": 4, "stride": 8, "local_window": 16, "batch_size": 16}
DEFAULT_CONDITIONS = ("none", "select:3+keep-first:1", "mean+keep-first:1")


def audit_config(**given: Any) -> EvalConfig:
    """The EvalConfig of an audit: `given` over AUDIT_DEFAULTS, the residue modulus the stride."""
    settings = {**AUDIT_DEFAULTS, **given}
    return from_section(EvalConfig, {"residue_modulus": settings["stride"], **settings}, "eval")


@dataclass(frozen=True)
class AuditPlan:
    """What an audit evaluates on its prompt sets: the conditions (`phasekv.adapters.conditions`; `none`, the
    capability gate, always runs first), the window W of the compressing conditions, the protocols and the prompts
    per phase of each protocol's set."""

    conditions: tuple[str, ...] = DEFAULT_CONDITIONS
    window: int = 8
    protocols: tuple[str, ...] = PROTOCOLS
    prompts_per_phase: int = 192  # finds a 30 pp single-phase gap >= 80% of the time (benchmarks/verdict_power.py)


@dataclass
class Experiment:
    """A resolved experiment: typed sections plus the plain tree written to config.json."""

    model: ModelConfig | TransformersModelConfig
    data: DataConfig
    train: TrainConfig
    eval: EvalConfig
    tree: dict[str, Any]

    SECTIONS = ("model", "data", "train", "eval", "notes", "vocab")

    @classmethod
    def from_tree(cls, tree: dict[str, Any]) -> Experiment:
        if not isinstance(tree, dict) or "model" not in tree:
            raise ValueError("config: expected a mapping with a 'model' section")
        unknown = sorted(set(tree) - set(cls.SECTIONS), key=str)
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown section; known: model, data, train, eval, notes")
        model = model_config_from_dict(tree["model"])
        data = from_section(DataConfig, tree.get("data"), "data")
        train = from_section(TrainConfig, tree.get("train"), "train")
        evaluation = from_section(EvalConfig, tree.get("eval"), "eval")
        if isinstance(model, ModelConfig) and data.local_window != model.local_window:
            raise ValueError(f"data.local_window: {data.local_window} differs from model.local_window="
                             f"{model.local_window}; retrieval must be scored outside the model's raw window")
        resolved = {"model": model.to_dict(), "data": dataclasses.asdict(data), "train": dataclasses.asdict(train),
                    "eval": dataclasses.asdict(evaluation)}
        if "notes" in tree:
            resolved["notes"] = tree["notes"]
        return cls(model, data, train, evaluation, resolved)

    @classmethod
    def from_file(cls, path: str | Path, overrides: list[str] = ()) -> Experiment:
        return cls.from_tree(apply_overrides(load_yaml(path), list(overrides)))


# ----------------------------------------------------------------------------- the theory model


@dataclass
class TheoryConfig:
    """Sizes and scales of the idealized model (names follow docs/science.md section 5)."""

    chunks: int = spec(4, low=1, high=1 << 12)  # L
    stride: int = spec(4, low=2, high=1 << 12)  # S: tokens per chunk (>= 2 so a query has a successor)
    vocab: int = spec(32, low=1, high=1 << 16)  # N: embeddings in the vocabulary
    heads: int = spec(2, low=1)  # m < S
    kappa: float = spec(1.0, positive=True)  # common component of every inner product
    eps: float = spec(0.0, low=0.0)  # largest deviation of the Gram matrix from kappa + identity
    gamma: float = spec(6.0, positive=True)  # attention scale
    beta: float = spec(8.0, positive=True)  # unembedding scale

    def __post_init__(self) -> None:
        check_fields(self, "theory")
        if not self.heads < self.stride:
            raise ValueError(f"theory.heads: need 1 <= m < S = {self.stride}, got m = {self.heads}")
        if self.vocab < self.chunks * self.stride:
            raise ValueError(f"theory.vocab: need N >= L*S = {self.chunks * self.stride} distinct tokens, "
                             f"got {self.vocab}")

    @property
    def dim(self) -> int:
        return self.vocab + 1


@dataclass
class FlowConfig:
    """Gradient-descent settings for the theory model's log-linear gates."""

    runs: int = spec(16, low=1, high=1 << 16)  # independent seeds trained together
    steps: int = spec(1500, low=1, high=1 << 24)
    lr: float = spec(2.0, positive=True)
    rho: float = spec(0.01, positive=True)  # norm of each run's initial parameter tensor
    batch: int = spec(32, low=1, high=1 << 16)  # fresh contexts per run per step
    record_every: int = spec(25, low=1)
    eval_contexts: int = spec(256, low=1, high=1 << 20)

    def __post_init__(self) -> None:
        check_fields(self, "flow")


# ----------------------------------------------------------------------------- files and overrides


class _StrictLoader(yaml.SafeLoader):
    """Safe YAML that refuses duplicate keys and aliases (no billion-laughs expansion)."""

    def compose_node(self, parent, index):  # noqa: ANN001 - yaml's signature
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.YAMLError(f"aliases (*{event.anchor}) are not allowed{event.start_mark}")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):  # noqa: ANN001
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, str | int | float | bool) and key is not None:  # a list or mapping as a key
                raise yaml.YAMLError(f"a mapping key must be a plain value, got a {type(key).__name__}"
                                     f"{key_node.start_mark}")
            if key in seen:
                raise yaml.YAMLError(f"duplicate key {key!r}{key_node.start_mark}")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _depth(tree: Any, limit: int = MAX_NESTING) -> int:
    """Nesting depth of mappings/lists, iteratively (a deep tree must not blow the stack)."""
    deepest, stack = 0, [(tree, 1)]
    while stack:
        node, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, d + 1) for c in children if isinstance(c, dict | list))
    return deepest


_PLAIN = (str, int, float, bool, type(None))


def _check_plain(tree: Any, where: str) -> None:
    """Refuse, in one line, any value JSON cannot write back as it was read: a date or timestamp, !!binary
    bytes, a !!set, a non-string mapping key.  Everything phasekv stores is plain JSON."""
    stack = [(tree, "")]
    while stack:
        node, at = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if not isinstance(key, str):
                    raise ValueError(f"{where}: mapping key {key!r} at {at or 'top level'} is a "
                                     f"{type(key).__name__}; keys must be strings (quote it)")
                stack.append((value, f"{at}.{key}" if at else key))
        elif isinstance(node, list):
            stack.extend((v, f"{at}[{i}]") for i, v in enumerate(node))
        elif not isinstance(node, _PLAIN):
            kind = {"date": "a date", "datetime": "a timestamp", "bytes": "binary data", "set": "a set"}.get(
                type(node).__name__, f"a {type(node).__name__}")
            raise ValueError(f"{where}: value at {at or 'top level'} is {kind}, which a config cannot hold; "
                             "quote it to make it a string")


def parse_yaml(text: str, where: str) -> Any:
    try:
        tree = yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except RecursionError:
        raise ValueError(f"{where}: nested more than {MAX_NESTING} levels deep") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{where}: not valid YAML ({' '.join(str(exc).split())[:160]})") from None
    except (TypeError, ValueError) as exc:  # e.g. an out-of-range date, a malformed !!binary or timestamp
        raise ValueError(f"{where}: not valid YAML ({' '.join(str(exc).split())[:160]})") from None
    if _depth(tree) > MAX_NESTING:
        raise ValueError(f"{where}: nested more than {MAX_NESTING} levels deep")
    _check_plain(tree, where)
    return tree


def parse_json(text: str, where: str) -> Any:
    try:
        tree = json.loads(text)
    except RecursionError:
        raise ValueError(f"{where}: nested more than {MAX_NESTING} levels deep") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{where}: not valid JSON ({getattr(exc, 'msg', exc)})") from None
    if _depth(tree) > MAX_NESTING:
        raise ValueError(f"{where}: nested more than {MAX_NESTING} levels deep")
    return tree


def parse_override(text: str) -> tuple[list[str], Any]:
    """'train.lr=3e-3' -> (['train', 'lr'], 0.003); the value is parsed as YAML."""
    if "=" not in text:
        raise ValueError(f"override {text!r}: expected KEY.PATH=VALUE")
    key, value = text.split("=", 1)
    path = key.strip().split(".")
    if not all(path):
        raise ValueError(f"override {text!r}: empty key component")
    parsed = parse_yaml(value, f"override {text!r}")
    if isinstance(parsed, str):  # YAML 1.1 reads 3e-3 (no dot) as a string: take it as the number it is
        with contextlib.suppress(ValueError):
            number = float(parsed)
            parsed = number if math.isfinite(number) else parsed
    return path, parsed


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `tree` with each `a.b=value` override set; unknown sections are errors."""
    tree = json.loads(json.dumps(tree))
    for text in overrides:
        path, value = parse_override(text)
        node = tree
        for part in path[:-1]:
            if part not in node and part in Experiment.SECTIONS:
                node[part] = {}
            if not isinstance(node.get(part), dict):
                raise ValueError(f"override {text!r}: no section {part!r}")
            node = node[part]
        node[path[-1]] = value
    return tree


MAX_CONFIG_BYTES = 1 << 20  # an experiment YAML is a few KB; a larger file is refused before it is read


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.exists() and not path.is_file():
        raise ValueError(f"config {path}: is not a regular file (a directory, pipe or device: process "
                         "substitution such as <(...) is not supported); write the config to a file")
    if not path.is_file():
        raise ValueError(f"config {path}: no such file")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"config {path}: {path.stat().st_size} bytes; a config may hold at most "
                         f"{MAX_CONFIG_BYTES} bytes")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"config {path}: unreadable ({exc})") from None
    tree = parse_yaml(text, f"config {path}")
    if not isinstance(tree, dict) or "model" not in tree:
        raise ValueError(f"config {path}: expected a mapping with a 'model' section")
    return tree
