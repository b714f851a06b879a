"""DeepSeek-V4.1-style CSA2 attention (docs/science.md section 2): a per-layer schedule of shared compressors.

What is modelled, written from the public description of V4.1's attention:
  - `compress_ratios`, one per layer: 0 = sliding window only (the layer's kind is "sliding"), r >= 1 = the layer
    also reads a shared compressed KV in which every r tokens are pooled into ONE entry by a learned channel-wise
    softmax over the r tokens (non-overlapping groups; V4's CSA pools windows of 2m every m).  r = 1 is a plain
    projection of every token ("full-resolution shared KV").  A group is visible once the query passes its last
    token; a partial group waits in the cache (so chunked prefill is exact when a chunk boundary cuts a group).
  - `kv_source_layer_ids`: only these layers own a compressor; every later compressed layer up to the next
    source reads the source's compressed cache (its own cache holds its raw sliding window only).
  - an optional indexer (`index_topk` > 0) in `index_source_layer_ids`; the compressed layers between two index
    sources reuse the last source's top-k choice.  Scores: sum_h w_h(x_t) * relu(q_h(x_t) . k_h(entry_j)), the
    index keys computed by the scoring layer's own `index_k` from the shared entries.
  - the two-level top-k: `candidate_source_layer_id` keeps, per query, its top `candidate_topk_blocks` blocks of
    `candidate_block_size` of its entries (a block scores as its best visible entry: only complete groups count);
    every later index source selects its top-k only inside those blocks (a block is candidate_block_size * r
    tokens of the candidate source, so a later ratio must divide it).
So V4.1's phase moduli are the pooling ratio (2) and the candidate block in tokens (8 * 2 = 16).
Not modelled: MoE, Engram, hyper-connections and DSpark (they do not touch the KV grid), quantization, and the
indexer's distillation objective (a top-k choice gives it no gradient from the LM loss; `training_problem`).

`parity_bug` (test-only, never from a config file) injects a deviation recorded for DeepSeek's own reference
code: on decode steps where no group completes, an index source scores against ANOTHER index source's keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from phasekv.compression.base import Selection, register
from phasekv.compression.gated import OffsetGatedCompressor
from phasekv.config import CompressorOptions, ModelConfig, spec

NAME = "deepseek_csa2"


@dataclass
class CSA2Options(CompressorOptions):
    compress_ratios: list[int] | None = None  # per layer; None: ratio 2 on every deepseek_csa2 layer
    kv_source_layer_ids: list[int] | None = None  # layers owning a compressor; None: every compressed layer
    index_topk: int = spec(0, low=0, high=1 << 20)  # entries kept per query (0: no indexer)
    index_source_layer_ids: list[int] | None = None  # layers scoring anew; None: the kv sources
    index_heads: int = spec(4, low=1, high=256)
    index_dim: int = spec(16, low=1, high=4096)
    candidate_source_layer_id: int = spec(-1, low=-1, high=511)  # -1: one-level top-k
    candidate_block_size: int = spec(8, low=1, high=1 << 16)  # entries of the candidate source per block
    candidate_topk_blocks: int = spec(2048, low=1, high=1 << 20)

    def validate(self) -> None:
        for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids"):
            values = getattr(self, name)
            if values is not None and any(v < 0 for v in values):
                raise ValueError(f"{self.section}.{name}: entries must be >= 0, got {values}")

    def geometry(self) -> tuple[int, int]:
        r = max(self.compress_ratios or [2])
        return max(r, 1), max(r, 1)  # the coarsest pooling: the phase stride of the model

    def selects(self) -> bool:
        return self.index_topk > 0

    # ------------------------------------------------------------- the schedule, read against the model
    def ratios(self, config: ModelConfig) -> list[int]:
        if self.compress_ratios is not None:
            return list(self.compress_ratios)
        return [2 if kind == NAME else 0 for kind in config.layer_types]

    def kv_sources(self, config: ModelConfig) -> list[int]:
        if self.kv_source_layer_ids is not None:
            return sorted(self.kv_source_layer_ids)
        return [i for i, r in enumerate(self.ratios(config)) if r > 0]

    def index_sources(self, config: ModelConfig) -> list[int]:
        if self.index_topk == 0:
            return []
        if self.index_source_layer_ids is not None:
            return sorted(self.index_source_layer_ids)
        return self.kv_sources(config)

    def source_of(self, sources: list[int], layer: int) -> int:
        """The last source at or before `layer` (the schedule is checked, so one exists)."""
        return max(s for s in sources if s <= layer)

    def block_tokens(self, config: ModelConfig) -> int:
        """Tokens per candidate block: candidate_block_size entries of the candidate source."""
        return self.candidate_block_size * self.ratios(config)[self.candidate_source_layer_id]

    def check_model(self, config: ModelConfig) -> None:
        """The schedule's rules against the model (`ModelConfig` calls this); each error names its field."""
        s, n = self.section, config.num_hidden_layers
        ratios = self.ratios(config)
        if len(ratios) != n:
            raise ValueError(f"{s}.compress_ratios: has {len(ratios)} entries for num_hidden_layers={n}")
        for i, (r, kind) in enumerate(zip(ratios, config.layer_types, strict=True)):
            if (r > 0) != (kind == NAME):
                raise ValueError(f"{s}.compress_ratios: layer {i} has ratio {r} but kind {kind!r} (ratio 0 "
                                 f"<-> a non-{NAME} layer, e.g. sliding; ratio >= 1 <-> {NAME})")
        if config.stagger or config.head_stagger or config.uncompressed_tail:
            raise ValueError(f"{s}.compress_ratios: {NAME} layers share one grid: stagger, head_stagger and "
                             "uncompressed_tail must be false")
        compressed = [i for i, r in enumerate(ratios) if r > 0]
        for name, sources in (("kv_source_layer_ids", self.kv_sources(config)),
                              ("index_source_layer_ids", self.index_sources(config))):
            bad = [i for i in sources if i >= n or ratios[i] == 0]
            if bad:
                raise ValueError(f"{s}.{name}: layer {bad[0]} is not a {NAME} layer")
            early = [i for i in compressed if not any(j <= i for j in sources)]
            if early and (sources or name == "kv_source_layer_ids"):
                raise ValueError(f"{s}.{name}: layer {early[0]} reuses a source but no source comes before it")
        kv = self.kv_sources(config)
        for i in compressed:
            if ratios[i] != ratios[self.source_of(kv, i)]:
                raise ValueError(f"{s}.compress_ratios: layer {i} (ratio {ratios[i]}) reuses layer "
                                 f"{self.source_of(kv, i)}'s cache of ratio {ratios[self.source_of(kv, i)]}")
        index = self.index_sources(config)
        if index and set(kv) - set(index):
            raise ValueError(f"{s}.index_source_layer_ids: kv source {min(set(kv) - set(index))} must also be an "
                             "index source (a reused top-k must index the same compressed cache)")
        c = self.candidate_source_layer_id
        if c >= 0 and index:  # without an indexer there is nothing to restrict
            if c not in index:
                raise ValueError(f"{s}.candidate_source_layer_id: layer {c} is not an index source ({index})")
            for i in (i for i in index if i > c and self.block_tokens(config) % ratios[i]):
                raise ValueError(f"{s}.candidate_block_size: ratio {ratios[i]} of layer {i} does not divide the "
                                 f"candidate block of {self.block_tokens(config)} tokens")


