"""The house's indexes: docs/README.md lists every document in docs/ and docs/notes/, every path under docs/ that a
file mentions exists (tests/test_foundations.py checks the mentions of top-level documents; this one the deeper
paths, docs/notes/NAME.md, docs/summaries/NAME.json, figures), scripts/ holds only what the Makefile runs, and
research/README.md names every research tool."""

from __future__ import annotations

import re
from pathlib import Path

from tests.test_foundations import repository_files

REPO = Path(__file__).resolve().parents[1]
DEEP_MENTION = re.compile(r"\bdocs/((?:[\w.-]+/)+[\w.-]+?\.(?:md|json|png))\b")
LINK = re.compile(r"\]\(([^)#]+)\)")


def test_the_docs_index_lists_every_document_and_every_link_resolves():
    index = (REPO / "docs" / "README.md").read_text()
    linked = {(REPO / "docs" / target).resolve() for target in LINK.findall(index)}
    broken = sorted(str(p.relative_to(REPO)) for p in linked if not p.is_file())
    assert not broken, f"docs/README.md links documents that do not exist: {broken}"
    documents = {p.resolve() for p in (REPO / "docs").rglob("*.md")} - {(REPO / "docs" / "README.md").resolve()}
    missing = sorted(str(p.relative_to(REPO)) for p in documents - linked)
    assert not missing, f"documents docs/README.md does not list (one line each): {missing}"


def test_every_path_under_docs_that_a_file_mentions_exists():
    files = repository_files()
    mentions = [(name, text.count("\n", 0, m.start()) + 1, m.group(1)) for name, text in files.items()
                for m in DEEP_MENTION.finditer(text)]
    assert any(path.startswith("notes/") for _, _, path in mentions)  # the pattern finds the notes
    missing = [f"{name}:{line}: docs/{path}" for name, line, path in mentions
               if not re.search(r"[A-Z]{3,}", path) and not (REPO / "docs" / path).is_file()]  # NAME: a pattern
    assert not missing, f"paths under docs/ mentioned but absent: {missing}"


def test_scripts_holds_only_what_make_runs_and_research_is_indexed_and_linted():
    makefile = (REPO / "Makefile").read_text()
    scripts = sorted(p.name for p in (REPO / "scripts").glob("*.py"))
    assert scripts and all(f"scripts/{name}" in makefile for name in scripts), (
        f"scripts/ holds files the Makefile does not run: {[n for n in scripts if f'scripts/{n}' not in makefile]}; "
        "research tools go to research/")
    assert re.search(r"ruff check [^\n]*\bscripts research\b", makefile)
    index = (REPO / "research" / "README.md").read_text()
    tools = sorted(p.name for p in (REPO / "research").glob("*.py"))
    assert tools and not [t for t in tools if f"`{t}`" not in index], "research/README.md must name every tool"
