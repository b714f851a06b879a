"""The query phase end to end: the query protocol through `predict` (prompts of different lengths), its
statistics and verdict (phasekv.evaluate.verdict.query_phase_statistics), the source x query phase cells
against a plain count, the heatmap, and `phasekv audit --protocol query` with its report."""

import json
import zlib

import numpy as np
import pytest
import torch

from phasekv import build_model
from phasekv.adapters.base import ModelInfo
from phasekv.adapters.phasekv import PhaseKVAdapter
from phasekv.data import Vocabulary, build_eval_set
from phasekv.evaluate.metrics import summarize, wilson_interval
from phasekv.evaluate.runner import evaluate, predict
from phasekv.evaluate.verdict import cross_phase_table, pair_period, query_phase_statistics, target_pairs
from phasekv.figures.evaluation import plot_cross_phase_heatmap
from tests.helpers import PromptAdapter, bpe_tokenizer, tiny

VOCAB = Vocabulary()


class LookupOracle(PromptAdapter):
    """Copies the value after the first occurrence of the prompt's final `key_tokens` tokens (the target record);
    wrong (the next token id) where `wrong(prompt)` says so."""

    def __init__(self, vocab_size: int, key_tokens: int = 1, wrong=lambda prompt: False):
        self.info = ModelInfo("oracle", vocab_size, 1, 1, 1, 1, 100_000, None, None)
        self.key_tokens, self.wrong = key_tokens, wrong

    def answer(self, row: list[int]) -> int:
        key, k = row[-self.key_tokens:], self.key_tokens
        start = next(i for i in range(len(row) - k) if row[i:i + k] == key)
        return row[start + k] + bool(self.wrong(row))


def query_set(**kw):
    kw.setdefault("n_clusters", 16)  # crossed: 8 per family, every length offset once
    return build_eval_set(VOCAB, "query", n_records=32, n_demos=4, stride=8, **kw)


def noisy(share: float, salt: int = 0):
    """Wrong on a fixed pseudo-random `share` of the prompts (a crc of the ids: the same in every run)."""
    return lambda row: zlib.crc32(np.asarray(row + [salt], dtype=np.int64).tobytes()) % 1000 < 1000 * share


def test_a_query_phase_failure_is_found_in_the_query_phase_and_not_the_source_phase(tmp_path):
    oracle = LookupOracle(VOCAB.size, wrong=lambda row: (len(row) - 1) % 8 == 3)
    metrics = evaluate(oracle, query_set(), tmp_path, progress=False, n_boot=200)
    query = metrics["query_phase"]
    assert [r["accuracy"] for r in query["per_phase"]] == [1.0] * 3 + [0.0] + [1.0] * 4
    assert query["verdict"].startswith("phase sensitive: period 8") and query["detected_period"] == 8
    assert query["can_do_task"] and query["in_context_chance"] == metrics["in_context_chance"]
    assert {r["accuracy"] for r in metrics["per_phase"]} == {7 / 8}  # every source phase loses its query phase 3
    assert metrics["verdict"].startswith("no phase effect detected")
    cells = {(c["phase"], c["query_phase"]): c["accuracy"] for c in metrics["cross"]["cells"]}
    assert all(cells[p, q] == (0.0 if q == 3 else 1.0) for p in range(8) for q in range(8))
    assert metrics["query_position_matching"]["max_mean_gap"] == 0.0
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["query_phase"]["verdict"] == query["verdict"] and saved["cross"] == metrics["cross"]
    assert (tmp_path / "accuracy_by_source_and_query_phase.png").stat().st_size > 10_000
    rows = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    assert all(r["query_phase"] == r["query_position"] % 8 for r in rows)


def test_a_source_phase_failure_leaves_the_query_phase_flat():
    oracle = LookupOracle(VOCAB.size, wrong=lambda row: row.index(row[-1]) % 8 in (2, 5))
    metrics = evaluate(oracle, query_set(), progress=False, n_boot=200)
    assert [r["accuracy"] for r in metrics["per_phase"]] == [1, 1, 0, 1, 1, 0, 1, 1]
    query = metrics["query_phase"]
    assert {r["accuracy"] for r in query["per_phase"]} == {0.75} and query["flatness_p"] == 1.0
    assert query["verdict"].startswith("no phase effect detected") and not query["phase_sensitive"]
    assert query["detected_period"] == 1
    cross = metrics["cross"]
    assert [r["accuracy"] for r in cross["per_relative_phase"]] == [0.75] * 8  # the design crosses phase and shift


