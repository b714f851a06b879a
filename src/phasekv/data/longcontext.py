"""Long-context prompt sets sized in tokens: docs/science.md section 3's needle test (128K tokens, 16,000 records,
the target near the middle, groups by the target key's position mod 8), streamed prompt by prompt.

A prompt of `context` = N tokens (the tokenizer in use resolves every length; `phasekv.data.keyspace` builds the
pieces) is

    <bos> header  A fillers  sp_0 rec_0  sp_1 rec_1 ... sp_{n-1} rec_{n-1}  sp_n  B fillers  tail  query

with the n records spread over the WHOLE context.  A record is a key code of `key_tokens` single-token words,
":" and a one-token name (the answer); the query is the target's code and ":" (a phasekv checkpoint's word
vocabulary has no ":": its records and query are as in its training data, `phasekv.data.keyspace`).  The
spacers sp_i hold P tokens in all, spread as evenly as integers allow (sp_0 .. sp_i hold floor((i + 1) P /
(n + 1)) tokens), newlines (a word vocabulary: its filler) in the `records` family and running prose (whole
sentences of the built-in list, cut at the spacer boundaries) in the `needle` family.  By default the records
family holds as many records as fit with one spacer token each and the needle family context // 16 records;
`n_records` fixes the count (the paper: 16,000).

Protocols (as in `phasekv.data.protocols`, whose docstring derives the algebra).  Each cluster (a logical
example: its records, values, prose and target) has one target record j and a family offset f in [0, 2R) and
is shown at every shift s = 0..R-1 (R = residue_modulus, a multiple of the stride S):
  * prefix:     A = f + s, B = E - f - s;
  * insequence: fillers also sit between the records: the target is preceded by exactly f + s + gap j fillers,
                the others are dropped uniformly at random into the gaps of the stretch before it and after it,
                afresh for every shift;
  * query:      A = f, B = 2R - 1 - f + s: every target keeps its position and the prompt, hence the query
                position, grows one token per shift (N - R + 1 .. N tokens).
E = 3R - 2 (+ gap n for insequence) fillers in all, so prefix and insequence prompts are exactly N tokens with
the query at N - 1.  At shift 0 the target sits at its base b = base0(j) + f, base0(j) = 1 + header +
floor((j + 1) P / (n + 1)) + (record + gap) j, and at shift s at b + s (prefix, insequence).

Exact matching.  Per depth d the design takes K = per_group / R pairs of each base residue rho (mod R) on the K
records j_m nearest d (n - 1), the same records for every rho; pair (rho, m) gets f = ((rho - base0(j_m)) mod R)
+ R e, e in {0, 1}.  Its base is = rho (mod R), and the class sum is Sigma_rho = sum_m base0(j_m) + D_rho + R E_rho
with D_rho = sum_m ((rho - base0(j_m)) mod R) and E_rho the number of its pairs with e = 1.  With R | K every
D_rho has the same residue mod R, so E_rho = (max D - D_rho) / R (an integer, at most K (R - 1) / R) makes every
class sum equal, which is the condition for equal means and variances of the target position in every residue
group (hence in every phase group mod S, which pools R / S residue groups): `matching_stats` checks it with
integer arithmetic.  per_group must therefore be a multiple of R^2 (64 at R = 8; the paper's 256 = 4 x 64).

Streaming: a prompt is a pure function of (seed, cluster, shift, target); `prompt` builds one, `prompts` yields
them all with one cluster's shared part (its record block: keys, values, spacers) built once for its R shifts
and nothing else kept, so memory is a few times N tokens (`held_bytes`) whatever the number of prompts.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from phasekv.data.keyspace import FAMILIES, KeySpace, build_key_space
from phasekv.data.lookup import outside_local_window, scatter
from phasekv.memory import check_budget

PROTOCOLS = ("prefix", "insequence", "query")
MIN_KEYS = 16_000  # the key space every set offers, whatever it uses (the paper's 16,000 records)
_TAG = 31  # RNG stream tag, apart from the lookup and protocol streams
_BYTES_PER_TOKEN = 40  # held per context token while streaming: the block, one prompt, int64 temporaries


@dataclass(frozen=True)
class LongContextSpec:
    """A long-context prompt set (module docstring).  0 for `residue_modulus` means the stride and for `n_records`
    the family's default."""

    family: str = "records"
    context: int = 8192
    protocol: str = "prefix"
    stride: int = 8
    residue_modulus: int = 0
    depths: tuple[float, ...] = (0.5,)
    per_group: int = 64  # prompts per residue group and depth: a multiple of R^2
    n_records: int = 0
    key_tokens: int = 2
    insequence_gap: int = 1
    local_window: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.depths, (list, tuple)):  # a list from a config file or flags: hashable, like the rest
            object.__setattr__(self, "depths", tuple(self.depths))
        if self.family not in FAMILIES:
            raise ValueError(f"family: must be one of {FAMILIES}, got {self.family!r}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol: must be one of {PROTOCOLS}, got {self.protocol!r}")
        for name in ("context", "stride", "per_group", "key_tokens", "residue_modulus", "n_records",
                     "insequence_gap", "local_window", "seed"):
            value, low = getattr(self, name), 1 if name in ("context", "stride", "per_group", "key_tokens") else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: must be an integer >= {low}, got {value!r}")
        R = self.modulus
        if R % self.stride:
            raise ValueError(f"residue_modulus: {R} is not a multiple of stride {self.stride}")
        if self.per_group % (R * R):
            raise ValueError(f"per_group: must be a multiple of R^2 = {R * R} (R = residue_modulus) for exactly "
                             f"matched groups, got {self.per_group}")
        if not self.depths or any(isinstance(d, bool) or not isinstance(d, (int, float)) or not 0 <= d <= 1
                                  for d in self.depths):
            raise ValueError(f"depths: need one or more target depths in [0, 1], got {self.depths!r}")

    @property
    def modulus(self) -> int:
        return self.residue_modulus or self.stride


