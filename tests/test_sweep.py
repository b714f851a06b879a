"""Shift sweep: the period rule on synthetic signals, an oracle that flips with (filler length mod 4),
teacher-forced scores of a tiny random model against one forward per token, and the command on a
checkpoint and on a tiny HF model."""

import argparse
import json

import numpy as np
import pytest
import torch

from phasekv import ModelConfig, build_model
from phasekv.adapters.base import Adapter, ModelInfo
from phasekv.adapters.phasekv import PhaseKVAdapter
from phasekv.checkpoint import save_checkpoint
from phasekv.cli import sweep as sweep_cli
from phasekv.data import Vocabulary
from phasekv.evaluate import sweep
from phasekv.evaluate.sweep import detect_signal_period, run_sweep
from tests.test_evaluate import _tiny_hf

VOCAB = Vocabulary()
BOS, FILLER = VOCAB.bos, VOCAB.encode("um")[0]
TEXT, A, B = VOCAB.encode("cat Alice dog"), VOCAB.encode("Bob"), VOCAB.encode("Carol")


def _config() -> ModelConfig:
    return ModelConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, compressor="gated", window=4,
                       stride=4, local_window=4)


@pytest.mark.parametrize("period", [4, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_period_of_a_noisy_periodic_signal(period, seed):
    rng = np.random.default_rng(seed)
    shape = rng.normal(size=period)
    shape -= shape.mean()
    shape /= shape.std()
    signal = np.tile(shape, 65 // period + 1)[:65] + 0.3 * rng.normal(size=65)
    found, scores = detect_signal_period(signal, max_period=16)
    assert found == period and scores[period] <= sweep.BIC_MARGIN
    assert scores[1] > 10 and scores[2 * period] > 0  # the multiple fits as well but pays for its extra means


@pytest.mark.parametrize("seed", range(10))
def test_pure_noise_has_period_one(seed):
    assert detect_signal_period(np.random.default_rng(seed).normal(size=65), max_period=16)[0] == 1


def test_exact_and_constant_signals():
    assert detect_signal_period(np.tile([1.0, 1.0, -1.0, -1.0], 16))[0] == 4  # RSS 0 at p = 4, 8, ...
    assert detect_signal_period(np.full(20, 0.3))[0] == 1
    _, scores = detect_signal_period(np.arange(9.0), max_period=16)
    assert sorted(scores) == [1, 2, 3, 4]  # candidates stop at N // 2 so that each class holds two values
    with pytest.raises(ValueError, match="signal"):
        detect_signal_period([1.0])


class FlipOracle(Adapter):
    """Prefers A when (number of fillers mod 4) < 2, else B; the preference is reversed at `exceptions`."""

    def __init__(self, exceptions=()):
        self.info = ModelInfo("flip-oracle", VOCAB.size, 1, 1, 1, 1, 10_000, 4, 4)
        self.exceptions = set(exceptions)

    def logits(self, ids):
        out = torch.zeros(*ids.shape, VOCAB.size)
        for row, tokens in enumerate(ids.tolist()):
            n = tokens.count(FILLER)
            prefer_a = (n % 4 < 2) != (n in self.exceptions)
            out[row, :, A[0] if prefer_a else B[0]] = 2.0
        return out


def test_oracle_flipping_with_period_4(tmp_path):
    result = run_sweep(FlipOracle(exceptions=(5, 22, 40)), VOCAB.decode, prefix_ids=[BOS], filler_id=FILLER,
                       text_ids=TEXT, a_ids=A, b_ids=B, max_filler=64, out_dir=tmp_path, progress=False)
    assert result["detected_period"] == 4
    assert result["pattern"] == ["a", "a", "b", "b"]
    assert result["n_rankings"] == 65 and result["agreement"] == 62
    rows = result["per_length"]
    high, low = np.exp(2) / (np.exp(2) + VOCAB.size - 1), 1 / (np.exp(2) + VOCAB.size - 1)
    assert rows[0]["p_a"] == pytest.approx(high) and rows[0]["p_b"] == pytest.approx(low)
    assert rows[2]["diff"] == pytest.approx(low - high) and rows[5]["choice"] == "b"
    assert [r["last_position"] for r in rows[:3]] == [3, 4, 5]
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "sweep.json").read_text())["agreement"] == 62


def test_scores_of_a_tiny_model_match_one_forward_per_token():
    torch.manual_seed(0)
    model = build_model(_config())
    adapter = PhaseKVAdapter(model)
    a, b = VOCAB.encode("Bob Alice otter"), VOCAB.encode("Carol")
    result = run_sweep(adapter, VOCAB.decode, prefix_ids=[BOS], filler_id=FILLER, text_ids=TEXT, a_ids=a, b_ids=b,
                       max_filler=9, progress=False)
    assert result["n_rankings"] == 10 and 1 <= result["detected_period"] <= 5
    for row in (result["per_length"][0], result["per_length"][7]):
        prompt = [BOS] + [FILLER] * row["filler"] + TEXT
        with torch.no_grad():
            def logp(ids, token):
                return model(torch.tensor([ids]))[0, -1].log_softmax(-1)[token].item()

            full_a = sum(logp(prompt + a[:k], a[k]) for k in range(len(a)))
            assert row["p_a"] == pytest.approx(np.exp(logp(prompt, a[0])), rel=1e-5)
            assert row["p_b"] == pytest.approx(np.exp(logp(prompt, b[0])), rel=1e-5)
        assert row["logp_a"] == pytest.approx(full_a, abs=1e-4)
        assert row["logp_b"] == pytest.approx(np.log(row["p_b"]), abs=1e-5)
        assert row["diff"] == pytest.approx(row["p_a"] - row["p_b"])
        assert row["choice"] == ("a" if row["logp_a"] > row["logp_b"] else "b")


def test_bad_inputs_are_value_errors():
    adapter = FlipOracle()
    with pytest.raises(ValueError, match="a and b"):
        run_sweep(adapter, VOCAB.decode, prefix_ids=[BOS], filler_id=FILLER, text_ids=TEXT, a_ids=A, b_ids=A,
                  max_filler=8, progress=False)
    with pytest.raises(ValueError, match="max_filler"):
        run_sweep(adapter, VOCAB.decode, prefix_ids=[BOS], filler_id=FILLER, text_ids=TEXT, a_ids=A, b_ids=B,
                  max_filler=0, progress=False)
    adapter.info.max_length = 10
    with pytest.raises(ValueError, match="exceeds the model's context"):
        run_sweep(adapter, VOCAB.decode, prefix_ids=[BOS], filler_id=FILLER, text_ids=TEXT, a_ids=A, b_ids=B,
                  max_filler=8, progress=False)


def _run_command(argv):
    parser = argparse.ArgumentParser()
    sweep_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["sweep", *argv])
    return args.func(args)


