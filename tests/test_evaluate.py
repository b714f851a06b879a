"""Evaluation harness: oracles with known phase failures, multi-query == one-by-one, determinism,
the HF path on a tiny local model, and one-line errors for bad input."""

import json

import pytest
import torch

from phasekv import ModelConfig, build_model
from phasekv.adapters.base import ModelInfo
from phasekv.adapters.phasekv import PhaseKVAdapter
from phasekv.cli import main
from phasekv.data import Vocabulary, build_eval_set
from phasekv.evaluate.runner import evaluate, predict
from tests.helpers import PromptAdapter

VOCAB = Vocabulary()


class Oracle(PromptAdapter):
    """Answers by looking the key up in the prompt; wrong when the record's phase is in `fail`, or
    (phase-blind) wrong with probability `p_wrong` decided by a hash of the prompt."""

    def __init__(self, stride, fail=(), p_wrong=0.0):
        self.info = ModelInfo("oracle", VOCAB.size, 1, 1, 1, 1, 10_000, stride, 16)
        self.fail, self.p_wrong = set(fail), p_wrong

    def answer(self, row: list[int]) -> int:
        key = row[-1]
        pos = row.index(key)  # the record is the key's first occurrence
        value = row[pos + 1]
        wrong = pos % self.info.stride in self.fail
        if self.p_wrong:
            wrong = (hash(tuple(row)) % 1000) / 1000 < self.p_wrong
        return VOCAB.group("values")[0] if wrong and value != VOCAB.group("values")[0] else value + wrong


def small_set(protocol="prefix", stride=8, **kw):
    kw.setdefault("n_clusters", 6)  # a multiple of gcd(record pitch, R) for both protocols
    return build_eval_set(VOCAB, protocol, n_records=32, n_demos=4, stride=stride, **kw)


@pytest.mark.parametrize("protocol", ["prefix", "insequence"])
def test_oracle_failing_phases_recovered(protocol):
    metrics = evaluate(Oracle(8, fail=(2, 5)), small_set(protocol), progress=False, n_boot=200)
    phases = {row["phase"]: row["accuracy"] for row in metrics["per_phase"]}
    assert phases[2] == 0.0 and phases[5] == 0.0
    assert all(phases[p] == 1.0 for p in range(8) if p not in (2, 5))
    assert metrics["max_gap_pp"] == 100.0 and metrics["detected_period"] == 8
    assert metrics["mean_accuracy"] == pytest.approx(0.75)


def test_phase_blind_oracle_is_flat():
    metrics = evaluate(Oracle(8, p_wrong=0.4), small_set(), progress=False, n_boot=200)
    assert metrics["flatness_p"] > 0.01
    assert metrics["detected_period"] == 1
    assert 0.5 < metrics["mean_accuracy"] < 0.7


def test_matching_stats_are_written_and_equal_across_groups(tmp_path):
    exact = small_set(stride=4, n_clusters=None).matching_stats()  # the default size matches exactly
    assert exact["max_mean_gap"] == 0.0 and exact["max_variance_rel_gap"] == 0.0
    eval_set = small_set(stride=4)
    metrics = evaluate(Oracle(4, fail=(1,)), eval_set, tmp_path, progress=False, n_boot=100)
    assert metrics["target_position_matching"] == eval_set.matching_stats()
    assert (tmp_path / "accuracy_by_residue.png").read_bytes()[:4] == b"\x89PNG"
    rows = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert len(rows) == metrics["n_prompts"]
    assert {"target_position", "residue", "phase", "protocol", "shift", "prediction", "correct"} <= set(rows[0])


def test_multi_query_equals_one_by_one_on_a_real_model():
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=VOCAB.size, hidden_size=32, intermediate_size=64,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=8, compressor="gated", window=8, stride=4, local_window=16))
    adapter = PhaseKVAdapter(model)
    eval_set = small_set("insequence", stride=4, n_clusters=3)
    fast = predict(adapter, eval_set, batch_size=16, multi_query=True, progress=False)
    slow = predict(adapter, eval_set, batch_size=37, multi_query=False, progress=False)
    assert fast == slow


