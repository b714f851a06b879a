"""Memory budgets: the memory free now on a device, and the one check that refuses work too large for it.

Work that would not fit is refused before anything is allocated, in one line that names the work, what it
needs and what is free: `check_budget(need, what, ...)`.  Each caller estimates `need` its own way: a model's
weights counted on the meta device (`families.check_fits`), a forward's peak (`adapters.hf.forward_bytes`), a
training micro-batch (`cli.train.activation_bytes`), a prompt set's bookkeeping (`cli.flags`).
"""

from __future__ import annotations

import os
from typing import Any

GIB = 1 << 30


def available_memory() -> int:
    """Bytes of memory available to a new allocation: MemAvailable of /proc/meminfo, else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return 1 << 62  # unknown: do not refuse


def free_memory(device: Any = "cpu") -> tuple[int, str]:
    """(bytes free now on `device`, how the budget reads in a message): MemAvailable for the CPU, the free memory
    of a GPU.  `device`: a name as `phasekv.distributed.resolve_device` takes it, or a torch.device."""
    if str(device) != "cpu":
        from phasekv.distributed import resolve_device

        target = resolve_device(str(device), int(os.environ.get("LOCAL_RANK", 0)))
        if target.type == "cuda":
            import torch

            return torch.cuda.mem_get_info(target)[0], f"is free on {target}"
    return available_memory(), "of memory is available"


def check_budget(need: float, what: str, *, device: Any = "cpu", advice: str = "", bound: str = "about",
                 have: int | None = None) -> None:
    """Refuse (one-line ValueError) work that needs `need` bytes when that is more than is free now on `device`
    (or than `have`).  `bound`: how `need` was estimated ("about", or "at least" for a lower bound)."""
    have, budget = free_memory(device) if have is None else (have, "of memory is available")
    if need > have:
        raise ValueError(f"{what}: needs {bound} {need / GIB:.1f} GiB, only {have / GIB:.1f} GiB {budget}"
                         f"{'; ' + advice if advice else ''}")