def test_command_on_a_checkpoint(tmp_path):
    torch.manual_seed(0)
    config = _config()
    save_checkpoint(tmp_path / "ckpt", build_model(config), {"model": config.to_dict(), "vocab": VOCAB.to_dict()})
    common = ["--checkpoint", str(tmp_path / "ckpt"), "--text", "cat Alice dog", "--a", "Bob", "--b", "Carol",
              "--max-filler", "8", "--no-progress"]
    result = _run_command([*common, "--out", str(tmp_path / "out")])
    written = json.loads((tmp_path / "out" / "sweep.json").read_text())
    assert written["per_length"] == result["per_length"] and len(written["per_length"]) == 9
    assert written["filler"] == "um" and written["prefix"] == "<bos>" and written["model_stride"] == 4
    assert (tmp_path / "out" / "sweep.png").is_file()
    with pytest.raises(ValueError, match="--filler: 'cat' is not one word of the checkpoint's fillers group"):
        _run_command([*common, "--filler", "cat", "--out", str(tmp_path / "o2")])
    with pytest.raises(ValueError, match="--text: encode: unknown word 'zzz'"):
        _run_command([*common[:2], "--text", "zzz", *common[4:], "--out", str(tmp_path / "o3")])


def test_command_on_a_tiny_hf_model(tmp_path):
    path = str(_tiny_hf(tmp_path, VOCAB.words))
    common = ["--hf", path, "--text", "cat Alice dog", "--a", "Bob", "--b", "Carol Alice", "--max-filler", "5",
              "--no-progress"]
    result = _run_command([*common, "--filler", " the", "--out", str(tmp_path / "out")])
    assert result["filler"] == "the" and result["prefix"] == "<eos>" and len(result["per_length"]) == 6
    assert result["b"] == "Carol Alice" and len(result["b_ids"]) == 2
    with pytest.raises(ValueError, match="must be exactly one token"):
        _run_command([*common, "--filler", "the cat", "--out", str(tmp_path / "o2")])
