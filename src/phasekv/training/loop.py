"""Pretraining from scratch: `phasekv train CONFIG.yaml [--set a.b=v ...] --out DIR [--resume]`.

AdamW with linear warmup and cosine decay, gradient clipping and accumulation, everything seeded.
One process, or DistributedDataParallel under `torchrun --nproc_per_node=N` (gloo on CPU, nccl on
GPU); rank 0 logs and checkpoints, each rank reads its own shard of every global batch.

The loss of a step is the token mean over the whole global batch (all micro-batches, all ranks):
each micro-batch contributes sum(token losses) / (global supervised tokens), so 1 and N processes
optimize the same objective on the same data, and a resumed run reproduces an uninterrupted one.

The run directory (config.json, metrics.jsonl, checkpoints, the latest pointer, resume, final/) is
`phasekv.training.rundir`; this module is the loop that fills it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from phasekv import distributed, families
from phasekv.archs import indexer_kl as indexer
from phasekv.checkpoint import MODEL_FILE, load_tensors, load_weights, read_experiment, resolve
from phasekv.compression import compressors_of, shifted_windows
from phasekv.config import Experiment, TrainConfig, model_config_from_dict
from phasekv.data.lookup import TrainingStream
from phasekv.data.vocab import Vocabulary
from phasekv.training.report import check_report_to, open_reporter
from phasekv.training.rundir import (
    append_metrics,
    ensure_final,
    latest_name,
    open_run,
    save_step,
    write_final,
)

log = logging.getLogger(__name__)


def token_losses(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy over supervised labels (labels already aligned to ids)."""
    logits = families.logits(model, ids)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum")


