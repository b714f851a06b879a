"""research/layout_knockout.py on the bundled DeepSeek-V3.2 model: its query masks split first-time from repeated
queries, and a whole-layer knockout removes what the untouched model retrieves."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import torch

from phasekv.checkpoint import read_experiment
from phasekv.config import Experiment

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "research" / "layout_knockout.py"
CHECKPOINT = ROOT / "checkpoints" / "dsv32-dsa"


def _module():
    spec = importlib.util.spec_from_file_location("layout_knockout", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_first_time_and_repeated_queries_are_disjoint_value_predictions():
    exp = Experiment.from_tree(read_experiment(CHECKPOINT))
    ids, labels, first, repeated = _module().sequences(exp, 4, seed=5)
    assert ids.shape == labels.shape == first.shape and first.any() and repeated.any()
    assert not (first & repeated).any()
    assert (labels[first | repeated] >= 0).all()  # every marked position is supervised (a value token)


def test_a_whole_layer_knockout_removes_the_lookup_and_no_knockout_keeps_it():
    out = subprocess.run([sys.executable, str(SCRIPT), str(CHECKPOINT), "--sequences", "4"], capture_output=True,
                         text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout
    rows = {line[:20].strip(): float(line.split("first-time queries")[1].split("%")[0])
            for line in out.splitlines() if "first-time queries" in line and "%" in line}
    assert rows["nothing knocked out"] > 90 and rows["layer 0 whole"] < 10 and rows["layer 1 whole"] < 10
    assert len(rows) == 1 + 2 * (1 + 8)  # clean, then per layer: whole and its 8 heads
    torch.testing.assert_close(torch.tensor(rows["layer 1 head 0"]), torch.tensor(rows["nothing knocked out"]),
                               atol=5.0, rtol=0)  # one redundant head of layer 1 costs little


def test_a_missing_checkpoint_or_no_sequences_is_one_line(tmp_path):
    for argv, why in (([str(tmp_path / "nothing")], "no such file or directory"),
                      ([str(CHECKPOINT), "--sequences", "0"], "--sequences: must be >= 1, got 0")):
        done = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True)
        assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr
        assert done.stderr.strip().splitlines()[-1].endswith(why)  # argparse's usage line may precede it
