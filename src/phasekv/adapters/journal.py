"""The endpoint journal: every answer of a served model appended as it arrives, so a killed run resumes.

One fsync'd JSON line per prompt, after a header line of the settings the answers depend on.  A run's journal lives
beside OUT (`journal_path`) until the run is published; then `keep_journal` moves it into OUT with endpoint.json, how
the answers were obtained.  The library keeps the journal end to end: `open_endpoint(..., out=OUT)` opens it, the
command that publishes OUT (`phasekv eval --endpoint`, `phasekv audit --endpoint`) keeps it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

from phasekv.adapters.engines import Answer, EndpointError
from phasekv.outputs import fsync_dir, write_json

log = logging.getLogger(__name__)

JOURNAL_VERSION = 1


def prompt_key(ids: list[int]) -> str:
    """A prompt's journal key: a hash of its exact token ids."""
    return hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode()).hexdigest()[:32]


class Journal:
    """Answers appended as they arrive, one fsync'd JSON line each, after a header line of the settings.

    A run killed mid-line leaves a torn last line: it is cut off when the journal is reopened.  A journal
    is continued only with `resume` and only for the same settings; `fresh` discards an old one."""

    def __init__(self, path: str | Path, settings: dict[str, Any], resume: bool = False, fresh: bool = False):
        self.path, self.settings = Path(path), settings
        self.answers: dict[str, Answer] = {}
        self._lock = threading.Lock()
        if self.path.exists() and not fresh:
            if not resume:
                raise EndpointError(f"{self.path}: the journal of an interrupted run exists: pass --resume to "
                                    "continue it (only unanswered prompts are sent) or --force to start over")
            self._load()
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")
            self._append({"journal": JOURNAL_VERSION, **settings})
        self.resumed = len(self.answers)

    def _load(self) -> None:
        data = self.path.read_bytes()
        complete = data[:data.rfind(b"\n") + 1]  # a torn last line is an answer that never arrived
        if len(complete) < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(len(complete))
        lines = complete.decode().splitlines()
        try:
            header = json.loads(lines[0]) if lines else {}
        except ValueError:
            header = {}
        if header.get("journal") != JOURNAL_VERSION:
            raise EndpointError(f"{self.path}: not a phasekv endpoint journal; remove it or use --force")
        stored = {k: v for k, v in header.items() if k != "journal"}
        if stored != self.settings:
            diff = {k: (stored.get(k), v) for k, v in self.settings.items() if stored.get(k) != v}
            raise EndpointError(f"{self.path}: written with other settings (journal, now: {diff}); --resume needs "
                                "the same ones, or use --force to start over")
        for line in lines[1:]:
            entry = json.loads(line)
            self.answers[entry["key"]] = Answer(entry["token"], [tuple(t) for t in entry["top"]], entry["cached"])

    def _append(self, entry: dict[str, Any]) -> None:
        with self._lock, open(self.path, "a") as f:
            f.write(json.dumps(entry, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def add(self, key: str, answer: Answer) -> None:
        self.answers[key] = answer
        self._append({"key": key, **asdict(answer)})


def journal_path(out: str | Path) -> Path:
    """Where a run's journal lives until the run is published: beside OUT (a killed run leaves no OUT)."""
    out = Path(out)
    return out.with_name(out.name + ".journal.jsonl")


def keep_journal(adapter, out: str | Path) -> None:
    """After OUT is published: OUT/endpoint.json (how the answers were obtained) and the journal moved into OUT
    as endpoint_journal.jsonl (every prompt's top-k log-probabilities)."""
    out = Path(out)
    cached = [a.cached for a in adapter.answers.values() if a.cached is not None]
    record = {**adapter.settings(), "endpoint": adapter.conn.url, "concurrency": adapter.concurrency,
              "prompt_cache": "reuse-prefix" if adapter.reuse_prefix else "off", "answers": len(adapter.answers),
              "requests_this_run": adapter.sent,
              "answers_from_journal": adapter.journal.resumed if adapter.journal else 0,
              "cached_prompt_tokens": sum(cached) if cached else None,
              # how many answers said how many prompt tokens came from the engine's cache (vLLM does only with
              # --enable-prompt-tokens-details): below `answers`, "off" is what was asked, not what was checked
              "cache_reported": len(cached),
              "server_cache": {k: v for k, v in (adapter.cache_config or {}).items()  # vLLM's own account
                               if k in ("enable_prefix_caching", "cache_dtype", "block_size")} or None}
    if not adapter.reuse_prefix and len(cached) < len(adapter.answers):
        log.warning("%d of %d answers did not say how many prompt tokens the server took from its cache: that no "
                    "prompt cache served them is not checked (vLLM reports it with --enable-prompt-tokens-details)",
                    len(adapter.answers) - len(cached), len(adapter.answers))
    write_json(out / "endpoint.json", record, atomic=True)
    if adapter.journal is not None and adapter.journal.path.exists():
        os.replace(adapter.journal.path, out / "endpoint_journal.jsonl")
        fsync_dir(out)
        fsync_dir(adapter.journal.path.parent)
