"""Evaluation prompt sets of the controlled lookup task: prefix and in-sequence padding, and the query-phase
protocol (docs/science.md s. 3).

A prompt is a sequence of the lookup family (`phasekv.data.lookup.assemble`): <bos>, N records with
fillers around them, D demonstrations (key-value queries of records that are not targets of the
context), then the target key; the answer is the first token of the target's value.  Prompts that
share everything but the target form a `Context` (ids up to, excluding, the target key) with several
`Query`s, so a runner can prefill the context once and continue each query from a copy of the cache.
`EvalSet.prompts()` is the flat view (one full prompt per query).

Padding protocols (fillers are real filler tokens; every prompt of a prefix or insequence set has the
same length, so the query position is fixed; positions count every token, <bos> at 0):

* prefix:      <bos> (f + s fillers) records (E - f - s fillers) demos target.  All records move
               together.
* insequence:  fillers also sit between records.  Each target j of a context is preceded by exactly
               f + gap * i_j + s fillers (i_j its record index), which fixes its position; the
               fillers of every stretch between consecutive targets (and before the first and after
               the last) are dropped uniformly at random into that stretch's gaps, afresh for every
               shift, so the distractors around a target move relative to it.  Targets of one
               context keep their mutual offsets.
* query:       the query-phase protocol, crossed with the shift: <bos> (f + e fillers) records (g - 1 - f + s
               fillers) demos target.  e = (c // g) mod E is the cluster's length offset (`query_length_offset`; E = S
               where R >= 3 S, else 3 S, `offset_count`),
               s the shift after the records; the query position is Q0 + e + s (Q0: the shortest prompt's), so a
               context's query phase is (Q0 + e + s) mod S.  Every target keeps its position at every shift.
               Prompt lengths differ, so `prompt_length` is the longest.
The shift s runs over 0..R-1; f in [0, g) is the cluster's family offset (below);
E = (g - 1) + (R - 1) + gap * N fillers in all (gap = 0 for prefix).  So prefix fillers and outer
fillers each range over 0..R+g-2: 0..24 for 2-token records, one token beyond the training default
prefix_max = outer_max = 23 (the g - 1 extra tokens let records start at every residue mod g).

Position matching, by construction.  A cluster is one logical example (records, their order, filler words,
demonstrations, targets).  Each (cluster, target) pair has a base position b (its key position at
s = 0) and is shown at every shift s = 0..R-1, at b + s; so every residue group (position mod R)
holds every pair exactly once: the groups contain the same logical examples and differ only in
position.  Write b = R x + rho.  In group r the pair sits at r + R (x + [rho > r]).  With K pairs of
each base residue rho ("balanced", n = R K pairs per group), elementary algebra gives

    mean_r = mean(b) + (R - 1) / 2                                (the same for every r)
    var_r  = var_{R-1} + (2 / K) * S_r,   S_r = sum_{rho > r} (Sigma_rho - mean_rho' Sigma_rho')

where Sigma_rho is the sum of the bases of residue rho.  So means are always equal, and variances
are equal iff all residue classes of bases have the same sum.  The bases of one class are spaced by
P = lcm(w, R) (w: record pitch, below; P = R whenever w divides R, as with every default), so
Sigma_rho = K b0_rho (mod P), b0_rho the class's first base; with P = R, equal sums need R | K, i.e.
n = R^2 pairs per group (576 at R = 24).  That size is unavoidable up to a factor 2: for ANY design
with equally weighted prompts, equal means need R | n and equal variances need R^2 / 2 | n (write the
group-g positions as g + R m and demand equal sums of p and p^2; the conditions for g = 0, 1, 2
force 2 n = 0 mod R^2).  The full sweep pays the factor 2 for identical logical examples in every
group.  The class sums are set on their lattices (the best of the R possible common levels, then
greedily from the top residue down) so that every |S_r| <= P / 2, and S_r = 0 when the lattices
share a level: with fewer prompts the means stay exactly equal and the variances differ by at most
2 P / K (position^2; 2 R / K when P = R).
Phase groups (mod S, S | R) pool R / S residue groups of equal size, mean and variance, so they
match as well.  `EvalSet.matching_stats()` measures both with exact integer arithmetic.

The query protocol, grouped by the query phase (query position mod S).  A query-phase group is not one shift:
cluster c shows its records after e_c extra fillers, and with e running through 0..E-1 in every family
(`settings["crossed"]`: n_clusters / g a multiple of E; the default) the algebra above, with e in the role of the
base residue and s of the shift, gives for every phase group p: (a) every shift s, hence every count of fillers
after the records, exactly n_clusters / S times (the contexts of shift s whose offset is = p - Q0 - s mod S);
(b) every (cluster, target) pair R / S times, at the same target position; (c) the same mean prompt length,
Q0 + (E - 1) / 2 + (R - 1) / 2 (e mod S is uniform, and within each residue class the offsets and the shifts are
evenly spaced).  So any effect of the shift (depth, fillers after the records, a layout trend) is the same in
every phase group, and a linear trend in the prompt length cancels exactly; what the protocol cannot cancel is a
sharp change with the length (a threshold inside the R + E - 1 lengths shown), which
`phasekv.evaluate.query_stats` reports as a length effect.  The lengths span (R + E - 1) / S cycles of the
stride, at least three (E = 3 S where R < 3 S): enough to tell a trend from a period. Grouped by the target
position mod R (the source phase) the groups hold each pair at every shift, the pair moved by its cluster's e,
so they are matched only approximately and hold different pairs (the evaluation takes the pair, not the cluster,
as the unit of the source-phase statistics, `verdict.target_pairs`): the padding protocols remain the test of
the source phase.  `matching_stats(coordinate="query")` gives the first view.

Realizing the bases.  In the base layout (s = 0) record i starts at 1 + f + w i, w = record length
(+ gap for insequence).  With g = gcd(w, R) a cluster's bases all have residues = 1 + f (mod g), so
clusters come in g families f = c mod g, and a cluster takes t targets in each of the R / g residue
classes of its family (targets_per_context = t R / g).  Record i of family f lies in the class fixed
by i mod (R / g); within a class, the record indices i = i_rho + (R / g) q are chosen (q spread as
evenly as possible over the records that are valid at every shift, distinct within a cluster) so
that the class sum is the designed one.  K = (n_clusters / g) t.  Defaults: targets_per_context =
R / g and n_clusters = the smallest multiple of g that makes the matching exact (g R when w divides R):
576 prompts per residue group at R = 24; with 2-token records, prefix: 48 clusters x 24 shifts =
1152 contexts of 12 queries; insequence (gap 1, w = 3, g = 3): 72 x 24 = 1728 contexts of 8 queries.

Needle formats (`vocab.haystack_tokens` = h > 0, `phasekv.data.formats`): h tokens of prose precede
every record and follow the last one.  Each prose piece belongs to its record's pitch (w = record + h
(+ gap)) and record 0's piece to the lead, so everything above holds unchanged: prefix padding shifts
the whole haystack, in-sequence fillers fall between the pieces, never inside one.

What prefix padding cannot balance.  With the query position fixed, the f + s fillers before the records and the
E - f - s after them (before the demonstrations) add up to E, and for one record the residue fixes s (r = base + s
mod R): the residue and the number of fillers after the records are one variable.  Their mean is equal in every
group (the groups hold the same pairs at equal mean depth), but no choice of targets or weights makes the pairs
(record, fillers after the records) alike across groups, so a model whose retrieval of SOME records depends on
that number shows a residue pattern, periodic in R, that is no phase effect.  It is a layout effect: training with
outer fillers (`DataConfig.outer_max` >= E) puts the layout in distribution.  Measured on the bundled full-1kv
(trained with outer_max = 0): its last six records fail once fillers push them 12 or more tokens before the first
demonstration, which gives its prefix residue gap; the same examples with the fillers moved after the
demonstrations are flat, and so is the network retrained with outer_max = 24 (docs/notes/full1kv.md,
research/layout_factors.py).

Local window (the query protocol's target moves by e <= E - 1 and its query by -(R - 1 - s) - (E - 1 - e), so the
design checks the window as for padding, target moved R - 1 and query fixed, at Q - 2 (E - 1)): every target record
ends at or before query_position - local_window at every shift
(`lookup.outside_local_window`); records that would not are never targets, and a configuration that
leaves too few valid records raises ValueError.  Demonstrations are never a target's record.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, NamedTuple

import numpy as np

from phasekv.config import EVAL_PROTOCOLS
from phasekv.data.lookup import assemble, filler_tokens, outside_local_window, sample_records, scatter
from phasekv.data.matching import class_starts, design_targets, exact_class_size
from phasekv.data.vocab import Vocabulary

_TAG = {"prefix": 10, "insequence": 11, "query": 12}  # RNG stream tags (lookup.py uses 0..2)
_DESIGN, _CLUSTER, _CONTEXT = 0, 1, 2


@dataclass(frozen=True)
class Query:
    key: tuple[int, ...]  # target key token ids, appended to the context ids
    answer: int  # first token of the target's value
    target_position: int  # position of the target record's first key token
    residue: int  # target_position mod residue_modulus
    phase: int  # target_position mod stride
    shift: int
    cluster: int
    protocol: str
    record: int  # index of the target record in its context
    query_position: int  # position of the last target-key token, whose logits predict the answer


@dataclass
class Context:
    ids: list[int]  # <bos> ... demonstrations: everything before the target key
    queries: list[Query]
    cluster: int
    shift: int
    record_positions: list[int]  # first key token of every record
    demo_records: list[int]  # record index of each demonstration, in prompt order


@dataclass(frozen=True)
class Prompt:
    ids: list[int]  # context ids + target key; the model's last-position logits score the answer
    query: Query
    context: int  # index into EvalSet.contexts


@dataclass
class EvalSet:
    protocol: str
    stride: int
    residue_modulus: int
    local_window: int
    vocab: Vocabulary
    contexts: list[Context]
    settings: dict[str, Any] = field(default_factory=dict)  # the build_eval_set arguments, resolved

    @property
    def prompt_length(self) -> int:
        """Tokens of the longest prompt (of every prompt, except under the query protocol)."""
        return max(len(c.ids) for c in self.contexts) + len(self.contexts[0].queries[0].key)

    @property
    def chance(self) -> float:
        """Accuracy of guessing the answer uniformly: 1 / number of possible answer tokens."""
        return 1.0 / len(self.vocab.group("values"))

    @property
    def in_context_chance(self) -> float:
        """Accuracy of a model that copies a uniformly random value present in its prompt, computed exactly: the
        mean over prompts of 1 / (distinct answer tokens among the context's records).  The capability gate's
        baseline: a prompt of 32 records over 64 values holds ~26 distinct values, so this is ~2.5x `chance`."""
        start = self.settings["key_tokens"]  # a record's value starts right after its key
        total = sum(len(c.queries) / len({c.ids[p + start] for p in c.record_positions}) for c in self.contexts)
        return total / sum(len(c.queries) for c in self.contexts)

    @property
    def query_position(self) -> int:
        """Position of the last target-key token, whose logits predict the answer: the same in every prompt of
        the padding protocols; the longest prompt's under the query protocol (each `Query` holds its own)."""
        return self.prompt_length - 1

    def queries(self) -> list[Query]:
        return [q for c in self.contexts for q in c.queries]

    def prompts(self) -> list[Prompt]:
        return [Prompt(c.ids + list(q.key), q, i) for i, c in enumerate(self.contexts) for q in c.queries]

    def matching_stats(self, modulus: int | None = None, coordinate: str = "target") -> dict[str, Any]:
        """Per group (the `coordinate`'s position mod `modulus`, default residue_modulus; coordinate "target":
        the target key's, "query": the query position's) n, mean and variance (ddof 0) of the target position
        and the mean query position, computed exactly; gaps: max - min of the target means, and (max - min) /
        mean of the variances."""
        modulus = modulus or self.residue_modulus
        if self.residue_modulus % modulus:
            raise ValueError(f"modulus: {modulus} does not divide residue_modulus {self.residue_modulus}")
        if coordinate not in ("target", "query"):
            raise ValueError(f"coordinate: must be 'target' or 'query', got {coordinate!r}")
        n, s1, s2, sq = [0] * modulus, [0] * modulus, [0] * modulus, [0] * modulus
        for q in self.queries():
            r = (q.target_position if coordinate == "target" else q.query_position) % modulus
            n[r] += 1
            s1[r] += q.target_position
            s2[r] += q.target_position ** 2
            sq[r] += q.query_position
        means = [Fraction(s1[r], n[r]) for r in range(modulus)]
        variances = [Fraction(n[r] * s2[r] - s1[r] ** 2, n[r] ** 2) for r in range(modulus)]
        mean_var = sum(variances) / modulus
        return {
            "modulus": modulus,
            "coordinate": coordinate,
            "query_position": self.query_position,
            "n_prompts": sum(n),
            "per_group": [{"group": r, "n": n[r], "mean": float(means[r]), "variance": float(variances[r]),
                           "mean_query_position": float(Fraction(sq[r], n[r]))} for r in range(modulus)],
            "max_mean_gap": float(max(means) - min(means)),
            "max_variance_rel_gap": float((max(variances) - min(variances)) / mean_var) if mean_var else 0.0,
        }

    def describe(self, i: int) -> str:
        """Readable text of flat prompt i: the target record in [brackets], then 'key -> answer'."""
        rest = i
        for context in self.contexts:
            if rest < len(context.queries):
                break
            rest -= len(context.queries)
        else:
            raise IndexError(f"prompt index {i} out of range")
        q = context.queries[rest]
        words = self.vocab.decode(context.ids).split(" ")
        end = q.target_position + self.settings["key_tokens"] + self.settings["value_tokens"] - 1
        words[q.target_position] = "[" + words[q.target_position]
        words[end] = words[end] + "]"
        head = (f"{self.protocol} prompt {i}: cluster {q.cluster}, shift {q.shift}, target record {q.record} at "
                f"position {q.target_position} (residue {q.residue} mod {self.residue_modulus}, phase {q.phase} "
                f"mod {self.stride}), query at position {q.query_position}")
        tail = f"{self.vocab.decode(q.key)} -> {self.vocab.decode([q.answer])}"
        return f"{head}\n{' '.join(words)} {tail}"


def _check_arguments(protocol: str, **ints: int) -> None:
    if protocol not in EVAL_PROTOCOLS:
        raise ValueError(f"protocol: unknown {protocol!r}; choose one of {EVAL_PROTOCOLS}")
    for name, value in ints.items():
        low = 0 if name in ("n_demos", "seed") or (name == "insequence_gap" and protocol != "insequence") else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}: must be an integer >= {low}, got {value!r}")


