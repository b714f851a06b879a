"""Prompt formats as data: how the records of a lookup prompt look to a real language model.

A format is a small template (docs/science.md section 3 describes the task; the real-models issue measured
why framing matters: bare word pairs 0-8% on SmolLM2-135M, framed `key: 482` lines 87%):

    <bos> [chat prefix] header  [fillers]  record x N  [fillers]  tail [chat suffix]  demonstration x D  query

A record is a key piece followed by a value piece (`key_text` / `value_text` with `{key}` / `{value}`),
a demonstration repeats a whole record, the query is a key piece, and the answer is the first token of
the value piece.  Keys and values come from kinds: `animals`, `names` (single words, extended by hyphenated
pairs such as "cat-otter"; `animals-plain` without them) or `digits:N` (N-digit numbers).  Everything is
built at token level from pieces tokenized once, so every position (and phase) is exact; only pieces of
the modal token length are kept, so every record has the same length, and any token prefix shared by
every value piece (a space before the digits) is moved into the key piece, so the answer is never a
give-away.  `FormatVocabulary` offers the vocabulary interface the
prompt builders use (`phasekv.data.protocols.build_eval_set`), plus `header`, `tail`, `answers` and
`sample_records`; `retokenization_agreement` measures how far the token-level prompt differs from what
the tokenizer would produce from its text.

Needle in a haystack (`haystack_tokens` > 0; docs/science.md section 3's needle test, multi-key): every record is
a needle sentence (" The special magic number for tiger is 482."), and `haystack_tokens` tokens of real
English prose sit before every needle and after the last one.  The prose is whole sentences of the
built-in list `haystack.txt` (package data), each tokenized once; a piece is a set of sentences whose
lengths sum to exactly `haystack_tokens` (drawn per cluster from the prompt set's seed, unused sentences
first), so needles sit at sentence boundaries, the text re-tokenizes to the same ids, and each prose piece
is part of its record's pitch: prefix padding shifts the whole haystack, in-sequence padding puts fillers
between the pieces (`phasekv.data.protocols`).

Long context (`preamble_tokens` > 0, with `{prose}` in the header): `preamble_tokens` tokens of the same prose
stand where the header says, in EVERY prompt of every cluster, shift and protocol: whole sentences of
`haystack.txt`, the list repeated as often as needed (each pass in its own fixed order) and then a set of
sentences summing exactly to the rest.  The context is long, the keys sit at large positions (where phase is
position mod S as everywhere), and the records follow the preamble, so a record is at most a record block
away from the query: what a long preamble tests is retrieval behind thousands of tokens of distractor prose
and under compression of all of them, not retrieval across the whole depth.  Because every context begins
with the same tokens, an evaluation prefills them once (`HFAdapter.prefill(ids, prefix=...)`), which is what
makes an 8K-token audit of a 135M model fit in minutes on two CPU cores.

Chat (`chat: true`, or `--chat`): the prompt is wrapped in the tokenizer's chat template, the user turn
holding header, records, tail (the question) and the assistant turn left open for the demonstrations and
the query.  The template is rendered once around a marker; its text before the marker and the header are
tokenized once as one piece, the tail and the text after it as another (a leading <bos> is dropped: every
prompt starts with one), so positions stay exact and the joins tokenize as in running text.

Shipped formats: `records` (3-digit values, a prose header and tail), `records-names` (name values),
`records-lmeval` (`records` with the filler " .", whose text tokenizes back to its own ids: lm-eval's tasks),
`needle` (needles in prose, a question as the tail), `needle-digits` (the same with 4-digit numbers: a
multi-token answer, for the decode-step audit), `bare` (the old bare word pairs, no framing: the
format a real model cannot do), and `records-4k`, `records-8k`, `needle-4k`, `needle-8k`: `records` and
`needle` behind a prose preamble sized so that prompts are just under 4,096 / 8,192 tokens for SmolLM2's
tokenizer (max positions 8,192) with the audit's defaults for records (24 records, 4 demonstrations) and
the needle settings the audit uses (16 needles, 2 demonstrations).  A YAML file with the same fields
defines a new one (`load_format`).
"""

