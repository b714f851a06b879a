"""Checkpoints: `config.json` + `model.safetensors` (+ trainer state), written atomically, loaded
without unpickling anything.

A checkpoint is a directory.  A training run directory holds `checkpoints/step_NNNNNN/` directories
and a `latest` file naming the newest; `load_checkpoint` accepts either a checkpoint directory or a
run directory.  Each checkpoint directory is written under a temporary name and renamed into place,
and `latest` is replaced with os.replace, so a crash at any moment leaves the previous checkpoint
intact and pointed to.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from phasekv.config import ModelConfig
from phasekv.model import PhaseKVForCausalLM, build_model

MODEL_FILE, CONFIG_FILE = "model.safetensors", "config.json"


def write_atomic(path: Path, content: str | bytes) -> None:
    """Write a file under a temporary name, then rename it into place (never half-written)."""
    tmp = path.with_name(path.name + ".tmp")
    if isinstance(content, bytes):
        tmp.write_bytes(content)
    else:
        tmp.write_text(content)
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def _state_dict_for_saving(model: torch.nn.Module, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    out, seen = {}, {}
    for name, tensor in model.state_dict().items():
        key = tensor.data_ptr()
        if key in seen and tensor.shape == seen[key][1]:  # tied weights are stored once
            continue
        seen[key] = (name, tensor.shape)
        out[name] = (tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor).contiguous()
    return out


def save_checkpoint(directory: str | Path, model: torch.nn.Module, experiment: dict[str, Any],
                    extra_tensors: dict[str, dict[str, torch.Tensor]] | None = None,
                    extra_json: dict[str, Any] | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write `directory` atomically: config.json (the whole experiment, `model` section included),
    model.safetensors, and any extra safetensors / JSON files (name -> content)."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(_state_dict_for_saving(model, dtype), str(tmp / MODEL_FILE))
    (tmp / CONFIG_FILE).write_text(json.dumps(experiment, indent=2, sort_keys=True) + "\n")
    for name, tensors in (extra_tensors or {}).items():
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp / name))
    for name, data in (extra_json or {}).items():
        (tmp / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    if directory.exists():
        old = directory.with_name(directory.name + ".old")
        os.replace(directory, old)
        os.replace(tmp, directory)
        shutil.rmtree(old)
    else:
        os.replace(tmp, directory)
    return directory


def resolve(path: str | Path) -> Path:
    """A checkpoint directory from a checkpoint or run directory; clear errors otherwise."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path}: no such file or directory")
    if (path / "latest").is_file():
        name = (path / "latest").read_text().strip()
        path = path / "checkpoints" / name
    if not (path / MODEL_FILE).is_file() or not (path / CONFIG_FILE).is_file():
        raise ValueError(f"checkpoint {path}: expected {CONFIG_FILE} and {MODEL_FILE} (or a run directory "
                         "with a 'latest' file)")
    return path


def read_experiment(path: str | Path) -> dict[str, Any]:
    path = resolve(path)
    try:
        tree = json.loads((path / CONFIG_FILE).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"checkpoint {path}: {CONFIG_FILE} is not valid JSON ({exc.msg})") from None
    if not isinstance(tree, dict) or not isinstance(tree.get("model"), dict):
        raise ValueError(f"checkpoint {path}: {CONFIG_FILE} has no 'model' section")
    return tree


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"checkpoint {path}: unreadable safetensors file ({str(exc).splitlines()[0]}); "
                         "it may be truncated or corrupted") from None


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu",
                    dtype: torch.dtype = torch.float32) -> tuple[PhaseKVForCausalLM, ModelConfig]:
    """(model in eval mode, its ModelConfig) from a checkpoint or run directory."""
    path = resolve(path)
    config = ModelConfig.from_dict(read_experiment(path)["model"])
    model = build_model(config)
    state = load_tensors(path / MODEL_FILE)
    expected = set(_state_dict_for_saving(model, None))
    if set(state) != expected:
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(f"checkpoint {path}: weights do not match the config "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.load_state_dict({k: v.to(torch.float32) for k, v in state.items()}, strict=False)
    return model.to(device=device, dtype=dtype).eval(), config
