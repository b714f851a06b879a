"""The one small interface evaluation and probes use to talk to a model (docs/architecture.md).

An adapter scores next-token logits for batches of token ids, either in one forward pass or by
prefilling shared contexts once and continuing several queries from the cache.  phasekv models
(`phasekv.adapters.phasekv`), transformers causal LMs (`phasekv.adapters.hf`) and served models
(`phasekv.engines.client`) implement it; probes attach PyTorch hooks to `adapter.attention_layers()`
(each layer's `self_attn` and its output projection, `o_proj` or the module the model's architecture
names in `phasekv.archs`, have the same roles in every family).

Every position is a real token: there is no padding, so a token's phase is its index in the input ids.

`Wrapped` is the base of every adapter that wraps another one (a compression condition, a probe's
hook switch, a recorder): it forwards each member the wrapper does not change, so a wrapper states only
what it changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class ModelInfo:
    name: str
    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_length: int
    stride: int | None  # the compression stride that sets phase (None: no compression)
    local_window: int | None  # raw tokens a compressed layer sees exactly (None: full attention)


class Adapter:
    info: ModelInfo
    module: nn.Module
    device: torch.device
    shares_cache = False  # True: continue_from may continue many contexts' queries at once (batch_size contexts)
    shares_prefix = False  # True: prefill(ids, prefix=P) may prefill the first P tokens once for every call

    def attention_layers(self) -> list[nn.Module]:
        """The attention module of each layer (exposing its output projection: `o_proj`, or what its architecture
        names, `phasekv.archs`)."""
        raise NotImplementedError

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, T) -> logits (B, T, V), one forward pass without cache."""
        raise NotImplementedError

    def next_logits(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (B, T) -> the last position's logits (B, 1, V), one forward pass without cache."""
        return self.logits(ids)[:, -1:]

    def prefill(self, ids: torch.Tensor):
        """ids (B, T) -> an opaque cache of the B contexts.  An adapter with `shares_prefix` also takes `prefix`:
        the number of leading tokens every row (and every later call) has in common."""
        raise NotImplementedError

    def continue_from(self, cache, ids: torch.Tensor, repeats: int) -> torch.Tensor:
        """Continue each of the cached contexts with `repeats` query rows each (context-major order):
        ids (B * repeats, t) -> logits (B * repeats, t, V).  The cache itself is left unchanged."""
        raise NotImplementedError

    def check_length(self, length: int) -> None:
        if length > self.info.max_length:
            raise ValueError(f"prompt length {length} exceeds the model's context ({self.info.max_length} tokens)")


class Wrapped(Adapter):
    """`inner` with every member forwarded: subclasses override what they change.

    Not forwarded, on purpose: `next_logits` (the interface's default calls `self.logits`, so a wrapper that
    changes or records `logits` sees the one-forward-per-prompt path too) and `shares_prefix` (False unless a
    wrapper opts in: a prefix prefilled once reaches `inner` in pieces, which a press, for one, must not see)."""

    def __init__(self, inner: Adapter, info: ModelInfo | None = None):
        self.inner, self.info = inner, info or inner.info
        self.module, self.device, self.shares_cache = inner.module, inner.device, inner.shares_cache

    def attention_layers(self) -> list[nn.Module]:
        return self.inner.attention_layers()

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.logits(ids)

    def prefill(self, ids: torch.Tensor, **kwargs):
        return self.inner.prefill(ids, **kwargs)

    def continue_from(self, cache, ids: torch.Tensor, repeats: int) -> torch.Tensor:
        return self.inner.continue_from(cache, ids, repeats)

    def check_length(self, length: int) -> None:
        self.inner.check_length(length)


def spec_fields(text: str, parts: list[str], *, what: str, keys: tuple[str, ...]) -> dict[str, str]:
    """The `key=value` items `parts` of a condition spec `text` (a kpool: or slices: condition) as strings, each key
    one of `keys` and given once; a one-line ValueError, starting with `what` and the spec, otherwise."""
    fields: dict[str, str] = {}
    for part in parts:
        key, eq, value = part.strip().partition("=")
        if key not in keys or not eq or not value:
            raise ValueError(f"{what} {text!r}: cannot read {part!r} (keys: {', '.join(keys)})")
        if key in fields:
            raise ValueError(f"{what} {text!r}: {key} given twice")
        fields[key] = value
    return fields


# the largest whole number a condition spec takes (sizes, counts, seeds): beyond it a value is a typo that would
# overflow a tensor, not a setting
MAX_SPEC_INT = 1 << 31


def whole_number(value: str, where: str, high: int = MAX_SPEC_INT) -> int:
    """`value` as a whole number 0..`high` written in ASCII digits (no sign, no full-width digits); a one-line
    ValueError starting with `where` otherwise."""
    if not (value.isascii() and value.isdigit()):
        raise ValueError(f"{where}: {value!r} is not a whole number")
    if len(value) > len(str(high)) or int(value) > high:
        raise ValueError(f"{where}: {value} is above the largest allowed, {high}")
    return int(value)
