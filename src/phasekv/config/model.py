"""Model configurations: compressor options, the phasekv model (`ModelConfig`) and transformers' models.

An experiment's `model` section either describes a phasekv model (`ModelConfig(**yaml["model"])` is
always a valid call) or names a transformers model type (`model_type: qwen3`, with that config class's
fields; `TransformersModelConfig`).

Compressor options are declared beside each compressor (a `CompressorOptions` dataclass registered
under the compressor's name by `phasekv.compression.register`), so a compressor with new knobs is one
file and one registry line, with no edit here.  A phasekv model config keeps them per compressor kind
in `compressors`; for convenience and for old checkpoints, flat keys (`window=8, stride=8`) are routed
to the options of the compressor kinds the model uses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from phasekv.config.fields import check_fields, from_section, short, spec

LAYER_KINDS_BUILTIN = ("full", "sliding")
ROPE_PARTS = ("first", "last")


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
        raise ValueError(f"model.compressors: must be a mapping of compressor name to options, got {short(raw)}")
    nested = {kind: dict(opts) if isinstance(opts, dict) else opts for kind, opts in raw.items()}
    for key in sorted(set(data) - own, key=str):
        owners = [n for n, cls in _OPTIONS.items() if key in {f.name for f in dataclasses.fields(cls)}]
        used = [k for k in kinds if k in owners]
        if used:
            for kind in used:
                options = nested.setdefault(kind, {})
                if isinstance(options, dict) and options.setdefault(key, data[key]) != data[key]:
                    raise ValueError(f"model.{key}: {short(data[key])} conflicts with model.compressors.{kind}."
                                     f"{key}={short(options[key])}; give it in one place")
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

    def __init__(self, **values: Any) -> None:
        """Keyword-only: `ModelConfig(compressor="gated", window=8, stride=8)`.  Flat compressor option keys
        (`window`, `stride`, ...) go to `compressors` of the kinds the model uses (`route_compressor_keys`);
        a field not given takes its default.  (Written here, so @dataclass keeps it and generates the rest.)"""
        values = route_compressor_keys(values)
        for f in dataclasses.fields(self):
            if f.name in values:
                setattr(self, f.name, values[f.name])
            elif f.default_factory is not dataclasses.MISSING:
                setattr(self, f.name, f.default_factory())
            else:
                setattr(self, f.name, f.default)
        self.__post_init__()

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
        for opts in self.compressors.values():  # rules of a per-layer schedule held in a compressor's options
            if hasattr(opts, "check_model"):
                opts.check_model(self)
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
            raise ValueError(f"model: section must be a mapping, got {short(data)}")
        return cls(**route_compressor_keys(data))



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
                raise ValueError(f"model.{name}: must be an integer in [1, {1 << 24}], got {short(value)}")

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
