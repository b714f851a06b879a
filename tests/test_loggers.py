"""`phasekv train --report-to tensorboard|wandb|trackio` (phasekv.training.report): each logger, read back by its
own file format, holds metrics.jsonl's numbers at metrics.jsonl's steps, the phase check's metrics among them.
The loggers are optional extras that `make real-model` installs: real-part tests (`make test-real` requires them)."""

import importlib.util
import json
import os
import sqlite3
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from phasekv.cli import main
from phasekv.training import report
from tests.helpers import needs_real

REPO = Path(__file__).resolve().parents[1]
# two steps, validation and the phase check at step 2, a row every step: ~10 s on one thread
TRAIN = ["train", str(REPO / "configs" / "cpu" / "w8s8.yaml"), "--no-progress", *[
    a for kv in ("train.steps=2", "train.warmup_steps=1", "train.eval_every=2", "train.log_every=1",
                 "train.batch_size=2", "train.eval_sequences=2", "train.phase_check_prompts=1", "train.threads=1")
    for a in ("--set", kv)]]
CHECKED = ("loss", "lr", "val_loss", "phase/mean_accuracy", "phase/gap_pp", "phase/acc_phase_0")


def installed(package: str):
    return needs_real(importlib.util.find_spec(package) is not None,
                      f"{package} not installed (make real-model installs the {package} extra)")


def logged_rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same_series(rows: list[dict], series: dict[str, list[tuple[int, float]]]) -> None:
    """`series` (metric -> [(step, value)] read back from a logger) holds every row's numbers at its step."""
    for name in CHECKED:
        expected = [(r["step"], r[name]) for r in rows if name in r]
        assert [s for s, _ in series[name]] == [s for s, _ in expected], name
        assert [v for _, v in series[name]] == pytest.approx([v for _, v in expected], rel=1e-6), name
    assert [s for s, _ in series["phase/gap_pp"]] == [r["step"] for r in rows if "val_loss" in r]  # at validation


@installed("tensorboard")
def test_train_reports_loss_and_phase_metrics_to_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert main([*TRAIN, "--out", str(tmp_path / "run"), "--report-to", "tensorboard"]) == 0
    events = EventAccumulator(str(tmp_path / "run" / report.TENSORBOARD_DIR))
    events.Reload()
    series = {name: [(e.step, e.value) for e in events.Scalars(name)] for name in events.Tags()["scalars"]}
    assert_same_series(logged_rows(tmp_path / "run"), series)


def wandb_records(path: Path) -> list[bytes]:
    """The records of a wandb transaction log (run-ID.wandb): a 7-byte file header (":W&B", magic, version), then
    LevelDB-log chunks in 32 KiB blocks, each a 7-byte header (crc32c, length, type: 1 full, 2 first, 3 middle,
    4 last) and its bytes; a block's tail shorter than a header is padding.  A log still being written gives its
    complete records."""
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    records, pos, part = [], 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if pos + 7 + length > len(data):  # a chunk still being written
            break
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(part)
            part = b""
    return records


@installed("wandb")
def test_train_reports_loss_and_phase_metrics_to_wandb_offline_run_files(tmp_path, monkeypatch):
    for var, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": tmp_path / "config",
                       "WANDB_CACHE_DIR": tmp_path / "cache", "WANDB_DATA_DIR": tmp_path / "data"}.items():
        monkeypatch.setenv(var, str(value))
    run = tmp_path / "run"
    assert main([*TRAIN, "--out", str(run), "--report-to", "wandb"]) == 0
    files = list((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1 and files[0].name == f"run-{report.run_name(run)}.wandb"
    assert_same_series(logged_rows(run), wandb_history(files[0]))
    # resumed for one more step: a second offline log of the same run id (`wandb sync` joins them), from step 3
    time.sleep(1)  # the offline directory is named by the second
    assert main([*TRAIN, "--resume", "--set", "train.steps=3", "--out", str(run), "--report-to", "wandb"]) == 0
    (second,) = set((run / "wandb").glob("offline-run-*/run-*.wandb")) - set(files)
    assert second.name == files[0].name and {s for v in wandb_history(second).values() for s, _ in v} == {3}


def wandb_history(path: Path) -> dict[str, list[tuple[int, float]]]:
    """metric -> [(step, value)] of a wandb offline log's history records, once wandb-core has closed it (just
    after finish() returns: its exit record)."""
    from wandb.proto import wandb_internal_pb2

    records = []
    for _ in range(300):
        records = [wandb_internal_pb2.Record.FromString(raw) for raw in wandb_records(path)]
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            break
        time.sleep(0.2)
    series: dict[str, list] = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                series.setdefault(item.key or "/".join(item.nested_key), []).append(
                    (record.history.step.num, json.loads(item.value_json)))
    return series


@installed("trackio")
def test_train_reports_loss_and_phase_metrics_to_a_local_trackio_database(tmp_path):
    # in a process of its own: Trackio reads TRACKIO_DIR once, when it is imported
    run, env = tmp_path / "run", {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio")}
    # trained, then resumed for one more step: the resumed run logs on into the same Trackio run
    for more in ([], ["--resume", "--set", "train.steps=3"]):
        done = subprocess.run([sys.executable, "-m", "phasekv", *TRAIN, *more, "--out", str(run), "--report-to",
                               "trackio"], env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
    with sqlite3.connect(tmp_path / "trackio" / f"{report.TRACKIO_PROJECT}.db") as db:
        logged = db.execute("SELECT step, metrics FROM metrics WHERE run_name = ? ORDER BY step",
                            (report.run_name(run),)).fetchall()
        assert db.execute("SELECT COUNT(DISTINCT run_id) FROM metrics").fetchone() == (1,)
    assert [step for step, _ in logged] == [1, 2, 3]
    series: dict[str, list] = {}
    for step, metrics in logged:
        for name, value in json.loads(metrics).items():
            series.setdefault(name, []).append((step, value))
    assert_same_series(logged_rows(run), series)


@pytest.mark.parametrize("kind", ["tensorboard", "wandb", "trackio"])
def test_a_logger_without_its_package_is_refused_in_one_line(monkeypatch, kind):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == kind else real(name, *a))
    with pytest.raises(ValueError, match=rf"phasekv\[{kind}\]") as info:
        report.open_reporter(Path("unused"), kind)
    assert "\n" not in str(info.value) and type(report.open_reporter(Path("unused"), "none")) is report.Reporter


def test_every_choice_of_train_report_to_has_a_reporter():
    from phasekv.config import REPORT_TO

    assert tuple(report.REPORTERS) == REPORT_TO


def test_only_finite_numbers_are_logged_and_run_names_are_stable_and_distinct(tmp_path):
    row = {"step": 3, "loss": 1.5, "tokens": 7, "done": True, "nan": float("nan"), "name": "x"}
    assert report.scalars(row) == {"loss": 1.5, "tokens": 7}
    a, b = tmp_path / "a" / "run", tmp_path / "b" / "run"
    assert report.run_name(a) == report.run_name(tmp_path / "a" / ".." / "a" / "run") != report.run_name(b)
    assert report.run_name(a).startswith("run-")
