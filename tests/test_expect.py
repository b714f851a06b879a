"""The regression gate (`phasekv audit --expect`, `--write-expect`): expectations written from a trusted run hold on
that run and on a rerun, and fail (exit 3, one line each) when a proxy corrupts the answers of one prompt-length
residue: the query-phase verdict turns to "phase sensitive" with period 4 and that phase's accuracy leaves its
interval; a bad expectations file is bad input (exit 2), refused before anything runs."""

import copy
import json

import pytest

from phasekv.auditing.expect import check_expectations, load_expectations, write_expectations
from tests.engine import CorruptingProxy
from tests.test_engine_grid import CFG, LLAMA, fake_engine, ubatch_grid


@pytest.fixture(scope="module")
def tokenizer():
    from tests.helpers import bpe_tokenizer

    return bpe_tokenizer()


def test_expectations_of_a_trusted_grid_hold_on_it_and_each_rule_can_say_no(tmp_path, tokenizer):
    _, summary = ubatch_grid(tmp_path, tokenizer, 32)
    expected = write_expectations(summary)
    path = tmp_path / "expect.json"
    path.write_text(json.dumps(expected))
    assert load_expectations(path) == expected and check_expectations(expected, summary) == []
    (small, large) = expected["points"].values()
    assert small["query"]["query_verdict"] == "phase sensitive" and large["query"]["query_verdict"].startswith("no ")
    assert 0.85 < large["query"]["agreement_at_least"] < 1 and small["query"]["agreement_at_least"] < 0.7
    # the clean point's expectations against the buggy point's measurements: every kind of rule fails
    swapped = copy.deepcopy(expected)
    names = list(swapped["points"])
    swapped["points"][names[0]] = expected["points"][names[1]]
    lines = check_expectations(swapped, summary)
    assert any("query-phase verdict is 'phase sensitive', expected 'no phase effect detected'" in li for li in lines)
    assert any("agreement" in li and "expected >=" in li for li in lines)
    assert all(li.startswith(f"expect: point {names[0]}, query") for li in lines)
    missing = {"phasekv_expect": 1, "points": {"ubatch=1": {"query": {"verdict": "x"}}}}
    assert check_expectations(missing, summary)[0].startswith("expect: point ubatch=1: not in this run")


@pytest.mark.parametrize("text, message", [
    ("[1, 2]", "not a phasekv expectations file"),
    ('{"phasekv_expect": 1, "points": {"a": {"query": {"colour": 1}}}}', "unknown fields ['colour']"),
    ('{"phasekv_expect": 1, "points": {"a": {"query": {"agreement_at_least": 2}}}}', "fraction in [0, 1]"),
    ('{"phasekv_expect": 1, "points": {"a": {"query": {"accuracy": {"0": [0.9, 0.1]}}}}}', "[low, high]"),
])
def test_a_bad_expectations_file_is_one_line_exit_2_before_anything_runs(tmp_path, capsys, text, message):
    from phasekv.cli import main

    path = tmp_path / "e.json"
    path.write_text(text)
    (tmp_path / "tok").mkdir()
    code = main(["audit", "--endpoint", "http://127.0.0.1:9", "--tokenizer", str(tmp_path / "tok"), "--expect",
                 str(path), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0] and not (tmp_path / "o").exists()


def test_the_gate_fails_with_status_3_on_the_bug_proxy_and_passes_without_it(tmp_path, tokenizer, capsys):
    from phasekv.cli import main
    from phasekv.engines.registry import started

    binary, model = fake_engine(tmp_path, len(tokenizer))
    tokenizer.save_pretrained(tmp_path / "tok")
    flags = ["--api", "llamacpp", "--tokenizer", str(tmp_path / "tok"), "--protocol", "query", "--records",
             str(CFG["records"]), "--demos", str(CFG["demos"]), "--stride", "4", "--local-window", "8",
             "--prompts-per-phase", "32", "--no-progress"]
    expect = tmp_path / "expect.json"
    with started(LLAMA, binary, model, {}, context=2048) as url:
        def audit(out, on, gate):
            with CorruptingProxy(url, residue=3, on=on) as proxy:
                code = main(["audit", "--endpoint", proxy.url, *flags, *gate, "--out", str(tmp_path / out)])
            return code, proxy.corrupted, capsys.readouterr()

        code, corrupted, _ = audit("trusted", False, ["--write-expect", str(expect)])
        assert code == 0 and corrupted == 0
        assert json.loads(expect.read_text())["points"]["audit"]["query"]["query_verdict"] == "no phase effect detected"
        code, _, seen = audit("clean", False, ["--expect", str(expect)])
        assert code == 0 and "all hold" in seen.out
        code, corrupted, seen = audit("bug", True, ["--expect", str(expect)])
    lines = seen.err.strip().splitlines()
    assert code == 3 and corrupted > 0 and lines and all(li.startswith("expect: point audit, query") for li in lines)
    assert any("query-phase verdict is 'phase sensitive'" in li for li in lines)
    bug = json.loads((tmp_path / "bug" / "summary.json").read_text())["conditions"]["none"]["query"]
    assert bug["query_phase"]["verdict"].startswith("phase sensitive: period 4")
