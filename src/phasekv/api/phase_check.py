"""The phase check inside training: a small phase evaluation of the model being trained (its own compressed
attention included), every N steps, logged as flat scalars: per-phase accuracy, the mean, the worst phase, the
best-minus-worst gap with its bootstrap interval, and the verdict's parts (docs/science.md section 3) as 0/1.

Three ways in: `phase_check(model, tokenizer)` once; `PhaseCheck(...)(model, step)` in a custom loop (it runs when
`step` is a multiple of `every` and hands the metrics to `log`); `PhaseCheckCallback`, a transformers
`TrainerCallback` that logs them through the Trainer's own `log` (so `report_to` sends them to TensorBoard, W&B,
Trackio) when given the trainer, and to `log` in any case.  The prompt set is built once per check object; the
model is put back in the mode it was in.  Without a tokenizer the prompts are phasekv's word vocabulary (a model
trained by `phasekv train` on `data`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

from phasekv.config import DataConfig, EvalConfig, from_section

PREFIX = "phase/"


def vocabulary_for(tokenizer, cfg: EvalConfig, data: DataConfig | None = None) -> tuple[Any, dict[str, Any]]:
    """(vocabulary, defaults of records / key and value tokens / local window): a tokenizer's, in `cfg.format`, or
    without a tokenizer the word vocabulary of the training data `data` (DataConfig's defaults when None)."""
    from phasekv.data.vocab import Vocabulary
    from phasekv.evaluate.sources import tokenizer_vocabulary

    if tokenizer is not None:
        return tokenizer_vocabulary(tokenizer, cfg)
    data = data or DataConfig()
    return Vocabulary.from_data_config(data), {"n_records": data.n_records, "key_tokens": data.key_tokens,
                                               "value_tokens": data.value_tokens, "local_window": data.local_window}


def eval_set_for(adapter, tokenizer, cfg: EvalConfig, data: DataConfig | None = None):
    """The prompt set `cfg` describes for `adapter` (`vocabulary_for`)."""
    from phasekv.evaluate.sources import make_eval_set, prompt_settings

    vocab, defaults = vocabulary_for(tokenizer, cfg, data)
    return make_eval_set(adapter, vocab, cfg.protocol, cfg.stride, **prompt_settings(cfg, defaults))


def phase_metrics(metrics: dict[str, Any], prefix: str = PREFIX) -> dict[str, float]:
    """A metrics dict as flat scalars for a logger (`prefix` before each name)."""
    rows = metrics["per_phase"]
    low, high = metrics["gap_ci_pp"] or (math.nan, math.nan)
    parts = metrics["verdict_parts"]
    flat = {f"acc_phase_{r['phase']}": r["accuracy"] for r in rows}
    flat.update(mean_accuracy=metrics["mean_accuracy"], worst_phase_accuracy=min(r["accuracy"] for r in rows),
                gap_pp=metrics["max_gap_pp"], gap_ci_low_pp=low, gap_ci_high_pp=high,
                flatness_p=metrics["flatness_p"], can_do_task=float(parts["can_do_task"]),
                phase_dependent=float(parts["phase_dependent"]), material=float(parts["material"]),
                phase_sensitive=float(metrics["phase_sensitive"]))
    return {prefix + k: float(v) for k, v in flat.items()}


class PhaseCheck:
    """A phase evaluation of a model object every `every` steps, for a custom training loop.

    `check(model, step)` returns the flat metrics (`phase_metrics`) at multiples of `every` (else None) and passes
    them to `log(metrics, step)`; `run(model)` evaluates now and returns the full metrics (metrics.json's fields).
    tokenizer: the model's (its prompts in `prompt_format`, records by default) or None (phasekv's word
    vocabulary of `data`).  `options`: the `eval` section's fields (stride, records, demos, local_window, seed,
    batch_size, ...); by default the model's own stride, 8 without compression."""

    def __init__(self, tokenizer: Any = None, *, every: int = 100, prompts_per_phase: int = 4,
                 protocol: str = "prefix", prompt_format: str | None = None,
                 log: Callable[[dict[str, float], int], Any] | None = None, data: DataConfig | None = None,
                 **options: Any):
        for name, value in (("every", every), ("prompts_per_phase", prompts_per_phase)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"phase check: {name} must be an integer >= 1, got {value!r}")
        fmt = prompt_format or ("records" if tokenizer is not None else None)
        self.cfg = from_section(EvalConfig, {"protocol": protocol, "format": fmt, "demos": 2, **options}, "eval")
        self.tokenizer, self.every, self.per_phase, self.log, self.data = tokenizer, every, prompts_per_phase, log, data
        self.eval_set = None  # built on the first run (it needs the model's stride)

    def run(self, model) -> dict[str, Any]:
        """The full metrics of one phase evaluation of `model` now (its mode restored)."""
        import dataclasses

        from phasekv.adapters.phasekv import adapter_for
        from phasekv.api.models import restored
        from phasekv.evaluate.runner import predict, write_run
        from phasekv.evaluate.sources import DEFAULT_STRIDE, audit_clusters

        with restored(model):
            adapter = adapter_for(model, "training")
            if self.eval_set is None:
                from phasekv.evaluate.sources import make_eval_set, prompt_settings

                stride = self.cfg.stride or adapter.info.stride or DEFAULT_STRIDE
                vocab, defaults = vocabulary_for(self.tokenizer, self.cfg, self.data)
                pitch = (self.cfg.key_tokens or defaults["key_tokens"]) + (self.cfg.value_tokens or
                                                                           defaults["value_tokens"])
                pitch += getattr(vocab, "haystack_tokens", 0)
                cfg = dataclasses.replace(self.cfg, stride=stride, residue_modulus=stride, clusters=self.cfg.clusters
                                          or audit_clusters(self.per_phase, pitch, self.cfg.protocol, stride))
                self.eval_set = make_eval_set(adapter, vocab, cfg.protocol, stride, **prompt_settings(cfg, defaults))
            records = predict(adapter, self.eval_set, self.cfg.batch_size or 32, True, False, desc="phase check")
            return write_run(adapter, self.eval_set, records, None, self.cfg.seed, figures=False)

    def check(self, model, step: int) -> dict[str, float] | None:
        """At multiples of `every`: evaluate, hand the flat metrics to `log`, return them; else None."""
        if step % self.every:
            return None
        flat = phase_metrics(self.run(model))
        if self.log is not None:
            self.log(flat, step)
        return flat

    __call__ = check


def phase_check(model, tokenizer: Any = None, **options: Any) -> dict[str, float]:
    """One phase evaluation of `model` now, as flat scalars (`PhaseCheck`'s options)."""
    return phase_metrics(PhaseCheck(tokenizer, **options).run(model))


class PhaseCheckCallback(TrainerCallback):
    """A transformers TrainerCallback running a `PhaseCheck` every `every` optimizer steps on the model being
    trained.  With `trainer` (or after `attach(trainer)`) the metrics go through `trainer.log`, into
    `state.log_history` and every `report_to` integration; `log(metrics, step)` is called in any case."""

    def __init__(self, tokenizer: Any = None, *, every: int = 100, trainer=None, **options: Any):
        self.check = PhaseCheck(tokenizer, every=every, **options)
        self.trainer = trainer

    def attach(self, trainer) -> PhaseCheckCallback:
        """Log through `trainer` and be one of its callbacks."""
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is None or state.global_step % self.check.every:
            return control
        flat = self.check.check(model, state.global_step)
        if self.trainer is not None:
            self.trainer.log(dict(flat))
        return control
