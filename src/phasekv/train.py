"""Pretraining from scratch: `phasekv train CONFIG.yaml [--set a.b=v ...] --out DIR [--resume]`.

AdamW with linear warmup and cosine decay, gradient clipping and accumulation, everything seeded.
One process, or DistributedDataParallel under `torchrun --nproc_per_node=N` (gloo on CPU, nccl on
GPU); rank 0 logs and checkpoints, each rank reads its own shard of every global batch.

The loss of a step is the token mean over the whole global batch (all micro-batches, all ranks):
each micro-batch contributes sum(token losses) / (global supervised tokens), so 1 and N processes
optimize the same objective on the same data, and a resumed run reproduces an uninterrupted one.

Run directory: config.json (the resolved experiment), metrics.jsonl (one JSON line per logged
step), checkpoints/step_NNNNNN/ (model, optimizer and trainer state, gate snapshot), latest,
gates/step_NNNNNN.safetensors (every checkpoint's gate parameters, for gate trajectories).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from phasekv.checkpoint import load_tensors, resolve, save_checkpoint, write_atomic, write_json_atomic
from phasekv.config import ModelConfig, _only_known, apply_overrides, load_yaml
from phasekv.data.lookup import DataConfig, TrainingStream
from phasekv.data.vocab import Vocabulary
from phasekv.model import build_model

log = logging.getLogger(__name__)


@dataclass
class TrainConfig:
    steps: int = 1000
    batch_size: int = 64  # global batch (sequences per optimizer step, all ranks, all micro-batches)
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    gate_lr_mult: float = 1.0  # learning-rate multiplier of the compressor gates (Z, b)
    seed: int = 42
    log_every: int = 10
    eval_every: int = 100
    eval_sequences: int = 256
    checkpoint_every: int = 200
    keep_checkpoints: int = 2
    device: str = "auto"  # "auto", "cpu", "cuda"
    threads: int = 0  # torch CPU threads (0: torch's default)
    save_dtype: str = "float32"  # dtype of the final model.safetensors ("float16" for bundling)

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "grad_accum", "log_every", "eval_every", "eval_sequences",
                     "checkpoint_every", "keep_checkpoints"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"train.{name}: must be a positive integer, got {value!r}")
        if self.warmup_steps < 0 or self.warmup_steps > self.steps:
            raise ValueError(f"train.warmup_steps: must be in [0, steps={self.steps}], got {self.warmup_steps}")
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1):
            raise ValueError(f"train.lr / train.min_lr_ratio: need lr > 0 and 0 <= min_lr_ratio <= 1, "
                             f"got {self.lr}, {self.min_lr_ratio}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"train.device: must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.save_dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"train.save_dtype: must be float32, float16 or bfloat16, got {self.save_dtype!r}")

    def lr_at(self, step: int) -> float:
        """Linear warmup to lr, then cosine to lr * min_lr_ratio at the last step."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class Experiment:
    model: ModelConfig
    data: DataConfig
    train: TrainConfig
    tree: dict[str, Any]  # the resolved experiment as plain data (written to config.json)

    @classmethod
    def from_tree(cls, tree: dict[str, Any]) -> Experiment:
        for section in ("model", "data", "train"):
            if not isinstance(tree.get(section, {}), dict):
                raise ValueError(f"{section}: section must be a mapping")
        unknown = sorted(set(tree) - {"model", "data", "train", "eval", "vocab", "notes"})
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown section; known: model, data, train, eval, notes")
        model = ModelConfig.from_dict(tree["model"])
        data = DataConfig(**_only_known(DataConfig, tree.get("data", {}), "data"))
        train = TrainConfig(**_only_known(TrainConfig, tree.get("train", {}), "train"))
        if data.local_window != model.local_window:
            raise ValueError(f"data.local_window: {data.local_window} differs from model.local_window="
                             f"{model.local_window}; retrieval must be scored outside the model's raw window")
        resolved = {"model": model.to_dict(), "data": dataclasses.asdict(data), "train": dataclasses.asdict(train)}
        for extra in ("eval", "notes"):
            if extra in tree:
                resolved[extra] = tree[extra]
        return cls(model, data, train, resolved)

    @classmethod
    def from_file(cls, path: str | Path, overrides: list[str] = ()) -> Experiment:
        return cls.from_tree(apply_overrides(load_yaml(path), list(overrides)))


# ----------------------------------------------------------------------------- distributed


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, value: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(value)
        return value

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def setup_distributed(device: str) -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if world == 1:
        return Dist(device=torch.device("cuda" if use_cuda else "cpu"))
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    dev = torch.device(f"cuda:{local}") if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    return Dist(rank, world, dev)


# ----------------------------------------------------------------------------- trainer