from __future__ import annotations

import collections
import dataclasses
import string
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from phasekv.config import MAX_CONFIG_BYTES, check_fields, from_section, parse_yaml, spec
from phasekv.data.vocab import BASE_WORDS, numbered_words

PROSE = "{prose}"  # where a long-context format's preamble goes in its header
_PREAMBLE_SEED = 7  # the fixed sentence order of the preamble's passes: the same prose in every prompt

# kind -> phasekv word list; "-plain": the list's words only, without the hyphenated pairs "a-b" that extend it
WORD_KINDS = {"animals": "keys", "animals-plain": "keys", "names": "values", "words": "background"}


def _check_placeholders(name: str, field_name: str, text: str, placeholder: str) -> None:
    """`text` is rendered with str.format(placeholder=...): it must hold {placeholder} and no other field (a
    positional {} or another name would fail only when the prompts are built, after the model has loaded)."""
    where = f"format {name}.{field_name}"
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(text) if f is not None]
    except ValueError as exc:  # an unmatched brace
        raise ValueError(f"{where}: {text!r} is not a valid template ({exc}); write a literal brace as {{{{ or }}}}"
                         ) from None
    other = [f"{{{f}}}" for f in fields if f != placeholder]
    if other or placeholder not in fields:
        problem = f"has the placeholder {other[0]}" if other else f"lacks {{{placeholder}}}"
        raise ValueError(f"{where}: {text!r} {problem}; it must hold exactly {{{placeholder}}} (write a literal "
                         "brace as {{ or }})")


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
    haystack_tokens: int = spec(0, low=0, high=4096)  # prose tokens before every record and after the last
    preamble_tokens: int = spec(0, low=0, high=1 << 17)  # prose tokens at the header's {prose}, shared by all prompts
    chat: bool = False  # wrap the prompt in the tokenizer's chat template (user turn; assistant turn open)

    def __post_init__(self) -> None:
        check_fields(self, f"format {self.name}")
        _check_placeholders(self.name, "key_text", self.key_text, "key")
        _check_placeholders(self.name, "value_text", self.value_text, "value")
        if self.header.count(PROSE) != (1 if self.preamble_tokens else 0):
            raise ValueError(f"format {self.name}.header: must hold {PROSE} exactly once when preamble_tokens > 0 "
                             f"and not at all otherwise (preamble_tokens={self.preamble_tokens})")
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
    "needle": PromptFormat("needle", header="Below is a long text. Hidden in it are the special magic numbers "
                           "of some animals. Remember them.\n", key_text=" The special magic number for {key} is",
                           value_text=" {value}.", tail="\nQuestion: What is the special magic number for the "
                           "animal below, according to the text?\nAnswer:", keys="animals-plain",
                           values="digits:3", filler=" ...", haystack_tokens=41),
    "bare": PromptFormat("bare", key_text=" {key}", value_text=" {value}", keys="animals", values="names",
                         filler=" um"),
}
# `records` whose text round-trips to its own ids under byte-level BPE tokenizers (SmolLM2's), for tools that talk to
# models in text (`phasekv export lm-eval`): `records`' filler "\n" merges with the records' own line ends ("\n\n\n"
# is one token), a space-led punctuation filler such as " ." merges neither with itself nor with a key or a line end
# (measured on SmolLM2-135M: 0 of 128 prompts differ, against 128 of 128 with "\n", "." or "-")
FORMATS["records-lmeval"] = dataclasses.replace(FORMATS["records"], name="records-lmeval", filler=" .")
# the answer is several tokens (four digits and a period with SmolLM2's digit-by-digit tokenizer): the decode-step
# audit compares every one of them (`phasekv.auditing.decode`)
FORMATS["needle-digits"] = dataclasses.replace(FORMATS["needle"], name="needle-digits", values="digits:4")
# the long-context formats: (base format, its header with the preamble, preamble tokens per size); with SmolLM2's
# tokenizer and the settings of the module docstring their prompts are 4,026-4,091 / 8,102-8,155 tokens (both
# protocols, with and without --chat)
_LONG = {"records": ("Below is a long text, and after it a list of records.\n" + PROSE
                     + "\nHere is the list of records.\n", {4: 3700, 8: 7776}),
         "needle": (FORMATS["needle"].header + PROSE, {4: 3072, 8: 7136})}
