"""`phasekv decide --endpoint URL` / `--launch ENGINE`: the decision audit of a model as an inference engine serves
it, every continuation scored by the engine itself, and (`--reference-hf`) beside the same weights in process.

A continuation's log-probability is read through the engine's API (`Api.continuation_logprobs`: llama.cpp forces
each continuation token with logit_bias and reads its probability from the raw softmax; vLLM returns prompt
log-probabilities of prompt + continuation), both exact, and each API's method is recorded in summary.json
(`scoring`) and printed.  The engine's own compression is what is audited, so the only condition is `none`.

With a reference, every prompt is scored by the reference too and `comparison` says, per phase of the decision
point and overall, how often the two decide alike (Wilson interval) and how far their continuation log-probabilities
lie apart (the largest and the mean absolute difference over every continuation of every prompt): the engine is
trusted where it decides as its own weights do at every phase.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from phasekv.decisions.scoring import Scorer


def endpoint_scorer(adapter) -> Scorer:
    """A `Scorer` of an `EndpointAdapter`: every continuation of every prompt scored by the engine (`none` only)."""

    def score(condition: str, prompts: Sequence) -> list[dict[str, list[float]]]:
        if condition != "none":
            raise ValueError(f"condition {condition}: a served model is audited as it serves: only none")
        pairs = [(list(p.ids), list(ids)) for p in prompts for ids in p.continuations.values()]
        values = iter(adapter.continuation_logprobs(pairs))
        return [{label: next(values) for label in p.continuations} for p in prompts]

    return score


def comparison_line(comparison: dict[str, Any]) -> str:
    overall = comparison["overall"]
    lowest = min(comparison["per_phase"], key=lambda g: g["agreement"])
    return (f"engine vs reference: {overall['agree']}/{overall['n']} decisions agree "
            f"({100 * overall['agreement']:.1f}% [{100 * overall['ci_low']:.1f}, {100 * overall['ci_high']:.1f}]; "
            f"lowest phase {lowest['phase']}: {100 * lowest['agreement']:.1f}%), continuation log-probabilities "
            f"{overall['mean_abs_logp_diff']:.4f} apart on average, {overall['max_abs_logp_diff']:.4f} at most")


@contextlib.contextmanager
def launched_endpoint(engine_name: str, binary: str | None, model: Path, context: int):
    """The URL of `engine_name` (llama-server, vllm) serving `model` with its default settings, one slot of
    `context` tokens, stopped when the block ends."""
    from phasekv.engines.registry import default_binary, launcher, started

    engine = launcher(engine_name)
    with started(engine, Path(binary) if binary else default_binary(engine), model, {}, context=context) as url:
        yield url, engine.api


def decide_endpoint(options, set_name: str, out: str | Path, *, geometry, shifts: int | None,
                    run: dict[str, Any]) -> dict[str, Any]:
    """`phasekv decide --endpoint`: the set's prompts scored by the served model (`options`: EndpointOptions),
    with `run["reference_hf"]` also in process (`device`, `dtype`, `gguf_file`, `batch_size` in `run`); `run` also
    holds items, minimum_pp, n_perm, seed, force, resume, progress."""
    from phasekv.adapters.hf import load_hf
    from phasekv.decisions.pipeline import adapter_scorer, prompt_set, run_decide
    from phasekv.engines.client import open_endpoint

    reference = None
    if run.get("reference_hf") is not None:
        base, _ = load_hf(run["reference_hf"], run.get("device", "auto"), run.get("dtype", "float32"),
                          gguf_file=options.gguf_file)
        reference = adapter_scorer(base, geometry, batch_size=run.get("batch_size", 8),
                                   progress=run.get("progress", True))
    adapter, tokenizer = open_endpoint(options)
    try:
        prompts, settings = prompt_set(tokenizer, set_name, geometry, shifts, run)
        settings.update({"model": adapter.info.name, "conditions": ["none"], "scoring": adapter.api.scoring,
                         "engine": adapter.settings(), "reference": run.get("reference_hf")})
        return run_decide(endpoint_scorer(adapter), prompts, out, conditions=("none",), settings=settings,
                          reference=reference, force=run.get("force", False), resume=run.get("resume", False),
                          progress=run.get("progress", True))
    finally:
        adapter.close()
