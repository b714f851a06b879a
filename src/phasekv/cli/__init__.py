"""The `phasekv` command: a thin map from subcommands to typed library functions.

Each subcommand has one module in this package, listed in `COMMAND_MODULES` (in the order of
`phasekv --help`), which exposes `add_parser(subparsers)`; the parser it adds sets `func`, which turns
the parsed flags into typed arguments and calls one library function.  No library module defines an
argparse parser.  Bad user input becomes one line on stderr and exit status 2 (130 on Ctrl-C; 3 with one line per
violated expectation for a run that missed its `--expect` gate, `GateFailed`), never a traceback (`-v` shows
it); a failure of phasekv itself (RuntimeError, MemoryError, a TypeError ...) is one line
that says "internal error" and asks for a rerun with -v, exit status 1, so a bug never looks like the user's fault;
under torchrun only rank 0 prints it.  An --out that is, holds or lies inside an input is refused before anything
runs, as is an empty --out.  Work is bounded: `phasekv.memory.check_budget` refuses, in one line that states the
budget, settings whose memory (estimated from the settings alone) would not fit.  --no-progress also silences the
progress bars of the libraries under phasekv (transformers' weight loading and GGUF de-quantizing).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

# seconds a failing rank other than 0 waits before exiting (measured: under load torchrun killed rank 0 before it
# printed, when rank 1 failed first)
RANK_ERROR_GRACE_S = 10.0
COMMAND_MODULES = ["demo", "train", "evaluate", "sweep", "theory", "knockout", "gates", "cycle", "grid", "reproduce",
                   "audit", "decide", "train_indexer", "export"]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit 2), like every other error of the command."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="phasekv", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level; full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(f"phasekv.cli.{name}").add_parser(sub)
    return parser


def check_positive(args: argparse.Namespace, *names: str) -> None:
    """Refuse a flag below 1 (`names`: argparse destinations) in one line that names the flag."""
    for name in names:
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {value}")


# flags whose value is something the command reads (a checkpoint, a model directory, a config, a tokenizer...)
INPUT_FLAGS = ("checkpoint", "hf", "config", "tokenizer", "checkpoints", "configs", "format", "reference_hf", "expect",
               "engine_model", "engine_bin", "shards")
POSITIONAL_INPUTS = ("config", "shards")  # `phasekv train CONFIG`, `phasekv audit merge DIR...`
# inputs that are files (a directory there is refused by the command itself)
FILE_INPUTS = ("config", "format", "expect", "engine_bin")  # (--engine-model: a file, or a folder for vLLM)
# flags whose value the command writes: --out is replaced as a whole, the others are written or replaced too
WRITE_FLAGS = ("out", "hf_out", "eval_results", "bundle", "write_expect")


def _flag(name: str) -> str:
    return name if name in POSITIONAL_INPUTS else f"--{name.replace('_', '-')}"


def _given(args: argparse.Namespace, names: tuple[str, ...]) -> Iterator[tuple[str, str]]:
    """(flag name, path) of every path among `names` the command was given (a list flag: each of its paths); with
    --gguf-file, the GGUF file inside --hf or --tokenizer too."""
    for name in names:
        value = getattr(args, name, None)
        for path in value if isinstance(value, list) else [value]:
            if isinstance(path, str) and path:
                yield name, path
    gguf = getattr(args, "gguf_file", None)
    if isinstance(gguf, str) and gguf and "hf" in names:
        for name in ("hf", "tokenizer"):
            folder = getattr(args, name, None)
            if isinstance(folder, str) and folder:
                yield "gguf_file", os.path.join(folder, gguf)


def _relation(target: str, source: str) -> str | None:
    """How the written path `target` meets the path `source`: it "is" it (a symlink or a hard link too), "holds"
    it, or "lies inside" it; None when they are apart."""
    written, given = Path(os.path.realpath(target)), Path(os.path.realpath(source))
    if written == given or (os.path.exists(target) and os.path.exists(source) and os.path.samefile(target, source)):
        return "is"
    return "holds" if written in given.parents else "lies inside" if given in written.parents else None


def check_inputs_untouched(args: argparse.Namespace) -> None:
    """Refuse an empty --out, and any path the command writes (--out, --hf-out, --eval-results, --bundle,
    --write-expect) that is, holds or lies inside one of the command's inputs (a symlink or a hard link to it
    included) or another path it writes: publishing replaces it, so it would overwrite or, with --force, delete what
    the command was given.  Checked before anything runs."""
    if getattr(args, "out", None) == "":
        raise ValueError("--out: is empty; give the path of the output directory")
    inputs = [(name, path) for name, path in _given(args, INPUT_FLAGS) if os.path.exists(path)
              and not (name in FILE_INPUTS and not os.path.isfile(path))]
    writes = list(_given(args, WRITE_FLAGS))
    for i, (flag, target) in enumerate(writes):
        met = [(relation, name, source) for name, source in [*inputs, *writes[i + 1:]]
               if (relation := _relation(target, source)) is not None]
        if met:  # the closest first: the file itself, then a folder holding it
            relation, name, source = min(met, key=lambda m: ("is", "holds", "lies inside").index(m[0]))
            kind = "the output" if name in WRITE_FLAGS else "the input"
            raise ValueError(f"{_flag(flag)} {target}: {relation} {kind} {_flag(name)} {source}; phasekv never "
                             "writes over what it reads or writes twice: choose another path")


@contextlib.contextmanager
def library_bars_off(off: bool, gguf: bool = True) -> Iterator[None]:
    """With `off`: transformers' progress bars are off inside the block, and restored after it: weight loading goes
    through its tqdm switch; with `gguf`, GGUF de-quantizing, which calls tqdm directly, gets its module's tqdm
    swapped for a disabled one (importing that module costs a second, so only when a GGUF file is read)."""
    if not off:
        yield
        return
    from transformers.utils import logging as hf_logging

    gguf_utils = None
    if gguf:
        with contextlib.suppress(ImportError):  # transformers without its GGUF loader
            from transformers import modeling_gguf_pytorch_utils as gguf_utils
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    original = getattr(gguf_utils, "tqdm", None)
    if original is not None:
        gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        if original is not None:
            gguf_utils.tqdm = original
        if was_on:
            hf_logging.enable_progress_bar()


# flags whose value means the command loads a transformers model or tokenizer
_TRANSFORMERS_FLAGS = ("hf", "tokenizer", "reference_hf", "gguf_file")


def _one_line(exc: BaseException) -> str:
    """The error as one line: the message, or the exception type for errors without one."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, OSError) and exc.filename is not None and str(exc.filename) not in text:
        text = f"{exc.filename}: {text}"
    return text[:500]


