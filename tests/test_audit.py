"""`phasekv audit`: the capability gate comes first and a model at chance gets no phase verdict; the
report is drawn from summary.json; on the real SmolLM2 (when present) the records format works; the
long-context formats put the same prose preamble in every prompt (prefilled once per audit) and fit
SmolLM2's 8,192 positions."""

import dataclasses
import json

import pytest
import torch

from phasekv.adapters.hf import HFAdapter
from phasekv.auditing.pipeline import run_audit
from phasekv.config import PROTOCOLS, AuditPlan, audit_config
from phasekv.data.formats import FORMATS, FormatVocabulary, PromptFormat, load_format
from phasekv.data.protocols import build_eval_set
from tests.helpers import SMOL, SMOL_FILE, bpe_tokenizer, needs_real_model, tiny_causal_lm


def _tiny_llama(vocab_size: int, max_positions: int = 1024):
    pytest.importorskip("transformers")
    return HFAdapter(tiny_causal_lm("llama", vocab_size, max_positions, "sdpa").eval(), "tiny-llama")


def test_a_model_at_chance_stops_at_the_capability_gate(tmp_path):
    tokenizer = bpe_tokenizer()
    adapter = _tiny_llama(len(tokenizer))
    summary = run_audit(adapter, tokenizer, audit_config(records=40), tmp_path / "audit",
                        plan=AuditPlan(conditions=("select:3", "mean"), prompts_per_phase=1), progress=False)
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
    summary = run_audit(HFAdapter(model, "SmolLM2-135M"), tokenizer, audit_config(), tmp_path / "a",
                        plan=AuditPlan(conditions=("select:3+keep-first:1",), prompts_per_phase=64,
                                       protocols=("prefix",)), progress=False)
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


def _preamble_set(vocab: FormatVocabulary, protocol: str):
    kt, vt = vocab.record_shape
    return build_eval_set(vocab, protocol, n_records=16, n_demos=2, stride=8, residue_modulus=8, n_clusters=4,
                          key_tokens=kt, value_tokens=vt, local_window=16)


def test_a_long_preamble_is_the_same_in_every_prompt_and_positions_stay_exact():
    tokenizer = bpe_tokenizer(prose=True)
    prose = sum(len(s) for s in FormatVocabulary(FORMATS["needle"], tokenizer).sentences)  # all of haystack.txt
    n = prose + 300
    vocab = FormatVocabulary(dataclasses.replace(FORMATS["needle-4k"], preamble_tokens=n, haystack_tokens=16),
                             tokenizer)
    head = tokenizer.encode(FORMATS["needle"].header, add_special_tokens=False)
    assert vocab.header[:len(head)] == head and len(vocab.header) == len(head) + n
    pieces = {tuple(p) for p in vocab.sentences}  # the preamble is whole haystack sentences, end to end
    rest, used = vocab.header[len(head):], 0
    while rest:
        piece = next(p for p in pieces if tuple(rest[:len(p)]) == p)
        rest, used = rest[len(piece):], used + 1
    assert used > len(vocab.sentences)  # more tokens than the whole list: it is repeated
    kt = vocab.record_shape[0]
    starts = set()
    for protocol in PROTOCOLS:
        eval_set = _preamble_set(vocab, protocol)
        stats = eval_set.matching_stats()
        assert stats["max_mean_gap"] == 0 and eval_set.prompt_length > n
        starts |= {tuple(c.ids[:1 + len(vocab.header)]) for c in eval_set.contexts}
        for prompt in eval_set.prompts():
            at = prompt.query.target_position
            assert tuple(prompt.ids[at:at + kt]) == prompt.query.key == tuple(prompt.ids[-kt:])
    assert starts == {(vocab.bos, *vocab.header)}  # one shared prefix for every cluster, shift and protocol


@pytest.mark.parametrize("fields, message", [
    (dict(header="no placeholder\n", preamble_tokens=10), "header: must hold {prose} exactly once"),
    (dict(header="{prose} twice {prose}", preamble_tokens=10), "header: must hold {prose} exactly once"),
    (dict(header="{prose}\n", preamble_tokens=0), "header: must hold {prose} exactly once when preamble"),
    (dict(header="{prose}\n", preamble_tokens=-1), "preamble_tokens: must be >= 0"),
])
def test_bad_preamble_fields_are_one_line_errors(fields, message):
    with pytest.raises(ValueError, match="^[^\n]+$") as err:
        PromptFormat("long", keys="animals", values="digits:3", **fields)
    assert message in str(err.value) and "format long" in str(err.value)


def test_a_preamble_no_set_of_sentences_can_fill_is_refused():
    fmt = dataclasses.replace(FORMATS["needle-4k"], preamble_tokens=3)  # every sentence is longer
    with pytest.raises(ValueError, match="^format needle-4k.preamble_tokens: no set of haystack sentences adds the "
                                         "remaining 3 tokens"):
        FormatVocabulary(fmt, bpe_tokenizer(prose=True))


def test_an_audit_on_a_long_format_prefills_its_preamble_once(tmp_path):
    tokenizer = bpe_tokenizer(prose=True)
    adapter = _tiny_llama(len(tokenizer), 8192)
    shapes = []
    original = adapter.module.forward

    def forward(*args, **kwargs):  # counts forwards by their token shape (a hook would change the query path)
        shapes.append(tuple(kwargs["input_ids"].shape))
        return original(*args, **kwargs)

    adapter.module.forward = forward
    summary = run_audit(adapter, tokenizer, audit_config(format="needle-4k", records=16, demos=2), tmp_path / "audit",
                        plan=AuditPlan(conditions=("none",), prompts_per_phase=1), progress=False)
    header = len(FormatVocabulary(load_format("needle-4k"), tokenizer).header)
    assert summary["format"]["format"]["preamble_tokens"] == 3072 and summary["conditions"]["none"]["prefix"]
    assert [s for s in shapes if s[1] > header] == [shapes[0]] and shapes[0][0] == 1  # both protocols, one prefill


@needs_real_model
def test_the_long_formats_fit_smollm2_at_4k_and_8k_tokens():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(SMOL, gguf_file=SMOL_FILE)
    for name, n_records, n_demos in [("records", 24, 4), ("needle", 16, 2)]:
        for size in (4, 8):
            for chat in (False, True):
                vocab = FormatVocabulary(load_format(f"{name}-{size}k", chat), tokenizer)
                kt, vt = vocab.record_shape
                lengths = [build_eval_set(vocab, p, n_records=n_records, n_demos=n_demos, stride=8, residue_modulus=8,
                                          n_clusters=2, key_tokens=kt, value_tokens=vt).prompt_length
                           for p in PROTOCOLS]
                assert size * 1024 - 128 < min(lengths) <= max(lengths) <= size * 1024, (name, size, chat, lengths)
