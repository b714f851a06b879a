"""Decision prompt sets as data: YAML files of items, each a context with one padding slot and two or more labelled
continuations, one of which is the item's `answer` (the decision the rate counts).

    name: code                         # the set's name
    description: ...                   # what it measures (one paragraph)
    chat: false                        # wrap the context in the tokenizer's chat template where it has one
    padding: {kind: comment, unit: " -"}   # what fills the slot: `unit` repeated s times at shift s
    continuations: {yes: " Yes", no: " No"}  # default labelled continuations (an item may give its own)
    answer: yes                        # default answer label (an item may give its own)
    items:
      - id: buffer-size                # unique within the set
        context: "SIZE = 32\\n#[[pad]]\\nassert len(buf) =="
        continuations: {right: " 32", wrong: " 8"}
        answer: right

The padding slot `[[pad]]` appears exactly once in every context.  The padding is meaning-preserving by
construction: a decorative divider (" -" in a comment), blank lines (" \\n"), dots or spaces; `kind` names it for
the report.  Whether s units are exactly s real tokens, with nothing else in the prompt changed, depends on the
tokenizer and is checked for every item and shift when the prompts are built (`phasekv.decisions.prompts`).
Shipped sets (package data, `sets/*.yaml`): `borderline` (requests that sound harmful and are not: comply or
refuse), `questions` (yes/no and multiple choice with one right answer) and `code` (a completion fixed by the code).
Every problem of a file is one ValueError naming the file and the item or field.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phasekv.config import MAX_CONFIG_BYTES
from phasekv.config.files import parse_yaml

SLOT = "[[pad]]"
SETS_DIR = Path(__file__).with_name("sets")
SHIPPED = ("borderline", "questions", "code")
_SET_KEYS = {"name", "description", "chat", "padding", "continuations", "answer", "items"}
_ITEM_KEYS = {"id", "context", "continuations", "answer", "padding"}
_PADDING_KEYS = {"kind", "unit"}


@dataclass(frozen=True)
class Padding:
    kind: str  # what the padding is, for the report: comment, blank-lines, dots, spaces, ...
    unit: str  # the text repeated s times in the slot at shift s (one token per unit, checked per tokenizer)


@dataclass(frozen=True)
class Item:
    id: str
    context: str  # holds SLOT exactly once
    continuations: dict[str, str]  # label -> text, two or more
    answer: str  # the label the decision rate counts
    padding: Padding

    @property
    def kind(self) -> str:
        """The item's kind, what `sample` stratifies by: its labelled continuations and which one is right
        ("no/yes:yes", "A/B/C:B"), so a sample keeps yes/no and multiple choice, and each right answer, in
        proportion."""
        return f"{'/'.join(sorted(self.continuations))}:{self.answer}"

    def text(self, shift: int) -> str:
        """The context with `shift` padding units in its slot."""
        return self.context.replace(SLOT, self.padding.unit * shift)


@dataclass(frozen=True)
class DecisionSet:
    name: str
    description: str
    chat: bool
    items: tuple[Item, ...]
    source: str  # the shipped name or the file it was read from


def load_set(name_or_path: str) -> DecisionSet:
    """A shipped set by name or a YAML file of the module docstring's layout; every problem is one ValueError."""
    path = SETS_DIR / f"{name_or_path}.yaml" if name_or_path in SHIPPED else Path(name_or_path)
    where = f"--set {name_or_path}"
    if not path.is_file():
        raise ValueError(f"{where}: neither a shipped set {list(SHIPPED)} nor a file")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{where}: {path.stat().st_size} bytes; a set file may hold at most {MAX_CONFIG_BYTES}")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{where}: not a UTF-8 text file") from None
    return parse_set(parse_yaml(text, where), where, source=name_or_path)