def test_a_small_query_phase_effect_is_not_material_and_chance_has_no_verdict():
    small = LookupOracle(VOCAB.size, wrong=lambda row: (len(row) - 1) % 8 == 3 and noisy(0.12)(row))
    query = evaluate(small, query_set(), progress=False, n_boot=400)["query_phase"]
    assert query["flatness_p"] < 0.05 and 5 < query["max_gap_pp"] < 20
    assert query["verdict_parts"]["phase_dependent"] and not query["phase_sensitive"]  # detected, not material
    assert query["verdict"].startswith(("a small phase effect", "a phase effect, not shown material"))
    at_chance = LookupOracle(VOCAB.size, wrong=lambda row: (len(row) - 1) % 8 != 3 or noisy(0.9, 1)(row))
    query = evaluate(at_chance, query_set(), progress=False, n_boot=200)["query_phase"]
    assert query["verdict"].startswith("cannot do the task") and "period" not in query["verdict"]


def test_errors_that_belong_to_an_example_are_no_source_phase_effect():
    """Under the query protocol a source-phase group holds its own (cluster, target) pairs, each at every shift: a
    hard pair must not read as a phase effect, so the pair is the unit (`target_pairs`)."""
    def hard(row):  # 40% of the (key, value) pairs are always wrong, whatever their phase
        pos = row.index(row[-1])
        return zlib.crc32(bytes([row[pos], row[pos + 1]])) % 100 < 40

    s = query_set()
    metrics = evaluate(LookupOracle(VOCAB.size, wrong=hard), s, progress=False, n_boot=200)
    assert metrics["flatness_p"] > 0.05 and metrics["verdict"].startswith("no phase effect detected")
    assert metrics["n_clusters"] == 16 * 12 and metrics["query_phase"]["n_clusters"] == 16  # pairs; clusters
    records = predict(LookupOracle(VOCAB.size, wrong=hard), s, progress=False)
    assert summarize(records, 8, 24, n_boot=50)["flatness_p"] < 0.01  # whole examples as the unit: a false effect
    assert target_pairs(records)[12]["cluster"] == 0 and len({r["cluster"] for r in target_pairs(records)}) == 16 * 12


def test_the_query_phase_test_shuffles_whole_contexts_within_the_cluster():
    """Every cluster shows all its targets at every shift: shuffling the shift labels of each cluster's contexts
    finds a small query-phase effect that shuffling prompts across whole examples (between-pair differences in the
    null) cannot see."""
    def wrong(row):  # 40% of the pairs always wrong, and 8% more prompts wrong at query phase 3
        pos = row.index(row[-1])
        return zlib.crc32(bytes([row[pos], row[pos + 1]])) % 100 < 40 or ((len(row) - 1) % 8 == 3
                                                                          and noisy(0.08)(row))

    records = predict(LookupOracle(VOCAB.size, wrong=wrong), query_set(), progress=False)
    query = query_phase_statistics(records, 8, 24, 0.1, 0.04, n_boot=100)["query_phase"]
    assert query["flatness_p"] < 0.01 and query["cochran_p"] is None and "context permutation" in query[
        "flatness_test"]
    assert query["verdict"].startswith("a small phase effect")  # detected, and bounded below 10 pp
    by_example = summarize([{**r, "target_position": r["query_position"]} for r in records], 8, 24, n_boot=50)
    assert by_example["flatness_p"] > 0.5  # the same prompts, whole examples as the unit


def test_the_source_period_counts_a_pair_once():
    def wrong(row):  # a period-8 source failure (phases 2 and 5) and 30% of the pairs always wrong
        pos = row.index(row[-1])
        return pos % 8 in (2, 5) or zlib.crc32(bytes([row[pos], row[pos + 1]])) % 100 < 30

    s = query_set()
    records = predict(LookupOracle(VOCAB.size, wrong=wrong), s, progress=False)
    assert summarize(target_pairs(records), 8, 24, n_boot=50)["detected_period"] == 24  # each pair counted 24 times
    period = pair_period(records, 24)
    assert period["detected_period"] == 8 and period["period_scores"]["8"] == 0.0
    metrics = evaluate(LookupOracle(VOCAB.size, wrong=wrong), s, progress=False, n_boot=50)
    assert metrics["detected_period"] == 8 and metrics["verdict_parts"]["period"] == 8


