"""Hugging Face causal LMs: loading, and a token-exact vocabulary of single-token words.

The lookup prompts need keys, values and fillers that are each exactly ONE token of the model's
tokenizer (records of k tokens use k such words), so that every position and phase is known.
`TokenizerVocabulary` tries the phasekv word lists (animals, person names, filler words), each
with a leading space as it appears in running text, and keeps those the tokenizer encodes as one
token.  It implements the small part of `phasekv.data.Vocabulary` that the prompt builders use.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from phasekv.data.vocab import _BASE, _words
from phasekv.distributed import resolve_device
from phasekv.evaluate.adapter import HFAdapter
from phasekv.families import check_fits

DTYPES = ("float32", "float16", "bfloat16", "float64")

log = logging.getLogger(__name__)


class TokenizerVocabulary:
    """Groups of single-token words of a transformers tokenizer (the bare synthetic format: no framing)."""

    header: tuple[int, ...] = ()  # no prose around the records (see phasekv.data.formats for framed prompts)
    tail: tuple[int, ...] = ()
    haystack_tokens = 0

    def __init__(self, tokenizer, need: dict[str, int]):
        self.tokenizer = tokenizer
        self._groups: dict[str, list[int]] = {}
        taken: set[int] = set()
        for group, n in need.items():
            found = []
            for word in _words(_BASE[group], 4 * len(_BASE[group])):
                ids = tokenizer.encode(" " + word, add_special_tokens=False)
                if len(ids) == 1 and ids[0] not in taken:
                    found.append(ids[0])
                    taken.add(ids[0])
                if len(found) == n:
                    break
            if len(found) < n:
                raise ValueError(f"tokenizer: only {len(found)} single-token {group} words found, need {n} "
                                 f"(lower --records / use multi-token records with --key-tokens)")
            self._groups[group] = found
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if bos is None:
            raise ValueError("tokenizer: has neither a bos nor an eos token to start prompts with")
        self._groups["specials"] = [bos]
        self._groups.setdefault("background", [])

    @property
    def bos(self) -> int:
        return self._groups["specials"][0]

    @property
    def size(self) -> int:
        return len(self.tokenizer)

    def group(self, name: str) -> list[int]:
        if name not in self._groups:
            raise ValueError(f"group: unknown {name!r}; known: {sorted(self._groups)}")
        return list(self._groups[name])

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    def to_dict(self) -> dict:
        return {"groups": {g: [self.tokenizer.decode([i]) for i in ids] for g, ids in self._groups.items()}}


def load_hf(path: str, device: str = "cpu", dtype: str = "float32", device_map: str | None = None,
            stride: int | None = None, local_window: int | None = None, gguf_file: str | None = None):
    """(HFAdapter, tokenizer) for a local directory or hub name (no download happens offline).

    device_map="auto" spreads a large model over the available GPUs (needs `accelerate`); `gguf_file`
    loads that GGUF file inside `path` through transformers' GGUF support, dequantized to `dtype`
    (needs the `gguf` extra: gguf + accelerate)."""
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
    return HFAdapter(model, name, stride=stride, local_window=local_window), tokenizer


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
