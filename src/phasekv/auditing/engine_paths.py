"""The engine's other code paths for the same prompt: a prefix served from its cache, and a prompt batched with
neighbours of other lengths, each compared with the cold, alone answer (the audit's own, prompt cache off).

Prefix cache: prompt i is preceded by a request for its first c tokens with the prompt cache on, c the longest
prefix (at most length - 2) with c = i mod S, so every residue of the cached length is covered; the prompt is then
sent with the cache on, and the engine reuses c tokens (or says how many it reused: `cached`).  Batch composition:
the prompts are sent `width` at a time, concurrently, each group striding across the prompt set so that its members
have different lengths (the query protocol's lengths differ by one token per shift), to a server with `width`
slots (continuous batching puts them in one batch).  Per residue (of the cached prefix's length; of the query
position for batches): agreement with the cold answers, Wilson 95% intervals, and for the prefix path the share of
requests whose cache hit covered the whole prefix.
"""

from __future__ import annotations

from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from phasekv.auditing.decode import share
from phasekv.data.protocols import EvalSet
from phasekv.engines.client import EndpointAdapter
from phasekv.engines.wire import Answer, Connection


def ask(adapter: EndpointAdapter, ids: list[int], cache_prompt: bool, conn: Connection | None = None) -> Answer:
    """One request outside the journal (these paths are measured again, never resumed from the journal), on
    `conn` (default: the adapter's own)."""
    payload = (conn or adapter.conn).request("POST", adapter.api.path, adapter.api.body(ids, adapter.top_k,
                                                                                       adapter.model, cache_prompt))
    return adapter.api.parse(payload)[0]


def cached_length(length: int, residue: int, stride: int) -> int:
    """The longest prefix of at most length - 2 tokens whose length is `residue` mod `stride` (>= 1)."""
    top = length - 2
    cut = top - (top - residue) % stride
    return cut if cut >= 1 else cut + stride


def _per(rows: list[dict[str, Any]], key: str, extra=None) -> list[dict[str, Any]]:
    groups: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in rows:
        groups[r[key]].append(r)
    return [{key: g, **share([r["agree"] for r in groups[g]]), **(extra(groups[g]) if extra else {})}
            for g in sorted(groups)]


def prefix_reuse(adapter: EndpointAdapter, eval_set: EvalSet, limit: int | None = None) -> dict[str, Any]:
    """The prefix-cache path of the first `limit` prompts (module docstring)."""
    S, rows = eval_set.stride, []
    prompts = eval_set.prompts()[:limit]
    cold = [group[0] for group in adapter.answer([[p.ids] for p in prompts])]
    for i, (p, alone) in enumerate(zip(prompts, cold, strict=True)):
        cut = cached_length(len(p.ids), i % S, S)
        ask(adapter, p.ids[:cut], True)
        warm = ask(adapter, p.ids, True)
        rows.append({"residue": cut % S, "query_phase": (len(p.ids) - 1) % S, "agree": warm.token == alone.token,
                     "cut": cut, "cached": warm.cached})

    def hits(group):
        reported = [r for r in group if r["cached"] is not None]
        return {"cache_served_prefix": (sum(r["cached"] >= r["cut"] for r in reported) / len(reported)
                                        if reported else None)}

    return {"path": "prefix cache", "protocol": eval_set.protocol, "stride": S, "n_prompts": len(rows),
            "overall": share([r["agree"] for r in rows]), **hits(rows),
            "per_residue": _per(rows, "residue", hits), "per_query_phase": _per(rows, "query_phase")}


def batch_composition(adapter: EndpointAdapter, eval_set: EvalSet, width: int,
                      limit: int | None = None) -> dict[str, Any]:
    """The batched path of the first `limit` prompts, `width` concurrent requests at a time (module docstring)."""
    S = eval_set.stride
    prompts = eval_set.prompts()[:limit]
    cold = [group[0] for group in adapter.answer([[p.ids] for p in prompts])]
    n_groups = -(-len(prompts) // width)
    groups = [list(range(g, len(prompts), n_groups)) for g in range(n_groups)]  # striding: mixed lengths
    rows, spread = [], []
    conn = Connection(adapter.conn.url, concurrency=width)  # the adapter's own keeps one request in flight
    with ThreadPoolExecutor(width) as pool:
        for members in groups:
            answers = list(pool.map(lambda i: ask(adapter, prompts[i].ids, False, conn), members))
            spread.append(len({len(prompts[i].ids) for i in members}))
            rows += [{"query_phase": (len(prompts[i].ids) - 1) % S, "agree": a.token == cold[i].token}
                     for i, a in zip(members, answers, strict=True)]
    conn.close()
    return {"path": "batch composition", "protocol": eval_set.protocol, "stride": S, "width": width,
            "n_prompts": len(rows), "distinct_lengths_per_batch": sum(spread) / len(spread) if spread else None,
            "overall": share([r["agree"] for r in rows]), "per_query_phase": _per(rows, "query_phase")}


def paths_check(kind: str, width: int = 4, limit: int | None = None):
    """The engine grid's per-point check of one path (`prefix` or `batch`), on the query protocol's prompts
    (else the first protocol's)."""

    def check(adapter, sets, logprobs, reference) -> dict[str, Any]:
        eval_set = sets.get("query") or next(iter(sets.values()))
        if kind == "prefix":
            return prefix_reuse(adapter, eval_set, limit)
        return batch_composition(adapter, eval_set, width, limit)

    return check
