"""The target design of the evaluation protocols: which records of which cluster are targets, so that every
residue group's target positions have equal means and (as nearly as the lattice allows) equal variances.

The algebra is in the docstring of `phasekv.data.protocols` ("Position matching, by construction" and "Realizing
the bases"); these functions are its arithmetic, kept apart so the prompt builder reads as layout only.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from phasekv.data.lookup import outside_local_window


def class_starts(R: int, g: int, pitch: int, lead: int = 1) -> tuple[list[int], list[int]]:
    """Per base residue rho: the first record index i0 whose base lead + f + pitch * i0
    (f = (rho - lead) mod g) is = rho (mod R), and that base (lead: tokens before the first filler)."""
    classes = R // g
    inverse = pow(pitch // g, -1, classes) if classes > 1 else 0
    first = [((rho - lead - (rho - lead) % g) // g * inverse) % classes for rho in range(R)]
    return first, [lead + (rho - lead) % g + pitch * first[rho] for rho in range(R)]


def exact_class_size(starts: list[int], step: int) -> int:
    """Smallest K for which K bases per residue class can have equal class sums: the class sums are
    K * start (mod step), so K must make every K * (start - start') a multiple of step."""
    common = 0
    for start in starts:
        common = math.gcd(common, start - starts[0])
    return step // math.gcd(step, common)


def design_targets(R: int, g: int, *, pitch: int, rec: int, lead: int, first: list[int], starts: list[int],
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
