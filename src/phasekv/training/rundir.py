"""The run directory of `phasekv train`: creating it, checkpoints, the latest pointer, resuming and the final model.

    config.json                          the resolved experiment and its vocabulary (written first)
    metrics.jsonl                        one JSON line per logged step
    checkpoints/step_NNNNNN/             model, optimizer and trainer state, gate snapshot
    latest                               the name of the newest complete checkpoint
    gates/step_NNNNNN.safetensors        every checkpoint's compressor parameters, for gate trajectories
    final/                               the model of the last step, in train.save_dtype

Every file is published atomically (`phasekv.outputs`), so a kill at any moment leaves a run that `--resume`
continues: from the checkpoint `latest` names, else (the pointer lost, or its checkpoint unreadable) from the
newest readable kept one; a run killed before its first checkpoint starts again from step 0.  The training loop
(`phasekv.training.loop`) calls `open_run` once, `save_step` every checkpoint and `ensure_final` at the end.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from phasekv import families
from phasekv.checkpoint import CONFIG_FILE, MODEL_FILE, latest_checkpoint, load_tensors, load_weights, save_checkpoint
from phasekv.compression import compressor_parameters
from phasekv.config import Experiment, TrainConfig, parse_json
from phasekv.outputs import append_jsonl, recover, write_atomic, write_json

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"


def gate_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every compressor parameter (gates, biases, payload maps): the gate-trajectory snapshot."""
    return {n: p.detach().clone().cpu() for n, p in compressor_parameters(families.unwrap(model)).items()}


# ----------------------------------------------------------------------------- creating and reopening


def open_run(run: Path, exp: Experiment, *, tree: dict[str, Any], resume: bool, dd, model,
             optimizer: torch.optim.Optimizer) -> int:
    """Create or reopen the run directory; the step to start from.  `tree` is the config.json content; `dd` the
    process's place in the job (`phasekv.distributed.Dist`)."""
    # a lost `latest` pointer never restarts a run that has checkpoints: resume from the newest readable one
    if resume and ((run / "latest").is_file() or kept_checkpoints(run)):
        check_resume_config(run, exp)
        start = _load_resume_point(run, model, optimizer)
        if dd.main:
            _truncate_metrics(run / METRICS_FILE, start)
            log.info("resumed %s at step %d", run, start)
            write_json(run / CONFIG_FILE, tree, atomic=True)  # records the train fields changed on resume
        return start
    # rank 0 checks and creates the run directory; every rank stops on its verdict (no rank is left
    # waiting in a collective for a rank 0 that has given up)
    problem = None
    if dd.main:
        try:
            _create_run(run, exp, tree, resume)
        except ValueError as exc:
            problem = str(exc)
    problem = dd.broadcast_object(problem)
    if problem:
        raise ValueError(problem)
    return 0


def _create_run(run: Path, exp: Experiment, tree: dict[str, Any], resume: bool) -> None:
    """A new run directory.  config.json is written before anything else, so `--resume` can tell a
    run killed before its first checkpoint (config.json, no `latest`: it starts again from step 0)
    from a foreign directory."""
    if (run / "latest").exists():
        raise ValueError(f"--out {run}: already holds a run; pass --resume to continue it or choose a new dir")
    if resume and (run / CONFIG_FILE).is_file():
        check_resume_config(run, exp)
        log.warning("--resume %s: the run has no checkpoint yet; starting it again from step 0", run)
    elif run.exists() and (not run.is_dir() or any(not (resume and p.name.endswith(".tmp")) for p in run.iterdir())):
        raise ValueError(f"--out {run}: exists and is not an empty directory (and holds no checkpoint); "
                         "choose a new directory")
    run.mkdir(parents=True, exist_ok=True)
    write_json(run / CONFIG_FILE, tree, atomic=True)
    write_atomic(run / METRICS_FILE, "")


def check_resume_config(run: Path, exp: Experiment) -> None:
    """The resolved experiment must match the run's: model and data exactly, train except the fields
    that may change on resume (TrainConfig.RESUMABLE)."""
    saved = parse_json((run / CONFIG_FILE).read_text(errors="replace"), f"run {run}: {CONFIG_FILE}")
    if not isinstance(saved, dict):
        raise ValueError(f"run {run}: {CONFIG_FILE} is not a mapping")
    saved = Experiment.from_tree({k: v for k, v in saved.items() if k != "vocab"}).tree  # resolved like exp
    for section in ("model", "data", "train"):
        old, new = _leaves(saved.get(section, {}), section), _leaves(exp.tree[section], section)
        for key in sorted(set(old) | set(new)):
            if section == "train" and key[len("train."):] in TrainConfig.RESUMABLE:
                continue
            if old.get(key) != new.get(key):
                parts = key.split(".")  # model.compressors.NAME.OPTION is usually set as model.OPTION
                name = f"{key} (set as model.{parts[3]})" if parts[1:2] == ["compressors"] else key
                raise ValueError(f"--resume: {name} is {new.get(key)!r} but the run was trained with "
                                 f"{old.get(key)!r}; only train.{', train.'.join(TrainConfig.RESUMABLE)} may change")


