"""`phasekv audit`: the capability gate comes first and a model at chance gets no phase verdict; the
report is drawn from summary.json; on the real SmolLM2 (when present) the records format works."""

import json

import pytest
import torch

from phasekv.evaluate.adapter import HFAdapter
from phasekv.report.audit import run_audit
from tests.helpers import SMOL, SMOL_FILE, bpe_tokenizer, needs_real_model


def _tiny_llama(vocab_size: int):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=1024)
    return HFAdapter(transformers.LlamaForCausalLM(config).eval(), "tiny-llama")


def test_a_model_at_chance_stops_at_the_capability_gate(tmp_path):
    tokenizer = bpe_tokenizer()
    adapter = _tiny_llama(len(tokenizer))
    summary = run_audit(adapter, tokenizer, tmp_path / "audit", conditions=("select:3", "mean"), n_records=40,
                        prompts_per_phase=1, progress=False)
    assert not summary["can_do_task"] and list(summary["conditions"]) == ["none"]
    verdict = summary["conditions"]["none"]["prefix"]["verdict"]
    assert verdict.startswith("cannot do the task") and "flat" not in verdict and "period" not in verdict
    on_disk = json.loads((tmp_path / "audit" / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(summary)) and 0 < on_disk["conditions"]["none"]["prefix"]["chance"] < 0.5
    page = (tmp_path / "audit" / "report.html").read_text()
    assert "cannot do the task" in page and "no compressed condition was evaluated" in page


@pytest.mark.slow
@needs_real_model
def test_real_model_records_format_is_flat_uncompressed_and_periodic_under_select(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOL, gguf_file=SMOL_FILE)
    model = AutoModelForCausalLM.from_pretrained(SMOL, gguf_file=SMOL_FILE, dtype=torch.float32)
    summary = run_audit(HFAdapter(model, "SmolLM2-135M"), tokenizer, tmp_path / "a",
                        conditions=("select:3+keep-first:1",), prompts_per_phase=64, progress=False,
                        protocols=("prefix",))
    none, select = (summary["conditions"][c]["prefix"] for c in ("none", "select:3+keep-first:1"))
    assert summary["can_do_task"] and none["mean_accuracy"] > 0.6 and none["flatness_p"] > 0.05
    assert none["verdict"].startswith("no phase effect detected")
    assert select["detected_period"] == 8 and select["max_gap_pp"] >= 25 and select["flatness_p"] < 0.01
    assert select["verdict"].startswith("phase sensitive: period 8")


def test_eval_and_audit_commands_take_a_format(tmp_path):
    from phasekv.cli import main

    tokenizer = bpe_tokenizer()
    adapter = _tiny_llama(len(tokenizer))
    model_dir = tmp_path / "model"
    adapter.module.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    assert main(["eval", "--hf", str(model_dir), "--format", "records", "--records", "24", "--demos", "2",
                 "--stride", "8", "--residue-modulus", "8", "--clusters", "8", "--out", str(tmp_path / "eval"),
                 "--no-progress"]) == 0
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert metrics["verdict"].startswith("cannot do the task") and 0 < metrics["chance"] < 0.5
    assert main(["audit", "--hf", str(model_dir), "--records", "24", "--demos", "2", "--prompts-per-phase", "1",
                 "--compress", "none", "mean", "--out", str(tmp_path / "audit"), "--no-progress"]) == 0
    summary = json.loads((tmp_path / "audit" / "summary.json").read_text())
    assert list(summary["conditions"]) == ["none"] and not summary["can_do_task"]


@pytest.mark.parametrize("flags, message", [
    (["--press", "squash"], "unknown press 'squash'"),
    (["--compress", "none", "select:99"], "select"),
    (["--compress", "none", "squash"], "squash"),
    (["--window", "4", "--stride", "8"], "stride"),
])
def test_audit_refuses_bad_conditions_before_loading_a_model(tmp_path, capsys, flags, message):
    from phasekv.cli import main

    code = main(["audit", "--hf", str(tmp_path / "no-such-model"), "--out", str(tmp_path / "o"), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0] and not (tmp_path / "o").exists()


def test_eval_takes_the_needle_format_with_a_chat_template(tmp_path, capsys):
    from phasekv.cli import main

    tokenizer = bpe_tokenizer(prose=True)
    adapter = _tiny_llama(len(tokenizer))
    model_dir = tmp_path / "model"
    adapter.module.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)  # with its chat template
    assert main(["eval", "--hf", str(model_dir), "--format", "needle", "--chat", "--records", "16", "--demos", "2",
                 "--stride", "8", "--residue-modulus", "8", "--clusters", "4", "--threads", "1",
                 "--out", str(tmp_path / "eval"), "--no-progress"]) == 0
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "eval" / "predictions.jsonl").read_text().splitlines()]
    assert metrics["n_prompts"] == len(rows) > 0 and 0 < metrics["chance"] < 0.5
    assert {r["answer_phase"] for r in rows} == set(range(8)) == {r["phase"] for r in rows}
    capsys.readouterr()
    code = main(["eval", "--hf", str(model_dir), "--chat", "--out", str(tmp_path / "bare")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "eval.chat: needs a prompt format" in err[0]
