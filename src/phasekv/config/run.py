"""The run sections of an experiment (`data`, `train`, `eval`), an audit's settings and the resolved
`Experiment`.

An experiment file has top-level sections `model`, `data`, `train` and optionally `eval` and `notes`;
each section is a plain mapping.  Cross-field rules live in each class's `__post_init__`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phasekv.config.fields import check_fields, from_section, short, spec
from phasekv.config.files import SECTIONS, apply_overrides, load_yaml
from phasekv.config.model import ModelConfig, TransformersModelConfig, model_config_from_dict

PROTOCOLS = ("prefix", "insequence")  # the padding protocols: the query position is fixed, the target moves
EVAL_PROTOCOLS = (*PROTOCOLS, "query")  # and the query-phase protocol: the target is fixed, the prompt length moves
REPORT_TO = ("none", "tensorboard", "wandb", "trackio")  # the loggers of `train.report_to` (phasekv.training.report)


@dataclass
class DataConfig:
    """Lengths, mixture and vocabulary of the training data (the `data` section of an experiment)."""

    n_records: int = spec(32, low=1, high=1 << 16)
    n_queries: int = spec(32, low=1, high=1 << 16)
    key_tokens: int = spec(1, low=1, high=64)
    value_tokens: int = spec(1, low=1, high=64)
    prefix_max: int = spec(23, low=0, high=1 << 16)  # prefix fillers ~ U{0..prefix_max}
    outer_max: int = spec(23, low=0, high=1 << 16)  # fillers between records and queries ~ U{0..outer_max}
    gap_fillers: int = spec(0, low=0, high=1 << 20)  # fillers scattered at random between records
    local_window: int = spec(16, low=1, high=1 << 20)  # the model's raw window; supervised only outside it
    background_fraction: float = spec(0.25, low=0.0, high=1.0)
    # share of the other examples that are a random key/value word sequence shown twice, every token of the second
    # copy supervised: a dense signal for the two-layer induction circuit token-level attention needs (0: none)
    repeat_fraction: float = spec(0.0, low=0.0, high=1.0)
    background_successors: int = spec(4, low=1, high=1 << 16)
    chain_seed: int = spec(0, low=0)  # fixes the background Markov chain (the "language")
    n_keys: int = spec(64, low=1, high=1 << 16)
    n_values: int = spec(64, low=1, high=1 << 16)
    n_fillers: int = spec(16, low=1, high=1 << 16)
    n_background: int = spec(64, low=1, high=1 << 16)
    curriculum_start: int = spec(0, low=0)  # records per example at the start of training (0: none)
    curriculum_examples: int = spec(0, low=0)  # examples over which the count ramps to n_records

    def __post_init__(self) -> None:
        check_fields(self, "data")
        if self.background_successors > self.n_background:
            raise ValueError(f"data.background_successors: {self.background_successors} exceeds n_background="
                             f"{self.n_background}")
        if self.n_records > self.n_keys ** self.key_tokens:
            raise ValueError(f"data.n_records: {self.n_records} distinct keys needed, only "
                             f"{self.n_keys ** self.key_tokens} exist (n_keys ** key_tokens)")
        if self.curriculum_start and not (2 <= self.curriculum_start <= self.n_records and self.curriculum_examples):
            raise ValueError(f"data.curriculum_start: must be in [2, n_records={self.n_records}] with "
                             f"curriculum_examples >= 1, got {self.curriculum_start}, {self.curriculum_examples}")
        if self.gap_fillers and self.n_records < 2:
            raise ValueError("data.gap_fillers: needs n_records >= 2 (fillers go between records)")
        reach = (self.n_records - 1) * self.record_length + self.key_tokens
        if reach < self.local_window:
            raise ValueError(f"data.n_records: {self.n_records} records are too few: no query can lie outside the "
                             f"local_window={self.local_window} of its record")

    @property
    def record_length(self) -> int:
        return self.key_tokens + self.value_tokens

    @property
    def seq_len(self) -> int:
        """Length of every training sequence (lookup and background alike)."""
        return (1 + self.prefix_max + self.outer_max + self.gap_fillers
                + (self.n_records + self.n_queries) * self.record_length)


@dataclass
class TrainConfig:
    steps: int = spec(1000, low=1, high=1 << 30)
    batch_size: int = spec(64, low=1, high=1 << 20)  # global batch (sequences per step, all ranks)
    grad_accum: int = spec(1, low=1, high=1 << 16)
    lr: float = spec(3e-3, positive=True, high=10.0)
    min_lr_ratio: float = spec(0.1, low=0.0, high=1.0)
    warmup_steps: int = spec(50, low=0)
    # earlier cosine horizons, increasing: up to step h the cosine decays over h steps, then over the next
    # horizon, finally over `steps`: the schedule of a run resumed with a larger train.steps, in one run
    lr_horizons: list = spec(factory=list)
    weight_decay: float = spec(0.1, low=0.0)
    beta1: float = spec(0.9, low=0.0, high=1.0)
    beta2: float = spec(0.95, low=0.0, high=1.0)
    grad_clip: float = spec(1.0, positive=True)
    gate_lr_mult: float = spec(1.0, low=0.0)  # learning-rate multiplier of the compressor gates
    indexer_loss_weight: float = spec(1.0, low=0.0)  # weight of the indexer's KL objective (models with one)
    indexer_dense_steps: int = spec(0, low=0)  # first steps with every indexer candidate selected (dense warm-up)
    window_jitter: bool = False  # each step shifts every compressor's window grid by a random 0..S-1 (a phase fix)
    seed: int = spec(42, low=0)
    log_every: int = spec(10, low=1)
    eval_every: int = spec(100, low=1)
    eval_sequences: int = spec(256, low=1, high=1 << 20)
    checkpoint_every: int = spec(200, low=1)
    keep_checkpoints: int = spec(2, low=1, high=1000)
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N" (checked by phasekv.distributed)
    threads: int = spec(0, low=0, high=1024)  # torch CPU threads (0: torch's default)
    save_dtype: str = spec("float32", choices=("float32", "float16", "bfloat16"))  # final weights' dtype
    report_to: str = spec("none", choices=REPORT_TO)  # metrics.jsonl's rows also to this logger
    phase_check_prompts: int = spec(0, low=0, high=4096)  # prompts per phase of the phase check at each validation
    # a warm start: a checkpoint or run directory whose weights (same model but max_position_embeddings) start a
    # new run; the optimizer starts afresh ("": random initialization).  A resumed run reads its own checkpoint
    init_from: str = ""

    # fields that may change when a run is resumed (everything else must match the saved run)
    RESUMABLE = ("steps", "log_every", "eval_every", "checkpoint_every", "keep_checkpoints", "threads", "device",
                 "report_to", "phase_check_prompts")

    def __post_init__(self) -> None:
        check_fields(self, "train")
        if self.warmup_steps > self.steps:
            raise ValueError(f"train.warmup_steps: must be in [0, steps={self.steps}], got {self.warmup_steps}")
        bounds = [self.warmup_steps, *self.lr_horizons, self.steps]
        if any(isinstance(h, bool) or not isinstance(h, int) for h in self.lr_horizons) or any(
                a >= b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"train.lr_horizons: must be increasing integers between warmup_steps="
                             f"{self.warmup_steps} and steps={self.steps} (exclusive), got {short(self.lr_horizons)}")

    def lr_at(self, step: int) -> float:
        """Linear warmup to lr, then cosine to lr * min_lr_ratio at the horizon: the first of `lr_horizons`
        above the step, else the last step."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        horizon = next((h for h in self.lr_horizons if step < h), self.steps)
        progress = (step - self.warmup_steps) / max(1, horizon - self.warmup_steps)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class EvalConfig:
    """Settings of `phasekv eval` and the probes (the `eval` section; command-line flags override it).

    None means "the model's own value": a checkpoint's training data for records, key/value tokens
    and local window; the model's compression stride (8 without compression)."""

    protocol: str = spec("prefix", choices=EVAL_PROTOCOLS)
    stride: int | None = spec(None, low=1, high=4096)
    residue_modulus: int = spec(24, low=1, high=4096)
    records: int | None = spec(None, low=1, high=1 << 16)
    demos: int = spec(8, low=0, high=1 << 12)
    clusters: int | None = spec(None, low=1, high=1 << 16)
    targets_per_context: int | None = spec(None, low=1, high=1 << 16)
    key_tokens: int | None = spec(None, low=1, high=64)
    value_tokens: int | None = spec(None, low=1, high=64)
    local_window: int | None = spec(None, low=1, high=1 << 20)
    batch_size: int | None = spec(None, low=1, high=1 << 16)
    one_by_one: bool = False
    seed: int = spec(0, low=0)
    device: str = "auto"
    dtype: str = spec("float32", choices=("float32", "float16", "bfloat16", "float64"))
    device_map: str | None = None
    format: str | None = None  # HF models: a prompt format (phasekv.data.formats) or YAML file; None: bare words
    chat: bool = False  # HF models: wrap the format's prompts in the tokenizer's chat template
    gguf_file: str | None = None  # HF models: a GGUF file inside the model directory
    threads: int = spec(0, low=0, high=1024)  # torch CPU threads (0: torch's default); 1 when runs share cores

    def __post_init__(self) -> None:
        check_fields(self, "eval")
        if self.chat and self.format is None:
            raise ValueError("eval.chat: needs a prompt format (--format): the bare word prompts have no chat form")