@torch.no_grad()
def evaluate_validation(model: torch.nn.Module, batches, device) -> dict[str, float]:
    """Validation loss (mean over supervised tokens) and lookup accuracy (top-1 at query answers)."""
    was_training = model.training
    model.eval()
    loss_sum, tokens, correct, queries = 0.0, 0, 0, 0
    for ids, labels, answer_mask in batches:
        ids, labels, answer_mask = ids.to(device), labels.to(device), answer_mask.to(device)
        logits = families.logits(model, ids).float()
        valid = labels != -100
        loss_sum += F.cross_entropy(logits[valid], labels[valid], reduction="sum").item()
        tokens += int(valid.sum())
        hit = logits.argmax(-1) == labels
        correct += int((hit & answer_mask).sum())
        queries += int(answer_mask.sum())
    model.train(was_training)
    return {"val_loss": loss_sum / max(tokens, 1), "val_lookup_acc": correct / max(queries, 1)}


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with three groups: matrices (decayed), vectors and embeddings (not decayed), and the
    compressor gates (not decayed, so decay does not pull them towards uniform; lr * gate_lr_mult)."""
    gates = {id(p) for _, c in compressors_of(model) for p in c.gate_parameters().values()}
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    groups: dict[str, list] = {"decay": [], "no_decay": [], "gates": []}
    for p in model.parameters():
        if id(p) in gates:
            groups["gates"].append(p)
        elif p.dim() >= 2 and id(p) not in embeddings:
            groups["decay"].append(p)
        else:
            groups["no_decay"].append(p)
    settings = {"decay": (cfg.weight_decay, 1.0), "no_decay": (0.0, 1.0), "gates": (0.0, cfg.gate_lr_mult)}
    return torch.optim.AdamW([{"params": groups[k], "weight_decay": wd, "lr_mult": mult}
                              for k, (wd, mult) in settings.items()],
                             lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=False, foreach=False)


def _check_trainable(model: torch.nn.Module, exp: Experiment, vocab: Vocabulary) -> None:
    if vocab.size > exp.model.vocab_size:
        raise ValueError(f"model.vocab_size: {exp.model.vocab_size} is smaller than the data vocabulary ({vocab.size})")
    for _, c in compressors_of(model):
        problem = c.training_problem()
        if problem:
            raise ValueError(f"model.{c.name}: cannot be trained here: {problem}")


def train(exp: Experiment, out: str | Path, resume: bool = False, progress: bool = True, *,
          checks: tuple[Callable[[torch.nn.Module], dict[str, float]], ...] = ()) -> dict[str, float]:
    """Train `exp` into run directory `out`; returns the last logged metrics.  `checks`: more metrics of the model
    at each validation (e.g. the phase check, `phasekv.api.phase_check`), added to the row."""
    cfg = exp.train
    check_report_to(cfg.report_to)
    dd = distributed.setup(cfg.device)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.batch_size % (dd.world * cfg.grad_accum):
        raise ValueError(f"train.batch_size: {cfg.batch_size} is not divisible by world_size * grad_accum = "
                         f"{dd.world * cfg.grad_accum}")
    run = Path(out)
    vocab = Vocabulary.from_data_config(exp.data)
    torch.manual_seed(cfg.seed)
    model = families.build(exp.model, copies=4)  # weights, gradients and two AdamW moments must fit
    _check_trainable(model, exp, vocab)
    model = model.to(dd.device)
    optimizer = build_optimizer(model, cfg)
    tree = {**exp.tree, "vocab": vocab.to_dict()}
    start = open_run(run, exp, tree=tree, resume=resume, dd=dd, model=model, optimizer=optimizer)
    if start == 0 and cfg.init_from:
        warm_start(model, exp, cfg.init_from)
    ddp = torch.nn.parallel.DistributedDataParallel(model) if dd.world > 1 else model
    stream = TrainingStream(vocab, exp.data, seed=cfg.seed, rank=dd.rank, world_size=dd.world)
    reporter = open_reporter(run, cfg.report_to if dd.main else "none", config=exp.tree)
    try:
        last = _train_loop(ddp, model, optimizer, stream, exp=exp, tree=tree, run=run, start=start, dd=dd,
                           progress=progress, report=(reporter, checks))
    finally:
        reporter.close()
    if dd.main:
        ensure_final(run, model, tree, getattr(torch, cfg.save_dtype))
    dd.barrier()
    return last


def warm_start(model: torch.nn.Module, exp: Experiment, source: str | Path) -> None:
    """Load the weights of checkpoint or run directory `source` into `model` (train.init_from).  Its model section
    must equal `exp`'s but for max_position_embeddings (a longer context for the same weights: positions are
    rotary), so a warm start never reinterprets weights."""
    path = resolve(source)
    theirs = model_config_from_dict(read_experiment(path)["model"]).to_dict()  # resolved: defaults filled in
    ours = exp.model.to_dict()
    differ = sorted(k for k in set(theirs) | set(ours)
                    if k != "max_position_embeddings" and theirs.get(k) != ours.get(k))
    if differ:
        raise ValueError(f"train.init_from {source}: its model differs from this one in {differ[:3]} (only "
                         "max_position_embeddings may differ)")
    with torch.no_grad():
        load_weights(model, load_tensors(path / MODEL_FILE), path)


def clip_groups(model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    """Parameter groups clipped separately: the indexers' (trained only by their own loss) and the rest, so the
    indexer loss never rescales the LM gradients."""
    own = indexer.indexer_parameters(families.unwrap(model))
    ids = {id(p) for p in own}
    return [g for g in ([p for p in model.parameters() if id(p) not in ids], own) if g]


def _train_step(ddp, model, optimizer, parts, *, cfg: TrainConfig, dd, lr: float, dense: bool = False
                ) -> tuple[float, int, float | None]:
    """One optimizer step over the micro-batches `parts`; (global mean LM loss, tokens seen by all ranks, mean
    indexer loss or None for a model without an indexer).  `dense`: the indexers' dense warm-up (every candidate
    selected)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_mult"]
    count = dd.all_sum(torch.tensor(float(sum(int((lab != -100).sum()) for _, lab in parts))))
    loss_total = torch.zeros((), device=dd.device)
    aux_total = None
    tokens = 0
    for a, (ids, labels) in enumerate(parts):
        ids, labels = ids.to(dd.device), labels.to(dd.device)
        sync = a == cfg.grad_accum - 1 or dd.world == 1
        with ddp.no_sync() if not sync else contextlib.nullcontext(), \
                indexer.dense_selection(families.unwrap(model), ids.shape[1], on=dense), \
                indexer.distillation(families.unwrap(model)) as distill:
            loss = token_losses(ddp, ids, labels) / count * dd.world  # DDP averages over ranks
            aux = distill.loss()
            (loss if aux is None else loss + cfg.indexer_loss_weight * aux / cfg.grad_accum).backward()
        loss_total += loss.detach() / dd.world
        if aux is not None:
            aux_total = (0.0 if aux_total is None else aux_total) + float(aux.detach()) / cfg.grad_accum
        tokens += ids.numel() * dd.world
    loss_value = float(dd.all_sum(loss_total))
    if math.isfinite(loss_value):
        for group in clip_groups(model):
            torch.nn.utils.clip_grad_norm_(group, cfg.grad_clip)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_value, tokens, aux_total


