"""Named hook points as context managers that always restore the model (STYLE.md 6).

Both hook kinds sit on the input of each layer's `o_proj`, i.e. the per-head attention outputs
before the output projection, laid out (B, T, H * D) with query head h in dims h*D .. (h+1)*D-1.
That module exists with that meaning in phasekv models and in HF Qwen3 / Llama models alike.
Query head h reads KV head h // (H / KVH) (grouped-query attention, as HF's `repeat_kv`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from phasekv.evaluate.adapter import Adapter


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
                captured[i].append(args[0][:, -1].detach().float().cpu())
            handles.append(attn.o_proj.register_forward_pre_hook(hook))
        yield captured
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def mean_knockout(adapter: Adapter, layer: int, kv_head: int | None, mean: torch.Tensor) -> Iterator[None]:
    """Replace, at the final position only, the outputs of the query heads reading `kv_head` of
    `layer` (None: all heads of the layer) by the calibration `mean` (H*D,); nothing else changes."""
    D = adapter.info.head_dim
    dims = torch.cat([torch.arange(h * D, (h + 1) * D) for h in heads_of_kv(adapter, kv_head)])

    def hook(module, args):
        x = args[0].clone()
        x[:, -1, dims.to(x.device)] = mean[dims].to(device=x.device, dtype=x.dtype)
        return (x, *args[1:])

    handle = adapter.attention_layers()[layer].o_proj.register_forward_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()
