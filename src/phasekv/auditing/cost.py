"""What an audit costs before it starts (`phasekv audit --dry-run`): requests, prompt tokens and a time estimate.

A served model answers one request per prompt (the engine's own compression is the one condition), so its cost is
the prompt set's size: requests = prompts, tokens = the sum of their lengths.  An in-process model is evaluated once
per condition.  The time estimate divides the tokens by a throughput: `--tokens-per-s` (one server's prefill rate;
several `--endpoint` replicas share the work), else, for an endpoint, the rate of one timed probe request (the first
prompt), which is the only request a dry run sends; nothing is written.
"""

from __future__ import annotations

import time
from typing import Any


def set_size(eval_set) -> tuple[int, int]:
    """(prompts, prompt tokens) of one prompt set, without building its prompts where it can say (`size()`)."""
    if hasattr(eval_set, "size"):
        return eval_set.size()
    if hasattr(eval_set, "n_prompts"):  # a long-context set: prompts of its context's length (query: up to it)
        R = eval_set.spec.modulus
        short = sum(R - 1 - s for s in range(R)) if eval_set.spec.protocol == "query" else 0
        return eval_set.n_prompts, eval_set.n_prompts * eval_set.prompt_length - eval_set.n_clusters * short
    prompts = eval_set.prompts()
    return len(prompts), sum(len(p.ids) for p in prompts)


def run_cost(sets: dict[str, Any], *, conditions: int = 1, endpoints: int = 1,
             tokens_per_s: float | None = None) -> dict[str, Any]:
    """Per protocol and in all: prompts, prompt tokens, longest prompt; requests (prompts x conditions); and, with a
    throughput, the estimated seconds."""
    protocols = {}
    for name, eval_set in sets.items():
        prompts, tokens = set_size(eval_set)
        protocols[name] = {"prompts": prompts, "prompt_tokens": tokens, "longest_prompt": eval_set.prompt_length}
    total = sum(p["prompt_tokens"] for p in protocols.values()) * conditions
    cost = {"protocols": protocols, "conditions": conditions, "endpoints": endpoints,
            "requests": sum(p["prompts"] for p in protocols.values()) * conditions, "prompt_tokens": total,
            "tokens_per_s": tokens_per_s, "seconds": None}
    if tokens_per_s is not None:
        cost["seconds"] = total / (tokens_per_s * endpoints)
    return cost


def probe_rate(adapter, eval_set) -> float:
    """Prompt tokens per second of one timed request (the set's first prompt) to a served model."""
    ids = next(iter(eval_set.prompts())).ids
    start = time.perf_counter()
    adapter.answer([[ids]])
    return len(ids) / max(time.perf_counter() - start, 1e-6)


def cost_lines(cost: dict[str, Any], rate_source: str = "--tokens-per-s") -> list[str]:
    """The dry run's printout: one line per protocol, the total, the estimate."""
    lines = [f"{name}: {p['prompts']:,} prompts, {p['prompt_tokens']:,} prompt tokens (longest {p['longest_prompt']:,})"
             for name, p in cost["protocols"].items()]
    per = f" x {cost['conditions']} conditions" if cost["conditions"] > 1 else ""
    lines.append(f"in all: {cost['requests']:,} requests{per}, {cost['prompt_tokens']:,} prompt tokens")
    if cost["seconds"] is None:
        lines.append("time: give --tokens-per-s (one server's prefill rate) for an estimate")
    else:
        spread = f" over {cost['endpoints']} endpoints" if cost["endpoints"] > 1 else ""
        lines.append(f"time: about {_duration(cost['seconds'])} at {cost['tokens_per_s']:,.0f} prompt tokens/s "
                     f"({rate_source}){spread}")
    return lines


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
