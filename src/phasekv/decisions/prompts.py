"""Token-exact shifted prompts of a decision set (docs/science.md section 3's position matching, for decisions).

Item i at shift s = 0..R-1 is its context with s padding units in the slot, wrapped in the tokenizer's chat
template (a user turn, the assistant turn left open) when the set asks for it and the tokenizer has one, and
tokenized as ONE text, so every id is what the tokenizer itself produces (no token-level splicing; re-encoding
the text rebuilds the ids).  The shift is token-exact when

    ids(s) == ids(0)[:k] + s padding tokens + ids(0)[k:]      (k: the slot's token index, from shift 1)

for every s: the padding inserts exactly s real tokens and changes nothing else, so everything after the slot,
the decision point included, moves by s positions.  The decision point is the prompt's last token; its phase is
(len(ids(s)) - 1) mod S, so R = S shifts show every item once at every phase (R = k S: k times each).  Each
continuation's ids are what the tokenizer produces for prompt text + continuation text beyond the prompt's own ids,
the same at every shift; a continuation that merges with the end of the prompt, or tokenizes differently at two
shifts, is refused in one line naming the item.  A tokenizer without a chat template (or a set with `chat: false`)
gets the plain context, after the bos token when the tokenizer has one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from phasekv.decisions.sets import DecisionSet, Item, sample


@dataclass(frozen=True)
class Prompt:
    item: str
    shift: int
    ids: tuple[int, ...]  # the whole prompt, ending at the decision point
    phase: int  # (len(ids) - 1) mod stride
    continuations: dict[str, tuple[int, ...]]  # label -> its token ids after the prompt
    answer: str


def render(tokenizer: Any, item: Item, shift: int, chat: bool) -> str:
    """The prompt text of `item` at `shift` (the chat template applied when `chat` and the tokenizer has one)."""
    text = item.text(shift)
    if chat and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return text


def encode(tokenizer: Any, text: str, chat: bool) -> list[int]:
    """Token ids of a rendered prompt: the text as the tokenizer encodes it, after bos for a plain prompt."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    templated = chat and getattr(tokenizer, "chat_template", None)
    bos = getattr(tokenizer, "bos_token_id", None)
    return ids if templated or bos is None else [bos, *ids]


def item_prompts(tokenizer: Any, item: Item, *, shifts: int, stride: int, chat: bool) -> list[Prompt]:
    """The item's prompts at shifts 0..shifts-1, each checked token-exact (module docstring)."""
    where = f"item {item.id!r}"
    texts = [render(tokenizer, item, s, chat) for s in range(shifts)]
    rows = [encode(tokenizer, t, chat) for t in texts]
    base = rows[0]
    k = next((j for j, (a, b) in enumerate(zip(base, rows[1])) if a != b), len(base)) if shifts > 1 else len(base)
    for s, ids in enumerate(rows):
        if len(ids) != len(base) + s or ids[:k] != base[:k] or ids[k + s:] != base[k:]:
            raise ValueError(f"{where}: shift {s}: the padding {item.padding.unit!r} x {s} is not {s} tokens "
                             f"inserted at the slot (the prompt is {len(ids)} tokens, {len(base)} at shift 0): "
                             "choose a padding unit that stays one token when repeated")
    continuations = _continuation_ids(tokenizer, item, texts, rows, chat)
    return [Prompt(item=item.id, shift=s, ids=tuple(ids), phase=(len(ids) - 1) % stride, continuations=continuations,
                   answer=item.answer) for s, ids in enumerate(rows)]


def _continuation_ids(tokenizer: Any, item: Item, texts: list[str], rows: list[list[int]],
                      chat: bool) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for label, cont in item.continuations.items():
        seen = set()
        for s, (text, ids) in enumerate(zip(texts, rows)):
            joined = encode(tokenizer, text + cont, chat)
            if joined[:len(ids)] != ids:
                raise ValueError(f"item {item.id!r}: continuation {label!r} ({cont!r}) merges with the end of the "
                                 f"prompt at shift {s}: its tokens are not the prompt's followed by its own")
            seen.add(tuple(joined[len(ids):]))
        if len(seen) != 1:
            raise ValueError(f"item {item.id!r}: continuation {label!r} ({cont!r}) tokenizes differently at "
                             f"different shifts: {sorted(seen)}")
        out[label] = seen.pop()
        if not out[label]:
            raise ValueError(f"item {item.id!r}: continuation {label!r} ({cont!r}) adds no token")
    if len(set(out.values())) < len(out):
        raise ValueError(f"item {item.id!r}: two continuations tokenize to the same ids")
    return out


def check_shifts(shifts: int, stride: int) -> None:
    if stride < 1 or shifts < stride or shifts % stride:
        raise ValueError(f"--shifts {shifts}: must be a positive multiple of the stride S={stride}, so that every "
                         "phase group holds every item equally often")


def build_prompts(tokenizer: Any, decision_set: DecisionSet, *, shifts: int, stride: int,
                  items: int | None = None, seed: int = 0) -> list[Prompt]:
    """Every item (with `items`: that many, a sample stratified by kind and seeded, `sets.sample`) at shifts
    0..shifts-1, item-major; `shifts` must be a multiple of `stride` so every phase group holds every item equally
    often."""
    check_shifts(shifts, stride)
    chosen: Sequence[Item] = sample(decision_set.items, items, seed)
    return [p for item in chosen for p in item_prompts(tokenizer, item, shifts=shifts, stride=stride,
                                                       chat=decision_set.chat)]
