"""Crash safety and resume verification.

Crash tests run `phasekv eval` / `phasekv train` in a subprocess whose `os.replace`, `os.fsync` or
`shutil.rmtree` SIGKILLs the process at its N-th call (every write step of publishing), then check
that the output is the old complete one or the new complete one, never a mix, and that
`train --resume` always finishes the run with a complete final/.
"""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import phasekv.outputs as outputs_mod
from phasekv.cli import main
from phasekv.config import Experiment
from phasekv.training.loop import train
from phasekv.training.rundir import read_metrics
from tests.test_train import TINY, experiment

SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}

# Imports phasekv once, then forks one child per job; the child patches `fn` to SIGKILL itself at its
# `at`-th call and runs `phasekv ARGV`.  Prints each child's wait status (fork keeps the tests fast:
# one interpreter start instead of one per kill point).
KILLER = '''
import json, os, shutil, sys
import torch
import torch._dynamo  # imported lazily by the optimizer: once here, not once per child
torch.set_num_threads(1)
import phasekv.evaluate.runner, phasekv.training.loop
from phasekv.cli import build_parser, main
build_parser()  # imports every subcommand's module before forking

def child(name, at, argv):
    module, attr = (shutil, "rmtree") if name == "shutil.rmtree" else (os, name[3:])
    original, calls = getattr(module, attr), [0]

    def patched(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            os.kill(os.getpid(), 9)
        return original(*args, **kwargs)

    setattr(module, attr, patched)
    os._exit(main(argv))

statuses = []
for name, at, argv in json.loads(sys.argv[1]):
    pid = os.fork()
    if pid == 0:
        child(name, at, argv)
    statuses.append(os.waitpid(pid, 0)[1])
print(json.dumps(statuses))
'''


def killed_runs(tmp_path: Path, jobs: list[tuple[str, int, list[str]]], env: dict[str, str] | None = None) -> None:
    """Run each (function, call number, phasekv argv) job and check that it was killed there."""
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    result = subprocess.run([sys.executable, str(script), json.dumps(jobs)], env={**ENV, **(env or {})},
                            capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    statuses = json.loads(result.stdout.strip().splitlines()[-1])
    for (name, at, _), status in zip(jobs, statuses, strict=True):
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (name, at, status,
                                                                                  result.stderr[-500:])


def counting(monkeypatch, run) -> dict[str, int]:
    """Run `run()` in this process; how often it called each function the killer can patch."""
    calls = {"os.replace": 0, "os.fsync": 0, "shutil.rmtree": 0}
    for name in calls:
        module, attr = (shutil, "rmtree") if name == "shutil.rmtree" else (os, name[3:])
        original = getattr(module, attr)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, attr, counted)
    run()
    monkeypatch.undo()
    return calls


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def tiny_yaml(tmp_path: Path, **train_overrides) -> Path:
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(yaml.safe_dump({**TINY, "train": {**TINY["train"], "steps": 3, "checkpoint_every": 3,
                                                     "threads": 1, **train_overrides}}))
    return cfg


# ---------------------------------------------------------------- crash tests


@pytest.mark.slow
@pytest.mark.parametrize("exchange", [True, False], ids=["rename-exchange", "two-renames"])
def test_eval_killed_at_every_publish_step_leaves_old_or_new(tmp_path, monkeypatch, exchange):
    monkeypatch.setattr(outputs_mod, "_USE_EXCHANGE", exchange)
    train(experiment(steps=3, checkpoint_every=3), tmp_path / "run", progress=False)
    base = ["eval", "--checkpoint", str(tmp_path / "run"), "--demos", "2", "--residue-modulus", "4", "--stride",
            "4", "--no-progress", "--force", "--out"]
    assert main(base + [str(tmp_path / "old")]) == 0  # the old, complete output
    old = snapshot(tmp_path / "old")
    calls = counting(monkeypatch, lambda: main(base + [str(tmp_path / "new"), "--seed", "1"]))
    monkeypatch.setattr(outputs_mod, "_USE_EXCHANGE", exchange)  # counting's undo reset it
    new = snapshot(tmp_path / "new")
    assert old != new and set(old) == set(new) == {"metrics.json", "predictions.jsonl", "accuracy_by_residue.png",
                                                   outputs_mod.MARKER}
    # replacing an old --out: one atomic exchange (or two renames) and one removal in publish; fsyncs of files,
    # then of directories
    points = [("shutil.rmtree", 1), ("os.fsync", 1), ("os.fsync", calls["os.fsync"])]
    if not exchange:
        points += [("os.replace", 1), ("os.replace", 2)]
    outs = [tmp_path / f"ev-{fn}-{at}" for fn, at in points]
    for out in outs:
        shutil.copytree(tmp_path / "old", out)
    env = {"PHASEKV_RENAME_EXCHANGE": "1" if exchange else "0"}
    killed_runs(tmp_path, [(fn, at, base + [str(out), "--seed", "1"]) for (fn, at), out in zip(points, outs)], env)
    for point, out in zip(points, outs, strict=True):
        outputs_mod.recover(out)  # what the next command does first (check_output_dir)
        assert snapshot(out) in (old, new), point