def _leaves(tree: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Nested config sections as {"a.b.c": value}, so a difference is named down to its field."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_leaves(value, f"{prefix}.{key}"))
        else:
            out[f"{prefix}.{key}"] = value
    return out


# ----------------------------------------------------------------------------- checkpoints and the latest pointer


def save_step(run: Path, step: int, model, optimizer: torch.optim.Optimizer, *, tree: dict[str, Any],
              keep: int) -> None:
    """Checkpoint `step` (model, optimizer, trainer state, gate snapshot), point `latest` at it and prune the
    kept checkpoints to the newest `keep`."""
    name = f"step_{step:06d}"
    gates = gate_parameters(model)
    opt_tensors, opt_meta = _optimizer_to_tensors(optimizer)
    save_checkpoint(run / "checkpoints" / name, model, tree,
                    extra_tensors={"optimizer.safetensors": opt_tensors, **({"gates.safetensors": gates}
                                                                              if gates else {})},
                    extra_json={"trainer_state.json": {"step": step, "optimizer": opt_meta}})
    if gates:
        (run / "gates").mkdir(exist_ok=True)
        write_atomic(run / "gates" / f"{name}.safetensors",
                     (run / "checkpoints" / name / "gates.safetensors").read_bytes())
    write_atomic(run / "latest", name + "\n")
    for old in kept_checkpoints(run)[:-keep]:
        # renamed out of the kept set first, so a kill while deleting never leaves a half checkpoint
        # that resume could fall back to
        os.replace(old, old.with_name(old.name + ".deleting"))
    for trash in (run / "checkpoints").glob("step_*.deleting"):  # this save's, and any a kill left
        shutil.rmtree(trash)


def kept_checkpoints(run: Path) -> list[Path]:
    """Complete checkpoint directories of a run, oldest first."""
    folder = run / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and p.name.startswith("step_")
                  and p.name[5:].isdigit())


def latest_name(run: Path) -> str:
    """The checkpoint `latest` names, or "none" (for messages)."""
    return (run / "latest").read_text().strip() if (run / "latest").exists() else "none"


def _optimizer_to_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    state = optimizer.state_dict()
    tensors, meta = {}, {"param_groups": state["param_groups"], "scalars": {}}
    for pid, s in state["state"].items():
        for key, value in s.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{pid}.{key}"] = value
            else:
                meta["scalars"][f"{pid}.{key}"] = value
    return tensors, meta


def _optimizer_from_tensors(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    for name, value in meta["scalars"].items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def _read_state(ck: Path) -> dict[str, Any]:
    """A checkpoint's trainer state, fully validated (nothing is changed before this succeeds)."""
    state = parse_json((ck / "trainer_state.json").read_text(errors="replace"), f"checkpoint {ck}: trainer_state.json")
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or isinstance(state["step"], bool) \
            or state["step"] < 0 or not isinstance(state.get("optimizer"), dict):
        raise ValueError(f"checkpoint {ck}: trainer_state.json needs an integer 'step' >= 0 and an 'optimizer' "
                         "mapping")
    return state


def _load_resume_point(run: Path, model, optimizer: torch.optim.Optimizer) -> int:
    """Load the newest readable checkpoint of `run` into model and optimizer; its step.  An unreadable
    newest checkpoint falls back to the previous kept one, with a warning."""
    newest = latest_checkpoint(run) if (run / "latest").is_file() else None  # the pointer may be lost
    candidates = ([newest] if newest else []) + [p for p in reversed(kept_checkpoints(run)) if p != newest]
    errors = []
    for ck in candidates:
        try:
            state = _read_state(ck)
            weights = load_tensors(ck / MODEL_FILE)
            opt = load_tensors(ck / "optimizer.safetensors")
            load_weights(model, weights, ck)
            _optimizer_from_tensors(optimizer, opt, state["optimizer"])
        except (ValueError, OSError, KeyError) as exc:
            errors.append(f"{ck.name}: {exc}")
            continue
        if errors:  # warn only when a fallback succeeded; a total failure is the one error line below
            log.warning("resuming from %s: newer checkpoints were unreadable (%s)", ck.name, "; ".join(errors)[:300])
        return state["step"]
    raise ValueError(f"--resume {run}: no readable checkpoint ({'; '.join(errors)[:300]})")


# ----------------------------------------------------------------------------- the final model


def write_final(run: Path, model, tree: dict[str, Any], dtype: torch.dtype) -> None:
    save_checkpoint(run / "final", model, tree, dtype=dtype)


def ensure_final(run: Path, model, tree: dict[str, Any], dtype: torch.dtype) -> None:
    """A run that reached its last step always ends with the final/ of that step: a kill between the
    last checkpoint and final/, or while final/ was replaced, is repaired here on --resume; so is a
    final/ left by an earlier, shorter run (resumed with a larger train.steps)."""
    final = run / "final"
    recover(final)
    try:
        current = (final / MODEL_FILE).is_file() and json.loads((final / CONFIG_FILE).read_text()) == \
            json.loads(json.dumps(tree))
    except (OSError, ValueError):
        current = False
    if not current:
        write_final(run, model, tree, dtype)


# ----------------------------------------------------------------------------- metrics


def append_metrics(run: Path, row: dict[str, Any]) -> None:
    append_jsonl(run / METRICS_FILE, row)


def _truncate_metrics(path: Path, step: int) -> None:
    """Keep the metrics rows of steps <= `step`; a torn (half-written) line is dropped with a warning."""
    if not path.exists():
        return
    rows = []
    for i, line in enumerate(path.read_text(errors="replace").splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            keep = row["step"] <= step
        except (json.JSONDecodeError, KeyError, TypeError):
            log.warning("%s: line %d is torn or malformed; dropped", path, i + 1)
            continue
        if keep:
            rows.append(line)
    write_atomic(path, "".join(r + "\n" for r in rows))


def read_metrics(run: str | Path) -> list[dict[str, Any]]:
    """The rows of a run's metrics.jsonl (a torn last line of a killed run is skipped)."""
    path = Path(run) / METRICS_FILE
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line of a killed run
    return rows
