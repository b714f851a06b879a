"""Head slicing on a bundled checkpoint of transformers' own classes (e.g. checkpoints/qwen3-full, transformers'
Qwen3 trained on the lookup task): every condition under each protocol, written as an audit-shaped summary.json
(`research/head_tables.py` reads it), and knockouts per query head and per KV head (all its query heads at once) at
the final position under `none` and the first slicing (knockout.json: accuracy by owner group of the answer token
per knocked-out head).

    python research/head_slices_checkpoint.py CHECKPOINT OUT --conditions none "slices:kind=interleaved,group=query" \
        [--protocols prefix insequence query] [--clusters 2] [--knockout-protocol prefix] [--owners SLICES]

A checkpoint trained with head slicing (phasekv's layer kind "slices", e.g. configs/cpu/slices-contiguous-4kv.yaml)
carries its slicing inside the model: run it with `--conditions none` and `--owners` naming the slicing it was
trained with (e.g. "slices:kind=contiguous,size=8"), so that its knockouts are grouped by the group (a KV head, or a
query head with group=query) that owns the answer token under that slicing.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from phasekv.conditions.head_slices import HeadSliceAdapter, parse_slices
from phasekv.evaluate.runner import predict, write_run
from phasekv.evaluate.sources import Source, eval_config, open_source
from phasekv.outputs import write_json
from phasekv.probes.hooks import QueryOnly, heads_of_kv, replace_heads
from phasekv.probes.knockout import calibration_means, calibration_set


def _safe(condition: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in condition)


def _condition(adapter, condition: str):
    return adapter if condition == "none" else HeadSliceAdapter(adapter, parse_slices(condition))


def _owner_accuracy(records, spec, groups: int) -> list[float | None]:
    out = []
    for g in range(groups):
        hits = [r["correct"] for r in records if r["answer_position"] >= spec.sink
                and (r["answer_position"] // spec.size) % groups == g]
        out.append(round(sum(hits) / len(hits), 4) if hits else None)
    return out


def owner_spec(condition: str, owners: str | None):
    """The slicing whose groups the knockouts are read by: `owners` if given, else the condition's own slicing
    (the interleaved query-head slicing for `none`).  Only a fixed slicing has one owner per position."""
    spec = parse_slices(owners or (condition if condition != "none" else "slices:kind=interleaved,group=query"))
    if spec.shift != "fixed":
        raise ValueError(f"owners {spec.name!r}: shift={spec.shift} moves the owners from layer to layer or request "
                         "to request; name a fixed slicing (shift=fixed)")
    return spec


def owner_groups(spec, info) -> int:
    """Groups of the slicing on this model: its query heads (group=query) or its KV heads (group=kv)."""
    return info.num_heads if spec.group == "query" else info.num_kv_heads


def knockouts(adapter, eval_set, condition: str, batch: int, owners: str | None = None) -> dict:
    """Each query head of each layer replaced by its calibration mean at the final position, under `condition`;
    accuracy grouped by the owner of the answer token under `owners` (`owner_spec`)."""
    spec = owner_spec(condition, owners)
    groups = owner_groups(spec, adapter.info)
    wrapped = QueryOnly(_condition(adapter, condition))
    means = calibration_means(wrapped, calibration_set(eval_set, 256), batch, True, False)
    clean = predict(wrapped, eval_set, batch, True, False)
    rows, kv_rows = [], []
    for layer in range(adapter.info.num_layers):
        for head in range(adapter.info.num_heads):
            with replace_heads(wrapped, layer, [head], means[layer]):
                records = predict(wrapped, eval_set, batch, True, False)
            rows.append({"layer": layer, "head": head,
                         "accuracy": round(sum(r["correct"] for r in records) / len(records), 4),
                         "by_answer_owner": _owner_accuracy(records, spec, groups)})
        for kv in range(adapter.info.num_kv_heads):  # every query head reading KV head kv at once
            with replace_heads(wrapped, layer, heads_of_kv(adapter, kv), means[layer]):
                records = predict(wrapped, eval_set, batch, True, False)
            kv_rows.append({"layer": layer, "kv_head": kv, "heads": heads_of_kv(adapter, kv),
                            "accuracy": round(sum(r["correct"] for r in records) / len(records), 4),
                            "by_answer_owner": _owner_accuracy(records, spec, groups)})
    return {"condition": condition, "owners_by": spec.name, "groups": groups, "n_prompts": len(clean),
            "clean": round(sum(r["correct"] for r in clean) / len(clean), 4),
            "clean_by_answer_owner": _owner_accuracy(clean, spec, groups), "rows": rows,
            "kv_rows": kv_rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("out", type=Path)
    parser.add_argument("--conditions", nargs="+", default=["none"])
    parser.add_argument("--protocols", nargs="+", default=["prefix", "insequence", "query"])
    parser.add_argument("--clusters", type=int, default=2)
    parser.add_argument("--knockout-protocol", default="prefix")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--owners", help="group the knockouts by the owner of the answer token under this fixed "
                        "slicing (for a checkpoint trained with head slicing, its own), e.g. "
                        "\"slices:kind=contiguous,size=8\"")
    args = parser.parse_args()
    if args.owners is not None:
        owner_spec("none", args.owners)  # a bad --owners fails before any evaluation
    torch.set_num_threads(1)
    started = time.perf_counter()
    source = Source(checkpoint=args.checkpoint)
    results: dict = {c: {} for c in args.conditions}
    sets = {}
    for protocol in args.protocols:
        clusters = args.clusters
        while True:  # the fewest clusters >= --clusters the protocol's record pitch allows (in-sequence: 3 here)
            try:
                adapter, eval_set = open_source(source, eval_config(source, {"protocol": protocol, "threads": 1,
                                                                             "clusters": clusters}))
                break
            except ValueError as exc:
                if "n_clusters" not in str(exc):
                    raise
                clusters += 1
        sets[protocol] = eval_set
        for condition in args.conditions:
            cond = _condition(adapter, condition)
            records = predict(cond, eval_set, args.batch_size, True, False)
            metrics = write_run(cond, eval_set, records, args.out / "conditions" / _safe(condition) / protocol)
            results[condition][protocol] = metrics
    summary = {"model": adapter.info.name, "conditions": results, "elapsed_s": round(time.perf_counter() - started, 1),
               "settings": {"protocols": args.protocols, "stride": sets[args.protocols[0]].stride,
                            "clusters": args.clusters, "owners": args.owners}}
    write_json(args.out / "summary.json", summary)
    sliced = next((c for c in args.conditions if c != "none"), None)
    ko = [knockouts(adapter, sets[args.knockout_protocol], c, args.batch_size, args.owners)
          for c in ("none", sliced) if c]
    write_json(args.out / "knockout.json", ko)
    for k in ko:
        print(k["condition"], "clean", k["clean"], k["clean_by_answer_owner"])
        for r in k["rows"]:
            print(f"  L{r['layer']} H{r['head']}: {r['accuracy']:.3f} by owner {r['by_answer_owner']}")
        for r in k["kv_rows"]:
            print(f"  L{r['layer']} KV{r['kv_head']}: {r['accuracy']:.3f} by owner {r['by_answer_owner']}")


if __name__ == "__main__":
    main()
