"""An endpoint audit spread over machines: `phasekv audit --endpoint ... --shard I/N` answers every N-th prompt
(those whose index in the whole prompt set, protocols in order, is I mod N) and publishes its journal with
shard.json; `phasekv audit merge DIR... --out OUT` checks that the shards are the N parts of one run (the same prompt
set, the same audit and engine settings, every index once), joins their answers and computes the audit from them
with no server at all: the summary is the one an unsharded run of the same settings publishes (tested).

A shard's shard.json holds what the merge needs to rebuild the prompt set (the audit's EvalConfig and plan, the
tokenizer's path) and to describe the served model as an unsharded run would (its name, settings, context and
report).
"""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path
from typing import Any

from tqdm import tqdm

from phasekv.adapters.base import ModelInfo
from phasekv.config import AuditPlan, EvalConfig
from phasekv.engines.client import EndpointAdapter
from phasekv.engines.journal import JOURNAL_NAME, Journal, journal_path, prompt_key, prompt_set_key, published
from phasekv.engines.registry import api as api_named
from phasekv.engines.wire import EndpointError
from phasekv.outputs import write_json

SHARD_FILE = "shard.json"
SHARD_VERSION = 1


def parse_shard(text: str) -> tuple[int, int]:
    """`I/N` -> (I, N), 0 <= I < N."""
    index, sep, count = text.partition("/")
    if not (sep and index.isascii() and index.isdigit() and count.isascii() and count.isdigit()):
        raise ValueError(f"--shard {text}: must be I/N, e.g. 0/4 (shard I of N, counted from 0)")
    i, n = int(index), int(count)
    if not 0 <= i < n or n > 1 << 16:
        raise ValueError(f"--shard {text}: needs 0 <= I < N <= 65536")
    return i, n


def _prompts(sets: dict[str, Any]) -> list[list[int]]:
    return [p.ids for s in sets.values() for p in s.prompts()]


def run_shard(adapter: EndpointAdapter, sets: dict[str, Any], out: str | Path, *, shard: tuple[int, int],
              audit: dict[str, Any], force: bool = False, progress: bool = True) -> dict[str, Any]:
    """Answer this shard's prompts of `sets` through `adapter` and publish OUT (journal, endpoint.json, shard.json).
    `audit`: what the merge rebuilds the prompt set from (`audit_record`)."""
    i, n = shard
    prompts = _prompts(sets)
    mine = [ids for index, ids in enumerate(prompts) if index % n == i]
    key = prompt_set_key(prompts)
    with published(out, force, adapter) as tmp:
        if adapter.journal is not None:
            adapter.journal.bind("prompt_set", key)
        adapter.check_length(max(len(ids) for ids in prompts))
        step = max(1, adapter.concurrency * len(adapter.conns) * 4)
        for start in tqdm(range(0, len(mine), step), desc=f"shard {i}/{n}", unit="batch", disable=not progress):
            adapter.answer([[ids] for ids in mine[start:start + step]])
        record = {"shard_version": SHARD_VERSION, "shard": i, "of": n, "prompt_set": key, "prompts": len(mine),
                  "audit": audit, "model": adapter.info.name, "engine": adapter.settings(),
                  "context": adapter.info.max_length + 1, "engine_report": adapter.report()}
        write_json(tmp / SHARD_FILE, record)
    return record


def audit_record(cfg: EvalConfig, plan: AuditPlan, *, tokenizer: str, gguf_file: str | None) -> dict[str, Any]:
    """What a shard stores for the merge to rebuild its prompt set."""
    return {"config": dataclasses.asdict(cfg), "plan": dataclasses.asdict(plan), "tokenizer": tokenizer,
            "gguf_file": gguf_file}


