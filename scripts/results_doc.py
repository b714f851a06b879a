"""Regenerate docs/results.md's generated part from `phasekv reproduce` runs (phasekv.report.results_doc).

    python scripts/results_doc.py runs/demo                  # print the generated part
    python scripts/results_doc.py runs/demo --update docs/results.md --keep docs/runs/demo-summary.json

Bad input (a missing run, a summary of another command, a document without the markers) is one line, exit 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from phasekv.report.results_doc import regenerate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="reproduce run directories or their summary.json files")
    parser.add_argument("--update", type=Path, help="rewrite the generated part of this document instead of printing")
    parser.add_argument("--keep", type=Path, help="with one run: store its trimmed summary here and render from it")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        block = regenerate(args.runs, update=args.update, keep=args.keep)
    except (OSError, ValueError) as e:
        print(f"results_doc: error: {e}", file=sys.stderr)
        return 2
    if args.update is None:
        sys.stdout.write(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
