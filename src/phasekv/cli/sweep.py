"""`phasekv sweep`: P(a) - P(b) as a filler grows one token at a time, and the period of its ranking."""

from __future__ import annotations

from typing import Any


def add_parser(sub) -> None:
    p = sub.add_parser("sweep", help="shift sweep: P(a) - P(b) as a filler grows one token at a time, and its period")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="phasekv checkpoint or run directory (texts are words of its vocabulary)")
    src.add_argument("--hf", help="transformers causal LM: local directory or hub name (texts use its tokenizer)")
    p.add_argument("--text", required=True, help="fixed text after the filler, e.g. 'T.Cast(FP'")
    p.add_argument("--a", required=True, help="first candidate continuation")
    p.add_argument("--b", required=True, help="second candidate continuation")
    p.add_argument("--filler", help="one filler token (checkpoint: a word of its fillers group, default the first; "
                                    "HF: a string that is exactly one token, default ' the')")
    p.add_argument("--max-filler", type=int, default=64, help="filler lengths 0..N are swept (N + 1 rankings)")
    p.add_argument("--max-period", type=int, default=16, help="largest period considered")
    p.add_argument("--prefix", help="text before the filler, instead of the default bos token (HF without bos: eos)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--force", action="store_true", help="replace an existing non-empty --out")
    p.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="float32", help="HF models: torch dtype, e.g. bfloat16")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args) -> dict[str, Any]:
    from phasekv.evaluate.sources import Source
    from phasekv.evaluate.sweep import sweep_source
    from phasekv.outputs import output_dir

    source = Source(checkpoint=args.checkpoint, hf=args.hf)
    with output_dir(args.out, args.force) as tmp:
        return sweep_source(source, args.text, args.a, args.b, tmp, filler=args.filler, prefix=args.prefix,
                            max_filler=args.max_filler, max_period=args.max_period, device=args.device,
                            dtype=args.dtype, progress=not args.no_progress)
