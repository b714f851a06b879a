"""Where a training run's metrics go besides metrics.jsonl (`train.report_to`): `none`, or `tensorboard`, an event
file in RUN/tensorboard that TensorBoard (and transformers' or torchtitan's users' dashboards) read, through
torch.utils.tensorboard (the `tensorboard` extra).  Every numeric field of a metrics row becomes a scalar at the
row's step (the loss, the learning rate, validation, and the phase check's `phase/...` metrics)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

TENSORBOARD_DIR = "tensorboard"


class Reporter:
    """Logs metrics rows; `none` logs nothing."""

    def __init__(self, writer=None):
        self.writer = writer

    def log(self, row: dict[str, Any]) -> None:
        if self.writer is None:
            return
        for name, value in row.items():
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value):
                self.writer.add_scalar(name, value, row["step"])
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def check_report_to(kind: str) -> None:
    """Refuse, before training starts, a logger whose package is not installed (one line)."""
    if kind == "tensorboard" and importlib.util.find_spec("tensorboard") is None:  # torch.utils.tensorboard needs it
        raise ValueError("train.report_to tensorboard: needs the tensorboard package (pip install "
                         "'phasekv[tensorboard]')")


def open_reporter(run: Path, kind: str) -> Reporter:
    """The reporter `train.report_to` names, writing under the run directory `run`."""
    check_report_to(kind)
    if kind == "none":
        return Reporter()
    from torch.utils.tensorboard import SummaryWriter

    return Reporter(SummaryWriter(log_dir=str(Path(run) / TENSORBOARD_DIR)))
