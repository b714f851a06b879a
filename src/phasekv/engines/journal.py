"""The endpoint journal: every answer of a served model appended as it arrives, so a killed run resumes.

One fsync'd JSON line per prompt, after a header line of the settings the answers depend on.  Until the run is
published, its journal lives in OUT's resumable work (`journal_dir`: OUT/.partial, `phasekv.outputs.partial_dir`,
never beside OUT), which a failed run keeps for --resume and a run refused before its first answer removes
(`Journal.close`).  A journal that is refused (other settings, not a journal) is never written to: a torn last line
is cut off only when this run appends its first answer.  `published` builds OUT (`phasekv.outputs.output_dir`)
with the journal and endpoint.json, how the answers were obtained, inside it, so they are published with OUT in its
one atomic step.  The library keeps the journal end to end: `open_endpoint(..., out=OUT)` opens it, the command that
publishes OUT (`phasekv eval --endpoint`, `phasekv audit --endpoint`) publishes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
from collections.abc import Iterable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

from phasekv.engines.wire import Answer, EndpointError
from phasekv.outputs import PARTIAL, append_jsonl, drop_partial, out_path, output_dir, partial_dir, write_json

log = logging.getLogger(__name__)

JOURNAL_VERSION = 1


def prompt_key(ids: list[int]) -> str:
    """A prompt's journal key: a hash of its exact token ids."""
    return hashlib.sha256(json.dumps(ids, separators=(",", ":")).encode()).hexdigest()[:32]


def prompt_set_key(prompts: Iterable[list[int]]) -> str:
    """A prompt set's identity: a hash of its prompts' keys, in order (what `Journal.bind` ties a journal to)."""
    digest = hashlib.sha256()
    for ids in prompts:
        digest.update(prompt_key(ids).encode())
    return digest.hexdigest()[:32]


class Journal:
    """Answers appended as they arrive, one fsync'd JSON line each, after a header line of the settings.

    A run killed mid-line leaves a torn last line: it is cut off when the journal is reopened.  A journal
    is continued only with `resume` and only for the same settings; `fresh` discards an old one."""

    def __init__(self, path: str | Path, settings: dict[str, Any], resume: bool = False, fresh: bool = False):
        self.path, self.settings = Path(path), settings
        self.answers: dict[str, Answer] = {}
        self._lock = threading.Lock()
        self.created = not self.path.exists() or fresh  # by this run: removed again if it journals nothing
        self.added = 0
        self.bound: dict[str, Any] = {}  # what the run bound to the journal after its header (`bind`)
        self._torn: int | None = None  # the length to cut a torn last line back to, before the first append
        if not self.created:
            if not resume:
                raise EndpointError(f"{self.path}: the journal of an interrupted run exists: pass --resume to "
                                    "continue it (only unanswered prompts are sent) or --force to start over")
            self._load()
        else:
            if self.path.parent.name == PARTIAL:  # OUT's work: OUT made and marked first (`partial_dir`)
                partial_dir(self.path.parent.parent, force=False, resume=True)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")
            self._append({"journal": JOURNAL_VERSION, **settings})
        self.resumed = len(self.answers)

    def _load(self) -> None:
        data = self.path.read_bytes()
        complete = data[:data.rfind(b"\n") + 1]  # a torn last line is an answer that never arrived
        if len(complete) < len(data):
            self._torn = len(complete)
        try:
            lines = complete.decode().splitlines()
            header = json.loads(lines[0]) if lines else {}
        except (ValueError, RecursionError):
            header = {}
        if not isinstance(header, dict) or header.get("journal") != JOURNAL_VERSION:
            raise EndpointError(f"{self.path}: not a phasekv endpoint journal; remove it or use --force")
        stored = {k: v for k, v in header.items() if k != "journal"}
        if stored != self.settings:
            diff = {k: (stored.get(k), v) for k, v in self.settings.items() if stored.get(k) != v}
            raise EndpointError(f"{self.path}: written with other settings (journal, now: {diff}); --resume needs "
                                "the same ones, or use --force to start over")
        for number, line in enumerate(lines[1:], start=2):
            bound = _binding(line)
            if bound is not None:
                self.bound.update(bound)
                continue
            key, answer = _entry(line)
            if answer is None:
                raise EndpointError(f"{self.path}: line {number} is not a journaled answer ({key}); remove the "
                                    "journal or use --force to start over")
            self.answers[key] = answer

    def _append(self, entry: dict[str, Any]) -> None:
        with self._lock:
            if self._torn is not None:  # checked and continued: the torn line is cut before the first new one
                with open(self.path, "r+b") as f:
                    f.truncate(self._torn)
                self._torn = None
            append_jsonl(self.path, entry, compact=True, durable=True)

    def bind(self, name: str, value: Any) -> None:
        """Tie the journal to `value` (the hash of the prompt set it answers): recorded the first time, and a
        resumed journal bound to another value is refused in one line (its answers belong to another run)."""
        if name in self.bound:
            if self.bound[name] != value:
                raise EndpointError(f"{self.path}: its answers belong to another {name.replace('_', ' ')} "
                                    f"({self.bound[name]}, this run: {value}); --resume needs the same prompts, or "
                                    "use --force to start over")
            return
        self.bound[name] = value
        self._append({"bound": {name: value}})

    def add(self, key: str, answer: Answer) -> None:
        self.answers[key] = answer
        self._append({"key": key, **asdict(answer)})
        self.added += 1

    def close(self) -> None:
        """A journal this run created and never added to (a run refused before its first answer) is removed, with
        its directory when nothing else is in it: a refused run leaves nothing behind."""
        if self.created and self.added == 0 and self.path.exists():
            self.path.unlink()
            if self.path.parent.name == PARTIAL:
                drop_partial(self.path.parent.parent)
            else:
                with contextlib.suppress(OSError):
                    self.path.parent.rmdir()


