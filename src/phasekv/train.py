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
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from phasekv import distributed, families, indexer
from phasekv.checkpoint import (
    CONFIG_FILE,
    MODEL_FILE,
    latest_checkpoint,
    load_tensors,
    load_weights,
    save_checkpoint,
)
from phasekv.compression import compressor_parameters, compressors_of, shifted_windows
from phasekv.config import Experiment, TrainConfig, parse_json
from phasekv.data.lookup import TrainingStream
from phasekv.data.vocab import Vocabulary
from phasekv.outputs import recover, write_atomic, write_json

log = logging.getLogger(__name__)


def gate_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every compressor parameter (gates, biases, payload maps): the gate-trajectory snapshot."""
    return {n: p.detach().clone().cpu() for n, p in compressor_parameters(families.unwrap(model)).items()}


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


def _save(run: Path, step: int, model, optimizer, exp: Experiment, vocab: Vocabulary) -> None:
    name = f"step_{step:06d}"
    gates = gate_parameters(model)
    opt_tensors, opt_meta = _optimizer_to_tensors(optimizer)
    save_checkpoint(run / "checkpoints" / name, model, {**exp.tree, "vocab": vocab.to_dict()},
                    extra_tensors={"optimizer.safetensors": opt_tensors, **({"gates.safetensors": gates}
                                                                              if gates else {})},
                    extra_json={"trainer_state.json": {"step": step, "optimizer": opt_meta}})
    if gates:
        (run / "gates").mkdir(exist_ok=True)
        write_atomic(run / "gates" / f"{name}.safetensors",
                     (run / "checkpoints" / name / "gates.safetensors").read_bytes())
    write_atomic(run / "latest", name + "\n")
    for old in _kept_checkpoints(run)[:-exp.train.keep_checkpoints]:
        # renamed out of the kept set first, so a kill while deleting never leaves a half checkpoint
        # that resume could fall back to
        os.replace(old, old.with_name(old.name + ".deleting"))
    for trash in (run / "checkpoints").glob("step_*.deleting"):  # this save's, and any a kill left
        shutil.rmtree(trash)


def _kept_checkpoints(run: Path) -> list[Path]:
    """Complete checkpoint directories of a run, oldest first."""
    folder = run / "checkpoints"
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_dir() and p.name.startswith("step_")
                  and p.name[5:].isdigit())


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



def _read_state(ck: Path) -> dict[str, Any]:
    """A checkpoint's trainer state, fully validated (nothing is changed before this succeeds)."""
    state = parse_json((ck / "trainer_state.json").read_text(errors="replace"), f"checkpoint {ck}: trainer_state.json")
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or isinstance(state["step"], bool) \
            or state["step"] < 0 or not isinstance(state.get("optimizer"), dict):
        raise ValueError(f"checkpoint {ck}: trainer_state.json needs an integer 'step' >= 0 and an 'optimizer' "
                         "mapping")
    return state


def _load_resume_point(run: Path, model, optimizer) -> int:
    """Load the newest readable checkpoint of `run` into model and optimizer; its step.  An unreadable
    newest checkpoint falls back to the previous kept one, with a warning."""
    newest = latest_checkpoint(run) if (run / "latest").is_file() else None  # the pointer may be lost
    candidates = ([newest] if newest else []) + [p for p in reversed(_kept_checkpoints(run)) if p != newest]
    errors = []
    for ck in candidates:
        try:
            state = _read_state(ck)
            weights = load_tensors(ck / MODEL_FILE)
            opt = load_tensors(ck / "optimizer.safetensors")
            load_weights(model, weights, ck)
            _optimizer_from_tensors(optimizer, opt, state["optimizer"])
        except (ValueError, OSError, KeyError) as exc:
            errors.append(f"{ck.name}: {exc}")
            continue
        if errors:  # warn only when a fallback succeeded; a total failure is the one error line below
            log.warning("resuming from %s: newer checkpoints were unreadable (%s)", ck.name, "; ".join(errors)[:300])
        return state["step"]
    raise ValueError(f"--resume {run}: no readable checkpoint ({'; '.join(errors)[:300]})")


