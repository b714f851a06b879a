"""`phasekv.audit` and `phasekv.api.evaluate`: the commands `phasekv audit` and `phasekv eval` as Python functions
on a model object, a path or an endpoint URL (`phasekv.api.models`).

Both measure with the commands' own functions (`phasekv.auditing.pipeline.measure_audit`, the runner's `predict` and
`write_run`) and return a result object (`phasekv.api.result`); nothing is written unless `out` is given (then
OUT as the command writes it, published atomically).  A model object is left as it was found: its train/eval mode
is restored, its device and weights are untouched.

`evaluate` is not re-exported as `phasekv.evaluate`: that name is the package of the measurement code, and importing
any of its modules (`import phasekv.evaluate.runner`) sets the package attribute, which would replace a function.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from phasekv.config import AUDIT_DEFAULTS, DEFAULT_CONDITIONS, PROTOCOLS, AuditPlan, from_section

PROMPTS_PER_PHASE = AuditPlan().prompts_per_phase


def audit(model: Any, tokenizer: Any = None, *, conditions: tuple[str, ...] | list[str] = DEFAULT_CONDITIONS,  # long:
          protocols: tuple[str, ...] | list[str] = PROTOCOLS, prompt_format: str = AUDIT_DEFAULTS["format"],  # one
          prompts_per_phase: int = PROMPTS_PER_PHASE, out: str | Path | None = None,  # keyword per flag of
          **options: Any):  # `phasekv audit`, checked before anything runs
    """Audit `model` for phase sensitivity under each condition, as `phasekv audit` does; an `AuditResult`.

    model: a transformers causal LM or phasekv model object, a path (`--hf`), or an http(s) endpoint URL
    (`--endpoint`; `tokenizer` then required).  tokenizer: an object or a path (None: a path's own).  `options`:
    window, stride, local_window, records, demos, chat, seed, batch_size (the command's flags), name (the model's
    name in the result), device, dtype, gguf_file (a path's loading), api (an endpoint's server), force (replace
    an existing `out`), progress (bars; default off).  `out`: also write OUT as the command does."""
    from phasekv.api.models import open_model, restored
    from phasekv.api.result import AuditResult
    from phasekv.auditing.pipeline import measure_audit, write_audit
    from phasekv.config import audit_config
    from phasekv.engines.journal import published

    known = {"window", "stride", "local_window", "records", "demos", "chat", "seed", "batch_size", "name", "device",
             "dtype", "gguf_file", "api", "force", "progress"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"audit: unknown option {unknown[0]!r} (options: {', '.join(sorted(known))})")
    plan = audit_plan(conditions, protocols, prompts_per_phase, options.get("window", AuditPlan().window))
    prompt_keys = ("stride", "local_window", "records", "demos", "chat", "seed", "batch_size")
    cfg = audit_config(format=prompt_format, **{k: options[k] for k in prompt_keys if k in options})
    check_prompts(cfg.records, cfg.demos)
    force, progress = bool(options.get("force", False)), bool(options.get("progress", False))
    if out is not None:
        from phasekv.outputs import check_output_dir

        check_output_dir(Path(out), force)  # before loading anything
    from phasekv.conditions.grammar import Geometry, check_conditions

    check_conditions(("none", *plan.conditions), Geometry(plan.window, cfg.stride, cfg.local_window))
    if tokenizer is None and not isinstance(model, (str, Path)):
        raise ValueError("audit: needs the model's tokenizer (an object or a path): the prompts are text in a format")
    with restored(model):
        adapter, tokenizer = open_model(model, tokenizer, **{k: options[k] for k in ("name", "device", "dtype",
                                                                                     "gguf_file", "api")
                                                             if k in options})
        try:
            with published(out, force) if out is not None else contextlib.nullcontext() as tmp:
                summary, runs = measure_audit(adapter, tokenizer, cfg, plan=plan, progress=progress)
                write_audit(summary, runs, tmp)
        finally:
            if hasattr(adapter, "close"):  # an endpoint's connections
                adapter.close()
    return AuditResult(summary, runs)


def audit_plan(conditions, protocols, prompts_per_phase: int, window: int) -> AuditPlan:
    """The AuditPlan of the API's arguments, each checked (one-line ValueErrors)."""
    from phasekv.config import EVAL_PROTOCOLS

    conditions, protocols = _names(conditions, "conditions"), _names(protocols, "protocols")
    bad = [p for p in protocols if p not in EVAL_PROTOCOLS]
    if bad or not protocols:
        raise ValueError(f"protocols: each one of {', '.join(EVAL_PROTOCOLS)}, got {list(protocols)}")
    for name, value in (("prompts_per_phase", prompts_per_phase), ("window", window)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
    return AuditPlan(tuple(dict.fromkeys(conditions)), window, tuple(dict.fromkeys(protocols)), prompts_per_phase)


def _names(value, what: str) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{what}: a list of names, got {value!r}")
    return tuple(value)


def check_prompts(records: int, demos: int) -> None:
    """A prompt holds a target and its demonstrations, as `phasekv audit` checks its flags."""
    if records < demos + 1:
        raise ValueError(f"records: {records} records cannot hold a target and {demos} demonstrations of other "
                         "records (demos)")


def evaluate(model: Any, tokenizer: Any = None, *, protocol: str = "prefix", prompt_format: str | None = None,
             out: str | Path | None = None, **options: Any):
    """Evaluate `model` as `phasekv eval` does, on one protocol's prompt set; an `EvalResult`.

    model, tokenizer: as `audit`'s (a phasekv model without a tokenizer is evaluated on its training data's word
    vocabulary).  `options`: the `eval` section's fields (stride, residue_modulus, records, demos, clusters,
    key_tokens, value_tokens, local_window, batch_size, seed, chat, ...), name, device, dtype, gguf_file, api,
    force, progress.  `out`: also write metrics.json, predictions.jsonl and the figure there."""
    from phasekv.api.models import open_model, restored
    from phasekv.api.phase_check import eval_set_for
    from phasekv.api.result import EvalResult
    from phasekv.config import EvalConfig
    from phasekv.evaluate.runner import predict, write_run
    from phasekv.outputs import output_dir

    loading = {k: options.pop(k) for k in ("name", "device", "dtype", "gguf_file", "api") if k in options}
    force, progress = bool(options.pop("force", False)), bool(options.pop("progress", False))
    cfg = from_section(EvalConfig, {"protocol": protocol, "format": prompt_format, **options}, "eval")
    with restored(model):
        adapter, tokenizer = open_model(model, tokenizer, **loading)
        try:
            eval_set = eval_set_for(adapter, tokenizer, cfg)
            records = predict(adapter, eval_set, cfg.batch_size or 32, not cfg.one_by_one, progress)
            metrics = write_run(adapter, eval_set, records, None, cfg.seed)
        finally:
            if hasattr(adapter, "close"):
                adapter.close()
    result = EvalResult(metrics, records, prompt_format=cfg.format)
    if out is not None:
        with output_dir(out, force) as tmp:
            result.write_into(tmp)
    return result
