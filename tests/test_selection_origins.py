"""scripts/selection_origins.py: a jittered condition's predictions joined to their contexts' drawn origins."""

from __future__ import annotations

import pytest
import torch

from phasekv.adapters.selection import parse_selection
from tests.helpers import load_script


@pytest.fixture(scope="module")
def script():
    return load_script("selection_origins")


def test_each_prediction_lands_in_its_contexts_origin_and_phase(script):
    """Predictions correct exactly when (origin + phase) is odd: every cell is all right or all wrong, the cells
    hold every prompt, and a prediction of another prompt set fails the join."""
    from phasekv.data.protocols import build_eval_set
    from phasekv.data.vocab import Vocabulary

    spec = parse_selection("kpool:pool=4,top=2,local=4,grid=jitter")
    eval_set = build_eval_set(Vocabulary(), "prefix", n_records=24, n_demos=1, stride=4, residue_modulus=4, seed=0)
    origins = [int(spec.offsets(torch.tensor([c.ids]))[0]) for c in eval_set.contexts for _ in c.queries]
    records = [{"target_position": q.target_position, "correct": (o + q.target_position) % 2 == 1}
               for q, o in zip(eval_set.queries(), origins, strict=True)]
    cells = script.origin_curves(spec, eval_set, records)
    assert sum(c["n"] for c in cells) == len(records) and len({c["origin"] for c in cells}) > 1
    assert all(c["accuracy"] == float((c["origin"] + c["phase"]) % 2) for c in cells)
    records[3] = {**records[3], "target_position": records[3]["target_position"] + 1}
    with pytest.raises(ValueError, match="another prompt set"):
        script.origin_curves(spec, eval_set, records)