def parse_set(tree: Any, where: str, source: str = "") -> DecisionSet:
    """A `DecisionSet` from a parsed YAML tree; `where` starts every error."""
    if not isinstance(tree, dict):
        raise ValueError(f"{where}: a decision set is a YAML mapping with {sorted(_SET_KEYS)}")
    _known(tree, _SET_KEYS, where)
    name = _string(tree, "name", where)
    chat = tree.get("chat", False)
    if not isinstance(chat, bool):
        raise ValueError(f"{where}: chat: must be true or false, got {chat!r}")
    items = tree.get("items")
    if not isinstance(items, list) or not items:
        raise ValueError(f"{where}: items: must be a non-empty list of items")
    defaults = {"continuations": tree.get("continuations"), "answer": tree.get("answer"),
                "padding": tree.get("padding")}
    parsed, seen = [], set()
    for index, raw in enumerate(items):
        item = _item(raw, defaults, f"{where}: item {index + 1}")
        if item.id in seen:
            raise ValueError(f"{where}: item {item.id!r}: id given twice")
        seen.add(item.id)
        parsed.append(item)
    description = tree.get("description", "")
    if not isinstance(description, str):
        raise ValueError(f"{where}: description: must be text")
    return DecisionSet(name=name, description=description, chat=chat, items=tuple(parsed), source=source)


def _item(raw: Any, defaults: dict[str, Any], where: str) -> Item:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: must be a mapping with id, context (and continuations, answer)")
    _known(raw, _ITEM_KEYS, where)
    item_id = _string(raw, "id", where)
    where = f"{where.rsplit(': item', 1)[0]}: item {item_id!r}"
    context = _string(raw, "context", where)
    if context.count(SLOT) != 1:
        raise ValueError(f"{where}: context: must hold the padding slot {SLOT} exactly once "
                         f"(found {context.count(SLOT)})")
    continuations = raw.get("continuations", defaults["continuations"])
    if not isinstance(continuations, dict) or len(continuations) < 2:
        raise ValueError(f"{where}: continuations: needs a mapping of two or more labels to texts")
    for label, text in continuations.items():
        if not isinstance(label, str) or not isinstance(text, str) or not text:
            raise ValueError(f"{where}: continuations: label {label!r} needs a non-empty text")
    if len(set(continuations.values())) < len(continuations):
        raise ValueError(f"{where}: continuations: two labels have the same text")
    answer = raw.get("answer", defaults["answer"])
    if answer not in continuations:
        raise ValueError(f"{where}: answer: {answer!r} is not one of its continuations {list(continuations)}")
    return Item(id=item_id, context=context, continuations=dict(continuations), answer=answer,
                padding=_padding(raw.get("padding", defaults["padding"]), where))


def _padding(raw: Any, where: str) -> Padding:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: padding: needs a mapping {{kind: ..., unit: ...}} (in the item or the set)")
    _known(raw, _PADDING_KEYS, f"{where}: padding")
    kind, unit = raw.get("kind"), raw.get("unit")
    if not isinstance(kind, str) or not kind or not isinstance(unit, str) or not unit:
        raise ValueError(f"{where}: padding: kind and unit must be non-empty texts, got {kind!r}, {unit!r}")
    if SLOT in unit:
        raise ValueError(f"{where}: padding: the unit may not hold the slot {SLOT}")
    return Padding(kind, unit)


def _string(tree: dict, key: str, where: str) -> str:
    value = tree.get(key)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: {key}: missing or not a non-empty text")
    return value


def _known(tree: dict, keys: set[str], where: str) -> None:
    unknown = sorted(str(k) for k in tree if k not in keys)
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(sorted(keys))})")


def sample(items: Sequence[Item], n: int | None, seed: int = 0) -> list[Item]:
    """`n` of `items` (all when n is None or at least their number), stratified by `Item.kind` and seeded: every
    kind gets one item first, then each next item goes to the kind furthest below its share n * size / total (the
    earlier kind on a tie), and each kind's items are a seeded random choice; the sample keeps the set's order.
    With fewer than one item per kind, `n` kinds are a seeded choice, one item each."""
    if n is None or n >= len(items):
        return list(items)
    rng = random.Random(seed)
    kinds: dict[str, list[int]] = {}
    for index, item in enumerate(items):
        kinds.setdefault(item.kind, []).append(index)
    names = list(kinds)
    counts = dict.fromkeys(rng.sample(names, n) if n < len(names) else names, 1)
    for _ in range(n - sum(counts.values())):
        open_kinds = [k for k in names if counts.get(k, 0) < len(kinds[k])]
        best = max(open_kinds, key=lambda k: (n * len(kinds[k]) / len(items) - counts.get(k, 0), -names.index(k)))
        counts[best] = counts.get(best, 0) + 1
    chosen = sorted(i for k in names if k in counts for i in rng.sample(kinds[k], counts[k]))
    return [items[i] for i in chosen]
