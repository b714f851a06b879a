"""Checkpoints: `config.json` + `model.safetensors` (+ trainer state), written atomically, loaded
without unpickling anything.

Any model family (`phasekv.families`) saves and loads the same way; the `model` section of
config.json says which family and config to rebuild.  A checkpoint is a directory.  A training run
directory holds `checkpoints/step_NNNNNN/` directories and a `latest` file naming the newest;
`load_checkpoint` accepts either a checkpoint directory or a run directory.  Each checkpoint
directory is written under a temporary name, flushed and renamed into place, and `latest` is
replaced with os.replace, so a crash at any moment leaves the previous checkpoint intact and
pointed to.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from phasekv import families
from phasekv.config import ModelConfig, TransformersModelConfig, model_config_from_dict, parse_json
from phasekv.outputs import fsync_tree, publish, write_json

MODEL_FILE, CONFIG_FILE = "model.safetensors", "config.json"


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
    write_json(tmp / CONFIG_FILE, experiment)
    for name, tensors in (extra_tensors or {}).items():
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp / name))
    for name, data in (extra_json or {}).items():
        write_json(tmp / name, data)
    fsync_tree(tmp)
    publish(tmp, directory)
    return directory


def resolve(path: str | Path) -> Path:
    """A checkpoint directory from a checkpoint or run directory; clear errors otherwise."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path}: no such file or directory")
    if (path / "latest").is_file():
        path = latest_checkpoint(path)
    if not (path / MODEL_FILE).is_file() or not (path / CONFIG_FILE).is_file():
        raise ValueError(f"checkpoint {path}: expected {CONFIG_FILE} and {MODEL_FILE} (or a run directory "
                         "with a 'latest' file)")
    return path


def latest_checkpoint(run: Path) -> Path:
    """The checkpoint directory a run's `latest` file names (never a path outside run/checkpoints)."""
    name = (run / "latest").read_text(errors="replace").strip()
    if not name.startswith("step_") or not name[5:].isdigit():
        raise ValueError(f"run {run}: 'latest' names {name[:40]!r}, not a checkpoint step_NNNNNN")
    return run / "checkpoints" / name


def read_experiment(path: str | Path) -> dict[str, Any]:
    path = resolve(path)
    try:
        text = (path / CONFIG_FILE).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"checkpoint {path}: {CONFIG_FILE} is unreadable ({exc})") from None
    tree = parse_json(text, f"checkpoint {path}: {CONFIG_FILE}")
    if not isinstance(tree, dict) or not isinstance(tree.get("model"), dict):
        raise ValueError(f"checkpoint {path}: {CONFIG_FILE} has no 'model' section")
    return tree


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise ValueError(f"checkpoint {path}: unreadable safetensors file ({str(exc).splitlines()[0]}); "
                         "it may be truncated or corrupted") from None


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], where: str | Path) -> None:
    """Load `state` into `model` strictly: the same names (tied weights stored once), shapes and kind of dtype
    (floating point where the model has it), and finite values only (a NaN weight would make every later number
    meaningless)."""
    expected = _state_dict_for_saving(model, None)
    if set(state) != set(expected):
        missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        raise ValueError(f"checkpoint {where}: weights do not match the config "
                         f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise ValueError(f"checkpoint {where}: weight {name} has shape {tuple(tensor.shape)}, the config "
                             f"needs {tuple(expected[name].shape)}")
        if tensor.is_floating_point() != expected[name].is_floating_point():  # e.g. int32 weights: not a model
            raise ValueError(f"checkpoint {where}: weight {name} is stored as {tensor.dtype}, the model needs "
                             f"{expected[name].dtype}; the file does not hold this model's weights")
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise ValueError(f"checkpoint {where}: weight {name} holds non-finite values (NaN or inf); the "
                             "checkpoint is corrupted or its training diverged")
    dtype = next(iter(expected.values())).dtype if expected else torch.float32
    # strict=False only for the tied aliases _state_dict_for_saving leaves out (checked above)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)


def load_checkpoint(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                    tree: dict[str, Any] | None = None
                    ) -> tuple[torch.nn.Module, ModelConfig | TransformersModelConfig]:
    """(model in eval mode, its config) from a checkpoint or run directory, of either model family; `tree`: the
    checkpoint's config.json when the caller has read it already (one read per checkpoint)."""
    path = resolve(path)
    config = model_config_from_dict((read_experiment(path) if tree is None else tree)["model"])
    model = families.build(config)
    load_weights(model, load_tensors(path / MODEL_FILE), path)
    return model.to(device=device, dtype=dtype).eval(), config
