"""Prompt formats as data: how the records of a lookup prompt look to a real language model.

A format is a small template (PAPER.md section 3 describes the task; the real-models issue measured
why framing matters: bare word pairs 0-8% on SmolLM2-135M, framed `key: 482` lines 87%):

    <bos> header  [fillers]  record x N  [fillers]  tail  demonstration x D  query

A record is a key piece followed by a value piece (`key_text` / `value_text` with `{key}` / `{value}`),
a demonstration repeats a whole record, the query is a key piece, and the answer is the first token of
the value piece.  Keys and values come from kinds: `animals`, `names` (single words) or `digits:N`
(N-digit numbers).  Everything is built at token level from pieces tokenized once, so every position
(and phase) is exact; only pieces of the modal token length are kept, so every record has the same
length, and any token prefix shared by every value piece (a space before the digits) is moved into the
key piece, so the answer is never a give-away.  `FormatVocabulary` offers the vocabulary interface the
prompt builders use (`phasekv.data.protocols.build_eval_set`), plus `header`, `tail`, `answers` and
`sample_records`; `retokenization_agreement` measures how far the token-level prompt differs from what
the tokenizer would produce from its text.

Shipped formats: `records` (3-digit values, a prose header and tail), `records-names` (name values),
`bare` (the old bare word pairs, no framing: the format a real model cannot do).  A YAML file with the
same fields defines a new one (`load_format`).  Chat templates are not applied (a base-model prompt).
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from phasekv.config import check_fields, from_section, parse_yaml, spec
from phasekv.data.vocab import _BASE, _words

WORD_KINDS = {"animals": "keys", "names": "values", "words": "background"}  # kind -> phasekv word list


@dataclass
class PromptFormat:
    """One prompt format (see the module docstring)."""

    name: str
    header: str = ""
    key_text: str = " {key}"
    value_text: str = " {value}"
    tail: str = ""
    keys: str = "animals"
    values: str = spec("names")
    filler: str = "\n"  # one token: the unit of padding (prefix and in-sequence)

    def __post_init__(self) -> None:
        check_fields(self, f"format {self.name}")
        if "{key}" not in self.key_text or "{value}" not in self.value_text:
            raise ValueError(f"format {self.name}: key_text needs {{key}} and value_text needs {{value}}")
        for field_name in ("keys", "values"):
            kind = getattr(self, field_name)
            if kind not in WORD_KINDS and not (kind.startswith("digits:") and kind[7:].isdigit() and
                                               1 <= int(kind[7:]) <= 6):
                raise ValueError(f"format {self.name}.{field_name}: must be a word kind {sorted(WORD_KINDS)} or "
                                 f"digits:N (N in 1..6), got {kind!r}")


FORMATS = {
    "records": PromptFormat("records", header="Here is the list of records.\n", key_text="{key}:",
                            value_text=" {value}\n", tail="That is the whole list.\n", keys="animals",
                            values="digits:3"),
    "records-names": PromptFormat("records-names", header="Here is the list of records.\n", key_text="{key}:",
                                  value_text=" {value}\n", tail="That is the whole list.\n", keys="animals",
                                  values="names"),
    "bare": PromptFormat("bare", key_text=" {key}", value_text=" {value}", keys="animals", values="names",
                         filler=" um"),
}


def load_format(name_or_path: str) -> PromptFormat:
    """A shipped format by name, or a YAML file with PromptFormat's fields."""
    if name_or_path in FORMATS:
        return FORMATS[name_or_path]
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"--format: {name_or_path!r} is neither a shipped format {sorted(FORMATS)} nor a file")
    tree = parse_yaml(path.read_text(), f"--format {path}")
    if isinstance(tree, dict):
        tree.setdefault("name", path.stem)
    return from_section(PromptFormat, tree, f"format {path}")


def _kind_texts(kind: str) -> list[str]:
    if kind.startswith("digits:"):
        n = int(kind[7:])
        return [str(v) for v in range(10 ** (n - 1), 10 ** n)]
    base = _BASE[WORD_KINDS[kind]]
    return _words(base, 4 * len(base))


def _modal(pieces: dict[str, tuple[int, ...]], by_first: bool = False) -> dict[str, tuple[int, ...]]:
    """The pieces of one token length: the most common one (ties: the shorter), or with `by_first` the length
    whose pieces have the most distinct first tokens (values: the answers a guesser must choose among)."""
    groups: dict[int, list[tuple[int, ...]]] = collections.defaultdict(list)
    for p in pieces.values():
        groups[len(p)].append(p)

    def score(n: int) -> tuple[int, int]:
        return (len({p[0] for p in groups[n]}) if by_first else len(groups[n]), -n)

    length = max(groups, key=score)
    return {t: p for t, p in pieces.items() if len(p) == length}


