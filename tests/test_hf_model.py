"""phasekv models through transformers' Auto classes: the bundled checkpoints as they are, save_pretrained /
from_pretrained round trips, generate() with the compressed cache, lm-eval's HFLM on a phasekv model, and a
registration that costs `import phasekv` nothing."""

import json
import subprocess
import sys

import pytest
import torch

import phasekv
from phasekv.cache import KVCache
from phasekv.checkpoint import read_experiment
from phasekv.config import model_config_from_dict
from phasekv.hf.config import PhaseKVConfig
from phasekv.hf.model import HFPhaseKVForCausalLM
from tests.helpers import bpe_tokenizer, tiny
from tests.test_checkpoint import CHECKPOINTS

transformers = pytest.importorskip("transformers")


def _tiny_hf(**overrides) -> HFPhaseKVForCausalLM:
    """A random compressed model (W8/S8, 16-token local window) whose weights are large enough to vary its guesses."""
    torch.manual_seed(0)
    config = tiny(compressor="gated", window=8, stride=8, local_window=16, initializer_range=0.2, **overrides)
    return HFPhaseKVForCausalLM(PhaseKVConfig(model=config.to_dict())).eval()


def test_bundled_checkpoints_load_through_auto_classes_with_phasekv_logits():
    found = sorted(p for p in CHECKPOINTS.iterdir() if (p / "model.safetensors").is_file()
                   and "model_type" not in read_experiment(p)["model"])  # phasekv-family checkpoints only
    assert len(found) >= 8
    ids = torch.randint(0, 256, (2, 120), generator=torch.Generator().manual_seed(0))
    for path in found:
        config = transformers.AutoConfig.from_pretrained(path)
        assert isinstance(config, PhaseKVConfig)
        assert config.model_config == model_config_from_dict(read_experiment(path)["model"])
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
        reference, _ = phasekv.load_checkpoint(path)
        assert isinstance(model, HFPhaseKVForCausalLM) and model.dtype == torch.float32 and not model.training
        with torch.no_grad():
            assert (model(ids).logits - reference(ids)).abs().max().item() <= 1e-6, path.name


def test_transformers_family_checkpoints_load_as_their_own_transformers_class():
    """A bundled checkpoint of transformers' own architectures (DeepSeek-V4 HCA, Qwen3) loads through the Auto
    classes as that class, with the logits of `phasekv.load_checkpoint`; GLM-5.3's text model, which transformers
    has no causal-LM class for, loads its config and is refused by AutoModelForCausalLM."""
    found = {p.name: p for p in [*CHECKPOINTS.iterdir(), *(CHECKPOINTS / "extra").iterdir()]
             if (p / "model.safetensors").is_file() and "model_type" in read_experiment(p)["model"]}
    assert {"dsv4-hca", "qwen3-full", "glm5-kpool"} <= set(found)
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    for name, cls in (("dsv4-hca", "DeepseekV4ForCausalLM"), ("qwen3-full", "Qwen3ForCausalLM")):
        model_type = read_experiment(found[name])["model"]["model_type"]
        config = transformers.AutoConfig.from_pretrained(found[name])
        assert config.model_type == model_type and not isinstance(config, PhaseKVConfig)
        model = transformers.AutoModelForCausalLM.from_pretrained(found[name], dtype=torch.float32).eval()
        assert type(model).__name__ == cls
        reference, _ = phasekv.load_checkpoint(found[name])
        with torch.no_grad():
            assert torch.equal(model(ids).logits, reference(ids).logits), name
    assert transformers.AutoConfig.from_pretrained(found["glm5-kpool"]).model_type == "glm5_next_text"
    with pytest.raises(ValueError, match="Unrecognized configuration class"):
        transformers.AutoModelForCausalLM.from_pretrained(found["glm5-kpool"])