class _Replay(EndpointAdapter):
    """A served model's answers, joined from the shards' journals: every prompt answered from them, none sent."""

    def __init__(self, record: dict[str, Any], answers: dict, vocab_size: int):  # no server: no super().__init__
        engine = record["engine"]
        self.api, self.top_k = api_named(engine["api"]), engine["top_k"]
        self.concurrency, self.reuse_prefix = engine["concurrency"], engine["reuse_prefix"]
        self.conns, self.conn, self.model, self.cache_config = [], None, engine["model"], engine["server_cache"]
        self.info = ModelInfo(name=record["model"], vocab_size=vocab_size, num_layers=0, num_heads=0, num_kv_heads=0,
                              head_dim=0, max_length=record["context"] - 1, stride=None, local_window=None)
        self.journal, self.answers, self.sent, self.answered_by = None, dict(answers), 0, {}
        self._lock, self.recorded_report, self.recorded_settings = threading.Lock(), record["engine_report"], engine

    def settings(self) -> dict[str, Any]:
        return dict(self.recorded_settings)

    def report(self) -> dict[str, Any] | None:
        return self.recorded_report

    def _send_group(self, prompts, keys) -> None:
        missing = next(k for k in keys if k not in self.answers)
        raise EndpointError(f"audit merge: prompt {missing} was answered by no shard")

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()


def _read_shards(dirs: list[Path]) -> list[dict[str, Any]]:
    records = []
    for d in dirs:
        path = d / SHARD_FILE
        try:
            record = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"audit merge: {d} holds no {SHARD_FILE}: not the output of an --shard run") from None
        except (ValueError, RecursionError):
            raise ValueError(f"audit merge: {path} is not JSON") from None
        if not isinstance(record, dict) or record.get("shard_version") != SHARD_VERSION:
            raise ValueError(f"audit merge: {path} is not a phasekv shard record")
        records.append({**record, "dir": d})
    first = records[0]
    for record in records[1:]:
        for field in ("of", "prompt_set", "audit", "engine", "model"):
            if record[field] != first[field]:
                raise ValueError(f"audit merge: {record['dir']} and {first['dir']} differ in {field}: shards of one "
                                 "run share the prompt set, the audit and the engine settings")
    indices = sorted(r["shard"] for r in records)
    if indices != list(range(first["of"])):
        raise ValueError(f"audit merge: shards {indices} given, a run of {first['of']} needs each of "
                         f"0..{first['of'] - 1} once")
    return sorted(records, key=lambda r: r["shard"])


def merge_shards(dirs: list[str | Path], out: str | Path, *, force: bool = False,
                 progress: bool = True) -> dict[str, Any]:
    """The audit of the joined answers of `dirs` (every shard of one run), published as OUT."""
    from phasekv.adapters.hf import load_tokenizer
    from phasekv.auditing.pipeline import run_audit
    from phasekv.data.formats import FormatVocabulary, load_format
    from phasekv.evaluate.sources import audit_sets

    records = _read_shards([Path(d) for d in dirs])
    first = records[0]
    answers: dict = {}
    for record in records:
        journal = Journal(record["dir"] / JOURNAL_NAME, {k: v for k, v in first["engine"].items()}, resume=True)
        answers.update(journal.answers)
    audit = first["audit"]
    tokenizer = load_tokenizer(audit["tokenizer"], audit["gguf_file"], flag="the shards' tokenizer")
    cfg = EvalConfig(**audit["config"])
    plan = AuditPlan(**{k: tuple(v) if isinstance(v, list) else v for k, v in audit["plan"].items()})
    sets = audit_sets(FormatVocabulary(load_format(cfg.format, cfg.chat), tokenizer), cfg, plan.protocols,
                      plan.prompts_per_phase)
    prompts = _prompts(sets)
    if prompt_set_key(prompts) != first["prompt_set"]:
        raise ValueError("audit merge: the prompt set rebuilt from the shards' settings is not the one they answered "
                         "(another phasekv version or tokenizer?)")
    missing = sum(prompt_key(ids) not in answers for ids in prompts)
    if missing:
        raise ValueError(f"audit merge: {missing} of {len(prompts)} prompts were answered by no shard")
    replay = _Replay(first, answers, len(tokenizer))
    replay.journal = Journal(journal_path(out), replay.settings(), fresh=True)
    for key, answer in answers.items():
        replay.journal.add(key, answer)
    try:
        return run_audit(replay, tokenizer, cfg, out, plan=plan, force=force, progress=progress)
    finally:
        replay.close()
