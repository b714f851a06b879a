"""The token pieces of the long-context prompt sets (`phasekv.data.longcontext`), built for any tokenizer.

The long-context needle test (docs/science.md section 3) needs thousands of distinct keys of one constant token
length, one-token answers, a one-token filler and, for the needle family, prose.  No word list gives 16,000
single-token keys for every tokenizer, so a key is a code of `key_tokens` pieces, each a single-token word with
a leading space (" owl", " river"): byte-level BPE (GPT-2) and metaspace BPE (Llama, SentencePiece-like) both
split text at spaces before merging, so the pieces of a code cannot merge across their boundaries, and every code
is exactly k tokens.  That argument is checked, not assumed: every piece, every adjacent pair of pieces, and each
piece before the key terminator ":" must
tokenize back to exactly its own ids (round-trip tokenization); a piece that fails any check is dropped.

A code's first piece is a word found nowhere in the prose, header or tail, so a key occurs in a prompt only as
itself (its other pieces may be any key words); a code of k pieces over A1 first and A other words gives
A1 A^(k - 1) distinct keys.

A record is `<code>:` followed by a one-token value `" Name"`; the answer is that value token.  Values are
person names, keys are ordinary words, and the two alphabets never share a token.

A phasekv checkpoint's word vocabulary (`phasekv.data.vocab.Vocabulary`, one word a token, no unknown token) is
its own key space (`vocabulary_key_space`): its key words are the pieces (there is no prose, so each may start a
code), its value words the answers, its first filler word both the padding and the records family's spacer; no
header, tail or terminator, so a record is its code directly followed by its value, as in the training data
(`phasekv.data.lookup`).  Its size is the model's, not the 16,000 keys a tokenizer's key space must offer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from phasekv.data.formats import haystack_sentences
from phasekv.data.vocab import BASE_WORDS, Vocabulary

FAMILIES = ("records", "needle")
_HEADERS = {"records": "Here is a long list of records, each a key of a few words and a name.\n",
            "needle": "Below is a long text. Hidden in it are records, each a key of a few words and a name. "
                      "Remember them.\n"}
_TAIL = "\nThat is the end. The name that follows the key below, according to the text:\n"
_FILLERS = (" ...", " um", "\n", ".")  # the first that is one token is the padding unit
_TERMINATOR = ":"


def _encoder(tokenizer: Any):
    """A function texts -> lists of ids (no special tokens) for a transformers or a `tokenizers` tokenizer; a text
    it cannot encode is one ValueError."""
    def encode(texts):
        try:
            if hasattr(tokenizer, "encode_batch"):  # tokenizers.Tokenizer
                return [e.ids for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]
            return tokenizer(list(texts), add_special_tokens=False)["input_ids"]
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception for unknown words
            raise ValueError(f"tokenizer: cannot encode the long-context set's text ({str(exc).splitlines()[0]}); a "
                             "word-level tokenizer without an unknown token (a phasekv checkpoint's) renders no "
                             "long-context set") from None
    return encode


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
    names = tuple(dict.fromkeys(BASE_WORDS["values"]))
    words = [w.strip(".,;:!?\"'()").lower() for line in haystack_sentences() for w in line.split()]
    words += BASE_WORDS["keys"] + BASE_WORDS["background"]
    keys = tuple(dict.fromkeys(w for w in words if w.isalpha() and w.isascii() and len(w) > 1))
    return keys, names


@dataclass
class KeySpace:
    """The pieces of one tokenizer (module docstring).  Arrays are int64 token ids."""

    bos: int
    pieces: np.ndarray  # (A,) single-token key words
    first: np.ndarray  # (A1,) the pieces that occur in no prose, header or tail: a code's first piece
    terminator: int | None  # ":" after a key code (None: the code is directly followed by the value)
    values: np.ndarray  # (V,) single-token answers
    filler: int  # one padding token
    newline: int  # the spacer of the records family
    header: dict[str, np.ndarray]  # family -> header ids
    tail: np.ndarray
    sentences: list[np.ndarray]  # the prose of the needle family, one sentence each (none: no needle family)
    vocabulary: bool = False  # a phasekv word vocabulary's (module docstring), not a tokenizer's

    @property
    def frame(self) -> list[int]:
        """The terminator as a list of ids: [":"] or [] (the query is the code and this)."""
        return [] if self.terminator is None else [self.terminator]

    def size(self, key_tokens: int) -> int:
        """Distinct keys of `key_tokens` pieces."""
        return len(self.first) * len(self.pieces) ** (key_tokens - 1)

    def codes(self, numbers: np.ndarray, key_tokens: int) -> np.ndarray:
        """Key numbers (n,) in [0, size) -> their pieces (n, key_tokens): a first piece, then any pieces."""
        codes = np.empty((len(numbers), key_tokens), dtype=np.int64)
        rest = np.asarray(numbers, dtype=np.int64)
        for k in reversed(range(1, key_tokens)):
            rest, digit = np.divmod(rest, len(self.pieces))
            codes[:, k] = self.pieces[digit]
        codes[:, 0] = self.first[rest]
        return codes

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


def vocabulary_key_space(vocab: Vocabulary) -> KeySpace:
    """The key space of a phasekv word vocabulary (module docstring)."""
    filler = vocab.group("fillers")[0]
    empty = np.zeros(0, dtype=np.int64)
    keys = np.asarray(vocab.group("keys"), dtype=np.int64)
    return KeySpace(bos=vocab.bos, pieces=keys, first=keys, terminator=None,
                    values=np.asarray(vocab.group("values"), dtype=np.int64), filler=filler, newline=filler,
                    header={f: empty for f in FAMILIES}, tail=empty, sentences=[], vocabulary=True)


def build_key_space(tokenizer: Any) -> KeySpace:
    """The pieces of `tokenizer` (module docstring), every one checked by round-trip tokenization after running
    text: alone, before ":", and after and before another piece (its neighbours in the list; a pair that fails
    drops both).  A phasekv `Vocabulary` gives `vocabulary_key_space`."""
    if isinstance(tokenizer, Vocabulary):
        return vocabulary_key_space(tokenizer)
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
    pairs = [(words[k - 1], w) for k, w in enumerate(words)]  # every piece after one and before another
    bad = {w for (w, ids) in zip(words, encode([f" {w}{_TERMINATOR}" for w in words]))
           if ids != [keys[w], terminator[0]]}
    bad |= {w for (a, b), ids in zip(pairs, encode([f" {a} {b}" for a, b in pairs]))
            if ids != [keys[a], keys[b]] for w in (a, b)}
    pieces = np.array([keys[w] for w in words if w not in bad], dtype=np.int64)
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
    header = {f: np.array(plain([t])[0], dtype=np.int64) for f, t in _HEADERS.items()}
    tail = np.array(encode([_TAIL])[0], dtype=np.int64)
    sentences = [np.array(ids, dtype=np.int64) for ids in encode([" " + s for s in haystack_sentences()]) if ids]
    # a code starts with a token found nowhere but at the start of codes, so no key can occur in the prose, the
    # frame, or across a record's boundary (its other pieces may be prose words)
    seen = np.concatenate([*sentences, *header.values(), tail])
    first = pieces[~np.isin(pieces, seen)]
    if len(first) < 2:
        raise ValueError(f"tokenizer: only {len(first)} single-token key words occur nowhere in the prose; a "
                         "long-context prompt set needs at least 2")
    return KeySpace(bos=_bos(tokenizer), pieces=pieces, first=first, terminator=terminator[0], values=answers,
                    filler=filler, newline=newline[0], header=header, tail=tail, sentences=sentences)


def train_bpe(kind: str = "byte-level", vocab_size: int = 3000):
    """A small BPE tokenizer (`tokenizers.Tokenizer`) trained in well under a second on the built-in prose and word
    lists, for tests and benchmarks that need a real subword tokenizer without a download: "byte-level" (GPT-2's
    family: byte alphabet, regex pre-split) or "metaspace" (Llama's SentencePiece-like family: spaces become "▁")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    keys, names = _candidate_words()
    lines = list(haystack_sentences()) * 3 + [" ".join(keys[i:i + 12]) + ":" for i in range(0, len(keys), 12)] * 20
    lines += [": " + " ".join(names[i:i + 12]) for i in range(0, len(names), 12)] * 20
    lines += [_HEADERS["needle"] + _HEADERS["records"] + _TAIL + " ..."] * 5
    if kind == "byte-level":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        specials, alphabet = ["<|endoftext|>"], pre_tokenizers.ByteLevel.alphabet()
    elif kind == "metaspace":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
        specials, alphabet = ["<unk>", "<s>", "</s>"], []
    else:
        raise ValueError(f"kind: must be 'byte-level' or 'metaspace', got {kind!r}")
    tok.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                       initial_alphabet=alphabet, show_progress=False))
    return tok
