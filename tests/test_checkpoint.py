"""phasekv.checkpoint: a checkpoint is config.json + model.safetensors, saved atomically, loaded strictly and
without unpickling, from a checkpoint directory or a run directory.  (Damaged files through the CLI:
test_fuzz.py; kills during a save: test_reliability.py.)"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import phasekv
from phasekv import ModelConfig, build_model, families
from phasekv.checkpoint import load_weights, read_experiment, resolve, save_checkpoint
from phasekv.config import TransformersModelConfig
from tests.helpers import tiny

CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"


def _saved(tmp_path: Path, **overrides) -> tuple[torch.nn.Module, Path]:
    torch.manual_seed(0)
    config = tiny(compressor="gated", window=4, stride=4, **overrides)
    model = build_model(config).eval()
    return model, save_checkpoint(tmp_path / "ck", model, {"model": config.to_dict(), "notes": "n"})


def test_save_and_load_give_the_same_function(tmp_path):
    model, path = _saved(tmp_path)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    assert not list(tmp_path.glob("*.tmp")) and not list(tmp_path.glob("*.old"))
    loaded, config = phasekv.load_checkpoint(path)
    assert config == model.config and not loaded.training
    ids = torch.randint(0, config.vocab_size, (2, 30))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))
    assert read_experiment(path)["notes"] == "n"


def test_tied_weights_are_stored_once_and_tied_again_on_load(tmp_path):
    model, path = _saved(tmp_path, tie_word_embeddings=True)
    stored = load_file(str(path / "model.safetensors"))
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored
    loaded, _ = phasekv.load_checkpoint(path)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_a_half_precision_checkpoint_loads_as_float32(tmp_path):
    torch.manual_seed(0)
    model = build_model(tiny())
    path = save_checkpoint(tmp_path / "half", model, {"model": model.config.to_dict()}, dtype=torch.float16)
    assert {t.dtype for t in load_file(str(path / "model.safetensors")).values()} == {torch.float16}
    loaded, _ = phasekv.load_checkpoint(path)
    weight = loaded.model.embed_tokens.weight
    assert weight.dtype == torch.float32
    assert torch.equal(weight, model.model.embed_tokens.weight.half().float())


def test_extra_files_are_written_beside_and_a_save_replaces_the_old_directory(tmp_path):
    model, path = _saved(tmp_path)
    save_checkpoint(path, model, {"model": model.config.to_dict(), "notes": "second"},
                    extra_tensors={"gates.safetensors": {"g": torch.ones(2)}}, extra_json={"state.json": {"step": 3}})
    assert read_experiment(path)["notes"] == "second"
    assert json.loads((path / "state.json").read_text()) == {"step": 3}
    assert torch.equal(load_file(str(path / "gates.safetensors"))["g"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temporary or old copy is left


def test_a_run_directory_resolves_to_its_latest_checkpoint(tmp_path):
    model, _ = _saved(tmp_path)
    run = tmp_path / "run"
    for step in (2, 4):
        save_checkpoint(run / "checkpoints" / f"step_{step:06d}", model, {"model": model.config.to_dict()})
    (run / "latest").write_text("step_000002\n")
    assert resolve(run) == run / "checkpoints" / "step_000002"
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        resolve(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="expected config.json and model.safetensors"):
        resolve(tmp_path / "empty")


def test_weights_must_match_the_config_by_name_shape_and_finiteness(tmp_path):
    model, path = _saved(tmp_path)
    state = load_file(str(path / "model.safetensors"))
    fresh = build_model(model.config)
    with pytest.raises(ValueError, match=r"missing \['model.norm.weight'\], unexpected \[\]"):
        load_weights(fresh, {k: v for k, v in state.items() if k != "model.norm.weight"}, "here")
    with pytest.raises(ValueError, match="weight model.norm.weight has shape \\(3,\\), the config needs \\(32,\\)"):
        load_weights(fresh, {**state, "model.norm.weight": torch.ones(3)}, "here")
    with pytest.raises(ValueError, match="model.norm.weight holds non-finite values"):
        load_weights(fresh, {**state, "model.norm.weight": torch.full((32,), float("nan"))}, "here")
    save_file({**state, "extra": torch.ones(1)}, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"unexpected \['extra'\]"):
        phasekv.load_checkpoint(path)


def test_every_bundled_checkpoint_loads_through_the_public_function():
    found = sorted(p for p in CHECKPOINTS.iterdir() if (p / "model.safetensors").is_file())
    assert len(found) >= 8
    for path in found:
        model, config = phasekv.load_checkpoint(path)
        assert isinstance(config, ModelConfig | TransformersModelConfig) and not model.training
        ids = torch.randint(0, config.vocab_size, (1, 40))
        with torch.no_grad():
            assert torch.isfinite(families.logits(model, ids)).all()


def test_eval_opens_a_checkpoint_once(monkeypatch):
    """From the flags of `phasekv eval --checkpoint` to the adapter and its prompt set, config.json is read once: the
    settings (its eval section), the in-distribution defaults and the weights' config all come from that read."""
    from phasekv.cli import build_parser
    from phasekv.cli.flags import source_and_config
    from phasekv.evaluate.sources import open_source

    reads = []
    read_text = Path.read_text

    def counted(path, *args, **kwargs):
        if path.name == "config.json":
            reads.append(path)
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counted)
    args = build_parser().parse_args(["eval", "--checkpoint", str(CHECKPOINTS / "w8s8"), "--out", "unused",
                                      "--residue-modulus", "8", "--clusters", "2"])
    adapter, eval_set = open_source(*source_and_config(args))
    assert eval_set.prompts() and adapter.info.stride == 8
    assert reads == [CHECKPOINTS / "w8s8" / "config.json"]
