"""The Python API (`phasekv.audit`, `phasekv.api.evaluate`): a model object in memory gives the numbers `phasekv
audit --hf` gives on the same saved weights, writes nothing unless asked, and its result object reads, writes and
prints the per-phase table; the phase check inside a real transformers `Trainer.train()` and in a custom loop."""

import json

import pytest
import torch

import phasekv
from phasekv.api.audit import evaluate
from tests.helpers import SMOL, SMOL_FILE, bpe_tokenizer, needs_real_model, tiny_causal_lm

SMALL = dict(records=24, demos=2, prompts_per_phase=1)  # a few hundred prompts: seconds on one thread


@pytest.fixture(scope="module")
def tokenizer():
    return bpe_tokenizer()


def _same_numbers(a: dict, b: dict) -> None:
    """Two summaries equal but for what names the model and times the run."""
    strip = lambda s: {k: v for k, v in s.items() if k not in ("model", "elapsed_s")}  # noqa: E731
    assert json.loads(json.dumps(strip(a))) == json.loads(json.dumps(strip(b)))


def _files(path) -> set:
    return {p.relative_to(path) for p in path.rglob("*")}


def test_audit_of_a_model_object_equals_the_command_on_its_saved_weights_and_writes_nothing(tmp_path, monkeypatch,
                                                                                           tokenizer):
    from phasekv.cli import main

    model = tiny_causal_lm("llama", len(tokenizer), 1024, "sdpa").train()
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    before = _files(tmp_path)
    monkeypatch.chdir(tmp_path)
    result = phasekv.audit(model, tokenizer, **SMALL)
    assert _files(tmp_path) == before and model.training  # nothing written; the model's mode restored
    assert main(["audit", "--hf", str(tmp_path / "model"), "--records", "24", "--demos", "2", "--prompts-per-phase",
                 "1", "--out", str(tmp_path / "cli"), "--no-progress"]) == 0
    on_disk = json.loads((tmp_path / "cli" / "summary.json").read_text())
    _same_numbers(result.to_dict(), on_disk)
    page = (tmp_path / "cli" / "report.html").read_text()
    assert page.index("<img ") < page.index("<table>")  # the per-phase curves open the report, then the table
    assert result.per_phase("none", "prefix") == on_disk["conditions"]["none"]["prefix"]["per_phase"]
    rows = result.per_phase()
    assert len(rows) == 8 and all(r["ci_low"] <= r["accuracy"] <= r["ci_high"] for r in rows)
    assert result.verdict_parts()["can_do_task"] is False and not result.can_do_task
    # write(dir): the command's files, the same summary
    result.write(tmp_path / "written")
    assert _same_numbers(json.loads((tmp_path / "written" / "summary.json").read_text()), on_disk) is None
    assert {p.relative_to(tmp_path / "cli") for p in (tmp_path / "cli").rglob("*") if p.is_file()} == \
           {p.relative_to(tmp_path / "written") for p in (tmp_path / "written").rglob("*") if p.is_file()}
    text = repr(result)
    assert "none prefix" in text and "none insequence" in text and "cannot do the task" in text
    # a path gives the same numbers too
    _same_numbers(phasekv.audit(str(tmp_path / "model"), **SMALL).to_dict(), on_disk)


def test_the_evaluate_function_survives_importing_the_evaluate_package():
    import phasekv.evaluate.runner  # noqa: F401 - sets phasekv.evaluate to the package

    assert callable(phasekv.audit) and callable(evaluate) and not callable(phasekv.evaluate)


def test_evaluate_of_a_phasekv_model_object_writes_only_where_asked(tmp_path):
    model = phasekv.build_model(phasekv.ModelConfig(compressor="gated", window=8, stride=8, local_window=16,
                                                    hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                                    vocab_size=256, max_position_embeddings=1024))
    result = evaluate(model, clusters=2, demos=2, residue_modulus=8, out=tmp_path / "eval")
    on_disk = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert on_disk == json.loads(json.dumps(result.to_dict())) and on_disk["schema_version"] == 1
    assert len(result.per_phase()) == 8 and result.metrics["model_stride"] == 8
    assert "EvalResult" in repr(result)


