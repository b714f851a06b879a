"""phasekv.families: the seam between the two model families (phasekv's own models and transformers' classes)
and the trainer, checkpoints, evaluation and probes.  (transformers' sparse-attention architectures end to end:
test_realarch.py.)"""

import json
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import phasekv
from phasekv import ModelConfig, build_model, families
from phasekv.checkpoint import load_weights, save_checkpoint
from phasekv.config import Experiment, TransformersModelConfig, model_config_from_dict
from tests.helpers import tiny

QWEN3 = {"model_type": "qwen3", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "attention_bias": False,
         "use_sliding_window": False}
SAME_AS_QWEN3 = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


def test_transformers_model_sections_are_validated_by_name():
    assert isinstance(model_config_from_dict(QWEN3), TransformersModelConfig)
    with pytest.raises(ValueError, match="model.hiden_size: not a field of transformers' Qwen3Config"):
        model_config_from_dict({**QWEN3, "hiden_size": 3})
    with pytest.raises(ValueError, match="model.model_type: transformers has no model type 'qwen99'"):
        model_config_from_dict({**QWEN3, "model_type": "qwen99"})
    assert isinstance(model_config_from_dict({**SAME_AS_QWEN3, "model_type": "phasekv"}), ModelConfig)


def test_both_families_build_and_give_logits_through_one_call():
    """transformers' Qwen3ForCausalLM and a phasekv full-attention model with the same weights are one function."""
    torch.manual_seed(0)
    hf = families.build(model_config_from_dict(QWEN3)).eval()
    own = families.build(ModelConfig(**SAME_AS_QWEN3)).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM" and isinstance(own, phasekv.PhaseKVForCausalLM)
    assert (families.family_name(hf), families.family_name(own)) == ("transformers", "phasekv")
    load_weights(own, dict(hf.state_dict()), "hf")
    ids = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        a, b = families.logits(hf, ids), families.logits(own, ids)
    assert a.shape == (2, 40, 256)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert families.compression_geometry(hf) is None and families.compression_geometry(own) is None


def test_weight_bytes_are_counted_exactly_without_allocating():
    config = tiny(compressor="gated", window=4, stride=4)
    model = build_model(config)
    values = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    assert families.weight_bytes(config) == 4 * values
    assert families.weight_bytes(config, bytes_per_value=2) == 2 * values
    families.check_fits(config, copies=4, available=16 * values)
    refused = r"^model \(its weights x 4\): needs about [\d.]+ GiB, only [\d.]+ GiB of memory is available; use smaller"
    with pytest.raises(ValueError, match=refused):
        families.check_fits(config, copies=4, available=16 * values - 1)


def _transformers_like(**config) -> nn.Module:
    model = nn.Module()
    model.config = SimpleNamespace(**config)
    return model


@pytest.mark.parametrize("config, geometry", [
    (dict(model_type="deepseek_v4",
          layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                       "compressed_sparse_attention"],
          compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}),
     {"compressor": "deepseek_v4_csa", "window": 8, "stride": 4, "compressed_layers": [1, 3]}),
    (dict(model_type="deepseek_v4", layer_types=["heavily_compressed_attention"] * 2,
          compress_rates={"heavily_compressed_attention": 8}),
     {"compressor": "deepseek_v4_hca", "window": 8, "stride": 8, "compressed_layers": [0, 1]}),
    (dict(model_type="glm5_next_text", layer_types=["linear_attention", "indexed_attention"], index_kpool=4),
     {"compressor": "glm5_kpool_indexer", "window": 4, "stride": 4, "compressed_layers": [1]}),
    (dict(model_type="glm5_next_text", layer_types=["indexed_attention"], index_kpool=1), None),  # token-level
    (dict(layer_types=["heavily_compressed_attention"], compress_rates={"heavily_compressed_attention": 8}),
     None),  # the architecture comes from the model type: a dense model's config names no compression
    (dict(model_type="qwen3", layer_types=["full_attention"]), None),
])
def test_compression_geometry_is_read_from_a_transformers_config(config, geometry):
    assert families.compression_geometry(_transformers_like(**config)) == geometry


@pytest.mark.slow
def test_qwen3_from_transformers_trains_and_evaluates_like_the_same_phasekv_model(tmp_path):
    """`phasekv train` trains transformers' Qwen3ForCausalLM; `phasekv eval --checkpoint` evaluates it;
    a phasekv full-attention model with the same weights is the same function and gets the same metrics."""
    from phasekv.cli import main
    from phasekv.training.loop import train
    from tests.test_train import TINY

    tree = {**TINY, "model": QWEN3, "train": {**TINY["train"], "steps": 4, "checkpoint_every": 4}}
    train(Experiment.from_tree(tree), tmp_path / "run", progress=False)
    hf_model, hf_config = phasekv.load_checkpoint(tmp_path / "run")
    assert type(hf_model).__name__ == "Qwen3ForCausalLM"
    same = build_model(ModelConfig(**SAME_AS_QWEN3, local_window=TINY["model"]["local_window"]))
    load_weights(same, {k: v for k, v in hf_model.state_dict().items()}, "hf")
    ids = torch.randint(0, 256, (2, 50))
    with torch.no_grad():
        torch.testing.assert_close(same(ids), hf_model(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    tree_json = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    save_checkpoint(tmp_path / "same", same, {**tree_json, "model": same.config.to_dict()})
    flags = ["--clusters", "2", "--records", "24", "--demos", "4", "--no-progress", "--seed", "3"]
    assert main(["eval", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf_eval"), *flags]) == 0
    assert main(["eval", "--checkpoint", str(tmp_path / "same"), "--out", str(tmp_path / "pk_eval"), *flags]) == 0
    a, b = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("hf_eval", "pk_eval"))
    assert a["per_residue"] == b["per_residue"] and a["n_prompts"] == b["n_prompts"] > 0
    preds = [(tmp_path / d / "predictions.jsonl").read_text() for d in ("hf_eval", "pk_eval")]
    assert preds[0] == preds[1]
