"""The flags several commands share, defined and checked once: the model source (--checkpoint, --hf, --endpoint and
its flags), the prompt set, the run (batch size, device, dtype, threads), and the --reference-hf rule.

`eval`, the probes (knockout, gates, cycle, grid), `audit` and `export lm-eval` build their parsers from these.
Settings come from the checkpoint's `eval` section; every flag given overrides it.  Everything is checked before
anything loads: a flag only --hf models read is refused with --checkpoint (never silently ignored), a --format file
is read, and a prompt set whose size alone would not fit in memory is refused (`check_prompt_count`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from phasekv.config import EVAL_PROTOCOLS
from phasekv.data.formats import FORMATS

# flag -> EvalConfig field, for the flags that describe the prompt set and the run
_EVAL_FLAGS = ("protocol", "stride", "residue_modulus", "records", "demos", "clusters", "targets_per_context",
               "key_tokens", "value_tokens", "local_window", "batch_size", "one_by_one", "seed", "device", "dtype",
               "device_map", "format", "chat", "gguf_file", "threads")


def add_source_arguments(p, hf_help: str = "transformers causal LM: local directory or hub name"):
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="phasekv checkpoint or run directory")
    src.add_argument("--hf", help=hf_help)
    return src


def add_endpoint_arguments(p, source) -> None:
    """--endpoint (one more choice of the `source` group) and its flags (shared by eval and audit), into `p` (a parser
    or an argument group); the --api names come from the engines' registry."""
    from phasekv.engines.registry import apis

    source.add_argument("--endpoint", metavar="URL", nargs="+",
                        help="an inference engine serving the model, e.g. http://127.0.0.1:8080 (llama.cpp, vLLM, "
                             "SGLang); several URLs: replicas of one model, the requests spread over them")
    names = ", ".join(f"{name} ({api.path})" for name, api in apis().items())
    p.add_argument("--api", help=f"--endpoint: the engine API: {names}; default llamacpp")
    p.add_argument("--tokenizer", metavar="DIR", help="--endpoint: the served model's tokenizer (prompts are sent as "
                                                      "its token ids; with --gguf-file, read from that GGUF file)")
    p.add_argument("--model", help="--endpoint: the served model's name (default: the one model the server serves)")
    p.add_argument("--concurrency", type=int, help="--endpoint: requests in flight at once per server (default 1)")
    p.add_argument("--reuse-prefix", action="store_true", help="--endpoint: send a context's queries back to back "
                                                               "with the engine's prompt cache on (default: off)")
    p.add_argument("--timeout", type=float, help="--endpoint: seconds one request may take (default 600)")
    p.add_argument("--resume", action="store_true", help="--endpoint: continue the journal of a killed or failed "
                                                         "run (only unanswered prompts are sent)")


# the flags only an --endpoint reads (their defaults are None or False, so a given one is seen)
ENDPOINT_ONLY = ("api", "tokenizer", "model", "concurrency", "reuse_prefix", "timeout", "resume")
# the flags only an in-process transformers model reads; with --endpoint, that is the --reference-hf model
IN_PROCESS_ONLY = ("dtype", "device", "device_map")


def add_launch_arguments(p, source) -> None:
    """--launch NAME (one more choice of the `source` group: phasekv starts the engine itself, once per point of
    --engine-grid) and its flags, into `p` (a parser or an argument group); the engine names and their settings come
    from the engines' registry.  The --tokenizer, --timeout and --resume of the --endpoint flags apply too."""
    from phasekv.engines.registry import launchers

    engines = launchers()
    source.add_argument("--launch", metavar="ENGINE", help=f"start this engine ({', '.join(engines)}) for each point "
                                                           "of --engine-grid, audit each point with --reference-hf")
    p.add_argument("--engine-bin", metavar="PATH", help="--launch: the engine's binary (default: where its install "
                                                        "step puts it: make engine llama-server, make vllm vLLM's "
                                                        "Python)")
    p.add_argument("--engine-model", metavar="FILE", help="--launch: the model the engine serves (default: "
                                                          "--tokenizer's --gguf-file, or the --tokenizer folder for "
                                                          "an engine that serves folders)")
    settings = "; ".join(f"{name}: {', '.join(engine.settings)}" for name, engine in engines.items())
    p.add_argument("--engine-grid", nargs="+", default=[], metavar="KEY=V1,V2",
                   help=f"--launch: engine settings to vary, every combination one point ({settings}), e.g. "
                        "ubatch=16,64 flash_attn=on,off")
    p.add_argument("--engine-context", type=int, default=4096, help="--launch: the engine's context in tokens "
                                                                    "(per slot)")
    p.add_argument("--engine-checks", nargs="+", default=[], choices=("decode", "prefix", "batch"), metavar="CHECK",
                   help="--launch: per point, also decode (greedy multi-token answers vs the teacher-forced "
                        "reference), prefix (answers served from the prefix cache vs cold), batch (batched with "
                        "neighbours of other lengths vs alone)")
    p.add_argument("--decode-steps", type=int, default=6, help="--engine-checks decode: tokens generated per prompt")
    p.add_argument("--batch-width", type=int, default=4, help="--engine-checks batch: requests batched together "
                                                              "(the server gets as many slots)")
    p.add_argument("--check-prompts", type=int, default=0, help="--engine-checks: prompts per check (0: all of the "
                                                                "query protocol's, else the first protocol's)")