@pytest.mark.parametrize("tie", [False, True])
def test_save_pretrained_round_trips_and_is_a_phasekv_checkpoint(tmp_path, tie):
    model = _tiny_hf(tie_word_embeddings=tie)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "phasekv"
    assert (tmp_path / "model.safetensors").is_file() and not list(tmp_path.glob("*.bin"))
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    native, config = phasekv.load_checkpoint(tmp_path)
    assert config.tie_word_embeddings is tie and (again.lm_head.weight is again.model.embed_tokens.weight) is tie
    ids = torch.randint(0, 64, (2, 50))
    with torch.no_grad():
        expected = model(ids).logits
        assert torch.equal(again(ids).logits, expected) and torch.equal(native(ids), expected)


def test_generate_uses_the_compressed_cache_and_matches_full_forward_greedy():
    model = _tiny_hf()
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))
    out = model.generate(ids, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    assert isinstance(out.cache, KVCache) and out.cache.length == 51  # the last token is never fed back
    sequence = ids
    with torch.no_grad():
        for _ in range(12):
            sequence = torch.cat([sequence, model(sequence).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out.sequences, sequence) and len(set(sequence[0, 40:].tolist())) > 2


def test_bad_input_is_refused_in_one_line(tmp_path):
    model = _tiny_hf()
    with pytest.raises(ValueError, match="no padding"):
        model(torch.ones(2, 8, dtype=torch.long), attention_mask=torch.tensor([[0] * 2 + [1] * 6, [1] * 8]))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.ones(1, 600, dtype=torch.long))
    with pytest.raises(ValueError, match="window"):
        PhaseKVConfig(model=tiny().to_dict() | {"compressor": "gated", "window": 0})
    with pytest.raises(OSError, match="missing"):  # transformers' own error for a path that is not there
        transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "missing"))


def test_hflm_evaluates_a_phasekv_model_like_phasekv(tmp_path):
    """lm-eval's `hf` model, given a phasekv model instance, predicts every exported prompt as phasekv does."""
    pytest.importorskip("lm_eval")
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from phasekv.adapters.phasekv import PhaseKVAdapter
    from phasekv.config import EvalConfig
    from phasekv.data.formats import FormatVocabulary, load_format
    from phasekv.data.protocols import build_eval_set
    from phasekv.evaluate.runner import predict
    from phasekv.export.lmeval import export_lmeval

    tokenizer = bpe_tokenizer()
    tokenizer.save_pretrained(tmp_path / "tok")
    cfg = EvalConfig(format="records", records=24, demos=2, stride=8, residue_modulus=8, clusters=8)
    task = export_lmeval(str(tmp_path / "tok"), cfg, tmp_path / "task")["task"]
    model = _tiny_hf(vocab_size=len(tokenizer))
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=64, backend="causal")
    out = lm_eval.simple_evaluate(model=lm, tasks=[task], task_manager=TaskManager(include_path=str(tmp_path / "task")),
                                  log_samples=True)
    vocab = FormatVocabulary(load_format("records"), tokenizer)
    eval_set = build_eval_set(vocab, "prefix", stride=8, n_records=24, n_demos=2, residue_modulus=8, n_clusters=8,
                              key_tokens=vocab.record_shape[0], value_tokens=vocab.record_shape[1], local_window=16)
    native = phasekv.build_model(model.config.model_config)
    native.load_state_dict(model.state_dict())
    expected = [tokenizer.decode([r["prediction"]]) for r in predict(PhaseKVAdapter(native.eval()), eval_set,
                                                                       progress=False)]
    samples = sorted(out["samples"][task], key=lambda s: s["doc_id"])
    assert [s["filtered_resps"][0] for s in samples] == expected and len(set(expected)) > 1


def test_import_phasekv_does_not_import_transformers_modeling_code():
    code = ("import sys, phasekv; assert 'transformers.modeling_utils' not in sys.modules; "
            "from transformers import AutoConfig, AutoModelForCausalLM; "
            "from transformers.models.auto.configuration_auto import CONFIG_MAPPING; "
            "from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING; "
            "from phasekv.hf.config import PhaseKVConfig; "
            "assert CONFIG_MAPPING['phasekv'] is PhaseKVConfig; "
            "assert MODEL_FOR_CAUSAL_LM_MAPPING[PhaseKVConfig].__name__ == 'HFPhaseKVForCausalLM'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
