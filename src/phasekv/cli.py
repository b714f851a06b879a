"""The `phasekv` command: a thin map from subcommands to typed functions.

Each subcommand lives in its own module, which exposes `add_parser(subparsers)`; the parser it
adds sets `func`, called with the parsed arguments.  Bad user input (ValueError, FileNotFoundError)
becomes one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMAND_MODULES = [
    "phasekv.demo",
    "phasekv.train",
    "phasekv.evaluate.cli",
    "phasekv.evaluate.sweep",
    "phasekv.theory.cli",
    "phasekv.probes.cli",
    "phasekv.report.reproduce",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phasekv", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"phasekv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"phasekv {args.command}: interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