def endpoint_options(args):
    """The EndpointOptions of the --endpoint flags (unset ones at EndpointOptions' defaults)."""
    from phasekv.engines.client import EndpointOptions

    given = {name: getattr(args, name) for name in ("api", "concurrency", "timeout") if getattr(args, name) is not None}
    return EndpointOptions(args.endpoint[0], replicas=tuple(args.endpoint[1:]), tokenizer=args.tokenizer,
                           gguf_file=getattr(args, "gguf_file", None), model=args.model,
                           reuse_prefix=args.reuse_prefix, resume=args.resume, **given)


def check_source_flags(args) -> None:
    """Refuse a flag the chosen model source would ignore: an --endpoint flag with --hf or --checkpoint, an
    in-process flag (--dtype, --device, --device-map) with an --endpoint that has no --reference-hf to apply it to;
    with --endpoint, every endpoint flag is checked too (URL, API, concurrency, timeout, --reuse-prefix); with
    --launch, the endpoint flags apply to the engine phasekv starts."""
    endpoint = getattr(args, "endpoint", None)
    launched = getattr(args, "launch", None) is not None  # phasekv starts the engine: its flags apply too
    if endpoint is None and not launched:
        source = "--hf" if getattr(args, "hf", None) is not None else "--checkpoint"
        for name in ENDPOINT_ONLY:
            value = getattr(args, name, None)
            if value is not None and value is not False:  # 0 is given (`0 in (None, False)` would say it is not)
                raise ValueError(f"--{name.replace('_', '-')}: applies to --endpoint only, not to {source}: drop it")
        return
    from phasekv.engines.client import check_endpoint_options

    for name in IN_PROCESS_ONLY:
        if getattr(args, name, None) is not None and (name == "device_map" or args.reference_hf is None):
            raise ValueError(f"--{name.replace('_', '-')}: applies to an in-process model (--hf, or --reference-hf "
                             "beside --endpoint); the engine chooses its own: drop it")
    if endpoint is not None:
        check_endpoint_options(endpoint_options(args))
    check_reference_path(args)


