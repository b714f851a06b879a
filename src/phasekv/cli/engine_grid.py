"""`phasekv audit --launch llama-server [--engine-bin PATH] [--engine-model FILE] --engine-grid ubatch=16,64 ...
--tokenizer DIR [--gguf-file NAME] --reference-hf DIR --out OUT`: the engine started by phasekv once per grid point
(`phasekv.audit.engine_grid`); `--launch vllm` serves the --tokenizer folder (or --engine-model DIR) with the
Python of `make vllm`'s environment.  Every flag and every grid value is checked before the reference loads."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def grid_of(args):
    """The EngineGrid the flags describe (checked: the engine, its binary, the model file, every grid value)."""
    from phasekv.audit.engine_grid import EngineGrid
    from phasekv.engines.base import parse_grid
    from phasekv.engines.registry import default_binary, launcher

    engine = launcher(args.launch)
    points = parse_grid(engine, args.engine_grid)
    binary = Path(args.engine_bin) if args.engine_bin else default_binary(engine)
    if not binary.is_file():
        raise ValueError(f"--engine-bin {binary}: no such file ({engine.install})")
    model = served_model(engine, args)
    if args.tokenizer is None:
        raise ValueError("--launch: needs --tokenizer DIR (the served model's tokenizer)")
    if args.timeout is not None and (isinstance(args.timeout, bool) or not args.timeout > 0
                                     or args.timeout == float("inf")):
        raise ValueError(f"--timeout: must be a finite number of seconds > 0, got {args.timeout}")
    for name in ("engine_context", "decode_steps", "batch_width"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.check_prompts < 0:
        raise ValueError(f"--check-prompts: must be >= 0, got {args.check_prompts}")
    if "decode" in args.engine_checks and args.reference_hf is None:
        raise ValueError("--engine-checks decode: compares with the reference: needs --reference-hf")
    slots = args.batch_width if "batch" in args.engine_checks else 1
    for point in points:
        engine.limits(point, context=args.engine_context * slots, slots=slots)
    return EngineGrid(engine, binary, model, tuple(points), context=args.engine_context * slots, slots=slots,
                      reuse_prefix=args.reuse_prefix, **({} if args.timeout is None else {"timeout": args.timeout}))


def served_model(engine, args) -> Path:
    """What the engine serves: --engine-model, else llama-server's --tokenizer/--gguf-file, vLLM's --tokenizer DIR
    (a safetensors folder is its own tokenizer); a file or a folder as the engine needs."""
    folder = engine.serves == "folder"
    if args.engine_model:
        model = Path(args.engine_model)
    elif folder and args.tokenizer and not args.gguf_file:
        model = Path(args.tokenizer)
    elif not folder and args.tokenizer and args.gguf_file:
        model = Path(args.tokenizer) / args.gguf_file
    elif folder:
        raise ValueError(f"--launch {engine.name}: serves a model folder (safetensors): needs --engine-model DIR or "
                         "--tokenizer DIR without --gguf-file")
    else:
        raise ValueError("--launch: needs --engine-model FILE (the file the engine serves) or --tokenizer DIR with "
                         "--gguf-file NAME")
    if folder and not (model / "config.json").is_file():
        raise ValueError(f"--engine-model {model}: not a model folder (no config.json); {engine.name} serves "
                         "safetensors folders")
    if not folder and not model.is_file():
        raise ValueError(f"--engine-model {model}: no such file")
    return model


def checks_of(args) -> dict:
    """The per-point checks --engine-checks names, in the order of the grid's table."""
    from phasekv.audit.decode import decode_check
    from phasekv.audit.engine_paths import paths_check

    limit = args.check_prompts or None
    made = {"decode": lambda: decode_check(args.decode_steps, limit),
            "prefix": lambda: paths_check("prefix", limit=limit),
            "batch": lambda: paths_check("batch", args.batch_width, limit)}
    return {name: made[name]() for name in ("decode", "prefix", "batch") if name in args.engine_checks}


def run_launched(args) -> dict[str, Any]:
    from phasekv.adapters.hf import load_hf, load_tokenizer
    from phasekv.audit.engine_grid import check_work_dir, run_grid
    from phasekv.config import audit_config
    from phasekv.outputs import check_output_dir

    grid = grid_of(args)
    check_output_dir(Path(args.out), args.force)
    check_work_dir(args.out, resume=args.resume, force=args.force)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    cfg = audit_config(format=args.format, chat=args.chat, records=args.records, demos=args.demos, stride=args.stride,
                       local_window=args.local_window, batch_size=args.batch_size, seed=args.seed,
                       device=args.device or "auto", dtype=args.dtype or "float32", threads=args.threads,
                       gguf_file=args.gguf_file)
    tokenizer = load_tokenizer(args.tokenizer, args.gguf_file, flag="--tokenizer")
    reference = None
    if args.reference_hf is not None:
        reference, _ = load_hf(args.reference_hf, args.device or "auto", args.dtype or "float32",
                               gguf_file=args.gguf_file)
    summary = run_grid(grid, tokenizer, cfg, args.out, protocols=tuple(dict.fromkeys(args.protocol)),
                       per_phase=args.prompts_per_phase, reference=reference, checks=checks_of(args), force=args.force,
                       resume=args.resume, progress=not args.no_progress)
    for row in summary["rows"]:
        if "failed" in row:
            print(f"{row['point']:>40}  {row['protocol']}: failed: {row['failed']}")
            continue
        line = f"{row['point']:>40}  {row['protocol']}: {100 * row['accuracy']:.1f}%, {row['verdict']}"
        if "query_verdict" in row:
            line += f"; query phase: {row['query_verdict']}"
        if "agree" in row:
            line += f"; {row['agree']}/{row['n']} greedy tokens agree with the reference"
        for check in ("decode", "prefix", "batch"):
            if f"{check}_agreement" in row:
                line += f"; {check}: {100 * row[f'{check}_agreement']:.1f}% of {row[f'{check}_n']} agree"
        print(line)
    return summary