def test_cross_table_equals_a_plain_count():
    rng = np.random.default_rng(3)
    records = [{"target_position": int(t), "query_position": int(t + d), "correct": bool(c)}
               for t, d, c in zip(rng.integers(0, 200, 700), rng.integers(20, 60, 700), rng.random(700) < 0.6)]
    records += [{"target_position": 8, "query_position": 50, "correct": True}]  # (0, 2): one prompt
    table = cross_phase_table(records, 4)
    for cell in table["cells"]:
        mine = [r["correct"] for r in records if r["target_position"] % 4 == cell["phase"]
                and r["query_position"] % 4 == cell["query_phase"]]
        assert cell["n"] == len(mine) and cell["n_correct"] == sum(mine)
        assert cell["accuracy"] == pytest.approx(sum(mine) / len(mine))
        assert (cell["ci_low"], cell["ci_high"]) == pytest.approx(wilson_interval(sum(mine), len(mine)))
    for row in table["per_relative_phase"]:
        mine = [r["correct"] for r in records if (r["query_position"] - r["target_position"]) % 4
                == row["relative_phase"]]
        assert row["n"] == len(mine) and row["n_correct"] == sum(mine)
    assert sum(r["n"] for r in table["per_query_phase"]) == table["n_prompts"] == len(records)
    only = cross_phase_table([{"target_position": 1, "query_position": 6, "correct": True}], 4)
    empty = [c for c in only["cells"] if c["n"] == 0]
    assert len(empty) == 15 and all(c["accuracy"] is None for c in empty)
    with pytest.raises(ValueError, match="query_position"):
        query_phase_statistics([{"cluster": 0, "record": 0, "target_position": 1, "correct": True}], 4, 4, 0.1, 0.2)


def test_predict_groups_prompts_of_one_length_and_both_strategies_agree():
    torch.manual_seed(0)
    model = build_model(tiny(vocab_size=VOCAB.size, local_window=16, max_position_embeddings=256))
    adapter = PhaseKVAdapter(model)
    s = query_set(n_clusters=2, residue_modulus=8)
    assert len({len(c.ids) for c in s.contexts}) == 8  # one length per shift
    multi = predict(adapter, s, batch_size=5, progress=False)
    single = predict(adapter, s, batch_size=7, multi_query=False, progress=False)
    assert [r["prediction"] for r in multi] == [r["prediction"] for r in single]
    prompts = s.prompts()
    for i in (0, 13, len(prompts) - 1):  # the reference: one forward of the full prompt
        reference = int(adapter.logits(torch.tensor([prompts[i].ids]))[0, -1].argmax())
        assert multi[i]["prediction"] == reference and multi[i]["query_position"] == len(prompts[i].ids) - 1


def test_heatmap_draws_the_cells_and_margins(tmp_path):
    oracle = LookupOracle(VOCAB.size, wrong=lambda row: (len(row) - 1) % 8 == 3)
    cross = evaluate(oracle, query_set(), progress=False, n_boot=50)["cross"]
    path = plot_cross_phase_heatmap(cross, tmp_path / "cross.png")
    assert path.stat().st_size > 10_000
    with pytest.raises(ValueError, match="cross_phase_table"):
        plot_cross_phase_heatmap({"per_phase": []}, tmp_path / "bad.png")


def test_audit_with_the_query_protocol_reports_the_query_phase(tmp_path):
    from phasekv.auditing.pipeline import run_audit
    from phasekv.config import AuditPlan, audit_config
    from phasekv.data.formats import FormatVocabulary, load_format

    tokenizer = bpe_tokenizer()
    kt = FormatVocabulary(load_format("records"), tokenizer).record_shape[0]
    oracle = LookupOracle(len(tokenizer), kt, wrong=lambda row: (len(row) - 1) % 4 == 1)
    summary = run_audit(oracle, tokenizer, audit_config(stride=4, records=16, demos=2), tmp_path / "audit",
                        plan=AuditPlan(conditions=("none",), window=4, prompts_per_phase=64, protocols=("query",)),
                        progress=False)
    query = summary["conditions"]["none"]["query"]
    assert query["query_phase"]["verdict"].startswith("phase sensitive: period 4")
    assert [r["accuracy"] for r in query["cross"]["per_query_phase"]] == [1.0, 0.0, 1.0, 1.0]
    assert query["verdict"].startswith("no phase effect detected")  # the source phase
    assert summary["settings"]["protocols"] == ["query"] and "comparison" not in summary
    page = (tmp_path / "audit" / "report.html").read_text()
    assert "query protocol: the query phase" in page and page.count("data:image/png") == 2  # heatmap, source curve
    assert json.loads((tmp_path / "audit" / "summary.json").read_text()) == json.loads(json.dumps(summary))


def test_audit_cli_query_protocol_flags(tmp_path, capsys):
    from phasekv.cli import main

    code = main(["audit", "--hf", str(tmp_path / "none"), "--reference-hf", "x", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--reference-hf" in err[0] and "needs --endpoint" in err[0]
    with pytest.raises(SystemExit):
        main(["audit", "--hf", "x", "--protocol", "suffix", "--out", str(tmp_path / "o")])
    assert "invalid choice: 'suffix'" in capsys.readouterr().err