@pytest.mark.slow
def test_train_killed_at_every_save_step_resumes_to_a_complete_final(tmp_path, monkeypatch):
    cfg = tiny_yaml(tmp_path)
    calls = counting(monkeypatch, lambda: train(Experiment.from_file(cfg), tmp_path / "ref", progress=False))
    reference = (tmp_path / "ref" / "final" / "model.safetensors").read_bytes()
    # config.json, metrics.jsonl, the checkpoint, its gate snapshot, latest, final/
    assert calls["os.replace"] == 6
    points = range(1, calls["os.replace"] + 1)
    killed_runs(tmp_path, [("os.replace", at, ["train", str(cfg), "--out", str(tmp_path / f"run-{at}"),
                                               "--no-progress"]) for at in points])
    for at in points:
        run = tmp_path / f"run-{at}"
        train(Experiment.from_file(cfg), run, resume=True, progress=False)
        assert (run / "final" / "model.safetensors").read_bytes() == reference, at
        assert json.loads((run / "final" / "config.json").read_text())["train"]["steps"] == 3
        assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]


def test_kill_while_final_is_replaced_on_a_longer_resume(tmp_path):
    """A run resumed with more steps replaces final/; killed inside that publish (or just before),
    resume must not keep the shorter run's final."""
    cfg = tiny_yaml(tmp_path)
    train(Experiment.from_file(cfg), tmp_path / "run", progress=False)
    longer = Experiment.from_file(cfg, ["train.steps=6"])
    original = outputs_mod.os.replace
    calls = []

    def dies_replacing_final(src, dst):
        calls.append(dst)
        if Path(dst).name == "final":
            raise KeyboardInterrupt  # the old final sits under its swap name, final does not exist
        return original(src, dst)

    outputs_mod.os.replace = dies_replacing_final
    outputs_mod._USE_EXCHANGE = False  # the two-rename path: the atomic exchange has no such moment
    try:
        with pytest.raises(KeyboardInterrupt):
            train(longer, tmp_path / "run", resume=True, progress=False)
    finally:
        outputs_mod.os.replace = original
        outputs_mod._USE_EXCHANGE = True
    assert not (tmp_path / "run" / "final").exists() and list((tmp_path / "run").glob(".final.old-*"))
    train(longer, tmp_path / "run", resume=True, progress=False)
    final, last = (load_file(str(tmp_path / "run" / d / "model.safetensors"))
                   for d in ("final", "checkpoints/step_000006"))
    assert json.loads((tmp_path / "run" / "final" / "config.json").read_text())["train"]["steps"] == 6
    assert all(torch.equal(final[k], last[k].to(final[k].dtype)) for k in last)


def test_resume_of_a_run_killed_before_its_first_checkpoint(tmp_path):
    cfg = tiny_yaml(tmp_path)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({**Experiment.from_file(cfg).tree}))
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n{"step": 2, "lo')
    train(Experiment.from_file(cfg), run, resume=True, progress=False)
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3] and (run / "final" / "model.safetensors").is_file()


# ---------------------------------------------------------------- resume verification


def drop_a_tensor(checkpoint: Path) -> None:
    from safetensors.torch import save_file

    weights = load_file(str(checkpoint / "model.safetensors"))
    weights.pop(sorted(weights)[0])
    save_file(weights, str(checkpoint / "model.safetensors"))


def test_checkpoint_missing_a_tensor_falls_back_to_the_previous_one(tmp_path, caplog):
    run = tmp_path / "r"
    train(experiment(), run, progress=False)
    drop_a_tensor(run / "checkpoints" / "step_000006")
    with caplog.at_level(logging.WARNING):
        train(experiment(steps=7), run, resume=True, progress=False)
    assert "missing" in caplog.text and "resuming from step_000003" in caplog.text


