"""research/insequence_spacing.py's helpers: a record's place on the window grid and its spacing, by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("insequence_spacing", ROOT / "research" / "insequence_spacing.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_record_on_a_window_boundary_is_split_only_without_overlap(script):
    starts = [3, 5, 7, 11]  # packed 3..8, then two fillers (9, 10), then 11-12
    w8 = script.record_features(starts, 2, 2, 8, 8)  # 7-8 straddles [0, 8) | [8, 16)
    assert w8["split"] and w8["offset"] == 7
    w9 = script.record_features(starts, 2, 2, 9, 8)  # [0, 9) holds 7 and 8
    assert not w9["split"] and w9["offset"] == 7
    # window [0, 9): positions 0-2 and none of 3..8 are fillers -> 3 fillers (position 0 is <bos>: no record)
    assert w9["fillers_in_window"] == 3
    assert (w9["gap_before"], w9["gap_after"]) == (0, 2)
    last = script.record_features(starts, 3, 2, 8, 8)  # 11-12 whole in [8, 16) with 8 and 9, 10 not records
    assert not last["split"] and last["gap_after"] is None and last["gap_before"] == 2
    assert last["fillers_in_window"] == 8 - 3  # tokens 8, 11, 12 belong to records
    first = script.record_features(starts, 0, 2, 8, 8)
    assert first["gap_before"] is None and first["gap_after"] == 0


def test_the_window_grid_is_read_from_the_compressed_layer_and_refused_without_one(script):
    model = {"layer_types": ["gated", "gated"], "compressors": {"gated": {"window": 9, "stride": 8}}}
    assert script.window_grid(model) == (9, 8)
    with pytest.raises(ValueError, match="no layer with a window"):
        script.window_grid({"layer_types": ["full"], "compressors": {}})


def test_accuracy_is_split_by_the_key_with_intervals(script):
    rows = [{"correct": c, "gap_before": g} for c, g in [(True, 0), (True, 0), (False, 1), (True, 5), (False, None)]]
    groups = {g["value"]: g for g in script.split_by(rows, lambda r: script.bucket(r["gap_before"], 3))}
    assert groups["0"]["accuracy"] == 1.0 and groups["0"]["n"] == 2
    assert groups["1"]["accuracy"] == 0.0 and groups[">=3"]["n"] == 1 and groups["first/last"]["n"] == 1
    assert 0.0 < groups["0"]["ci"][0] < 1.0 == groups["0"]["ci"][1]


def test_predictions_of_other_prompts_are_refused(script):
    from types import SimpleNamespace
    context = SimpleNamespace(cluster=0, shift=1, record_positions=[3, 6, 9],
                              queries=[SimpleNamespace(key=(5,))])
    eval_set = SimpleNamespace(contexts=[context], settings={"value_tokens": 1})
    good = {"cluster": 0, "shift": 1, "record": 1, "target_position": 6, "correct": True}
    (row,) = script.joined(eval_set, [good], 8, 8)
    assert (row["gap_before"], row["gap_after"], row["split"]) == (1, 1, False)
    for bad in ({**good, "target_position": 7}, {**good, "shift": 2}):
        with pytest.raises(ValueError, match="other settings"):
            script.joined(eval_set, [bad], 8, 8)


def test_gap_parity_names_odd_even_and_the_ends(script):
    assert [script.parity(g) for g in (0, 1, 2, 5, None)] == ["even", "odd", "even", "odd", "first/last"]
