"""Regenerate docs/results.md's generated part from `phasekv reproduce` runs (phasekv.report.results_doc), and
README.md's generated blocks from the summaries under docs/summaries/ (phasekv.report.readme_doc).

    python scripts/results_doc.py runs/demo                  # print the generated part
    python scripts/results_doc.py runs/demo --update docs/results.md --keep docs/summaries/demo.json \
        --readme README.md                                   # make results
    python scripts/results_doc.py --readme README.md         # README's blocks only, from the kept summaries

Bad input (a missing run, a summary of another command, a document without the markers) is one line, exit 2.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from phasekv.report import readme_doc
from phasekv.report.results_doc import regenerate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="*", type=Path, help="reproduce run directories or their summary.json files")
    parser.add_argument("--update", type=Path, help="rewrite the generated part of this document instead of printing")
    parser.add_argument("--keep", type=Path, help="with one run: store its trimmed summary here and render from it")
    parser.add_argument("--readme", type=Path, help="also rewrite this README's generated blocks (after the runs)")
    parser.add_argument("--summaries", type=Path, default=Path("docs/summaries"),
                        help="the folder of the summaries the README's blocks read (default docs/summaries)")
    args = parser.parse_args(argv)
    if not args.runs and args.readme is None:
        parser.error("give reproduce runs, --readme, or both")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        block = regenerate(args.runs, update=args.update, keep=args.keep) if args.runs else None
        if args.readme is not None and readme_doc.update(args.readme, args.summaries):
            logging.info("%s: generated blocks rewritten from %s", args.readme, args.summaries)
    except (OSError, ValueError) as e:
        print(f"results_doc: error: {e}", file=sys.stderr)
        return 2
    if block is not None and args.update is None:
        sys.stdout.write(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
