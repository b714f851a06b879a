"""The mechanism of pooled selection, not only its accuracy: per phase of the target record, how often the
answering query's selection holds the record's pool (and the pool of its answer token, which differs when the
record straddles a pool boundary), and the attention mass the query puts on those pools
(`phasekv.adapters.selection`).

Rates are over layers and selection groups (one group with heads=shared, one per KV head with heads=kv); a pool
the query attends anyway (inside its local tail or the sink) counts as attended, and is reported apart
(`fixed_share`) so a high rate from the tail is not read as the indexer's work.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from tqdm import tqdm

from phasekv.adapters.selection import SelectionAdapter, selecting


def _pool_attended(record: dict[str, torch.Tensor], row: int, pool: int, position: int, spec) -> tuple[float, float]:
    """(share of groups whose selection holds `pool`, attention mass on the pool's keys, heads averaged) of one
    layer at the last query, for a key at `position`."""
    query = int(record["query_pos"])
    fixed = position < spec.sink or query - position < spec.local
    chosen = 1.0 if fixed else float(record["selected"][row, :, pool].float().mean())
    keys = (record["key_pos"] // spec.pool) == pool
    mass = float(record["probs"][row][:, keys].sum(-1).mean())
    return chosen, mass


@torch.no_grad()
def selection_mechanism(adapter: SelectionAdapter, eval_set, per_phase: int = 8, batch_size: int = 8,
                        progress: bool = True) -> dict[str, Any]:
    """Per phase (target position mod pool): n, target_selected, answer_selected (rates in [0, 1]),
    target_mass, answer_mass, fixed_share; `per_phase` prompts of each phase, the first ones of the set."""
    spec = adapter.spec
    chosen: dict[int, list] = defaultdict(list)
    for prompt, query in zip(eval_set.prompts(), eval_set.queries(), strict=True):
        phase = query.target_position % spec.pool
        if len(chosen[phase]) < per_phase:
            chosen[phase].append((prompt, query))
    items = [item for phase in sorted(chosen) for item in chosen[phase]]
    by_length: dict[int, list] = defaultdict(list)
    for item in items:
        by_length[len(item[0].ids)].append(item)
    rows: dict[int, list[dict[str, float]]] = defaultdict(list)
    with tqdm(total=len(items), desc="selection mechanism", unit="prompt", disable=not progress, leave=False) as bar:
        for group in by_length.values():
            for start in range(0, len(group), batch_size):
                batch = group[start:start + batch_size]
                ids = torch.tensor([p.ids for p, _ in batch])
                with selecting(adapter.module, spec, adapter.indexer, record=True) as state:
                    adapter.module(input_ids=ids.to(adapter.device), use_cache=False, logits_to_keep=1)
                for row, (_, q) in enumerate(batch):
                    answer = q.target_position + len(q.key)
                    target = [_pool_attended(r, row, q.target_position // spec.pool, q.target_position, spec)
                              for r in state.recorded]
                    ans = [_pool_attended(r, row, answer // spec.pool, answer, spec) for r in state.recorded]
                    last = int(state.recorded[0]["query_pos"])
                    rows[q.target_position % spec.pool].append({
                        "target_selected": sum(c for c, _ in target) / len(target),
                        "answer_selected": sum(c for c, _ in ans) / len(ans),
                        "target_mass": sum(m for _, m in target) / len(target),
                        "answer_mass": sum(m for _, m in ans) / len(ans),
                        "fixed": float(q.target_position < spec.sink or last - q.target_position < spec.local)})
                bar.update(len(batch))
    phases = []
    for phase in sorted(rows):
        r = rows[phase]
        mean = {k: sum(x[k] for x in r) / len(r) for k in r[0]}
        phases.append({"phase": phase, "n": len(r), **{k: round(v, 4) for k, v in mean.items() if k != "fixed"},
                       "fixed_share": round(mean["fixed"], 4)})
    return {"pool": spec.pool, "indexer": spec.indexer, "per_phase": phases}
