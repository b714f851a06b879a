"""Any transformers causal LM behind the adapter interface (`HFAdapter`), and loading one (`load_hf`).

Loading: a local directory or hub name (no download happens offline), safetensors only (pickle can run code), or a
GGUF file through transformers' GGUF support; a model that is not a causal LM, or a tokenizer whose ids run past its
embedding, is refused before any weight is read.

Multi-query for transformers models (`HFAdapter`).  A prefilled cache of full-attention `DynamicLayer`s is
read in place: the queries of one context sit side by side in ONE row, (B, n * t), each at the true
positions length .. length + t - 1, with a 4-D attention mask that lets every query token see the whole
cache and the earlier tokens of its own query only (`query_mask`).  The cache is handed to the forward
through `read_only` layers, which return the cached keys with the new ones appended and keep nothing, so
the cache is never copied per query and never written; B contexts are continued in one forward.  This is
the same attention as one forward per full prompt (tests/test_multiquery.py compares them).  The slow
reference, `continue_by_copies`, deep-copies the cache and repeats it once per query row; it also serves
whatever the packed layout does not cover: caches with other layer kinds (sliding windows, compressors),
attention kernels other than eager and sdpa, model classes not in `PACKED_MODELS`, and models with forward
hooks (the probes' hooks act at the final position of each row, and a packed row holds n queries).

Shared prefix (`prefill(ids, prefix=P)`, `shares_prefix`): when every context of an evaluation begins with
the same P tokens (the long-context formats' prose preamble, `phasekv.data.formats`), those are prefilled
once, kept (one entry, the last prefix seen), and each batch of contexts prefills only its own suffix on top
of a broadcast view of them.  A suffix forward needs an explicit causal mask, which makes its attention
dearer than a plain prefill's, so the prefix is shared only when it is at least `SHARE_PREFIX_FROM` of the
context.

Chunked prefill (`prefill_chunk` = C > 0): a context (and a shared prefix) is prefilled C tokens at a time, each
chunk at its true positions on top of the cache of the chunks before it, so a prefill holds the KV cache plus one
chunk's activations and attention, (C, T) per row instead of (T, T): what lets a 135M model prefill 32K tokens on
a laptop.  The one-shot prefill is its reference (tests/test_chunked_prefill.py: the same cache and query logits
to 1e-5, and the same answers under a post-hoc compression condition).

Layout: transformers cache tensors are (B, H_kv, T, D); query ids come context-major, (B * n, t).

Memory: before each forward, `check_memory(length, rows, chunk)` estimates its peak (`forward_bytes`) and refuses,
in one line and before any compute, a batch of contexts that would not fit in the available memory.  The
attention term follows the implementation: eager materializes float32 scores and probabilities, (heads, q, T) per
row; sdpa materializes only the mask transformers builds once queries follow cached tokens, (q, T) per row (its
CPU and GPU kernels work in blocks; measured: 54 MiB for a (4096, 4096) boolean mask on CPU against 1 GiB for
eager's (8, 4096, 4096)), and nothing for a one-shot causal prefill; a mask costs MASK_BYTES a (query, key) pair
(tests/test_chunked_prefill.py checks a 16K-token chunked prefill's peak RSS against the estimate).
"""

from __future__ import annotations

import copy
import functools
import inspect
from pathlib import Path

import torch
from torch import nn

from phasekv.adapters.base import Adapter, ModelInfo
from phasekv.archs import architecture_of
from phasekv.archs.base import text_config
from phasekv.distributed import resolve_device
from phasekv.families import check_fits
from phasekv.memory import check_budget

DTYPES = ("float32", "float16", "bfloat16", "float64")
PACKED_MODELS = ("LlamaForCausalLM", "Qwen3ForCausalLM")  # classes tests/test_multiquery.py checks the packed layout on
# a suffix forward's masked attention costs about twice a causal prefill's per score (tiny Llama, 8K tokens), so on an
# attention-bound model a shared prefix pays from about 3/4 of the context on (half of 2K tokens: 0.41 s vs 0.33 s)
SHARE_PREFIX_FROM = 0.75
# a (query, key) pair of an attention mask: transformers' boolean mask, a boolean temporary of building it, and the
# float copy PyTorch's CPU attention makes of it (measured, tiny Llama, chunks of 1-4K behind 8-32K cached tokens:
# 5.6-5.9 bytes a pair of peak RSS growth beyond the other terms, sdpa and eager alike)
MASK_BYTES = 6


