"""The indexers of pooled selection (`phasekv.conditions.selection.pooled`): how a query scores the pools it may select.

Every indexer maps one attention call to pool scores (B, G, Tq, pools), G = 1 (one selection for all heads) or
H_kv (one per KV head group), from the call's dense logits (B, H, Tq, Tk) and, for a learned indexer, the layer's
input hidden states.  Scores of pools with no visible key are -inf.

  oracle         the dense attention probabilities of the query, summed over the pool's keys and the group's
                 heads: the pools holding the most attention mass (the ideal indexer; what pooling costs with
                 a perfect indexer)
  mean           the query against the pool's mean key, summed over the group's heads (q . mean(k) =
                 mean(q . k)): a pooled-key indexer with no training
  max            the pool's largest per-key logit, summed over the group's heads: MiniMax-M3's max-pooling of
                 per-key scores into blocks, with the model's own queries and keys as the indexer's
  distilled:DIR  trained indexer modules, one per layer, on the layer's input hidden states, saved in DIR by
                 `phasekv train-indexer` (`training.distill_indexer`) as indexer.safetensors beside indexer.json,
                 whose "kind" says which: transformers' real `Glm5NextTextIndexer` (glm5_kpool: the query
                 residual is the same hidden state, a dense model has no query LoRA; one selection for all heads)
                 or `MiniMaxM3VLIndexer` (minimax_m3_block: its per-key scores, RoPE'd at the key positions,
                 max-pooled into blocks of `pool` keys from position 0; one selection per KV group, heads=kv)

On a moved grid (`grid=stagger|jitter`, `Geometry.origins`) oracle, mean and max pool each key into its moved pool
(the scatter path); a distilled GLM-5.3 indexer pools the hidden states over each request's moved pools with the
real module's `get_pooled_states` (jitter; `phasekv.archs.glm5_next.pool_scores`) and makes one selection for all
heads, so it has no per-group grid (stagger is refused); a distilled MiniMax-M3 indexer pools from position 0 only
(both are refused).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

KINDS = ("oracle", "mean", "max", "distilled:DIR")
CONFIG_FILE, WEIGHTS_FILE = "indexer.json", "indexer.safetensors"
GLM_KIND, MINIMAX_KIND = "glm5_kpool", "minimax_m3_block"  # indexer.json's "kind" (GLM-5.3's when absent)


def pool_reduce(values: torch.Tensor, key_pool: torch.Tensor, pools: int, visible: torch.Tensor,
                how: str) -> torch.Tensor:
    """values (B, H, Tq, Tk) reduced over the visible keys of each pool -> (B, H, Tq, pools): 'sum', 'mean' or
    'max' (-inf where a pool has no visible key; 'sum' gives 0 there)."""
    shape = (*values.shape[:-1], pools)
    index = key_pool.expand_as(values)
    visible = visible.expand_as(values)
    if how == "max":
        masked = values.float().masked_fill(~visible, float("-inf"))
        return torch.full(shape, float("-inf")).scatter_reduce(-1, index, masked, "amax", include_self=True)
    total = torch.zeros(shape).scatter_add(-1, index, torch.where(visible, values.float(), 0.0))
    if how == "sum":
        return total
    count = torch.zeros(shape).scatter_add(-1, index, visible.float())
    return torch.where(count > 0, total / count.clamp(min=1), float("-inf"))


def pool_reduce_fast(values: torch.Tensor, visible: torch.Tensor | None, pool: int, pools: int,
                     how: str) -> torch.Tensor:
    """`pool_reduce` for keys at positions 0 .. Tk - 1 in order (pool j holds keys jP .. jP + P - 1): the complete
    pools by a reshape of the last dimension, the trailing partial pool apart, instead of a scatter; `visible`
    (broadcastable to values) is counted at its own, smaller, shape.  `visible` None ('sum' and 'max' only): the
    caller's values are already 0 (or -inf for 'max') wherever the query does not see the key."""
    if visible is None and how == "mean":
        raise ValueError("pool_reduce_fast: 'mean' counts the visible keys; give `visible`")
    tk = values.shape[-1]
    full = min(pools, tk // pool)  # pools wholly inside the keys
    partial = full < pools and tk > full * pool  # a trailing pool the keys fill in part
    fill = float("-inf") if how == "max" else 0.0

    def reduce(x: torch.Tensor, empty: float) -> torch.Tensor:  # (..., Tk) -> (..., pools)
        parts = [x[..., :full * pool].unflatten(-1, (full, pool))]
        parts = [parts[0].amax(-1) if how == "max" else parts[0].sum(-1)]
        if partial:
            tail = x[..., full * pool:]
            parts.append((tail.amax(-1) if how == "max" else tail.sum(-1)).unsqueeze(-1))
        parts.append(x.new_full((*x.shape[:-1], pools - full - partial), empty))  # pools with no key at all
        return torch.cat(parts, -1)

    out = reduce(values.float() if visible is None else values.float().masked_fill(~visible, fill), fill)
    if how != "mean":
        return out
    count = reduce(visible.float(), 0.0)  # at the mask's own shape
    return torch.where(count > 0, out / count.clamp(min=1), float("-inf"))


def pooled(values: torch.Tensor, geometry: Any, pool: int, pools: int, how: str) -> torch.Tensor:
    """values (B, H, Tq, Tk) reduced per pool of the call's keys: the reshape when the keys sit at 0 .. Tk - 1 on
    the grid at 0, the scatter otherwise (keys over a cache with packed queries, or a moved grid)."""
    if geometry.slices:
        return pool_reduce_fast(values, geometry.visible, pool, pools, how)
    return pool_reduce(values, geometry.key_pool(pool, values.shape[1]), pools, geometry.visible, how)


def group_heads(scores: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, H, Tq, P) -> (B, G, Tq, P): summed over all heads (G = 1) or within each of `groups` KV groups."""
    b, h, tq, p = scores.shape
    if groups == 1:
        return scores.sum(1, keepdim=True)
    return scores.view(b, groups, h // groups, tq, p).sum(2)


class Indexer:
    """A pool scorer; `needs_hidden`: it reads the layer's input hidden states (a forward pre-hook keeps them)."""

    name = ""
    needs_hidden = False

    def pool_scores(self, *, module: nn.Module, logits: torch.Tensor, geometry: Any, spec: Any, pools: int,
                    kv_heads: int, hidden: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def call_scores(self, *, module: nn.Module, hidden: torch.Tensor | None, query_pos: torch.Tensor, tk: int,
                    pool: int, origins: torch.Tensor | None = None) -> torch.Tensor | None:
        """Pool scores (B, G, Tq, pools) of a whole call at once, for an indexer that does not read the dense
        logits (the block-wise attention then slices them); None: score each block from its logits."""
        return None


def _groups(spec: Any, kv_heads: int) -> int:
    return 1 if spec.heads == "shared" else kv_heads


class Oracle(Indexer):
    name = "oracle"

    def pool_scores(self, *, module, logits, geometry, spec, pools, kv_heads, hidden):
        probs = logits.float().masked_fill(~geometry.visible, float("-inf")).softmax(-1)  # dense attention
        if geometry.slices:  # probs are 0 wherever the query does not see the key: nothing to mask again
            mass = pool_reduce_fast(probs, None, spec.pool, pools, "sum")
        else:
            mass = pooled(probs, geometry, spec.pool, pools, "sum")
        return group_heads(mass, _groups(spec, kv_heads))


class MeanKey(Indexer):
    name = "mean"

    def pool_scores(self, *, module, logits, geometry, spec, pools, kv_heads, hidden):
        return group_heads(pooled(logits, geometry, spec.pool, pools, "mean"),
                           _groups(spec, kv_heads))


class MaxKey(Indexer):
    name = "max"

    def pool_scores(self, *, module, logits, geometry, spec, pools, kv_heads, hidden):
        return group_heads(pooled(logits, geometry, spec.pool, pools, "max"),
                           _groups(spec, kv_heads))


def glm_indexer_config(hidden_size: int, pool: int, heads: int, head_dim: int) -> SimpleNamespace:
    """The fields `Glm5NextTextIndexer.__init__` reads, for a dense model's hidden size (no query LoRA: the
    query residual is the hidden state itself, q_lora_rank = hidden_size)."""
    return SimpleNamespace(hidden_size=hidden_size, index_n_heads=heads, index_head_dim=head_dim,
                           qk_rope_head_dim=0, index_topk=pool, q_lora_rank=hidden_size, index_kpool=pool,
                           index_kpool_always_select_tail=True)


def build_glm_indexers(hidden_size: int, layers: int, pool: int, heads: int, head_dim: int,
                       seed: int = 0) -> nn.ModuleList:
    """One freshly initialised transformers `Glm5NextTextIndexer` per layer."""
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

    torch.manual_seed(seed)
    config = glm_indexer_config(hidden_size, pool, heads, head_dim)
    return nn.ModuleList(Glm5NextTextIndexer(config, i) for i in range(layers))


def glm_pool_scores(indexer: nn.Module, hidden: torch.Tensor, queries: int | None = None,
                    origins: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T, hidden) -> (B, Tq, ceil(T / pool)) scores of the real module's pools (from position 0) for the last
    Tq = `queries` positions (default all T), with grad; the module leaves out a trailing incomplete pool (never a
    candidate), which comes back here as -inf.  `origins` (B,): each row's pools moved by its origin o (pool j:
    positions jP - o .. jP - o + P - 1), ceil((T + P - 1) / pool) of them."""
    from phasekv.archs.glm5_next import pool_scores

    mask = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
    scores, _, _ = pool_scores(indexer, hidden, hidden[:, hidden.shape[1] - (queries or hidden.shape[1]):], mask,
                               origins=origins)
    lead = 0 if origins is None else indexer.index_kpool - 1
    pools = -(-(hidden.shape[1] + lead) // indexer.index_kpool)
    return F.pad(scores, (0, pools - scores.shape[-1]), value=float("-inf"))


def minimax_indexer_config(hidden_size: int, pool: int, heads: int, head_dim: int, rope_theta: float) -> Any:
    """A `MiniMaxM3VLTextConfig` with the fields `MiniMaxM3VLIndexer` and its rotary embedding read: blocks of
    `pool` keys, `heads` indexer heads (one per KV group) of `head_dim`, default RoPE at the model's theta over
    the indexer's head dimension."""
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig

    return MiniMaxM3VLTextConfig(hidden_size=hidden_size, index_n_heads=heads, index_head_dim=head_dim,
                                 index_block_size=pool, index_topk_blocks=1, index_local_blocks=0, head_dim=head_dim,
                                 rope_parameters={"rope_type": "default", "rope_theta": rope_theta})


def build_minimax_indexers(hidden_size: int, layers: int, pool: int, heads: int, head_dim: int, rope_theta: float, *,
                           seed: int = 0) -> nn.ModuleList:
    """One freshly initialised transformers `MiniMaxM3VLIndexer` per layer."""
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLIndexer

    torch.manual_seed(seed)
    config = minimax_indexer_config(hidden_size, pool, heads, head_dim, rope_theta)
    return nn.ModuleList(MiniMaxM3VLIndexer(config, i) for i in range(layers))


def minimax_pool_scores(indexer: nn.Module, hidden: torch.Tensor, queries: int | None = None) -> torch.Tensor:
    """(B, T, hidden) -> (B, H, Tq, ceil(T / block)) the real module's block scores (`minimax_m3.block_scores`:
    per-key scores max-pooled into blocks from position 0, -inf where a block has no causal key) for the last
    Tq = `queries` positions, with grad; RoPE from the module's config at positions 0 .. T-1."""
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLRotaryEmbedding

    from phasekv.archs.minimax_m3 import block_scores

    b, t, _ = hidden.shape
    position_ids = torch.arange(t, device=hidden.device)[None].expand(b, -1)
    cos_sin = MiniMaxM3VLRotaryEmbedding(indexer.config)(hidden, position_ids)
    return block_scores(indexer, hidden, cos_sin, position_ids, queries)


def indexer_pool_scores(indexer: nn.Module, hidden: torch.Tensor, queries: int | None = None,
                        origins: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T, hidden) -> (B, G, Tq, pools) pool scores of either kind's module, with grad: G = 1 for GLM-5.3's
    (its heads weighted into one score), G = its heads (one per KV group) for MiniMax-M3's.  `origins` (B,): each
    row's pools moved (`glm_pool_scores`); MiniMax-M3's blocks start at position 0 only."""
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLIndexer

    if isinstance(indexer, MiniMaxM3VLIndexer):
        if origins is not None:
            raise ValueError("indexer=distilled: a MiniMax-M3 indexer max-pools its blocks from position 0: no moved "
                             "grid (use grid=fixed)")
        return minimax_pool_scores(indexer, hidden, queries)
    return glm_pool_scores(indexer, hidden, queries, origins)[:, None]


def build_indexers(config: dict[str, Any], seed: int = 0) -> nn.ModuleList:
    """The freshly initialised per-layer modules an indexer config describes (its "kind", fields)."""
    kind = config.get("kind", GLM_KIND)
    shape = (config["hidden_size"], config["layers"], config["pool"], config["heads"], config["head_dim"])
    if kind == GLM_KIND:
        return build_glm_indexers(*shape, seed=seed)
    if kind == MINIMAX_KIND:
        return build_minimax_indexers(*shape, config["rope_theta"], seed=seed)
    raise ValueError(f"indexer kind {kind!r}: allowed {GLM_KIND}, {MINIMAX_KIND}")


class Distilled(Indexer):
    """Trained indexer modules of either kind, one per layer, read from DIR (`load_distilled`)."""

    needs_hidden = True

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.config, self.modules = load_distilled(self.directory)
        self.name = f"distilled:{self.directory}"

    def pool_scores(self, *, module, logits, geometry, spec, pools, kv_heads, hidden):
        if not geometry.contiguous:
            raise ValueError("indexer=distilled: scores keys at positions 0 .. T-1 in order only (its keys are "
                             "the hidden states of the positions before each query)")
        scores = self._scores(module, hidden, logits.shape[-2], logits.shape[-1], geometry.origins)[..., :pools]
        if scores.shape[1] not in (1, kv_heads):
            raise ValueError(f"indexer=distilled: {self.directory} has {scores.shape[1]} selection groups; the "
                             f"model has {kv_heads} KV heads")
        return scores

    def call_scores(self, *, module, hidden, query_pos, tk, pool, origins=None):
        return self._scores(module, hidden, len(query_pos), tk, origins)

    def _scores(self, module: nn.Module, hidden: torch.Tensor | None, tq: int, tk: int,
                origins: torch.Tensor | None) -> torch.Tensor:
        """(B, G, Tq, pools) scores of the last Tq of Tk positions, whose hidden states (B, Tk, width) `hidden`
        holds (the selection's hook joins a cached context's to the new positions'), on the grid moved by the
        per-row `origins` (B | 1, 1) when given (GLM-5.3 kind only)."""
        if hidden is None or hidden.shape[1] != tk:
            raise ValueError("indexer=distilled: needs the hidden states of every key position (a cache made "
                             "without them, e.g. by another condition, cannot be continued)")
        layer = getattr(module, "layer_idx", None)
        if layer is None or not 0 <= layer < len(self.modules):
            raise ValueError(f"indexer=distilled: {self.directory} has {len(self.modules)} layers; the model's "
                             f"attention layer {layer} has no indexer")
        if origins is not None and origins.shape[1] > 1:
            raise ValueError("indexer=distilled: no per-KV-group grid (grid=stagger) for a distilled indexer")
        rows = None if origins is None else origins[:, 0].expand(hidden.shape[0])
        with torch.no_grad():
            return indexer_pool_scores(self.modules[layer], hidden.float(), tq, rows)


def check_indexer(name: str, pool: int, heads: str = "shared", grid: str = "fixed") -> None:
    """One-line ValueError for an unknown indexer, or a distilled one trained for another pool size, or a
    MiniMax-M3 one (a selection per KV group, blocks from position 0) asked for one selection shared by all heads
    or for a moved grid."""
    if name in ("oracle", "mean", "max"):
        return
    if not name.startswith("distilled:"):
        raise ValueError(f"kpool: indexer={name!r}: allowed {', '.join(KINDS)}")
    directory = Path(name[len("distilled:"):])
    config_path = directory / CONFIG_FILE
    if not config_path.is_file() or not (directory / WEIGHTS_FILE).is_file():
        raise ValueError(f"kpool: indexer={name}: {directory} holds no {CONFIG_FILE} and {WEIGHTS_FILE} "
                         "(train one with phasekv train-indexer)")
    config = _read_config(config_path)
    if config.get("pool") != pool:
        raise ValueError(f"kpool: indexer={name} was trained for pool={config.get('pool')}, not pool={pool}")
    if config.get("kind") == MINIMAX_KIND and heads != "kv":
        raise ValueError(f"kpool: indexer={name} is a MiniMax-M3 indexer (one selection per KV group): it needs "
                         f"heads=kv, not heads={heads}")
    if config.get("kind") == MINIMAX_KIND and grid != "fixed":
        raise ValueError(f"kpool: indexer={name} is a MiniMax-M3 indexer, whose blocks start at position 0: "
                         f"grid={grid} is not supported (use grid=fixed)")


def make_indexer(name: str) -> Indexer:
    simple = {"oracle": Oracle, "mean": MeanKey, "max": MaxKey}
    return simple[name]() if name in simple else Distilled(name[len("distilled:"):])


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable indexer config ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a readable indexer config (a JSON object expected)")
    return config


def load_distilled(directory: Path) -> tuple[dict[str, Any], nn.ModuleList]:
    """(config, the per-layer indexers) of a trained indexer directory, weights checked strictly."""
    from safetensors.torch import load_file

    config = _read_config(directory / CONFIG_FILE)
    try:
        modules = build_indexers(config)
    except KeyError as e:
        raise ValueError(f"{directory / CONFIG_FILE}: missing field {e}") from None
    state = load_file(str(directory / WEIGHTS_FILE))
    try:
        modules.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{directory / WEIGHTS_FILE}: does not match {CONFIG_FILE}: {str(e).splitlines()[0]}") \
            from None
    return config, modules.eval()
