"""The interface of a transformers architecture and its registry (docs/architecture.md, "Architectures").

phasekv runs transformers' classes as they are.  What it must know about one architecture beyond what every causal
LM offers lives in one `Architecture` subclass, in its own file of this package, registered with `@register`:

  matches(config)           whether a transformers config (its `model_type`) is this architecture's
  geometry(config)          its chunked compression: a `CompressionGeometry` (sets the phase stride) or None
  output_projection(attn)   the module whose input is the heads' output before the output projection: where the
                            knockout hooks sit
  gate_layers(model)        compressor modules whose gate softmax the probes recompute from the module's own weights
  cycled_layers(model)      the offset-indexed gate parameters that gate cycling rolls
  indexer_kinds()           its sparse-attention indexers and their distillation objective (`training.indexer_kl`)
  repeat_cache(...)         one prefilled cache repeated per query row (shared-prefill evaluation)

The base class is the dense default (Qwen3, Llama: `o_proj`, no compression, no gates, no indexer), so an
architecture overrides only what it has.  `architecture_of(model or config)` picks the registered architecture that
matches, else the default.  phasekv's own compressors satisfy the `Geometry` protocol too (`name`, `window`,
`stride`), so a report reads the geometry of either family the same way.

Architecture files import transformers' modules only inside methods: a model of those classes has imported them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class Geometry(Protocol):
    """Window geometry of a chunked compression: windows of `window` tokens starting every `stride` tokens.  A
    phasekv `Compressor` and a `CompressionGeometry` both are one."""

    name: str
    window: int
    stride: int


@dataclass(frozen=True)
class CompressionGeometry:
    """A transformers architecture's chunked compression, read from its config: the first compressed layer's kind
    (`name`) and the indices of the layers of that kind."""

    name: str
    window: int
    stride: int
    compressed_layers: tuple[int, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"compressor": self.name, "window": self.window, "stride": self.stride,
                "compressed_layers": list(self.compressed_layers)}


@dataclass
class GateLayer:
    """A compressor module of a transformers architecture whose gates the probes read (`phasekv.probes.archgates`):
    windows of `window` offsets every `stride` tokens from position 0, one gate record per layer."""

    layer: int
    module: nn.Module  # its forward's first argument (or `hidden_states`) is the (B, T, hidden) the gates read
    window: int
    stride: int
    weights: Callable[[torch.Tensor], torch.Tensor]  # hidden (B, T, hidden) from position 0 -> alpha (B, N, W, D)
    kind: str  # "vector": one softmax per channel; "scalar": one per window
    branch: str  # "k" when keys and values are one tensor (tied)
    tied: bool
    shared_payload: bool  # every offset's payload goes through one projection


@dataclass
class CycledLayer:
    """A compressed layer as gate cycling sees it: geometry, boundary phase and its offset-specific gate
    parameters (one slice per window offset on dim 0)."""

    layer: int
    window: int
    stride: int
    boundary: int  # phase of the windows' last offset
    gates: dict[str, nn.Parameter]


def _one_token(indexer: nn.Module) -> int:
    return 1


@dataclass
class IndexerKind:
    """How one transformers indexer class is hooked (`training.indexer_kl`): the indexer, its attention module, and
    `record`, which turns one indexer call (module, args, kwargs, output, scorer output) into (scores (B, S, C),
    candidates (B, S, C) bool, selected (B, S, C) bool, pools (B, C, kpool) or None)."""

    indexer: type
    attention: type
    record: Callable[..., tuple]
    cache_index: int  # position of the indexer's `cache` argument (only cache-free training forwards are recorded)
    scorer: type | None = None  # a differentiable scoring submodule: its inputs are detached, its output recorded
    trailing: bool = False  # candidates are the attention's trailing key columns (compressed entries after raw keys)
    pool: Callable[[nn.Module], int] = field(default=_one_token)  # tokens per candidate, for the dense warm-up
    groups: Callable[[nn.Module], int] = field(default=_one_token)  # selections per batch row (MiniMax-M3: one
    # per KV group); the record's rows are then (batch, group) pairs, group-major within a batch row
    topk_attribute: str | None = None  # the indexer's top-k attribute the dense warm-up raises (None: DeepSeek's)
    topk_in_candidates: bool = False  # that top-k counts candidates (blocks), not tokens


def selected_mask(indices: torch.Tensor, width: int) -> torch.Tensor:
    """Top-k indices (B, S, k), -1 for none -> (B, S, width) bool."""
    valid = (indices >= 0) & (indices < width)
    out = torch.zeros(*indices.shape[:2], width + 1, dtype=torch.bool, device=indices.device)
    out.scatter_(-1, torch.where(valid, indices.long(), width), True)
    return out[..., :width]


def argument(args: tuple, kwargs: dict, index: int, name: str) -> Any:
    """A forward hook's argument, passed by keyword or at `index`."""
    return kwargs[name] if name in kwargs else args[index]