def test_checkpoint_missing_a_tensor_is_refused(tmp_path):
    run = tmp_path / "r"
    train(experiment(steps=3, checkpoint_every=3), run, progress=False)
    drop_a_tensor(run / "checkpoints" / "step_000003")
    with pytest.raises(ValueError, match="no readable checkpoint.*missing"):
        train(experiment(steps=4, checkpoint_every=3), run, resume=True, progress=False)


def test_resume_refuses_changed_model_and_seed_but_allows_steps(tmp_path):
    cfg = tiny_yaml(tmp_path)
    train(Experiment.from_file(cfg), tmp_path / "r", progress=False)
    with pytest.raises(ValueError, match=r"model\.window") as info:
        train(Experiment.from_file(cfg, ["model.window=16", "model.stride=4"]), tmp_path / "r", resume=True,
              progress=False)
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match=r"train\.seed"):
        train(Experiment.from_file(cfg, ["train.seed=7"]), tmp_path / "r", resume=True, progress=False)
    train(Experiment.from_file(cfg, ["train.steps=4"]), tmp_path / "r", resume=True, progress=False)
    assert json.loads((tmp_path / "r" / "config.json").read_text())["train"]["steps"] == 4
    assert [r["step"] for r in read_metrics(tmp_path / "r")] == [1, 2, 3, 4]


def test_cli_resume_with_changed_window_is_one_line(tmp_path):
    cfg = tiny_yaml(tmp_path)
    train(Experiment.from_file(cfg), tmp_path / "r", progress=False)
    result = subprocess.run([sys.executable, "-m", "phasekv.cli", "train", str(cfg), "--out", str(tmp_path / "r"),
                             "--resume", "--set", "model.window=16", "--no-progress"], env=ENV, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "model.window" in result.stderr


def test_torn_metrics_line_is_dropped_and_resume_works(tmp_path, caplog):
    run = tmp_path / "r"
    train(experiment(steps=3, checkpoint_every=3), run, progress=False)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "los')
    with caplog.at_level(logging.WARNING):
        train(experiment(steps=5, checkpoint_every=3), run, resume=True, progress=False)
    assert "torn" in caplog.text
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5]


def test_corrupt_newest_checkpoint_falls_back_to_previous(tmp_path, caplog):
    run = tmp_path / "r"
    train(experiment(), run, progress=False)
    path = run / "checkpoints" / "step_000006" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with caplog.at_level(logging.WARNING):
        train(experiment(steps=7), run, resume=True, progress=False)
    assert "resuming from step_000003" in caplog.text
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 8))


def test_corrupt_trainer_state_everywhere_leaves_metrics_untouched(tmp_path):
    run = tmp_path / "r"
    train(experiment(), run, progress=False)
    for ck in (run / "checkpoints").iterdir():
        (ck / "trainer_state.json").write_text("{broken")
    before = (run / "metrics.jsonl").read_bytes()
    with pytest.raises(ValueError, match="no readable checkpoint"):
        train(experiment(steps=7), run, resume=True, progress=False)
    assert (run / "metrics.jsonl").read_bytes() == before


@pytest.mark.parametrize("name", ["../../etc", "/etc", "step_000003/../../x"])
def test_latest_outside_the_run_is_refused(tmp_path, name):
    run = tmp_path / "r"
    train(experiment(steps=3, checkpoint_every=3), run, progress=False)
    (run / "latest").write_text(name + "\n")
    with pytest.raises(ValueError, match="latest"):
        train(experiment(steps=4, checkpoint_every=3), run, resume=True, progress=False)