FORMATS.update({f"{base}-{k}k": dataclasses.replace(FORMATS[base], name=f"{base}-{k}k", header=header,
                                                    preamble_tokens=n)
                for base, (header, sizes) in _LONG.items() for k, n in sizes.items()})


def load_format(name_or_path: str, chat: bool = False) -> PromptFormat:
    """A shipped format by name, or a YAML file with PromptFormat's fields (at most MAX_CONFIG_BYTES of text);
    `chat` turns its chat option on.  Every problem of the file is one ValueError that names the file."""
    if name_or_path in FORMATS:
        fmt = FORMATS[name_or_path]
    else:
        path = Path(name_or_path)
        if not path.is_file():
            kind = "a directory" if path.is_dir() else "not a regular file" if path.exists() else "not a file"
            raise ValueError(f"--format: {name_or_path!r} is neither a shipped format {sorted(FORMATS)} nor a file "
                             f"({kind})")
        where = f"--format {path}"
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ValueError(f"{where}: {path.stat().st_size} bytes; a format file may hold at most "
                             f"{MAX_CONFIG_BYTES} bytes")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{where}: not a text file (it is not UTF-8; binary data?); a format is a YAML "
                             "mapping of PromptFormat's fields") from None
        except OSError as exc:
            raise ValueError(f"{where}: unreadable ({exc.strerror})") from None
        tree = parse_yaml(text, where)
        if tree is None:
            raise ValueError(f"{where}: is empty; a format is a YAML mapping of PromptFormat's fields, e.g. "
                             "key_text: '{key}:'")
        if isinstance(tree, dict):
            tree.setdefault("name", path.stem)
        try:
            fmt = from_section(PromptFormat, tree, "format")
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None
    return dataclasses.replace(fmt, chat=True) if chat else fmt


