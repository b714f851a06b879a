"""One device and process-group layer for training and evaluation.

`setup(device)` resolves a device string ("auto", "cpu", "cuda", "cuda:N", "meta") with a clear
error when it cannot be used, and under torchrun (WORLD_SIZE > 1) joins the process group: nccl on
GPU, gloo on CPU, each rank on `cuda:LOCAL_RANK`.  Reductions (`all_sum`) run on the rank's device,
so NCCL accepts them.  Only rank 0 reports errors (`is_main`); the others exit quietly.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

DEVICE_KINDS = ("auto", "cpu", "cuda", "cuda:N", "meta")


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The torch device for `name`; ValueError naming the problem when it is unknown or unavailable."""
    if not isinstance(name, str):
        raise ValueError(f"device: must be one of {list(DEVICE_KINDS)}, got {name!r}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name in ("cpu", "meta"):
        return torch.device(name)
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        if not torch.cuda.is_available():
            raise ValueError(f"device: {name!r} requested but CUDA is not available on this machine "
                             f"(torch {torch.__version__}); use --device cpu")
        index = local_rank if name == "cuda" else int(name[5:])
        if index >= torch.cuda.device_count():
            raise ValueError(f"device: {name!r} (index {index}) but only {torch.cuda.device_count()} GPU(s) exist")
        return torch.device("cuda", index)
    raise ValueError(f"device: unknown device {name!r}; use one of {list(DEVICE_KINDS)}")


@dataclass
class Dist:
    """This process's place in the job: rank, world size and its device."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum of `value` over ranks (in place), on this rank's device."""
        value = value.to(self.device)
        if self.world > 1:
            dist.all_reduce(value)
        return value

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (plain data only: lists, dicts, numbers, strings)."""
        if self.world == 1:
            return [obj]
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (plain data only)."""
        if self.world == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def shutdown(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def world_size() -> int:
    value = os.environ.get("WORLD_SIZE", "1")
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"WORLD_SIZE: must be a positive integer, got {value!r}")
    return int(value)


def setup(device: str = "auto") -> Dist:
    """Resolve `device` and, under torchrun, join the process group (idempotent)."""
    world = world_size()
    if world == 1:
        return Dist(device=resolve_device(device))
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    dev = resolve_device(device, local)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Dist(rank, world, local, dev)


def is_main() -> bool:
    """True on rank 0 (and outside torchrun): the one process that reports errors."""
    return os.environ.get("RANK", "0") == "0"


__all__ = ["DEVICE_KINDS", "Dist", "is_main", "resolve_device", "setup", "world_size"]
