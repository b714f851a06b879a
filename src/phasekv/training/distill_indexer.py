"""`phasekv train-indexer`: a GLM-5.3 k-pool or MiniMax-M3 block indexer retrofitted onto a frozen dense LM by
distillation.

DeepSeek-V3.2 and GLM added their sparse-attention indexers to dense checkpoints and warmed them up against the
dense attention before training on (DeepSeek-V3.2, arXiv 2512.02556, section 2.1: the dense warm-up, with the main
model frozen).  This module does the warm-up for transformers' real `Glm5NextTextIndexer` (kind glm5: one selection
for all heads) or `MiniMaxM3VLIndexer` (kind minimax: one indexer head and one selection per KV group, its per-key
scores max-pooled into blocks of `pool` keys from position 0), one per layer of a dense model
(phasekv.conditions.selection.scorers), with the model frozen:

  1. corpus: disjoint windows of the Python documentation's prose (`pydoc_data.topics`, part of every Python), so
     the training text is generic, none of the audit's prompt formats, and nothing to download;
  2. features: one dense forward per sequence keeps each layer's input hidden states and its attention mass per
     pool of `pool` tokens (all heads summed for glm5, each KV group's query heads for minimax), the target p_t;
  3. training: the sum over layers (and groups) of mean_t KL(p_t || softmax(I_t)) over the pools selection
     chooses among (complete, not in the local tail or the sink; `training.indexer_kl.kl_to_attention`), AdamW, on
     the cached features (the model never runs again);
  4. held-out: the KL (per layer and group) and the top-K recall of the oracle's pools (K at a quarter of each
     context) on sequences never trained on, before and after training.

The run directory holds indexer.safetensors and indexer.json (the config, the curve, the held-out numbers before
and after, the cost); it is published whole when training ends, and only when every loss and weight is finite (a
NaN or inf stops the run in one line naming the step).  The frozen model's features are kept in the work directory
as they are computed (features.safetensors), so a killed run resumes without redoing them; they carry the key of
what they depend on (`features_key`: the model and its weights' fingerprint, the corpus seed and sizes, the pool),
and a run of another key refuses them in one line instead of training on another run's features.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from phasekv.archs.base import text_config
from phasekv.archs.indexer_kl import kl_to_attention
from phasekv.conditions.selection.kernel import candidate_pools, select_pools
from phasekv.conditions.selection.pooled import SelectionSpec
from phasekv.conditions.selection.scorers import (
    CONFIG_FILE,
    GLM_KIND,
    MINIMAX_KIND,
    WEIGHTS_FILE,
    build_indexers,
    indexer_pool_scores,
)
from phasekv.outputs import write_json

log = logging.getLogger(__name__)
FEATURES_FILE = "features.safetensors"  # the frozen model's hidden states and attention mass, kept for a resume
KINDS = {"glm5": GLM_KIND, "minimax": MINIMAX_KIND}  # --kind -> indexer.json's kind

LIMITS = {"pool": 4096, "heads": 1024, "head_dim": 4096, "length": 1 << 20, "batch": 4096, "steps": 10_000_000}


@dataclass(frozen=True)
class IndexerTraining:
    kind: str = "glm5"  # a key of KINDS
    pool: int = 4
    heads: int = 4
    head_dim: int = 32
    sequences: int = 96  # training sequences (the corpus holds `held_out` more)
    held_out: int = 16
    length: int = 384  # tokens per sequence
    steps: int = 1200
    batch: int = 4
    lr: float = 1e-3
    seed: int = 0
    recall_budget: float = 0.25  # K for held-out recall: this share of each query's context, in pools
    local: int = 16
    sink: int = 1

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"train-indexer: kind {self.kind!r}: allowed {', '.join(KINDS)}")
        for name in ("pool", "heads", "head_dim", "sequences", "held_out", "length", "steps", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"train-indexer: {name} must be >= 1, got {getattr(self, name)}")
        if not (isinstance(self.lr, int | float) and 0 < self.lr < math.inf):
            raise ValueError(f"train-indexer: lr must be a finite number > 0, got {self.lr}")
        for name, limit in LIMITS.items():  # before anything is allocated: a typo must not ask for 400 GB
            if getattr(self, name) > limit:
                raise ValueError(f"train-indexer: {name} must be <= {limit}, got {getattr(self, name)}")
        if self.heads * self.head_dim > 65536:
            raise ValueError(f"train-indexer: heads x head_dim must be <= 65536 (GLM-5.3's indexer has 32 x 128), "
                             f"got {self.heads} x {self.head_dim}")
        if not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"train-indexer: seed must be an integer in [0, 2^63), got {self.seed}")
        if self.length < 4 * self.pool:
            raise ValueError(f"train-indexer: length {self.length} must hold at least 4 pools of {self.pool}")


# ----------------------------------------------------------------------------- 1. corpus


def corpus(tokenizer, n: int, length: int, seed: int) -> list[list[int]]:
    """n disjoint windows of `length` tokens of the Python documentation's prose (the standard library's
    `pydoc_data.topics`, on every Python: generic English text, none of it in the audit's prompt formats),
    chosen at random (seeded) among all windows."""
    import pydoc_data.topics

    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    windows = [ids[i:i + length] for i in range(0, len(ids) - length + 1, length)]
    if len(windows) < n:
        raise ValueError(f"train-indexer: the corpus holds {len(windows)} windows of {length} tokens, fewer than the "
                         f"{n} asked for (lower --sequences, --held-out or --length)")
    return random.Random(seed).sample(windows, n)


# ----------------------------------------------------------------------------- 2. features


@torch.no_grad()
def features(model, sequences: list[list[int]], pool: int, progress: bool = True,
             groups: int = 1) -> list[dict[str, torch.Tensor]]:
    """Per sequence: 'hidden' (L, T, hidden) float16, each layer's attention input; 'mass' (L, G, T, pools)
    float16, each query's dense attention mass per pool, summed over all heads (G = groups = 1) or over each KV
    group's query heads (G = groups = the model's KV heads)."""
    from phasekv.conditions.selection.pooled import attention_modules
    from phasekv.conditions.selection.scorers import group_heads, pool_reduce

    modules = attention_modules(model)
    kept: dict[int, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(
        lambda mod, args, kwargs, i=i: kept.__setitem__(i, kwargs.get("hidden_states", args[0] if args else None)),
        with_kwargs=True) for i, m in enumerate(modules)]
    implementation = model.config._attn_implementation
    model.config._attn_implementation = "eager"  # the attention probabilities are returned only by eager
    out = []
    try:
        for seq in tqdm(sequences, desc="features", unit="seq", disable=not progress):
            ids = torch.tensor([seq])
            attentions = model(input_ids=ids, output_attentions=True, use_cache=False).attentions
            t = ids.shape[1]
            key_pool = torch.arange(t) // pool
            visible = torch.ones(1, 1, t, t, dtype=torch.bool).tril()
            mass = [group_heads(pool_reduce(a.float(), key_pool, (t - 1) // pool + 1, visible, "sum"), groups)[0]
                    for a in attentions]  # (G, T, pools) per layer
            out.append({"hidden": torch.stack([kept[i][0] for i in range(len(modules))]).half(),
                        "mass": torch.stack(mass).half()})
    finally:
        model.config._attn_implementation = implementation
        for h in hooks:
            h.remove()
    return out


def weights_fingerprint(model) -> str:
    """A cheap identity of `model`'s weights: every parameter's name, shape, dtype and a sample of its values."""
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        flat = p.detach().reshape(-1)
        sample = torch.cat([flat[:8], flat[-8:], flat[::max(1, flat.numel() // 64)][:64]]).float().cpu()
        digest.update(f"{name}{tuple(p.shape)}{p.dtype}".encode())
        digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:32]


def features_key(model, model_name: str, cfg: IndexerTraining, groups: int) -> dict[str, Any]:
    """What the cached features depend on: a resume with any of it changed must not reuse them."""
    return {"model": model_name, "weights": weights_fingerprint(model), "seed": cfg.seed, "sequences": cfg.sequences,
            "held_out": cfg.held_out, "length": cfg.length, "pool": cfg.pool, "groups": groups}


def _stored_features(path: Path, key: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The features an interrupted run kept in `path`, refused in one line when they are of another `key` (another
    model, seed, corpus or pool) or not a readable features file."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not path.is_file():
        return {}
    try:
        with safe_open(str(path), "pt") as f:
            stored = json.loads((f.metadata() or {}).get("key", "null"))
        done = load_file(str(path))
    except Exception as exc:  # safetensors raises its own error type for a torn or foreign file
        raise ValueError(f"train-indexer: {path}: not a readable features file of an interrupted run "
                         f"({' '.join(str(exc).split())[:120]}); --force starts over") from None
    if stored != key:
        stored = stored if isinstance(stored, dict) else {}
        diff = sorted(k for k in key if stored.get(k) != key[k])
        then = ", ".join(f"{k}={stored.get(k)}" for k in diff)
        raise ValueError(f"train-indexer: {path} holds the features of an interrupted run of another "
                         f"{', '.join(diff) or 'version'} ({then}; this run: {', '.join(f'{k}={key[k]}' for k in diff)}"
                         "); rerun with its settings or --force to start over")
    return done


def cached_features(model, sequences: list[list[int]], pool: int, path: Path, progress: bool = True,
                    groups: int = 1, *, key: dict[str, Any] | None = None) -> list[dict[str, torch.Tensor]]:
    """`features`, kept in `path` (safetensors) in batches of 8 sequences as they are computed, so a killed run
    resumes with the sequences it had done (the slow part: one dense forward each); `key` (`features_key`) is stored
    with them and must match on resume."""
    from safetensors.torch import save_file

    key = key or {}
    done = _stored_features(path, key)
    out = [{"hidden": done[f"{i}.hidden"], "mass": done[f"{i}.mass"]} for i in range(len(sequences))
           if f"{i}.hidden" in done]
    if out and (out[0]["mass"].ndim != 4 or out[0]["mass"].shape[1] != groups):
        raise ValueError(f"train-indexer: {path} holds attention mass of another shape than {groups} group(s) "
                         f"({tuple(out[0]['mass'].shape)}); delete it to recompute the features")
    for start in range(len(out), len(sequences), 8):
        out += features(model, sequences[start:start + 8], pool, progress, groups)
        flat = {f"{i}.{k}": v.contiguous() for i, f in enumerate(out) for k, v in f.items()}
        tmp = path.with_name(path.name + ".tmp")  # inside the run's work directory
        save_file(flat, str(tmp), metadata={"key": json.dumps(key, sort_keys=True)})
        tmp.replace(path)
    return out


# ----------------------------------------------------------------------------- 3. training and 4. held-out


def distillation_loss(indexers, batch: list[dict[str, torch.Tensor]], cfg: IndexerTraining) -> torch.Tensor:
    """Sum over layers and selection groups of the mean KL of the batch's queries over the pools selection chooses
    among: complete, not wholly in the local tail or the sink (`candidate_pools` of `cfg`'s selection).  The local
    tail and the sink are attended anyway; left in, they hold a quarter of a query's dense mass on the prose
    (SmolLM2) and the KL spent itself on ranking them instead of the pools selection must choose."""
    hidden = torch.stack([f["hidden"] for f in batch]).float()  # (B, L, T, hidden)
    mass = torch.stack([f["mass"] for f in batch]).float()  # (B, L, G, T, pools)
    t = hidden.shape[2]
    candidates = candidate_pools(_selection(cfg), _plain_geometry(t), mass.shape[-1])  # (T, pools)
    total = hidden.new_zeros(())
    for layer, indexer in enumerate(indexers):
        scores = indexer_pool_scores(indexer, hidden[:, layer])  # (B, G, T, pools)
        for g in range(scores.shape[1]):
            total = total + kl_to_attention(scores[:, g], candidates.expand_as(scores[:, g]), mass[:, layer, g])
    return total


def _selection(cfg: IndexerTraining) -> SelectionSpec:
    """The selection the indexer is trained for and measured under (K at cfg.recall_budget)."""
    return SelectionSpec(pool=cfg.pool, budget=cfg.recall_budget, local=max(cfg.local, cfg.pool), sink=cfg.sink)


@torch.no_grad()
def held_out(indexers, feats: list[dict[str, torch.Tensor]], cfg: IndexerTraining) -> dict[str, float]:
    """KL and top-K recall of the oracle's selection (K at cfg.recall_budget), averaged over layers, selection
    groups and queries that have more candidates than K (where selection chooses)."""
    spec = _selection(cfg)
    per = len(feats) * len(indexers) * feats[0]["mass"].shape[1]  # sequences x layers x groups
    kl = float(sum(distillation_loss(indexers, [f], cfg) for f in feats)) / per
    hits = total = 0.0
    for f in feats:
        t = f["hidden"].shape[1]
        geometry = _plain_geometry(t)
        pools = (t - 1) // cfg.pool + 1
        candidates = candidate_pools(spec, geometry, pools)  # (T, pools)
        k = spec.pools_per_query(geometry.query_pos)
        chooses = candidates.sum(-1) > k  # (T,)
        for layer, indexer in enumerate(indexers):
            scores = indexer_pool_scores(indexer, f["hidden"][layer][None].float())  # (1, G, T, pools)
            mine = select_pools(spec, scores, candidates, geometry.query_pos)[0]  # (G, T, pools)
            truth = select_pools(spec, f["mass"][layer][None].float(), candidates, geometry.query_pos)[0]
            hits += float((mine & truth)[:, chooses].sum())
            total += float(truth[:, chooses].sum())
    return {"kl_per_layer": kl, "recall_at_budget": hits / total if total else float("nan")}


def _plain_geometry(t: int):
    from phasekv.conditions.selection.kernel import Geometry

    pos = torch.arange(t)
    return Geometry(pos, pos, (pos[None, :] <= pos[:, None])[None, None])


def fit(indexers, train: list[dict[str, torch.Tensor]], cfg: IndexerTraining, progress: bool = True) -> list[dict]:
    """AdamW on the distillation loss over `train` features (warm-up 50 steps, cosine to 0); the curve."""
    optimizer = torch.optim.AdamW(indexers.parameters(), lr=cfg.lr, weight_decay=0.0)
    warm = min(50, max(1, cfg.steps // 10))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / cfg.steps)))
    rng = random.Random(cfg.seed)
    per = len(indexers) * train[0]["mass"].shape[1]  # layers x groups
    curve = []
    for step in tqdm(range(cfg.steps), desc="train-indexer", unit="step", disable=not progress):
        loss = distillation_loss(indexers, rng.sample(train, min(cfg.batch, len(train))), cfg)
        if not torch.isfinite(loss):
            raise ValueError(f"train-indexer: step {step}: the loss is {loss.item()} (not finite); nothing is "
                             f"published (a smaller --lr than {cfg.lr} may train)")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 25 == 0 or step == cfg.steps - 1:
            curve.append({"step": step, "kl_per_layer": loss.item() / per})
    return curve


def train_indexer(model, tokenizer, out: Path, cfg: IndexerTraining, *, model_name: str,
                  progress: bool = True) -> dict[str, Any]:
    """Run the four stages into `out` (a temporary directory the caller publishes); the config written there."""
    started = time.perf_counter()
    model.eval().requires_grad_(False)
    text = text_config(model.config)
    shape = {"kind": KINDS[cfg.kind], "pool": cfg.pool, "heads": cfg.heads, "head_dim": cfg.head_dim,
             "hidden_size": text.hidden_size, "layers": text.num_hidden_layers}
    groups = 1
    if cfg.kind == "minimax":
        groups = text.num_key_value_heads
        if cfg.heads != groups:
            raise ValueError(f"train-indexer: kind minimax has one indexer head per KV group: heads must be "
                             f"{groups}, got {cfg.heads}")
        shape["rope_theta"] = rope_theta(text)
    sequences = corpus(tokenizer, cfg.sequences + cfg.held_out, cfg.length, cfg.seed)
    feats = cached_features(model, sequences, cfg.pool, out / FEATURES_FILE, progress, groups,
                            key=features_key(model, model_name, cfg, groups))
    features_s = time.perf_counter() - started
    train, test = feats[:cfg.sequences], feats[cfg.sequences:]
    indexers = build_indexers(shape, seed=cfg.seed)
    before = held_out(indexers, test, cfg)
    curve = fit(indexers, train, cfg, progress)
    after = held_out(indexers, test, cfg)
    check_finite(indexers, after)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in indexers.state_dict().items()}, str(out / WEIGHTS_FILE))
    config = {**shape, "model": model_name,
              "training": asdict(cfg), "corpus": "Python documentation prose (pydoc_data.topics), disjoint windows",
              "held_out_before": before, "held_out_after": after, "curve": curve,
              "elapsed_s": {"features": round(features_s, 1), "total": round(time.perf_counter() - started, 1)},
              "threads": torch.get_num_threads()}
    write_json(out / CONFIG_FILE, config, atomic=True)
    return config


def check_finite(indexers, after: dict[str, float]) -> None:
    """Refuse, in one line, trained weights or a held-out KL that are not all finite: nothing is published."""
    for name, p in indexers.named_parameters():
        bad = int((~torch.isfinite(p)).sum())
        if bad:
            raise ValueError(f"train-indexer: {bad} of {p.numel()} values of the trained weight {name} are not "
                             "finite (NaN or inf); nothing is published")
    if not math.isfinite(after["kl_per_layer"]):
        raise ValueError(f"train-indexer: the held-out KL after training is {after['kl_per_layer']}; nothing is "
                         "published")


def rope_theta(text: Any) -> float:
    """The model's default-RoPE theta, which a MiniMax-M3 indexer rotates its queries and keys with."""
    rope = getattr(text, "rope_parameters", None) or {"rope_theta": getattr(text, "rope_theta", None)}
    if rope.get("rope_type", "default") != "default" or rope.get("rope_theta") is None:
        raise ValueError(f"train-indexer: kind minimax needs the model's default RoPE, got {rope}")
    return float(rope["rope_theta"])
