"""Named hook points as context managers that always restore the model (docs/style.md 6).

The o_proj hooks sit on the input of each layer's output projection, i.e. the per-head attention outputs
before the projection, laid out (B, T, H * D) with query head h in dims h*D .. (h+1)*D-1.
That module is `o_proj` in phasekv models and in HF Qwen3 / Llama models alike (and in MLA attention, with
D = v_head_dim); an architecture without one names its own in `phasekv.archs` (`output_projection`), possibly a
grouped projection reading (B, T, groups, H * D / groups), which flattens to the same layout.
Query head h reads KV head h // (H / KVH) (grouped-query attention, as HF's `repeat_kv`).

They act at the final position of a forward, which is the query position of a full prompt and of
a query continuation, but NOT of a context prefill (its final position is the last context token,
and changing it there would change the cache every query reads).  `QueryOnly` wraps an adapter so
that its prefill forwards are invisible to the hooks of this module; pass the wrapper to both the
hook and the runner (`phasekv.evaluate.runner.predict`) and both evaluation modes act on queries only.

`attention_inputs` captures each compressed layer's attention input, the normalized hidden state h
that the compressor reads (docs/science.md section 1); `compressed_layers` finds those layers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from phasekv.adapters.base import Adapter, Wrapped
from phasekv.archs import architecture_of
from phasekv.compression import Compressor


class QueryOnly(Wrapped):
    """`inner` with its prefill forwards hidden from the o_proj hooks of this module (see the docstring)."""

    def __init__(self, inner: Adapter):
        super().__init__(inner)
        self.armed = True  # read by the hooks at call time

    def prefill(self, ids: torch.Tensor):
        self.armed = False
        try:
            return self.inner.prefill(ids)
        finally:
            self.armed = True


def output_projection(adapter: Adapter, attn: nn.Module) -> nn.Module:
    """The module whose input is `attn`'s per-head output, as the model's architecture names it (`phasekv.archs`)."""
    arch = architecture_of(adapter.module)
    module = arch.output_projection(attn)
    if module is None:
        raise ValueError(f"{type(attn).__name__}: no output projection to hook (architecture {arch.name!r})")
    return module


def _per_head(x: torch.Tensor) -> torch.Tensor:
    """An output projection's input as (B, T, H * D) (a grouped (B, T, groups, H * D / groups) flattened)."""
    return x.flatten(2) if x.dim() == 4 else x


def _armed(adapter: Adapter) -> bool:
    return getattr(adapter, "armed", True)


def heads_of_kv(adapter: Adapter, kv_head: int | None) -> list[int]:
    """Query heads that read `kv_head` (None: every head of the layer)."""
    info = adapter.info
    if kv_head is None:
        return list(range(info.num_heads))
    if not 0 <= kv_head < info.num_kv_heads:
        raise ValueError(f"kv_head: must be in [0, {info.num_kv_heads}), got {kv_head}")
    group = info.num_heads // info.num_kv_heads
    return list(range(kv_head * group, (kv_head + 1) * group))


@contextlib.contextmanager
def capture_final_head_outputs(adapter: Adapter) -> Iterator[list[list[torch.Tensor]]]:
    """Collect, per layer, the o_proj input at the final position of every forward: list of (B, H*D)."""
    captured: list[list[torch.Tensor]] = [[] for _ in adapter.attention_layers()]
    handles = []
    try:
        for i, attn in enumerate(adapter.attention_layers()):
            def hook(module, args, i=i):
                if _armed(adapter):
                    captured[i].append(_per_head(args[0])[:, -1].detach().float().cpu())
            handles.append(output_projection(adapter, attn).register_forward_pre_hook(hook))
        yield captured
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def replace_heads(adapter: Adapter, layer: int, heads: list[int] | None, mean: torch.Tensor) -> Iterator[None]:
    """Replace, at the final position only, the o_proj input of query `heads` of `layer` (None: all of it) by the
    matching dims of `mean` (H*D,); every other dim and position passes through unchanged."""
    if not 0 <= layer < adapter.info.num_layers:
        raise ValueError(f"layer: must be in [0, {adapter.info.num_layers}), got {layer}")
    D = adapter.info.head_dim
    if heads is None:
        dims = torch.arange(mean.numel())
    else:
        dims = torch.tensor([h * D + d for h in heads for d in range(D)], dtype=torch.long)
        if dims.numel() and int(dims.max()) >= mean.numel():
            raise ValueError(f"layer {layer}: its output projection takes {mean.numel()} dims, not the model's "
                             f"{adapter.info.num_heads} heads x {D}: knock out the whole layer")

    def hook(module, args):
        if not _armed(adapter):
            return None
        x = args[0].clone(memory_format=torch.contiguous_format)  # contiguous: _per_head(x) is a view of it
        _per_head(x)[:, -1, dims.to(x.device)] = mean[dims].to(device=x.device, dtype=x.dtype)  # a view of x
        return (x, *args[1:])

    handle = output_projection(adapter, adapter.attention_layers()[layer]).register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def mean_knockout(adapter: Adapter, layer: int, kv_head: int | None,
                  mean: torch.Tensor) -> contextlib.AbstractContextManager[None]:
    """Replace, at the final position only, the outputs of the query heads reading `kv_head` of
    `layer` (None: all heads of the layer) by the calibration `mean` (H*D,); nothing else changes."""
    return replace_heads(adapter, layer, None if kv_head is None else heads_of_kv(adapter, kv_head), mean)


def compressed_layers(model: nn.Module | Adapter) -> list[tuple[int, nn.Module]]:
    """(layer index, attention module) of every layer with a KV compressor (phasekv models; [] for others)."""
    if isinstance(model, Adapter):
        attn = model.attention_layers()
    else:
        attn = [layer.self_attn for layer in model.model.layers]
    # a transformers attention may have a `compressor` too, not a phasekv one (its architecture reads it: phasekv.archs)
    return [(i, a) for i, a in enumerate(attn) if isinstance(getattr(a, "compressor", None), Compressor)]


@contextlib.contextmanager
def attention_inputs(model: nn.Module | Adapter) -> Iterator[dict[int, list[torch.Tensor]]]:
    """Collect, per compressed layer, the attention module's input h (B, T, hidden) of every forward."""
    captured: dict[int, list[torch.Tensor]] = {}
    handles = []
    try:
        for i, attn in compressed_layers(model):
            captured[i] = []

            def hook(module, args, i=i):
                captured[i].append(args[0].detach())
            handles.append(attn.register_forward_pre_hook(hook))
        yield captured
    finally:
        for h in handles:
            h.remove()
