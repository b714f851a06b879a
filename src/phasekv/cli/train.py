"""`phasekv train CONFIG.yaml --out DIR [--set a.b=v ...] [--resume]` (under torchrun for several processes).

Before anything is allocated, a config whose training step would not fit in memory is refused in one line:
`activation_bytes` (a lower bound of what one micro-batch's step holds at once) against the memory free
on the training device (`phasekv.memory.check_budget`); the weights have their own check (`families.check_fits`)."""

from __future__ import annotations

import os

from phasekv.config import REPORT_TO, Experiment, TransformersModelConfig


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="pretrain a model from an experiment YAML")
    p.add_argument("config", help="experiment YAML (sections model, data, train, eval)")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                   help="override a config value (repeatable), e.g. --set train.steps=100")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--report-to", choices=REPORT_TO, help="also log every metrics row to this logger "
                                                        "(= --set train.report_to=...)")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def activation_bytes(exp: Experiment, world: int = 1) -> tuple[int, int]:
    """(sequences per micro-batch, a lower bound of the bytes its step holds at once).  When the loss is computed,
    per token: the float32 logits and their log-softmax (2 V), and what every layer saved for the backward pass, at
    least its input, its attention output, the MLP input (3 hidden) and one MLP intermediate.
    tests/test_reliability.py checks it against the tensors autograd saves plus the logits."""
    micro = max(1, exp.train.batch_size // (world * exp.train.grad_accum))
    model = exp.model.text() if isinstance(exp.model, TransformersModelConfig) else exp.model
    hidden, layers = getattr(model, "hidden_size", 0), getattr(model, "num_hidden_layers", 0)
    per_token = 2 * model.vocab_size + layers * (3 * hidden + (getattr(model, "intermediate_size", None) or 0))
    return micro, micro * exp.data.seq_len * per_token * 4


def run(args) -> None:
    import torch.distributed as dist

    from phasekv.memory import check_budget
    from phasekv.training.loop import train

    overrides = [*args.overrides, *([f"train.report_to={args.report_to}"] if args.report_to else [])]
    exp = Experiment.from_file(args.config, overrides)
    micro, need = activation_bytes(exp, int(os.environ.get("WORLD_SIZE", 1)))
    check_budget(need, f"train: a micro-batch of {micro:,} sequences of {exp.data.seq_len} tokens",
                 device=exp.train.device, bound="at least", advice="lower train.batch_size or raise train.grad_accum")
    try:
        train(exp, args.out, resume=args.resume, progress=not args.no_progress, checks=phase_checks(exp))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def phase_checks(exp: Experiment) -> tuple:
    """The phase check of `train.phase_check_prompts` prompts per phase at each validation (none at 0): the prompts
    in the run's own word vocabulary, at the model's stride."""
    if not exp.train.phase_check_prompts:
        return ()
    from phasekv.api.phase_check import PhaseCheck, phase_metrics

    check = PhaseCheck(every=1, prompts_per_phase=exp.train.phase_check_prompts, data=exp.data,
                       demos=min(2, exp.data.n_records - 1), seed=exp.train.seed)
    return (lambda model: phase_metrics(check.run(model)),)