def haystack_sentences() -> list[str]:
    """The built-in prose of the needle format: one sentence per line of `haystack.txt`."""
    text = resources.files("phasekv.data").joinpath("haystack.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def _kind_texts(kind: str) -> list[str]:
    if kind.startswith("digits:"):
        n = int(kind[7:])
        return [str(v) for v in range(10 ** (n - 1), 10 ** n)]
    base = BASE_WORDS[WORD_KINDS[kind]]
    return list(base) if kind.endswith("-plain") else numbered_words(base, 4 * len(base))


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
            try:
                return tuple(tokenizer.encode(text, add_special_tokens=False))
            except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for unknown words
                raise ValueError(f"format {fmt.name}: the tokenizer cannot encode {text!r} ({exc}); a word-level "
                                 f"tokenizer without an unknown token (e.g. a phasekv checkpoint's) renders no prose "
                                 f"format: evaluate it with `phasekv eval`") from None

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
        bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
        if bos is None:
            raise ValueError("tokenizer: has neither a bos nor an eos token to start prompts with")
        self.bos = bos
        before, after = _chat_texts(tokenizer, fmt.name) if fmt.chat else ("", "")
        self.haystack_tokens = fmt.haystack_tokens
        prose = fmt.haystack_tokens or fmt.preamble_tokens
        self.sentences = [encode(" " + text) for text in haystack_sentences()] if prose else []
        head, _, rest = fmt.header.partition(PROSE)
        self.header = list(encode(before + head)) + self._preamble(fmt) + list(encode(rest))
        self.tail = list(encode(fmt.tail + after))
        if fmt.chat and self.header[:1] == [bos]:  # every prompt already starts with <bos>
            self.header = self.header[1:]
        if self.sentences and _exact_subset([len(p) for p in self.sentences], range(len(self.sentences)),
                                            fmt.haystack_tokens) is None:
            raise ValueError(f"format {fmt.name}.haystack_tokens: no set of haystack sentences is exactly "
                             f"{fmt.haystack_tokens} tokens with this tokenizer; choose another length")
        if len(self.answers) < 2 or len(self.key_pieces) < 2:
            raise ValueError(f"format {fmt.name}: too few distinct keys ({len(self.key_pieces)}) or answers "
                             f"({len(self.answers)}) for this tokenizer")

    def _preamble(self, fmt: PromptFormat) -> list[int]:
        """`fmt.preamble_tokens` tokens of whole sentences (module docstring): the same in every prompt."""
        if not fmt.preamble_tokens:
            return []
        lengths = [len(p) for p in self.sentences]
        passes, rest = divmod(fmt.preamble_tokens, sum(lengths))
        # each whole pass in its own fixed order, so the repeated prose is not one long verbatim repeat
        order = [i for k in range(passes)
                 for i in np.random.default_rng([_PREAMBLE_SEED, k]).permutation(len(lengths)).tolist()]
        last = _exact_subset(lengths, range(len(lengths)), rest)
        if last is None:
            raise ValueError(f"format {fmt.name}.preamble_tokens: no set of haystack sentences adds the remaining "
                             f"{rest} tokens with this tokenizer; choose another length")
        return [t for i in order + last for t in self.sentences[i]]

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

    def haystack(self, rng: np.random.Generator, n: int) -> list[list[int]]:
        """n prose pieces of exactly `haystack_tokens` tokens: whole sentences, in a random order, sentences
        not yet used in this prompt first (so a short haystack repeats none)."""
        lengths = [len(p) for p in self.sentences]
        used: set[int] = set()
        pieces = []
        for _ in range(n):
            order = sorted(rng.permutation(len(lengths)).tolist(), key=lambda i: i in used)  # stable: fresh first
            chosen = _exact_subset(lengths, order, self.haystack_tokens)
            used.update(chosen)
            pieces.append([t for i in chosen for t in self.sentences[i]])
        return pieces

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


_USER_TURN = "PHASEKV_USER_TURN"  # stands for the user's message while the chat template is rendered


def _chat_texts(tokenizer: Any, name: str) -> tuple[str, str]:
    """The text of the tokenizer's chat template before and after one user message, assistant turn open."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"format {name}.chat: the tokenizer has no chat template")
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": _USER_TURN}], add_generation_prompt=True,
                                             tokenize=False)
    except Exception as exc:  # noqa: BLE001 - jinja and transformers raise many types for a broken template
        raise ValueError(f"format {name}.chat: the chat template does not render ({exc})") from None
    if not isinstance(text, str) or text.count(_USER_TURN) != 1:
        raise ValueError(f"format {name}.chat: the chat template does not hold the user message exactly once")
    before, after = text.split(_USER_TURN)
    return before, after


def _exact_subset(lengths: list[int], order, target: int) -> list[int] | None:
    """Items whose lengths sum to exactly `target`: the first such set a 0/1 knapsack over `order` reaches
    (so earlier items are preferred), in `order`'s order; None if there is none."""
    reach: dict[int, tuple[int, int]] = {0: (0, -1)}  # sum -> (previous sum, item that reached it)
    for item in order:
        for total in list(reach):
            new = total + lengths[item]
            if new <= target and new not in reach:
                reach[new] = (total, item)
        if target in reach:
            break
    if target not in reach:
        return None
    chosen, total = [], target
    while total:
        total, item = reach[total]
        chosen.append(item)
    return chosen[::-1]


def _common_prefix(pieces: list[tuple[int, ...]]) -> tuple[int, ...]:
    first = pieces[0]
    n = 0
    while n < len(first) and all(len(p) > n and p[n] == first[n] for p in pieces):
        n += 1
    return first[:n]
