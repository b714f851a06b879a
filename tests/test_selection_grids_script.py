"""research/selection_grids.py: a jittered condition's predictions joined to their contexts' drawn origins, and
the paired differences of a moved grid against the unfixed one."""

from __future__ import annotations

import pytest
import torch

from phasekv.conditions.selection.pooled import parse_selection
from tests.helpers import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("selection_grids")


def test_each_prediction_lands_in_its_contexts_origin_and_phase(script):
    """Predictions correct exactly when (origin + phase) is odd: every cell is all right or all wrong, the cells
    hold every prompt, and a prediction of another prompt set fails the join."""
    from phasekv.data.protocols import build_eval_set
    from phasekv.data.vocab import Vocabulary

    spec = parse_selection("kpool:pool=4,top=2,local=4,grid=jitter")
    eval_set = build_eval_set(Vocabulary(), "prefix", n_records=24, n_demos=1, stride=4, residue_modulus=4, seed=0)
    origins = [int(spec.offsets(torch.tensor([c.ids]))[0]) for c in eval_set.contexts for _ in c.queries]
    records = [{"target_position": q.target_position, "cluster": q.cluster, "correct": (o + q.target_position) % 2 == 1}
               for q, o in zip(eval_set.queries(), origins, strict=True)]
    assert script.request_origins(spec, eval_set, records) == origins
    cells = script.origin_curves(records, origins, 4)
    assert sum(c["n"] for c in cells) == len(records) and len({c["origin"] for c in cells}) > 1
    assert all(c["accuracy"] == float((c["origin"] + c["phase"]) % 2) for c in cells)
    own = script.own_grid_statistics(records, origins, 4)  # correct exactly at the odd phases of the own grid
    assert own["per_phase"] == [0.0, 1.0, 0.0, 1.0] and own["max_gap_pp"] == 100.0 and own["flatness_p"] < 0.01
    records[3] = {**records[3], "target_position": records[3]["target_position"] + 1}
    with pytest.raises(ValueError, match="another prompt set"):
        script.request_origins(spec, eval_set, records)


def test_the_paired_differences_are_the_plain_ones_with_intervals_around_them(script):
    """Two evaluations of 40 clusters x 4 phases: the moved one answers phase 3 too; the mean rises by a quarter
    of the unfixed one's phase-3 failures, the gap closes, and the intervals hold the plain differences."""
    unfixed = [{"cluster": c, "phase": p, "correct": p != 3 or c % 2 == 0} for c in range(40) for p in range(4)]
    moved = [{**r, "correct": True} for r in unfixed]
    diff = script.paired(unfixed, moved, 4, n_boot=200)
    assert diff["mean_diff_pp"] == 12.5 and diff["gap_diff_pp"] == -50.0
    low, high = diff["mean_diff_ci_pp"]
    assert low < 12.5 < high and diff["gap_diff_ci_pp"][0] < -50.0 < diff["gap_diff_ci_pp"][1]
    assert script.paired(unfixed, unfixed, 4, n_boot=200)["mean_diff_ci_pp"] == [0.0, 0.0]
