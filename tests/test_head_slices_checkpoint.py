"""research/head_slices_checkpoint.py's helpers: the knockouts' owner groups (`--owners`) follow the named fixed
slicing on the model's own head counts, and a slicing whose owners move is refused."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "research" / "head_slices_checkpoint.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("head_slices_checkpoint", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


INFO = SimpleNamespace(num_heads=8, num_kv_heads=4)


def test_owners_name_the_slicing_and_its_groups(script):
    contiguous = script.owner_spec("none", "slices:kind=contiguous,size=8")
    assert (contiguous.kind, contiguous.size, contiguous.group) == ("contiguous", 8, "kv")
    assert script.owner_groups(contiguous, INFO) == 4
    query = script.owner_spec("none", "slices:kind=interleaved,group=query")
    assert script.owner_groups(query, INFO) == 8
    # without --owners: the condition's own slicing, and for `none` the interleaved query-head slicing
    assert script.owner_spec("slices:kind=contiguous,size=4,group=query", None).size == 4
    assert script.owner_spec("none", None).kind == "interleaved"
    assert script.owner_groups(script.owner_spec("none", None), INFO) == 8


@pytest.mark.parametrize("owners", ["slices:kind=contiguous,size=8,shift=layer",
                                    "slices:kind=interleaved,shift=random", "slices:kind=diagonal", "chunks:8"])
def test_owners_that_move_or_do_not_parse_are_refused(script, owners):
    with pytest.raises(ValueError):
        script.owner_spec("none", owners)


def test_owner_accuracy_groups_the_answers_by_the_owner_of_their_position(script):
    spec = script.owner_spec("none", "slices:kind=contiguous,size=8")  # sink 1: position 0 belongs to no group
    # positions 8-15 -> group 1, 16-23 -> 2, 24-31 -> 3, 32-39 -> 0, 40-47 -> 1 (period 32); 0 is the sink
    records = [{"answer_position": p, "correct": c} for p, c in
               [(0, True), (9, True), (15, False), (17, True), (23, True), (33, False), (39, False), (40, True)]]
    assert script._owner_accuracy(records, spec, 4) == [0.0, 0.6667, 1.0, None]
    interleaved = script.owner_spec("none", "slices:kind=interleaved")
    assert script._owner_accuracy(records, interleaved, 4) == [1.0, 0.6667, None, 0.3333]