# `phasekv audit`'s settings where `phasekv eval` has others (its residue modulus is the stride: R = S)
AUDIT_DEFAULTS = {"format": "records", "records": 24, "demos": 4, "stride": 8, "local_window": 16, "batch_size": 16}
DEFAULT_CONDITIONS = ("none", "select:3+keep-first:1", "mean+keep-first:1")


def audit_config(**given: Any) -> EvalConfig:
    """The EvalConfig of an audit: `given` over AUDIT_DEFAULTS, the residue modulus the stride."""
    settings = {**AUDIT_DEFAULTS, **given}
    return from_section(EvalConfig, {"residue_modulus": settings["stride"], **settings}, "eval")


@dataclass(frozen=True)
class AuditPlan:
    """What an audit evaluates on its prompt sets: the conditions (`phasekv.conditions.grammar`; `none`, the
    capability gate, always runs first), the window W of the compressing conditions, the protocols and the prompts
    per phase of each protocol's set."""

    conditions: tuple[str, ...] = DEFAULT_CONDITIONS
    window: int = 8
    protocols: tuple[str, ...] = PROTOCOLS
    prompts_per_phase: int = 192  # finds a 30 pp single-phase gap >= 80% of the time (benchmarks/verdict_power.py)


@dataclass
class Experiment:
    """A resolved experiment: typed sections plus the plain tree written to config.json."""

    model: ModelConfig | TransformersModelConfig
    data: DataConfig
    train: TrainConfig
    eval: EvalConfig
    tree: dict[str, Any]

    SECTIONS = SECTIONS  # the top-level sections a file may have (phasekv.config.files)

    @classmethod
    def from_tree(cls, tree: dict[str, Any]) -> Experiment:
        if not isinstance(tree, dict) or "model" not in tree:
            raise ValueError("config: expected a mapping with a 'model' section")
        unknown = sorted(set(tree) - set(cls.SECTIONS), key=str)
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown section; known: model, data, train, eval, notes")
        model = model_config_from_dict(tree["model"])
        data = from_section(DataConfig, tree.get("data"), "data")
        train = from_section(TrainConfig, tree.get("train"), "train")
        evaluation = from_section(EvalConfig, tree.get("eval"), "eval")
        if isinstance(model, ModelConfig) and data.local_window != model.local_window:
            raise ValueError(f"data.local_window: {data.local_window} differs from model.local_window="
                             f"{model.local_window}; retrieval must be scored outside the model's raw window")
        resolved = {"model": model.to_dict(), "data": dataclasses.asdict(data), "train": dataclasses.asdict(train),
                    "eval": dataclasses.asdict(evaluation)}
        if "notes" in tree:
            resolved["notes"] = tree["notes"]
        return cls(model, data, train, evaluation, resolved)

    @classmethod
    def from_file(cls, path: str | Path, overrides: list[str] = ()) -> Experiment:
        return cls.from_tree(apply_overrides(load_yaml(path), list(overrides)))
