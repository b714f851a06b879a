"""A long-context design through the audit (phasekv.evaluate.longrun, auditing.pipeline with `long_context`, the
--context / --preset flags): streamed prompts through an in-process model and through a served one, a verdict per
target depth and the depth x phase map in the report, and the paper's design counted by --dry-run without building
a prompt."""

import json
from pathlib import Path

import pytest
import transformers

from phasekv.data.keyspace import train_bpe
from phasekv.data.longcontext import LongContextSet, LongContextSpec
from phasekv.engines.registry import launcher, started
from phasekv.evaluate.longrun import LongSetView, depth_statistics, predict_long
from tests.test_engine_grid import fake_engine


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=train_bpe("byte-level"), bos_token="<s>",
                                                   eos_token="<s>")
    where = tmp_path_factory.mktemp("tok")
    wrapped.save_pretrained(where)
    return wrapped, where


SPEC = LongContextSpec(family="records", context=1024, stride=4, depths=(0.25, 0.75), per_group=16, local_window=8)


def test_predict_long_streams_every_prompt_and_the_depths_get_their_own_verdicts(tokenizer):
    from phasekv.adapters.hf import HFAdapter
    from tests.helpers import tiny_causal_lm

    tok, _ = tokenizer
    lset = LongContextSet(SPEC, tok)
    model = tiny_causal_lm("llama", len(tok), 2048, "sdpa")
    adapter = HFAdapter(model, "tiny", prefill_chunk=256)
    records = predict_long(adapter, lset, progress=False)
    assert len(records) == lset.n_prompts == 2 * 16 * 4
    assert {r["depth"] for r in records} == {0.25, 0.75}
    expected = [p.target_position for p in lset.prompts()]
    assert [r["target_position"] for r in records] == expected  # the set's order, one record per prompt
    by_depth = depth_statistics(records, LongSetView(lset))
    assert set(by_depth) == {"0.25", "0.75"}
    assert all(len(d["per_phase"]) == 4 and d["n_prompts"] == 64 for d in by_depth.values())
    assert all("cannot do the task" in d["verdict"] for d in by_depth.values())  # a random model: at chance


def test_a_served_long_context_audit_has_depth_verdicts_and_the_depth_phase_map(tmp_path, tokenizer):
    from phasekv.cli import main

    tok, where = tokenizer
    binary, model = fake_engine(tmp_path, len(tok))
    with started(launcher("llama-server"), binary, model, {}, context=2048) as url:
        code = main(["audit", "--endpoint", url, "--tokenizer", str(where), "--context", "1024", "--family",
                     "records", "--depths", "0.25", "0.75", "--stride", "4", "--local-window", "8",
                     "--prompts-per-phase", "16", "--protocol", "prefix", "--concurrency", "2", "--no-progress",
                     "--out", str(tmp_path / "o")])
    assert code == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    result = summary["conditions"]["none"]["prefix"]
    assert result["mean_accuracy"] == 1.0  # the stand-in's induction rule finds the one occurrence of each key
    assert set(result["by_depth"]) == {"0.25", "0.75"}
    assert all(d["mean_accuracy"] == 1.0 and "no phase effect" in d["verdict"] for d in result["by_depth"].values())
    assert summary["format"]["long_context"]["context"] == 1024
    assert (tmp_path / "o" / "figures" / "depth_phase_prefix.png").is_file()
    assert "Top-1 accuracy by target depth" in (tmp_path / "o" / "report.html").read_text()


def test_the_paper_design_is_counted_by_a_dry_run_and_bad_long_flags_are_one_line(tmp_path, tokenizer, capsys):
    from phasekv.cli import main

    tok, where = tokenizer
    base = ["audit", "--hf", str(where), "--protocol", "prefix", "query", "--out", str(tmp_path / "o")]
    assert main([*base, "--preset", "paper-niah", "--dry-run", "--tokens-per-s", "1700"]) == 0
    out = capsys.readouterr().out
    assert "prefix: 2,048 prompts, 268,435,456 prompt tokens (longest 131,072)" in out
    assert "query: 2,048 prompts" in out and not Path(tmp_path / "o").exists()
    for flags, message in ((["--preset", "paper-niah", "--context", "4096"], "give one"),
                           (["--depths", "0.5"], "applies to a long-context set"),
                           (["--context", "64"], "cannot hold")):
        assert main([*base, *flags, "--dry-run"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
