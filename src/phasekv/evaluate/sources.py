"""Opening what evaluation, the audit and the probes measure: a checkpoint or a transformers model, and every
prompt set they evaluate.

`open_source(Source(checkpoint=DIR) or Source(hf=PATH), EvalConfig)` returns the model's adapter and
the prompt set the settings describe; `audit_sets(vocab, EvalConfig, protocols, prompts_per_phase)` the
audit's prompt sets, from the same EvalConfig (`phasekv.config.audit_config`: the audit's defaults).  A
checkpoint's config.json is read once (`Source.experiment`), so settings, defaults and weights come from the same
checkpoint even while a run directory's latest pointer moves.  For a checkpoint (either model family), the number of
records, the vocabulary and the local window default to those of its training data (tested in
distribution), and the `eval` section of its config.json supplies the settings the caller leaves
unset (`eval_config`); the paper's 64 records + 8 demonstrations is the default for HF models.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phasekv.adapters.base import Adapter
from phasekv.adapters.phasekv import adapter_for
from phasekv.checkpoint import load_checkpoint, read_experiment, resolve
from phasekv.config import DataConfig, EvalConfig, from_section
from phasekv.data.protocols import EvalSet, build_eval_set
from phasekv.data.vocab import BASE_WORDS, Vocabulary, numbered_words
from phasekv.distributed import resolve_device

DEFAULT_STRIDE = 8  # phase stride assumed for models without compression (override with stride)
DEFAULT_RESIDUES = 24  # the residue modulus of the paper's protocols (a multiple of strides 4, 6, 8, 12)
HF_DEFAULTS = {"n_records": 64, "key_tokens": 1, "value_tokens": 1, "local_window": 16}

@dataclass
class Source:
    """Exactly one of: a phasekv checkpoint or run directory, a transformers model (directory or name)."""

    checkpoint: str | None = None
    hf: str | None = None

    def __post_init__(self) -> None:
        if (self.checkpoint is None) == (self.hf is None):
            raise ValueError("source: give exactly one of --checkpoint and --hf")

    @functools.cached_property
    def experiment(self) -> tuple[Path, dict[str, Any]]:
        """The checkpoint's resolved directory and its config.json, read once."""
        path = resolve(self.checkpoint)
        return path, read_experiment(path)


def eval_config(source: Source, given: dict[str, Any]) -> EvalConfig:
    """The settings: the checkpoint's `eval` section (if any), overridden by `given` (e.g. command-line flags)."""
    base: dict[str, Any] = {}
    if source.checkpoint is not None:
        saved = source.experiment[1].get("eval")
        if saved is not None and not isinstance(saved, dict):
            raise ValueError(f"checkpoint {source.checkpoint}: config.json's eval section must be a mapping, "
                             f"got {type(saved).__name__}")
        base = saved or {}
    return from_section(EvalConfig, {**base, **given}, "eval")


def checkpoint_eval_defaults(path: str | Path, tree: dict[str, Any] | None = None) -> dict[str, Any]:
    """Eval-set settings that test a checkpoint in distribution (from its training data; `tree`: its config.json,
    when already read)."""
    tree = read_experiment(path) if tree is None else tree
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


def open_checkpoint(path: str | Path, device: str = "cpu", experiment: tuple[Path, dict[str, Any]] | None = None
                    ) -> tuple[Adapter, dict[str, Any]]:
    """The adapter of a checkpoint of either family, and its in-distribution eval defaults (vocab included);
    `experiment`: the resolved checkpoint directory and its config.json, when already read (`Source.experiment`)."""
    directory, tree = experiment or (resolve(path), None)
    tree = read_experiment(directory) if tree is None else tree
    defaults = checkpoint_eval_defaults(path, tree)
    model, config = load_checkpoint(directory, device=resolve_device(device), tree=tree)
    if defaults["vocab"].size > config.vocab_size:
        raise ValueError(f"checkpoint {path}: its vocabulary has {defaults['vocab'].size} words but the model has "
                         f"only {config.vocab_size} token ids (model.vocab_size)")
    return adapter_for(model, Path(path).resolve().name), defaults


