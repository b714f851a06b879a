"""A long-context design through the audit (phasekv.evaluate.longrun, auditing.pipeline with `long_context`, the
--context / --preset flags): streamed prompts through an in-process model and through a served one, a verdict per
target depth and the depth x phase map in the report, and the paper's design counted by --dry-run without building
a prompt; and SmolLM2 at 8K tokens through the real llama-server (`-m real`), a server whose context is too small
refused in one line before any prompt."""

import json
from pathlib import Path

import pytest
import transformers

from phasekv.data.keyspace import train_bpe
from phasekv.data.longcontext import LongContextSet, LongContextSpec
from phasekv.engines.registry import launcher, started
from phasekv.evaluate.longrun import LongSetView, depth_statistics, predict_long
from tests.engine import CountingProxy, engine_present, llama_server
from tests.helpers import SMOL, SMOL_FILE, needs_real
from tests.test_engine_grid import fake_engine

needs_engine = needs_real(engine_present, "llama-server not built (make engine) or real model absent (make real-model)")


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
                           (["--context", "64"], "cannot hold"),
                           (["--context", "1024", "--prefill-chunk", "-1"], "--prefill-chunk: must be >= 0")):
        assert main([*base, *flags, "--dry-run"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    # a shard's journal and the merge hold a --format set: a long-context set is refused before any server is asked
    assert main(["audit", "--endpoint", "http://127.0.0.1:9", "--tokenizer", str(where), "--context", "1024",
                 "--shard", "0/2", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a long-context set (--context, --preset) is not sharded" in err[0], err


# ---------------------------------------------------------------------------------------------- real llama-server

# SmolLM2's window is 8,192 tokens and llama-server caps a slot at the training context: the largest prompt it holds
# with its answer token is 8,191 tokens.  Stride 1 and one prompt per depth keep the run to two prompts (each about
# a minute of prefill on one free core; several minutes on a loaded machine): the plumbing at 8K, not a verdict.
SMOL_8K = ["--family", "needle", "--stride", "1", "--depths", "0.25", "0.75", "--prompts-per-phase", "1",
           "--protocol", "prefix", "--no-progress"]


@needs_engine
@pytest.mark.slow
def test_smollm2_at_8k_through_the_real_llama_server_and_a_too_small_context_refused(tmp_path, capsys):
    from phasekv.cli import main

    tokenizer = ["--tokenizer", str(SMOL), "--gguf-file", SMOL_FILE]

    def refused(url, context, out, window):
        with CountingProxy(url) as proxy:
            code = main(["audit", "--endpoint", proxy.url, *tokenizer, "--context", context, *SMOL_8K, "--out",
                         str(out)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and f"serves a context of {window} tokens" in err[0], err
        assert "+ 1 answer token" in err[0] and not proxy.prompts and not Path(out).exists()  # before any prompt

    with llama_server(slots=1, context=4096, threads=2) as small:
        refused(small, "8191", tmp_path / "small", 4096)  # -c smaller than the prompts
    with llama_server(slots=1, context=8192, threads=2) as url:
        refused(url, "8192", tmp_path / "full", 8192)  # the prompt fills the window: no room for its answer
        code = main(["audit", "--endpoint", url, *tokenizer, "--context", "8191", *SMOL_8K, "--out",
                     str(tmp_path / "o")])
    assert code == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["format"]["long_context"]["context"] == 8191
    assert summary["format"]["long_context"]["n_records"] > 100  # records over the whole depth, not a preamble
    result = summary["conditions"]["none"]["prefix"]
    assert set(result["by_depth"]) == {"0.25", "0.75"}
    for depth in result["by_depth"].values():
        assert depth["n_prompts"] == 1 and len(depth["per_phase"]) == 1 and depth["verdict"]
        assert depth["mean_accuracy"] in (0.0, 1.0)
    records = [json.loads(line) for line in
               (tmp_path / "o" / "conditions" / "none" / "prefix" / "predictions.jsonl").read_text().splitlines()]
    assert [r["depth"] for r in records] == [0.25, 0.75]
    for r in records:  # the target where its depth says, the query at the end of an 8,191-token prompt
        assert abs(r["target_position"] / 8191 - r["depth"]) < 0.05 and r["query_position"] == 8190
    assert (tmp_path / "o" / "figures" / "depth_phase_prefix.png").stat().st_size > 1000
    assert "Top-1 accuracy by target depth" in (tmp_path / "o" / "report.html").read_text()
    assert summary["engine_report"]["props"]["model_path"].endswith(SMOL_FILE)