@functools.cache
def _read_only_layer() -> type:
    """A DynamicLayer whose update returns its keys and values with the new ones appended and stores nothing."""
    from transformers.cache_utils import DynamicLayer

    class ReadOnlyLayer(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            return torch.cat([self.keys, key_states], -2), torch.cat([self.values, value_states], -2)

    return ReadOnlyLayer


def read_only(layers: list[tuple[torch.Tensor, torch.Tensor]], keep: bool = False):
    """A transformers Cache over existing (keys, values) tensors (B, H, T, D), none copied.  With `keep` False
    its layers return the cached keys and values with the forward's own appended and store nothing (the
    tensors are read, never written); with `keep` True they are ordinary DynamicLayers, which store the
    concatenation (new tensors: the given ones, broadcast views included, stay as they are)."""
    from transformers.cache_utils import Cache, DynamicLayer

    out = []
    for keys, values in layers:
        layer = DynamicLayer() if keep else _read_only_layer()()
        if keys is not None:
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
        out.append(layer)
    return Cache(layers=out)


def query_mask(entries: int, repeats: int, length: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The additive mask (1, 1, n * t, entries + n * t) of `repeats` queries of `length` tokens packed in one
    row behind `entries` cached entries: every query token sees every cached entry and the tokens of its own
    query up to itself, nothing of the other queries."""
    own = torch.ones(length, length, dtype=torch.bool, device=device).tril()  # (t, t)
    visible = torch.cat([torch.ones(repeats * length, entries, dtype=torch.bool, device=device),
                         torch.block_diag(*[own] * repeats)], 1)  # (n * t, entries + n * t)
    mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def forward_bytes(config, length: int, rows: int, bytes_per_value: int, eager: bool, *, chunk: int = 0) -> int:
    """Estimated peak bytes, beyond the weights, of one forward of a transformers decoder over `rows` sequences of
    `length` tokens, prefilled `chunk` tokens at a time (0: at once): the K/V of every layer (the cache a prefill
    keeps), one layer's activations of one chunk at a time (hidden states, queries, the grouped K/V repeated per
    query head, the MLP's three intermediate tensors), the attention's own tensors (eager: (heads, q, T) float32
    scores and probabilities; both: the (q, T) mask wherever one is built, MASK_BYTES a pair) and the last
    position's logits."""
    text = text_config(config)
    heads, hidden = text.num_attention_heads, text.hidden_size
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv = text.num_hidden_layers * 2 * kv_heads * head_dim * length
    q = chunk if 0 < chunk < length else length
    layer = q * (4 * hidden + 3 * heads * head_dim + 3 * (getattr(text, "intermediate_size", None) or 4 * hidden))
    scores = 2 * heads * q * length * 4 if eager else 0
    mask = q * length * MASK_BYTES if eager or q < length else 0  # sdpa's one-shot causal prefill builds none
    return rows * ((kv + layer) * bytes_per_value + scores + mask + text.vocab_size * 4)


class HFAdapter(Adapter):
    """Any transformers causal LM.  Queries read a full-attention cache in place (the module docstring); other
    caches are deep-copied and repeated per query (`continue_by_copies`)."""

    shares_prefix = True

    def __init__(self, model: nn.Module, name: str, stride: int | None = None, local_window: int | None = None,
                 *, prefill_chunk: int = 0):
        if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 0:
            raise ValueError(f"prefill_chunk: must be an integer >= 0 (0: one forward), got {prefill_chunk!r}")
        self.prefill_chunk = prefill_chunk
        cfg = model.config
        text = text_config(cfg)
        heads = text.num_attention_heads
        self.module, self.device = model.eval(), next(model.parameters()).device
        self.info = ModelInfo(name=name, vocab_size=text.vocab_size, num_layers=text.num_hidden_layers,
                              num_heads=heads, num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
                              head_dim=getattr(text, "v_head_dim", None) or getattr(text, "head_dim", None)
                              or text.hidden_size // heads,  # o_proj input
                              max_length=getattr(text, "max_position_embeddings", 1 << 30), stride=stride,
                              local_window=local_window)
        forward = inspect.signature(self.module.forward).parameters
        self._cache_arg = "cache" if "cache" in forward else "past_key_values"  # renamed in transformers 5.x
        # the cache is what a prefill wants: the LM head runs on the last position only where the class allows it
        self._last = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}
        self._prefix: tuple[tuple[int, ...], object] | None = None  # the last shared prefix and its cache
        # a shared prefix is broadcast full-attention keys: a sliding-window, chunked or linear layer prefills whole
        kinds = getattr(text, "layer_types", None) or (["full_attention"] if getattr(text, "sliding_window", None) is
                                                       None and getattr(text, "attention_chunk_size", None) is None
                                                       else ["windowed"])
        self.shares_prefix = set(kinds) == {"full_attention"}

    def attention_layers(self) -> list[nn.Module]:
        layers = None
        for path in ("model.layers", "model.model.layers", "transformer.h", "model.decoder.layers"):
            obj = self.module
            try:
                for part in path.split("."):
                    obj = getattr(obj, part)
            except AttributeError:
                continue
            layers = obj
            break
        if layers is None:
            raise ValueError(f"{self.info.name}: cannot find decoder layers (looked for model.layers)")
        attn = [getattr(layer, "self_attn", None) for layer in layers]
        arch = architecture_of(self.module)
        if any(a is None or arch.output_projection(a) is None for a in attn):
            raise ValueError(f"{self.info.name}: layers have no self_attn.o_proj (or the output projection their "
                             f"architecture names in phasekv.archs; read as {arch.name!r})")
        return attn

    @torch.no_grad()
    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        self.check_memory(ids.shape[1], ids.shape[0])
        return self.module(input_ids=ids.to(self.device), use_cache=False).logits

    @torch.no_grad()
    def next_logits(self, ids: torch.Tensor) -> torch.Tensor:
        self.check_memory(ids.shape[1], ids.shape[0])
        return self.module(input_ids=ids.to(self.device), use_cache=False, **self._last).logits[:, -1:]

    def check_memory(self, length: int, rows: int, chunk: int = 0) -> None:
        """Refuse (one-line ValueError), before it runs, a forward over `rows` sequences of `length` tokens (in chunks
        of `chunk`, 0: at once) whose estimated peak (`forward_bytes`) exceeds the memory available now."""
        dtype = next(self.module.parameters()).dtype
        eager = getattr(self.module.config, "_attn_implementation", None) == "eager"
        need = forward_bytes(self.module.config, length, rows, torch.finfo(dtype).bits // 8, eager, chunk=chunk)
        pieces = f" in chunks of {chunk}" if 0 < chunk < length else ""
        check_budget(need, f"context: a forward of {rows} x {length} tokens{pieces} of {self.info.name}",
                     device=self.device, advice="lower --batch-size, the prompt length or the prefill chunk")

    @torch.no_grad()
    def prefill(self, ids: torch.Tensor, prefix: int = 0):
        """ids (B, T) -> (cache, T).  `prefix`: the first `prefix` tokens are the same in every row and in every
        call of this evaluation; at least SHARE_PREFIX_FROM of the context, they are prefilled once."""
        ids = ids.to(self.device)
        rows, length = ids.shape
        self.check_memory(length, rows, self.prefill_chunk)
        if not SHARE_PREFIX_FROM * length <= prefix < length:
            return (self._extend(ids, 0, None), length)
        if not torch.equal(ids[:, :prefix], ids[:1, :prefix].expand(rows, -1)):
            raise ValueError(f"prefix: the rows differ within their first {prefix} tokens")
        shared = [(layer.keys.expand(rows, -1, -1, -1), layer.values.expand(rows, -1, -1, -1))
                  for layer in self._shared_prefix(ids[0, :prefix]).layers]  # broadcast views, (B, H, P, D)
        return (self._extend(ids[:, prefix:], prefix, read_only(shared, keep=True)), length)

    def _extend(self, ids: torch.Tensor, start: int, past):
        """The cache of `past` (None: empty) extended by ids (B, t) at positions start.., `prefill_chunk` tokens per
        forward (all at once when 0): each chunk sees the cache of every token before it, as in one forward."""
        step = self.prefill_chunk or ids.shape[1]
        for lo in range(0, ids.shape[1], step):
            piece = ids[:, lo:lo + step]
            more = {} if past is None else {self._cache_arg: past}
            if start + lo:  # a one-shot prefill from 0 passes no positions, as before chunking existed
                more["position_ids"] = torch.arange(start + lo, start + lo + piece.shape[1],
                                                    device=self.device).expand(piece.shape[0], -1)
            out = self.module(input_ids=piece, use_cache=True, **more, **self._last)
            past = getattr(out, "cache", None) or out.past_key_values  # renamed in transformers 5.x
        return past

    def _shared_prefix(self, ids: torch.Tensor):
        """The cache of one row of prefix ids (T,), prefilled once while the same prefix keeps coming."""
        key = tuple(ids.tolist())
        if self._prefix is None or self._prefix[0] != key:
            self._prefix = None  # the previous prefix's cache is released before the new one is built
            self._prefix = (key, self._extend(ids[None], 0, None))
        return self._prefix[1]

    def reads_in_place(self, past) -> bool:
        """Whether `continue_from` packs the queries of a context into one row over `past` (the module docstring)."""
        from transformers.cache_utils import DynamicLayer

        hooked = any(m._forward_hooks or m._forward_pre_hooks for m in self.module.modules())
        return (type(self.module).__name__ in PACKED_MODELS and not hooked
                and getattr(self.module.config, "_attn_implementation", None) in ("eager", "sdpa")
                and all(type(layer) is DynamicLayer for layer in getattr(past, "layers", [None])))

    @torch.no_grad()
    def continue_from(self, cache, ids: torch.Tensor, repeats: int) -> torch.Tensor:
        past, length = cache
        if not self.reads_in_place(past):
            return self.continue_by_copies(cache, ids, repeats)
        rows, t = ids.shape[0] // repeats, ids.shape[1]
        packed = ids.to(self.device).reshape(rows, repeats * t)  # (B, n * t): a context's queries side by side
        positions = torch.arange(length, length + t, device=self.device).repeat(repeats).expand(rows, -1)
        dtype = next(self.module.parameters()).dtype
        mask = query_mask(past.get_seq_length(), repeats, t, dtype, self.device)  # (1, 1, n * t, entries + n * t)
        view = read_only([(layer.keys, layer.values) for layer in past.layers])
        logits = self.module(input_ids=packed, position_ids=positions, attention_mask=mask, use_cache=True,
                             **{self._cache_arg: view}).logits  # (B, n * t, V)
        return logits.reshape(rows * repeats, t, -1)

    @torch.no_grad()
    def continue_by_copies(self, cache, ids: torch.Tensor, repeats: int) -> torch.Tensor:
        """`continue_from` through a deep copy of the cache repeated per query row, one query per row: the
        reference, and the path of every cache `reads_in_place` does not cover."""
        past, length = cache
        past = copy.deepcopy(past)
        if repeats > 1:  # every cache layer repeats its whole state (compressor buffers too)
            architecture_of(self.module).repeat_cache(past, ids.shape[0] // repeats, repeats)
        ids = ids.to(self.device)
        positions = torch.arange(length, length + ids.shape[1], device=self.device).expand(ids.shape[0], -1)
        return self.module(input_ids=ids, position_ids=positions, use_cache=True, **{self._cache_arg: past}).logits


def load_hf(path: str, device: str = "cpu", dtype: str = "float32", *, device_map: str | None = None,
            stride: int | None = None, local_window: int | None = None, gguf_file: str | None = None,
            prefill_chunk: int = 0):
    """(HFAdapter, tokenizer) for a local directory or hub name (no download happens offline).

    device_map="auto" spreads a large model over the available GPUs (needs `accelerate`); `gguf_file`
    loads that GGUF file inside `path` through transformers' GGUF support, dequantized to `dtype`
    (needs the `gguf` extra: gguf + accelerate); `prefill_chunk`: tokens per prefill forward (0: all at once)."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:  # pragma: no cover - transformers is a dependency
        raise ValueError(f"--hf needs transformers ({exc})") from None
    if dtype not in DTYPES:
        raise ValueError(f"--dtype: must be one of {list(DTYPES)}, got {dtype!r}")
    device = resolve_device(device)
    local = _local_path(path, "--hf")
    if gguf_file is not None and not (local / gguf_file).is_file():
        raise ValueError(f"--gguf-file {gguf_file}: no such file in {path}")
    if gguf_file is None and local.is_dir() and not any(local.glob("*.safetensors")) and any(local.glob("*.bin")):
        raise ValueError(f"--hf {path}: holds only pickled .bin weights; phasekv loads safetensors only (pickle "
                         "can run code): convert the weights to model.safetensors")
    # safetensors only: never unpickle weights, not even with torch's weights_only loader
    kwargs = {"dtype": getattr(torch, dtype), **({"gguf_file": gguf_file} if gguf_file else {"use_safetensors": True})}
    if device_map:
        kwargs["device_map"] = device_map
    source = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = load_tokenizer(path, gguf_file)
    try:
        hf_config = AutoConfig.from_pretrained(path, **source)
    except Exception as exc:  # noqa: BLE001 - transformers/tokenizers raise many types for a damaged model
        raise ValueError(f"--hf {path}: cannot load model/tokenizer ({_first_line(exc)})") from None
    check_causal_lm(path, hf_config, len(tokenizer))
    if not device_map:  # a device map spreads the weights over GPUs: accelerate checks what fits
        check_fits(hf_config, bytes_per_value=torch.finfo(kwargs["dtype"]).bits // 8)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except Exception as exc:  # noqa: BLE001 - transformers/tokenizers raise many types for a damaged model
        raise ValueError(f"--hf {path}: cannot load model/tokenizer ({_first_line(exc)})") from None
    if not device_map:
        model = model.to(device)
    name = Path(path).name or str(path)
    return HFAdapter(model, name, stride=stride, local_window=local_window, prefill_chunk=prefill_chunk), tokenizer


def check_causal_lm(path: str, hf_config, tokenizer_size: int) -> None:
    """Refuse, before any weight is read, a model transformers cannot load as a causal LM (a vision model such as
    ViT) and a tokenizer whose ids run past the model's embedding (another model's tokenizer)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(hf_config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"--hf {path}: config.json describes a {type(hf_config).__name__} (model_type "
                         f"{hf_config.model_type!r}), not a causal language model; phasekv evaluates next-token "
                         "prediction")
    text = hf_config.get_text_config()
    vocab = getattr(text, "vocab_size", None)
    if isinstance(vocab, int) and tokenizer_size > vocab:
        raise ValueError(f"--hf {path}: the tokenizer has {tokenizer_size} token ids but the model's embedding only "
                         f"{vocab} (vocab_size): ids from {vocab} on have no embedding; is it another model's "
                         "tokenizer?")


def load_tokenizer(path: str, gguf_file: str | None = None, flag: str = "--hf"):
    """The transformers tokenizer of a local directory or hub name (no download happens offline)."""
    from transformers import AutoTokenizer

    _local_path(path, flag)
    try:
        return AutoTokenizer.from_pretrained(path, **({"gguf_file": gguf_file} if gguf_file else {}))
    except Exception as exc:  # noqa: BLE001 - transformers/tokenizers raise many types for a damaged model
        raise ValueError(f"{flag} {path}: cannot load model/tokenizer ({_first_line(exc)})") from None


def _local_path(path: str, flag: str) -> Path:
    """`path` as a local path; refused when it looks like a path (not a hub name) but does not exist."""
    local = Path(path).expanduser()
    if (local.is_absolute() or path.startswith((".", "~"))) and not local.exists():
        raise ValueError(f"{flag} {path}: no such directory")
    return local


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
