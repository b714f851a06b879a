"""Every preset in configs/ loads, validates and builds; the paper scale is Qwen3-0.6B-sized."""

from pathlib import Path

import pytest
import torch

from phasekv import ModelConfig, build_model
from phasekv.config import Experiment, load_yaml

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
SWEEP = {"full-1kv", "full-8kv", "w8s8", "w8s4", "w8s6", "w4s4", "w12s12", "w8s8-2kv", "w8s8-4kv", "w8s8-8kv",
         "w8s8-vector", "w8s8-tied", "w8s8-nobias", "w8s8-noqknorm", "w8s8-norope", "w8s8-partrope", "w8s8-tail",
         "w8s8-uniform", "w8s8-postnorm", "deepseek-style", "deepseek-style-scalar", "deepseek-csa",
         "w8s8-stagger"}  # the last one goes beyond the paper: staggered window offsets per layer


# cpu only: full attention with twice the steps (it learns the task slowly at this scale), and the 4-KV-head family
# that gives the cpu scale enough compressor heads for graded curves (plus the one-token-overlap fix, W9/S8)
CPU_EXTRA = {"full-1kv-long", "full-4kv", "w8s4-4kv", "w12s12-4kv", "w8s8-uniform-4kv", "w8s8-shared-4kv", "w9s8-4kv",
             "dsv4-hca", "dsv4-csa", "dsv32-dsa", "qwen3-full", "glm5-kpool", "glm5-kpool-dsa",  # transformers family
             "glm5-kpool-induction",  # issue 26: GLM-5.3 under the token-attention recipe
             "w8s8-4kv-jitter",  # issue 15: random window offset per training step
             "w8s8-4kv-headstagger", "w8s8-4kv-headstagger-layer",  # issue 15: staggered KV heads (and layers)
             "slices-contiguous-4kv", "slices-interleaved-4kv",  # issue 40: head-partitioned attention, trained
             "minimax-m3",  # issue 39: MiniMax-M3 block-sparse attention (transformers family)
             "w9s8-4kv-gaps",  # issue 40: W9/S8 trained with fillers between records (a fix under both paddings)
             "w8s8-4kv-gaps",  # issue 40: its control, W8/S8 trained the same way
             "dsv41-csa2",  # issue 53: DeepSeek-V4.1's CSA2 schedule in phasekv's own model
             "w8s8-4kv-long"}  # issue 51: w8s8-4kv warm-started at 4,096 tokens (the long-context audit's subject)


@pytest.mark.parametrize("scale, extra", [("cpu", CPU_EXTRA), ("paper", set())])
def test_every_sweep_variant_has_a_preset(scale, extra):
    assert {p.stem for p in (CONFIGS / scale).glob("*.yaml")} == SWEEP | extra


@pytest.mark.parametrize("path", sorted((CONFIGS / "cpu").glob("*.yaml")), ids=lambda p: p.stem)
def test_cpu_presets_build_and_run(path):
    from phasekv import families

    exp = Experiment.from_file(path)
    section = load_yaml(path)["model"]
    if "model_type" in section:  # a transformers-family model, built by transformers' own class
        model = families.build(exp.model)
        # a text model shipped only inside a multimodal class (GLM-5.3) gets phasekv's linear LM head around it
        backbone = model.model if type(model).__module__ == "phasekv.hf.textlm" else model
        assert type(backbone).__module__.startswith("transformers.models." + section["model_type"].split("_text")[0])
    else:
        assert ModelConfig(**section) == exp.model
        model = build_model(exp.model)
    with torch.no_grad():
        assert families.logits(model, torch.zeros(1, 40, dtype=torch.long)).shape == (1, 40, exp.model.vocab_size)


@pytest.mark.parametrize("path", sorted((CONFIGS / "paper").glob("*.yaml")), ids=lambda p: p.stem)
def test_paper_presets_are_qwen3_06b_geometry(path):
    exp = Experiment.from_file(path)
    with torch.device("meta"):
        model = build_model(exp.model)
    n_backbone = sum(p.numel() for n, p in model.named_parameters() if ".compressor." not in n and "sink" not in n)
    kv = exp.model.num_key_value_heads
    # Qwen3-0.6B has 596.0M parameters with 8 KV heads; each KV head fewer removes 28 * 2 * 1024 * 128,
    # and dropping the q/k norms removes 28 * 2 * 128
    expected = 596_049_920 - (8 - kv) * 28 * 2 * 1024 * 128 - (0 if exp.model.qk_norm else 28 * 2 * 128)
    assert n_backbone == expected


@pytest.mark.parametrize("path", sorted((CONFIGS / "transformers").glob("*.yaml")), ids=lambda p: p.stem)
def test_transformers_presets_build_and_run(path):
    from phasekv import families

    exp = Experiment.from_file(path)
    model = families.build(exp.model)
    with torch.no_grad():
        assert families.logits(model, torch.zeros(1, 40, dtype=torch.long)).shape == (1, 40, exp.model.vocab_size)
