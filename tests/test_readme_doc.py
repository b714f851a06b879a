"""README.md's generated blocks (`phasekv.report.readme_doc`): rendered from docs/summaries/*.json, never by hand.

The first test renders the committed README's blocks again from the committed summaries and compares them with the
file, so a hand edit inside a block, or a summary changed without `make results`, fails here.  The others check
that a number in a summary reaches its block, that text outside the blocks is kept, and the one-line refusals.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest

from phasekv.report import readme_doc

REPO = Path(__file__).resolve().parents[1]
SUMMARIES = REPO / "docs" / "summaries"


def test_the_committed_readme_blocks_are_what_the_summaries_render_to():
    document = (REPO / "README.md").read_text()
    assert {m.group("name") for m in readme_doc.MARKER.finditer(document)} == set(readme_doc.BLOCKS)
    assert readme_doc.render(document, SUMMARIES) == document, (
        "README.md's generated blocks differ from what docs/summaries/ renders to: run `make results` (or "
        "`python scripts/results_doc.py --readme README.md`) instead of editing them by hand")


@pytest.fixture
def summaries(tmp_path):
    folder = tmp_path / "summaries"
    shutil.copytree(SUMMARIES, folder)
    return folder


def _edit(folder: Path, name: str, change) -> None:
    path = folder / f"{name}.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _blocks(folder: Path) -> str:
    document = "\n".join(f"{readme_doc.begin(name)}\n{readme_doc.END}" for name in readme_doc.BLOCKS) + "\n"
    return readme_doc.render(document, folder)


def test_a_number_in_a_summary_reaches_its_block(summaries):
    before = _blocks(summaries)

    def fixes(data):
        data["models"]["w9s8-4kv"]["insequence"]["max_gap_pp"] = 12.345
        data["models"]["w8s8"]["prefix"]["mean_accuracy"] = 0.5
        data["findings"][0]["status"] = "inconclusive" if data["findings"][0]["status"] != "inconclusive" else "holds"

    def oracle(data):
        data["conditions"]["kpool:pool=4,budget=0.25,indexer=oracle"]["prefix"]["mean_accuracy"] = 0.4321

    _edit(summaries, readme_doc.DEMO, fixes)
    _edit(summaries, readme_doc.ORACLE, oracle)
    after = _blocks(summaries)
    assert "| 12.3 / 74.2 |" in after and "| 12.3 / 74.2 |" not in before
    assert "retrieval is 43.2/" in after and "retrieval is 43.2/" not in before
    assert "model averages 50% while" in after and "model averages 50% while" not in before
    counts = [re.search(r"(\d+) hold, (\d+) fail and (\d+) are inconclusive", text).groups()
              for text in (before, after)]
    assert counts[0] != counts[1]


def test_the_phases_a_model_retrieves_are_read_from_its_curve():
    curve = [{"accuracy": a} for a in (1.0, 0.97, 0.02, 0.5, 1.0)]
    assert readme_doc._phases(curve) == "0, 1, 4" and readme_doc._phases(curve[:2]) == "0-1"


def test_every_fix_row_comes_from_a_summary(summaries):
    rows = [line for line in _blocks(summaries).splitlines() if line.startswith("| ") and "---" not in line][1:]
    with_extra = len(rows)
    (summaries / f"{readme_doc.EXTRA}.json").unlink()  # the models outside the demo: their rows go with the file
    assert len([line for line in _blocks(summaries).splitlines() if line.startswith("| ")]) - 1 == with_extra - 4


def test_render_keeps_the_text_outside_the_blocks_and_refuses_bad_documents(summaries):
    document = f"# Title\n\nby hand 1.5x\n{readme_doc.begin('kpool')}\nstale 99.9\n{readme_doc.END}\nafter\n"
    rendered = readme_doc.render(document, summaries)
    assert rendered.startswith("# Title\n\nby hand 1.5x\n") and rendered.endswith(f"{readme_doc.END}\nafter\n")
    assert "stale" not in rendered and "**k-pool selection on SmolLM2**" in rendered
    with pytest.raises(ValueError, match="no generated block"):
        readme_doc.render("# no markers\n", summaries)
    with pytest.raises(ValueError, match="unknown generated block 'heads'"):
        readme_doc.render(f"{readme_doc.begin('heads')}\n{readme_doc.END}\n", summaries)
    (summaries / f"{readme_doc.ORACLE}.json").unlink()
    with pytest.raises(ValueError, match="cannot read the summary a README block needs"):
        readme_doc.render(document, summaries)


def test_the_command_rewrites_the_readme_and_refuses_in_one_line(summaries, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("results_doc_script", REPO / "scripts" / "results_doc.py")
    command = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(command)
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{readme_doc.begin('fixes')}\nold\n{readme_doc.END}\noutro\n")
    assert command.main(["--readme", str(readme), "--summaries", str(summaries)]) == 0
    text = readme.read_text()
    assert text == readme_doc.render(text, summaries) and "old" not in text and text.endswith("outro\n")
    readme.write_text("no blocks\n")
    assert command.main(["--readme", str(readme), "--summaries", str(summaries)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no generated block" in err
