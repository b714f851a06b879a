"""research/minimax_m3_selection.py: its targets are the record value tokens the first-time queries must copy, and a
checkpoint without a MiniMax-M3 block indexer or a bad argument is refused in one line."""

import importlib.util
import subprocess
import sys
from pathlib import Path

from phasekv.checkpoint import read_experiment
from phasekv.config import Experiment

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "research" / "minimax_m3_selection.py"
DSV32 = ROOT / "checkpoints" / "dsv32-dsa"  # a token-level indexer, no blocks


def _module():
    spec = importlib.util.spec_from_file_location("minimax_m3_selection", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_targets_are_the_record_values_the_first_time_queries_copy():
    exp = Experiment.from_tree(read_experiment(DSV32))  # the same data section as the MiniMax-M3 preset
    ids, labels, queries = _module().targets(exp, 4, seed=5)
    assert queries and ids.shape == labels.shape
    rows = {row for row, _, _ in queries}
    assert rows == set(range(4))
    for row, answer, target in queries:
        assert target < answer - 16  # outside the local window: a first-time query's value is only in its record
        assert labels[row, answer] == ids[row, target]  # the answer is the record's first value token
        assert ids[row, target - 1] == ids[row, answer]  # preceded by the same (last) key token as the query's
    assert len({(r, t) for r, _, t in queries}) == len(queries)  # first-time: each record once per sequence


def test_no_block_indexer_or_no_sequences_is_one_line(tmp_path):
    for argv, why in (([str(DSV32)], "has no MiniMax-M3 block indexer"),
                      ([str(tmp_path / "nothing")], "no such file or directory"),
                      ([str(DSV32), "--sequences", "0"], "--sequences: must be >= 1, got 0")):
        done = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True)
        assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr
        assert done.stderr.strip().splitlines()[-1].endswith(why)
