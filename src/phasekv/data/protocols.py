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
* query:       the query-phase protocol: the records sit where prefix padding puts them at s = 0,
               <bos> (f fillers) records (g - 1 - f + s fillers) demos target, so the shift goes after the
               records.  Every target keeps its position (and its source phase) at every shift, while the
               prompt length, and with it the query position Q - (R - 1) + s (Q: the padding protocols'
               fixed query position), grows by one token per shift: every query residue mod R exactly once
               per cluster.  Prompt lengths differ, so `prompt_length` is the longest.
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

The query protocol, grouped by the query position mod R (the query phase): each group is one shift, so it
holds every (cluster, target) pair exactly once at the same target position: the target positions of the
groups are identical, and only the query position, hence the distance from target to query, differs, by
exactly s tokens (a depth trend of at most R - 1 tokens, linear in s, not periodic).  Grouped by the target
position mod R (the source phase) its groups hold the K pairs of each base residue, each at R shifts: their
means are the class means Sigma_rho / K, equal under exact matching (equal class sums); their variances are
those of each class's bases and are not matched, and the groups hold different pairs (so the evaluation takes the
pair, not the cluster, as the unit of the source-phase statistics, `verdict.target_pairs`): the padding protocols
remain the test of the source phase.  `matching_stats(coordinate="query")` gives the first view.

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

Local window: every target record ends at or before query_position - local_window at every shift
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

