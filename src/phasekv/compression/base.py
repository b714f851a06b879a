"""The compressor interface and its name registry (docs/science.md section 1).

A compressor reads a layer's normalized hidden states in windows of `W` tokens that start every
`S` tokens from the layer's first window start `offset` (0 unless the layer is staggered) and writes
ONE key (and one value) per window per KV head.  Window `j` covers positions
`offset + j*S .. offset + j*S + W - 1`; it is usable by a query at position `t` only once it is
complete.  Layout in this package: hidden states are `(B, T, hidden)`, compressed entries are
`(B, N, KVH, D)` with N the number of complete windows.

With `head_stagger` (beyond the paper), KV head h starts its windows at `offset + h*S/KVH`: the
compressor then runs on the union grid of stride S' = S/KVH (`grid_stride`, first start `grid_offset`)
and window j of that grid belongs to ONE head, `owners(starts)`; the layer keeps only that head's
entry, so the cache holds as many bytes as without stagger while `compress` does KVH times the work.

The compressor owns everything the rest of phasekv needs to know about it: its geometry and window
starts, its gate parameters (the optimizer's gate group, snapshots), its offset-indexed gate
parameters (gate cycling), its payload parameters, and an optional selection step (a top-k indexer)
that attention calls through `select`.  Nothing outside this package looks at parameter names.

A new compressor is one file: an options dataclass (its hyperparameters, subclass of
`phasekv.config.CompressorOptions`), a `Compressor` subclass implementing `compress` (fast, all
windows at once), `compress_reference` (slow loops, the oracle in the tests) and the parameter
accessors, decorated with `@register("name", Options)`; plus one import in `__init__.py`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from phasekv.config import CompressorOptions, ModelConfig, register_options

_REGISTRY: dict[str, type[Compressor]] = {}


def register(name: str, options: type[CompressorOptions]):
    """Class decorator: register a compressor and its options dataclass under `name`."""
    def wrap(cls: type[Compressor]) -> type[Compressor]:
        cls.name, cls.Options = name, options
        _REGISTRY[name] = cls
        register_options(name, options)
        return cls

    return wrap


def available() -> list[str]:
    """Names of the registered compressors."""
    return sorted(_REGISTRY)


def get(name: str) -> type[Compressor]:
    if name not in _REGISTRY:
        raise ValueError(f"compressor: unknown {name!r}; known: {available()}")
    return _REGISTRY[name]


def build(config: ModelConfig, name: str, offset: int = 0, layer: int | None = None) -> Compressor:
    """The compressor `name` of a model, its first window starting at position `offset`; a compressor whose
    role depends on its layer (`layer_aware`, e.g. CSA2's shared compressors) also gets the layer index."""
    cls = get(name)
    if getattr(cls, "layer_aware", False):
        return cls(config.options(name), config, offset, layer=layer)
    return cls(config.options(name), config, offset)


def num_windows(length: int, window: int, stride: int) -> int:
    """How many complete windows `length` tokens hold."""
    return 0 if length < window else (length - window) // stride + 1


def windows(x: torch.Tensor, window: int, stride: int) -> torch.Tensor:
    """All complete windows of `x` (B, T, C) as a strided view (B, N, W, C); no copy."""
    if x.shape[1] < window:
        return x.new_zeros(x.shape[0], 0, window, x.shape[2])
    return x.unfold(1, window, stride).transpose(-1, -2)  # (B, N, W, C)


@dataclass
class Selection:
    """A compressor's choice of entries per query: keep the top `k` visible entries by `scores`."""

    scores: torch.Tensor  # (B, Tq, N)
    k: int
    allowed: torch.Tensor | None = None  # (B, Tq, N) bool: the only entries it may pick (None: any visible one)

    def rows(self, a: int, b: int) -> Selection:
        """The selection of queries a..b-1."""
        return Selection(self.scores[:, a:b], self.k, None if self.allowed is None else self.allowed[:, a:b])


class Compressor(nn.Module):
    """Maps hidden states to one compressed key and value per complete window.

    Subclasses call `super().__init__(options, config, offset)` and set `self.tied` (True: the
    layer reuses the normalized, rotated keys as values and `compress` returns `None` for them).
    """

    name = "base"
    Options: type[CompressorOptions]
    tied: bool
    kv_source: int | None = None  # a layer whose compressed cache this layer reads (CSA2); None: its own

    def __init__(self, options: CompressorOptions, config: ModelConfig, offset: int = 0):
        super().__init__()
        self.window, self.stride = options.geometry()
        if not 1 <= self.stride <= self.window:
            raise ValueError(f"{options.section}: stride S={self.stride} must satisfy 1 <= S <= W={self.window}")
        self.offset = offset  # first window start (of KV head 0 with head stagger)
        self.num_kv_heads, self.head_dim = config.num_key_value_heads, config.head_dim
        self.head_stagger = config.head_stagger
        self.selects = options.selects()  # picks entries per query (an indexer's top-k)

    # ---------------------------------------------------------------- geometry
    @property
    def grid_stride(self) -> int:
        """Tokens between consecutive windows `compress` reads: S, or S / KVH with head stagger."""
        return self.stride // self.num_kv_heads if self.head_stagger else self.stride

    @property
    def grid_offset(self) -> int:
        """Position of the first window start of the grid `compress` reads (of any head)."""
        return self.offset % self.grid_stride if self.head_stagger else self.offset

    def head_offset(self, head: int) -> int:
        """Position of KV head `head`'s first window start (`offset` for every head without head stagger)."""
        return self.offset + head * self.grid_stride if self.head_stagger else self.offset

    def owners(self, starts: torch.Tensor) -> torch.Tensor:
        """KV head that keeps the entry of each window starting at `starts` (N,) (head stagger only): head h
        owns the starts `head_offset(h)` mod S.  Computed from positions, so compressing in pieces agrees."""
        return torch.div(starts - self.offset, self.grid_stride, rounding_mode="floor") % self.num_kv_heads

    def window_starts(self, length: int) -> torch.Tensor:
        """Positions of the first token of every complete window of the grid in a sequence of `length` tokens."""
        n = num_windows(max(0, length - self.grid_offset), self.window, self.grid_stride)
        return self.grid_offset + torch.arange(n) * self.grid_stride

    def from_first_window(self, h: torch.Tensor, head: int = 0) -> torch.Tensor:
        """h (B, T, hidden) of positions 0..T-1 -> its part from KV head `head`'s first window start on."""
        return h[:, self.head_offset(head):]

    def offset_phase(self, i: int, head: int = 0) -> int:
        """Phase (position mod S) of the token at offset i of every window of KV head `head`."""
        return (self.head_offset(head) + i) % self.stride

    # ---------------------------------------------------------------- the computation
    def compress(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h (B, T, hidden), position 0 a window start -> keys, values (B, N, KVH, D) of the complete windows
        every `grid_stride` tokens."""
        raise NotImplementedError

    def compress_reference(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Same as `compress`, written as plain loops over windows and offsets."""
        raise NotImplementedError

    def gate_weights(self, h: torch.Tensor) -> dict[str, torch.Tensor]:
        """alpha per branch ("k", "v"): (B, N, W, KVH, G) with G = 1 (scalar) or D (vector), over windows every S
        tokens from position 0 of h (one head's windows: with head stagger, pass `from_first_window(h, head)`)."""
        raise NotImplementedError

    def select(self, x: torch.Tensor, entries: torch.Tensor) -> Selection | None:
        """Optional selection step: x (B, Tq, hidden) queries' layer input, entries (B, N, KVH, D)
        -> which entries each query may read (None: every visible entry)."""
        return None

    def training_problem(self) -> str | None:
        """Why this compressor cannot be trained by the language-model loss alone (None: it can)."""
        return None

    # ---------------------------------------------------------------- parameter roles
    def gate_parameters(self) -> dict[str, nn.Parameter]:
        """The gate maps and biases (empty for gate-free compressors such as uniform averaging)."""
        return {}

    def offset_gate_parameters(self) -> dict[str, nn.Parameter]:
        """Gate parameters with one slice per window offset on dim 0 (W slices): what gate cycling rolls."""
        return {}

    def payload_parameters(self) -> dict[str, nn.Parameter]:
        """The payload maps C."""
        return {}

    def offset_payload_maps(self) -> dict[str, nn.Parameter]:
        """Per branch ("k", "v"), a payload map with one slice per window offset on dim 0, laid out
        (W, hidden, KVH * D); empty when payload maps are shared by the offsets.  Gate-cycling controls
        roll these with the gates, or replace them by one gate-weighted average."""
        return {}


def compressors_of(model: nn.Module) -> list[tuple[str, Compressor]]:
    """(module name, compressor) of every compressor inside `model`, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, Compressor)]


def compressor_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every compressor parameter of `model` by its full name (gate snapshots and trajectories)."""
    return {f"{name}.{p_name}": p for name, c in compressors_of(model) for p_name, p in c.named_parameters()}


@contextlib.contextmanager
def shifted_windows(model: torch.nn.Module, shift: int):
    """While active, every compressor's first window starts `shift` tokens later (mod its stride S), on top of its
    own offset (a staggered layer keeps its stagger): `train.window_jitter` draws a shift per step so records land
    at every offset of a window during training, and `probes.grid` measures a randomized grid at inference.
    The offsets are restored on exit, whatever happens."""
    saved = [(c, c.offset) for _, c in compressors_of(model)]
    try:
        for c, offset in saved:
            c.offset = (offset + shift) % c.stride
        yield
    finally:
        for c, offset in saved:
            c.offset = offset
