"""kvpress presses as audit conditions: parse `NAME[:k=v,...]`, apply the press during prefill, continue the
queries on the cache it left.

A press (NVIDIA kvpress 0.5.5) is a forward hook on every layer's `self_attn`: after the prefill forward
has written a layer's keys and values, it scores the cached positions and keeps some of them.  kvpress
0.5.5 was written for transformers < 5.3; transformers 5.24 passes the cache to an attention layer as
`cache` (was `past_key_values`) and no longer passes `cache_position`, both of which the hook reads.
`pressed` is the compatibility layer: a context manager that registers, on each attention layer, a hook
that hands kvpress's hook the keyword arguments it expects (`_kvpress_kwargs`), attaches the model's
rotary embedding to each layer as kvpress does, and removes both on exit, also when the press raises.

Presses offered (`NAME`: kvpress class; keys with their defaults; what it keeps):
  knorm               KnormPress              ratio=0.5                   the lowest key norms, per KV head
  snapkv              SnapKVPress             ratio, window=64, kernel=5  the most attended by the last `window`
                                                                          queries (pooled), and that window
  streaming           StreamingLLMPress       ratio, sinks=4              the first `sinks` and the most recent
  expected-attention  ExpectedAttentionPress  ratio, sinks=4, future=512  the highest expected attention of the
                                                                          next `future` queries, and the sinks
  tova                TOVAPress               ratio                       the most attended by the last token
  keydiff             KeyDiffPress            ratio                       keys least like their mean direction
  chunkkv             ChunkKVPress            press=knorm, chunk=20       whole chunks of the highest score
  chunk               ChunkPress              press=knorm, chunk=1024     each chunk's own top share
  block               BlockPress              press=knorm, block=128      top-k renewed block by block
`ratio` is the fraction of positions removed (kvpress's compression_ratio); a wrapper (chunkkv, chunk,
block) scores with `press=` and takes that press's keys too, e.g. `chunkkv:press=snapkv,window=16,ratio=0.75,chunk=8`.

A press compresses each context once, during its prefill (the whole context in one forward: a press scores
positions against the context's own queries, so no prefix is shared), and all of the context's queries read
that one compressed cache in place (`HFAdapter.continue_from`).

Batches: kvpress 0.5.5's ChunkKVPress picks the chunks of batch row 0 for every row, so a chunkkv press
prefills and continues its contexts one row at a time (`PressAdapter.rows_separately`); every other press
selects per row and head.  Lengths: contexts are never padded, every position is a real token.  kvpress
0.5.5's ChunkKVPress scores a partial last chunk by its mean score, so when the context length is not a
multiple of the chunk, some layers may keep that shorter chunk and others not; such a cache is continued
one query token at a time (`PressAdapter.stepwise`), which is the same attention and needs no mask.

Hybrid models (`conditions.hybrid`): the hooks go on the full-attention layers only, and each pressed layer
becomes an `OffsetLayer` (fewer entries than positions seen); sliding-window, chunked and linear layers keep what
the model's own prefill left.  `check_hybrid` refuses, in one line, what a press cannot do there.

Layout: cache tensors are (B, H_kv, T, D), as in transformers' DynamicLayer.  A press keeps entries in
its own order (score order for most): `kept_positions` reads which positions it kept.
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import torch
from torch import nn

from phasekv.adapters.base import Wrapped
from phasekv.adapters.hf import HFAdapter
from phasekv.archs import repeat_rows as repeat_cache
from phasekv.conditions.hybrid import TARGET, layer_kinds, offset_layer
from phasekv.conditions.posthoc import cache_bytes

KVPRESS_VERSION = "0.5.5"  # the version the compatibility layer and tests/test_presses.py verify


@dataclass(frozen=True)
class Param:
    field: str  # the kvpress dataclass field it sets
    default: float | int
    low: float | int  # the smallest allowed value
    kind: type = int
    below: float | None = None  # an exclusive upper bound
    odd: bool = False

    def describe(self) -> str:
        if self.below is not None:
            return f"a number in [{self.low}, {self.below})"
        return f"an {'odd ' if self.odd else ''}integer >= {self.low}"

    def parse(self, raw: str) -> float | int:
        """The value of `raw`; ValueError (without context) when it is not allowed."""
        try:
            value = self.kind(raw)
        except ValueError:
            raise ValueError(self.describe()) from None
        below = math.inf if self.below is None else self.below
        if not self.low <= value < below or (self.odd and value % 2 == 0):  # NaN fails too
            raise ValueError(self.describe())
        return value


RATIO = Param("compression_ratio", 0.5, 0.0, float, below=1.0)
SINKS = Param("n_sink", 4, 0)

# presses that score positions: NAME -> (kvpress class, {key: Param})
SCORERS: dict[str, tuple[str, dict[str, Param]]] = {
    "knorm": ("KnormPress", {"ratio": RATIO}),
    "snapkv": ("SnapKVPress", {"ratio": RATIO, "window": Param("window_size", 64, 1),
                               "kernel": Param("kernel_size", 5, 1, odd=True)}),  # an even kernel changes the length
    "streaming": ("StreamingLLMPress", {"ratio": RATIO, "sinks": SINKS}),
    "expected-attention": ("ExpectedAttentionPress", {"ratio": RATIO, "sinks": SINKS,
                                                      "future": Param("n_future_positions", 512, 1)}),
    "tova": ("TOVAPress", {"ratio": RATIO}),
    "keydiff": ("KeyDiffPress", {"ratio": RATIO}),
}
# presses that select over a scoring press's scores (`press=` names it): NAME -> (kvpress class, own keys)
WRAPPERS: dict[str, tuple[str, dict[str, Param]]] = {
    "chunkkv": ("ChunkKVPress", {"chunk": Param("chunk_length", 20, 1)}),
    "chunk": ("ChunkPress", {"chunk": Param("chunk_length", 1024, 1)}),
    "block": ("BlockPress", {"block": Param("block_size", 128, 1)}),
}
VERIFIED_MODELS = ("LlamaForCausalLM", "Qwen3ForCausalLM",  # the classes tests/test_presses.py checks presses on
                   "Gemma3ForCausalLM", "GptOssForCausalLM", "Llama4ForCausalLM",  # and tests/test_hybrid.py
                   "Qwen3NextForCausalLM")
PRESSED_WITH = ("full", "sliding", "chunked", "linear")  # the layer kinds of a hybrid a press acts beside
ROWS_SEPARATELY = ("chunkkv",)  # kvpress 0.5.5 selects these from batch row 0 only
NO_WEIGHTS = ("chunkkv", "chunk", "block")  # these assert the attention layer returned no weights (eager does)


@dataclass(frozen=True)
class PressSpec:
    name: str
    scorer: str  # the scoring press: `name` itself, or a wrapper's press=
    values: dict[str, float | int]  # every key of the press, defaults filled in
    text: str  # as written

    def build(self):
        """The kvpress press object."""
        kv = load_kvpress()
        cls, keys = SCORERS[self.scorer]
        press = getattr(kv, cls)(**{p.field: self.values[k] for k, p in keys.items()})
        if self.name in WRAPPERS:
            cls, keys = WRAPPERS[self.name]
            press = getattr(kv, cls)(press=press, **{p.field: self.values[k] for k, p in keys.items()})
        return press


def parse_press(text: str) -> PressSpec:
    """'NAME[:k=v,...]' (module docstring); one-line ValueError for an unknown name, key or value."""
    name, _, rest = text.strip().partition(":")
    names = [*SCORERS, *WRAPPERS]
    if name not in names:
        raise ValueError(f"press {text!r}: unknown press {name!r} (allowed: {', '.join(names)})")
    given: dict[str, str] = {}
    for item in rest.split(",") if rest else []:
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not key or not value:
            raise ValueError(f"press {text!r}: {item!r} is not key=value")
        if key in given:
            raise ValueError(f"press {text!r}: {key} given twice")
        given[key] = value
    scorer, keys = name, {}
    if name in WRAPPERS:
        scorer, keys = given.pop("press", "knorm"), WRAPPERS[name][1]
        if scorer not in SCORERS:
            raise ValueError(f"press {text!r}: press={scorer} is not a scoring press (allowed: {', '.join(SCORERS)})")
    keys = {**keys, **SCORERS[scorer][1]}
    for key in given:
        if key not in keys:
            allowed = ", ".join(["press", *keys] if name in WRAPPERS else keys)
            raise ValueError(f"press {text!r}: unknown key {key!r} for {name} (allowed: {allowed})")
    values = {}
    for key, param in keys.items():
        try:
            values[key] = param.parse(given[key]) if key in given else param.default
        except ValueError as exc:
            raise ValueError(f"press {text!r}: {key}={given[key]} must be {exc}") from None
    return PressSpec(name, scorer, values, text)


@functools.cache
def load_kvpress() -> ModuleType:
    """The kvpress module, at the verified version; ValueError naming the install step otherwise.

    Importing kvpress wraps every transformers attention function (for head-wise presses, which mask keys
    through `module.masked_key_indices`); none of the presses offered here does, so the originals are put
    back and the other conditions run through transformers' own functions."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    originals = dict(ALL_ATTENTION_FUNCTIONS.items())
    try:
        import kvpress
    except ImportError as exc:
        raise ValueError(f"kvpress cannot be imported ({exc}): run make kvpress") from None
    finally:
        for name, function in originals.items():
            ALL_ATTENTION_FUNCTIONS[name] = function
    version = importlib.metadata.version("kvpress")
    if version != KVPRESS_VERSION:
        raise ValueError(f"kvpress {version} is installed; phasekv's press support is verified with "
                         f"{KVPRESS_VERSION} only: run make kvpress")
    return kvpress