class GateFailed(Exception):
    """A run that completed and violated the expectations it was given (`phasekv audit --expect`): its `lines` go to
    stderr and the exit status is 3, distinct from bad input (2) and from phasekv's own failures (1)."""

    def __init__(self, lines: list[str]):
        super().__init__(f"{len(lines)} expectations violated")
        self.lines = lines


def _user_errors() -> tuple[type[BaseException], ...]:
    import pickle

    from safetensors import SafetensorError

    return (ValueError, OSError, pickle.UnpicklingError, SafetensorError, UnicodeError)


# failures of phasekv itself (or of a library under it), not of the input: one line that says so, exit 1
_INTERNAL = (RuntimeError, MemoryError, RecursionError, TypeError, KeyError, IndexError, AttributeError, AssertionError)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["audit", "merge"]:  # `phasekv audit merge DIR...`: its own parser (audit's are flags only)
        argv = ["audit-merge", *argv[2:]]
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    from phasekv.distributed import is_main

    quiet = getattr(args, "no_progress", False) and (
        "transformers" in sys.modules or any(getattr(args, name, None) for name in _TRANSFORMERS_FLAGS))
    previous = signal.signal(signal.SIGTERM, _interrupt) if threading.current_thread() is threading.main_thread() \
        else None
    try:
        check_inputs_untouched(args)
        with library_bars_off(quiet, gguf=bool(getattr(args, "gguf_file", None))):
            args.func(args)
    except GateFailed as failed:
        if is_main():
            print("\n".join(failed.lines), file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        if is_main():
            kept = " (its answers are journaled: --resume continues it)" if getattr(args, "endpoint", None) else ""
            print(f"phasekv {args.command}: interrupted{kept}", file=sys.stderr)
        return 130
    except _user_errors() as exc:
        if args.verbose:
            traceback.print_exc()
        if is_main():
            print(f"phasekv {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        else:  # torchrun stops every rank as soon as one exits: give rank 0 the time to print the error
            time.sleep(RANK_ERROR_GRACE_S)
        return 2
    except _INTERNAL as exc:
        if args.verbose:
            traceback.print_exc()
        if is_main():
            print(f"phasekv {args.command}: internal error: {type(exc).__name__}: {_one_line(exc)} (if the input is "
                  "valid this is a bug in phasekv; rerun with -v for the traceback)", file=sys.stderr)
        else:
            time.sleep(RANK_ERROR_GRACE_S)
        return 1
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return 0


def _interrupt(signum, frame):
    """SIGTERM as Ctrl-C: the command stops the way an interrupted one does (journals kept, partial summaries
    written, launched engines stopped), not killed mid-write."""
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