# ----------------------------------------------------------------------------- the two-level top-k


def candidate_blocks(scores: torch.Tensor, ends: torch.Tensor, q_pos: torch.Tensor, block: int,
                     keep: int) -> torch.Tensor:
    """scores (B, Tq, N) of the candidate source's entries (group ends `ends` (N,)), queries at q_pos (Tq,)
    -> (B, Tq, nb) True for each query's top `keep` blocks of `block` entries among blocks holding at least one
    visible (complete) entry; a block scores as its best visible entry."""
    B, Tq, N = scores.shape
    nb = -(-N // block)
    visible = ends.to(scores.device)[None, :] <= q_pos.to(scores.device)[:, None]  # (Tq, N)
    s = scores.masked_fill(~visible, float("-inf"))
    s = torch.cat([s, s.new_full((B, Tq, nb * block - N), float("-inf"))], dim=-1)
    best = s.view(B, Tq, nb, block).amax(dim=-1)  # (B, Tq, nb)
    top = best.topk(min(keep, nb), dim=-1).indices
    chosen = torch.zeros_like(best, dtype=torch.bool).scatter_(-1, top, True)
    return chosen & (best > float("-inf"))


def candidate_blocks_reference(scores, ends, q_pos, block, keep):
    """`candidate_blocks` as per-query loops over explicitly listed visible entries."""
    B, Tq, N = scores.shape
    nb = -(-N // block)
    out = torch.zeros(B, Tq, nb, dtype=torch.bool)
    for b in range(B):
        for i in range(Tq):
            best = {}
            for j in range(N):
                if int(ends[j]) <= int(q_pos[i]):
                    best[j // block] = max(best.get(j // block, float("-inf")), float(scores[b, i, j]))
            for blk in sorted(best, key=lambda k: -best[k])[:keep]:
                out[b, i, blk] = True
    return out


def allowed_entries(blocks: torch.Tensor, starts: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """blocks (B, Tq, nb) candidate blocks per query, starts (N,) first token of each entry -> (B, Tq, N) True
    where the entry lies inside a candidate block (entries past the last block are not candidates)."""
    idx = torch.div(starts, block_tokens, rounding_mode="floor").to(blocks.device)  # (N,)
    inside = idx < blocks.shape[-1]
    got = blocks[..., idx.clamp(max=max(blocks.shape[-1] - 1, 0))] if blocks.shape[-1] else \
        blocks.new_zeros(*blocks.shape[:2], idx.shape[0])
    return got & inside


# ----------------------------------------------------------------------------- the compressor


@register(NAME, CSA2Options)
class DeepSeekCSA2(OffsetGatedCompressor):
    """One layer's view of the CSA2 schedule: an owner (kv source) pools every `ratio` tokens into one K = V
    entry; a reusing layer has no compressor parameters and reads its source's entries (`kv_source`)."""

    layer_aware = True  # built with its layer index (`phasekv.compression.build`)

    def __init__(self, options: CSA2Options, config: ModelConfig, offset: int = 0, layer: int | None = None):
        super().__init__(options, config, offset, vector_gate=True, tied=True, post_norm=False)
        kv_sources = options.kv_sources(config)
        layer = kv_sources[0] if layer is None else layer
        self.layer, self.options = layer, options
        self.window = self.stride = options.ratios(config)[layer]
        self.kv_source = options.source_of(kv_sources, layer)
        self.owner = self.kv_source == layer
        index = options.index_sources(config)
        self.index_source = options.source_of(index, layer) if index else None
        self.index_sources = index
        self.candidate = options.candidate_source_layer_id if index else -1
        self.block_tokens = options.block_tokens(config) if self.candidate >= 0 else 0
        self.parity_bug = False  # test-only: see the module docstring
        hidden, F, std = config.hidden_size, self.num_kv_heads * self.head_dim, config.initializer_range
        if self.owner:
            self.k_payload = nn.Parameter(torch.randn(1, hidden, F) * std)
            self.k_gate = nn.Parameter(torch.randn(1, hidden, F) * std)
            self.k_gate_bias = nn.Parameter(torch.zeros(self.window, F))  # per offset, per channel
        if self.index_source == layer:
            Hi, Di = options.index_heads, options.index_dim
            self.index_q = nn.Linear(hidden, Hi * Di, bias=False)
            self.index_w = nn.Linear(hidden, Hi, bias=False)
            self.index_k = nn.Linear(F, Hi * Di, bias=False)

    # ------------------------------------------------------------- pooling (owners only)
    def maps(self, branch: str):
        if not self.owner:
            raise ValueError(f"{NAME}: layer {self.layer} reuses layer {self.kv_source}'s cache and pools nothing")
        return (self.k_payload.expand(self.window, -1, -1), self.k_gate.expand(self.window, -1, -1),
                self.k_gate_bias)

    def gate_weights(self, h: torch.Tensor) -> dict[str, torch.Tensor]:
        return super().gate_weights(h) if self.owner else {}

    def gate_parameters(self) -> dict[str, nn.Parameter]:
        return {"k_gate": self.k_gate, "k_gate_bias": self.k_gate_bias} if self.owner else {}

    def offset_gate_parameters(self) -> dict[str, nn.Parameter]:
        return {"k_gate_bias": self.k_gate_bias} if self.owner else {}

    def payload_parameters(self) -> dict[str, nn.Parameter]:
        return {"k_payload": self.k_payload} if self.owner else {}

    # ------------------------------------------------------------- selection
    def index_scores(self, x: torch.Tensor, entries: torch.Tensor, keys: nn.Linear | None = None) -> torch.Tensor:
        """x (B, Tq, hidden), entries (B, N, KVH, D) -> scores (B, Tq, N) with this layer's indexer (its index
        keys from `keys`, this layer's own `index_k` unless given)."""
        B, Tq, _ = x.shape
        N, Hi = entries.shape[1], self.index_w.out_features
        q = self.index_q(x).view(B, Tq, Hi, -1)  # (B, Tq, Hi, Di)
        k = (keys or self.index_k)(entries.reshape(B, N, -1)).view(B, N, Hi, -1)  # (B, N, Hi, Di)
        per_head = torch.relu(torch.einsum("bthd,bnhd->bthn", q, k))  # (B, Tq, Hi, N)
        return (self.index_w(x)[..., None] * per_head).sum(dim=2)

    def choose(self, x: torch.Tensor, entries: torch.Tensor, ends: torch.Tensor, start: int,
               state: dict) -> Selection | None:
        """The layer's selection over its kv source's entries (B, N, KVH, D) ending at `ends` (N,), for queries
        x at positions start..: an index source scores anew (inside the candidate blocks when a candidate source
        came before it) and publishes its choice in `state`; the layers after it reuse that choice."""
        if self.index_source is None:
            return None
        if self.index_source != self.layer:
            return state["selection"]
        q_pos = torch.arange(start, start + x.shape[1])
        keys = self.index_k
        if self.parity_bug and x.shape[1] == 1 and int(ends[-1]) != start:  # no group completed at this step
            keys = state.get("indexers", {}).get(self.other_index_source(), self).index_k
        scores = self.index_scores(x, entries, keys)
        allowed = None
        if 0 <= self.candidate < self.layer:
            blocks = state["candidates"]
            allowed = allowed_entries(blocks, ends - self.window + 1, self.block_tokens)
        if self.candidate == self.layer:
            state["candidates"] = candidate_blocks(scores, ends, q_pos, self.options.candidate_block_size,
                                                   self.options.candidate_topk_blocks)
        state.setdefault("indexers", {})[self.layer] = self
        state["selection"] = Selection(scores, self.options.index_topk, allowed)
        return state["selection"]

    def other_index_source(self) -> int:
        """The index source whose keys the injected parity bug borrows: the previous one (or the next)."""
        others = [i for i in self.index_sources if i != self.layer]
        before = [i for i in others if i < self.layer]
        return before[-1] if before else (others[0] if others else self.layer)

    def training_problem(self) -> str | None:
        if self.options.index_topk:
            return ("index_topk > 0: the indexer's top-k choice gives its parameters no gradient from the "
                    "language-model loss (its distillation objective is not implemented for phasekv's own "
                    "models); train with index_topk: 0")
        return None