from phasekv.config import EVAL_PROTOCOLS, PROTOCOLS  # noqa: F401 (PROTOCOLS: re-exported by phasekv.data)
from phasekv.data.lookup import assemble, filler_tokens, outside_local_window, sample_records, scatter
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
    first, starts = _class_starts(R, g, pitch, lead)
    exact = _exact_class_size(starts, pitch * classes)
    targets_per_context = classes if targets_per_context is None else targets_per_context
    if not isinstance(targets_per_context, int) or targets_per_context < 1 or targets_per_context % classes:
        raise ValueError(f"targets_per_context: must be a positive multiple of R / gcd(record pitch {pitch}, R) = "
                         f"{classes}, got {targets_per_context!r}")
    t = targets_per_context // classes
    n_clusters = g * exact // math.gcd(exact, t) if n_clusters is None else n_clusters
    if not isinstance(n_clusters, int) or n_clusters < 1 or n_clusters % g:
        raise ValueError(f"n_clusters: must be a positive multiple of gcd(record pitch {pitch}, R) = {g}, "
                         f"got {n_clusters!r}")
    if targets_per_context + n_demos > n_records:
        raise ValueError(f"n_records: {n_records} records cannot hold {targets_per_context} targets and "
                         f"{n_demos} demonstrations of other records")
    if n_records > len(vocab.group("keys")) ** key_tokens:
        raise ValueError(f"n_records: {n_records} distinct keys needed, the vocabulary has "
                         f"{len(vocab.group('keys'))} key words")

    fillers_total = (g - 1) + (R - 1) + gap * n_records
    query_position = (lead + fillers_total + len(tail) + rec * (n_records + n_demos) + spacer * n_records
                      + key_tokens - 1)
    settings = {"protocol": protocol, "n_records": n_records, "n_demos": n_demos, "stride": stride,
                "residue_modulus": R, "n_clusters": n_clusters, "targets_per_context": targets_per_context,
                "local_window": local_window, "key_tokens": key_tokens, "value_tokens": value_tokens,
                "insequence_gap": gap, "seed": seed, "families": g,
                "exact_matching": (n_clusters // g) * t % exact == 0}
    targets = _design_targets(R, g, pitch=pitch, rec=rec, lead=lead, first=first, starts=starts, n_records=n_records,
                              n_clusters=n_clusters, t=t, query_position=query_position, local_window=local_window,
                              rng=np.random.default_rng([seed, _TAG[protocol], _DESIGN]))
    geo = _Geometry(protocol=protocol, R=R, stride=stride, g=g, gap=gap, pitch=pitch, rec=rec, lead=lead, header=header,
                    tail=tail, fillers_total=fillers_total, query_position=query_position, local_window=local_window,
                    n_records=n_records, n_demos=n_demos, key_tokens=key_tokens, value_tokens=value_tokens, seed=seed,
                    tag=_TAG[protocol], spacer=spacer)
    contexts = [ctx for c, target_records in enumerate(targets)
                for ctx in _cluster_contexts(vocab, geo, c, target_records)]
    return EvalSet(protocol, stride, R, local_window, vocab, contexts, settings=settings)


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
    rng = np.random.default_rng([geo.seed, geo.tag, _CLUSTER, c])
    keys, values = sample_records(rng, vocab, geo.n_records, geo.key_tokens, geo.value_tokens)
    others = np.setdiff1d(np.arange(geo.n_records), target_records)
    demos = rng.choice(others, size=geo.n_demos, replace=False).tolist()
    fillers = filler_tokens(rng, vocab, geo.fillers_total)  # the same words, in order, at every shift
    haystack = vocab.haystack(rng, geo.n_records + 1) if geo.spacer else None  # the same prose at every shift
    for s in range(geo.R):
        # the query protocol shortens the prompt by the shifts still to come: R - 1 - s fillers fewer
        query_position = geo.query_position - (geo.R - 1 - s if geo.protocol == "query" else 0)
        if geo.protocol == "prefix":
            gaps = [f + s] + [0] * (geo.n_records - 1) + [geo.fillers_total - f - s]
        elif geo.protocol == "query":
            gaps = [f] + [0] * (geo.n_records - 1) + [geo.fillers_total - (geo.R - 1) - f + s]
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
            placed = pos == geo.lead + f + geo.pitch * i + (0 if geo.protocol == "query" else s)
            if not placed or not outside_local_window(pos + geo.rec - 1, query_position, geo.local_window):
                raise AssertionError(f"internal: target record {i} of cluster {c} misplaced at {pos}")
            queries.append(Query(key=tuple(keys[i].tolist()), answer=int(values[i][0]), target_position=pos,
                                 residue=pos % geo.R, phase=pos % geo.stride, shift=s, cluster=c,
                                 protocol=geo.protocol, record=i, query_position=query_position))
        contexts.append(Context(layout.ids, queries, c, s, layout.record_positions, demos))
    return contexts


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


def _class_starts(R: int, g: int, pitch: int, lead: int = 1) -> tuple[list[int], list[int]]:
    """Per base residue rho: the first record index i0 whose base lead + f + pitch * i0
    (f = (rho - lead) mod g) is = rho (mod R), and that base (lead: tokens before the first filler)."""
    classes = R // g
    inverse = pow(pitch // g, -1, classes) if classes > 1 else 0
    first = [((rho - lead - (rho - lead) % g) // g * inverse) % classes for rho in range(R)]
    return first, [lead + (rho - lead) % g + pitch * first[rho] for rho in range(R)]


def _exact_class_size(starts: list[int], step: int) -> int:
    """Smallest K for which K bases per residue class can have equal class sums: the class sums are
    K * start (mod step), so K must make every K * (start - start') a multiple of step."""
    common = 0
    for start in starts:
        common = math.gcd(common, start - starts[0])
    return step // math.gcd(step, common)


def _design_targets(R: int, g: int, *, pitch: int, rec: int, lead: int, first: list[int], starts: list[int],
                    n_records: int, n_clusters: int, t: int, query_position: int, local_window: int,
                    rng: np.random.Generator) -> list[list[int]]:
    """Target record indices of every cluster, sorted; see the module docstring."""
    classes = R // g
    step = pitch * classes  # base distance between records of one residue class: lcm(pitch, R)
    per_family = n_clusters // g
    K = per_family * t  # pairs per base residue
    qmax = []  # per base residue: largest valid q (record first + classes * q)
    for rho in range(R):
        q = -1
        while (first[rho] + classes * (q + 1) < n_records  # a record, outside the window at the largest shift
               and outside_local_window(starts[rho] + step * (q + 1) + R - 1 + rec - 1, query_position,
                                        local_window)):
            q += 1
        if q + 1 < t:
            raise ValueError(f"n_records: too few records for {t * classes} targets per context outside the "
                             f"local window (residue {rho} has {q + 1} valid records per cluster, needs {t})")
        qmax.append(q)

    half = Fraction(t - 1, 2)  # feasible class means run from the t shallowest to the t deepest records
    low = max(starts[rho] + step * half for rho in range(R))
    high = min(starts[rho] + step * (qmax[rho] - half) for rho in range(R))
    if low > high:
        raise ValueError(f"n_records: {n_records} records leave no common target depth for all residues; "
                         "use more records or fewer targets_per_context")
    lattice = [K * start % step for start in starts]  # Sigma_rho = K * start_rho (mod step)
    centre = K * (low + high) / 2
    z0 = round((R * centre - sum(lattice)) / step) - R // 2
    candidates = [_class_sums(lattice, step, Fraction(sum(lattice) + step * z, R)) for z in range(z0, z0 + R)]
    sums = min(candidates, key=lambda c: (c[1], abs(sum(c[0]) / R - centre)))[0]

    targets: list[list[int]] = [[] for _ in range(n_clusters)]
    for rho in range(R):
        qs = _spread(K, qmax[rho], per_family, (sums[rho] - K * starts[rho]) // step, rho)
        owner = rng.permutation(per_family)
        for j, q in enumerate(qs):  # sorted; a run of equal q is at most per_family long: distinct per cluster
            targets[(rho - lead) % g + g * int(owner[j % per_family])].append(first[rho] + classes * q)
    return [sorted(ts) for ts in targets]


def _class_sums(lattice: list[int], step: int, mean_sum: Fraction) -> tuple[list[int], Fraction]:
    """Class sums on their lattices (lattice + step * Z) with mean `mean_sum`, chosen greedily from the
    top residue down so that every partial sum S_r of deviations lies in [-step/2, step/2]; returns
    them and max S_r - min S_r, which sets the variance gap (module docstring)."""
    R = len(lattice)
    sums = [0] * R
    deviation, partial = Fraction(0), [Fraction(0)]
    for rho in reversed(range(R)):
        sums[rho] = lattice[rho] + step * round((mean_sum - deviation - lattice[rho]) / step)
        deviation += sums[rho] - mean_sum
        partial.append(deviation)
    if deviation % step:
        raise AssertionError("internal: class sums off their lattices")
    sums[0] -= int(deviation)  # 0 unless the rounding tied; changes only the grand total, not any S_r
    return sums, max(partial[:-1]) - min(partial[:-1])


def _spread(K: int, qmax: int, cap: int, total: int, rho: int) -> list[int]:
    """K integers in [0, qmax], each value at most `cap` times, summing to `total`, spread evenly (sorted)."""
    hist = np.bincount([(2 * j + 1) * (qmax + 1) // (2 * K) for j in range(K)], minlength=qmax + 1)
    diff = total - int(hist @ np.arange(qmax + 1))
    step = 1 if diff > 0 else -1
    for _ in range(abs(diff)):  # move one item by one step where the histogram is most uneven
        moves = [x for x in range(qmax + 1) if hist[x] and 0 <= x + step <= qmax and hist[x + step] < cap]
        if not moves:
            raise ValueError(f"n_records: cannot place the targets of residue {rho} at the designed depth; "
                             "use more records, fewer targets_per_context or more n_clusters")
        x = max(moves, key=lambda x: hist[x] - hist[x + step])
        hist[x] -= 1
        hist[x + step] += 1
    if hist.max() > cap:
        raise ValueError(f"n_records: too few records for the targets of residue {rho}")
    return np.repeat(np.arange(qmax + 1), hist).tolist()