@pytest.mark.parametrize("call, message", [
    (lambda m, t: phasekv.audit(m, t, conditions=("squash",)), "squash"),
    (lambda m, t: phasekv.audit(m, t, protocols=("sideways",)), "protocols"),
    (lambda m, t: phasekv.audit(m, t, prompts_per_phase=0), "prompts_per_phase"),
    (lambda m, t: phasekv.audit(m, t, records=3, demos=4), "records"),
    (lambda m, t: phasekv.audit(m, t, windw=8), "unknown option 'windw'"),
    (lambda m, t: phasekv.audit(m, None), "tokenizer"),
    (lambda m, t: phasekv.audit(42, t), "model"),
    (lambda m, t: phasekv.audit("http://127.0.0.1:9", None), "tokenizer"),
])
def test_bad_arguments_are_one_line_errors(call, message, tokenizer):
    model = tiny_causal_lm("llama", len(tokenizer), 1024, "sdpa")
    with pytest.raises(ValueError, match=message) as info:
        call(model, tokenizer)
    assert "\n" not in str(info.value)


@pytest.mark.slow
@needs_real_model
def test_audit_of_smollm2_in_memory_equals_the_command(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from phasekv.cli import main

    tokenizer = AutoTokenizer.from_pretrained(SMOL, gguf_file=SMOL_FILE)
    model = AutoModelForCausalLM.from_pretrained(SMOL, gguf_file=SMOL_FILE, dtype=torch.float32)
    flags = dict(conditions=("select:3+keep-first:1",), protocols=("prefix",), prompts_per_phase=8)
    result = phasekv.audit(model, tokenizer, **flags)
    assert main(["audit", "--hf", str(SMOL), "--gguf-file", SMOL_FILE, "--compress", "select:3+keep-first:1",
                 "--protocol", "prefix", "--prompts-per-phase", "8", "--out", str(tmp_path / "cli"),
                 "--no-progress"]) == 0
    _same_numbers(result.to_dict(), json.loads((tmp_path / "cli" / "summary.json").read_text()))
    assert result.can_do_task and result.conditions == ["none", "select:3+keep-first:1"]


def test_the_callback_logs_phase_metrics_inside_a_real_trainer(tmp_path, tokenizer):
    from transformers import Trainer, TrainingArguments

    from phasekv.api.phase_check import PhaseCheckCallback, phase_check

    model = tiny_causal_lm("llama", len(tokenizer), 1024, "sdpa")
    ids = torch.randint(0, len(tokenizer), (8, 32), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=str(tmp_path / "trainer"), max_steps=4, per_device_train_batch_size=4,
                             report_to="none", logging_steps=100, save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    seen = []
    options = dict(prompts_per_phase=1, records=24)
    PhaseCheckCallback(tokenizer, every=2, log=lambda metrics, step: seen.append(step), **options).attach(trainer)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "phase/mean_accuracy" in h]
    assert [h["step"] for h in logged] == [2, 4] and seen == [2, 4]
    keys = {f"phase/acc_phase_{r}" for r in range(8)} | {f"phase/{k}" for k in (
        "mean_accuracy", "worst_phase_accuracy", "gap_pp", "gap_ci_low_pp", "gap_ci_high_pp", "can_do_task",
        "phase_dependent", "material", "phase_sensitive")}
    assert keys <= set(logged[-1])
    # the last check ran on the trained model: the same numbers as a check of it now
    now = phase_check(model, tokenizer, **options)
    assert {k: logged[-1][k] for k in now} == pytest.approx(now)
    acc = [logged[-1][f"phase/acc_phase_{r}"] for r in range(8)]
    assert logged[-1]["phase/gap_pp"] == pytest.approx(100 * (max(acc) - min(acc)))


def test_the_phase_check_in_a_custom_loop_runs_every_n_steps():
    from phasekv.api.phase_check import PhaseCheck

    model = phasekv.build_model(phasekv.ModelConfig(compressor="gated", window=8, stride=8, local_window=16,
                                                    hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                                    num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                                    vocab_size=256, max_position_embeddings=1024))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    logged = {}
    check = PhaseCheck(every=2, prompts_per_phase=1, log=lambda metrics, step: logged.update({step: metrics}))
    for step in range(1, 5):
        loss = model(torch.randint(0, 256, (2, 32))).logsumexp(-1).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert (check(model, step) is None) == (step % 2 == 1) and model.training
    assert sorted(logged) == [2, 4] and all(0 <= v <= 1 for k, v in logged[4].items() if "acc" in k)
    with pytest.raises(ValueError, match="every"):
        PhaseCheck(every=0)


# ----------------------------------------------------------------------------- schemas and the Hub's eval results

SCHEMAS = __import__("pathlib").Path(__file__).resolve().parents[1] / "docs" / "schemas"
TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None), "integer": int,
         "number": (int, float)}