def check_resume_config(run: Path, exp: Experiment) -> None:
    """The resolved experiment must match the run's: model and data exactly, train except the fields
    that may change on resume (TrainConfig.RESUMABLE)."""
    saved = parse_json((run / CONFIG_FILE).read_text(errors="replace"), f"run {run}: {CONFIG_FILE}")
    if not isinstance(saved, dict):
        raise ValueError(f"run {run}: {CONFIG_FILE} is not a mapping")
    saved = Experiment.from_tree({k: v for k, v in saved.items() if k != "vocab"}).tree  # resolved like exp
    for section in ("model", "data", "train"):
        old, new = _leaves(saved.get(section, {}), section), _leaves(exp.tree[section], section)
        for key in sorted(set(old) | set(new)):
            if section == "train" and key[len("train."):] in TrainConfig.RESUMABLE:
                continue
            if old.get(key) != new.get(key):
                parts = key.split(".")  # model.compressors.NAME.OPTION is usually set as model.OPTION
                name = f"{key} (set as model.{parts[3]})" if parts[1:2] == ["compressors"] else key
                raise ValueError(f"--resume: {name} is {new.get(key)!r} but the run was trained with "
                                 f"{old.get(key)!r}; only train.{', train.'.join(TrainConfig.RESUMABLE)} may change")