def text_config(config: Any) -> Any:
    """The text model's config (a multimodal config's text part; the config itself otherwise)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def repeat_rows(cache: Any, batch: int, repeats: int) -> None:
    """Repeat each of the `batch` rows of a transformers cache `repeats` times in place (context-major order, like
    repeat_interleave).  Goes through `reorder_cache`, which every cache layer implements for its whole state
    (compressor buffers, overlap and compressed entries, linear-attention states), unlike `batch_repeat_interleave`,
    which repeats only the keys and values or is missing."""
    cache.reorder_cache(torch.arange(batch).repeat_interleave(repeats))


class Architecture:
    """The dense default; a subclass overrides what its architecture has (see the module docstring)."""

    name = ""  # the registry key
    model_types: tuple[str, ...] = ()  # transformers `model_type`s of this architecture (top-level or text config)

    def matches(self, config: Any) -> bool:
        types = {getattr(config, "model_type", None), getattr(text_config(config), "model_type", None)}
        return bool(types & set(self.model_types))

    def check_config(self, config: Any) -> None:
        """Raise a one-line ValueError for a (text) config that transformers would accept but fail on deep inside
        the first forward; the default has nothing to check."""

    def geometry(self, config: Any) -> CompressionGeometry | None:
        """The chunked compression the (text) config describes; None: no phase grid."""
        return None

    def output_projection(self, attn: nn.Module) -> nn.Module | None:
        """The module whose input is `attn`'s per-head output, (B, T, H * D) or grouped (B, T, groups, H * D /
        groups); None when `attn` has none."""
        module = getattr(attn, "o_proj", None)
        return module if isinstance(module, nn.Module) else None

    def gate_layers(self, model: nn.Module) -> list[GateLayer]:
        return []

    def cycled_layers(self, model: nn.Module) -> list[CycledLayer]:
        return []

    def indexer_kinds(self) -> list[IndexerKind]:
        return []

    def repeat_cache(self, cache: Any, batch: int, repeats: int) -> None:
        repeat_rows(cache, batch, repeats)


_REGISTRY: dict[str, Architecture] = {}
DEFAULT = "dense"  # the architecture of every model no other one matches (`phasekv.archs.dense`)


def register(cls: type[Architecture]) -> type[Architecture]:
    """Class decorator: register one instance of an architecture under its `name`."""
    _REGISTRY[cls.name] = cls()
    return cls


def available() -> list[str]:
    """Names of the registered architectures."""
    return sorted(_REGISTRY)


def get(name: str) -> Architecture:
    if name not in _REGISTRY:
        raise ValueError(f"architecture: unknown {name!r}; known: {available()}")
    return _REGISTRY[name]


def architecture_of(model_or_config: Any) -> Architecture:
    """The registered architecture of a model (read from its `config`) or of a config; the dense default when
    none matches (phasekv's own models included)."""
    config = getattr(model_or_config, "config", None) if isinstance(model_or_config, nn.Module) else model_or_config
    found = [a for name, a in _REGISTRY.items() if name != DEFAULT and config is not None and a.matches(config)]
    return found[0] if found else _REGISTRY[DEFAULT]


def geometry_of(model_or_config: Any) -> CompressionGeometry | None:
    """The chunked compression of a transformers model (or config) as its architecture reads it; None for a dense
    model, a token-level indexer and phasekv's own models (their compressors carry their geometry)."""
    config = getattr(model_or_config, "config", None) if isinstance(model_or_config, nn.Module) else model_or_config
    return None if config is None else architecture_of(config).geometry(text_config(config))