def build_eval_set(vocab: Vocabulary, protocol: str, *, n_records: int = 64, n_demos: int = 8, stride: int = 8,
                   residue_modulus: int = 24, n_clusters: int | None = None,
                   targets_per_context: int | None = None, local_window: int = 16, key_tokens: int = 1,
                   value_tokens: int = 1, insequence_gap: int = 1, seed: int = 0) -> EvalSet:
    """The prompt set of one padding protocol (see the module docstring for the construction).

    targets_per_context defaults to R / g (g = gcd(record pitch, R)) and n_clusters to the smallest
    count that makes the matching of target-position means and variances exact (g R when the pitch
    divides R).  insequence_gap: fillers per record in the in-sequence layout (ignored by prefix).
    """
    _check_arguments(protocol, n_records=n_records, n_demos=n_demos, stride=stride, residue_modulus=residue_modulus,
                     local_window=local_window, key_tokens=key_tokens, value_tokens=value_tokens, seed=seed,
                     insequence_gap=insequence_gap)
    header, tail = list(vocab.header), list(vocab.tail)
    spacer = vocab.haystack_tokens  # prose before every record and after the last (a needle format)
    lead = 1 + len(header) + spacer  # <bos>, the format's header and record 0's prose precede record 0's fillers
    R = residue_modulus
    if R % stride:
        raise ValueError(f"residue_modulus: {R} is not a multiple of stride {stride}")
    rec = key_tokens + value_tokens
    gap = insequence_gap if protocol == "insequence" else 0
    pitch = rec + spacer + gap
    g = math.gcd(pitch, R)
    classes = R // g  # residue classes a cluster can reach
    first, starts = class_starts(R, g, pitch, lead)
    exact = exact_class_size(starts, pitch * classes)
    targets_per_context = classes if targets_per_context is None else targets_per_context
    if not isinstance(targets_per_context, int) or targets_per_context < 1 or targets_per_context % classes:
        raise ValueError(f"targets_per_context: must be a positive multiple of R / gcd(record pitch {pitch}, R) = "
                         f"{classes}, got {targets_per_context!r}")
    t = targets_per_context // classes
    E = offset_count(R, stride) if protocol == "query" else 1  # the query protocol's length offsets 0..E-1
    n_clusters = _cluster_count(n_clusters, protocol=protocol, g=g, exact=exact, t=t, pitch=pitch, offsets=E)
    if targets_per_context + n_demos > n_records:
        raise ValueError(f"n_records: {n_records} records cannot hold {targets_per_context} targets and "
                         f"{n_demos} demonstrations of other records")
    if n_records > len(vocab.group("keys")) ** key_tokens:
        raise ValueError(f"n_records: {n_records} distinct keys needed, the vocabulary has "
                         f"{len(vocab.group('keys'))} key words")

    offsets = E - 1
    fillers_total = (g - 1) + (R - 1) + gap * n_records + offsets
    query_position = (lead + fillers_total + len(tail) + rec * (n_records + n_demos) + spacer * n_records
                      + key_tokens - 1)
    settings = {"protocol": protocol, "n_records": n_records, "n_demos": n_demos, "stride": stride,
                "residue_modulus": R, "n_clusters": n_clusters, "targets_per_context": targets_per_context,
                "local_window": local_window, "key_tokens": key_tokens, "value_tokens": value_tokens,
                "insequence_gap": gap, "seed": seed, "families": g,
                "exact_matching": (n_clusters // g) * t % exact == 0}
    settings.update({"crossed": (n_clusters // g) % E == 0, "length_offsets": E} if protocol == "query" else {})
    targets = design_targets(R, g, pitch=pitch, rec=rec, lead=lead, first=first, starts=starts, n_records=n_records,
                              n_clusters=n_clusters, t=t, query_position=query_position - 2 * offsets,  # module doc
                              local_window=local_window, rng=np.random.default_rng([seed, _TAG[protocol], _DESIGN]))
    geo = _Geometry(protocol=protocol, R=R, stride=stride, g=g, gap=gap, pitch=pitch, rec=rec, lead=lead, header=header,
                    tail=tail, fillers_total=fillers_total, query_position=query_position, local_window=local_window,
                    n_records=n_records, n_demos=n_demos, key_tokens=key_tokens, value_tokens=value_tokens, seed=seed,
                    tag=_TAG[protocol], spacer=spacer)
    contexts = [ctx for c, target_records in enumerate(targets)
                for ctx in _cluster_contexts(vocab, geo, c, target_records)]
    return EvalSet(protocol, stride, R, local_window, vocab, contexts, settings=settings)


def _cluster_count(n_clusters: int | None, *, protocol: str, g: int, exact: int, t: int, offsets: int,
                   pitch: int) -> int:
    """n_clusters, checked (a positive multiple of g); by default the smallest count with exact matching, and under
    the query protocol also every length offset 0..E-1 in every family (the crossed design)."""
    if n_clusters is None:
        n_clusters = g * exact // math.gcd(exact, t)
        if protocol == "query":
            n_clusters = math.lcm(n_clusters, g * offsets)
    if not isinstance(n_clusters, int) or n_clusters < 1 or n_clusters % g:
        raise ValueError(f"n_clusters: must be a positive multiple of gcd(record pitch {pitch}, R) = {g}, "
                         f"got {n_clusters!r}")
    return n_clusters


class _Geometry(NamedTuple):
    """The fixed layout of one prompt set (build_eval_set's derived quantities)."""

    protocol: str
    R: int
    stride: int
    g: int
    gap: int
    pitch: int
    rec: int
    lead: int
    header: list[int]
    tail: list[int]
    fillers_total: int
    query_position: int
    local_window: int
    n_records: int
    n_demos: int
    key_tokens: int
    value_tokens: int
    seed: int
    tag: int
    spacer: int  # haystack tokens before every record and after the last


def _cluster_contexts(vocab, geo: _Geometry, c: int, target_records: list[int]) -> list[Context]:
    """The R shifted contexts of cluster c (same records, filler words in order and demonstrations at every
    shift; the query protocol uses the first g - 1 + s filler words)."""
    contexts = []
    f = c % geo.g
    e = query_length_offset(c, geo.g, offset_count(geo.R, geo.stride)) if geo.protocol == "query" else 0
    rng = np.random.default_rng([geo.seed, geo.tag, _CLUSTER, c])
    keys, values = sample_records(rng, vocab, geo.n_records, geo.key_tokens, geo.value_tokens)
    others = np.setdiff1d(np.arange(geo.n_records), target_records)
    demos = rng.choice(others, size=geo.n_demos, replace=False).tolist()
    fillers = filler_tokens(rng, vocab, geo.fillers_total)  # the same words, in order, at every shift
    haystack = vocab.haystack(rng, geo.n_records + 1) if geo.spacer else None  # the same prose at every shift
    for s in range(geo.R):
        # the query protocol shortens the prompt by the shifts and offsets still to come
        E = offset_count(geo.R, geo.stride)
        query_position = geo.query_position - ((geo.R - 1 - s) + (E - 1 - e) if geo.protocol == "query" else 0)
        if geo.protocol == "prefix":
            gaps = [f + s] + [0] * (geo.n_records - 1) + [geo.fillers_total - f - s]
        elif geo.protocol == "query":  # e before the records, s after them: g - 1 + e + s fillers in all
            gaps = [f + e] + [0] * (geo.n_records - 1) + [geo.g - 1 - f + s]
        else:
            gaps = _insequence_gaps(np.random.default_rng([geo.seed, geo.tag, _CONTEXT, c, s]), target_records,
                                    geo.n_records, f + s, geo.gap, geo.fillers_total)
        layout = assemble(vocab.bos, keys, values, gaps, fillers, demos, header=geo.header, tail=geo.tail,
                          haystack=haystack)
        if len(layout.ids) + geo.key_tokens - 1 != query_position:
            raise AssertionError(f"internal: context {s} of cluster {c} puts the query at {len(layout.ids)}")
        queries = []
        for i in target_records:
            pos = layout.record_positions[i]
            placed = pos == geo.lead + f + geo.pitch * i + (e if geo.protocol == "query" else s)
            if not placed or not outside_local_window(pos + geo.rec - 1, query_position, geo.local_window):
                raise AssertionError(f"internal: target record {i} of cluster {c} misplaced at {pos}")
            queries.append(Query(key=tuple(keys[i].tolist()), answer=int(values[i][0]), target_position=pos,
                                 residue=pos % geo.R, phase=pos % geo.stride, shift=s, cluster=c,
                                 protocol=geo.protocol, record=i, query_position=query_position))
        contexts.append(Context(layout.ids, queries, c, s, layout.record_positions, demos))
    return contexts


def offset_count(residue_modulus: int, stride: int) -> int:
    """E, the number of the query protocol's length offsets: S where the shifts alone span three stride cycles
    (R >= 3 S), else 3 S, so that the lengths Q0 + e + s always span at least three cycles (a trend told from a
    period) and every offset residue mod S occurs equally often."""
    return stride if residue_modulus >= 3 * stride else 3 * stride


def query_length_offset(cluster: int, families: int, offsets: int) -> int:
    """The query protocol's length offset e of a cluster: e fillers before its records at every shift, so its
    query phase at shift s is (Q0 + e + s) mod S; e = (cluster // families) mod E (`offset_count`) runs through
    every value in every family."""
    return (cluster // families) % offsets


def _insequence_gaps(rng: np.random.Generator, target_records: Sequence[int], n_records: int, lead: int,
                     gap: int, total: int) -> list[int]:
    """Fillers before each record (and after the last): target i gets exactly lead + gap * i before it,
    the rest of each stretch between fixed points is scattered uniformly over the stretch's gaps."""
    gaps = np.zeros(n_records + 1, dtype=np.int64)
    bounds = [-1, *target_records, n_records]  # gaps (a, b] between fixed points a and b
    cumulative = [0, *(lead + gap * i for i in target_records), total]
    for a, b, before, after in zip(bounds, bounds[1:], cumulative, cumulative[1:]):
        gaps[a + 1:b + 1] = scatter(rng, after - before, b - a)
    return gaps.tolist()