def check_press(text: str) -> PressSpec:
    """Parse a press and check kvpress can be imported: everything that can be refused before loading a model."""
    spec = parse_press(text)
    load_kvpress()
    return spec


def _kvpress_kwargs(module: nn.Module, kwargs: dict[str, Any], cache) -> dict[str, Any]:
    """The keyword arguments kvpress 0.5.5's hook reads, from those transformers 5.24 gives an attention layer:
    the cache as `past_key_values` and `cache_position`, the cache slots of this forward's tokens (read after
    the forward, when the layer's cache already holds them)."""
    length, q_len = cache.layers[module.layer_idx].get_seq_length(), kwargs["hidden_states"].shape[1]
    position = torch.arange(length - q_len, length, device=kwargs["hidden_states"].device)
    return {**kwargs, "past_key_values": cache, "cache_position": kwargs.get("cache_position", position)}


# called per layer with (layer index, keys and values before the press, keys after)
Recorder = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


@contextmanager
def pressed(press, model: nn.Module, layers: list[nn.Module], record: Recorder | None = None) -> Iterator[None]:
    """Inside the block, every forward of `model` that fills an empty cache is compressed by `press` in each
    of `layers` (the `self_attn` modules).  On exit (also on an error) the hooks and the rotary embeddings
    attached to the layers are removed again."""
    press.post_init_from_model(model)
    rotary = getattr(getattr(model, "model", model), "rotary_emb", None)  # ExpectedAttentionPress reads it
    handles, attached = [], []

    def hook(module, args, kwargs, output):
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        if cache is None:
            raise ValueError("a press compresses the cache: the model must run with use_cache=True")
        layer = cache.layers[module.layer_idx]
        keys, values = layer.keys, layer.values
        output = press.forward_hook(module, args, _kvpress_kwargs(module, kwargs, cache), output)
        if record is not None:
            record(module.layer_idx, keys, values, layer.keys)
        return output

    try:
        for attn in layers:
            if rotary is not None and not hasattr(attn, "rotary_emb"):
                attn.rotary_emb = rotary
                attached.append(attn)
            handles.append(attn.register_forward_hook(hook, with_kwargs=True))
        yield
    finally:
        for handle in handles:
            handle.remove()
        for attn in attached:
            del attn.rotary_emb


