"""The indexers of pooled selection (`phasekv.adapters.selection`): how a query scores the pools it may select.

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
  distilled:DIR  transformers' real `Glm5NextTextIndexer` modules, one per layer, on the layer's input hidden
                 states (the query residual is the same hidden state: a dense model has no query LoRA), trained
                 by `phasekv train-indexer` (`phasekv.train_indexer`) and saved in DIR as indexer.safetensors
                 beside indexer.json

On a moved grid (`grid=stagger|jitter`, `Geometry.origins`) oracle, mean and max pool each key into its moved pool
(the scatter path); the distilled indexer pools the hidden states over each request's moved pools with the real
module's `get_pooled_states` (jitter; `phasekv.archs.glm5_next.pool_scores`), and makes one selection for all heads
so it has no per-group grid (stagger is refused).
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


class Distilled(Indexer):
    """Trained `Glm5NextTextIndexer`s, one per layer, read from DIR (`load_distilled`)."""

    needs_hidden = True

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.config, self.modules = load_distilled(self.directory)
        self.name = f"distilled:{self.directory}"

    def pool_scores(self, *, module, logits, geometry, spec, pools, kv_heads, hidden):
        if not geometry.contiguous:
            raise ValueError("indexer=distilled: scores keys at positions 0 .. T-1 in order only (its keys are "
                             "the hidden states of the positions before each query)")
        return self._scores(module, hidden, logits.shape[-2], logits.shape[-1], geometry.origins)[..., :pools]

    def call_scores(self, *, module, hidden, query_pos, tk, pool, origins=None):
        return self._scores(module, hidden, len(query_pos), tk, origins)

    def _scores(self, module: nn.Module, hidden: torch.Tensor | None, tq: int, tk: int,
                origins: torch.Tensor | None) -> torch.Tensor:
        """(B, 1, Tq, pools) scores of the last Tq of Tk positions, whose hidden states (B, Tk, width) `hidden`
        holds (the selection's hook joins a cached context's to the new positions'), on the grid moved by the
        per-row `origins` (B | 1, 1) when given."""
        if hidden is None or hidden.shape[1] != tk:
            raise ValueError("indexer=distilled: needs the hidden states of every key position (a cache made "
                             "without them, e.g. by another condition, cannot be continued)")
        layer = getattr(module, "layer_idx", None)
        if layer is None or not 0 <= layer < len(self.modules):
            raise ValueError(f"indexer=distilled: {self.directory} has {len(self.modules)} layers; the model's "
                             f"attention layer {layer} has no indexer")
        if origins is not None and origins.shape[1] > 1:
            raise ValueError("indexer=distilled: makes one selection for all heads: no per-KV-group grid "
                             "(grid=stagger)")
        rows = None if origins is None else origins[:, 0].expand(hidden.shape[0])
        with torch.no_grad():
            return glm_pool_scores(self.modules[layer], hidden.float(), tq, rows)[:, None]


def check_indexer(name: str, pool: int) -> None:
    """One-line ValueError for an unknown indexer, or a distilled one trained for another pool size."""
    if name in ("oracle", "mean", "max"):
        return
    if not name.startswith("distilled:"):
        raise ValueError(f"kpool: indexer={name!r}: allowed {', '.join(KINDS)}")
    directory = Path(name[len("distilled:"):])
    config_path = directory / CONFIG_FILE
    if not config_path.is_file() or not (directory / WEIGHTS_FILE).is_file():
        raise ValueError(f"kpool: indexer={name}: {directory} holds no {CONFIG_FILE} and {WEIGHTS_FILE} "
                         "(train one with phasekv train-indexer)")
    trained = _read_config(config_path).get("pool")
    if trained != pool:
        raise ValueError(f"kpool: indexer={name} was trained for pool={trained}, not pool={pool}")


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
        modules = build_glm_indexers(config["hidden_size"], config["layers"], config["pool"], config["heads"],
                                     config["head_dim"])
    except KeyError as e:
        raise ValueError(f"{directory / CONFIG_FILE}: missing field {e}") from None
    state = load_file(str(directory / WEIGHTS_FILE))
    try:
        modules.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{directory / WEIGHTS_FILE}: does not match {CONFIG_FILE}: {str(e).splitlines()[0]}") \
            from None
    return config, modules.eval()