def _train_loop(ddp, model, optimizer, stream, *, exp: Experiment, tree: dict, run: Path, start: int, dd,  # long:
                progress: bool, report: tuple = (None, ())) -> dict[str, float]:  # the loop reads in one place
    """Steps `start`..train.steps of `exp`, logging, validating and checkpointing into `run` (whose config.json
    holds `tree`); the last logged metrics.  `report`: (a `Reporter` of every row, the checks run at validation)."""
    reporter, checks = report
    cfg = exp.train
    val_batches = stream.validation_set(cfg.eval_sequences, batch_size=min(64, cfg.eval_sequences))
    micro = cfg.batch_size // (dd.world * cfg.grad_accum)
    last: dict[str, float] = {}
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, disable=not (progress and dd.main),
               desc=f"train {run.name}", unit="step", dynamic_ncols=True)
    t_last, tokens_since = time.perf_counter(), 0
    model.train()
    for step in bar:
        parts = [stream.batch(step * cfg.grad_accum + a, micro) for a in range(cfg.grad_accum)]
        # the same shift on every rank: drawn from the step number
        shift = int(torch.randint(0, 1 << 30, (1,), generator=torch.Generator().manual_seed(cfg.seed + step))
                    ) if cfg.window_jitter else 0
        with shifted_windows(families.unwrap(model), shift):
            loss_value, tokens, aux_value = _train_step(ddp, model, optimizer, parts, cfg=cfg, dd=dd,
                                                         lr=cfg.lr_at(step), dense=step < cfg.indexer_dense_steps)
        tokens_since += tokens
        if not math.isfinite(loss_value):
            bar.close()
            raise ValueError(f"loss became non-finite ({loss_value}) at step {step}; stopped. Last good checkpoint "
                             f"kept: {latest_name(run)} in {run}")
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps or done % cfg.eval_every == 0:
            now = time.perf_counter()
            row = {"step": done, "loss": loss_value, "lr": cfg.lr_at(step),
                   "tokens_per_s": tokens_since / (now - t_last),
                   **({"indexer_loss": aux_value} if aux_value is not None else {})}
            t_last, tokens_since = now, 0
            if done % cfg.eval_every == 0 or done == cfg.steps:
                row.update(evaluate_validation(model, val_batches, dd.device))
                for check in checks:
                    row.update(check(model))
            if dd.main:
                append_metrics(run, row)
                if reporter is not None:
                    reporter.log(row)
                bar.set_postfix(loss=f"{loss_value:.3f}", tok_s=f"{row['tokens_per_s']:.0f}",
                                **({"val_acc": f"{row['val_lookup_acc']:.3f}"} if "val_lookup_acc" in row else {}))
            last = row
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            if dd.main:
                save_step(run, done, model, optimizer, tree=tree, keep=cfg.keep_checkpoints)
                if done == cfg.steps:
                    write_final(run, model, tree, getattr(torch, cfg.save_dtype))
            dd.barrier()
    bar.close()
    return last
