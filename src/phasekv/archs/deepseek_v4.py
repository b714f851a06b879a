"""transformers' DeepSeek-V4 (`model_type: deepseek_v4`): compressed sparse attention (CSA), heavily compressed
attention (HCA), a lightning indexer over compressed entries and a grouped low-rank output projection.

Geometry (read from the config):
  CSA   windows of 2m tokens starting every m (overlapping), m = compress_rates["compressed_sparse_attention"]
  HCA   windows of m' tokens every m' (non-overlapping), m' = compress_rates["heavily_compressed_attention"]

Knockout target: V4 has no o_proj.  Its grouped low-rank output projection `o_a_proj` reads the per-head outputs as
(B, T, groups, H * D / groups), which flattens to the (B, T, H * D) layout of an o_proj input, so the hooks sit
there; with V4's single KV head a KV-head knockout is a whole-layer knockout.

Gates.  `DeepseekV4HCACompressor` compresses each closed window of m' tokens into one entry (tied: the entry is key
and value) as sum_j softmax_j(gate_proj(h_j) + position_bias_j) * kv_proj(h_j), with the softmax over the window's
offsets j, per channel: a shared payload projection, a per-channel ("vector") gate and a learned per-offset bias.
`gate_weights` recomputes that softmax from the module's own `gate_proj` and `position_bias` for every closed
window; `phasekv.probes.archgates` pools the windows as `phasekv.probes.gates.gate_statistics` does for phasekv's
compressors (same keys, kind "vector", branch "k", tied), so the report draws both alike.  The recomputation is
checked against the module's own compressed entries in tests/test_realarch.py.
`DeepseekV4CSACompressor` (m tokens per step) is covered too: its entry w mixes two series over 2m slots, the Ca
half of the gate and payload projections (`[..., :head_dim]`) for the m tokens of window w-1 and the Cb half
(`[..., head_dim:]`) for the m tokens of window w, under ONE softmax over the 2m slots (W = 2m at S = m).  Entry 0
has no previous window (its Ca slots carry weight 0), so the statistics pool entries 1.. : windows of 2m tokens
starting at 0, m, 2m, ..., offset j at phase j mod m.

Gate cycling: the HCA compressor (W = S = m', windows from position 0, a payload map shared by the offsets) is
cycled through its per-offset `position_bias` (m', D); the CSA compressor (W = 2m, S = m) is not cyclable, like any
W != S compressor (`phasekv.probes.cycle` refuses it).

Indexer (`DeepseekV4Indexer`): candidates are compressed entries (one per m tokens), the attention's trailing key
columns after the raw window; the scores are the output of the real `DeepseekV4IndexerScorer` (differentiable),
with the indexer's inputs detached by a pre-hook (`phasekv.archs.indexer_kl`).
"""

from __future__ import annotations

import torch
from torch import nn

from phasekv.archs.base import (
    Architecture,
    CompressionGeometry,
    CycledLayer,
    GateLayer,
    IndexerKind,
    argument,
    register,
    selected_mask,
)

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"


def compressors(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer index, compressor) of every HCA or CSA compressor of `model` (by class)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    kinds = (v4.DeepseekV4HCACompressor, v4.DeepseekV4CSACompressor)
    return [(m.layer_idx, m.compressor) for m in model.modules()
            if isinstance(m, v4.DeepseekV4Attention) and isinstance(m.compressor, kinds)]


def overlapping(compressor: nn.Module) -> bool:
    """A CSA compressor: windows of 2m tokens every m (two series per token), else HCA (m' tokens every m')."""
    return compressor.kv_proj.out_features == 2 * compressor.head_dim


def window_of(compressor: nn.Module) -> int:
    """W: 2m for CSA, m' for HCA."""
    return 2 * compressor.compress_rate if overlapping(compressor) else compressor.compress_rate


def windows(compressor: nn.Module, projected: torch.Tensor) -> torch.Tensor:
    """A projection (B, T, D or 2D) of the tokens from position 0 laid out per window's slots: HCA (B, N, m', D)
    over the closed windows; CSA (B, N-1, 2m, D) for entries 1..N-1, the Ca half of window w-1's tokens then the
    Cb half of window w's."""
    m = compressor.compress_rate
    n = projected.shape[1] // m
    per_window = projected[:, :n * m].view(projected.shape[0], n, m, -1)  # (B, N, m, D or 2D)
    if not overlapping(compressor):
        return per_window
    D = compressor.head_dim
    return torch.cat([per_window[:, :-1, :, :D], per_window[:, 1:, :, D:]], dim=2)  # (B, N-1, 2m, D)


def gate_weights(compressor: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """hidden (B, T, hidden) from position 0 -> alpha (B, N, W, D): the softmax over each window's slots of
    gate_proj(h) + position_bias, per channel (the compressor's own weights, float32 as it computes them);
    W = m' for HCA, 2m for CSA (entries 1.., `windows`)."""
    m = compressor.compress_rate
    n = hidden.shape[1] // m
    gate = compressor.gate_proj(hidden[:, :n * m]).view(hidden.shape[0], n, m, -1) + compressor.position_bias
    return windows(compressor, gate.flatten(1, 2)).softmax(dim=2, dtype=torch.float32)


def _record(indexer, args, kwargs, output, scores):
    position_ids = argument(args, kwargs, 2, "position_ids")
    width = scores.shape[-1]
    causal = torch.arange(width, device=scores.device) < ((position_ids + 1) // indexer.compress_rate)[..., None]
    return scores, causal, selected_mask(output, width), None


@register
class DeepseekV4(Architecture):
    name = "deepseek_v4"
    model_types = ("deepseek_v4",)

    def geometry(self, config) -> CompressionGeometry | None:
        rates = getattr(config, "compress_rates", None) or {}
        types = getattr(config, "layer_types", None) or []
        for layer_type in types:  # the first compressed layer's kind, and every layer of that kind
            if layer_type in (CSA, HCA) and layer_type in rates:
                m = int(rates[layer_type])
                layers = tuple(i for i, t in enumerate(types) if t == layer_type)
                if layer_type == CSA:
                    return CompressionGeometry("deepseek_v4_csa", 2 * m, m, layers)
                return CompressionGeometry("deepseek_v4_hca", m, m, layers)
        return None

    def output_projection(self, attn: nn.Module) -> nn.Module | None:
        module = getattr(attn, "o_a_proj", None)
        return module if isinstance(module, nn.Module) else None

    def gate_layers(self, model: nn.Module) -> list[GateLayer]:
        return [GateLayer(i, c, window_of(c), c.compress_rate, lambda h, c=c: gate_weights(c, h), kind="vector",
                          branch="k", tied=True, shared_payload=True)  # one kv_proj for every offset's payload
                for i, c in compressors(model)]

    def cycled_layers(self, model: nn.Module) -> list[CycledLayer]:
        out = []
        for i, c in compressors(model):  # windows from position 0: the last offset's phase is (W - 1) mod m
            W, m = window_of(c), c.compress_rate
            out.append(CycledLayer(i, W, m, (W - 1) % m, {"position_bias": c.position_bias}))
        return out

    def indexer_kinds(self) -> list[IndexerKind]:
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

        return [IndexerKind(v4.DeepseekV4Indexer, v4.DeepseekV4Attention, _record, 3, v4.DeepseekV4IndexerScorer,
                            trailing=True)]
