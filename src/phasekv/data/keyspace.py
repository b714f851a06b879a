"""The token pieces of the long-context prompt sets (`phasekv.data.longcontext`), built for any tokenizer.

The long-context needle test (docs/science.md section 3) needs thousands of distinct keys of one constant token
length, one-token answers, a one-token filler and, for the needle family, prose.  No word list gives 16,000
single-token keys for every tokenizer, so a key is a code of `key_tokens` pieces, each a single-token word with
a leading space (" owl", " river"): byte-level BPE (GPT-2) and metaspace BPE (Llama, SentencePiece-like) both
split text at spaces before merging, so the pieces of a code cannot merge across their boundaries, and a code
of k pieces over an alphabet of A words gives A^k distinct keys of exactly k tokens.  That argument is checked,
not assumed: every piece, every adjacent pair of pieces, and each piece before the key terminator ":" must
tokenize back to exactly its own ids (round-trip tokenization); a piece that fails any check is dropped.

A record is `<code>:` followed by a one-token value `" Name"`; the answer is that value token.  Values are
person names, keys are ordinary words, and the two alphabets never share a token.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from phasekv.data.formats import haystack_sentences
from phasekv.data.vocab import _BASE

FAMILIES = ("records", "needle")
_HEADERS = {"records": "Here is a long list of records, each a key of a few words and a name.\n",
            "needle": "Below is a long text. Hidden in it are records, each a key of a few words and a name. "
                      "Remember them.\n"}
_TAIL = "\nThat is the end. The name that follows the key below, according to the text:\n"
_FILLERS = (" ...", " um", "\n", ".")  # the first that is one token is the padding unit
_TERMINATOR = ":"


def _encoder(tokenizer: Any):
    """A function texts -> lists of ids (no special tokens) for a transformers or a `tokenizers` tokenizer."""
    if hasattr(tokenizer, "encode_batch"):  # tokenizers.Tokenizer
        return lambda texts: [e.ids for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]
    return lambda texts: tokenizer(list(texts), add_special_tokens=False)["input_ids"]


def _bos(tokenizer: Any) -> int:
    for name in ("bos_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    if hasattr(tokenizer, "token_to_id"):  # tokenizers.Tokenizer: the usual names of its start token
        for token in ("<s>", "<|endoftext|>", "<bos>", "<|im_start|>"):
            if tokenizer.token_to_id(token) is not None:
                return tokenizer.token_to_id(token)
    raise ValueError("tokenizer: has neither a bos nor an eos token to start prompts with")


@functools.cache
def _candidate_words() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(key words, value words): lowercase words of the built-in prose and word lists, and person names."""
    names = tuple(dict.fromkeys(_BASE["values"]))
    words = [w.strip(".,;:!?\"'()").lower() for line in haystack_sentences() for w in line.split()]
    words += _BASE["keys"] + _BASE["background"]
    keys = tuple(dict.fromkeys(w for w in words if w.isalpha() and w.isascii() and len(w) > 1))
    return keys, names


@dataclass
class KeySpace:
    """The pieces of one tokenizer (module docstring).  Arrays are int64 token ids."""

    bos: int
    pieces: np.ndarray  # (A,) single-token key words
    terminator: int  # ":" after a key code
    values: np.ndarray  # (V,) single-token answers
    filler: int  # one padding token
    newline: int  # the spacer of the records family
    header: dict[str, np.ndarray]  # family -> header ids
    tail: np.ndarray
    sentences: list[np.ndarray]  # the prose of the needle family, one sentence each

    def size(self, key_tokens: int) -> int:
        """Distinct keys of `key_tokens` pieces."""
        return len(self.pieces) ** key_tokens

    def codes(self, numbers: np.ndarray, key_tokens: int) -> np.ndarray:
        """Key numbers (n,) in [0, size) -> their pieces (n, key_tokens), most significant piece first."""
        digits = np.empty((len(numbers), key_tokens), dtype=np.int64)
        rest = np.asarray(numbers, dtype=np.int64)
        for k in reversed(range(key_tokens)):
            rest, digits[:, k] = np.divmod(rest, len(self.pieces))
        return self.pieces[digits]

    def prose(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """n tokens of whole sentences in a random order (each pass over the list in its own order), cut at n."""
        lengths = np.array([len(s) for s in self.sentences])
        starts = np.cumsum(lengths) - lengths
        passes = -(-n // int(lengths.sum()))
        order = np.concatenate([rng.permutation(len(lengths)) for _ in range(passes)])
        span = lengths[order]
        index = np.arange(int(span.sum())) + np.repeat(starts[order] - (np.cumsum(span) - span), span)
        return np.concatenate(self.sentences)[index[:n]]


def _in_context(encode, lead: str = " the"):
    """`encode` for text that follows other text (a metaspace tokenizer marks the start of a text): each text is
    encoded after `lead` and returned without lead's ids (None where the join changed them)."""
    head = encode([lead])[0]

    def run(texts):
        return [ids[len(head):] if ids[:len(head)] == head else None for ids in encode([lead + t for t in texts])]
    return run


def build_key_space(tokenizer: Any) -> KeySpace:
    """The pieces of `tokenizer` (module docstring), every one checked by round-trip tokenization: alone, before
    ":", and between two other pieces (its neighbours in the list, so every piece is checked on both sides)."""
    plain = _encoder(tokenizer)
    encode = _in_context(plain)
    key_words, names = _candidate_words()

    def single(words: tuple[str, ...]) -> dict[str, int]:
        return {w: i[0] for w, i in zip(words, encode([" " + w for w in words])) if i is not None and len(i) == 1}

    terminator = encode([_TERMINATOR])[0]
    if terminator is None or len(terminator) != 1:
        raise ValueError(f"tokenizer: the key terminator {_TERMINATOR!r} is not one token; it must be")
    values = single(names)
    taken = set(values.values())
    keys = {w: i for w, i in single(key_words).items() if i not in taken}
    words = list(keys)
    triples = [(words[k - 1], w, words[(k + 1) % len(words)]) for k, w in enumerate(words)]
    checked = encode([f" {a} {b} {c}{_TERMINATOR}" for a, b, c in triples])
    pieces = np.array([keys[b] for (a, b, c), ids in zip(triples, checked)
                       if ids == [keys[a], keys[b], keys[c], terminator[0]]], dtype=np.int64)
    record = encode([f"{_TERMINATOR} {n}" for n in values])
    answers = np.array([i for (n, i), ids in zip(values.items(), record) if ids == [terminator[0], i]],
                       dtype=np.int64)
    if len(pieces) < 2 or len(answers) < 2:
        raise ValueError(f"tokenizer: only {len(pieces)} single-token key words and {len(answers)} single-token "
                         "names survive round-trip tokenization; a long-context prompt set needs at least 2 of each")
    filler = next((ids[0] for ids in encode(_FILLERS) if ids is not None and len(ids) == 1), None)
    newline = encode(["\n"])[0]
    if filler is None or newline is None or len(newline) != 1:
        raise ValueError(f"tokenizer: none of the fillers {_FILLERS} (or the newline) is one token")
    return KeySpace(bos=_bos(tokenizer), pieces=pieces, terminator=terminator[0], values=answers, filler=filler,
                    newline=newline[0], header={f: np.array(plain([t])[0], dtype=np.int64)
                                                for f, t in _HEADERS.items()},
                    tail=np.array(encode([_TAIL])[0], dtype=np.int64),
                    sentences=[np.array(ids, dtype=np.int64) for ids in encode([" " + s for s in haystack_sentences()])
                               if ids])
