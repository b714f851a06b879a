"""`phasekv reproduce` end to end on two tiny freshly trained models: every section and number present."""

import json
import math

import pytest

from phasekv.cli import main
from phasekv.config import Experiment
from phasekv.report.html import write_report
from phasekv.report.reproduce import bundle
from phasekv.training.loop import train

TINY = {
    "model": dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, local_window=8, max_position_embeddings=256),
    "data": dict(n_records=24, n_queries=8, local_window=8),
    "train": dict(steps=4, batch_size=8, warmup_steps=1, log_every=2, eval_every=2, eval_sequences=8,
                  checkpoint_every=2),
}


def _walk_numbers(tree, where="summary"):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _walk_numbers(v, f"{where}.{k}")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _walk_numbers(v, f"{where}[{i}]")
    elif isinstance(tree, int | float) and not isinstance(tree, bool):
        yield where, tree


@pytest.mark.slow
def test_reproduce_end_to_end(tmp_path, capsys):
    for name, model in (("full-1kv", {}), ("w4s4", dict(compressor="gated", window=4, stride=4))):
        tree = json.loads(json.dumps(TINY))
        tree["model"].update(model)
        train(Experiment.from_tree(tree), tmp_path / "runs" / name, progress=False)
        bundle(tmp_path / "runs" / name, tmp_path / "ckpt" / name)
    out = tmp_path / "report"
    code = main(["reproduce", "--out", str(out), "--checkpoints", str(tmp_path / "ckpt"), "--quick",
                 "--no-progress"])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["models"]) == {"full-1kv", "w4s4"}
    for name, m in summary["models"].items():
        for protocol in ("prefix", "insequence"):
            for key in ("mean_accuracy", "max_gap_pp", "detected_period", "flatness_p", "per_residue"):
                assert key in m[protocol], (name, protocol, key)
        assert m["knockout"]["rows"] and m["val_loss"] is not None
    w = summary["models"]["w4s4"]
    assert w["gates"] and w["cycling"]["deltas"] and w["gate_trajectory"]["steps"] == [2, 4]
    assert summary["theory"] and summary["findings"]
    for f in summary["findings"]:  # every claim that does not hold says why, with its evidence
        assert ("reason" in f) == (f["status"] in ("fails", "inconclusive")), f["claim"]
    for row in w["cycling"]["deltas"]:  # each shift's outcome, and no R^2 below -1
        assert row["status"] in ("moved", "did not move", "destroyed", "inconclusive", None)
        assert (row["status"] is None) == (row["delta"] % 4 == 0)
        assert row["r2_excl_boundary"] is None or row["r2_excl_boundary"] >= -1
    for where, value in _walk_numbers(summary):
        assert math.isfinite(value), where
    page = (out / "report.html").read_text()
    for section in ("Findings", "prefix padding", "insequence padding", "Knockouts", "Gate concentration",
                    "Gate cycling", "Theory"):
        assert section in page
    assert page.count("data:image/png;base64,") >= 8
    # the report's table shows summary.json's numbers
    assert f"{100 * w['prefix']['mean_accuracy']:.1f}" in page
    # the per-model figures drawn by the workers are the ones a redraw from summary.json alone makes
    redrawn = tmp_path / "redrawn"
    write_report(summary, redrawn)
    names = sorted(p.name for p in (out / "figures").iterdir())
    assert names == sorted(p.name for p in (redrawn / "figures").iterdir())
    assert {"knockout_w4s4.png", "cycling_w4s4.png", "knockout_full-1kv.png"} <= set(names)


def test_reproduce_workers_die_with_a_killed_parent(tmp_path):
    """A SIGKILLed `reproduce` leaves no orphaned analysis workers (their initializer asks the kernel for SIGTERM
    on the parent's death); without the initializer the worker outlives the parent (the control)."""
    import os
    import subprocess
    import sys
    import time

    script = tmp_path / "parent.py"
    script.write_text(
        "import concurrent.futures, multiprocessing, os, signal, sys, time\n"
        "from phasekv.report.reproduce import _die_with_parent\n"
        "def work(path):\n"
        "    open(path, 'w').write(str(os.getpid()))\n"
        "    time.sleep(60)\n"
        "if __name__ == '__main__':\n"
        "    init = _die_with_parent if sys.argv[2] == 'init' else None\n"
        "    pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context('spawn'),"
        " initializer=init)\n"
        "    pool.submit(work, sys.argv[1])\n"
        "    while not os.path.exists(sys.argv[1]): time.sleep(0.05)\n"
        "    time.sleep(0.2)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n")

    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    survived = {}
    for mode in ("init", "none"):
        pid_file = tmp_path / f"worker-{mode}.pid"
        subprocess.run([sys.executable, str(script), str(pid_file), mode], timeout=120)
        pid = int(pid_file.read_text())
        deadline = time.time() + 10
        while alive(pid) and time.time() < deadline:
            time.sleep(0.1)
        survived[mode] = alive(pid)
        if survived[mode]:
            os.kill(pid, 9)
    assert survived == {"init": False, "none": True}