# the paper's test (docs/science.md section 3): 128K tokens, 16,000 four-token records (two-piece key, ":",
# the name) in prose, the target in the middle, mod 8, 256 prompts per group: 256 clusters x 8 shifts = 2,048
PAPER_NIAH = LongContextSpec(family="needle", context=131_072, stride=8, depths=(0.5,), per_group=256,
                             n_records=16_000, key_tokens=2)
PRESETS = {"paper-niah": PAPER_NIAH}


@dataclass(frozen=True)
class LongPrompt:
    ids: np.ndarray  # (L,) int32; the last position's logits score the answer
    answer: int
    target_position: int  # the target record's first key token
    query_position: int  # the last token (L - 1)
    residue: int  # target_position mod residue_modulus
    phase: int  # target_position mod stride
    depth: float  # the design depth of its target
    record: int  # the target's record index
    cluster: int
    shift: int
    protocol: str


class LongContextSet:
    """The prompts of one spec for one tokenizer (module docstring): designed at construction, built on demand."""

    def __init__(self, spec: LongContextSpec, tokenizer: Any = None, keys: KeySpace | None = None):
        self.spec, self.keys = spec, keys or build_key_space(tokenizer)
        R, kt = spec.modulus, spec.key_tokens
        if self.keys.size(kt) < MIN_KEYS and not self.keys.vocabulary:  # a word vocabulary offers what it has
            raise ValueError(f"key_tokens: {len(self.keys.pieces)} key words of one token give {self.keys.size(kt)} "
                             f"codes of {kt}; at least {MIN_KEYS} are needed: raise key_tokens")
        if spec.family == "needle" and not self.keys.sentences:
            raise ValueError("family: the needle family needs prose; a phasekv vocabulary has none: use records")
        self.query_tokens = kt + len(self.keys.frame)  # the code and ":" (a word vocabulary: the code alone)
        self.record_tokens = self.query_tokens + 1  # and the name
        self.gap = spec.insequence_gap if spec.protocol == "insequence" else 0
        self.lead = 1 + len(self.keys.header[spec.family])
        fixed = self.lead + 3 * R - 2 + len(self.keys.tail) + self.query_tokens  # all but records, spacers, fillers
        pitch = self.record_tokens + self.gap
        self.n = spec.n_records or ((spec.context - fixed - 1) // (pitch + 1) if spec.family == "records"
                                    else spec.context // 16)
        self.spacers = spec.context - fixed - pitch * self.n  # P
        if self.n < 1 or self.spacers < self.n + 1:
            raise ValueError(f"context: {spec.context} tokens cannot hold {self.n} records of {pitch} tokens with a "
                             f"spacer token each and {fixed} tokens of frame; needs at least "
                             f"{fixed + (pitch + 1) * max(self.n, 1) + 1}")
        if self.n > self.keys.size(kt):
            raise ValueError(f"n_records: {self.n} distinct keys needed, the key space has {self.keys.size(kt)}")
        self.fillers = 3 * R - 2 + self.gap * self.n  # E
        self._design()
        self._cache: tuple[int, Any] | None = None

    # ---- the design: positions only, no token ids ----

    def base0(self, j: int) -> int:
        """The first key token of record j at shift 0 with family offset 0 (module docstring)."""
        return self.lead + (j + 1) * self.spacers // (self.n + 1) + (self.record_tokens + self.gap) * j

    def _design(self) -> None:
        spec, R = self.spec, self.spec.modulus
        K = spec.per_group // R
        if self.n < K:
            raise ValueError(f"per_group: {spec.per_group} prompts per group need {K} target records per depth, "
                             f"the context holds {self.n} records")
        rng = np.random.default_rng([spec.seed, _TAG, 0])
        record, offset, depth = [], [], []
        for d in spec.depths:
            first = min(max(round(d * (self.n - 1)) - K // 2, 0), self.n - K)
            js = list(range(first, first + K))
            u = [self.base0(j) % R for j in js]
            D = [sum((rho - x) % R for x in u) for rho in range(R)]
            for rho in range(R):
                raised = set(rng.permutation(K)[:(max(D) - D[rho]) // R].tolist())
                for m, j in enumerate(js):
                    record.append(j)
                    offset.append((rho - u[m]) % R + R * (m in raised))
                    depth.append(float(d))
        self.cluster_record, self.cluster_offset, self.cluster_depth = record, offset, depth
        last = max(self.target_position(c, R - 1) for c in range(self.n_clusters)) + self.record_tokens - 1
        if not outside_local_window(last, self.query_position(0), spec.local_window):
            raise ValueError(f"depths: a target at depth {max(spec.depths)} ends at {last}, inside the local window "
                             f"of {spec.local_window} tokens before the query at {self.query_position(0)}")

    @property
    def n_clusters(self) -> int:
        return len(self.spec.depths) * self.spec.per_group

    @property
    def n_prompts(self) -> int:
        return self.n_clusters * self.spec.modulus

    @property
    def prompt_length(self) -> int:
        """Tokens of every prompt (the longest, under the query protocol)."""
        return self.spec.context

    @property
    def chance(self) -> float:
        return 1.0 / len(self.keys.values)

    def target_position(self, cluster: int, shift: int) -> int:
        base = self.base0(self.cluster_record[cluster]) + self.cluster_offset[cluster]
        return base + (0 if self.spec.protocol == "query" else shift)

    def query_position(self, shift: int) -> int:
        R = self.spec.modulus
        return self.spec.context - 1 - (R - 1 - shift if self.spec.protocol == "query" else 0)

    def matching_stats(self, modulus: int | None = None, coordinate: str = "target",
                       depth: float | None = None) -> dict[str, Any]:
        """Per group (the `coordinate`'s position mod `modulus`, default residue_modulus) n, mean and variance
        (ddof 0) of the target position and the mean query position, from integer sums; `exact`: every mean
        equal and every variance equal, as fractions.  `depth`: that depth's clusters only."""
        modulus = modulus or self.spec.modulus
        if self.spec.modulus % modulus:
            raise ValueError(f"modulus: {modulus} does not divide residue_modulus {self.spec.modulus}")
        if coordinate not in ("target", "query"):
            raise ValueError(f"coordinate: must be 'target' or 'query', got {coordinate!r}")
        if depth is not None and depth not in self.spec.depths:
            raise ValueError(f"depth: {depth} is not one of the set's depths {self.spec.depths}")
        n, s1, s2, sq = ([0] * modulus for _ in range(4))
        for c in range(self.n_clusters):
            if depth is not None and self.cluster_depth[c] != depth:
                continue
            for s in range(self.spec.modulus):
                t, q = self.target_position(c, s), self.query_position(s)
                r = (t if coordinate == "target" else q) % modulus
                n[r], s1[r], s2[r], sq[r] = n[r] + 1, s1[r] + t, s2[r] + t * t, sq[r] + q
        full = [r for r in range(modulus) if n[r]]  # a fixed query position fills one query group only
        means = {r: Fraction(s1[r], n[r]) for r in full}
        variances = {r: Fraction(n[r] * s2[r] - s1[r] ** 2, n[r] ** 2) for r in full}
        return {"modulus": modulus, "coordinate": coordinate, "n_prompts": sum(n),
                "query_positions": sorted({self.query_position(s) for s in range(self.spec.modulus)}),
                "per_group": [{"group": r, "n": n[r], "mean": float(means[r]), "variance": float(variances[r]),
                               "mean_query_position": float(Fraction(sq[r], n[r]))} for r in full],
                "exact": len(set(means.values())) == 1 and len(set(variances.values())) == 1
                and len({n[r] for r in full}) == 1,
                "max_mean_gap": float(max(means.values()) - min(means.values())),
                "max_variance_gap": float(max(variances.values()) - min(variances.values()))}

    # ---- the token ids, on demand ----

    def _block(self, cluster: int):
        """The shared part of a cluster, built once for its shifts: (block ids, spacer starts (n + 1,), codes
        (n, kt), values (n,)).  The block is sp_0 rec_0 ... rec_{n-1} sp_n."""
        if self._cache is not None and self._cache[0] == cluster:
            return self._cache[1]
        self._cache = None  # the previous cluster's block goes before the next is built
        spec, ks, n, P = self.spec, self.keys, self.n, self.spacers
        rng = np.random.default_rng([spec.seed, _TAG, 1, cluster])
        codes = ks.codes(rng.choice(ks.size(spec.key_tokens), size=n, replace=False), spec.key_tokens)
        values = ks.values[rng.integers(len(ks.values), size=n)]
        frame = np.tile(np.asarray(ks.frame, dtype=np.int64), (n, 1))  # (n, 0 or 1)
        records = np.concatenate([codes, frame, values[:, None]], 1)  # (n, record)
        i = np.arange(n + 1, dtype=np.int64)
        unit = i * P // (n + 1) + i * self.record_tokens  # where sp_i starts in the block
        at = (unit[1:] - self.record_tokens)[:, None] + np.arange(self.record_tokens)  # (n, record)
        block = np.empty(P + n * self.record_tokens, dtype=np.int32)
        spacer = np.ones(len(block), dtype=bool)
        spacer[at] = False
        block[at] = records
        block[spacer] = ks.prose(rng, P) if spec.family == "needle" else ks.newline
        self._cache = (cluster, (block, unit, codes, values))
        return self._cache[1]

    def prompt(self, cluster: int, shift: int, target: int = 0) -> LongPrompt:
        """Prompt (cluster, shift, target); a cluster has one target (target 0)."""
        R = self.spec.modulus
        for name, value, high in (("cluster", cluster, self.n_clusters), ("shift", shift, R), ("target", target, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < high:
                raise ValueError(f"{name}: must be an integer in [0, {high}), got {value!r}")
        block, unit, codes, values = self._block(cluster)
        ks, j, f = self.keys, self.cluster_record[cluster], self.cluster_offset[cluster]
        if self.spec.protocol == "insequence":
            before = f + shift + self.gap * j
            rng = np.random.default_rng([self.spec.seed, _TAG, 2, cluster, shift])
            gaps = np.concatenate([scatter(rng, before, j + 1), scatter(rng, self.fillers - before, self.n - j)])
            body, a, b = np.insert(block, np.repeat(unit, gaps), ks.filler), 0, 0
        else:
            a = f + (shift if self.spec.protocol == "prefix" else 0)
            b = (self.fillers if self.spec.protocol == "prefix" else 2 * R - 1 + shift) - a
            body = block
        header = self.keys.header[self.spec.family]
        ids = np.concatenate([[ks.bos], header, np.full(a, ks.filler), body, np.full(b, ks.filler), ks.tail,
                              codes[j], ks.frame]).astype(np.int32)
        position, query = self.target_position(cluster, shift), self.query_position(shift)
        if len(ids) != query + 1 or not np.array_equal(ids[position:position + len(codes[j])], codes[j]):
            raise AssertionError(f"internal: prompt ({cluster}, {shift}) misplaced its target or its length")
        return LongPrompt(ids=ids, answer=int(values[j]), target_position=position, query_position=query,
                          residue=position % R, phase=position % self.spec.stride,
                          depth=self.cluster_depth[cluster], record=j, cluster=cluster, shift=shift,
                          protocol=self.spec.protocol)

    def prompts(self, clusters: range | None = None) -> Iterator[LongPrompt]:
        """Every prompt (or those of `clusters`), cluster-major, each built when it is reached."""
        for c in clusters if clusters is not None else range(self.n_clusters):
            for s in range(self.spec.modulus):
                yield self.prompt(c, s)

    def held_bytes(self, prompts: int = 1) -> int:
        """Memory held while streaming with `prompts` prompts alive at once: counted in tokens."""
        return _BYTES_PER_TOKEN * self.spec.context * (1 + prompts)

    def check_memory(self, prompts: int = 1) -> None:
        check_budget(self.held_bytes(prompts), f"context: streaming prompts of {self.spec.context} tokens",
                     advice="lower --context")

    @property
    def settings(self) -> dict[str, Any]:
        """The spec and what the tokenizer resolved it to: part of a run's identity."""
        return {**asdict(self.spec), "depths": list(self.spec.depths), "n_records": self.n,
                "spacer_tokens": self.spacers, "fillers": self.fillers, "key_space": self.keys.size(
                    self.spec.key_tokens), "n_answers": len(self.keys.values), "n_prompts": self.n_prompts,
                "record_tokens": self.record_tokens, "query_tokens": self.query_tokens}