class FormatVocabulary:
    """A format rendered with one tokenizer: token-level pieces with exact lengths."""

    def __init__(self, fmt: PromptFormat, tokenizer: Any):
        self.format, self.tokenizer = fmt, tokenizer

        def encode(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        keys = _modal({w: encode(fmt.key_text.format(key=w)) for w in _kind_texts(fmt.keys)})
        values = _modal({v: encode(fmt.value_text.format(value=v)) for v in _kind_texts(fmt.values)}, by_first=True)
        taken = set(values.values())
        keys = {w: p for w, p in keys.items() if p not in taken}
        common = _common_prefix(list(values.values()))
        self.key_pieces = [p + common for p in dict.fromkeys(keys.values())]  # distinct
        self.value_pieces = [p[len(common):] for p in values.values()]
        if len(self.value_pieces[0]) == 0:
            raise ValueError(f"format {fmt.name}: value pieces are empty after their common prefix")
        self.answers = sorted({p[0] for p in self.value_pieces})
        filler = encode(fmt.filler)
        if len(filler) != 1:
            raise ValueError(f"format {fmt.name}.filler: {fmt.filler!r} is {len(filler)} tokens; it must be one")
        self.fillers = list(filler)
        self.header, self.tail = list(encode(fmt.header)), list(encode(fmt.tail))
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if bos is None:
            raise ValueError("tokenizer: has neither a bos nor an eos token to start prompts with")
        self.bos = bos
        if len(self.answers) < 2 or len(self.key_pieces) < 2:
            raise ValueError(f"format {fmt.name}: too few distinct keys ({len(self.key_pieces)}) or answers "
                             f"({len(self.answers)}) for this tokenizer")

    @property
    def record_shape(self) -> tuple[int, int]:
        """(key tokens, value tokens) of every record."""
        return len(self.key_pieces[0]), len(self.value_pieces[0])

    @property
    def size(self) -> int:
        return len(self.tokenizer)

    def group(self, name: str) -> list[int]:
        if name == "fillers":
            return list(self.fillers)
        if name == "values":
            return list(self.answers)
        if name == "keys":
            return list(range(len(self.key_pieces)))  # one "word" per key piece (for counts)
        raise ValueError(f"group: unknown {name!r} for a prompt format")

    def sample_records(self, rng: np.random.Generator, n: int, key_tokens: int, value_tokens: int
                       ) -> tuple[np.ndarray, np.ndarray]:
        """n records: distinct key pieces (n, kt) and value pieces drawn with replacement (n, vt)."""
        if (key_tokens, value_tokens) != self.record_shape:
            raise ValueError(f"format {self.format.name}: records are {self.record_shape} tokens (key, value), "
                             f"not {(key_tokens, value_tokens)}")
        if n > len(self.key_pieces):
            raise ValueError(f"n_records: {n} distinct keys needed, format {self.format.name} has "
                             f"{len(self.key_pieces)} with this tokenizer")
        keys = np.asarray(self.key_pieces)[rng.choice(len(self.key_pieces), size=n, replace=False)]
        values = np.asarray(self.value_pieces)[rng.integers(len(self.value_pieces), size=n)]
        return keys, values

    def decode(self, ids) -> str:
        return self.tokenizer.decode([int(i) for i in ids])

    def retokenization_agreement(self, ids: list[int]) -> float:
        """Fraction of a prompt's tokens (after <bos>) that re-tokenizing its text reproduces in place."""
        again = self.tokenizer.encode(self.decode(ids[1:]), add_special_tokens=False)
        same = sum(a == b for a, b in zip(ids[1:], again))
        return same / max(len(ids) - 1, len(again))

    def to_dict(self) -> dict[str, Any]:
        return {"format": dataclasses.asdict(self.format), "record_shape": list(self.record_shape),
                "n_keys": len(self.key_pieces), "n_values": len(self.value_pieces), "n_answers": len(self.answers)}


def _common_prefix(pieces: list[tuple[int, ...]]) -> tuple[int, ...]:
    first = pieces[0]
    n = 0
    while n < len(first) and all(len(p) > n and p[n] == first[n] for p in pieces):
        n += 1
    return first[:n]
