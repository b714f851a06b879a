"""How many prompts per phase a verdict needs: the smallest single-phase gap a design detects, and its inverse.

The material rule (`phasekv.evaluate.verdict`) asks for the cross-fitted phase contrast's one-sided 95% lower bound
to reach MATERIAL_GAP_PP.  The contrast's bootstrap sd shrinks as 1 / sqrt(prompts per phase) at a fixed number of
prompts per cluster; with sd = CONTRAST_SD_UNIT_PP / sqrt(N) the gap found with 80% power is about

    MATERIAL_GAP_PP + (BOUND_SD + z_0.80) x CONTRAST_SD_UNIT_PP / sqrt(N)

where BOUND_SD is the distance from the estimate to the 5th bootstrap percentile in sd units (the bootstrap is
left-skewed: about 2 sd, not 1.645).  Both constants are measured by `benchmarks/verdict_power.py` on the simulated
models of `phasekv.evaluate.power` (60% base accuracy, example sd 0.5 and pair sd 1.0 on the logit, the audit's
designs; docs/power.md): they describe those models, and a run's own bootstrap (`minimum_detectable_gap`) replaces
them whenever the run has enough clusters to resolve it.  `prompts_per_phase_for` is the helper behind a
`--target-mde PP` option: the prompts per phase whose detectable gap is at most PP.
"""

from __future__ import annotations

import math

from scipy.stats import norm

MATERIAL_GAP_PP = 10.0  # the material rule's minimum (the same constant as phasekv.evaluate.verdict's)
CONTRAST_SD_UNIT_PP = 81.0  # sd of the phase contrast x sqrt(prompts per phase) at the detectable gap, simulated
BOUND_SD = 2.1  # (estimate - 5th bootstrap percentile) / sd of the contrast, simulated (module doc)
POWER = 0.80


def detectable_gap_pp(prompts_per_phase: int) -> float:
    """The single-phase gap (pp) a design with `prompts_per_phase` prompts per phase detects with 80% power, on the
    simulated models of the module doc.  ValueError for a count below 1."""
    if isinstance(prompts_per_phase, bool) or not isinstance(prompts_per_phase, int) or prompts_per_phase < 1:
        raise ValueError(f"prompts_per_phase: must be an integer >= 1, got {prompts_per_phase!r}")
    return MATERIAL_GAP_PP + (BOUND_SD + norm.ppf(POWER)) * CONTRAST_SD_UNIT_PP / math.sqrt(prompts_per_phase)


def prompts_per_phase_for(target_mde_pp: float, multiple: int = 1) -> int:
    """The fewest prompts per phase (a multiple of `multiple`, e.g. the prompts one cluster adds to a phase) whose
    `detectable_gap_pp` is at most `target_mde_pp`; ValueError for a target at or below MATERIAL_GAP_PP, which no
    size reaches (the rule needs the lower bound above it)."""
    if not isinstance(target_mde_pp, int | float) or not target_mde_pp > MATERIAL_GAP_PP:
        raise ValueError(f"target_mde_pp: must exceed the material minimum {MATERIAL_GAP_PP:g} pp, "
                         f"got {target_mde_pp!r}")
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
        raise ValueError(f"multiple: must be an integer >= 1, got {multiple!r}")
    n = math.ceil(((BOUND_SD + norm.ppf(POWER)) * CONTRAST_SD_UNIT_PP / (target_mde_pp - MATERIAL_GAP_PP)) ** 2)
    n = multiple * max(1, math.ceil(n / multiple))
    while detectable_gap_pp(n) > target_mde_pp:  # float rounding at the boundary
        n += multiple
    return n