def _entry(line: str) -> tuple[str, Answer | None]:
    """(key, answer) of a journal line; (what is wrong, None) when the line is no answer this module wrote."""
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError):
        return "not JSON", None
    if not isinstance(entry, dict):
        return "not a JSON object", None
    missing = [f for f in ("key", "token", "top", "cached") if f not in entry]
    if missing:
        return f"it lacks {', '.join(missing)}", None
    key, token, top, cached = entry["key"], entry["token"], entry["top"], entry["cached"]
    pairs = top if isinstance(top, list) else None
    if not (isinstance(key, str) and _integer(token) and (cached is None or _integer(cached)) and pairs is not None
            and all(isinstance(p, list) and len(p) == 2 and _integer(p[0]) and _number(p[1]) for p in pairs)):
        return "a field of the wrong type", None
    return key, Answer(token, [(i, float(lp)) for i, lp in pairs], cached)


def _binding(line: str) -> dict[str, Any] | None:
    """The {name: value} of a `bind` line, None for any other line."""
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError):
        return None
    bound = entry.get("bound") if isinstance(entry, dict) and set(entry) == {"bound"} else None
    return bound if isinstance(bound, dict) else None


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


JOURNAL_NAME = "endpoint_journal.jsonl"  # its name in the temporary directory and in the published OUT


def journal_dir(out: str | Path) -> Path:
    """OUT's resumable work (OUT/.partial), where a run's journal lives until the run is published."""
    return out_path(out) / PARTIAL


def journal_path(out: str | Path) -> Path:
    """Where a run's journal lives until the run is published (`journal_dir`)."""
    return journal_dir(out) / JOURNAL_NAME


@contextlib.contextmanager
def published(out: str | Path, force: bool, adapter=None) -> Iterator[Path]:
    """`output_dir(out, force)` that, for an endpoint `adapter`, also publishes its endpoint.json and journal with
    OUT (both written into the temporary directory before its atomic publish, which replaces OUT's work with
    them)."""
    journaled = adapter is not None and adapter.journal is not None
    with output_dir(out, force, resume=journaled) as tmp:
        yield tmp
        if adapter is not None:
            keep_journal(adapter, tmp)


def keep_journal(adapter, tmp: Path) -> None:
    """Into the directory `tmp` that becomes OUT: endpoint.json (how the answers were obtained) and the journal as
    endpoint_journal.jsonl (every prompt's top-k log-probabilities), a hard link where the file system allows one
    (the journal stays where it is until OUT is published), else a copy."""
    cached = [a.cached for a in adapter.answers.values() if a.cached is not None]
    record = {**adapter.settings(), "endpoint": adapter.conn.url if adapter.conn else None,
              "endpoint_urls": [c.url for c in adapter.conns],
              "concurrency": adapter.concurrency, "prompt_set": (adapter.journal.bound.get("prompt_set")
                                                                 if adapter.journal else None),
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
    write_json(tmp / "endpoint.json", record)
    if adapter.journal is not None and adapter.journal.path.exists():
        try:
            os.link(adapter.journal.path, tmp / JOURNAL_NAME)
        except OSError:
            shutil.copyfile(adapter.journal.path, tmp / JOURNAL_NAME)
