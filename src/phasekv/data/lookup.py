"""The lookup prompt family (docs/science.md section 3) and the training stream built from it.

One family serves training and evaluation.  A sequence is laid out by `assemble`:

    <bos>  gap[0] fillers  record 0  gap[1] fillers  record 1 ... record N-1  gap[N] fillers  queries

A record is `key_tokens` key words (animals) directly followed by `value_tokens` value words
(person names); the N records of a sequence have distinct keys and random values.  A query repeats
the key and value of one record.  An evaluation prompt (`phasekv.data.protocols`) is exactly such a
sequence whose queries are the demonstrations, followed by one more query cut after its key: the
target.  Positions count every token, <bos> and fillers included (position 0 is <bos>).

Local-window rule (`outside_local_window`, used by training and evaluation alike).  The raw local
window of the query position t (the last token of the queried key, whose logits predict the value)
holds positions t - local_window + 1 .. t (itself included, as in `ModelConfig.local_window`).  A
lookup counts only if every token of every earlier copy of the queried record (the record itself
and any earlier query of the same key) lies outside that window:

    last token of the latest earlier copy  <=  t - local_window.

So the value cannot be copied from raw tokens of the one layer's window; retrieval must go through
compressed entries (or, in a full-attention model, through attention beyond the window).  A deeper
stack of raw windows can still relay information further; pass a larger local_window to exclude that.

Training examples ("dense multi-query" format, `TrainingStream`):

    <bos>  p fillers  N records (gap_fillers fillers scattered between them)  o fillers
           Q queries  (prefix_max + outer_max - p - o) trailing fillers

p ~ U{0..prefix_max} (default 23: every residue mod 24, hence every phase mod S for S in
{4, 6, 8, 12}, equally likely), o ~ U{0..outer_max}; the trailing fillers make every sequence the
same length without moving any position.  Queries are drawn WITH replacement (queries that never
repeat could be answered late by elimination).  Labels are aligned with the logits, i.e. already
shifted: labels[t] is the target of the prediction made at position t, -100 where there is no loss.
A query is supervised (all of its value tokens) iff it passes the local-window rule; `answer_mask`
marks the first-value-token positions, where lookup accuracy is measured.  Background examples are
<bos> plus a walk of a fixed sparse Markov chain over the background words (each word has
`background_successors` successors with Dirichlet(1) probabilities, fixed by `chain_seed`), every
next token supervised. Each example is a background example with probability background_fraction. Of the others, a
share repeat_fraction are repeat examples: <bos>, a uniform random sequence of m key and value words, m ~
U{local_window + 1 .. (T - 1) // 2}, the same sequence again, fillers up to T; every token of the second copy but
its first is supervised, predicted from the same token m positions back. m varies so that a head attending at a
fixed distance cannot solve it (a fixed m was measured to train exactly that, and no lookup). Full attention must
retrieve through a two-layer induction circuit (a previous-token head, then a matching head) that the lookup's 32
supervised answers per sequence train only slowly; a repeat example trains the same circuit at every position. With
repeat_fraction = 0 no draw is made, so streams without it are unchanged.

The o fillers are the training counterpart of the evaluation protocols' outer fillers (between the
records and the demonstrations); outer_max = 0 gives the prototype's format.  The default
gap_fillers = 0 keeps records contiguous, so in-sequence evaluation prompts (about one filler per
record between the records) lie outside the trained layout; gap_fillers ~ n_records * insequence_gap
trains on it.

Determinism and sharding: example i of the stream is a pure function of (seed, i).  The global batch
of step s is examples s * B * world_size + [0, B * world_size) (B = per-rank batch size); rank r
takes the contiguous slice r * B + [0, B).  So 2 ranks with batch B see exactly the examples of one
rank with batch 2 B.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from phasekv.config import DataConfig
from phasekv.data.vocab import Vocabulary

IGNORE = -100
_TRAIN, _VALIDATION, _CHAIN = 0, 1, 2  # RNG stream tags, so the streams never share draws


def outside_local_window(source_end: int, query_position: int, local_window: int) -> bool:
    """True iff position `source_end` lies outside the raw window of `query_position` (see module doc)."""
    return source_end <= query_position - local_window


class Layout(NamedTuple):
    ids: list[int]
    record_positions: list[int]  # position of each record's first key token
    query_positions: list[int]  # position of each query's first key token


def assemble(bos: int, keys: np.ndarray, values: np.ndarray, gaps: list[int], fillers: np.ndarray,
             queries: list[int], *, header: list[int] = (), tail: list[int] = (),
             haystack: list[list[int]] | None = None) -> Layout:
    """<bos> header, then record i preceded by gaps[i] fillers, gaps[N] fillers, tail, then the queried
    records.

    keys (N, key_tokens) and values (N, value_tokens) are token ids; gaps has N + 1 entries; fillers
    holds at least sum(gaps) filler ids, used in order; queries are record indices; header and tail are
    a prompt format's framing (`phasekv.data.formats`; empty for the synthetic task).  haystack (a
    needle format): N + 1 prose pieces of one length; piece i sits between record i's fillers and record
    i, piece N right after record N-1, so fillers never split a piece and the records are needles in prose.
    """
    n = len(keys)
    if len(gaps) != n + 1 or (haystack is not None and len(haystack) != n + 1):
        raise ValueError(f"gaps, haystack: expected {n + 1} entries each, got {len(gaps)}, "
                         f"{None if haystack is None else len(haystack)}")
    ids = [bos, *header]
    used = 0
    record_positions = []
    for i in range(n + 1):
        if i == n and haystack is not None:
            ids.extend(haystack[n])
        ids.extend(fillers[used:used + gaps[i]].tolist())
        used += gaps[i]
        if i < n:
            if haystack is not None:
                ids.extend(haystack[i])
            record_positions.append(len(ids))
            ids.extend(keys[i].tolist())
            ids.extend(values[i].tolist())
    ids.extend(tail)
    query_positions = []
    for r in queries:
        query_positions.append(len(ids))
        ids.extend(keys[r].tolist())
        ids.extend(values[r].tolist())
    return Layout(ids, record_positions, query_positions)


def sample_records(rng: np.random.Generator, vocab: Vocabulary, n: int, key_tokens: int,
                   value_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """n records: keys (n, key_tokens) all distinct, values (n, value_tokens) uniform with replacement.
    A vocabulary with its own record pieces (a prompt format) samples them itself."""
    if hasattr(vocab, "sample_records"):
        return vocab.sample_records(rng, n, key_tokens, value_tokens)
    key_ids = np.asarray(vocab.group("keys"))
    space = len(key_ids) ** key_tokens
    if n > space:
        raise ValueError(f"n_records: {n} distinct keys needed, only {space} exist")
    flat = rng.choice(space, size=n, replace=False)
    digits = (flat[:, None] // len(key_ids) ** np.arange(key_tokens)[::-1]) % len(key_ids)  # (n, key_tokens)
    values = rng.choice(np.asarray(vocab.group("values")), size=(n, value_tokens))
    return key_ids[digits], values


def filler_tokens(rng: np.random.Generator, vocab: Vocabulary, n: int) -> np.ndarray:
    return rng.choice(np.asarray(vocab.group("fillers")), size=n)


def scatter(rng: np.random.Generator, n: int, slots: int) -> np.ndarray:
    """Counts of n items dropped independently and uniformly into `slots` slots."""
    return np.bincount(rng.integers(slots, size=n), minlength=slots)


class MarkovChain:
    """A fixed sparse random Markov chain over `n_states` states (the background "language")."""

    def __init__(self, n_states: int, successors: int, seed: int):
        rng = np.random.default_rng([seed, _CHAIN])
        self.successors = np.stack([rng.choice(n_states, successors, replace=False) for _ in range(n_states)])
        self.probs = rng.dirichlet(np.ones(successors), size=n_states)  # (n_states, successors)
        self._cumulative = [list(np.cumsum(p)[:-1]) for p in self.probs]
        self._next = self.successors.tolist()

    def sample(self, rng: np.random.Generator, length: int) -> np.ndarray:
        """A walk of `length` states from a uniformly drawn start state."""
        u = rng.random(length).tolist()
        state = int(rng.integers(len(self._next)))
        out = []
        for t in range(length):
            out.append(state)
            state = self._next[state][bisect.bisect_right(self._cumulative[state], u[t])]
        return np.asarray(out)

    def transition_matrix(self) -> np.ndarray:
        n = len(self.successors)
        matrix = np.zeros((n, n))
        np.add.at(matrix, (np.arange(n)[:, None], self.successors), self.probs)
        return matrix

    def entropy_rate(self) -> float:
        """Nats per token of the stationary chain: the floor of the background loss after the first token."""
        matrix = self.transition_matrix()
        pi = np.full(len(matrix), 1 / len(matrix))
        for _ in range(10_000):
            nxt = pi @ matrix
            if np.abs(nxt - pi).max() < 1e-13:
                break
            pi = nxt
        row_entropy = -(self.probs * np.log(self.probs)).sum(axis=1)
        return float(pi @ row_entropy)


@dataclass(frozen=True)
class Example:
    """One training sequence.  For background examples the position lists are empty."""

    ids: np.ndarray  # (T,) int64
    labels: np.ndarray  # (T,) int64, aligned with the logits, IGNORE where no loss
    answer_mask: np.ndarray  # (T,) bool, positions predicting a query's first value token
    kind: str  # "lookup", "background" or "repeat"
    prefix: int = 0  # fillers before the first record
    record_positions: tuple[int, ...] = ()
    query_positions: tuple[int, ...] = ()
    query_records: tuple[int, ...] = ()  # which record each query repeats
    supervised: tuple[bool, ...] = ()  # per query: passed the local-window rule


class Batch(NamedTuple):
    input_ids: torch.Tensor  # (B, T) long
    labels: torch.Tensor  # (B, T) long, IGNORE where no loss
    answer_mask: torch.Tensor  # (B, T) bool, lookup answers: accuracy = top-1 hit rate over these


class TrainingStream:
    """Deterministic, rank-sharded batches of lookup and background sequences (see module doc)."""

    def __init__(self, vocab: Vocabulary, data_config: DataConfig, seed: int, rank: int = 0, world_size: int = 1):
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed: must be an integer >= 0, got {seed!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank: must be in [0, world_size={world_size}), got {rank}")
        cfg = data_config
        if cfg.n_records > len(vocab.group("keys")) ** cfg.key_tokens:
            raise ValueError(f"n_records: {cfg.n_records} distinct keys needed, the vocabulary has "
                             f"{len(vocab.group('keys'))} key words")
        if cfg.background_successors > len(vocab.group("background")):
            raise ValueError("background_successors: exceeds the vocabulary's background words")
        self.vocab, self.config, self.seed = vocab, cfg, seed
        self.rank, self.world_size = rank, world_size
        self.chain = MarkovChain(len(vocab.group("background")), cfg.background_successors, cfg.chain_seed)
        self._background = np.asarray(vocab.group("background"))

    @property
    def seq_len(self) -> int:
        return self.config.seq_len

    def batch(self, step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels), each a LongTensor (batch_size, seq_len): this rank's share of step `step`."""
        if step < 0 or batch_size < 1:
            raise ValueError(f"batch: need step >= 0 and batch_size >= 1, got {step}, {batch_size}")
        start = (step * self.world_size + self.rank) * batch_size
        examples = [self.example(start + j) for j in range(batch_size)]
        return _stack(examples)[:2]

    def example(self, index: int, tag: int = _TRAIN, seed: int | None = None) -> Example:
        """Example `index` of the stream; a pure function of (seed, tag, index)."""
        rng = np.random.default_rng([self.seed if seed is None else seed, tag, index])
        if rng.random() < self.config.background_fraction:
            return self._background_example(rng)
        if self.config.repeat_fraction and rng.random() < self.config.repeat_fraction:
            return self._repeat_example(rng)
        return self._lookup_example(rng, self.records_at(index) if tag == _TRAIN else self.config.n_records)

    def records_at(self, index: int) -> int:
        """Records in training example `index`: the curriculum ramps linearly from curriculum_start to
        n_records over the first curriculum_examples examples (fewer records = an easier lookup);
        validation always uses n_records."""
        cfg = self.config
        if not cfg.curriculum_start or index >= cfg.curriculum_examples:
            return cfg.n_records
        return cfg.curriculum_start + (cfg.n_records - cfg.curriculum_start) * index // cfg.curriculum_examples

    def validation_set(self, n: int, seed: int | None = None, batch_size: int = 64) -> list[Batch]:
        """n fixed held-out sequences (same mixture, a separate RNG stream) in batches of batch_size.

        Validation loss = mean over labels != IGNORE; lookup accuracy = top-1 hits over answer_mask.
        """
        if n < 1 or batch_size < 1:
            raise ValueError(f"validation_set: need n >= 1 and batch_size >= 1, got {n}, {batch_size}")
        examples = [self.example(i, _VALIDATION, seed) for i in range(n)]
        return [_stack(examples[i:i + batch_size]) for i in range(0, n, batch_size)]

    def _background_example(self, rng: np.random.Generator) -> Example:
        T = self.seq_len
        ids = np.concatenate([[self.vocab.bos], self._background[self.chain.sample(rng, T - 1)]])
        labels = np.full(T, IGNORE)
        labels[:-1] = ids[1:]
        return Example(ids.astype(np.int64), labels, np.zeros(T, dtype=bool), "background")

    def _repeat_example(self, rng: np.random.Generator) -> Example:
        T = self.seq_len
        m = int(rng.integers(self.config.local_window + 1, (T - 1) // 2 + 1))
        words = np.asarray(self.vocab.group("keys") + self.vocab.group("values"))
        half = words[rng.integers(len(words), size=m)]
        pad = filler_tokens(rng, self.vocab, T - 1 - 2 * m)
        ids = np.concatenate([[self.vocab.bos], half, half, pad]).astype(np.int64)
        labels = np.full(T, IGNORE)
        labels[m + 1:2 * m] = ids[m + 2:2 * m + 1]  # position t predicts ids[t + 1] = ids[t + 1 - m]
        return Example(ids, labels, np.zeros(T, dtype=bool), "repeat")

    def _lookup_example(self, rng: np.random.Generator, n: int) -> Example:
        cfg, vocab = self.config, self.vocab
        keys, values = sample_records(rng, vocab, n, cfg.key_tokens, cfg.value_tokens)
        prefix = int(rng.integers(cfg.prefix_max + 1))
        outer = int(rng.integers(cfg.outer_max + 1))
        inner = scatter(rng, cfg.gap_fillers, n - 1).tolist() if n > 1 else []
        gaps = [prefix, *inner, outer]
        queries = rng.integers(n, size=cfg.n_queries).tolist()
        spare = (cfg.n_records - n) * cfg.record_length  # records the curriculum leaves out: trailing fillers
        fillers = filler_tokens(rng, vocab, cfg.prefix_max + cfg.outer_max + cfg.gap_fillers + spare)
        layout = assemble(vocab.bos, keys, values, gaps, fillers, queries)
        ids = layout.ids + fillers[sum(gaps):].tolist()  # trailing fillers: equal lengths, no shift

        T, k, rec = cfg.seq_len, cfg.key_tokens, cfg.record_length
        labels = np.full(T, IGNORE)
        answer = np.zeros(T, dtype=bool)
        latest_end = [p + rec - 1 for p in layout.record_positions]  # last token of the latest copy
        supervised = []
        for record, start in zip(queries, layout.query_positions):
            t = start + k - 1  # predicts the first value token
            ok = outside_local_window(latest_end[record], t, cfg.local_window)
            if ok:
                labels[t:t + cfg.value_tokens] = values[record]
                answer[t] = True
            supervised.append(ok)
            latest_end[record] = start + rec - 1
        return Example(np.asarray(ids, dtype=np.int64), labels, answer, "lookup", prefix=prefix,
                       record_positions=tuple(layout.record_positions),
                       query_positions=tuple(layout.query_positions), query_records=tuple(queries),
                       supervised=tuple(supervised))


def _stack(examples: list[Example]) -> Batch:
    return Batch(torch.from_numpy(np.stack([e.ids for e in examples])),
                 torch.from_numpy(np.stack([e.labels for e in examples]).astype(np.int64)),
                 torch.from_numpy(np.stack([e.answer_mask for e in examples])))
