"""Where a training run's metrics go besides metrics.jsonl (`train.report_to`), one small class per logger behind
`Reporter` (which logs nothing, `none`), each an optional extra:

  tensorboard  an event file in RUN/tensorboard, through torch.utils.tensorboard (`phasekv[tensorboard]`)
  wandb        a Weights & Biases run in RUN/wandb, under wandb's own settings: WANDB_MODE=offline keeps it in
               local run files (`wandb sync` uploads them later) (`phasekv[wandb]`)
  trackio      a Trackio run in project `phasekv`, in Trackio's local database (TRACKIO_DIR, by default
               ~/.cache/huggingface/trackio; `trackio show` opens it) (`phasekv[trackio]`)

Every numeric field of a metrics row becomes a scalar at the row's step (the loss, the learning rate, validation,
and the phase check's `phase/...` metrics).  A resumed run logs on into the same wandb / Trackio run (its id and
name come from the run directory)."""

from __future__ import annotations

import hashlib
import importlib.util
import math
from pathlib import Path
from typing import Any

TENSORBOARD_DIR = "tensorboard"
TRACKIO_PROJECT = "phasekv"


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """A metrics row's finite numbers, without its step."""
    return {name: value for name, value in row.items()
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


def run_name(run: Path) -> str:
    """The logger's run name: the run directory's name and a short hash of its full path (stable across resumes,
    distinct for two runs of the same name)."""
    path = str(Path(run).resolve())
    return f"{Path(path).name}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"


class Reporter:
    """Logs metrics rows (this base: nowhere, `none`)."""

    package: str | None = None  # the package the logger needs

    def log(self, row: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardReporter(Reporter):
    package = "tensorboard"  # torch.utils.tensorboard imports it

    def __init__(self, run: Path, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(run) / TENSORBOARD_DIR))

    def log(self, row):
        for name, value in scalars(row).items():
            self.writer.add_scalar(name, value, row["step"])
        self.writer.flush()

    def close(self):
        self.writer.close()


class WandbReporter(Reporter):
    package = "wandb"

    def __init__(self, run: Path, config: dict):
        import wandb

        name = run_name(run)
        self.run = wandb.init(project=TRACKIO_PROJECT, name=name, id=name, resume="allow", dir=str(run),
                              config=config)

    def log(self, row):
        self.run.log(scalars(row), step=row["step"])

    def close(self):
        self.run.finish()


class TrackioReporter(Reporter):
    package = "trackio"

    def __init__(self, run: Path, config: dict):
        import trackio

        self.trackio = trackio
        self.run = trackio.init(project=TRACKIO_PROJECT, name=run_name(run), config=config, resume="allow",
                                embed=False, auto_log_cpu=False, auto_log_gpu=False)

    def log(self, row):
        self.trackio.log(scalars(row), step=row["step"])

    def close(self):
        self.trackio.finish()


REPORTERS: dict[str, type[Reporter]] = {"none": Reporter, "tensorboard": TensorBoardReporter,
                                        "wandb": WandbReporter, "trackio": TrackioReporter}  # = config's REPORT_TO


def check_report_to(kind: str) -> None:
    """Refuse, before training starts, a logger whose package is not installed (one line)."""
    package = REPORTERS[kind].package
    if package is not None and importlib.util.find_spec(package) is None:
        raise ValueError(f"train.report_to {kind}: needs the {package} package (pip install 'phasekv[{kind}]')")


def open_reporter(run: Path, kind: str, config: dict | None = None) -> Reporter:
    """The reporter `train.report_to` names, writing under the run directory `run`; `config`: the run's resolved
    config, recorded with the run where the logger keeps one (wandb, Trackio)."""
    check_report_to(kind)
    return Reporter() if kind == "none" else REPORTERS[kind](Path(run), config or {})
