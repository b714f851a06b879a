"""Query-dependent pooled selection retrofitted onto a transformers model: GLM-5.3's k-pool and MiniMax-M3's
block selection as an audit condition (docs/science.md, "pooled selection").

Condition grammar (one string): `kpool:pool=P,top=K[,budget=F][,local=L][,sink=N][,heads=shared|kv]
[,indexer=NAME][,grid=fixed|stagger|jitter][,seed=S]`.  Keys are cut into pools of P consecutive positions
starting at position 0 (pool j holds positions jP .. jP + P - 1, the grid of GLM-5.3's `get_pooled_states` and
MiniMax-M3's key blocks).  In every layer, each query at position t attends exactly to

  - the keys of the K pools its indexer scores highest among the candidate pools: pools that are complete
    (their last position <= t) and not wholly inside the local tail or the sink;
  - the local tail: keys at positions t - L + 1 .. t (it holds the current incomplete pool, which both models
    always attend; L >= P is required so a pool is either a candidate or local);
  - the sink: keys at positions 0 .. N - 1 (the first tokens every real model attends).

`budget=F` replaces the fixed K by K(t) = max(1, round(F * (t + 1) / P)): a fraction F of each query's
context is attended through selection.  `heads=shared` makes one selection per query for all heads (GLM-5.3's
indexer sums its heads into one score), `heads=kv` one per KV head group (MiniMax-M3).  Phase = position mod P.

`grid` moves the pools (the training-free fixes of docs/notes/fixes.md, "Pooled selection: moved pool grids"): `fixed`
is the grid above; `stagger` gives KV group g of G the origin o_g = round(g P / G) (`heads=kv` only), `jitter`
every request one origin o in [0, P), drawn from `seed` and the request's tokens (its context, which its queries
continue; a whole prompt when there is no split), the same in every layer.  With origin o pool j holds positions
jP - o .. jP - o + P - 1: pool 0 is the partial 0 .. P - 1 - o, a pool like any other; candidates are complete on
the moved grid (last position <= t) and not wholly in the tail or the sink, and K(t) is unchanged, so the budget
is too.  The audit's phase stays position mod P of the fixed grid: what a fix has to flatten.

Indexers (`selection.scorers`): `oracle` (the pools holding the most dense attention mass of that query:
the ideal indexer), `mean` (the query against the pool's mean key: a pooled-key indexer), `max` (the pool's
largest per-key score: MiniMax-M3's max-pooling), `distilled:DIR` (transformers' real `Glm5NextTextIndexer`
modules on the model's hidden states, trained by `phasekv train-indexer`).

Implementation: an attention function registered in transformers' `AttentionInterface` (`selecting` installs it
on the model and restores the previous implementation on exit) scores the keys, asks the indexer for pool scores
and runs softmax attention over the allowed keys (`selection_mask`); the tensor side is
`phasekv.conditions.selection.kernel` (block-wise over the queries when the keys sit at 0 .. Tk - 1, at once
otherwise, and the slow per-query reference).  Key positions come from the call: the cached keys occupy
0 .. Tk - Tq - 1 and the new keys sit at the queries' `position_ids`, so a plain forward, a shared-prefix prefill
and packed queries over a cache are all covered.  tests/test_selection.py compares the paths with the reference
and checks that no query ever selects from its future.

Hybrid models: only the full-attention layers select; sliding-window and chunked layers run the model's own
attention (`conditions.hybrid`), and GPT-OSS's learned sinks enter the selected softmax.

Layout: attention tensors are (B, H, T, D) as in transformers; pool scores are (B, G, Tq, pools) with G = 1
(shared) or H_kv (kv).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from phasekv.adapters.base import Wrapped, spec_fields, whole_number
from phasekv.conditions.hybrid import attend_left, is_left, release, sink_logits, split_modules
from phasekv.conditions.selection.kernel import (
    Geometry,
    call_geometry,
    candidate_pools,
    chunked_attention,
    grid_origins,
    in_order,
    positions,
    whole_attention,
)

ATTENTION_NAME = "phasekv_selection"
HEAD_MODES = ("shared", "kv")
GRIDS = ("fixed", "stagger", "jitter")


@dataclass(frozen=True)
class SelectionSpec:
    """One selection condition (the module docstring's grammar)."""

    pool: int
    top: int = 0  # pools selected per query (0: set by `budget`)
    budget: float = 0.0  # fraction of each query's context attended through selection (0: fixed `top`)
    local: int = 16
    sink: int = 1
    heads: str = "shared"
    indexer: str = "oracle"
    grid: str = "fixed"
    seed: int = 0  # grid=jitter: the draws' seed

    def __post_init__(self) -> None:
        if self.pool < 1:
            raise ValueError(f"kpool: pool={self.pool}: must be >= 1 (1 = token-level selection)")
        if (self.top > 0) == (self.budget > 0):
            raise ValueError("kpool: give exactly one of top=K (pools per query, >= 1) or budget=F (0 < F < 1)")
        if self.top < 0 or not 0 <= self.budget < 1:
            raise ValueError(f"kpool: top={self.top}, budget={self.budget}: top >= 1 or 0 < budget < 1")
        if self.local < self.pool:
            raise ValueError(f"kpool: local={self.local} < pool={self.pool}: the local tail must hold the current "
                             "incomplete pool (local >= pool)")
        if self.sink < 0:
            raise ValueError(f"kpool: sink={self.sink}: must be >= 0")
        if self.heads not in HEAD_MODES:
            raise ValueError(f"kpool: heads={self.heads!r}: allowed {', '.join(HEAD_MODES)}")
        if self.grid not in GRIDS:
            raise ValueError(f"kpool: grid={self.grid!r}: allowed {', '.join(GRIDS)}")
        if self.grid == "stagger" and (self.heads != "kv" or self.indexer.startswith("distilled:")):
            raise ValueError("kpool: grid=stagger moves each KV group's pools: needs heads=kv and an indexer that "
                             "scores per group (oracle, mean, max)")
        from phasekv.conditions.selection.scorers import check_indexer

        check_indexer(self.indexer, self.pool, self.heads, self.grid)

    @property
    def name(self) -> str:
        size = f"top={self.top}" if self.top else f"budget={self.budget:g}"
        grid = "" if self.grid == "fixed" else f",grid={self.grid}" + (f",seed={self.seed}" if self.seed else "")
        return (f"kpool:pool={self.pool},{size},local={self.local},sink={self.sink},heads={self.heads},"
                f"indexer={self.indexer}{grid}")

    def offsets(self, ids: torch.Tensor) -> torch.Tensor | None:
        """grid=jitter: each request's origin (B,) from `seed` and its tokens ids (B, T); None for other grids."""
        if self.grid != "jitter":
            return None
        draws = [hashlib.blake2b(row.numpy().astype("<i8").tobytes(), digest_size=8, key=str(self.seed).encode())
                 for row in ids.cpu()]
        return torch.tensor([int.from_bytes(h.digest(), "little") % self.pool for h in draws])

    def pools_per_query(self, positions: torch.Tensor) -> torch.Tensor:
        """K for queries at `positions` (Tq,): the fixed top, or the budget's share of each context."""
        if self.top:
            return torch.full_like(positions, self.top)
        return ((self.budget * (positions + 1).double() / self.pool).round().long()).clamp(min=1)


_KEYS = ("pool", "top", "budget", "local", "sink", "heads", "indexer", "grid", "seed")


def parse_selection(text: str) -> SelectionSpec:
    """'kpool:pool=4,top=8,indexer=oracle' -> SelectionSpec; one-line ValueError for anything else."""
    head, _, body = text.partition(":")
    if head != "kpool" or not body:
        raise ValueError(f"selection {text!r}: expected kpool:pool=P,top=K[,budget=F][,local=L][,sink=N]"
                         "[,heads=shared|kv][,indexer=oracle|mean|max|distilled:DIR][,grid=fixed|stagger|jitter]")
    fields: dict[str, Any] = {}
    for key, value in spec_fields(text, body.split(","), what="selection", keys=_KEYS).items():
        if key in ("heads", "indexer", "grid"):
            fields[key] = value
        elif key == "budget":
            try:
                fields[key] = float(value)
            except ValueError:
                raise ValueError(f"selection {text!r}: {key}={value!r} is not a number") from None
        else:
            fields[key] = whole_number(value, f"selection {text!r}: {key}")
    if "pool" not in fields:
        raise ValueError(f"selection {text!r}: pool=P is required")
    return SelectionSpec(**fields)


def is_selection(condition: str) -> bool:
    return condition.startswith("kpool:")


@dataclass
class SelectionState:
    """What the installed attention function needs per call, and what it recorded."""

    spec: SelectionSpec
    indexer: Any  # phasekv.conditions.selection.scorers.Indexer
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # id(attention module) -> its input hidden states
    context: dict[int, torch.Tensor] = field(default_factory=dict)  # id(module) -> a cached context's hidden states
    record: bool = False  # keep each layer's selection at the last query position (selection statistics)
    offsets: torch.Tensor | None = None  # grid=jitter: each row's origin (B,) (`SelectionSpec.offsets`)
    prefilling: bool = False  # a prefill, maybe in chunks: each forward's hidden states join the earlier ones'
    recorded: list[dict[str, torch.Tensor]] = field(default_factory=list)


_ACTIVE: dict[int, SelectionState] = {}  # id(attention module) -> the selection it runs under


def selection_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, *, scaling: float | None = None, dropout: float = 0.0,
                        **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' attention-function signature: (B, H, Tq, D) queries over (B, H_kv, Tk, D) keys and values
    -> ((B, Tq, H, D) output, None: the probabilities are never materialised) under the module's selection."""
    if is_left(module):  # a sliding-window or chunked layer of a hybrid model runs as the model runs it
        return attend_left(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    state = _ACTIVE[id(module)]
    sinks = sink_logits(kwargs, query.shape[1])
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    # a continuation's joined hidden states are used once: let them go (a prefill keeps its own for the cache)
    hidden = state.hidden.pop(id(module), None) if state.context else state.hidden.get(id(module))
    record = state.recorded if state.record else None
    query_pos, key_pos = positions(query, key, kwargs.get("position_ids"))
    origins = grid_origins(state.spec, state.offsets, key.shape[1])
    if origins is not None:
        origins = origins.to(query.device)
    if in_order(key_pos):
        out = chunked_attention(state.spec, state.indexer, module, query, key, value, attention_mask=attention_mask,
                                query_pos=query_pos, scaling=scaling, hidden=hidden, record=record, origins=origins,
                                sinks=sinks)
    else:
        geometry = call_geometry(query, key, attention_mask, kwargs.get("position_ids"))
        out = whole_attention(state.spec, state.indexer, module, query, key, value, scaling=scaling, hidden=hidden,
                              geometry=replace(geometry, origins=origins), record=record, sinks=sinks)
    return out.transpose(1, 2).contiguous(), None


# ----------------------------------------------------------------------------- installing it on a model


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask

    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, selection_attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, eager_mask)


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """Every decoder layer's `self_attn` of a transformers causal LM."""
    found = [m.self_attn for m in model.modules() if hasattr(m, "self_attn") and hasattr(m.self_attn, "o_proj")]
    if not found:
        raise ValueError(f"{type(model).__name__}: no decoder layer with self_attn.o_proj to select under")
    return found


@contextlib.contextmanager
def selecting(model: nn.Module, spec: SelectionSpec, indexer: Any, record: bool = False,
              offsets: torch.Tensor | None = None) -> Iterator[SelectionState]:
    """While active, every full-attention layer of `model` runs under `spec` with `indexer` (and, for grid=jitter, the
    rows' origins `offsets` (B,)); the model's attention implementation, and every hook added here, are restored
    on exit, whatever happens."""
    _register()
    state = SelectionState(spec, indexer, record=record, offsets=offsets)
    configs = {id(c): (c, c._attn_implementation) for c in attention_configs(model)}
    every = attention_modules(model)
    handles, modules = [], split_modules(model, every, next(iter(configs.values()))[1])  # full layers only
    try:
        for module in modules:
            _ACTIVE[id(module)] = state
            if indexer.needs_hidden:
                handles.append(module.register_forward_pre_hook(_keep_hidden(state), with_kwargs=True))
        for config, _ in configs.values():
            config._attn_implementation = ATTENTION_NAME
        yield state
    finally:
        for handle in handles:
            handle.remove()
        release(every)
        for module in modules:
            _ACTIVE.pop(id(module), None)
        for config, implementation in configs.values():
            config._attn_implementation = implementation


def attention_configs(model: nn.Module) -> list[Any]:
    """The model's config objects that carry the attention implementation (the model's, its text config's)."""
    seen, out = set(), []
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation") and id(config) not in seen:
            seen.add(id(config))
            out.append(config)
    return out


def _keep_hidden(state: SelectionState):
    """A forward pre-hook keeping the layer's input hidden states, after those of the cached context it continues
    (`state.context`) or, in a chunked prefill, of the chunks before, so that the indexer sees every key
    position's."""
    def hook(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        context = state.hidden.get(id(module)) if state.prefilling else state.context.get(id(module))
        state.hidden[id(module)] = hidden if context is None else torch.cat([context, hidden], dim=1)
    return hook


def attended_fraction(spec: SelectionSpec, length: int) -> float:
    """The share of a `length`-token context the last query attends (sink, local tail and K whole pools)."""
    t = length - 1
    k = int(spec.pools_per_query(torch.tensor([t]))[0])
    return min(1.0, (spec.sink + spec.local + k * spec.pool) / length) if length else math.nan


# ----------------------------------------------------------------------------- the audit condition


class SelectionAdapter(Wrapped):
    """An HFAdapter evaluated under pooled selection, which acts at every position of the prefill as in the real
    models.  It runs the runner's split path: the contexts are prefilled once under selection and each query
    continues from a copy of their cache under selection (selection is causal, so this is the whole prompt's
    forward).  A distilled indexer scores hidden states, which a cache does not hold: its prefill keeps each
    layer's input hidden states of the contexts beside the cache, and a continuation joins them to the new
    positions'.  `attended` is the share of the context the answering query attends (sink + local tail + K pools)
    at the last checked prompt length; `extras` adds it and the selection mechanism per phase
    (`selection_mechanism`) to the audit's summary."""

    def __init__(self, inner, spec: SelectionSpec):
        from phasekv.conditions.selection.scorers import make_indexer

        i = inner.info
        super().__init__(inner, replace(i, name=f"{i.name} {spec.name}", stride=spec.pool, local_window=spec.local))
        self.spec, self.indexer = spec, make_indexer(spec.indexer)
        self.shares_cache = inner.shares_cache
        self.attended: float | None = None

    def check_length(self, length: int) -> None:
        """Also refuse prompts too short for selection to choose (every candidate pool selected): their numbers
        would be dense attention's."""
        self.inner.check_length(length)
        pos = torch.tensor([length - 1])
        geometry = Geometry(pos, torch.arange(length), torch.ones(1, 1, 1, length, dtype=torch.bool))
        candidates = int(candidate_pools(self.spec, geometry, (length - 1) // self.spec.pool + 1).sum())
        if candidates <= int(self.spec.pools_per_query(pos)[0]):
            raise ValueError(f"{self.spec.name}: prompts of {length} tokens have {candidates} candidate pools, no more "
                             "than it selects: selection would attend everything (lower top/budget or use longer "
                             "prompts)")
        self.attended = attended_fraction(self.spec, length)

    def _forward(self, ids: torch.Tensor, keep: int, record: bool = False, offsets: torch.Tensor | None = None):
        """The last `keep` positions' logits (0: all) of one selected forward of the prompts `ids`, each its own
        request (jitter: origins drawn from the whole prompt unless `offsets` gives them)."""
        from phasekv.adapters.hf import forward_bytes
        from phasekv.memory import check_budget

        dtype = next(self.module.parameters()).dtype
        need = forward_bytes(self.module.config, ids.shape[1], ids.shape[0], torch.finfo(dtype).bits // 8, True)
        check_budget(need, f"context: a selection forward of {ids.shape[0]} x {ids.shape[1]} tokens",
                     device=self.device, advice="lower --batch-size")
        offsets = self.spec.offsets(ids) if offsets is None else offsets
        with torch.no_grad(), selecting(self.module, self.spec, self.indexer, record=record, offsets=offsets) as state:
            logits = self.module(input_ids=ids.to(self.device), use_cache=False, logits_to_keep=keep).logits
        return (logits, state.recorded) if record else logits

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self._forward(ids, 0)

    def next_logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self._forward(ids, 1)

    def prefill(self, ids: torch.Tensor, prefix: int = 0):
        """The inner adapter's cache of the contexts, prefilled under selection; for an indexer that reads hidden
        states, with each layer's input hidden states of the contexts beside it; for grid=jitter, with each
        context's origin (a context is one request: its queries continue it on its grid).  A chunked prefill (the
        inner adapter's `prefill_chunk`) gives the same cache and hidden states (tests/test_chunked_prefill.py)."""
        offsets = self.spec.offsets(ids)
        with selecting(self.module, self.spec, self.indexer, offsets=offsets) as state:
            state.prefilling = True
            cache = self.inner.prefill(ids)
        return cache, (dict(state.hidden) if self.indexer.needs_hidden else {}), offsets

    def continue_from(self, cache, ids: torch.Tensor, repeats: int) -> torch.Tensor:
        """(B * n, t) query ids after B contexts -> (B * n, t, V) logits of the whole prompts' query positions, from
        copies of the contexts' cache (and hidden states) under selection: causal selection makes this the whole
        prompts' forward."""
        inner_cache, hidden, offsets = cache
        offsets = None if offsets is None else offsets.repeat_interleave(repeats)
        with selecting(self.module, self.spec, self.indexer, offsets=offsets) as state:
            state.context = {m: h.repeat_interleave(repeats, 0) for m, h in hidden.items()}
            return self.inner.continue_by_copies(inner_cache, ids, repeats)

    def extras(self, sets: dict[str, Any], progress: bool = True) -> dict[str, Any]:
        """What the audit records beside this condition's metrics: the attended share and, per padding protocol,
        the selection mechanism by phase."""
        return {"attended": self.attended,
                "mechanism": {p: selection_mechanism(self, s, progress=progress) for p, s in sets.items()
                              if p != "query"}}


# ----------------------------------------------------------------------------- the mechanism, by phase


def _pool_attended(record: dict[str, torch.Tensor], row: int, position: int, spec) -> tuple[float, float]:
    """(share of groups whose selection holds the pool of `position`, attention mass on that pool's keys, heads
    averaged) of one layer at the last query, the pool taken on each group's grid (moved by the call's origins);
    a key in the local tail or the sink counts as held."""
    query = int(record["query_pos"])
    fixed = position < spec.sink or query - position < spec.local
    selected, probs = record["selected"][row], record["probs"][row]  # (G, pools), (H, Tk)
    origins = record["origins"]
    o = torch.zeros(1, dtype=torch.long) if origins is None else origins[min(row, origins.shape[0] - 1)].cpu()
    pool = (position + o.expand(selected.shape[0])) // spec.pool  # (G,)
    chosen = 1.0 if fixed else float(selected.gather(-1, pool[:, None].to(selected.device)).float().mean())
    per_head = o.repeat_interleave(probs.shape[0] // len(o)).to(probs.device)  # (H,)
    keys = (record["key_pos"][None] + per_head[:, None]) // spec.pool == ((position + per_head) // spec.pool)[:, None]
    mass = float(torch.where(keys, probs, 0.0).sum(-1).mean())
    return chosen, mass


def _request_offsets(spec: SelectionSpec, batch: list) -> torch.Tensor | None:
    """grid=jitter: the origins the evaluation gave these (prompt, query) pairs: drawn from each prompt's context
    (its tokens before the query's), the request the runner prefills."""
    if spec.grid != "jitter":
        return None
    return torch.cat([spec.offsets(torch.tensor([p.ids[:len(p.ids) - len(q.key)]])) for p, q in batch])


def selection_mechanism(adapter: SelectionAdapter, eval_set, per_phase: int = 4, batch_size: int = 8,
                        progress: bool = True) -> dict[str, Any]:
    """The mechanism of selection, not only its accuracy: per phase of the target record (its position mod the
    pool), how often the answering query's selection holds the record's pool and the pool of its answer token
    (they differ when the record straddles a pool boundary), and the attention mass the query puts on them, over
    layers and selection groups; `fixed_share` is the share of prompts whose target lies in the local tail or the
    sink (attended anyway, not by the indexer).  `per_phase` prompts of each phase, the first ones of the set."""
    # long: the per-prompt bookkeeping reads top to bottom
    spec = adapter.spec
    chosen: dict[int, list] = defaultdict(list)
    for prompt, query in zip(eval_set.prompts(), eval_set.queries(), strict=True):
        if len(chosen[query.target_position % spec.pool]) < per_phase:
            chosen[query.target_position % spec.pool].append((prompt, query))
    by_length: dict[int, list] = defaultdict(list)
    for phase in sorted(chosen):
        for item in chosen[phase]:
            by_length[len(item[0].ids)].append(item)
    rows: dict[int, list[dict[str, float]]] = defaultdict(list)
    total = sum(len(v) for v in chosen.values())
    with tqdm(total=total, desc="selection mechanism", unit="prompt", disable=not progress, leave=False) as bar:
        for group in by_length.values():
            for start in range(0, len(group), batch_size):
                batch = group[start:start + batch_size]
                ids = torch.tensor([p.ids for p, _ in batch])
                _, recorded = adapter._forward(ids, 1, record=True, offsets=_request_offsets(spec, batch))
                last = int(recorded[0]["query_pos"])
                for row, (_, q) in enumerate(batch):
                    answer = q.target_position + len(q.key)
                    target = [_pool_attended(r, row, q.target_position, spec) for r in recorded]
                    ans = [_pool_attended(r, row, answer, spec) for r in recorded]
                    rows[q.target_position % spec.pool].append({
                        "target_selected": sum(c for c, _ in target) / len(target),
                        "answer_selected": sum(c for c, _ in ans) / len(ans),
                        "target_mass": sum(m for _, m in target) / len(target),
                        "answer_mass": sum(m for _, m in ans) / len(ans),
                        "fixed_share": float(q.target_position < spec.sink or last - q.target_position < spec.local)})
                bar.update(len(batch))
    phases = [{"phase": phase, "n": len(r), **{k: round(sum(x[k] for x in r) / len(r), 4) for k in r[0]}}
              for phase, r in sorted(rows.items())]
    return {"pool": spec.pool, "indexer": spec.indexer, "per_phase": phases}
