"""Opening what evaluation and the probes measure: a checkpoint or a transformers model, and its prompts.

`open_source(Source(checkpoint=DIR) or Source(hf=PATH), EvalConfig)` returns the model's adapter and
the prompt set the settings describe.  For a checkpoint (either model family), the number of
records, the vocabulary and the local window default to those of its training data (tested in
distribution), and the `eval` section of its config.json supplies the settings the caller leaves
unset (`eval_config`); the paper's 64 records + 8 demonstrations is the default for HF models.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phasekv.checkpoint import load_checkpoint, read_experiment
from phasekv.config import DataConfig, EvalConfig, from_section
from phasekv.data.protocols import EvalSet, build_eval_set
from phasekv.data.vocab import Vocabulary
from phasekv.distributed import resolve_device
from phasekv.evaluate.adapter import Adapter, adapter_for

DEFAULT_STRIDE = 8  # phase stride assumed for models without compression (override with stride)
HF_DEFAULTS = {"n_records": 64, "key_tokens": 1, "value_tokens": 1, "local_window": 16}


@dataclass
class Source:
    """Exactly one of: a phasekv checkpoint or run directory, a transformers model (directory or name)."""

    checkpoint: str | None = None
    hf: str | None = None

    def __post_init__(self) -> None:
        if (self.checkpoint is None) == (self.hf is None):
            raise ValueError("source: give exactly one of --checkpoint and --hf")


def eval_config(source: Source, given: dict[str, Any]) -> EvalConfig:
    """The settings: the checkpoint's `eval` section (if any), overridden by `given` (e.g. command-line flags)."""
    base: dict[str, Any] = {}
    if source.checkpoint is not None:
        saved = read_experiment(source.checkpoint).get("eval")
        if saved is not None and not isinstance(saved, dict):
            raise ValueError(f"checkpoint {source.checkpoint}: config.json's eval section must be a mapping, "
                             f"got {type(saved).__name__}")
        base = saved or {}
    return from_section(EvalConfig, {**base, **given}, "eval")


def checkpoint_eval_defaults(path: str | Path) -> dict[str, Any]:
    """Eval-set settings that test a checkpoint in distribution (from its training data)."""
    tree = read_experiment(path)
    if "vocab" not in tree:
        raise ValueError(f"checkpoint {path}: config.json has no 'vocab' (not written by phasekv train)")
    data = from_section(DataConfig, tree.get("data"), "data")
    try:
        vocab = Vocabulary.from_dict(tree["vocab"])
    except (TypeError, AttributeError, KeyError) as exc:  # a hand-edited vocab of the wrong shape
        raise ValueError(f"checkpoint {path}: config.json's vocab is malformed ({exc})") from None
    return {"vocab": vocab, "n_records": data.n_records, "key_tokens": data.key_tokens,
            "value_tokens": data.value_tokens,
            "local_window": tree["model"].get("local_window", data.local_window)}


def open_checkpoint(path: str | Path, device: str = "cpu") -> tuple[Adapter, dict[str, Any]]:
    """The adapter of a checkpoint of either family, and its in-distribution eval defaults (vocab included)."""
    defaults = checkpoint_eval_defaults(path)
    model, config = load_checkpoint(path, device=resolve_device(device))
    if defaults["vocab"].size > config.vocab_size:
        raise ValueError(f"checkpoint {path}: its vocabulary has {defaults['vocab'].size} words but the model has "
                         f"only {config.vocab_size} token ids (model.vocab_size)")
    return adapter_for(model, Path(path).resolve().name), defaults


def make_eval_set(adapter: Adapter, vocab, protocol: str, stride: int | None = None, **settings) -> EvalSet:
    """The prompt set for `adapter`; stride defaults to the model's compression stride."""
    stride = stride or adapter.info.stride or DEFAULT_STRIDE
    eval_set = build_eval_set(vocab, protocol, stride=stride, **settings)
    adapter.check_length(eval_set.prompt_length)
    return eval_set


def open_model(source: Source, cfg: EvalConfig) -> tuple[Adapter, Any, dict[str, Any]]:
    """(adapter, vocabulary, defaults for records / key and value tokens / local window)."""
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    if source.hf is not None:
        from phasekv.evaluate.hf import load_hf

        adapter, tokenizer = load_hf(source.hf, cfg.device, cfg.dtype, cfg.device_map, stride=cfg.stride,
                                     local_window=cfg.local_window, gguf_file=cfg.gguf_file)
        return (adapter, *tokenizer_vocabulary(tokenizer, cfg))
    adapter, defaults = open_checkpoint(source.checkpoint, cfg.device)
    return adapter, defaults.pop("vocab"), defaults


def tokenizer_vocabulary(tokenizer, cfg: EvalConfig) -> tuple[Any, dict[str, Any]]:
    """The vocabulary of a transformers tokenizer's prompts: `cfg.format`'s pieces, or bare single-token
    words without a format; and the defaults for records / key and value tokens / local window."""
    from phasekv.evaluate.hf import TokenizerVocabulary

    if cfg.format is not None:
        from phasekv.data.formats import FormatVocabulary, load_format

        vocab = FormatVocabulary(load_format(cfg.format, cfg.chat), tokenizer)
        kt, vt = vocab.record_shape
        return vocab, {**HF_DEFAULTS, "n_records": 24, "key_tokens": kt, "value_tokens": vt}
    n = cfg.records or HF_DEFAULTS["n_records"]
    vocab = TokenizerVocabulary(tokenizer, {"keys": _words_needed(n, cfg.key_tokens or 1), "values": 16,
                                            "fillers": 8})
    return vocab, dict(HF_DEFAULTS)


def prompt_settings(cfg: EvalConfig, defaults: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `build_eval_set` that `cfg` describes (unset fields: `defaults`)."""
    return {
        "n_records": cfg.records or defaults["n_records"], "n_demos": cfg.demos,
        "residue_modulus": cfg.residue_modulus, "n_clusters": cfg.clusters,
        "targets_per_context": cfg.targets_per_context,
        "key_tokens": cfg.key_tokens or defaults["key_tokens"],
        "value_tokens": cfg.value_tokens or defaults["value_tokens"],
        "local_window": cfg.local_window or defaults["local_window"], "seed": cfg.seed,
    }


def open_source(source: Source, cfg: EvalConfig) -> tuple[Adapter, EvalSet]:
    """The adapter and the prompt set `cfg` describes (unset fields: the model's own values)."""
    adapter, vocab, defaults = open_model(source, cfg)
    return adapter, make_eval_set(adapter, vocab, cfg.protocol, cfg.stride, **prompt_settings(cfg, defaults))


# contexts per forward for phasekv checkpoints: small batches keep a forward's activations in the CPU caches
# (measured, `predict` of the 13,824 in-sequence prompts of checkpoints/w8s8-4kv, one thread, quiet 2-core
# machine: 13.4-15.7 s at 256, 10.2 s at 64, 9.2-10.0 s at 32, 9.5 s at 16)
CHECKPOINT_BATCH = 32


def batch_size(source: Source, cfg: EvalConfig) -> int:
    """Query rows per forward: the setting, else 32 for HF models and CHECKPOINT_BATCH for checkpoints."""
    return cfg.batch_size or (32 if source.hf is not None else CHECKPOINT_BATCH)


def _words_needed(n_records: int, key_tokens: int) -> int:
    """Single-token key words needed for n_records distinct keys of key_tokens tokens."""
    k = 1
    while k ** key_tokens < n_records:
        k += 1
    return max(k, 2)