def make_eval_set(adapter: Adapter, vocab, protocol: str, stride: int | None = None, **settings) -> EvalSet:
    """The prompt set for `adapter`; stride defaults to the model's compression stride, the residue modulus (when
    not given) to 24, or to the stride itself when it does not divide 24 (R = S, as the audit: Llama 4's chunks of
    16; a multiple such as 48 leaves the training-length record lists no common target depth)."""
    stride = stride or adapter.info.stride or DEFAULT_STRIDE
    settings.setdefault("residue_modulus", stride if DEFAULT_RESIDUES % stride else DEFAULT_RESIDUES)
    eval_set = build_eval_set(vocab, protocol, stride=stride, **settings)
    adapter.check_length(eval_set.prompt_length)
    return eval_set


def open_model(source: Source, cfg: EvalConfig) -> tuple[Adapter, Any, dict[str, Any]]:
    """(adapter, vocabulary, defaults for records / key and value tokens / local window)."""
    if cfg.threads:
        import torch

        torch.set_num_threads(cfg.threads)
    if source.hf is not None:
        from phasekv.adapters.hf import load_hf

        adapter, tokenizer = load_hf(source.hf, cfg.device, cfg.dtype, device_map=cfg.device_map, stride=cfg.stride,
                                     local_window=cfg.local_window, gguf_file=cfg.gguf_file)
        return (adapter, *tokenizer_vocabulary(tokenizer, cfg))
    adapter, defaults = open_checkpoint(source.checkpoint, cfg.device, source.experiment)
    return adapter, defaults.pop("vocab"), defaults


def tokenizer_vocabulary(tokenizer, cfg: EvalConfig) -> tuple[Any, dict[str, Any]]:
    """The vocabulary of a transformers tokenizer's prompts: `cfg.format`'s pieces, or bare single-token
    words without a format; and the defaults for records / key and value tokens / local window."""
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


def audit_sets(vocab, cfg: EvalConfig, protocols: tuple[str, ...], prompts_per_phase: int) -> dict[str, EvalSet]:
    """The audit's prompt set of each protocol: `cfg`'s settings, with the fewest clusters that give at least
    `prompts_per_phase` prompts per phase (`audit_clusters`)."""
    kt, vt = vocab.record_shape
    record = kt + vt + vocab.haystack_tokens
    defaults = {"n_records": cfg.records, "key_tokens": kt, "value_tokens": vt, "local_window": cfg.local_window}
    return {p: build_eval_set(vocab, p, stride=cfg.stride, **prompt_settings(dataclasses.replace(
        cfg, clusters=audit_clusters(prompts_per_phase, record, p, cfg.stride)), defaults)) for p in protocols}


def audit_clusters(per_phase: int, record: int, protocol: str, stride: int) -> int:
    """The fewest clusters (a multiple of g = gcd(record pitch, S)) that give at least `per_phase` prompts
    per phase: a cluster is shown at S shifts with S / g targets, i.e. S / g prompts per phase.  `record`:
    the tokens of a record and its haystack prose (the pitch without in-sequence fillers)."""
    g = math.gcd(record + (1 if protocol == "insequence" else 0), stride)
    clusters = math.ceil(per_phase / (stride // g))
    return math.ceil(clusters / g) * g


# contexts per forward for phasekv checkpoints: small batches keep a forward's activations in the CPU caches
# (measured, `predict` of the 13,824 in-sequence prompts of checkpoints/w8s8-4kv, one thread, quiet 2-core
# machine: 13.4-15.7 s at 256, 10.2 s at 64, 9.2-10.0 s at 32, 9.5 s at 16)
CHECKPOINT_BATCH = 32


def batch_size(source: Source, cfg: EvalConfig) -> int:
    """Query rows per forward: the setting, else 32 for HF models and CHECKPOINT_BATCH for checkpoints."""
    return cfg.batch_size or (32 if source.hf is not None else CHECKPOINT_BATCH)


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
            for word in numbered_words(BASE_WORDS[group], 4 * len(BASE_WORDS[group])):
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


def _words_needed(n_records: int, key_tokens: int) -> int:
    """Single-token key words needed for n_records distinct keys of key_tokens tokens."""
    k = 1
    while k ** key_tokens < n_records:
        k += 1
    return max(k, 2)