def add_prompt_arguments(p) -> None:
    """The flags that choose a model and build its prompt set (shared by eval and the probes).
    Unset flags are absent from the namespace, so the checkpoint's `eval` section applies."""
    quiet = argparse.SUPPRESS
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--force", action="store_true", help="replace an existing non-empty --out")
    add_prompt_set_arguments(p)
    p.add_argument("--batch-size", type=int, default=quiet, help="query rows per forward (default: 256 checkpoints, "
                                                                 "32 HF)")
    p.add_argument("--one-by-one", action="store_true", default=quiet, help="one forward per prompt (no shared "
                                                                            "prefill)")
    p.add_argument("--device", default=quiet, help="auto (default), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default=quiet, help="HF models: torch dtype, e.g. bfloat16")
    p.add_argument("--device-map", default=quiet, help="HF models: e.g. 'auto' to spread a large model over GPUs")
    p.add_argument("--gguf-file", default=quiet, help="HF models: a GGUF file inside the --hf directory")
    p.add_argument("--threads", type=int, default=quiet, help="torch CPU threads (default: torch's; use 1 when "
                                                              "several runs share the cores)")
    p.add_argument("--no-progress", action="store_true")


def add_prompt_set_arguments(p) -> None:
    """The flags that describe the prompt set (shared by eval, the probes and export)."""
    quiet = argparse.SUPPRESS
    p.add_argument("--protocol", choices=EVAL_PROTOCOLS, default=quiet, help="padding protocol (default prefix); "
                   "query: the target fixed, the prompt length varied (the query phase, source x query cells)")
    p.add_argument("--stride", type=int, default=quiet, help="phase stride S (default: the model's; 8 without "
                                                             "compression)")
    p.add_argument("--residue-modulus", type=int, default=quiet, help="residues R (default 24)")
    p.add_argument("--records", type=int, default=quiet, help="records per prompt (checkpoint: its training value; "
                                                              "HF: 64, 24 with --format)")
    p.add_argument("--demos", type=int, default=quiet, help="demonstrations per prompt (default 8)")
    p.add_argument("--clusters", type=int, default=quiet, help="logical examples (default: exact position matching)")
    p.add_argument("--targets-per-context", type=int, default=quiet)
    p.add_argument("--key-tokens", type=int, default=quiet, help="tokens per key (needle test: 2 keys + 2 values)")
    p.add_argument("--value-tokens", type=int, default=quiet)
    p.add_argument("--local-window", type=int, default=quiet, help="targets lie outside this many final tokens "
                                                                   "(HF default 16)")
    p.add_argument("--seed", type=int, default=quiet)
    p.add_argument("--format", default=quiet, help=f"HF models: prompt format ({', '.join(FORMATS)} or a YAML "
                                                   "file); default: bare single-token words")
    p.add_argument("--chat", action="store_true", default=quiet, help="HF models: wrap the --format prompts in the "
                                                                      "tokenizer's chat template")


def given_flags(args) -> dict[str, Any]:
    """EvalConfig fields of the flags given on the command line (unset flags are absent)."""
    return {name: getattr(args, name) for name in _EVAL_FLAGS if hasattr(args, name)}


# EvalConfig fields only a transformers model (--hf) reads: with --checkpoint they are refused, not ignored
HF_ONLY = ("format", "chat", "gguf_file", "device_map", "dtype")
# bytes one prompt holds at least through an evaluation (its share of the context's ids, its query, its prediction
# record): tracemalloc measured 820-1220 per prompt (tests/test_reliability.py checks this bound)
PROMPT_BYTES = 512


def source_and_config(args):
    """(Source, EvalConfig) from parsed flags: the checkpoint's eval section, overridden by given flags; flags that
    would be ignored, and prompt sets too large for memory, are refused before anything is loaded."""
    from phasekv.evaluate.sources import Source, eval_config

    source = Source(checkpoint=getattr(args, "checkpoint", None), hf=getattr(args, "hf", None))
    given = given_flags(args)
    cfg = eval_config(source, given)
    if source.checkpoint is not None:
        for name in HF_ONLY:
            if name in given or (name != "dtype" and getattr(cfg, name)):
                flag = f"--{name.replace('_', '-')}" if name in given else f"eval.{name} (the checkpoint's config.json)"
                raise ValueError(f"{flag}: applies to --hf models only; a phasekv checkpoint is evaluated on its own "
                                 "vocabulary, in float32: drop it")
    elif cfg.format is not None:  # a broken format file is refused before the model loads
        from phasekv.data.formats import load_format

        load_format(cfg.format, cfg.chat)
    check_prompt_count(prompts_at_least(cfg))
    return source, cfg


def check_eval_results(args) -> None:
    """--eval-results DIR (audit, eval): refused before anything runs when DIR holds other files (DIR = --out, or
    one inside the other, is refused earlier with every other pair of outputs: `cli.check_inputs_untouched`)."""
    from pathlib import Path

    from phasekv.outputs import check_output_dir

    if args.eval_results:
        check_output_dir(Path(args.eval_results), args.force)


def apply_target_mde(args, conditions: int) -> None:
    """`phasekv audit --target-mde PP`: the fewest prompts per phase whose detectable gap on the simulated audit
    designs is at most PP (`phasekv.evaluate.sizing.prompts_per_phase_for`, docs/power.md) replace
    --prompts-per-phase, and one line says the choice and its cost (`conditions`: the conditions each protocol's
    prompts run under).  Nothing for an audit without the flag."""
    import math

    from phasekv.evaluate.sizing import MATERIAL_GAP_PP, detectable_gap_pp, prompts_per_phase_for

    target = getattr(args, "target_mde", None)
    if target is None:
        return
    if not (math.isfinite(target) and target > MATERIAL_GAP_PP):
        raise ValueError(f"--target-mde: must be a finite gap above the material minimum {MATERIAL_GAP_PP:g} pp "
                         f"(no size detects less), got {target:g}")
    args.prompts_per_phase = n = prompts_per_phase_for(target)
    prompts = n * args.stride
    print(f"--target-mde {target:g} pp: {n} prompts per phase (the gap found 80% of the time: about "
          f"{detectable_gap_pp(n):.1f} pp on the simulated audit designs, docs/power.md); cost: {prompts:,} prompts "
          f"per protocol and condition or more (whole clusters), {prompts * len(set(args.protocol)) * conditions:,} "
          f"in all")


def prompts_at_least(cfg) -> int:
    """A lower bound of the prompts an EvalConfig describes, from the settings alone: build_eval_set makes
    n_clusters x R contexts of targets_per_context prompts; unset, the targets are R / g and the clusters a multiple
    of g (g = gcd(record pitch, R) divides both), so there are at least R x max(clusters, R) prompts."""
    r, clusters, targets = cfg.residue_modulus, cfg.clusters, cfg.targets_per_context
    if targets:
        return r * targets * (clusters or 1)
    return r * max(clusters or 1, r)


def check_prompt_count(prompts: int, flags: str = "--clusters, --targets-per-context, --residue-modulus") -> None:
    """Refuse, before anything is built, a prompt set whose bookkeeping alone (PROMPT_BYTES a prompt) exceeds the
    memory available now; `flags`: those that set its size."""
    from phasekv.memory import check_budget

    check_budget(prompts * PROMPT_BYTES, f"prompt set: {prompts:,} prompts or more", bound="at least",
                 advice=f"lower {flags}")


def vocabulary_fingerprint(tokenizer) -> str:
    """A tokenizer's vocabulary, identified: a hash of its (token, id) pairs."""
    import hashlib
    import json

    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()[:16]


def check_reference_path(args) -> None:
    """A --reference-hf that is missing (a local path that does not exist, or a --gguf-file not inside it) is
    refused in one line before anything loads."""
    import os
    import re

    given = getattr(args, "reference_hf", None)
    if given is None:
        return
    if not os.path.isdir(given) and (os.path.exists(given) or not re.fullmatch(r"[\w.-]+/[\w.-]+", given)):
        raise ValueError(f"--reference-hf {given}: no such model directory (the served model's weights in "
                         "transformers, for the comparison)")
    gguf = getattr(args, "gguf_file", None)
    if gguf and os.path.isdir(given) and not os.path.isfile(os.path.join(given, gguf)):
        raise ValueError(f"--reference-hf {given}: holds no GGUF file {gguf} (--gguf-file)")


def check_reference_model(args, reference_tokenizer, tokenizer, served: str | None = None) -> None:
    """Refuse, in one line, a --reference-hf of another model than the one served: another vocabulary than the
    served model's tokenizer (--tokenizer), or, when both are GGUF files (--launch with --gguf-file), other weights
    than the served file's.  Compared otherwise, it would read as a served model that disagrees with itself."""
    import os

    ours, theirs = vocabulary_fingerprint(tokenizer), vocabulary_fingerprint(reference_tokenizer)
    if ours != theirs:
        raise ValueError(f"--reference-hf {args.reference_hf}: its vocabulary ({len(reference_tokenizer)} tokens, "
                         f"fingerprint {theirs}) is not the served model's (--tokenizer {args.tokenizer}: "
                         f"{len(tokenizer)} tokens, {ours}): a reference of another model; give the served weights")
    gguf = getattr(args, "gguf_file", None)
    if served is None or not gguf or not str(served).endswith(".gguf"):
        return
    reference = os.path.join(args.reference_hf, gguf)
    if os.path.isfile(reference) and not os.path.samefile(reference, served):
        from phasekv.export.gguf_check import weights_fingerprint

        mine, other = weights_fingerprint(Path(served)), weights_fingerprint(Path(reference))
        if mine != other:
            raise ValueError(f"--reference-hf {args.reference_hf}: its weights {reference} (fingerprint {other}) are "
                             f"not the served model's {served} ({mine}): a reference of another model; give the "
                             "served weights")