def _leaves(tree: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Nested config sections as {"a.b.c": value}, so a difference is named down to its field."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_leaves(value, f"{prefix}.{key}"))
        else:
            out[f"{prefix}.{key}"] = value
    return out


def _prepare_run(run: Path, exp: Experiment, tree: dict[str, Any], resume: bool, dd, model, optimizer) -> int:
    """Create or reopen the run directory; the step to start from.  `tree` is the config.json content."""
    # a lost `latest` pointer never restarts a run that has checkpoints: resume from the newest readable one
    if resume and ((run / "latest").is_file() or _kept_checkpoints(run)):
        check_resume_config(run, exp)
        start = _load_resume_point(run, model, optimizer)
        if dd.main:
            _truncate_metrics(run / "metrics.jsonl", start)
            log.info("resumed %s at step %d", run, start)
        return start
    # rank 0 checks and creates the run directory; every rank stops on its verdict (no rank is left
    # waiting in a collective for a rank 0 that has given up)
    problem = None
    if dd.main:
        try:
            _create_run(run, exp, tree, resume)
        except ValueError as exc:
            problem = str(exc)
    problem = dd.broadcast_object(problem)
    if problem:
        raise ValueError(problem)
    return 0


def _create_run(run: Path, exp: Experiment, tree: dict[str, Any], resume: bool) -> None:
    """A new run directory.  config.json is written before anything else, so `--resume` can tell a
    run killed before its first checkpoint (config.json, no `latest`: it starts again from step 0)
    from a foreign directory."""
    if (run / "latest").exists():
        raise ValueError(f"--out {run}: already holds a run; pass --resume to continue it or choose a new dir")
    if resume and (run / CONFIG_FILE).is_file():
        check_resume_config(run, exp)
        log.warning("--resume %s: the run has no checkpoint yet; starting it again from step 0", run)
    elif run.exists() and (not run.is_dir() or any(not (resume and p.name.endswith(".tmp")) for p in run.iterdir())):
        raise ValueError(f"--out {run}: exists and is not an empty directory (and holds no checkpoint); "
                         "choose a new directory")
    run.mkdir(parents=True, exist_ok=True)
    write_json(run / CONFIG_FILE, tree, atomic=True)
    write_atomic(run / "metrics.jsonl", "")


def _check_trainable(model: torch.nn.Module, exp: Experiment, vocab: Vocabulary) -> None:
    if vocab.size > exp.model.vocab_size:
        raise ValueError(f"model.vocab_size: {exp.model.vocab_size} is smaller than the data vocabulary ({vocab.size})")
    for _, c in compressors_of(model):
        problem = c.training_problem()
        if problem:
            raise ValueError(f"model.{c.name}: cannot be trained here: {problem}")


def train(exp: Experiment, out: str | Path, resume: bool = False, progress: bool = True) -> dict[str, float]:
    """Train `exp` into run directory `out`; returns the last logged metrics."""
    cfg = exp.train
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
    start = _prepare_run(run, exp, tree, resume, dd, model, optimizer)
    if dd.main and start:
        write_json(run / CONFIG_FILE, tree, atomic=True)  # records the train fields changed on resume
    ddp = torch.nn.parallel.DistributedDataParallel(model) if dd.world > 1 else model
    stream = TrainingStream(vocab, exp.data, seed=cfg.seed, rank=dd.rank, world_size=dd.world)
    last = _train_loop(ddp, model, optimizer, stream, exp, vocab, run, start, dd, progress)
    if dd.main:
        _ensure_final(run, model, exp, vocab)
    dd.barrier()
    return last


def clip_groups(model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    """Parameter groups clipped separately: the indexers' (trained only by their own loss) and the rest, so the
    indexer loss never rescales the LM gradients."""
    own = indexer.indexer_parameters(families.unwrap(model))
    ids = {id(p) for p in own}
    return [g for g in ([p for p in model.parameters() if id(p) not in ids], own) if g]


def _train_step(ddp, model, optimizer, parts, cfg: TrainConfig, dd, lr: float, dense: bool = False
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


def _train_loop(ddp, model, optimizer, stream, exp: Experiment, vocab, run: Path, start: int, dd,
                progress: bool) -> dict[str, float]:
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
            loss_value, tokens, aux_value = _train_step(ddp, model, optimizer, parts, cfg, dd, cfg.lr_at(step),
                                                         dense=step < cfg.indexer_dense_steps)
        tokens_since += tokens
        if not math.isfinite(loss_value):
            bar.close()
            kept = (run / "latest").read_text().strip() if (run / "latest").exists() else "none"
            raise ValueError(f"loss became non-finite ({loss_value}) at step {step}; stopped. Last good checkpoint "
                             f"kept: {kept} in {run}")
        done = step + 1
        if done % cfg.log_every == 0 or done == cfg.steps or done % cfg.eval_every == 0:
            now = time.perf_counter()
            row = {"step": done, "loss": loss_value, "lr": cfg.lr_at(step),
                   "tokens_per_s": tokens_since / (now - t_last),
                   **({"indexer_loss": aux_value} if aux_value is not None else {})}
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
                _save(run, done, model, optimizer, exp, vocab)
                if done == cfg.steps:
                    _write_final(run, model, exp, vocab)
            dd.barrier()
    bar.close()
    return last


def _write_final(run: Path, model, exp: Experiment, vocab: Vocabulary) -> None:
    save_checkpoint(run / "final", model, {**exp.tree, "vocab": vocab.to_dict()},
                    dtype=getattr(torch, exp.train.save_dtype))


def _ensure_final(run: Path, model, exp: Experiment, vocab: Vocabulary) -> None:
    """A run that reached its last step always ends with the final/ of that step: a kill between the
    last checkpoint and final/, or while final/ was replaced, is repaired here on --resume; so is a
    final/ left by an earlier, shorter run (resumed with a larger train.steps)."""
    final = run / "final"
    recover(final)
    tree = {**exp.tree, "vocab": vocab.to_dict()}
    try:
        current = (final / MODEL_FILE).is_file() and json.loads((final / CONFIG_FILE).read_text()) == \
            json.loads(json.dumps(tree))
    except (OSError, ValueError):
        current = False
    if not current:
        _write_final(run, model, exp, vocab)


def _truncate_metrics(path: Path, step: int) -> None:
    """Keep the metrics rows of steps <= `step`; a torn (half-written) line is dropped with a warning."""
    if not path.exists():
        return
    rows = []
    for i, line in enumerate(path.read_text(errors="replace").splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            keep = row["step"] <= step
        except (json.JSONDecodeError, KeyError, TypeError):
            log.warning("%s: line %d is torn or malformed; dropped", path, i + 1)
            continue
        if keep:
            rows.append(line)
    write_atomic(path, "".join(r + "\n" for r in rows))


def read_metrics(run: str | Path) -> list[dict[str, Any]]:
    path = Path(run) / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line of a killed run
    return rows
