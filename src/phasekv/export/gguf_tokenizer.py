"""The tokenizer phasekv's GGUF exports carry: one token per phasekv vocabulary word (`word_tokens`), and BPE merges
under which llama.cpp rebuilds every word from its characters (`word_merges`, checked against `bpe_split`, the
merge order of llama.cpp's BPE session), so llama.cpp's own text tokenization equals `Vocabulary.encode`;
`word_tokenizer` is the same vocabulary as a transformers tokenizer (what `--tokenizer` reads).
"""

from __future__ import annotations

from typing import Any


def word_tokens(vocab: Any, size: int) -> list[str]:
    """One token per id: the vocabulary's words, then `[PADn]` for the embedding rows no word uses."""
    if vocab.size > size:
        raise ValueError(f"model.vocab_size: {size} ids cannot hold the vocabulary's {vocab.size} words")
    return [*vocab.words, *(f"[PAD{i}]" for i in range(vocab.size, size))]


def bpe_split(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """`word` byte-pair merged as llama.cpp's BPE session does: the lowest-ranked adjacent pair (leftmost on a
    tie) merges first, one pair at a time, until no pair has a rank."""
    symbols = list(word)
    while len(symbols) > 1:
        rank, i = min((ranks.get((a, b), len(ranks)), i) for i, (a, b) in enumerate(zip(symbols, symbols[1:])))
        if rank == len(ranks):
            break
        symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
    return symbols


def word_merges(words: list[str]) -> list[str]:
    """Merges ("left right") under which every word of `words` is rebuilt from its characters.  Each word first
    gets the chain of its prefixes; a word another word's merges break up (a pair of its letters merged first
    elsewhere, e.g. "o n" of "on" inside "salmon") then gets merges joining the pieces it stops at, ranked after
    all earlier ones, so they never fire in a word that already completes."""
    merges: list[tuple[str, str]] = []
    for word in words:
        merges += [(word[:i], word[i]) for i in range(1, len(word))]
    ranks: dict[tuple[str, str], int] = {}
    for pair in merges:
        ranks.setdefault(pair, len(ranks))
    for word in words:
        pieces = bpe_split(word, ranks)
        while len(pieces) > 1:
            ranks.setdefault((pieces[0], pieces[1]), len(ranks))
            pieces = [pieces[0] + pieces[1], *pieces[2:]]
    return [f"{a} {b}" for (a, b), _ in sorted(ranks.items(), key=lambda kv: kv[1])]


def word_tokenizer(vocab: Any, size: int):
    """The vocabulary as a transformers tokenizer: whitespace-separated words, one id each (`word_tokens`), <bos>
    as bos, <pad> as pad and eos (DeepSeek-V4's config defaults, bos 0 and eos 1); an unknown word is an error."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = word_tokens(vocab, size)
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with single spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=tokens[vocab.bos], pad_token="<pad>",
                                   eos_token="<pad>")