def schema_errors(doc, schema: dict, where: str = "$") -> list[str]:
    """The subset of JSON Schema the docs/schemas files use: type, const, enum, required, properties,
    additionalProperties (a schema), items, minItems, maxItems, minimum, maximum."""
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        ok = any(isinstance(doc, TYPES[k]) and not (k in ("integer", "number") and isinstance(doc, bool))
                 for k in kinds)
        if not ok:
            return [f"{where}: expected {kinds}, got {type(doc).__name__}"]
    errors = []
    if "const" in schema and doc != schema["const"]:
        errors.append(f"{where}: expected {schema['const']!r}")
    if "enum" in schema and doc not in schema["enum"]:
        errors.append(f"{where}: {doc!r} not in {schema['enum']}")
    number = isinstance(doc, (int, float)) and not isinstance(doc, bool)
    if number and not schema.get("minimum", -float("inf")) <= doc <= schema.get("maximum", float("inf")):
        errors.append(f"{where}: {doc} out of range")
    if isinstance(doc, dict):
        errors += [f"{where}: missing {k!r}" for k in schema.get("required", ()) if k not in doc]
        for key, value in doc.items():
            sub = schema.get("properties", {}).get(key, schema.get("additionalProperties"))
            if isinstance(sub, dict):
                errors += schema_errors(value, sub, f"{where}.{key}")
    if isinstance(doc, list):
        if not schema.get("minItems", 0) <= len(doc) <= schema.get("maxItems", 1 << 30):
            errors.append(f"{where}: {len(doc)} items")
        errors += [e for i, item in enumerate(doc)
                   for e in schema_errors(item, schema.get("items", {}), f"{where}[{i}]")]
    return errors


def validate_eval_result_entries(entries) -> None:
    """The Hub's documented `.eval_results/*.yaml` fields: a list of entries, each with dataset.id and value
    required, only documented keys, an ISO-8601 date, source.url whenever a source is given."""
    import datetime

    from phasekv.api.publish import ENTRY_FIELDS

    assert isinstance(entries, list) and entries
    for entry in entries:
        assert set(entry) <= set(ENTRY_FIELDS) and {"dataset", "value"} <= set(entry)
        for key, allowed in ENTRY_FIELDS.items():
            if allowed is not None and key in entry:
                assert isinstance(entry[key], dict) and set(entry[key]) <= allowed
        assert isinstance(entry["dataset"]["id"], str) and "/" in entry["dataset"]["id"]
        assert isinstance(entry["value"], (int, float)) and not isinstance(entry["value"], bool)
        datetime.datetime.fromisoformat(entry["date"])
        assert "source" not in entry or isinstance(entry["source"]["url"], str)