def kept_positions(full: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """full (B, H, T, D), kept (B, H, T', D) gathered from it -> the position of each kept entry (B, H, T').

    Entries are matched on the exact bits of their keys (a press copies them); ValueError when an entry is
    not a copy of a key at its row and head."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[full.element_size()]
    weights = torch.randint(1, 1 << 31, (full.shape[-1],), generator=torch.Generator().manual_seed(0))
    weights = weights.to(full.device)

    def signature(t: torch.Tensor) -> torch.Tensor:  # (B, H, T) int64, wrapping on overflow
        return (t.contiguous().view(ints).long() * weights).sum(-1)

    order = signature(full).sort(-1)
    where = torch.searchsorted(order.values, signature(kept)).clamp(max=full.shape[2] - 1)
    index = order.indices.gather(-1, where)  # (B, H, T')
    if not torch.equal(full.gather(2, index[..., None].expand_as(kept)), kept):
        raise ValueError("a compressed cache entry is not a copy of a prefilled key: the press changed the keys")
    return index


def check_hybrid(spec: PressSpec, model: str, kinds: list[str]) -> None:
    """A one-line ValueError for a hybrid a press cannot act on.  On a hybrid, a press acts on the full-attention
    layers only (kvpress 0.5.5 itself does so for Gemma 3's multimodal class alone); the sliding-window, chunked
    and linear layers keep the windows and states the model bounds itself."""
    if set(kinds) == {TARGET}:
        return
    if TARGET not in kinds:
        raise ValueError(f"press {spec.text}: {model} has no full-attention layer (its layers are "
                         f"{'/'.join(sorted(set(kinds)))}): a press has nothing to compress")
    refused = sorted(set(kinds) - set(PRESSED_WITH))
    if refused:
        raise ValueError(f"press {spec.text}: {model} has {'/'.join(refused)} layers, which no press acts on "
                         "(only full-attention layers beside sliding-window, chunked or linear ones)")
    if spec.scorer == "expected-attention":
        raise ValueError(f"press {spec.text}: kvpress 0.5.5's expected-attention re-derives the queries' "
                         f"statistics with one rotary embedding for every layer, which {model}'s layer kinds "
                         "do not share: use knorm, streaming, keydiff, snapkv or tova")


def full_attention_modules(inner: HFAdapter, kinds: list[str]) -> list[nn.Module]:
    """The `self_attn` modules of a hybrid model's full-attention decoder layers."""
    decoder = getattr(inner.module, "model", inner.module).layers
    return [layer.self_attn for layer, kind in zip(decoder, kinds, strict=True) if kind == TARGET]


def offset_layers(cache, kinds: list[str], length: int):
    """A pressed hybrid cache with its full-attention layers as `OffsetLayer`s (they hold fewer entries than the
    `length` positions seen, and report `length` as the other layers do); the other layers stay as they are."""
    cache.layers = [offset_layer(layer.keys, layer.values, seen=length) if kind == TARGET else layer
                    for layer, kind in zip(cache.layers, kinds, strict=True)]
    return cache


class PressAdapter(Wrapped):
    """An HFAdapter whose prefills run under a kvpress press; the queries continue from the compressed cache,
    so `runner.predict` (multi-query) and the audit's protocols and verdicts work unchanged.

    `bytes`: the (full, compressed) cache sizes of the last prefill.  `kept()`: which positions the press
    kept, by phase (position mod `stride`), over every prefill so far."""

    def __init__(self, inner: HFAdapter, spec: str | PressSpec, stride: int | None = None):
        self.spec = parse_press(spec) if isinstance(spec, str) else spec
        self.kinds = layer_kinds(inner.module)
        check_hybrid(self.spec, type(inner.module).__name__, self.kinds)
        if type(inner.module).__name__ not in VERIFIED_MODELS:
            raise ValueError(f"press {self.spec.text}: {type(inner.module).__name__} is not a model presses are "
                             f"verified on ({', '.join(VERIFIED_MODELS)})")
        attention = getattr(inner.module.config, "_attn_implementation", None)
        if self.spec.name in NO_WEIGHTS and attention == "eager":
            raise ValueError(f"press {self.spec.text}: kvpress's {self.spec.name} does not run on eager attention "
                             "(it returns attention weights): load the model with sdpa attention")
        self.press = self.spec.build()
        i = inner.info
        super().__init__(inner, replace(i, name=f"{i.name} press {self.spec.text}", stride=stride or i.stride,
                                        local_window=None))
        self.rows_separately = self.spec.name in ROWS_SEPARATELY
        self.period = stride or i.stride or 1
        self.bytes = {"full": 0, "compressed": 0}
        self._kept = torch.zeros(self.period, dtype=torch.long)  # kept entries by phase, all layers, rows, heads
        self._seen = torch.zeros(self.period, dtype=torch.long)  # prefilled entries by phase
        self._full_bytes = 0

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        raise ValueError("a press compresses the cache during prefill: evaluate with prefill + continue_from "
                         "(multi-query), not one forward pass per prompt")

    def kept(self) -> dict[str, Any]:
        """{"period", "fraction" kept of all prefilled entries, "fraction_by_phase"} over every prefill so far."""
        seen = self._seen.clamp(min=1).double()
        return {"period": self.period, "fraction": float(self._kept.sum() / self._seen.sum().clamp(min=1)),
                "fraction_by_phase": (self._kept / seen).tolist()}

    def _record(self, layer: int, keys: torch.Tensor, values: torch.Tensor, small_keys: torch.Tensor) -> None:
        rows, heads, length, _ = keys.shape
        phases = kept_positions(keys, small_keys).flatten().cpu() % self.period
        self._kept += torch.bincount(phases, minlength=self.period)
        self._seen += torch.bincount(torch.arange(length) % self.period, minlength=self.period) * rows * heads
        self._full_bytes += sum(t.numel() * t.element_size() for t in (keys, values))

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor):
        self._full_bytes = 0
        caches = []
        hybrid = set(self.kinds) != {TARGET}
        layers = full_attention_modules(self.inner, self.kinds) if hybrid else self.inner.attention_layers()
        for rows in ids.split(1) if self.rows_separately else [ids]:
            with pressed(self.press, self.module, layers, self._record):
                try:
                    past, length = self.inner.prefill(rows)
                except AssertionError as exc:  # kvpress checks its settings (e.g. window < length) with assert
                    raise ValueError(f"press {self.spec.text}: {exc}") from None
                except (RuntimeError, TypeError) as exc:
                    if not hybrid:
                        raise
                    raise ValueError(f"press {self.spec.text}: kvpress failed on {type(self.module).__name__}'s "
                                     f"full-attention layers ({str(exc).splitlines()[0]}); a press that re-derives "
                                     "the queries (snapkv, tova) reads the model's own attention weights under "
                                     "eager attention") from None
            caches.append(offset_layers(past, self.kinds, length) if hybrid else past)
        self.bytes = {"full": self._full_bytes, "compressed": sum(cache_bytes(c) for c in caches)}
        return caches, length

    def continue_from(self, cache, ids: torch.Tensor, repeats: int) -> torch.Tensor:
        caches, length = cache
        parts = ids.split(ids.shape[0] // len(caches))  # context-major: each cache's query rows in turn
        return torch.cat([self.inner.continue_from((past, length), part, repeats)
                          if len({layer.get_seq_length() for layer in past.layers}) == 1
                          else self.stepwise(past, length, part, repeats)
                          for past, part in zip(caches, parts, strict=True)])

    @torch.no_grad()
    def stepwise(self, past, length: int, ids: torch.Tensor, repeats: int) -> torch.Tensor:
        """`continue_from` one query token at a time, for a cache whose layers hold different numbers of entries
        (ChunkKV kept the partial last chunk in some layers only): transformers builds one causal mask from
        layer 0's length, while a single query token needs no mask (it attends every entry in the cache, which
        by then holds the query tokens before it)."""
        past = copy.deepcopy(past)
        if repeats > 1:
            repeat_cache(past, ids.shape[0] // repeats, repeats)
        ids = ids.to(self.device)
        steps = []
        for j in range(ids.shape[1]):
            position = torch.full((ids.shape[0], 1), length + j, device=self.device)
            steps.append(self.module(input_ids=ids[:, j:j + 1], position_ids=position, cache=past,
                                     use_cache=True).logits)
        return torch.cat(steps, 1)