def test_out_holding_only_metrics_is_refused_and_untouched(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    for resume in (False, True):
        with pytest.raises(ValueError, match="not an empty directory"):
            train(experiment(steps=3, checkpoint_every=3), run, resume=resume, progress=False)
        assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n' and len(list(run.iterdir())) == 1


def test_publish_fsyncs(tmp_path, monkeypatch):
    synced = []
    original = os.fsync
    monkeypatch.setattr(outputs_mod.os, "fsync", lambda fd: synced.append(fd) or original(fd))
    with outputs_mod.output_dir(tmp_path / "out") as tmp:
        (tmp / "a.json").write_text("{}")
        (tmp / "b.txt").write_text("x")
    assert len(synced) >= 4  # two files, the new directory, its parent after the rename
    synced.clear()
    train(experiment(steps=3, checkpoint_every=3), tmp_path / "run", progress=False)
    assert len(synced) >= 10


def test_kill_while_pruning_an_old_checkpoint(tmp_path, monkeypatch):
    import phasekv.training.rundir as rundir_mod

    run = tmp_path / "r"
    original = shutil.rmtree

    def dies_after_one_file(path, *args, **kwargs):
        next(Path(path).iterdir()).unlink()  # half deleted
        raise KeyboardInterrupt

    monkeypatch.setattr(rundir_mod.shutil, "rmtree", dies_after_one_file)
    with pytest.raises(KeyboardInterrupt):
        train(experiment(keep_checkpoints=1), run, progress=False)
    monkeypatch.setattr(rundir_mod.shutil, "rmtree", original)
    assert (run / "checkpoints" / "step_000003.deleting").is_dir()
    assert rundir_mod.kept_checkpoints(run) == [run / "checkpoints" / "step_000006"]
    train(experiment(keep_checkpoints=1, steps=9), run, resume=True, progress=False)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000009"]


def test_resume_without_its_latest_pointer_continues_from_the_newest_checkpoint(tmp_path, caplog):
    """`latest` lost (checkpoints and final/ present): --resume continues from the newest readable checkpoint,
    never from step 0 over the existing checkpoints."""
    cfg = tiny_yaml(tmp_path, checkpoint_every=2, steps=4)
    train(Experiment.from_file(cfg), tmp_path / "ref", progress=False)
    run = tmp_path / "run"
    train(Experiment.from_file(cfg, ["train.steps=2"]), run, progress=False)
    (run / "latest").unlink()
    kept = (run / "checkpoints" / "step_000002" / "model.safetensors").stat().st_mtime_ns
    with caplog.at_level("INFO", logger="phasekv.training.rundir"):
        train(Experiment.from_file(cfg), run, resume=True, progress=False)
    assert any("at step 2" in r.getMessage() for r in caplog.records), caplog.text
    assert (run / "checkpoints" / "step_000002" / "model.safetensors").stat().st_mtime_ns == kept  # not retrained
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    reference, resumed = (load_file(str(d / "final" / "model.safetensors")) for d in (tmp_path / "ref", run))
    assert all(torch.equal(reference[k], resumed[k]) for k in reference)


# ---------------------------------------------------------------- bounded work and quiet libraries


def held_bytes_per_sequence(exp: Experiment) -> float:
    """Bytes one training sequence holds when its loss is computed, measured: the storages autograd saved in a
    forward of `token_losses` plus its float32 logits, at batch 2 and at batch 6 (the difference drops the weights,
    saved at any batch)."""
    from phasekv import families
    from phasekv.training.loop import token_losses

    torch.manual_seed(0)
    model = families.build(exp.model)
    saved = []
    for batch in (2, 6):
        storages: dict[int, int] = {}

        def pack(t, storages=storages):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        ids = torch.randint(0, exp.model.vocab_size, (batch, exp.data.seq_len))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            token_losses(model, ids, ids)
        saved.append(sum(storages.values()) + ids.numel() * exp.model.vocab_size * 4)
    return (saved[1] - saved[0]) / 4


@pytest.mark.parametrize("model", [
    TINY["model"],
    {**TINY["model"], "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 3, "num_attention_heads": 4,
     "num_key_value_heads": 2},
    {**TINY["model"], "compressor": "deepseek_csa", "csa_block": 4, "window": None, "stride": None},
    {**TINY["model"], "vocab_size": 8192},
    {"model_type": "qwen3", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256},
], ids=["tiny-gated", "wider-gated", "deepseek-csa", "large-vocab", "qwen3"])
def test_activation_estimate_is_a_lower_bound_of_what_autograd_keeps(model):
    """`phasekv train` refuses a config whose estimate exceeds the memory: the estimate must never exceed what a
    step really holds, and stay within a small factor of it (so the check means something)."""
    from phasekv.cli.train import activation_bytes

    tree = {**TINY, "model": {k: v for k, v in model.items() if v is not None},
            "train": {**TINY["train"], "batch_size": 1}}
    exp = Experiment.from_tree(tree)
    micro, estimate = activation_bytes(exp)
    measured = held_bytes_per_sequence(exp)
    print(f"\nheld {measured:.0f} bytes per sequence, estimate {estimate}: ratio {measured / estimate:.2f}")
    assert micro == 1 and estimate <= measured <= 8 * estimate, (estimate, measured)
    big = Experiment.from_tree({**tree, "train": {**tree["train"], "batch_size": 1 << 20, "grad_accum": 4}})
    assert activation_bytes(big) == (1 << 18, (1 << 18) * estimate)  # linear in the micro-batch


def test_prompt_bytes_is_a_lower_bound_of_what_an_evaluation_holds():
    """The prompt-set check charges PROMPT_BYTES per prompt; tracemalloc measures what the eval set and the
    prediction records really hold per prompt."""
    import gc
    import tracemalloc

    from phasekv.adapters.phasekv import PhaseKVAdapter
    from phasekv.cli.flags import PROMPT_BYTES
    from phasekv.data.protocols import build_eval_set
    from phasekv.evaluate.runner import predict
    from phasekv.model import build_model
    from tests.helpers import tiny
    from tests.test_evaluate import VOCAB

    torch.manual_seed(0)
    adapter = PhaseKVAdapter(build_model(tiny(vocab_size=256, max_position_embeddings=1024)))
    for protocol, records in (("prefix", 32), ("insequence", 64)):
        gc.collect()
        tracemalloc.start()
        try:
            eval_set = build_eval_set(VOCAB, protocol, n_records=records, n_demos=2, stride=8, residue_modulus=8)
            kept = predict(adapter, eval_set, 64, progress=False)
            per_prompt = tracemalloc.get_traced_memory()[0] / len(kept)
        finally:
            tracemalloc.stop()
        assert PROMPT_BYTES <= per_prompt <= 4 * PROMPT_BYTES, (protocol, per_prompt)


def test_prompts_at_least_never_exceeds_the_prompts_built():
    from phasekv.cli.flags import prompts_at_least
    from phasekv.config import EvalConfig
    from phasekv.data.protocols import build_eval_set
    from tests.test_evaluate import VOCAB

    tight = 0
    for protocol in ("prefix", "insequence"):
        for r, stride, clusters, targets in [(8, 8, None, None), (8, 4, 2, None), (8, 8, 4, 8), (16, 4, None, None),
                                             (12, 4, 6, None), (8, 8, None, 16), (24, 8, 3, None), (4, 4, 12, None)]:
            try:
                built = len(build_eval_set(VOCAB, protocol, n_records=48, n_demos=2, stride=stride, residue_modulus=r,
                                           n_clusters=clusters, targets_per_context=targets).queries())
            except ValueError:  # a combination the builder refuses (clusters not a multiple of g, ...)
                continue
            bound = prompts_at_least(EvalConfig(residue_modulus=r, stride=stride, clusters=clusters,
                                                targets_per_context=targets))
            assert bound <= built, (protocol, r, clusters, targets, bound, built)
            tight += bound == built
    assert tight >= 3  # the bound is exact where the settings fix the count


def test_a_compression_that_compresses_nothing_is_refused():
    """`max-norm+keep-first:100000` (a sink longer than every prompt) or prompts too short for one window would
    evaluate the full cache under a compressed condition's name: refused when the prompt length is checked, before
    any forward."""
    from phasekv.adapters.hf import HFAdapter
    from phasekv.conditions.posthoc import PosthocAdapter
    from tests.helpers import tiny_causal_lm

    base = HFAdapter(tiny_causal_lm("qwen3", 64, 512, "sdpa"), "tiny")
    with pytest.raises(ValueError, match="would not be compressed at all .keep-first:100000 keeps every window raw"):
        PosthocAdapter(base, "max-norm+keep-first:100000", window=8, stride=8).check_length(120)
    with pytest.raises(ValueError, match="no window of 8 tokens ends before the last 16"):
        PosthocAdapter(base, "mean", window=8, stride=8).check_length(20)
    PosthocAdapter(base, "mean+keep-first:1", window=8, stride=8).check_length(120)
    PosthocAdapter(base, "select:3+keep-first:100", window=8, stride=8).check_length(120)  # windows 96..104 remain


def test_no_progress_silences_the_libraries_progress_bars(tmp_path, capsys):
    """transformers' "Loading weights" bar (and, by the same switch, its GGUF de-quantizing bar) is off with
    --no-progress and on without it."""
    import io

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    from phasekv.cli import library_bars_off
    from tests.test_evaluate import VOCAB, _tiny_hf

    def gguf_bar() -> str:
        buffer = io.StringIO()
        for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors...", file=buffer):
            pass
        return buffer.getvalue()

    with library_bars_off(True):
        assert gguf_bar() == ""
    assert "de-quantizing" in gguf_bar()  # restored after the block
    hf = _tiny_hf(tmp_path, VOCAB.words)
    stderr = {}
    for quiet in (True, False):
        capsys.readouterr()
        assert main(["eval", "--hf", str(hf), "--records", "32", "--clusters", "2", "--residue-modulus", "8", "--out",
                     str(tmp_path / f"out-{quiet}"), *(["--no-progress"] if quiet else [])]) == 0
        stderr[quiet] = capsys.readouterr().err
    assert stderr[True] == "" and "Loading weights" in stderr[False]