def gate_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every compressor parameter (gates, biases, payload maps): the gate-trajectory snapshot."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".compressor." in n}


def token_losses(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over supervised labels (labels already aligned to ids)."""
    logits = model(ids)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")


@torch.no_grad()
def evaluate_validation(model: torch.nn.Module, batches, device) -> dict[str, float]:
    """Validation loss (mean over supervised tokens) and lookup accuracy (top-1 at query answers)."""
    was_training = model.training
    model.eval()
    loss_sum, tokens, correct, queries = 0.0, 0, 0, 0
    for ids, labels, answer_mask in batches:
        ids, labels, answer_mask = ids.to(device), labels.to(device), answer_mask.to(device)
        logits = model(ids).float()
        valid = labels != -100
        loss_sum += F.cross_entropy(logits[valid], labels[valid], reduction="sum").item()
        tokens += int(valid.sum())
        hit = logits.argmax(-1) == labels
        correct += int((hit & answer_mask).sum())
        queries += int(answer_mask.sum())
    model.train(was_training)
    return {"val_loss": loss_sum / max(tokens, 1), "val_lookup_acc": correct / max(queries, 1)}


def is_gate_parameter(name: str) -> bool:
    """Compressor gate maps Z and biases b (not the payload maps C)."""
    return ".compressor." in name and ("_gate" in name)


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with three groups: matrices (decayed), vectors and embeddings (not decayed), and the
    compressor gates (not decayed, so decay does not pull them towards uniform; lr * gate_lr_mult)."""
    groups: dict[str, list] = {"decay": [], "no_decay": [], "gates": []}
    for n, p in model.named_parameters():
        if is_gate_parameter(n):
            groups["gates"].append(p)
        elif p.dim() >= 2 and "embed" not in n:
            groups["decay"].append(p)
        else:
            groups["no_decay"].append(p)
    settings = {"decay": (cfg.weight_decay, 1.0), "no_decay": (0.0, 1.0), "gates": (0.0, cfg.gate_lr_mult)}
    return torch.optim.AdamW([{"params": groups[k], "weight_decay": wd, "lr_mult": mult}
                              for k, (wd, mult) in settings.items()],
                             lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=False, foreach=False)


def _save(run: Path, step: int, model, optimizer, exp: Experiment, vocab: Vocabulary, dtype=None) -> None:
    name = f"step_{step:06d}"
    gates = gate_parameters(model)
    opt_tensors, opt_meta = _optimizer_to_tensors(optimizer)
    save_checkpoint(run / "checkpoints" / name, model, {**exp.tree, "vocab": vocab.to_dict()},
                    extra_tensors={"optimizer.safetensors": opt_tensors, **({"gates.safetensors": gates}
                                                                              if gates else {})},
                    extra_json={"trainer_state.json": {"step": step, "optimizer": opt_meta}}, dtype=dtype)
    if gates:
        (run / "gates").mkdir(exist_ok=True)
        write_atomic(run / "gates" / f"{name}.safetensors",
                     (run / "checkpoints" / name / "gates.safetensors").read_bytes())
    write_atomic(run / "latest", name + "\n")
    kept = sorted(p for p in (run / "checkpoints").iterdir() if p.name.startswith("step_") and p.is_dir()
                  and not p.name.endswith((".tmp", ".old")))
    for old in kept[:-exp.train.keep_checkpoints]:
        for f in old.iterdir():
            f.unlink()
        old.rmdir()


def _optimizer_to_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    state = optimizer.state_dict()
    tensors, meta = {}, {"param_groups": state["param_groups"], "scalars": {}}
    for pid, s in state["state"].items():
        for key, value in s.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{pid}.{key}"] = value
            else:
                meta["scalars"][f"{pid}.{key}"] = value
    return tensors, meta


def _optimizer_from_tensors(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict[str, Any]] = {}
    for name, value in tensors.items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    for name, value in meta["scalars"].items():
        pid, key = name.split(".", 1)
        state.setdefault(int(pid), {})[key] = value
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def train(exp: Experiment, out: str | Path, resume: bool = False, progress: bool = True) -> dict[str, float]:
    """Train `exp` into run directory `out`; returns the last logged metrics."""
    cfg = exp.train
    dd = setup_distributed(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.batch_size % (dd.world * cfg.grad_accum):
        raise ValueError(f"train.batch_size: {cfg.batch_size} is not divisible by world_size * grad_accum = "
                         f"{dd.world * cfg.grad_accum}")
    run = Path(out)
    vocab = Vocabulary.from_data_config(exp.data)
    if vocab.size > exp.model.vocab_size:
        raise ValueError(f"model.vocab_size: {exp.model.vocab_size} is smaller than the data vocabulary ({vocab.size})")
    torch.manual_seed(cfg.seed)
    model = build_model(exp.model).to(dd.device)
    optimizer = build_optimizer(model, cfg)
    start = 0
    if resume and (run / "latest").is_file():
        ck = resolve(run)
        model.load_state_dict(load_tensors(ck / "model.safetensors"), strict=False)
        state = json.loads((ck / "trainer_state.json").read_text())
        _optimizer_from_tensors(optimizer, load_tensors(ck / "optimizer.safetensors"), state["optimizer"])
        start = state["step"]
        if dd.main:
            _truncate_metrics(run / "metrics.jsonl", start)
            log.info("resumed %s at step %d", run, start)
    elif dd.main:
        if (run / "latest").exists():
            raise ValueError(f"--out {run}: already holds a run; pass --resume to continue it or choose a new dir")
        run.mkdir(parents=True, exist_ok=True)
        (run / "metrics.jsonl").write_text("")
    if dd.main:
        write_json_atomic(run / "config.json", {**exp.tree, "vocab": vocab.to_dict()})
    ddp = torch.nn.parallel.DistributedDataParallel(model) if dd.world > 1 else model
    stream = TrainingStream(vocab, exp.data, seed=cfg.seed, rank=dd.rank, world_size=dd.world)
    val_batches = stream.validation_set(cfg.eval_sequences, batch_size=min(64, cfg.eval_sequences))
    micro = cfg.batch_size // (dd.world * cfg.grad_accum)
    last: dict[str, float] = {}
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not (progress and dd.main),
               desc=f"train {run.name}", unit="step", dynamic_ncols=True)
    t_last, tokens_since = time.perf_counter(), 0
    model.train()
    for step in bar:
        lr = cfg.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr * group["lr_mult"]
        parts = [stream.batch(step * cfg.grad_accum + a, micro) for a in range(cfg.grad_accum)]
        count = dd.all_sum(torch.tensor(float(sum(int((lab != -100).sum()) for _, lab in parts))))
        loss_total = torch.zeros(())
        for a, (ids, labels) in enumerate(parts):
            ids, labels = ids.to(dd.device), labels.to(dd.device)
            sync = a == cfg.grad_accum - 1 or dd.world == 1
            ctx = ddp.no_sync() if not sync else contextlib.nullcontext()
            with ctx:
                loss = token_losses(ddp, ids, labels) / count * dd.world  # DDP averages over ranks
                loss.backward()
            loss_total += loss.detach().cpu() / dd.world
            tokens_since += ids.numel() * dd.world
        loss_value = float(dd.all_sum(loss_total))
        if not math.isfinite(loss_value):
            bar.close()
            kept = (run / "latest").read_text().strip() if (run / "latest").exists() else "none"
            raise ValueError(f"loss became non-finite ({loss_value}) at step {step}; stopped. Last good checkpoint "
                             f"kept: {kept} in {run}")
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps or done % cfg.eval_every == 0:
            now = time.perf_counter()
            row = {"step": done, "loss": loss_value, "lr": lr, "tokens_per_s": tokens_since / (now - t_last)}
            t_last, tokens_since = now, 0
            if done % cfg.eval_every == 0 or done == cfg.steps:
                row.update(evaluate_validation(model, val_batches, dd.device))
            if dd.main:
                with open(run / "metrics.jsonl", "a") as f:
                    f.write(json.dumps(row) + "\n")
                bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{row['tokens_per_s']:.0f}",
                                **({"val_acc": f"{row['val_lookup_acc']:.3f}"} if "val_lookup_acc" in row else {}))
            last = row
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            if dd.main:
                final = done == cfg.steps
                _save(run, done, model, optimizer, exp, vocab)
                if final:
                    save_checkpoint(run / "final", model, {**exp.tree, "vocab": vocab.to_dict()},
                                    dtype=getattr(torch, cfg.save_dtype))
            dd.barrier()
    bar.close()
    return last


def _truncate_metrics(path: Path, step: int) -> None:
    if not path.exists():
        return
    rows = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
    write_atomic(path, "".join(r + "\n" for r in rows))


def read_metrics(run: str | Path) -> list[dict[str, Any]]:
    path = Path(run) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="pretrain a model from an experiment YAML")
    p.add_argument("config", help="experiment YAML (sections model, data, train)")
    p.add_argument("--out", required=True, help="run directory")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                   help="override a config value (repeatable), e.g. --set train.steps=100")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--no-progress", action="store_true")

    def run(args) -> None:
        exp = Experiment.from_file(args.config, args.overrides)
        train(exp, args.out, resume=args.resume, progress=not args.no_progress)
        if dist.is_initialized():
            dist.destroy_process_group()

    p.set_defaults(func=run)