def test_the_command_writes_valid_eval_results_and_outputs_that_match_their_schemas(tmp_path, tokenizer):
    import yaml

    from phasekv.cli import main

    model = tiny_causal_lm("llama", len(tokenizer), 1024, "sdpa")
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    assert main(["audit", "--hf", str(tmp_path / "model"), "--records", "24", "--demos", "2", "--prompts-per-phase",
                 "1", "--protocol", "prefix", "--out", str(tmp_path / "audit"), "--eval-results",
                 str(tmp_path / "hub"), "--no-progress"]) == 0
    summary = json.loads((tmp_path / "audit" / "summary.json").read_text())
    metrics = json.loads((tmp_path / "audit" / "conditions" / "none" / "prefix" / "metrics.json").read_text())
    summary_schema = json.loads((SCHEMAS / "summary.schema.json").read_text())
    metrics_schema = json.loads((SCHEMAS / "metrics.schema.json").read_text())
    assert schema_errors(summary, summary_schema) == [] and schema_errors(metrics, metrics_schema) == []
    broken = {**metrics, "schema_version": 2, "per_phase": [{"phase": 0, "accuracy": 1.5}]}
    assert len(schema_errors(broken, metrics_schema)) >= 3  # the validator can fail
    files = sorted((tmp_path / "hub" / ".eval_results").glob("*.yaml"))
    assert [f.name for f in files] == ["phasekv_none_prefix.yaml"]
    entries = yaml.safe_load(files[0].read_text())
    validate_eval_result_entries(entries)
    m = summary["conditions"]["none"]["prefix"]
    worst = min(r["accuracy"] for r in m["per_phase"])
    assert [e["value"] for e in entries] == pytest.approx([100 * m["mean_accuracy"], 100 * worst, m["max_gap_pp"]],
                                                          abs=0.005)
    assert all(m["verdict"] in e["notes"] for e in entries)
    card = (tmp_path / "hub" / "phasekv_model_card.md").read_text()
    assert "| none | prefix |" in card and "figures/phases_prefix.png" in card
    assert (tmp_path / "hub" / "figures" / "phases_prefix.png").read_bytes() == \
           (tmp_path / "audit" / "figures" / "phases_prefix.png").read_bytes()  # the card's figure beside it
    with pytest.raises(AssertionError):
        validate_eval_result_entries([{"dataset": {"id": "x/y"}, "value": 1.0, "date": "2026-12-06", "metric": 1}])


def test_the_eval_command_writes_valid_eval_results_and_the_function_the_same(tmp_path, tokenizer, capsys):
    import yaml

    from phasekv.cli import main

    model = tiny_causal_lm("llama", len(tokenizer), 1024, "sdpa")
    model.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    flags = ["--format", "records", "--records", "24", "--demos", "2", "--residue-modulus", "8", "--clusters", "4"]
    assert main(["eval", "--hf", str(tmp_path / "model"), *flags, "--out", str(tmp_path / "eval"), "--eval-results",
                 str(tmp_path / "hub"), "--no-progress"]) == 0
    m = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    files = sorted((tmp_path / "hub" / ".eval_results").glob("*.yaml"))
    assert [f.name for f in files] == ["phasekv_eval_prefix.yaml"]
    entries = yaml.safe_load(files[0].read_text())
    validate_eval_result_entries(entries)
    worst = min(r["accuracy"] for r in m["per_phase"])
    assert [e["value"] for e in entries] == pytest.approx([100 * m["mean_accuracy"], 100 * worst, m["max_gap_pp"]],
                                                          abs=0.005)
    assert [e["dataset"]["task_id"] for e in entries] == ["records_prefix_mean_accuracy",
                                                          "records_prefix_worst_phase_accuracy",
                                                          "records_prefix_phase_gap_pp"]
    assert all(e["notes"].startswith("phasekv eval, prefix protocol, format records, stride 8") and
               m["verdict"] in e["notes"] for e in entries)
    card = (tmp_path / "hub" / "phasekv_model_card.md").read_text()
    assert "| model | prefix |" in card and f"{m['n_prompts']} prompts" in card
    assert (tmp_path / "hub" / "accuracy_by_residue.png").read_bytes() == \
           (tmp_path / "eval" / "accuracy_by_residue.png").read_bytes()
    # the Python API's result publishes the same entries
    result = evaluate(model, tokenizer, prompt_format="records", records=24, demos=2, residue_modulus=8, clusters=4)
    result.write_eval_results(tmp_path / "api")
    same = yaml.safe_load((tmp_path / "api" / ".eval_results" / "phasekv_eval_prefix.yaml").read_text())
    assert [(e["dataset"], e["value"], e["notes"]) for e in same] == \
           [(e["dataset"], e["value"], e["notes"]) for e in entries]
    # refused in one line before anything runs: DIR is --out, or DIR holds other files
    capsys.readouterr()
    for out, hub in ((tmp_path / "o1", tmp_path / "o1"), (tmp_path / "o2", tmp_path / "hub")):
        assert main(["eval", "--hf", str(tmp_path / "model"), *flags, "--out", str(out), "--eval-results", str(hub),
                     "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and ("is the output --eval-results" in err[0] or "not empty" in err[0]), err
        assert not out.exists()