def test_same_seed_same_metrics_bytes(tmp_path):
    for name in ("a", "b"):
        evaluate(Oracle(8, p_wrong=0.3), small_set(), tmp_path / name, progress=False, n_boot=300, seed=5)
    assert (tmp_path / "a" / "metrics.json").read_bytes() == (tmp_path / "b" / "metrics.json").read_bytes()


def test_residue_modulus_must_be_a_multiple_of_stride():
    with pytest.raises(ValueError, match="residue_modulus"):
        small_set(stride=5)


def test_prompt_longer_than_context_is_one_clear_error():
    adapter = Oracle(8)
    adapter.info.max_length = 20
    with pytest.raises(ValueError, match="exceeds the model's context"):
        predict(adapter, small_set(), progress=False)


# ----------------------------------------------------------------------------- HF path


def _tiny_hf(tmp_path, words):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=len(vocab), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      head_dim=8, max_position_embeddings=1024)
    model = transformers.Qwen3ForCausalLM(config)
    model.save_pretrained(tmp_path / "hf")
    fast.save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_eval_on_a_tiny_hf_model(tmp_path, capsys):
    path = _tiny_hf(tmp_path, VOCAB.words)
    code = main(["eval", "--hf", str(path), "--protocol", "prefix", "--records", "32", "--demos", "4",
                 "--clusters", "2", "--batch-size", "64", "--out", str(tmp_path / "out"), "--no-progress"])
    assert code == 0
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    for key in ("stride", "residue_modulus", "n_prompts", "mean_accuracy", "max_gap_pp", "detected_period",
                "per_residue", "per_phase"):
        assert key in metrics
    assert metrics["stride"] == 8 and len(metrics["per_residue"]) == 24


def test_hf_batch_size_and_multi_query_do_not_change_predictions(tmp_path):
    from phasekv.adapters.hf import load_hf
    from phasekv.evaluate.sources import TokenizerVocabulary

    adapter, tokenizer = load_hf(str(_tiny_hf(tmp_path, VOCAB.words)))
    vocab = TokenizerVocabulary(tokenizer, {"keys": 32, "values": 16, "fillers": 8})
    eval_set = build_eval_set(vocab, "prefix", n_records=32, n_demos=4, stride=4, n_clusters=2)
    a = predict(adapter, eval_set, batch_size=48, multi_query=True, progress=False)
    b = predict(adapter, eval_set, batch_size=50, multi_query=False, progress=False)
    assert a == b


def test_tokenizer_with_too_few_single_token_words(tmp_path, capsys):
    path = _tiny_hf(tmp_path, VOCAB.words[:40])  # only a few animal names
    code = main(["eval", "--hf", str(path), "--out", str(tmp_path / "o"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "single-token keys words found, need 64" in err
    assert "Traceback" not in err and sum(line.startswith("phasekv eval: error") for line in err.splitlines()) == 1


@pytest.mark.slow
def test_torchrun_sharded_eval_equals_single_process(tmp_path):
    import os
    import subprocess
    import sys

    from phasekv.checkpoint import save_checkpoint

    torch.manual_seed(0)
    config = ModelConfig(vocab_size=VOCAB.size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, compressor="gated", window=4,
                         stride=4, local_window=8)
    tree = {"model": config.to_dict(), "data": {"n_records": 24, "local_window": 8}, "vocab": VOCAB.to_dict()}
    save_checkpoint(tmp_path / "ckpt", build_model(config), tree)
    args = ["eval", "--checkpoint", str(tmp_path / "ckpt"), "--clusters", "2", "--no-progress", "--out"]
    assert main([*args, str(tmp_path / "one")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29544",
           "-m", "phasekv.cli", *args, str(tmp_path / "two")]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "one" / "predictions.jsonl").read_text() == (tmp_path / "two" / "predictions.jsonl").read_text()
    assert (tmp_path / "one" / "metrics.json").read_text() == (tmp_path / "two" / "metrics.json").read_text()
