"""`phasekv export lm-eval`: lm-evaluation-harness, run through its Python API on a tiny random Llama saved
locally, gives per-document predictions and per-residue / per-phase accuracies identical to `phasekv eval --hf`
on the same prompts."""

import json
import shlex

import pytest
import torch

from phasekv.cli import main
from phasekv.config import EvalConfig
from phasekv.evaluate.runner import run_eval
from phasekv.evaluate.sources import Source
from phasekv.export import lmeval_task
from phasekv.export.lmeval import answer_texts, export_lmeval
from tests.helpers import SMOL, SMOL_FILE, bpe_tokenizer, needs_real_model

# one-digit values: 9 possible answers, so a model restricted to them is right about 1 time in 9, unevenly
DIGITS = ("name: digits1\nheader: \"Here is the list of records.\\n\"\nkey_text: \"{key}:\"\n"
          "value_text: \" {value}\\n\"\ntail: \"That is the whole list.\\n\"\nvalues: \"digits:1\"\n")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Llama and the test tokenizer, saved with save_pretrained; its LM head can only say a digit,
    and its weights are large enough that its guesses depend on the position."""
    transformers = pytest.importorskip("transformers")
    tokenizer = bpe_tokenizer()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=1024, initializer_range=0.2)  # 0.02: no position effect
    model = transformers.LlamaForCausalLM(config).eval()
    digits = [tokenizer.encode(f" {d}", add_special_tokens=False)[0] for d in range(1, 10)]
    with torch.no_grad():
        keep = model.lm_head.weight[digits].clone()
        model.lm_head.weight.zero_()
        model.lm_head.weight[digits] = keep
    path = tmp_path_factory.mktemp("lmeval") / "model"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path.parent / "digits1.yaml").write_text(DIGITS)
    return path


def test_lm_eval_task_gives_the_accuracies_of_phasekv_eval(model_dir, tmp_path):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    cfg = EvalConfig(format=str(model_dir.parent / "digits1.yaml"), records=24, demos=2, stride=8,
                     residue_modulus=8, clusters=8, protocol="prefix")
    metrics = run_eval(Source(hf=str(model_dir)), cfg, tmp_path / "eval", progress=False)
    summary = export_lmeval(str(model_dir), cfg, tmp_path / "task")
    assert summary["task"] == "phasekv_digits1_prefix" and summary["n_prompts"] == metrics["n_prompts"] == 256
    tasks = TaskManager(include_path=str(tmp_path / "task"))
    out = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model_dir},dtype=float32",
                                  tasks=[summary["task"]], task_manager=tasks, batch_size=64, device="cpu",
                                  log_samples=True)
    results = out["results"][summary["task"]]
    residues = [results[f"acc_residue_{g['residue']},none"] for g in metrics["per_residue"]]
    assert residues == [g["accuracy"] for g in metrics["per_residue"]]  # 32 prompts each: exact in binary
    assert [results[f"acc_phase_{g['phase']},none"] for g in metrics["per_phase"]] == [
        g["accuracy"] for g in metrics["per_phase"]]
    assert 0.02 < results["acc,none"] < 0.5 and len(set(residues)) > 1  # neither trivial nor flat
    assert results["gap_pp,none"] == pytest.approx(metrics["max_gap_pp"], abs=1e-8) and metrics["max_gap_pp"] > 0
    assert results["phase_gap_pp,none"] == pytest.approx(metrics["phase_gap_pp"], abs=1e-8)
    predictions = [json.loads(line) for line in (tmp_path / "eval" / "predictions.jsonl").read_text().splitlines()]
    samples = sorted(out["samples"][summary["task"]], key=lambda s: s["doc_id"])
    tokenizer = bpe_tokenizer()
    assert [s["filtered_resps"][0] for s in samples] == [tokenizer.decode([p["prediction"]]) for p in predictions]
    assert [(s["doc"]["residue"], s["doc"]["phase"]) for s in samples] == [
        (p["residue"], p["phase"]) for p in predictions]


def test_export_command_writes_a_task_and_refuses_bad_input(model_dir, tmp_path, capsys):
    out = tmp_path / "task"
    assert main(["export", "lm-eval", "--tokenizer", str(model_dir), "--format", "records", "--protocol",
                 "insequence", "--records", "24", "--demos", "2", "--residue-modulus", "8", "--clusters", "8",
                 "--out", str(out)]) == 0
    assert "wrote task phasekv_records_insequence (512 prompts" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == [".phasekv-output", "export.json",
                                                      "phasekv_records_insequence.yaml", "prompts.jsonl", "utils.py"]
    docs = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert {d["residue"] for d in docs} == set(range(8)) and all(d["residue"] % 8 == d["phase"] for d in docs)
    assert "acc_residue_7" in (out / "phasekv_records_insequence.yaml").read_text()
    bad = str(tmp_path / "bad")
    for argv, message in [(["--out", bad, "--protocol", "sideways"], "invalid choice"),
                          (["--out", bad, "--format", "nope"], "neither a shipped"),
                          (["--out", str(out)], "not empty"), (["--out", bad, "--stride", "0"], "stride"),
                          (["--out", bad, "--records", "9999"], "records")]:
        assert _exit_status(["export", "lm-eval", "--tokenizer", str(model_dir), *argv]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
    assert main(["export", "lm-eval", "--tokenizer", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    assert "--tokenizer" in capsys.readouterr().err and not (tmp_path / "o").exists()


def run_printed(command: str, out) -> int:
    """Run a `phasekv ...` command line the export printed, its OUT placeholder replaced by `out`."""
    argv = shlex.split(command.replace("--out OUT", f"--out {shlex.quote(str(out))}"))
    assert argv[0] == "phasekv"
    return main(argv[1:])


def test_export_for_a_model_directory_prints_the_commands_that_evaluate_the_same_prompts(model_dir, tmp_path,
                                                                                        capsys):
    flags = ["--format", "records", "--records", "24", "--demos", "2", "--residue-modulus", "8", "--clusters", "2"]
    assert main(["export", "lm-eval", "--hf", str(model_dir), *flags, "--out", str(tmp_path / "task")]) == 0
    printed = capsys.readouterr().out
    summary = json.loads((tmp_path / "task" / "export.json").read_text())
    assert summary["lm_eval_command"] == (f"lm_eval --model hf --model_args pretrained={model_dir} --include_path "
                                          f"{tmp_path / 'task'} --tasks phasekv_records_prefix")
    assert summary["lm_eval_command"] in printed and summary["eval_command"] in printed
    assert run_printed(summary["eval_command"], tmp_path / "eval") == 0
    capsys.readouterr()
    docs = [json.loads(line) for line in (tmp_path / "task" / "prompts.jsonl").read_text().splitlines()]
    predictions = [json.loads(line) for line in (tmp_path / "eval" / "predictions.jsonl").read_text().splitlines()]
    where = ("residue", "phase", "target_position", "cluster", "record", "answer")
    assert [tuple(d[k] for k in where) for d in docs] == [tuple(p[k] for k in where) for p in predictions]
    # without --format, --hf exports records-lmeval: this toy tokenizer has no one-token " ." filler, said in one line
    assert main(["export", "lm-eval", "--hf", str(model_dir), "--out", str(tmp_path / "default")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "records-lmeval.filler" in err[0] and not (tmp_path / "default").exists()


def _exit_status(argv: list[str]) -> int:
    """main's return value, or the status of argparse's exit on a usage error."""
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code


def test_prompts_that_would_tokenize_differently_are_refused(model_dir, tmp_path):
    """A filler that merges with its neighbours ('e' 'e' -> 'ee') would shift every later position in lm-eval."""
    fmt = tmp_path / "merging.yaml"
    fmt.write_text(DIGITS.replace("name: digits1", "name: merging") + "filler: \"e\"\n")
    cfg = EvalConfig(format=str(fmt), records=24, demos=2, stride=8, residue_modulus=8, clusters=8)
    with pytest.raises(ValueError, match="do not tokenize back to their own token ids"):
        export_lmeval(str(model_dir), cfg, tmp_path / "task")
    assert not (tmp_path / "task").exists()


def test_answers_sharing_their_text_with_another_token_are_refused():
    class Tokenizer:
        def __len__(self):
            return 3

        def batch_decode(self, ids, skip_special_tokens):
            return ["a", "b", "a"]

    assert answer_texts(Tokenizer(), {1}) == {1: "b"}
    with pytest.raises(ValueError, match="same text"):
        answer_texts(Tokenizer(), {0})


def test_group_metrics_average_their_own_documents_only():
    doc = {"residue": 3, "phase": 1, "residue_modulus": 12, "stride": 4, "answer_text": " 5"}
    right, wrong = lmeval_task.process_results(doc, [" 5"]), lmeval_task.process_results(doc, ["5"])
    assert right["acc_residue_03"] == 1.0 and right["acc_residue_04"] is None and wrong["acc_phase_1"] == 0.0
    assert lmeval_task.group_accuracy([None, 1.0, 0.0, 1.0, None]) == pytest.approx(2 / 3)
    assert lmeval_task.gap([(0, 1.0), (0, 0.0), (1, 1.0), (2, 0.0)]) == 100.0


@pytest.mark.slow
@needs_real_model
def test_export_for_smollm2_succeeds_with_the_shipped_format_and_lm_eval_agrees_with_phasekv_eval(tmp_path, capsys):
    """`phasekv export lm-eval --hf SmolLM2` without --format: `records` would be refused (its "\\n" fillers merge
    under SmolLM2's tokenizer), the default `records-lmeval` round-trips, and the real lm_eval run of the exported
    task (with the printed command's model) gives the per-phase accuracies of the printed `phasekv eval` command."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    settings = dict(records=24, demos=4, stride=8, residue_modulus=8, clusters=2, protocol="prefix",
                    gguf_file=SMOL_FILE)
    with pytest.raises(ValueError, match="do not tokenize back"):
        export_lmeval(str(SMOL), EvalConfig(format="records", **settings), tmp_path / "refused")
    flags = ["--gguf-file", SMOL_FILE, "--records", "24", "--demos", "4", "--stride", "8", "--residue-modulus", "8",
             "--clusters", "2", "--protocol", "prefix"]
    assert main(["export", "lm-eval", "--hf", str(SMOL), *flags, "--out", str(tmp_path / "task")]) == 0
    summary = json.loads((tmp_path / "task" / "export.json").read_text())
    assert summary["format"] == "records-lmeval" and "--format records-lmeval" in summary["eval_command"]
    assert run_printed(summary["eval_command"] + " --no-progress", tmp_path / "eval") == 0
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert summary["n_prompts"] == metrics["n_prompts"] and metrics["can_do_task"]
    model_args = shlex.split(summary["lm_eval_command"])[4]
    assert model_args == f"pretrained={SMOL},gguf_file={SMOL_FILE}"
    out = lm_eval.simple_evaluate(model="hf", model_args=f"{model_args},dtype=float32", tasks=[summary["task"]],
                                  task_manager=TaskManager(include_path=str(tmp_path / "task")), batch_size=16,
                                  device="cpu")
    results = out["results"][summary["task"]]
    assert [results[f"acc_phase_{g['phase']},none"] for g in metrics["per_phase"]] == pytest.approx(
        [g["accuracy"] for g in metrics["per_phase"]], abs=1e-12)
