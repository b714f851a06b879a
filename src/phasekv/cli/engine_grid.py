"""`phasekv audit --launch llama-server [--engine-bin PATH] [--engine-model FILE] --engine-grid ubatch=16,64 ...
--tokenizer DIR [--gguf-file NAME] --reference-hf DIR --out OUT`: the engine started by phasekv once per grid point
(`phasekv.evaluate.engine_grid`).  Every flag and every grid value is checked before the reference loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def grid_of(args):
    """The EngineGrid the flags describe (checked: the engine, its binary, the model file, every grid value)."""
    from phasekv.adapters.launchers import default_binary, launcher, parse_grid
    from phasekv.evaluate.engine_grid import EngineGrid

    engine = launcher(args.launch)
    points = parse_grid(engine, args.engine_grid)
    binary = Path(args.engine_bin) if args.engine_bin else default_binary(engine)
    if not binary.is_file():
        raise ValueError(f"--engine-bin {binary}: no such file (make engine builds llama-server)")
    if args.engine_model:
        model = Path(args.engine_model)
    elif args.tokenizer and args.gguf_file:
        model = Path(args.tokenizer) / args.gguf_file
    else:
        raise ValueError("--launch: needs --engine-model FILE (the file the engine serves) or --tokenizer DIR with "
                         "--gguf-file NAME")
    if not model.is_file():
        raise ValueError(f"--engine-model {model}: no such file")
    if args.tokenizer is None:
        raise ValueError("--launch: needs --tokenizer DIR (the served model's tokenizer)")
    if args.engine_context < 1:
        raise ValueError(f"--engine-context: must be >= 1, got {args.engine_context}")
    return EngineGrid(engine, binary, model, tuple(points), context=args.engine_context, timeout=args.timeout)


def run_launched(args) -> dict[str, Any]:
    from phasekv.adapters.hf import load_hf, load_tokenizer
    from phasekv.config import audit_config
    from phasekv.evaluate.engine_grid import check_work_dir, run_grid
    from phasekv.outputs import check_output_dir

    grid = grid_of(args)
    check_output_dir(Path(args.out), args.force)
    check_work_dir(args.out, resume=args.resume, force=args.force)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    cfg = audit_config(format=args.format, chat=args.chat, records=args.records, demos=args.demos, stride=args.stride,
                       local_window=args.local_window, batch_size=args.batch_size, seed=args.seed, device=args.device,
                       dtype=args.dtype, threads=args.threads, gguf_file=args.gguf_file)
    tokenizer = load_tokenizer(args.tokenizer, args.gguf_file, flag="--tokenizer")
    reference = None
    if args.reference_hf is not None:
        reference, _ = load_hf(args.reference_hf, args.device, args.dtype, gguf_file=args.gguf_file)
    summary = run_grid(grid, tokenizer, cfg, args.out, protocols=tuple(dict.fromkeys(args.protocol)),
                       per_phase=args.prompts_per_phase, reference=reference, force=args.force, resume=args.resume,
                       progress=not args.no_progress)
    for row in summary["rows"]:
        if "failed" in row:
            print(f"{row['point']:>40}  {row['protocol']}: failed: {row['failed']}")
            continue
        line = f"{row['point']:>40}  {row['protocol']}: {100 * row['accuracy']:.1f}%, {row['verdict']}"
        if "query_verdict" in row:
            line += f"; query phase: {row['query_verdict']}"
        if "agree" in row:
            line += f"; {row['agree']}/{row['n']} greedy tokens agree with the reference"
        print(line)
    return summary
