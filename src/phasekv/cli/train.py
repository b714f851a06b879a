"""`phasekv train CONFIG.yaml --out DIR [--set a.b=v ...] [--resume]` (under torchrun for several processes)."""

from __future__ import annotations

from phasekv.config import Experiment


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="pretrain a model from an experiment YAML")
    p.add_argument("config", help="experiment YAML (sections model, data, train, eval)")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                   help="override a config value (repeatable), e.g. --set train.steps=100")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def run(args) -> None:
    import torch.distributed as dist

    from phasekv.train import train

    exp = Experiment.from_file(args.config, args.overrides)
    try:
        train(exp, args.out, resume=args.resume, progress=not args.no_progress)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
