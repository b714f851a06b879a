"""docs/results.md's generated part (`phasekv.report.results_doc`): rendered from summary.json, never by hand.

The fixture `tests/fixtures/reproduce-summary.json` is cut from a real `make demo` summary (2026-12-02): five models
with the findings that name them, the fix and the theory, trimmed to what the document reads except w8s8, kept with
every field reproduce wrote; `tests/fixtures/reproduce-results.md` is what the renderer made of it
when it was committed, so any change to the renderer shows up here as a diff to review.  The second test renders
the summary the committed docs/results.md names and compares it with the document.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

from phasekv.report import results_doc

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
FIXTURE_NAME = "tests/fixtures/reproduce-summary.json"
DOC_SUMMARY = "docs/summaries/demo.json"  # the copy `make results` keeps beside the document


def script():
    """scripts/results_doc.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location("results_doc_script", REPO / "scripts" / "results_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fixture_summary() -> dict:
    return json.loads((FIXTURES / "reproduce-summary.json").read_text())


def test_the_fixture_renders_to_the_expected_document():
    rendered = results_doc.render({FIXTURE_NAME: fixture_summary()})
    assert rendered == (FIXTURES / "reproduce-results.md").read_text()


def test_the_committed_results_document_is_what_its_summary_renders_to():
    document = (REPO / "docs" / "results.md").read_text()
    summary = results_doc.load_summary(REPO / DOC_SUMMARY)
    assert results_doc.generated_part(document) == results_doc.render({DOC_SUMMARY: summary}), (
        "docs/results.md's generated part differs from what docs/summaries/demo.json renders to: run "
        "`make results` after `make demo` (or regenerate from the kept summary) instead of editing it by hand")


def test_a_number_in_the_summary_reaches_the_document():
    summary = fixture_summary()
    name = next(iter(summary["models"]))
    changed = copy.deepcopy(summary)
    changed["models"][name]["prefix"]["max_gap_pp"] = 12.345
    before, after = (results_doc.render({"run": s}) for s in (summary, changed))
    assert before != after and "| 12.3 |" in after


def test_trim_keeps_everything_the_document_reads():
    summary = fixture_summary()
    trimmed = results_doc.trim(summary)
    assert trimmed != summary and len(json.dumps(trimmed)) < len(json.dumps(summary)) / 2  # w8s8 loses fields
    assert results_doc.render({"run": trimmed}) == results_doc.render({"run": summary})
    assert results_doc.trim(trimmed) == trimmed


def test_replace_generated_keeps_the_hand_written_text_and_refuses_a_document_without_markers():
    block = results_doc.render({"run": fixture_summary()})
    document = f"# Results\n\nintro\n\n{results_doc.BEGIN}\nstale\n{results_doc.END}\n\n## By hand\n\nkept\n"
    updated = results_doc.replace_generated(document, block)
    assert updated.startswith("# Results\n\nintro\n\n") and updated.endswith("\n\n## By hand\n\nkept\n")
    assert results_doc.generated_part(updated) == block and "stale" not in updated
    with pytest.raises(ValueError, match="no generated part"):
        results_doc.replace_generated("# Results\n\nno markers\n", block)


def test_the_command_updates_a_document_and_refuses_a_summary_of_another_kind(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(fixture_summary()))
    doc, kept = tmp_path / "results.md", tmp_path / "kept" / "summary.json"
    doc.write_text(f"intro\n{results_doc.BEGIN}\n{results_doc.END}\nby hand\n")
    command = script()
    assert command.main([str(run), "--update", str(doc), "--keep", str(kept)]) == 0
    text = doc.read_text()
    assert text.startswith("intro\n") and text.endswith("by hand\n")
    assert results_doc.generated_part(text) == results_doc.render({str(kept): json.loads(kept.read_text())})
    audit = tmp_path / "audit.json"
    audit.write_text(json.dumps({"conditions": {}}))
    assert command.main([str(audit)]) == 2
    assert "not the summary.json of `phasekv reproduce`" in capsys.readouterr().err
    (tmp_path / "bare.md").write_text("no markers\n")
    assert command.main([str(run), "--update", str(tmp_path / "bare.md"), "--keep", str(tmp_path / "k.json")]) == 2
    assert "no generated part" in capsys.readouterr().err and not (tmp_path / "k.json").exists()


def test_a_findings_reason_and_a_cycling_outcome_reach_the_document():
    summary = fixture_summary()
    changed = copy.deepcopy(summary)
    failing = next(f for f in changed["findings"] if f["status"] == "fails")
    failing["reason"] = {"category": "recipe", "because": "the layout it was trained on",
                         "evidence": "docs/notes/full1kv.md"}
    row = next(d for m in changed["models"].values() for d in (m.get("cycling") or {}).get("deltas", [])
               if d["delta"] != 0)
    row["status"] = "destroyed"
    before, after = (results_doc.render({"run": s}) for s in (summary, changed))
    assert "| recipe: the layout it was trained on (docs/notes/full1kv.md) |" in after and "recipe:" not in before
    shown = f"{row['delta']:+d}: " + results_doc._r2(row["r2_excl_boundary"])
    assert f"{shown} destroyed" in after and f"{shown} destroyed" not in before
    assert results_doc.render({"run": results_doc.trim(changed)}) == after  # trim keeps both


def test_the_document_never_shows_an_r2_below_minus_one():
    shown = [results_doc._r2(x) for x in (None, -20763.98, -1.0, -0.999, 0.5)]
    assert shown == ["-", "<= -1", "<= -1", "-1.00", "0.50"]
