"""Training and evaluation under `torch.distributed.run` (2 gloo processes on CPU): a DeepSeek-CSA
model (attention sink, partial RoPE) trains to the same per-step losses as one process, errors are
printed once (by rank 0), and an untrainable compressor is refused in one line."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from phasekv.config import Experiment
from phasekv.training.loop import train
from phasekv.training.rundir import read_metrics
from tests.test_train import TINY

SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}

# configs/cpu/deepseek-csa.yaml, shrunk
CSA = {**TINY, "model": {**TINY["model"], "compressor": "deepseek_csa", "csa_block": 4, "rope_dims": 8,
                         "rope_part": "last", "attn_sink": True},
       "train": {**TINY["train"], "steps": 3, "checkpoint_every": 3, "threads": 1}}
for key in ("window", "stride"):
    CSA["model"].pop(key)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "-m", "phasekv.cli", *args]
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_ddp_deepseek_csa_matches_one_process(tmp_path):
    cfg = tmp_path / "csa.yaml"
    cfg.write_text(yaml.safe_dump(CSA))
    train(Experiment.from_file(cfg), tmp_path / "one", progress=False)
    result = torchrun("train", str(cfg), "--out", str(tmp_path / "two"), "--no-progress")
    assert result.returncode == 0, result.stderr[-2000:]
    one, two = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2, 3]
    for x, y in zip(one, two, strict=True):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4)
    assert json.loads((tmp_path / "two" / "final" / "config.json").read_text())["model"]["attn_sink"] is True


@pytest.mark.slow
@pytest.mark.parametrize("command", ["eval", "train"])
def test_failing_command_under_torchrun_prints_its_error_once(tmp_path, command):
    """eval: every rank fails (no checkpoint); train: only rank 0 sees the non-empty --out, and the
    other rank must stop too instead of waiting for it in a collective."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    cfg = tmp_path / "csa.yaml"
    cfg.write_text(yaml.safe_dump(CSA))
    args = ["--checkpoint", str(tmp_path / "nowhere")] if command == "eval" else [str(cfg)]
    result = torchrun(command, *args, "--out", str(tmp_path / "out"), "--no-progress")
    assert result.returncode != 0
    assert result.stderr.count(f"phasekv {command}: error:") == 1, result.stderr[-2000:]
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine" and len(list((tmp_path / "out").iterdir())) == 1


def test_indexer_is_refused_by_training_in_one_line(tmp_path):
    tree = json.loads(json.dumps(CSA))
    tree["model"]["index_topk"] = 2
    with pytest.raises(ValueError, match="index_topk") as info:
        train(Experiment.from_tree(tree), tmp_path / "r", progress=False)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "r").exists()  # refused before the run directory is created
