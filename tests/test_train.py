"""Trainer: loss falls, resume reproduces an uninterrupted run exactly, DDP matches one process,
checkpoints fail loudly when damaged, a non-finite loss stops the run and keeps the last checkpoint."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import phasekv.training.loop as train_mod
from phasekv.checkpoint import load_checkpoint
from phasekv.config import Experiment
from phasekv.training.loop import train
from phasekv.training.rundir import read_metrics

TINY = {
    "model": dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, compressor="gated", window=4, stride=4, local_window=4,
                  max_position_embeddings=128),
    "data": dict(n_records=8, n_queries=8, prefix_max=7, outer_max=3, local_window=4, background_fraction=0.25),
    "train": dict(steps=6, batch_size=8, lr=1e-2, warmup_steps=1, log_every=1, eval_every=3, eval_sequences=16,
                  checkpoint_every=3, seed=3),
}


def experiment(**train_overrides) -> Experiment:
    tree = json.loads(json.dumps(TINY))
    tree["train"].update(train_overrides)
    return Experiment.from_tree(tree)


def losses(run: Path) -> list[float]:
    return [row["loss"] for row in read_metrics(run)]


def test_loss_falls(tmp_path):
    train(experiment(steps=40, eval_every=40, checkpoint_every=40, lr=1e-2, warmup_steps=4), tmp_path / "r",
          progress=False)
    values = losses(tmp_path / "r")
    assert sum(values[-5:]) / 5 < 0.8 * sum(values[:5]) / 5
    model, config = load_checkpoint(tmp_path / "r")
    assert config.compressor == "gated" and not model.training


def test_resume_after_kill_reproduces_losses(tmp_path, monkeypatch):
    train(experiment(), tmp_path / "full", progress=False)
    original = train_mod.TrainingStream.batch

    def dies_at_step_4(self, step, batch_size):
        if step == 4:
            raise KeyboardInterrupt  # the process is killed after the step-3 checkpoint
        return original(self, step, batch_size)

    monkeypatch.setattr(train_mod.TrainingStream, "batch", dies_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        train(experiment(), tmp_path / "killed", progress=False)
    monkeypatch.setattr(train_mod.TrainingStream, "batch", original)
    assert (tmp_path / "killed" / "latest").read_text().strip() == "step_000003"
    train(experiment(), tmp_path / "killed", resume=True, progress=False)
    assert losses(tmp_path / "killed") == losses(tmp_path / "full")  # exact, not approximately
    a = (tmp_path / "full" / "checkpoints" / "step_000006" / "model.safetensors").read_bytes()
    b = (tmp_path / "killed" / "checkpoints" / "step_000006" / "model.safetensors").read_bytes()
    assert a == b
    assert sorted(p.name for p in (tmp_path / "killed" / "gates").iterdir()) == [
        "step_000003.safetensors", "step_000006.safetensors"]


def test_existing_run_needs_resume(tmp_path):
    train(experiment(steps=3, checkpoint_every=3), tmp_path / "r", progress=False)
    with pytest.raises(ValueError, match="--resume"):
        train(experiment(steps=3, checkpoint_every=3), tmp_path / "r", progress=False)


def test_non_finite_loss_stops_and_keeps_checkpoint(tmp_path, monkeypatch):
    original = train_mod.token_losses
    calls = {"n": 0}

    def nan_after_four(model, ids, labels):
        calls["n"] += 1
        out = original(model, ids, labels)
        return out * float("nan") if calls["n"] > 4 else out

    monkeypatch.setattr(train_mod, "token_losses", nan_after_four)
    with pytest.raises(ValueError, match="non-finite.*step_000003"):
        train(experiment(), tmp_path / "r", progress=False)
    model, _ = load_checkpoint(tmp_path / "r")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_damaged_checkpoints_give_clear_errors(tmp_path):
    train(experiment(steps=3, checkpoint_every=3), tmp_path / "r", progress=False)
    ck = tmp_path / "r" / "checkpoints" / "step_000003"
    data = (ck / "model.safetensors").read_bytes()
    (ck / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated or corrupted"):
        load_checkpoint(tmp_path / "r")
    (ck / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="truncated or corrupted"):
        load_checkpoint(ck)
    (ck / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_checkpoint(ck)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "nowhere")


@pytest.mark.parametrize("section, key", [("model", "windw"), ("train", "stepz"), ("data", "n_recordz")])
def test_unknown_keys_are_named(section, key):
    tree = json.loads(json.dumps(TINY))
    tree[section][key] = 1
    with pytest.raises(ValueError, match=f"{section}.{key}"):
        Experiment.from_tree(tree)


def test_gradient_accumulation_matches_one_big_batch(tmp_path):
    train(experiment(steps=3, checkpoint_every=3), tmp_path / "a", progress=False)
    train(experiment(steps=3, checkpoint_every=3, grad_accum=2), tmp_path / "b", progress=False)
    for x, y in zip(losses(tmp_path / "a"), losses(tmp_path / "b")):
        assert x == pytest.approx(y, rel=1e-4)


@pytest.mark.slow
def test_ddp_two_processes_match_one(tmp_path):
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump({**TINY, "train": {**TINY["train"], "steps": 3, "checkpoint_every": 3,
                                                     "threads": 1}}))
    train(Experiment.from_file(cfg), tmp_path / "one", progress=False)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533",
           "-m", "phasekv.cli", "train", str(cfg), "--out", str(tmp_path / "two"), "--no-progress"]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    for x, y in zip(losses(tmp_path / "one"), losses(tmp_path / "two"), strict=True):
        assert x == pytest.approx(y, rel=1e-4)


def test_window_jitter_shifts_the_grid_per_step_and_restores_it(tmp_path, monkeypatch):
    from phasekv.compression import compressors_of, shifted_windows
    from phasekv.model import build_model

    model = build_model(experiment().model).eval()
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        clean = model(ids)
        with shifted_windows(model, 4):  # a whole stride: the same grid
            assert torch.equal(model(ids), clean)
        with shifted_windows(model, 1):
            assert [c.offset for _, c in compressors_of(model)] == [1]
            assert not torch.allclose(model(ids), clean)
    assert [c.offset for _, c in compressors_of(model)] == [0]
    seen = []
    real = train_mod.shifted_windows

    def spy(m, shift):
        seen.append(shift % 4)
        return real(m, shift)

    monkeypatch.setattr(train_mod, "shifted_windows", spy)
    train(experiment(window_jitter=True), tmp_path / "r", progress=False)
    assert len(seen) == 6 and len(set(seen)) > 1  # a shift drawn per step, not always the same
    seen.clear()
    train(experiment(), tmp_path / "plain", progress=False)
    assert seen == [0] * 6


def test_lr_horizons_reproduce_a_run_resumed_with_more_steps(tmp_path):
    """A run of 3 steps resumed with steps=6 equals one run of 6 steps with lr_horizons [3], bit for bit (the
    schedule the bundled dsv4-csa and dsv32-dsa checkpoints were trained with)."""
    train(experiment(steps=3, checkpoint_every=3, eval_every=3), tmp_path / "resumed", progress=False)
    train(experiment(steps=6, checkpoint_every=3, eval_every=3), tmp_path / "resumed", resume=True, progress=False)
    train(experiment(steps=6, checkpoint_every=3, eval_every=3, lr_horizons=[3]), tmp_path / "one", progress=False)
    rows = {name: read_metrics(tmp_path / name) for name in ("resumed", "one")}
    assert [r["lr"] for r in rows["one"]] == [r["lr"] for r in rows["resumed"]]
    assert losses(tmp_path / "one") == losses(tmp_path / "resumed")
    a = (tmp_path / "one" / "checkpoints" / "step_000006" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "resumed" / "checkpoints" / "step_000006" / "model.safetensors").read_bytes()
    plain = experiment(steps=6).train
    assert plain.lr_at(2) != experiment(steps=6, lr_horizons=[3]).train.lr_at(2)
    for bad in ([6], [0], [4, 3], ["3"], [True]):
        with pytest.raises(ValueError, match="train.lr_horizons"):
            experiment(steps=6, lr_horizons=bad)


def test_a_warm_start_begins_from_the_source_weights_and_refuses_another_model(tmp_path):
    """train.init_from: step 1's loss is the source model's loss on that batch (a fresh model's differs), the longer
    max_position_embeddings is accepted, any other model change is one line; a resumed run reads its own checkpoint."""
    train(experiment(steps=3, checkpoint_every=3, eval_every=3), tmp_path / "source", progress=False)
    source_final = load_checkpoint(tmp_path / "source")[0].state_dict()
    longer = {**TINY["model"], "max_position_embeddings": 512}
    tree = {**json.loads(json.dumps(TINY)), "model": longer}
    tree["train"].update(steps=1, lr=1e-9, warmup_steps=0, eval_every=1, checkpoint_every=1,
                         init_from=str(tmp_path / "source"))
    train(Experiment.from_tree(tree), tmp_path / "warm", progress=False)
    warm = load_checkpoint(tmp_path / "warm")[0].state_dict()
    assert all(torch.allclose(warm[k], source_final[k], atol=1e-5) for k in source_final)
    tree["train"]["init_from"] = ""
    train(Experiment.from_tree(tree), tmp_path / "cold", progress=False)
    cold = load_checkpoint(tmp_path / "cold")[0].state_dict()
    assert not all(torch.allclose(cold[k], source_final[k], atol=1e-5) for k in source_final)
    tree["model"] = {**longer, "hidden_size": 48}
    tree["train"]["init_from"] = str(tmp_path / "source")
    with pytest.raises(ValueError, match=r"train.init_from .*differs from this one in \['hidden_size'\]") as info:
        train(Experiment.from_tree(tree), tmp_path / "other", progress=False)
    assert "\n" not in str(info.value)
