"""`phasekv audit --target-mde PP` (the prompts per phase chosen from `phasekv.evaluate.sizing`, printed with their
cost and shown by --dry-run) and the audit's family-wise view of its flatness p-values (one Holm line in
summary.json, the printed summary and report.html)."""

import json

import pytest

from phasekv.evaluate.sizing import detectable_gap_pp, prompts_per_phase_for
from tests.helpers import bpe_tokenizer, tiny_causal_lm


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny llama (at chance: the audit stops at the capability gate) and its tokenizer, saved as --hf."""
    from phasekv.adapters.hf import HFAdapter

    tokenizer = bpe_tokenizer()
    adapter = HFAdapter(tiny_causal_lm("llama", len(tokenizer), 1024, "sdpa").eval(), "tiny-llama")
    where = tmp_path_factory.mktemp("model")
    adapter.module.save_pretrained(where)
    tokenizer.save_pretrained(where)
    return where


def test_target_mde_chooses_the_prompts_per_phase_and_the_dry_run_shows_them_with_their_cost(model_dir, tmp_path,
                                                                                            capsys):
    from phasekv.cli import main

    base = ["audit", "--hf", str(model_dir), "--records", "24", "--demos", "2", "--protocol", "prefix",
            "--compress", "none", "mean", "--out", str(tmp_path / "o")]
    n = prompts_per_phase_for(30.0)
    assert detectable_gap_pp(n) <= 30.0 < detectable_gap_pp(n - 1)
    assert main([*base, "--target-mde", "30", "--dry-run", "--tokens-per-s", "1000"]) == 0
    out = capsys.readouterr().out
    assert (f"--target-mde 30 pp: {n} prompts per phase (the gap found 80% of the time: about "
            f"{detectable_gap_pp(n):.1f} pp") in out
    assert f"cost: {8 * n:,} prompts per protocol and condition or more (whole clusters), {2 * 8 * n:,} in all" in out
    prompts = int(out.split("prefix: ")[1].split(" prompts")[0].replace(",", ""))  # the dry run's own count
    assert 8 * n <= prompts < 8 * n + 8 * 8  # the chosen size, rounded up to whole clusters
    assert main([*base, "--prompts-per-phase", "40", "--dry-run", "--tokens-per-s", "1000"]) == 0
    assert "--target-mde" not in capsys.readouterr().out  # without the flag nothing is chosen
    for bad in ("10", "5", "inf"):  # no size detects the material minimum or less
        assert main([*base, "--target-mde", bad, "--dry-run"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--target-mde: must be a finite gap above the material minimum 10 pp" in err[0], err
    with pytest.raises(SystemExit):  # one size, not two
        main([*base, "--target-mde", "30", "--prompts-per-phase", "64", "--dry-run"])
    assert not (tmp_path / "o").exists()


def test_the_family_wise_line_is_in_the_summary_the_printout_and_the_report(model_dir, tmp_path, capsys):
    from phasekv.cli import main
    from phasekv.evaluate.verdict import holm_line

    assert main(["audit", "--hf", str(model_dir), "--records", "24", "--demos", "2", "--prompts-per-phase", "1",
                 "--compress", "none", "mean", "--out", str(tmp_path / "a"), "--no-progress"]) == 0
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    pvalues = {f"none/{p}": summary["conditions"]["none"][p]["flatness_p"] for p in ("prefix", "insequence")}
    assert summary["family_wise"] == holm_line(pvalues)
    assert summary["family_wise"].startswith("family-wise (Holm) over 2 flatness tests")
    assert summary["family_wise"] in capsys.readouterr().out
    assert summary["family_wise"] in (tmp_path / "a" / "report.html").read_text()


def test_the_family_wise_line_says_no_where_one_of_several_tests_rejects_alone():
    from phasekv.auditing.pipeline import family_wise

    def result(p, query=None):
        return {"flatness_p": p, **({} if query is None else {"query_phase": {"flatness_p": query}})}

    conditions = {"none": {"prefix": result(0.40), "query": result(0.30, 0.02)},
                  "mean": {"prefix": result(0.70), "query": result(0.90, 0.60)}}
    line = family_wise(conditions, ("prefix", "query"))
    # 0.02 is below 5% alone; Holm over the 6 tests multiplies it by 6: nothing rejects family-wise
    assert line == ("family-wise (Holm) over 6 flatness tests: 0 reject at 5%, smallest adjusted p = 0.12 "
                    "(none/query phase)")
    conditions["none"]["query"]["query_phase"]["flatness_p"] = 0.001
    line = family_wise(conditions, ("prefix", "query"))
    assert "1 reject at 5%, smallest adjusted p = 0.006 (none/query phase)" in line
